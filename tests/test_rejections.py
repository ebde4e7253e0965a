"""Usage errors reject one operation and keep the group usable, on every rank involved.

For each mistake (a reduce op the dtype cannot take, a root outside the group, a list of
mixed dtypes, a short scatter list on the source only, a send to oneself, a bad tag, a send
of something that is not an array, new_group with different lists), made by every rank or by
one, with 2, 3 and 4 ranks, through the async and the blocking API: every rank that made it
raises DistUsageError naming the operation and the problem, every rank that waited for it
raises DistUsageError naming the rank that rejected it, all within a second, and the next
all_reduce equals numpy on every rank.
"""

from __future__ import annotations

import pytest
from rejection_cases import (
    CASES,
    ONE_SIDED,
    SYMMETRIC,
    agree_async,
    agree_blocking,
    check_async,
    check_blocking,
)

import aiodist
from aiodist.testing import run_world, run_world_processes

pytestmark = pytest.mark.both_loops


async def _all_cases(rank: int, size: int) -> list[str]:
    seen = []
    for case in CASES:
        for side in (ONE_SIDED, SYMMETRIC):
            seen.append(f"{case}/{side}: {await check_async(case, side, rank, size)}")
            await agree_async(rank, size)
    # Every peer's word on the operations before the last agreement has arrived (in order,
    # before its data): none may be left waiting for an operation that ended already.
    assert aiodist.group.current_world().rejected == {}
    return seen


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("size", [2, 3, 4])
async def test_every_usage_error_rejects_one_operation(size: int, transport: str) -> None:
    # Over shared memory, the collectives run in the group's workspace: a rejected
    # operation still takes its turn there, so the peers' turns fail alike.
    results = await run_world(_all_cases, size, timeout=60, transport=transport)
    # Every case made some rank raise, and every rank agreed on the next all_reduce.
    for case in CASES:
        for side in (ONE_SIDED, SYMMETRIC):
            assert any(f"{case}/{side}: raised" in r for r in results), (case, side, results)


def _all_cases_blocking(rank: int, size: int) -> list[str]:
    seen = []
    for case in CASES:
        for side in (ONE_SIDED, SYMMETRIC):
            seen.append(f"{case}/{side}: {check_blocking(case, side, rank, size)}")
            agree_blocking(rank, size)
    return seen


@pytest.mark.multiprocess
@pytest.mark.parametrize("size", [2, 3, 4])
def test_every_usage_error_rejects_one_operation_blocking(size: int) -> None:
    results = run_world_processes(_all_cases_blocking, size, timeout=90)
    for case in CASES:
        for side in (ONE_SIDED, SYMMETRIC):
            assert any(f"{case}/{side}: raised" in r for r in results), (case, side, results)
