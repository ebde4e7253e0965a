"""The parts of asyncio's implementation aiodist relies on, all in this one module.

Each is checked, on every Python version aiodist supports, by ``tests/test_asyncio_internals.py``,
which fails if the attribute no longer means what the code here assumes:

* **standing in for the loop's thread** (:class:`aiodist.sync._loop_thread.HandOverLoop`): which
  loop runs on this thread (``asyncio.events._get_running_loop`` and
  ``_set_running_loop``), whether a loop has callbacks to run or timers to arm (its
  ``_ready`` and ``_scheduled``), and waking it from another thread (``_write_to_self``);
* **running an operation's coroutine inline** (``ProcessGroup._start``): a coroutine that
  awaits a future hands it to whoever drives it with ``_asyncio_future_blocking`` set, which
  the driver clears before awaiting the future itself, as ``asyncio.Task`` does.

Both are measured to pay (``docs/architecture.md``: a blocking 8-byte all_reduce 58 -> 19 µs
standing in; an operation whose data are there ends without a task).
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = [
    "loop_on_this_thread",
    "pending_work",
    "release_yielded",
    "set_loop_on_this_thread",
    "wake",
]


def loop_on_this_thread() -> asyncio.AbstractEventLoop | None:
    """The loop running on this thread, or ``None``."""
    return asyncio.events._get_running_loop()


def set_loop_on_this_thread(loop: asyncio.AbstractEventLoop | None) -> None:
    """Make ``loop`` the one :func:`asyncio.get_running_loop` returns on this thread."""
    asyncio.events._set_running_loop(loop)


def pending_work(loop: asyncio.AbstractEventLoop) -> tuple[int, int]:
    """How many callbacks the standard ``loop`` has ready to run, and how many timers."""
    inner: Any = loop  # (typeshed leaves the standard loop's internals out)
    return len(inner._ready), len(inner._scheduled)


def wake(loop: asyncio.AbstractEventLoop) -> None:
    """Wake the standard ``loop`` from its wait for events, from another thread."""
    inner: Any = loop
    inner._write_to_self()


def release_yielded(future: Any) -> None:
    """Take ``future``, which a coroutine just yielded to its driver, as the driver's own to
    await (``Task`` clears the flag the same way before it waits on it)."""
    future._asyncio_future_blocking = False
