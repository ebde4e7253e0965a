"""Flow control on the TCP and shared-memory transports: what a receiver stages for receives
not posted yet is bounded per peer, a message beyond the bound waits for its receive, and a
rendezvous that cannot complete is released (refused by the receiver, withdrawn by the
sender, or failed with a lost peer), never left waiting."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
from shm_helpers import leftovers, new_job, shm_world

import aiodist
import aiodist.sync as dist
from aiodist.store import HashStore
from aiodist.testing import run_world, run_world_processes, start_world_processes
from aiodist.transport.base import PeerDirectory, Transport
from aiodist.transport.tcp import TCPTransport

#: The staging bound of the transports made here; messages of BIG bytes go beyond it.
STAGING = 1 << 20
BIG = 4 << 20
T = (5, 1, 0)


def data(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, n, np.uint8)


async def until(check: Callable[[], bool], what: str, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


@pytest.fixture(params=["tcp", "shm"])
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[list[Transport]]:
    """Two connected transports of the given kind, staging at most ``STAGING`` bytes."""
    transports: list[Transport]
    job = None
    if request.param == "tcp":
        store = HashStore(timeout=10)
        transports = list(
            await asyncio.gather(
                *(
                    TCPTransport.create(
                        PeerDirectory(store), r, 2, timeout=10, staging_bytes=STAGING
                    )
                    for r in range(2)
                )
            )
        )
        # Connected both ways before a test starts: a send then never waits for a connect.
        await asyncio.gather(
            transports[0].send(1, (9, 9, 9), memoryview(b"")),
            transports[1].recv_into(0, (9, 9, 9), memoryview(bytearray())),
        )
    else:
        job = new_job()
        transports = list(await shm_world(2, job, staging_bytes=STAGING))
    try:
        yield transports
    finally:
        for t in transports:
            await t.aclose()
    if job is not None:
        assert leftovers(job) == []


# -- messages beyond the bound wait for their receive -------------------------------------------
async def test_a_large_message_waits_for_its_receive(pair: list[Transport]) -> None:
    t0, t1 = pair
    x = data(BIG, 1)
    send = t0.send(1, T, memoryview(x))
    await until(lambda: t1.mailbox.num_staged() == 1, "the announcement")
    await asyncio.sleep(0.05)
    assert not send.done()  # nothing of it is staged: it waits for the receive
    out = np.zeros(BIG, np.uint8)
    assert await t1.recv_into(0, T, memoryview(out)) == 0
    await send
    np.testing.assert_array_equal(out, x)
    assert t1.mailbox.num_staged() == 0


async def test_messages_within_the_bound_go_at_once_and_the_credit_comes_back(
    pair: list[Transport],
) -> None:
    t0, t1 = pair
    size = 400 << 10  # two fit in the 1 MiB bound, a third does not
    for round_ in range(3):
        xs = [data(size, 10 * round_ + i) for i in range(3)]
        sends = [t0.send(1, T, memoryview(x)) for x in xs]
        await until(lambda: t1.mailbox.num_staged() == 3, "three messages")
        await asyncio.gather(*sends[:2])  # staged by the receiver: done without receives
        await asyncio.sleep(0.05)
        assert not sends[2].done()
        for x in xs:
            out = np.zeros(size, np.uint8)
            await t1.recv_into(0, T, memoryview(out))
            np.testing.assert_array_equal(out, x)
        await sends[2]
        # Taking the staged messages gave their credit back: the next round goes at once.


async def test_a_small_message_after_a_large_one_is_not_held_up(pair: list[Transport]) -> None:
    """Rank 0 sends a large message tagged 1, then a small one tagged 2; rank 1 receives
    tag 2 first, then tag 1. The large one's receive cannot come first: it completes."""
    t0, t1 = pair
    big, small = data(BIG, 2), data(100, 3)
    sends = [t0.send(1, (5, 1, 0), memoryview(big)), t0.send(1, (5, 2, 0), memoryview(small))]
    out_small, out_big = np.zeros(100, np.uint8), np.zeros(BIG, np.uint8)
    assert await asyncio.wait_for(t1.recv_into(0, (5, 2, 0), memoryview(out_small)), 5) == 0
    assert await asyncio.wait_for(t1.recv_into(0, (5, 1, 0), memoryview(out_big)), 5) == 0
    await asyncio.wait_for(asyncio.gather(*sends), 5)
    np.testing.assert_array_equal(out_small, small)
    np.testing.assert_array_equal(out_big, big)


