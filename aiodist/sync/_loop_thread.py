"""The blocking facade's event-loop thread, and the hand-offs that run work on it.

``aiodist.sync`` runs the async core on one event loop that lives in a daemon thread of this
process (``aiodist-loop``). The thread starts on the first blocking call; a forked child
starts without one. No global event-loop policy is touched, so the caller's own asyncio code
is unaffected.

A blocking call stands in for the loop thread when it can (:class:`HandOverLoop`): while
the loop thread waits for events, a caller that takes the loop's turn starts the operation
on its own thread, and an operation that can finish at once (see ``ProcessGroup._start``)
costs no hand-off between threads at all. Otherwise it hands the call to the loop thread.
The loop is the standard one with a turn (``$AIODIST_LOOP`` unset, ``auto`` or
``asyncio``), or uvloop, which has no such hook, when ``$AIODIST_LOOP=uvloop``: every call
is then handed to the loop thread.

What this module offers the rest of the package:

* :data:`loop_thread`: the thread itself (its loop, its id, ``stop()``);
* :func:`run`: run a coroutine there and block for its result (with a timeout, cancelling it
  on Ctrl-C);
* :func:`on_loop`: call a function there, or standing in for it, and return its result;
* :func:`start_operation`: start an operation there (or standing in for it), then block for
  its end (:class:`Outcome`), aborting the default group if Ctrl-C interrupts the wait;
* :func:`start_on_loop`: start work there (or standing in for it); return a future of its
  end at once;
* :func:`wait`: ``future.result()`` with a short poll first (:mod:`aiodist._util._wait`'s policy,
  when :func:`may_spin`), which spares the loop thread a wake-up of the caller.

Each refuses to run on the loop thread itself (it would wait for itself forever) with a
``DistUsageError``, and may be used from any number of threads at the same time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import selectors
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

from .._util._asyncio_internals import (
    loop_on_this_thread,
    pending_work,
    set_loop_on_this_thread,
    wake,
)
from .._util._loop import loop_factory
from .._util._wait import SPIN_SECONDS, local_ranks, ranks_fit, spin_until
from ..errors import DistError, DistTimeoutError, DistUsageError
from ..group import peek_world
from ..group._default import blocking_loops

__all__ = [
    "SHUTDOWN_TIMEOUT",
    "Outcome",
    "loop_thread",
    "may_spin",
    "on_loop",
    "run",
    "start_on_loop",
    "start_operation",
    "wait",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
W = TypeVar("W")

#: How long interpreter exit waits for the loop thread to close stores and stop (seconds).
SHUTDOWN_TIMEOUT = 5.0


class TurnSelector(selectors.DefaultSelector):
    """The hand-over loop's selector: the loop's thread gives up the turn while it waits."""

    def __init__(self) -> None:
        super().__init__()
        #: Held by whoever acts as the loop: its thread, except while it waits for events.
        self.turn = threading.Lock()
        #: Whether the loop's thread waits in :meth:`select` (then a holder of the turn may
        #: stand in for it).
        self.waiting = False
        #: Whether a thread stood in for the loop's during the current :meth:`select`.
        self.stood_in = False

    def select(self, timeout: float | None = None) -> list[tuple[Any, int]]:
        self.stood_in = False
        self.waiting = True
        self.turn.release()
        try:
            events = self.wait_for_events(timeout)
        finally:
            self.turn.acquire()
            self.waiting = False
        if self.stood_in:
            # A thread stood in meanwhile: it may have closed a transport and opened another
            # on the same descriptor, and an event found for the old one would then be taken
            # for the new one (the loop removes the reader of a descriptor whose handle was
            # cancelled: the new transport's). Look again, under the turn, at the
            # registrations as they are now; epoll is level-triggered, so nothing is lost.
            events = self.wait_for_events(0)
        return events

    def wait_for_events(self, timeout: float | None) -> list[tuple[Any, int]]:
        """The selector's own ``select``."""
        return super().select(timeout)


