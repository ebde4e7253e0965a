"""One thread per process that watches completions and wakes the event loops waiting on them.

Device work (a CUDA event) finishes on its own time; an event loop must learn of it without
blocking and without a callback from a driver thread (a Python callback there needs the GIL
while the driver holds its own locks, a known deadlock). The :class:`ProgressThread` polls
every pending *completion* (any object with a ``query() -> bool`` method: ``True`` once done,
``False`` while pending, an exception if it failed) with a nap that grows from
``min_nap`` to ``max_nap`` while nothing finishes, sleeps on a condition while nothing is
pending, and settles each waiter's future on its own loop with
``loop.call_soon_threadsafe``. It also runs periodic health checks (an NCCL communicator's
asynchronous error) while anything is pending, and keeps objects alive until a completion is
done (staging memory a cancelled operation's copies may still touch).

Nothing here knows CUDA: a completion is whatever has ``query()``, so the thread is tested
with host-side completions (flags set by other threads), which is the whole of its job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import DistBackendError, DistError, DistTimeoutError

__all__ = ["Completion", "ProgressThread", "progress_thread"]

logger = logging.getLogger(__name__)


class Completion(Protocol):
    """Something that finishes on its own: ``query()`` is ``True`` once it has.

    ``query()`` raises if the work failed; it must be cheap and must not block.
    """

    def query(self) -> bool: ...


@dataclass(eq=False)
class _Item:
    completion: Completion
    loop: asyncio.AbstractEventLoop | None
    future: asyncio.Future[None] | None
    deadline: float | None
    what: str
    keep: Any = None


@dataclass(eq=False)
class _Check:
    check: Callable[[], None]
    on_error: Callable[[BaseException], None]
    interval: float
    due: float = field(default=0.0)


class ProgressThread:
    """Watches completions from one daemon thread and settles futures on their loops.

    Args:
        name: the thread's name.
        min_nap: the first pause (seconds) after a pass in which nothing finished.
        max_nap: the longest pause between passes while something is pending.

    The thread starts with the first :meth:`watch` and sleeps (no CPU) while nothing is
    pending.
    """

    def __init__(
        self, name: str = "aiodist-progress", *, min_nap: float = 1e-5, max_nap: float = 2e-4
    ) -> None:
        if not 0 < min_nap <= max_nap:
            raise ValueError(f"need 0 < min_nap <= max_nap, got {min_nap} and {max_nap}")
        self.name = name
        self.min_nap = min_nap
        self.max_nap = max_nap
        self._cond = threading.Condition()
        self._items: list[_Item] = []
        self._checks: list[_Check] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        #: Passes made over the pending items (for tests and benchmarks).
        self.passes = 0

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self._thread else "idle"
        return f"<ProgressThread {self.name} {state} pending={len(self._items)}>"

    @property
    def pending(self) -> int:
        """How many completions are being watched (waited on or keeping objects alive)."""
        with self._cond:
            return len(self._items)

    # -- the loop side ---------------------------------------------------------------------

    def watch(
        self, completion: Completion, *, timeout: float | None = None, what: str = "device work"
    ) -> asyncio.Future[None]:
        """Return a future of the running loop that resolves once ``completion`` is done.

        The completion is queried once here first (most short work is done by the time it
        is awaited), so a finished completion costs no thread hop. The future fails with
        the completion's error (a :class:`DistError` as it is, anything else wrapped in
        :class:`DistBackendError`), or with :class:`DistTimeoutError` naming ``what`` after
        ``timeout`` seconds. Cancelling the future stops the watch.

        Raises:
            DistBackendError: the thread was closed.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        try:
            done = completion.query()
        except BaseException as exc:
            future.set_exception(_as_dist_error(exc, what))
            return future
        if done:
            future.set_result(None)
            return future
        deadline = None if timeout is None else time.monotonic() + timeout
        item = _Item(completion, loop, future, deadline, what)
        self._add(item)
        future.add_done_callback(lambda f: self._drop(item) if f.cancelled() else None)
        return future

    async def wait(
        self, completion: Completion, *, timeout: float | None = None, what: str = "device work"
    ) -> None:
        """Wait until ``completion`` is done, without blocking the loop.

        Raises:
            DistTimeoutError: ``timeout`` seconds passed first.
            DistError: the completion failed (wrapped in DistBackendError if it was not one).
        """
        await self.watch(completion, timeout=timeout, what=what)

    def keep(self, completion: Completion, obj: object) -> None:
        """Keep ``obj`` referenced until ``completion`` is done (or has failed).

        For memory that device work still reads or writes after its owner stopped waiting
        (a cancelled operation): the memory must not return to its pool before the work
        that uses it ends.
        """
        try:
            if completion.query():
                return
        except BaseException:
            return
        self._add(_Item(completion, None, None, None, "kept memory", obj))

    def add_check(
        self,
        check: Callable[[], None],
        on_error: Callable[[BaseException], None],
        *,
        interval: float = 0.1,
    ) -> Callable[[], None]:
        """Call ``check()`` every ``interval`` seconds while any completion is pending.

        If it raises, the check is dropped and ``on_error(exc)`` is called from the progress
        thread (it must hand over to a loop itself, e.g. with ``call_soon_threadsafe``).
        Returns a function that removes the check.
        """
        entry = _Check(check, on_error, interval)
        with self._cond:
            self._checks.append(entry)

        def remove() -> None:
            with self._cond, contextlib.suppress(ValueError):
                self._checks.remove(entry)

        return remove

    def close(self) -> None:
        """Stop the thread; pending waiters fail with :class:`DistBackendError`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _add(self, item: _Item) -> None:
        with self._cond:
            if self._closed:
                raise DistBackendError(f"{self!r} is closed: cannot watch {item.what}")
            self._items.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def _drop(self, item: _Item) -> None:
        with self._cond, contextlib.suppress(ValueError):
            self._items.remove(item)

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        nap = self.min_nap
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                if self._closed:
                    remaining, self._items = self._items, []
                    break
                checks = list(self._checks)
            self.passes += 1
            # One pass in a method of its own: no local keeps an item (and the memory it
            # keeps alive) referenced while the thread sleeps.
            if self._pass(checks):
                nap = self.min_nap
                continue
            with self._cond:
                # A new watch notifies the condition, which ends the nap early.
                if not self._closed:
                    self._cond.wait(nap)
            nap = min(nap * 2, self.max_nap)
        closed = DistBackendError(f"{self.name} was closed while device work was pending")
        for item in remaining:
            _wake(item, closed)

    def _pass(self, checks: list[_Check]) -> bool:
        """Query every pending completion once; settle the finished ones; run due checks."""
        with self._cond:
            items = list(self._items)
        now = time.monotonic()
        finished: list[tuple[_Item, BaseException | None]] = []
        for item in items:
            try:
                if item.completion.query():
                    finished.append((item, None))
                    continue
            except BaseException as exc:
                finished.append((item, _as_dist_error(exc, item.what)))
                continue
            if item.deadline is not None and now >= item.deadline:
                finished.append((item, DistTimeoutError(f"{item.what} did not finish in time")))
        self._run_checks(checks, now)
        if finished:
            with self._cond:
                for item, _ in finished:
                    with contextlib.suppress(ValueError):
                        self._items.remove(item)
            for item, error in finished:
                _wake(item, error)
        return bool(finished)

    def _run_checks(self, checks: list[_Check], now: float) -> None:
        for entry in checks:
            if now < entry.due:
                continue
            entry.due = now + entry.interval
            try:
                entry.check()
            except BaseException as exc:
                with self._cond, contextlib.suppress(ValueError):
                    self._checks.remove(entry)
                try:
                    entry.on_error(exc)
                except Exception:
                    logger.exception("%s: a check's error handler failed", self.name)


def _as_dist_error(exc: BaseException, what: str) -> DistError:
    if isinstance(exc, DistError):
        return exc
    error = DistBackendError(f"{what} failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def _wake(item: _Item, exc: BaseException | None) -> None:
    if item.future is None or item.loop is None:
        return  # memory kept alive: dropping the item releases it
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
        item.loop.call_soon_threadsafe(_settle, item.future, exc)


def _settle(future: asyncio.Future[None], exc: BaseException | None) -> None:
    if future.done():
        return  # cancelled, or failed by the loop side meanwhile
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)


_shared: ProgressThread | None = None
_shared_lock = threading.Lock()


def progress_thread() -> ProgressThread:
    """Return the process's progress thread (made on first use)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = ProgressThread()
        return _shared


def _after_fork() -> None:
    # The thread does not survive fork; the child makes its own on first use.
    global _shared, _shared_lock
    _shared = None
    _shared_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)
