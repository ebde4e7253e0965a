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
import types
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from .._util._loop import loop_factory
from .._util._timeouts import Timeout, to_seconds
from ..errors import DistError, DistNetworkError, DistTimeoutError, DistUsageError

if TYPE_CHECKING:  # (imported only when a world runs, as the functions below do)
    from ..store import Store
    from ..transport.local import LocalTransport

__all__ = [
    "WorldProcessError",
    "WorldProcesses",
    "free_port",
    "run_world",
    "run_world_processes",
    "start_world_processes",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

RankFn = Callable[[int, int], Awaitable[T]]
BlockingRankFn = Callable[[int, int], T]

#: Seconds to wait, after a rank failed, for the others to report how they failed.
_FAILURE_GRACE = 2.0

#: The operation a rank's failure happened in: its name and the global ranks of its group.
_WaitedIn = tuple[str, tuple[int, ...]]


def _waited_in(exc: BaseException) -> _WaitedIn | None:
    """The operation of this rank's default world that failed with ``exc``, if one did.

    Read from the world's flight recorder, before the world is destroyed; the earliest
    such operation is the one a caller awaiting its works in order saw fail.
    """
    from ..group import peek_world

    world = peek_world()
    if world is None or not isinstance(exc, DistError):
        return None
    text = f"{type(exc).__name__}: {exc}"
    for record in world.recorder.records():
        if record.state == "failed" and record.error == text:
            return record.op, tuple(record.peers)
    return None


def _returned_text(ranks: Collection[int]) -> str:
    """``"rank 1 already returned (its function ended)"``, or the plural for several."""
    if len(ranks) == 1:
        return f"rank {next(iter(ranks))} already returned (its function ended)"
    return f"ranks {sorted(ranks)} already returned (their functions ended)"


def _early_return(rank: int, waited: _WaitedIn | None, returned: Collection[int]) -> str | None:
    """Why ``rank`` failed, when ranks of the operation it waited in had already returned:
    ``"rank 1 already returned (its function ended) while rank 0 waited for it in
    all_reduce"``; ``None`` when none had."""
    if waited is None:
        return None
    op, members = waited
    early = sorted(set(returned) & set(members) - {rank})
    if not early:
        return None
    them = "it" if len(early) == 1 else "them"
    return f"{_returned_text(early)} while rank {rank} waited for {them} in {op}"


def _still_running(
    what: str, missing: list[int], seconds: float | None, returned: Collection[int]
) -> str:
    """The timeout message of a runner, naming the ranks that had returned meanwhile."""
    limit = "" if seconds is None else f" within {seconds:g} s"
    text = f"{what}: ranks {missing} did not finish{limit}"
    return f"{text}; {_returned_text(returned)}" if returned else text


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
    and the direct algorithms of ``aiodist.collectives.shm``), or
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
        DistTimeoutError: some rank did not finish within ``timeout`` (they are named, and
            so are the ranks that had already returned).
        DistNetworkError: an operation of a rank failed because ranks it waited for had
            already returned (their function ended and their group was destroyed): the
            message names them and the operation, e.g. ``"rank 1 already returned (its
            function ended) while rank 0 waited for it in all_reduce"``; the error the
            operation raised is its ``__cause__``.
        BaseException: the first exception a rank raised, with notes naming its rank and
            every other rank that failed too (their exceptions are retrieved, so the loop
            reports none of them as never retrieved); the other ranks are cancelled.
    """
    from .. import _api
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
            await _join(rank, world_size, backend, store, seconds, transport, local)
            try:
                result = await fn(rank, world_size)
            except BaseException as exc:
                failed_at[rank] = time.monotonic()  # before teardown makes the peers fail
                why = _early_return(rank, _waited_in(exc), returned_at)
                if why is None:
                    if not isinstance(exc, asyncio.CancelledError):
                        # (Kept now: a teardown that outlasts the grace below is cancelled.)
                        raised[rank] = exc
                    raise
                # Raised where fn awaited the operation (the line a test report shows); its
                # own error, the cause, has every frame.
                error = DistNetworkError(why)
                raised[rank] = error
                raise error.with_traceback(_to_own_code(exc.__traceback__)) from exc
            else:
                returned_at[rank] = time.monotonic()  # before teardown makes the peers fail
                return result
            finally:
                if _api.is_initialized():
                    await _api.destroy_process_group()
        except BaseException:
            failed_at.setdefault(rank, time.monotonic())
            raise

    # rank -> when its fn raised: the earliest failure is the root cause, the others
    # usually follow from it (their group was aborted).
    failed_at: dict[int, float] = {}
    # rank -> when its fn returned: a peer that fails after that waited for it in vain.
    returned_at: dict[int, float] = {}
    # rank -> what its fn raised (the exception its task ends with, unless its teardown
    # was cancelled).
    raised: dict[int, BaseException] = {}
    tasks = [asyncio.create_task(one(r), name=f"aiodist-rank-{r}") for r in range(world_size)]
    await _wait_for_ranks(tasks, seconds, failed_at)
    return await _outcome(tasks, seconds, failed_at, returned_at, raised)


async def _join(
    rank: int,
    world_size: int,
    backend: str | None,
    store: Store,
    seconds: float | None,
    transport: str,
    local: list[LocalTransport] | None,
) -> None:
    """Give this task's context a world of its own and join it as ``rank`` (over the
    in-process transports ``local``, else through ``init_process_group``)."""
    from .. import _api, group
    from ..backends import parse_backend

    group.isolate_context()  # this task's context gets a world of its own
    if local is not None:
        name, devices = parse_backend(backend)
        group.start_world(local[rank], store, backend=name, backends=devices, timeout=seconds)
    else:
        await _api.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=seconds,
            shared_memory=None if transport == "shm" else False,
        )


async def _wait_for_ranks(
    tasks: list[asyncio.Task[T]], seconds: float | None, failed_at: dict[int, float]
) -> None:
    """Wait until every rank's task ended, one failed, or ``seconds`` passed."""
    try:
        _, pending = await asyncio.wait(tasks, timeout=seconds, return_when=asyncio.FIRST_EXCEPTION)
        # The others get a grace period to end: a rank that failed too (usually because its
        # group was aborted) or is still tearing down is reported, not cancelled, and the
        # earliest failure is the root cause, not the fastest teardown.
        if pending and failed_at:
            await asyncio.wait(pending, timeout=_FAILURE_GRACE)
    except BaseException:
        await _cancel(tasks)
        raise


