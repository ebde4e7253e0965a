"""Membership changes: the remaining ranks of a group go on without some of its ranks.

:func:`shrink` is ``shrink_group``. Only the ranks that remain call it. They vote through
the world's store on the ranks to exclude (a rank that names other ranks makes every one of
them raise, and the group stays as it was), then:

* shrinking the **default group** forms a new world of the remaining ranks, renumbered in
  order, over new connections and in a namespace of its own in the same store; it takes
  over the stores the old world made and becomes the default; the old world, with every
  other group of it, is closed. This works on a healthy world (a rank leaves by choice)
  and on one aborted by a lost rank: the failure domain is the world, so the way on after a
  failure is a new one;
* shrinking **another group** of a healthy world makes a group of its remaining ranks in the
  same world (its id drawn from the store, since the excluded ranks take no part) and
  destroys the old one.

What is in flight ends first: ``SHRINK_DEFAULT`` lets it end (or fail), ``SHRINK_ABORT``
fails it at once on this rank.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from . import backends as _backends
from ._assembly import connect_members
from ._default import peek_world, set_current_world
from .errors import DistNetworkError, DistTimeoutError, DistUsageError
from .group import ProcessGroup, World, check_int
from .store import PrefixStore

__all__ = ["LOST_GRACE", "SHRINK_ABORT", "SHRINK_DEFAULT", "lost", "shrink"]

#: ``shrink_group``'s flag to let the operations in flight end before shrinking.
SHRINK_DEFAULT = 0
#: ``shrink_group``'s flag to fail the operations in flight at once.
SHRINK_ABORT = 1

#: Seconds :func:`lost` waits, in a broken world, for a rank that went away to be recorded.
LOST_GRACE = 1.0
_LOST_POLL = 0.02
# Why a rank that moved on to a shrunk group left the old world: it is not lost.
_MOVED_ON = "moved on to the group of its"

# Ids of the groups that shrinking a group other than the default makes: apart from the ids
# new_group hands out, which every rank of the world counts alike.
_SHRUNK_GROUP_BIT = 1 << 30


async def lost(group: ProcessGroup) -> list[int]:
    """The ranks of ``group`` that left its world for good; see :func:`aiodist.lost_ranks`."""
    world = group.world
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LOST_GRACE
    while True:
        left = await world.domain.departures()
        ranks = [
            group.group_rank(r)
            for r, why in left.items()
            if r in group.ranks and not why.startswith(_MOVED_ON)
        ]
        # A rank noticed through its connection may not be in the store yet: its lease fires
        # as the store's server sees the same connection end, moments later.
        if ranks or world.broken is None or loop.time() >= deadline:
            return sorted(ranks)
        await asyncio.sleep(_LOST_POLL)


async def shrink(
    group: ProcessGroup, ranks_to_exclude: Sequence[int], shrink_flags: int
) -> ProcessGroup:
    """Return a group of the ranks of ``group`` not in ``ranks_to_exclude`` (group ranks).

    See :func:`aiodist.shrink_group`.

    Raises:
        DistUsageError: a bad list or flag, this rank excluded, a destroyed group, or
            remaining ranks that name different ranks (on every one of them).
        DistNetworkError: the store cannot be reached, a remaining rank left as the new
            group formed, or (for a group other than the default) the world was aborted.
        DistTimeoutError: a remaining rank did not call it within the group's timeout.
    """
    excluded = _check(ranks_to_exclude, shrink_flags, group)
    world = group.world
    default = group is world.default_group
    if group.is_destroyed:
        raise DistUsageError("shrink_group: the process group has been destroyed")
    if default and world.connect is None:
        raise DistUsageError(
            "shrink_group: this world's connections were made outside init_process_group "
            "(start_world with a transport of its own), so they cannot be made again for "
            "the remaining ranks"
        )
    if not default and world.domain.aborted:
        raise DistNetworkError(
            f"shrink_group: the world of {group!r} was aborted ({world.broken}); a failure "
            "aborts every group of its world: shrink the default group instead"
        )
    groups = list(world.groups.values()) if default else [group]
    await _end_inflight(groups, abort=shrink_flags == SHRINK_ABORT)
    remaining = [r for i, r in enumerate(group.ranks) if i not in excluded]
    key, new_id = await _vote(group, excluded, remaining)
    if default:
        return await _successor(world, key, remaining)
    shrunk = ProcessGroup(
        world, remaining, _SHRUNK_GROUP_BIT | new_id, group.backend, group.backends, group.timeout
    )
    await _backends.setup(shrunk)
    await group.destroy()
    return shrunk


def _check(ranks_to_exclude: Sequence[int], shrink_flags: int, group: ProcessGroup) -> set[int]:
    if shrink_flags not in (SHRINK_DEFAULT, SHRINK_ABORT) or isinstance(shrink_flags, bool):
        raise DistUsageError(
            f"shrink_group: shrink_flags must be SHRINK_DEFAULT ({SHRINK_DEFAULT}) or "
            f"SHRINK_ABORT ({SHRINK_ABORT}), got {shrink_flags!r}"
        )
    if isinstance(ranks_to_exclude, (str, bytes)) or not isinstance(ranks_to_exclude, Sequence):
        raise DistUsageError(
            "shrink_group: ranks_to_exclude must be a list of group ranks, got "
            f"{type(ranks_to_exclude).__name__}"
        )
    if not ranks_to_exclude:
        raise DistUsageError("shrink_group: ranks_to_exclude must name at least one rank")
    for r in ranks_to_exclude:
        check_int(r, "shrink_group: each rank to exclude")
        if not 0 <= r < group.size:
            raise DistUsageError(
                f"shrink_group: rank {r} is out of range for a group of size {group.size}"
            )
    excluded = set(ranks_to_exclude)
    if len(excluded) != len(ranks_to_exclude):
        raise DistUsageError(
            f"shrink_group: ranks_to_exclude {list(ranks_to_exclude)} has duplicates"
        )
    if len(excluded) == group.size:
        raise DistUsageError(
            f"shrink_group: cannot exclude every rank of a group of size {group.size}"
        )
    if group.rank in excluded:
        raise DistUsageError(
            f"shrink_group: this rank (group rank {group.rank}) is in ranks_to_exclude; only "
            "the remaining ranks call shrink_group"
        )
    return excluded


async def _end_inflight(groups: list[ProcessGroup], *, abort: bool) -> None:
    """Let the operations in flight on ``groups`` end, or (``abort``) fail them now."""
    if abort:
        cause = DistNetworkError("aborted by shrink_group(shrink_flags=SHRINK_ABORT)")
        tasks = [task for g in groups for task in g.fail_inflight(cause)]
        await asyncio.gather(*tasks, return_exceptions=True)
        return
    await asyncio.gather(*(g.drain() for g in groups))


async def _vote(group: ProcessGroup, excluded: set[int], remaining: list[int]) -> tuple[str, int]:
    """Agree with the other remaining ranks on the ranks to exclude; return the vote's key
    in the store and a number unique to it in the world.

    Raises:
        DistUsageError: another rank voted for another list (every voter raises).
        DistTimeoutError: a remaining rank did not vote in time (named).
        DistNetworkError: the store cannot be reached.
    """
    world, store = group.world, group.world.store
    group.membership_votes += 1
    key = f"shrink/{group.group_id}/{group.membership_votes}"
    vote = ",".join(map(str, sorted(excluded)))
    try:
        await store.append(f"{key}/arrived", f"{world.rank},")
        agreed = (await store.compare_set(f"{key}/excluded", "", vote)).decode()
        if agreed != vote:
            await store.compare_set(
                f"{key}/problem",
                "",
                f"shrink_group: rank {group.rank} of the group excludes ranks [{vote}] but "
                f"another remaining rank excludes ranks [{agreed}]; every remaining rank "
                "must exclude the same ranks",
            )
            await store.compare_set(f"{key}/done", "", "")  # (a completed vote stands)
        elif await store.add(f"{key}/votes", 1) == len(remaining):
            await store.set(f"{key}/done", str(await store.add("shrink/groups", 1)))
        try:
            await store.wait([f"{key}/done"], group.timeout)
        except DistTimeoutError:
            arrived = {int(r) for r in (await store.get(f"{key}/arrived")).decode().split(",") if r}
            missing = [group.group_rank(r) for r in remaining if r not in arrived]
            raise DistTimeoutError(
                f"shrink_group: group ranks {missing} did not call shrink_group within "
                f"{group.timeout} s"
            ) from None
        if await store.check([f"{key}/problem"]):
            raise DistUsageError((await store.get(f"{key}/problem")).decode())
        return key, int(await store.get(f"{key}/done"))
    except DistNetworkError as exc:
        raise DistNetworkError(
            f"shrink_group: the store cannot be reached ({exc}); the remaining ranks agree "
            "through it, so it must be served by one of them or from outside the job"
        ) from exc


async def _successor(world: World, key: str, remaining: list[int]) -> ProcessGroup:
    """Form the world of the ``remaining`` ranks, make it the default, close ``world``."""
    assert world.connect is not None
    store = PrefixStore(f"{key}/world", world.store)
    rank, size = remaining.index(world.rank), len(remaining)
    transport = await connect_members(store, rank, size, world.connect)
    successor = World(
        transport,
        store,
        backend=world.backend,
        backends=world.backends,
        timeout=world.timeout,
        connect=world.connect,
    )
    successor.start()
    try:
        await _backends.setup(successor.default_group)
    except BaseException:
        await successor.aclose()
        raise
    world.hand_over_stores(successor)
    if peek_world() is world:
        set_current_world(successor)
    await world.aclose(f"{_MOVED_ON} {size} remaining ranks (shrink_group)")
    return successor.default_group
