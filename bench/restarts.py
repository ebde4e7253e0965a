"""Restart reliability: a worker crashes after its group formed, the launcher restarts the group.

Each run starts ``--nproc`` workers under ``--max-restarts=1``; on attempt 0 rank 1 exits with
code 3 after ``init_process_group`` and an all_reduce; attempt 1 must complete. The run
counts as a success when the launcher exits 0 and every rank printed attempt 1's result.

    python bench/restarts.py                      # 20 runs, aiodist and torch workers
    python bench/restarts.py --runs 5 --torchrun  # also torch's torchrun, for comparison

torch's torchrun keeps the failed attempt's keys in its store, which breaks gloo's
re-initialisation in most runs; aiodist-run empties the store between attempts.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKERS = {
    "aiodist": [str(ROOT / "tests" / "launcher_worker.py"), "crash-once", "1"],
    "torch": [str(ROOT / "tests" / "launcher_torch_worker.py"), "crash-once"],
}
EXPECTED = {"aiodist": "attempt=1 sum={s:g}", "torch": "torch attempt=1 sum={s:g}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_run(launcher: str, workers: str, nproc: int, timeout: float) -> tuple[bool, float, str]:
    if launcher == "aiodist-run":
        cmd = [sys.executable, "-m", "aiodist.run"]
    else:
        torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
        assert torchrun is not None, "torchrun is not installed next to this python"
        cmd = [torchrun, f"--master-port={free_port()}"]
    cmd += [f"--nproc-per-node={nproc}", "--max-restarts=1", *WORKERS[workers]]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    t0 = time.monotonic()
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return False, time.monotonic() - t0, f"timed out after {timeout:g} s"
    elapsed = time.monotonic() - t0
    want = EXPECTED[workers].format(s=nproc * (nproc + 1) / 2)
    done = len(re.findall(rf"{re.escape(want)}\b", result.stdout))
    if result.returncode == 0 and done == nproc:
        return True, elapsed, ""
    last = (result.stderr.strip().splitlines() or ["(no stderr)"])[-1]
    return False, elapsed, f"exit {result.returncode}, {done}/{nproc} ranks done: {last[:160]}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--workers", default="aiodist,torch", help="comma-separated: aiodist,torch")
    p.add_argument("--torchrun", action="store_true", help="also run torch workers under torchrun")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    args = p.parse_args()
    cases = [("aiodist-run", w) for w in args.workers.split(",") if w]
    if args.torchrun:
        cases.append(("torchrun", "torch"))
    print(f"{'launcher':>12} {'workers':>8} {'runs':>5} {'ok':>4} {'mean s':>7} {'max s':>7}")
    for launcher, workers in cases:
        ok, times, errors = 0, [], []
        for _ in range(args.runs):
            success, elapsed, error = one_run(launcher, workers, args.nproc, args.timeout)
            ok += success
            times.append(elapsed)
            if error:
                errors.append(error)
        print(
            f"{launcher:>12} {workers:>8} {args.runs:>5} {ok:>4} "
            f"{sum(times) / len(times):>7.2f} {max(times):>7.2f}",
            flush=True,
        )
        for error in errors[:3]:
            print(f"{'':>14}failure: {error}")


if __name__ == "__main__":
    main()
