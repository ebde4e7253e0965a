"""The failure domain: the ranks of one ``init_process_group`` fail together.

A :class:`FailureDomain` holds what makes the ranks of a world fail together and leave
together, over the world's store:

* the **abort key**: the first rank to abort records why (``compare_set``, so the first
  cause wins); every rank keeps a server-side ``get`` of the key parked, so a rank with no
  connection to the one that failed learns at once, and learns the reason in the same
  answer. Every aborting rank also records what it aborted for under ``aborted/<rank>``
  (see :meth:`FailureDomain.why_gone`);
* **departures**: a rank whose connection to the store ends without a goodbye (its process
  exited without leaving, was killed, or its host became unreachable) has the server record
  it (a lease on ``departed``: the first under ``departed``, each later one under the next
  free ``departed/<n>``); every rank keeps a ``get`` of the next record parked, so it learns
  of every departure, from ranks it talks to or not. Every departure, a goodbye or a lease,
  is also a record in one key, ``departures``, so that who has left is one request however
  many ranks the world has (:meth:`FailureDomain.departures`);
* **store loss**: losing the store aborts the world (every later group creation, abort and
  rendezvous needs it; a rank hosting it keeps it up until the others have left);
* **arrivals**: when an operation times out, the ranks that entered it say so under one key,
  so the error can name the ranks that did not;
* **leaving**: a rank records why it left under ``left/<rank>`` (its lease writes there too
  if it goes without a goodbye); a rank that hosts the store keeps it up until every rank
  has left or gone, so that late address lookups and the abort reason stay readable. The
  last rank to leave sweeps the world's keys (``sweep``: a world whose store is a namespace
  made for it deletes that namespace), so that a store that outlives the world keeps
  nothing of it.

Two ways to break. :meth:`FailureDomain.abort` (a real failure: an operation that failed
part-way, a timeout, a mismatch, the store lost) drops the world's connections at once, and
every later operation fails. A departure (:meth:`FailureDomain.depart`: a rank gone without
a goodbye) only marks the world broken (``is_aborted()``, ``wait_aborted()``): operations go
on, since what the departed rank sent before it went still counts, and the first one that
needs it fails and aborts. A rank that leaves in order (``destroy_process_group``, or its
script ending) breaks nothing.

It knows nothing of operations or groups: the world above hands it a callback that drops
the connections when the domain aborts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable, Container
from typing import TypeVar

from .._util._speaking import speaking
from ..errors import DistError, DistNetworkError, DistTimeoutError
from ..store import Store
from ..transport.base import abort_text, peer_aborted_error

__all__ = [
    "ARRIVAL_GRACE",
    "LEAVE_WAIT",
    "FailureDomain",
    "departure_record",
    "read_departures",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_ABORT_KEY = "abort"
_DEPARTED_KEY = "departed"
#: The key that holds a record of every rank that left the world (see departure_record).
_DEPARTURES_KEY = "departures"
# The keys under which the ranks of timed-out operations recorded their arrival.
_ARRIVALS_KEY = "arrivals"
#: How a departure record (see _take_leases) starts: the rank it names.
_GONE = re.compile(r"rank (\d+) is gone")

#: Seconds an aborting rank waits for its reason to be recorded before closing the store.
ABORT_RECORD_WAIT = 1.0

#: Seconds a rank whose peer's connection ended without a word waits for the store to say
#: whether that peer went away or aborted (see FailureDomain.why_gone); and its first poll.
GONE_CHECK_WAIT = 0.5
_GONE_POLL = 0.002

#: Seconds a rank whose operation timed out waits for the other ranks to record that they
#: entered it too, to name those that did not.
ARRIVAL_GRACE = 1.0
_ARRIVAL_POLL = 0.02

#: Seconds a store-hosting rank of an aborted world keeps the store up for the others to
#: read the cause and leave.
BROKEN_LEAVE_WAIT = 2.0

#: Seconds a rank hosting the store waits for every rank to leave before it looks whether
#: the last of them swept the world's keys already (see FailureDomain._all_left).
_SWEPT_POLL = 0.5

#: Seconds a leaving rank waits for the store to record its goodbye: the store's host may
#: have left already, its process alive with its event loop stopped (a worker pool, a
#: notebook), and a store that never answers must not hold ``destroy_process_group``.
LEAVE_WAIT = 5.0

# The watch retries a store error that is not a lost connection after this many seconds,
# doubling up to the maximum.
_WATCH_RETRY, _WATCH_RETRY_MAX = 0.1, 5.0


class FailureDomain:
    """The abort key, its watch, the arrival records and leaving, for one world.

    Args:
        store: the world's store (namespaced for this world).
        rank: this rank.
        size: the number of ranks.
        on_abort: called once, on the loop, with the error later operations fail with, when
            this domain aborts; it drops the world's connections.
        on_gone: called with a rank, and the error for what still needs it, when the store
            says that rank went without a goodbye (its lease): the world's connections take
            what it sent, then fail what still needs it (a vanished host sends no FIN).
        hosting: whether this rank hosts the store (then it waits for every rank to leave).
        timeout: the world's operation timeout, also how long a host waits for the others
            to leave.
        sweep: what the last rank to leave does, once every rank has left or gone, to
            delete the world's keys (its namespace, where the store is one made for it);
            ``None``: it deletes the records of timed-out operations (:meth:`missing`), the
            only keys that grow while the world runs, and leaves the rest to the store's
            owner.

    Attributes:
        broken: the first cause this domain broke for (an abort or a departure), or ``None``.
        aborted: whether it was aborted (its connections dropped), not only broken.
        closed: whether :meth:`aclose` ran.
    """

    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        *,
        on_abort: Callable[[BaseException], None],
        on_gone: Callable[[int, BaseException], None],
        hosting: bool,
        timeout: float | None,
        sweep: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.store = store
        self.rank = rank
        self.size = size
        self._on_abort = on_abort
        self._on_gone = on_gone
        #: Whether this rank hosts the store (then it waits for every rank to leave).
        self.hosting = hosting
        self._timeout = timeout
        self._sweep = sweep
        self.broken: BaseException | None = None
        self.aborted = False
        self.closed = False
        # Set when the world is aborted or closed (a wait must end either way).
        self._ended = asyncio.Event()
        self._watchers: list[asyncio.Task[None]] = []
        self._leasing: asyncio.Task[None] | None = None
        self._recording: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        state = "closed" if self.closed else "broken" if self.broken else "healthy"
        return f"<FailureDomain rank={self.rank}/{self.size} {state}>"

    def start(self) -> None:
        """Start watching the abort and departure keys (needs a running loop; nothing to
        watch for one rank)."""
        if not self._watchers and self.size > 1:
            loop = asyncio.get_running_loop()
            self._leasing = loop.create_task(self._take_leases())
            self._watchers = [
                self._leasing,
                loop.create_task(self._watch(_ABORT_KEY)),
                loop.create_task(self._watch(_DEPARTED_KEY)),
            ]

    async def leased(self) -> None:
        """Wait until the store holds this rank's leases (see :meth:`start`).

        Until then, the store could not tell the others that this rank went away: a world
        is handed to its user only after, or a rank that vanishes at once (its host
        unplugged) may go unnoticed by a peer whose data to it is still unacknowledged.
        """
        if self._leasing is not None:
            await asyncio.shield(self._leasing)

    async def _take_leases(self) -> None:
        # If this rank's connection to the store ends without a goodbye (the process ended
        # without leaving, was killed, or its host can no longer be reached), the server
        # records it: the other ranks learn within moments, even those that never talked
        # to this one, and a rank hosting the store stops waiting for this one to leave.
        gone = (
            f"rank {self.rank} is gone: its connection to the store ended without a goodbye "
            "(its process exited without leaving the process group or was killed, or its "
            "host cannot be reached)"
        )
        try:
            # (Made at once, so that reading it never waits; see departures.)
            await self.store.append(_DEPARTURES_KEY, "")
            await self.store.lease(f"left/{self.rank}", gone)
            await self.store.lease(_DEPARTED_KEY, gone)
            await self.store.lease(_DEPARTURES_KEY, departure_record(self.rank, gone), append=True)
        except DistError as exc:
            logger.warning("rank %d: could not take a lease on the store: %s", self.rank, exc)

    async def _watch(self, key: str) -> None:
        # The abort key is read once (the first cause is the world's); departures are read
        # one record after the other (``departed``, then ``departed/1``, ...: see the store
        # server's leases), for as long as the world is open.
        slot, records = key, 0
        delay = _WATCH_RETRY
        while not self.closed:
            try:
                reason = (await self.store.get(slot)).decode(errors="replace")
            except DistTimeoutError:
                continue  # the store's own timeout: park the wait again
            except DistNetworkError as exc:
                # Losing the store is a failure of the job too (the rank hosting it died,
                # or its server). (Both watches see it: one reports it.)
                if not self.closed and key == _ABORT_KEY:
                    lost = DistNetworkError(f"rank {self.rank}: lost the store: {exc}")
                    lost.__cause__ = exc
                    self.abort(lost)
                return
            except DistError as exc:
                # Anything else is the store refusing one request: try again, so that
                # failures keep spreading to this rank.
                logger.warning("rank %d: watching %r: %s (retrying)", self.rank, key, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _WATCH_RETRY_MAX)
                continue
            delay = _WATCH_RETRY
            # (Both do nothing once closed.)
            if key == _DEPARTED_KEY:
                self._departed(reason)
                records += 1
                slot = f"{key}/{records}"
                continue
            if not reason.startswith(f"rank {self.rank}:"):
                aborted = DistNetworkError(f"the group was aborted by {reason}")
                aborted.origin = reason  # type: ignore[attr-defined]
                self.abort(aborted)
            return

    def _departed(self, record: str) -> None:
        # A departure the store recorded: the first breaks the world; each one fails what
        # still needs the rank it names (the first to fail aborts the world).
        gone = _GONE.match(record)
        if gone is not None and int(gone[1]) != self.rank and not self.closed:
            error = DistNetworkError(record)
            self.depart(error)
            self._on_gone(int(gone[1]), error)

    def depart(self, cause: BaseException) -> None:
        """Mark the world broken because a rank went away without a goodbye (``cause``).

        Operations go on (what the departed rank sent still reaches them); the first that
        needs the departed rank fails, which aborts the world. Does nothing once broken or
        closed.
        """
        if self.broken is not None or self.closed:
            return
        self.broken = cause
        self._ended.set()
        logger.warning("rank %d: %s", self.rank, cause)

    def abort(self, cause: BaseException) -> None:
        """Make the world unusable because of ``cause``; tell the other ranks why.

        The reason goes to the store (the first rank's wins) and, through ``on_abort``, to
        the connected peers as the transport drops its connections. Aborting twice, or
        after :meth:`aclose`, does nothing; a world broken by a departure is aborted now.
        """
        if self.aborted or self.closed:
            return
        self.aborted = True
        if self.broken is None:
            self.broken = cause
        self._ended.set()
        logger.warning("rank %d: aborting the process group: %s", self.rank, cause)
        failure = DistNetworkError(
            f"rank {self.rank}: process group aborted: {type(cause).__name__}: {cause}"
        )
        failure.__cause__ = cause
        # What the peers and the store are told: the failure that started it all (a cause
        # heard from another rank is passed on as it came, so it names the first failure).
        origin = getattr(cause, "origin", None) or f"rank {self.rank}: {abort_text(cause)}"
        failure.origin = origin  # type: ignore[attr-defined]
        with contextlib.suppress(RuntimeError):  # no running loop: nobody to tell
            self._recording = asyncio.get_running_loop().create_task(self._record(origin))
        self._on_abort(failure)

    async def _record(self, reason: str) -> None:
        try:
            async with asyncio.timeout(ABORT_RECORD_WAIT):
                await asyncio.gather(
                    self.store.set(f"aborted/{self.rank}", reason),
                    self.store.compare_set(_ABORT_KEY, "", reason),
                )
        except (DistError, TimeoutError) as exc:
            logger.debug("rank %d: could not record the abort reason: %s", self.rank, exc)

    async def why_gone(self, exc: BaseException) -> BaseException:
        """Return why the peer that ``exc`` lost went: ``exc`` if it went away, or the
        error of a peer that aborted, with its reason, if the store says it aborted.

        ``exc`` is a lost connection to a peer that ended without a goodbye or a reason. A
        rank that aborts in the middle of a message to this one cannot send its reason
        after it (it cannot follow part of a frame): it closes the connection, which looks
        the same as its death. The store tells them apart: an aborting rank records its
        reason (``aborted/<rank>``), and a dead one's lease writes ``left/<rank>``. This
        waits up to :data:`GONE_CHECK_WAIT` for either; a store that cannot answer leaves
        ``exc`` as it is.
        """
        peer: int | None = getattr(exc, "peer", None)
        if peer is None or peer == self.rank:
            return exc
        # (A task of its own, bounded by asyncio.wait: the operation that calls this may be
        # running inline, in its caller's task, which a timeout must not cancel.)
        asking = asyncio.get_running_loop().create_task(self._aborted_for(peer))
        await asyncio.wait([asking], timeout=GONE_CHECK_WAIT)
        if not asking.done():
            asking.cancel()
            return exc
        if isinstance(asking.exception(), DistError):
            return exc  # the store cannot answer
        why = asking.result()
        return exc if why is None else peer_aborted_error(peer, why)

    async def _aborted_for(self, peer: int) -> str | None:
        # What ``peer`` recorded it aborted for, or None once its lease says it went away.
        delay = _GONE_POLL
        while True:
            aborted, left = await asyncio.gather(
                self.store.check([f"aborted/{peer}"]), self.store.check([f"left/{peer}"])
            )
            if aborted:
                return (await self.store.get(f"aborted/{peer}")).decode(errors="replace")
            if left:
                return None
            await asyncio.sleep(delay)
            delay *= 2

    async def missing(self, prefix: str, me: int, ranks: list[int]) -> list[int] | None:
        """Record that rank ``me`` arrived at ``prefix``; return which of ``ranks`` did not.

        Every rank whose operation times out calls this at about the same time; each waits
        up to :data:`ARRIVAL_GRACE` for the others (one store request per poll). ``None``
        if the store cannot be reached.
        """
        loop = asyncio.get_running_loop()
        try:
            await self.arrive(prefix, me)
            end = loop.time() + ARRIVAL_GRACE
            while True:
                seen = await self.arrived(prefix)
                pending = [r for r in ranks if r not in seen]
                if not pending or loop.time() >= end:
                    return pending
                await asyncio.sleep(_ARRIVAL_POLL)
        except DistError as exc:
            logger.warning("rank %d: could not count the ranks that arrived: %s", self.rank, exc)
            return None

    async def arrive(self, prefix: str, me: int) -> None:
        """Record that rank ``me`` arrived at ``prefix`` (an operation that runs long).

        Raises:
            DistError: the store cannot be reached.
        """
        key = f"arrived/{prefix}"
        await self.store.append(key, f"{me},")
        # Listed for the last rank to leave the world, which deletes them (unless it sweeps
        # the world's whole namespace).
        await self.store.append(_ARRIVALS_KEY, f"{key};")

    async def arrived(self, prefix: str) -> set[int]:
        """The ranks that recorded their arrival at ``prefix`` so far (see :meth:`arrive`).

        Raises:
            DistError: the store cannot be reached.
        """
        key = f"arrived/{prefix}"
        if not await self.store.check([key]):
            return set()
        return {int(r) for r in (await self.store.get(key)).decode().split(",") if r}

    async def _forget_arrivals(self) -> None:
        """Delete the records of timed-out operations (:meth:`missing`) once every rank has
        left: they matter only while the ranks wait for each other."""
        if not await self.store.check([_ARRIVALS_KEY]):
            return
        listed = (await self.store.get(_ARRIVALS_KEY)).decode().split(";")
        for key in {k for k in listed if k}:
            await self.store.delete_key(key)
        await self.store.delete_key(_ARRIVALS_KEY)

    async def meet(self, key: str, count: int, timeout: float | None, what: str) -> None:
        """Return once ``count`` ranks have called this with ``key`` (a store barrier), or
        raise as soon as the world breaks; ``what`` the ranks are doing names the error.

        A store server answers every waiter of a barrier in one turn of its loop, so when
        the rank hosting it returns from here, the others have their answers already: a
        setup that ends with this needs nothing more from the store host, whose event loop
        may stop running once it returns there (a loop driven by ``run_until_complete``,
        or blocked by its owner). (A TCPStore's own server runs on a loop of its own, which
        keeps answering; a ``TCPStoreServer`` that a script serves on its loop does not.)

        Raises:
            DistTimeoutError: fewer than ``count`` arrived within ``timeout`` seconds.
            DistNetworkError: the world was aborted or closed, or a rank went without a
                goodbye, meanwhile (its cause is chained).
        """
        if count > 1:
            await self.unless_broken(self.store.barrier(key, count, timeout), what)

    async def unless_broken(self, work: Awaitable[T], what: str) -> T:
        """Await ``work`` (a step of setting something up that waits for every rank),
        unless the world breaks first: then cancel it and raise; ``what`` the ranks are
        doing names the error.

        A rank that dies before it does its part of such a step may hold no lease the step
        watches (it waits in the store for that rank's record): its lost connections break
        the world, which ends the wait.

        Raises:
            DistNetworkError: the world was aborted or closed, or a rank went without a
                goodbye, meanwhile (its cause is chained).
        """
        task = asyncio.ensure_future(work)
        ended = asyncio.ensure_future(self._ended.wait())
        try:
            await asyncio.wait((task, ended), return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if task.cancelled():
            cause = self.broken
            raise DistNetworkError(
                f"{what}: the world "
                + (f"broke before every rank got there: {cause}" if cause else "was closed")
            ) from cause
        return task.result()

    async def departures(self, ranks: Container[int] | None = None) -> dict[int, str]:
        """The ranks (of ``ranks``, default all) that have left this world so far, with why
        (a goodbye, or their lease if they went without one).

        One store request, whatever the size of the world: every departure appends its
        record to one key (a goodbye as the rank leaves, a lease as its connection ends),
        which every rank made as it took its leases.

        Raises:
            DistNetworkError: the store cannot be reached.
        """
        if self.size == 1:
            return {}  # (nobody else to leave; and the record was never made)
        raw = await self.store.get(_DEPARTURES_KEY)
        left = {int(who): why for who, why in _parse_departures(raw).items()}
        # (By the departures, which are few: ``ranks`` may be every rank of a large world.)
        return left if ranks is None else {r: why for r, why in left.items() if r in ranks}

    async def wait_ended(self) -> BaseException | None:
        """Wait until the world is aborted (return the cause) or closed (return ``None``)."""
        await self._ended.wait()
        return self.broken

    async def aclose(self, reason: str = "left") -> None:
        """Stop watching, finish recording an abort reason, and leave the store.

        ``reason`` is recorded as why this rank left.
        """
        if self.closed:
            return
        self.closed = True
        self._ended.set()
        for watcher in self._watchers:
            watcher.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        if self._recording is not None:
            await asyncio.gather(self._recording, return_exceptions=True)
        await self._leave(reason)

    async def _leave(self, reason: str) -> None:
        # Peers look each other's addresses up in the store when they first talk, which can
        # be long after this rank is done; so a rank that hosts the store keeps it up until
        # every rank has left (or gone: its lease records that). An aborted world waits
        # briefly: its ranks leave as soon as they learn of the abort, and the cause stays
        # readable meanwhile. Every other step is bounded by LEAVE_WAIT.
        keys = [f"left/{r}" for r in range(self.size)]
        try:
            async with asyncio.timeout(LEAVE_WAIT):
                # The goodbye first: a request a stopped server has received is carried out
                # when it runs again, and until the leases are withdrawn the end of this
                # connection still says that this rank went. ``left/<rank>`` is the last key
                # this rank writes here: once every rank's is there, nothing more comes, and
                # the last to leave can delete the world's keys.
                await self.store.append(_DEPARTURES_KEY, departure_record(self.rank, reason))
                await self.store.set(f"left/{self.rank}", reason)
                # Nothing more for the server to tell the others.
                await self.store.lease(f"left/{self.rank}", None)
                await self.store.lease(_DEPARTED_KEY, None)
                await self.store.lease(_DEPARTURES_KEY, None)
                if await self.store.check(keys):
                    # The last to leave: nobody reads the world's keys any more.
                    await (self._forget_arrivals() if self._sweep is None else self._sweep())
                    return
        except TimeoutError:
            logger.warning(
                "rank %d: the store did not answer within %g s while this rank left (its "
                "host may have left already); leaving without a goodbye in the store",
                self.rank,
                LEAVE_WAIT,
            )
            return
        except DistError as exc:
            logger.warning("rank %d: leaving the store: %s", self.rank, exc)
            return
        if not self.hosting:
            return
        limit = BROKEN_LEAVE_WAIT if self.aborted else self._timeout
        logger.info("rank %d: keeping the store up until every rank left", self.rank)
        try:
            await speaking(
                self._all_left(keys, limit),
                lambda: self._not_left(keys),
                f"rank {self.rank} keeps the store it hosts up until every rank has left "
                "(destroy_process_group or exit)",
            )
        except TimeoutError:
            logger.info("rank %d: not every rank left the store within %s s", self.rank, limit)
        except DistError as exc:
            logger.warning("rank %d: leaving the store: %s", self.rank, exc)

    async def _all_left(self, keys: list[str], limit: float | None) -> None:
        # Until every rank's ``left/<rank>`` is there, or they are gone: the last rank to
        # leave may have found them all and swept the world's keys between this rank's look
        # and its wait, which then would never end. Its own goodbye, which only a sweep
        # deletes, says which (looked at between slices of the wait).
        async with asyncio.timeout(limit):
            while True:
                try:
                    await self.store.wait(keys, _SWEPT_POLL)
                    return
                except DistTimeoutError:
                    if not await self.store.check([f"left/{self.rank}"]):
                        return

    async def _not_left(self, keys: list[str]) -> str:
        found = await asyncio.gather(*(self.store.check([k]) for k in keys))
        waiting = [r for r, there in enumerate(found) if not there]
        return f"ranks {waiting} have not left yet"


def departure_record(who: int | str, why: str) -> str:
    """The record that ``who`` left, and why, appended to a key that lists departures (see
    :func:`_parse_departures`)."""
    return f"{who}:{why.replace(chr(0), ' ')}\0"


async def read_departures(store: Store, key: str = _DEPARTURES_KEY) -> dict[str, str]:
    """Who left, and why, by the records in ``key`` of ``store`` (by default, the world's
    departures, when ``store`` is a world's namespace), for a process that holds no domain
    there; two requests at most.

    Raises:
        DistNetworkError: the store cannot be reached.
    """
    if not await store.check([key]):
        return {}
    return _parse_departures(await store.get(key))


def _parse_departures(raw: bytes) -> dict[str, str]:
    """Who left, and why, from the records of :func:`departure_record` in ``raw`` (the
    first record of each, should there be two)."""
    left: dict[str, str] = {}
    for record in raw.decode(errors="replace").split("\0"):
        who, sep, why = record.partition(":")
        if sep:
            left.setdefault(who, why)
    return left
