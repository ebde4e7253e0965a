"""Process groups, the operations issued on them, their work handles, and the default group.

A *world* is what ``init_process_group`` builds: a transport between all ranks, the failure
domain over the store it was bootstrapped through (:mod:`aiodist.group._world`), and the process
groups made from it (the default group covers every rank; :func:`new_group` adds more).

Every call on a group is an :class:`Operation`, whose life has four steps:

1. **reserve**: the group's next sequence number (or, point to point, the tag) is taken
   first, before any argument is looked at, so every rank stays in step whatever happens;
2. **plan**: a backend's validate function checks the arguments and returns a :class:`Plan`
   (the algorithm and its checked arguments, the call's fingerprint);
3. **start**: the plan starts at once, in issue order, and takes the operation's place on
   the group's data path (a turn in a shared-memory workspace, say). A check that fails
   *rejects* the operation: its place is taken all the same, by the backend's rejection
   plan, which tells the members that would have exchanged data in it why (point to point:
   the receiver) before any byte of it moved; the caller gets the ``DistUsageError``, the
   members fail their side of it at once, and the group stays usable. So every collective
   a group issues, accepted or rejected, is one item of one sequence, the same on every
   rank, and the data path alone decides, from the operation, what its place is.
   The operation's :class:`Work` resolves with its result;
4. **fail**: only real failures abort the whole world (a mismatch found after bytes
   flowed, the group timeout, an operation that still needed a rank that went away); every
   rank then raises, naming the first cause, until ``destroy`` and ``init`` rebuild it.

A rank that goes away is not a failure by itself: what it sent before it went still reaches
the others, and only an operation that still needs something from it fails. If it left in
order (it destroyed its group, or its script ended: it said goodbye), that operation fails
alone, naming why the rank left. If it went without a goodbye (killed, or exited without
leaving), the world is marked broken at once (``is_aborted()``), and that operation aborts
it.

The operation's own objects (:class:`Operation`, :class:`Plan`, :class:`Work`) are in
:mod:`aiodist.group._work`, the default world (process-wide, or a context's own) in
:mod:`aiodist.group._default`, and the vote that makes a subgroup in :mod:`aiodist._assembly._subgroups`;
this module re-exports what they offer.

The package is the process-group core: this module (``World``, ``ProcessGroup``,
``start_world``, the default world's accessors) and its parts, ``_work`` (an operation's
life: ``Operation``, ``Plan``, ``Work``), ``_operations`` (every operation declared once),
``_world`` (the failure domain), ``_default`` (the default world) and ``_recorder`` (the
flight recorder's ring). It may import the collectives, the transports, the stores,
:mod:`aiodist._arrays`, :mod:`aiodist._util` and :mod:`aiodist.errors`; the backends and
everything above them talk to it, never the other way.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import threading
import time
from collections.abc import (
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Mapping,
    Sequence,
)
from typing import Any, Protocol, TypeVar

from .._arrays._fingerprint import NO_FINGERPRINT
from .._util._asyncio_internals import release_yielded
from .._util._speaking import FIRST_WARNING, WAIT_WARNING_ENV, interval as speaking_interval
from .._util._timeouts import DEFAULT_PG_TIMEOUT, Timeout, to_seconds
from ..collectives._common import ResultError
from ..errors import DistError, DistNetworkError, DistTimeoutError, DistUsageError
from ..store import PrefixStore, Store
from ..transport.base import (
    Departure,
    OpComm,
    Transport,
    departure_of,
    lost_peer_error,
    only_this_operation,
    peer_gave_up,
    rejection_text,
)
from . import _recorder
from ._default import DefaultWorld
from ._recorder import FlightRecorder, payload_nbytes
from ._work import (
    ANY_TAG,
    MAX_TAG,
    P2P_GROUP_BIT,
    Inline,
    Operation,
    OpKind,
    Plan,
    Work,
    handed_over,
    raising,
    rejected_on_transport,
)
from ._world import FailureDomain

__all__ = [
    "ANY_TAG",
    "DEFAULT_PG_TIMEOUT",
    "MAX_TAG",
    "NON_GROUP_MEMBER",
    "P2P_GROUP_BIT",
    "NonGroupMember",
    "OpKind",
    "Operation",
    "Plan",
    "ProcessGroup",
    "Work",
    "World",
    "current_world",
    "check_int",
    "isolate_context",
    "not_in_group",
    "peek_world",
    "resolve_group",
    "set_current_world",
    "start_world",
    "warn_not_in_group",
]

logger = logging.getLogger(__name__)

#: This process's default world (the process's, or a context's own: see
#: :mod:`aiodist.group._default`), and its accessors.
_DEFAULT: DefaultWorld[World] = DefaultWorld()
isolate_context = _DEFAULT.isolate_context
peek_world = _DEFAULT.peek
set_current_world = _DEFAULT.set
current_world = _DEFAULT.current
warn_not_in_group = _DEFAULT.warn_not_in_group

T = TypeVar("T")

#: How a rank connects to the other ranks of a world: ``connect(store, rank, size)`` returns
#: its transport once every rank gathering in ``store`` is connected.
Connect = Callable[[Store, int, int], Coroutine[Any, Any, Transport]]


#: The key, in a job's namespace, naming its world of the moment: where it is in the store
#: and how many ranks it has (``"<namespace>|<size>"``), with ``"|ended"`` after them once
#: every rank has left it for good.
CURRENT = "current"


@dataclasses.dataclass
class Membership:
    """What a world needs to change its members (``shrink_group``, ``admit``).

    A world with one has a namespace of the job's to itself (``init_process_group``'s
    generation, a shrunk or grown world's): its last rank to leave deletes it.

    Attributes:
        connect: how its ranks connect, to connect the new set of ranks the same way.
        lobby: the job's namespace in the store, where processes started later wait to be
            admitted (``join_process_group``).
        seen: how many of those that ever waited there the members have dealt with.
    """

    connect: Connect
    lobby: Store
    seen: int = 0

    def path_of(self, store: Store) -> str:
        """Where ``store``, a namespace in the job's (a world's), is in it: its prefix there."""
        path = ""
        while store is not self.lobby:
            assert isinstance(store, PrefixStore)  # a world's store is a namespace of the job's
            path = store.prefix + path
            store = store.underlying_store
        return path

    async def ended(self, world: World) -> None:
        """Record that ``world``, which every rank has left, ended: if the job still names it
        its world of the moment (:data:`CURRENT`; a world its ranks moved on from names its
        successor), processes waiting to join it learn that nobody will admit them."""
        named = f"{self.path_of(world.store)}|{world.size}"
        await self.lobby.compare_set(CURRENT, named, f"{named}|ended")


#: Why a second ``init_process_group`` where a default group exists is refused, and what to
#: do to run several ranks in one process.
TWICE = (
    "trying to initialize the default process group twice: this process (or this context) "
    "already has one; destroy it first, or run several ranks in one process as tasks that "
    "each have a world of their own (aiodist.testing.run_world, or "
    "aiodist.group.isolate_context() at the start of each rank's task)"
)

#: What the peers of a rank that destroyed its default group are told: "rank N ...".
LEFT_REASON = "left the process group (destroy_process_group)"
#: How long (seconds) operations of a group may keep ending inline, one after another,
#: before the event loop must run again: an operation that ends inline never yields to the
#: loop, so ranks in lockstep would otherwise keep every other task (leases, servers)
#: waiting. A time, not a count: an operation that waits for its peers in a short spin can
#: take 200 µs inline, and sixteen of them stalled the loop for 3 ms.
EAGER_SECONDS = 0.5e-3
#: Seconds a rank that destroys its world waits for the calls it rejected to take their places
#: on their data paths (a workspace's turn needs the peers there), so that the peers hear why.
REJECTION_GRACE = 2.0
#: Seconds an operation that a member left in order, or whose message a member gave up,
#: waits for another member's rejection of it before it fails for that member (see
#: ProcessGroup._rejected_meanwhile).
REJECTION_WAIT = 0.5
#: What they are told when its event loop ended with the group open.
LOOP_ENDED_REASON = "left the process group as its event loop ended (no destroy_process_group)"


class DataPath(Protocol):
    """What a backend keeps for one group: the state of its data path (a shared-memory
    workspace, a communicator), in :attr:`ProcessGroup.paths` under the backend's name.

    The group aborts and closes it with itself. Which operations take a place in an order
    the path keeps is the path's own business: the group starts every operation's plan, or
    its rejection plan, in issue order (:func:`aiodist.backends.reject`).
    """

    def abort(self, cause: BaseException) -> None:
        """Fail what runs on the path now, and later, with ``cause``; tell the peers."""

    async def aclose(self) -> None:
        """Release what the path holds (the group is destroyed)."""


#: A backend's entry point for one call: ``planner(group, op_name, args) -> Plan``.
Planner = Callable[["ProcessGroup", str, tuple[Any, ...]], Plan]
#: The backend's plan for a collective that is rejected, here or by a peer:
#: ``rejecter(group, op_name, error, tell) -> Plan``. It takes the operation's place on the
#: group's data path as an accepted call of that operation would have (whatever the
#: arguments were), telling the peers why when ``tell`` (the rejection is this rank's),
#: and then fails with ``error``, marked as failing this operation alone.
Rejecter = Callable[["ProcessGroup", str, BaseException, bool], Plan]


class NonGroupMember:
    """The value :func:`new_group` returns on ranks outside the new group.

    Passing it as ``group=`` to any operation raises :class:`DistUsageError`.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return "<NON_GROUP_MEMBER>"

    def __bool__(self) -> bool:
        return False


