"""The blocking facade: ``import aiodist.sync as dist``, with ``torch.distributed``'s names.

Everything here runs the async core on one event loop that lives in a daemon thread of this
process (``aiodist-loop``; uvloop when installed, or as ``$AIODIST_LOOP`` says: ``auto``,
``uvloop``, ``asyncio``). The thread starts on the first blocking call and stops at interpreter
exit. No global event-loop policy is touched, so the caller's own asyncio code is unaffected.

Every blocking call goes through :func:`_run`, which

* refuses to run on the loop thread itself (that would deadlock) with a ``DistUsageError``,
* on Ctrl-C (``KeyboardInterrupt`` in the calling thread) cancels the operation on the loop
  and re-raises at once,
* may be used from any number of threads at the same time.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextvars
import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Coroutine, Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any, Concatenate, Generic, ParamSpec, Self, TypeVar, overload

from . import _api as _aio_api, group as _group, store as _aio
from ._loop import loop_factory
from ._ops import ReduceOp
from ._timeouts import Timeout, to_seconds
from .errors import DistError, DistTimeoutError, DistUsageError
from .group import NON_GROUP_MEMBER, NonGroupMember, ProcessGroup
from .rendezvous import get_node_local_rank

__all__ = [
    "NON_GROUP_MEMBER",
    "Backend",
    "FileStore",
    "GroupMember",
    "HashStore",
    "P2POp",
    "PrefixStore",
    "ProcessGroup",
    "ReduceOp",
    "Store",
    "TCPStore",
    "Work",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "gather",
    "gather_object",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_node_local_rank",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "group",
    "init_process_group",
    "irecv",
    "is_available",
    "is_backend_available",
    "is_gloo_available",
    "is_initialized",
    "is_nccl_available",
    "is_torchelastic_launched",
    "isend",
    "monitored_barrier",
    "new_group",
    "new_subgroups",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
P = ParamSpec("P")

#: torch's default store timeout.
_DEFAULT_STORE_TIMEOUT = timedelta(seconds=300)

#: How long interpreter exit waits for the loop thread to close stores and stop (seconds).
_SHUTDOWN_TIMEOUT = 5.0


class _LoopThread:
    """The process's event loop thread, started on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None

    def __repr__(self) -> str:
        state = "running" if self._thread is not None and self._thread.is_alive() else "stopped"
        return f"<aiodist loop thread {state} loop={self._loop!r}>"

    @property
    def ident(self) -> int | None:
        """The loop thread's id, or ``None`` when it is not running."""
        thread = self._thread
        return thread.ident if thread is not None else None

    def loop(self) -> asyncio.AbstractEventLoop:
        """Return the running loop, starting the thread if needed."""
        loop = self._loop
        if loop is not None:
            return loop
        with self._lock:
            if self._loop is None:
                self._start()
            assert self._loop is not None
            return self._loop

    def _start(self) -> None:
        factory = loop_factory(os.environ.get("AIODIST_LOOP", "auto"))
        ready = threading.Event()
        failure: list[BaseException] = []

        async def serve() -> None:
            self._stopping = asyncio.Event()
            self._loop = asyncio.get_running_loop()
            ready.set()
            await self._stopping.wait()

        def main() -> None:
            try:
                with asyncio.Runner(loop_factory=factory) as runner:
                    runner.run(serve())
            except BaseException as exc:  # reported to the starting thread, or logged
                failure.append(exc)
                ready.set()
                logger.exception("aiodist's event-loop thread failed")

        thread = threading.Thread(target=main, name="aiodist-loop", daemon=True)
        thread.start()
        ready.wait()
        if failure:
            raise DistUsageError(f"cannot start aiodist's event-loop thread: {failure[0]}")
        self._thread = thread
        logger.debug("started the event-loop thread %r", self)

    def stop(self, timeout: float = _SHUTDOWN_TIMEOUT) -> None:
        """Stop the loop and wait (up to ``timeout``) for the thread to end."""
        with self._lock:
            loop, thread, stopping = self._loop, self._thread, self._stopping
            self._loop = self._thread = self._stopping = None
        if loop is None or thread is None or stopping is None:
            return
        if threading.get_ident() == thread.ident:
            raise DistUsageError("the aiodist event loop cannot be stopped from its own thread")
        loop.call_soon_threadsafe(stopping.set)
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("aiodist's event-loop thread did not stop within %.1f s", timeout)

    def forget(self) -> None:
        """Drop the state inherited by a forked child: its loop thread does not exist there."""
        self._lock = threading.Lock()
        self._loop = self._thread = self._stopping = None


_loop_thread = _LoopThread()
os.register_at_fork(after_in_child=_loop_thread.forget)


