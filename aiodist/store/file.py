"""FileStore: a store kept in a file that every process of the job can open.

The file is an append-only log of records ``u32 keylen, key, u32 vallen, value`` (little
endian), the layout torch's ``FileStore`` writes, so the two can share a file:

* ``/key`` sets a user key (counters are ASCII decimal, as everywhere),
* ``-/key`` deletes it (a tombstone),
* ``refcount/`` and ``cleanup/`` count the open and the closed instances,
* ``+/key`` pushes onto queue ``key`` and ``^/key`` pops from it (aiodist only: torch's
  FileStore has no queues).

Each process replays the log into a :class:`KeyValueState` and afterwards reads only what was
appended since its last offset. Writers hold an exclusive ``flock`` while they read the tail and
append, which makes ``add``, ``compare_set`` and ``queue_pop`` atomic across processes. All
file I/O runs in the loop's default executor so the event loop never waits on the disk or on
another process's lock; waiting for a key polls the file with a growing delay.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import logging
import os
import struct
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import TypeVar

from .._util._timeouts import Timeout, to_seconds
from ..errors import DistStoreError, DistUsageError, QueueEmptyError
from ._base import Store, Value, check_lengths, encode_key, encode_value, settled
from ._state import KeyValueState, format_keys, timeout_error

__all__ = ["FileStore"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_LEN = struct.Struct("<I")
_USER = b"/"
_DELETE = b"-"
_PUSH = b"+/"
_PUSH_FRONT = b"</"
_POP = b"^/"
_REFCOUNT = b"refcount/"
_CLEANUP = b"cleanup/"

#: Polling for a key starts at 1 ms and doubles up to this many seconds between looks.
_MAX_POLL_INTERVAL = 0.02


def _record(key: bytes, value: bytes) -> bytes:
    return b"".join((_LEN.pack(len(key)), key, _LEN.pack(len(value)), value))


class _Log:
    """One open file and this process's replay of it. Every method blocks: run it in a thread.

    A ``threading.Lock`` serialises the executor threads of one FileStore object (``flock``
    does not exclude two threads sharing one open file description); ``flock`` excludes
    other FileStore objects and other processes.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.state = KeyValueState()  # no waiters are ever registered: it is only a container
        self.internal: dict[bytes, bytes] = {}
        self._lock = threading.Lock()
        self._fd = -1
        self._offset = 0
        self._closed = False
        self._finalizer: weakref.finalize[[int], _Log] | None = None

    # -- file access ---------------------------------------------------------------------
    def _open(self) -> None:
        try:
            self._fd = os.open(
                self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644
            )
        except OSError as exc:
            raise DistStoreError(
                f"FileStore cannot open {self.path!r}: {exc.strerror or exc}"
            ) from exc
        self._finalizer = weakref.finalize(self, os.close, self._fd)
        # Not at exit: the blocking facade closes open stores then, and needs the file.
        self._finalizer.atexit = False
        with self._flocked(exclusive=True):
            self._add_internal(_REFCOUNT, 1)

    @contextmanager
    def _flocked(self, exclusive: bool) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            self._catch_up()
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    @contextmanager
    def locked(self, exclusive: bool) -> Iterator[None]:
        """Hold the file lock with this process's view brought up to date."""
        with self._lock:
            if self._closed:
                raise DistStoreError(f"FileStore {self.path!r} is closed")
            if self._fd < 0:
                self._open()
            elif not exclusive and os.fstat(self._fd).st_size == self._offset:
                # Nothing was appended since we last read: the view is current, and a
                # reader need not queue behind writers for the lock.
                yield
                return
            with self._flocked(exclusive):
                yield

    def _catch_up(self) -> None:
        size = os.fstat(self._fd).st_size
        if size < self._offset:
            # The file was truncated or replaced: start over from its beginning.
            logger.debug("FileStore %s shrank from %d to %d bytes", self.path, self._offset, size)
            self.state = KeyValueState()
            self.internal.clear()
            self._offset = 0
        if size == self._offset:
            return
        data = os.pread(self._fd, size - self._offset, self._offset)
        pos = 0
        while pos + _LEN.size <= len(data):
            (key_len,) = _LEN.unpack_from(data, pos)
            value_at = pos + _LEN.size + key_len
            if value_at + _LEN.size > len(data):
                break
            (value_len,) = _LEN.unpack_from(data, value_at)
            end = value_at + _LEN.size + value_len
            if end > len(data):
                break
            self._apply(data[pos + _LEN.size : value_at], data[value_at + _LEN.size : end])
            pos = end
        # An incomplete record at the end is left unread; writers append whole records
        # under the lock, so only a writer that died mid-write leaves one.
        self._offset += pos

    def _apply(self, key: bytes, value: bytes) -> None:
        if key.startswith(_DELETE):
            target = key[len(_DELETE) :]
            if target.startswith(_USER):
                self.state.delete(target[len(_USER) :])
            else:
                self.internal.pop(target, None)
        elif key.startswith(_USER):
            self.state.set(key[len(_USER) :], value)
        elif key.startswith(_PUSH):
            self.state.queue_push(key[len(_PUSH) :], value)
        elif key.startswith(_PUSH_FRONT):
            self.state.queue_push_front(key[len(_PUSH_FRONT) :], value)
        elif key.startswith(_POP):
            self.state.queue_pop(key[len(_POP) :])
        else:
            self.internal[key] = value

    def write(self, *records: bytes) -> None:
        """Append records whose effect is already applied to the view (file lock held)."""
        data = b"".join(records)
        try:
            written = os.write(self._fd, data)
            if written != len(data):
                raise OSError(f"short write: {written} of {len(data)} bytes")
        except OSError as exc:
            # The view is ahead of the file now: forget it and replay the file next time.
            self.state = KeyValueState()
            self.internal.clear()
            self._offset = 0
            raise DistStoreError(f"FileStore cannot write to {self.path!r}: {exc}") from exc
        self._offset += written

    def _add_internal(self, key: bytes, amount: int) -> int:
        new = int(self.internal.get(key, b"0")) + amount
        self.internal[key] = str(new).encode()
        self.write(_record(key, self.internal[key]))
        return new

    def close(self, world_size: int) -> None:
        """Count this instance out; the last one of a known world removes the file."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._fd < 0:
                # Never used: still count it in and out, or a known world never reaches
                # its count of closed instances and the file is never removed.
                if not os.path.exists(self.path):
                    return
                self._open()
            try:
                with self._flocked(exclusive=True):
                    finished = self._add_internal(_CLEANUP, 1)
                    refs = self._add_internal(_REFCOUNT, -1)
                    if refs == 0 and world_size >= 0 and finished >= world_size:
                        logger.debug("FileStore %s: last instance closed, removing", self.path)
                        with suppress(FileNotFoundError):
                            os.remove(self.path)
            finally:
                assert self._finalizer is not None
                self._finalizer()

    # -- operations (each takes the file lock once) -------------------------------------
    def get(self, key: bytes) -> bytes | None:
        with self.locked(exclusive=False):
            return self.state.get(key)

    def missing(self, keys: Sequence[bytes]) -> list[bytes]:
        with self.locked(exclusive=False):
            return [k for k in keys if not self.state.exists(k)]

    def multi_get(self, keys: Sequence[bytes]) -> list[bytes] | None:
        with self.locked(exclusive=False):
            values = [self.state.get(k) for k in keys]
        if any(v is None for v in values):
            return None
        return [v for v in values if v is not None]

    def read(self, fn: Callable[[KeyValueState], T]) -> T:
        with self.locked(exclusive=False):
            return fn(self.state)

    def count_all_keys(self) -> int:
        """The user keys and the internal ones (the reference and cleanup counters)."""
        with self.locked(exclusive=False):
            return self.state.num_keys() + len(self.internal)

    def set_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        with self.locked(exclusive=True):
            for key, value in items:
                self.state.set(key, value)
            self.write(*(_record(_USER + k, v) for k, v in items))

    def add(self, key: bytes, amount: int) -> int:
        with self.locked(exclusive=True):
            new = self.state.add(key, amount)
            self.write(_record(_USER + key, str(new).encode()))
            return new

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        with self.locked(exclusive=True):
            before = self.state.get(key)
            result = self.state.compare_set(key, expected, desired)
            after = self.state.get(key)
            if after is not None and after != before:
                self.write(_record(_USER + key, after))
            return result

    def append(self, key: bytes, value: bytes) -> None:
        with self.locked(exclusive=True):
            self.state.append(key, value)
            new = self.state.get(key)
            assert new is not None
            self.write(_record(_USER + key, new))

    def delete(self, key: bytes) -> bool:
        with self.locked(exclusive=True):
            existed = self.state.delete(key)
            if existed:
                self.write(_record(_DELETE + _USER + key, b""))
            return existed

    def delete_prefix(self, prefix: bytes) -> int:
        with self.locked(exclusive=True):
            doomed = self.state.delete_prefix(prefix)
            if doomed:
                self.write(*(_record(_DELETE + _USER + key, b"") for key in doomed))
            return len(doomed)

    def queue_push(self, key: bytes, value: bytes) -> None:
        with self.locked(exclusive=True):
            self.state.queue_push(key, value)
            self.write(_record(_PUSH + key, value))

    def queue_push_front(self, key: bytes, value: bytes) -> None:
        with self.locked(exclusive=True):
            self.state.queue_push_front(key, value)
            self.write(_record(_PUSH_FRONT + key, value))

    def queue_pop(self, key: bytes, abandoned: threading.Event) -> bytes | None:
        # A reader's look first: an empty queue needs no exclusive lock.
        with self.locked(exclusive=False):
            if not self.state.queue_len(key):
                return None
        with self.locked(exclusive=True):
            if abandoned.is_set():
                return None  # (its caller was cancelled while this waited for the lock)
            value = self.state.queue_pop(key)
            if value is not None:
                self.write(_record(_POP + key, b""))
            return value


class FileStore(Store):
    """A store in a file on a filesystem every process can reach (local disk, NFS).

    Processes (and several FileStore objects in one process) that open the same path see the
    same keys. The file format is torch's, so a torch ``FileStore`` can share the file.
    ``num_keys`` and ``list_keys`` count user keys only (torch also counts its internal
    reference counter), and ``delete_key`` reports whether the key existed (torch's always
    says ``True``).

    When ``world_size`` is known, the file is removed once that many instances have been
    closed and none is open any more, as torch does: close every FileStore (or use
    ``async with``) for the file to go away. An instance dropped without ``aclose()`` is
    closed when it is garbage collected (torch's FileStore counts itself out in its
    destructor): a short write under the file lock, on the thread that collects it.

    The constructor does no I/O; the file is opened, created if missing, and this instance
    counted in by ``open()`` or the first operation.

    Args:
        file_name: path of the file (created if missing).
        world_size: the number of processes that will use the file, or ``-1`` if unknown.
        timeout: how long ``get``, ``wait`` and blocking ``queue_pop`` wait (seconds or
            ``timedelta``); ``None`` gives the default of 300 s.

    Raises:
        DistUsageError: ``file_name`` is empty or ``world_size`` is neither ``-1`` nor
            positive.
    """

    def __init__(self, file_name: str | os.PathLike[str], world_size: int | None = -1, *,
                 timeout: Timeout = None) -> None:  # fmt: skip
        super().__init__(timeout)
        path = os.fspath(file_name)
        if not isinstance(path, str) or not path:
            raise DistUsageError(f"FileStore needs a file name, got {file_name!r}")
        if world_size is None:
            world_size = -1
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise DistUsageError(f"world_size must be an int, got {type(world_size).__name__}")
        if world_size == 0 or world_size < -1:
            raise DistUsageError(f"FileStore world_size must be -1 or positive, got {world_size}")
        self._path = path
        self._world_size = world_size
        self._log = _Log(path)
        self._closed = False
        self._collected = weakref.finalize(self, self._log.close, world_size)
        # Not at exit: the blocking facade closes open stores then, with the loop running.
        self._collected.atexit = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"keys={self._log.state.num_keys()}"
        return (
            f"<FileStore path={self._path!r} world_size={self._world_size} {state} "
            f"timeout={self.timeout}>"
        )

    @property
    def path(self) -> str:
        """The file's path."""
        return self._path

    @property
    def world_size(self) -> int:
        """The number of users given at construction (``-1``: unknown)."""
        return self._world_size

    async def _io(self, fn: Callable[..., T], *args: object) -> T:
        call = functools.partial(fn, *args)
        try:
            future = asyncio.get_running_loop().run_in_executor(None, call)
        except RuntimeError:
            # During interpreter exit executors take no new work; what still runs then is
            # the final close, which is short enough to do right here.
            return call()
        return await future

    async def _poll(
        self,
        attempt: Callable[[], Awaitable[T | None]],
        keys: Sequence[bytes],
        timeout: float | None,
    ) -> T:
        """Await ``attempt()`` until it returns a value, or raise after ``timeout``."""
        start = time.monotonic()
        delay = 0.001
        while True:
            result = await attempt()
            if result is not None:
                return result
            waited = time.monotonic() - start
            if timeout is not None and waited >= timeout:
                missing = await self._io(self._log.missing, keys)
                raise timeout_error(keys, missing or keys, waited)
            pause = delay if timeout is None else min(delay, timeout - waited)
            await asyncio.sleep(pause)
            delay = min(delay * 2, _MAX_POLL_INTERVAL)

    async def set(self, key: str, value: Value) -> None:
        await self._io(self._log.set_many, [(encode_key(key), encode_value(value))])

    async def get(self, key: str) -> bytes:
        k = encode_key(key)
        return await self._poll(functools.partial(self._io, self._log.get, k), [k], self.timeout)

    async def add(self, key: str, amount: int) -> int:
        return await self._io(self._log.add, encode_key(key), int(amount))

    async def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        return await self._io(
            self._log.compare_set, encode_key(key), encode_value(expected), encode_value(desired)
        )

    async def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        encoded = [encode_key(k) for k in keys]
        deadline = to_seconds(timeout, self.timeout)

        def ready() -> bool | None:
            return True if not self._log.missing(encoded) else None

        await self._poll(functools.partial(self._io, ready), encoded, deadline)

    async def check(self, keys: Sequence[str]) -> bool:
        encoded = [encode_key(k) for k in keys]
        return not await self._io(self._log.missing, encoded)

    async def delete_key(self, key: str) -> bool:
        return await self._io(self._log.delete, encode_key(key))

    async def delete_prefix(self, prefix: str) -> int:
        return await self._io(self._log.delete_prefix, encode_key(prefix))

    async def num_keys(self) -> int:
        return await self._io(self._log.read, KeyValueState.num_keys)

    async def list_keys(self) -> list[str]:
        keys = await self._io(self._log.read, KeyValueState.list_keys)
        return [k.decode(errors="surrogateescape") for k in keys]

    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        encoded = [encode_key(k) for k in keys]
        if not encoded:
            return []
        return await self._poll(
            functools.partial(self._io, self._log.multi_get, encoded), encoded, self.timeout
        )

    async def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        check_lengths(keys, values)
        items = [(encode_key(k), encode_value(v)) for k, v in zip(keys, values, strict=True)]
        if items:
            await self._io(self._log.set_many, items)

    async def append(self, key: str, value: Value) -> None:
        await self._io(self._log.append, encode_key(key), encode_value(value))

    async def queue_push(self, key: str, value: Value) -> None:
        await self._io(self._log.queue_push, encode_key(key), encode_value(value))

    async def queue_push_front(self, key: str, value: Value) -> None:
        await self._io(self._log.queue_push_front, encode_key(key), encode_value(value))

    async def queue_pop(self, key: str, block: bool = True) -> bytes:
        k = encode_key(key)
        if not block:
            value = await self._take(k)
            if value is None:
                raise QueueEmptyError(f"queue {format_keys([k])} is empty")
            return value
        return await self._poll(functools.partial(self._take, k), [k], self.timeout)

    async def _take(self, key: bytes) -> bytes | None:
        """One pop in a thread. Cancelled, the thread (which cannot be stopped) is told not
        to pop and waited for; a value it popped all the same goes back at the head of the
        queue before the cancellation goes on."""
        abandoned = threading.Event()
        popping = asyncio.get_running_loop().run_in_executor(
            None, self._log.queue_pop, key, abandoned
        )
        try:
            return await asyncio.shield(popping)
        except asyncio.CancelledError:
            abandoned.set()
            await settled(popping)
            if not popping.cancelled() and popping.exception() is None:
                value = popping.result()
                if value is not None:
                    giving = asyncio.ensure_future(self._io(self._log.queue_push_front, key, value))
                    await settled(giving)
                    if not giving.cancelled() and giving.exception() is not None:
                        logger.warning(
                            "a cancelled queue_pop could not give its value back: %s",
                            giving.exception(),
                        )
            raise

    async def queue_len(self, key: str) -> int:
        k = encode_key(key)
        return await self._io(self._log.read, lambda state: state.queue_len(k))

    async def clone(self) -> FileStore:
        """Return another instance on the same file (counted like any other instance)."""
        return FileStore(self._path, self._world_size, timeout=self.timeout)

    async def open(self) -> None:
        """Open the file (creating it if missing) and count this instance in, as torch's
        constructor does; otherwise the first operation does it.

        Raises:
            DistStoreError: the file cannot be opened, or the store is closed.
        """
        await self._io(self._log.read, KeyValueState.num_keys)

    async def count_all_keys(self) -> int:
        """Return the number of keys as torch's ``FileStore.num_keys()`` counts them: with the
        instances' reference counter (and, once one has closed, the cleanup counter)."""
        return await self._io(self._log.count_all_keys)

    async def aclose(self) -> None:
        """Count this instance out, removing the file if it was the last of its world."""
        if self._closed:
            return
        self._closed = True
        self._collected.detach()
        await self._io(self._log.close, self._world_size)
