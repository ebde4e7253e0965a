"""Shared memory against loopback TCP, in the same processes and the same run.

Run:  python bench/shm.py [--quick] [--ranks 2,4] [--sizes 8,1048576] [--reps 5]
      [--write] [--out FILE] [--profile]

The tables are printed and written to a temporary folder, or with ``--write`` to
``bench/results/shm.md`` (``--out``: another path).

One process per rank on this machine, meeting through a FileStore. Every process holds a
``TCPTransport``, a ``ShmTransport`` and a ``NodeWorkspace`` at once, and every size is
timed with each, batch after batch in turn, so changes in the machine's load hit all of
them alike:

* ``tcp``: the transport algorithms (``aiodist.collectives``) over loopback TCP;
* ``shm``: the same algorithms over the shared-memory transport;
* ``direct``: ``aiodist.collectives.shm`` on private arrays (copied in and out);
* ``shared``: ``aiodist.collectives.shm`` on arrays from ``aiodist.collectives._shared_array.empty``
  (read and written in place).

A measurement is a batch of back-to-back operations after a barrier, divided by the batch
length; the slowest rank counts and the table shows the median over the repetitions.
Point to point (two ranks): ``latency`` is half a ping-pong round trip of one message;
``bandwidth`` streams a window of messages one way and waits for one reply. all_reduce
columns follow nccl-tests: ``algbw = size / time``, ``busbw = algbw * 2(n-1)/n``.
``stall`` is the longest the event loop went without running another task during a
direct all_reduce (a task yielding in a loop measures it, in a separate pass), in wall
time / in CPU time of the loop's thread: with more ranks than CPUs the wall time also
counts the time the process waited for a CPU. The
machine's limits are measured in the same run: numpy copy (bytes copied per second) and
``a += b`` (bytes of ``a`` per second), single process.

``--profile`` runs cProfile on rank 0 during 20,000 direct 8-byte all_reduces and prints
where the time goes.

Run it inside a private network namespace so nothing leaves the machine:
``unshare -n bash -c 'ip link set lo up && .venv/bin/python bench/shm.py --quick'``
(``unshare -n`` needs root; ``unshare -rn`` works without).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import multiprocessing as mp
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

SIZES = [8, 1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [8, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
P2P_SIZES = [8, 1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
MODES = ["tcp", "shm", "direct", "shared"]
STALL_SIZES = [1 << 20, 64 << 20]


def iters_for(size: int, quick: bool) -> int:
    budget = (16 << 20) if quick else (64 << 20)
    return max(2, min(300 if quick else 2000, budget // max(size, 1)))


async def _timed(op: Callable[[], Awaitable[Any]], iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        await op()
    return (time.perf_counter() - start) / iters


async def pingpong(t: Any, rank: int, tag: Any, data: memoryview, box: memoryview) -> None:
    """One message from rank 0 to rank 1 and one back."""
    if rank == 0:
        await t.send(1, tag, data)
        await t.recv_into(1, tag, box)
    else:
        await t.recv_into(0, tag, box)
        await t.send(0, tag, data)


async def stream(
    t: Any, rank: int, tag: Any, data: memoryview, box: memoryview, window: int
) -> None:
    """``window`` messages from rank 0 to rank 1, then one empty reply."""
    if rank == 0:
        await asyncio.gather(*(t.send(1, tag, data) for _ in range(window)))
        await t.recv_into(1, tag, memoryview(bytearray()))
    else:
        # Every receive posted up front (into the same memory: only the bytes moved count),
        # so no message waits in a staging buffer for its receive.
        await asyncio.gather(*(t.recv_into(0, tag, box) for _ in range(window)))
        await t.send(0, tag, memoryview(b""))


async def max_stall(op: Callable[[], Awaitable[Any]], times: int) -> tuple[float, float]:
    """The longest gap between two turns of a task that yields in a loop, during ``op``:
    in wall-clock time, and in CPU time of this thread (which leaves out the time the
    process was not running at all, as when more ranks than CPUs take turns)."""
    gaps = [(0.0, 0.0)]
    done = False

    async def ticker() -> None:
        last, last_cpu = time.perf_counter(), time.thread_time()
        while not done:
            await asyncio.sleep(0)
            now, cpu = time.perf_counter(), time.thread_time()
            gaps.append((now - last, cpu - last_cpu))
            last, last_cpu = now, cpu

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    for _ in range(times):
        await op()
    done = True
    await tick
    return max(g[0] for g in gaps), max(g[1] for g in gaps)


async def rank_main(rank: int, n: int, tmp: str, args: argparse.Namespace) -> dict[Any, Any]:
    from aiodist import collectives
    from aiodist._arrays._reduce import ReduceOp
    from aiodist.collectives import _shared_array, shm
    from aiodist.collectives.shm import NodeWorkspace
    from aiodist.store import FileStore, PrefixStore
    from aiodist.transport.base import OpComm, PeerDirectory
    from aiodist.transport.shm import ShmTransport
    from aiodist.transport.tcp import TCPTransport

    store = FileStore(os.path.join(tmp, "store"))
    job = f"bench-{os.path.basename(tmp)}"
    tcp = await TCPTransport.create(PeerDirectory(PrefixStore("tcp", store)), rank, n, timeout=60)
    shmt = await ShmTransport.create(PrefixStore("shm", store), rank, n, timeout=60, job_key=job)
    ws = await NodeWorkspace.create(PrefixStore("ws", store), rank, n, timeout=60, job_key=job)
    ranks = list(range(n))
    seq = iter(range(1 << 62))
    transports = {"tcp": tcp, "shm": shmt}
    out: dict[Any, Any] = {}

    def comm(mode: str) -> OpComm:
        return OpComm(transports[mode], ranks, rank, 1, next(seq))

    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    # -- all_reduce ---------------------------------------------------------------------
    for size in sizes:
        count = max(1, size // 4)
        # Zeros: sums of anything else overflow float32 after a few hundred operations.
        private = np.zeros(count, np.float32)
        in_shm = _shared_array.zeros(count, np.float32, ws)
        ops: dict[str, Callable[[], Awaitable[Any]]] = {
            "tcp": lambda x=private: collectives.all_reduce(comm("tcp"), x, ReduceOp.SUM),
            "shm": lambda x=private: collectives.all_reduce(comm("shm"), x, ReduceOp.SUM),
            "direct": lambda x=private: shm.all_reduce(ws, x, ReduceOp.SUM),
            "shared": lambda x=in_shm: shm.all_reduce(ws, x, ReduceOp.SUM),
        }
        iters = iters_for(size, args.quick)
        for mode in MODES:  # warm up: connections, mappings, page faults
            for _ in range(min(iters, 200)):
                await ops[mode]()
        for _ in range(args.reps):
            for mode in MODES:
                await shm.barrier(ws)
                out["all_reduce", size, mode] = out.get(("all_reduce", size, mode), [])
                out["all_reduce", size, mode].append(await _timed(ops[mode], iters))
        if size in STALL_SIZES:
            for mode in ("direct", "shared"):
                await shm.barrier(ws)
                out["stall", size, mode] = await max_stall(ops[mode], 3)
        del in_shm
    # -- point to point -------------------------------------------------------------------
    if n == 2:
        for size in args.sizes or (P2P_SIZES if not args.quick else [8, 1 << 20, 64 << 20]):
            data = np.ones(size, np.uint8).data
            box = np.zeros(size, np.uint8).data
            window = max(1, min(16, (64 << 20) // max(size, 1)))
            for mode in ("tcp", "shm"):
                for _ in range(5):
                    await pingpong(transports[mode], rank, (2, next(seq), 0), data, box)
                    await stream(transports[mode], rank, (3, next(seq), 0), data, box, window)
            for _ in range(args.reps):
                for mode in ("tcp", "shm"):
                    t = transports[mode]
                    await shm.barrier(ws)
                    lat = await _timed(
                        lambda t=t, d=data, b=box: pingpong(t, rank, (2, next(seq), 0), d, b),
                        iters_for(size, args.quick),
                    )
                    out.setdefault(("latency", size, mode), []).append(lat / 2)
                    await shm.barrier(ws)
                    per_window = await _timed(
                        lambda t=t, d=data, b=box, w=window: stream(
                            t, rank, (3, next(seq), 0), d, b, w
                        ),
                        iters_for(size * window, args.quick),
                    )
                    out.setdefault(("bandwidth", size, mode), []).append(per_window / window)
    # -- where the 8-byte direct all_reduce spends its time --------------------------------
    if args.profile:
        x = np.zeros(2, np.float32)
        await shm.barrier(ws)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20000):
            await shm.all_reduce(ws, x, ReduceOp.SUM)
        prof.disable()
        if rank == 0:
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
            out["profile"] = text.getvalue()
    await shm.barrier(ws)
    await ws.aclose()
    await shmt.aclose()
    await tcp.aclose()
    return out


def rank_entry(rank: int, n: int, tmp: str, args: argparse.Namespace, queue: Any) -> None:
    from aiodist._util._loop import loop_factory

    try:
        with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
            queue.put((rank, runner.run(rank_main(rank, n, tmp, args))))
    except BaseException as exc:
        queue.put((rank, exc))
        raise


def run_world(n: int, args: argparse.Namespace) -> dict[Any, Any]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="aiodist-bench-") as tmp:
        queue = ctx.Queue()
        procs = [ctx.Process(target=rank_entry, args=(r, n, tmp, args, queue)) for r in range(n)]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        try:
            while len(results) < n:
                rank, res = queue.get(timeout=1800)
                if isinstance(res, BaseException):
                    raise RuntimeError(f"rank {rank} failed: {res!r}")
                results[rank] = res
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
    merged: dict[Any, Any] = {}
    for key, value in results[0].items():
        if isinstance(value, list):
            # The slowest rank counts, then the median over the repetitions.
            per_rep = [max(results[r][key][i] for r in range(n)) for i in range(len(value))]
            merged[key] = statistics.median(per_rep)
        elif key[0] == "stall":
            merged[key] = tuple(max(results[r][key][i] for r in range(n)) for i in range(2))
        else:
            merged[key] = value
    return merged


def fmt_size(size: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift} {unit}"
    return f"{size} B"


def machine_limits() -> list[str]:
    lines = ["| size | numpy copy | `a += b` |", "| ---: | ---: | ---: |"]
    for size in (1 << 20, 16 << 20, 64 << 20):
        a = np.ones(size // 4, np.float32)
        b = np.ones(size // 4, np.float32)
        reps = max(5, (512 << 20) // size)
        copies, adds = [], []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(reps):
                np.copyto(a, b)
            copies.append((time.perf_counter() - start) / reps)
            start = time.perf_counter()
            for _ in range(reps):
                a += b
            adds.append((time.perf_counter() - start) / reps)
        lines.append(
            f"| {fmt_size(size)} | {size / statistics.median(copies) / 1e9:.1f} GB/s "
            f"| {size / statistics.median(adds) / 1e9:.1f} GB/s |"
        )
    return lines


def all_reduce_table(n: int, rows: dict[Any, Any]) -> list[str]:
    head = (
        "| size | "
        + " | ".join(f"{m} time | {m} busbw" for m in MODES)
        + " | stall direct | stall shared |"
    )
    lines = [f"### all_reduce, {n} ranks, float32", "", head]
    lines.append("| ---: " * (1 + 2 * len(MODES) + 2) + "|")
    factor = 2 * (n - 1) / n
    sizes = sorted({k[1] for k in rows if k[0] == "all_reduce"})
    for size in sizes:
        cells = [fmt_size(size)]
        for mode in MODES:
            t = rows["all_reduce", size, mode]
            cells.append(f"{t * 1e6:.1f} µs" if t < 1e-3 else f"{t * 1e3:.2f} ms")
            cells.append(f"{size / t * factor / 1e9:.2f} GB/s")
        for mode in ("direct", "shared"):
            stall = rows.get(("stall", size, mode))
            cells.append("" if stall is None else f"{stall[0] * 1e3:.2f} / {stall[1] * 1e3:.2f} ms")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def p2p_table(rows: dict[Any, Any]) -> list[str]:
    lines = [
        "### point to point, 2 ranks",
        "",
        "| size | tcp latency | shm latency | tcp bandwidth | shm bandwidth |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for size in sorted({k[1] for k in rows if k[0] == "latency"}):
        cells = [fmt_size(size)]
        for mode in ("tcp", "shm"):
            t = rows["latency", size, mode]
            cells.append(f"{t * 1e6:.1f} µs" if t < 1e-3 else f"{t * 1e3:.2f} ms")
        cells += [f"{size / rows['bandwidth', size, m] / 1e9:.2f} GB/s" for m in ("tcp", "shm")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    parser.add_argument("--ranks", default="2,4", help="world sizes, comma separated")
    parser.add_argument("--reps", type=int, default=5, help="batches per size and mode")
    parser.add_argument(
        "--sizes",
        type=lambda text: [int(v) for v in text.split(",")],
        help="message sizes in bytes, comma separated (instead of the default list)",
    )
    parser.add_argument(
        "--write", action="store_true", help="write bench/results/shm.md (else a temp folder)"
    )
    parser.add_argument("--out", help="the results file (overrides --write's)")
    parser.add_argument("--profile", action="store_true", help="profile the 8-byte direct path")
    args = parser.parse_args()
    # Committed results change only on purpose: without --write they go to a fresh folder.
    if args.out is None:
        args.out = (
            os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "shm.md")
            if args.write
            else os.path.join(tempfile.mkdtemp(prefix="aiodist-bench-"), "shm.md")
        )
    lines = [
        f"# bench/shm.py ({'quick' if args.quick else 'full'}), {os.cpu_count()} CPUs, "
        f"{time.strftime('%Y-%m-%d %H:%M')}",
        "",
        "### machine limits (one process)",
        "",
        *machine_limits(),
        "",
    ]
    print("\n".join(lines), flush=True)
    profiles = []
    for n in (int(r) for r in args.ranks.split(",")):
        rows = run_world(n, args)
        block = [*all_reduce_table(n, rows), ""]
        if n == 2:
            block += [*p2p_table(rows), ""]
        if "profile" in rows:
            profiles.append(f"rank 0 of {n}, 20,000 direct 8-byte all_reduces:\n{rows['profile']}")
        print("\n".join(block), flush=True)
        lines += block
    for text in profiles:
        print(text)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    sys.exit(0)


if __name__ == "__main__":
    main()
