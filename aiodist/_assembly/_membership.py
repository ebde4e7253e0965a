"""Membership changes: ranks leave a world (``shrink_group``), processes join one (``admit``).

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
fails it at once on this rank. :func:`lost` (``lost_ranks``) says which ranks to exclude.

:func:`join` (``join_process_group``) registers a process in the job's *lobby* in the store
and waits for a ticket; :func:`admit`, called by every member at the same points, hands
tickets to the processes waiting and forms, with them, a grown world (members keep their
ranks), which becomes the default.

Either way the old world is replaced by a successor over new connections rather than
patched (see docs/architecture.md, "Membership changes").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
from collections.abc import Awaitable, Callable, Collection, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from .. import backends as _backends
from ..errors import DistError, DistNetworkError, DistTimeoutError, DistUsageError
from ..group import Membership, ProcessGroup, World, check_int, peek_world, set_current_world
from ..group._world import FailureDomain, departure_record, read_departures
from ..store import PrefixStore, Store
from ._join import CURRENT, announce, connect_members, leave_forming, open_world

__all__ = [
    "LOST_GRACE",
    "SHRINK_ABORT",
    "SHRINK_DEFAULT",
    "admit",
    "gone_for_good",
    "join",
    "lost",
    "shrink",
    "stands",
    "vote",
]

logger = logging.getLogger(__name__)

#: ``shrink_group``'s flag to let the operations in flight end before shrinking.
SHRINK_DEFAULT = 0
#: ``shrink_group``'s flag to fail the operations in flight at once.
SHRINK_ABORT = 1

#: Seconds :func:`lost` waits, in a broken world, for a rank that went away to be recorded.
LOST_GRACE = 1.0
_LOST_POLL = 0.02
# How often a membership change checks that the processes it waits for are still there
# (seconds; see _unless_gone).
_LOST_CHECK = 0.25
# How often a process waiting to join checks whether it was admitted (seconds).
_ADMITTED_POLL = 0.1
# Why a rank that moved on to a successor world left the old one: it is not lost.
_MOVED_ON = "moved on to the group of its"
# Keys in the store where a successor world forms: how many of its processes formed it, and
# whether it stands (_STANDS) or why not (see stands).
_FORMED = "formed"
_OUTCOME = "outcome"
_STANDS = "stands"
# The outcome of a vote to shrink (under its ``done`` key) starts with one of these: the
# number of the vote that stood, why it failed (voters that differ), or which rank went
# away before it voted.
_AGREED, _FAILED, _WENT = "=", "!", "-"
# How many times a second the voters of a vote, together, check whether a rank went away
# before it voted (see _watch_voters).
_CHECKS_PER_SECOND = 256
# The key of a job's lobby that records the processes that stopped waiting to be admitted
# (their leases, or their own word), by the name they registered under.
_WITHDRAWN = "withdrawn"

T = TypeVar("T")

# Ids of the groups that shrinking a group other than the default makes: apart from the ids
# new_group hands out, which every rank of the world counts alike.
_SHRUNK_GROUP_BIT = 1 << 30


async def lost(group: ProcessGroup, *, expected: bool = False) -> list[int]:
    """The ranks of ``group`` that left its world for good; see :func:`aiodist.lost_ranks`.

    ``expected``: a rank is known to have gone (an operation failed for a lost connection),
    so a record still on its way is waited for (as in a broken world), up to
    :data:`LOST_GRACE` and the time the store takes to carry out a lease.
    """
    gone = await gone_for_good(group.world.domain, group.ranks, expected=expected)
    return sorted(group.group_rank(r) for r in gone)


async def gone_for_good(
    domain: FailureDomain, ranks: Sequence[int], *, expected: bool = False
) -> list[int]:
    """The ranks of ``ranks`` that left ``domain``'s world for good (not to a successor
    world), in one store request unless one is expected and not recorded yet (see
    :func:`lost`)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LOST_GRACE + domain.store.lease_lapse
    delay = _LOST_POLL
    while True:
        left = await domain.departures(ranks)
        gone = [r for r, why in left.items() if not why.startswith(_MOVED_ON)]
        # A rank noticed through its connection may not be in the store yet: its lease is
        # carried out as the store's server sees the same connection end, moments later
        # (on etcd, once its lease lapses: seconds, where every survivor asking every 20 ms
        # would flood it, hence the growing pause).
        if gone or (domain.broken is None and not expected) or loop.time() >= deadline:
            return gone
        await asyncio.sleep(delay)
        delay = min(2 * delay, _LOST_CHECK)


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
    if default:
        _changeable(world, "shrink_group")
    if not default and world.domain.aborted:
        raise DistNetworkError(
            f"shrink_group: the world of {group!r} was aborted ({world.broken}); a failure "
            "aborts every group of its world: shrink the default group instead"
        )
    groups = list(world.groups.values()) if default else [group]
    await _end_inflight(groups, abort=shrink_flags == SHRINK_ABORT)
    remaining = [r for i, r in enumerate(group.ranks) if i not in excluded]
    group.membership_votes += 1
    key = f"shrink/{group.group_id}/{group.membership_votes}"
    new_id = await vote(world.domain, key, excluded, remaining, group.timeout, group.group_rank)
    if default:
        store = _beside(world.store, key)
        rank, size = remaining.index(world.rank), len(remaining)
        others = [r for r in remaining if r != world.rank]
        successor = await _successor(
            world, store, rank, size, "shrink_group", _departed(world.domain, others)
        )
        return successor.default_group
    shrunk = ProcessGroup(
        world, remaining, _SHRUNK_GROUP_BIT | new_id, group.backend, group.backends, group.timeout
    )
    await _backends.setup(shrunk)
    await group.destroy()
    return shrunk


