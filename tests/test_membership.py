"""Membership changes. shrink_group: the remaining ranks go on without some ranks, on a
healthy world and on one aborted by a failure, on every transport; bad lists are refused on
every rank and lose nothing. admit and join_process_group: processes started later join a
running world and receive its state."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
from collections.abc import Sequence
from datetime import timedelta

import numpy as np
import proc_helpers
import pytest

import aiodist
import aiodist.sync as dist
from aiodist import DistNetworkError, DistUsageError, HashStore
from aiodist.testing import run_world

pytestmark = pytest.mark.both_loops  # the standard loop (asyncio.run, uvicorn) too


def _value(global_rank: int) -> np.ndarray:
    return np.arange(5, dtype=np.float64) * (global_rank + 1) + 0.25 * global_rank


def _sum(ranks: list[int]) -> np.ndarray:
    return np.sum([_value(r) for r in ranks], axis=0)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_a_rank_leaves_by_choice_and_the_others_go_on_renumbered(transport: str) -> None:
    async def fn(rank: int, size: int) -> tuple[int, int, bool, np.ndarray] | None:
        sub = await aiodist.new_group([0, 1, 3])
        if rank == 2:
            return None  # leaves: its group is destroyed as its function returns
        pg = await aiodist.shrink_group([2])
        x = _value(rank)
        await aiodist.all_reduce(x)
        assert pg is aiodist.group.current_world().default_group
        return aiodist.get_rank(), aiodist.get_world_size(), sub.is_destroyed, x

    results = await run_world(fn, 4, transport=transport)
    assert results[2] is None
    for new_rank, old in enumerate([0, 1, 3]):
        rank, size, sub_destroyed, x = results[old]
        assert (rank, size) == (new_rank, 3)
        assert sub_destroyed  # shrinking the default group destroys the other groups
        np.testing.assert_array_equal(x, _sum([0, 1, 3]))


async def test_survivors_of_an_aborted_world_exclude_the_failed_rank_and_go_on() -> None:
    async def fn(rank: int, size: int) -> tuple[str, int, np.ndarray] | None:
        await aiodist.barrier()
        if rank == 1:
            # As a crash looks to the others: the world aborted, naming this rank.
            aiodist.group.current_world().abort(DistUsageError("rank 1 crashed"))
            await asyncio.sleep(0.5)
            return None
        x = _value(rank)
        with pytest.raises(DistNetworkError) as failed:
            while True:  # until this rank hears of the abort
                await aiodist.all_reduce(x.copy())
                await asyncio.sleep(0.01)
        await aiodist.shrink_group([1])
        await aiodist.all_reduce(x)
        await aiodist.barrier()
        return str(failed.value), aiodist.get_world_size(), x

    results = await run_world(fn, 3, transport="tcp")
    for r in (0, 2):
        text, size, x = results[r]
        assert "rank 1 crashed" in text
        assert size == 2
        np.testing.assert_array_equal(x, _sum([0, 2]))


async def test_shrinking_a_subgroup_keeps_the_world_and_global_ranks() -> None:
    async def fn(rank: int, size: int) -> tuple[tuple[int, ...], int, np.ndarray] | None:
        sub = await aiodist.new_group([1, 2, 3])
        shrunk = None
        if rank in (1, 3):
            shrunk = await aiodist.shrink_group([1], group=sub)  # group rank 1 is global 2
            assert sub.is_destroyed
        world = _value(rank)
        await aiodist.all_reduce(world)  # the default group is untouched
        np.testing.assert_array_equal(world, _sum([0, 1, 2, 3]))
        if shrunk is None:
            return None
        x = _value(rank)
        await aiodist.all_reduce(x, group=shrunk)
        peer = np.zeros(1)
        await aiodist.broadcast(peer + rank, src=3, group=shrunk)
        return shrunk.ranks, aiodist.get_rank(shrunk), x

    results = await run_world(fn, 4, transport="tcp")
    assert results[0] is None and results[2] is None
    for rank, group_rank in ((1, 0), (3, 1)):
        ranks, got_rank, x = results[rank]
        assert ranks == (1, 3) and got_rank == group_rank
        np.testing.assert_array_equal(x, _sum([1, 3]))


@pytest.mark.parametrize(
    ("exclude", "flags", "message"),
    [
        ([], 0, "ranks_to_exclude must name at least one rank"),
        ([3], 0, "rank 3 is out of range for a group of size 3"),
        ([2, 2], 0, "ranks_to_exclude [2, 2] has duplicates"),
        ([0, 1, 2], 0, "cannot exclude every rank of a group of size 3"),
        ([1.0], 0, "each rank to exclude must be an int, got float"),
        ("2", 0, "ranks_to_exclude must be a list of group ranks, got str"),
        ([2], 7, "shrink_flags must be SHRINK_DEFAULT (0) or SHRINK_ABORT (1), got 7"),
    ],
)
async def test_a_bad_list_is_refused_and_the_group_stays_usable(
    exclude: object, flags: int, message: str
) -> None:
    async def fn(rank: int, size: int) -> np.ndarray:
        with pytest.raises(DistUsageError) as refused:
            await aiodist.shrink_group(exclude, shrink_flags=flags)  # type: ignore[arg-type]
        assert isinstance(refused.value, ValueError)
        assert str(refused.value) == f"shrink_group: {message}"
        x = _value(rank)
        await aiodist.all_reduce(x)
        return x

    for x in await run_world(fn, 3, transport="tcp"):
        np.testing.assert_array_equal(x, _sum([0, 1, 2]))


async def test_an_excluded_rank_that_calls_is_told_so() -> None:
    async def fn(rank: int, size: int) -> str:
        with pytest.raises(DistUsageError) as refused:
            await aiodist.shrink_group([rank])
        return str(refused.value)

    assert await run_world(fn, 2, transport="tcp") == [
        f"shrink_group: this rank (group rank {r}) is in ranks_to_exclude; only the remaining "
        "ranks call shrink_group"
        for r in range(2)
    ]


async def test_ranks_that_exclude_different_ranks_all_raise_and_can_vote_again() -> None:
    async def fn(rank: int, size: int) -> tuple[str, np.ndarray, int]:
        text = ""
        if rank < 2:
            # Each keeps the other: whichever list is recorded first, the other rank
            # disagrees with it, so neither forms a group.
            with pytest.raises(DistUsageError) as split:
                await aiodist.shrink_group([2] if rank == 0 else [0])
            text = str(split.value)
        x = _value(rank)
        await aiodist.all_reduce(x)  # nothing was lost
        await aiodist.barrier()  # (rank 2 leaves only when the others are done with it)
        if rank == 2:
            return text, x, -1
        await aiodist.shrink_group([2])  # and a second vote can agree
        return text, x, aiodist.get_world_size()

    results = await run_world(fn, 3, transport="tcp")
    rule = "every remaining rank must exclude the same ranks"
    for text, _, _ in results[:2]:  # whichever list came first, the other one disagreed
        assert text.startswith("shrink_group: rank ")
        assert text.endswith(
            tuple(f"another remaining rank excludes ranks [{first}]; {rule}" for first in (0, 2))
        )
    for _, x, _ in results:
        np.testing.assert_array_equal(x, _sum([0, 1, 2]))
    assert [size for *_, size in results] == [2, 2, -1]


async def test_a_remaining_rank_that_leaves_before_it_votes_fails_the_vote() -> None:
    async def fn(rank: int, size: int) -> str | None:
        if rank == 3:
            return None  # leaves by choice: the others exclude it
        if rank == 2:
            await asyncio.sleep(0.3)  # the others wait for its vote, which never comes,
            return None  # and it leaves too
        with pytest.raises(DistNetworkError) as gone:
            await aiodist.shrink_group([3])
        return str(gone.value)

    # (The world's timeout is 60 s: a vote that waited for it would fail the guard.)
    results = await asyncio.wait_for(run_world(fn, 4, transport="tcp"), 20)
    assert results[2:] == [None, None]
    for text in results[:2]:
        assert text == (
            "shrink_group: rank 2 (left the process group (destroy_process_group)) went away "
            "before it voted"
        )


async def test_recover_leaves_out_a_rank_lost_while_the_survivors_shrink() -> None:
    async def fn(rank: int, size: int) -> tuple[list[int], int, int, np.ndarray] | None:
        if rank == 3:
            return None
        if rank == 2:
            await asyncio.sleep(0.3)  # gone while the others shrink without rank 3 only
            return None
        lost = await aiodist.recover(DistNetworkError("lost connection to rank 3"))
        x = _value(rank)
        await aiodist.all_reduce(x)
        return lost, aiodist.get_rank(), aiodist.get_world_size(), x

    results = await asyncio.wait_for(run_world(fn, 4, transport="tcp"), 20)
    for rank in (0, 1):
        lost, new_rank, size, x = results[rank]
        assert (lost, new_rank, size) == ([2, 3], rank, 2)
        np.testing.assert_array_equal(x, _sum([0, 1]))


@pytest.mark.parametrize("flags", [aiodist.SHRINK_DEFAULT, aiodist.SHRINK_ABORT])
async def test_what_is_in_flight_ends_first_or_is_aborted(flags: int) -> None:
    async def fn(rank: int, size: int) -> tuple[bool, str, np.ndarray] | None:
        if rank == 2:
            await asyncio.sleep(0.5)  # never joins the all_reduce the others started
            return None
        stuck = aiodist.all_reduce(_value(rank))
        await aiodist.shrink_group([2], shrink_flags=flags)
        ended = stuck.is_completed()
        with pytest.raises(aiodist.DistError) as failed:
            await stuck
        x = _value(rank)
        await aiodist.all_reduce(x)
        return ended, str(failed.value), x

    results = await run_world(fn, 3, transport="tcp")
    for ended, text, x in results[:2]:
        assert ended
        if flags == aiodist.SHRINK_ABORT:
            assert text == "aborted by shrink_group(shrink_flags=SHRINK_ABORT)"
        else:  # it waited for rank 2, which left without joining it
            assert "lost connection to rank 2: it left the process group" in text
        np.testing.assert_array_equal(x, _sum([0, 1]))


async def _registered(store: HashStore, count: int) -> None:
    """Wait until ``count`` processes wait to join the job (the default group name)."""
    while not await store.check(["aiodist/default_pg/waiting"]) or (
        (await store.get("aiodist/default_pg/waiting")).count(b",") < count
    ):
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("shared_memory", [False, None])
async def test_processes_started_later_are_admitted_and_receive_the_state(
    shared_memory: bool | None,
) -> None:
    store = HashStore(timeout=60)
    state = np.arange(6, dtype=np.float64) * 7.5
    first_admits: list[None] = []
    started = asyncio.Event()  # the joiners start once both members admitted nobody

    async def member(rank: int) -> tuple[list[int], list[int], np.ndarray, np.ndarray]:
        aiodist.group.isolate_context()
        await aiodist.init_process_group(
            "cpu", store=store, rank=rank, world_size=2, timeout=60, shared_memory=shared_memory
        )
        try:
            nobody = await aiodist.admit()  # nobody is waiting yet: nothing changes
            first_admits.append(None)
            if len(first_admits) == 2:
                started.set()
            await _registered(store, 2)
            admitted = await aiodist.admit()
            return nobody, admitted, *await _after_admission(aiodist.get_rank())
        finally:
            await aiodist.destroy_process_group()

    async def joiner() -> tuple[int, int, np.ndarray, np.ndarray]:
        aiodist.group.isolate_context()
        await started.wait()
        await aiodist.join_process_group(
            "cpu", store=store, timeout=60, shared_memory=shared_memory
        )
        try:
            rank = aiodist.get_rank()
            return rank, aiodist.get_world_size(), *await _after_admission(rank)
        finally:
            await aiodist.destroy_process_group()

    async def _after_admission(rank: int) -> tuple[np.ndarray, np.ndarray]:
        received = state.copy() if rank == 0 else np.zeros_like(state)
        await aiodist.broadcast(received, src=0)
        x = _value(rank)
        await aiodist.all_reduce(x)
        return received, x

    results = await asyncio.wait_for(
        asyncio.gather(member(0), member(1), joiner(), joiner()), timeout=60
    )
    for nobody, admitted, received, x in results[:2]:
        assert (nobody, admitted) == ([], [2, 3])
        np.testing.assert_array_equal(received, state)
        np.testing.assert_array_equal(x, _sum([0, 1, 2, 3]))
    assert sorted((rank, size) for rank, size, *_ in results[2:]) == [(2, 4), (3, 4)]
    for _, _, received, x in results[2:]:
        np.testing.assert_array_equal(received, state)
        np.testing.assert_array_equal(x, _sum([0, 1, 2, 3]))


async def test_a_replacement_takes_the_place_of_a_lost_rank() -> None:
    store = HashStore(timeout=60)
    step, weights = np.array([12]), np.linspace(0, 1, 5)

    async def member(rank: int) -> tuple[int, list[int], np.ndarray] | None:
        aiodist.group.isolate_context()
        await aiodist.init_process_group("cpu", store=store, rank=rank, world_size=3, timeout=60)
        try:
            await aiodist.barrier()
            if rank == 1:
                return None  # leaves while the others start an all_reduce
            x = _value(rank)
            with pytest.raises(aiodist.DistError) as failed:
                await aiodist.all_reduce(x)
            lost = await aiodist.recover(failed.value)
            await _registered(store, 1)
            assert await aiodist.admit(state=[step, weights]) == [2]
            x = _value(aiodist.get_rank())
            await aiodist.all_reduce(x)
            return aiodist.get_world_size(), lost, x
        finally:
            await aiodist.destroy_process_group()

    async def replacement() -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        aiodist.group.isolate_context()
        got_step, got_weights = np.zeros(1, int), np.zeros(5)
        await aiodist.join_process_group(
            "cpu", store=store, timeout=60, state=[got_step, got_weights]
        )
        try:
            x = _value(aiodist.get_rank())
            await aiodist.all_reduce(x)
            return aiodist.get_world_size(), got_step, got_weights, x
        finally:
            await aiodist.destroy_process_group()

    results = await asyncio.wait_for(
        asyncio.gather(member(0), member(1), member(2), replacement()), timeout=60
    )
    assert results[1] is None
    for size, lost, x in (results[0], results[2]):
        assert (size, lost) == (3, [1])
        np.testing.assert_array_equal(x, _sum([0, 1, 2]))
    size, got_step, got_weights, x = results[3]
    assert size == 3 and got_step.tolist() == [12]
    np.testing.assert_array_equal(got_weights, weights)
    np.testing.assert_array_equal(x, _sum([0, 1, 2]))


async def test_recover_raises_the_error_again_when_no_rank_is_lost() -> None:
    async def fn(rank: int, size: int) -> None:
        error = aiodist.DistTimeoutError("a deadline passed, every rank still there")
        with pytest.raises(aiodist.DistTimeoutError) as info:
            await aiodist.recover(error)
        assert info.value is error
        assert aiodist.get_world_size() == 2  # nothing was shrunk
        await aiodist.barrier()  # (neither leaves while the other still looks)

    await run_world(fn, 2, transport="tcp")


class _CountingStore(aiodist.PrefixStore):
    """A namespace of a store that counts the reads made through it."""

    requests = 0

    async def get(self, key: str) -> bytes:
        self.requests += 1
        return await super().get(key)

    async def check(self, keys: Sequence[str]) -> bool:
        self.requests += 1
        return await super().check(keys)

    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        self.requests += 1
        return await super().multi_get(keys)


async def test_who_left_a_world_is_one_store_request_however_large_the_world() -> None:
    from aiodist.group._world import FailureDomain

    size = 64
    master = await aiodist.TCPStore.create("127.0.0.1", 0, is_master=True, timeout=30)
    clients = [await master.clone() for _ in range(size)]
    domains = [
        FailureDomain(
            _CountingStore("world", client),
            rank,
            size,
            on_abort=lambda cause: None,
            on_gone=lambda rank, cause: None,
            hosting=False,
            timeout=30,
        )
        for rank, client in enumerate(clients)
    ]
    try:
        for domain in domains:
            domain.start()
        await asyncio.gather(*(d.leased() for d in domains))
        await domains[62].aclose("left the process group")  # a goodbye
        await clients[63].aclose()  # gone without one: its lease says so
        await domains[0].wait_ended()  # (told by the lease on `departed`)
        counted = domains[0].store
        assert isinstance(counted, _CountingStore)
        before = counted.requests
        left = await domains[0].departures()
        assert counted.requests - before == 1
        assert left == {
            62: "left the process group",
            63: "rank 63 is gone: its connection to the store ended without a goodbye (its "
            "process exited without leaving the process group or was killed, or its host "
            "cannot be reached)",
        }
        assert await domains[0].departures([1, 63]) == {63: left[63]}
    finally:
        for domain in domains:
            await domain.aclose()
        for client in clients:
            await client.aclose()
        await master.aclose()


async def test_admit_outside_the_default_group_is_refused() -> None:
    async def fn(rank: int, size: int) -> str:
        sub = await aiodist.new_group([0, 1])
        with pytest.raises(DistUsageError) as refused:
            await aiodist.admit(sub)
        return str(refused.value)

    assert (
        await run_world(fn, 2, transport="tcp")
        == ["admit: only the default group admits new processes"] * 2
    )


async def test_a_process_that_waits_to_join_an_ended_world_is_told_so() -> None:
    store = HashStore(timeout=60)

    async def member(rank: int) -> None:
        aiodist.group.isolate_context()
        await aiodist.init_process_group("cpu", store=store, rank=rank, world_size=2)
        await aiodist.destroy_process_group()

    await asyncio.gather(member(0), member(1))
    with pytest.raises(DistNetworkError) as ended:
        await aiodist.join_process_group("cpu", store=store, timeout=60)
    assert str(ended.value) == (
        "join_process_group: the job's world ended before it admitted this process: every one "
        "of its 2 ranks left it"
    )
    assert not aiodist.is_initialized()


async def test_a_process_not_admitted_in_time_raises_and_leaves_the_lobby() -> None:
    store = HashStore(timeout=60)
    joined = asyncio.Event()

    async def member(rank: int) -> list[int]:
        aiodist.group.isolate_context()
        await aiodist.init_process_group("cpu", store=store, rank=rank, world_size=2)
        try:
            await joined.wait()  # the joiner gave up: nobody is admitted
            return await aiodist.admit()
        finally:
            await aiodist.destroy_process_group()

    async def joiner() -> str:
        aiodist.group.isolate_context()
        try:
            with pytest.raises(aiodist.DistTimeoutError) as late:
                await aiodist.join_process_group("cpu", store=store, timeout=0.3)
            return str(late.value)
        finally:
            joined.set()

    *admitted, text = await asyncio.gather(member(0), member(1), joiner())
    assert text == (
        "join_process_group: not admitted within 0.3 s: the members of the job's world admit "
        "waiting processes when they call admit()"
    )
    assert admitted == [[], []]


# -- a second rank killed while the survivors recover, in processes ----------------------------
def _run_roles(
    script: str, roles: list[str], *args: str
) -> tuple[list[int], list[tuple[str, str]]]:
    """Run ``python -c script ROLE *args`` for every role at once; return each process's
    exit code and (stdout, stderr), in the order of ``roles``."""
    procs = [
        proc_helpers.track(
            subprocess.Popen(
                [sys.executable, "-c", script, role, *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        for role in roles
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    return [p.returncode for p in procs], outs


_KILLED_WHILE_SURVIVORS_RECOVER = """
import json, os, signal, sys, time
from datetime import timedelta
import numpy as np
import aiodist.sync as dist
rank, port, where = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=4, timeout=60)
dist.barrier()
if rank == 0:
    os.kill(os.getpid(), signal.SIGKILL)
