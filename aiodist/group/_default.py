"""The default world: the process-wide one, and a context's own.

The default group is process-wide once initialised, as in torch: a group made in one task
(a FastAPI lifespan) or thread is the default in every other. A context may hold a world of
its own instead (:func:`isolate_context`), which is how ``aiodist.testing.run_world`` runs
several ranks as tasks of one event loop. A forked child starts with none.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import warnings
import weakref
from typing import TYPE_CHECKING, Any

from ..errors import DistUsageError

if TYPE_CHECKING:
    from . import World

__all__ = [
    "blocking_loops",
    "current_world",
    "isolate_context",
    "peek_world",
    "set_current_world",
    "warn_not_in_group",
]

# The process-wide default world, and a per-context override: a context where
# isolate_context() ran holds a world of its own (None until it initialises one); any other
# context holds _PROCESS, meaning "the process-wide one". One context variable lookup.
_PROCESS: Any = object()
_process_world: World | None = None
# Worlds a forked child inherited: kept, never used, so that nothing of them (sockets, the
# parent's loop) is finalized in the child.
_inherited: list[World] = []


def _forget_after_fork() -> None:
    # The parent's world is not the child's: its connections and loop thread are the
    # parent's. The child starts uninitialized (and leaves nothing at exit).
    global _process_world
    if _process_world is not None:
        _inherited.append(_process_world)
        _process_world = None


os.register_at_fork(after_in_child=_forget_after_fork)
_context_world: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "aiodist_world", default=_PROCESS
)


def isolate_context() -> None:
    """Give the current context a default world of its own, apart from the process's.

    After this, ``init_process_group`` in this context (and the tasks it creates) sets this
    context's default group, and the process-wide one is not seen here. This is how several
    ranks live as tasks of one event loop (``aiodist.testing.run_world``).
    """
    _context_world.set(None)


def peek_world() -> World | None:
    """Return the default world seen here (the context's own, else the process's), or ``None``."""
    world: World | None = _context_world.get()
    return _process_world if world is _PROCESS else world


def set_current_world(world: World | None) -> None:
    """Make ``world`` the default seen here: this context's if it is isolated, else the process's."""
    global _process_world
    if _context_world.get() is _PROCESS:
        _process_world = world
    else:
        _context_world.set(world)


def current_world(op: str = "this operation") -> World:
    """Return the default world seen here.

    Raises:
        DistUsageError: the default process group is not initialized.
    """
    world = peek_world()
    if world is None:
        raise DistUsageError(f"{op} needs the default process group: call {_init_call()} first")
    return world


#: The event loops that run ``aiodist.sync``'s calls (its loop thread's): an error raised
#: there names the blocking call to make.
blocking_loops: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()


def _init_call() -> str:
    """How the caller initializes: the blocking call outside any event loop and on
    ``aiodist.sync``'s, the awaited one in the caller's own loop."""
    try:
        loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    if loop is None or loop in blocking_loops:
        return "`dist.init_process_group(...)` (with `import aiodist.sync as dist`)"
    return "`await aiodist.init_process_group(...)`"


def warn_not_in_group(op: str, stacklevel: int) -> None:
    """Warn, as torch does, that ``op`` was called on a group this rank is not in."""
    world = peek_world()
    warnings.warn(
        f"Running {op} on global rank {-1 if world is None else world.rank} which does not "
        "belong to the given group.",
        stacklevel=stacklevel + 1,
    )
