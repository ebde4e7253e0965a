"""Process groups, work handles, sequence numbers, subgroups and the default group.

A *world* is what ``init_process_group`` builds: one transport between all ranks, the store
it was bootstrapped through, and the process groups made from it (the default group covers
every rank; :func:`new_group` adds subgroups). The world of the running code is held in a
:class:`contextvars.ContextVar`, so several ranks can live as tasks of one event loop and each
sees its own.

A :class:`ProcessGroup` turns each call into a :class:`Work` at once: it assigns the group's
next sequence number, binds it into an :class:`~aiodist.transport.base.OpComm` (so the
messages of concurrent operations never mix), and runs the operation as a task. Any failure of
an operation aborts the whole world: the transport drops its connections so the peers' pending
receives fail within moments, and every later call raises at once, naming the cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
from collections.abc import Callable, Coroutine, Generator, Iterable, Sequence
from typing import Any, Generic, TypeVar

from ._fingerprint import NO_FINGERPRINT
from ._timeouts import Timeout, to_seconds
from .debug import FlightRecorder, OpRecord
from .errors import DistError, DistNetworkError, DistTimeoutError, DistUsageError
from .store import Store
from .transport.base import OpComm, Transport

__all__ = [
    "DEFAULT_PG_TIMEOUT",
    "NON_GROUP_MEMBER",
    "P2P_GROUP_BIT",
    "NonGroupMember",
    "ProcessGroup",
    "Work",
    "World",
    "current_world",
    "new_group",
    "new_subgroups",
    "parse_backend",
    "peek_world",
    "resolve_group",
    "set_current_world",
    "start_world",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: torch's default for CPU process groups: thirty minutes per operation.
DEFAULT_PG_TIMEOUT = 1800.0

#: Seconds a rank waits for the store to say why a peer aborted (and to record its own
#: reason). Only failures pay it, and only when the peer vanished without a reason.
ABORT_REASON_WAIT = 1.0
_ABORT_KEY = "abort"

#: Seconds a rank whose operation lost a peer waits for that peer's reason. A rank that
#: aborts records it before dropping its connections, so it is normally there already; a
#: peer that died without one (SIGKILL) costs this much before the loss is reported.
REASON_READ_WAIT = 0.25

#: Seconds a rank whose operation timed out waits for the other ranks to record that they
#: entered it too (``arrived/<group>/<seq>/<rank>``), to name those that did not.
ARRIVAL_GRACE = 1.0

#: Each rank watches the abort key with a server-side wait renewed this often: a rank that
#: aborts wakes every other rank at once, whether or not they have a connection to it.
_WATCH_PERIOD = 3600.0

#: Point-to-point messages of group ``g`` travel under group id ``g | P2P_GROUP_BIT`` with
#: the user's tag as sequence number, so they never meet a collective's messages.
P2P_GROUP_BIT = 1 << 31

_KNOWN_BACKENDS = ("cpu", "gloo", "cuda", "nccl")


def parse_backend(backend: str | None) -> str:
    """Return the canonical backend name (``"cpu"``) for what the caller asked for.

    ``None``, ``"cpu"`` and ``"gloo"`` mean the CPU backend; torch's per-device form
    ``"cpu:gloo,cuda:nccl"`` is accepted (its CUDA half is not available in this build, so
    only the CPU backend runs).

    Raises:
        DistUsageError: the backend is unknown, or only CUDA was asked for.
    """
    if backend is None:
        return "cpu"
    if not isinstance(backend, str):
        raise DistUsageError(f"backend must be a string or None, got {type(backend).__name__}")
    name = backend.strip().lower()
    parts = [p.strip() for p in name.split(",")] if ":" in name else [name]
    chosen: list[str] = []
    for part in parts:
        device, _, impl = part.rpartition(":")
        if impl not in _KNOWN_BACKENDS or device not in ("", "cpu", "cuda"):
            raise DistUsageError(
                f"unknown backend {backend!r}: expected 'cpu' (alias 'gloo'), 'cuda' (alias "
                "'nccl') or a per-device form such as 'cpu:gloo,cuda:nccl'"
            )
        kind = "cpu" if impl in ("cpu", "gloo") else "cuda"
        if device and device != kind:
            raise DistUsageError(f"backend {backend!r}: {impl!r} cannot serve {device!r} arrays")
        chosen.append(kind)
    if "cpu" not in chosen:
        raise DistUsageError(
            f"backend {backend!r}: the CUDA backend is not available in this build of "
            "aiodist; use backend='cpu' (alias 'gloo') for numpy arrays"
        )
    return "cpu"


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


class Work(Generic[T]):
    """The handle of one operation, returned as soon as the operation is issued.

    Await it (``await work``) or call ``await work.wait(timeout)`` to get the operation's
    result; both can be done any number of times. The operation runs as a task on the event
    loop whether or not anyone awaits it.

    The result is the output the operation wrote (the array or list passed in, or the object
    list), the sender's rank for a receive, and ``None`` for a barrier or a send.
    """

    __slots__ = ("_future", "_group", "_record", "_task", "label", "op", "seq")

    def __init__(self, op: str, seq: int, group: ProcessGroup, *, p2p: bool = False) -> None:
        #: The operation's name, e.g. ``"all_reduce"``.
        self.op = op
        #: The group sequence number (or the tag, for point-to-point operations).
        self.seq = seq
        #: ``"seq N"`` or, for point-to-point operations, ``"tag N"``; used in messages.
        self.label = f"{'tag' if p2p else 'seq'} {seq}"
        self._group = group
        self._future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._task: asyncio.Task[None] | None = None
        self._record: OpRecord | None = None

    def __repr__(self) -> str:
        if not self._future.done():
            state = "pending"
        elif self._future.exception() is not None:
            state = f"failed ({type(self._future.exception()).__name__})"
        else:
            state = "completed"
        key = self.label.replace(" ", "=")
        return f"<Work {self.op} {key} group={self._group.group_id} {state}>"

    def __await__(self) -> Generator[Any, None, T]:
        return self.wait().__await__()

    async def wait(self, timeout: Timeout = None) -> T:
        """Wait for the operation to finish and return its result.

        Args:
            timeout: seconds (or ``timedelta``) to wait; ``None`` or ``0`` (torch's "no
                timeout") waits until the group's own timeout ends the operation.

        Returns:
            The operation's result (see the class docstring).

        Raises:
            DistTimeoutError: ``timeout`` passed first. As in torch's gloo backend, this
                fails the operation and aborts the process group, because the peers are
                left part-way through it.
            DistError: the operation failed (the same exception on every call).
        """
        if self._future.done():
            return self._future.result()
        seconds = to_seconds(timeout, None)
        if not seconds:
            await _join(self._future)
        else:
            # asyncio.wait never cancels what it waits on, so cancelling the caller leaves
            # the operation running.
            await asyncio.wait([self._future], timeout=seconds)
            if not self._future.done():
                self._group._fail(self, self._group._timeout_error(self, "wait", seconds, None))
        return self._future.result()

    def is_completed(self) -> bool:
        """Return whether the operation has finished, successfully or not."""
        return self._future.done()

    def is_success(self) -> bool:
        """Return whether the operation has finished without an error."""
        return self._future.done() and self._future.exception() is None

    def exception(self) -> BaseException | None:
        """Return the operation's exception, or ``None`` if it succeeded or is still running."""
        return self._future.exception() if self._future.done() else None

    def result(self) -> T:
        """Return the result of a finished operation without waiting.

        Raises:
            DistUsageError: the operation has not finished yet.
            DistError: the operation failed.
        """
        if not self._future.done():
            raise DistUsageError(f"{self!r} has not completed yet; await it first")
        return self._future.result()


async def _join(future: asyncio.Future[Any]) -> None:
    """Wait for ``future`` without cancelling it if the waiting task is cancelled."""
    waiter = future.get_loop().create_future()

    def wake(_: asyncio.Future[Any]) -> None:
        if not waiter.done():
            waiter.set_result(None)

    future.add_done_callback(wake)
    try:
        await waiter
    finally:
        future.remove_done_callback(wake)


def _set_failed(future: asyncio.Future[Any], exc: BaseException) -> None:
    # Work that nobody awaits must not report "exception never retrieved": the failure is
    # kept in the work and in the world's state, so it is marked as retrieved here.
    future.set_exception(exc)
    future.exception()


class World:
    """What one ``init_process_group`` built: a transport, a store and their groups.

    Attributes:
        rank: this process's global rank.
        size: the number of ranks.
        store: the store the world was bootstrapped through (its keys namespaced).
        transport: the connections to the other ranks.
    """

    def __init__(
        self,
        transport: Transport,
        store: Store,
        *,
        backend: str,
        timeout: float | None,
        owned: Sequence[Store] = (),
    ) -> None:
        self.rank = transport.rank
        self.size = transport.world_size
        self.transport = transport
        self.store = store
        self.backend = backend
        self.timeout = timeout
        self._owned = list(owned)
        self._next_group_id = 1
        self.groups: list[ProcessGroup] = []
        self.broken: BaseException | None = None
        self.closed = False
        #: The last operations of this rank (see :mod:`aiodist.debug`).
        self.recorder = FlightRecorder(self.rank, self.size)
        transport.set_mismatch_handler(self._on_mismatch)
        self._publishing: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self.default_group = ProcessGroup(self, range(self.size), 0, backend, timeout)

    def start_watching(self) -> None:
        """Start the task that aborts this world when another rank aborts or the store goes."""
        if self._watcher is None and self.size > 1:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        # A failure seen by one rank must reach every rank, including those with no
        # connection to the one that failed (rings connect neighbours only): every rank
        # parks a wait for the abort key on the store, which costs nothing until it fires.
        try:
            while True:
                try:
                    await self.store.wait([_ABORT_KEY], _WATCH_PERIOD)
                    break
                except DistTimeoutError:
                    continue
            reason = (await self.store.get(_ABORT_KEY)).decode(errors="replace")
        except DistNetworkError as exc:
            # Losing the store is a failure of the job too (the rank hosting it died, or
            # its server): every later rendezvous, group creation and abort needs it.
            if not self.closed:
                lost = DistNetworkError(f"rank {self.rank}: lost the store: {exc}")
                lost.__cause__ = exc
                self.abort(lost)
            return
        except DistError as exc:
            logger.warning("rank %d: watching the abort key failed: %s", self.rank, exc)
            return
        if not self.closed and not reason.startswith(f"rank {self.rank}:"):
            self.abort(DistNetworkError(f"the group was aborted by {reason}"))

    def __repr__(self) -> str:
        state = "closed" if self.closed else "broken" if self.broken else "open"
        return f"<World rank={self.rank}/{self.size} backend={self.backend} {state}>"

    def _on_mismatch(self, group_id: int, seq: int, exc: DistUsageError) -> None:
        # A peer called another collective than this rank under (group, seq): that
        # operation fails with the mismatch, and the world is aborted so nobody waits.
        for group in self.groups:
            if group.group_id == group_id:
                group._fail_seq(seq, exc)
                return
        self.abort(exc)

    def allocate_group_id(self) -> int:
        """Return the next group id; every rank allocates ids in the same order."""
        gid = self._next_group_id
        self._next_group_id += 1
        return gid

    def abort(self, cause: BaseException) -> None:
        """Make the world unusable because of ``cause`` and drop every connection."""
        if self.broken is not None or self.closed:
            return
        self.broken = cause
        logger.warning("rank %d: aborting the process group: %s", self.rank, cause)
        failure = DistNetworkError(
            f"rank {self.rank}: process group aborted: {type(cause).__name__}: {cause}"
        )
        failure.__cause__ = cause
        # The peers only see connections drop; the store tells them why (the first rank
        # to abort wins the key), and it wakes the ranks watching the key. The reason is
        # recorded *before* the connections drop (one store round trip, at most
        # ABORT_REASON_WAIT), so a peer that sees the drop finds it already there.
        reason = f"rank {self.rank}: {type(cause).__name__}: {cause}"
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no running loop: nobody to tell
            self.transport.abort(failure)
            return
        self._publishing = loop.create_task(self._publish(reason, failure))

    async def _publish(self, reason: str, failure: BaseException) -> None:
        try:
            async with asyncio.timeout(ABORT_REASON_WAIT):
                await self.store.compare_set(_ABORT_KEY, "", reason)
        except (DistError, TimeoutError) as exc:
            logger.debug("rank %d: could not record the abort reason: %s", self.rank, exc)
        finally:
            self.transport.abort(failure)

    async def abort_reason(self) -> str | None:
        """Return why another rank aborted the world, waiting briefly for it to be recorded."""
        try:
            async with asyncio.timeout(REASON_READ_WAIT):
                await self.store.wait([_ABORT_KEY], REASON_READ_WAIT)
                return (await self.store.get(_ABORT_KEY)).decode(errors="replace")
        except (DistError, TimeoutError):
            return None

    async def close(self) -> None:
        """Fail what is still running, close the transport and the stores the world owns."""
        if self.closed:
            return
        self.closed = True
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        cause = DistUsageError("the process group was destroyed while the operation ran")
        pending: list[asyncio.Task[None]] = []
        for group in self.groups:
            group._destroyed = True
            pending.extend(group._cancel_all(cause))
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        if self._publishing is not None:
            # The abort drops the connections once its reason is recorded.
            await asyncio.gather(self._publishing, return_exceptions=True)
        await self.transport.aclose()
        await self._leave()
        for store in self._owned:
            await store.aclose()

    async def _leave(self) -> None:
        # Peers look each other's addresses up in the store when they first talk, which can
        # be long after this rank is done; so a rank that hosts the store (rank 0 under
        # env:// or tcp://) keeps it up until every rank has left. A broken world skips the
        # wait: its peers are failing anyway.
        hosting = any(getattr(s, "server", None) is not None for s in self._owned)
        try:
            await self.store.set(f"left/{self.rank}", b"1")
            if hosting and self.broken is None:
                keys = [f"left/{r}" for r in range(self.size)]
                if not await self.store.check(keys):
                    logger.info("rank %d: keeping the store up until every rank left", self.rank)
                    await self.store.wait(keys, self.timeout)
        except DistError as exc:
            logger.warning("rank %d: leaving the store: %s", self.rank, exc)


class ProcessGroup:
    """A set of ranks that run collectives together, and this rank's place in it.

    Attributes:
        rank: this process's rank within the group.
        size: the number of ranks in the group.
        ranks: the global rank of each group rank.
        group_id: the group's number, the same on every member (the default group is 0).
        backend: the backend's canonical name (``"cpu"``).
        timeout: seconds one operation may run before it fails the group (``None``: no limit).
    """

    def __init__(
        self,
        world: World,
        ranks: Iterable[int],
        group_id: int,
        backend: str,
        timeout: float | None,
    ) -> None:
        self._world = world
        self.ranks: tuple[int, ...] = tuple(ranks)
        self._group_rank_of = {g: i for i, g in enumerate(self.ranks)}
        self.rank = self._group_rank_of[world.rank]
        self.size = len(self.ranks)
        self.group_id = group_id
        self.backend = backend
        self.timeout = timeout
        self._seq = 0
        # Operations in flight, in issue order, with their deadlines (group timeout).
        self._inflight: dict[Work[Any], float] = {}
        self._watchdog: asyncio.TimerHandle | None = None
        # Operations past their deadline, while the ranks that entered them are counted.
        self._expiring: dict[Work[Any], asyncio.Task[None]] = {}
        self._destroyed = False
        world.groups.append(self)

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

    def group_rank(self, global_rank: int, what: str = "rank") -> int:
        """Return the group rank of ``global_rank``.

        Raises:
            DistUsageError: ``global_rank`` is not a member of this group.
        """
        _check_int(global_rank, what)
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
        _check_int(group_rank, what)
        if not 0 <= group_rank < self.size:
            raise DistUsageError(
                f"{what} {group_rank} is out of range for a group of size {self.size}"
            )
        return self.ranks[group_rank]

    def check_usable(self, op: str) -> None:
        """Raise at once if this group can no longer run operations.

        Raises:
            DistUsageError: the group was destroyed.
            DistNetworkError: an earlier failure aborted the group (the cause is named).
        """
        if self._destroyed or self._world.closed:
            raise DistUsageError(f"{op}: the process group has been destroyed")
        cause = self._world.broken
        if cause is not None:
            raise DistNetworkError(
                f"{op}: the process group is unusable after an earlier failure: "
                f"{type(cause).__name__}: {cause}"
            ) from cause

    @contextlib.contextmanager
    def checking(self, op: str) -> Generator[None, None, None]:
        """Validate the arguments of ``op`` inside this block.

        A :class:`DistUsageError` raised in the block is re-raised and also aborts the group:
        the peers have entered the same operation and would otherwise wait for this rank.

        Raises:
            DistUsageError: from the block, or because the group is not usable.
            DistNetworkError: the group was aborted earlier.
        """
        self.check_usable(op)
        try:
            yield
        except DistUsageError as exc:
            self._world.abort(exc)
            raise

    def launch(
        self,
        op: str,
        body: Callable[..., Coroutine[Any, Any, T]],
        *,
        nseq: int = 1,
        fingerprint: bytes = NO_FINGERPRINT,
    ) -> Work[T]:
        """Start collective ``op`` as a task and return its :class:`Work`.

        ``body`` is called with ``nseq`` :class:`OpComm` objects, one per sequence number
        reserved for the operation (an object collective runs two algorithms in a row).
        ``fingerprint`` (see :mod:`aiodist._fingerprint`) travels with every message of the
        operation, so that a rank that called something else is told so.

        Raises:
            DistUsageError: the group was destroyed.
            DistNetworkError: the group was aborted earlier.
        """
        self.check_usable(op)
        first = self._seq
        self._seq += nseq
        comms = [
            OpComm(self._world.transport, self.ranks, self.rank, self.group_id, first + i)
            for i in range(nseq)
        ]
        work: Work[T] = Work(op, first, self)
        transport, gid = self._world.transport, self.group_id
        for i in range(nseq):
            transport.begin_op(gid, first + i, fingerprint)
        work._record = self._world.recorder.record(op, gid, first, fingerprint, self.ranks)
        return self._start(work, lambda: body(*comms), nseq)

    def launch_p2p(
        self, op: str, tag: int, body: Callable[[Transport, int], Coroutine[Any, Any, T]]
    ) -> Work[T]:
        """Start point-to-point ``op`` as a task; ``body`` gets the transport and wire tag group.

        Raises:
            DistUsageError: the group was destroyed.
            DistNetworkError: the group was aborted earlier.
        """
        self.check_usable(op)
        transport, gid = self._world.transport, self.group_id | P2P_GROUP_BIT
        work: Work[T] = Work(op, tag, self, p2p=True)
        work._record = self._world.recorder.record(
            op, self.group_id, tag, NO_FINGERPRINT, self.ranks, p2p=True
        )
        return self._start(work, lambda: body(transport, gid), 0)

    def _start(
        self, work: Work[T], make: Callable[[], Coroutine[Any, Any, T]], nseq: int
    ) -> Work[T]:
        loop = asyncio.get_running_loop()
        if self.timeout is None:
            self._inflight[work] = math.inf
        else:
            # One timer per group, armed for the oldest operation's deadline, instead of a
            # timer per operation: operations are issued and mostly finish in order.
            self._inflight[work] = deadline = loop.time() + self.timeout
            if self._watchdog is None:
                self._watchdog = loop.call_at(deadline, self._check_deadlines)
        # The coroutine is made inside the task: a task cancelled before its first step
        # (destroy right after issuing) then leaves no never-awaited coroutine behind.
        task = asyncio.get_running_loop().create_task(self._run(work, make))
        task.add_done_callback(lambda _: self._finished(work, nseq))
        work._task = task
        return work

    def _finished(self, work: Work[Any], nseq: int) -> None:
        self._inflight.pop(work, None)
        transport = self._world.transport
        for i in range(nseq):
            transport.end_op(self.group_id, work.seq + i)
        rec = work._record
        if rec is not None:
            fut = work._future
            rec.finish(fut.exception() if fut.done() else DistError("ended without a result"))

    def _fail_seq(self, seq: int, exc: DistUsageError) -> None:
        # The collective in flight that holds sequence number ``seq`` (an object collective
        # holds two) fails with ``exc``; the world is aborted either way.
        for work in reversed(list(self._inflight)):
            if not work.label.startswith("tag") and work.seq <= seq:
                self._fail(work, exc)
                return
        self._world.abort(exc)

    async def _run(self, work: Work[T], make: Callable[[], Coroutine[Any, Any, T]]) -> None:
        if work._record is not None:
            work._record.start()
        try:
            result = await make()
        except asyncio.CancelledError:
            # Only close() and _fail() cancel operations, and both set the outcome first.
            if not work._future.done():
                _set_failed(work._future, DistUsageError(f"{work.op} was cancelled"))
            raise
        except Exception as exc:
            if work in self._expiring:
                # Timed out here already: the timeout, not the abort of a rank that timed
                # out a moment earlier, is this operation's error.
                return
            broken = self._world.broken
            if isinstance(exc, DistNetworkError) and broken is None:
                # A peer went away: if it aborted on purpose, say why.
                reason = await self._world.abort_reason()
                if reason is not None and not reason.startswith(f"rank {self._world.rank}:"):
                    explained = DistNetworkError(f"{exc} (the group was aborted by {reason})")
                    explained.__cause__ = exc
                    exc = explained
            elif isinstance(exc, DistNetworkError) and str(broken) not in str(exc):
                # The group was aborted while this operation was losing a peer (the abort
                # drops the connections only once its reason is recorded): name the cause.
                explained = DistNetworkError(
                    f"{exc} (the group was aborted: {type(broken).__name__}: {broken})"
                )
                explained.__cause__ = exc
                exc = explained
            self._fail(work, exc)
        else:
            if not work._future.done():
                work._future.set_result(result)

    def _check_deadlines(self) -> None:
        self._watchdog = None
        now = asyncio.get_running_loop().time()
        for work, deadline in list(self._inflight.items()):
            if work in self._expiring:
                continue
            if deadline > now:
                self._watchdog = asyncio.get_running_loop().call_at(deadline, self._check_deadlines)
                return
            self._expiring[work] = asyncio.get_running_loop().create_task(self._expire(work))

    async def _expire(self, work: Work[Any]) -> None:
        try:
            missing = None if work.label.startswith("tag") else await self._not_arrived(work.seq)
            assert self.timeout is not None  # only operations with a deadline expire
            self._fail(work, self._timeout_error(work, "group", self.timeout, missing))
        finally:
            self._expiring.pop(work, None)

    async def _not_arrived(self, seq: int) -> list[int] | None:
        """Return the group ranks that did not record entering operation ``seq`` in time.

        Every rank whose operation times out records that it entered it, then waits up to
        :data:`ARRIVAL_GRACE` for the others (their deadlines pass at about the same time).
        ``None`` if the store cannot be reached.
        """
        loop = asyncio.get_running_loop()
        store, prefix = self._world.store, f"arrived/{self.group_id}/{seq}/"
        try:
            await store.set(f"{prefix}{self.rank}", b"1")
            pending = [r for r in range(self.size) if r != self.rank]
            end = loop.time() + ARRIVAL_GRACE
            while True:
                pending = [r for r in pending if not await store.check([f"{prefix}{r}"])]
                if not pending or loop.time() >= end:
                    return pending
                await asyncio.sleep(0.02)
        except DistError as exc:
            logger.warning("rank %d: could not count the ranks that arrived: %s", self.rank, exc)
            return None

    def _timeout_error(
        self, work: Work[Any], kind: str, seconds: float, missing: list[int] | None
    ) -> DistTimeoutError:
        """Build the error of ``work`` timing out: op, sequence number, ranks, time waited."""
        text = (
            f"{work.op} ({work.label}) on {self!r} did not complete within the {kind} "
            f"timeout of {seconds:g} s"
        )
        if missing is not None:
            text += f"; ranks that did not arrive: {missing or 'none'}"
        group = self.group_id | P2P_GROUP_BIT if work.label.startswith("tag") else self.group_id
        waiting = [
            self._group_rank_of[p]
            for p in self._world.transport.waiting_for(group, work.seq)
            if p in self._group_rank_of
        ]
        if waiting:
            text += f"; still waiting for messages from ranks {waiting}"
        return DistTimeoutError(text)

    def _fail(self, work: Work[Any], exc: BaseException) -> None:
        if work._future.done():
            return
        if not isinstance(exc, DistError):
            wrapped = DistError(f"{work.op} ({work.label}) failed: {type(exc).__name__}: {exc}")
            wrapped.__cause__ = exc
            exc = wrapped
        _set_failed(work._future, exc)
        if isinstance(exc, DistTimeoutError):
            self._world.recorder.dump_on_timeout()
        if work._record is not None:
            work._record.finish(exc)
        self._world.abort(exc)
        task = work._task
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def destroy(self) -> None:
        """Destroy this group: later operations on it raise at once.

        Operations still running fail; since their peers may be waiting for them, the
        world is then aborted too.
        """
        if self._destroyed:
            return
        self._destroyed = True
        cause = DistUsageError(f"{self!r} was destroyed while the operation ran")
        tasks = self._cancel_all(cause)
        if tasks:
            self._world.abort(cause)
            await asyncio.gather(*tasks, return_exceptions=True)
        if self in self._world.groups:
            self._world.groups.remove(self)

    def _cancel_all(self, cause: BaseException) -> list[asyncio.Task[None]]:
        tasks = []
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        for work, expiring in self._expiring.items():
            if not work._future.done():
                _set_failed(work._future, cause)
            expiring.cancel()
            tasks.append(expiring)
        for work in list(self._inflight):
            if not work._future.done():
                _set_failed(work._future, cause)
            if work._task is not None and not work._task.done():
                work._task.cancel()
                tasks.append(work._task)
        return tasks


def _check_int(value: object, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise DistUsageError(f"{what} must be an int, got {type(value).__name__}")


_current_world: contextvars.ContextVar[World | None] = contextvars.ContextVar(
    "aiodist_world", default=None
)


def current_world(op: str = "this operation") -> World:
    """Return the world set up by ``init_process_group`` in the current context.

    Raises:
        DistUsageError: the default process group is not initialized here.
    """
    world = _current_world.get()
    if world is None:
        raise DistUsageError(
            f"{op} needs the default process group: call "
            "`await aiodist.init_process_group(...)` first"
        )
    return world


def set_current_world(world: World | None) -> None:
    """Make ``world`` the current context's default world (``None`` clears it)."""
    _current_world.set(world)


def peek_world() -> World | None:
    """Return the current context's world, or ``None``."""
    return _current_world.get()


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
    backend: str | None = None,
    timeout: Timeout = None,
    owned: Sequence[Store] = (),
) -> ProcessGroup:
    """Build a world over a connected ``transport`` and make it the current context's default.

    This is the layer below ``init_process_group``: tests and embedders can hand it any
    :class:`~aiodist.transport.base.Transport` (for instance the in-process one).

    Returns:
        The default process group.

    Raises:
        DistUsageError: a world is already initialized in this context, or bad arguments.
    """
    if _current_world.get() is not None:
        raise DistUsageError("trying to initialize the default process group twice")
    world = World(
        transport,
        store,
        backend=parse_backend(backend),
        timeout=to_seconds(timeout, DEFAULT_PG_TIMEOUT),
        owned=owned,
    )
    with contextlib.suppress(RuntimeError):  # no running loop: nothing to watch with
        world.start_watching()
    _current_world.set(world)
    return world.default_group


async def new_group(
    ranks: Sequence[int] | None = None,
    timeout: Timeout = None,
    backend: str | None = None,
) -> ProcessGroup | NonGroupMember:
    """Create a process group of the given global ranks.

    Every rank of the default group must call ``new_group`` with the same arguments in the
    same order (members and non-members alike), so that the group gets the same id
    everywhere. Group ranks follow the sorted global ranks.

    Args:
        ranks: global ranks of the members; ``None`` means every rank.
        timeout: per-operation timeout of the new group; ``None`` inherits the default
            group's.
        backend: ``None`` inherits the default group's backend.

    Returns:
        The new group on members, :data:`NON_GROUP_MEMBER` on other ranks.

    Raises:
        DistUsageError: not initialized, an empty list, a duplicate or out-of-range rank,
            or an unknown backend.
    """
    world = current_world("new_group")
    world.default_group.check_usable("new_group")
    members = _check_ranks(ranks, world.size)
    name = world.backend if backend is None else parse_backend(backend)
    seconds = world.timeout if timeout is None else to_seconds(timeout, None)
    gid = world.allocate_group_id()
    # Ranks that called new_group in different orders or with different ranks would give
    # one id to different groups and mix their messages: the first rank to get here
    # records what group ``gid`` is, the others check it (one store round trip).
    mine = ",".join(map(str, members))
    try:
        agreed = (await world.store.compare_set(f"group/{gid}", "", mine)).decode()
    except DistError as exc:
        world.abort(exc)
        raise
    if agreed != mine:
        mismatch = DistUsageError(
            f"new_group: group {gid} is ranks [{agreed}] on another rank but ranks [{mine}] "
            "here; every rank must call new_group with the same ranks in the same order"
        )
        world.abort(mismatch)
        raise mismatch
    if world.rank not in members:
        return NON_GROUP_MEMBER
    return ProcessGroup(world, members, gid, name, seconds)


async def new_subgroups(
    group_size: int | None = None,
    group: ProcessGroup | None = None,
    timeout: Timeout = None,
    backend: str | None = None,
) -> tuple[ProcessGroup, list[ProcessGroup | NonGroupMember]]:
    """Split the ranks of ``group`` into consecutive subgroups of ``group_size`` ranks.

    Every rank of the default group must call it with the same arguments.

    Args:
        group_size: ranks per subgroup; ``None`` makes one subgroup per host, which in this
            build means a single subgroup of every rank of ``group``.
        group: the group to split (global ranks are taken from it); default the world.
        timeout: per-operation timeout of the subgroups.
        backend: backend of the subgroups; ``None`` inherits.

    Returns:
        ``(this rank's subgroup, every subgroup)``; entries of subgroups this rank is not in
        are :data:`NON_GROUP_MEMBER`.

    Raises:
        DistUsageError: ``group_size`` is not positive, or does not divide the group size,
            or this rank is not in ``group``.
    """
    parent = resolve_group(group, "new_subgroups")
    if group_size is None:
        group_size = parent.size
    _check_int(group_size, "group_size")
    if group_size <= 0 or parent.size % group_size:
        raise DistUsageError(
            f"new_subgroups: group_size {group_size} must be positive and divide the group "
            f"size {parent.size}"
        )
    mine: ProcessGroup | None = None
    groups: list[ProcessGroup | NonGroupMember] = []
    for start in range(0, parent.size, group_size):
        sub = await new_group(parent.ranks[start : start + group_size], timeout, backend)
        groups.append(sub)
        if isinstance(sub, ProcessGroup):
            mine = sub
    assert mine is not None  # this rank is in the parent group, so in one subgroup
    return mine, groups


def _check_ranks(ranks: Sequence[int] | None, world_size: int) -> list[int]:
    if ranks is None:
        return list(range(world_size))
    try:
        members = list(ranks)
    except TypeError:
        raise DistUsageError(
            f"ranks must be a sequence of global ranks, got {type(ranks).__name__}"
        ) from None
    if not members:
        raise DistUsageError("new_group: ranks must not be empty")
    for r in members:
        _check_int(r, "new_group: rank")
        if not 0 <= r < world_size:
            raise DistUsageError(
                f"new_group: rank {r} is out of range for a world of size {world_size}"
            )
    if len(set(members)) != len(members):
        raise DistUsageError(f"new_group: ranks {members} contain duplicates")
    return sorted(members)
