"""The two-level collectives (aiodist.collectives.two_level) on in-process and loopback ranks
laid out over pretend hosts, against numpy references; the plan of hosts and its exchange."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cluster_helpers import clean_env
from collective_helpers import RUNNERS, numpy_reduce, sample
from netns_helpers import Hosts
from two_level_cases import CASES, expected

from aiodist._arrays._reduce import ReduceOp
from aiodist.collectives import RING_THRESHOLD_BYTES, two_level
from aiodist.collectives.two_level import HostPlan
from aiodist.store import HashStore
from aiodist.testing import free_port
from aiodist.transport.base import OpComm
from aiodist.transport.shm import plan_hosts, plan_shared_memory

pytestmark = pytest.mark.both_loops

Runner = Callable[[int, Callable[[OpComm], Awaitable[Any]]], Awaitable[list[Any]]]

#: Ranks by host: two of two, uneven (one, two, one), hosts of interleaved ranks, three and two.
LAYOUTS = {
    "2x2": [(0, 1), (2, 3)],
    "1+2+1": [(0,), (1, 2), (3,)],
    "interleaved": [(0, 2), (1, 3)],
    "3+2": [(0, 1, 2), (3, 4)],
}
#: Below the ring threshold (one column), above it (one per rank of the largest host), empty.
COUNTS = [0, 7, RING_THRESHOLD_BYTES // 8 + 13]


@pytest.fixture(params=sorted(RUNNERS))
def run(request: pytest.FixtureRequest) -> Runner:
    """The in-process transport, then loopback TCP."""
    return RUNNERS[request.param]  # type: ignore[return-value]


def _size(layout: str) -> int:
    return sum(len(h) for h in LAYOUTS[layout])


def _plan(layout: str, comm: OpComm) -> HostPlan:
    return HostPlan(LAYOUTS[layout], comm.rank)


_OPS = [
    (ReduceOp.SUM, np.int64),
    (ReduceOp.AVG, np.int32),
    (ReduceOp.AVG, np.float64),
    (ReduceOp.PRODUCT, np.float32),
    (ReduceOp.MIN, np.int16),
    (ReduceOp.MAX, np.float32),
    (ReduceOp.BAND, np.uint8),
    (ReduceOp.BOR, np.int32),
    (ReduceOp.BXOR, np.uint64),
    (ReduceOp.SUM, np.complex64),
]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize(("op", "dtype"), _OPS, ids=lambda v: getattr(v, "__name__", str(v)))
async def test_all_reduce(run: Runner, layout: str, count: int, op: ReduceOp, dtype: Any) -> None:
    await _check_all_reduce(run, layout, count, op, dtype)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize(("op", "dtype"), [(ReduceOp.SUM, np.int64), (ReduceOp.AVG, np.float32)])
async def test_all_reduce_in_segments(
    run: Runner, layout: str, op: ReduceOp, dtype: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Segments of 128 KiB: 800 KB of int64 (400 KB of float32) move as 7 (4) of them, two
    # in flight at a time.
    monkeypatch.setattr(two_level, "SEGMENT_BYTES", 128 << 10)
    await _check_all_reduce(run, layout, 100_003, op, dtype)


async def _check_all_reduce(run: Runner, layout: str, count: int, op: ReduceOp, dtype: Any) -> None:
    n = _size(layout)
    xs = [sample(np.dtype(dtype), (count,), seed=r, op=op) for r in range(n)]
    expected = numpy_reduce(op, xs)

    async def rank(comm: OpComm) -> None:
        await two_level.all_reduce(comm, _plan(layout, comm), xs[comm.rank], op)

    await run(n, rank)
    for x in xs:
        np.testing.assert_array_equal(x, expected)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("count", [5, 3 * RING_THRESHOLD_BYTES // 4 + 1])
async def test_all_reduce_of_ordinary_floats_is_bitwise_the_same_on_every_rank(
    run: Runner, layout: str, count: int
) -> None:
    n = _size(layout)
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(count).astype(np.float32) for _ in range(n)]
    expected = np.sum(np.stack(xs).astype(np.float64), axis=0)

    async def rank(comm: OpComm) -> None:
        await two_level.all_reduce(comm, _plan(layout, comm), xs[comm.rank], ReduceOp.SUM)

    await run(n, rank)
    for x in xs[1:]:
        assert x.tobytes() == xs[0].tobytes()
    np.testing.assert_allclose(xs[0], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("count", COUNTS)
async def test_broadcast_from_every_root(run: Runner, layout: str, count: int) -> None:
    n = _size(layout)
    for root in range(n):
        xs = [np.full(count, -1.0) if r != root else np.arange(count) * 0.5 for r in range(n)]

        async def rank(comm: OpComm, root: int = root, xs: list[np.ndarray] = xs) -> None:
            await two_level.broadcast(comm, _plan(layout, comm), xs[comm.rank], root)

        await run(n, rank)
        for x in xs:
            np.testing.assert_array_equal(x, np.arange(count) * 0.5)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize(("op", "dtype"), [(ReduceOp.SUM, np.int64), (ReduceOp.AVG, np.float32)])
async def test_reduce_onto_every_root_leaves_the_others_unchanged(
    run: Runner, layout: str, op: ReduceOp, dtype: Any
) -> None:
    n = _size(layout)
    for root in range(n):
        xs = [sample(np.dtype(dtype), (2, 9), seed=r, op=op) for r in range(n)]
        before = [x.copy() for x in xs]

        async def rank(comm: OpComm, root: int = root, xs: list[np.ndarray] = xs) -> None:
            await two_level.reduce(comm, _plan(layout, comm), xs[comm.rank], root, op)

        await run(n, rank)
        np.testing.assert_array_equal(xs[root], numpy_reduce(op, before))
        for r in range(n):
            if r != root:
                np.testing.assert_array_equal(xs[r], before[r])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("count", [0, 3, 5000])
async def test_all_gather(run: Runner, layout: str, count: int) -> None:
    n = _size(layout)
    xs = [np.arange(count, dtype=np.int32) + 1000 * r for r in range(n)]
    outs = [[np.full(count, -1, np.int32) for _ in range(n)] for _ in range(n)]

    async def rank(comm: OpComm) -> None:
        await two_level.all_gather(comm, _plan(layout, comm), outs[comm.rank], xs[comm.rank])

    await run(n, rank)
    for rows in outs:
        for r in range(n):
            np.testing.assert_array_equal(rows[r], xs[r])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize(("op", "dtype"), [(ReduceOp.SUM, np.int64), (ReduceOp.AVG, np.int32)])
@pytest.mark.parametrize("count", [0, 4, 3000])
async def test_reduce_scatter(
    run: Runner, layout: str, op: ReduceOp, dtype: Any, count: int
) -> None:
    n = _size(layout)
    ins = [
        [sample(np.dtype(dtype), (count,), seed=10 * r + d, op=op) for d in range(n)]
        for r in range(n)
    ]
    outs = [np.full(count, -1, dtype) for _ in range(n)]

    async def rank(comm: OpComm) -> None:
        r = comm.rank
        await two_level.reduce_scatter(comm, _plan(layout, comm), outs[r], ins[r], op)

    await run(n, rank)
    for d in range(n):
        np.testing.assert_array_equal(outs[d], numpy_reduce(op, [ins[r][d] for r in range(n)]))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
async def test_barrier_holds_every_rank_until_the_last_arrives(run: Runner, layout: str) -> None:
    n = _size(layout)
    last = n - 1
    passed: list[int] = []
    arrived = asyncio.Event()

    async def rank(comm: OpComm) -> None:
        if comm.rank == last:
            await asyncio.sleep(0.05)
            arrived.set()
        await two_level.barrier(comm, _plan(layout, comm))
        assert arrived.is_set()
        passed.append(comm.rank)

    await run(n, rank)
    assert sorted(passed) == list(range(n))


def test_plan_of_a_group() -> None:
    world = [(0, 1, 2), (3, 4, 5), (6,)]
    # On one host, or one rank per host: nothing to gain.
    assert HostPlan.of_group(world, [0, 1, 2], 0) is None
    assert HostPlan.of_group(world, [0, 3, 6], 1) is None
    assert HostPlan.of_group(None, [0, 1, 3], 0) is None
    plan = HostPlan.of_group(world, [6, 4, 1, 3], 3)  # group ranks: 6->0, 4->1, 1->2, 3->3
    assert plan is not None
    assert plan.hosts == ((0,), (1, 3), (2,))
    assert plan.mine == (1, 3) and plan.local == 1 and plan.width == 2
    assert plan.column(0) == (0, 1, 2) and plan.column(1) == (0, 3, 2)
    assert plan.carrier(2) == 1 and plan.carrier(3) == 3
    assert plan.representative(2) == ((0, 1, 2), 1)
    assert plan.representative(3) == ((0, 3, 2), 3)


@pytest.mark.parametrize(
    "layout", [["a", "a", "b", "b"], ["a", "b", "a", "c", "c", "c"], ["a", "a", "a"]]
)
async def test_plan_hosts_over_the_store(layout: list[str]) -> None:
    store = HashStore()
    n = len(layout)

    async def rank(r: int) -> tuple[tuple[int, ...], ...]:
        local, _ = await plan_shared_memory(store, r, n, host=layout[r], timeout=10)
        return await plan_hosts(store, r, n, local, timeout=10)

    plans = await asyncio.gather(*(rank(r) for r in range(n)))
    expected = tuple(
        sorted(tuple(r for r in range(n) if layout[r] == h) for h in sorted(set(layout)))
    )
    assert all(p == expected for p in plans)


# -- a world over network namespaces ---------------------------------------------------------
WORKER = Path(__file__).with_name("two_level_worker.py")


def _start(hosts: Hosts, placement: list[int], mode: str, loop: str) -> list[subprocess.Popen[str]]:
    # Rank r runs on host placement[r]; the store is on the first rank's host.
    addr, port = hosts.addresses[placement[0]], str(free_port())
    n = str(len(placement))
    return [
        subprocess.Popen(
            [*hosts.prefix(h), sys.executable, str(WORKER), mode, loop, str(r), addr, port, n],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
        )
        for r, h in enumerate(placement)
    ]


def _finish(procs: list[subprocess.Popen[str]]) -> list[tuple[int, str, str]]:
    outcomes = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        outcomes.append((p.returncode, out, err))
    return outcomes


def _check_cases(procs: list[subprocess.Popen[str]], two_level: tuple[bool, bool]) -> None:
    n = len(procs)
    reports = []
    for rc, out, err in _finish(procs):
        assert rc == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    for rank, report in enumerate(reports):
        results = report["results"]
        for case in CASES:
            want = expected(case, rank, n)
            if want is not None:
                assert results[case] == want, (rank, case)
            if rank < 3:
                want = expected(case, rank, 3)
                if want is not None:
                    assert results[f"{case} in 0-2"] == want, (rank, case, "group 0-2")
        assert ("two levels" in report["paths"]["world"]) is two_level[0], report["paths"]
        if rank < 3:
            assert ("two levels" in report["paths"]["0-2"]) is two_level[1], report["paths"]
    floats = "all_reduce of ordinary floats"
    assert len({r["results"][floats] for r in reports}) == 1
    assert len({r["results"][f"{floats} in 0-2"] for r in reports[:3]}) == 1


@pytest.mark.netns
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_two_hosts_of_two_ranks(hosts: Hosts, loop: str) -> None:
    # The world and the group of ranks 0-2 (two on the first host, one on the second) both
    # work in two levels.
    _check_cases(_start(hosts, [0, 0, 1, 1], "cases", loop), (True, True))


@pytest.mark.netns
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_uneven_hosts(three_hosts: Hosts, loop: str) -> None:
    # One rank, two ranks, one rank: the world works in two levels; ranks 0-2 are one rank
    # on the first host and two on the second.
    _check_cases(_start(three_hosts, [0, 1, 1, 2], "cases", loop), (True, True))


@pytest.mark.netns
def test_two_hosts_through_the_blocking_facade(hosts: Hosts) -> None:
    # A script ported from torch.distributed: the same cases through aiodist.sync.
    _check_cases(_start(hosts, [0, 0, 1, 1], "sync", "asyncio"), (True, True))


@pytest.mark.netns
def test_a_rank_killed_on_the_other_host_is_named_everywhere(hosts: Hosts) -> None:
    procs = _start(hosts, [0, 0, 1, 1], "kill", "uvloop")
    outcomes = _finish(procs)
    assert outcomes[3][0] == -9
    for rank, (rc, out, err) in enumerate(outcomes[:3]):
        assert rc == 0, err
        report = json.loads(out.strip().splitlines()[-1])
        assert report["error"] == "DistNetworkError", (rank, report)
        assert "rank 3" in report["message"], (rank, report)
