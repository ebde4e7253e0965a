"""Choosing an event loop implementation without touching the global policy."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Literal

from ..errors import DistUsageError

__all__ = ["LoopKind", "loop_factory"]

LoopKind = Literal["auto", "uvloop", "asyncio"]


def loop_factory(prefer: str = "auto") -> Callable[[], asyncio.AbstractEventLoop]:
    """Return a callable that creates a new event loop.

    Args:
        prefer: ``"auto"`` uses uvloop when it is installed and the standard loop otherwise;
            ``"uvloop"`` insists on uvloop; ``"asyncio"`` always uses the standard loop.

    Raises:
        DistUsageError: ``prefer`` is unknown, or ``"uvloop"`` was asked for and is missing.
    """
    if prefer not in ("auto", "uvloop", "asyncio"):
        raise DistUsageError(
            f"unknown loop kind {prefer!r}: expected 'auto', 'uvloop' or 'asyncio'"
        )
    if prefer == "asyncio":
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError:
        if prefer == "uvloop":
            raise DistUsageError(
                "loop='uvloop' requested but uvloop is not installed: pip install uvloop"
            ) from None
        return asyncio.new_event_loop
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory
