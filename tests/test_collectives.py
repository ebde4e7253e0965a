"""Every collective algorithm on 1..8 in-process ranks, against numpy references."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from collective_helpers import RUNNERS, Wrapped, make_world, numpy_reduce, run_on, sample

from aiodist import collectives as coll
from aiodist._arrays._reduce import ReduceOp
from aiodist.collectives._common import READY_STEP
from aiodist.errors import DistNetworkError, DistUsageError
from aiodist.transport.base import OpComm
from aiodist.transport.local import LocalTransport

pytestmark = pytest.mark.both_loops  # the standard loop (asyncio.run, uvicorn) too

Runner = Callable[[int, Callable[[OpComm], Awaitable[Any]]], Awaitable[list[Any]]]

SIZES = range(1, 9)
# Tiny chunks make even small arrays go through many pipelined chunks.
CHUNKS = [None, 8]


@pytest.fixture(params=sorted(RUNNERS))
def run(request: pytest.FixtureRequest) -> Runner:
    """Run the ranks over the in-process transport, then over loopback TCP."""
    return RUNNERS[request.param]  # type: ignore[return-value]


def _inputs(n: int, shape: tuple[int, ...], dtype: Any = np.int64, op: ReduceOp = ReduceOp.SUM):
    return [sample(np.dtype(dtype), shape, seed=r, op=op) for r in range(n)]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("count", [0, 1, 5, 37])
@pytest.mark.parametrize("algorithm", ["auto", "recursive_doubling", "ring"])
async def test_all_reduce_sizes_and_algorithms(
    run: Runner, n: int, count: int, algorithm: str
) -> None:
    xs = _inputs(n, (count,))
    expected = numpy_reduce(ReduceOp.SUM, xs)

    async def rank(comm: OpComm) -> None:
        await coll.all_reduce(comm, xs[comm.rank], ReduceOp.SUM, algorithm=algorithm)  # type: ignore[arg-type]

    await run(n, rank)
    for x in xs:
        np.testing.assert_array_equal(x, expected)


@pytest.mark.parametrize("n", [2, 3, 5, 8])
@pytest.mark.parametrize("chunk", [1, 8, 24, 1000])
async def test_ring_all_reduce_chunking(run: Runner, n: int, chunk: int) -> None:
    xs = _inputs(n, (3, 41), np.float32)
    expected = numpy_reduce(ReduceOp.SUM, xs)

    async def rank(comm: OpComm) -> None:
        await coll.ring_all_reduce(comm, xs[comm.rank], ReduceOp.SUM, chunk_bytes=chunk)

    await run(n, rank)
    for x in xs:
        np.testing.assert_array_equal(x, expected)


@pytest.mark.parametrize("chunk", [1, 8, 24, 1000, None])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT])
async def test_pair_all_reduce_pipelined(run: Runner, chunk: int | None, op: ReduceOp) -> None:
    xs = _inputs(2, (5, 37), np.float64, op)
    expected = numpy_reduce(op, xs)

    async def rank(comm: OpComm) -> None:
        await coll.pair_all_reduce_pipelined(comm, xs[comm.rank], op, chunk_bytes=chunk)

    await run(2, rank)
    for x in xs:
        np.testing.assert_array_equal(x, expected)


async def test_all_reduce_two_ranks_large(run: Runner) -> None:
    """Two ranks, several MiB: the chunked exchange with default chunks and slot reuse."""
    xs = [np.arange(3_000_001, dtype=np.int64) * (r + 1) for r in range(2)]

    async def rank(comm: OpComm) -> None:
        await coll.all_reduce(comm, xs[comm.rank], ReduceOp.SUM)

    await run(2, rank)
    for x in xs:
        np.testing.assert_array_equal(x, np.arange(3_000_001, dtype=np.int64) * 3)


@pytest.mark.parametrize("op", [op for op in ReduceOp if op is not ReduceOp.PREMUL_SUM])
@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("algorithm", ["recursive_doubling", "ring"])
async def test_all_reduce_every_op(run: Runner, op: ReduceOp, n: int, algorithm: str) -> None:
    dtype = np.int32 if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) else np.float64
    xs = _inputs(n, (50,), dtype, op)
    expected = numpy_reduce(op, xs)

    async def rank(comm: OpComm) -> None:
        await coll.all_reduce(comm, xs[comm.rank], op, algorithm=algorithm)  # type: ignore[arg-type]

    await run(n, rank)
    for x in xs:
        np.testing.assert_array_equal(x, expected)


async def test_all_reduce_large_ring_default_chunks(
    run: Runner,
) -> None:
    """A few MiB through the default chunking: many chunks, several windows."""
    n = 3
    xs = [np.full(1_000_003, r + 1, dtype=np.float32) for r in range(n)]

    async def rank(comm: OpComm) -> None:
        await coll.all_reduce(comm, xs[comm.rank], ReduceOp.AVG)

    await run(n, rank)
    for x in xs:
        np.testing.assert_array_equal(x, np.full(1_000_003, 2.0, dtype=np.float32))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("chunk", CHUNKS)
async def test_broadcast(run: Runner, n: int, chunk: int | None) -> None:
    for root in range(n):
        xs = _inputs(n, (4, 9), np.float32)
        expected = xs[root].copy()

        async def rank(comm: OpComm, root: int = root, xs: list[np.ndarray] = xs) -> None:
            await coll.broadcast(comm, xs[comm.rank], root, chunk_bytes=chunk)

        await run(n, rank)
        for x in xs:
            np.testing.assert_array_equal(x, expected)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN])
async def test_reduce(run: Runner, n: int, chunk: int | None, op: ReduceOp) -> None:
    for root in range(n):
        xs = _inputs(n, (5, 7), np.int16, op)
        originals = [x.copy() for x in xs]
        expected = numpy_reduce(op, originals)

        async def rank(comm: OpComm, root: int = root, xs: list[np.ndarray] = xs) -> None:
            await coll.reduce(comm, xs[comm.rank], root, op, chunk_bytes=chunk)

        await run(n, rank)
        for r, x in enumerate(xs):
            np.testing.assert_array_equal(x, expected if r == root else originals[r])


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("chunk", CHUNKS)
async def test_all_gather_into_views_of_one_output(run: Runner, n: int, chunk: int | None) -> None:
    xs = _inputs(n, (3, 5), np.complex64)
    outs = [np.zeros((n, 3, 5), np.complex64) for _ in range(n)]

    async def rank(comm: OpComm) -> None:
        big = outs[comm.rank]
        await coll.all_gather(comm, [big[i] for i in range(n)], xs[comm.rank], chunk_bytes=chunk)

    await run(n, rank)
    for out in outs:
        np.testing.assert_array_equal(out, np.stack(xs))


async def test_all_gather_output_list_holding_the_input(
    run: Runner,
) -> None:
    n = 3
    xs = _inputs(n, (6,))
    outs = [[np.zeros(6, np.int64) for _ in range(n)] for _ in range(n)]
    for r in range(n):
        outs[r][r] = xs[r]

    async def rank(comm: OpComm) -> None:
        await coll.all_gather(comm, outs[comm.rank], xs[comm.rank])

    await run(n, rank)
    for out in outs:
        for i in range(n):
            np.testing.assert_array_equal(out[i], xs[i])


@pytest.mark.parametrize("n", SIZES)
async def test_gather(run: Runner, n: int) -> None:
    for root in range(n):
        xs = _inputs(n, (2, 3), np.uint8)
        outs = [np.zeros((2, 3), np.uint8) for _ in range(n)]

        async def rank(
            comm: OpComm, root: int = root, xs: list[np.ndarray] = xs, outs: list[np.ndarray] = outs
        ) -> None:
            mine = outs if comm.rank == root else None
            await coll.gather(comm, mine, xs[comm.rank], root)

        await run(n, rank)
        np.testing.assert_array_equal(np.stack(outs), np.stack(xs))


@pytest.mark.parametrize("n", SIZES)
async def test_scatter(run: Runner, n: int) -> None:
    for root in range(n):
        ins = _inputs(n, (7,), np.float64)
        outs = [np.zeros(7) for _ in range(n)]

        async def rank(
            comm: OpComm,
            root: int = root,
            ins: list[np.ndarray] = ins,
            outs: list[np.ndarray] = outs,
        ) -> None:
            mine = ins if comm.rank == root else None
            await coll.scatter(comm, outs[comm.rank], mine, root)

        await run(n, rank)
        for r in range(n):
            np.testing.assert_array_equal(outs[r], ins[r])


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("chunk", [None, 8, 1])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.BXOR])
async def test_reduce_scatter(run: Runner, n: int, chunk: int | None, op: ReduceOp) -> None:
    ins = [
        [sample(np.dtype(np.int64), (11,), seed=r * n + i, op=op) for i in range(n)]
        for r in range(n)
    ]
    originals = [[a.copy() for a in row] for row in ins]
    outs = [np.zeros(11, np.int64) for _ in range(n)]

    async def rank(comm: OpComm) -> None:
        await coll.reduce_scatter(comm, outs[comm.rank], ins[comm.rank], op, chunk_bytes=chunk)

    await run(n, rank)
    for r in range(n):
        np.testing.assert_array_equal(outs[r], numpy_reduce(op, [ins[s][r] for s in range(n)]))
        for i in range(n):
            np.testing.assert_array_equal(ins[r][i], originals[r][i])


@pytest.mark.parametrize("n", SIZES)
async def test_all_to_all_uneven_blocks(run: Runner, n: int) -> None:
    # Rank s sends (s + d) % 3 elements to rank d: some blocks are empty.
    def size(s: int, d: int) -> int:
        return (s + d) % 3

    ins = [[np.full(size(s, d), 10 * s + d, np.int32) for d in range(n)] for s in range(n)]
    outs = [[np.zeros(size(s, d), np.int32) for s in range(n)] for d in range(n)]

    async def rank(comm: OpComm) -> None:
        await coll.all_to_all(comm, outs[comm.rank], ins[comm.rank])

    await run(n, rank)
    for d in range(n):
        for s in range(n):
            np.testing.assert_array_equal(outs[d][s], ins[s][d])


@pytest.mark.parametrize("n", SIZES)
async def test_barrier_waits_for_every_rank(run: Runner, n: int) -> None:
    entered: list[float] = [0.0] * n
    left: list[float] = [0.0] * n

    async def rank(comm: OpComm) -> None:
        await asyncio.sleep(0.002 * ((comm.rank * 3) % n))
        entered[comm.rank] = time.monotonic()
        await coll.barrier(comm)
        left[comm.rank] = time.monotonic()

    await run(n, rank)
    assert min(left) >= max(entered)


@pytest.mark.parametrize("kind", sorted(RUNNERS))
async def test_thousand_concurrent_all_reduces(kind: str) -> None:
    """1000 operations in flight at once on one group, told apart by sequence number."""
    n = 4
    world = await make_world(kind, n)
    ranks = list(range(n))
    arrays = {(r, s): np.full(3, s * (r + 1), np.int64) for r in range(n) for s in range(1000)}

    async def rank(r: int) -> None:
        ops = [
            coll.all_reduce(OpComm(world[r], ranks, r, 7, s), arrays[r, s], ReduceOp.SUM)
            for s in range(1000)
        ]
        # Every rank starts them in a different order.
        order = list(range(1000)) if r % 2 == 0 else list(reversed(range(1000)))
        await asyncio.gather(*(ops[s] for s in order))

    try:
        await asyncio.gather(*(rank(r) for r in range(n)))
    finally:
        for t in world:
            await t.aclose()
    for (_r, s), a in arrays.items():
        assert a.tolist() == [s * 10] * 3


async def test_size_mismatch_fails_with_usage_error() -> None:
    xs = [np.zeros(4), np.zeros(5)]

    async def rank(comm: OpComm) -> None:
        await coll.all_reduce(comm, xs[comm.rank], ReduceOp.SUM)

    world = LocalTransport.create_world(2)
    ranks = [0, 1]
    results = await asyncio.gather(
        *(rank(OpComm(world[r], ranks, r, 0, 0)) for r in range(2)), return_exceptions=True
    )
    for res in results:
        assert isinstance(res, DistUsageError)
        assert "message size mismatch" in str(res)


@pytest.mark.parametrize("algorithm", ["recursive_doubling", "ring"])
async def test_lost_peer_fails_every_rank(algorithm: str) -> None:
    """Rank 2 goes away; a rank whose operation fails drops its transport (as the process
    group does), so ranks waiting on it fail too instead of hanging."""
    world = LocalTransport.create_world(3)
    ranks = [0, 1, 2]
    xs = [np.zeros(1000) for _ in range(3)]

    async def rank(r: int) -> None:
        comm = OpComm(world[r], ranks, r, 0, 0)
        try:
            await coll.all_reduce(comm, xs[r], ReduceOp.SUM, algorithm=algorithm)  # type: ignore[arg-type]
        except BaseException as exc:
            world[r].abort(exc)
            raise

    tasks = [asyncio.create_task(rank(r)) for r in (0, 1)]
    await asyncio.sleep(0.01)
    await world[2].aclose()
    for task in tasks:
        with pytest.raises(DistNetworkError, match=r"lost connection to rank [0-2]"):
            await asyncio.wait_for(task, 5)


async def test_world_of_one_sends_nothing() -> None:
    x = np.arange(4.0)
    outs = [np.zeros(4)]

    async def rank(comm: OpComm) -> None:
        await coll.all_reduce(comm, x, ReduceOp.AVG)
        await coll.broadcast(comm, x, 0)
        await coll.reduce(comm, x, 0, ReduceOp.MAX)
        await coll.all_gather(comm, outs, x)
        await coll.reduce_scatter(comm, outs[0], [x], ReduceOp.SUM)
        await coll.all_to_all(comm, outs, [x])
        await coll.barrier(comm)

    world = LocalTransport.create_world(1)
    await run_on(world, rank)
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert outs[0].tolist() == [0.0, 1.0, 2.0, 3.0]


async def test_loop_keeps_ticking_during_large_all_reduce() -> None:
    """A 64 MiB all_reduce between two TCP ranks on this loop; a ticker task measures the
    largest gap between its turns. Reported (run with ``-s``), not asserted."""
    n = 2
    xs = [np.full(16 * 1024 * 1024, r + 1, np.float32) for r in range(n)]
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async def rank(comm: OpComm) -> None:
        await coll.all_reduce(comm, xs[comm.rank], ReduceOp.SUM)

    tick = asyncio.create_task(ticker())
    try:
        await RUNNERS["tcp"](n, rank)
    finally:
        done.set()
        await tick
    for x in xs:
        assert x[0] == 3.0
        assert x[-1] == 3.0
    print(f"largest gap between ticks during a 64 MiB all_reduce: {max(gaps) * 1e3:.2f} ms")


@pytest.mark.parametrize("n", [2, 3])
async def test_large_messages_default_chunking(run: Runner, n: int) -> None:
    """Blocks of several 512 KiB chunks, above the ready-signal threshold, every
    pipelined collective, twice (the second round finds its scratch in the pool)."""
    for seq in range(2):
        await _large_round(run, n, seq)


async def _large_round(run: Runner, n: int, seq: int) -> None:
    count = 300_001  # per block; float64: 2.4 MB
    xs = [np.full(count, r + 1 + seq, np.float64) for r in range(n)]
    ins = [[np.full(count, 10 * r + i, np.float64) for i in range(n)] for r in range(n)]
    gathered = [np.zeros((n, count)) for _ in range(n)]
    scattered = [np.zeros(count) for _ in range(n)]
    bcast = [np.full(count, float(r)) for r in range(n)]
    red = [np.full(count, float(r + 1)) for r in range(n)]

    async def rank(comm: OpComm) -> None:
        r = comm.rank
        await coll.all_reduce(comm, xs[r], ReduceOp.SUM)
        await coll.all_gather(comm.__class__(*_args(comm, 1)), list(gathered[r]), xs[r])
        await coll.reduce_scatter(
            comm.__class__(*_args(comm, 2)), scattered[r], ins[r], ReduceOp.SUM
        )
        await coll.broadcast(comm.__class__(*_args(comm, 3)), bcast[r], n - 1)
        await coll.reduce(comm.__class__(*_args(comm, 4)), red[r], 0, ReduceOp.MAX)

    await run(n, rank)
    total = sum(r + 1 + seq for r in range(n))
    for r in range(n):
        assert (xs[r] == total).all()
        assert (gathered[r] == total).all()
        assert (scattered[r] == sum(10 * s + r for s in range(n))).all()
        assert (bcast[r] == n - 1).all()
    assert (red[0] == n).all()
    for r in range(1, n):
        assert (red[r] == r + 1).all()


def _args(comm: OpComm, seq: int) -> tuple[Any, ...]:
    """Constructor arguments of another operation's OpComm on the same group."""
    return (comm._transport, comm._ranks, comm.rank, 0, comm._seq + seq)


