"""The blocking facade's cost: an 8-byte all_reduce through ``aiodist.sync`` vs the async API.

Run:  unshare -n bash -c 'ip link set lo up && .venv/bin/python bench/sync_overhead.py'
      [--ranks 2] [--iters 3000] [--torch]

Each of ``--ranks`` processes joins an aiodist group through env:// twice: first from its own
event loop (the async API: ``await aiodist.all_reduce(x, op=MAX)``), then through the blocking
facade (``aiodist.sync.all_reduce(x, op=MAX)``, and ``all_reduce(..., async_op=True).wait()``),
whose loop runs in a thread of the process. With ``--torch`` a torch gloo group runs the same
loop for comparison (``pip install torch==2.13.0``; without it that row is left out, saying
so). The tables are printed and written to ``sync_overhead.md`` in a temporary folder, or
with ``--write`` to ``bench/results/sync_overhead.md`` (``--out``: another path). MAX keeps the repeatedly reduced values finite. Every rank times each
operation; the table shows the slowest rank's median and mean, in microseconds. A second
table times blocking store calls against the async ones (HashStore and a TCPStore client,
in one process).

Where the microseconds go (2-vCPU VM shared with other work, medians of 3000 hops of an
empty coroutine from a caller thread to the loop thread and back, ``run_coroutine_threadsafe``
as ``_loop_thread.run`` does it):

* to the loop thread, 10 us: ``call_soon_threadsafe`` writes the loop's self-pipe, the loop
  thread wakes from ``epoll_wait`` and takes the GIL;
* back to the caller, 16 us when it sleeps on the future (the loop thread's ``set_result``
  wakes it through a futex), 7 us when it polls (``_loop_thread.wait``: ``future.done()`` and
  ``os.sched_yield()``, which drops the GIL, for up to ``SPIN_SECONDS``);
* but a polling caller holds the GIL between its yields, so the loop thread waits for it:
  to the loop thread 20 us instead of 10. A busy poll that never drops the GIL: 73 us.
  ``time.sleep(0)`` sleeps the kernel's timer slack (about 50 us) each round.

So one hop costs 27 us either way, against 1.1 us for an awaited ``HashStore.get``: a
blocking store call cannot come within 2x of the async one while it crosses threads.
A blocking collective used to make two hops (``_on_loop`` created the operation's ``Work``,
then ``_block`` waited for its end); it now makes one (``_start_on_loop`` hands the loop
thread a future to settle, and the caller polls it). The loop thread holds the GIL for the
operation's own Python (about 30 us per 8-byte all_reduce), during which a polling caller
only gets its turns between the loop's GIL releases.

Measured (2 vCPUs, load average 2-3, ``nice -n -15``, five runs of each version
alternating). The async time itself is bimodal from run to run: 30 us while the transport's
own receive polling catches the answers, 140 us once that polling has backed off (see
``docs/architecture.md``, "Polling policy"); compare runs in the same mode:

| | async | ``sync.all_reduce`` | ``async_op=True`` + ``wait()`` | blocking ``HashStore.get`` |
| --- | ---: | ---: | ---: | ---: |
| before, async 140 us (3 runs) | 138-142 | 243-274 (1.74-1.98x) | 245-265 (1.77-1.86x) | 26-27 |
| after, async 140 us (3 runs) | 139-147 | 196-204 (1.34-1.45x) | 197-205 (1.34-1.46x) | 28-45 |
| before, async 30 us (4 runs) | 30-33 | 80-84 (2.6-2.7x); one run 265 | 81-83; one run 270 | 27-100 |
| after, async 30 us (5 runs) | 30-33 | 66-68 (2.1-2.2x); two runs 120, 225 | 71-108; two runs 224-243 | 45-109 |

(async ``HashStore.get``: 1.1 us throughout.)
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def _stats(samples: list[float]) -> tuple[float, float]:
    return statistics.median(samples) * 1e6, statistics.fmean(samples) * 1e6


def _time_sync(fn: Callable[[], Any], iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _rank(rank: int, size: int, ports: list[int], iters: int, use_torch: bool, q: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1")
    results: dict[str, list[float]] = {}
    x = np.ones(2, dtype=np.float32)  # 8 bytes

    import aiodist
    from aiodist._util._loop import loop_factory

    async def async_part() -> None:
        os.environ["MASTER_PORT"] = str(ports[0])
        await aiodist.init_process_group("cpu")
        for _ in range(200):
            await aiodist.all_reduce(x, op=aiodist.ReduceOp.MAX)
        samples = []
        for _ in range(iters):
            t = time.perf_counter()
            await aiodist.all_reduce(x, op=aiodist.ReduceOp.MAX)
            samples.append(time.perf_counter() - t)
        results["async API: await all_reduce(x, op=MAX)"] = samples
        await aiodist.barrier()
        await aiodist.destroy_process_group()

    with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
        runner.run(async_part())

    import aiodist.sync as dist

    os.environ["MASTER_PORT"] = str(ports[1])
    dist.init_process_group("gloo")
    for _ in range(200):
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    results["aiodist.sync: all_reduce(x, op=MAX)"] = _time_sync(
        lambda: dist.all_reduce(x, op=dist.ReduceOp.MAX), iters
    )

    def with_work() -> None:
        work = dist.all_reduce(x, op=dist.ReduceOp.MAX, async_op=True)
        assert work is not None
        work.wait()

    results["aiodist.sync: all_reduce(x, op=MAX, async_op=True).wait()"] = _time_sync(
        with_work, iters
    )
    dist.barrier()
    dist.destroy_process_group()

    if use_torch:
        import torch
        import torch.distributed as tdist

        os.environ["MASTER_PORT"] = str(ports[2])
        tdist.init_process_group("gloo", rank=rank, world_size=size)
        t = torch.ones(2, dtype=torch.float32)
        for _ in range(200):
            tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        results["torch gloo: all_reduce(t, op=MAX)"] = _time_sync(
            lambda: tdist.all_reduce(t, op=tdist.ReduceOp.MAX), iters
        )
        tdist.barrier()
        tdist.destroy_process_group()
    q.put((rank, results))


def _store_table(iters: int) -> list[tuple[str, float, float]]:
    import aiodist
    import aiodist.sync as dist
    from aiodist._util._loop import loop_factory

    rows = []
    with dist.TCPStore("127.0.0.1", 0, is_master=True) as server:
        for name, make_sync in (
            ("HashStore", dist.HashStore),
            ("TCPStore client", lambda: dist.TCPStore("127.0.0.1", server.port)),
        ):
            with make_sync() as store:
                store.set("k", b"v")
                rows.append(
                    (f"blocking {name}.get", *_stats(_time_sync(lambda s=store: s.get("k"), iters)))
                )

        async def async_part() -> None:
            for name, make in (
                ("HashStore", lambda: _async_hash(aiodist)),
                ("TCPStore client", lambda: aiodist.TCPStore.create("127.0.0.1", server.port)),
            ):
                store = await make()
                await store.set("k", b"v")
                samples = []
                for _ in range(iters):
                    t = time.perf_counter()
                    await store.get("k")
                    samples.append(time.perf_counter() - t)
                rows.append((f"async {name}.get", *_stats(samples)))
                await store.aclose()

        with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
            runner.run(async_part())
    return rows


async def _async_hash(aiodist: Any) -> Any:
    return aiodist.HashStore()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=3000)
    parser.add_argument("--torch", action="store_true", help="also time torch gloo")
    parser.add_argument(
        "--write",
        action="store_true",
        help="write bench/results/sync_overhead.md (else a temp folder)",
    )
    parser.add_argument("--out", help="the results file (overrides --write's)")
    args = parser.parse_args()
    # Committed results change only on purpose: without --write they go to a fresh folder.
    if args.out is None:
        args.out = str(
            Path(__file__).resolve().parent / "results" / "sync_overhead.md"
            if args.write
            else Path(tempfile.mkdtemp(prefix="aiodist-bench-"), "sync_overhead.md")
        )
    if args.torch:
        try:
            import torch  # noqa: F401
        except ImportError:
            # A rank would fail to import it and the others would wait for it.
            print("torch is not installed (pip install torch==2.13.0): the gloo row is left out")
            args.torch = False
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ports = [_free_port() for _ in range(3)]
    procs = [
        ctx.Process(target=_rank, args=(r, args.ranks, ports, args.iters, args.torch, q))
        for r in range(args.ranks)
    ]
    for p in procs:
        p.start()
    per_rank = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    lines = [
        "# The blocking facade's cost",
        "",
        f"`{' '.join(['python', 'bench/sync_overhead.py', *sys.argv[1:]])}` on "
        f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs (load average "
        f"{os.getloadavg()[0]:.1f} at the end).",
        "",
        f"8-byte all_reduce (MAX: repeated ops stay finite), {args.ranks} ranks, "
        f"{args.iters} operations per row:",
        "",
        "| how | median µs | mean µs |",
        "| --- | ---: | ---: |",
    ]
    for label in per_rank[0]:
        medians, means = zip(*(_stats(per_rank[r][label]) for r in per_rank), strict=True)
        lines.append(f"| {label} | {max(medians):.1f} | {max(means):.1f} |")
    lines += [
        "",
        f"Store get of a present key, one process, {args.iters} calls per row:",
        "",
        "| how | median µs | mean µs |",
        "| --- | ---: | ---: |",
    ]
    for label, med, mean in _store_table(args.iters):
        lines.append(f"| {label} | {med:.1f} | {mean:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
