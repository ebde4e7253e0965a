"""A call alike to an earlier one reuses what its checks found; any difference is checked anew.

``all_reduce`` keeps what the checks of a call found (by intake, dtype, shape and op) for the
next call alike. These tests make a call, then calls that differ from it in one thing each
(dtype, shape, op, group, a read-only or non-contiguous output, an op given as an int or a
bool, an array subclass) and check every result against numpy, and every rejection on every
rank: the rank that made the mistake names it, the others name the rank that rejected.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

import aiodist
from aiodist import ReduceOp
from aiodist.testing import run_world

pytestmark = pytest.mark.both_loops


def _input(rank: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    return np.array((np.arange(int(np.prod(shape))).reshape(shape) % 5 + rank + 1), dtype)


def _expected(size: int, shape: tuple[int, ...], dtype: Any, op: ReduceOp) -> np.ndarray:
    xs = [_input(r, shape, dtype) for r in range(size)]
    if op is ReduceOp.SUM:
        return np.array(np.sum(xs, axis=0), dtype)
    if op is ReduceOp.PRODUCT:
        return np.array(np.prod(xs, axis=0), dtype)
    if op is ReduceOp.MAX:
        return np.max(xs, axis=0)
    if op is ReduceOp.MIN:
        return np.min(xs, axis=0)
    assert op is ReduceOp.AVG
    return np.array(np.sum(xs, axis=0) / size, dtype)


async def _reduces_alike(rank: int, size: int) -> int:
    """Calls that differ from the one before in one thing each, twice in a row (the second
    reuses the first's checks): every result equals numpy."""
    calls = [
        ((4,), np.float32, ReduceOp.SUM),
        ((4,), np.float64, ReduceOp.SUM),  # dtype
        ((2, 2), np.float64, ReduceOp.SUM),  # shape, same size
        ((5,), np.float64, ReduceOp.SUM),  # size
        ((5,), np.float64, ReduceOp.MAX),  # op
        ((5,), np.float64, ReduceOp.AVG),
        ((5,), np.int32, ReduceOp.PRODUCT),
        ((), np.int64, ReduceOp.MIN),  # 0-d
        ((0,), np.float32, ReduceOp.SUM),  # empty
        ((4,), np.float32, ReduceOp.SUM),  # the first again
    ]
    done = 0
    for shape, dtype, op in calls:
        for _ in range(2):
            x = _input(rank, shape, dtype)
            out = await aiodist.all_reduce(x, op=op)
            assert out is x
            np.testing.assert_array_equal(x, _expected(size, shape, dtype, op))
            assert x.dtype == np.dtype(dtype) and x.shape == shape
            done += 1
    # The same array again, and its op as an int (the same reduction).
    x = _input(rank, (3,), np.float32)
    await aiodist.all_reduce(x)
    x[...] = _input(rank, (3,), np.float32)
    await aiodist.all_reduce(x, op=int(ReduceOp.MAX))
    np.testing.assert_array_equal(x, _expected(size, (3,), np.float32, ReduceOp.MAX))
    # A subgroup of every rank but the last, between calls alike on the world.
    sub = await aiodist.new_group(list(range(size - 1)))
    for group, n in ((None, size), (sub, size - 1), (None, size)):
        if group is not None and rank == size - 1:
            continue
        x = _input(rank, (4,), np.float32)
        await aiodist.all_reduce(x, group=group)
        np.testing.assert_array_equal(x, _expected(n, (4,), np.float32, ReduceOp.SUM))
    return done


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("size", [2, 3])
async def test_calls_alike_and_unlike_give_numpys_results(size: int, transport: str) -> None:
    assert await run_world(_reduces_alike, size, timeout=60, transport=transport) == [20] * size


def _bad(kind: str) -> tuple[np.ndarray, Any, str]:
    """A call that differs from a good ``all_reduce(float32 (4,), SUM)`` in one thing that
    makes it wrong, and the error it gets."""
    x = np.ones(4, np.float32)
    if kind == "read-only":
        x.flags.writeable = False
        return x, ReduceOp.SUM, "all_reduce: tensor is read-only, but the collective writes"
    if kind == "not contiguous":
        return np.ones(8, np.float32)[::2], ReduceOp.SUM, "all_reduce: tensor is not C-contiguous"
    if kind == "op the dtype cannot take":
        return x, ReduceOp.BAND, "all_reduce: ReduceOp.BAND is not supported for dtype float32"
    if kind == "bool op":  # True == ReduceOp.AVG, but a bool is no reduction
        return x, True, "all_reduce: op must be an aiodist.ReduceOp, got True"
    if kind == "byte order":
        return x.astype(">f4"), ReduceOp.SUM, "all_reduce: tensor has dtype >f4 in non-native"
    assert kind == "object dtype"
    return np.ones(4, object), ReduceOp.SUM, "all_reduce: tensor has unsupported dtype object"


KINDS = [
    "read-only",
    "not contiguous",
    "op the dtype cannot take",
    "bool op",
    "byte order",
    "object dtype",
]


async def _rejected_after_calls_alike(rank: int, size: int, symmetric: bool) -> list[str]:
    seen = []
    for kind in KINDS:
        good = np.ones(4, np.float32)
        await aiodist.all_reduce(good, op=ReduceOp.AVG if kind == "bool op" else ReduceOp.SUM)
        await aiodist.all_reduce(good)  # (now reused)
        x, op, pattern = _bad(kind) if symmetric or rank == 0 else (good, ReduceOp.SUM, "")
        if not pattern:
            pattern = "was rejected by rank 0: " + _bad(kind)[2]
        with pytest.raises(aiodist.DistUsageError, match=pattern.replace("(", r"\(")) as info:
            await aiodist.all_reduce(x, op=op)
        seen.append(str(info.value))
        # The group goes on: the next call equals numpy everywhere.
        y = _input(rank, (4,), np.float32)
        await aiodist.all_reduce(y)
        np.testing.assert_array_equal(y, _expected(size, (4,), np.float32, ReduceOp.SUM))
    return seen


@pytest.mark.parametrize("symmetric", [False, True], ids=["one-sided", "symmetric"])
@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("size", [2, 3])
async def test_a_bad_call_after_good_ones_is_rejected_on_every_rank(
    size: int, transport: str, symmetric: bool
) -> None:
    fn = functools.partial(_rejected_after_calls_alike, symmetric=symmetric)
    results = await run_world(fn, size, timeout=60, transport=transport)
    assert all(len(r) == len(KINDS) for r in results)


async def _subclass(rank: int, size: int) -> None:
    # An ndarray subclass takes the whole intake, after plain arrays of its dtype and shape.
    x = _input(rank, (4,), np.float64)
    await aiodist.all_reduce(x)
    tagged = _input(rank, (4,), np.float64).view(_Tagged)
    assert await aiodist.all_reduce(tagged) is tagged
    np.testing.assert_array_equal(tagged, _expected(size, (4,), np.float64, ReduceOp.SUM))


class _Tagged(np.ndarray):
    pass


async def test_an_array_subclass_is_checked_in_full() -> None:
    await run_world(_subclass, 2, timeout=30, transport="shm")


async def _unlike_peers(rank: int, size: int) -> list[str]:
    # After calls alike, rank 0 changes the shape (same size), then the dtype (same bytes):
    # its fingerprint says so, and every rank raises the mismatch, naming both calls.
    seen = []
    for shape, dtype, what in (((2, 2), np.float32, "shape=(2, 2)"), ((4,), np.int32, "int32")):
        for _ in range(2):
            await aiodist.all_reduce(np.ones(4, np.float32))
        x = np.ones(shape if rank == 0 else (4,), dtype if rank == 0 else np.float32)
        with pytest.raises(aiodist.DistUsageError, match="collective mismatch") as info:
            await aiodist.all_reduce(x)
        assert what in str(info.value) and "shape=(4,), dtype=float32" in str(info.value)
        seen.append(str(info.value))
        y = _input(rank, (4,), np.float32)
        await aiodist.all_reduce(y)
        np.testing.assert_array_equal(y, _expected(size, (4,), np.float32, ReduceOp.SUM))
    return seen


@pytest.mark.parametrize("size", [2, 3])
async def test_a_call_unlike_its_peers_after_calls_alike_is_a_mismatch_everywhere(
    size: int,
) -> None:
    # (Over shared memory the workspace finds a mismatch before any byte moves, and the
    # group goes on.)
    results = await run_world(_unlike_peers, size, timeout=60, transport="shm")
    assert all(len(r) == 2 for r in results)