def _run(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coro`` on the loop thread and block until it finishes; return its result.

    Args:
        coro: the coroutine to run.
        timeout: seconds to wait; ``None`` waits as long as the coroutine runs.

    Raises:
        DistUsageError: called from the loop thread (it would wait for itself forever).
        DistTimeoutError: ``timeout`` passed; the coroutine was cancelled.
        KeyboardInterrupt: Ctrl-C while waiting; the coroutine was cancelled.
    """
    if threading.get_ident() == _loop_thread.ident:
        coro.close()
        raise DistUsageError(
            "a blocking aiodist.sync call was made on aiodist's event-loop thread (from a "
            "coroutine or callback running there), where it would wait for itself forever; "
            "await the async API (import aiodist) there instead"
        )
    future = asyncio.run_coroutine_threadsafe(coro, _loop_thread.loop())
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        # The builtin TimeoutError is this class: a DistTimeoutError the coroutine raised
        # arrives here too, with the future done.
        if future.done():
            raise
        future.cancel()
        raise DistTimeoutError(f"blocking call did not finish within {timeout} s") from None
    except BaseException:
        # KeyboardInterrupt (or SystemExit) in this thread: stop the operation on the loop.
        future.cancel()
        raise


# -- stores ---------------------------------------------------------------------------------
class _Blocking(Generic[P, T]):
    """A blocking method that runs the async store method of the same name on the loop."""

    def __init__(self, method: Callable[Concatenate[_aio.Store, P], Coroutine[Any, Any, T]]):
        self._name = method.__name__
        self.__doc__ = method.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Self: ...
    @overload
    def __get__(self, obj: Store, owner: type | None = None) -> Callable[P, T]: ...
    def __get__(self, obj: Store | None, owner: type | None = None) -> Self | Callable[P, T]:
        if obj is None:
            return self
        method = getattr(obj.async_store, self._name)

        def call(*args: P.args, **kwargs: P.kwargs) -> T:
            result: T = _run(method(*args, **kwargs))
            return result

        call.__name__ = self._name
        call.__doc__ = self.__doc__
        return call


_live_stores: weakref.WeakSet[Store] = weakref.WeakSet()


class Store:
    """A blocking store: the methods of an async :class:`aiodist.Store`, as in torch.

    Each method runs the async store's method of the same name on aiodist's loop thread and
    returns its result; errors are the async store's (``DistTimeoutError`` naming the keys,
    ``DistStoreError``, ``QueueEmptyError``, ...). Usable from several threads at once.
    Stores still open at interpreter exit are closed then.

    Args:
        store: the async store to drive.

    Raises:
        DistUsageError: ``store`` is not an async aiodist store.
    """

    def __init__(self, store: _aio.Store) -> None:
        if not isinstance(store, _aio.Store):
            raise DistUsageError(f"expected an aiodist Store, got {type(store).__name__}")
        self._store = store
        self._closed = False
        _live_stores.add(self)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} (blocking) {self._store!r}>"

    @property
    def async_store(self) -> _aio.Store:
        """The async store this one drives (use it from coroutines on the loop thread)."""
        return self._store

    @property
    def timeout(self) -> timedelta | None:
        """How long ``get``, ``wait`` and blocking ``queue_pop`` wait; ``None``: forever."""
        seconds = self._store.timeout
        return None if seconds is None else timedelta(seconds=seconds)

    def set_timeout(self, timeout: Timeout) -> None:
        """Set the wait deadline (``timedelta`` or seconds; ``None`` waits forever).

        Raises:
            DistUsageError: the timeout is negative or of the wrong type.
        """
        self._store.set_timeout(timeout)

    set = _Blocking(_aio.Store.set)
    get = _Blocking(_aio.Store.get)
    add = _Blocking(_aio.Store.add)
    compare_set = _Blocking(_aio.Store.compare_set)
    wait = _Blocking(_aio.Store.wait)
    check = _Blocking(_aio.Store.check)
    delete_key = _Blocking(_aio.Store.delete_key)
    num_keys = _Blocking(_aio.Store.num_keys)
    list_keys = _Blocking(_aio.Store.list_keys)
    multi_get = _Blocking(_aio.Store.multi_get)
    multi_set = _Blocking(_aio.Store.multi_set)
    append = _Blocking(_aio.Store.append)
    queue_push = _Blocking(_aio.Store.queue_push)
    queue_pop = _Blocking(_aio.Store.queue_pop)
    queue_len = _Blocking(_aio.Store.queue_len)
    barrier = _Blocking(_aio.Store.barrier)

    def clone(self) -> Store:
        """Return a new, independent handle to the same store (a new connection, if any)."""
        return Store(_run(self._store.clone()))

    def close(self) -> None:
        """Release the store's resources. Closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        _live_stores.discard(self)
        _run(self._store.aclose())

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class HashStore(Store):
    """A blocking in-process store (``torch.distributed.HashStore``)."""

    def __init__(self) -> None:
        super().__init__(_aio.HashStore())


class FileStore(Store):
    """A blocking store in a shared file (``torch.distributed.FileStore``).

    Args:
        file_name: path of the file (created if missing).
        world_size: the number of processes using the file, or ``-1`` if unknown; when known,
            the last of them to close removes the file.

    Raises:
        DistUsageError: ``file_name`` is empty or ``world_size`` is neither -1 nor positive.
    """

    def __init__(self, file_name: str | os.PathLike[str], world_size: int = -1) -> None:
        super().__init__(_aio.FileStore(file_name, world_size))


