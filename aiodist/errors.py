"""The aiodist error tree.

Every error aiodist raises derives from :class:`DistError`. The subclasses are split by who is
at fault and mixed with the builtin exception a caller would naturally catch, so
``except ValueError`` catches bad arguments and ``except TimeoutError`` catches deadlines.
"""

from __future__ import annotations

__all__ = [
    "DistError",
    "DistNetworkError",
    "DistProtocolError",
    "DistStoreError",
    "DistTimeoutError",
    "DistUsageError",
    "QueueEmptyError",
]


class DistError(RuntimeError):
    """Base class of every error raised by aiodist."""


class DistUsageError(DistError, ValueError):
    """The caller passed something invalid: an argument, dtype, shape, rank or URL."""


class DistStoreError(DistError):
    """The key/value store failed to carry out a request."""


class QueueEmptyError(DistStoreError):
    """A non-blocking ``queue_pop`` found the queue empty."""


class DistNetworkError(DistError, ConnectionError):
    """A peer or the store went away, or could not be reached."""


class DistTimeoutError(DistError, TimeoutError):
    """A deadline passed; the message says what was waited for, and how long."""


class DistProtocolError(DistError):
    """A peer sent bytes that are not part of the protocol."""