def _beside(store: Store, key: str) -> PrefixStore:
    """The namespace where the world that the vote under ``key`` shrinks to forms, beside
    the namespace ``store`` of the world it replaces, not in it: the old world's last rank to
    leave deletes that world's namespace while the new one lives on."""
    assert isinstance(store, PrefixStore)  # (a world that changes members has one of its own)
    return PrefixStore(f"{store.prefix.rstrip('/')}+{key}", store.underlying_store)


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


async def vote(
    domain: FailureDomain,
    key: str,
    excluded: Collection[int],
    remaining: Sequence[int],
    timeout: float | None,
    group_rank: Callable[[int], int],
) -> int:
    """Agree with the other ranks ``remaining`` of ``domain``'s world on the group ranks
    ``excluded``, through the store under ``key`` (new for each vote); return a number
    unique to the vote in the world. ``group_rank`` names a world rank in the messages.

    Three round trips to the store per voter, whatever the number of voters: it records
    that it voted (``arrived``) as it proposes its list (the first one recorded is the
    list), counts itself in, and reads the outcome (``done``) as soon as there is one: the
    vote's number once every remaining rank voted for the list, or why the vote failed,
    whichever comes first. Meanwhile the voters check that no remaining rank went away
    before it voted (see :func:`_watch_voters`); the one that finds such a rank records it
    as the outcome, which tells the others.

    Raises:
        DistUsageError: another rank voted for another list (every voter raises).
        DistTimeoutError: a remaining rank did not vote in time (named).
        DistNetworkError: the store cannot be reached, or a remaining rank went away before
            it voted.
    """
    store, me = domain.store, domain.rank
    mine = ",".join(map(str, sorted(excluded)))
    done = f"{key}/done"
    problem = None
    watching: asyncio.Task[None] | None = None
    try:
        _, agreed_raw = await asyncio.gather(
            store.append(f"{key}/arrived", f"{me},"),
            store.compare_set(f"{key}/excluded", "", mine),
        )
        agreed = agreed_raw.decode()
        if agreed != mine:
            problem = (
                f"shrink_group: rank {group_rank(me)} of the group excludes ranks [{mine}] but "
                f"another remaining rank excludes ranks [{agreed}]; every remaining rank must "
                "exclude the same ranks"
            )
            # (Unless the vote stood already: then this rank alone raises.)
            outcome = (await store.compare_set(done, "", _FAILED + problem)).decode()
        elif await store.add(f"{key}/votes", 1) == len(remaining):
            number = await store.add("shrink/groups", 1)
            outcome = (await store.compare_set(done, "", f"{_AGREED}{number}")).decode()
        else:
            watching = asyncio.ensure_future(_watch_voters(domain, key, remaining))
            try:
                async with asyncio.timeout(timeout):
                    outcome = (await _value_of(store, done)).decode()
            except TimeoutError:
                voted = await _voted(store, key)
                missing = [group_rank(r) for r in remaining if r not in voted]
                raise DistTimeoutError(
                    f"shrink_group: group ranks {missing} did not call shrink_group within "
                    f"{timeout} s"
                ) from None
    except DistNetworkError as exc:
        raise DistNetworkError(
            f"shrink_group: the store cannot be reached ({exc}); the remaining ranks agree "
            "through it, so it must be served by one of them or from outside the job"
        ) from exc
    finally:
        if watching is not None:
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
    if outcome.startswith(_FAILED):
        raise DistUsageError(outcome.removeprefix(_FAILED))
    if outcome.startswith(_WENT):
        raise DistNetworkError(
            f"shrink_group: {outcome.removeprefix(_WENT)} went away before it voted"
        )
    if problem is not None:
        raise DistUsageError(problem)  # (the vote stood for the list first recorded)
    return int(outcome.removeprefix(_AGREED))


