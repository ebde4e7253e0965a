"""One rank on one "host" (network namespace): ``multihost_worker.py MODE RANK ADDR PORT``.

Modes (each with no aiodist variable in the environment):
    tcp     ``init_process_group(init_method="tcp://ADDR:PORT", rank=RANK, world_size=2)``
    env     ``init_process_group()`` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set
    store   rank 0 hosts a TCPStore at ADDR:PORT, both pass it as ``store=``

Then an all_reduce; prints one JSON line: the result and the address this rank listens on.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import numpy as np

import aiodist

mode, rank, addr, port = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])


async def main() -> None:
    host = f"[{addr}]" if ":" in addr else addr
    if mode == "tcp":
        await aiodist.init_process_group(
            init_method=f"tcp://{host}:{port}", rank=rank, world_size=2, timeout=30
        )
        store = None
    elif mode == "env":
        os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR=addr, MASTER_PORT=str(port))
        await aiodist.init_process_group(timeout=30)
        store = None
    else:
        store = await aiodist.TCPStore.create(
            addr, port, world_size=2, is_master=rank == 0, timeout=30
        )
        await aiodist.init_process_group(store=store, rank=rank, world_size=2, timeout=30)
    x = np.full(4, rank + 1.0)
    await aiodist.all_reduce(x)
    listening = aiodist.group.current_world().transport.address[0]
    await aiodist.destroy_process_group()
    if store is not None:
        await store.aclose()
    print(json.dumps({"rank": rank, "sum": x.tolist(), "listening": listening}), flush=True)


asyncio.run(main())
