"""Every operation once, in real processes meeting through env:// and a TCPStore."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

import aiodist
from aiodist.testing import WorldProcessError, run_world_processes

pytestmark = pytest.mark.multiprocess


async def every_operation(rank: int, size: int) -> dict[str, object]:
    """Run each operation of the API once and check it against numpy; return a summary."""
    assert aiodist.get_rank() == rank == int(os.environ["RANK"])
    assert aiodist.get_world_size() == size
    ranks = range(size)

    x = np.full(5, rank + 1.0)
    await aiodist.all_reduce(x)
    assert (x == sum(r + 1 for r in ranks)).all()

    b = np.arange(4.0) if rank == 0 else np.zeros(4)
    await aiodist.broadcast(b, src=0)
    np.testing.assert_array_equal(b, np.arange(4.0))

    r = np.full(3, float(rank))
    await aiodist.reduce(r, dst=size - 1, op=aiodist.ReduceOp.MAX)
    if rank == size - 1:
        assert (r == size - 1).all()

    outs = [np.empty(2, np.int32) for _ in ranks]
    await aiodist.all_gather(outs, np.array([rank, -rank], np.int32))
    np.testing.assert_array_equal(np.stack(outs), [[q, -q] for q in ranks])

    flat = np.empty(2 * size, np.int32)
    await aiodist.all_gather_into_tensor(flat, np.array([rank, rank], np.int32))
    np.testing.assert_array_equal(flat, np.repeat(np.arange(size), 2))

    g = [np.empty(1) for _ in ranks] if rank == 0 else None
    await aiodist.gather(np.array([rank * 2.0]), g, dst=0)
    if g is not None:
        assert [float(v[0]) for v in g] == [q * 2.0 for q in ranks]

    s = np.empty(1)
    await aiodist.scatter(s, [np.array([q + 0.5]) for q in ranks] if rank == 0 else None, src=0)
    assert s[0] == rank + 0.5

    rs = np.empty(2)
    await aiodist.reduce_scatter(rs, [np.full(2, float(q)) for q in ranks])
    assert (rs == rank * size).all()

    rst = np.empty(2)
    await aiodist.reduce_scatter_tensor(rst, np.repeat(np.arange(size, dtype=float), 2))
    assert (rst == rank * size).all()

    a2a = [np.empty(1, np.int64) for _ in ranks]
    await aiodist.all_to_all(a2a, [np.array([rank * 10 + q]) for q in ranks])
    assert [int(v[0]) for v in a2a] == [q * 10 + rank for q in ranks]

    single = np.empty(size, np.int64)
    await aiodist.all_to_all_single(single, np.arange(size) + rank * 100)
    np.testing.assert_array_equal(single, [q * 100 + rank for q in ranks])

    await aiodist.barrier()
    await aiodist.monitored_barrier(timeout=30, wait_all_ranks=True)

    right, left = (rank + 1) % size, (rank - 1) % size
    buf = np.empty(3)
    works = aiodist.batch_isend_irecv(
        [
            aiodist.P2POp(aiodist.isend, np.full(3, float(rank)), right, tag=3),
            aiodist.P2POp(aiodist.irecv, buf, left, tag=3),
        ]
    )
    assert [await w for w in works] == [None, left]
    assert (buf == left).all()
    if rank == 0:
        senders = set()
        for _ in range(size - 1):
            one = np.empty(1)
            senders.add(await aiodist.recv(one))  # any source
            assert one[0] == 7.0
        assert senders == set(range(1, size))
    else:
        await aiodist.send(np.array([7.0]), dst=0)

    objs: list[object] = [{"from": 0}, [1, 2]] if rank == 0 else [None, None]
    await aiodist.broadcast_object_list(objs, src=0)
    assert objs == [{"from": 0}, [1, 2]]
    gathered: list[object] = [None] * size
    await aiodist.all_gather_object(gathered, ("rank", rank))
    assert gathered == [("rank", q) for q in ranks]
    got = await aiodist.gather_object(rank, [None] * size if rank == 0 else None, dst=0)
    assert got == (list(ranks) if rank == 0 else None)
    out: list[object] = [None]
    await aiodist.scatter_object_list(out, [f"to {q}" for q in ranks] if rank == 0 else None, src=0)
    assert out == [f"to {rank}"]

    mine, _ = await aiodist.new_subgroups(1)
    sub = np.array([1.0])
    await aiodist.all_reduce(sub, group=mine)
    pair = await aiodist.new_group([0, size - 1])
    if rank in (0, size - 1):
        v = np.array([float(rank)])
        await aiodist.all_reduce(v, group=pair)
        assert v[0] == size - 1
    return {"rank": rank, "pid": os.getpid(), "backend": aiodist.get_backend()}


async def early_leaver(rank: int, size: int) -> list[float] | None:
    """Rank 0 (the store's host) is done at once; 1 and 2 first talk to each other later."""
    if rank == 0:
        return None
    await asyncio.sleep(0.3)
    buf = np.zeros(2)
    if rank == 1:
        await aiodist.send(np.ones(2), dst=2)
    else:
        await aiodist.recv(buf, src=1)  # needs rank 1's address from the store
    return buf.tolist()


async def failing(rank: int, size: int) -> None:
    if rank == 1:
        raise RuntimeError("deliberate failure on rank 1")
    await aiodist.barrier()  # rank 1 never joins; its exit ends this one too


def test_every_operation_in_processes() -> None:
    results = run_world_processes(every_operation, 3, timeout=120)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert len({r["pid"] for r in results} | {os.getpid()}) == 4
    assert {r["backend"] for r in results} == {"cpu"}


def test_store_host_stays_until_every_rank_left() -> None:
    assert run_world_processes(early_leaver, 3, timeout=60) == [None, [0.0, 0.0], [1.0, 1.0]]


def test_child_failure_is_reported_with_traceback() -> None:
    with pytest.raises(
        WorldProcessError, match=r"(?s)rank 1 failed:.*deliberate failure on rank 1"
    ):
        run_world_processes(failing, 2, timeout=60)
