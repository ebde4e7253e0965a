"""One rank of a fault scenario: ``fault_worker.py LIB MODE RANK WORLD HOST PORT [TIMEOUT]``.

``LIB`` is ``aiodist`` (async API, or ``aiodist-sync`` for the blocking facade) or ``torch``
(gloo). The store at ``HOST:PORT`` is hosted by the caller (a test, the benchmark or a
store process it can kill). Every event is printed as one JSON line on stdout:
``{"rank", "event", "t"}`` plus ``type``/``msg`` for errors; ``t`` is ``time.time()`` so the
caller can compare it with the moment it injected the fault.

Modes:
    loop        all_reduce of 4096 float32 forever (``looping`` after the first 3)
    straggler   rank WORLD-1 never calls all_reduce; the others call it once
    storewait   ``ready``, then wait on a store key that never appears, then all_reduce
    recover     (aiodist, aiodist-sync) the straggler scenario, then destroy, init again and
                check one all_reduce (``recovered`` with the result)
    store       host the store (``aiodist`` or ``torch`` server) for WORLD ranks at HOST on a
                free port, print ``{"event": "store", "port": P}`` and serve until killed
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

import numpy as np

lib, mode = sys.argv[1], sys.argv[2]
rank, world = int(sys.argv[3]), int(sys.argv[4])
host, port_n = sys.argv[5], int(sys.argv[6])
timeout = float(sys.argv[7]) if len(sys.argv) > 7 else 30.0


def emit(event: str, **extra: Any) -> None:
    """Print one event line for the caller."""
    print(json.dumps({"rank": rank, "event": event, "t": time.time(), **extra}), flush=True)


def emit_error(exc: BaseException) -> None:
    """Report ``exc`` (its type and message)."""
    emit("error", type=type(exc).__name__, msg=str(exc))


async def run_aiodist() -> None:
    """The scenario on the async API."""
    import aiodist
    from aiodist.store import TCPStore

    store = await TCPStore.create(host, port_n, timeout=timeout)
    await aiodist.init_process_group(
        "cpu", store=store, rank=rank, world_size=world, timeout=timeout
    )
    x = np.ones(4096, np.float32)
    try:
        if mode == "loop":
            n = 0
            while True:
                await aiodist.all_reduce(x)
                n += 1
                if n == 3:
                    emit("looping")
        elif mode in ("straggler", "recover"):
            emit("ready")
            if rank == world - 1:
                await asyncio.sleep(timeout + 2)
                await aiodist.all_reduce(x)  # the group was aborted meanwhile
            else:
                await aiodist.all_reduce(x)
        elif mode == "storewait":
            emit("ready")
            await store.get("never-set")
    except Exception as exc:
        emit_error(exc)
        if mode == "storewait":
            try:
                await aiodist.all_reduce(x)
            except Exception as later:
                emit("later", type=type(later).__name__, msg=str(later))
    if mode == "recover":
        await aiodist.destroy_process_group()
        await aiodist.init_process_group(
            "cpu", store=store, rank=rank, world_size=world, timeout=30
        )
        y = np.full(8, rank + 1, np.float32)
        await aiodist.all_reduce(y)
        emit("recovered", value=float(y[0]))
    await aiodist.destroy_process_group()
    await store.aclose()


def run_sync() -> None:
    """The recover scenario on the blocking facade."""
    import aiodist.sync as dist

    store = dist.TCPStore(host, port_n, timeout=timedelta(seconds=timeout))
    dist.init_process_group("cpu", store=store, rank=rank, world_size=world, timeout=timeout)
    x = np.ones(4096, np.float32)
    emit("ready")
    try:
        if rank == world - 1:
            time.sleep(timeout + 2)
        dist.all_reduce(x)
    except Exception as exc:
        emit_error(exc)
    dist.destroy_process_group()
    dist.init_process_group("cpu", store=store, rank=rank, world_size=world, timeout=30)
    y = np.full(8, rank + 1, np.float32)
    dist.all_reduce(y)
    emit("recovered", value=float(y[0]))
    dist.destroy_process_group()


def run_torch() -> None:
    """The scenario on torch.distributed with gloo."""
    import torch
    import torch.distributed as dist

    store = dist.TCPStore(host, port_n, world, False, timedelta(seconds=timeout))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout)
    )
    x = torch.ones(4096)
    try:
        if mode == "loop":
            n = 0
            while True:
                dist.all_reduce(x)
                n += 1
                if n == 3:
                    emit("looping")
        elif mode == "straggler":
            emit("ready")
            if rank == world - 1:
                time.sleep(timeout + 3)
            dist.all_reduce(x)
        elif mode == "storewait":
            emit("ready")
            store.get("never-set")
    except Exception as exc:
        emit_error(exc)


async def serve_aiodist_store() -> None:
    """Host an aiodist TCPStore until killed."""
    from aiodist.store import TCPStore

    store = await TCPStore.create(host, 0, is_master=True, wait_for_workers=False)
    emit("store", port=store.port)
    await asyncio.Event().wait()


def serve_torch_store() -> None:
    """Host torch's TCPStore until killed."""
    import torch.distributed as dist

    store = dist.TCPStore(host, 0, world, True, timedelta(seconds=300), wait_for_workers=False)
    emit("store", port=store.port)
    time.sleep(10**6)


def main() -> None:
    """Run the scenario and report anything that escapes it."""
    if mode == "store":
        if lib == "torch":
            serve_torch_store()
        else:
            asyncio.run(serve_aiodist_store())
        return
    try:
        if lib == "torch":
            run_torch()
        elif lib == "aiodist-sync":
            run_sync()
        else:
            from aiodist._util._loop import loop_factory

            with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
                runner.run(run_aiodist())
    except Exception as exc:
        emit("fatal", type=type(exc).__name__, msg=str(exc), tb=traceback.format_exc())
    emit("exit")


if __name__ == "__main__":
    main()
