"""The direct shared-memory collectives and shared arrays, against numpy."""

from __future__ import annotations

import asyncio
import functools
import gc
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from collective_helpers import numpy_reduce, sample
from shm_helpers import leftovers, new_job

import aiodist
from aiodist._arrays._reduce import ReduceOp, check_reduce_op
from aiodist.collectives import _shared_array, shm
from aiodist.collectives.shm import NodeWorkspace
from aiodist.store import FileStore, HashStore
from aiodist.testing import start_world_processes

DTYPES = [np.dtype(t) for t in (np.bool_, np.int8, np.float16, np.float64)]
# Scalar, empty, one round, and several rounds of 8 KiB blocks (4 x 700 x 8 bytes).
SHAPES = [(), (0,), (5,), (4, 700)]
BLOCK = 8192


def ops_for(dtype: np.dtype[Any]) -> list[ReduceOp]:
    ok = []
    for op in ReduceOp:
        try:
            check_reduce_op(op, dtype)
        except aiodist.DistUsageError:
            continue
        ok.append(op)
    return ok


@pytest.fixture
def job() -> Any:
    key = new_job()
    yield key
    assert leftovers(key) == []


@pytest.fixture(params=["private", "shared"])
def shared(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Inputs as private arrays, or as shared arrays read in place (at any size)."""
    if request.param == "shared":
        monkeypatch.setattr(shm, "DIRECT_MIN_BYTES", 0)
    return bool(request.param == "shared")


async def workspaces(n: int, job: str, **kwargs: Any) -> list[NodeWorkspace]:
    store = HashStore()
    kwargs.setdefault("block_bytes", BLOCK)
    return list(
        await asyncio.gather(
            *(
                NodeWorkspace.create(store, r, n, timeout=10, job_key=job, **kwargs)
                for r in range(n)
            )
        )
    )


def place(a: np.ndarray, ws: NodeWorkspace, shared: bool) -> np.ndarray:
    """``a`` as a private copy, or copied into a shared array of ``ws``."""
    if not shared:
        return a.copy()
    out = _shared_array.empty(a.shape, a.dtype, ws)
    out[...] = a
    return out


class PerRank(list[Any]):
    """An argument that differs by rank: rank ``r`` gets element ``r``."""


async def each(wss: Sequence[NodeWorkspace], fn: Any, *args: Any) -> list[Any]:
    """``fn(ws, *args)`` on every rank at once (a :class:`PerRank` argument by rank)."""
    return list(
        await asyncio.gather(
            *(fn(ws, *(a[ws.rank] if isinstance(a, PerRank) else a for a in args)) for ws in wss)
        )
    )


async def on_all(wss: Sequence[NodeWorkspace], fn: Any) -> list[Any]:
    return list(await asyncio.gather(*(fn(ws) for ws in wss)))


async def close(wss: Sequence[NodeWorkspace]) -> None:
    for ws in wss:
        await ws.aclose()


def assert_in_place(wss: Sequence[NodeWorkspace], shared: bool) -> None:
    if shared and len(wss) > 1:
        assert all(ws.statistics().in_place > 0 for ws in wss)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
async def test_all_reduce_and_reduce_every_op_dtype_and_shape(
    n: int, shared: bool, job: str
) -> None:
    wss = await workspaces(n, job)
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for shape in SHAPES:
                xs = [sample(dtype, shape, 10 * r + int(op), op) for r in range(n)]
                want = numpy_reduce(op, xs)
                ys = [place(x, ws, shared) for x, ws in zip(xs, wss, strict=True)]
                await each(wss, shm.all_reduce, PerRank(ys), op)
                for y in ys:
                    np.testing.assert_array_equal(y, want, err_msg=f"{dtype} {op!r} {shape}")
                root = n - 1
                zs = [place(x, ws, shared) for x, ws in zip(xs, wss, strict=True)]
                await each(wss, shm.reduce, PerRank(zs), root, op)
                np.testing.assert_array_equal(zs[root], want, err_msg=f"{dtype} {op!r} {shape}")
                for r in range(n - 1):
                    np.testing.assert_array_equal(zs[r], xs[r])  # non-roots untouched
    assert_in_place(wss, shared)
    await close(wss)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
async def test_broadcast_all_gather_gather_scatter(n: int, shared: bool, job: str) -> None:
    wss = await workspaces(n, job)
    for dtype in DTYPES:
        for shape in SHAPES:
            xs = [sample(dtype, shape, r) for r in range(n)]
            for root in {0, n - 1}:
                bs = [place(x, ws, shared) for x, ws in zip(xs, wss, strict=True)]
                await each(wss, shm.broadcast, PerRank(bs), root)
                for b in bs:
                    np.testing.assert_array_equal(b, xs[root])
            ins = [place(x, ws, shared) for x, ws in zip(xs, wss, strict=True)]
            outs = [[np.zeros(shape, dtype) for _ in range(n)] for _ in range(n)]
            await each(wss, shm.all_gather, PerRank(outs), PerRank(ins))
            for o in outs:
                for j in range(n):
                    np.testing.assert_array_equal(o[j], xs[j])
            flat = [np.zeros((n, *shape), dtype) for _ in range(n)]
            await each(wss, shm.all_gather_into_tensor, PerRank(flat), PerRank(ins))
            for f in flat:
                np.testing.assert_array_equal(f, np.stack(xs))
            got = [np.zeros(shape, dtype) for _ in range(n)]
            await each(
                wss,
                shm.gather,
                PerRank(got if r == 1 % n else None for r in range(n)),
                PerRank(ins),
                1 % n,
            )
            for j in range(n):
                np.testing.assert_array_equal(got[j], xs[j])
            pieces = [place(sample(dtype, shape, 50 + j), wss[0], shared) for j in range(n)]
            into = [np.zeros(shape, dtype) for _ in range(n)]
            await each(
                wss,
                shm.scatter,
                PerRank(into),
                PerRank(pieces if r == 0 else None for r in range(n)),
                0,
            )
            for j in range(n):
                np.testing.assert_array_equal(into[j], pieces[j])
    assert_in_place(wss, shared)
    await close(wss)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
async def test_reduce_scatter_every_op_and_dtype(n: int, shared: bool, job: str) -> None:
    wss = await workspaces(n, job)
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for shape in [(0,), (3,), (2, 1500)]:
                ins = [
                    [place(sample(dtype, shape, 7 * r + j, op), wss[r], shared) for j in range(n)]
                    for r in range(n)
                ]
                outs = [np.zeros(shape, dtype) for _ in range(n)]
                await each(wss, shm.reduce_scatter, PerRank(outs), PerRank(ins), op)
                for j in range(n):
                    want = numpy_reduce(op, [ins[r][j] for r in range(n)])
                    np.testing.assert_array_equal(outs[j], want, err_msg=f"{dtype} {op!r}")
        big = [place(sample(dtype, (n * 40,), r), wss[r], shared) for r in range(n)]
        res = [np.zeros(40, dtype) for _ in range(n)]
        await each(wss, shm.reduce_scatter_tensor, PerRank(res), PerRank(big), ReduceOp.MAX)
        for j in range(n):
            want = numpy_reduce(ReduceOp.MAX, [b[40 * j : 40 * (j + 1)] for b in big])
            np.testing.assert_array_equal(res[j], want)
    assert_in_place(wss, shared)
    await close(wss)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
async def test_all_to_all_blocks_of_any_size(n: int, shared: bool, job: str) -> None:
    wss = await workspaces(n, job)

    def size(s: int, j: int) -> int:  # 0 included, and several rounds for some pairs
        return (s * 977 + j * 331) % 2500

    for dtype in (np.dtype(np.int8), np.dtype(np.float64)):
        ins = [
            [place(sample(dtype, (size(s, j),), 3 * s + j), wss[s], shared) for j in range(n)]
            for s in range(n)
        ]
        outs = [[np.zeros(size(j, r), dtype) for j in range(n)] for r in range(n)]
        await each(wss, shm.all_to_all, PerRank(outs), PerRank(ins))
        for r in range(n):
            for j in range(n):
                np.testing.assert_array_equal(outs[r][j], ins[j][r])
        xs = [place(sample(dtype, (n * 6, 2), s), wss[s], shared) for s in range(n)]
        ys = [np.zeros((n * 6, 2), dtype) for _ in range(n)]
        await each(wss, shm.all_to_all_single, PerRank(ys), PerRank(xs))
        for r in range(n):
            for j in range(n):
                np.testing.assert_array_equal(ys[r][6 * j : 6 * j + 6], xs[j][6 * r : 6 * r + 6])
    await on_all(wss, shm.barrier)
    assert_in_place(wss, shared)
    await close(wss)


@pytest.mark.both_loops
async def test_a_barrier_waits_for_the_last_rank(job: str) -> None:
    wss = await workspaces(3, job)
    for late in range(3):  # each rank's counter in turn
        arrived: list[float] = []
        returned: list[float] = []

        async def rank(
            ws: NodeWorkspace,
            late: int = late,
            arrived: list[float] = arrived,
            returned: list[float] = returned,
        ) -> None:
            if ws.rank == late:
                await asyncio.sleep(0.1)
                arrived.append(time.monotonic())
            await shm.barrier(ws)
            returned.append(time.monotonic())

        await on_all(wss, rank)
        assert min(returned) >= arrived[0]
    # And so does every other operation's first barrier.
    xs = [np.full(4, float(r)) for r in range(3)]

    async def late_all_reduce(ws: NodeWorkspace) -> float:
        if ws.rank == 0:
            await asyncio.sleep(0.1)
        await shm.all_reduce(ws, xs[ws.rank], ReduceOp.SUM)
        return time.monotonic()

    start = time.monotonic()
    done = await on_all(wss, late_all_reduce)
    assert min(done) - start >= 0.09  # the loop clock may wake a hair early
    assert all((x == 3.0).all() for x in xs)
    await close(wss)


async def test_calls_issued_at_once_run_in_call_order(job: str) -> None:
    wss = await workspaces(3, job)
    xs = [[np.full(1000, float(r + i)) for i in range(30)] for r in range(3)]

    async def rank(ws: NodeWorkspace) -> None:
        # Thirty operations started before any is awaited, in the same order everywhere.
        tasks = [asyncio.create_task(shm.all_reduce(ws, x, ReduceOp.SUM)) for x in xs[ws.rank]]
        tasks.append(asyncio.create_task(shm.barrier(ws)))
        await asyncio.gather(*tasks)

    await on_all(wss, rank)
    for i in range(30):
        for r in range(3):
            assert (xs[r][i] == 3 + 3 * i).all()
    await close(wss)


async def test_a_mismatch_raises_the_same_error_everywhere_and_the_workspace_goes_on(
    job: str,
) -> None:
    wss = await workspaces(3, job)

    async def different(ws: NodeWorkspace) -> None:
        x = np.zeros(4, np.float32)
        if ws.rank == 1:
            await shm.broadcast(ws, x, 0)
        else:
            await shm.all_reduce(ws, x, ReduceOp.SUM)

    results = await asyncio.gather(*(different(ws) for ws in wss), return_exceptions=True)
    messages = {str(e) for e in results}
    assert len(messages) == 1 and all(isinstance(e, aiodist.DistUsageError) for e in results)
    (msg,) = messages
    assert msg.startswith(
        "collective mismatch: rank 0 called all_reduce(shape=(4,), dtype=float32, op=SUM) as "
        "op #1 but rank 1 called broadcast(shape=(4,), dtype=float32, src=0)"
    )

    async def sizes(ws: NodeWorkspace) -> None:
        ins = [np.zeros(3 if (ws.rank, j) == (2, 0) else 2, np.int8) for j in range(3)]
        outs = [np.zeros(2, np.int8) for _ in range(3)]
        await shm.all_to_all(ws, outs, ins)

    results = await asyncio.gather(*(sizes(ws) for ws in wss), return_exceptions=True)
    assert {str(e) for e in results} == {
        "all_to_all: rank 2 sends 3 bytes to rank 0, which expects 2 bytes from it"
    }
    # Still usable.
    xs = [np.full(3, r + 1.0) for r in range(3)]
    await each(wss, shm.all_reduce, PerRank(xs), ReduceOp.SUM)
    assert all((x == 6.0).all() for x in xs)
    await close(wss)


async def test_closing_aborting_or_cancelling_fails_the_peers_by_name(job: str) -> None:
    wss = await workspaces(3, job)
    await wss[2].aclose()
    with pytest.raises(aiodist.DistUsageError, match="is closed"):
        await shm.barrier(wss[2])
    results = await asyncio.gather(*(shm.barrier(ws) for ws in wss[:2]), return_exceptions=True)
    for e in results:
        assert isinstance(e, aiodist.DistNetworkError)
        assert str(e) == "lost connection to rank 2: it closed the shared-memory workspace"
    await close(wss)

    wss = await workspaces(2, job, ranks=[5, 9])
    wss[1].abort(aiodist.DistNetworkError("the group was aborted"))
    with pytest.raises(
        aiodist.DistNetworkError,
        match=r"lost connection to rank 9: it aborted: DistNetworkError: the group was aborted",
    ):
        await shm.barrier(wss[0])
    await close(wss)

    wss = await workspaces(2, job)
    task = asyncio.create_task(shm.barrier(wss[0]))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # Rank 0 had arrived before it gave up, so this barrier completes; the next fails.
    await shm.barrier(wss[1])
    with pytest.raises(
        aiodist.DistNetworkError, match="rank 0 cancelled a shared-memory operation"
    ):
        await shm.barrier(wss[1])
    with pytest.raises(aiodist.DistNetworkError, match="cancelled"):
        await shm.barrier(wss[0])
    await close(wss)

    # Cancelled while waiting for its turn: it would have been the group's next operation.
    wss = await workspaces(2, job)
    first = asyncio.create_task(shm.barrier(wss[0]))
    queued = asyncio.create_task(shm.barrier(wss[0]))
    await asyncio.sleep(0.05)
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    with pytest.raises(aiodist.DistNetworkError, match="rank 0 cancelled"):
        await first
    await shm.barrier(wss[1])  # pairs with the first, which had arrived
    with pytest.raises(aiodist.DistNetworkError, match="rank 0 cancelled"):
        await shm.barrier(wss[1])
    await close(wss)


async def test_bad_workspace_arguments(job: str) -> None:
    store = HashStore()
    with pytest.raises(aiodist.DistUsageError, match="block_bytes must be a multiple of 4096"):
        await NodeWorkspace.create(store, 0, 2, block_bytes=1000, job_key=job)
    with pytest.raises(aiodist.DistUsageError, match=r"rank must be in \[0, 2\)"):
        await NodeWorkspace.create(store, 2, 2, job_key=job)
    with pytest.raises(aiodist.DistTimeoutError, match=r"ranks \[1\] did not arrive"):
        await NodeWorkspace.create(store, 0, 2, job_key=job, timeout=0.3)


async def test_shared_arrays_are_mapped_lazily_and_unmapped_when_dropped(
    job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shm, "DIRECT_MIN_BYTES", 0)
    wss = await workspaces(2, job)
    # Above SMALL_BYTES: smaller all_reduces always go through the workspace.
    shape = (100, 50)
    z = _shared_array.zeros(shape, np.int32, wss[0])
    assert z.shape == shape and z.dtype == np.int32 and (z == 0).all()
    assert z.flags.c_contiguous and z.flags.writeable
    loc = _shared_array.locate(z[1:], wss[0])
    assert loc is not None and loc.offset == 200
    assert _shared_array.locate(np.zeros(3), wss[0]) is None
    xs = [z, _shared_array.empty(shape, np.int32, wss[1])]
    xs[0][...] = 1
    xs[1][...] = 2
    await each(wss, shm.all_reduce, PerRank(xs), ReduceOp.SUM)
    assert (xs[0] == 3).all() and (xs[1] == 3).all()
    assert wss[1].statistics().mapped == 1  # rank 0's array, mapped by rank 1
    # Rank 0 drops its array: rank 1 unmaps it at its next operation.
    del z, xs[0]
    gc.collect()
    await on_all(wss, shm.barrier)
    mine = np.full(shape, 2, np.int32)
    await each(wss, shm.all_reduce, PerRank([mine, xs[0]]), ReduceOp.SUM)
    assert wss[1].statistics().mapped == 0
    with pytest.raises(aiodist.DistUsageError, match="shape must hold non-negative ints"):
        _shared_array.empty((-1,), np.float32, wss[0])
    with pytest.raises(aiodist.DistUsageError, match="dtype"):
        _shared_array.empty(3, object, wss[0])
    await close(wss)
    with pytest.raises(aiodist.DistUsageError, match="is closed"):
        _shared_array.empty(3, np.float32, wss[0])


# -- real processes -------------------------------------------------------------------------


async def _battery(path: str, job: str, rank: int, n: int) -> bool:
    store = FileStore(path)
    ws = await NodeWorkspace.create(store, rank, n, timeout=30, job_key=job, block_bytes=BLOCK)
    try:
        for share in (False, True):
            for dtype in (np.dtype(np.float16), np.dtype(np.int64), np.dtype(np.bool_)):
                for shape in ((), (7,), (3, 10_000)):
                    for op in (ReduceOp.SUM, ReduceOp.MAX):
                        xs = [sample(dtype, shape, r, op) for r in range(n)]
                        x = place(xs[rank], ws, share)
                        await shm.all_reduce(ws, x, op)
                        np.testing.assert_array_equal(x, numpy_reduce(op, xs))
                    b = place(sample(dtype, shape, rank), ws, share)
                    await shm.broadcast(ws, b, n - 1)
                    np.testing.assert_array_equal(b, sample(dtype, shape, n - 1))
                    outs = [np.zeros(shape, dtype) for _ in range(n)]
                    await shm.all_gather(ws, outs, place(sample(dtype, shape, rank), ws, share))
                    for j in range(n):
                        np.testing.assert_array_equal(outs[j], sample(dtype, shape, j))
            ins = [place(np.full(3000 + j, rank * 10 + j, np.int32), ws, share) for j in range(n)]
            outs = [np.zeros(3000 + rank, np.int32) for _ in range(n)]
            await shm.all_to_all(ws, outs, ins)
            assert [int(o[0]) for o in outs] == [j * 10 + rank for j in range(n)]
        return ws.statistics().in_place > 0
    finally:
        await ws.aclose()


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 4])
def test_processes_run_the_direct_collectives(
    n: int, job: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 4 ranks on this 2-CPU machine: barriers sleep on doorbells instead of polling.
    battery = functools.partial(_battery, str(tmp_path / "store"), job)
    with start_world_processes(battery, n, timeout=90, init_group=False) as world:
        assert world.results() == [True] * n


async def _keep_reducing(path: str, job: str, rank: int, n: int) -> tuple[str, float]:
    store = FileStore(path)
    ws = await NodeWorkspace.create(store, rank, n, timeout=30, job_key=job)
    x = np.ones(4 << 20, np.float32)
    await store.add("looping", 1)
    try:
        while True:
            await shm.all_reduce(ws, x, ReduceOp.MAX)
    except aiodist.DistNetworkError as exc:
        return str(exc), time.time()
    finally:
        await ws.aclose()


@pytest.mark.multiprocess
async def test_a_rank_killed_mid_operation_is_named_by_every_survivor(
    job: str, tmp_path: Any
) -> None:
    path = str(tmp_path / "store")
    rank_main = functools.partial(_keep_reducing, path, job)
    with start_world_processes(rank_main, 3, timeout=60, init_group=False) as world:
        store = FileStore(path)
        while int(await store.add("looping", 0)) < 3:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # well inside a 16 MiB all_reduce loop
        assert leftovers(job) == []  # every name is gone once set up
        pid = world.procs[1].pid
        killed_at = time.time()
        world.procs[1].kill()
        results = await asyncio.to_thread(world.results, timeout=30, ranks=[0, 2])
    for msg, failed_at in results:
        assert msg == f"lost connection to rank 1: its process (pid {pid}) exited"
        assert failed_at - killed_at < 2.0
    assert leftovers(job) == []
