"""Operations that end as they start (eager), and blocking calls that stand in for the loop
thread: the same results, order and errors as the queued path, whichever one a call takes."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

import aiodist
import aiodist.sync as dist
from aiodist.sync import _loop_thread
from aiodist.testing import run_world, run_world_processes

pytestmark = pytest.mark.both_loops  # the standard loop (asyncio.run, uvicorn) too


async def test_an_operation_that_can_end_at_once_is_born_done_and_the_loop_still_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def fn(rank: int, size: int) -> tuple[bool, int, int, float]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        async def ticks_over(calls: int) -> int:
            start = ticks
            for _ in range(calls):
                await aiodist.all_reduce(x)
            return ticks - start

        x = np.arange(4.0)
        work = aiodist.all_reduce(x)
        born_done = work.is_completed()
        await work
        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        # Thousands of operations that end inline, as fast as they go: the loop still runs
        # (every EAGER_SECONDS at the latest).
        many = await ticks_over(5000)
        # No time for any: after each operation that ended inline, the next goes through the
        # loop.
        monkeypatch.setattr(aiodist.group, "EAGER_SECONDS", 0.0)
        none = await ticks_over(100)
        task.cancel()
        return born_done, many, none, float(x[1])

    [(born_done, many, none, value)] = await run_world(fn, 1)
    assert born_done
    assert many >= 1
    assert none >= 50
    assert value == 1.0


def _expected(i: int, size: int) -> float:
    return float(sum(r * 10 + i for r in range(size)))


async def _mixed(rank: int, size: int) -> list[str]:
    """Sixty all_reduces of three sizes, some awaited at once and some left in flight, from
    two tasks on two groups, with a rejected one in the middle; every result checked."""
    rng = np.random.default_rng(11)  # the same choices on every rank
    plan = [(int(rng.choice([1, 64, 70_000])), bool(rng.random() < 0.5)) for _ in range(60)]
    pair = await aiodist.new_group(list(range(size)))
    outcomes: list[str] = []

    async def issue(group: Any, offset: int) -> None:
        in_flight = []
        for i, (n, now) in enumerate(plan):
            x = np.full(n, float(rank * 10 + i + offset))
            if i == 30 and group is None:
                bad = aiodist.ReduceOp.BAND if rank == 0 else aiodist.ReduceOp.SUM
                try:
                    await aiodist.all_reduce(np.ones(4, np.float32), op=bad)
                except aiodist.DistUsageError as exc:
                    outcomes.append(str(exc))
            work = aiodist.all_reduce(x, group=group)
            if now:
                await work
                assert np.array_equal(x, np.full(n, _expected(i + offset, size))), i
            else:
                in_flight.append((work, x, i))
        for work, x, i in in_flight:
            await work
            assert np.array_equal(x, np.full(x.size, _expected(i + offset, size))), i

    await asyncio.gather(issue(None, 0), issue(pair, 1000))
    return outcomes


async def _late_peers(rank: int, size: int) -> dict[str, Any]:
    pg = aiodist.group.current_world().default_group
    x = np.full(3, rank + 1.0)
    # Rank 0 is first: its call takes its turn, arrives, and hands the rest over (the others
    # sleep); the last rank finds everyone arrived and ends its call at once.
    await asyncio.sleep(0.05 * rank)
    work = aiodist.all_reduce(x)
    born_done = work.is_completed()
    first = (await work).copy()
    await asyncio.sleep(0.05 * rank)
    barrier = aiodist.barrier()
    barrier_born_done = barrier.is_completed()
    await barrier
    # A call whose shape differs on one rank, run at once everywhere: every rank raises the
    # mismatch, and the group goes on.
    try:
        await aiodist.all_reduce(np.ones(2 if rank == size - 1 else 3))
        mismatch = ""
    except aiodist.DistUsageError as exc:
        mismatch = str(exc)
    y = np.arange(4.0) * (rank + 1)
    await aiodist.all_reduce(y, op=aiodist.ReduceOp.MAX)
    records = [(r.op, r.seq, r.state) for r in pg.world.recorder.records()]
    return {
        "inline": sorted(pg.inline_ops),
        "born_done": born_done,
        "barrier_born_done": barrier_born_done,
        "first": first.tolist(),
        "mismatch": mismatch,
        "after": y.tolist(),
        "records": records,
        "next_seq": pg.next_seq,
    }


@pytest.mark.parametrize("size", [2, 3])
async def test_small_operations_run_at_once_in_the_workspace_and_hand_over_when_peers_are_late(
    size: int,
) -> None:
    outcomes = await run_world(_late_peers, size, transport="shm")
    total = float(sum(range(1, size + 1)))
    for rank, seen in enumerate(outcomes):
        assert seen["inline"] == ["all_reduce", "barrier"]
        assert seen["born_done"] == (rank == size - 1), rank
        assert seen["barrier_born_done"] == (rank == size - 1), rank
        assert seen["first"] == [total] * 3
        assert "collective mismatch" in seen["mismatch"], seen["mismatch"]
        assert seen["after"] == [0.0, size, 2.0 * size, 3.0 * size]
        assert seen["next_seq"] == 4
        assert seen["records"][-4:] == [
            ("all_reduce", 0, "completed"),
            ("barrier", 1, "completed"),
            ("all_reduce", 2, "failed"),
            ("all_reduce", 3, "completed"),
        ]


async def test_a_group_over_tcp_runs_no_operation_at_once() -> None:
    async def fn(rank: int, size: int) -> list[str]:
        return sorted(aiodist.group.current_world().default_group.inline_ops)

    assert await run_world(fn, 2, transport="tcp") == [[], []]


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_eager_and_queued_operations_mix(size: int, transport: Any) -> None:
    outcomes = await run_world(_mixed, size, transport=transport)
    assert "all_reduce: ReduceOp.BAND is not supported for dtype float32" in outcomes[0][0]
    for rank in range(1, size):
        [text] = outcomes[rank]
        assert "was rejected by rank 0" in text and "ReduceOp.BAND" in text


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("objects", [False, True], ids=["arrays", "objects"])
async def test_a_queued_send_keeps_its_place_before_a_rejected_one(
    objects: bool, transport: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 0's first send on a tag goes through the loop (an operation ended inline just
    # before it: a receive of a message that is in), its second is rejected at once: rank
    # 1's first receive still gets the data and its second fails with the rejection (the
    # rejection overtook the queued send, whose message left only once its task ran).
    monkeypatch.setattr(aiodist.group, "EAGER_SECONDS", 0.0)

    async def fn(rank: int, size: int) -> object:
        if rank == 0:
            await aiodist.recv(np.zeros(1), src=1, tag=4)  # (and tag 3 is in before it)
            assert aiodist.irecv(np.zeros(1), src=1, tag=3).is_completed()  # inline
            if objects:
                first = aiodist.send_object_list([42, "x"], dst=1)
                with pytest.raises(aiodist.DistUsageError):
                    aiodist.send_object_list([], dst=1)
            else:
                first = aiodist.isend(np.full(2, 42), dst=1, tag=5)
                with pytest.raises(aiodist.DistUsageError):
                    aiodist.isend([1, 2], dst=1, tag=5)  # not an array: rejected
            await first
            return None
        await aiodist.send(np.ones(1), dst=0, tag=3)
        await aiodist.send(np.ones(1), dst=0, tag=4)
        outcomes: list[object] = []
        for _ in range(2):
            out: list[Any] = [None, None]
            x = np.zeros(2, np.int64)
            try:
                if objects:
                    await aiodist.recv_object_list(out, src=0)
                    outcomes.append(out)
                else:
                    await aiodist.recv(x, src=0, tag=5)
                    outcomes.append(x.tolist())
            except aiodist.DistUsageError as exc:
                outcomes.append(str(exc))
        return outcomes

    first, second = (await run_world(fn, 2, transport=transport, timeout=20))[1]
    assert first == ([42, "x"] if objects else [42, 42])
    assert isinstance(second, str)
    tag = 0 if objects else 5  # (object lists travel with tag 0)
    assert second.startswith(f"recv from rank 0 (tag {tag}): rank 0 rejected its send: "), second


def test_a_blocking_call_stands_in_for_an_idle_loop_thread_and_hands_over_to_a_busy_one() -> None:
    dist.HashStore().set("k", b"v")  # the loop thread runs
    loop = _loop_thread.loop_thread.loop()
    assert isinstance(loop, _loop_thread.HandOverLoop)
    here = threading.get_ident()
    assert _loop_thread.on_loop(threading.get_ident) == here
    # While a callback runs there, the loop thread holds its turn: the call is handed over.
    running, release = threading.Event(), threading.Event()

    def busy() -> None:
        running.set()
        release.wait(30)

    loop.call_soon_threadsafe(busy)
    assert running.wait(30)
    result: list[int] = []
    caller = threading.Thread(
        target=lambda: result.append(_loop_thread.on_loop(threading.get_ident))
    )
    caller.start()
    release.set()
    caller.join(30)
    assert result == [_loop_thread.loop_thread.ident]
    # A call that schedules work for the loop wakes it, although it slept with no deadline.
    woke = threading.Event()
    _loop_thread.on_loop(lambda: loop.call_soon(woke.set))
    assert woke.wait(30)


def _sync_mixed(rank: int, size: int) -> list[float]:
    # Blocking calls, some ending as they start, others queued (async_op, p2p round trips),
    # from the main thread and a second thread on a group of its own.
    pair = dist.new_group(list(range(size)))
    sums: list[float] = []

    def other() -> None:
        for i in range(200):
            y = np.full(3, float(rank + i))
            dist.all_reduce(y, group=pair)
            assert y[0] == sum(r + i for r in range(size))

    thread = threading.Thread(target=other)
    thread.start()
    works = []
    for i in range(200):
        x = np.full(1 if i % 3 else 50_000, float(rank))
        if i % 7 == 0:
            works.append((dist.all_reduce(x, async_op=True), x))
        else:
            dist.all_reduce(x)
            sums.append(float(x[0]))
        if i % 50 == 0:
            peer = (rank + 1) % size
            token = np.array([float(rank)])
            dist.send(token, dst=peer)
            dist.recv(token, src=(rank - 1) % size)
            assert token[0] == (rank - 1) % size
    for work, x in works:
        work.wait()
        sums.append(float(x[0]))
    thread.join(60)
    assert not thread.is_alive()
    return sums


@pytest.mark.multiprocess
@pytest.mark.parametrize(("size", "loop"), [(2, "auto"), (3, "uvloop"), (4, "asyncio")])
def test_blocking_calls_standing_in_or_handed_over_give_the_same_results(
    size: int, loop: str
) -> None:
    results = run_world_processes(_sync_mixed, size, env={"AIODIST_LOOP": loop})
    total = float(sum(range(size)))
    for sums in results:
        assert sums == [total] * 200
