"""Every collective of the async API, on ranks run as tasks over loopback TCP, vs numpy."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import numpy as np
import pytest

import aiodist
from aiodist.testing import run_world

pytestmark = pytest.mark.both_loops


@pytest.fixture(params=["tcp", "shm"])
def transport(request: pytest.FixtureRequest) -> str:
    """Every test over TCP, and over shared memory (the transport and direct algorithms)."""
    return str(request.param)


SIZES = [1, 2, 3, 4]


def data(rank: int, shape: tuple[int, ...] = (5, 3), dtype: str = "float64") -> np.ndarray:
    """Rank ``rank``'s input: distinct per rank, exactly representable."""
    rng = np.random.default_rng(1000 + rank)
    return rng.integers(-8, 9, size=shape).astype(dtype)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize(
    ("op", "ref"),
    [
        (aiodist.ReduceOp.SUM, lambda xs: np.sum(xs, axis=0)),
        (aiodist.ReduceOp.PRODUCT, lambda xs: np.prod(xs, axis=0)),
        (aiodist.ReduceOp.MIN, lambda xs: np.min(xs, axis=0)),
        (aiodist.ReduceOp.MAX, lambda xs: np.max(xs, axis=0)),
        (aiodist.ReduceOp.AVG, lambda xs: np.mean(xs, axis=0)),
    ],
)
async def test_all_reduce(n: int, op: aiodist.ReduceOp, ref, transport: str) -> None:
    async def fn(rank: int, size: int) -> np.ndarray:
        x = data(rank)
        out = await aiodist.all_reduce(x, op=op)
        assert out is x
        return x

    expected = ref([data(r) for r in range(n)])
    for got in await run_world(fn, n, transport=transport):
        np.testing.assert_allclose(got, expected)


@pytest.mark.parametrize("dtype", ["int32", "uint8", "bool", "complex64", "float16"])
async def test_all_reduce_dtypes(dtype: str, transport: str) -> None:
    async def fn(rank: int, size: int) -> np.ndarray:
        x = data(rank, (7,), dtype)
        await aiodist.all_reduce(x)
        return x

    xs = [data(r, (7,), dtype) for r in range(3)]
    expected = np.logical_or.reduce(xs) if dtype == "bool" else np.sum(xs, axis=0, dtype=dtype)
    for got in await run_world(fn, 3, transport=transport):
        np.testing.assert_array_equal(got, expected)


