"""Property tests of the API's own work: reshaping, splitting and checking, vs numpy."""

from __future__ import annotations

import asyncio

import numpy as np
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import aiodist
from aiodist._util._loop import loop_factory
from aiodist.testing import run_world

DTYPES = ["int8", "int64", "uint16", "float32", "float64", "complex64"]
OPS = [aiodist.ReduceOp.SUM, aiodist.ReduceOp.MAX, aiodist.ReduceOp.PRODUCT]


def _run(coro_fn, n: int):
    with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
        return runner.run(run_world(coro_fn, n, timeout=30, transport="local"))


def _input(rank: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    rng = np.random.default_rng(rank)
    return rng.integers(1, 4, size=shape).astype(dtype)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 6),
    rows=st.integers(0, 3),
    cols=st.integers(1, 4),
    dtype=st.sampled_from(DTYPES),
    op=st.sampled_from(OPS),
)
def test_tensor_collectives_match_numpy(
    n: int, rows: int, cols: int, dtype: str, op: aiodist.ReduceOp
) -> None:
    # MAX is not defined on complex numbers (that error is tested elsewhere).
    assume(not (op is aiodist.ReduceOp.MAX and dtype.startswith("complex")))
    shape = (rows, cols)

    async def fn(rank: int, size: int) -> tuple[np.ndarray, ...]:
        x = _input(rank, shape, dtype)
        gathered = np.empty((size * rows, cols), dtype)
        await aiodist.all_gather_into_tensor(gathered, x)
        big = np.concatenate([_input(rank * 10 + k, shape, dtype) for k in range(size)])
        scattered = np.empty(shape, dtype)
        await aiodist.reduce_scatter_tensor(scattered, big, op=op)
        reduced = x.copy()
        await aiodist.all_reduce(reduced, op=op)
        return gathered, scattered, reduced

    ufunc = {aiodist.ReduceOp.SUM: np.add, aiodist.ReduceOp.MAX: np.maximum}.get(op, np.multiply)
    for r, (gathered, scattered, reduced) in enumerate(_run(fn, n)):
        np.testing.assert_array_equal(
            gathered, np.concatenate([_input(q, shape, dtype) for q in range(n)])
        )
        np.testing.assert_array_equal(
            scattered,
            ufunc.reduce([_input(q * 10 + r, shape, dtype) for q in range(n)], dtype=dtype),
        )
        np.testing.assert_array_equal(
            reduced, ufunc.reduce([_input(q, shape, dtype) for q in range(n)], dtype=dtype)
        )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), n=st.integers(1, 5), width=st.integers(1, 3))
def test_all_to_all_single_with_random_splits(data: st.DataObject, n: int, width: int) -> None:
    # splits[i][j]: rows rank i sends to rank j.
    splits = [[data.draw(st.integers(0, 3)) for _ in range(n)] for _ in range(n)]

    def block(i: int, j: int) -> np.ndarray:
        return np.full((splits[i][j], width), i * 100 + j, np.int32)

    async def fn(rank: int, size: int) -> np.ndarray:
        x = np.concatenate([block(rank, j) for j in range(size)])
        out = np.empty((sum(splits[i][rank] for i in range(size)), width), np.int32)
        await aiodist.all_to_all_single(
            out, x, [splits[i][rank] for i in range(size)], splits[rank]
        )
        return out

    for r, out in enumerate(_run(fn, n)):
        np.testing.assert_array_equal(out, np.concatenate([block(i, r) for i in range(n)]))
