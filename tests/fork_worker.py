"""A parent that may hold a process group, and two ``multiprocessing`` children that form
one of their own: ``python fork_worker.py START_METHOD HOLD``.

With ``HOLD=1`` the parent initializes a one-rank group through ``aiodist.sync`` and starts
the progress thread (a completion it watches from the loop) before it starts the children;
a forked child inherits all that and must start clean: no group, its own loop thread and
progress thread. The children form a two-rank group (``tcp://``, shared memory between
them), all_reduce, watch a completion through the progress thread, and end without
``destroy_process_group()``. The parent then checks its own group still works and prints
one JSON line: what each child computed.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import sys
import threading
from typing import Any

import numpy as np

import aiodist.sync as dist
from aiodist.backends._progress import progress_thread
from aiodist.testing import free_port


class Flag:
    """A completion that is done once ``set`` ran (from any thread)."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()


async def watched() -> bool:
    """Whether this process's progress thread settles a completion set by another thread."""
    flag = Flag()
    threading.Timer(0.05, flag.done.set).start()
    await asyncio.wait_for(progress_thread().wait(flag, what="a flag"), 5)
    return True


def child(rank: int, port: int, queue: Any) -> None:
    inherited = dist.is_initialized()
    dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = np.full(4, rank + 1.0)
    dist.all_reduce(x)
    queue.put(
        {
            "rank": rank,
            "inherited": inherited,
            "sum": float(x[0]),
            "watched": asyncio.run(watched()),
        }
    )


def main() -> None:
    method, hold = sys.argv[1], sys.argv[2] == "1"
    if hold:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        asyncio.run(watched())  # the progress thread runs in the parent now
    port = free_port()
    ctx = mp.get_context(method)
    queue = ctx.Queue()
    children = [ctx.Process(target=child, args=(r, port, queue)) for r in range(2)]
    for c in children:
        c.start()
    results = sorted((queue.get(timeout=60) for _ in children), key=lambda r: r["rank"])
    for c in children:
        c.join(60)
    parent = None
    if hold:
        y = np.ones(2)
        dist.all_reduce(y)
        parent = float(y[0])
        dist.destroy_process_group()
    codes = [c.exitcode for c in children]
    print(json.dumps({"children": results, "codes": codes, "parent": parent}))


if __name__ == "__main__":
    main()