#: The sentinel handed to ranks that are not in a group they created together.
NON_GROUP_MEMBER = NonGroupMember()


class World:
    """What one ``init_process_group`` built: a transport, a failure domain and their groups.

    Attributes:
        rank: this process's global rank.
        size: the number of ranks.
        store: the store the world was bootstrapped through (its keys namespaced).
        transport: the connections to the other ranks.
        domain: the failure domain (abort key, watch, leaving).
        backends: the backends of the default group, by device kind.
        recorder: the last operations of this rank (see :mod:`aiodist.debug`).
        membership: what changing its members needs (``None``: a transport made elsewhere,
            which cannot be made again for other ranks).
    """

    def __init__(
        self,
        transport: Transport,
        store: Store,
        *,
        backend: str,
        backends: Mapping[str, Any],
        timeout: float | None,
        owned: Sequence[Store] = (),
        membership: Membership | None = None,
    ) -> None:
        self.rank = transport.rank
        self.size = transport.world_size
        self.transport = transport
        self.store = store
        self.backend = backend
        self.backends = backends
        self.timeout = timeout
        self.membership = membership
        #: The thread of the event loop the world runs on (another thread may stand in for
        #: it: see ``aiodist.sync._loop_thread.HandOverLoop``).
        self.loop_thread = threading.get_ident()
        self._owned: list[Store] = []
        self.domain = FailureDomain(
            store,
            self.rank,
            self.size,
            on_abort=self._aborted,
            on_gone=self._gone,
            hosting=False,
            timeout=timeout,
            sweep=None if membership is None else self._sweep,
        )
        self.keep_stores(owned)
        self._next_group_id = 1
        self.groups: dict[int, ProcessGroup] = {}
        # Operations a peer rejected before this rank issued them: (group, seq) -> error.
        self.rejected: dict[tuple[int, int], tuple[int, str]] = {}
        self.recorder = FlightRecorder(self.rank, self.size)
        self._leaving = False
        self._keeper: asyncio.Task[None] | None = None
        self._speaker: asyncio.Task[None] | None = None
        self.default_group = ProcessGroup(self, range(self.size), 0, backend, backends, timeout)
        transport.mailbox.listen(self)  # (a peer lost since the transport connected too)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "broken" if self.broken else "open"
        return f"<World rank={self.rank}/{self.size} backend={self.backend} {state}>"

    @property
    def broken(self) -> BaseException | None:
        """The first failure that aborted this world, or ``None``."""
        return self.domain.broken

    @property
    def closed(self) -> bool:
        """Whether the world was destroyed."""
        return self.domain.closed

    def abort(self, cause: BaseException) -> None:
        """Make the world unusable because of ``cause``; every rank is told."""
        self.domain.abort(cause)

    def _gone(self, peer: int, cause: BaseException) -> None:
        # The store says ``peer`` went without a goodbye: the transport takes what it sent,
        # then fails what still needs it (and the first operation that does aborts).
        self.transport.peer_gone(peer, lost_peer_error(peer, str(cause), Departure.GONE))

    def _aborted(self, failure: BaseException) -> None:
        # The peers learn the cause from whatever they wait on: a data path's turn or a message.
        for group in self.groups.values():
            for path in group.paths.values():
                path.abort(failure)
        self.transport.abort(failure)

    async def _sweep(self) -> None:
        # Every rank has left: nobody reads the world's keys any more (a successor forms in
        # a namespace beside this one), so its namespace goes, and the job stops naming it.
        assert self.membership is not None
        await self.store.delete_prefix("")
        await self.membership.ended(self)

    def hand_over_stores(self, successor: World) -> None:
        """Give the stores this world made to ``successor``, the world that replaces it
        (``shrink_group``): this one no longer closes them, nor keeps a store it serves up
        for its ranks; ``successor`` does."""
        successor.keep_stores(self._owned)
        successor.domain.hosting = successor.domain.hosting or self.domain.hosting
        self._owned, self.domain.hosting = [], False

    def keep_stores(self, stores: Sequence[Store]) -> None:
        """Close ``stores`` too when this world closes, and keep up a store it serves until
        every rank has left (stores made for it, handed over once it is whole)."""
        self._owned.extend(stores)
        self.domain.hosting = self.domain.hosting or any(
            getattr(s, "server", None) is not None for s in stores
        )

    @property
    def group_count(self) -> int:
        """How many process groups this world has made, the default group included."""
        return self._next_group_id

    def allocate_group_id(self) -> int:
        """Return the next group id; every rank allocates ids in the same order."""
        gid = self._next_group_id
        self._next_group_id += 1
        return gid

    # -- what the mailbox reports (MailboxListener) --------------------------------------

    def on_mismatch(self, group_id: int, seq: int, exc: DistUsageError) -> None:
        """A peer called another collective than this rank under ``(group, seq)``."""
        group = self.groups.get(group_id)
        op = None if group is None else group.inflight_op(seq)
        if group is not None and op is not None:
            group._fail(op, exc)
        else:
            self.abort(exc)

    def on_lost(self, peer: int, exc: BaseException) -> None:
        """``peer`` is gone: it left in order, went away without a goodbye, or failed.

        A goodbye breaks nothing (what still needs ``peer`` fails when it finds that it
        cannot get it, see :meth:`ProcessGroup._fail_alone`); going without one breaks the
        world but lets what is in flight go on; a failure (``peer`` aborted, or its
        connection broke mid-message) aborts the world, even when idle.
        """
        departure = departure_of(exc)
        if departure is Departure.GONE:
            self.domain.depart(exc)
        elif departure is None:
            self.abort(exc)

    def on_reject(self, peer: int, group_id: int, seq: int, reason: str) -> None:
        """``peer`` rejected its operation ``(group, seq)`` before sending any of its data."""
        mailbox = self.transport.mailbox
        if group_id & P2P_GROUP_BIT:
            # Its send takes the place of one message: the receive that would have taken
            # it fails instead.
            tag = None if seq == ANY_TAG else seq
            exc = DistUsageError(
                f"recv from rank {peer} ({'any tag' if tag is None else f'tag {tag}'}): "
                f"rank {peer} rejected its send: {reason}"
            )
            mailbox.poison(peer, group_id, tag, exc)
            return
        mailbox.kill(group_id, seq, DistUsageError(f"rejected by rank {peer}: {reason}"))
        group = self.groups.get(group_id)
        op = None if group is None else group.inflight_op(seq)
        if group is not None and op is not None:
            group._fail_rejected(op, group._rejection(op, peer, reason))
        elif group is None or seq >= group.next_seq:
            # Kept for the operation this rank has yet to issue (an operation it issued
            # already, and which ended, needs no word: it rejected it too).
            self.rejected[group_id, seq] = (peer, reason)

    def start(self) -> None:
        """Watch the failure domain, and leave when the event loop ends (:meth:`keep`).

        Needs a running loop.
        """
        self.domain.start()
        self.keep()
        if self._speaker is None:
            self._speaker = asyncio.get_running_loop().create_task(self._speak_while_slow())

    async def _speak_while_slow(self) -> None:
        # Says, at the first minute and then at every interval (see aiodist._util._speaking), which
        # operations still wait and for whom: a peer stuck in user code, or one that never
        # calls, shows in the log long before the group's timeout. A collective that has run
        # a quarter of that records its arrival in the store (as a timed-out one does), so
        # the warning can name the ranks that have not called it.
        every = speaking_interval()
        first = min(FIRST_WARNING, every)
        arrived: set[Operation] = set()
        warned: dict[Operation, float] = {}
        while True:
            await asyncio.sleep(first / 4)
            now = time.time()
            running = [op for g in list(self.groups.values()) for op in g._inflight]
            for op in running:
                record = op.record
                if record is None:
                    continue
                ran = now - record.queued
                if op.kind is OpKind.COLLECTIVE and op not in arrived and ran >= first / 4:
                    arrived.add(op)
                    with contextlib.suppress(DistError, TimeoutError):
                        async with asyncio.timeout(first):
                            await self.domain.arrive(_arrival_key(op), op.group.rank)
                last = warned.get(op)
                if now < (record.queued + first if last is None else last + every):
                    continue
                warned[op] = now
                logger.warning(
                    "rank %d: %s (%s) on %r still waits after %.1f s: %s (next word in %g s; "
                    "set %s to change)",
                    self.rank,
                    op.name,
                    op.label,
                    op.group,
                    ran,
                    await op.group.waits_for(op, first),
                    every,
                    WAIT_WARNING_ENV,
                )
            alive = set(running)
            arrived &= alive
            for op in [op for op in warned if op not in alive]:
                del warned[op]

    def keep(self) -> None:
        """Leave this world when the event loop that runs it shuts down with it still open.

        ``asyncio.run`` cancels every task it leaves behind as it ends: a task waiting here
        then leaves as a script's exit does (:meth:`finish`), so that what is in flight
        ends and a store this process hosts stays up until the others have left.
        Needs a running loop.
        """
        if self._keeper is None:
            self._keeper = asyncio.get_running_loop().create_task(self._keep())

    async def _keep(self) -> None:
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError:
            if not self._leaving and not self.closed:
                await self.finish(LOOP_ENDED_REASON)
            raise

    async def __aenter__(self) -> World:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def finish(self, reason: str, failure: BaseException | None = None) -> None:
        """Leave at the end of the process: let what is in flight end, then :meth:`aclose`.

        The operations in flight get the world's timeout to end (a peer's receive may not
        be posted yet); a failure ends them sooner. The peers are told ``reason``. A
        process that ends on an exception passes it as ``failure``: the world is aborted
        with it instead, so that no peer waits for this rank. A store served from this
        process, even one the caller made, stays up until every rank has left: the process
        is its last user.
        """
        if failure is not None:
            self.abort(failure)
        pending = [op.ended for g in self.groups.values() for op in g._inflight]
        if pending and not self.closed:
            await asyncio.wait(pending, timeout=self.timeout)
        self.domain.hosting = self.domain.hosting or _hosts_server(self.store)
        await self.aclose(reason)

    async def aclose(self, reason: str = LEFT_REASON) -> None:
        """Fail what is still running, close the transport and the stores the world owns.

        The peers are told ``reason`` (it completes "rank N ...").
        """
        if self._leaving or self.closed:
            return
        self._leaving = True
        keeper = self._keeper
        if keeper is not None and keeper is not asyncio.current_task():
            keeper.cancel()
        if self._speaker is not None:
            self._speaker.cancel()
            await asyncio.gather(self._speaker, return_exceptions=True)
        groups = list(self.groups.values())
        # A call this rank rejected still takes its place on its path (a turn of a
        # workspace): let it, so that the peers hear why instead of that this rank left.
        owed = [t for g in groups for t in g.rejections_in_flight()]
        if owed and not self.closed:
            await asyncio.wait(owed, timeout=REJECTION_GRACE)
        cause = DistUsageError("the process group was destroyed while the operation ran")
        for group in groups:
            group._destroyed = True
            group.settle_inflight(cause)
        # The paths close before what still runs on them is cancelled: the peers then see
        # this rank leave in order, where an operation given up part-way would abort them.
        for group in groups:
            await group._close_paths()
        pending = [task for g in groups for task in g.cancel_inflight()]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        await self.transport.aclose(reason)
        await self.domain.aclose(reason)
        for store in self._owned:
            await store.aclose()


