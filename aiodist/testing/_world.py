"""Running a function on every rank of a small world: as tasks of one loop, or as processes."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import multiprocessing
import multiprocessing.connection
import os
import socket
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, TypeVar

from .._loop import loop_factory
from .._timeouts import Timeout, to_seconds
from ..errors import DistError, DistTimeoutError, DistUsageError

__all__ = ["WorldProcessError", "free_port", "run_world", "run_world_processes"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

RankFn = Callable[[int, int], Awaitable[T]]
BlockingRankFn = Callable[[int, int], T]

#: Seconds to wait, after a rank failed, for the others to report how they failed.
_FAILURE_GRACE = 2.0


async def run_world(
    fn: RankFn[T],
    world_size: int,
    backend: str | None = "cpu",
    *,
    timeout: Timeout = 60.0,
    transport: Literal["tcp", "shm", "local"] = "tcp",
) -> list[T]:
    """Run ``await fn(rank, world_size)`` on ``world_size`` ranks as tasks of the running loop.

    Each rank is a task with a default process group of its own (the default group lives
    in a :class:`contextvars.ContextVar`): inside ``fn``, ``aiodist.all_reduce(x)`` and
    friends work as they would in a separate process. The ranks meet through one shared
    :class:`~aiodist.HashStore` and talk over real loopback TCP (``transport="tcp"``),
    shared memory as ranks on one host do (``transport="shm"``: the shared-memory transport
    and the direct algorithms of :mod:`aiodist.collectives.shm`), or
    the in-process transport (``transport="local"``). Each rank's group is destroyed when
    its ``fn`` returns.

    Args:
        fn: an async function of ``(rank, world_size)``.
        world_size: the number of ranks.
        backend: passed to ``init_process_group``.
        timeout: limit for the whole run, also the groups' operation timeout.
        transport: ``"tcp"``, ``"shm"`` or ``"local"``.

    Returns:
        The results of ``fn``, indexed by rank.

    Raises:
        DistUsageError: ``world_size`` is not a positive integer or ``transport`` is unknown.
        DistTimeoutError: some rank did not finish within ``timeout`` (they are named).
        BaseException: the first exception a rank raised, with notes naming its rank and
            every other rank that failed too (their exceptions are retrieved, so the loop
            reports none of them as never retrieved); the other ranks are cancelled.
    """
    from .. import _api, group
    from ..backends import parse_backend
    from ..store import HashStore
    from ..transport.local import LocalTransport

    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise DistUsageError(f"world_size must be a positive integer, got {world_size!r}")
    if transport not in ("tcp", "shm", "local"):
        raise DistUsageError(f"transport must be 'tcp', 'shm' or 'local', got {transport!r}")
    seconds = to_seconds(timeout, None)
    store = HashStore(timeout=seconds)
    local = LocalTransport.create_world(world_size) if transport == "local" else None

    async def one(rank: int) -> T:
        try:
            group.isolate_context()  # this task's context gets a world of its own
            if local is not None:
                name, devices = parse_backend(backend)
                group.start_world(
                    local[rank], store, backend=name, backends=devices, timeout=seconds
                )
            else:
                await _api.init_process_group(
                    backend,
                    store=store,
                    rank=rank,
                    world_size=world_size,
                    timeout=seconds,
                    shared_memory=None if transport == "shm" else False,
                )
            try:
                return await fn(rank, world_size)
            except BaseException:
                failed_at[rank] = time.monotonic()  # before teardown makes the peers fail
                raise
            finally:
                if _api.is_initialized():
                    await _api.destroy_process_group()
        except BaseException:
            failed_at.setdefault(rank, time.monotonic())
            raise

    # rank -> when its fn raised: the earliest failure is the root cause, the others
    # usually follow from it (their group was aborted).
    failed_at: dict[int, float] = {}
    tasks = [asyncio.create_task(one(r), name=f"aiodist-rank-{r}") for r in range(world_size)]
    try:
        _, pending = await asyncio.wait(tasks, timeout=seconds, return_when=asyncio.FIRST_EXCEPTION)
        # Ranks that already failed but are still tearing down finish first, so the
        # earliest failure is reported, not the fastest teardown.
        tearing_down = [tasks[r] for r in failed_at if tasks[r] in pending]
        if tearing_down:
            await asyncio.wait(tearing_down, timeout=_FAILURE_GRACE)
    except BaseException:
        await _cancel(tasks)
        raise
    pending = {t for t in tasks if not t.done()}
    if pending:
        await _cancel(tasks)
    # Every failed task's exception is retrieved here, so none is left for the loop to
    # report as "never retrieved"; the earliest is raised, the later ones become notes.
    failures = {
        r: exc
        for r, t in enumerate(tasks)
        if t.done() and not t.cancelled() and (exc := t.exception()) is not None
    }
    if failures:
        first = min(failures, key=lambda r: failed_at.get(r, float("inf")))
        raise _with_notes(failures, first, world_size)
    if pending:
        missing = [r for r, t in enumerate(tasks) if t in pending]
        raise DistTimeoutError(f"run_world: ranks {missing} did not finish within {seconds:g} s")
    return [t.result() for t in tasks]


def _with_notes(failures: dict[int, BaseException], first: int, world_size: int) -> BaseException:
    """The exception of rank ``first``, with notes naming its rank and the later failures."""
    exc = failures[first]
    exc.add_note(f"run_world: raised on rank {first} of {world_size}")
    for rank in sorted(failures):
        other = failures[rank]
        if rank != first and other is not exc and not isinstance(other, asyncio.CancelledError):
            exc.add_note(f"run_world: rank {rank} failed too: {type(other).__name__}: {other}")
    return exc


async def _cancel(tasks: Sequence[asyncio.Task[Any]]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class WorldProcessError(DistError):
    """A rank of :func:`run_world_processes` failed; the message holds its traceback.

    Attributes:
        rank: the failing rank.
    """

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


def free_port() -> int:
    """Return a TCP port that is free on loopback now (for a master port a test chooses).

    Another process may take it before the caller binds it; a store that can take port 0
    instead (``TCPStore.create(host, 0, is_master=True)``) never races.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _is_async(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` gives a coroutine: an async function, a partial of one, or an
    object whose ``__call__`` is one."""
    call = type(fn).__call__
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


def _format_failure(exc: BaseException) -> str:
    """``exc``'s traceback, from the rank's own code on when it passed through that code.

    The frames before it (this runner, the event loop) are left out; a failure that never
    reached the rank's code (in ``init_process_group``, say) keeps every frame.
    """
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    event_loop = os.path.dirname(os.path.abspath(asyncio.__file__)) + os.sep

    def plumbing(path: str) -> bool:
        # Not an absolute path: compiled frames such as uvloop's "uvloop/loop.pyx".
        return path.startswith((package, event_loop)) or not os.path.isabs(path)

    tb = exc.__traceback__
    while tb is not None and plumbing(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))


def _child(
    fn: RankFn[Any] | BlockingRankFn[Any],
    rank: int,
    world_size: int,
    env: dict[str, str],
    backend: str | None,
    timeout: float | None,
    conn: multiprocessing.connection.Connection,
) -> None:
    os.environ.update(env)
    # When the failure happened, before tearing down (which makes the peers fail too).
    failed_at: list[float] = []

    def note_failure() -> None:
        if not failed_at:
            failed_at.append(time.time())

    async def run_async() -> Any:
        from .. import _api

        await _api.init_process_group(backend, timeout=timeout)
        try:
            return await fn(rank, world_size)
        except BaseException:
            note_failure()
            raise
        finally:
            await _api.destroy_process_group()

    def run_blocking() -> Any:
        # The blocking facade runs its own loop in a thread of this process; the function
        # runs here, in the main thread, as a script would.
        from .. import sync

        sync.init_process_group(backend, timeout=timeout)
        try:
            return fn(rank, world_size)
        except BaseException:
            note_failure()
            raise
        finally:
            sync.destroy_process_group()

    try:
        if _is_async(fn):
            loop = loop_factory(os.environ.get("AIODIST_LOOP", "auto"))
            with asyncio.Runner(loop_factory=loop) as runner:
                result = runner.run(run_async())
        else:
            result = run_blocking()
        conn.send(("ok", result))
    except BaseException as exc:
        note_failure()
        conn.send(("error", (failed_at[0], _format_failure(exc))))
        raise SystemExit(1) from None
    finally:
        conn.close()


def run_world_processes(
    fn: RankFn[T] | BlockingRankFn[T],
    world_size: int,
    backend: str | None = "cpu",
    *,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[T]:
    """Run ``fn(rank, world_size)`` in ``world_size`` new processes on loopback.

    Blocks until every rank has finished. Each child gets ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1`` and a free
    ``MASTER_PORT`` and joins the default process group through ``env://`` (rank 0 hosts
    the TCPStore):

    * an async ``fn`` (or a ``functools.partial`` of one) is awaited on a fresh event loop
      (``$AIODIST_LOOP``: ``auto``, ``uvloop`` or ``asyncio``) after
      ``await aiodist.init_process_group()``;
    * a plain ``fn`` is called in the child's main thread after
      ``aiodist.sync.init_process_group()``, so it uses the blocking API
      (``import aiodist.sync as dist``) as a script would.

    The result of ``fn`` is sent back, so it must be picklable. Processes are started with
    ``spawn``, so ``fn`` must be a module-level function of an importable module (or a
    partial of one, with picklable arguments).

    Args:
        fn: a function of ``(rank, world_size)``, async or blocking.
        world_size: the number of processes.
        backend: passed to ``init_process_group``.
        timeout: seconds for the whole run, also the groups' operation timeout.
        env: extra environment variables for the children.

    Returns:
        The results of ``fn``, indexed by rank.

    Raises:
        DistUsageError: ``world_size`` is not a positive integer.
        WorldProcessError: a rank raised (its traceback is in the message) or died; the
            other ranks are terminated.
        DistTimeoutError: ranks still running after ``timeout`` (they are named and killed).
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise DistUsageError(f"world_size must be a positive integer, got {world_size!r}")
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs: list[multiprocessing.process.BaseProcess] = []
    conns: dict[multiprocessing.connection.Connection, int] = {}
    for rank in range(world_size):
        child_env = {
            **(env or {}),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        recv_end, send_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_child,
            args=(fn, rank, world_size, child_env, backend, timeout, send_end),
            name=f"aiodist-rank-{rank}",
            daemon=True,
        )
        proc.start()
        send_end.close()
        procs.append(proc)
        conns[recv_end] = rank
    results: dict[int, Any] = {}
    # rank -> (when it failed, message); the earliest failure is the root cause, the
    # others usually follow from it (their peer went away).
    failures: dict[int, tuple[float, str]] = {}
    deadline = time.monotonic() + timeout
    try:
        while conns:
            if failures:
                deadline = min(deadline, time.monotonic() + _FAILURE_GRACE)
            left = deadline - time.monotonic()
            ready = multiprocessing.connection.wait(list(conns), timeout=max(0.0, left))
            if not ready:
                if failures:
                    break
                missing = sorted(conns.values())
                raise DistTimeoutError(
                    f"run_world_processes: ranks {missing} did not finish within {timeout:g} s"
                )
            for c in ready:
                assert isinstance(c, multiprocessing.connection.Connection)
                rank = conns.pop(c)
                try:
                    status, payload = c.recv()
                except EOFError:
                    procs[rank].join(5)
                    failures[rank] = (
                        time.time(),
                        f"rank {rank} died without a result (exit code {procs[rank].exitcode})",
                    )
                    continue
                finally:
                    c.close()
                if status == "error":
                    when, text = payload
                    failures[rank] = (when, f"rank {rank} failed:\n{text}")
                else:
                    results[rank] = payload
        if failures:
            first = min(failures, key=lambda r: failures[r][0])
            others = sorted(set(failures) - {first})
            also = f"\n(ranks {others} failed afterwards)" if others else ""
            raise WorldProcessError(first, failures[first][1] + also)
        for p in procs:
            p.join(10)
    finally:
        for c in conns:
            c.close()
        for p in procs:
            if p.is_alive():
                p.kill()
            with contextlib.suppress(Exception):
                p.join(5)
    return [results[r] for r in range(world_size)]
