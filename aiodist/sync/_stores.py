"""The blocking stores of ``aiodist.sync``: torch's store classes over the async stores.

:class:`Store` drives an async :class:`aiodist.Store` from any thread: each method runs the
async method of the same name on aiodist's loop thread (:mod:`aiodist.sync._loop_thread`) and
blocks for its result. :class:`HashStore`, :class:`FileStore`, :class:`PrefixStore` and
:class:`TCPStore` take torch's constructor arguments; :class:`EtcdStore` those of
:meth:`aiodist.EtcdStore.create`. ``aiodist.sync`` re-exports and
documents them; it asks :func:`any_store_open` whether the loop thread may stop with the
default group, and :func:`close_all_stores` closes what is left at exit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Coroutine, Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any, Concatenate, Generic, ParamSpec, Self, TypeVar, overload

from .. import store as _aio
from .._util._timeouts import DEFAULT_STORE_TIMEOUT, Timeout
from ..errors import DistStoreError, DistUsageError
from ._loop_thread import SHUTDOWN_TIMEOUT, run, start_on_loop, wait

__all__ = [
    "EtcdStore",
    "FileStore",
    "HashStore",
    "PrefixStore",
    "Store",
    "TCPStore",
    "any_store_open",
    "close_all_stores",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
P = ParamSpec("P")

#: torch's default store timeout.
_DEFAULT_STORE_TIMEOUT = timedelta(seconds=DEFAULT_STORE_TIMEOUT)


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
            result: T = run(method(*args, **kwargs))
            return result

        call.__name__ = self._name
        call.__doc__ = self.__doc__
        return call


_live_stores: weakref.WeakSet[Store] = weakref.WeakSet()
# The async stores with connections on the loop whose blocking store was dropped without
# being closed: a process group made on them may still use them (a store made inside a
# function and passed to init_process_group), so they are closed only when the loop thread
# stops, not left open on a stopped loop, where a server would hold its clients'
# connections without answering.
_orphans: list[_aio.Store] = []


def _orphaned(store: _aio.Store) -> None:
    # The others are the garbage collector's, once nothing uses them: a FileStore then counts
    # itself out (the last of its world removes the file), as torch's does when destroyed.
    if isinstance(store, (_aio.TCPStore, _aio.EtcdStore)):
        _orphans.append(store)


class Store:
    """A blocking store: the methods of an async :class:`aiodist.Store`, as in torch.

    Each method runs the async store's method of the same name on aiodist's loop thread and
    returns its result; errors are the async store's (``DistTimeoutError`` naming the keys,
    ``DistStoreError``, ``QueueEmptyError``, ...). Usable from several threads at once.
    Stores still open at interpreter exit are closed then.

    As torch's ``dist.Store``, it is also the base of a store written in Python: a subclass
    that calls ``super().__init__()`` and defines ``set``, ``get``, ``add``,
    ``compare_set``... (blocking, with ``str`` keys and ``bytes`` values) is a store
    wherever one is taken (``PrefixStore``, ``init_process_group(store=...)``): aiodist calls
    its methods from a worker thread. A method it does not define raises ``DistStoreError``
    ("Not implemented.", as torch); ``append``, ``multi_get`` and ``multi_set`` fall back on
    ``compare_set``, ``get`` and ``set``.

    Args:
        store: the async store to drive; ``None`` for a store written in Python.

    Raises:
        DistUsageError: ``store`` is not an async aiodist store.
    """

    def __init__(self, store: _aio.Store | None = None) -> None:
        if store is None:
            store = _PythonStore(self)
        elif not isinstance(store, _aio.Store):
            raise DistUsageError(f"expected an aiodist Store, got {type(store).__name__}")
        self._store = store
        self._closed = False
        _live_stores.add(self)
        self._dropped = weakref.finalize(self, _orphaned, store)
        self._dropped.atexit = False

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
    delete_prefix = _Blocking(_aio.Store.delete_prefix)
    num_keys = _Blocking(_aio.Store.num_keys)
    list_keys = _Blocking(_aio.Store.list_keys)
    multi_get = _Blocking(_aio.Store.multi_get)
    multi_set = _Blocking(_aio.Store.multi_set)
    append = _Blocking(_aio.Store.append)
    queue_push = _Blocking(_aio.Store.queue_push)
    queue_push_front = _Blocking(_aio.Store.queue_push_front)
    queue_len = _Blocking(_aio.Store.queue_len)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Pop the oldest value of queue ``key`` (see :meth:`aiodist.Store.queue_pop`).

        Interrupted (Ctrl-C), it never loses a value: one the pop took as the interrupt came
        goes back at the head of the queue before ``KeyboardInterrupt`` is raised.

        Raises:
            QueueEmptyError: ``block`` is false and the queue is empty.
            DistTimeoutError: ``block`` is true and nothing arrived within the store timeout.
        """
        store = self._store
        started: list[asyncio.Task[bytes]] = []  # (the pop's task, once started on the loop)
        gave_up = threading.Event()

        def start() -> asyncio.Task[bytes] | None:
            if gave_up.is_set():
                return None  # (interrupted before the pop began: it never does)
            task = asyncio.ensure_future(store.queue_pop(key, block))
            started.append(task)
            return task

        def track(task: asyncio.Task[bytes] | None, done: concurrent.futures.Future[bytes]) -> None:
            if task is not None:
                task.add_done_callback(functools.partial(_settle, done))

        try:
            return wait(start_on_loop(start, track))
        except BaseException:
            # Decided on the loop, where the pop ends: cancelled there (the store gives back
            # what it took), or, if it ended first, its value put back.
            gave_up.set()
            run(_abandon(store, key, started), timeout=SHUTDOWN_TIMEOUT)
            raise

    barrier = _Blocking(_aio.Store.barrier)

    def has_extended_api(self) -> bool:
        """torch's question: whether ``append``, ``multi_get`` and ``multi_set`` are the
        store's own. ``True`` for aiodist's stores; a store written in Python says ``False``
        unless it overrides this method (the three then fall back on the basic methods)."""
        return not isinstance(self._store, _PythonStore)

    def clone(self) -> Store:
        """Return a new, independent handle to the same store (a new connection, if any)."""
        return Store(run(self._store.clone()))

    def close(self) -> None:
        """Release the store's resources. Closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        _live_stores.discard(self)
        self._dropped.detach()
        run(self._store.aclose())

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _bytes(value: _aio.Value) -> bytes:
    # torch hands a Python store's methods bytes values.
    return value.encode() if isinstance(value, str) else bytes(value)


class _PythonStore(_aio.Store):
    """The async store behind a blocking store written in Python: each method runs the
    Python method of the same name in a worker thread (it may block)."""

    def __init__(self, owner: Store) -> None:
        super().__init__()
        # Weakly: the owner holds this store, and a store written in Python is dropped as
        # torch's are, with its last reference.
        self._owner = weakref.ref(owner)

    def __repr__(self) -> str:
        return f"<store written in Python: {type(self._owner()).__name__}>"

    def _method(self, name: str) -> Callable[..., Any] | None:
        owner = self._owner()
        if owner is None:
            raise DistUsageError("the store written in Python was garbage collected")
        method = getattr(type(owner), name, None)
        if method is None or method is getattr(Store, name, None):
            return None  # not defined by the subclass
        bound: Callable[..., Any] = getattr(owner, name)
        return bound

    async def _call(self, name: str, *args: Any) -> Any:
        method = self._method(name)
        if method is None:
            owner = type(self._owner()).__name__
            raise DistStoreError(f"Not implemented.: {owner}.{name}() is not defined")
        return await asyncio.to_thread(method, *args)

    async def set(self, key: str, value: _aio.Value) -> None:
        await self._call("set", key, _bytes(value))

    async def get(self, key: str) -> bytes:
        value: bytes = await self._call("get", key)
        return value

    async def add(self, key: str, amount: int) -> int:
        total: int = await self._call("add", key, amount)
        return total

    async def compare_set(self, key: str, expected: _aio.Value, desired: _aio.Value) -> bytes:
        expected, desired = _bytes(expected), _bytes(desired)
        value: bytes = await self._call("compare_set", key, expected, desired)
        return value

    async def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        await self._call("wait", list(keys), *([] if timeout is None else [timeout]))

    async def check(self, keys: Sequence[str]) -> bool:
        return bool(await self._call("check", list(keys)))

    async def delete_key(self, key: str) -> bool:
        return bool(await self._call("delete_key", key))

    async def num_keys(self) -> int:
        return int(await self._call("num_keys"))

    async def list_keys(self) -> list[str]:
        return list(await self._call("list_keys"))

    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        if self._method("multi_get") is None:  # torch's fallback
            return [await self.get(k) for k in keys]
        return list(await self._call("multi_get", list(keys)))

    async def multi_set(self, keys: Sequence[str], values: Sequence[_aio.Value]) -> None:
        if self._method("multi_set") is None:  # torch's fallback
            for key, value in zip(keys, values, strict=True):
                await self.set(key, value)
            return
        await self._call("multi_set", list(keys), [_bytes(v) for v in values])

    async def append(self, key: str, value: _aio.Value) -> None:
        data = _bytes(value)
        if self._method("append") is not None:
            await self._call("append", key, data)
            return
        # torch's fallback (a get could wait for a missing key forever): compare_set until
        # no other writer came in between. As torch's, it cannot tell a key it created from
        # one that already held exactly ``data``.
        expected = data
        current = await self.compare_set(key, b"", expected)
        while current != expected:
            expected = current + data
            current = await self.compare_set(key, current, expected)

    async def queue_push(self, key: str, value: _aio.Value) -> None:
        await self._call("queue_push", key, _bytes(value))

    async def queue_pop(self, key: str, block: bool = True) -> bytes:
        value: bytes = await self._call("queue_pop", key, block)
        return value

    async def queue_len(self, key: str) -> int:
        return int(await self._call("queue_len", key))

    async def clone(self) -> _aio.Store:
        clone: Store = await self._call("clone")
        return clone.async_store

    async def aclose(self) -> None:
        """Nothing to release: the Python store owns its resources."""


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
        store = _aio.FileStore(file_name, world_size)
        super().__init__(store)
        self._file = store
        run(store.open())  # counted in now, as torch's constructor does

    def num_keys(self) -> int:
        """The number of keys, counted as torch's FileStore does: with its reference counter
        (so ``num_keys()`` is one more than the keys set; ``list_keys()`` lists those).

        Raises:
            DistStoreError: the file cannot be read, or the store is closed.
        """
        return run(self._file.count_all_keys())


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

    def num_keys(self) -> int:
        """The number of keys of the underlying store, all prefixes, as torch counts them
        (``list_keys()`` lists this prefix's own).

        Raises:
            DistStoreError: the underlying store failed.
        """
        return self._underlying.num_keys()

    def has_extended_api(self) -> bool:
        """The underlying store's answer, as torch's PrefixStore gives."""
        return self._underlying.has_extended_api()


class EtcdStore(Store):
    """A blocking store kept in an etcd cluster (:class:`aiodist.EtcdStore`).

    Args:
        endpoints: the etcd members' client addresses, ``"host:port,host:port"`` or a
            sequence of them, tried in this order.
        prefix: the etcd key prefix of this store.
        timeout: the wait deadline (``timedelta`` or seconds).
        **options: further keyword arguments of :meth:`aiodist.EtcdStore.create`
            (``lease_ttl``, ``max_value_size``, ``peer_timeout``).

    Raises:
        DistUsageError: malformed endpoints, prefix or options.
        DistNetworkError: no etcd member answered.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        prefix: str = _aio.etcd.DEFAULT_PREFIX,
        timeout: Timeout = _DEFAULT_STORE_TIMEOUT,
        **options: Any,
    ) -> None:
        store = run(_aio.EtcdStore.create(endpoints, prefix, timeout, **options))
        super().__init__(store)
        self._etcd = store

    @property
    def endpoints(self) -> list[tuple[str, int]]:
        """The etcd members' client addresses."""
        return self._etcd.endpoints

    @property
    def prefix(self) -> str:
        """The etcd key prefix of this store."""
        return self._etcd.prefix