class PrefixStore(Store):
    """A blocking view of ``store`` in which each key ``k`` is ``prefix + "/" + k``.

    Args:
        prefix: the namespace.
        store: the blocking store to wrap (it stays open when this one is closed).

    Raises:
        DistUsageError: ``store`` is ``None`` or not a blocking aiodist store.
    """

    def __init__(self, prefix: str, store: Store) -> None:
        if not isinstance(store, Store):
            raise DistUsageError(
                "PrefixStore needs an aiodist.sync store, got "
                f"{'None' if store is None else type(store).__name__}"
            )
        super().__init__(_aio.PrefixStore(prefix, store.async_store))
        self._underlying = store

    @property
    def underlying_store(self) -> Store:
        """The store this one writes into."""
        return self._underlying


# Masters created with multi_tenant=True, by port: later instances on that port join them.
_tenants: weakref.WeakValueDictionary[int, TCPStore] = weakref.WeakValueDictionary()


class TCPStore(Store):
    """A blocking TCP store with ``torch.distributed.TCPStore``'s constructor.

    The master (``is_master=True``) serves the store from aiodist's loop thread, so it keeps
    serving while the calling thread blocks or computes.

    Args:
        host_name: the server's address (the master listens on exactly this address).
        port: the server's port; a master may pass 0 and read :attr:`port` afterwards.
        world_size: the number of store instances of the job (``None``: not known).
        is_master: start the server in this process.
        timeout: connect, join and wait deadline (``timedelta`` or seconds).
        wait_for_workers: the master waits until ``world_size`` instances have joined.
        multi_tenant: a master on a port this process already serves joins that server
            instead of starting another.
        master_listen_fd: not supported (must be ``None``).
        use_libuv: accepted for torch compatibility; the server is always asyncio's.
        **options: further keyword arguments of :meth:`aiodist.TCPStore.create`
            (``auth_token``, ``wire``, ``max_key_size``, ...).

    Raises:
        DistUsageError: bad arguments, or ``master_listen_fd`` given.
        DistNetworkError: the port is in use, or the server cannot be reached in time.
        DistTimeoutError: the master's workers did not all join in time.
    """

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: Timeout = _DEFAULT_STORE_TIMEOUT,
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: int | None = None,
        use_libuv: bool = True,
        **options: Any,
    ) -> None:
        if master_listen_fd is not None:
            raise DistUsageError("TCPStore(master_listen_fd=...) is not supported by aiodist")
        if is_master and multi_tenant and port != 0 and port in _tenants:
            is_master = False
        store = _run(
            _aio.TCPStore.create(
                host_name, port, world_size, is_master, timeout, wait_for_workers, **options
            )
        )
        super().__init__(store)
        self._tcp = store
        if is_master and multi_tenant:
            _tenants[store.port] = self

    @property
    def host(self) -> str:
        """The host name the store was created with."""
        return self._tcp.host

    @property
    def port(self) -> int:
        """The server's port (the one picked, for a master created with port 0)."""
        return self._tcp.port

    def close(self) -> None:
        """Close the connection, and the server if this instance hosts it."""
        if _tenants.get(self.port) is self:
            del _tenants[self.port]
        super().close()


# -- process groups ---------------------------------------------------------------------------
# The async API keeps the default group in a ContextVar, so each asyncio task can belong to
# its own world. A blocking script has one world per process: it is kept here and installed
# into the context of every coroutine this module runs.
_world: _group.World | None = None
_world_lock = threading.Lock()

Group = ProcessGroup | NonGroupMember | None

#: torch's default process-group timeout.
_DEFAULT_PG_TIMEOUT = timedelta(minutes=30)


def _enter_world(op: str) -> None:
    if _world is None:
        raise DistUsageError(
            f"{op} needs the default process group: call aiodist.sync.init_process_group(...) first"
        )
    _group.set_current_world(_world)


def _local(op: str, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Call a non-blocking function of the async API with this process's world installed."""

    def call() -> T:
        _enter_world(op)
        return fn(*args, **kwargs)

    return contextvars.copy_context().run(call)


def _complete(op: str, fn: Callable[..., _group.Work[T]], *args: Any) -> T:
    """Issue an operation on the loop and block until it is done; return its result."""

    async def call() -> T:
        _enter_world(op)
        return await fn(*args)

    try:
        return _run(call())
    except KeyboardInterrupt:
        # The peers are part-way through the operation and this rank will not finish it:
        # abort the group so they fail at once (with the reason) instead of waiting for its
        # timeout. Recover with destroy_process_group() and init_process_group().
        world = _world
        if world is not None:
            cause = DistError(f"rank {world.rank}: {op} interrupted by KeyboardInterrupt")
            _loop_thread.loop().call_soon_threadsafe(world.abort, cause)
        raise


def _copy_outcome(target: concurrent.futures.Future[T], source: asyncio.Future[T]) -> None:
    if source.cancelled():
        target.set_exception(DistUsageError("the operation was cancelled"))
    elif (exc := source.exception()) is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result())