async def test_all_reduce_bitwise_and_large(transport: str) -> None:
    async def fn(rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        x = np.arange(16, dtype=np.int64) * (rank + 1)
        await aiodist.all_reduce(x, op=aiodist.ReduceOp.BXOR)
        # Large enough for the ring algorithm.
        big = np.full(1 << 19, rank, np.float32)
        await aiodist.all_reduce(big)
        return x, big

    expected = np.bitwise_xor.reduce([np.arange(16, dtype=np.int64) * (r + 1) for r in range(3)])
    for x, big in await run_world(fn, 3, transport=transport):
        np.testing.assert_array_equal(x, expected)
        assert (big == 3).all()


@pytest.mark.parametrize("n", SIZES)
async def test_broadcast_src_and_group_src(n: int, transport: str) -> None:
    async def fn(rank: int, size: int) -> list[np.ndarray]:
        a = data(rank)
        await aiodist.broadcast(a, src=size - 1)
        b = data(rank, (4,), "int16")
        await aiodist.broadcast(b, group_src=0)
        return [a, b]

    for a, b in await run_world(fn, n, transport=transport):
        np.testing.assert_array_equal(a, data(n - 1))
        np.testing.assert_array_equal(b, data(0, (4,), "int16"))


@pytest.mark.parametrize("n", SIZES)
async def test_reduce(n: int, transport: str) -> None:
    async def fn(rank: int, size: int) -> np.ndarray:
        x = data(rank)
        await aiodist.reduce(x, dst=size // 2, op=aiodist.ReduceOp.MAX)
        return x

    results = await run_world(fn, n, transport=transport)
    np.testing.assert_array_equal(results[n // 2], np.max([data(r) for r in range(n)], axis=0))


async def test_reduce_leaves_other_ranks_alone_and_takes_read_only_inputs(transport: str) -> None:
    async def fn(rank: int, size: int) -> np.ndarray:
        x = data(rank)
        if rank != 0:
            x.setflags(write=False)
        await aiodist.reduce(x, dst=0)
        return x

    results = await run_world(fn, 3, transport=transport)
    np.testing.assert_array_equal(results[0], np.sum([data(r) for r in range(3)], axis=0))
    for r in (1, 2):
        np.testing.assert_array_equal(results[r], data(r))


@pytest.mark.parametrize("n", SIZES)
async def test_all_gather_and_into_tensor(n: int, transport: str) -> None:
    async def fn(rank: int, size: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        x = data(rank)
        outs = [np.empty_like(x) for _ in range(size)]
        got = await aiodist.all_gather(outs, x)
        assert got is outs
        flat = np.empty((size * 5, 3))
        await aiodist.all_gather_into_tensor(flat, x)
        stacked = np.empty((size, 5, 3))
        await aiodist.all_gather_into_tensor(stacked, x)
        return outs, flat, stacked

    everyone = [data(r) for r in range(n)]
    for outs, flat, stacked in await run_world(fn, n, transport=transport):
        for r in range(n):
            np.testing.assert_array_equal(outs[r], everyone[r])
        np.testing.assert_array_equal(flat, np.concatenate(everyone))
        np.testing.assert_array_equal(stacked, np.stack(everyone))


@pytest.mark.parametrize("n", SIZES)
async def test_gather_and_scatter(n: int, transport: str) -> None:
    async def fn(rank: int, size: int) -> tuple[list[np.ndarray] | None, np.ndarray]:
        root = size - 1
        x = data(rank)
        outs = [np.empty_like(x) for _ in range(size)] if rank == root else None
        await aiodist.gather(x, outs, dst=root)
        out = np.empty((5, 3))
        ins = [data(100 + r) for r in range(size)] if rank == 0 else None
        await aiodist.scatter(out, ins, src=0)
        return outs, out

    results = await run_world(fn, n, transport=transport)
    for r, (outs, out) in enumerate(results):
        np.testing.assert_array_equal(out, data(100 + r))
        if r == n - 1:
            assert outs is not None
            for k in range(n):
                np.testing.assert_array_equal(outs[k], data(k))
        else:
            assert outs is None


@pytest.mark.parametrize("n", SIZES)
async def test_gather_single_into_one_array(n: int, transport: str) -> None:
    async def fn(rank: int, size: int) -> tuple[object, object, object]:
        x = data(rank)
        flat = np.empty((size * 5, 3)) if rank == 1 % size else None
        got = await aiodist.gather_single(x, flat, dst=1 % size)
        stacked = np.empty((size, 5, 3)) if rank == 0 else np.empty(0)  # ignored off dst
        got2 = await aiodist.gather_into_tensor(x, stacked, dst=0)
        return flat, got, (stacked if rank == 0 else got2)

    everyone = [data(r) for r in range(n)]
    for rank, (flat, got, stacked) in enumerate(await run_world(fn, n, transport=transport)):
        if rank == 1 % n:
            assert got is flat
            np.testing.assert_array_equal(flat, np.concatenate(everyone))
        else:
            assert flat is None and got is None
        if rank == 0:
            np.testing.assert_array_equal(stacked, np.stack(everyone))
        else:
            assert stacked is None  # the Work's result off the destination


async def test_gather_single_needs_a_right_sized_array_on_the_destination() -> None:
    async def fn(rank: int, size: int) -> None:
        x = np.ones(4, np.float32)
        bad = {0: None, 1: np.empty(4 * size + 1, np.float32)}
        for dst, message in (
            (0, r"gather_tensor must be given on the destination rank \(group rank 0\)"),
            (1, r"gather_tensor has .* but must hold 2 x tensor"),
        ):
            if rank == dst:
                with pytest.raises(aiodist.DistUsageError, match=message):
                    await aiodist.gather_single(x, bad[dst], dst=dst)
            else:  # told by the destination, before any data moved
                with pytest.raises(aiodist.DistUsageError, match=f"rejected by rank {dst}"):
                    await aiodist.gather_single(x, None, dst=dst)
        out = np.empty(4 * size, np.float32) if rank == 0 else None
        await aiodist.gather_single(x, out, dst=0)  # the group is still usable
        if rank == 0:
            np.testing.assert_array_equal(out, np.ones(8, np.float32))

    await run_world(fn, 2)


async def test_set_timeout_applies_to_the_next_operations() -> None:
    timed_out = asyncio.Event()  # (the ranks are tasks of this loop)

    async def fn(rank: int, size: int) -> str:
        aiodist.set_timeout(timedelta(seconds=0.5))
        if rank == 1:
            await timed_out.wait()  # misses rank 0's barrier
            return ""
        with pytest.raises(aiodist.DistTimeoutError) as info:
            await aiodist.barrier()
        timed_out.set()
        return str(info.value)

    text = (await run_world(fn, 2, timeout=60))[0]
    assert text.startswith(
        "barrier (seq 0) on <ProcessGroup rank=0/2 backend=cpu> did not complete within the "
        "group timeout of 0.5 s; ranks that did not arrive: [1]"
    ), text


@pytest.mark.parametrize("n", SIZES)
async def test_reduce_scatter_and_tensor(n: int, transport: str) -> None:
    async def fn(rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        ins = [data(rank * 10 + k) for k in range(size)]
        out = np.empty((5, 3))
        await aiodist.reduce_scatter(out, ins)
        big = np.concatenate(ins)
        out2 = np.empty((5, 3))
        await aiodist.reduce_scatter_tensor(out2, big, op=aiodist.ReduceOp.MIN)
        return out, out2

    for r, (out, out2) in enumerate(await run_world(fn, n, transport=transport)):
        contributions = [data(q * 10 + r) for q in range(n)]
        np.testing.assert_array_equal(out, np.sum(contributions, axis=0))
        np.testing.assert_array_equal(out2, np.min(contributions, axis=0))


@pytest.mark.parametrize("n", SIZES)
async def test_all_to_all(n: int, transport: str) -> None:
    async def fn(rank: int, size: int) -> list[np.ndarray]:
        # Block sent from rank r to rank k has shape (r + k + 1,): shapes differ per pair.
        ins = [np.full(rank + k + 1, rank * 100 + k, np.int32) for k in range(size)]
        outs = [np.empty(k + rank + 1, np.int32) for k in range(size)]
        await aiodist.all_to_all(outs, ins)
        return outs

    for r, outs in enumerate(await run_world(fn, n, transport=transport)):
        for k in range(n):
            np.testing.assert_array_equal(outs[k], np.full(k + r + 1, k * 100 + r, np.int32))


@pytest.mark.parametrize("n", SIZES)
async def test_all_to_all_single_even_and_uneven(n: int, transport: str) -> None:
    async def fn(rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        even_in = np.arange(size * 2 * 3, dtype=np.float32).reshape(size * 2, 3) + 1000 * rank
        even_out = np.empty_like(even_in)
        await aiodist.all_to_all_single(even_out, even_in)
        # Rank r sends (k + 1) rows to rank k, so it receives (r + 1) rows from everyone.
        in_splits = [k + 1 for k in range(size)]
        x = np.concatenate([np.full((k + 1, 2), rank * 10.0 + k) for k in range(size)])
        out = np.empty(((rank + 1) * size, 2))
        await aiodist.all_to_all_single(out, x, [rank + 1] * size, in_splits)
        return even_out, out

    for r, (even_out, out) in enumerate(await run_world(fn, n, transport=transport)):
        expected = np.concatenate(
            [
                (np.arange(n * 2 * 3, dtype=np.float32).reshape(n * 2, 3) + 1000 * q)[
                    2 * r : 2 * r + 2
                ]
                for q in range(n)
            ]
        )
        np.testing.assert_array_equal(even_out, expected)
        np.testing.assert_array_equal(
            out, np.concatenate([np.full((r + 1, 2), q * 10 + r) for q in range(n)])
        )


@pytest.mark.parametrize("n", SIZES)
async def test_barrier_and_monitored_barrier(n: int, transport: str) -> None:
    async def fn(rank: int, size: int) -> None:
        assert await aiodist.barrier() is None
        await aiodist.monitored_barrier(timeout=10)
        await aiodist.monitored_barrier(timeout=10, wait_all_ranks=True)

    assert await run_world(fn, n, transport=transport) == [None] * n


async def test_zero_size_and_zero_dim_arrays(transport: str) -> None:
    async def fn(rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        empty = np.empty((0, 4))
        await aiodist.all_reduce(empty)
        scalar = np.array(rank + 1.0)
        await aiodist.all_reduce(scalar)
        outs = [np.empty((0, 4)) for _ in range(size)]
        await aiodist.all_gather(outs, empty)
        await aiodist.all_gather_into_tensor(np.empty((0, 4)), empty)
        await aiodist.reduce_scatter_tensor(np.empty(0), np.empty(0))
        await aiodist.all_to_all_single(np.empty((0, 2)), np.empty((0, 2)))
        return empty, scalar

    for empty, scalar in await run_world(fn, 3, transport=transport):
        assert empty.shape == (0, 4)
        assert scalar == 6.0


async def test_local_transport_runs_the_same_api() -> None:
    async def fn(rank: int, size: int) -> np.ndarray:
        x = data(rank)
        await aiodist.all_reduce(x)
        return x

    expected = np.sum([data(r) for r in range(4)], axis=0)
    for got in await run_world(fn, 4, transport="local"):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.torch
async def test_torch_tensors_through_dlpack(transport: str) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")

    async def fn(rank: int, size: int) -> list[list[float]]:
        t = torch.full((4,), float(rank + 1))
        await aiodist.all_reduce(t)
        outs = [torch.zeros(2) for _ in range(size)]
        await aiodist.all_gather(outs, torch.tensor([rank, rank * 2.0]))
        return [t.tolist(), *(o.tolist() for o in outs)]

    for res in await run_world(fn, 3, transport=transport):
        assert res[0] == [6.0] * 4
        assert res[1:] == [[0.0, 0.0], [1.0, 2.0], [2.0, 4.0]]
