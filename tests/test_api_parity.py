"""The torch.distributed names a script or a modern training loop calls, async and blocking."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import aiodist
import aiodist.sync as dist
from aiodist.testing import run_world, run_world_processes

pytestmark = pytest.mark.both_loops


async def test_device_mesh_groups_along_each_dimension() -> None:
    async def fn(rank: int, size: int) -> tuple[object, ...]:
        mesh = await aiodist.init_device_mesh("cpu", (2, 3), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh["dp"], mesh["tp"]
        x = np.array([float(rank)])
        await aiodist.all_reduce(x, group=tp.get_group())
        y = np.array([float(rank)])
        await aiodist.all_reduce(y, group=mesh.get_group("dp"))
        both = mesh["tp", "dp"]
        return (
            mesh.shape,
            mesh.get_coordinate(),
            dp.mesh.tolist(),
            tp.mesh.tolist(),
            mesh.get_local_rank("tp"),
            tp.size(),
            x[0],
            y[0],
            both.mesh.tolist(),
            aiodist.get_pg_count(),
        )

    results = await run_world(fn, 6, timeout=60)
    for rank, (shape, coord, dp, tp, local_tp, tp_size, x, y, both, count) in enumerate(results):
        row, col = divmod(rank, 3)
        assert shape == (2, 3) and coord == (row, col)  # a tuple, as torch's
        assert dp == [col, col + 3] and tp == [3 * row, 3 * row + 1, 3 * row + 2]
        assert local_tp == col and tp_size == 3
        assert x == sum(tp) and y == sum(dp)
        assert both == [[0, 3], [1, 4], [2, 5]]
        assert count == 1 + 3 + 2  # the default group, 3 dp lines, 2 tp rows


async def test_device_mesh_bad_arguments() -> None:
    async def fn(rank: int, size: int) -> None:
        with pytest.raises(aiodist.DistUsageError, match=r"holds 6 ranks but the world has 4"):
            await aiodist.init_device_mesh("cpu", (2, 3))
        with pytest.raises(aiodist.DistUsageError, match="must name each of the 2 dimensions"):
            await aiodist.init_device_mesh("cpu", (2, 2), mesh_dim_names=("a",))
        with pytest.raises(aiodist.DistUsageError, match="no backend serves device 'tpu'"):
            await aiodist.init_device_mesh("tpu", (4,))
        mesh = await aiodist.init_device_mesh("cpu", (4,))
        with pytest.raises(aiodist.DistUsageError, match="no mesh dimension named 'dp'"):
            mesh.get_group("dp")
        assert mesh.get_group() is mesh.get_all_groups()[0]

    await run_world(fn, 4, timeout=60)


async def test_split_group_and_enumeration() -> None:
    async def fn(rank: int, size: int) -> tuple[object, ...]:
        mine = await aiodist.split_group(split_ranks=[[0, 2], [1]])
        sub, subs = await aiodist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
        x = np.array([rank])
        if mine is not None:
            await aiodist.all_reduce(x, group=mine)
        return (None if mine is None else mine.ranks, sub.ranks if sub else None, len(subs), x[0])

    results = await run_world(fn, 4, timeout=60)
    assert results[0] == ((0, 2), (0, 1), 2, 2)
    assert results[1] == ((1,), (0, 1), 2, 1)
    assert results[2] == ((0, 2), (2, 3), 2, 2)
    assert results[3] == (None, (2, 3), 2, 3)


async def test_coalesced_collectives_and_premul_sum() -> None:
    async def fn(rank: int, size: int) -> None:
        a, b = np.full(3, rank + 1.0), np.full((2, 2), 2.0 * rank)
        await aiodist.all_reduce_coalesced([a, b])
        np.testing.assert_array_equal(a, np.full(3, 3.0))
        np.testing.assert_array_equal(b, np.full((2, 2), 2.0))
        outs = [[np.zeros(2), np.zeros(1, np.int32)] for _ in range(size)]
        await aiodist.all_gather_coalesced(
            outs, [np.full(2, float(rank)), np.array([rank], np.int32)]
        )
        assert [o[0].tolist() for o in outs] == [[0.0, 0.0], [1.0, 1.0]]
        assert [o[1].tolist() for o in outs] == [[0], [1]]
        x = np.full(4, rank + 1.0, np.float32)
        await aiodist.all_reduce(x, op=aiodist.make_premul_sum(0.5))
        np.testing.assert_array_equal(x, np.full(4, 1.5, np.float32))
        with pytest.raises(aiodist.DistUsageError, match="PREMUL_SUM needs its factor"):
            aiodist.all_reduce(np.ones(2), op=aiodist.ReduceOp.PREMUL_SUM)
        with pytest.raises(
            aiodist.DistUsageError, match="PREMUL_SUM is not supported for dtype int64"
        ):
            aiodist.all_reduce(np.ones(2, np.int64), op=aiodist.make_premul_sum(2))

    await run_world(fn, 2, timeout=30)


async def test_object_point_to_point() -> None:
    async def fn(rank: int, size: int) -> object:
        if rank == 0:
            await aiodist.send_object_list([{"a": 1}, "two", 3.0], dst=1)
            return None
        got = [None, None, None]
        sender = await aiodist.recv_object_list(got)
        return sender, got

    _, (sender, got) = await run_world(fn, 2, timeout=30)
    assert sender == 0 and got == [{"a": 1}, "two", 3.0]


def test_small_functions() -> None:
    assert aiodist.supports_complex(aiodist.ReduceOp.SUM)
    assert not aiodist.supports_complex(aiodist.ReduceOp.MAX)
    assert aiodist.get_default_backend_for_device("cuda:1") == "cuda"
    previous = logging.getLogger("aiodist").level
    try:
        aiodist.set_debug_level("DETAIL")
        assert aiodist.get_debug_level() is aiodist.DebugLevel.DETAIL
        aiodist.set_debug_level(aiodist.DebugLevel.OFF)
        assert aiodist.get_debug_level() is aiodist.DebugLevel.OFF
        with pytest.raises(aiodist.DistUsageError, match="OFF, INFO or DETAIL"):
            aiodist.set_debug_level("LOUD")
    finally:
        logging.getLogger("aiodist").setLevel(previous)
    assert dist.is_gloo_available() and not dist.is_mpi_available()
    assert dist.DistNetworkError is aiodist.DistNetworkError
    assert issubclass(dist.QueueEmptyError, dist.DistStoreError)


def _blocking_parity(rank: int, size: int) -> list[object]:
    assert dist.group.WORLD is not None and dist.group.WORLD.size == size
    mesh = dist.init_device_mesh("cpu", (size,), mesh_dim_names=("dp",))
    x = np.array([float(rank)])
    dist.all_reduce(x, group=mesh["dp"].get_group())
    if rank == 0:
        dist.send_object_list(["hello", rank], dst=1)
    elif rank == 1:
        got = [None, None]
        assert dist.recv_object_list(got, src=0) == 0
        assert got == ["hello", 0]
    work = dist.all_reduce(np.ones(2), async_op=True)
    assert work.wait() and work.is_completed()
    return [x[0], dist.get_pg_count()]


@pytest.mark.multiprocess
def test_blocking_parity_in_processes() -> None:
    results = run_world_processes(_blocking_parity, 3, timeout=60)
    assert results == [[3.0, 2]] * 3
