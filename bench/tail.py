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
the calls and the share of the time. The parent prints them as a table and writes it to a
temporary folder, or with ``--write`` to ``bench/results/tail.md`` (``--out``: another path).
Profile the ranks meanwhile with ``py-spy record --pid
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
import tempfile
import time
from pathlib import Path
from typing import Any

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
    print(json.dumps(out), flush=True)
    await aiodist.destroy_process_group()


#: Columns of the results table: (heading, key in a rank's report, format).
COLUMNS = (
    ("rank", "rank", "{}"),
    ("back to back µs", "mean", "{:.1f}"),
    ("median", "median", "{:.1f}"),
    ("p90", "p90", "{:.1f}"),
    ("p99", "p99", "{:.1f}"),
    ("longest", "max", "{:.0f}"),
    ("born done", "born_done", "{:.1%}"),
    ("µs born done", "mean_born_done", "{:.1f}"),
    ("µs handed over", "mean_handed_over", "{:.1f}"),
    ("CPU µs", "cpu_us", "{:.1f}"),
    ("involuntary switches", "involuntary_switches", "{}"),
    ("collector passes", "gc_passes", "{}"),
)


def table(reports: list[dict[str, Any]]) -> list[str]:
    """The ranks' reports as Markdown: one row a rank, then the calls and time by duration."""
    lines = [
        "| " + " | ".join(h for h, _, _ in COLUMNS) + " |",
        "| " + " | ".join("---:" for _ in COLUMNS) + " |",
    ]
    for r in reports:
        cells = [("-" if r[k] is None else f.format(r[k])) for _, k, f in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    buckets = [k for k in reports[0] if k.startswith("calls, time in")]
    lines += [
        "",
        "| rank | " + " | ".join(b.removeprefix("calls, time in ") for b in buckets) + " |",
    ]
    lines.append("| ---: | " + " | ".join("---:" for _ in buckets) + " |")
    for r in reports:
        cells = [f"{r[b][0]:.1%} of calls, {r[b][1]:.1%} of time" for b in buckets]
        lines.append(f"| {r['rank']} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=30000)
    parser.add_argument("--loop", default="auto", choices=("auto", "asyncio"))
    parser.add_argument("--write", action="store_true", help="write bench/results/tail.md")
    parser.add_argument("--out", help="the results file (overrides --write's)")
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
    procs = [
        subprocess.Popen(command, env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, text=True)
        for r in range(args.ranks)
    ]
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit("a rank failed (see above)")
    reports = sorted(
        (json.loads(o.strip().splitlines()[-1]) for o in outputs), key=lambda r: r["rank"]
    )
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [
        "# The back-to-back tail of small operations (`bench/tail.py`)",
        "",
        f"Command: `python bench/tail.py --ranks {args.ranks} --calls {args.calls} --loop "
        f"{args.loop}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{os.cpu_count()} CPUs, load average {load} at the end. Every call of a loop of "
        f"{args.calls} 8-byte all_reduces timed on every rank (µs); *born done*: the call "
        "ended as it was issued, else a peer was late and it was handed to a task; CPU µs "
        "and switches per call are the rank's own; collector passes per generation during "
        "the loop.",
        "",
        *table(reports),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    # Committed results change only on purpose: without --write they go to a fresh folder.
    if args.out:
        out = Path(args.out)
    elif args.write:
        out = Path(__file__).resolve().parent / "results" / "tail.md"
    else:
        out = Path(tempfile.mkdtemp(prefix="aiodist-bench-")) / "tail.md"
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
