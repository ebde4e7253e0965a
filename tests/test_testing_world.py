"""aiodist.testing's world runners: every rank's failure is retrieved and reported, and
run_world_processes runs blocking (aiodist.sync) functions as well as async ones."""

from __future__ import annotations

import asyncio
import functools
import gc
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aiodist
import aiodist.sync as dist
from aiodist.errors import DistNetworkError, DistTimeoutError
from aiodist.testing import WorldProcessError, run_world, run_world_processes

pytestmark = pytest.mark.both_loops  # the standard loop (asyncio.run, uvicorn) too


# -- run_world ----------------------------------------------------------------------------------
async def _every_rank_fails(rank: int, world_size: int) -> None:
    # In rank order: which rank's task runs first after init_process_group is up to the loop.
    await asyncio.sleep(0.05 * rank)
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


async def _rank_one_returns_early(rank: int, world_size: int) -> float | None:
    if rank == 1:
        return None  # before rank 0's all_reduce, which needs it
    x = np.arange(4, dtype=np.float64)
    await aiodist.all_reduce(x)
    return float(x.sum())


#: What rank 0's all_reduce raised when rank 1 had left, by transport.
_LEFT = {
    "tcp": "lost connection to rank 1: it left the process group (destroy_process_group)",
    "local": "lost connection to rank 1: it left the process group (destroy_process_group)",
    "shm": "lost connection to rank 1: it closed the shared-memory workspace",
}


@pytest.mark.parametrize("transport", ["tcp", "shm", "local"])
async def test_run_world_names_the_rank_that_returned_early(transport: Any) -> None:
    with pytest.raises(DistNetworkError) as info:
        await run_world(_rank_one_returns_early, 2, timeout=30, transport=transport)
    assert str(info.value) == (
        "rank 1 already returned (its function ended) while rank 0 waited for it in all_reduce"
    )
    assert info.value.__notes__ == ["run_world: raised on rank 0 of 2"]
    # The operation's own error stays the cause.
    cause = info.value.__cause__
    assert isinstance(cause, DistNetworkError) and str(cause) == _LEFT[transport]


async def test_run_world_names_every_rank_that_returned_early() -> None:
    async def two_return_early(rank: int, world_size: int) -> None:
        if rank in (1, 2):
            return
        await aiodist.barrier()

    with pytest.raises(DistNetworkError) as info:
        await run_world(two_return_early, 3, timeout=30, transport="local")
    assert str(info.value) == (
        "ranks [1, 2] already returned (their functions ended) while rank 0 waited for them "
        "in barrier"
    )


async def test_run_world_timeout_names_the_ranks_that_returned() -> None:
    async def rank_zero_hangs(rank: int, world_size: int) -> None:
        if rank == 0:
            await asyncio.Event().wait()

    with pytest.raises(DistTimeoutError) as info:
        await run_world(rank_zero_hangs, 3, timeout=0.5, transport="local")
    assert str(info.value) == (
        "run_world: ranks [0] did not finish within 0.5 s; "
        "ranks [1, 2] already returned (their functions ended)"
    )


async def test_a_failure_after_an_early_return_keeps_its_own_error() -> None:
    # Rank 1 returned, but rank 0's failure is its own: it is not blamed on rank 1.
    async def own_failure(rank: int, world_size: int) -> None:
        if rank == 0:
            await asyncio.sleep(0.05)
            raise KeyError("rank 0's own")

    with pytest.raises(KeyError) as info:
        await run_world(own_failure, 2, timeout=30, transport="local")
    assert str(info.value) == '"rank 0\'s own"'
    assert info.value.__notes__ == ["run_world: raised on rank 0 of 2"]


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


def _blocking_rank_one_returns_early(rank: int, world_size: int) -> None:
    if rank == 1:
        return
    dist.all_reduce(np.ones(3))


def _rank_zero_hangs(flag: str, rank: int, world_size: int) -> None:
    if rank == 1:
        Path(flag).touch()
        return
    while not os.path.exists(flag):  # rank 1 is about to return
        time.sleep(0.01)
    time.sleep(60)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("body", "call"),
    [
        (_rank_one_returns_early, "await aiodist.all_reduce(x)"),
        (_blocking_rank_one_returns_early, "dist.all_reduce(np.ones(3))"),
    ],
)
def test_run_world_processes_names_the_rank_that_returned_early(body: Any, call: str) -> None:
    with pytest.raises(WorldProcessError) as info:
        run_world_processes(body, 2, timeout=60)
    assert info.value.rank == 0
    lines = str(info.value).splitlines()
    assert lines[:2] == [
        "rank 0 failed: rank 1 already returned (its function ended) while rank 0 waited "
        "for it in all_reduce",
        "Traceback (most recent call last):",
    ]
    # Below it, rank 0's own traceback, from its call on (ranks of one host share memory).
    assert f"    {call}" in lines
    assert lines[-1] == f"aiodist.errors.DistNetworkError: {_LEFT['shm']}"


@pytest.mark.multiprocess
def test_run_world_processes_timeout_names_the_rank_that_returned(tmp_path: Path) -> None:
    hangs = functools.partial(_rank_zero_hangs, str(tmp_path / "rank1-returns"))
    with pytest.raises(DistTimeoutError) as info:
        run_world_processes(hangs, 2, timeout=8)
    assert str(info.value) == (
        "run_world_processes: ranks [0] did not finish within 8 s; "
        "rank 1 already returned (its function ended)"
    )


@pytest.mark.multiprocess
def test_run_world_processes_tells_partials_apart_and_uses_aiodist_loop() -> None:
    blocking = run_world_processes(functools.partial(_blocking_scaled, 2.5), 2, timeout=60)
    assert blocking == [5.0, 5.0]
    for kind in ("asyncio", "uvloop"):
        results = run_world_processes(
            functools.partial(_loop_kind, 2.0), 2, timeout=60, env={"AIODIST_LOOP": kind}
        )
        assert results == [(kind, 2.0), (kind, 2.0)]