@pytest.mark.parametrize("name", ["scatter", "gather", "broadcast", "reduce", "all_to_all"])
@pytest.mark.parametrize("big_rank", [0, 1])
async def test_size_mismatch_across_ready_threshold_fails_fast(
    run: Runner, name: str, big_rank: int
) -> None:
    """One rank's message is above the ready-signal threshold, the other's is tiny: the
    mismatch surfaces as a usage error instead of both ranks waiting for each other."""

    def arr(r: int) -> np.ndarray:
        return np.zeros(100_000 if r == big_rank else 3)

    async def rank(comm: OpComm) -> None:
        r = comm.rank
        if name == "scatter":
            await coll.scatter(comm, arr(r), [arr(r), arr(r)] if r == 0 else None, 0)
        elif name == "gather":
            await coll.gather(comm, [arr(r), arr(r)] if r == 0 else None, arr(r), 0)
        elif name == "broadcast":
            await coll.broadcast(comm, arr(r), 0)
        elif name == "reduce":
            await coll.reduce(comm, arr(r), 0, ReduceOp.SUM)
        else:
            await coll.all_to_all(comm, [arr(r), arr(r)], [arr(r), arr(r)])

    async def guarded(comm: OpComm) -> BaseException | None:
        try:
            await rank(comm)
        except DistUsageError as exc:
            comm._transport.abort(exc)  # as the process group does on failure
            return exc
        except DistNetworkError as exc:
            return exc
        return None

    results = await asyncio.wait_for(run(2, guarded), 10)
    assert any(isinstance(r, DistUsageError) for r in results), results
    assert any("message size mismatch" in str(r) for r in results)


class _LateSignals(Wrapped):
    """A LocalTransport whose ready signals arrive 20 ms late: a rank may then receive
    everything it needs before its neighbour's signal, and must still send its own part."""

    def send(
        self, peer: int, tag: Any, data: memoryview, *, cleared: bool = False
    ) -> asyncio.Future[None]:
        if tag[2] != READY_STEP:
            return self.inner.send(peer, tag, data, cleared=cleared)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        asyncio.get_running_loop().call_later(0.02, self.inner.send, peer, tag, data)
        return fut


@pytest.mark.parametrize("n", [2, 3, 4])
async def test_late_ready_signals(n: int) -> None:
    world = [_LateSignals(t) for t in LocalTransport.create_world(n)]
    try:
        for seq in range(2):

            def run(n: int, fn: Any, seq: int = seq) -> Any:
                return run_on(world, fn, seq=10 * seq)

            await asyncio.wait_for(_large_round(run, n, seq), 10)
    finally:
        await asyncio.sleep(0.05)  # let the delayed signals land before closing
        for t in world:
            await t.aclose()