if rank == 2:  # dies after it voted with the others to exclude rank 0
    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)
    if where == "before connecting":
        import aiodist._assembly._membership as membership
        membership._successor = die
    else:  # in the new world's setup, connected to the others
        import aiodist.collectives.shm as shm
        shm.NodeWorkspace.create = die
start = time.monotonic()
try:
    dist.all_reduce(np.ones(3))
    lost = []
except dist.DistError as exc:
    lost = dist.recover(exc)
x = np.full(3, float(rank))
dist.all_reduce(x)
print(json.dumps({"lost": lost, "rank": dist.get_rank(), "size": dist.get_world_size(),
                  "x": x.tolist(), "t": time.monotonic() - start}))
dist.destroy_process_group()
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("where", ["before connecting", "in the setup"])
def test_a_rank_killed_after_it_voted_is_left_out_too(where: str) -> None:
    """Ranks 1 and 3 recover from the loss of rank 0 with rank 2, which is killed once the
    vote is done: they shrink again without it, within moments, not the 60 s timeout."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    roles = ["0", "1", "2", "3"]
    codes, outs = _run_roles(_KILLED_WHILE_SURVIVORS_RECOVER, roles, str(store.port), where)
    assert codes == [-signal.SIGKILL, 0, -signal.SIGKILL, 0], outs
    for new_rank, (out, err) in enumerate((outs[1], outs[3])):
        result = json.loads(out)
        assert result["lost"] == [0, 2], (result, err)
        assert (result["rank"], result["size"]) == (new_rank, 2)
        assert result["x"] == [4.0, 4.0, 4.0]  # ranks 1 and 3
        assert result["t"] < 20, result  # (a generous no-hang guard)
    store.close()


_MEMBER_LOST_AS_THE_WORLD_GROWS = """
import json, os, signal, sys, time
from datetime import timedelta
import numpy as np
import aiodist.sync as dist
role, port, where = sys.argv[1], int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
state = np.zeros(4)
if role == "joiner":
    dist.join_process_group("gloo", store=store, timeout=60, state=[state])
