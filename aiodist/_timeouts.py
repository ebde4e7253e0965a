"""Normalising the timeout arguments users pass (seconds or ``timedelta``)."""

from __future__ import annotations

from datetime import timedelta

from .errors import DistUsageError

__all__ = ["Timeout", "DEFAULT_STORE_TIMEOUT", "to_seconds"]

Timeout = float | int | timedelta | None

#: torch's stores default to five minutes.
DEFAULT_STORE_TIMEOUT = 300.0


def to_seconds(timeout: Timeout, default: float | None = None) -> float | None:
    """Convert ``timeout`` to float seconds; ``None`` gives ``default``.

    Raises:
        DistUsageError: the timeout is negative or not a number or ``timedelta``.
    """
    if timeout is None:
        return default
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, int | float) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise DistUsageError(
            f"timeout must be seconds or a datetime.timedelta, got {type(timeout).__name__}"
        )
    if seconds < 0:
        raise DistUsageError(f"timeout must not be negative, got {seconds} s")
    return seconds
