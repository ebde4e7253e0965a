"""Point-to-point operations: send/recv, any-source receives, tags, batches."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import aiodist
from aiodist.testing import run_world

pytestmark = pytest.mark.both_loops


async def test_send_recv_ring() -> None:
    async def fn(rank: int, size: int) -> tuple[int, np.ndarray]:
        right, left = (rank + 1) % size, (rank - 1) % size
        out = np.empty(6, np.int64)
        recv = aiodist.irecv(out, src=left)
        send = aiodist.isend(np.arange(6, dtype=np.int64) * rank, dst=right)
        assert await send is None
        return await recv, out

    for rank, (sender, out) in enumerate(await run_world(fn, 4)):
        left = (rank - 1) % 4
        assert sender == left
        np.testing.assert_array_equal(out, np.arange(6) * left)


async def test_recv_from_any_source_returns_sender() -> None:
    async def fn(rank: int, size: int) -> list[tuple[int, float]]:
        if rank != 0:
            await aiodist.send(np.full(3, float(rank)), dst=0)
            return []
        got = []
        for _ in range(size - 1):
            buf = np.empty(3)
            sender = await aiodist.recv(buf)  # src=None: from any rank
            assert (buf == buf[0]).all()
            got.append((sender, float(buf[0])))
        return got

    results = await run_world(fn, 4)
    assert sorted(results[0]) == [(1, 1.0), (2, 2.0), (3, 3.0)]


async def test_tags_match_out_of_order_and_fifo_per_tag() -> None:
    async def fn(rank: int, size: int) -> list[int]:
        if rank == 0:
            for tag, value in [(7, 70), (8, 80), (7, 71)]:
                await aiodist.send(np.array([value]), dst=1, tag=tag)
            return []
        a, b, c = (np.empty(1, np.int64) for _ in range(3))
        # Receive tag 8 first although it was sent second; tag 7 keeps its order.
        await aiodist.recv(b, src=0, tag=8)
        await aiodist.recv(a, src=0, tag=7)
        await aiodist.recv(c, src=0, tag=7)
        return [int(a[0]), int(b[0]), int(c[0])]

    assert (await run_world(fn, 2))[1] == [70, 80, 71]


async def test_group_dst_and_group_src_in_subgroup() -> None:
    async def fn(rank: int, size: int) -> int | None:
        g = await aiodist.new_group([1, 3])
        if rank == 1:
            await aiodist.send(np.array([42]), group=g, group_dst=1)
        if rank == 3:
            buf = np.empty(1, np.int64)
            sender = await aiodist.recv(buf, group=g, group_src=0)
            assert buf[0] == 42
            return sender
        return None

    assert (await run_world(fn, 4))[3] == 0  # a group rank, since group_src was used


async def test_batch_isend_irecv_ring() -> None:
    async def fn(rank: int, size: int) -> np.ndarray:
        right, left = (rank + 1) % size, (rank - 1) % size
        out = np.empty(2)
        ops = [
            aiodist.P2POp(aiodist.isend, np.array([rank, -rank], float), right),
            aiodist.P2POp(aiodist.irecv, out, left),
        ]
        works = aiodist.batch_isend_irecv(ops)
        assert len(works) == 2
        results = [await w for w in works]
        assert results == [None, left]
        return out

    for rank, out in enumerate(await run_world(fn, 3)):
        left = (rank - 1) % 3
        np.testing.assert_array_equal(out, [left, -left])


async def test_p2p_usage_errors() -> None:
    async def fn(rank: int, size: int) -> None:
        # Each call is refused on its own; the group stays usable through all of them.
        for call, match in [
            (lambda: aiodist.isend(np.zeros(1)), "send: a destination is required"),
            (lambda: aiodist.send(np.zeros(1), dst=rank), "cannot send to or from itself"),
            (lambda: aiodist.send(np.zeros(1), dst=5), "dst 5 is not in the process group"),
            (
                lambda: aiodist.recv(np.zeros(1), src=1 - rank, tag=-1),
                r"recv: tag must be an int in \[0, 2\*\*63\)",
            ),
            (lambda: aiodist.recv(np.zeros(4)[::2], src=1 - rank), "not C-contiguous"),
            (
                lambda: aiodist.P2POp(print, np.zeros(1), 1),
                "op must be aiodist.isend or aiodist.irecv",
            ),
            (lambda: aiodist.batch_isend_irecv([]), "non-empty list"),
        ]:
            with pytest.raises(aiodist.DistUsageError, match=match):
                call()
        got = np.zeros(1)
        await asyncio.gather(
            aiodist.send(np.array([float(rank)]), dst=1 - rank),
            aiodist.recv(got, src=1 - rank),
        )
        assert got[0] == 1 - rank

    await run_world(fn, 2)


async def test_recv_size_mismatch_fails_the_receive_only() -> None:
    async def fn(rank: int, size: int) -> None:
        if rank == 0:
            await aiodist.send(np.zeros(4), dst=1)
        else:
            with pytest.raises(aiodist.DistUsageError, match="32"):
                await aiodist.recv(np.zeros(3), src=0)
        # Point-to-point messages keep no order across the group: it stays usable.
        x = np.array([float(rank + 1)])
        await aiodist.all_reduce(x)
        assert x[0] == 3.0

    await run_world(fn, 2, timeout=20)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_a_rejected_send_takes_the_place_of_its_message_before_the_next_one(
    transport: str,
) -> None:
    # Rank 0's first send on tag 5 is rejected, its second goes: rank 1's first receive
    # fails, its second gets the data, whatever the transport (over shared memory the
    # rejection used to be handed on after the next message had taken the first receive).
    async def fn(rank: int, size: int) -> object:
        if rank == 0:
            with pytest.raises(aiodist.DistUsageError):
                aiodist.isend([1, 2], dst=1, tag=5)  # not an array: rejected
            await aiodist.isend(np.full(2, 42), dst=1, tag=5)
            return None
        first, second = np.zeros(2, np.int64), np.zeros(2, np.int64)
        works = [aiodist.irecv(first, src=0, tag=5), aiodist.irecv(second, src=0, tag=5)]
        outcomes = []
        for work in works:
            try:
                await work
                outcomes.append("ok")
            except aiodist.DistUsageError as exc:
                outcomes.append(str(exc))
        return outcomes, second.tolist()

    outcomes, second = (await run_world(fn, 2, transport=transport, timeout=20))[1]
    assert outcomes[0].startswith("recv from rank 0 (tag 5): rank 0 rejected its send: send:")
    assert outcomes[1] == "ok" and second == [42, 42]
