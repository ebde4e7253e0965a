"""Process groups: init, introspection, subgroups, non-members, destroy, backends."""

from __future__ import annotations

import asyncio
import importlib.util

import numpy as np
import pytest

import aiodist
from aiodist.backends import parse_backend
from aiodist.testing import free_port, run_world

pytestmark = pytest.mark.both_loops


async def test_introspection_and_repr() -> None:
    async def fn(rank: int, size: int) -> tuple[int, int, str, str, bool]:
        pg = aiodist.group.resolve_group(None, "test")
        return (
            aiodist.get_rank(),
            aiodist.get_world_size(),
            aiodist.get_backend(),
            repr(pg),
            aiodist.is_initialized(),
        )

    results = await run_world(fn, 4)
    for rank, (r, n, backend, text, init) in enumerate(results):
        assert (r, n, backend, init) == (rank, 4, "cpu", True)
        assert text == f"<ProcessGroup rank={rank}/4 backend=cpu>"
    assert not aiodist.is_initialized()


async def test_not_initialized_errors() -> None:
    with pytest.raises(aiodist.DistUsageError, match=r"call `await aiodist\.init_process_group"):
        aiodist.all_reduce(np.zeros(1))
    with pytest.raises(aiodist.DistUsageError, match="get_rank needs the default process group"):
        aiodist.get_rank()
    assert not aiodist.is_initialized()


async def test_init_argument_errors() -> None:
    store = aiodist.HashStore()
    with pytest.raises(aiodist.DistUsageError, match="either store or init_method"):
        await aiodist.init_process_group(store=store, init_method="env://", rank=0, world_size=1)
    with pytest.raises(aiodist.DistUsageError, match="world_size must be a positive int"):
        await aiodist.init_process_group(store=store, rank=0)
    with pytest.raises(aiodist.DistUsageError, match=r"rank must be in \[0, 2\)"):
        await aiodist.init_process_group(store=store, rank=2, world_size=2)
    if importlib.util.find_spec("cupy") is None:
        with pytest.raises(aiodist.DistUsageError, match=r"aiodist\[cuda13\]"):
            await aiodist.init_process_group("nccl", store=store, rank=0, world_size=1)
    assert not aiodist.is_initialized()


async def test_init_twice_and_destroy() -> None:
    store = aiodist.HashStore()
    pg = await aiodist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(
            aiodist.DistUsageError, match="initialize the default process group twice"
        ):
            await aiodist.init_process_group(store=store, rank=0, world_size=1)
        x = np.ones(3)
        await aiodist.all_reduce(x)
    finally:
        await aiodist.destroy_process_group()
    assert not aiodist.is_initialized()
    assert repr(pg) == "<ProcessGroup rank=0/1 backend=gloo destroyed>"  # the name given
    with pytest.raises(
        aiodist.DistUsageError, match="all_reduce: the process group has been destroyed"
    ):
        aiodist.all_reduce(np.ones(3), group=pg)
    # The same store can host the next world: keys are namespaced per generation, and a
    # world's go as its last rank leaves.
    await aiodist.init_process_group(store=store, rank=0, world_size=1)
    assert sorted(k for k in await store.list_keys() if "transport/" in k) == [
        "aiodist/default_pg/1/1/transport/tcp/0"
    ]
    await aiodist.destroy_process_group()
    assert [k for k in await store.list_keys() if k.startswith("aiodist/default_pg/1/")] == []


def test_parse_backend() -> None:
    cuda = importlib.util.find_spec("cupy") is not None
    assert parse_backend(None) == (
        ("cpu:cpu,cuda:cuda", {"cpu": "cpu", "cuda": "cuda"}) if cuda else ("cpu", {"cpu": "cpu"})
    )
    assert parse_backend("GLOO") == ("cpu", {"cpu": "cpu"})
    assert parse_backend("nccl") == ("cuda", {"cuda": "cuda"})
    assert parse_backend("cpu:gloo,cuda:nccl") == (
        "cpu:cpu,cuda:cuda",
        {"cpu": "cpu", "cuda": "cuda"},
    )
    with pytest.raises(aiodist.DistUsageError, match="unknown backend 'mpi'"):
        parse_backend("mpi")
    with pytest.raises(aiodist.DistUsageError, match="cannot serve 'cuda' arrays"):
        parse_backend("cpu:gloo,cuda:gloo")


