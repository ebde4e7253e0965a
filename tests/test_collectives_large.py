"""Shared pieces of the algorithms that serve large transfers.

The local block of gather, scatter, all_gather and all_to_all: a rank copies its own block
only after its receives are posted and signalled, so its peers' sends to it never wait for
the copy; a copy larger than ``YIELD_BYTES`` runs as a task that yields between pieces.
And a rank that moves ``AWAKE_BYTES`` or more keeps its loop from sleeping until the work
is done, when the machine's ranks fit its CPUs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from collective_helpers import RUNNERS, Wrapped, run_on

from aiodist import collectives as coll
from aiodist._arrays._reduce import ReduceOp
from aiodist._util import _wait
from aiodist.collectives._common import READY_STEP, YIELD_BYTES, Dataflow, _tick_until
from aiodist.transport.base import OpComm
from aiodist.transport.local import LocalTransport

pytestmark = pytest.mark.both_loops  # the standard loop (asyncio.run, uvicorn) too

Runner = Callable[[int, Callable[[OpComm], Awaitable[Any]]], Awaitable[list[Any]]]

#: float64 elements per block: above YIELD_BYTES, so the copy runs as a yielding task.
LARGE = YIELD_BYTES // 8 + 12_345


@pytest.fixture(params=sorted(RUNNERS))
def run(request: pytest.FixtureRequest) -> Runner:
    """Run the ranks over the in-process transport, then over loopback TCP."""
    return RUNNERS[request.param]  # type: ignore[return-value]


def _block(src: int, dst: int, count: int) -> np.ndarray:
    return np.arange(count, dtype=np.float64) * (src + 1) + 1000.0 * dst


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("count", [LARGE, 1000])
async def test_all_to_all_blocks(run: Runner, n: int, count: int) -> None:
    ins = [[_block(s, d, count) for d in range(n)] for s in range(n)]
    outs = [[np.zeros(count) for _ in range(n)] for _ in range(n)]

    async def rank(comm: OpComm) -> None:
        await coll.all_to_all(comm, outs[comm.rank], ins[comm.rank])

    await run(n, rank)
    for d in range(n):
        for s in range(n):
            np.testing.assert_array_equal(outs[d][s], ins[s][d])


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("root", [0, 1])
async def test_scatter_and_gather_large_blocks(run: Runner, n: int, root: int) -> None:
    ins = [_block(root, d, LARGE) for d in range(n)]
    scattered = [np.zeros(LARGE) for _ in range(n)]
    gathered = [np.zeros(LARGE) for _ in range(n)]

    async def rank(comm: OpComm) -> None:
        r = comm.rank
        await coll.scatter(comm, scattered[r], ins if r == root else None, root)
        again = OpComm(comm._transport, comm._ranks, r, 0, comm._seq + 1)
        await coll.gather(again, gathered if r == root else None, scattered[r] + 1, root)

    await run(n, rank)
    for r in range(n):
        np.testing.assert_array_equal(scattered[r], ins[r])
        np.testing.assert_array_equal(gathered[r], ins[r] + 1)


@pytest.mark.parametrize("n", [2, 3])
async def test_all_gather_large_blocks(run: Runner, n: int) -> None:
    xs = [_block(r, 0, LARGE) for r in range(n)]
    outs = [[np.zeros(LARGE) for _ in range(n)] for _ in range(n)]

    async def rank(comm: OpComm) -> None:
        await coll.all_gather(comm, outs[comm.rank], xs[comm.rank])

    await run(n, rank)
    for r in range(n):
        for s in range(n):
            np.testing.assert_array_equal(outs[r][s], xs[s])


class _WatchSignals(Wrapped):
    """A LocalTransport that records, at each ready signal a rank sends, whether that
    rank's own block has been copied into its output yet."""

    def __init__(self, inner: LocalTransport, own_out: np.ndarray, seen: list[bool]) -> None:
        super().__init__(inner)
        self.own_out = own_out
        self.seen = seen

    def send(
        self, peer: int, tag: Any, data: memoryview, *, cleared: bool = False
    ) -> asyncio.Future[None]:
        if tag[2] == READY_STEP:
            self.seen.append(bool(self.own_out.any()))
        return self.inner.send(peer, tag, data, cleared=cleared)


@pytest.mark.parametrize("name", ["all_to_all", "scatter", "gather", "all_gather"])
@pytest.mark.parametrize("count", [LARGE, 40_000])
async def test_signals_go_out_before_the_local_copy(name: str, count: int) -> None:
    """Every ready signal leaves before the rank copies its own block (large or small):
    a copy first would hold up the peers' sends to this rank for as long as it takes."""
    n = 3
    ins = [[_block(s, d, count) for d in range(n)] for s in range(n)]
    outs = [[np.zeros(count) for _ in range(n)] for _ in range(n)]
    seen: list[bool] = []
    world = [
        _WatchSignals(t, outs[r][r], seen) for r, t in enumerate(LocalTransport.create_world(n))
    ]

    async def rank(comm: OpComm) -> None:
        r = comm.rank
        if name == "all_to_all":
            await coll.all_to_all(comm, outs[r], ins[r])
        elif name == "scatter":
            await coll.scatter(comm, outs[r][r], ins[r] if r == 0 else None, 0)
        elif name == "gather":
            await coll.gather(comm, outs[r] if r == 0 else None, ins[r][r], 0)
        else:
            await coll.all_gather(comm, outs[r], ins[r][r])

    try:
        await asyncio.wait_for(run_on(world, rank), 10)
    finally:
        for t in world:
            await t.aclose()
    assert seen and not any(seen), seen
    for r in range(n):
        if name != "scatter" and (name != "gather" or r == 0):
            np.testing.assert_array_equal(outs[r][r], ins[r][r])
    if name == "scatter":
        for r in range(n):
            np.testing.assert_array_equal(outs[r][r], ins[0][r])


