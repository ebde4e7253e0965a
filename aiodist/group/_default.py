"""The default world: the process-wide one, and a context's own.

The default group is process-wide once initialised, as in torch: a group made in one task
(a FastAPI lifespan) or thread is the default in every other. A context may hold a world of
its own instead (:func:`isolate_context`), which is how ``aiodist.testing.run_world`` runs
several ranks as tasks of one event loop. A forked child starts with none.

:class:`DefaultWorld` holds it, for any kind of world: :mod:`aiodist.group` keeps the one
of its ``World`` and names its methods ``current_world``, ``peek_world``, ...
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import warnings
import weakref
from typing import Any, Generic, Protocol, TypeVar

from ..errors import DistUsageError

__all__ = ["DefaultWorld", "blocking_loops"]


class _Ranked(Protocol):
    @property
    def rank(self) -> int:
        """This process's global rank in the world."""


W = TypeVar("W", bound=_Ranked)

# A context where isolate() ran holds a world of its own (None until it initialises one);
# any other context holds _PROCESS, meaning "the process-wide one". One context variable
# lookup.
_PROCESS: Any = object()


class DefaultWorld(Generic[W]):
    """The default world: the process-wide one, and a per-context override."""

    def __init__(self) -> None:
        self._process_world: W | None = None
        # Worlds a forked child inherited: kept, never used, so that nothing of them
        # (sockets, the parent's loop) is finalized in the child.
        self._inherited: list[W] = []
        self._context_world: contextvars.ContextVar[Any] = contextvars.ContextVar(
            "aiodist_world", default=_PROCESS
        )
        os.register_at_fork(after_in_child=self._forget_after_fork)

    def _forget_after_fork(self) -> None:
        # The parent's world is not the child's: its connections and loop thread are the
        # parent's. The child starts uninitialized (and leaves nothing at exit).
        if self._process_world is not None:
            self._inherited.append(self._process_world)
            self._process_world = None

    def isolate_context(self) -> None:
        """Give the current context a default world of its own, apart from the process's.

        After this, ``init_process_group`` in this context (and the tasks it creates) sets
        this context's default group, and the process-wide one is not seen here. This is how
        several ranks live as tasks of one event loop (``aiodist.testing.run_world``).
        """
        self._context_world.set(None)

    def peek(self) -> W | None:
        """Return the default world seen here (the context's own, else the process's), or
        ``None``."""
        world: W | None = self._context_world.get()
        return self._process_world if world is _PROCESS else world

    def set(self, world: W | None) -> None:
        """Make ``world`` the default seen here: this context's if it is isolated, else the
        process's."""
        if self._context_world.get() is _PROCESS:
            self._process_world = world
        else:
            self._context_world.set(world)

    def current(self, op: str = "this operation") -> W:
        """Return the default world seen here.

        Raises:
            DistUsageError: the default process group is not initialized.
        """
        world = self.peek()
        if world is None:
            raise DistUsageError(f"{op} needs the default process group: call {_init_call()} first")
        return world

    def warn_not_in_group(self, op: str, stacklevel: int) -> None:
        """Warn, as torch does, that ``op`` was called on a group this rank is not in."""
        world = self.peek()
        warnings.warn(
            f"Running {op} on global rank {-1 if world is None else world.rank} which does "
            "not belong to the given group.",
            stacklevel=stacklevel + 1,
        )


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
