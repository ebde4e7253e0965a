"""Helpers for testing code that uses aiodist (and for aiodist's own tests).

May import anything but the package index (it sits above the facades).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._store_kit import check_store, check_sync_store
    from ._world import (
        WorldProcessError,
        WorldProcesses,
        free_port,
        run_world,
        run_world_processes,
        start_world_processes,
    )

__all__ = [
    "WorldProcessError",
    "WorldProcesses",
    "check_store",
    "check_sync_store",
    "free_port",
    "run_world",
    "run_world_processes",
    "start_world_processes",
]

#: The names that :mod:`._store_kit` defines; the others come from :mod:`._world`.
_STORE_KIT = frozenset({"check_store", "check_sync_store"})
_WORLD = frozenset(__all__) - _STORE_KIT


def __getattr__(name: str) -> Any:
    # Imported on first use: the pytest plugin imports this package in every test run of
    # every project that installs aiodist, and must stay cheap and inert.
    if name in _STORE_KIT:
        from . import _store_kit

        return getattr(_store_kit, name)
    if name in _WORLD:
        from . import _world

        return getattr(_world, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
