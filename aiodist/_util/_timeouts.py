"""Every default timeout, in one place, and normalising the timeout arguments users pass
(seconds or ``timedelta``).

A timeout given to ``init_process_group`` or ``new_group`` reaches every set-up and wait
below it; these defaults apply only where nothing was given.
"""

from __future__ import annotations

from datetime import timedelta

from ..errors import DistUsageError

__all__ = [
    "DEFAULT_PEER_TIMEOUT",
    "DEFAULT_PG_TIMEOUT",
    "DEFAULT_SETUP_TIMEOUT",
    "DEFAULT_STORE_TIMEOUT",
    "Timeout",
    "to_seconds",
]

Timeout = float | int | timedelta | None

#: torch's stores default to five minutes.
DEFAULT_STORE_TIMEOUT = 300.0
#: torch's default for CPU process groups: thirty minutes per operation.
DEFAULT_PG_TIMEOUT = 1800.0
#: For a transport or workspace set up on its own (within a group, the group's timeout).
DEFAULT_SETUP_TIMEOUT = 300.0
#: Seconds of silence after which a connection's peer counts as gone (``AIODIST_PEER_TIMEOUT``).
DEFAULT_PEER_TIMEOUT = 8.0


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
