"""The failure domain: the ranks of one ``init_process_group`` fail together.

A :class:`FailureDomain` holds what makes the ranks of a world fail together and leave
together, over the world's store:

* the **abort key**: the first rank to abort records why (``compare_set``, so the first
  cause wins); every rank keeps a server-side ``get`` of the key parked, so a rank with no
  connection to the one that failed learns at once, and learns the reason in the same
  answer;
* **store loss**: losing the store aborts the world (every later group creation, abort and
  rendezvous needs it);
* **arrivals**: when an operation times out, the ranks that entered it say so under one key,
  so the error can name the ranks that did not;
* **leaving**: a rank that hosts the store keeps it up until every rank has left, so that
  late address lookups and the abort reason stay readable.

It knows nothing of operations or groups: the world above hands it a callback that drops
the connections when the domain aborts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from .errors import DistError, DistNetworkError, DistTimeoutError
from .store import Store

__all__ = ["ARRIVAL_GRACE", "FailureDomain"]

logger = logging.getLogger(__name__)

_ABORT_KEY = "abort"

#: Seconds an aborting rank waits for its reason to be recorded before closing the store.
ABORT_RECORD_WAIT = 1.0

#: Seconds a rank whose operation timed out waits for the other ranks to record that they
#: entered it too, to name those that did not.
ARRIVAL_GRACE = 1.0
_ARRIVAL_POLL = 0.02

#: Seconds a store-hosting rank of an aborted world keeps the store up for the others to
#: read the cause and leave.
BROKEN_LEAVE_WAIT = 2.0

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
        hosting: whether this rank hosts the store (then it waits for every rank to leave).
        timeout: the world's operation timeout, also how long a host waits for the others
            to leave.

    Attributes:
        broken: the cause this domain aborted for, or ``None``.
        closed: whether :meth:`close` ran.
    """

    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        *,
        on_abort: Callable[[BaseException], None],
        hosting: bool,
        timeout: float | None,
    ) -> None:
        self.store = store
        self.rank = rank
        self.size = size
        self._on_abort = on_abort
        self._hosting = hosting
        self._timeout = timeout
        self.broken: BaseException | None = None
        self.closed = False
        # Set when the world is aborted or closed (a wait must end either way).
        self._ended = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None
        self._recording: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        state = "closed" if self.closed else "broken" if self.broken else "healthy"
        return f"<FailureDomain rank={self.rank}/{self.size} {state}>"

    def start(self) -> None:
        """Start watching the abort key (needs a running loop; nothing to watch for one rank)."""
        if self._watcher is None and self.size > 1:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        # If this rank's connection to the store ends without a goodbye (the process died,
        # or its host can no longer be reached), the server sets the abort key for it: the
        # other ranks learn within moments, even those that never talked to this one.
        try:
            await self.store.lease(
                _ABORT_KEY,
                f"rank {self.rank}: DistNetworkError: rank {self.rank} is gone: its connection "
                "to the store ended without a goodbye (its process exited or was killed, or "
                "its host cannot be reached)",
            )
        except DistError as exc:
            logger.warning("rank %d: could not take a lease on the store: %s", self.rank, exc)
        delay = _WATCH_RETRY
        while not self.closed:
            try:
                reason = (await self.store.get(_ABORT_KEY)).decode(errors="replace")
            except DistTimeoutError:
                continue  # the store's own timeout: park the wait again
            except DistNetworkError as exc:
                # Losing the store is a failure of the job too (the rank hosting it died,
                # or its server).
                if not self.closed:
                    lost = DistNetworkError(f"rank {self.rank}: lost the store: {exc}")
                    lost.__cause__ = exc
                    self.abort(lost)
                return
            except DistError as exc:
                # Anything else is the store refusing one request: try again, so that
                # failures keep spreading to this rank.
                logger.warning("rank %d: watching the abort key: %s (retrying)", self.rank, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _WATCH_RETRY_MAX)
                continue
            if not self.closed and not reason.startswith(f"rank {self.rank}:"):
                self.abort(DistNetworkError(f"the group was aborted by {reason}"))
            return

    def abort(self, cause: BaseException) -> None:
        """Make the world unusable because of ``cause``; tell the other ranks why.

        The reason goes to the store (the first rank's wins) and, through ``on_abort``, to
        the connected peers as the transport drops its connections. Aborting twice, or
        after :meth:`close`, does nothing.
        """
        if self.broken is not None or self.closed:
            return
        self.broken = cause
        self._ended.set()
        logger.warning("rank %d: aborting the process group: %s", self.rank, cause)
        failure = DistNetworkError(
            f"rank {self.rank}: process group aborted: {type(cause).__name__}: {cause}"
        )
        failure.__cause__ = cause
        reason = f"rank {self.rank}: {type(cause).__name__}: {cause}"
        with contextlib.suppress(RuntimeError):  # no running loop: nobody to tell
            self._recording = asyncio.get_running_loop().create_task(self._record(reason))
        self._on_abort(failure)

    async def _record(self, reason: str) -> None:
        try:
            async with asyncio.timeout(ABORT_RECORD_WAIT):
                await self.store.compare_set(_ABORT_KEY, "", reason)
        except (DistError, TimeoutError) as exc:
            logger.debug("rank %d: could not record the abort reason: %s", self.rank, exc)

    async def missing(self, prefix: str, me: int, ranks: list[int]) -> list[int] | None:
        """Record that rank ``me`` arrived at ``prefix``; return which of ``ranks`` did not.

        Every rank whose operation times out calls this at about the same time; each waits
        up to :data:`ARRIVAL_GRACE` for the others (one store request per poll). ``None``
        if the store cannot be reached.
        """
        key = f"arrived/{prefix}"
        loop = asyncio.get_running_loop()
        try:
            await self.store.append(key, f"{me},")
            end = loop.time() + ARRIVAL_GRACE
            while True:
                seen = {int(r) for r in (await self.store.get(key)).decode().split(",") if r}
                pending = [r for r in ranks if r not in seen]
                if not pending or loop.time() >= end:
                    return pending
                await asyncio.sleep(_ARRIVAL_POLL)
        except DistError as exc:
            logger.warning("rank %d: could not count the ranks that arrived: %s", self.rank, exc)
            return None

    async def wait_ended(self) -> BaseException | None:
        """Wait until the world is aborted (return the cause) or closed (return ``None``)."""
        await self._ended.wait()
        return self.broken

    async def close(self) -> None:
        """Stop watching, finish recording an abort reason, and leave the store."""
        if self.closed:
            return
        self.closed = True
        self._ended.set()
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        if self._recording is not None:
            await asyncio.gather(self._recording, return_exceptions=True)
        await self._leave()

    async def _leave(self) -> None:
        # Peers look each other's addresses up in the store when they first talk, which can
        # be long after this rank is done; so a rank that hosts the store keeps it up until
        # every rank has left. An aborted world waits briefly: its ranks leave as soon as
        # they learn of the abort, and the cause stays readable meanwhile.
        try:
            await self.store.lease(_ABORT_KEY, None)  # a goodbye: nothing to tell the others
            await self.store.set(f"left/{self.rank}", b"1")
            if not self._hosting:
                return
            keys = [f"left/{r}" for r in range(self.size)]
            if await self.store.check(keys):
                return
            logger.info("rank %d: keeping the store up until every rank left", self.rank)
            wait = BROKEN_LEAVE_WAIT if self.broken is not None else self._timeout
            # A rank that exits without leaving sets the abort key through its lease: then
            # there is nobody left to wait for.
            left = asyncio.ensure_future(self.store.wait(keys, wait))
            gone = asyncio.ensure_future(self.store.wait([_ABORT_KEY], wait))
            done, pending = await asyncio.wait([left, gone], return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for task in done:
                task.result()
        except DistTimeoutError as exc:
            logger.info("rank %d: not every rank left the store: %s", self.rank, exc)
        except DistError as exc:
            logger.warning("rank %d: leaving the store: %s", self.rank, exc)
