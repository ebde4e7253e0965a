"""Property-based tests: random world sizes, shapes, dtypes and ops, against numpy."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from collective_helpers import RUNNERS, numpy_reduce, sample
from hypothesis import HealthCheck, given, settings, strategies as st

from aiodist import collectives as coll
from aiodist._arrays._reduce import ReduceOp, check_reduce_op
from aiodist.errors import DistUsageError
from aiodist.transport.base import OpComm

pytestmark = pytest.mark.both_loops  # the standard loop (asyncio.run, uvicorn) too

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes")

DTYPES = [
    np.dtype(t)
    for t in (
        np.bool_,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint16,
        np.uint32,
        np.uint64,
        np.float16,
        np.float32,
        np.float64,
        np.complex64,
        np.complex128,
        ml_dtypes.bfloat16,
    )
]
COLLECTIVES = [
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "gather",
    "scatter",
    "reduce_scatter",
    "all_to_all",
    "barrier",
]


def _supported(op: ReduceOp, dtype: np.dtype[Any]) -> bool:
    try:
        check_reduce_op(op, dtype)
    except DistUsageError:
        return False
    return True


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(1, 8))
    dtype = draw(st.sampled_from(DTYPES))
    return {
        "name": draw(st.sampled_from(COLLECTIVES)),
        "n": n,
        "dtype": dtype,
        "shape": draw(st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)),
        "op": draw(st.sampled_from([op for op in ReduceOp if _supported(op, dtype)])),
        "root": draw(st.integers(0, n - 1)),
        "algorithm": draw(st.sampled_from(["auto", "recursive_doubling", "ring"])),
        "chunk": draw(st.sampled_from([None, 1, 6, 64])),
        "a2a_sizes": draw(
            st.lists(st.lists(st.integers(0, 4), min_size=n, max_size=n), min_size=n, max_size=n)
        ),
        "seed": draw(st.integers(0, 2**16)),
    }


async def check_case(case: dict[str, Any], transport: str) -> None:
    """Run one collective on ``case["n"]`` ranks and compare every rank with numpy."""
    name, n, dtype, shape, op, root = (
        case[k] for k in ("name", "n", "dtype", "shape", "op", "root")
    )
    chunk = case["chunk"]
    seed = case["seed"]
    xs = [sample(dtype, shape, seed + r, op) for r in range(n)]
    originals = [x.copy() for x in xs]
    run = RUNNERS[transport]

    if name == "all_reduce":

        async def rank(comm: OpComm) -> None:
            await coll.all_reduce(comm, xs[comm.rank], op, algorithm=case["algorithm"])

        await run(n, rank)
        for x in xs:
            _equal(x, numpy_reduce(op, originals))
    elif name == "broadcast":

        async def rank(comm: OpComm) -> None:
            await coll.broadcast(comm, xs[comm.rank], root, chunk_bytes=chunk)

        await run(n, rank)
        for x in xs:
            _equal(x, originals[root])
    elif name == "reduce":

        async def rank(comm: OpComm) -> None:
            await coll.reduce(comm, xs[comm.rank], root, op, chunk_bytes=chunk)

        await run(n, rank)
        for r, x in enumerate(xs):
            _equal(x, numpy_reduce(op, originals) if r == root else originals[r])
    elif name == "all_gather":
        outs = [np.zeros((n, *shape), dtype) for _ in range(n)]

        async def rank(comm: OpComm) -> None:
            big = outs[comm.rank]
            await coll.all_gather(
                comm, [big[i, ...] for i in range(n)], xs[comm.rank], chunk_bytes=chunk
            )

        await run(n, rank)
        for out in outs:
            _equal(out, np.stack(originals))
    elif name == "gather":
        outs = [np.zeros(shape, dtype) for _ in range(n)]

        async def rank(comm: OpComm) -> None:
            await coll.gather(comm, outs if comm.rank == root else None, xs[comm.rank], root)

        await run(n, rank)
        _equal(np.stack(outs), np.stack(originals))
    elif name == "scatter":
        ins = [sample(dtype, shape, seed + 100 + i, op) for i in range(n)]
        outs = [np.zeros(shape, dtype) for _ in range(n)]

        async def rank(comm: OpComm) -> None:
            await coll.scatter(comm, outs[comm.rank], ins if comm.rank == root else None, root)

        await run(n, rank)
        for r in range(n):
            _equal(outs[r], ins[r])
    elif name == "reduce_scatter":
        ins = [[sample(dtype, shape, seed + r * n + i, op) for i in range(n)] for r in range(n)]
        before = [[a.copy() for a in row] for row in ins]
        outs = [np.zeros(shape, dtype) for _ in range(n)]

        async def rank(comm: OpComm) -> None:
            await coll.reduce_scatter(comm, outs[comm.rank], ins[comm.rank], op, chunk_bytes=chunk)

        await run(n, rank)
        for r in range(n):
            _equal(outs[r], numpy_reduce(op, [before[s][r] for s in range(n)]))
            for i in range(n):
                _equal(ins[r][i], before[r][i])
    elif name == "all_to_all":
        sizes = case["a2a_sizes"]  # sizes[s][d]: elements rank s sends rank d
        ins = [
            [sample(dtype, (sizes[s][d],), seed + s * n + d) for d in range(n)] for s in range(n)
        ]
        outs = [[np.zeros(sizes[s][d], dtype) for s in range(n)] for d in range(n)]

        async def rank(comm: OpComm) -> None:
            await coll.all_to_all(comm, outs[comm.rank], ins[comm.rank])

        await run(n, rank)
        for d in range(n):
            for s in range(n):
                _equal(outs[d][s], ins[s][d])
    else:

        async def rank(comm: OpComm) -> None:
            await coll.barrier(comm)

        await run(n, rank)


def _equal(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.dtype == expected.dtype
    assert got.shape == expected.shape
    if got.dtype.kind in "fcV":
        # Values, not bytes: a product's zero may carry either sign depending on order.
        np.testing.assert_array_equal(got.astype(np.complex128), expected.astype(np.complex128))
    else:
        assert got.tobytes() == expected.tobytes(), (got, expected)


@settings(
    max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=cases())
async def test_collectives_match_numpy_in_process(case: dict[str, Any]) -> None:
    await check_case(case, "local")


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=cases())
async def test_collectives_match_numpy_over_tcp(case: dict[str, Any]) -> None:
    await check_case(case, "tcp")
