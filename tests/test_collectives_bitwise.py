"""Ordinary floats, not integers: every rank gets the same bits, close to numpy's result.

Integer-valued references hide the order of a floating-point reduction. Here the inputs are
random normals, and every rank's output must equal rank 0's bit for bit (a reduction that
some rank summed in another order would differ in the last bits), and match numpy's to
rounding. Each transport runs its own algorithms: TCP (ring and recursive doubling by
size), shared memory (the node workspace's direct algorithms), and large arrays in pieces.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import aiodist
from aiodist import ReduceOp
from aiodist.testing import run_world

pytestmark = pytest.mark.both_loops


def _inputs(rank: int, count: int, dtype: str) -> np.ndarray:
    return np.random.default_rng(1000 + rank).standard_normal(count).astype(dtype)


async def _all(rank: int, size: int, count: int, dtype: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT):
        x = _inputs(rank, count, dtype)
        await aiodist.all_reduce(x, op=op)
        out[f"all_reduce {op.name}"] = x
    y = np.empty(count, dtype)
    await aiodist.reduce_scatter_tensor(y, _inputs(rank, count * size, dtype))
    out["reduce_scatter_tensor"] = y
    z = _inputs(rank, count, dtype)
    await aiodist.reduce(z, dst=0)
    if rank == 0:
        out["reduce"] = z
    return out


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize(("count", "dtype"), [(5, "float64"), (200_003, "float32")])
async def test_every_rank_gets_the_same_bits(
    transport: str, size: int, count: int, dtype: str
) -> None:
    results = await run_world(
        lambda r, n: _all(r, n, count, dtype),
        size,
        transport=transport,  # type: ignore[arg-type]
        timeout=60,
    )
    inputs = [_inputs(r, count, dtype) for r in range(size)]
    tol = {"float64": 1e-12, "float32": 1e-4}[dtype]
    for op, expected in [
        ("all_reduce SUM", np.sum(inputs, axis=0)),
        ("all_reduce AVG", np.mean(inputs, axis=0)),
        ("all_reduce PRODUCT", np.prod(inputs, axis=0)),
    ]:
        for rank, got in enumerate(results):
            assert got[op].tobytes() == results[0][op].tobytes(), (op, rank)
        np.testing.assert_allclose(results[0][op], expected, rtol=tol, atol=tol)
    full = np.sum([_inputs(r, count * size, dtype) for r in range(size)], axis=0)
    for rank, got in enumerate(results):
        piece = full[rank * count : (rank + 1) * count]
        np.testing.assert_allclose(got["reduce_scatter_tensor"], piece, rtol=tol, atol=tol)
    np.testing.assert_allclose(results[0]["reduce"], np.sum(inputs, axis=0), rtol=tol, atol=tol)
