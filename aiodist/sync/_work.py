"""The blocking handle of an operation started with ``async_op=True`` (torch's ``Work``),
as :mod:`aiodist.sync` gives it: the async :class:`aiodist.Work` read from any thread."""

from __future__ import annotations

import concurrent.futures
from datetime import timedelta
from typing import Any, Generic, TypeVar

from .. import group as _group
from .._util._timeouts import Timeout, to_seconds
from ..errors import DistUsageError
from ._loop_thread import on_loop, run, wait

__all__ = ["Work"]

T = TypeVar("T")


class Work(Generic[T]):
    """The blocking handle of an operation started with ``async_op=True`` (torch's ``Work``).

    Thread-safe; every method may be called any number of times. Its state is the async
    :class:`aiodist.Work`'s, read directly: ``is_completed()`` is true as soon as the
    operation has finished.
    """

    def __init__(self, work: _group.Work[T]) -> None:
        # Made on the loop thread, or by a thread standing in for it (the done callback is
        # added there).
        self._work = work
        self._future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._future.set_running_or_notify_cancel()
        if work.is_completed():  # (ended as it started: no callback, no hand-off)
            self._settle(work)
        else:  # runs on the loop thread once the operation ends
            work.add_done_callback(self._settle)

    def _settle(self, work: _group.Work[T]) -> None:
        exc = work.exception()
        if exc is not None:
            self._future.set_exception(exc)
        else:
            self._future.set_result(work.result())

    def __repr__(self) -> str:
        return f"<Work (blocking) {self._work!r}>"

    def wait(self, timeout: Timeout = None) -> bool:
        """Block until the operation is done; return ``True``.

        Args:
            timeout: seconds or ``timedelta``; ``None`` waits until the group's own timeout.

        Raises:
            DistTimeoutError: ``timeout`` passed first; as in torch, this fails the operation
                and aborts the process group.
            DistError: the operation failed.
            KeyboardInterrupt: Ctrl-C; the operation itself keeps running.
        """
        if to_seconds(timeout) is None:
            wait(self._future)
            return True
        # A deadline fails the operation when it passes: the async Work does that.
        run(self._work.wait(timeout))
        self._future.result()
        return True

    def is_completed(self) -> bool:
        """Return whether the operation has finished, successfully or not."""
        return self._work.is_completed()

    @property
    def timeout(self) -> timedelta | None:
        """The operation's deadline from its start, as torch's ``Work.timeout``."""
        return self._work.timeout

    def is_success(self) -> bool:
        """Return whether the operation has finished without an error."""
        return self._work.is_success()

    def exception(self) -> BaseException | None:
        """Return the operation's error, or ``None`` if it succeeded or is still running."""
        return self._work.exception()

    def result(self) -> T:
        """Return the result of a finished operation (the output array or list).

        Raises:
            DistUsageError: the operation has not finished yet.
            DistError: the operation failed.
        """
        return self._work.result()

    def source_rank(self) -> int:
        """The rank a finished receive (``irecv``) got its message from, as torch's
        ``Work.source_rank()`` (also spelled ``_source_rank()``): the work's result.

        Raises:
            DistUsageError: the work is not a receive's, or it has not finished.
            DistError: the receive failed.
        """
        if self._work.op != "recv":
            raise DistUsageError(
                f"source_rank() is the sender of a receive; this is the work of {self._work.op}"
            )
        sender: Any = self._work.result()
        return int(sender)

    _source_rank = source_rank

    def get_future(self) -> concurrent.futures.Future[T]:
        """Return a :class:`concurrent.futures.Future` resolved with the operation's result."""
        return self._future

    def wait_stream(self, stream: Any = None) -> None:
        """Make a device stream wait for this operation without blocking (CUDA operations).

        Raises:
            DistUsageError: the operation runs on the host.
        """
        on_loop(self._work.wait_stream, stream)
