"""Collectives on a world spread over hosts, for ``two_level_worker.py`` to run and
``test_two_level.py`` to check: each case's inputs, its run through the public API, and the
numpy reference of what each rank ends with (as a digest of the result's bytes)."""

from __future__ import annotations

import hashlib
from collections.abc import Coroutine
from typing import Any, TypeVar, cast

import numpy as np
from collective_helpers import numpy_reduce, sample

import aiodist
import aiodist.sync
from aiodist._arrays._reduce import ReduceOp

T = TypeVar("T")

#: Below the ring threshold (one column across hosts) and above it (a column per rank).
SMALL, LARGE = 7, 20000

#: name -> (operation, reduce op, dtype, count)
CASES: dict[str, tuple[str, ReduceOp, str, int]] = {
    **{
        f"all_reduce {op.name} {dtype} {count}": ("all_reduce", op, dtype, count)
        for op, dtype in [
            (ReduceOp.SUM, "int64"),
            (ReduceOp.AVG, "float32"),
            (ReduceOp.AVG, "int32"),
            (ReduceOp.PRODUCT, "float64"),
            (ReduceOp.MIN, "int16"),
            (ReduceOp.MAX, "float32"),
            (ReduceOp.BAND, "uint8"),
            (ReduceOp.BOR, "int32"),
            (ReduceOp.BXOR, "uint64"),
        ]
        for count in (SMALL, LARGE)
    },
    "all_reduce PREMUL_SUM float64": ("all_reduce_premul", ReduceOp.SUM, "float64", LARGE),
    "all_reduce of ordinary floats": ("all_reduce_floats", ReduceOp.SUM, "float32", LARGE),
    "broadcast from 0": ("broadcast", ReduceOp.SUM, "float64", LARGE),
    "broadcast from 2": ("broadcast", ReduceOp.SUM, "int8", SMALL),
    "reduce onto 1": ("reduce", ReduceOp.SUM, "int64", LARGE),
    "reduce onto 2": ("reduce", ReduceOp.MAX, "float32", SMALL),
    "all_gather": ("all_gather", ReduceOp.SUM, "int32", 5000),
    "all_gather_into_tensor": ("all_gather_into_tensor", ReduceOp.SUM, "float64", SMALL),
    "reduce_scatter": ("reduce_scatter", ReduceOp.SUM, "int64", 5000),
    "reduce_scatter_tensor AVG": ("reduce_scatter_tensor", ReduceOp.AVG, "float32", SMALL),
    "barrier": ("barrier", ReduceOp.SUM, "int8", 0),
}

#: The root of the rooted cases (a global rank, in every group 0-2 too).
_ROOTS = {"broadcast from 0": 0, "broadcast from 2": 2, "reduce onto 1": 1, "reduce onto 2": 2}


def _input(case: str, rank: int, n: int) -> np.ndarray:
    kind, op, dtype, count = CASES[case]
    if kind == "all_reduce_floats":
        return np.random.default_rng(rank).standard_normal(count).astype(dtype)
    rows = n if kind in ("reduce_scatter", "reduce_scatter_tensor") else 1
    return sample(np.dtype(dtype), (rows * count,), seed=rank, op=op)


def _digest(x: np.ndarray | list[np.ndarray]) -> str:
    parts = x if isinstance(x, list) else [x]
    return hashlib.sha256(b"".join(p.tobytes() for p in parts)).hexdigest()


async def call(api: Any, name: str, *args: Any, **kwargs: Any) -> None:
    """Call ``api.name(*args, **kwargs)``, awaiting it when ``api`` is ``aiodist``."""
    result = getattr(api, name)(*args, **kwargs)
    if api is aiodist:
        await result


async def run_case(case: str, rank: int, n: int, group: Any, api: Any = aiodist) -> str:
    """Run ``case`` as ``rank`` of ``n`` (in ``group``, default the world) through ``api``
    (``aiodist``, or ``aiodist.sync`` run by :func:`finish_now`); return the digest of
    what this rank ends with."""
    kind, op, _, count = CASES[case]
    x = _input(case, rank, n)
    root = _ROOTS.get(case, 0)
    if kind in ("all_reduce", "all_reduce_floats"):
        await call(api, "all_reduce", x, op, group=group)
    elif kind == "all_reduce_premul":
        await call(api, "all_reduce", x, aiodist.make_premul_sum(0.5), group=group)
    elif kind == "broadcast":
        await call(api, "broadcast", x, src=root, group=group)
    elif kind == "reduce":
        await call(api, "reduce", x, dst=root, op=op, group=group)
    elif kind == "all_gather":
        outs = [np.empty_like(x) for _ in range(n)]
        await call(api, "all_gather", outs, x, group=group)
        return _digest(outs)
    elif kind == "all_gather_into_tensor":
        out = np.empty(n * count, x.dtype)
        await call(api, "all_gather_into_tensor", out, x, group=group)
        return _digest(out)
    elif kind == "reduce_scatter":
        out = np.empty(count, x.dtype)
        await call(api, "reduce_scatter", out, list(x.reshape(n, count)), op, group=group)
        return _digest(out)
    elif kind == "reduce_scatter_tensor":
        out = np.empty(count, x.dtype)
        await call(api, "reduce_scatter_tensor", out, x, op, group=group)
        return _digest(out)
    else:
        await call(api, "barrier", group=group)
    return _digest(x)


def expected(case: str, rank: int, n: int) -> str | None:
    """The digest ``run_case`` must return on ``rank`` of ``n``; ``None`` where only the
    ranks' agreement is checked (sums of ordinary floats depend on the order of addition)."""
    kind, op, _, count = CASES[case]
    xs = [_input(case, r, n) for r in range(n)]
    root = _ROOTS.get(case, 0)
    if kind == "all_reduce_floats":
        return None
    if kind == "all_reduce":
        return _digest(numpy_reduce(op, xs))
    if kind == "all_reduce_premul":
        return _digest(numpy_reduce(ReduceOp.SUM, [x * 0.5 for x in xs]))
    if kind == "broadcast":
        return _digest(xs[root])
    if kind == "reduce":
        return _digest(numpy_reduce(op, xs) if rank == root else xs[rank])
    if kind in ("all_gather", "all_gather_into_tensor"):
        return _digest(xs)
    if kind in ("reduce_scatter", "reduce_scatter_tensor"):
        return _digest(numpy_reduce(op, [x.reshape(n, count)[rank] for x in xs]))
    return _digest(xs[rank])


def finish_now(coro: Coroutine[Any, Any, T]) -> T:
    """The result of ``coro``, which runs :func:`run_case` through ``aiodist.sync``: its calls
    block and never suspend it, so it runs to its end in one step, with no event loop here."""
    try:
        coro.send(None)
    except StopIteration as done:
        return cast(T, done.value)
    coro.close()
    raise AssertionError("a run through aiodist.sync suspended")
