"""Object collectives: pickled Python objects of different sizes per rank."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
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


class Code:
    """An object whose unpickling could run code: weights_only refuses it."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("this must not run",))


async def test_weights_only_unpickles_data_and_refuses_code() -> None:
    data = {"w": np.arange(3.0), "step": np.int64(7), "cfg": OrderedDict(lr=0.1), "s": {1, 2j}}

    async def fn(rank: int, size: int) -> tuple[list[Any], list[Any]]:
        objects: list[Any] = [data, np.dtype("f4")] if rank == 0 else [None, None]
        await aiodist.broadcast_object_list(objects, src=0, weights_only=True)
        gathered: list[Any] = [None] * size
        await aiodist.all_gather_object(gathered, [rank, b"x"], weights_only=True)
        return objects, gathered

    for objects, gathered in await run_world(fn, 2):
        np.testing.assert_array_equal(objects[0]["w"], data["w"])
        assert objects[0]["step"] == 7 and objects[0]["cfg"] == data["cfg"]
        assert objects[0]["s"] == data["s"] and objects[1] == np.dtype("f4")
        assert gathered == [[0, b"x"], [1, b"x"]]

    # Code is refused on every rank that receives it; the group goes on.
    refusal = (
        "received bytes did not unpickle: weights_only=True does not unpickle builtins.print: "
        "only builtin values, containers and numpy arrays"
    )

    async def collective(rank: int, size: int) -> None:
        out: list[Any] = [None] * size
        with pytest.raises(aiodist.DistError) as refused:
            await aiodist.all_gather_object(out, Code() if rank == 0 else rank, weights_only=True)
        assert str(refused.value) == f"object from group rank 0: {refusal}"
        x = np.full(3, rank + 1.0)
        await aiodist.all_reduce(x)
        np.testing.assert_array_equal(x, [3.0] * 3)

    await run_world(collective, 2)

    async def p2p(rank: int, size: int) -> None:
        if rank == 0:
            await aiodist.send_object_list([Code()], dst=1)
        else:
            with pytest.raises(aiodist.DistError) as refused:
                await aiodist.recv_object_list([None], src=0, weights_only=True)
            assert str(refused.value) == f"object_list[0]: {refusal}"
        await aiodist.barrier()

    await run_world(p2p, 2)


async def test_weights_only_must_be_a_bool() -> None:
    async def fn(rank: int, size: int) -> None:
        with pytest.raises(aiodist.DistUsageError, match="weights_only must be True or False"):
            aiodist.gather_object(rank, None, dst=0, weights_only="yes")  # type: ignore[arg-type]

    await run_world(fn, 1)