class HandOverLoop(asyncio.SelectorEventLoop):
    """The standard event loop, which another thread may stand in for while it waits.

    The loop's thread holds a lock, the turn, while it runs callbacks, and gives it up only
    while it waits for events. A thread that takes the turn then (:meth:`stand_in`) may do
    what a callback does (start operations, make futures, tasks and timers) with the same
    safety: the two never run the loop's code at once, the lock orders their memory, and the
    events the loop's thread was handed while a thread stood in are looked for again.
    """

    def __init__(self, selector: TurnSelector | None = None) -> None:
        self._turns = selector if selector is not None else TurnSelector()
        super().__init__(self._turns)

    def run_forever(self) -> None:
        with self._turns.turn:
            super().run_forever()

    def stand_in(self, call: Callable[[], None]) -> bool:
        """Run ``call()`` on this thread as the loop's thread would, if it waits for events
        now; return whether it ran. ``call`` must not raise or block."""
        turns = self._turns
        if self.get_debug() or not turns.turn.acquire(blocking=False):
            return False
        try:
            if not turns.waiting:  # (the loop is starting or stopping)
                return False
            turns.stood_in = True
            before = pending_work(self)
            caller_loop = loop_on_this_thread()  # (a caller's own loop)
            set_loop_on_this_thread(self)
            try:
                call()
            finally:
                set_loop_on_this_thread(caller_loop)
            # The loop's thread sleeps in select with a timeout computed before: wake it if
            # the call left it callbacks to run or timers to arm.
            ready, timers = pending_work(self)
            woken = ready > 0 or timers != before[1]
        finally:
            turns.turn.release()
        if woken:
            wake(self)
        return True


