"""Mismatch detection: ranks that call different collectives get an error naming both calls."""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

import aiodist
from aiodist._arrays._fingerprint import NO_FINGERPRINT, describe, fingerprint
from aiodist.errors import DistError, DistUsageError
from aiodist.testing import run_world

pytestmark = pytest.mark.both_loops  # the standard loop (asyncio.run, uvicorn) too

TAIL = (
    "; every rank of a group must issue the same collectives, with the same shapes, dtypes, "
    "roots and reduce ops, in the same order"
)


def expected(rank: int, mine: str, peer: int, theirs: str, seq: int) -> str:
    return (
        f"collective mismatch: rank {rank} called {mine} as op #{seq} but rank {peer} "
        f"called {theirs}{TAIL}"
    )


Call = Callable[[int], Awaitable[Any]]


async def outcomes(calls: dict[int, Call], n: int, transport: str) -> list[tuple[Any, float]]:
    """Run ``calls[rank]`` (default ``calls[-1]``) on every rank; return (error, seconds)."""

    async def fn(rank: int, size: int) -> tuple[Any, float]:
        await aiodist.all_reduce(np.ones(2))  # connections up, so timings are the check's
        start = time.monotonic()
        try:
            await calls.get(rank, calls.get(-1))(rank)  # type: ignore[misc]
        except DistError as exc:
            return exc, time.monotonic() - start
        return None, time.monotonic() - start

    return await run_world(fn, n, timeout=20, transport=transport)  # type: ignore[arg-type]


def f32(n: int = 4) -> np.ndarray[Any, Any]:
    return np.ones(n, np.float32)


CASES = {
    "different op": (
        {0: lambda r: aiodist.all_reduce(f32()), 1: lambda r: aiodist.broadcast(f32(), 0)},
        "all_reduce(shape=(4,), dtype=float32, op=SUM)",
        "broadcast(shape=(4,), dtype=float32, src=0)",
    ),
    "shape": (
        {0: lambda r: aiodist.all_reduce(f32(4)), 1: lambda r: aiodist.all_reduce(f32(5))},
        "all_reduce(shape=(4,), dtype=float32, op=SUM)",
        "all_reduce(shape=(5,), dtype=float32, op=SUM)",
    ),
    "dtype": (
        {
            0: lambda r: aiodist.all_reduce(np.ones((2, 3), np.float32)),
            1: lambda r: aiodist.all_reduce(np.ones((2, 3), np.int32)),
        },
        "all_reduce(shape=(2, 3), dtype=float32, op=SUM)",
        "all_reduce(shape=(2, 3), dtype=int32, op=SUM)",
    ),
    "root": (
        {0: lambda r: aiodist.broadcast(f32(), 0), 1: lambda r: aiodist.broadcast(f32(), 1)},
        "broadcast(shape=(4,), dtype=float32, src=0)",
        "broadcast(shape=(4,), dtype=float32, src=1)",
    ),
    "reduce op": (
        {
            0: lambda r: aiodist.all_reduce(f32(), aiodist.ReduceOp.SUM),
            1: lambda r: aiodist.all_reduce(f32(), aiodist.ReduceOp.MAX),
        },
        "all_reduce(shape=(4,), dtype=float32, op=SUM)",
        "all_reduce(shape=(4,), dtype=float32, op=MAX)",
    ),
}


@pytest.mark.parametrize("transport", ["tcp", "local"])
@pytest.mark.parametrize("case", list(CASES))
async def test_two_ranks_each_name_both_calls(case: str, transport: str) -> None:
    calls, call0, call1 = CASES[case]
    (err0, t0), (err1, t1) = await outcomes(calls, 2, transport)
    # Both ranks receive a message of the other's call, so both see the mismatch.
    assert isinstance(err0, DistUsageError) and isinstance(err1, DistUsageError)
    assert str(err0) == expected(0, call0, 1, call1, 1)
    assert str(err1) == expected(1, call1, 0, call0, 1)
    assert max(t0, t1) < 2.0


