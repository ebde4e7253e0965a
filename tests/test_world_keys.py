"""A world leaves nothing of itself in a store that outlives it.

Worlds of four ranks, each rank a task with its own TCPStore client of a store this test
serves (so that every rank holds its own leases, as processes do), go through what writes
keys: forming on shared memory, subgroups, a rejected ``new_group`` and a rejected
collective, a rank that leaves and a shrink of the others to a successor world, an operation
that times out (arrival records) and aborts the world (abort records), and a second
generation of the job. Once every rank has left, the store holds the job's own keys (what
each rank counts its generations with, its forming record, and the job's world of the
moment, marked ended) and nothing of any world: the last rank to leave a world deletes its
namespace, and a successor lives beside the world it replaces, not in its namespace.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable, Sequence

import numpy as np
import pytest

import aiodist
from aiodist import DistError, DistTimeoutError, DistUsageError, PrefixStore, Store
from aiodist.group._world import FailureDomain
from aiodist.store.tcp import TCPStore

pytestmark = pytest.mark.both_loops

JOB = "kept"
SIZE = 4
#: The worlds' operation timeout (seconds): the barrier that times out waits this long.
TIMEOUT = 4.0


def _value(rank: int) -> np.ndarray:
    return np.arange(6, dtype=np.float64) * (rank + 1)


def _sum(ranks: list[int]) -> np.ndarray:
    return np.sum([_value(r) for r in ranks], axis=0)


def _world_keys(keys: list[str]) -> list[str]:
    """The keys of ``keys`` that are not the job's own (see the module's docstring)."""
    own = re.compile(rf"aiodist/{JOB}/(joined/{SIZE}/\d|forming/\d|current)")
    return sorted(k for k in keys if not own.fullmatch(k))


async def test_every_world_of_a_job_leaves_no_key_once_its_ranks_left() -> None:
    master = await TCPStore.create("127.0.0.1", 0, is_master=True, timeout=60)
    timed_out = asyncio.Event()  # their barrier without rank 2 timed out
    left_in_the_middle: list[list[str]] = []
    between = asyncio.Barrier(SIZE)  # every rank left the first worlds

    async def first_world(rank: int, store: TCPStore) -> None:
        await aiodist.init_process_group(
            "cpu", store=store, rank=rank, world_size=SIZE, group_name=JOB, timeout=TIMEOUT
        )
        try:
            sub = await aiodist.new_group([0, 2, 3])
            if sub:
                x = _value(rank)
                await aiodist.all_reduce(x, group=sub)
                np.testing.assert_array_equal(x, _sum([0, 2, 3]))
            # A rejected new_group: rank 1 names other ranks; every rank raises.
            with pytest.raises(DistUsageError, match="new_group"):
                await aiodist.new_group([0, 1] if rank == 1 else [0, 2])
            # A rejected collective: rank 3's output is read-only.
            x = _value(rank)
            if rank == 3:
                x.setflags(write=False)
            with pytest.raises(DistUsageError) as rejected:
                await aiodist.all_reduce(x)
            if rank != 3:
                assert "was rejected by rank 3" in str(rejected.value)
            x = _value(rank)
            await aiodist.all_reduce(x)  # the group is usable again
            np.testing.assert_array_equal(x, _sum([0, 1, 2, 3]))
        except BaseException:
            await aiodist.destroy_process_group()
            raise
        if rank == 3:
            await aiodist.destroy_process_group()  # leaves; the others shrink without it
            return
        await aiodist.shrink_group([3])

    async def successor(rank: int) -> None:
        # Ranks 0, 1, 2 of the world that replaced the first, which they left: nothing of
        # the first is in the store any more, and the successor works.
        try:
            x = _value(rank)
            await aiodist.all_reduce(x)
            np.testing.assert_array_equal(x, _sum([0, 1, 2]))
            if rank == 0:
                left_in_the_middle.append(_world_keys(await master.list_keys()))
            await aiodist.barrier()
            if rank == 2:
                await timed_out.wait()  # not in the barrier below: it times out
                return
            with pytest.raises(DistTimeoutError, match="ranks that did not arrive: \\[2\\]"):
                await aiodist.barrier()
            timed_out.set()
            with pytest.raises(DistError):
                await aiodist.barrier()  # the world was aborted
        finally:
            await aiodist.destroy_process_group()

    async def second_generation(rank: int, store: TCPStore) -> None:
        await aiodist.init_process_group(
            "cpu", store=store, rank=rank, world_size=SIZE, group_name=JOB, timeout=TIMEOUT
        )
        try:
            x = _value(rank)
            await aiodist.all_reduce(x)
            np.testing.assert_array_equal(x, _sum([0, 1, 2, 3]))
        finally:
            await aiodist.destroy_process_group()

    async def rank_task(rank: int) -> None:
        aiodist.group.isolate_context()
        store = await TCPStore.create("127.0.0.1", master.port, timeout=60)
        try:
            await first_world(rank, store)
            if rank != 3:
                await successor(rank)
            await between.wait()
            await second_generation(rank, store)
        finally:
            await store.aclose()

    try:
        await asyncio.wait_for(asyncio.gather(*(rank_task(r) for r in range(SIZE))), 120)
        # The first world's namespace was gone while its successor, beside it, ran.
        (middle,) = left_in_the_middle
        assert [k for k in middle if k.startswith(f"aiodist/{JOB}/{SIZE}/0/")] == []
        assert any(k.startswith(f"aiodist/{JOB}/{SIZE}/0+shrink/0/1/") for k in middle)
        keys = await master.list_keys()
        assert _world_keys(keys) == []
        assert sorted(keys) == sorted(
            [f"aiodist/{JOB}/joined/{SIZE}/{r}" for r in range(SIZE)]
            + [f"aiodist/{JOB}/forming/{r}" for r in range(SIZE)]
            + [f"aiodist/{JOB}/current"]
        )
        assert await master.get(f"aiodist/{JOB}/current") == f"{SIZE}/1/|{SIZE}|ended".encode()
    finally:
        await master.aclose()


class _LeavingMeanwhile(PrefixStore):
    """A world's namespace where, the first time this rank looks whether every rank has
    left, ``meanwhile`` runs before the answer comes back (another rank leaving then)."""

    def __init__(self, prefix: str, store: Store, meanwhile: Callable[[], Awaitable[None]]):
        super().__init__(prefix, store)
        self._meanwhile: Callable[[], Awaitable[None]] | None = meanwhile

    async def check(self, keys: Sequence[str]) -> bool:
        found = await super().check(keys)
        if len(keys) > 1 and self._meanwhile is not None:
            meanwhile, self._meanwhile = self._meanwhile, None
            await meanwhile()
        return found


async def test_a_store_host_is_not_kept_waiting_by_the_last_rank_sweeping_first() -> None:
    # The host rank finds that rank 1 has not left; rank 1 then leaves, finds every rank
    # gone and sweeps the world's keys, before the host waits for them: the host must see
    # that every rank left, not wait for keys that will never come back.
    master = await TCPStore.create("127.0.0.1", 0, is_master=True, timeout=30)
    clients = [await master.clone() for _ in range(2)]
    domains: list[FailureDomain] = []

    def domain(rank: int, store: PrefixStore) -> FailureDomain:
        async def sweep() -> None:
            await store.delete_prefix("")

        return FailureDomain(
            store,
            rank,
            2,
            on_abort=lambda cause: None,
            on_gone=lambda rank, cause: None,
            hosting=rank == 0,
            timeout=TIMEOUT,
            sweep=sweep,
        )

    async def rank_1_leaves() -> None:
        await domains[1].aclose()

    domains.append(domain(0, _LeavingMeanwhile("world", clients[0], rank_1_leaves)))
    domains.append(domain(1, PrefixStore("world", clients[1])))
    try:
        for d in domains:
            d.start()
        await asyncio.gather(*(d.leased() for d in domains))
        started = time.monotonic()
        await domains[0].aclose()
        # (Before, it waited out the world's timeout.)
        assert time.monotonic() - started < TIMEOUT / 2
        assert domains[1].closed
        assert await master.list_keys() == []
    finally:
        for d in domains:
            await d.aclose()
        for client in clients:
            await client.aclose()
        await master.aclose()
