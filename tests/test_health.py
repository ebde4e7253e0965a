"""Health of a group for servers: is_aborted, abort, wait_aborted, ordered issue, idle deaths."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

import aiodist
from aiodist.group._world import FailureDomain
from aiodist.testing import run_world, run_world_processes

pytestmark = pytest.mark.both_loops


async def test_abort_reaches_every_rank_and_wait_aborted_returns_the_cause() -> None:
    async def fn(rank: int, size: int) -> tuple[bool, str]:
        pg = aiodist.group.resolve_group(None, "test")
        waiter = asyncio.ensure_future(pg.wait_aborted())
        await asyncio.sleep(0)
        # Before the barrier, which rank 1 passes before it aborts. (After it, the abort may
        # reach a rank before that rank's task resumes: they share one loop.)
        assert not pg.is_aborted() and not waiter.done()
        await aiodist.barrier()
        if rank == 1:
            pg.abort("the model server is shutting down")
        cause = await asyncio.wait_for(waiter, 5)
        assert cause is not None
        return pg.is_aborted(), str(cause)

    results = await run_world(fn, 3)
    assert all(aborted for aborted, _ in results)
    assert all("the model server is shutting down" in cause for _, cause in results), results


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_abort_fails_the_operations_peers_wait_in_naming_the_cause(transport: str) -> None:
    async def fn(rank: int, size: int) -> str:
        pg = aiodist.group.resolve_group(None, "test")
        await aiodist.barrier()
        if rank == 1:
            await asyncio.sleep(0.2)  # the others are waiting for rank 1's broadcast
            pg.abort("the model server is shutting down")
            return ""
        with pytest.raises(aiodist.DistNetworkError) as info:
            await aiodist.broadcast(np.zeros(4), src=1)
        return str(info.value)

    results = await run_world(fn, 3, transport=transport)  # type: ignore[arg-type]
    for cause in (results[0], results[2]):
        assert "the model server is shutting down" in cause, results


async def test_wait_aborted_returns_none_when_destroyed() -> None:
    async def fn(rank: int, size: int) -> object:
        pg = aiodist.group.resolve_group(None, "test")
        waiter = asyncio.ensure_future(pg.wait_aborted())
        await aiodist.barrier()
        await aiodist.destroy_process_group()
        return await asyncio.wait_for(waiter, 5)

    assert await run_world(fn, 2) == [None, None]


async def test_ordered_keeps_concurrent_sequences_apart() -> None:
    # Rank 0 serves 8 "requests" at once, each a broadcast then an all_gather; the workers
    # run them one after another. Without ordered() rank 0's steps would interleave.
    async def fn(rank: int, size: int) -> list[list[float]]:
        pg = aiodist.group.resolve_group(None, "test")

        async def request(i: int) -> list[float]:
            async with pg.ordered():
                x = np.array([float(i)])
                await asyncio.sleep(0.001 * (8 - i))  # let the others try to cut in
                await aiodist.broadcast(x, src=0)
                outs = [np.zeros(1) for _ in range(size)]
                await aiodist.all_gather(outs, x + rank)
            return [float(o[0]) for o in outs]

        if rank == 0:
            return list(await asyncio.gather(*(request(i) for i in range(8))))
        got = []
        for _ in range(8):
            x = np.zeros(1)
            await aiodist.broadcast(x, src=0)
            outs = [np.zeros(1) for _ in range(size)]
            await aiodist.all_gather(outs, x + rank)
            got.append([float(o[0]) for o in outs])
        return got

    results = await run_world(fn, 3)
    assert results[0] == [[i, i + 1, i + 2] for i in range(8)]
    assert results[1] == results[2] == results[0]


def _idle_then_killed(rank: int, size: int) -> None:
    import aiodist.sync as dist

    x = np.ones(4)
    dist.all_reduce(x)  # every rank has talked; then everybody is idle
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    pg = dist.group.WORLD
    assert pg is not None
    killed = time.monotonic()
    while not pg.is_aborted() and time.monotonic() - killed < 10:
        time.sleep(0.01)
    with open(os.path.join(os.environ["HEALTH_DIR"], f"rank{rank}"), "w") as f:
        f.write(f"{time.monotonic() - killed} {pg.world.broken}")
    time.sleep(30)  # stays until the dead rank is reported


@pytest.mark.multiprocess
def test_an_idle_peer_dying_is_noticed(tmp_path: Path) -> None:
    with pytest.raises(aiodist.testing.WorldProcessError, match="rank 2"):
        run_world_processes(_idle_then_killed, 3, timeout=60, env={"HEALTH_DIR": str(tmp_path)})
    for rank in (0, 1):
        # The survivors wrote how long it took them before the dead rank was reported.
        waited, cause = (tmp_path / f"rank{rank}").read_text().split(" ", 1)
        assert float(waited) < 2.0, (rank, waited, cause)
        assert "rank 2" in cause, cause


def _killed_before_talking(rank: int, size: int) -> None:
    import aiodist.sync as dist

    # No operation has run: no rank holds a connection to any other. Only the store knows.
    if rank == size - 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    pg = dist.group.WORLD
    assert pg is not None
    start = time.monotonic()
    while not pg.is_aborted() and time.monotonic() - start < 10:
        time.sleep(0.01)
    with open(os.path.join(os.environ["HEALTH_DIR"], f"rank{rank}"), "w") as f:
        f.write(f"{time.monotonic() - start} {pg.world.broken}")
    time.sleep(30)


@pytest.mark.multiprocess
def test_a_rank_nobody_talked_to_is_noticed_through_its_store_lease(tmp_path: Path) -> None:
    with pytest.raises(aiodist.testing.WorldProcessError, match="rank 3"):
        # Over TCP only: ranks sharing memory watch each other's processes directly.
        run_world_processes(
            _killed_before_talking,
            4,
            timeout=60,
            env={"HEALTH_DIR": str(tmp_path), "AIODIST_SHM": "0"},
        )
    for rank in (0, 1, 2):
        waited, cause = (tmp_path / f"rank{rank}").read_text().split(" ", 1)
        assert float(waited) < 2.0, (rank, waited, cause)
        assert "rank 3 is gone: its connection to the store ended" in cause, cause


async def test_every_departure_the_store_records_reaches_every_rank() -> None:
    # Four ranks' failure domains over one store. Ranks 2, 3 and 1 go without a goodbye,
    # one after the other (their connections to the store end): rank 0 hears of each one,
    # in that order, whether or not it ever talked to them; the first breaks its world.
    async with await aiodist.TCPStoreServer().start("127.0.0.1", 0) as server:
        stores = [
            await aiodist.TCPStore.create("127.0.0.1", server.port, timeout=5) for _ in range(4)
        ]
        heard: list[tuple[int, str]] = []
        domains = [
            FailureDomain(
                store,
                rank,
                4,
                on_abort=lambda exc: None,
                on_gone=(lambda r, exc: heard.append((r, str(exc))))
                if rank == 0
                else (lambda r, exc: None),
                hosting=False,
                timeout=5,
            )
            for rank, store in enumerate(stores)
        ]
        for domain in domains:
            domain.start()
        for domain in domains:
            await domain.leased()
        for count, rank in enumerate((2, 3, 1), 1):
            await stores[rank].aclose()
            async with asyncio.timeout(5):
                while len(heard) < count:
                    await asyncio.sleep(0.01)
        assert [r for r, _ in heard] == [2, 3, 1]
        for r, text in heard:
            assert text.startswith(f"rank {r} is gone: its connection to the store ended"), text
        assert str(domains[0].broken).startswith("rank 2 is gone"), domains[0].broken
        assert not domains[0].aborted  # (a departure breaks the world; it aborts nothing)
        for domain in domains:
            await domain.aclose()
        await stores[0].aclose()
