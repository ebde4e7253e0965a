"""The single-copy path of large messages between ranks of one host: a message beyond the
receiver's staging bound is copied straight from the sender's memory into the receive
(``process_vm_readv``), is delivered only once the sender vouched it kept the memory
unchanged meanwhile, and goes through the ring whenever the copy cannot be made."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from shm_helpers import shm_transports

import aiodist
from aiodist.testing import run_world_processes
from aiodist.transport import _shm_link, _shm_pull
from aiodist.transport._flow import PeerFlow
from aiodist.transport._frames import MAX_MESSAGE
from aiodist.transport.shm import ShmTransport

pytestmark = pytest.mark.skipif(not _shm_pull.AVAILABLE, reason="needs process_vm_readv")

#: The staging bound of the transports made here; messages of BIG bytes go beyond it.
STAGING = 1 << 20
BIG = (4 << 20) + 12345  # several PULL_STEPs' worth, and not a round number
T = (5, 1, 0)


def data(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, n, np.uint8)


@pytest.fixture
async def pair() -> AsyncIterator[list[ShmTransport]]:
    async with shm_transports(2, staging_bytes=STAGING) as transports:
        yield transports


async def exchange(t0: ShmTransport, t1: ShmTransport, seed: int) -> None:
    sent = data(BIG, seed)
    out = np.zeros(BIG, np.uint8)
    recv = t1.recv_into(0, T, memoryview(out))
    await asyncio.wait_for(asyncio.gather(t0.send(1, T, memoryview(sent)), recv), 10)
    assert np.array_equal(out, sent)


async def test_a_message_beyond_the_bound_is_copied_once_from_the_senders_memory(
    pair: list[ShmTransport],
) -> None:
    t0, t1 = pair
    await exchange(t0, t1, 1)
    assert t1.pulled_bytes == BIG
    # Announced before its receive is posted, too.
    sent, out = data(BIG, 2), np.zeros(BIG, np.uint8)
    send = t0.send(1, T, memoryview(sent))
    await asyncio.sleep(0.05)
    await asyncio.wait_for(asyncio.gather(send, t1.recv_into(0, T, memoryview(out))), 10)
    assert np.array_equal(out, sent)
    assert t1.pulled_bytes == 2 * BIG and t0.pulled_bytes == 0


async def test_with_aiodist_shm_pull_0_messages_come_through_the_ring(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(_shm_pull.PULL_ENV, "0")
    async with shm_transports(2, staging_bytes=STAGING) as (t0, t1):
        await exchange(t0, t1, 3)
        assert t1.pulled_bytes == 0


async def test_a_peer_whose_memory_cannot_be_read_sends_through_the_ring(
    pair: list[ShmTransport], monkeypatch: pytest.MonkeyPatch
) -> None:
    t0, t1 = pair
    refusals = []

    def refused(pid: int, address: int, dest: int, nbytes: int) -> None:
        refusals.append(pid)
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(_shm_link, "read_memory", refused)
    await exchange(t0, t1, 4)
    await exchange(t0, t1, 5)
    # Asked once: the link then clears the peer's messages as without an offer.
    assert len(refusals) == 1 and t1.pulled_bytes == 0


#: A payload the credit covers that is offered all the same (above the eager limit).
CREDITED = _shm_link.OFFERED_ABOVE * 3 + 4321


async def test_a_payload_above_the_eager_limit_within_the_credit_is_copied_once() -> None:
    # Into its receive when one is posted; else into a staging buffer at once, so the send
    # completes before any receive, as an eager send does; at the limit, eagerly.
    async with shm_transports(2) as (t0, t1):
        sent, out = data(CREDITED, 20), np.zeros(CREDITED, np.uint8)
        recv = t1.recv_into(0, T, memoryview(out))
        await asyncio.wait_for(asyncio.gather(t0.send(1, T, memoryview(sent)), recv), 10)
        assert np.array_equal(out, sent) and t1.pulled_bytes == CREDITED

        sent, out = data(CREDITED, 21), np.zeros(CREDITED, np.uint8)
        await asyncio.wait_for(t0.send(1, T, memoryview(sent)), 10)
        expected = sent.copy()
        sent[:] = 0  # the caller may reuse its memory once the send completed
        assert t1.mailbox.num_staged() == 1
        await asyncio.wait_for(t1.recv_into(0, T, memoryview(out)), 10)
        assert np.array_equal(out, expected) and t1.pulled_bytes == 2 * CREDITED

        at = _shm_link.OFFERED_ABOVE
        sent, out = data(at, 22), np.zeros(at, np.uint8)
        await asyncio.wait_for(t0.send(1, T, memoryview(sent)), 10)
        await asyncio.wait_for(t1.recv_into(0, T, memoryview(out)), 10)
        assert np.array_equal(out, sent) and t1.pulled_bytes == 2 * CREDITED
        # Nothing is staged or held: the sender's credit and what the receiver has yet to
        # give back (in batches) make up the whole bound.
        await asyncio.sleep(0.05)
        sender, receiver = t0._by_peer[1].flow, t1._by_peer[0].flow
        assert t1.mailbox.num_staged() == 0 and receiver._staged == 0
        assert sender.credit + receiver._received - receiver._returned == receiver.limit


async def test_a_staged_credited_payload_goes_to_a_receive_posted_while_it_is_copied() -> None:
    async with shm_transports(2) as (t0, t1):
        sent, out = data(CREDITED, 23), np.zeros(CREDITED, np.uint8)
        send = t0.send(1, T, memoryview(sent))
        while not t1.mailbox.num_staged():  # announced, staged, its copy asked for
            await asyncio.sleep(0)
        recv = t1.recv_into(0, T, memoryview(out))
        await asyncio.wait_for(asyncio.gather(send, recv), 10)
        assert np.array_equal(out, sent) and t1.pulled_bytes == CREDITED


async def test_a_cancelled_credited_send_fails_the_receive_that_takes_it_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Cancelled between the copy into staging and the sender's word: the copy may hold
    # bytes the caller wrote afterwards, so it is never delivered; the next message is.
    async with shm_transports(2) as (t0, t1):
        sent = data(CREDITED, 24)
        send = t0.send(1, T, memoryview(sent))
        took = PeerFlow.took

        def cancel_first(flow: PeerFlow, ticket: int, *, wanted: bool = True) -> None:
            send.cancel()
            sent[:] = 0
            took(flow, ticket, wanted=wanted)

        monkeypatch.setattr(PeerFlow, "took", cancel_first)
        with pytest.raises(asyncio.CancelledError):
            await send
        monkeypatch.undo()
        after = data(100, 25)
        await asyncio.wait_for(t0.send(1, T, memoryview(after)), 10)
        out = np.zeros(CREDITED, np.uint8)
        with pytest.raises(
            aiodist.DistUsageError,
            match=r"rank 0 withdrew its message tagged \(5, 1, 0\): its send was cancelled",
        ):
            await asyncio.wait_for(t1.recv_into(0, T, memoryview(out)), 10)
        assert not out.any()
        small = np.zeros(100, np.uint8)
        await asyncio.wait_for(t1.recv_into(0, T, memoryview(small)), 10)
        assert np.array_equal(small, after)
        assert t1.mailbox.num_staged() == 0


async def test_a_peer_that_cannot_read_gets_payloads_within_the_credit_eagerly_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refused(pid: int, address: int, dest: int, nbytes: int) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(_shm_link, "read_memory", refused)
    async with shm_transports(2) as (t0, t1):
        for seed in (26, 27):  # offered, refused and sent through the ring; then eagerly
            sent, out = data(CREDITED, seed), np.zeros(CREDITED, np.uint8)
            await asyncio.wait_for(t0.send(1, T, memoryview(sent)), 10)
            await asyncio.wait_for(t1.recv_into(0, T, memoryview(out)), 10)
            assert np.array_equal(out, sent) and t1.pulled_bytes == 0
        assert t0._by_peer[1].flow.eager_limit == MAX_MESSAGE


async def test_an_offer_that_cannot_be_read_once_comes_through_the_ring(
    pair: list[ShmTransport], monkeypatch: pytest.MonkeyPatch
) -> None:
    t0, t1 = pair
    real = _shm_link.read_memory
    calls = []

    def unmapped_once(pid: int, address: int, dest: int, nbytes: int) -> None:
        calls.append(nbytes)
        if len(calls) == 2:  # part-way through the payload
            raise OSError(errno.EFAULT, "Bad address")
        real(pid, address, dest, nbytes)

    monkeypatch.setattr(_shm_link, "read_memory", unmapped_once)
    await exchange(t0, t1, 6)  # the whole payload through the ring, over the partial copy
    await exchange(t0, t1, 7)  # and the next one copied again
    assert t1.pulled_bytes == _shm_link.PULL_STEP + BIG


async def test_a_send_that_ends_while_its_payload_is_copied_fails_the_receive(
    pair: list[ShmTransport], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sender's caller may write the memory once its send ended: a copy made meanwhile
    # is never delivered, the receive fails naming the withdrawal, and nothing is left.
    t0, t1 = pair
    sent, out = data(BIG, 8), np.zeros(BIG, np.uint8)
    send = t0.send(1, T, memoryview(sent))
    took = PeerFlow.took

    def cancel_first(flow: PeerFlow, ticket: int) -> None:
        send.cancel()
        sent[:] = 0  # the caller reuses its memory
        took(flow, ticket)

    monkeypatch.setattr(PeerFlow, "took", cancel_first)
    with pytest.raises(
        aiodist.DistUsageError,
        match=r"rank 0 withdrew its message tagged \(5, 1, 0\): its send was cancelled",
    ):
        await asyncio.wait_for(t1.recv_into(0, T, memoryview(out)), 10)
    monkeypatch.undo()
    assert t1.mailbox.num_staged() == 0 and not t1._by_peer[0].flow._taken
    await exchange(t0, t1, 9)  # the link goes on


async def test_a_receive_that_fails_before_the_copy_is_never_written_and_the_send_ends(
    pair: list[ShmTransport],
) -> None:
    t0, t1 = pair
    out = np.zeros(BIG, np.uint8)
    send = t0.send(1, (6, 2, 0), memoryview(data(BIG, 10)))
    await asyncio.sleep(0.05)  # announced
    recv = t1.recv_into(0, (6, 2, 0), memoryview(out))  # takes it: the copy comes next turn
    t1.mailbox.kill(6, 2, aiodist.DistUsageError("rejected"))
    with pytest.raises(aiodist.DistUsageError, match="rejected"):
        await recv
    await asyncio.wait_for(send, 5)  # taken before the rejection: it was sent
    assert not out.any() and t1.pulled_bytes == 0
    assert not t1._by_peer[0].flow._taken  # nothing waits for the sender's word
    await exchange(t0, t1, 11)


def _ring_of_large_messages(rank: int, size: int) -> tuple[list[bool], bool]:
    import aiodist.sync as dist

    n = (20 << 20) // 8  # beyond the default staging bound (16 MiB)
    ok = []
    for step in range(3):
        x = np.arange(n, dtype=np.float64) * (rank + 1) + step
        out = np.zeros(n)
        nxt, prv = (rank + 1) % size, (rank - 1) % size
        works = [dist.isend(x, nxt), dist.irecv(out, prv)]
        for w in works:
            w.wait()
        ok.append(np.array_equal(out, np.arange(n, dtype=np.float64) * (prv + 1) + step))
    world = aiodist.group.peek_world()
    assert world is not None
    transport = getattr(world.transport, "shm", world.transport)  # (routed: its local part)
    return ok, transport.pulled_bytes >= 3 * n * 8  # every message copied from its sender


@pytest.mark.multiprocess
@pytest.mark.parametrize("size", [2, 3, 4])
def test_ranks_in_a_ring_exchange_large_messages_copied_once(size: int) -> None:
    results: list[Any] = run_world_processes(_ring_of_large_messages, size, timeout=120)
    assert results == [([True, True, True], True)] * size