async def _voted(store: Store, key: str) -> set[int]:
    """The world ranks that voted in the vote under ``key``."""
    return {int(r) for r in (await store.get(f"{key}/arrived")).decode().split(",") if r}


async def _watch_voters(domain: FailureDomain, key: str, remaining: Sequence[int]) -> None:
    """Until cancelled, check whether one of the ranks ``remaining`` went away before it
    voted in the vote under ``key``; if one did, record it as the vote's outcome (which
    ends the vote for every voter).

    Every voter checks, but each at a pace that keeps all the checks together at about
    :data:`_CHECKS_PER_SECOND` (one request each), from a random start: a loss is seen
    within moments by one voter or another, at a cost to the store that does not grow with
    the number of voters (each voter checking every :data:`_LOST_CHECK` seconds would
    cost ``N / 0.25`` requests a second, which at thousands of ranks slowed the vote
    itself).
    """
    every = max(_LOST_CHECK, len(remaining) / _CHECKS_PER_SECOND)
    await asyncio.sleep(random.uniform(0, every))
    while True:
        gone = await _departed(domain, remaining)()
        if gone is not None:  # (the usual answer is no, in one request)
            voted = await _voted(domain.store, key)
            gone = await _departed(domain, [r for r in remaining if r not in voted])()
            if gone is not None:
                await domain.store.compare_set(f"{key}/done", "", _WENT + gone)
                return
        await asyncio.sleep(every)


async def _value_of(store: Store, key: str) -> bytes:
    """The value of ``key`` once it is set, however long that takes (the caller bounds the
    wait): a ``get`` parked at the store, again each time the store's own timeout ends it.
    """
    while True:
        with contextlib.suppress(DistTimeoutError):
            return await store.get(key)


async def admit(world: World) -> list[int]:
    """Admit the processes waiting to join ``world``'s job; see :func:`aiodist.admit`."""
    membership = _changeable(world, "admit")
    group = world.default_group
    group.check_usable("admit")
    group.membership_votes += 1
    lobby = membership.lobby
    # The first member to get here decides who is admitted this time: those that registered
    # since the last time and are still there; the others adopt its decision.
    registered = [i for i in (await lobby.compare_set("waiting", "", "")).decode().split(",") if i]
    fresh = registered[membership.seen :]
    withdrawn = await read_departures(lobby, _WITHDRAWN) if fresh else {}
    alive = [i for i in fresh if i not in withdrawn]
    round_id = await lobby.add("rounds", 1) if alive else 0
    proposal = f"{round_id}|{len(registered)}|{','.join(alive)}"
    agreed = (
        await world.store.compare_set(f"admit/{group.membership_votes}", "", proposal)
    ).decode()
    round_text, seen, joiners = agreed.split("|")
    membership.seen = int(seen)
    if not joiners:
        return []
    ids = joiners.split(",")
    size = world.size + len(ids)
    # Every member writes the same tickets: any one of them getting here lets the joiners on.
    await lobby.multi_set(
        [f"ticket/{i}" for i in ids],
        [f"{round_text}|{world.size + n}|{size}|{seen}" for n in range(len(ids))],
    )
    store = PrefixStore(f"round/{round_text}", lobby)
    members = [r for r in range(world.size) if r != world.rank]
    gone = _departed(world.domain, members, lobby, ids)
    try:
        await _successor(world, store, world.rank, size, "admit", gone)
    except DistNetworkError as exc:
        # Only processes being admitted were lost: the members' world is as it was, and
        # admitting nobody is what happened (the others that wait register again).
        if world.broken is not None or await _departed(world.domain, members)() is not None:
            raise
        logger.warning("rank %d: admit: nobody admitted this time: %s", world.rank, exc)
        return []
    return list(range(world.size, size))