else:
    rank = int(role)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3, timeout=60)
    state[:] = [7, 1.5, 2.5, 3.5]
    while not store.check(["aiodist/default_pg/waiting"]):  # the joiner registered
        time.sleep(0.01)
    if rank == 2:  # dies once the members decided to admit the joiner, or as they send
        import aiodist._api as api, aiodist._assembly._membership as membership
        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        if where == "forming":
            membership._successor = die
        else:
            api.broadcast = die  # the grown world formed; the state is sent next
    try:
        dist.admit(state=[state])
    except dist.DistNetworkError as exc:
        print(json.dumps({"admit": str(exc), "lost": dist.recover(exc)}), flush=True)
    while not dist.admit(state=[state]):  # the joiner waits for the next admission
        time.sleep(0.01)
x = np.full(3, float(dist.get_rank() + 1))
dist.all_reduce(x)
print(json.dumps({"rank": dist.get_rank(), "size": dist.get_world_size(),
                  "state": state.tolist(), "x": x.tolist()}))
dist.destroy_process_group()
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("where", ["forming", "state"])
def test_a_member_lost_as_the_world_grows_fails_admit_and_the_joiner_waits_again(
    where: str,
) -> None:
    # Member 2 dies as the grown world forms, or once it formed, before the state is sent.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    roles = ["0", "1", "2", "joiner"]
    codes, outs = _run_roles(_MEMBER_LOST_AS_THE_WORLD_GROWS, roles, str(store.port), where)
    assert codes == [0, 0, -signal.SIGKILL, 0], outs
    for rank in (0, 1):
        out, err = outs[rank]
        failed, result = map(json.loads, out.splitlines())
        if where == "forming":
            assert failed["admit"].startswith(
                "admit: the new process group can never be complete: rank 2 (rank 2 is gone: "
                "its connection to the store ended without a goodbye"
            ), (failed, err)
            assert failed["lost"] == [2]
        else:
            # The broadcast of the state failed, naming rank 2; the joiner, rank 3 of the
            # grown world, left it to wait again, so the members lost both.
            named = r"lost connection to rank 2\b|\brank 2 is gone"
            assert re.search(named, failed["admit"]), (failed, err)
            assert failed["lost"] == [2, 3]
        assert (result["rank"], result["size"]) == (rank, 3)
    joined = json.loads(outs[3][0])
    assert (joined["rank"], joined["size"]) == (2, 3)
    assert joined["state"] == [7, 1.5, 2.5, 3.5]
    for out, _ in (outs[0], outs[1], outs[3]):
        assert json.loads(out.splitlines()[-1])["x"] == [6.0, 6.0, 6.0]  # 1 + 2 + 3
    store.close()


