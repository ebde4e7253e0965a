"""Scripts that end without ``destroy_process_group()``: how often they pass, and what exit costs.

Two measurements, both beside two CPU-bound processes (as on a busy machine, where a rank that
finished and exited used to be taken for a crash):

- **passes**: each program of ``tests/tutorials/`` (public torch tutorials ported by the
  import line; none destroys its group) run ``--runs`` times in a row, 4 ranks, in the
  configurations users meet (``mp.Process`` with fork, the launcher, ``mp.spawn``; shared
  memory and TCP); every run must exit 0 with every rank's checked output.
- **exit cost**: a script of ``--ranks`` ranks (``mp.Process``, fork) does one all_reduce,
  notes the time, and ends, calling ``destroy_process_group()`` or not (then the exit
  handler leaves); the cost is the time from that note to the end of its process as the
  parent sees it, per rank; the same script on torch's gloo when torch is installed.

``python bench/exits.py [--runs 50] [--write]``: results are printed, and written to a
temporary folder, or with ``--write`` to ``bench/results/exits.md``. torch starts a TCPStore
that reverse-resolves its clients: run it in a private network namespace
(``unshare -n bash -c 'ip link set lo up && .venv/bin/python bench/exits.py'``; ``unshare -n``
needs root, ``unshare -rn`` works without).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = ROOT / "tests" / "tutorials"
LAUNCHER = [sys.executable, "-m", "aiodist.run", "--standalone", "--nproc-per-node=4"]

# (label, command builder, environment, line each rank prints once it checked its result)
PROGRAMS = [
    (
        "ring all-reduce tutorial, mp.Process (fork), shared memory",
        lambda port: [sys.executable, str(TUTORIALS / "ring_allreduce.py"), "4", str(port), "fork"],
        {"AIODIST_SHM": "1"},
        "has data 10.0",
    ),
    (
        "ring all-reduce tutorial, mp.Process (fork), TCP",
        lambda port: [sys.executable, str(TUTORIALS / "ring_allreduce.py"), "4", str(port), "fork"],
        {"AIODIST_SHM": "0"},
        "has data 10.0",
    ),
    (
        "collectives under aiodist-run, shared memory",
        lambda port: [*LAUNCHER, str(TUTORIALS / "collectives.py")],
        {"AIODIST_SHM": "1"},
        "all collectives gave the documented results",
    ),
    (
        "collectives under aiodist-run, TCP",
        lambda port: [*LAUNCHER, str(TUTORIALS / "collectives.py")],
        {"AIODIST_SHM": "0"},
        "all collectives gave the documented results",
    ),
    (
        "data-parallel SGD, mp.spawn, shared memory",
        lambda port: [sys.executable, str(TUTORIALS / "spawn_sgd.py"), "4", str(port)],
        {"AIODIST_SHM": "1"},
        "weights match the single-process reference",
    ),
]

# One all_reduce, then the script ends: {lib} is aiodist.sync or torch.distributed.
EXIT_SCRIPT = """
import multiprocessing as mp, os, sys, time
import numpy as np
LIB, DESTROY, WORLD, PORT, OUT = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4], sys.argv[5]

def main(rank):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT)
    if LIB == "torch":
        import torch, torch.distributed as dist
        x = torch.ones(1024)
    else:
        import aiodist.sync as dist
        x = np.ones(1024)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    dist.all_reduce(x)
    with open(f"{OUT}.{rank}", "w") as f:  # the script's work is done
        f.write(repr(time.time()))
    if DESTROY:
        dist.destroy_process_group()

if __name__ == "__main__":
    procs = [mp.Process(target=main, args=(r,)) for r in range(WORLD)]
    for p in procs:
        p.start()
    ends = {}
    waiting = {p.sentinel: r for r, p in enumerate(procs)}
    from multiprocessing.connection import wait
    while waiting:
        for s in wait(list(waiting)):
            ends[waiting.pop(s)] = time.time()
    for r, p in enumerate(procs):
        p.join()
        assert p.exitcode == 0, (r, p.exitcode)
    print(" ".join(repr(ends[r] - float(open(f"{OUT}.{r}").read())) for r in range(WORLD)))
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_hogs() -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]