async def _outcome(
    tasks: list[asyncio.Task[T]],
    seconds: float | None,
    failed_at: dict[int, float],
    returned_at: dict[int, float],
    raised: dict[int, BaseException],
) -> list[T]:
    """The ranks' results, once :func:`_wait_for_ranks` returned; the ranks still running
    are cancelled.

    Raises:
        BaseException: the earliest failure, with notes naming the other failed ranks.
        DistTimeoutError: some ranks were still running (named).
    """
    world_size = len(tasks)
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
    failures = {**raised, **failures}
    if failures:
        first = min(failures, key=lambda r: failed_at.get(r, float("inf")))
        raise _with_notes(failures, first, world_size)
    if pending:
        missing = [r for r, t in enumerate(tasks) if t in pending]
        raise DistTimeoutError(_still_running("run_world", missing, seconds, returned_at))
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


def _is_plumbing(tb: types.TracebackType) -> bool:
    """Whether ``tb``'s frame is aiodist's or the event loop's, not the rank's own code."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    event_loop = os.path.dirname(os.path.abspath(asyncio.__file__)) + os.sep
    path = tb.tb_frame.f_code.co_filename
    # Not an absolute path: compiled frames such as uvloop's "uvloop/loop.pyx".
    return path.startswith((package, event_loop)) or not os.path.isabs(path)


def _to_own_code(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` without its first frame (the runner's), ending at its last frame in the rank's
    own code: the line that awaited the operation. ``tb`` itself when none is its own."""
    frames = []
    entry = tb.tb_next if tb is not None else None
    while entry is not None:
        frames.append(entry)
        entry = entry.tb_next
    own = [i for i, entry in enumerate(frames) if not _is_plumbing(entry)]
    if not own:
        return tb
    cut = None
    for entry in reversed(frames[: own[-1] + 1]):
        cut = types.TracebackType(cut, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return cut


def _format_failure(exc: BaseException) -> str:
    """``exc``'s traceback, from the rank's own code on when it passed through that code.

    The frames before it (this runner, the event loop) are left out; a failure that never
    reached the rank's code (in ``init_process_group``, say) keeps every frame.
    """
    tb = exc.__traceback__
    while tb is not None and _is_plumbing(tb):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))


