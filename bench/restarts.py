"""Restart reliability and recovery time: a worker crashes after its group formed.

Cases (``--cases``, comma-separated):

    aiodist-all     aiodist workers, --max-restarts=1 (--restart-policy=all): rank 1 exits 3
                    after init_process_group and an all_reduce on attempt 0; the launcher
                    restarts every worker, and attempt 1 must complete
    torch-all       the same with torch gloo workers (tests/launcher_torch_worker.py)
    aiodist-failed  aiodist workers, --restart-policy=failed --max-restarts=1: the last rank
                    exits 3 after a first all_reduce; only it is restarted, the others notice
                    (their next all_reduce raises), destroy and init their group again, and
                    all of them run an all_reduce in the rebuilt group

A run succeeds when the launcher exits 0 and every rank printed its result after the restart.
Recovery is the time from the crashing rank's last line to the last rank's result after the
restart, as read from the launcher's output (each line is written as soon as it is complete).

    python bench/restarts.py                      # 20 runs of each case, 3 workers
    python bench/restarts.py --runs 5 --torchrun  # also torch workers under torch's torchrun

torch's torchrun keeps the failed attempt's keys in its store, which breaks gloo's
re-initialisation in most runs; aiodist-run empties the store between attempts. Without torch
(``pip install torch==2.13.0``) the torch cases are left out, saying so.

The table is printed and written to ``restarts.md`` in a temporary folder, or with
``--write`` to ``bench/results/restarts.md`` (``--out``: another path).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AIODIST_WORKER = str(ROOT / "tests" / "launcher_worker.py")
TORCH_WORKER = str(ROOT / "tests" / "launcher_torch_worker.py")
CASES = ("aiodist-all", "torch-all", "aiodist-failed")
CRASH = re.compile(r"^\[rank\d+\]: crashing")
#: What each case is, in the results file's words.
DESCRIPTIONS = {
    "aiodist-all": "aiodist workers, every worker restarted",
    "torch-all": "torch gloo workers, every worker restarted",
    "aiodist-failed": "aiodist workers, only the failed one restarted (the others rebuild)",
}


@dataclass
class Run:
    ok: bool
    seconds: float
    recovery: float | None
    error: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def command(launcher: str, case: str, nproc: int) -> tuple[list[str], re.Pattern[str]]:
    """The command line of one run, and the line every rank prints once it recovered."""
    if launcher == "aiodist-run":
        cmd = [sys.executable, "-m", "aiodist.run"]
    else:
        torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
        assert torchrun is not None, "torchrun is not installed next to this python"
        cmd = [torchrun, f"--master-port={free_port()}"]
    cmd += [f"--nproc-per-node={nproc}", "--max-restarts=1"]
    total = nproc * (nproc + 1) // 2
    if case == "aiodist-all":
        return [*cmd, AIODIST_WORKER, "crash-once", "1"], re.compile(rf"attempt=1 sum={total}$")
    if case == "torch-all":
        return [*cmd, TORCH_WORKER, "crash-once"], re.compile(rf"torch attempt=1 sum={total} ")
    # The restarted rank adds 10 to its contribution in the rebuilt group.
    done = re.compile(rf"rebuilt restart=\d sum={total + 10} ")
    return [*cmd, "--restart-policy=failed", AIODIST_WORKER, "rebuild", str(nproc - 1)], done


def one_run(launcher: str, case: str, nproc: int, timeout: float) -> Run:
    cmd, done = command(launcher, case, nproc)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    t0 = time.monotonic()
    # A session of its own: on a timeout the launcher's workers go too (torchrun's would
    # outlive it, holding the pipe open, and the read below would never end).
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(timeout, kill)
    timer.start()
    crashed: float | None = None
    finished: list[float] = []
    why: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        now = time.monotonic()
        line = line.rstrip("\n")
        if "root cause:" in line or (line.startswith(" ") and "Error: " in line):
            why.append(line.strip())  # the summary's root cause and the error it quotes
        if crashed is None and CRASH.match(line):
            crashed = now
        if done.search(line):
            finished.append(now)
    proc.wait()
    timer.cancel()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever the launcher left behind
    elapsed = time.monotonic() - t0
    if timed_out.is_set():
        return Run(False, elapsed, None, f"timed out after {timeout:g} s")
    if proc.returncode == 0 and len(finished) == nproc and crashed is not None:
        return Run(True, elapsed, max(finished) - crashed)
    unseen = "" if crashed is not None else ", no line of the crashing rank seen"
    return Run(
        False,
        elapsed,
        None,
        f"exit {proc.returncode}, {len(finished)}/{nproc} ranks recovered{unseen}: "
        + " / ".join(w[:200] for w in why[:1] + why[-1:]),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--nproc", type=int, default=3)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated: {','.join(CASES)}")
    p.add_argument("--torchrun", action="store_true", help="also run torch workers under torchrun")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    p.add_argument(
        "--write", action="store_true", help="write bench/results/restarts.md (else a temp folder)"
    )
    p.add_argument("--out", help="the results file (overrides --write's)")
    args = p.parse_args()
    if args.nproc < 2:
        p.error("--nproc must be at least 2: one rank crashes, another survives")
    cases = [("aiodist-run", c) for c in args.cases.split(",") if c]
    for _launcher, case in cases:
        if case not in CASES:
            p.error(f"unknown case {case!r}: expected one of {', '.join(CASES)}")
    if args.torchrun:
        cases.append(("torchrun", "torch-all"))
    # Committed results change only on purpose: without --write they go to a fresh folder.
    if args.out is None:
        args.out = str(
            ROOT / "bench" / "results" / "restarts.md"
            if args.write
            else Path(tempfile.mkdtemp(prefix="aiodist-bench-"), "restarts.md")
        )
    try:
        import torch

        torch_note = f"torch {torch.__version__}"
    except ImportError:
        # Every run of a torch case would fail the same way: leave them out, once, saying so.
        torch_note = "no torch: the torch cases are left out"
        if any(case == "torch-all" for _, case in cases):
            print(
                "torch is not installed (pip install torch==2.13.0): the torch cases are left out"
            )
        cases = [(launcher, case) for launcher, case in cases if case != "torch-all"]
    started = time.strftime("%Y-%m-%d %H:%M")
    load_before = os.getloadavg()[0]
    print(f"{args.nproc} workers, {args.runs} runs per case")
    print(
        f"{'launcher':>12} {'case':>15} {'ok':>6} {'run mean s':>11} {'recovery mean s':>16} "
        f"{'median s':>9} {'max s':>7}"
    )
    rows, failures = [], []
    for launcher, case in cases:
        runs = [one_run(launcher, case, args.nproc, args.timeout) for _ in range(args.runs)]
        ok = [r for r in runs if r.ok]
        recovery = [r.recovery for r in ok if r.recovery is not None]
        rec = (
            f"{statistics.mean(recovery):>16.3f} {statistics.median(recovery):>9.3f} "
            f"{max(recovery):>7.3f}"
            if recovery
            else f"{'-':>16} {'-':>9} {'-':>7}"
        )
        run_mean = statistics.mean(r.seconds for r in runs)
        print(
            f"{launcher:>12} {case:>15} {len(ok):>3}/{len(runs):<2} {run_mean:>11.2f} {rec}",
            flush=True,
        )
        failed = [r for r in runs if not r.ok]
        for run in failed[:3]:
            print(f"{'':>14}failure: {run.error}")
            failures.append(f"- {launcher}, {DESCRIPTIONS[case]}: {run.error}")
        cells = (
            [
                f"{statistics.mean(recovery):.2f}",
                f"{statistics.median(recovery):.2f}",
                f"{max(recovery):.2f}",
            ]
            if recovery
            else ["-", "-", "-"]
        )
        rows.append(
            f"| `{launcher}` | {DESCRIPTIONS[case]} | {len(ok)}/{len(runs)} | {run_mean:.2f} | "
            + " | ".join(cells)
            + " |"
        )
    command = " ".join(["python", "bench/restarts.py", *sys.argv[1:]])
    lines = [
        "# Restarts after a worker crash",
        "",
        f"`{command}` on {started}, {os.cpu_count()} CPUs (load average {load_before:.1f} "
        f"at the start, {os.getloadavg()[0]:.1f} at the end), {torch_note}. Each run is a job "
        f"of {args.nproc} workers under the launcher with `--max-restarts=1`; one worker "
        "exits with status 3 after its group formed and an all_reduce. A run completes when "
        "the launcher exits 0 and every rank printed its result after the restart. Recovery: "
        "seconds from the crashing rank's last line to the last rank's result after the "
        "restart, over the completed runs; run time: the whole job, start to exit, over "
        "every run.",
        "",
        "| launcher | workers | completed | run time, mean (s) | recovery, mean (s) "
        "| recovery, median (s) | recovery, max (s) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
    ]
    if failures:
        lines += ["Failures (the first 3 of each case):", "", *failures, ""]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
