"""The transport contract, as checks any transport must pass (like the stores' ``check_store``).

Each check gets a fresh world of three connected transports (global ranks 0, 1, 2) and
exercises what ``aiodist.transport.base.Transport`` promises: per-``(peer, tag)`` order,
any-source receives, zero-size and large messages, sending to oneself, length mismatches,
usage errors, rejections, an orderly close (a goodbye with its reason, messages sent before
it still delivered), an abort (a failure, no departure; passed on, it names the first failure) and a peer the store says is gone
(what it sent is still taken). ``test_transport_conformance.py``
runs every check against the TCP, shared-memory, routed and in-process transports.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import numpy as np
import pytest

import aiodist
from aiodist.transport.base import Departure, Transport, departure_of, lost_peer_error

World = list[Transport]
Check = Callable[[World], Awaitable[None]]
T = (1, 0, 0)


def _buf(n: int) -> memoryview:
    return memoryview(bytearray(n))


async def _recv(t: Transport, peer: int | None, tag: tuple[int, int, int], n: int) -> bytes:
    out = bytearray(n)
    await asyncio.wait_for(t.recv_into(peer, tag, memoryview(out)), 10)
    return bytes(out)


async def messages_keep_their_order_per_peer_and_tag(w: World) -> None:
    sends = [w[0].send(1, T, memoryview(bytes([i]) * 8)) for i in range(5)]
    # Other tags, sent in the opposite order of the receives posted for them.
    sends += [w[0].send(1, (1, 0, step), memoryview(bytes([100 + step]))) for step in (3, 2, 1)]
    for step in (1, 2, 3):
        assert await _recv(w[1], 0, (1, 0, step), 1) == bytes([100 + step])
    assert [await _recv(w[1], 0, T, 8) for _ in range(5)] == [bytes([i]) * 8 for i in range(5)]
    await asyncio.gather(*sends)


async def empty_and_large_messages_arrive_whole(w: World) -> None:
    big = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)
    sends = [w[2].send(0, T, memoryview(b"")), w[2].send(0, (1, 1, 0), memoryview(big))]
    assert await _recv(w[0], 2, T, 0) == b""
    assert await _recv(w[0], 2, (1, 1, 0), big.nbytes) == big.tobytes()
    await asyncio.gather(*sends)


async def a_receive_from_any_rank_names_the_sender(w: World) -> None:
    out = _buf(2)
    fut = w[0].recv_into(None, T, out)
    await w[2].send(0, T, memoryview(b"hi"))
    assert await asyncio.wait_for(fut, 10) == 2 and bytes(out) == b"hi"


async def a_rank_sends_to_itself(w: World) -> None:
    await w[1].send(1, T, memoryview(b"me"))
    assert await _recv(w[1], 1, T, 2) == b"me"


async def a_length_mismatch_fails_that_receive_only(w: World) -> None:
    await w[0].send(1, T, memoryview(b"four"))
    await w[0].send(1, T, memoryview(b"next"))
    with pytest.raises(aiodist.DistUsageError, match="expects 3 bytes, the message has 4 bytes"):
        await _recv(w[1], 0, T, 3)
    assert await _recv(w[1], 0, T, 4) == b"next"  # the bad one was consumed


async def bad_arguments_are_usage_errors_at_once(w: World) -> None:
    t = w[0]
    for peer in (3, -1, "1"):
        with pytest.raises(aiodist.DistUsageError, match="peer must be a rank in"):
            t.send(peer, T, memoryview(b"x"))  # type: ignore[arg-type]
        with pytest.raises(aiodist.DistUsageError, match="peer must be a rank in"):
            t.recv_into(peer, T, _buf(1))  # type: ignore[arg-type]
    for tag in ((1, 2), (1, 2, -1), (1, 2, 2**64)):
        with pytest.raises(aiodist.DistUsageError, match="a tag must be three integers"):
            t.send(1, tag, memoryview(b"x"))  # type: ignore[arg-type]
    with pytest.raises(aiodist.DistUsageError):
        t.recv_into(1, T, memoryview(b"read-only"))


async def a_rejection_fails_the_receives_of_that_operation(w: World) -> None:
    early = w[1].recv_into(0, (7, 3, 0), _buf(4))
    w[0].send_reject(1, 7, 3, "rank 0 did not like it")
    with pytest.raises(aiodist.DistUsageError, match="did not like it"):
        await asyncio.wait_for(early, 10)
    with pytest.raises(aiodist.DistUsageError, match="did not like it"):
        await asyncio.wait_for(w[1].recv_into(0, (7, 3, 1), _buf(4)), 10)
    # Other operations are unaffected.
    await w[0].send(1, (7, 4, 0), memoryview(b"fine"))
    assert await _recv(w[1], 0, (7, 4, 0), 4) == b"fine"


async def closing_says_goodbye_after_what_was_sent(w: World) -> None:
    await w[1].send(0, T, memoryview(b"last"))
    await w[0].send(1, T, memoryview(b"hi"))  # connected both ways
    pending = w[0].recv_into(1, (1, 9, 0), _buf(1))
    any_source = w[0].recv_into(None, (1, 8, 0), _buf(4))
    await w[1].aclose("left for the test")
    with pytest.raises(
        aiodist.DistNetworkError, match=r"^lost connection to rank 1: it left for the test$"
    ) as info:
        await asyncio.wait_for(pending, 10)
    assert departure_of(info.value) is Departure.LEFT
    assert await _recv(w[0], 1, T, 4) == b"last"  # sent before the goodbye
    assert not any_source.done()  # others may still send
    await w[2].send(0, (1, 8, 0), memoryview(b"from"))
    assert await asyncio.wait_for(any_source, 10) == 2


async def an_abort_fails_everything_and_is_no_departure(w: World) -> None:
    await w[1].send(0, T, memoryview(b"x"))
    await _recv(w[0], 1, T, 1)
    mine = w[1].recv_into(2, T, _buf(1))
    theirs = w[0].recv_into(1, (1, 5, 0), _buf(1))
    cause = aiodist.DistTimeoutError("rank 1 gave up")
    w[1].abort(cause)
    with pytest.raises(aiodist.DistTimeoutError, match="rank 1 gave up"):
        await asyncio.wait_for(mine, 10)
    with pytest.raises(aiodist.DistTimeoutError, match="rank 1 gave up"):
        await asyncio.wait_for(w[1].send(0, T, memoryview(b"x")), 10)
    with pytest.raises(aiodist.DistNetworkError, match="lost connection to rank 1") as info:
        await asyncio.wait_for(theirs, 10)
    assert departure_of(info.value) is None
    # The other peers go on.
    await w[2].send(0, T, memoryview(b"z"))
    assert await _recv(w[0], 2, T, 1) == b"z"


async def an_abort_passed_on_names_the_first_failure(w: World) -> None:
    # Connected: 2 -> 1 -> 0.
    await w[2].send(1, T, memoryview(b"x"))
    await _recv(w[1], 2, T, 1)
    await w[1].send(0, T, memoryview(b"y"))
    await _recv(w[0], 1, T, 1)
    heard = w[1].recv_into(2, (1, 5, 0), _buf(1))
    w[2].abort(aiodist.DistTimeoutError("rank 2 gave up"))
    with pytest.raises(aiodist.DistNetworkError) as info:
        await asyncio.wait_for(heard, 10)
    assert (
        str(info.value) == "lost connection to rank 2: it aborted: DistTimeoutError: rank 2 gave up"
    )
    # Rank 1 aborts because rank 2 did: rank 0 hears rank 2's cause, not a chain of causes.
    theirs = w[0].recv_into(1, (1, 5, 0), _buf(1))
    w[1].abort(info.value)
    with pytest.raises(aiodist.DistNetworkError) as relayed:
        await asyncio.wait_for(theirs, 10)
    assert (
        str(relayed.value)
        == "lost connection to rank 1: it aborted: DistTimeoutError: rank 2 gave up"
    )


async def a_peer_the_store_says_is_gone_leaves_what_it_sent(w: World) -> None:
    await w[0].send(1, T, memoryview(b"hi"))  # connected both ways
    await w[1].send(0, T, memoryview(b"last"))  # perhaps still in the socket, unread
    pending = w[0].recv_into(1, (1, 6, 0), _buf(1))
    gone = lost_peer_error(1, "rank 1 is gone", Departure.GONE)
    w[0].peer_gone(1, gone)
    assert await _recv(w[0], 1, T, 4) == b"last"
    with pytest.raises(aiodist.DistNetworkError, match="rank 1 is gone") as info:
        await asyncio.wait_for(pending, 10)
    assert departure_of(info.value) is Departure.GONE
    with pytest.raises(aiodist.DistNetworkError, match="rank 1 is gone"):
        await asyncio.wait_for(w[0].send(1, T, memoryview(b"x")), 10)


#: Every check of the contract.
CHECKS: list[Check] = [
    messages_keep_their_order_per_peer_and_tag,
    empty_and_large_messages_arrive_whole,
    a_receive_from_any_rank_names_the_sender,
    a_rank_sends_to_itself,
    a_length_mismatch_fails_that_receive_only,
    bad_arguments_are_usage_errors_at_once,
    a_rejection_fails_the_receives_of_that_operation,
    closing_says_goodbye_after_what_was_sent,
    an_abort_fails_everything_and_is_no_departure,
    an_abort_passed_on_names_the_first_failure,
    a_peer_the_store_says_is_gone_leaves_what_it_sent,
]
