"""Where the back-to-back time of small operations goes: every call of a loop timed, on every rank.

Run (one process per rank on this host):

    unshare -n bash -c 'ip link set lo up && .venv/bin/python bench/tail.py [--ranks 2] [--calls 30000]'

``--loop asyncio``: the standard loop instead of uvloop.

Each rank runs ``--calls`` 8-byte all_reduces back to back (after a warm-up and a barrier),
noting when each call ended and whether it ended as it was issued (its work born done) or
was handed to a task because a peer was late. Each rank prints one JSON line: the mean
(the back-to-back figure), median, p90, p99 and longest call in µs; the share of calls born
done and the mean of each kind; its CPU time per call; its context switches; the garbage
collector's passes per generation during the loop; and, by duration bucket, the share of
the calls and the share of the time. Profile the ranks meanwhile with ``py-spy record --pid
PID --nonblocking`` to see where the wall time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np


async def rank_main(calls: int) -> None:
    import aiodist

    await aiodist.init_process_group(init_method="env://")
    x = np.zeros(1)
    for _ in range(500):
        await aiodist.all_reduce(x)
    await aiodist.barrier()
    ended = np.empty(calls + 1, np.int64)
    born_done = np.zeros(calls, bool)
    passes = [g["collections"] for g in gc.get_stats()]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = time.process_time()
    clock, all_reduce = time.perf_counter_ns, aiodist.all_reduce
    ended[0] = clock()
    for i in range(calls):
        work = all_reduce(x)
        born_done[i] = work.is_completed()
        await work
        ended[i + 1] = clock()
    cpu = time.process_time() - cpu
    after = resource.getrusage(resource.RUSAGE_SELF)
    d = np.diff(ended) / 1e3
    median = float(np.median(d))
    out: dict[str, object] = {
        "rank": int(os.environ["RANK"]),
        "mean": float(d.mean()),
        "median": median,
        "p90": float(np.percentile(d, 90)),
        "p99": float(np.percentile(d, 99)),
        "max": float(d.max()),
        "born_done": float(born_done.mean()),
        "mean_born_done": float(d[born_done].mean()) if born_done.any() else None,
        "mean_handed_over": float(d[~born_done].mean()) if (~born_done).any() else None,
        "cpu_us": cpu / calls * 1e6,
        "involuntary_switches": after.ru_nivcsw - usage.ru_nivcsw,
        "voluntary_switches": after.ru_nvcsw - usage.ru_nvcsw,
        "gc_passes": [g["collections"] - p for g, p in zip(gc.get_stats(), passes, strict=True)],
    }
    edges = [0.0, 2 * median, max(2 * median, 50.0), 200.0, 1000.0, float("inf")]
    for lo, hi in itertools.pairwise(edges):
        inside = (d >= lo) & (d < hi)
        out[f"calls, time in [{lo:.0f}, {hi:.0f}) µs"] = [
            round(float(inside.mean()), 4),
            round(float(d[inside].sum() / d.sum()), 3),
        ]
    print(json.dumps(out, ensure_ascii=False), flush=True)
    await aiodist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=30000)
    parser.add_argument("--loop", default="auto", choices=("auto", "asyncio"))
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        from aiodist._util._loop import loop_factory  # uvloop where installed (auto)

        with asyncio.Runner(loop_factory=loop_factory(args.loop)) as runner:
            runner.run(rank_main(args.calls))
        return
    env = dict(
        os.environ,
        WORLD_SIZE=str(args.ranks),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(29500 + os.getpid() % 1000),
    )
    command = [sys.executable, __file__, "--rank", "--calls", str(args.calls), "--loop", args.loop]
    procs = [subprocess.Popen(command, env=dict(env, RANK=str(r))) for r in range(args.ranks)]
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
