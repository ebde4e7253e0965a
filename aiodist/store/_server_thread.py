"""An event loop of its own, in a daemon thread, for a store server that must keep answering
while the loop of the process that hosts it is blocked.

A rank that hosts its job's store (``TCPStore.create(is_master=True)``) used to serve it on
its own event loop: a long blocking call on that loop (user code, a large numpy step, a
``time.sleep``) stalled every store request of the job, first contacts between other ranks
included. :class:`ServerThread` runs the server on a loop of its own instead, as torch serves
its store from a thread of its own. Everything of the server stays on that loop; the owner
reaches it only through :meth:`ServerThread.run`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from .._util._loop import loop_factory

__all__ = ["ServerThread"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ServerThread:
    """A daemon thread running an event loop of the same kind as the caller's (uvloop or the
    standard loop) until :meth:`stop`.

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._ended: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._pid = os.getpid()

    def __repr__(self) -> str:
        state = "running" if self._loop is not None and not self._ended.done() else "stopped"
        return f"<ServerThread {self.name} {state}>"

    async def start(self) -> None:
        """Start the thread and its loop; return once the loop runs."""
        factory = _same_kind(asyncio.get_running_loop())
        ready: concurrent.futures.Future[asyncio.AbstractEventLoop] = concurrent.futures.Future()

        async def serve() -> None:
            self._stopping = asyncio.Event()
            ready.set_result(asyncio.get_running_loop())
            await self._stopping.wait()

        def main() -> None:
            try:
                with asyncio.Runner(loop_factory=factory) as runner:
                    runner.run(serve())
            except BaseException as exc:  # (reported to the caller of start, or logged)
                if not ready.done():
                    ready.set_exception(exc)
                else:
                    logger.exception("the store server's thread failed")
            finally:
                self._ended.set_result(None)

        threading.Thread(target=main, name=self.name, daemon=True).start()
        self._loop = await asyncio.wrap_future(ready)

    @property
    def here(self) -> bool:
        """Whether the thread is in this process (a forked child inherits the object, not
        the thread)."""
        return os.getpid() == self._pid

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the thread's loop and return its result (cancelling the caller
        cancels it there)."""
        assert self._loop is not None, "start() first"
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def stop(self) -> None:
        """Stop the loop (its remaining tasks are cancelled) and wait for the thread to end.
        Stopping twice is harmless."""
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None and not self._ended.done():
            loop.call_soon_threadsafe(stopping.set)
        if loop is not None:
            await asyncio.wrap_future(self._ended)


def _same_kind(loop: asyncio.AbstractEventLoop) -> Callable[[], asyncio.AbstractEventLoop]:
    """A factory of loops of ``loop``'s kind: uvloop if it is one, else the standard loop."""
    return loop_factory("uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio")
