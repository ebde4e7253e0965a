"""How a transport names what failed: a lost or aborted peer, how it departed, an
operation's failure that concerns it alone, and a message its peer gave up; and failing the
futures that waited on it.

The transports raise these errors where they learn of a failure; the layers above read
them back (:func:`departure_of`, :func:`only_this_operation`, :func:`peer_gave_up`,
:func:`abort_text`).
"""

from __future__ import annotations

import asyncio
import enum
from typing import Any, TypeVar

from ..errors import DistNetworkError

__all__ = [
    "Departure",
    "abort_text",
    "departure_of",
    "fail_future",
    "fails_alone",
    "given_up_by_peer",
    "lost_peer_error",
    "only_this_operation",
    "peer_aborted_error",
    "peer_gave_up",
]

E = TypeVar("E", bound=BaseException)


class Departure(enum.Enum):
    """How a peer went away when it did not fail: see :func:`lost_peer_error`."""

    #: It closed in order and said why (``destroy_process_group``, or its process exiting).
    LEFT = "left"
    #: Its connection or its process ended without a goodbye: it exited without leaving,
    #: was killed, or its host can no longer be reached. What it sent before still counts.
    GONE = "gone"


def fail_future(fut: asyncio.Future[Any], exc: BaseException) -> bool:
    """Fail ``fut`` with ``exc`` unless it is done already; return whether it was failed.

    The exception is marked as retrieved: one lost peer fails many futures at once and the
    caller stops awaiting after the first error, so the rest must not be reported by the
    loop as "never retrieved".
    """
    if fut.done():
        return False
    fut.set_exception(exc)
    fut.exception()
    return True


def lost_peer_error(peer: int, reason: str, departure: Departure | None = None) -> DistNetworkError:
    """Return the error for receives and sends that depended on a lost ``peer``.

    ``departure`` says how it went, when it went without failing (``None``: it failed, or
    the connection to it did); :func:`departure_of` reads it back. ``peer`` is kept as the
    error's ``peer`` attribute.
    """
    error = DistNetworkError(f"lost connection to rank {peer}: {reason}")
    error.departure = departure  # type: ignore[attr-defined]
    error.peer = peer  # type: ignore[attr-defined]
    return error


def fails_alone(exc: E) -> E:
    """Mark ``exc`` as the failure of one operation only, which every rank that takes part
    in it learns alike (a rejection, a mismatch found before any result was written, a
    member that left in order): the group and its other operations go on. Returns ``exc``."""
    exc.alone = True  # type: ignore[attr-defined]
    return exc


def only_this_operation(exc: BaseException) -> bool:
    """Whether ``exc`` fails its operation only (see :func:`fails_alone`)."""
    return getattr(exc, "alone", False) is True


def given_up_by_peer(exc: E) -> E:
    """Mark ``exc`` as the failure of a message that its peer gave up: it withdrew it (its
    send ended first) or refused it (its receive ended first, or did not fit). In an
    operation of several ranks this is most often the echo of a rejection by a third rank,
    which the peer heard first and which reaches this rank too. Returns ``exc``."""
    exc.given_up = True  # type: ignore[attr-defined]
    return exc


def peer_gave_up(exc: BaseException) -> bool:
    """Whether ``exc`` fails a message its peer gave up (see :func:`given_up_by_peer`)."""
    return getattr(exc, "given_up", False) is True


def departure_of(exc: BaseException) -> Departure | None:
    """How the peer named by a :func:`lost_peer_error` went away (``None``: it failed)."""
    departure: Departure | None = getattr(exc, "departure", None)
    return departure


def abort_text(exc: BaseException) -> str:
    """What a rank aborting because of ``exc`` tells its peers: the failure that started it.

    A rank that aborts because a peer did passes that peer's text on unchanged (the
    ``origin`` :func:`peer_aborted_error` and the world layer attach), so the chain of aborts
    across a whole world names the first failure and stays short.
    """
    origin: str | None = getattr(exc, "origin", None)
    return origin if origin is not None else f"{type(exc).__name__}: {exc}"


def peer_aborted_error(peer: int, text: str) -> DistNetworkError:
    """Return the error for what depended on ``peer``, which aborted and said ``text``."""
    error = lost_peer_error(peer, f"it aborted: {text}")
    error.origin = text  # type: ignore[attr-defined]
    return error
