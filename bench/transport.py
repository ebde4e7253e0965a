"""TCPTransport between two processes: small-message round trip and one-way bandwidth.

Run:  python bench/transport.py [--iters 2000] [--max-size 64M] [--loop uvloop|asyncio]
      [--spin auto|0|SECONDS] [--profile FILE]

Two processes on this machine exchange messages over loopback. The latency table is a
ping-pong of 8 bytes (half the round trip is the one-way latency); the bandwidth table sends
a window of messages of each size from rank 0 to rank 1, which answers with one byte once
the last arrives. The results are printed and written to ``transport.md`` in a temporary
folder, or with ``--write`` to ``bench/results/transport.md`` (``--out``: another path).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from aiodist._util._loop import loop_factory
from aiodist.store import FileStore
from aiodist.transport.base import PeerDirectory
from aiodist.transport.tcp import TCPTransport


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text[-1].upper() in units:
        return int(text[:-1]) * units[text[-1].upper()]
    return int(text)


async def ping_pong(t: TCPTransport, iters: int) -> list[float]:
    peer = 1 - t.rank
    buf = memoryview(np.zeros(1, np.float64))
    times = []
    for i in range(iters):
        tag = (1, i, 0)
        start = time.perf_counter()
        if t.rank == 0:
            reply = t.recv_into(peer, tag, buf)
            await t.send(peer, tag, buf)
            await reply
        else:
            await t.recv_into(peer, tag, buf)
            await t.send(peer, tag, buf)
        times.append(time.perf_counter() - start)
    return times


WINDOW = 4


async def exchange(t: TCPTransport, iters: int) -> list[float]:
    """Both ranks send 8 bytes and receive 8 bytes at once, as a 2-rank all_reduce does."""
    peer = 1 - t.rank
    out = memoryview(np.zeros(1, np.float64))
    data = memoryview(np.ones(1, np.float64))
    times = []
    for i in range(iters):
        start = time.perf_counter()
        recv = t.recv_into(peer, (4, i, 0), out)
        await t.send(peer, (4, i, 0), data)
        await recv
        times.append(time.perf_counter() - start)
    return times


async def bandwidth(t: TCPTransport, size: int, seq: int, count: int) -> float:
    """Return seconds per message of ``size`` bytes, ``WINDOW`` messages in flight."""
    ack = memoryview(bytearray(1))
    if t.rank == 0:
        data = np.ones(size, np.uint8)
        await t.recv_into(1, (3, seq, 1), ack)  # the receiver's buffers are ready
        start = time.perf_counter()
        window: list[asyncio.Future[None]] = []
        for i in range(count):
            window.append(t.send(1, (2, seq, i), memoryview(data)))
            if len(window) >= WINDOW:
                await window.pop(0)
        await asyncio.gather(*window)
        await t.recv_into(1, (3, seq, 0), ack)
        return (time.perf_counter() - start) / count
    # Receives posted a window ahead into reused buffers, as a pipelined collective does:
    # payloads land straight in their final memory.
    outs = [np.ones(size, np.uint8) for _ in range(WINDOW)]
    posted = [t.recv_into(0, (2, seq, i), memoryview(outs[i])) for i in range(min(count, WINDOW))]
    await t.send(0, (3, seq, 1), ack)
    for i in range(count):
        await posted[i]
        if i + WINDOW < count:
            posted.append(t.recv_into(0, (2, seq, i + WINDOW), memoryview(outs[i % WINDOW])))
    await t.send(0, (3, seq, 0), ack)
    return 0.0


async def both_ways(t: TCPTransport, size: int, seq: int, count: int) -> float:
    """Return seconds per message when both ranks stream ``size``-byte messages at once."""
    peer = 1 - t.rank
    data = np.ones(size, np.uint8)
    outs = [np.ones(size, np.uint8) for _ in range(WINDOW)]
    ready = memoryview(bytearray(1))
    # Both ranks have posted their first receives before either starts sending.
    posted = [t.recv_into(peer, (5, seq, i), memoryview(outs[i])) for i in range(WINDOW)]
    await asyncio.gather(t.send(peer, (6, seq, 0), ready), t.recv_into(peer, (6, seq, 0), ready))
    start = time.perf_counter()
    sends: list[asyncio.Future[None]] = []
    for i in range(count):
        sends.append(t.send(peer, (5, seq, i), memoryview(data)))
        if len(sends) >= WINDOW:
            await sends.pop(0)
        if i >= WINDOW - 1:
            await posted[i - WINDOW + 1]
            nxt = i + 1
            if nxt < count and nxt >= WINDOW:
                posted.append(t.recv_into(peer, (5, seq, nxt), memoryview(outs[nxt % WINDOW])))
    await asyncio.gather(*sends, *posted[max(0, count - WINDOW + 1) :])
    return (time.perf_counter() - start) / count


async def rank_main(rank: int, path: str, args: argparse.Namespace) -> None:
    store = FileStore(path, 2, timeout=60)
    spin = None if args.spin == "auto" else float(args.spin)
    t = await TCPTransport.create(PeerDirectory(store), rank, 2, local_world_size=2, spin=spin)
    await ping_pong(t, 200)  # connect and warm up
    times = await ping_pong(t, args.iters)
    await exchange(t, 200)
    swaps = await exchange(t, args.iters)
    rows = []
    size = 1 << 10
    seq = 0
    while size <= args.max_size:
        count = max(8, min(2000, (256 << 20) // size))
        await bandwidth(t, size, seq, WINDOW)  # warm up
        rows.append((size, await bandwidth(t, size, seq + 1, count)))
        size *= 4
        seq += 2
    duplex = []
    size = 64 << 10
    while size <= args.max_size:
        count = max(8, min(2000, (128 << 20) // size))
        await both_ways(t, size, seq, WINDOW)  # warm up
        duplex.append((size, await both_ways(t, size, seq + 1, count)))
        size *= 8
        seq += 2
    await ping_pong(t, 5)
    if rank == 0:
        us = sorted(x * 1e6 for x in times)
        lines = [
            "# TCP transport between two processes",
            "",
            f"`{' '.join(['python', 'bench/transport.py', *args.argv])}` on "
            f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, loop={args.loop}, "
            f"spin={args.spin}.",
            "",
            f"8 B round trip over {args.iters} iterations: p50 {us[len(us) // 2]:.1f} us, "
            f"p90 {us[int(len(us) * 0.9)]:.1f} us, mean {statistics.fmean(us):.1f} us "
            f"(one-way ~{us[len(us) // 2] / 2:.1f} us)",
            "",
        ]
        us = sorted(x * 1e6 for x in swaps)
        lines += [
            f"8 B exchange (both ranks send and receive at once): p50 {us[len(us) // 2]:.1f} us, "
            f"p90 {us[int(len(us) * 0.9)]:.1f} us",
            "",
            "One way, a window of messages in flight:",
            "",
            "| size (bytes) | time/msg (us) | GB/s |",
            "| ---: | ---: | ---: |",
            *(f"| {size} | {sec * 1e6:.1f} | {size / sec / 1e9:.3f} |" for size, sec in rows),
            "",
            "Both ranks sending at once (GB/s per direction):",
            "",
            "| size (bytes) | time/msg (us) | GB/s |",
            "| ---: | ---: | ---: |",
            *(f"| {size} | {sec * 1e6:.1f} | {size / sec / 1e9:.3f} |" for size, sec in duplex),
            "",
        ]
        text = "\n".join(lines)
        print(text)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)  # noqa: ASYNC240 - once, at the end
        print(f"wrote {out}")
    await t.aclose()
    await store.aclose()


def run_rank(rank: int, path: str, args: argparse.Namespace) -> None:
    runner = asyncio.Runner(loop_factory=loop_factory(args.loop))
    try:
        if args.profile and rank == 0:
            prof = cProfile.Profile()
            prof.enable()
            runner.run(rank_main(rank, path, args))
            prof.disable()
            prof.dump_stats(args.profile)
        else:
            runner.run(rank_main(rank, path, args))
    finally:
        runner.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--max-size", type=parse_size, default=64 << 20)
    parser.add_argument("--loop", default="auto", choices=["auto", "uvloop", "asyncio"])
    parser.add_argument("--spin", default="auto")
    parser.add_argument("--profile", help="write rank 0's cProfile stats here")
    parser.add_argument(
        "--write", action="store_true", help="write bench/results/transport.md (else a temp folder)"
    )
    parser.add_argument("--out", help="the results file (overrides --write's)")
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    # Committed results change only on purpose: without --write they go to a fresh folder.
    if args.out is None:
        args.out = str(
            Path(__file__).resolve().parent / "results" / "transport.md"
            if args.write
            else Path(tempfile.mkdtemp(prefix="aiodist-bench-"), "transport.md")
        )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "store")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=run_rank, args=(r, path, args)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            sys.exit(1)


if __name__ == "__main__":
    main()