# -- keeping the loop awake during large transfers ---------------------------------------------


async def test_tick_until_polls_until_done_and_then_stops() -> None:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    rounds = [0]

    def count() -> None:
        rounds[0] += 1

    _tick_until(done, count)
    await asyncio.sleep(0.01)  # the timer needs more than one round of the loop
    assert rounds[0] >= 2
    done.set_result(None)
    await asyncio.sleep(0)
    settled = rounds[0]
    await asyncio.sleep(0.01)
    assert rounds[0] == settled


def test_ranks_fit_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_wait, "_usable_cpus", 4)
    monkeypatch.setattr(_wait, "_runnable", (time.monotonic() + 60, 1))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert _wait.ranks_fit(_wait.local_ranks(4))
    assert not _wait.ranks_fit(_wait.local_ranks(5))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert not _wait.ranks_fit(_wait.local_ranks(2))  # other groups' ranks share the machine
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert _wait.ranks_fit(_wait.local_ranks(2))
    assert _wait.AWAKE_BYTES is not None
    assert _wait.may_stay_awake(2, _wait.AWAKE_BYTES)
    assert not _wait.may_stay_awake(5, _wait.AWAKE_BYTES)  # a group larger than it says
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    assert not _wait.ranks_fit(_wait.local_ranks(2))


@pytest.mark.parametrize("cpus", [1, 64])
async def test_stay_awake_only_for_large_transfers_on_free_cpus(
    monkeypatch: pytest.MonkeyPatch, cpus: int
) -> None:
    monkeypatch.setattr(_wait, "_usable_cpus", cpus)
    monkeypatch.setattr(_wait, "_runnable", (time.monotonic() + 60, 1))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert _wait.AWAKE_BYTES is not None
    world = LocalTransport.create_world(2)
    comm = OpComm(world[0], [0, 1], 0, 0, 0)
    small, large = Dataflow(0), Dataflow(0)
    small.stay_awake(comm, _wait.AWAKE_BYTES - 1)
    large.stay_awake(comm, _wait.AWAKE_BYTES)
    assert not small._awake
    assert large._awake is (cpus >= 2)
    for t in world:
        await t.aclose()


async def test_no_polling_beside_other_busy_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_wait, "_usable_cpus", 64)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert _wait.runnable_threads() >= 1  # this thread, at least
    assert _wait.AWAKE_BYTES is not None
    world = LocalTransport.create_world(2)
    comm = OpComm(world[0], [0, 1], 0, 0, 0)
    # A reading that stays fresh: 100 threads want the 64 CPUs.
    monkeypatch.setattr(_wait, "_runnable", (time.monotonic() + 60, 100))
    busy = Dataflow(0)
    busy.stay_awake(comm, _wait.AWAKE_BYTES)
    assert not busy._awake
    monkeypatch.setattr(_wait, "_runnable", (time.monotonic() + 60, 3))
    quiet = Dataflow(0)
    quiet.stay_awake(comm, _wait.AWAKE_BYTES)
    assert quiet._awake
    for t in world:
        await t.aclose()


@pytest.mark.parametrize("name", ["broadcast", "scatter", "gather", "all_to_all", "reduce"])
async def test_large_operations_with_the_loop_kept_awake(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Two ranks over loopback TCP that fit the CPUs keep their loop awake; results against
    numpy."""
    monkeypatch.setattr(_wait, "_usable_cpus", 64)
    monkeypatch.setattr(_wait, "_runnable", (time.monotonic() + 60, 1))
    n, count = 2, (1 << 20) // 8 + 3
    xs = [_block(r, 0, 2 * count) for r in range(n)]
    outs = [[np.zeros(count) for _ in range(n)] for _ in range(n)]
    ins = [[_block(s, d, count) for d in range(n)] for s in range(n)]

    async def rank(comm: OpComm) -> None:
        r = comm.rank
        if name == "broadcast":
            await coll.broadcast(comm, xs[r], 1)
        elif name == "reduce":
            await coll.reduce(comm, xs[r], 0, ReduceOp.SUM)
        elif name == "scatter":
            await coll.scatter(comm, outs[r][r], ins[0] if r == 0 else None, 0)
        elif name == "gather":
            await coll.gather(comm, outs[r] if r == 1 else None, ins[r][r], 1)
        else:
            await coll.all_to_all(comm, outs[r], ins[r])

    expected_x = [_block(r, 0, 2 * count) for r in range(n)]
    await asyncio.wait_for(RUNNERS["tcp"](n, rank), 20)
    if name == "broadcast":
        for r in range(n):
            np.testing.assert_array_equal(xs[r], expected_x[1])
    elif name == "reduce":
        np.testing.assert_array_equal(xs[0], expected_x[0] + expected_x[1])
        np.testing.assert_array_equal(xs[1], expected_x[1])
    elif name == "scatter":
        for r in range(n):
            np.testing.assert_array_equal(outs[r][r], ins[0][r])
    elif name == "gather":
        for s in range(n):
            np.testing.assert_array_equal(outs[1][s], ins[s][s])
    else:
        for d in range(n):
            for s in range(n):
                np.testing.assert_array_equal(outs[d][s], ins[s][d])