_JOINER_LOST_AS_THE_WORLD_GROWS = """
import asyncio, json, os, signal, sys
from datetime import timedelta
import numpy as np
import aiodist.sync as dist
role, port, when = sys.argv[1], int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
if role == "joiner":
    import aiodist._assembly._membership as membership, aiodist.backends as backends
    async def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)
    if when == "setting up":  # connected to the members, before its leases in the grown world
        backends.setup = die
    else:  # once its part of the grown world is done
        real_open_world = membership.open_world
        async def open_world_then_die(*args, **kwargs):
            await real_open_world(*args, **kwargs)
            await die()
        membership.open_world = open_world_then_die
    dist.join_process_group("gloo", store=store, timeout=60)
else:
    import logging
    logging.basicConfig(format="%(message)s")  # the warning of the admission that failed
    dist.init_process_group("gloo", store=store, rank=int(role), world_size=3, timeout=60)
    if when == "formed" and role == "1":  # slow to finish: sees the joiner gone while forming
        import aiodist.backends as backends
        real_setup = backends.setup
        async def slow_setup(*args, **kwargs):
            await real_setup(*args, **kwargs)
            await asyncio.sleep(0.8)
        backends.setup = slow_setup
    while not store.check(["aiodist/default_pg/waiting"]):  # the joiner registered
        pass
    print(json.dumps({"admitted": dist.admit()}), flush=True)
    x = np.full(3, float(dist.get_rank() + 1))
    dist.all_reduce(x)  # the world before the admission goes on, for every member alike
    print(json.dumps({"rank": dist.get_rank(), "size": dist.get_world_size(), "x": x.tolist()}))
    dist.destroy_process_group()
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("when", ["setting up", "formed"])
def test_a_joiner_lost_as_the_world_grows_is_not_admitted_and_the_members_go_on(
    when: str,
) -> None:
    """The joiner dies in its set-up of the grown world, or once its part is done while
    member 1 is still forming it (members 0 and 2 done): the grown world stands for all its
    processes or for none, so every member gives it up and goes on in the world it had
    (each deciding alone left members 0 and 2 in the grown world and member 1 in the old
    one, where neither could go on)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    roles = ["0", "1", "2", "joiner"]
    codes, outs = _run_roles(_JOINER_LOST_AS_THE_WORLD_GROWS, roles, str(store.port), when)
    assert codes == [0, 0, 0, -signal.SIGKILL], outs
    for rank in range(3):
        out, err = outs[rank]
        admitted, result = map(json.loads, out.splitlines())
        assert admitted == {"admitted": []}, err
        # Named as the joiner (rank 3 of the grown world): by its lease in the lobby, or by
        # its lost connections as the grown world was set up, whichever came first.
        warned = (
            rf"rank {rank}: admit: nobody admitted this time: .*(a process being admitted|rank 3\b)"
        )
        assert re.search(warned, err), err
        assert result == {"rank": rank, "size": 3, "x": [6.0, 6.0, 6.0]}
    if when == "formed":  # the members that had formed it say why it was given up
        for rank in (0, 2):
            assert "admit: the new process group was given up as it formed: " in outs[rank][1]
    store.close()
