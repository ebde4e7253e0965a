"""A rank of a job whose store is in etcd, for tests/test_store_etcd.py.

``python etcd_worker.py lease URL RANK``: join a world of two through ``URL`` and print
``ready``; rank 0 then waits for the world to break and prints why and after how long, rank 1
sleeps (the test stops or kills it).

``python etcd_worker.py job``: under ``aiodist-run``, join the job's world through ``env://``
(the etcd store the launcher names) and print the sum of every rank's ``rank + 1``.
"""

from __future__ import annotations

import asyncio
import sys
import time

import numpy as np


async def lease(url: str, rank: int) -> None:
    import aiodist

    pg = await aiodist.init_process_group("cpu", init_method=url, rank=rank, world_size=2)
    print("ready", flush=True)
    if rank == 1:
        await asyncio.sleep(120)
        return
    start = time.monotonic()
    cause = await asyncio.wait_for(pg.wait_aborted(), 60)
    print(f"broken after {time.monotonic() - start:.1f} s: {cause}", flush=True)


def job() -> None:
    import os

    import aiodist.sync as dist

    dist.init_process_group("gloo")
    x = np.array([dist.get_rank() + 1.0])
    dist.all_reduce(x)
    print(f"sum {x[0]:g} store {os.environ['AIODIST_STORE_URL']}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "lease":
        asyncio.run(lease(sys.argv[2], int(sys.argv[3])))
    else:
        job()
