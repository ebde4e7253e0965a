"""One rank of an exit scenario of ``tests/test_exits.py``, with the blocking API, as a script.

Usage: ``python exit_worker.py SCENARIO RANK WORLD PORT [MASTER]``. Ranks join through
``tcp://MASTER:PORT`` (default ``127.0.0.1``; rank 0 hosts the store) and print one JSON
object per line for the test; none calls ``destroy_process_group()``:

    sent_then_gone   rank 1 sends 64 KiB to rank 0 and ends with ``os._exit(0)`` (no
                     goodbye); rank 0 receives it afterwards, then reports the group's state
                     and what a second receive from rank 1 raises
    sent_then_exit   the same, rank 1 ending normally (3 ranks); then ranks 0 and 2 run an
                     all_reduce on a group of their own
    raise            rank 1 raises after an all_reduce; ranks 0 and 2 wait to receive from it
    host_first       rank 0 (the store's host) ends at once; ranks 1 and 2 run an all_reduce
                     a second later, on a group made before
    barrier_gone     rank 1 arrives last at a barrier, then runs a 32 MiB all_reduce and
                     ends with ``os._exit(0)`` the moment its part is done, while rank 0 may
                     still be copying its result out
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import aiodist.sync as dist

scenario, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
master = sys.argv[5] if len(sys.argv) > 5 else "127.0.0.1"


def emit(event: str, **extra: object) -> None:
    """Print one event line for the test."""
    print(json.dumps({"rank": rank, "event": event, "t": time.time(), **extra}), flush=True)


def error(exc: BaseException) -> dict[str, str]:
    return {"type": type(exc).__name__, "msg": str(exc)}


dist.init_process_group("gloo", f"tcp://{master}:{port}", rank=rank, world_size=world, timeout=30)
payload = np.arange(8192, dtype=np.float64)  # 64 KiB

if scenario in ("sent_then_gone", "sent_then_exit"):
    pair = dist.new_group([0, 2]) if world == 3 else None
    if rank == 1:
        dist.send(payload, dst=0)
        emit("sent")
        if scenario == "sent_then_gone":
            os._exit(0)
    elif rank == 0:
        time.sleep(0.5)  # rank 1 has gone by now
        got = np.zeros_like(payload)
        dist.recv(got, src=1)
        emit("received", ok=bool((got == payload).all()))
        world_group = dist.group.WORLD
        assert world_group is not None
        emit("state", aborted=world_group.is_aborted(), cause=str(world_group.world.broken))
        try:
            dist.recv(got, src=1)
        except Exception as exc:
            emit("second", **error(exc))
    if pair is not None and rank != 1:
        x = np.array([rank + 1.0])
        dist.all_reduce(x, group=pair)
        emit("pair", value=float(x[0]))
elif scenario == "raise":
    x = np.ones(4)
    dist.all_reduce(x)
    if rank == 1:
        raise ValueError("boom")
    start = time.monotonic()
    try:
        dist.recv(x, src=1)
    except Exception as exc:
        emit("error", waited=time.monotonic() - start, **error(exc))
elif scenario == "host_first":
    pair = dist.new_group([1, 2])
    if rank != 0:
        time.sleep(1.0)
        x = np.array([float(rank)])
        dist.all_reduce(x, group=pair)
        dist.barrier(group=pair)
        emit("pair", value=float(x[0]))
elif scenario == "barrier_gone":
    if rank == 1:
        time.sleep(0.3)
    dist.barrier()
    big = np.full(8 << 20, rank + 1.0, dtype=np.float32)
    dist.all_reduce(big)
    if rank == 1:
        os._exit(0)
    emit("passed", ok=bool((big == 3.0).all()))
emit("end")
