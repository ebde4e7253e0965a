"""One rank of a liveness scenario: ``vanish_worker.py SCENARIO RANK ADDR PORT HOST_RANK``.

The store is hosted by rank HOST_RANK at ADDR:PORT (``store=``, no other variable). After a
first all_reduce every rank prints ``ready``; then:

    wait      rank 0 waits in an all_reduce, the others sleep: the test takes a link down
    busy      rank 1 holds the GIL in pure Python for BUSY seconds before its all_reduce
    stopped   rank 1 is stopped by the test (SIGSTOP) for a while, then all_reduce
    unread    rank 0 sends rank 1 8 MiB (more than the kernels' buffers hold), then
              all_reduce; rank 1 holds the GIL for BUSY seconds first (so nothing reads
              rank 0's data: rank 0 sees a closed window), then receives it and all_reduces
    stream    rank 0 sends rank 1 1 MiB messages until one fails (data of its own is always
              unacknowledged), rank 1 receives them: the test takes a link down

With STORE_PEER_TIMEOUT set, the store's connections use that peer timeout (the lease of a
vanished rank then tells nobody sooner than it): the ranks' own connections must notice.

Events are JSON lines: ``ready``, ``aborted`` (when the group learns of a failure, with the
cause), ``done`` (the all_reduce completed), ``error`` (what it raised: type, msg); ``t`` is
``time.time()``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import numpy as np

import aiodist

scenario, rank, addr, port, host_rank = (
    sys.argv[1],
    int(sys.argv[2]),
    sys.argv[3],
    int(sys.argv[4]),
    int(sys.argv[5]),
)
BUSY = float(os.environ.get("VANISH_BUSY", "12"))


def emit(event: str, **extra: object) -> None:
    print(json.dumps({"rank": rank, "event": event, "t": time.time(), **extra}), flush=True)


def spin(seconds: float) -> int:
    # Pure Python: holds the GIL the whole time, so no thread of this process runs.
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        n += 1
    return n


async def main() -> None:
    store_peer = os.environ.get("STORE_PEER_TIMEOUT")
    store = await aiodist.TCPStore.create(
        addr,
        port,
        world_size=2,
        is_master=rank == host_rank,
        timeout=60,
        peer_timeout=None if store_peer is None else float(store_peer),
    )
    await aiodist.init_process_group(store=store, rank=rank, world_size=2, timeout=120)
    x = np.ones(4)
    await aiodist.all_reduce(x)

    async def watch() -> None:
        cause = await aiodist.group.resolve_group(None, "watch").wait_aborted()
        emit("aborted", msg=str(cause))

    watcher = asyncio.ensure_future(watch())
    emit("ready")
    try:
        if scenario == "wait" and rank != 0:
            await asyncio.sleep(60)
        if scenario == "busy" and rank == 1:
            spin(BUSY)
        if scenario == "unread":
            data = np.arange(1 << 20, dtype=np.float64)  # 8 MiB
            if rank == 0:
                await aiodist.send(data, 1)
            else:
                spin(BUSY)
                got = np.zeros_like(data)
                await aiodist.recv(got, 0)
                assert np.array_equal(got, data)
        if scenario == "stream":
            chunk = np.ones(1 << 17)  # 1 MiB
            for _ in range(1 << 30):
                await (aiodist.send(chunk, 1) if rank == 0 else aiodist.recv(chunk, 0))
        await aiodist.all_reduce(x)
        emit("done", value=float(x[0]))
    except aiodist.DistError as exc:
        emit("error", type=type(exc).__name__, msg=str(exc))
    await asyncio.sleep(0.2)  # an abort learned meanwhile is reported
    watcher.cancel()
    os._exit(0)  # the group may be broken; nothing to tidy for these scenarios


asyncio.run(main())