def _child(
    fn: RankFn[Any] | BlockingRankFn[Any],
    rank: int,
    world_size: int,
    env: dict[str, str],
    backend: str | None,
    timeout: float | None,
    init_group: bool,
    conn: multiprocessing.connection.Connection,
) -> None:
    os.environ.update(env)
    # When the failure happened, before tearing down (which makes the peers fail too), and
    # the operation it happened in; or when fn returned, before tearing down.
    failed_at: list[float] = []
    waited: list[_WaitedIn | None] = []
    returned_at: list[float] = []

    def note_failure(exc: BaseException | None = None) -> None:
        if not failed_at:
            failed_at.append(time.time())
            waited.append(None if exc is None else _waited_in(exc))

    async def run_async() -> Any:
        from .. import _api

        if init_group:
            await _api.init_process_group(backend, timeout=timeout)
        try:
            result = await fn(rank, world_size)
        except BaseException as exc:
            note_failure(exc)
            raise
        else:
            returned_at.append(time.time())
            return result
        finally:
            if init_group:
                await _api.destroy_process_group()

    def run_blocking() -> Any:
        # The blocking facade runs its own loop in a thread of this process; the function
        # runs here, in the main thread, as a script would.
        from .. import sync

        if init_group:
            sync.init_process_group(backend, timeout=timeout)
        try:
            result = fn(rank, world_size)
        except BaseException as exc:
            note_failure(exc)
            raise
        else:
            returned_at.append(time.time())
            return result
        finally:
            if init_group:
                sync.destroy_process_group()

    try:
        if _is_async(fn):
            loop = loop_factory(os.environ.get("AIODIST_LOOP", "auto"))
            with asyncio.Runner(loop_factory=loop) as runner:
                result = runner.run(run_async())
        else:
            result = run_blocking()
        conn.send(("ok", (returned_at[0], result)))
    except BaseException as exc:
        note_failure()
        conn.send(("error", (failed_at[0], waited[0], _format_failure(exc))))
        raise SystemExit(1) from None
    finally:
        conn.close()


class WorldProcesses(Generic[T]):
    """The running processes of a world that :func:`start_world_processes` started.

    :meth:`results` waits for the ranks' results; :meth:`kill` (or leaving a ``with`` block)
    kills every process still running. ``procs`` lets a test kill one rank, or read its pid,
    while the others run on.

    Attributes:
        procs: the process of each rank, indexed by rank.
        store_address: ``(MASTER_ADDR, MASTER_PORT)``: where rank 0 hosts the job's store.
    """

    def __init__(self, timeout: float, what: str, store_address: tuple[str, int]) -> None:
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.store_address = store_address
        # rank -> the end of its pipe, until its outcome is read.
        self._conns: dict[int, multiprocessing.connection.Connection] = {}
        self._timeout = timeout
        self._what = what
        self._results: dict[int, T] = {}
        # rank -> when its fn returned (before its group was destroyed).
        self._returned_at: dict[int, float] = {}
        # rank -> (when it failed, the operation it failed in, message); the earliest
        # failure is the root cause, the others usually follow from it (a peer went away).
        self._failures: dict[int, tuple[float, _WaitedIn | None, str]] = {}

    def __repr__(self) -> str:
        alive = [r for r, p in enumerate(self.procs) if p.is_alive()]
        return f"<WorldProcesses size={len(self.procs)} running={alive}>"

    def __enter__(self) -> WorldProcesses[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill()

    def results(
        self, timeout: float | None = None, ranks: Collection[int] | None = None
    ) -> list[T]:
        """Wait for the ranks to finish and return their results.

        Only the ranks of ``ranks`` are waited for and reported on: leave out those the test
        killed. A rank's result is kept, so a later call returns it again.

        Args:
            timeout: seconds to wait; ``None`` keeps the ``timeout`` given to
                :func:`start_world_processes`.
            ranks: the ranks to wait for, by default every rank.

        Returns:
            The results of ``fn``, one per rank of ``ranks``, in the order of ``ranks``
            (indexed by rank when every rank is waited for).

        Raises:
            DistUsageError: ``ranks`` holds something other than a rank of this world.
            WorldProcessError: a rank waited for raised (its traceback is in the message)
                or died; every process is killed. When ranks the failing operation waited
                for had already returned, the first line says so: ``"rank 0 failed: rank 1
                already returned (its function ended) while rank 0 waited for it in
                all_reduce"``.
            DistTimeoutError: ranks waited for still running after ``timeout`` (they are
                named, and so are the ranks that had already returned); every process is
                killed.
        """
        wanted = list(range(len(self.procs))) if ranks is None else list(ranks)
        for rank in wanted:
            if not isinstance(rank, int) or isinstance(rank, bool):
                raise DistUsageError(f"ranks must hold ints, got {rank!r}")
            if not 0 <= rank < len(self.procs):
                raise DistUsageError(
                    f"rank {rank} is not a rank of this world of {len(self.procs)}"
                )
        seconds = self._timeout if timeout is None else timeout
        try:
            self._collect(set(wanted), seconds)
        except BaseException:
            self.kill()
            raise
        for rank in wanted:
            self.procs[rank].join(10)
        return [self._results[r] for r in wanted]

    def _collect(self, wanted: set[int], seconds: float) -> None:
        """Read the outcome of every rank of ``wanted`` not read yet; raise for a failure."""
        deadline = time.monotonic() + seconds
        while conns := {c: r for r, c in self._conns.items() if r in wanted}:
            if self._failures.keys() & wanted:
                deadline = min(deadline, time.monotonic() + _FAILURE_GRACE)
            left = deadline - time.monotonic()
            ready = multiprocessing.connection.wait(list(conns), timeout=max(0.0, left))
            if not ready:
                if self._failures.keys() & wanted:
                    break
                missing = sorted(conns.values())
                raise DistTimeoutError(
                    _still_running(self._what, missing, seconds, self._returned_at)
                )
            for c in ready:
                assert isinstance(c, multiprocessing.connection.Connection)
                self._read(conns[c])
        failures = {r: f for r, f in self._failures.items() if r in wanted}
        if failures:
            first = min(failures, key=lambda r: failures[r][0])
            when, waited, message = failures[first]
            early = [r for r, t in self._returned_at.items() if t <= when]
            why = _early_return(first, waited, early)
            if why is not None:  # "rank 0 failed: rank 1 already returned ..."
                message = message.replace(":\n", f": {why}\n", 1)
            others = sorted(set(failures) - {first})
            also = f"\n(ranks {others} failed afterwards)" if others else ""
            raise WorldProcessError(first, message + also)

    def _read(self, rank: int) -> None:
        """Read what ``rank`` sent: its result, its failure, or nothing (it died)."""
        conn = self._conns.pop(rank)
        try:
            status, payload = conn.recv()
        except EOFError:
            self.procs[rank].join(5)
            self._failures[rank] = (
                time.time(),
                None,
                f"rank {rank} died without a result (exit code {self.procs[rank].exitcode})",
            )
            return
        finally:
            conn.close()
        if status == "error":
            when, waited, text = payload
            self._failures[rank] = (when, waited, f"rank {rank} failed:\n{text}")
        else:
            self._returned_at[rank], self._results[rank] = payload

    def kill(self) -> None:
        """Kill every process still running and wait for them to end (at once, for a world
        whose ranks all finished). Calling it again does nothing more."""
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            with contextlib.suppress(Exception):
                proc.join(5)


def _start(
    fn: RankFn[T] | BlockingRankFn[T],
    world_size: int,
    backend: str | None,
    timeout: float,
    env: dict[str, str] | None,
    init_group: bool,
    what: str,
) -> WorldProcesses[T]:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise DistUsageError(f"world_size must be a positive integer, got {world_size!r}")
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    world: WorldProcesses[T] = WorldProcesses(timeout, what, ("127.0.0.1", port))
    try:
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
                args=(fn, rank, world_size, child_env, backend, timeout, init_group, send_end),
                name=f"aiodist-rank-{rank}",
                daemon=True,
            )
            world._conns[rank] = recv_end
            world.procs.append(proc)
            try:
                proc.start()
            finally:
                send_end.close()  # the child holds its own: a dead child reads as EOF
    except BaseException:
        world.kill()
        raise
    return world


