"""The async API under the launcher: overlap communication with work on the same loop.

Each rank issues one all_reduce per gradient bucket as soon as the bucket is "computed"
(the returned ``Work`` runs on its own), keeps computing the next bucket meanwhile, and
awaits all of them at the end; a health-check task keeps ticking on the same loop the whole
time. Every rank checks the averaged buckets against numpy and prints one line.

    aiodist-run --standalone --nproc-per-node=3 examples/async_overlap.py
"""

import asyncio
import sys
import time

import numpy as np

import aiodist

BUCKETS = 8
BUCKET_ELEMS = 1 << 18  # 1 MiB of float32 per bucket


def gradient(rank: int, bucket: int) -> np.ndarray:
    """What rank ``rank`` computes for ``bucket``: deterministic, so every rank can check."""
    return np.full(BUCKET_ELEMS, rank * 10.0 + bucket, np.float32)


async def health_check(stop: asyncio.Event, gaps: list[float]) -> None:
    """Stand-in for a server's health endpoint: it must keep answering during collectives."""
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


async def main() -> None:
    await aiodist.init_process_group()  # env://, as aiodist-run and torchrun set it up
    rank, size = aiodist.get_rank(), aiodist.get_world_size()
    stop, gaps = asyncio.Event(), []
    ticker = asyncio.create_task(health_check(stop, gaps))

    grads, works = [], []
    for b in range(BUCKETS):
        g = gradient(rank, b)  # "backward" of bucket b
        grads.append(g)
        works.append(aiodist.all_reduce(g, op=aiodist.ReduceOp.AVG))  # starts at once
        await asyncio.sleep(0)  # the next bucket's compute overlaps this one's all_reduce
    for w in works:
        await w
    stop.set()
    await ticker

    for b, g in enumerate(grads):
        expected = np.mean([gradient(r, b)[0] for r in range(size)], dtype=np.float32)
        np.testing.assert_allclose(g, expected)
    await aiodist.barrier()
    await aiodist.destroy_process_group()
    # One write per line: the ranks share the terminal.
    sys.stdout.write(
        f"rank {rank}/{size}: {BUCKETS} buckets averaged and checked; "
        f"health check's largest gap {max(gaps) * 1000:.1f} ms\n"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    asyncio.run(main())
