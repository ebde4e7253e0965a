"""In-memory key/value state with waiters: the one implementation of the store's semantics.

``HashStore`` wraps it directly and the TCPStore server serves it to its clients, so the rules
(ASCII counters, compare_set, which writes wake waiters, queues) live in exactly one place.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable, Sequence

from ..errors import DistStoreError, DistTimeoutError

__all__ = ["KeyValueState", "format_keys", "timeout_error"]


def format_keys(keys: Iterable[bytes]) -> str:
    """Render keys for an error message."""
    return ", ".join(repr(k.decode(errors="backslashreplace")) for k in keys)


def timeout_error(
    keys: Sequence[bytes], missing: Iterable[bytes], waited: float
) -> DistTimeoutError:
    """Build the error for a wait on ``keys`` that gave up after ``waited`` seconds."""
    return DistTimeoutError(
        f"store wait timed out after {waited * 1000:.0f} ms waiting for keys "
        f"[{format_keys(keys)}]; still missing: [{format_keys(missing)}]"
    )


class _Waiter:
    __slots__ = ("future", "missing")

    def __init__(self, future: asyncio.Future[None], missing: set[bytes]) -> None:
        self.future = future
        self.missing = missing


class KeyValueState:
    """Keys, values, queues and the waiters on them, for one event loop."""

    def __init__(self) -> None:
        self._data: dict[bytes, bytes] = {}
        self._queues: dict[bytes, deque[bytes]] = {}
        self._waiters: dict[bytes, list[_Waiter]] = {}
        self._change_waiters: dict[bytes, list[asyncio.Future[None]]] = {}

    def __repr__(self) -> str:
        return f"<KeyValueState keys={len(self._data)} queues={len(self._queues)}>"

    # -- reads ---------------------------------------------------------------------------
    def get(self, key: bytes) -> bytes | None:
        """Return the value of ``key`` or ``None``."""
        return self._data.get(key)

    def exists(self, key: bytes) -> bool:
        """Whether ``key`` holds a value or a non-empty queue."""
        return key in self._data or bool(self._queues.get(key))

    def check(self, keys: Iterable[bytes]) -> bool:
        """Whether every key exists."""
        return all(self.exists(k) for k in keys)

    def num_keys(self) -> int:
        """The number of key/value entries (queues are not counted, as in torch)."""
        return len(self._data)

    def list_keys(self) -> list[bytes]:
        """All key/value keys, in insertion order."""
        return list(self._data)

    @property
    def waiter_count(self) -> int:
        """The number of pending waits and change watches (a leak check for servers)."""
        waits = {id(w) for ws in self._waiters.values() for w in ws}
        return len(waits) + sum(len(fs) for fs in self._change_waiters.values())

    def queue_len(self, key: bytes) -> int:
        """The number of values in queue ``key``."""
        queue = self._queues.get(key)
        return len(queue) if queue else 0

    # -- writes --------------------------------------------------------------------------
    def set(self, key: bytes, value: bytes) -> None:
        """Set ``key`` and wake its waiters."""
        self._data[key] = value
        self._wake(key)

    def add(self, key: bytes, amount: int) -> int:
        """Add to the ASCII-decimal counter ``key`` (missing = 0) and return the new value.

        Raises:
            DistStoreError: the current value is not an integer; the key is left unchanged.
        """
        old = self._data.get(key, b"0")
        try:
            current = int(old)
        except ValueError:
            raise DistStoreError(
                f"add on key {format_keys([key])}: its value {old[:64]!r} is not an integer"
            ) from None
        new = current + amount
        self.set(key, str(new).encode())
        return new

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        """torch's compare-and-swap; returns the value afterwards (see ``Store.compare_set``)."""
        current = self._data.get(key)
        if current is None:
            if expected:
                return expected
            self.set(key, desired)
            return desired
        if current == expected:
            self.set(key, desired)
            return desired
        return current

    def delete(self, key: bytes) -> bool:
        """Delete ``key``; return whether it existed. Waiters are not affected."""
        return self._data.pop(key, None) is not None

    def append(self, key: bytes, value: bytes) -> None:
        """Append to ``key`` (creating it) and wake its waiters."""
        self.set(key, self._data.get(key, b"") + value)

    def queue_push(self, key: bytes, value: bytes) -> None:
        """Push onto queue ``key`` and wake its waiters."""
        self._queues.setdefault(key, deque()).append(value)
        self._wake(key)

    def queue_pop(self, key: bytes) -> bytes | None:
        """Pop the oldest value of queue ``key``, or ``None`` if it is empty."""
        queue = self._queues.get(key)
        if not queue:
            return None
        value = queue.popleft()
        if not queue:
            del self._queues[key]
        return value

    # -- waiting -------------------------------------------------------------------------
    def watch(self, keys: Sequence[bytes]) -> asyncio.Future[None]:
        """Return a future that resolves once every key exists.

        Cancelling the future unregisters it, so abandoned waits leave nothing behind.
        """
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        missing = {k for k in keys if not self.exists(k)}
        if not missing:
            future.set_result(None)
            return future
        waiter = _Waiter(future, missing)
        for key in missing:
            self._waiters.setdefault(key, []).append(waiter)
        future.add_done_callback(lambda _: self._forget(waiter))
        return future

    def watch_change(self, key: bytes) -> asyncio.Future[None]:
        """Return a future that resolves at the next write of ``key`` (set, add, append...).

        Counting barriers use it to re-check a counter; cancelling it unregisters it.
        """
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._change_waiters.setdefault(key, []).append(future)
        future.add_done_callback(lambda f: self._forget_change(key, f))
        return future

    async def wait(self, keys: Sequence[bytes], timeout: float | None) -> None:
        """Wait until every key exists.

        Raises:
            DistTimeoutError: naming the keys still missing after ``timeout`` seconds.
        """
        future = self.watch(keys)
        if future.done():
            return
        start = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                await future
        except TimeoutError:
            missing = [k for k in keys if not self.exists(k)]
            raise timeout_error(keys, missing, time.monotonic() - start) from None

    def _wake(self, key: bytes) -> None:
        changes = self._change_waiters.pop(key, None)
        if changes:
            for future in changes:
                if not future.done():
                    future.set_result(None)
        waiters = self._waiters.pop(key, None)
        if not waiters:
            return
        for waiter in waiters:
            waiter.missing.discard(key)
            if not waiter.missing and not waiter.future.done():
                waiter.future.set_result(None)

    def _forget(self, waiter: _Waiter) -> None:
        for key in waiter.missing:
            waiters = self._waiters.get(key)
            if waiters is None:
                continue
            try:
                waiters.remove(waiter)
            except ValueError:
                continue
            if not waiters:
                del self._waiters[key]

    def _forget_change(self, key: bytes, future: asyncio.Future[None]) -> None:
        futures = self._change_waiters.get(key)
        if futures is None:
            return
        try:
            futures.remove(future)
        except ValueError:
            return
        if not futures:
            del self._change_waiters[key]
