"""Bad input and faults: the rank that can see the problem names it, no rank hangs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import aiodist
from aiodist.testing import run_world

pytestmark = pytest.mark.both_loops


async def _one_rank_misuses(
    call: Callable[[int], Any], match: str, *, bad_rank: int = 1, size: int = 3
) -> None:
    """``bad_rank`` makes a bad call; the others enter a good collective under the same number.

    The bad call is rejected: its rank raises the usage error, the others' collective fails
    at once with the reason and the rank that gave it, and the group stays usable.
    """

    async def fn(rank: int, n: int) -> None:
        started = time.monotonic()
        if rank == bad_rank:
            with pytest.raises(aiodist.DistUsageError, match=match):
                call(rank)
        else:
            with pytest.raises(aiodist.DistUsageError, match=f"rejected by rank {bad_rank}: "):
                await aiodist.all_reduce(np.ones(4))
        assert time.monotonic() - started < 10  # told at once, not after the 30 s timeout
        x = np.full(2, float(rank))
        await aiodist.all_reduce(x)
        np.testing.assert_array_equal(x, np.full(2, float(sum(range(n)))))

    await run_world(fn, size, timeout=30)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda r: aiodist.all_reduce(np.ones(4).view()[::2]), "tensor is not C-contiguous"),
        (
            lambda r: aiodist.all_reduce(np.ones(4), op=aiodist.ReduceOp.BXOR),
            "BXOR is not supported for dtype float64",
        ),
        (lambda r: aiodist.all_reduce([1.0, 2.0]), "must be a numpy array"),
        (lambda r: aiodist.all_reduce(np.ones(4), op=42), "op must be an aiodist.ReduceOp"),
        (
            lambda r: aiodist.broadcast(np.ones(4), src=9),
            "broadcast: src 9 is not in the process group",
        ),
        (lambda r: aiodist.reduce(np.ones(4), group_dst=-1), "group_dst -1 is out of range"),
        (
            lambda r: aiodist.broadcast(np.ones(4), src=0, group_src=0),
            "either src or group_src, not both",
        ),
        (lambda r: aiodist.all_gather([], np.ones(4)), "tensor_list is empty; it needs 3 arrays"),
        (
            lambda r: aiodist.all_gather([np.ones(4)] * 2, np.ones(4)),
            "tensor_list has 2 entries; it needs 3",
        ),
        (
            lambda r: aiodist.all_gather(
                [np.ones(4), np.ones(4, np.float32), np.ones(4)], np.ones(4)
            ),
            r"tensor_list mixes dtypes: tensor_list\[0\] is float64 but tensor_list\[1\] is float32",
        ),
        (
            lambda r: aiodist.all_gather([np.ones(5)] * 3, np.ones(4)),
            r"tensor_list\[0\] has shape \(5,\) and dtype float64 but tensor has shape \(4,\)",
        ),
        (
            lambda r: aiodist.gather(np.ones(4), [np.ones(4)] * 3, dst=0),
            "gather_list must only be given on the root",
        ),
        (
            lambda r: aiodist.scatter(np.ones(4), None, src=1),
            "scatter_list must be a list of 3 arrays",
        ),
        (
            lambda r: aiodist.all_gather_into_tensor(np.ones(11), np.ones(4)),
            "output_tensor has shape .* but must hold 3 x input_tensor",
        ),
        (
            lambda r: aiodist.reduce_scatter_tensor(np.ones(4), np.ones(12, np.int32)),
            "input has shape .* but must hold 3 x output",
        ),
        (
            lambda r: aiodist.all_to_all_single(np.ones(6), np.ones(6), [1, 2, 2], None),
            r"output_split_sizes \[1, 2, 2\] must be 3 non-negative sizes adding up to dimension 0 \(6\)",
        ),
        (
            lambda r: aiodist.all_to_all_single(np.ones(3), np.array(1.0)),
            r"output has shape \(3,\) and dtype float64 and input has shape \(\) and dtype float64",
        ),
        (
            lambda r: aiodist.all_to_all_single(np.ones(4), np.ones(4)),
            r"dimension 0 of output \(4\) is not divisible by the group size 3",
        ),
        (
            lambda r: aiodist.all_to_all([np.ones(1)] * 3, [np.ones(1, np.int64)] * 3),
            "output_tensor_list has dtype float64 but input_tensor_list has dtype int64",
        ),
        (
            lambda r: aiodist.reduce_scatter(np.ones(2), [np.ones(2)] * 3, op="sum"),
            "op must be an aiodist.ReduceOp",
        ),
    ],
)
async def test_local_misuse_fails_peers_fast(call: Callable[[int], Any], match: str) -> None:
    await _one_rank_misuses(call, match)


async def test_read_only_output() -> None:
    ro = np.ones(4)
    ro.setflags(write=False)
    await _one_rank_misuses(lambda r: aiodist.all_reduce(ro), "tensor is read-only")


@pytest.mark.parametrize(
    "make",
    [
        lambda rank: np.ones(4 + rank),  # shape (size) mismatch
        lambda rank: np.ones(4, np.float32 if rank else np.float64),  # dtype (width) mismatch
    ],
)
async def test_mismatch_between_ranks_is_an_error_everywhere(
    make: Callable[[int], np.ndarray],
) -> None:
    async def fn(rank: int, size: int) -> BaseException:
        with pytest.raises(aiodist.DistError) as info:
            await aiodist.all_reduce(make(rank))
        return info.value

    errors = await run_world(fn, 3, timeout=30)
    # The rank(s) that received a message of the other call name both calls; the rest learn
    # that the group was aborted.
    usage = [e for e in errors if isinstance(e, aiodist.DistUsageError)]
    assert usage, errors
    assert all("collective mismatch" in str(e) for e in usage), usage


async def test_dead_peer_fails_pending_receive() -> None:
    async def fn(rank: int, size: int) -> None:
        if rank == 1:
            await asyncio.sleep(0.1)
            await aiodist.destroy_process_group()  # goes away without sending
            return
        started = time.monotonic()
        with pytest.raises(aiodist.DistNetworkError, match="rank 1"):
            await aiodist.recv(np.empty(3), src=1)
        assert time.monotonic() - started < 15

    await run_world(fn, 2, timeout=30)


async def test_destroy_with_operation_in_flight() -> None:
    async def fn(rank: int, size: int) -> None:
        if rank == 0:
            w = aiodist.irecv(np.empty(1), src=1)
            await aiodist.destroy_process_group()
            with pytest.raises(aiodist.DistUsageError, match="destroyed while the operation ran"):
                await w
            with pytest.raises(aiodist.DistUsageError, match="needs the default process group"):
                aiodist.barrier()
        else:
            with pytest.raises(aiodist.DistNetworkError):
                await aiodist.recv(np.empty(1), src=0)

    await run_world(fn, 2, timeout=30)


async def test_run_world_reports_first_failure() -> None:
    async def fn(rank: int, size: int) -> None:
        if rank == 2:
            raise KeyError("boom on rank 2")
        await asyncio.sleep(30)

    started = time.monotonic()
    with pytest.raises(KeyError, match="boom on rank 2"):
        await run_world(fn, 3, timeout=60)
    assert time.monotonic() - started < 15


async def test_run_world_timeout_names_ranks() -> None:
    async def fn(rank: int, size: int) -> None:
        if rank == 1:
            await asyncio.sleep(30)

    with pytest.raises(
        aiodist.DistTimeoutError, match=r"run_world: ranks \[1\] did not finish within 0.3 s"
    ):
        await run_world(fn, 2, timeout=0.3)


@pytest.mark.parametrize(
    ("wait_all", "match"),
    [(False, "Rank 2 failed to pass"), (True, "Ranks 2, 3 failed to pass")],
)
async def test_monitored_barrier_names_missing_ranks(wait_all: bool, match: str) -> None:
    async def fn(rank: int, size: int) -> None:
        if rank >= 2:
            await asyncio.sleep(1.0)  # never enters the barrier
            return
        if rank == 0:
            with pytest.raises(aiodist.DistTimeoutError, match=rf"rank 0: {match} .* within 0.3 s"):
                await aiodist.monitored_barrier(timeout=0.3, wait_all_ranks=wait_all)
        else:
            # Told by rank 0: only this operation failed, in torch's words.
            with pytest.raises(aiodist.DistTimeoutError, match="Rank 1 successfully reached"):
                await aiodist.monitored_barrier(timeout=20)

    await run_world(fn, 4, timeout=30)


async def test_run_world_raises_the_root_cause_not_the_cascade() -> None:
    async def fn(rank: int, size: int) -> None:
        if rank == 2:
            aiodist.all_gather([], np.ones(1))  # rejected: raises out of fn
        await aiodist.all_reduce(np.ones(1))  # the others learn it was rejected

    for _ in range(3):
        with pytest.raises(aiodist.DistUsageError, match="tensor_list is empty"):
            await run_world(fn, 3, timeout=30, transport="local")
