"""Long waits that say what they wait for.

A wait that may last as long as a timeout of thirty minutes (ranks gathering in
``init_process_group``, a collective waiting for a peer, the store's host waiting for the
others to leave) logs a warning after :data:`FIRST_WARNING` seconds and then every
:func:`interval` seconds while it lasts, naming what it waits for and on whom, so that a
wrong ``MASTER_PORT``, a rank that never started or a peer stuck in user code shows up in the
log within a minute instead of at the timeout.

:class:`SlowWait` is the clock of one such wait (for loops that poll anyway);
:func:`speaking` wraps an awaitable in one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["FIRST_WARNING", "WAIT_WARNING_ENV", "SlowWait", "interval", "speaking"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds after which a long wait first says what it waits for.
FIRST_WARNING = 60.0
#: Seconds between the later warnings, unless ``$AIODIST_WAIT_WARNING`` says otherwise.
DEFAULT_INTERVAL = 300.0
#: The variable that sets the interval (seconds; the first warning comes at the first
#: minute, or after one interval when that is shorter).
WAIT_WARNING_ENV = "AIODIST_WAIT_WARNING"
# How long a wait's description may take to gather (it asks the store): a store that does
# not answer must not delay the warning itself.
_DESCRIBE_LIMIT = 5.0

#: What a wait says about whom it waits for (a store read, typically).
Describe = Callable[[], Awaitable[str]]


def interval() -> float:
    """Seconds between the warnings of a long wait (``$AIODIST_WAIT_WARNING``, default 300;
    a value that is not a positive number is logged and the default used)."""
    text = os.environ.get(WAIT_WARNING_ENV, "").strip()
    try:
        seconds = float(text) if text else DEFAULT_INTERVAL
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        logger.warning(
            "%s=%r is not a positive number of seconds: using %g",
            WAIT_WARNING_ENV,
            text,
            DEFAULT_INTERVAL,
        )
        return DEFAULT_INTERVAL
    return seconds


class SlowWait:
    """The clock of one long wait: :meth:`tick` logs a warning when one is due.

    Args:
        what: what is waited for ("rank 1: init_process_group waits for the world of 3
            ranks to form").
        describe: returns who is missing, asked for each warning (may be ``None``).
    """

    def __init__(self, what: str, describe: Describe | None = None) -> None:
        self.what = what
        self._describe = describe
        self._every = interval()
        self._start = time.monotonic()
        self._next = self._start + min(FIRST_WARNING, self._every)

    def __repr__(self) -> str:
        return f"<SlowWait {self.what!r} {self.elapsed:.0f} s>"

    @property
    def elapsed(self) -> float:
        """Seconds since the wait began."""
        return time.monotonic() - self._start

    @property
    def due_in(self) -> float:
        """Seconds until the next warning is due (0 when it is)."""
        return max(0.0, self._next - time.monotonic())

    async def tick(self) -> None:
        """Log the warning if one is due (asking ``describe`` who is missing)."""
        if time.monotonic() < self._next:
            return
        self._next = time.monotonic() + self._every
        detail = ""
        if self._describe is not None:
            try:
                async with asyncio.timeout(_DESCRIBE_LIMIT):
                    detail = await self._describe()
            except Exception as exc:  # the warning must come, whatever the store does
                detail = f"(could not tell whom: {type(exc).__name__}: {exc})"
        logger.warning(
            "%s: still waiting after %.1f s%s (next word in %g s; set %s to change)",
            self.what,
            self.elapsed,
            f": {detail}" if detail else "",
            self._every,
            WAIT_WARNING_ENV,
        )


async def speaking(work: Awaitable[T], describe: Describe | None, what: str) -> T:
    """Await ``work``; while it runs, log what it waits for (see :class:`SlowWait`).

    Cancelling the caller cancels ``work``. Returns what ``work`` returns.

    Raises:
        BaseException: what ``work`` raises.
    """
    task = asyncio.ensure_future(work)
    clock = SlowWait(what, describe)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=clock.due_in)
            if done:
                return task.result()
            await clock.tick()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
