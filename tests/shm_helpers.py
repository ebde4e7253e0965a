"""Helpers for the shared-memory tests: job keys, what a job left in /dev/shm, and worlds of
transports as tasks of one loop. (Worlds of processes: ``aiodist.testing``'s
``run_world_processes`` and ``start_world_processes``.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiodist.store import HashStore
from aiodist.transport._shm_segment import SHM_DIR, job_prefix
from aiodist.transport.shm import ShmTransport


def new_job() -> str:
    """A job key no other test (or person on this machine) uses."""
    return f"test-{uuid.uuid4().hex}"


def leftovers(job: str) -> list[str]:
    """The files in /dev/shm that belong to ``job``."""
    prefix = job_prefix(job)
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))


async def shm_world(n: int, job: str, **kwargs: Any) -> list[ShmTransport]:
    """``n`` connected ShmTransports as tasks of this loop, meeting through a HashStore."""
    store = HashStore()
    return list(
        await asyncio.gather(
            *(ShmTransport.create(store, r, n, timeout=10, job_key=job, **kwargs) for r in range(n))
        )
    )


@contextlib.asynccontextmanager
async def shm_transports(n: int, **kwargs: Any) -> AsyncIterator[list[ShmTransport]]:
    """:func:`shm_world` of a job of its own, closed at the end, which must leave nothing in
    /dev/shm."""
    job = new_job()
    transports = await shm_world(n, job, **kwargs)
    try:
        yield transports
    finally:
        for t in transports:
            await t.aclose()
    assert leftovers(job) == []
