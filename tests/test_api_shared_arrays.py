"""aiodist.empty / aiodist.zeros: arrays that a group's collectives read in place."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest

import aiodist
import aiodist.sync
from aiodist.collectives import _shared_array
from aiodist.collectives.shm import NodeWorkspace
from aiodist.group import ProcessGroup
from aiodist.testing import run_world


def shared(x: np.ndarray[Any, Any], group: ProcessGroup) -> bool:
    """Whether ``x`` lives in the shared memory of ``group``'s workspace."""
    workspace: Any = group.paths.get("cpu")
    if workspace is None:
        return False
    return _shared_array.locate(x, workspace.ws) is not None


@pytest.mark.both_loops
@pytest.mark.parametrize("n", [2, 3, 4])
async def test_shared_arrays_reduce_in_place_on_every_rank(n: int) -> None:
    async def rank_fn(rank: int, size: int) -> None:
        pg = aiodist.group.current_world().default_group
        x = aiodist.empty((3, 50_000), np.float32)
        z = aiodist.zeros(7, np.int64)
        assert shared(x, pg) and shared(z, pg)
        assert x.shape == (3, 50_000) and x.dtype == np.float32 and x.flags.c_contiguous
        assert (z == 0).all()
        x[:] = np.arange(x.size, dtype=np.float32).reshape(x.shape) * (rank + 1)
        await aiodist.all_reduce(x)
        expected = np.arange(x.size, dtype=np.float32).reshape(x.shape) * sum(range(1, size + 1))
        np.testing.assert_array_equal(x, expected)
        # A view of a shared array is read in place too.
        z[:] = rank
        await aiodist.all_reduce(z[2:5], op=aiodist.ReduceOp.MAX)
        assert z.tolist() == [rank, rank, size - 1, size - 1, size - 1, rank, rank]

    await run_world(rank_fn, n, transport="shm")


async def test_a_subgroup_gets_its_own_shared_arrays() -> None:
    async def rank_fn(rank: int, size: int) -> None:
        sub = await aiodist.new_group([0, 2])
        if rank == 1:
            with pytest.raises(aiodist.DistUsageError, match=r"^empty: this rank is not a"):
                aiodist.empty(4, np.float64, group=sub)
            return
        assert isinstance(sub, ProcessGroup)
        x = aiodist.empty(4, np.float64, group=sub)
        assert shared(x, sub)
        x[:] = rank + 0.5
        await aiodist.broadcast(x, src=2, group=sub)
        assert x.tolist() == [2.5] * 4

    await run_world(rank_fn, 3, transport="shm")


def in_place(group: ProcessGroup) -> int:
    """How many collectives of ``group``'s workspace had inputs peers read in place."""
    workspace: Any = group.paths.get("cpu")
    stats: int = workspace.ws.statistics().in_place
    return stats


@pytest.mark.both_loops
async def test_a_shared_array_is_read_in_place_by_every_group_on_the_host() -> None:
    # Made for the world; then reduced in a subgroup, and in the world that replaces the
    # first when a rank leaves (shrink_group): read in place there too, not copied.
    async def rank_fn(rank: int, size: int) -> list[float] | None:
        x = aiodist.empty(1 << 18, np.float32)
        sub = await aiodist.new_group([0, 1, 2])
        if rank == 3:
            return None  # leaves
        assert isinstance(sub, ProcessGroup)
        x[:] = rank + 1
        await aiodist.all_reduce(x, group=sub)
        assert in_place(sub) == 1
        sums = [float(x[0]), float(x[-1])]
        pg = await aiodist.shrink_group([3])
        x[:] = 10 * (rank + 1)
        await aiodist.all_reduce(x, op=aiodist.ReduceOp.MAX)
        assert in_place(pg) == 1
        return [*sums, float(x[0]), float(x[-1])]

    results = await run_world(rank_fn, 4, transport="shm")
    assert results == [[6.0, 6.0, 30.0, 30.0]] * 3 + [None]


async def test_over_tcp_they_are_ordinary_arrays() -> None:
    async def rank_fn(rank: int, size: int) -> None:
        x = aiodist.zeros((2, 2), np.complex64)
        assert type(x) is np.ndarray and x.dtype == np.complex64 and (x == 0).all()
        assert not shared(x, aiodist.group.current_world().default_group)
        x += rank + 1j
        await aiodist.all_reduce(x)
        assert (x == sum(range(size)) + size * 1j).all()

    await run_world(rank_fn, 2, transport="tcp")


@pytest.mark.parametrize(
    ("shape", "dtype", "message"),
    [
        ((2, -1), np.float32, r"^empty: shape must hold non-negative ints, got \(2, -1\)$"),
        ("ab", np.float32, r"^empty: shape must be an int or a tuple of ints, got 'ab'$"),
        (3, object, r"^empty: the array has unsupported dtype object; collectives take "),
        (3, "nonsense", r"^empty: dtype must be a numpy dtype, got 'nonsense'"),
    ],
)
async def test_bad_shapes_and_dtypes_are_named(shape: Any, dtype: Any, message: str) -> None:
    async def rank_fn(rank: int, size: int) -> None:
        with pytest.raises(aiodist.DistUsageError, match=message):
            aiodist.empty(shape, dtype)
        # Nothing was taken from the group: the next collective works.
        x = aiodist.empty(2, np.int32)
        x[:] = 1
        await aiodist.all_reduce(x)
        assert x.tolist() == [size, size]

    await run_world(rank_fn, 2, transport="shm")


def test_before_init_the_error_says_what_to_do() -> None:
    with pytest.raises(aiodist.DistUsageError, match=r"^zeros needs the default process group"):
        aiodist.sync.zeros(3, np.float32)


async def test_an_array_collected_while_its_thread_holds_the_index_is_forgotten() -> None:
    # The garbage collector may run a shared array's finalizer on a thread that holds the
    # index of live arrays (an allocation under it collects): it must not wait for the
    # index, which this thread holds (it did: a hang in locate(), seen on Python 3.12).
    ws = await NodeWorkspace.create(aiodist.HashStore(), 0, 1)
    try:
        x = _shared_array.empty((1024,), np.float32, ws)
        freed = _shared_array._by_start[x.__array_interface__["data"][0]]
        cycle: list[object] = [x]
        cycle.append(cycle)  # only the cycle holds it: the collector frees it
        del x, cycle
        with _shared_array._index():
            gc.collect()
        y = _shared_array.empty((8,), np.float64, ws)
        assert freed not in _shared_array._by_start.values()
        assert _shared_array.locate(y, ws) is not None
        assert _shared_array.locate(np.ones(3), ws) is None
    finally:
        await ws.aclose()