def _departed(
    domain: FailureDomain,
    ranks: Sequence[int],
    lobby: Store | None = None,
    joiners: Sequence[str] = (),
) -> Callable[[], Awaitable[str | None]]:
    """Why one of ``domain``'s world's ``ranks``, or of the processes ``joiners`` waiting
    in ``lobby``, went away (other than to a successor world), if one did: a process that
    dies before it takes its part in forming a successor holds its lease there only. One
    store request each, however many there are."""

    async def gone() -> str | None:
        for r, why in (await domain.departures(ranks)).items():
            if not why.startswith(_MOVED_ON):
                return f"rank {r} ({why})"
        if lobby is not None and joiners:
            withdrawn = await read_departures(lobby, _WITHDRAWN)
            for i in joiners:
                if i in withdrawn:
                    return f"a process being admitted ({withdrawn[i]})"
        return None

    return gone


async def join(
    membership: Membership,
    *,
    backend: str,
    backends: Mapping[str, str],
    timeout: float | None,
    owned: list[Store],
    receive: Callable[[ProcessGroup], Awaitable[None]],
    form: Callable[[], Coroutine[Any, Any, ProcessGroup]] | None = None,
) -> ProcessGroup:
    """Wait in the job's lobby (``membership.lobby``) until the members admit this process;
    return the default group it then joins, once ``receive(group)`` got the members' state.
    While the job has no world yet, ``form()`` (if given) takes this process's rank in the
    world being formed instead. See :func:`aiodist.join_process_group`."""
    lobby = membership.lobby
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    while form is not None and not await lobby.check([CURRENT]):
        try:
            formed = await _unless_announced(lobby, form())
        except DistNetworkError:
            # A rank left that generation as it formed (its replacement joins the next):
            # join the next too, unless a world runs by now.
            if deadline is not None and loop.time() >= deadline:
                raise
            continue
        if formed is not None:
            formed.world.keep_stores(owned)
            return formed
    while True:
        me = secrets.token_hex(8)
        store: Store | None = None  # where the grown world forms, once admitted
        pg: ProcessGroup | None = None
        try:
            # Members that decide while this process is gone leave it out; those that
            # decided watch this lease as the grown world forms, so it is held until the
            # grown world holds this process's own.
            ended = "its process ended while it waited to be admitted"
            await lobby.lease(_WITHDRAWN, departure_record(me, ended), append=True)
            await lobby.append("waiting", f"{me},")
            await _admitted(lobby, f"ticket/{me}", timeout, deadline)
            round_text, rank, size, seen = (await lobby.get(f"ticket/{me}")).decode().split("|")
            store = PrefixStore(f"round/{round_text}", lobby)
            connect = membership.connect
            transport = await connect_members(store, int(rank), int(size), connect, "admit")
            membership.seen = int(seen)
            # (The job's stores go to the grown world once it is whole: a retry keeps them.)
            pg = await open_world(
                transport,
                store,
                backend=backend,
                backends=backends,
                timeout=timeout,
                owned=[],
                membership=membership,
            )
            why_not = await stands(pg.world.domain, int(size), pg.world.timeout)
            if why_not is not None:
                raise DistNetworkError(
                    f"join_process_group: the grown world was given up as it formed: {why_not}"
                )
            await lobby.lease(_WITHDRAWN, None)
            await receive(pg)
        except BaseException as exc:
            if store is not None:
                await _give_up_forming(store, repr(exc))  # (no effect once it stands)
            if pg is None:
                await _give_up(lobby, me, exc)
            else:
                await pg.destroy()
            # A member lost while the grown world formed, or sent the state, fails it for
            # every process in it; the members go on without that one (recover) and admit
            # again: wait for that, under a new name.
            if store is not None and isinstance(exc, DistNetworkError):
                continue
            for s in owned:
                await s.aclose()
            raise
        pg.world.keep_stores(owned)
        return pg


