"""Every collective, aiodist against torch's gloo, in the same processes and the same run.

Run:  python bench/collectives.py [--quick] [--ranks 2,4] [--write] [--out FILE]
      [--only all_reduce,broadcast] [--sizes 64K,4M] [--profile DIR]

The tables are printed and written to a temporary folder, or with ``--write`` to
``bench/results/collectives.md`` (``--out``: another path). Without torch
(``pip install torch==2.13.0``) only aiodist's columns are measured.

One process per rank on this machine. Each process joins an aiodist group (uvloop, TCP over
loopback) and a torch gloo group; for every collective and size it times aiodist, then gloo,
back to back. A measurement is a batch of back-to-back operations after a barrier, divided
by the batch length; batches alternate between the two libraries, so changes in the
machine's load hit both alike; each rank times its own batches and the slowest rank counts;
the table shows the median over the repetitions. Columns follow nccl-tests: ``size`` is the bytes of
the whole operation (the output of all_gather and gather, the input of reduce_scatter,
scatter and all_to_all), ``algbw = size / time``, ``busbw = algbw * factor`` with factor
``2(n-1)/n`` for all_reduce, ``(n-1)/n`` for all_gather, reduce_scatter, gather, scatter
and all_to_all, and 1 for broadcast and reduce.

Run it inside a private network namespace so nothing leaves the machine:
``unshare -n bash -c 'ip link set lo up && .venv/bin/python bench/collectives.py --quick'``
(``unshare -n`` needs root; ``unshare -rn`` works without).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

COLLECTIVES = [
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "reduce_scatter",
    "gather",
    "scatter",
    "all_to_all",
    "barrier",
]
SIZES = [8, 128, 1 << 10, 8 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [8, 64 << 10, 1 << 20, 16 << 20]
DTYPE = np.float32


def bus_factor(name: str, n: int) -> float:
    if name == "all_reduce":
        return 2 * (n - 1) / n
    if name in ("broadcast", "reduce"):
        return 1.0
    return (n - 1) / n


def count_for(name: str, size: int, n: int) -> int:
    """Elements of the whole operation: at least one per rank, a multiple of n where split."""
    count = max(1, size // np.dtype(DTYPE).itemsize)
    if name in ("all_gather", "reduce_scatter", "gather", "scatter", "all_to_all"):
        count = max(n, count - count % n)
    return count


def iters_for(size: int, quick: bool) -> int:
    budget = (2 << 20) if quick else (8 << 20)
    return max(1, min(50 if quick else 200, budget // max(size, 1)))


# -- the operations, per library --------------------------------------------------------------


def make_buffers(name: str, count: int, n: int, rank: int) -> dict[str, Any]:
    block = count // n
    if name in ("all_reduce", "broadcast", "reduce"):
        return {"x": np.zeros(count, DTYPE)}
    if name == "all_gather":
        return {"x": np.zeros(block, DTYPE), "out": np.zeros(count, DTYPE)}
    if name == "reduce_scatter":
        return {"x": np.zeros(count, DTYPE), "out": np.zeros(block, DTYPE)}
    if name == "gather":
        outs = [np.zeros(block, DTYPE) for _ in range(n)] if rank == 0 else None
        return {"x": np.zeros(block, DTYPE), "outs": outs}
    if name == "scatter":
        ins = [np.zeros(block, DTYPE) for _ in range(n)] if rank == 0 else None
        return {"out": np.zeros(block, DTYPE), "ins": ins}
    if name == "all_to_all":
        return {"x": np.zeros(count, DTYPE), "out": np.zeros(count, DTYPE)}
    return {}


def aiodist_op(name: str, b: dict[str, Any]) -> Callable[[], Any]:
    import aiodist

    if name == "all_reduce":
        return lambda: aiodist.all_reduce(b["x"])
    if name == "broadcast":
        return lambda: aiodist.broadcast(b["x"], 0)
    if name == "reduce":
        return lambda: aiodist.reduce(b["x"], 0)
    if name == "all_gather":
        return lambda: aiodist.all_gather_into_tensor(b["out"], b["x"])
    if name == "reduce_scatter":
        return lambda: aiodist.reduce_scatter_tensor(b["out"], b["x"])
    if name == "gather":
        return lambda: aiodist.gather(b["x"], b["outs"], 0)
    if name == "scatter":
        return lambda: aiodist.scatter(b["out"], b["ins"], 0)
    if name == "all_to_all":
        return lambda: aiodist.all_to_all_single(b["out"], b["x"])
    return lambda: aiodist.barrier()


def torch_op(name: str, b: dict[str, Any]) -> Callable[[], Any]:
    import torch
    import torch.distributed as dist

    t = {k: torch.from_numpy(v) for k, v in b.items() if isinstance(v, np.ndarray)}
    lists = {k: [torch.from_numpy(a) for a in v] for k, v in b.items() if isinstance(v, list)}
    if name == "all_reduce":
        return lambda: dist.all_reduce(t["x"])
    if name == "broadcast":
        return lambda: dist.broadcast(t["x"], 0)
    if name == "reduce":
        return lambda: dist.reduce(t["x"], 0)
    if name == "all_gather":
        return lambda: dist.all_gather_into_tensor(t["out"], t["x"])
    if name == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(t["out"], t["x"])
    if name == "gather":
        return lambda: dist.gather(t["x"], lists.get("outs"), 0)
    if name == "scatter":
        return lambda: dist.scatter(t["out"], lists.get("ins"), 0)
    if name == "all_to_all":
        return lambda: dist.all_to_all_single(t["out"], t["x"])
    return lambda: dist.barrier()


# -- one rank --------------------------------------------------------------------------------


#: Untimed operations before each timed batch: the library whose turn it is gets its
#: threads, caches and connections going again after the other library's batch.
WARMUP = 5


async def batch_aiodist(op: Callable[[], Any], iters: int) -> float:
    import aiodist

    for _ in range(min(iters, WARMUP)):
        await op()
    await aiodist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        await op()
    return (time.perf_counter() - start) / iters


def batch_torch(op: Callable[[], Any], iters: int) -> float:
    import torch.distributed as dist

    for _ in range(min(iters, WARMUP)):
        op()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        op()
    return (time.perf_counter() - start) / iters


async def rank_main(
    rank: int, n: int, ports: tuple[int, int], args: argparse.Namespace
) -> dict[Any, Any]:
    import aiodist

    if args.gloo:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        # torch 2.13 marks the *_tensor collectives deprecated; they are still gloo's fast path.
        warnings.filterwarnings("ignore", category=FutureWarning)
        # Each library's own TCPStore, hosted by rank 0, as env:// jobs have. (With file://,
        # aiodist's world keeps polling the file for its abort key, about 100 us of CPU per
        # 4 MiB operation here, while gloo never reads its file store again after setup.)
        # gloo first: its blocking setup would stall rank 0's loop, where aiodist's store
        # server runs, while the other ranks still need it to join.
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{ports[1]}", world_size=n, rank=rank
        )
    await aiodist.init_process_group(
        "cpu", init_method=f"tcp://127.0.0.1:{ports[0]}", world_size=n, rank=rank
    )
    results: dict[Any, Any] = {}
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    reps = 5 if args.quick else 9
    profiler = cProfile.Profile() if args.profile else None
    for name in args.only:
        for size in [0] if name == "barrier" else sizes:
            count = count_for(name, size, n) if size else 0
            b = make_buffers(name, count, n, rank)
            iters = iters_for(size, args.quick)
            if rank == 0 and args.verbose:
                print(f"  {n} ranks: {name} {size} B", file=sys.stderr, flush=True)
            ours_op = aiodist_op(name, b)
            theirs_op = torch_op(name, b) if args.gloo else None
            # A warm-up batch each (connections, scratch buffers), then repetitions that alternate
            # between the libraries, so a change in the machine's load hits both alike.
            await batch_aiodist(ours_op, iters)
            if theirs_op:
                batch_torch(theirs_op, iters)
            ours, theirs = [], []
            for _ in range(reps):
                if profiler:
                    profiler.enable()
                ours.append(await batch_aiodist(ours_op, iters))
                if profiler:
                    profiler.disable()
                if theirs_op:
                    theirs.append(batch_torch(theirs_op, iters))
            results[name, size] = (count, ours, theirs)
    if profiler:
        profiler.dump_stats(os.path.join(args.profile, f"aiodist-n{n}-rank{rank}.prof"))
    if args.gloo:
        dist.destroy_process_group()
    await aiodist.destroy_process_group()
    return results


def rank_entry(
    rank: int, n: int, ports: tuple[int, int], args: argparse.Namespace, queue: Any
) -> None:
    from aiodist._util._loop import loop_factory

    try:
        with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
            queue.put((rank, runner.run(rank_main(rank, n, ports, args))))
    except BaseException as exc:
        queue.put((rank, exc))
        raise


def free_ports(count: int) -> tuple[int, ...]:
    """Distinct loopback ports that were free a moment ago (run it in its own namespace)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return tuple(int(sock.getsockname()[1]) for sock in socks)
    finally:
        for sock in socks:
            sock.close()