async def test_new_group_members_and_non_members() -> None:
    async def fn(rank: int, size: int) -> tuple[object, ...]:
        g = await aiodist.new_group([3, 1])
        odd = await aiodist.new_group([1, 3])  # a second group: another id, same members
        # As in torch, every rank of the world takes part in making every group.
        evens = await aiodist.new_group([0, 2])
        if rank in (1, 3):
            assert isinstance(g, aiodist.ProcessGroup)
            assert isinstance(odd, aiodist.ProcessGroup)
            x = np.array([float(rank)])
            await aiodist.all_reduce(x, group=g)
            y = np.array([rank])
            await aiodist.broadcast(y, src=3, group=odd)
            return (
                g.group_id,
                odd.group_id,
                aiodist.get_rank(g),
                aiodist.get_world_size(g),
                aiodist.get_process_group_ranks(g),
                float(x[0]),
                int(y[0]),
            )
        assert g is aiodist.NON_GROUP_MEMBER
        assert aiodist.get_rank(g) == -1 and aiodist.get_world_size(g) == -1
        # As torch: a warning, and nothing done (the members are not affected).
        untouched = np.zeros(1)
        with pytest.warns(UserWarning, match=rf"Running all_reduce on global rank {rank} which"):
            work = aiodist.all_reduce(untouched, group=g)
        assert work.is_completed() and await work is None and untouched[0] == 0
        # Non-members keep working on the world meanwhile.
        z = np.array([1.0])
        await aiodist.all_reduce(z, group=evens)
        return (float(z[0]),)

    r = await run_world(fn, 4)
    assert r[1] == (1, 2, 0, 2, [1, 3], 4.0, 3)
    assert r[3] == (1, 2, 1, 2, [1, 3], 4.0, 3)
    assert r[0] == r[2] == (2.0,)


async def test_new_group_errors() -> None:
    async def fn(rank: int, size: int) -> None:
        with pytest.raises(aiodist.DistUsageError, match="ranks must not be empty"):
            await aiodist.new_group([])
        with pytest.raises(aiodist.DistUsageError, match="rank 7 is out of range"):
            await aiodist.new_group([0, 7])
        with pytest.raises(aiodist.DistUsageError, match="contain duplicates"):
            await aiodist.new_group([0, 0])
        with pytest.raises(aiodist.DistUsageError, match="must be a positive int dividing"):
            await aiodist.new_subgroups(3)

    await run_world(fn, 2)


