"""The staged path's algorithms over real loopback TCP, with host memory as the device.

:class:`HostMover` is the device interface over numpy buffers; the chunking, pipelining,
block splits, per-chunk steps and device-side reductions are the code a GPU runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import aiodist
from aiodist._arrays._fingerprint import fingerprint
from aiodist._arrays._reduce import ReduceOp
from aiodist.backends import _cuda_staged as staged
from aiodist.group import Plan, ProcessGroup, current_world

pytestmark = pytest.mark.both_loops  # the standard loop (asyncio.run, uvicorn) too

BF16 = np.dtype(ml_dtypes.bfloat16)
MOVER = staged.HostMover()


def group() -> ProcessGroup:
    return current_world().default_group


def issue(name: str, algorithm: Callable[..., Any], *args: Any) -> aiodist.Work[Any]:
    """Run ``algorithm(comm, *args)`` as a collective of the default group."""
    fp = fingerprint(name)
    return group().issue(name, lambda pg, op, a: Plan(algorithm, a, fp), args)


def u8(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


def data(rank: int, n: int, dtype: np.dtype[Any]) -> np.ndarray:
    rng = np.random.default_rng(rank + 7)
    if dtype.kind in "iu":
        return rng.integers(0, 50, n).astype(dtype)
    return rng.normal(size=n).astype(np.float32).astype(dtype)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize(
    ("chunk", "window"), [(staged.CHUNK_BYTES, staged.WINDOW), (104, 2), (40, 3)]
)
async def test_all_reduce(size: int, chunk: int, window: int) -> None:
    count = 1001  # blocks of unequal sizes, a short last chunk

    async def fn(rank: int, n: int) -> None:
        for dtype, op in [
            (np.dtype(np.float32), ReduceOp.SUM),
            (np.dtype(np.int64), ReduceOp.MAX),
            (np.dtype(np.int32), ReduceOp.AVG),
            (BF16, ReduceOp.SUM),
        ]:
            x = data(rank, count, dtype)
            inputs = [data(r, count, dtype) for r in range(n)]
            await issue_kw(
                staged.staged_all_reduce,
                (MOVER, u8(x), dtype, op, None),
                chunk_bytes=chunk,
                window=window,
            )
            if op is ReduceOp.SUM and dtype == BF16:
                expected = sum(a.astype(np.float32) for a in inputs)
                np.testing.assert_allclose(x.astype(np.float32), expected, rtol=2e-2, atol=5e-2)
            elif op is ReduceOp.SUM:
                np.testing.assert_allclose(x, sum(inputs), rtol=1e-5)
            elif op is ReduceOp.MAX:
                np.testing.assert_array_equal(x, np.maximum.reduce(inputs))
            else:
                np.testing.assert_array_equal(x, sum(inputs) // n)

    await aiodist.testing.run_world(fn, size, timeout=60)


async def issue_kw(algorithm: Callable[..., Any], args: tuple[Any, ...], **kw: Any) -> Any:
    async def run(comm: Any, *a: Any) -> None:
        await algorithm(comm, *a, **kw)

    return await issue(algorithm.__name__.removeprefix("staged_"), run, *args)


def test_issue_kw_names_are_collectives() -> None:
    # The fingerprints used above name real collectives.
    for name in ["all_reduce", "reduce", "reduce_scatter", "broadcast", "all_gather", "gather"]:
        assert fingerprint(name)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
async def test_reduce_premul_and_reduce_scatter(size: int) -> None:
    count, chunk = 257, 64

    async def fn(rank: int, n: int) -> None:
        inputs = [data(r, count, np.dtype(np.float64)) for r in range(n)]
        x = inputs[rank].copy()
        for root in range(n):
            y = x.copy()
            await issue_kw(
                staged.staged_reduce,
                (MOVER, u8(y), np.dtype(np.float64), ReduceOp.PREMUL_SUM, root, 0.25),
                chunk_bytes=chunk,
            )
            if rank == root:
                np.testing.assert_allclose(y, 0.25 * sum(inputs))
            else:
                np.testing.assert_array_equal(y, x)  # only read
        blocks = [data(rank * 10 + j, count, np.dtype(np.int16)) for j in range(n)]
        out = np.zeros(count, np.int16)
        await issue_kw(
            staged.staged_reduce_scatter,
            (MOVER, u8(out), [u8(b) for b in blocks], np.dtype(np.int16), ReduceOp.SUM, None),
            chunk_bytes=chunk,
        )
        expected = sum(data(r * 10 + rank, count, np.dtype(np.int16)) for r in range(n))
        np.testing.assert_array_equal(out, expected.astype(np.int16))

    await aiodist.testing.run_world(fn, size, timeout=60)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
async def test_data_movement(size: int) -> None:
    count, chunk = 300, 128

    async def fn(rank: int, n: int) -> None:
        mine = np.arange(count, dtype=np.float32) + 1000 * rank
        # broadcast from every root
        for root in range(n):
            x = mine.copy()
            await issue_kw(staged.staged_broadcast, (MOVER, u8(x), root), chunk_bytes=chunk)
            np.testing.assert_array_equal(x, np.arange(count, dtype=np.float32) + 1000 * root)
        # all_gather
        outs = [np.zeros(count, np.float32) for _ in range(n)]
        await issue_kw(
            staged.staged_all_gather, (MOVER, [u8(o) for o in outs], u8(mine)), chunk_bytes=chunk
        )
        for r, o in enumerate(outs):
            np.testing.assert_array_equal(o, np.arange(count, dtype=np.float32) + 1000 * r)
        # gather / scatter at the last rank
        root = n - 1
        gathered = [np.zeros(count, np.float32) for _ in range(n)] if rank == root else None
        await issue_kw(
            staged.staged_gather,
            (MOVER, None if gathered is None else [u8(g) for g in gathered], u8(mine), root),
            chunk_bytes=chunk,
        )
        if gathered is not None:
            for r, g in enumerate(gathered):
                np.testing.assert_array_equal(g, np.arange(count, dtype=np.float32) + 1000 * r)
        pieces = [np.full(count, 10.0 * r, np.float32) for r in range(n)] if rank == root else None
        out = np.zeros(count, np.float32)
        await issue_kw(
            staged.staged_scatter,
            (MOVER, u8(out), None if pieces is None else [u8(p) for p in pieces], root),
            chunk_bytes=chunk,
        )
        np.testing.assert_array_equal(out, np.full(count, 10.0 * rank, np.float32))
        # all_to_all with blocks of different sizes (zero included)
        ins = [np.full(rank + j, rank * 100 + j, np.int64) for j in range(n)]
        outs2 = [np.zeros(j + rank, np.int64) for j in range(n)]
        await issue_kw(
            staged.staged_all_to_all, (MOVER, [u8(o) for o in outs2], [u8(i) for i in ins])
        )
        for j, o in enumerate(outs2):
            np.testing.assert_array_equal(o, np.full(j + rank, j * 100 + rank, np.int64))

    await aiodist.testing.run_world(fn, size, timeout=60)


async def test_send_recv() -> None:
    async def fn(rank: int, n: int) -> int | None:
        pg = group()
        if rank == 0:
            x = np.arange(1000, dtype=np.float64)

            async def send(comm: Any) -> None:
                await staged.staged_send(comm, MOVER, 1, u8(x))

            await pg.issue_p2p(
                "send",
                lambda g, op, a: Plan(send, ()),
                (),
                peer=1,
                group_peer=None,
                tag=5,
                sends=True,
            )
            return None
        out = np.zeros(1000, np.float64)

        async def recv(comm: Any) -> int:
            return await staged.staged_recv(comm, MOVER, None, u8(out))

        sender = await pg.issue_p2p(
            "recv",
            lambda g, op, a: Plan(recv, ()),
            (),
            peer=None,
            group_peer=None,
            tag=5,
            sends=False,
        )
        np.testing.assert_array_equal(out, np.arange(1000, dtype=np.float64))
        return int(sender)

    assert await aiodist.testing.run_world(fn, 2) == [None, 0]


def test_chunks() -> None:
    assert staged.chunks(0) == []
    assert staged.chunks(10, 4, 8) == [(0, 8), (8, 10)]
    assert staged.chunks(10, 8, 4) == [(0, 8), (8, 10)]  # at least one item per chunk
    assert staged.chunks(12, 3, 7) == [(0, 6), (6, 12)]
    spans = staged.chunks(5 << 20)
    assert spans == [(0, 4 << 20), (4 << 20, 5 << 20)]


async def test_failure_in_one_chunk_cancels_the_rest() -> None:
    started: list[int] = []

    async def run(c: int) -> None:
        started.append(c)
        if c == 2:
            raise aiodist.DistBackendError("chunk 2 failed")
        await asyncio.sleep(0.01)

    with pytest.raises(aiodist.DistBackendError, match="chunk 2 failed"):
        await staged._pipeline(10, run, 2)
    assert started == [0, 1, 2, 3] or started[:3] == [0, 1, 2]
    assert 9 not in started


# -- the IPC path's rounds, with host buffers as the slabs ------------------------------------
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("slab_bytes", [1024, 4096])
async def test_ipc_rounds(size: int, slab_bytes: int) -> None:
    from aiodist.backends import _cuda_ipc as ipc

    # Ranks are tasks of one process: each rank's slab is visible to all, as IPC maps them.
    slabs = [np.zeros(slab_bytes, np.uint8) for _ in range(size)]
    count = 203

    async def fn(rank: int, n: int) -> None:
        inputs = [data(r, count, np.dtype(np.float32)) for r in range(n)]
        x = inputs[rank].copy()
        await issue(
            "all_reduce",
            ipc.ipc_all_reduce,
            MOVER,
            slabs,
            u8(x),
            np.dtype(np.float32),
            ReduceOp.SUM,
            None,
        )
        np.testing.assert_allclose(x, sum(inputs), rtol=1e-5)
        y = inputs[rank].copy()
        await issue(
            "all_reduce",
            ipc.ipc_all_reduce,
            MOVER,
            slabs,
            u8(y),
            np.dtype(np.float32),
            ReduceOp.AVG,
            None,
        )
        np.testing.assert_allclose(y, sum(inputs) / n, rtol=1e-5)
        root = n - 1
        z = inputs[rank].copy()
        await issue(
            "reduce",
            ipc.ipc_reduce,
            MOVER,
            slabs,
            u8(z),
            np.dtype(np.float32),
            ReduceOp.MAX,
            root,
            None,
        )
        np.testing.assert_array_equal(
            z, np.maximum.reduce(inputs) if rank == root else inputs[rank]
        )
        blocks = [np.full(count, rank * 10 + j, np.int32) for j in range(n)]
        out = np.zeros(count, np.int32)
        await issue(
            "reduce_scatter",
            ipc.ipc_reduce_scatter,
            MOVER,
            slabs,
            u8(out),
            [u8(b) for b in blocks],
            np.dtype(np.int32),
            ReduceOp.SUM,
            None,
        )
        np.testing.assert_array_equal(out, sum(r * 10 + rank for r in range(n)))
        b = np.arange(count, dtype=np.int64) * (rank + 1)
        await issue("broadcast", ipc.ipc_broadcast, MOVER, slabs, u8(b), 0)
        np.testing.assert_array_equal(b, np.arange(count, dtype=np.int64))
        outs = [np.zeros(count, np.int64) for _ in range(n)]
        mine = np.arange(count, dtype=np.int64) + rank
        await issue("all_gather", ipc.ipc_all_gather, MOVER, slabs, [u8(o) for o in outs], u8(mine))
        for r, o in enumerate(outs):
            np.testing.assert_array_equal(o, np.arange(count, dtype=np.int64) + r)
        got = [np.zeros(count, np.int64) for _ in range(n)] if rank == root else None
        await issue(
            "gather",
            ipc.ipc_gather,
            MOVER,
            slabs,
            None if got is None else [u8(g) for g in got],
            u8(mine),
            root,
        )
        if got is not None:
            for r, g in enumerate(got):
                np.testing.assert_array_equal(g, np.arange(count, dtype=np.int64) + r)
        pieces = [np.full(count, r, np.int64) for r in range(n)] if rank == root else None
        sc = np.zeros(count, np.int64)
        await issue(
            "scatter",
            ipc.ipc_scatter,
            MOVER,
            slabs,
            u8(sc),
            None if pieces is None else [u8(p) for p in pieces],
            root,
        )
        np.testing.assert_array_equal(sc, np.full(count, rank, np.int64))

    await aiodist.testing.run_world(fn, size, timeout=60)