def _start(op: str, fn: Callable[..., _group.Work[T]], *args: Any) -> Work[T]:
    """Issue an operation on the loop and return its blocking :class:`Work` at once."""

    async def start() -> tuple[_group.Work[T], asyncio.Task[T], concurrent.futures.Future[T]]:
        _enter_world(op)
        work = fn(*args)
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        task = asyncio.ensure_future(work.wait())
        task.add_done_callback(functools.partial(_copy_outcome, future))
        return work, task, future

    return Work(*_run(start()))


def _issue(
    op: str, async_op: bool, fn: Callable[..., _group.Work[Any]], *args: Any
) -> Work[Any] | None:
    if async_op:
        return _start(op, fn, *args)
    _complete(op, fn, *args)
    return None


class Work(Generic[T]):
    """The blocking handle of an operation started with ``async_op=True`` (torch's ``Work``).

    Thread-safe; every method may be called any number of times.
    """

    def __init__(
        self,
        work: _group.Work[T],
        task: asyncio.Task[T],
        future: concurrent.futures.Future[T],
    ) -> None:
        self._work = work
        self._task = task  # keeps the task that feeds ``future`` alive
        self._future = future

    def __repr__(self) -> str:
        return f"<Work (blocking) {self._work!r}>"

    def wait(self, timeout: Timeout = None) -> bool:
        """Block until the operation is done; return ``True``.

        Args:
            timeout: seconds or ``timedelta``; ``None`` waits until the group's own timeout.

        Raises:
            DistTimeoutError: ``timeout`` passed first; as in torch, this fails the operation
                and aborts the process group.
            DistError: the operation failed.
            KeyboardInterrupt: Ctrl-C; the operation itself keeps running.
        """
        if to_seconds(timeout) is None:
            # No deadline of its own: block on the future the loop completes, without a
            # round trip to the loop thread.
            self._future.result()
            return True
        # A deadline fails the operation when it passes: the async Work does that.
        _run(self._work.wait(timeout))
        # The blocking future is completed by a callback of the same event; let it land.
        concurrent.futures.wait([self._future])
        self._future.result()
        return True

    def is_completed(self) -> bool:
        """Return whether the operation has finished, successfully or not."""
        return self._future.done()

    def is_success(self) -> bool:
        """Return whether the operation has finished without an error."""
        return self._future.done() and self._future.exception() is None

    def exception(self) -> BaseException | None:
        """Return the operation's error, or ``None`` if it succeeded or is still running."""
        return self._future.exception() if self._future.done() else None

    def result(self) -> T:
        """Return the result of a finished operation (the output array or list).

        Raises:
            DistUsageError: the operation has not finished yet.
            DistError: the operation failed.
        """
        if not self._future.done():
            raise DistUsageError(f"{self!r} has not completed yet; wait() for it first")
        return self._future.result()

    def get_future(self) -> concurrent.futures.Future[T]:
        """Return a :class:`concurrent.futures.Future` resolved with the operation's result."""
        return self._future


class Backend(str):
    """Backend names, as in ``torch.distributed.Backend``: ``Backend("GLOO") == "gloo"``.

    Raises:
        DistUsageError: the name is not a backend aiodist knows.
    """

    CPU = "cpu"
    CUDA = "cuda"
    GLOO = "gloo"
    NCCL = "nccl"
    _NAMES = (CPU, CUDA, GLOO, NCCL)

    def __new__(cls, name: str) -> Self:
        if not isinstance(name, str):
            raise DistUsageError(f"backend must be a string, got {type(name).__name__}")
        value = name.strip().lower()
        # A name check, as torch's: whether this build can run it is is_backend_available's.
        for part in value.split(","):
            device, _, impl = part.strip().rpartition(":")
            if impl not in cls._NAMES or device not in ("", "cpu", "cuda"):
                raise DistUsageError(
                    f"unknown backend {name!r}: expected 'cpu' (alias 'gloo'), 'cuda' (alias "
                    "'nccl') or a per-device form such as 'cpu:gloo,cuda:nccl'"
                )
        return super().__new__(cls, value)


def is_available() -> bool:
    """Return ``True``: aiodist's process groups are always available."""
    return True


def is_backend_available(backend: str) -> bool:
    """Return whether ``init_process_group(backend)`` can work in this build."""
    try:
        _group.parse_backend(backend)
    except DistUsageError:
        return False
    return True


def is_gloo_available() -> bool:
    """Return ``True``: ``"gloo"`` names the CPU backend."""
    return is_backend_available("gloo")


def is_nccl_available() -> bool:
    """Return whether the CUDA backend (``"nccl"``) is available in this build."""
    return is_backend_available("nccl")


def is_torchelastic_launched() -> bool:
    """Return whether a torchrun-style launcher started this process (``TORCHELASTIC_RUN_ID``)."""
    return os.environ.get("TORCHELASTIC_RUN_ID") is not None