def run_world(n: int, args: argparse.Namespace) -> dict[Any, Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    os.environ.update(OMP_NUM_THREADS="1", LOCAL_WORLD_SIZE=str(n))
    aiodist_port, torch_port = free_ports(2)
    ports = (aiodist_port, torch_port)
    procs = [ctx.Process(target=rank_entry, args=(r, n, ports, args, queue)) for r in range(n)]
    for p in procs:
        p.start()
    per_rank: dict[int, Any] = {}
    try:
        for _ in range(n):
            rank, res = queue.get(timeout=1800)
            if isinstance(res, BaseException):
                raise RuntimeError(f"rank {rank} failed: {res!r}")
            per_rank[rank] = res
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    merged = {}
    for key, (count, _, _) in per_rank[0].items():
        # Per repetition, the slowest rank; then the median over repetitions.
        ours = [
            max(per_rank[r][key][1][i] for r in range(n)) for i in range(len(per_rank[0][key][1]))
        ]
        theirs = [
            max(per_rank[r][key][2][i] for r in range(n)) for i in range(len(per_rank[0][key][2]))
        ]
        merged[key] = (count, statistics.median(ours), statistics.median(theirs) if theirs else 0)
    return merged


# -- report --------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """``8``, ``64K``, ``4M``: bytes."""
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:].upper(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


def fmt_size(size: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


def table(name: str, n: int, rows: dict[Any, Any], gloo: bool) -> list[str]:
    op = "sum" if name in ("all_reduce", "reduce", "reduce_scatter") else "-"
    head = "| size | count | dtype | op | aiodist time (us) | algbw (GB/s) | busbw (GB/s) "
    if gloo:
        head += "| gloo time (us) | algbw (GB/s) | busbw (GB/s) | busbw ratio | time ratio "
    lines = [f"### {name}, {n} ranks", "", head + "|"]
    lines.append("| ---: | ---: | --- | --- " + "| ---: " * (8 if gloo else 3) + "|")
    factor = bus_factor(name, n)
    for (coll, _size), (count, ours, theirs) in sorted(rows.items(), key=lambda kv: kv[0][1]):
        if coll != name:
            continue
        nbytes = count * np.dtype(DTYPE).itemsize
        a_alg = nbytes / ours / 1e9
        cells = [f"{a_alg:.3f}", f"{a_alg * factor:.3f}"] if nbytes else ["-", "-"]
        if gloo:
            g_alg = nbytes / theirs / 1e9
            cells.append(f"{theirs * 1e6:.1f}")
            cells += [f"{g_alg:.3f}", f"{g_alg * factor:.3f}"] if nbytes else ["-", "-"]
            cells.append(f"{a_alg / g_alg:.2f}x" if nbytes else "-")
            cells.append(f"{ours / theirs:.3f}x")
        lines.append(
            f"| {fmt_size(nbytes)} | {count} | float32 | {op} | {ours * 1e6:.1f} | "
            + " | ".join(cells)
            + " |"
        )
    lines.append("")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 sizes, 5 repetitions")
    parser.add_argument("--ranks", default="2,4", help="world sizes, comma-separated")
    parser.add_argument("--only", default=",".join(COLLECTIVES), help="collectives to run")
    parser.add_argument(
        "--write",
        action="store_true",
        help="write bench/results/collectives.md (else a temp folder)",
    )
    parser.add_argument("--out", help="the results file (overrides --write's)")
    parser.add_argument("--sizes", default="", help="sizes instead of the default list: 8,64K,4M")
    parser.add_argument("--verbose", action="store_true", help="progress on stderr")
    parser.add_argument("--profile", default=None, help="directory for per-rank cProfile dumps")
    args = parser.parse_args()
    args.only = [c for c in args.only.split(",") if c]
    args.sizes = [parse_size(x) for x in args.sizes.split(",") if x]
    unknown = set(args.only) - set(COLLECTIVES)
    if unknown:
        parser.error(f"unknown collectives: {sorted(unknown)}")
    # Committed results change only on purpose: without --write they go to a fresh folder.
    if args.out is None:
        args.out = (
            os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "collectives.md")
            if args.write
            else os.path.join(tempfile.mkdtemp(prefix="aiodist-bench-"), "collectives.md")
        )
    try:
        import torch

        args.gloo = True
        against = f"torch {torch.__version__}"
    except ImportError:
        print("torch is not installed (pip install torch==2.13.0): the gloo columns are left out")
        args.gloo = False
        against = "no torch (aiodist only)"

    out = [
        "# Collectives: aiodist vs torch gloo",
        "",
        f"`python bench/collectives.py {' '.join(sys.argv[1:])}` on {os.cpu_count()} CPUs, "
        f"loopback TCP, {against}, numpy {np.__version__}. Times are medians "
        "(slowest rank per repetition); busbw ratio = aiodist busbw / gloo busbw (higher is "
        "better), time ratio = aiodist time / gloo time (lower is better).",
        "",
    ]
    for n in [int(x) for x in args.ranks.split(",")]:
        rows = run_world(n, args)
        for name in args.only:
            lines = table(name, n, rows, args.gloo)
            print("\n".join(lines), flush=True)
            out.extend(lines)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