async def test_messages_of_one_tag_keep_their_order_across_both_ways(
    pair: list[Transport],
) -> None:
    t0, t1 = pair
    sizes = [BIG, 100, 600 << 10, BIG, 0, 700 << 10, 5]
    xs = [data(n, i) for i, n in enumerate(sizes)]
    sends = [t0.send(1, T, memoryview(x)) for x in xs]
    await asyncio.sleep(0.02)
    for x in xs:
        out = np.zeros(len(x), np.uint8)
        assert await asyncio.wait_for(t1.recv_into(0, T, memoryview(out)), 5) == 0
        np.testing.assert_array_equal(out, x)
    await asyncio.gather(*sends)


async def test_two_ranks_exchange_large_messages_both_ways(pair: list[Transport]) -> None:
    """Each rank's clearances travel while its own payloads stream the other way."""
    xs = [[data(BIG + 7 * i, 10 * r + i) for i in range(3)] for r in range(2)]
    outs = [[np.zeros(BIG + 7 * i, np.uint8) for i in range(3)] for _ in range(2)]
    futs: list[asyncio.Future[Any]] = []
    for r, t in enumerate(pair):
        for i in range(3):
            futs.append(t.send(1 - r, (5, i, 0), memoryview(xs[r][i])))
            futs.append(t.recv_into(1 - r, (5, i, 0), memoryview(outs[r][i])))
    await asyncio.wait_for(asyncio.gather(*futs), 20)
    for r in range(2):
        for i in range(3):
            np.testing.assert_array_equal(outs[r][i], xs[1 - r][i])


async def test_an_any_source_receive_takes_an_announced_message(pair: list[Transport]) -> None:
    t0, t1 = pair
    x = data(BIG, 4)
    send = t0.send(1, T, memoryview(x))
    await until(lambda: t1.mailbox.num_staged() == 1, "the announcement")
    out = np.zeros(BIG, np.uint8)
    assert await t1.recv_into(None, T, memoryview(out)) == 0
    await send
    np.testing.assert_array_equal(out, x)
    # Posted first, the any-source receive clears the announcement as it arrives.
    posted = t1.recv_into(None, T, memoryview(out))
    await t0.send(1, T, memoryview(x[::-1].copy()))
    assert await posted == 0
    np.testing.assert_array_equal(out, x[::-1])


# -- a rendezvous that cannot complete is released ----------------------------------------------
async def test_a_receive_of_another_size_refuses_the_message(pair: list[Transport]) -> None:
    t0, t1 = pair
    for posted_first in (True, False):
        send = t0.send(1, T, memoryview(data(BIG, 5)))
        if not posted_first:
            await until(lambda: t1.mailbox.num_staged() == 1, "the announcement")
        recv = t1.recv_into(0, T, memoryview(bytearray(16)))
        mismatch = (
            rf"size mismatch on tag \(5, 1, 0\) from rank 0: the receive expects 16 bytes, "
            rf"the message has {BIG} bytes"
        )
        with pytest.raises(aiodist.DistUsageError, match=mismatch):
            await recv
        with pytest.raises(
            aiodist.DistUsageError, match="rank 1 refused the message: message " + mismatch
        ):
            await asyncio.wait_for(send, 5)
    # The link stays in step.
    out = bytearray(5)
    recv = t1.recv_into(0, T, memoryview(out))
    await t0.send(1, T, memoryview(b"after"))
    assert await recv == 0 and out == b"after"