class ProcessGroup:
    """A set of ranks that run collectives together, and this rank's place in it.

    An async context manager: ``async with await aiodist.init_process_group(...) as pg:``
    destroys the group at the end (the default group: its whole world, as
    ``destroy_process_group()`` does).

    Attributes:
        rank: this process's rank within the group.
        size: the number of ranks in the group.
        ranks: the global rank of each group rank.
        group_id: the group's number, the same on every member (the default group is 0).
        backend: the backend's name (``"cpu"``, ``"cuda"``, or both as ``"cpu:...,cuda:..."``).
        backends: the backend serving each device kind, by device (``"cpu"``, ``"cuda"``).
        timeout: seconds one operation may run before it fails the group (``None``: no limit).
    """

    def __init__(
        self,
        world: World,
        ranks: Iterable[int],
        group_id: int,
        backend: str,
        backends: Mapping[str, Any],
        timeout: float | None,
    ) -> None:
        self._world = world
        self.ranks: tuple[int, ...] = tuple(ranks)
        self._group_rank_of = {g: i for i, g in enumerate(self.ranks)}
        self.rank = self._group_rank_of[world.rank]
        self.size = len(self.ranks)
        self.group_id = group_id
        self.backend = backend
        self.backends = backends
        self.timeout = timeout
        self._seq = 0
        # Collectives in flight, by each sequence number they hold.
        self._by_seq: dict[int, Operation] = {}
        # Every operation in flight, in issue order, with its deadline (group timeout).
        self._inflight: dict[Operation, float] = {}
        self._watchdog: asyncio.TimerHandle | None = None
        self._watchdog_at = math.inf
        # Operations past their deadline, while the ranks that entered them are counted.
        self._expiring: dict[Operation, asyncio.Task[None]] = {}
        self._destroyed = False
        self._order: asyncio.Lock | None = None
        #: What each backend keeps for this group, by backend name (:class:`DataPath`).
        self.paths: dict[str, DataPath] = {}
        #: The operations a backend of this group runs at once when it can (see
        #: :data:`~aiodist.group._work.Inline`), by name: small ones, whose cost is the
        #: issuing itself. A call it cannot run (any argument it does not expect, its path
        #: busy) is planned and started as any other.
        self.inline_ops: dict[str, Inline] = {}
        # When the first operation that ended inline since the loop last ran started (see
        # _start); None when none did.
        self._inline_since: float | None = None
        #: How many times the members voted to change this group (``shrink_group``): each
        #: vote has keys of its own.
        self.membership_votes = 0
        world.groups[group_id] = self

    def __repr__(self) -> str:
        extra = ""
        if self._destroyed:
            extra = " destroyed"
        elif self._world.broken is not None:
            extra = " aborted"
        return f"<ProcessGroup rank={self.rank}/{self.size} backend={self.backend}{extra}>"

    @property
    def world(self) -> World:
        """The world this group was made from."""
        return self._world

    async def __aenter__(self) -> ProcessGroup:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.destroy()

    @property
    def next_seq(self) -> int:
        """The sequence number the next collective on this group will get."""
        return self._seq

    @property
    def inflight(self) -> int:
        """The number of operations issued on this group that have not finished."""
        return len(self._inflight)

    @property
    def is_destroyed(self) -> bool:
        """Whether ``destroy_process_group`` has been called for this group."""
        return self._destroyed

    def is_aborted(self) -> bool:
        """Whether a failure aborted this group's world (see :meth:`wait_aborted`)."""
        return self._world.broken is not None

    def abort(self, reason: str | BaseException) -> None:
        """Abort this group's world on purpose: every rank's operations fail, naming ``reason``.

        The failure domain is the world (every group made from it), as for any real failure;
        ``destroy_process_group()`` and ``init_process_group()`` rebuild it.
        """
        cause = reason if isinstance(reason, BaseException) else DistError(str(reason))
        self._world.abort(cause)

    async def wait_aborted(self) -> BaseException | None:
        """Wait until this group's world is aborted; return the cause.

        Returns ``None`` if the world is destroyed first, without a failure. A health check
        of a server awaits this in a task of its own.
        """
        return await self._world.domain.wait_ended()

    def ordered(self) -> asyncio.Lock:
        """A lock to hold while issuing a sequence of collectives from one task.

        Operations of one group must be issued in the same order on every rank. Tasks that
        each issue several (a server's request handlers: a broadcast, then a gather) hold
        it across their sequence, so that no other task's operations come in between::

            async with pg.ordered():
                await aiodist.broadcast(x, src=0, group=pg)
                await aiodist.all_gather_into_tensor(out, y, group=pg)

        The tasks then take turns in the order they asked for it (first come, first served).
        """
        if self._order is None:
            self._order = asyncio.Lock()
        return self._order

    def inflight_op(self, seq: int) -> Operation | None:
        """Return the collective in flight that holds sequence number ``seq``, if any."""
        return self._by_seq.get(seq)

    def group_rank(self, global_rank: int, what: str = "rank") -> int:
        """Return the group rank of ``global_rank``.

        Raises:
            DistUsageError: ``global_rank`` is not a member of this group.
        """
        check_int(global_rank, what)
        try:
            return self._group_rank_of[global_rank]
        except KeyError:
            raise DistUsageError(
                f"{what} {global_rank} is not in the process group (global ranks "
                f"{list(self.ranks)})"
            ) from None

    def global_rank(self, group_rank: int, what: str = "group rank") -> int:
        """Return the global rank of ``group_rank``.

        Raises:
            DistUsageError: ``group_rank`` is outside ``0 .. size-1``.
        """
        check_int(group_rank, what)
        if not 0 <= group_rank < self.size:
            raise DistUsageError(
                f"{what} {group_rank} is out of range for a group of size {self.size}"
            )
        return self.ranks[group_rank]

    def root(
        self,
        global_rank: int | None,
        group_rank: int | None,
        names: tuple[str, str],
        default: int | None = 0,
    ) -> int | None:
        """Resolve a ``src``/``group_src`` pair to a group rank (``default`` when neither).

        Raises:
            DistUsageError: both given, or a rank outside the group.
        """
        if global_rank is not None and group_rank is not None:
            raise DistUsageError(f"pass either {names[0]} or {names[1]}, not both")
        if group_rank is not None:
            self.global_rank(group_rank, names[1])
            return group_rank
        if global_rank is not None:
            return self.group_rank(global_rank, names[0])
        return default

    def check_usable(self, op: str) -> None:
        """Raise at once if this group can no longer run operations.

        Raises:
            DistUsageError: the group was destroyed.
            DistError: an earlier failure aborted the group; the error has the class of
                that failure (``DistNetworkError``, ``DistTimeoutError``, ...) and names it.
        """
        if self._destroyed or self._world.closed:
            raise DistUsageError(f"{op}: the process group has been destroyed")
        cause = self._world.broken
        if cause is not None and self._world.domain.aborted:
            cls = type(cause) if isinstance(cause, DistError) else DistError
            raise cls(
                f"{op}: the process group is unusable after an earlier failure: "
                f"{type(cause).__name__}: {cause}"
            ) from cause

    # -- issuing -------------------------------------------------------------------------

    def issue(
        self,
        name: str,
        planner: Planner,
        args: tuple[Any, ...],
        nseq: int = 1,
        *,
        rejecter: Rejecter = rejected_on_transport,
        timeout: Timeout = None,
    ) -> Work[Any]:
        """Issue collective ``name``: reserve its sequence numbers, plan it and start it.

        ``planner(self, name, args)`` checks the arguments and returns the :class:`Plan`;
        if it raises, or a peer rejected this operation before this rank issued it,
        ``rejecter`` gives the plan that takes its place instead (see ``Rejecter``; by
        default the peers are told over the transport, for plans that keep no order).
        ``timeout`` is the operation's own deadline (default: the group's timeout).

        Raises:
            DistUsageError: the planner rejected the call (the peers are told), or the group
                was destroyed.
            DistError: the group was aborted earlier.
        """
        self.check_usable(name)
        inline = self.inline_ops.get(name)
        if inline is not None and timeout is None and not self._world.rejected:
            work = self._issue_inline(name, inline, args)
            if work is not None:
                return work
        op = Operation(self, name, OpKind.COLLECTIVE, self._seq, nseq=nseq)
        self._seq += nseq
        try:
            if timeout is not None:
                op.set_timeout(timeout)
            plan = planner(self, name, args)
        except Exception as exc:
            error = _named(name, exc) if isinstance(exc, DistUsageError) else exc
            for i in range(nseq):
                self._world.rejected.pop((self.group_id, op.seq + i), None)
            op.rejected = True
            self._start(op, rejecter(self, name, error, True))
            raise error  # noqa: B904 (the error is chained to exc already)
        rejected = self._world.rejected
        if rejected:
            for i in range(nseq):
                found = rejected.pop((self.group_id, op.seq + i), None)
                if found is not None:
                    # A peer rejected it before this rank issued it: it takes its place
                    # failing with the peer's reason (the peers know it already).
                    plan = rejecter(self, name, self._rejection(op, *found), False)
                    op.rejected = True
        return self._start(op, plan)

    def _issue_inline(self, name: str, inline: Inline, args: tuple[Any, ...]) -> Work[Any] | None:
        """Issue ``name`` run at once by ``inline`` (see :attr:`inline_ops`), or return
        ``None`` when it cannot run it (then nothing was issued)."""
        # As _start's inline end, within the loop's budget: a program that never waits for
        # an operation still lets the loop run (the general path then makes a task).
        standing_in = threading.get_ident() != self._world.loop_thread
        since, now = self._inline_since, time.perf_counter()
        if not (standing_in or since is None or now - since < EAGER_SECONDS):
            return None
        try:
            ran = inline(args)
        except Exception as exc:  # (it took its place, then failed: the peers know it)
            ran = (None, NO_FINGERPRINT, Plan(handed_over, (raising(exc),)))
        if ran is None:
            return None
        output, fp, rest = ran
        op = Operation(self, name, OpKind.COLLECTIVE, self._seq)
        self._seq += 1
        if rest is not None:
            return self._start(op, rest)
        op.record = record = self._world.recorder.record(
            name, self.group_id, op.seq, fp, self.ranks
        )
        if _recorder.observer is not None:  # the metrics are on
            record.nbytes = payload_nbytes(args)
        op.settle(None, output)  # (never waiting to start: no start time of its own)
        self._world.transport.mailbox.end(self.group_id, op.seq)  # (its floor moves on)
        if not standing_in and since is None:
            self._inline_since = now
            asyncio.get_running_loop().call_soon(self._loop_ran)
        return Work(op)

    def issue_p2p(
        self,
        name: str,
        planner: Planner,
        args: tuple[Any, ...],
        *,
        peer: int | None,
        group_peer: int | None,
        tag: object,
        sends: bool,
        timeout: Timeout = None,
    ) -> Work[Any]:
        """Issue point-to-point ``name`` with ``peer`` (global) or ``group_peer`` and ``tag``.

        ``planner`` gets ``(peer as a group rank or None, *args)``; ``timeout`` is the
        operation's own deadline (default: the group's timeout).

        Raises:
            DistUsageError: a bad peer or tag, or the planner rejected the call (a rejected
                send is reported to its receiver).
            DistError: the group was aborted earlier.
        """
        self.check_usable(name)
        op, plan = self._prepare_p2p(name, planner, args, peer, group_peer, tag, sends, timeout)
        return self._start(op, plan)

    def issue_batch(
        self,
        entries: Sequence[tuple[str, Planner, tuple[Any, ...], int | None, int | None, object]],
    ) -> list[Work[Any]]:
        """Check every ``(name, planner, args, peer, group_peer, tag)`` entry, then start all.

        Nothing is started unless every entry passes its checks; the receivers of the
        batch's sends are then told it was rejected.

        Raises:
            DistUsageError: the first entry that failed its checks, by index.
        """
        self.check_usable("batch_isend_irecv")
        prepared: list[tuple[Operation, Plan]] = []
        first: BaseException | None = None
        for i, (name, planner, args, peer, group_peer, tag) in enumerate(entries):
            try:
                prepared.append(
                    self._prepare_p2p(name, planner, args, peer, group_peer, tag, name == "send")
                )
            except Exception as exc:
                if first is None:
                    first = DistUsageError(f"batch_isend_irecv: entry {i}: {exc}")
                    first.__cause__ = exc
        if first is not None:
            for op, _ in prepared:
                self._reject(op, DistUsageError(f"the batch was rejected: {first}"))
            raise first
        return [self._start(op, plan) for op, plan in prepared]

    def _prepare_p2p(
        self,
        name: str,
        planner: Planner,
        args: tuple[Any, ...],
        peer: int | None,
        group_peer: int | None,
        tag: object,
        sends: bool,
        timeout: Timeout = None,
    ) -> tuple[Operation, Plan]:
        try:
            target = self.root(
                peer, group_peer, ("dst", "group_dst") if sends else ("src", "group_src"), None
            )
            if target is None and sends:
                raise DistUsageError("a destination is required (dst or group_dst)")
            if target == self.rank:
                raise DistUsageError(
                    f"peer group rank {target} is this rank; a rank cannot {name} to or from itself"
                )
        except DistUsageError as exc:
            raise _named(name, exc) from exc
        if not isinstance(tag, int) or isinstance(tag, bool) or not 0 <= tag <= MAX_TAG:
            bad_tag = DistUsageError(f"{name}: tag must be an int in [0, 2**63), got {tag!r}")
            if sends:
                assert target is not None
                wire = self.group_id | P2P_GROUP_BIT
                self._world.transport.send_reject(self.ranks[target], wire, ANY_TAG, str(bad_tag))
            raise bad_tag
        op = Operation(self, name, OpKind.P2P, tag, peer=target, sends=sends)
        try:
            op.set_timeout(timeout)
            plan = planner(self, name, (target, *args))
        except Exception as exc:
            raise self._reject(op, exc)  # noqa: B904 (the error is chained to exc already)
        return op, plan

    def _reject(self, op: Operation, exc: BaseException) -> BaseException:
        """Reject point-to-point ``op``: a send's receiver is told why; return the caller's
        error."""
        error = _named(op.name, exc) if isinstance(exc, DistUsageError) else exc
        if op.sends and op.peer is not None:
            transport = self._world.transport
            transport.send_reject(self.ranks[op.peer], op.wire_group, op.seq, rejection_text(error))
        self._record(op, NO_FINGERPRINT)
        op.settle(error)
        return error

    def _rejection(self, op: Operation, peer: int, reason: str) -> DistError:
        """The error of ``op`` when ``peer`` rejected it: a usage error for a usage error of
        the peer's call, but a network error when a rank the operation needs left (the
        peer learned it first, and passes it on with the exception's name)."""
        kind, sep, what = reason.partition(": ")
        if sep and kind == DistNetworkError.__name__:
            return DistNetworkError(
                f"{op.name} ({op.label}) on {self!r}: rank {peer} reports {what}"
            )
        return DistUsageError(
            f"{op.name} ({op.label}) on {self!r} was rejected by rank {peer}: {reason}"
        )

    def _record(self, op: Operation, fingerprint: bytes) -> None:
        op.record = self._world.recorder.record(
            op.name, self.group_id, op.seq, fingerprint, self.ranks, p2p=op.kind is OpKind.P2P
        )

    def _start(self, op: Operation, plan: Plan) -> Work[Any]:
        # The path every operation takes: kept free of work it does not need.
        loop = asyncio.get_running_loop()
        transport, gid, seq, fp = self._world.transport, op.wire_group, op.seq, plan.fingerprint
        comms = [OpComm(transport, self.ranks, self.rank, gid, seq)]
        if op.kind is OpKind.COLLECTIVE:
            mailbox = transport.mailbox
            mailbox.begin(gid, seq, fp)
            self._by_seq[seq] = op
            for i in range(1, op.nseq):
                comms.append(OpComm(transport, self.ranks, self.rank, gid, seq + i))
                mailbox.begin(gid, seq + i, fp)
                self._by_seq[seq + i] = op
        op.record = record = self._world.recorder.record(
            op.name, self.group_id, seq, fp, self.ranks, op.kind is OpKind.P2P
        )
        if _recorder.observer is not None:  # the metrics are on
            record.nbytes = payload_nbytes(plan.args)
        op.device_sync = plan.device_sync
        op.waiting_for = plan.waiting_for
        # Called now, in issue order: a path that keeps an order takes the operation's
        # place in it here, whenever its data will move.
        started = plan.algorithm(*comms, *plan.args)
        coro = self._run(op, started, plan.output)
        # (A thread standing in for the loop's holds up no task of the loop: no budget.)
        standing_in = threading.get_ident() != self._world.loop_thread
        since, now = self._inline_since, time.perf_counter()
        if standing_in or since is None or now - since < EAGER_SECONDS:
            # Run it here, up to where it would wait: an operation whose data can move at
            # once (its peers' messages are in, its turn in the workspace is free) ends
            # without a task or a turn of the loop, and its work is born done.
            try:
                yielded = coro.send(None)
            except StopIteration:
                if not standing_in and since is None:
                    self._inline_since = now
                    loop.call_soon(self._loop_ran)
                self._finished(op)
                return Work(op)
            except BaseException:  # (_run keeps every Exception; KeyboardInterrupt and such)
                self._finished(op)
                raise
            task = loop.create_task(_resume(coro, yielded))
        else:
            task = loop.create_task(coro)
        if op.timeout is None:
            self._inflight[op] = math.inf
        else:
            # One timer per group, armed for the earliest deadline, instead of a timer per
            # operation.
            self._inflight[op] = deadline = loop.time() + op.timeout
            if deadline < self._watchdog_at:
                if self._watchdog is not None:
                    self._watchdog.cancel()
                self._watchdog = loop.call_at(deadline, self._check_deadlines)
                self._watchdog_at = deadline
        task.add_done_callback(functools.partial(self._finished, op, started))
        op.task = task
        return Work(op)

    def _loop_ran(self) -> None:
        # Other tasks had their turn since the last operation ended inline.
        self._inline_since = None

    async def _run(self, op: Operation, started: Awaitable[Any], output: Any) -> None:
        if op.record is not None:
            op.record.start()
        try:
            result = await started
        except asyncio.CancelledError:
            # Only close(), _fail() and _fail_rejected() cancel operations, and they set
            # the outcome first.
            op.settle(DistUsageError(f"{op.name} was cancelled"))
            raise
        except Exception as exc:
            if isinstance(exc, ResultError):
                op.settle(exc)  # (only this rank's result failed: nothing is broken)
            elif only_this_operation(exc) or (
                op.kind is OpKind.P2P and isinstance(exc, DistUsageError)
            ):
                # A rejection, a mismatch every rank found alike, a member that left in
                # order, as every rank of the operation learns it; or a receive whose sender
                # rejected its send, or whose message had another size (point-to-point
                # messages keep no order across the group): only this operation fails.
                peer = getattr(exc, "rejected_by", None)
                if peer is not None:  # a data path's word for a peer's rejection
                    exc = self._rejection(op, peer, getattr(exc, "reason", ""))
                op.settle(exc)
            elif departure_of(exc) is Departure.LEFT:
                await self._rejected_meanwhile(op)
                if not op.ended.done():
                    self._fail_alone(op, exc)
            elif peer_gave_up(exc) and op not in self._expiring:
                # A member withdrew or refused a message of it, most often because a third
                # member's rejection reached it first: that word is the cause.
                await self._rejected_meanwhile(op)
                self._fail(op, exc)
            elif departure_of(exc) is Departure.GONE and op not in self._expiring:
                # Gone without a word: dead, or aborted in the middle of a message to this
                # rank. The store says which (and why it aborted) within moments.
                self._fail(op, await self._world.domain.why_gone(exc))
            elif op not in self._expiring:
                # (An operation that timed out here already fails with the timeout, not
                # with the abort of a rank that timed out a moment earlier.)
                self._fail(op, exc)
        else:
            op.settle(None, output if result is None else result)

    def _finished(self, op: Operation, started: object = None, _task: object = None) -> None:
        if started is not None and isinstance(started, Coroutine):
            # A task cancelled before its first step never awaited it (a group destroyed
            # at once): closed, it is not reported as never awaited.
            started.close()
        self._inflight.pop(op, None)
        op.task = None  # (ended: nothing to cancel, and no cycle through the task)
        if op.kind is OpKind.COLLECTIVE:
            mailbox = self._world.transport.mailbox
            for i in range(op.nseq):
                mailbox.end(self.group_id, op.seq + i)
                self._by_seq.pop(op.seq + i, None)
        if not op.ended.done() and op not in self._expiring:
            # (An expiring operation is settled with its timeout.)
            op.settle(DistError(f"{op.name} ({op.label}) ended without a result"))

    # -- failing ---------------------------------------------------------------------------

    def wait_expired(self, op: Operation, seconds: float) -> None:
        """Fail ``op`` because a caller's ``work.wait(seconds)`` gave up on it (as gloo does:
        its peers are left part-way through it, so the world is aborted)."""
        self._fail(op, self._timeout_error(op, "wait", seconds, None))

    def _fail(self, op: Operation, exc: BaseException) -> None:
        """Fail ``op`` with a real failure: the world is aborted, every rank is told."""
        if op.ended.done():
            return
        if not isinstance(exc, DistError):
            wrapped = DistError(f"{op.name} ({op.label}) failed: {type(exc).__name__}: {exc}")
            wrapped.__cause__ = exc
            exc = wrapped
        if isinstance(exc, DistTimeoutError):
            self._world.recorder.dump_on_timeout()  # the operation as it timed out
        op.settle(exc)
        self._world.abort(exc)
        self._cancel_task(op)

    async def _rejected_meanwhile(self, op: Operation) -> None:
        """Give a rejection of ``op`` a moment to arrive (:data:`REJECTION_WAIT`), a member
        it needs having left in order, or withdrawn or refused a message of it: that member
        may have given up its part because another member rejected the operation, whose
        word, the real cause, can still be on its way here over another connection, or
        unread, as the goodbye, the withdrawal or the refusal is read. The rejection settles
        ``op`` (and cancels its task: see :meth:`World.on_reject`)."""
        if op in self._inflight:
            self._inflight[op] = math.inf  # (failing already: no timeout of its own)
        await asyncio.wait([op.ended], timeout=REJECTION_WAIT)

    def _fail_alone(self, op: Operation, exc: BaseException) -> None:
        """Fail ``op`` because a rank it needs left in order, which breaks nothing else.

        The members it exchanges data with hear why, as for a rejection, so that none of
        them waits for this rank's part.
        """
        if op.kind is OpKind.COLLECTIVE:
            transport = self._world.transport
            reason = rejection_text(exc)
            for i in range(op.nseq):
                OpComm(transport, self.ranks, self.rank, self.group_id, op.seq + i).reject(reason)
        op.settle(exc)

    def _fail_rejected(self, op: Operation, exc: DistError) -> None:
        """Fail ``op`` because a peer rejected it: only this operation ends."""
        op.settle(exc)
        self._cancel_task(op)

    def _cancel_task(self, op: Operation) -> None:
        task = op.task
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    def _check_deadlines(self) -> None:
        self._watchdog, self._watchdog_at = None, math.inf
        loop = asyncio.get_running_loop()
        now = loop.time()
        soonest = math.inf
        for op, deadline in list(self._inflight.items()):
            if op in self._expiring:
                continue
            if deadline <= now:
                self._expiring[op] = loop.create_task(self._expire(op))
            else:
                soonest = min(soonest, deadline)
        if soonest < math.inf:
            self._watchdog = loop.call_at(soonest, self._check_deadlines)
            self._watchdog_at = soonest

    async def _expire(self, op: Operation) -> None:
        try:
            missing = None
            if op.kind is OpKind.COLLECTIVE:
                missing = await self._world.domain.missing(
                    _arrival_key(op), self.rank, list(range(self.size))
                )
            assert op.timeout is not None  # only operations with a deadline expire
            kind = "call's" if op.own_timeout else "group"
            self._fail(op, self._timeout_error(op, kind, op.timeout, missing))
        finally:
            self._expiring.pop(op, None)

    def _timeout_error(
        self, op: Operation, kind: str, seconds: float, missing: list[int] | None
    ) -> DistTimeoutError:
        """Build the error of ``op`` timing out: op, sequence number, ranks, time waited."""
        text = (
            f"{op.name} ({op.label}) on {self!r} did not complete within the {kind} "
            f"timeout of {seconds:g} s"
        )
        if missing is not None:
            text += f"; ranks that did not arrive: {missing or 'none'}"
        waiting = self.waiting_on(op)
        if waiting:
            text += f"; still waiting for messages from ranks {waiting}"
        return DistTimeoutError(text)

    async def waits_for(self, op: Operation, within: float) -> str:
        """Say for whom ``op``, which has run long, waits: the members that have not
        recorded their arrival (collectives, see ``World._speak_while_slow``; asking
        the store for up to ``within`` seconds), and those whose messages it lacks."""
        text = ""
        if op.kind is OpKind.COLLECTIVE:
            try:
                async with asyncio.timeout(within):
                    seen = await self._world.domain.arrived(_arrival_key(op))
            except (DistError, TimeoutError):
                seen = None
            if seen is not None:
                absent = [r for r in range(self.size) if r not in seen]
                text = (
                    f"group ranks {absent} have not called it (or only just)"
                    if absent
                    else "every group rank has called it"
                )
        waiting = self.waiting_on(op)
        if waiting:
            text += ("; " if text else "") + f"waiting for messages from group ranks {waiting}"
        return text or "waiting for the other ranks"

    def waiting_on(self, op: Operation) -> list[int]:
        """The group ranks whose part ``op`` still waits for (its data path says, or the
        transport: the peers whose messages it has not received)."""
        if op.waiting_for is not None:
            return op.waiting_for()
        return [
            self._group_rank_of[p]
            for p in self._world.transport.waiting_for(op.wire_group, op.seq)
            if p in self._group_rank_of
        ]

    async def destroy(self) -> None:
        """Destroy this group: later operations on it raise at once.

        Operations still running fail; since their peers may be waiting for them, the
        world is then aborted too. The default group takes its world with it (every group
        of it, the connections, the stores the world made) and stops being the default.
        """
        world = self._world
        if self is world.default_group:
            if peek_world() is world:
                set_current_world(None)
            # A store served from this process, even one the caller made, stays up until
            # every rank has left: the caller may drop it (or stop the loop) next.
            world.domain.hosting = world.domain.hosting or _hosts_server(world.store)
            await world.aclose()
            return
        if self._destroyed:
            return
        self._destroyed = True
        cause = DistUsageError(f"{self!r} was destroyed while the operation ran")
        tasks = self.fail_inflight(cause)
        if tasks:
            self._world.abort(cause)
            await asyncio.gather(*tasks, return_exceptions=True)
        await self._close_paths()
        self._world.groups.pop(self.group_id, None)

    async def _close_paths(self) -> None:
        for name, path in list(self.paths.items()):
            try:
                await path.aclose()
            except DistError as exc:
                logger.warning("%r: closing its %s data path: %s", self, name, exc)
        self.paths.clear()

    async def drain(self) -> None:
        """Wait until the operations in flight have ended (each by its deadline at the latest)."""
        pending = [op.ended for op in self._inflight]
        if pending:
            await asyncio.wait(pending)

    def fail_inflight(self, cause: BaseException) -> list[asyncio.Task[None]]:
        """Fail the operations in flight on this rank with ``cause`` at once; return the tasks
        to await for them to have stopped. Their peers are not told."""
        self.settle_inflight(cause)
        return self.cancel_inflight()

    def settle_inflight(self, cause: BaseException) -> None:
        """Fail the works of the operations in flight with ``cause`` (their tasks run on)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog, self._watchdog_at = None, math.inf
        for op in [*self._expiring, *self._inflight]:
            op.settle(cause)

    def cancel_inflight(self) -> list[asyncio.Task[None]]:
        """Cancel the tasks of the operations in flight; return them to await."""
        tasks = list(self._expiring.values())
        for expiring in tasks:
            expiring.cancel()
        for op in list(self._inflight):
            if op.task is not None and not op.task.done():
                op.task.cancel()
                tasks.append(op.task)
        return tasks

    def rejections_in_flight(self) -> list[asyncio.Task[None]]:
        """The tasks of the operations rejected here whose places on the path are still to
        be taken."""
        return [
            op.task
            for op in self._inflight
            if op.rejected and op.task is not None and not op.task.done()
        ]


async def _resume(coro: Coroutine[Any, Any, None], yielded: Any) -> None:
    """Run the rest of ``coro``, started inline and now waiting on ``yielded`` (what a
    coroutine hands its task: a future, or ``None`` to let the loop run once).

    This task stands in for the one ``coro`` would have had: a cancellation reaches ``coro``
    as it would have (through the future it waits on, else thrown in).
    """
    while True:
        cancelled: BaseException | None = None
        try:
            if yielded is None:
                await asyncio.sleep(0)
            else:
                release_yielded(yielded)
                await yielded
        except asyncio.CancelledError as exc:
            if yielded is None or not yielded.cancelled():
                cancelled = exc
        except BaseException:
            pass  # ``coro`` reads its future's outcome itself as it resumes
        try:
            yielded = coro.send(None) if cancelled is None else coro.throw(cancelled)
        except StopIteration:
            return


def _arrival_key(op: Operation) -> str:
    """Where the ranks of a collective that runs long record their arrival (see
    ``FailureDomain.arrive``)."""
    return f"{op.group.group_id}/{op.seq}"


def _hosts_server(store: Store) -> bool:
    """Whether ``store`` (under its prefixes) is served from this process: then this rank
    is its last user and keeps it up until every rank has left."""
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return getattr(store, "server", None) is not None


def _named(op: str, exc: BaseException) -> DistUsageError:
    """``exc`` as a usage error whose message starts with the operation's name."""
    text = str(exc)
    if isinstance(exc, DistUsageError) and text.startswith(f"{op}:"):
        return exc
    error = DistUsageError(f"{op}: {text}")
    error.__cause__ = exc
    return error