class GroupMember:
    """torch's group constants: ``WORLD`` (the default group) and ``NON_GROUP_MEMBER``."""

    #: Passing ``group=GroupMember.WORLD`` (``None``) means the default group.
    WORLD: ProcessGroup | None = None
    NON_GROUP_MEMBER = NON_GROUP_MEMBER


#: ``dist.group.WORLD``, as torch spells it.
group = GroupMember


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: Timeout = _DEFAULT_PG_TIMEOUT,
    world_size: int = -1,
    rank: int = -1,
    store: Store | None = None,
    group_name: str = "",
    pg_options: object = None,
    device_id: object = None,
    *,
    auth_token: str | bytes | None = None,
) -> None:
    """Join this process to the default process group, with torch's rules.

    ``init_method`` and ``store`` are exclusive; with neither, ``init_method="env://"``; with
    ``store``, ``rank`` and ``world_size`` are required. ``backend``: ``"cpu"``/``"gloo"``,
    ``"cpu:gloo,cuda:nccl"`` or ``None``. ``pg_options`` and ``device_id`` are accepted for
    torch compatibility and ignored.

    Args:
        backend: the backend name.
        init_method: a rendezvous URL (``env://``, ``tcp://...``, ``file://...``).
        timeout: per-operation and rendezvous timeout (``timedelta`` or seconds).
        world_size: the number of processes.
        rank: this process's rank.
        store: a blocking store shared by every rank (``aiodist.sync.TCPStore`` etc.).
        group_name: namespace of this job's keys in the store.
        pg_options: ignored.
        device_id: ignored.
        auth_token: shared secret for the store the rendezvous makes and for every
            connection between ranks (``None``: ``$AIODIST_AUTH_TOKEN``, if set).

    Raises:
        DistUsageError: initialized already, conflicting or missing arguments, an unknown
            backend, or a store that is not a blocking aiodist store.
        DistTimeoutError: the other ranks did not arrive in time.
        DistNetworkError: the store or a peer could not be reached.
    """
    global _world
    if store is not None and not isinstance(store, Store):
        raise DistUsageError(
            "init_process_group: store must be a blocking aiodist.sync store (TCPStore, "
            f"FileStore, HashStore, PrefixStore), got {type(store).__name__}"
        )

    async def init() -> _group.World:
        await _aio_api.init_process_group(
            backend, init_method, timeout, world_size, rank,
            None if store is None else store.async_store, group_name,
            auth_token=auth_token,
        )  # fmt: skip
        world = _group.peek_world()
        assert world is not None
        return world

    with _world_lock:
        if _world is not None:
            raise DistUsageError("trying to initialize the default process group twice!")
        _world = _run(init())


def destroy_process_group(group: Group = None) -> None:
    """Destroy ``group``, or with ``None`` every group and the default one.

    Destroying the default group closes its connections; when no blocking store is still
    open, the event-loop thread stops too (a later call starts a new one), so
    ``init_process_group`` may be called again.

    Raises:
        DistUsageError: not initialized, or ``group`` is not a process group of this world.
    """
    global _world
    with _world_lock:
        world = _world

        async def destroy() -> None:
            _enter_world("destroy_process_group")
            await _aio_api.destroy_process_group(group)

        _run(destroy())
        if world is not None and (group is None or group is world.default_group):
            _world = None
            if not any(not s._closed for s in list(_live_stores)):
                _loop_thread.stop()


def is_initialized() -> bool:
    """Return whether this process has a default process group."""
    return _world is not None


def get_rank(group: Group = None) -> int:
    """Return this rank in ``group`` (default: the global rank); ``-1`` for a non-member.

    Raises:
        DistUsageError: not initialized.
    """
    return _local("get_rank", _aio_api.get_rank, group)


def get_world_size(group: Group = None) -> int:
    """Return the number of ranks in ``group``; ``-1`` for a non-member.

    Raises:
        DistUsageError: not initialized.
    """
    return _local("get_world_size", _aio_api.get_world_size, group)


def get_backend(group: Group = None) -> str:
    """Return the backend of ``group``.

    Raises:
        DistUsageError: not initialized.
    """
    return _local("get_backend", _aio_api.get_backend, group)


def get_process_group_ranks(group: Group = None) -> list[int]:
    """Return the global ranks of ``group`` in group-rank order.

    Raises:
        DistUsageError: not initialized.
    """
    return _local("get_process_group_ranks", _aio_api.get_process_group_ranks, group)


def get_group_rank(group: Group, global_rank: int) -> int:
    """Return the group rank of ``global_rank`` in ``group``.

    Raises:
        DistUsageError: ``global_rank`` is not in the group.
    """
    return _local("get_group_rank", _aio_api.get_group_rank, group, global_rank)


def get_global_rank(group: Group, group_rank: int) -> int:
    """Return the global rank of ``group_rank`` in ``group``.

    Raises:
        DistUsageError: ``group_rank`` is out of range.
    """
    return _local("get_global_rank", _aio_api.get_global_rank, group, group_rank)


