"""Ranks for tests/test_leaving.py, in the shape of torch's explicit-store example.

Each rank builds its ``TCPStore`` inside a function (rank 0 hosts it) and lets it go once
``init_process_group`` has it, runs an ``all_reduce`` and an ``all_gather_object``, then
calls ``destroy_process_group``; the process lives on afterwards (a pool's worker).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

import aiodist.sync as dist


def _join(rank: int, port: int) -> None:
    # The store goes out of scope when this returns: only the process group holds it.
    store = dist.TCPStore("127.0.0.1", port, 3, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3)


def _work(rank: int) -> None:
    x = np.full(4, rank + 1, dtype=np.float32)
    dist.all_reduce(x)
    assert x.tolist() == [6.0] * 4, x
    out: list[object] = [None] * 3
    dist.all_gather_object(out, {"rank": rank})
    assert out == [{"rank": r} for r in range(3)], out


def destroy_in_order(args: tuple[int, int, tuple[int, ...], str]) -> tuple[int, float, float]:
    """Join, work, then call ``destroy_process_group`` after the rank before this one in
    ``order`` has called it; return (rank, when it called, when it returned)."""
    rank, port, order, run_dir = args
    where = Path(run_dir)
    _join(rank, port)
    _work(rank)
    place = order.index(rank)
    if place:
        before = where / f"calling-{order[place - 1]}"
        deadline = time.monotonic() + 60
        while not before.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {order[place - 1]} never called destroy_process_group")
            time.sleep(0.005)
        time.sleep(0.1)  # (it is inside destroy_process_group by now)
    (where / f"calling-{rank}").touch()
    called = time.time()
    dist.destroy_process_group()
    return rank, called, time.time()


def stop_after_work(rank: int, port: int, ready: str, report: str) -> None:
    """Join and work; rank 0 then waits (a test stops it), the others report how long their
    ``destroy_process_group`` took."""
    _join(rank, port)
    _work(rank)
    Path(ready, str(rank)).touch()
    if rank == 0:
        while not Path(report, "1").exists() or not Path(report, "2").exists():
            time.sleep(0.01)
        dist.destroy_process_group()
        return
    while not Path(ready, "stopped").exists():
        time.sleep(0.01)
    start = time.monotonic()
    dist.destroy_process_group()
    Path(report, str(rank)).write_text(f"{time.monotonic() - start}")
    os._exit(0)
