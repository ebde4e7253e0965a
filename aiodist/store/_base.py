"""The asynchronous key/value store interface that every aiodist store implements."""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self

from .._util._timeouts import DEFAULT_STORE_TIMEOUT, Timeout, to_seconds
from ..errors import DistStoreError, DistUsageError
from ._state import barrier_timeout_error, format_keys

__all__ = ["Store", "Value", "check_world_size", "encode_key", "encode_value", "settled"]

#: The longest pause between two looks at a counter when a store can only poll it.
_MAX_BARRIER_POLL = 0.05

#: What a store accepts as a value: text is stored as UTF-8.
Value = bytes | bytearray | memoryview | str


def encode_key(key: str | bytes) -> bytes:
    """Return ``key`` as the bytes the store keeps.

    Raises:
        DistUsageError: ``key`` is neither ``str`` nor ``bytes``.
    """
    if isinstance(key, str):
        return key.encode()
    if isinstance(key, bytes):
        return key
    raise DistUsageError(f"store keys must be str, got {type(key).__name__}")


def encode_value(value: Value) -> bytes:
    """Return ``value`` as bytes (text as UTF-8).

    Raises:
        DistUsageError: ``value`` is not bytes-like or ``str``.
    """
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise DistUsageError(f"store values must be bytes or str, got {type(value).__name__}")