async def _unless_announced(
    lobby: Store, forming: Coroutine[Any, Any, ProcessGroup]
) -> ProcessGroup | None:
    """Await ``forming`` a world, unless the job announces a world (``CURRENT``) first:
    then cancel it and return ``None``.

    A world formed without this process (the worker it replaces died after the world had
    formed, before it was announced) is announced moments later, or its successor is once
    the members shrink it: this process then waits to be admitted.
    """
    task = asyncio.ensure_future(forming)
    try:
        while True:
            done, _ = await asyncio.wait([task], timeout=_LOST_CHECK)
            if done:
                return task.result()
            if await lobby.check([CURRENT]):
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                if not task.cancelled() and task.exception() is None:
                    await task.result().destroy()  # formed in the same turn: let it go
                return None
    except BaseException:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise


async def _admitted(
    lobby: Store, ticket: str, timeout: float | None, deadline: float | None
) -> None:
    """Wait for ``ticket`` in ``lobby`` until the loop's time ``deadline``, ``timeout``
    seconds after joining began.

    Raises:
        DistTimeoutError: not by ``deadline``.
        DistNetworkError: every rank of the job's world left it (none will admit).
    """
    loop = asyncio.get_running_loop()
    while not await lobby.check([ticket]):
        current = await lobby.compare_set(CURRENT, "", "")
        if current:
            path, size, *ended = current.decode().split("|")
            # (Its last rank to leave marks it ended as it deletes its keys; until then, the
            # departures say whether every rank left it.)
            left = {} if ended else await read_departures(PrefixStore(path.rstrip("/"), lobby))
            if ended or (
                len(left) == int(size) and not any(w.startswith(_MOVED_ON) for w in left.values())
            ):
                raise DistNetworkError(
                    "join_process_group: the job's world ended before it admitted this "
                    f"process: every one of its {size} ranks left it"
                )
        if deadline is not None and loop.time() >= deadline:
            raise DistTimeoutError(
                f"join_process_group: not admitted within {timeout} s: the members of the "
                "job's world admit waiting processes when they call admit()"
            )
        await asyncio.sleep(_ADMITTED_POLL)


async def _give_up(lobby: Store, me: str, exc: BaseException) -> None:
    """Withdraw the waiting process ``me``: members that decide from now on leave it out,
    and those that already admitted it and form a world with it hear it will not come."""
    why = "cancelled" if isinstance(exc, asyncio.CancelledError) else repr(exc)
    try:
        record = departure_record(me, f"it stopped waiting: {why}")
        await asyncio.wait_for(lobby.append(_WITHDRAWN, record), 5)
        if await asyncio.wait_for(lobby.check([f"ticket/{me}"]), 5):
            round_text, rank, *_ = (await lobby.get(f"ticket/{me}")).decode().split("|")
            world = PrefixStore(f"round/{round_text}", lobby)
            await leave_forming(world, f"rank {rank} (it stopped waiting to be admitted: {why})")
    except (DistError, TimeoutError):
        pass  # the store is gone: nobody is left to tell


def _changeable(world: World, op: str) -> Membership:
    if world.membership is None:
        raise DistUsageError(
            f"{op}: this world's connections were made outside init_process_group "
            "(start_world with a transport of its own), so they cannot be made again for "
            "another set of ranks"
        )
    return world.membership