def start_world_processes(
    fn: RankFn[T] | BlockingRankFn[T],
    world_size: int,
    backend: str | None = "cpu",
    *,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    init_group: bool = True,
) -> WorldProcesses[T]:
    """Start ``fn(rank, world_size)`` in ``world_size`` new processes and return at once.

    The processes are those of :func:`run_world_processes`, which is built on this: use it
    when a test acts on the world while it runs (kills a rank through
    the handle's ``procs``, waits for a key a rank sets), then collects the results
    with :meth:`WorldProcesses.results`. Use the handle in a ``with`` block, which kills
    what still runs when it ends::

        with start_world_processes(fn, 3) as world:
            ...  # wait until the ranks are busy
            world.procs[1].kill()
            survivors = world.results(ranks=[0, 2])

    Args:
        fn: a function of ``(rank, world_size)``, async or blocking (as for
            :func:`run_world_processes`).
        world_size: the number of processes.
        backend: passed to ``init_process_group``.
        timeout: the groups' operation timeout, and how long :meth:`WorldProcesses.results`
            waits by default.
        env: extra environment variables for the children.
        init_group: whether each child joins the default process group before ``fn`` runs
            (and leaves it after); ``False`` calls ``fn`` alone, for code below the process
            group (a store, a transport) that sets up what it needs itself.

    Returns:
        The running processes.

    Raises:
        DistUsageError: ``world_size`` is not a positive integer.
    """
    return _start(fn, world_size, backend, timeout, env, init_group, "start_world_processes")


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
    partial of one, with picklable arguments). :func:`start_world_processes` starts the
    same processes without waiting for them, and can leave the group out.

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
            other ranks are terminated. When ranks the failing operation waited for had
            already returned, the first line says so: ``"rank 0 failed: rank 1 already
            returned (its function ended) while rank 0 waited for it in all_reduce"``.
        DistTimeoutError: ranks still running after ``timeout`` (they are named and killed,
            and so are the ranks that had already returned).
    """
    with _start(fn, world_size, backend, timeout, env, True, "run_world_processes") as world:
        return world.results()