class Store(abc.ABC):
    """A key/value store shared by the ranks of a job, with torch's store semantics.

    Every method that may talk to the network or wait is a coroutine. ``get`` and ``wait``
    wait for missing keys up to the store's timeout (:attr:`timeout`, settable with
    :meth:`set_timeout`); past it they raise :class:`~aiodist.errors.DistTimeoutError`
    and the store stays usable. Stores are async context managers.
    """

    def __init__(self, timeout: Timeout = None) -> None:
        self._timeout = to_seconds(timeout, DEFAULT_STORE_TIMEOUT)

    async def lease(self, key: str, value: Value | None, *, append: bool = False) -> bool:
        """Have ``key`` set to ``value`` if this store's connection to its server ends.

        A lease is how the server tells the other users of the store that this one went
        away without saying goodbye (its process died, or its host became unreachable): the
        server sets ``key`` when the connection ends. A lease never overwrites: if ``key``
        holds a value already (another client's lease, say), an aiodist TCPStore server
        records this one under the first free key of ``key/1``, ``key/2``, ..., so that the
        leases of many clients on one key are all recorded, in order (an etcd store keeps
        the first). With ``append``, the server appends ``value`` to ``key`` instead
        (creating it), so that one key collects the value of every client that went: a
        reader learns who went in one request, however many clients there are. ``None``
        withdraws the lease on ``key``, of either kind; a client holds one lease per key.
        Returns whether the store holds leases: an aiodist TCPStore client and an EtcdStore
        do; in-process and file stores have no connection to lose.

        Raises:
            DistNetworkError: the server went away.
        """
        return False

    @property
    def lease_lapse(self) -> float:
        """Seconds a lease may take, at most, to be carried out once its holder is gone.

        0 where the server sees the holder's connection end (a TCPStore: the lease is
        carried out as the holder's peers see their connections to it end); an EtcdStore's
        lease time to live, since etcd learns that a holder is gone only when its lease is
        no longer renewed.
        """
        return 0.0

    def local_address(self) -> str | None:
        """The local address this store's connection to its server uses, if it has one.

        In-process and file stores have none (``None``). A process group's ranks listen on
        this address by default: the interface that reaches the store reaches the peers.
        """
        return None

    @property
    def timeout(self) -> float | None:
        """Seconds that ``get``, ``wait`` and blocking ``queue_pop`` wait; ``None`` = forever."""
        return self._timeout

    def set_timeout(self, timeout: Timeout) -> None:
        """Set the default wait deadline (seconds or ``timedelta``; ``None`` waits forever).

        Raises:
            DistUsageError: the timeout is negative or of the wrong type.
        """
        self._timeout = to_seconds(timeout, None)

    @abc.abstractmethod
    async def set(self, key: str, value: Value) -> None:
        """Store ``value`` under ``key``, replacing any old value, and wake its waiters."""

    @abc.abstractmethod
    async def get(self, key: str) -> bytes:
        """Return the value of ``key``, waiting up to the store timeout for it to appear.

        Raises:
            DistTimeoutError: the key did not appear in time.
        """

    @abc.abstractmethod
    async def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer under ``key`` (missing keys start at 0); return it.

        The value is stored as ASCII decimal, so ``get`` of a counter returns e.g. ``b"3"``.

        Raises:
            DistStoreError: the existing value is not an integer.
        """

    @abc.abstractmethod
    async def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        """Atomically set ``key`` to ``desired`` if it currently holds ``expected``.

        A missing key is created only when ``expected`` is empty. Returns the value the key
        holds afterwards, or ``expected`` when the key is missing and was not created.
        """

    @abc.abstractmethod
    async def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        """Wait until every key in ``keys`` exists.

        Raises:
            DistTimeoutError: naming the missing keys and the time waited.
        """

    @abc.abstractmethod
    async def check(self, keys: Sequence[str]) -> bool:
        """Return whether every key in ``keys`` exists, without waiting."""

    @abc.abstractmethod
    async def delete_key(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""

    async def delete_prefix(self, prefix: str) -> int:
        """Delete every key that starts with ``prefix`` (every key, for ``""``); return how
        many it deleted. Queues are not deleted, as with :meth:`delete_key`.

        This is how a namespace of keys is removed once its users are done (a process
        group's, when its last rank leaves): one request where the store has one for it (an
        aiodist TCPStore's server, a FileStore, a HashStore), else (this default, and
        torch's wire) :meth:`list_keys` and a :meth:`delete_key` for each key found.
        """
        doomed = [k for k in await self.list_keys() if k.startswith(prefix)]
        deleted = await asyncio.gather(*(self.delete_key(k) for k in doomed))
        return sum(deleted)

    @abc.abstractmethod
    async def num_keys(self) -> int:
        """Return the number of keys in the store."""

    @abc.abstractmethod
    async def list_keys(self) -> list[str]:
        """Return the keys in the store."""

    @abc.abstractmethod
    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Return the values of ``keys``, waiting for all of them like :meth:`get`.

        Raises:
            DistTimeoutError: a key did not appear in time.
        """

    @abc.abstractmethod
    async def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        """Set each of ``keys`` to the matching entry of ``values`` in one request.

        Raises:
            DistUsageError: the two sequences differ in length.
        """

    @abc.abstractmethod
    async def append(self, key: str, value: Value) -> None:
        """Append ``value`` to ``key``, creating it if missing."""

    @abc.abstractmethod
    async def queue_push(self, key: str, value: Value) -> None:
        """Push ``value`` onto the FIFO queue ``key``, waking one popper."""

    @abc.abstractmethod
    async def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Pop the oldest value of queue ``key``.

        A pop that is cancelled never loses a value: either it returned it, or the value is
        in the queue (a value taken as the cancellation came is put back at the head, see
        :meth:`queue_push_front`).

        Raises:
            QueueEmptyError: ``block`` is false and the queue is empty.
            DistTimeoutError: ``block`` is true and nothing arrived within the store timeout.
        """

    async def queue_push_front(self, key: str, value: Value) -> None:
        """Put ``value`` at the head of queue ``key``, waking one popper: the next pop
        returns it. This is how a pop that was cancelled after it took ``value`` gives it
        back. Stores that cannot put a value first put it at the end (this default, and
        torch's wire).
        """
        await self.queue_push(key, value)

    @abc.abstractmethod
    async def queue_len(self, key: str) -> int:
        """Return the number of values in queue ``key``."""

    async def barrier(self, key: str, world_size: int, timeout: Timeout = None) -> None:
        """Count this caller in at ``key`` and wait until ``world_size`` callers are in.

        torch's ``Store.barrier``: the count is the ASCII counter ``key`` (as with
        :meth:`add`), so the barrier passes once ``world_size`` calls (from any clients)
        have added to it; use a new key for each barrier. ``timeout`` defaults to the store
        timeout. Stores with a server or shared memory wait there; this default polls.

        Raises:
            DistUsageError: ``world_size`` is not a positive integer.
            DistStoreError: ``key`` holds something that is not an integer.
            DistTimeoutError: fewer than ``world_size`` arrived in time; the message names
                the key and the count reached. The caller stays counted in.
        """
        world = check_world_size(world_size)
        seconds = to_seconds(timeout, self.timeout)
        start = time.monotonic()
        try:
            arrived = await self.add(key, 1)
        except DistStoreError as exc:
            # The counting is an add; the caller called barrier.
            raise DistStoreError(str(exc).replace("add on key", "barrier on key", 1)) from None
        delay = 0.001
        while arrived < world:
            waited = time.monotonic() - start
            if seconds is not None and waited >= seconds:
                raise barrier_timeout_error(key.encode(), arrived, world, waited)
            await asyncio.sleep(delay if seconds is None else min(delay, seconds - waited))
            delay = min(delay * 2, _MAX_BARRIER_POLL)
            value = await self.get(key)
            try:
                arrived = int(value)
            except ValueError:
                raise DistStoreError(
                    f"barrier on key {format_keys([key.encode()])}: its value {value[:64]!r} "
                    "is not an integer"
                ) from None

    @abc.abstractmethod
    async def clone(self) -> Store:
        """Return a new, independent handle to the same store (a new connection, if any)."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release the store's resources. Closing twice is harmless."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


async def settled(future: asyncio.Future[Any], limit: float | None = None) -> bool:
    """Wait for ``future`` to be done (up to ``limit`` seconds; ``None``: no limit), through
    cancellations: the caller is handling a failure or a cancellation already (it gives back
    what a request it gave up on took). Returns whether the caller was cancelled meanwhile
    (for it to raise that)."""
    loop = asyncio.get_running_loop()
    end = None if limit is None else loop.time() + limit
    cancelled = False
    while not future.done() and (end is None or loop.time() < end):
        try:
            await asyncio.wait([future], timeout=None if end is None else end - loop.time())
        except asyncio.CancelledError:
            cancelled = True
    return cancelled


def check_world_size(world_size: object) -> int:
    """Return ``world_size`` if it is a positive int.

    Raises:
        DistUsageError: it is not.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise DistUsageError(f"barrier world_size must be a positive int, got {world_size!r}")
    return world_size


def check_lengths(keys: Sequence[object], values: Sequence[object]) -> None:
    """Raise :class:`DistUsageError` unless ``keys`` and ``values`` have equal length."""
    if len(keys) != len(values):
        raise DistUsageError(
            f"multi_set got {len(keys)} keys but {len(values)} values: they must match"
        )
