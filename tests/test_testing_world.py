"""aiodist.testing's world runners: every rank's failure is retrieved and reported, and
run_world_processes runs blocking (aiodist.sync) functions as well as async ones."""

from __future__ import annotations

import asyncio
import functools
import gc
import os
from typing import Any

import numpy as np
import pytest

import aiodist
import aiodist.sync as dist
from aiodist.testing import WorldProcessError, run_world, run_world_processes

pytestmark = pytest.mark.both_loops  # the standard loop (asyncio.run, uvicorn) too


# -- run_world ----------------------------------------------------------------------------------
async def _every_rank_fails(rank: int, world_size: int) -> None:
    raise ValueError(f"rank {rank} of {world_size} failed")


@pytest.mark.parametrize("transport", ["tcp", "local"])
async def test_run_world_retrieves_every_rank_failure(transport: Any) -> None:
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        with pytest.raises(ValueError) as info:
            await run_world(_every_rank_fails, 3, timeout=30, transport=transport)
        raised, notes = str(info.value), getattr(info.value, "__notes__", [])
        del info
        # An unretrieved task exception is reported when the task is collected.
        gc.collect()
        await asyncio.sleep(0)
        assert [c["message"] for c in reported] == []
        # The first rank's exception is raised; the others are attached as notes.
        assert raised == "rank 0 of 3 failed"
        assert notes == [
            "run_world: raised on rank 0 of 3",
            "run_world: rank 1 failed too: ValueError: rank 1 of 3 failed",
            "run_world: rank 2 failed too: ValueError: rank 2 of 3 failed",
        ]
    finally:
        loop.set_exception_handler(previous)


async def test_run_world_names_the_rank_that_failed_first() -> None:
    async def one_rank_fails(rank: int, world_size: int) -> None:
        if rank == 1:
            raise KeyError("only rank 1")
        await aiodist.barrier()

    with pytest.raises(KeyError) as info:
        await run_world(one_rank_fails, 3, timeout=30, transport="local")
    assert info.value.__notes__[0] == "run_world: raised on rank 1 of 3"


# -- run_world_processes --------------------------------------------------------------------------
def _blocking_all_reduce(rank: int, world_size: int) -> dict[str, Any]:
    x = np.arange(6, dtype=np.float64) * (rank + 1)
    dist.all_reduce(x)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, os.getpid())
    return {"rank": dist.get_rank(), "size": dist.get_world_size(), "x": x, "pids": gathered}


def _blocking_failure(rank: int, world_size: int) -> None:
    if rank == 2:
        raise RuntimeError(f"blocking rank {rank} gave up")
    dist.barrier()


async def _loop_kind(scale: float, rank: int, world_size: int) -> tuple[str, float]:
    x = np.array([scale * rank])
    await aiodist.all_reduce(x)
    return type(asyncio.get_running_loop()).__module__.split(".")[0], float(x[0])


def _blocking_scaled(scale: float, rank: int, world_size: int) -> float:
    x = np.array([scale * (rank + 1)])
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return float(x[0])


@pytest.mark.multiprocess
def test_run_world_processes_runs_blocking_functions() -> None:
    results = run_world_processes(_blocking_all_reduce, 3, timeout=60)
    expected = sum(np.arange(6, dtype=np.float64) * (r + 1) for r in range(3))
    for rank, result in enumerate(results):
        assert (result["rank"], result["size"]) == (rank, 3)
        np.testing.assert_array_equal(result["x"], expected)
    # Every rank ran in a process of its own, none in this one.
    pids = results[0]["pids"]
    assert len(set(pids)) == 3 and os.getpid() not in pids
    assert all(r["pids"] == pids for r in results)


@pytest.mark.multiprocess
def test_run_world_processes_reports_a_blocking_rank_failure() -> None:
    with pytest.raises(WorldProcessError) as info:
        run_world_processes(_blocking_failure, 3, timeout=60)
    assert info.value.rank == 2
    message = str(info.value)
    assert message.startswith("rank 2 failed:\nTraceback (most recent call last):\n")
    assert 'raise RuntimeError(f"blocking rank {rank} gave up")' in message
    assert message.splitlines()[-3:] == [
        "RuntimeError: blocking rank 2 gave up",
        "",
        "(ranks [0, 1] failed afterwards)",
    ]
    # The traceback starts at the rank's own code, not in the runner.
    assert "testing/_world.py" not in message


@pytest.mark.multiprocess
def test_run_world_processes_tells_partials_apart_and_uses_aiodist_loop() -> None:
    blocking = run_world_processes(functools.partial(_blocking_scaled, 2.5), 2, timeout=60)
    assert blocking == [5.0, 5.0]
    for kind in ("asyncio", "uvloop"):
        results = run_world_processes(
            functools.partial(_loop_kind, 2.0), 2, timeout=60, env={"AIODIST_LOOP": kind}
        )
        assert results == [(kind, 2.0), (kind, 2.0)]
