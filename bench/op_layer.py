"""The cost of the operation layer per call: an 8-byte all_reduce, with and without a peer.

Run:  unshare -n bash -c 'ip link set lo up && .venv/bin/python bench/op_layer.py'
      [--iters 20000] [--repeat 5]

Two numbers, in microseconds per ``await aiodist.all_reduce(x)`` (8 bytes of float32):

* **world size 1**: a group of one rank, so no message moves: what issuing, planning,
  running and completing an operation costs in Python (median of ``--repeat`` runs of
  ``--iters`` calls each, on uvloop);
* **2 processes**: the same call between two processes over loopback TCP, the slower
  rank's median per call.

To compare two versions of the library, run the script with ``PYTHONPATH`` pointing at each
checkout in turn; it imports whatever ``aiodist`` comes first. The table is printed and
written to ``op_layer.md`` in a temporary folder, or with ``--write`` to
``bench/results/op_layer.md`` (``--out``: another path).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


async def _world_of_one(iters: int, repeat: int) -> list[float]:
    import aiodist

    store = aiodist.HashStore()
    await aiodist.init_process_group("cpu", store=store, rank=0, world_size=1)
    x = np.ones(2, np.float32)
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(iters):
            await aiodist.all_reduce(x)
        runs.append((time.perf_counter() - start) / iters * 1e6)
    await aiodist.destroy_process_group()
    return runs


def _rank(rank: int, port: int, iters: int, out: Any) -> None:
    import aiodist
    from aiodist._util._loop import loop_factory

    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )

    async def main() -> list[float]:
        await aiodist.init_process_group("cpu")
        x = np.ones(2, np.float32)
        for _ in range(500):
            await aiodist.all_reduce(x, op=aiodist.ReduceOp.MAX)
        samples = []
        for _ in range(iters):
            t = time.perf_counter()
            await aiodist.all_reduce(x, op=aiodist.ReduceOp.MAX)
            samples.append(time.perf_counter() - t)
        await aiodist.destroy_process_group()
        return samples

    with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
        out.put((rank, runner.run(main())))


def _two_processes(iters: int) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, iters, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=300) for _ in procs)
    for p in procs:
        p.join()
    return max(statistics.median(s) for s in results.values()) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--write", action="store_true", help="write bench/results/op_layer.md (else a temp folder)"
    )
    parser.add_argument("--out", help="the results file (overrides --write's)")
    args = parser.parse_args()
    # Committed results change only on purpose: without --write they go to a fresh folder.
    if args.out is None:
        args.out = str(
            Path(__file__).resolve().parent / "results" / "op_layer.md"
            if args.write
            else Path(tempfile.mkdtemp(prefix="aiodist-bench-"), "op_layer.md")
        )
    import aiodist
    from aiodist._util._loop import loop_factory

    with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
        one = runner.run(_world_of_one(args.iters, args.repeat))
    two = _two_processes(args.iters // 2)
    text = "\n".join(
        [
            "# The operation layer's cost per call",
            "",
            f"`{' '.join(['python', 'bench/op_layer.py', *sys.argv[1:]])}` on "
            f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, aiodist from "
            f"`{os.path.dirname(aiodist.__file__)}`.",
            "",
            "| setting | us per 8 B all_reduce |",
            "| --- | ---: |",
            f"| world size 1 (median of {args.repeat}) | {statistics.median(one):.2f} |",
            f"| 2 processes, loopback TCP (slower rank's median) | {two:.2f} |",
            "",
        ]
    )
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
