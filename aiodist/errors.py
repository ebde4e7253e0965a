"""The aiodist error tree.

Every error aiodist raises derives from :class:`DistError`. The subclasses are split by who is
at fault and mixed with the builtin exception a caller would naturally catch, so
``except ValueError`` catches bad arguments and ``except TimeoutError`` catches deadlines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = [
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistProtocolError",
    "DistStoreError",
    "DistStoreTimeoutError",
    "DistTimeoutError",
    "DistUsageError",
    "QueueEmptyError",
    "map_exceptions",
]


class DistError(RuntimeError):
    """Base class of every error raised by aiodist."""

    def __reduce__(self) -> tuple[Any, ...]:
        # What BaseException does, for every subclass alike: the errors that are also an
        # OSError (DistNetworkError, DistTimeoutError) would otherwise pickle as OSError
        # does, which tblib (Dask's tracebacks) cannot rebuild.
        return (type(self), self.args, self.__dict__ or None)


class DistUsageError(DistError, ValueError):
    """The caller passed something invalid: an argument, dtype, shape, rank or URL."""


class DistStoreError(DistError):
    """The key/value store failed to carry out a request."""


class QueueEmptyError(DistStoreError):
    """A non-blocking ``queue_pop`` found the queue empty."""


class DistBackendError(DistError):
    """A backend failed while running an operation (a CUDA or NCCL error, for instance)."""


class DistNetworkError(DistError, ConnectionError):
    """A peer or the store went away, or could not be reached."""


class DistTimeoutError(DistError, TimeoutError):
    """A deadline passed; the message says what was waited for, and how long."""


class DistStoreTimeoutError(DistStoreError, DistTimeoutError):
    """A store wait (``get``, ``wait``, ``multi_get``, blocking ``queue_pop``, ``barrier``)
    passed its deadline: caught by ``except DistStoreError`` as in torch, and by ``except
    TimeoutError`` like every deadline."""


class DistProtocolError(DistError):
    """A peer sent bytes that are not part of the protocol."""


@contextlib.contextmanager
def map_exceptions(
    mapping: Mapping[type[BaseException], type[DistError]], context: str
) -> Iterator[None]:
    """Translate a lower layer's exceptions into aiodist's, once, at a layer boundary.

    An exception raised in the block that is an instance of a key of ``mapping`` is
    re-raised as the mapped class, with ``context`` and the original message, chained to
    the original. aiodist's own errors and unmapped exceptions pass through unchanged.

    Args:
        mapping: source exception class -> aiodist error class, tried in order.
        context: what was being done, e.g. ``"cannot connect to 10.0.0.2:29500"``.

    Raises:
        DistError: the translated exception.
    """
    try:
        yield
    except DistError:
        raise
    except BaseException as exc:
        for source, target in mapping.items():
            if isinstance(exc, source):
                detail = str(exc) or type(exc).__name__
                raise target(f"{context}: {detail}") from exc
        raise