# Masters created with multi_tenant=True, by port: later instances on that port join them.
_tenants: weakref.WeakValueDictionary[int, TCPStore] = weakref.WeakValueDictionary()


class TCPStore(Store):
    """A blocking TCP store with ``torch.distributed.TCPStore``'s constructor.

    The master (``is_master=True``) serves the store from a thread of its own, so it keeps
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
        master_listen_fd: for the master, a TCP socket bound to ``port`` (unless 0) that the
            server listens on and takes over, as in torch.
        use_libuv: accepted for torch compatibility (:attr:`libuvBackend` returns it).
        **options: further keyword arguments of :meth:`aiodist.TCPStore.create`
            (``auth_token``, ``wire``, ``max_key_size``, ...).

    Raises:
        DistUsageError: bad arguments (``world_size=0``: in torch's words, "TCPStore world
            size cannot be 0"), or a ``master_listen_fd`` that is not a TCP socket.
        DistStoreError: ``master_listen_fd`` is bound to another port.
        DistNetworkError: the port is in use ("The server socket has failed to listen on any
            local network address", as torch says), or the server cannot be reached in time.
        DistStoreTimeoutError: the master's workers did not all join in time (a
            ``DistStoreError``, as in torch).
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
        if is_master and multi_tenant and port != 0 and port in _tenants:
            is_master = False
        if master_listen_fd is not None and is_master:
            options["master_listen_fd"] = master_listen_fd
        store = run(
            _aio.TCPStore.create(
                host_name, port, world_size, is_master, timeout, wait_for_workers, **options
            )
        )
        super().__init__(store)
        self._tcp = store
        self._use_libuv = use_libuv
        if is_master and multi_tenant:
            _tenants[store.port] = self

    @property
    def libuvBackend(self) -> bool:
        """torch's ``TCPStore.libuvBackend``: the ``use_libuv`` asked for. aiodist has one
        server and client, which run on uvloop (libuv) where it is installed."""
        return self._use_libuv

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


def _settle(done: concurrent.futures.Future[bytes], task: asyncio.Task[bytes]) -> None:
    error = None if task.cancelled() else task.exception()
    if task.cancelled():
        done.cancel()
    elif error is not None:
        done.set_exception(error)
    else:
        done.set_result(task.result())


async def _abandon(store: _aio.Store, key: str, started: list[asyncio.Task[bytes]]) -> None:
    # A pop whose caller stopped waiting (Ctrl-C): its value must stay in the queue. (This
    # runs after the pop's start on the loop, which was handed over first.)
    for task in started:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        elif not task.cancelled() and task.exception() is None:
            await store.queue_push_front(key, task.result())


def any_store_open() -> bool:
    """Return whether a blocking store of this process is still open."""
    return any(not s._closed for s in list(_live_stores))


def close_all_stores() -> None:
    """Close every blocking store still open, and the async stores of those dropped without
    being closed, each within :data:`SHUTDOWN_TIMEOUT` (before the loop thread stops).

    A failure to close one is logged and the others are closed still: exit must not hang on
    a dead peer.
    """
    stores: list[_aio.Store] = []
    for store in list(_live_stores):
        if not store._closed:
            store._closed = True
            store._dropped.detach()
            stores.append(store.async_store)
    stores += _orphans
    _orphans.clear()
    for async_store in stores:
        try:
            run(async_store.aclose(), timeout=SHUTDOWN_TIMEOUT)
        except Exception as exc:
            logger.debug("closing %r failed: %s", async_store, exc)
