"""Every transport passes the transport contract (``tests/transport_kit.py``), on both loops:
TCP, shared memory, shared memory and TCP behind one router, and the in-process one."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from transport_kit import CHECKS, Check, World

from aiodist.store import HashStore
from aiodist.transport._mailbox import Mailbox
from aiodist.transport.base import PeerDirectory, Transport
from aiodist.transport.local import LocalTransport
from aiodist.transport.routed import RoutedTransport
from aiodist.transport.shm import ShmTransport
from aiodist.transport.tcp import TCPTransport

pytestmark = pytest.mark.both_loops
N = 3


async def _tcp() -> World:
    store = HashStore()
    made = await asyncio.gather(
        *(TCPTransport.create(PeerDirectory(store), r, N, timeout=10) for r in range(N))
    )
    return list(made)


async def _shm() -> World:
    store, job = HashStore(), uuid.uuid4().hex
    made = await asyncio.gather(
        *(ShmTransport.create(store, r, N, timeout=10, job_key=job) for r in range(N))
    )
    return list(made)


async def _routed() -> World:
    # Ranks 0 and 1 share memory and reach rank 2 over TCP.
    store, job = HashStore(), uuid.uuid4().hex

    async def make(rank: int) -> Transport:
        mailbox = Mailbox(rank, N)
        tcp = await TCPTransport.create(PeerDirectory(store), rank, N, timeout=10, mailbox=mailbox)
        if rank == 2:
            return tcp
        shm = await ShmTransport.create(store, rank, N, [0, 1], mailbox=mailbox, job_key=job)
        return RoutedTransport(tcp, shm)

    return list(await asyncio.gather(*(make(r) for r in range(N))))


async def _local() -> World:
    return list(LocalTransport.create_world(N))


WORLDS = {"tcp": _tcp, "shm": _shm, "routed": _routed, "local": _local}


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("kind", list(WORLDS))
async def test_transport_contract(kind: str, check: Check) -> None:
    world = await WORLDS[kind]()
    try:
        await asyncio.wait_for(check(world), 30)
    finally:
        await asyncio.gather(*(t.aclose() for t in world))
