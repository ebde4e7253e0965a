"""The collective matrix through the blocking API, in real processes (env:// rendezvous)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from collective_helpers import numpy_reduce

import aiodist.sync as dist
from aiodist import ReduceOp
from aiodist.testing import run_world_processes

pytestmark = pytest.mark.multiprocess

OPS = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG]
BITWISE = [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR]
DTYPES = ["float64", "float32", "float16", "int64", "int32", "uint8", "complex64", "bool"]


def data(rank: int, dtype: str, n: int = 6) -> np.ndarray:
    rng = np.random.default_rng(100 + rank)
    return rng.integers(1 if dtype == "bool" else -3, 4, n).astype(dtype)


def supported(op: ReduceOp, dtype: str) -> bool:
    kind = np.dtype(dtype).kind
    if op in BITWISE:
        return kind in "iub"
    if kind == "b":
        return op in (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)
    if kind == "c":
        return op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.AVG)
    return True


def matrix(rank: int, size: int) -> int:
    """Every reduction op x dtype through all_reduce (blocking and async_op), reduce and
    reduce_scatter_tensor; returns how many cases ran."""
    cases = 0
    for dtype in DTYPES:
        for op in OPS + BITWISE:
            if not supported(op, dtype):
                continue
            xs = [data(r, dtype) for r in range(size)]
            expected = numpy_reduce(op, xs)
            close = {"rtol": 1e-2} if dtype == "float16" else {}

            x = data(rank, dtype)
            assert dist.all_reduce(x, op=op) is None
            np.testing.assert_allclose(x, expected, **close, err_msg=f"all_reduce {op} {dtype}")

            y = data(rank, dtype)
            work = dist.all_reduce(y, op, None, True)
            assert work is not None and work.wait() and work.is_success()
            np.testing.assert_allclose(work.get_future().result(), expected, **close)

            z = data(rank, dtype)
            dist.reduce(z, dst=size - 1, op=op)
            if rank == size - 1:
                np.testing.assert_allclose(z, expected, **close, err_msg=f"reduce {op} {dtype}")

            chunks = [np.roll(data(rank, dtype), q) for q in range(size)]
            out = np.empty(6, dtype)
            dist.reduce_scatter_tensor(out, np.concatenate(chunks), op=op)
            mine = numpy_reduce(op, [np.roll(data(r, dtype), rank) for r in range(size)])
            np.testing.assert_allclose(out, mine, **close, err_msg=f"reduce_scatter {op} {dtype}")
            cases += 1
    return cases


def every_operation(rank: int, size: int) -> int:
    """Each blocking operation once, checked against numpy (the async suite's twin)."""
    ranks = range(size)
    b = np.arange(4.0) if rank == 0 else np.zeros(4)
    dist.broadcast(b, src=0)
    np.testing.assert_array_equal(b, np.arange(4.0))
    outs = [np.empty(2, np.int32) for _ in ranks]
    dist.all_gather(outs, np.array([rank, -rank], np.int32))
    np.testing.assert_array_equal(np.stack(outs), [[q, -q] for q in ranks])
    flat = np.empty(2 * size, np.int32)
    dist.all_gather_into_tensor(flat, np.array([rank, rank], np.int32))
    np.testing.assert_array_equal(flat, np.repeat(np.arange(size), 2))
    g = [np.empty(1) for _ in ranks] if rank == 0 else None
    dist.gather(np.array([rank * 2.0]), g, dst=0)
    if g is not None:
        assert [float(v[0]) for v in g] == [q * 2.0 for q in ranks]
    s = np.empty(1)
    dist.scatter(s, [np.array([q + 0.5]) for q in ranks] if rank == 0 else None, src=0)
    assert s[0] == rank + 0.5
    rs = np.empty(2)
    dist.reduce_scatter(rs, [np.full(2, float(q)) for q in ranks])
    assert (rs == rank * size).all()
    a2a = [np.empty(1, np.int64) for _ in ranks]
    dist.all_to_all(a2a, [np.array([rank * 10 + q]) for q in ranks])
    assert [int(v[0]) for v in a2a] == [q * 10 + rank for q in ranks]
    single = np.empty(size, np.int64)
    work = dist.all_to_all_single(single, np.arange(size) + rank * 100, async_op=True)
    assert work is not None and work.wait(timeout=30)
    np.testing.assert_array_equal(single, [q * 100 + rank for q in ranks])
    dist.barrier()
    dist.monitored_barrier(timeout=30, wait_all_ranks=True)
    if rank == 0:
        senders = set()
        for _ in range(size - 1):
            one = np.empty(1)
            senders.add(dist.recv(one))
            assert one[0] == 7.0
        assert senders == set(range(1, size))
    else:
        dist.send(np.array([7.0]), dst=0)
    got: list[Any] | None = [None] * size if rank == 0 else None
    dist.gather_object(rank, got, dst=0)
    assert got == (list(ranks) if rank == 0 else None)
    out: list[object] = [None]
    dist.scatter_object_list(out, [f"to {q}" for q in ranks] if rank == 0 else None, src=0)
    assert out == [f"to {rank}"]
    mine, _ = dist.new_subgroups(1)
    sub = np.array([1.0])
    dist.all_reduce(sub, group=mine)
    assert sub[0] == 1.0
    return 1


def _every_operation_and_the_matrix(rank: int, size: int) -> tuple[int, int]:
    return every_operation(rank, size), matrix(rank, size)


def test_collective_matrix_through_the_blocking_api() -> None:
    results = run_world_processes(_every_operation_and_the_matrix, 3, timeout=120)
    cases = results[0][1]
    assert cases > 40 and all(r == (1, cases) for r in results)