def passes(runs: int) -> list[str]:
    rows = ["| program (4 ranks, no destroy_process_group) | passed | first failure |"]
    rows.append("| --- | ---: | --- |")
    for label, command, env, done in PROGRAMS:
        ok, first = 0, ""
        for _ in range(runs):
            proc = subprocess.run(
                command(free_port()),
                env={**os.environ, **env},
                capture_output=True,
                text=True,
                timeout=120,
            )
            if proc.returncode == 0 and proc.stdout.count(done) == 4:
                ok += 1
            elif not first:
                lines = [ln for ln in proc.stderr.splitlines() if "Error" in ln]
                first = (lines[-1] if lines else f"exit {proc.returncode}")[:160]
        rows.append(f"| {label} | {ok}/{runs} | {first.replace('|', '/')} |")
        print(rows[-1], flush=True)
    return rows


def exit_costs(runs: int, ranks: int, libs: list[str]) -> list[str]:
    rows = [
        f"| {ranks} ranks, end of script to end of process | median | p90 | max |",
        "| --- | ---: | ---: | ---: |",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp, "exit_cost.py")
        script.write_text(textwrap.dedent(EXIT_SCRIPT))
        for lib in libs:
            for destroy in ("1", "0"):
                costs: list[float] = []
                for _ in range(runs):
                    out = subprocess.run(
                        [sys.executable, str(script), lib, destroy, str(ranks), str(free_port()),
                         str(Path(tmp, "t"))],
                        capture_output=True, text=True, timeout=120, check=True,
                    ).stdout  # fmt: skip
                    costs += [float(v) * 1000 for v in out.split()]
                costs.sort()
                name = "aiodist" if lib == "aiodist" else "torch gloo"
                how = "destroy_process_group() at the end" if destroy == "1" else "no destroy"
                p90 = costs[int(0.9 * (len(costs) - 1))]
                rows.append(
                    f"| {name}, {how} | {statistics.median(costs):.0f} ms | {p90:.0f} ms | "
                    f"{costs[-1]:.0f} ms |"
                )
                print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="runs of each program (default 50)")
    parser.add_argument("--exit-runs", type=int, default=10, help="runs of the exit-cost script")
    parser.add_argument("--ranks", type=int, default=4, help="ranks of the exit-cost script")
    parser.add_argument(
        "--write", action="store_true", help="write bench/results/exits.md (else a temp folder)"
    )
    args = parser.parse_args()
    # Committed results change only on purpose: without --write they go to a fresh folder.
    out = (
        ROOT / "bench" / "results" / "exits.md"
        if args.write
        else Path(tempfile.mkdtemp(prefix="aiodist-bench-"), "exits.md")
    )
    try:
        import torch  # noqa: F401

        libs = ["aiodist", "torch"]
    except ImportError:
        print(
            "torch is not installed (pip install torch==2.13.0): "
            "the exit cost is measured for aiodist only"
        )
        libs = ["aiodist"]
    hogs = start_hogs()
    started = time.strftime("%Y-%m-%d %H:%M")
    try:
        pass_rows = passes(args.runs)
        load = os.getloadavg()[0]
        cost_rows = exit_costs(args.exit_runs, args.ranks, libs)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    report = "\n".join(
        [
            "# Scripts that end without destroy_process_group()",
            "",
            f"`python bench/exits.py --runs {args.runs}` on {started}, {os.cpu_count()} CPUs, "
            f"beside two CPU-bound processes (load average {load:.1f} after the runs); "
            f"{multiprocessing.get_start_method()} is the default start method here.",
            "",
            *pass_rows,
            "",
            f"Exit cost, {args.exit_runs} runs of each: a script does one all_reduce, notes the "
            "time and ends (destroying its group or not); the cost is the time from that note "
            "to the end of its process as its parent sees it.",
            "",
            *cost_rows,
            "",
        ]
    )
    print(report)
    out.write_text(report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