def new_group(
    ranks: Sequence[int] | None = None,
    timeout: Timeout = None,
    backend: str | None = None,
    pg_options: object = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
) -> ProcessGroup | NonGroupMember:
    """Create a group of ``ranks``; every rank of the world must call it the same way.

    Returns :data:`NON_GROUP_MEMBER` on ranks outside the group. ``pg_options``,
    ``use_local_synchronization`` and ``group_desc`` are accepted and ignored.

    Raises:
        DistUsageError: not initialized, or bad ranks.
    """

    async def create() -> ProcessGroup | NonGroupMember:
        _enter_world("new_group")
        return await _aio_api.new_group(ranks, timeout, backend)

    return _run(create())


def new_subgroups(
    group_size: int | None = None,
    group: ProcessGroup | None = None,
    timeout: Timeout = None,
    backend: str | None = None,
    pg_options: object = None,
    group_desc: str | None = None,
) -> tuple[ProcessGroup, list[ProcessGroup | NonGroupMember]]:
    """Split ``group`` into subgroups of ``group_size`` ranks; return (mine, all).

    Raises:
        DistUsageError: not initialized, or a size that does not divide the group.
    """

    async def create() -> tuple[ProcessGroup, list[ProcessGroup | NonGroupMember]]:
        _enter_world("new_subgroups")
        return await _aio_api.new_subgroups(group_size, group, timeout, backend)

    return _run(create())


# -- collectives: torch's signatures; ``async_op=True`` returns a Work, else None ----------
def all_reduce(
    tensor: Any, op: ReduceOp | int = ReduceOp.SUM, group: Group = None, async_op: bool = False
) -> Work[Any] | None:
    """Reduce ``tensor`` across the group, in place on every rank.

    Raises:
        DistUsageError: bad array, op or group (at once, or from the work).
        DistNetworkError: a peer failed. DistTimeoutError: the group timeout passed.
    """
    return _issue("all_reduce", async_op, _aio_api.all_reduce, tensor, op, group)


