"""Every operation is declared once (``aiodist.group._operations``): the public API, its blocking
twins, the backends' tables and the fingerprint table agree with the declarations; the
operations added through them (``all_gather_single``, ``reduce_scatter_single``) and
``record_comm`` work end to end."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest

import aiodist
import aiodist.debug
import aiodist.sync as dist
from aiodist._arrays import _fingerprint
from aiodist.backends import cpu
from aiodist.group._operations import ALGORITHMS, OPERATIONS
from aiodist.testing import run_world, run_world_processes

pytestmark = pytest.mark.both_loops

PUBLIC = {name: returns for op in OPERATIONS.values() for name, returns in op.public.items()}


def test_every_operation_has_a_public_function_and_a_blocking_twin() -> None:
    for name, returns in PUBLIC.items():
        assert name in aiodist.__all__ and name in dist.__all__, name
        params = list(inspect.signature(getattr(aiodist, name)).parameters)
        twin = list(inspect.signature(getattr(dist, name)).parameters)
        if returns == "async_op":  # torch's place for it: right after group
            at = params.index("group") + 1
            params.insert(at, "async_op")
        assert twin == params, name
        doc = getattr(dist, name).__doc__
        said = {"async_op": "with ``async_op=True``", "work": "a :class:`Work` at once"}
        said |= {"result": "the operation's result", "none": "``None``, once"}
        assert said[returns] in doc, (name, returns)


def test_the_public_functions_issue_only_declared_operations() -> None:
    # Each public function that returns a Work is an operation (batch_isend_irecv issues
    # several: sends and receives).
    works = {
        name
        for name in aiodist.__all__
        if inspect.isfunction(fn := getattr(aiodist, name))
        and "Work" in str(inspect.signature(fn).return_annotation)
    }
    assert works - {"batch_isend_irecv"} == set(PUBLIC), works ^ set(PUBLIC)


def test_backends_and_fingerprints_cover_every_operation() -> None:
    assert set(cpu.BACKEND.ops) == set(OPERATIONS)
    assert {op.algorithm for op in OPERATIONS.values()} == ALGORITHMS == set(cpu.PATHS)
    for op in OPERATIONS.values():
        if op.alias_of is not None:
            assert OPERATIONS[op.alias_of].check is op.check, op.name
    # An operation's fingerprint names it, or the operation it is another name of.
    for name in _fingerprint._OPS:
        assert name in OPERATIONS and OPERATIONS[name].alias_of is None, name


async def test_single_and_its_older_name_are_one_operation() -> None:
    async def fn(rank: int, size: int) -> None:
        x = np.arange(3, dtype=np.float32) + 10 * rank
        out = np.zeros((size, 3), np.float32)
        # Rank 0 uses torch 2.13's name, the others the older one: the calls match.
        gather = aiodist.all_gather_single if rank == 0 else aiodist.all_gather_into_tensor
        assert await gather(out, x) is out
        want = np.stack([np.arange(3, dtype=np.float32) + 10 * r for r in range(size)])
        np.testing.assert_array_equal(out, want)

        big = np.arange(size * 2, dtype=np.int64) * (rank + 1)
        mine = np.zeros(2, np.int64)
        scatter = aiodist.reduce_scatter_single if rank else aiodist.reduce_scatter_tensor
        await scatter(mine, big)
        total = sum(r + 1 for r in range(size))
        np.testing.assert_array_equal(mine, np.arange(2 * rank, 2 * rank + 2) * total)

        with pytest.raises(aiodist.DistUsageError, match="output_tensor has shape"):
            aiodist.all_gather_single(np.zeros(2, np.float32), x)
        assert aiodist.get_backend_config() == "cpu:cpu"

    await run_world(fn, 3)


async def test_record_comm_names_the_operations_it_covers() -> None:
    async def fn(rank: int, size: int) -> list[Any]:
        with aiodist.record_comm("layer1 grads"):
            await aiodist.all_reduce(np.ones(2))
            with aiodist.record_comm("inner"):
                await aiodist.barrier()
        await aiodist.all_reduce(np.ones(2))
        with (
            pytest.raises(aiodist.DistUsageError, match="name must be a string, got int"),
            aiodist.record_comm(3),  # type: ignore[arg-type]
        ):
            pass
        return [(r["op"], r["name"]) for r in aiodist.debug.dump()["ops"]]

    got = await run_world(fn, 2)
    want = [("all_reduce", "layer1 grads"), ("barrier", "inner"), ("all_reduce", None)]
    assert got == [want, want]


def _named_blocking(rank: int, size: int) -> list[Any]:
    out = np.zeros((size, 2))
    with dist.record_comm("fsdp gather"):
        dist.all_gather_single(out, np.full(2, float(rank)))
        dist.barrier(async_op=True).wait()
    dist.reduce_scatter_single(np.zeros(1), np.ones(size))
    assert dist.default_pg_timeout.total_seconds() == 1800
    records = aiodist.debug.dump()["ops"]
    return [dist.get_backend_config(), out.tolist(), [(r["op"], r["name"]) for r in records]]


def test_record_comm_and_the_new_names_through_the_blocking_api() -> None:
    results = run_world_processes(_named_blocking, 2, timeout=60)
    want_ops = [
        ("all_gather_single", "fsdp gather"),
        ("barrier", "fsdp gather"),
        ("reduce_scatter_single", None),
    ]
    for got in results:
        assert got[0] == "cpu:cpu"
        assert got[1] == [[0.0, 0.0], [1.0, 1.0]]
        assert got[2][-3:] == want_ops