async def test_new_subgroups() -> None:
    async def fn(rank: int, size: int) -> tuple[int, int, float, int]:
        mine, groups = await aiodist.new_subgroups(2)
        assert len(groups) == 3
        assert groups[rank // 2] is mine
        x = np.array([float(rank)])
        await aiodist.all_reduce(x, group=mine)
        return mine.rank, mine.size, float(x[0]), mine.group_id

    results = await run_world(fn, 6)
    assert [r[2] for r in results] == [1.0, 1.0, 5.0, 5.0, 9.0, 9.0]
    assert [r[:2] for r in results] == [(0, 2), (1, 2)] * 3
    assert [r[3] for r in results] == [1, 1, 2, 2, 3, 3]


async def test_destroy_subgroup_only() -> None:
    async def fn(rank: int, size: int) -> float:
        g = await aiodist.new_group()
        assert isinstance(g, aiodist.ProcessGroup)
        await aiodist.barrier(group=g)
        await aiodist.destroy_process_group(g)
        with pytest.raises(
            aiodist.DistUsageError, match="barrier: the process group has been destroyed"
        ):
            aiodist.barrier(group=g)
        x = np.ones(1)
        await aiodist.all_reduce(x)  # the world is still fine
        return float(x[0])

    assert await run_world(fn, 3) == [3.0] * 3


async def test_ops_on_same_group_interleave_across_groups() -> None:
    async def fn(rank: int, size: int) -> list[float]:
        g = await aiodist.new_group()
        xs = [np.array([float(rank + i)]) for i in range(6)]
        # Alternate groups, and await in reverse order of issue.
        works = [aiodist.all_reduce(x, group=g if i % 2 else None) for i, x in enumerate(xs)]
        for w in reversed(works):
            await w
        return [float(x[0]) for x in xs]

    for got in await run_world(fn, 3):
        assert got == [3.0 + 3 * i for i in range(6)]


async def test_new_group_called_differently_is_detected() -> None:
    async def fn(rank: int, size: int) -> BaseException:
        # Rank 1 creates its groups in the other order.
        order = [[0, 1], [0, 1, 2]] if rank != 1 else [[0, 1, 2], [0, 1]]
        with pytest.raises(aiodist.DistError) as info:
            for ranks in order:
                await aiodist.new_group(ranks)
            await aiodist.barrier()
        return info.value

    errors = await run_world(fn, 3, timeout=10)
    usage = [str(e) for e in errors if isinstance(e, aiodist.DistUsageError)]
    assert usage, errors
    assert all("every rank must call new_group with the same ranks" in m for m in usage)
    assert any("group 1 is ranks [0,1" in m for m in usage)


async def test_init_method_tcp_url_with_ranks_as_tasks() -> None:
    port = free_port()

    async def rank_main(rank: int) -> tuple[float, str]:
        aiodist.group.isolate_context()  # two ranks in one process: each its own default
        pg = await aiodist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=20
        )
        x = np.array([rank + 1.0])
        await aiodist.all_reduce(x)
        if rank == 1:
            await asyncio.sleep(0.2)  # rank 0, the store's host, must wait for us to leave
        await aiodist.destroy_process_group()
        return float(x[0]), repr(pg)

    results = await asyncio.gather(*(asyncio.create_task(rank_main(r)) for r in range(2)))
    assert results == [
        (3.0, "<ProcessGroup rank=0/2 backend=gloo destroyed>"),
        (3.0, "<ProcessGroup rank=1/2 backend=gloo destroyed>"),
    ]


async def test_destroy_leaves_no_socket_or_task_behind() -> None:
    import os

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def fn(rank: int, size: int) -> None:
        x = np.ones(1 << 16)
        for _ in range(3):
            await aiodist.all_reduce(x)
        await aiodist.all_gather_object([None] * size, rank)
        g = await aiodist.new_group([0, 2])
        if rank != 1:
            await aiodist.barrier(group=g)

    # A first world lets the loop create what it keeps for its lifetime (libuv, under
    # uvloop, reserves a spare descriptor on /dev/null at its first accepted connection).
    await run_world(fn, 3)
    before_fds, before_tasks = fds(), asyncio.all_tasks()
    await run_world(fn, 3)
    await asyncio.sleep(0)
    assert fds() == before_fds
    assert asyncio.all_tasks() == before_tasks


async def test_groups_are_async_context_managers() -> None:
    async def fn(rank: int, size: int) -> tuple[bool, bool]:
        # run_world made this rank's default group; leave it through `async with`.
        async with aiodist.group.resolve_group(None, "test") as pg:
            async with await aiodist.new_group([0, 1]) as pair:
                x = np.ones(2)
                await aiodist.all_reduce(x, group=pair)
                assert x[0] == 2.0
            pair_destroyed = pair.is_destroyed
        return pair_destroyed, aiodist.is_initialized() or pg.world.closed is False

    assert await run_world(fn, 2) == [(True, False), (True, False)]