async def _successor(
    world: World,
    store: Store,
    rank: int,
    size: int,
    why: str,
    gone: Callable[[], Awaitable[str | None]],
) -> World:
    """Form the world of ``size`` ranks gathering in ``store`` as ``rank``, make it the
    default once it stands (see :func:`stands`), and close ``world`` (which hands it its
    stores).

    ``gone`` says why one of the processes expected there went away, if one did (see
    :func:`_unless_gone`).
    """
    try:
        successor = await _unless_gone(_formed(world, store, rank, size, why), gone, World.aclose)
    except BaseException as exc:
        await _give_up_forming(store, f"{exc} went away" if isinstance(exc, _Gone) else repr(exc))
        if isinstance(exc, _Gone):
            raise DistNetworkError(
                f"{why}: the new process group can never be complete: {exc} went away"
            ) from None
        raise
    why_not = await stands(successor.domain, size, successor.timeout)
    if why_not is not None:
        await successor.aclose()
        raise DistNetworkError(f"{why}: the new process group was given up as it formed: {why_not}")
    await announce(successor)
    world.hand_over_stores(successor)
    if peek_world() is world:
        set_current_world(successor)
    await world.aclose(f"{_MOVED_ON} {size} ranks ({why})")
    return successor


async def _formed(world: World, store: Store, rank: int, size: int, why: str) -> World:
    """The world of ``size`` ranks gathering in ``store``, connected and set up."""
    assert world.membership is not None
    transport = await connect_members(store, rank, size, world.membership.connect, why)
    successor = World(
        transport,
        store,
        backend=world.backend,
        backends=world.backends,
        timeout=world.timeout,
        membership=world.membership,
    )
    successor.start()
    try:
        await successor.domain.leased()
        await _backends.setup(successor.default_group)
    except BaseException:
        await successor.aclose()
        raise
    return successor


async def stands(domain: FailureDomain, size: int, timeout: float | None) -> str | None:
    """Whether the world of ``size`` processes just formed by this one, ``domain``'s (in
    its store), stands: ``None`` if it does, else why not. ``timeout`` is its operation
    timeout.

    Decided once for every process of it, through the store: it stands once all ``size``
    have formed it, and not if one of them gave up forming it (:func:`_give_up_forming`), or
    this process saw the world break or time out, first. Without it, a process that went
    away as the world formed could leave some processes in it and others still in the
    world it replaces (each deciding alone whether it came too late), where neither can
    go on. Two round trips to the store, whatever ``size`` is: a process counts itself in
    and reads the outcome as soon as there is one (the last to count in decides it).
    """
    store = domain.store
    if await store.add(_FORMED, 1) == size:
        outcome = await store.compare_set(_OUTCOME, "", _STANDS)
    else:
        try:
            async with asyncio.timeout(timeout):
                outcome = await domain.unless_broken(_value_of(store, _OUTCOME), "forming")
        except TimeoutError:
            why = f"not every process had formed it within {timeout} s"
            outcome = await store.compare_set(_OUTCOME, "", why)
        except DistNetworkError:
            if domain.broken is None:
                raise  # (the store cannot be reached, or the world was closed)
            outcome = await store.compare_set(_OUTCOME, "", str(domain.broken))
    text = outcome.decode(errors="replace")
    return None if text == _STANDS else text


async def _give_up_forming(store: Store, why: str) -> None:
    """Tell the processes forming a world in ``store`` that this one will not (see
    :func:`stands`): the world cannot stand, since this process did not form it."""
    with contextlib.suppress(DistError, TimeoutError):
        await asyncio.wait_for(store.compare_set(_OUTCOME, "", why), 5)


class _Gone(Exception):
    """A process that a membership change waits for went away (the text says which, why)."""


async def _unless_gone(
    work: Coroutine[Any, Any, T],
    gone: Callable[[], Awaitable[str | None]],
    release: Callable[[T], Awaitable[object]] | None = None,
) -> T:
    """Await ``work`` unless ``gone``, asked every :data:`_LOST_CHECK` seconds, says that one
    of the processes it waits for went away: then cancel it and raise :class:`_Gone`.

    A process that dies before it holds a lease where ``work`` waits for it is seen only
    through its leases elsewhere (the world being replaced, the lobby): without this,
    ``work`` would wait for it until its timeout. ``release`` lets go of a result that came
    too late to be returned (the caller was cancelled in the same turn).
    """
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_LOST_CHECK)
            if not done:
                lost = await gone()
                if lost is not None and not task.done():
                    raise _Gone(lost)
            if task.done():
                return task.result()
    except BaseException:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if release is not None and not task.cancelled() and task.exception() is None:
            await release(task.result())
        raise