def _loop_thread_factory(prefer: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """The loop thread's loop factory: the hand-over loop unless uvloop is insisted on."""
    factory = loop_factory(prefer)  # (which checks ``prefer``)
    return factory if prefer == "uvloop" else HandOverLoop


class _LoopThread:
    """The process's event loop thread, started on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None

    def __repr__(self) -> str:
        state = "running" if self._thread is not None and self._thread.is_alive() else "stopped"
        return f"<aiodist loop thread {state} loop={self._loop!r}>"

    @property
    def ident(self) -> int | None:
        """The loop thread's id, or ``None`` when it is not running."""
        thread = self._thread
        return thread.ident if thread is not None else None

    def loop(self) -> asyncio.AbstractEventLoop:
        """Return the running loop, starting the thread if needed."""
        loop = self._loop
        if loop is not None:
            return loop
        with self._lock:
            if self._loop is None:
                self._start()
            assert self._loop is not None
            return self._loop

    def _start(self) -> None:
        factory = _loop_thread_factory(os.environ.get("AIODIST_LOOP", "auto"))
        ready = threading.Event()
        failure: list[BaseException] = []

        async def serve() -> None:
            self._stopping = asyncio.Event()
            self._loop = asyncio.get_running_loop()
            blocking_loops.add(self._loop)
            ready.set()
            await self._stopping.wait()

        def main() -> None:
            try:
                with asyncio.Runner(loop_factory=factory) as runner:
                    runner.run(serve())
            except BaseException as exc:  # reported to the starting thread, or logged
                failure.append(exc)
                ready.set()
                logger.exception("aiodist's event-loop thread failed")

        thread = threading.Thread(target=main, name="aiodist-loop", daemon=True)
        thread.start()
        ready.wait()
        if failure:
            raise DistUsageError(f"cannot start aiodist's event-loop thread: {failure[0]}")
        self._thread = thread
        logger.debug("started the event-loop thread %r", self)

    def stop(self, timeout: float = SHUTDOWN_TIMEOUT) -> None:
        """Stop the loop and wait (up to ``timeout``) for the thread to end."""
        with self._lock:
            loop, thread, stopping = self._loop, self._thread, self._stopping
            self._loop = self._thread = self._stopping = None
        if loop is None or thread is None or stopping is None:
            return
        if threading.get_ident() == thread.ident:
            raise DistUsageError("the aiodist event loop cannot be stopped from its own thread")
        loop.call_soon_threadsafe(stopping.set)
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("aiodist's event-loop thread did not stop within %.1f s", timeout)

    def forget(self) -> None:
        """Drop the state inherited by a forked child: its loop thread does not exist there."""
        self._lock = threading.Lock()
        self._loop = self._thread = self._stopping = None


#: The process's one loop thread (see :class:`_LoopThread`).
loop_thread = _LoopThread()
os.register_at_fork(after_in_child=loop_thread.forget)


def may_spin() -> bool:
    """Whether a blocking caller polls for its result before it sleeps on it: this host's
    ranks fit on this process's CPUs (see :mod:`aiodist._util._wait`). Sleeping means the loop
    thread must wake the caller when the result is set: on a VM waking a sleeping thread
    costs tens of microseconds, as much as a small operation itself."""
    world = peek_world()
    return ranks_fit(local_ranks(len(world.transport.local_ranks) if world is not None else 1))


def wait(future: concurrent.futures.Future[T], timeout: float | None = None) -> T:
    """``future.result(timeout)``, polling for up to :data:`~aiodist._util._wait.SPIN_SECONDS`
    first (when :func:`may_spin`): the loop thread runs the operation meanwhile and, finding
    nobody asleep on the future, sets its result without a wake-up."""
    if not future.done() and may_spin():
        spin_until(future.done, SPIN_SECONDS)
    return future.result(timeout)


def run(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coro`` on the loop thread and block until it finishes; return its result.

    Args:
        coro: the coroutine to run.
        timeout: seconds to wait; ``None`` waits as long as the coroutine runs.

    Raises:
        DistUsageError: called from the loop thread (it would wait for itself forever).
        DistTimeoutError: ``timeout`` passed; the coroutine was cancelled.
        KeyboardInterrupt: Ctrl-C while waiting; the coroutine was cancelled.
    """
    if threading.get_ident() == loop_thread.ident:
        coro.close()
        raise DistUsageError(
            "a blocking aiodist.sync call was made on aiodist's event-loop thread (from a "
            "coroutine or callback running there), where it would wait for itself forever; "
            "await the async API (import aiodist) there instead"
        )
    future = asyncio.run_coroutine_threadsafe(coro, loop_thread.loop())
    try:
        return wait(future, timeout)
    except concurrent.futures.TimeoutError:
        # The builtin TimeoutError is this class: a DistTimeoutError the coroutine raised
        # arrives here too, with the future done.
        if future.done():
            raise
        future.cancel()
        raise DistTimeoutError(f"blocking call did not finish within {timeout} s") from None
    except BaseException:
        # KeyboardInterrupt (or SystemExit) in this thread: stop the operation on the loop.
        future.cancel()
        raise


def _abort_on_interrupt(op: str) -> None:
    # The peers are part-way through the operation and this rank will not finish it: abort
    # the group so they fail at once (with the reason) instead of waiting for its timeout.
    # Recover with destroy_process_group() and init_process_group().
    world = peek_world()
    if world is not None:
        cause = DistError(f"rank {world.rank}: {op} interrupted by KeyboardInterrupt")
        loop_thread.loop().call_soon_threadsafe(world.abort, cause)


def _not_on_the_loop_thread() -> None:
    if threading.get_ident() == loop_thread.ident:
        raise DistUsageError(
            "a blocking aiodist.sync call was made on aiodist's event-loop thread, where it "
            "would wait for itself forever; await the async API (import aiodist) there instead"
        )


def on_loop(fn: Callable[..., T], *args: Any) -> T:
    """Call ``fn(*args)`` on the loop thread and return its result (one hop, no task).

    Raises:
        DistUsageError: called from the loop thread.
        BaseException: what ``fn`` raised.
    """
    _not_on_the_loop_thread()
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def call() -> None:
        try:
            done.set_result(fn(*args))
        except BaseException as exc:
            done.set_exception(exc)

    _call_soon(call)
    return wait(done)


def _call_soon(call: Callable[[], None]) -> None:
    # Standing in for the loop thread costs no hand-off; otherwise hand the call over.
    loop = loop_thread.loop()
    if not (isinstance(loop, HandOverLoop) and loop.stand_in(call)):
        loop.call_soon_threadsafe(call)


def start_on_loop(
    start: Callable[[], W], track: Callable[[W, concurrent.futures.Future[T]], object]
) -> concurrent.futures.Future[T]:
    """Start an operation on the loop thread; return a future of its result at once.

    The caller waits once, for the end, instead of first for the start and then for the
    end (each wait that sleeps costs a wake-up from the loop thread).

    Args:
        start: starts the operation on the loop thread and returns its async work.
        track: called there with that work and the returned future, which it settles with
            the operation's outcome (``aiodist.sync.Work``, which this module cannot import:
            the API sits above it).

    Raises:
        DistUsageError: called from the loop thread. What ``start`` raises is set on the
            future instead.
    """
    _not_on_the_loop_thread()
    done: concurrent.futures.Future[T] = concurrent.futures.Future()
    done.set_running_or_notify_cancel()

    def call() -> None:
        try:
            track(start(), done)
        except BaseException as exc:
            done.set_exception(exc)

    _call_soon(call)
    return done


class Outcome(Generic[T]):
    """The outcome of one operation, handed from the loop thread to the one thread that
    blocks on it: what :func:`start_operation` needs of ``concurrent.futures.Future``
    (settle once, ``done()``, ``result()``), without its condition variable, whose Python
    code cost a small operation more than the rest of the hand-over. A lock taken at birth
    and released when the outcome is set is what a waiter that finds it not done sleeps on.
    """

    __slots__ = ("_done", "_error", "_lock", "_value")

    def __init__(self) -> None:
        self._done = False
        self._value: T | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._lock.acquire()

    def set_result(self, value: T) -> None:
        """Settle with ``value`` (the first outcome stays)."""
        if not self._done:
            self._value = value
            self._done = True
            self._lock.release()

    def set_exception(self, exc: BaseException) -> None:
        """Settle with ``exc`` (the first outcome stays)."""
        if not self._done:
            self._error = exc
            self._done = True
            self._lock.release()

    def done(self) -> bool:
        """Whether the outcome is set."""
        return self._done

    def result(self) -> T:
        """Block until the outcome is set; return its value.

        Raises:
            BaseException: the exception it was set with.
        """
        if not self._done:
            self._lock.acquire()  # (interruptible: Ctrl-C raises KeyboardInterrupt here)
            self._lock.release()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


def start_operation(op: str, start: Callable[[], W], track: Callable[[W, Outcome[T]], object]) -> T:
    """Start operation ``op`` on the loop thread, or standing in for it, and block for its
    outcome; on Ctrl-C abort the default group and re-raise.

    Args:
        op: the operation's name (for the abort's reason).
        start: starts the operation on the loop thread and returns its async work.
        track: called there with that work and the outcome to settle with the operation's
            (at once when the work is born done, the common case of a small operation).

    Raises:
        DistUsageError: called from the loop thread.
        KeyboardInterrupt: Ctrl-C while waiting; the peers fail at once, naming ``op``.
        BaseException: what ``start`` raised, or the operation's failure.
    """
    _not_on_the_loop_thread()
    done: Outcome[T] = Outcome()

    def call() -> None:
        try:
            track(start(), done)
        except BaseException as exc:
            done.set_exception(exc)

    _call_soon(call)
    try:
        if not done.done() and may_spin():
            spin_until(done.done, SPIN_SECONDS)
        return done.result()
    except KeyboardInterrupt:
        _abort_on_interrupt(op)
        raise
