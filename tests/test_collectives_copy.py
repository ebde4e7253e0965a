"""The local block of gather, scatter, all_gather and all_to_all: copied beside the transfers.

A rank copies its own block only after its receives are posted and signalled, so its
peers' sends to it never wait for the copy; a copy larger than ``YIELD_BYTES`` runs as a
task that yields between pieces.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from collective_helpers import RUNNERS, run_on

from aiodist import collectives as coll
from aiodist.collectives._common import READY_STEP, YIELD_BYTES
from aiodist.transport.base import OpComm, Transport
from aiodist.transport.local import LocalTransport

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


class _WatchSignals(Transport):
    """A LocalTransport that records, at each ready signal a rank sends, whether that
    rank's own block has been copied into its output yet."""

    def __init__(self, inner: LocalTransport, own_out: np.ndarray, seen: list[bool]) -> None:
        super().__init__(inner.rank, inner.world_size, inner.mailbox)
        self.inner = inner
        self.own_out = own_out
        self.seen = seen

    def send(self, peer: int, tag: Any, data: memoryview) -> asyncio.Future[None]:
        if tag[2] == READY_STEP:
            self.seen.append(bool(self.own_out.any()))
        return self.inner.send(peer, tag, data)

    def recv_into(self, peer: int | None, tag: Any, out: memoryview) -> asyncio.Future[int]:
        return self.inner.recv_into(peer, tag, out)

    def send_reject(self, peer: int, group: int, seq: int, reason: str) -> None:
        self.inner.send_reject(peer, group, seq, reason)

    def abort(self, exc: BaseException) -> None:
        self.inner.abort(exc)

    async def aclose(self) -> None:
        await self.inner.aclose()


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
