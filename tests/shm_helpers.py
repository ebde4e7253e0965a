"""Helpers for the shared-memory tests: worlds of ranks as tasks or as processes."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import traceback
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiodist._loop import loop_factory
from aiodist.store import FileStore, HashStore
from aiodist.transport._shm_segment import SHM_DIR, job_prefix
from aiodist.transport.shm import ShmTransport

RankFn = Callable[..., Awaitable[Any]]


def new_job() -> str:
    """A job key no other test (or person on this machine) uses."""
    return f"test-{uuid.uuid4().hex}"


def leftovers(job: str) -> list[str]:
    """The files in /dev/shm that belong to ``job``."""
    prefix = job_prefix(job)
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))


async def shm_world(n: int, job: str, **kwargs: Any) -> list[ShmTransport]:
    """``n`` connected ShmTransports as tasks of this loop, meeting through a HashStore."""
    store = HashStore()
    return list(
        await asyncio.gather(
            *(ShmTransport.create(store, r, n, timeout=10, job_key=job, **kwargs) for r in range(n))
        )
    )


def _child(
    fn: RankFn, rank: int, n: int, store_path: str, args: tuple[Any, ...], conn: Any
) -> None:
    async def main() -> Any:
        return await fn(FileStore(store_path), rank, n, *args)

    try:
        with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
            result = runner.run(main())
        conn.send(("ok", result))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


class ProcessWorld:
    """``n`` processes, each running ``await fn(store, rank, n, *args)`` with a FileStore.

    Use ``start()``, then ``results()``; ``procs`` gives access to kill one.
    """

    def __init__(self, fn: RankFn, n: int, store_path: str, *args: Any) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        self._sends: list[Any] = []
        for rank in range(n):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child, args=(fn, rank, n, store_path, args, send), daemon=True
            )
            self.conns.append(recv)
            self.procs.append(proc)
            self._sends.append(send)

    def start(self) -> ProcessWorld:
        for proc in self.procs:
            proc.start()
        for send in self._sends:  # the children hold theirs: a dead child reads as EOF
            send.close()
        return self

    def results(self, timeout: float = 60.0, ranks: list[int] | None = None) -> list[Any]:
        """The result of each rank (``ranks``: only those); a rank's exception is re-raised
        as AssertionError with its traceback."""
        out = []
        for rank in ranks if ranks is not None else range(len(self.procs)):
            conn = self.conns[rank]
            if not conn.poll(timeout):
                self.kill()
                raise AssertionError(f"rank {rank} did not finish within {timeout} s")
            try:
                status, value = conn.recv()
            except EOFError:
                status, value = "error", f"died (exit code {self.procs[rank].exitcode})"
            if status != "ok":
                self.kill()
                raise AssertionError(f"rank {rank} failed:\n{value}")
            out.append(value)
        for rank in ranks if ranks is not None else range(len(self.procs)):
            self.procs[rank].join(10)
        return out

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)


def run_processes(
    fn: RankFn, n: int, store_path: str, *args: Any, timeout: float = 60
) -> list[Any]:
    """Run ``fn`` on ``n`` processes and return their results (see :class:`ProcessWorld`)."""
    world = ProcessWorld(fn, n, store_path, *args).start()
    try:
        return world.results(timeout)
    finally:
        world.kill()
