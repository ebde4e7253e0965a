"""Object collectives: pickled Python objects of different sizes per rank."""

from __future__ import annotations

from typing import Any

import pytest

import aiodist
from aiodist.testing import run_world

pytestmark = pytest.mark.both_loops

SIZES = [1, 2, 3]


def obj(rank: int) -> dict[str, Any]:
    """A per-rank object whose pickle size differs between ranks."""
    return {"rank": rank, "payload": "x" * (rank * 37), "nested": [rank, (rank, None)]}


@pytest.mark.parametrize("n", SIZES)
async def test_broadcast_object_list(n: int) -> None:
    async def fn(rank: int, size: int) -> list[Any]:
        objects: list[Any] = [obj(0), {1, 2}, "text", None] if rank == size - 1 else [None] * 4
        got = await aiodist.broadcast_object_list(objects, src=size - 1)
        assert got is objects
        return objects

    for objects in await run_world(fn, n):
        assert objects == [obj(0), {1, 2}, "text", None]


@pytest.mark.parametrize("n", SIZES)
async def test_all_gather_object(n: int) -> None:
    async def fn(rank: int, size: int) -> list[Any]:
        out: list[Any] = [None] * size
        await aiodist.all_gather_object(out, obj(rank))
        return out

    for out in await run_world(fn, n):
        assert out == [obj(r) for r in range(n)]


@pytest.mark.parametrize("n", SIZES)
async def test_gather_object(n: int) -> None:
    async def fn(rank: int, size: int) -> list[Any] | None:
        out: list[Any] | None = [None] * size if rank == 0 else None
        return await aiodist.gather_object(obj(rank), out, dst=0)

    results = await run_world(fn, n)
    assert results[0] == [obj(r) for r in range(n)]
    assert results[1:] == [None] * (n - 1)


@pytest.mark.parametrize("n", SIZES)
async def test_scatter_object_list(n: int) -> None:
    async def fn(rank: int, size: int) -> Any:
        ins = [obj(r) for r in range(size)] if rank == 0 else None
        out: list[Any] = [None]
        await aiodist.scatter_object_list(out, ins, src=0)
        return out[0]

    assert await run_world(fn, n) == [obj(r) for r in range(n)]


async def test_object_usage_errors() -> None:
    async def unpicklable(rank: int, size: int) -> None:
        if rank == 0:
            with pytest.raises(aiodist.DistUsageError, match=r"object_list\[0\] cannot be pickled"):
                aiodist.broadcast_object_list([lambda: 1], src=0)
        else:
            # Rank 0 rejected the call: this rank learns why instead of waiting.
            with pytest.raises(aiodist.DistUsageError, match=r"rejected by rank 0: .*pickled"):
                await aiodist.broadcast_object_list([None], src=0)

    await run_world(unpicklable, 2, timeout=20)

    async def wrong_length(rank: int, size: int) -> None:
        with pytest.raises(aiodist.DistUsageError, match="object_list has 1 entries; it needs 2"):
            aiodist.all_gather_object([None], rank)

    await run_world(wrong_length, 2)

    async def list_on_non_root(rank: int, size: int) -> None:
        if rank == 1:
            with pytest.raises(
                aiodist.DistUsageError, match="object_gather_list must only be given on the root"
            ):
                aiodist.gather_object(rank, [None, None], dst=0)
        else:
            with pytest.raises(aiodist.DistUsageError, match="rejected by rank 1"):
                await aiodist.gather_object(rank, [None, None], dst=0)

    await run_world(list_on_non_root, 2, timeout=20)