def broadcast(
    tensor: Any,
    src: int | None = None,
    group: Group = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work[Any] | None:
    """Copy ``tensor`` of ``src`` into ``tensor`` of every rank.

    Raises:
        DistUsageError: bad array or source. DistNetworkError, DistTimeoutError: as all_reduce.
    """
    return _issue("broadcast", async_op, _aio_api.broadcast, tensor, src, group, group_src)


def reduce(
    tensor: Any,
    dst: int | None = None,
    op: ReduceOp | int = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work[Any] | None:
    """Reduce ``tensor`` of every rank into ``tensor`` of ``dst``.

    Raises:
        DistUsageError: bad array, op or destination. DistNetworkError, DistTimeoutError.
    """
    return _issue("reduce", async_op, _aio_api.reduce, tensor, dst, op, group, group_dst)


def all_gather(
    tensor_list: list[Any], tensor: Any, group: Group = None, async_op: bool = False
) -> Work[Any] | None:
    """Gather ``tensor`` of every rank into ``tensor_list`` on every rank.

    Raises:
        DistUsageError: bad arrays or list length. DistNetworkError, DistTimeoutError.
    """
    return _issue("all_gather", async_op, _aio_api.all_gather, tensor_list, tensor, group)


def all_gather_into_tensor(
    output_tensor: Any, input_tensor: Any, group: Group = None, async_op: bool = False
) -> Work[Any] | None:
    """Gather ``input_tensor`` of every rank into ``output_tensor`` (concatenated).

    Raises:
        DistUsageError: bad arrays or sizes. DistNetworkError, DistTimeoutError.
    """
    return _issue(
        "all_gather_into_tensor", async_op, _aio_api.all_gather_into_tensor,
        output_tensor, input_tensor, group,
    )  # fmt: skip


def gather(
    tensor: Any,
    gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: Group = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work[Any] | None:
    """Gather ``tensor`` of every rank into ``gather_list`` on ``dst``.

    Raises:
        DistUsageError: bad arrays, list or destination. DistNetworkError, DistTimeoutError.
    """
    return _issue("gather", async_op, _aio_api.gather, tensor, gather_list, dst, group, group_dst)


def scatter(
    tensor: Any,
    scatter_list: list[Any] | None = None,
    src: int | None = None,
    group: Group = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work[Any] | None:
    """Send ``scatter_list[i]`` of ``src`` into ``tensor`` of rank ``i``.

    Raises:
        DistUsageError: bad arrays, list or source. DistNetworkError, DistTimeoutError.
    """
    return _issue(
        "scatter", async_op, _aio_api.scatter, tensor, scatter_list, src, group, group_src
    )


def reduce_scatter(
    output: Any,
    input_list: list[Any],
    op: ReduceOp | int = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
) -> Work[Any] | None:
    """Reduce ``input_list[i]`` across ranks into ``output`` of rank ``i``.

    Raises:
        DistUsageError: bad arrays or op. DistNetworkError, DistTimeoutError.
    """
    return _issue(
        "reduce_scatter", async_op, _aio_api.reduce_scatter, output, input_list, op, group
    )


def reduce_scatter_tensor(
    output: Any,
    input: Any,
    op: ReduceOp | int = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
) -> Work[Any] | None:
    """Reduce ``input`` across ranks; rank ``i`` gets slice ``i`` of the result in ``output``.

    Raises:
        DistUsageError: bad arrays, sizes or op. DistNetworkError, DistTimeoutError.
    """
    return _issue(
        "reduce_scatter_tensor", async_op, _aio_api.reduce_scatter_tensor,
        output, input, op, group,
    )  # fmt: skip


def all_to_all(
    output_tensor_list: list[Any],
    input_tensor_list: list[Any],
    group: Group = None,
    async_op: bool = False,
) -> Work[Any] | None:
    """Send ``input_tensor_list[i]`` to rank ``i``; receive into ``output_tensor_list``.

    Raises:
        DistUsageError: bad arrays or list lengths. DistNetworkError, DistTimeoutError.
    """
    return _issue(
        "all_to_all", async_op, _aio_api.all_to_all, output_tensor_list, input_tensor_list, group
    )


def all_to_all_single(
    output: Any,
    input: Any,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: Group = None,
    async_op: bool = False,
) -> Work[Any] | None:
    """Split ``input`` along dimension 0 among the ranks; concatenate what arrives in ``output``.

    Raises:
        DistUsageError: split sizes that do not add up, bad arrays. DistNetworkError,
            DistTimeoutError.
    """
    return _issue(
        "all_to_all_single", async_op, _aio_api.all_to_all_single,
        output, input, output_split_sizes, input_split_sizes, group,
    )  # fmt: skip


def barrier(
    group: Group = None,
    async_op: bool = False,
    device_ids: Sequence[int] | None = None,
    timeout: Timeout = None,
) -> Work[None] | None:
    """Wait until every rank of ``group`` has entered the barrier.

    Args:
        group: the group (default: the world).
        async_op: return a :class:`Work` instead of waiting.
        device_ids: ignored (torch compatibility).
        timeout: with ``async_op=False``, give up after this long (``DistTimeoutError``,
            which aborts the group, as in torch).

    Raises:
        DistTimeoutError: ``timeout`` or the group timeout passed. DistNetworkError.
    """
    if async_op:
        return _start("barrier", _aio_api.barrier, group, device_ids)

    async def call() -> None:
        _enter_world("barrier")
        await _aio_api.barrier(group, device_ids).wait(timeout)

    _run(call())
    return None


def monitored_barrier(
    group: Group = None, timeout: Timeout = None, wait_all_ranks: bool = False
) -> None:
    """A barrier that names the ranks which did not arrive within ``timeout``.

    Raises:
        DistTimeoutError: ranks missing at the deadline (named in the message).
    """
    _complete("monitored_barrier", _aio_api.monitored_barrier, group, timeout, wait_all_ranks)


# -- point to point -------------------------------------------------------------------------
def isend(
    tensor: Any,
    dst: int | None = None,
    group: Group = None,
    tag: int = 0,
    group_dst: int | None = None,
) -> Work[None]:
    """Start sending ``tensor`` to ``dst``; return its :class:`Work`.

    Raises:
        DistUsageError: no or invalid destination, bad tag.
    """
    return _start("isend", _aio_api.isend, tensor, dst, group, tag, group_dst)


def irecv(
    tensor: Any,
    src: int | None = None,
    group: Group = None,
    tag: int = 0,
    group_src: int | None = None,
) -> Work[int]:
    """Start receiving into ``tensor`` from ``src`` (``None``: any); the result is the sender.

    Raises:
        DistUsageError: invalid source, bad tag, read-only array.
    """
    return _start("irecv", _aio_api.irecv, tensor, src, group, tag, group_src)


def send(
    tensor: Any,
    dst: int | None = None,
    group: Group = None,
    tag: int = 0,
    group_dst: int | None = None,
) -> None:
    """Send ``tensor`` to ``dst`` and block until the transport no longer needs it.

    Raises:
        DistUsageError: no or invalid destination, bad tag. DistNetworkError,
            DistTimeoutError.
    """
    _complete("send", _aio_api.isend, tensor, dst, group, tag, group_dst)


def recv(
    tensor: Any,
    src: int | None = None,
    group: Group = None,
    tag: int = 0,
    group_src: int | None = None,
) -> int:
    """Receive into ``tensor`` from ``src`` (``None``: any rank); return the sender's rank.

    Raises:
        DistUsageError: invalid source, bad tag, read-only array, size mismatch.
        DistNetworkError, DistTimeoutError.
    """
    return _complete("recv", _aio_api.irecv, tensor, src, group, tag, group_src)


class P2POp:
    """One send or receive of a :func:`batch_isend_irecv` batch (torch's ``P2POp``).

    Args:
        op: :func:`isend` or :func:`irecv` of this module (or ``send``/``recv``).
        tensor: the array to send or to receive into.
        peer: global rank of the peer.
        group: the group (default: the world).
        tag: the message tag.
        group_peer: the peer as a group rank, instead of ``peer``.

    Raises:
        DistUsageError: ``op`` is not one of those functions.
    """

    def __init__(
        self,
        op: Callable[..., Any],
        tensor: Any,
        peer: int | None = None,
        group: Group = None,
        tag: int = 0,
        group_peer: int | None = None,
    ) -> None:
        if op not in _P2P_ASYNC_OPS:
            raise DistUsageError(
                f"P2POp: op must be aiodist.sync.isend or aiodist.sync.irecv, got {op!r}"
            )
        self.op = op
        self.tensor = tensor
        self.peer = peer
        self.group = group
        self.tag = tag
        self.group_peer = group_peer

    def __repr__(self) -> str:
        peer = f"group_peer={self.group_peer}" if self.peer is None else f"peer={self.peer}"
        return f"<P2POp {getattr(self.op, '__name__', self.op)} {peer} tag={self.tag}>"

    def _to_async(self) -> _aio_api.P2POp:
        return _aio_api.P2POp(
            _P2P_ASYNC_OPS[self.op], self.tensor, self.peer, self.group, self.tag,
            self.group_peer,
        )  # fmt: skip


#: The async operation behind each blocking point-to-point function a P2POp may name.
_P2P_ASYNC_OPS: dict[Callable[..., Any], Callable[..., _group.Work[Any]]] = {
    isend: _aio_api.isend,
    send: _aio_api.isend,
    irecv: _aio_api.irecv,
    recv: _aio_api.irecv,
}


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work[Any]]:
    """Start every send and receive of ``p2p_op_list``; return their works in order.

    Raises:
        DistUsageError: an empty list, an entry that is not a :class:`P2POp`, or ops on
            different groups.
    """
    if not isinstance(p2p_op_list, list | tuple) or not p2p_op_list:
        raise DistUsageError("batch_isend_irecv: p2p_op_list must be a non-empty list of P2POp")
    for p in p2p_op_list:
        if not isinstance(p, P2POp):
            raise DistUsageError(f"batch_isend_irecv: expected P2POp entries, got {p!r}")
    ops = [p._to_async() for p in p2p_op_list]

    async def start() -> list[_group.Work[Any]]:
        _enter_world("batch_isend_irecv")
        return _aio_api.batch_isend_irecv(ops)

    works = _run(start())
    return [_start("batch_isend_irecv", lambda w=w: w) for w in works]


# -- object collectives (blocking, as in torch) --------------------------------------------
def broadcast_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: Group = None,
    device: object = None,
    group_src: int | None = None,
) -> None:
    """Broadcast the picklable objects of ``object_list`` from ``src``, in place elsewhere.

    Unpickling runs code chosen by the sender: use only between trusted ranks.

    Raises:
        DistUsageError: not a non-empty list, or an object that cannot be pickled.
    """
    _complete(
        "broadcast_object_list", _aio_api.broadcast_object_list,
        object_list, src, group, device, group_src,
    )  # fmt: skip


def all_gather_object(object_list: list[Any], obj: Any, group: Group = None) -> None:
    """Gather the picklable ``obj`` of every rank into ``object_list``.

    Raises:
        DistUsageError: the list length is not the group size, or ``obj`` cannot be pickled.
    """
    _complete("all_gather_object", _aio_api.all_gather_object, object_list, obj, group)


def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: Group = None,
    group_dst: int | None = None,
) -> None:
    """Gather the picklable ``obj`` of every rank into ``object_gather_list`` on ``dst``.

    Raises:
        DistUsageError: a bad list, or ``obj`` cannot be pickled.
    """
    _complete(
        "gather_object", _aio_api.gather_object, obj, object_gather_list, dst, group, group_dst
    )


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int | None = None,
    group: Group = None,
    group_src: int | None = None,
) -> None:
    """Send ``scatter_object_input_list[i]`` of ``src`` into slot 0 of rank ``i``'s list.

    Raises:
        DistUsageError: bad lists, or an object that cannot be pickled.
    """
    _complete(
        "scatter_object_list", _aio_api.scatter_object_list,
        scatter_object_output_list, scatter_object_input_list, src, group, group_src,
    )  # fmt: skip


def _close_all_at_exit() -> None:
    # Close what is still open (a hosted server, FileStore reference counts) so that peers
    # see an orderly end, then stop the loop. Bounded: exit must not hang on a dead peer.
    if _loop_thread.ident is None:
        return
    for store in list(_live_stores):
        if store._closed:
            continue
        store._closed = True
        try:
            _run(store.async_store.aclose(), timeout=_SHUTDOWN_TIMEOUT)
        except Exception as exc:
            logger.debug("closing %r at exit failed: %s", store, exc)
    _loop_thread.stop()


atexit.register(_close_all_at_exit)