@pytest.mark.parametrize("transport", ["tcp", "local"])
async def test_different_order_of_ops(transport: str) -> None:
    async def first_reduce(rank: int) -> None:
        await aiodist.all_reduce(f32())
        await aiodist.barrier()

    async def first_barrier(rank: int) -> None:
        await aiodist.barrier()
        await aiodist.all_reduce(f32())

    (err0, _), (err1, _) = await outcomes({0: first_reduce, 1: first_barrier}, 2, transport)
    ar = "all_reduce(shape=(4,), dtype=float32, op=SUM)"
    assert str(err0) == expected(0, ar, 1, "barrier()", 1)
    assert str(err1) == expected(1, "barrier()", 0, ar, 1)


async def test_payload_of_a_mismatched_call_never_reaches_the_buffer() -> None:
    # Rank 1 is a broadcast root sending 7s; rank 0's all_reduce must not take them in.
    seen: dict[int, Any] = {}

    async def call(rank: int) -> None:
        x = np.zeros(4, np.float32) if rank == 0 else np.full(4, 7, np.float32)
        seen[rank] = x
        await (aiodist.all_reduce(x) if rank == 0 else aiodist.broadcast(x, 1))

    (err0, _), _ = await outcomes({-1: call}, 2, "tcp")
    assert isinstance(err0, DistUsageError)
    assert (seen[0] == 0).all()


@pytest.mark.parametrize("n", [3, 4])
async def test_one_rank_with_another_shape_fails_every_rank_quickly(n: int) -> None:
    async def call(rank: int) -> None:
        await aiodist.all_reduce(f32(5 if rank == n - 1 else 4))

    results = await outcomes({-1: call}, n, "tcp")
    odd = "all_reduce(shape=(5,), dtype=float32, op=SUM)"
    usual = "all_reduce(shape=(4,), dtype=float32, op=SUM)"
    saw = 0
    for rank, (err, seconds) in enumerate(results):
        assert isinstance(err, DistError), rank  # nobody completes, nobody hangs
        assert seconds < 3.0
        if isinstance(err, DistUsageError):
            saw += 1
            text = str(err)
            if rank == n - 1:
                pattern = re.escape(expected(rank, odd, 99, usual, 1)).replace("99", r"\d")
                assert re.fullmatch(pattern, text), text
            else:
                assert text == expected(rank, usual, n - 1, odd, 1)
        else:
            assert "collective mismatch" in str(err), str(err)  # the abort names the cause
    assert saw >= 1


async def test_object_collectives_and_subgroups_are_checked() -> None:
    async def fn(rank: int, size: int) -> str:
        sub = await aiodist.new_group([0, 1])
        try:
            if rank == 0:
                await aiodist.all_gather_object([None, None], "x", group=sub)
            else:
                await aiodist.broadcast_object_list(["y"], 0, group=sub)
        except DistUsageError as exc:
            return str(exc)
        return "completed"

    got = await run_world(fn, 2, timeout=20)
    assert got[0] == (
        "collective mismatch: rank 0 called all_gather_object() as op #0 of group 1 but rank 1 "
        f"called broadcast_object_list(src=0){TAIL}"
    )


async def test_matching_calls_still_work_and_world_size_one() -> None:
    async def fn(rank: int, size: int) -> list[float]:
        x = np.arange(6, dtype=np.float64).reshape(2, 3) + rank
        await aiodist.all_reduce(x)
        await aiodist.broadcast(x, size - 1)
        return x.ravel().tolist()

    assert (await run_world(fn, 1, timeout=20))[0] == [0, 1, 2, 3, 4, 5]
    got = await run_world(fn, 3, timeout=20)
    assert got[0] == got[2] == [3.0 * i + 3 for i in range(6)]


def test_fingerprint_describes_the_call() -> None:
    assert describe(NO_FINGERPRINT) == "point-to-point"
    fp = fingerprint("reduce", dtype=np.dtype("int64"), shape=(2, 3, 4, 5, 6), root=2, reduce_op=4)
    assert describe(fp) == "reduce(shape=(2, 3, 4, 5, ... (5 dims)), dtype=int64, op=MAX, dst=2)"
    assert fingerprint("barrier") != fingerprint("all_to_all", dtype=np.dtype("bool"))
    assert fingerprint("all_reduce", shape=(2, 3, 4, 5, 6)) != fingerprint(
        "all_reduce", shape=(2, 3, 4, 5, 7)
    )
    with pytest.raises(DistUsageError, match="no fingerprint for unknown collective 'nope'"):
        fingerprint("nope")