async def test_a_rejected_operation_refuses_its_announced_messages(pair: list[Transport]) -> None:
    t0, t1 = pair
    reason = aiodist.DistUsageError("rejected by rank 1: its output is read-only")
    # Announced before the operation is rejected, and after.
    first = t0.send(1, (6, 1, 0), memoryview(data(BIG, 6)))
    await until(lambda: t1.mailbox.num_staged() == 1, "the announcement")
    t1.mailbox.kill(6, 1, reason)
    later = t0.send(1, (6, 1, 3), memoryview(data(BIG, 7)))
    for send in (first, later):
        with pytest.raises(aiodist.DistUsageError, match="rank 1 refused the message: rejected"):
            await asyncio.wait_for(send, 5)
    assert t1.mailbox.num_staged() == 0
    # A receive of the operation fails with the rejection, as before.
    with pytest.raises(aiodist.DistUsageError, match="read-only"):
        await t1.recv_into(0, (6, 1, 0), memoryview(bytearray(BIG)))


async def test_a_rejection_drops_a_payload_on_its_way(pair: list[Transport]) -> None:
    t0, t1 = pair
    out = np.zeros(BIG, np.uint8)
    send = t0.send(1, (6, 2, 0), memoryview(np.full(BIG, 9, np.uint8)))
    await until(lambda: t1.mailbox.num_staged() == 1, "the announcement")
    recv = t1.recv_into(0, (6, 2, 0), memoryview(out))  # takes it: the payload may come
    t1.mailbox.kill(6, 2, aiodist.DistUsageError("rejected"))
    with pytest.raises(aiodist.DistUsageError, match="rejected"):
        await recv
    await asyncio.wait_for(send, 5)  # cleared before the rejection: it was sent
    after = np.zeros(BIG, np.uint8)
    recv = t1.recv_into(0, T, memoryview(after))
    await t0.send(1, T, memoryview(np.full(BIG, 4, np.uint8)))
    await recv
    assert (after == 4).all() and not out.any()  # the dropped payload reached no receive


async def test_a_send_given_up_fails_the_receive_that_takes_its_place(
    pair: list[Transport],
) -> None:
    t0, t1 = pair
    given_up = t0.send(1, T, memoryview(data(BIG, 8)))
    nxt = data(100, 9)
    after = t0.send(1, T, memoryview(nxt))
    await until(lambda: t1.mailbox.num_staged() == 2, "both messages")
    given_up.cancel()
    await asyncio.sleep(0.05)
    with pytest.raises(
        aiodist.DistUsageError,
        match=r"rank 0 withdrew its message tagged \(5, 1, 0\): its send was cancelled",
    ):
        await asyncio.wait_for(t1.recv_into(0, T, memoryview(bytearray(BIG))), 5)
    out = np.zeros(100, np.uint8)
    assert await t1.recv_into(0, T, memoryview(out)) == 0  # the order is kept
    await after
    np.testing.assert_array_equal(out, nxt)


async def test_a_cancelled_receive_leaves_the_message_to_the_next(pair: list[Transport]) -> None:
    t0, t1 = pair
    out = np.zeros(BIG, np.uint8)
    t1.recv_into(0, T, memoryview(out)).cancel()
    x = data(BIG, 10)
    send = t0.send(1, T, memoryview(x))
    await until(lambda: t1.mailbox.num_staged() == 1, "the announcement")
    assert not send.done()
    assert await t1.recv_into(0, T, memoryview(out)) == 0
    await send
    np.testing.assert_array_equal(out, x)


async def test_a_closed_receiver_fails_its_waiting_senders(pair: list[Transport]) -> None:
    t0, t1 = pair
    send = t0.send(1, T, memoryview(data(BIG, 11)))
    await until(lambda: t1.mailbox.num_staged() == 1, "the announcement")
    await t1.aclose("left the test")
    with pytest.raises(aiodist.DistNetworkError, match="lost connection to rank 1"):
        await asyncio.wait_for(send, 5)


async def test_a_bad_tag_on_an_open_link_is_a_usage_error(pair: list[Transport]) -> None:
    t0, t1 = pair
    for tag in [(0, 1, 2**64), (1, 2), 7, (1, "2", 3), ([1], 2, 3)]:
        with pytest.raises(aiodist.DistUsageError, match="tag must be three integers"):
            t0.send(1, tag, memoryview(data(BIG, 12)))  # type: ignore[arg-type]
    # Nothing of them went out: the next message is the first one rank 1 sees.
    out = bytearray(2)
    recv = t1.recv_into(0, T, memoryview(out))
    await t0.send(1, T, memoryview(b"ok"))
    assert await recv == 0 and out == b"ok" and t1.mailbox.num_staged() == 0