def check_int(value: object, what: str) -> None:
    """Raise ``DistUsageError`` naming ``what`` unless ``value`` is an int (not a bool)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise DistUsageError(f"{what} must be an int, got {type(value).__name__}")


def not_in_group(op: str, result: Any = None, stacklevel: int = 3) -> Work[Any]:
    """What a call on a group this rank is not a member of gets, as in torch.

    torch warns and returns without doing anything (the group's members are not
    affected); here the warning is the same, pointing ``stacklevel`` frames up (the
    caller's caller by default), and the result a :class:`Work` that is done with
    ``result`` (``-1`` for a receive, torch's "no sender").
    """
    warn_not_in_group(op, stacklevel + 1)
    return Work.not_issued(op, result)


def resolve_group(group: ProcessGroup | NonGroupMember | None, op: str) -> ProcessGroup:
    """Return ``group``, or the default group for ``None``.

    Raises:
        DistUsageError: not initialized, a non-member sentinel, or not a process group.
    """
    if group is None:
        return current_world(op).default_group
    if isinstance(group, ProcessGroup):
        return group
    if isinstance(group, NonGroupMember):
        raise DistUsageError(
            f"{op}: this rank is not a member of the group (new_group returned "
            "NON_GROUP_MEMBER here)"
        )
    raise DistUsageError(f"{op}: group must be a ProcessGroup or None, got {group!r}")


def start_world(
    transport: Transport,
    store: Store,
    *,
    backend: str,
    backends: Mapping[str, Any],
    timeout: Timeout = None,
    owned: Sequence[Store] = (),
    membership: Membership | None = None,
) -> ProcessGroup:
    """Build a world over a connected ``transport`` and make it the default seen here.

    This is the layer below ``init_process_group``: tests and embedders can hand it any
    :class:`~aiodist.transport.base.Transport` (for instance the in-process one), and
    ``membership`` if its members can change (see :class:`Membership`).

    Returns:
        The default process group.

    Raises:
        DistUsageError: a default world is already initialized here, or bad arguments.
    """
    if peek_world() is not None:
        raise DistUsageError(TWICE)
    world = World(
        transport,
        store,
        backend=backend,
        backends=backends,
        timeout=to_seconds(timeout, DEFAULT_PG_TIMEOUT),
        owned=owned,
        membership=membership,
    )
    with contextlib.suppress(RuntimeError):  # no running loop: nothing to watch with
        world.start()
    set_current_world(world)
    return world.default_group
