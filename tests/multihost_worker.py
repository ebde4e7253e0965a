"""One rank on one "host" (network namespace): ``multihost_worker.py MODE RANK ADDR PORT [N]``.

Modes (each with no aiodist variable in the environment):
    tcp     ``init_process_group(init_method="tcp://ADDR:PORT", rank=RANK, world_size=2)``
    env     ``init_process_group()`` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set
    store   rank 0 hosts a TCPStore at ADDR:PORT, both pass it as ``store=``

Then an all_reduce; prints one JSON line: the result and the address this rank listens on.

Mode ``mixed`` is ``tcp`` in a world of ``N`` ranks, two per host: ranks of one host talk
through shared memory, the others over TCP. It runs a collective of each shape and a ring of
sends across hosts, and prints the results with the ranks this one shares memory with.

Mode ``shrink`` is ``tcp`` in a world of ``N`` ranks, two per host, whose last rank kills
itself after a first all_reduce; the others shrink the world without it and all_reduce again.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import numpy as np

import aiodist

mode, rank, addr, port = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
world_size = int(sys.argv[5]) if len(sys.argv) > 5 else 2


async def mixed() -> dict[str, object]:
    n = world_size
    x = np.arange(6.0) * (rank + 1)
    await aiodist.all_reduce(x)
    gathered = [np.empty(2) for _ in range(n)]
    await aiodist.all_gather(gathered, np.full(2, float(rank)))
    b = np.full(3, float(rank))
    await aiodist.broadcast(b, src=n - 1)
    out = np.empty(n)
    await aiodist.all_to_all_single(out, np.arange(n, dtype=float) + 10 * rank)
    ring = np.empty(2)
    send = aiodist.isend(np.full(2, float(rank)), (rank + 1) % n)
    await aiodist.recv(ring, (rank - 1) % n)
    await send
    transport = aiodist.group.current_world().transport
    return {
        "sum": x.tolist(),
        "gathered": [g.tolist() for g in gathered],
        "broadcast": b.tolist(),
        "all_to_all": out.tolist(),
        "ring": ring.tolist(),
        "shared_memory_with": list(getattr(transport, "local_ranks", [rank])),
    }


async def shrink() -> dict[str, object]:
    await aiodist.all_reduce(np.ones(4))
    if rank == world_size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    with_all = np.ones(4)
    try:
        while True:  # until the loss is noticed
            await aiodist.all_reduce(with_all)
    except aiodist.DistNetworkError:
        pass
    lost = await aiodist.lost_ranks()
    await aiodist.shrink_group(lost)
    x = np.arange(4.0) * (rank + 1)
    await aiodist.all_reduce(x)
    transport = aiodist.group.current_world().transport
    return {
        "lost": lost,
        "now": [aiodist.get_rank(), aiodist.get_world_size()],
        "sum": x.tolist(),
        "shared_memory_with": list(getattr(transport, "local_ranks", [aiodist.get_rank()])),
    }


async def main() -> None:
    host = f"[{addr}]" if ":" in addr else addr
    if mode in ("tcp", "mixed", "shrink"):
        await aiodist.init_process_group(
            init_method=f"tcp://{host}:{port}", rank=rank, world_size=world_size, timeout=30
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
    if mode == "mixed":
        result = await mixed()
    elif mode == "shrink":
        result = await shrink()
    else:
        x = np.full(4, rank + 1.0)
        await aiodist.all_reduce(x)
        listening = aiodist.group.current_world().transport.address[0]
        result = {"sum": x.tolist(), "listening": listening}
    await aiodist.destroy_process_group()
    if store is not None:
        await store.aclose()
    print(json.dumps({"rank": rank, **result}), flush=True)


asyncio.run(main())