@pytest.mark.parametrize(
    ("env", "value", "message"),
    [
        (None, -1, r"staging_bytes must be a non-negative number of bytes, got -1"),
        (None, 1.5, r"staging_bytes must be a non-negative number of bytes, got 1.5"),
        ("16M", None, r"\$AIODIST_STAGING_BYTES='16M' is not a number of bytes"),
        ("-5", None, r"\$AIODIST_STAGING_BYTES must be a non-negative number of bytes, got -5"),
    ],
)
async def test_a_bad_staging_bound_is_a_usage_error(
    env: str | None, value: Any, message: str, monkeypatch: Any
) -> None:
    if env is not None:
        monkeypatch.setenv("AIODIST_STAGING_BYTES", env)
    with pytest.raises(aiodist.DistUsageError, match=message):
        await TCPTransport.create(PeerDirectory(HashStore()), 0, 1, staging_bytes=value)
    job = new_job()
    with pytest.raises(aiodist.DistUsageError, match=message):
        await shm_world(1, job, staging_bytes=value)
    assert leftovers(job) == []


# -- through the public API ---------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_tag_order_through_the_api(transport: Any) -> None:
    async def rank(r: int, n: int) -> None:
        if r == 0:
            big, small = np.arange(BIG // 8, dtype=np.float64), np.arange(3.0)
            works = [aiodist.isend(big, dst=1, tag=1), aiodist.isend(small, dst=1, tag=2)]
            for w in works:
                await w
            return
        small, big = np.zeros(3), np.zeros(BIG // 8)
        await aiodist.recv(small, src=0, tag=2)
        await aiodist.recv(big, src=0, tag=1)
        np.testing.assert_array_equal(small, np.arange(3.0))
        np.testing.assert_array_equal(big, np.arange(BIG // 8, dtype=np.float64))

    await run_world(rank, 2, transport=transport, timeout=20)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_everything_through_rendezvous(transport: Any, monkeypatch: Any) -> None:
    """With no staging at all, every message not cleared by a ready signal waits for its
    receive: the operations still give numpy's results, and a rejected one still fails
    alike on its ranks without holding up the next."""
    monkeypatch.setenv("AIODIST_STAGING_BYTES", "0")

    async def rank(r: int, n: int) -> None:
        for count in (3, 70_000, 600_000):
            x = np.full(count, float(r + 1))
            await aiodist.all_reduce(x)
            assert (x == n * (n + 1) / 2).all()
            b = np.arange(count, dtype=np.float64) if r == 0 else np.zeros(count)
            await aiodist.broadcast(b, src=0)
            np.testing.assert_array_equal(b, np.arange(count, dtype=np.float64))
            outs = [np.zeros(count) for _ in range(n)]
            await aiodist.all_to_all(outs, [np.full(count, float(10 * r + d)) for d in range(n)])
            for s in range(n):
                assert (outs[s] == 10 * s + r).all()
            if r == 0:
                await aiodist.send(np.full(count, 7.0), dst=1, tag=count)
            elif r == 1:
                y = np.zeros(count)
                assert await aiodist.recv(y, src=0, tag=count) == 0
                assert (y == 7.0).all()
        y = np.zeros(70_000)
        if r == 1:
            y.flags.writeable = False
        if r < 2:  # (rank 2 takes its data from rank 0 alone: it may be done before it hears)
            with pytest.raises(aiodist.DistUsageError, match=r"read-only|rejected by rank 1"):
                await aiodist.broadcast(y, src=0)
        else:
            with contextlib.suppress(aiodist.DistUsageError):
                await aiodist.broadcast(y, src=0)
        z = np.full(4, float(r))
        await aiodist.all_reduce(z)
        assert (z == n * (n - 1) / 2).all()

    await run_world(rank, 3, transport=transport, timeout=30)


# -- real processes: a receiver that is gone, and a flood -------------------------------------
async def _sender_losing_its_receiver(rank: int, size: int) -> tuple[str, str, float] | None:
    if rank == 1:
        await asyncio.sleep(1.0)  # rank 0's message is announced, no receive posted
        os.kill(os.getpid(), signal.SIGKILL)
    work = aiodist.isend(np.ones(16 << 20, np.uint8), dst=1)
    await asyncio.sleep(0.5)
    assert not work.is_completed()
    start = time.monotonic()
    try:
        await work
    except aiodist.DistError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return None


@pytest.mark.multiprocess
@pytest.mark.parametrize("shm", ["1", "0"], ids=["shm", "tcp"])
def test_a_sender_waiting_for_a_killed_receiver_fails_within_seconds(shm: str) -> None:
    env = {"AIODIST_SHM": shm, "AIODIST_STAGING_BYTES": str(STAGING)}
    with start_world_processes(_sender_losing_its_receiver, 2, timeout=30, env=env) as world:
        result = world.results(ranks=[0])[0]
    assert result is not None, "the send completed without its receiver"
    kind, text, waited = result
    assert kind == "DistNetworkError", result
    assert "rank 1" in text, result
    assert waited < 5, result


#: The flood: rank 0 sends FLOOD_COUNT messages of FLOOD_BYTES at once; rank 1 posts its
#: receives FLOOD_DELAY seconds later and may grow by less than FLOOD_GROWTH meanwhile.
FLOOD_COUNT, FLOOD_BYTES, FLOOD_DELAY, FLOOD_GROWTH = 64, 8 << 20, 1.5, 64 << 20


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) << 10
    raise AssertionError(f"no {field} in /proc/self/status")


def _peak_from_now() -> int:
    """Restart the peak resident size from the current one where the kernel allows;
    return the peak to measure growth from."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _vm("VmHWM")


async def _flood_async(rank: int, size: int) -> int | None:
    if rank == 0:
        xs = [np.full(FLOOD_BYTES, i, np.uint8) for i in range(FLOOD_COUNT)]
        works = [aiodist.isend(x, dst=1) for x in xs]
        for w in works:
            await w
        return None
    out = np.zeros(FLOOD_BYTES, np.uint8)
    baseline = _peak_from_now()
    await asyncio.sleep(FLOOD_DELAY)
    for i in range(FLOOD_COUNT):
        await aiodist.recv(out, src=0)
        assert out.min() == out.max() == i, i  # (no temporary array of 8 MiB)
    return _vm("VmHWM") - baseline


def _flood_sync(rank: int, size: int) -> int | None:
    if rank == 0:
        xs = [np.full(FLOOD_BYTES, i, np.uint8) for i in range(FLOOD_COUNT)]
        works = [dist.isend(x, dst=1) for x in xs]
        for w in works:
            w.wait()
        return None
    out = np.zeros(FLOOD_BYTES, np.uint8)
    baseline = _peak_from_now()
    time.sleep(FLOOD_DELAY)
    for i in range(FLOOD_COUNT):
        dist.recv(out, src=0)
        assert out.min() == out.max() == i, i  # (no temporary array of 8 MiB)
    return _vm("VmHWM") - baseline


@pytest.mark.multiprocess
@pytest.mark.parametrize("shm", ["1", "0"], ids=["shm", "tcp"])
@pytest.mark.parametrize("fn", [_flood_async, _flood_sync], ids=["async", "sync"])
def test_a_flood_of_sends_stays_bounded_at_the_receiver(fn: Any, shm: str) -> None:
    """Rank 0 isends 64 arrays of 8 MiB before rank 1 posts a receive: rank 1's peak
    resident memory grows by less than 64 MiB (it grew by the whole 512 MiB when every
    message was staged), and every message arrives, in order."""
    _, growth = run_world_processes(fn, 2, timeout=60, env={"AIODIST_SHM": shm})
    print(f"the receiver grew by {growth / 2**20:.1f} MiB")
    assert growth < FLOOD_GROWTH, f"the receiver grew by {growth / 2**20:.0f} MiB"
