"""The message-matching engine (Mailbox) and the in-process LocalTransport."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import aiodist
from aiodist.transport import _mailbox
from aiodist.transport._mailbox import Mailbox
from aiodist.transport.base import OpComm
from aiodist.transport.local import LocalTransport

T = (0, 1, 0)


def mv(a: np.ndarray) -> memoryview:
    return memoryview(a)


@pytest.mark.both_loops
async def test_send_then_recv_and_recv_then_send() -> None:
    t0, t1 = LocalTransport.create_world(2)
    a = np.arange(10, dtype=np.float32)
    # Message first: staged, copied out when the receive is posted.
    await t0.send(1, T, mv(a))
    out = np.zeros(10, dtype=np.float32)
    assert await t1.recv_into(0, T, mv(out)) == 0
    np.testing.assert_array_equal(out, a)
    # Receive first: the message lands straight in the receive's buffer.
    out2 = np.zeros(10, dtype=np.float32)
    fut = t0.recv_into(1, (0, 2, 0), mv(out2))
    assert not fut.done()
    await t1.send(0, (0, 2, 0), mv(a * 2))
    assert await fut == 1
    np.testing.assert_array_equal(out2, a * 2)


async def test_fifo_per_peer_and_tag_and_tags_out_of_order() -> None:
    t0, t1 = LocalTransport.create_world(2)
    for i in range(5):
        await t0.send(1, (0, 0, i % 2), mv(np.full(4, i, dtype=np.int64)))
    outs = [np.zeros(4, dtype=np.int64) for _ in range(5)]
    # Step 1 first, then step 0: each tag keeps its own send order.
    futs = [t1.recv_into(0, (0, 0, 1), mv(o)) for o in outs[:2]]
    futs += [t1.recv_into(0, (0, 0, 0), mv(o)) for o in outs[2:]]
    await asyncio.gather(*futs)
    assert [int(o[0]) for o in outs] == [1, 3, 0, 2, 4]


async def test_posted_receives_match_in_post_order() -> None:
    t0, t1 = LocalTransport.create_world(2)
    outs = [bytearray(3) for _ in range(3)]
    futs = [t1.recv_into(0, T, memoryview(o)) for o in outs]
    for i in range(3):
        await t0.send(1, T, memoryview(bytes([i]) * 3))
    await asyncio.gather(*futs)
    assert outs == [b"\x00" * 3, b"\x01" * 3, b"\x02" * 3]


async def test_any_source_takes_oldest_staged_then_next_arrival() -> None:
    t0, t1, t2 = LocalTransport.create_world(3)
    await t2.send(0, T, memoryview(b"two"))
    await t1.send(0, T, memoryview(b"one"))
    out = bytearray(3)
    assert await t0.recv_into(None, T, memoryview(out)) == 2
    assert out == b"two"
    assert await t0.recv_into(None, T, memoryview(out)) == 1
    assert out == b"one"
    # Posted first: whichever peer sends first fills it.
    fut = t0.recv_into(None, T, memoryview(out))
    await t2.send(0, T, memoryview(b"xyz"))
    assert await fut == 2
    assert out == b"xyz"


async def test_any_source_and_specific_receives_match_in_post_order() -> None:
    t0, t1 = LocalTransport.create_world(2)
    a, b = bytearray(1), bytearray(1)
    fa = t0.recv_into(None, T, memoryview(a))
    fb = t0.recv_into(1, T, memoryview(b))
    await t1.send(0, T, memoryview(b"A"))
    await t1.send(0, T, memoryview(b"B"))
    assert await fa == 1
    assert await fb == 1
    assert (a, b) == (b"A", b"B")


async def test_zero_size_messages() -> None:
    t0, t1 = LocalTransport.create_world(2)
    await t0.send(1, T, memoryview(b""))
    assert await t1.recv_into(0, T, memoryview(bytearray())) == 0
    fut = t1.recv_into(0, T, memoryview(bytearray()))
    await t0.send(1, T, memoryview(b""))
    assert await fut == 0


async def test_size_mismatch_names_sizes_tag_and_peer() -> None:
    t0, t1 = LocalTransport.create_world(2)
    fut = t1.recv_into(0, (3, 4, 5), memoryview(bytearray(8)))
    await t0.send(1, (3, 4, 5), memoryview(bytearray(12)))
    with pytest.raises(
        aiodist.DistUsageError,
        match=r"size mismatch on tag \(3, 4, 5\) from rank 0: the receive expects 8 bytes, "
        r"the message has 12 bytes",
    ):
        await fut
    # Staged message, then a receive of the wrong size.
    await t0.send(1, T, memoryview(bytearray(4)))
    with pytest.raises(aiodist.DistUsageError, match="expects 2 bytes, the message has 4"):
        await t1.recv_into(0, T, memoryview(bytearray(2)))
    # The mismatched messages were consumed: the next message matches normally.
    await t0.send(1, T, memoryview(b"ok"))
    out = bytearray(2)
    await t1.recv_into(0, T, memoryview(out))
    assert out == b"ok"


async def test_cancelled_receive_is_skipped() -> None:
    t0, t1 = LocalTransport.create_world(2)
    first, second = bytearray(1), bytearray(1)
    f1 = t1.recv_into(0, T, memoryview(first))
    f2 = t1.recv_into(0, T, memoryview(second))
    f1.cancel()
    await t0.send(1, T, memoryview(b"x"))
    assert await f2 == 0
    assert (first, second) == (b"\x00", b"x")


async def test_closed_peer_fails_pending_and_later_receives() -> None:
    t0, t1, t2 = LocalTransport.create_world(3)
    await t1.send(0, T, memoryview(b"early"))
    pending = t0.recv_into(1, (0, 9, 0), memoryview(bytearray(1)))
    any_src = t0.recv_into(None, (0, 8, 0), memoryview(bytearray(1)))
    other = t0.recv_into(2, (0, 9, 0), memoryview(bytearray(1)))
    await t1.aclose()
    with pytest.raises(
        aiodist.DistNetworkError, match="lost connection to rank 1: it closed its transport"
    ):
        await pending
    # Closed in order: an any-source receive still waits for rank 2.
    assert not other.done()
    assert not any_src.done()
    await t2.send(0, (0, 8, 0), memoryview(b"y"))
    assert await any_src == 2
    # What rank 1 sent before closing is still delivered; anything more fails at once.
    out = bytearray(5)
    assert await t0.recv_into(1, T, memoryview(out)) == 1
    assert out == b"early"
    with pytest.raises(aiodist.DistNetworkError, match="rank 1"):
        await t0.recv_into(1, T, memoryview(out))
    with pytest.raises(aiodist.DistNetworkError, match="rank 1"):
        await t0.send(1, T, memoryview(b"x"))
    await t2.send(0, (0, 9, 0), memoryview(b"z"))
    assert await other == 2
    # Once every other rank is gone, an any-source receive cannot complete.
    any_src = t0.recv_into(None, T, memoryview(bytearray(1)))
    await t2.aclose()
    with pytest.raises(aiodist.DistNetworkError, match="rank 2"):
        await any_src


async def test_aborted_peer_fails_any_source_receives() -> None:
    t0, t1, t2 = LocalTransport.create_world(3)
    any_src = t0.recv_into(None, T, memoryview(bytearray(1)))
    t1.abort(aiodist.DistTimeoutError("op timed out"))
    with pytest.raises(
        aiodist.DistNetworkError,
        match="lost connection to rank 1: it aborted: DistTimeoutError: op timed out",
    ):
        await any_src
    with pytest.raises(aiodist.DistNetworkError, match="rank 1"):
        await t0.recv_into(None, T, memoryview(bytearray(1)))
    # Receives from the ranks that remain still work.
    fut = t0.recv_into(2, T, memoryview(bytearray(1)))
    await t2.send(0, T, memoryview(b"k"))
    assert await fut == 2


async def test_abort_fails_everything_pending_with_the_given_error() -> None:
    (t0,) = LocalTransport.create_world(1)
    futs = [t0.recv_into(0, (0, i, 0), memoryview(bytearray(1))) for i in range(3)]
    futs.append(t0.recv_into(None, T, memoryview(bytearray(1))))
    t0.abort(aiodist.DistTimeoutError("op 7 timed out"))
    for fut in futs:
        with pytest.raises(aiodist.DistTimeoutError, match="op 7 timed out"):
            await fut
    with pytest.raises(aiodist.DistTimeoutError):
        await t0.recv_into(0, T, memoryview(bytearray(1)))
    await t0.aclose()
    assert "closed" in repr(t0)


async def test_send_to_self() -> None:
    (t0,) = LocalTransport.create_world(1)
    await t0.send(0, T, memoryview(b"me"))
    out = bytearray(2)
    assert await t0.recv_into(0, T, memoryview(out)) == 0
    assert out == b"me"


async def test_usage_errors() -> None:
    t0, _ = LocalTransport.create_world(2)
    with pytest.raises(aiodist.DistUsageError, match=r"peer must be a rank in \[0, 2\), got 2"):
        t0.send(2, T, memoryview(b""))
    with pytest.raises(aiodist.DistUsageError, match="tag must be three integers"):
        t0.send(1, (0, -1, 0), memoryview(b""))
    with pytest.raises(aiodist.DistUsageError, match="tag must be three integers"):
        t0.recv_into(1, (0, 1), memoryview(bytearray()))  # type: ignore[arg-type]
    with pytest.raises(aiodist.DistUsageError, match="read-only"):
        t0.recv_into(1, T, memoryview(b"abc"))
    with pytest.raises(aiodist.DistUsageError, match="C-contiguous"):
        t0.send(1, T, memoryview(np.zeros((4, 4))[:, 1]))
    with pytest.raises(aiodist.DistUsageError, match="positive integer"):
        LocalTransport.create_world(0)


async def test_multidimensional_views_are_sent_as_bytes() -> None:
    t0, t1 = LocalTransport.create_world(2)
    a = np.arange(12, dtype=np.float64).reshape(3, 4)
    out = np.zeros_like(a)
    fut = t1.recv_into(0, T, memoryview(out))
    await t0.send(1, T, memoryview(a))
    await fut
    np.testing.assert_array_equal(out, a)


async def test_opcomm_ring_exchange_over_local_transport() -> None:
    world = LocalTransport.create_world(4)
    ranks = [3, 2, 1, 0]  # group rank i is global rank 3 - i

    async def run(group_rank: int) -> int:
        t = world[ranks[group_rank]]
        comm = OpComm(t, ranks, group_rank, group_id=5, seq=1)
        out = np.zeros(1, dtype=np.int64)
        left = (group_rank - 1) % 4
        right = (group_rank + 1) % 4
        fut = comm.recv_into(left, 0, memoryview(out))
        await comm.send(right, 0, memoryview(np.array([group_rank], dtype=np.int64)))
        assert await fut == ranks[left]
        return int(out[0])

    assert await asyncio.gather(*(run(r) for r in range(4))) == [3, 0, 1, 2]


async def test_mailbox_streaming_claim_of_a_message_still_arriving() -> None:
    box = Mailbox(0, 3)
    inbound = box.incoming(1, T, 4)  # header read, no receive yet: staged
    inbound.buffer[:2] = b"ab"
    out = bytearray(4)
    fut = box.post(1, T, memoryview(out))  # takes the message that is still arriving
    assert not fut.done()
    assert box.num_staged() == 0
    inbound.buffer[2:] = b"cd"
    inbound.done()
    assert await fut == 1
    assert out == b"abcd"
    # A receive posted first gets the bytes written straight into its own memory.
    out2 = bytearray(3)
    fut2 = box.post(2, T, memoryview(out2))
    inbound2 = box.incoming(2, T, 3)
    assert inbound2.buffer.obj is out2
    inbound2.buffer[:] = b"xyz"
    inbound2.done()
    assert await fut2 == 2
    assert out2 == b"xyz"
    assert repr(box) == "<Mailbox rank=0 posted=0 staged=0 lost=[]>"


async def test_mailbox_peer_lost_while_message_arrives() -> None:
    box = Mailbox(0, 3)
    out = bytearray(4)
    fut = box.post(1, T, memoryview(out))
    box.incoming(1, T, 4)
    staged = box.incoming(2, T, 4)  # from rank 2, still arriving, no receive
    assert staged.buffer.obj is not out
    box.fail_peer(1, aiodist.DistNetworkError("lost connection to rank 1: reset"))
    with pytest.raises(aiodist.DistNetworkError, match="rank 1"):
        await fut
    assert box.num_staged() == 1
    box.fail_peer(2, aiodist.DistNetworkError("lost connection to rank 2: reset"))
    assert box.num_staged() == 0


async def test_a_large_staged_message_is_copied_out_a_piece_per_loop_turn() -> None:
    step = _mailbox.DELIVER_STEP
    payload = np.random.default_rng(0).integers(0, 256, 3 * step + 5, dtype=np.uint8)
    box = Mailbox(0, 3)
    # Complete before its receive is posted: copied when posted, a piece per turn.
    inbound = box.incoming(1, T, payload.size)
    inbound.buffer[:] = payload.data
    inbound.done()
    out = np.zeros_like(payload)
    fut = box.post(1, T, memoryview(out))
    assert not fut.done() and out[:step].tolist() == payload[:step].tolist()
    assert not out[step:].any()  # the rest waits for later turns
    assert await fut == 1
    np.testing.assert_array_equal(out, payload)
    # Claimed while still arriving: copied once its last byte is in, also in pieces.
    inbound = box.incoming(2, T, payload.size)
    out = np.zeros_like(payload)
    fut = box.post(2, T, memoryview(out))
    inbound.buffer[:] = payload.data
    inbound.done()
    assert not fut.done()
    assert await fut == 2
    np.testing.assert_array_equal(out, payload)
    # A receive cancelled meanwhile (its operation failed or was destroyed) is not written
    # into any further.
    inbound = box.incoming(1, (0, 2, 0), payload.size)
    inbound.buffer[:] = payload.data
    inbound.done()
    out = np.zeros_like(payload)
    fut = box.post(1, (0, 2, 0), memoryview(out))
    fut.cancel()
    await asyncio.sleep(0.01)
    assert out[:step].any() and not out[step:].any()
