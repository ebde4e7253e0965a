"""In-memory key/value state with waiters: the one implementation of the store's semantics.

``HashStore`` wraps it directly and the TCPStore server serves it to its clients, so the rules
(ASCII counters, compare_set, which writes wake waiters, queues) live in exactly one place.

Waiting costs O(1) per waiter to register and to drop, and a write wakes the waiters of its
key in O(woken): the waiters of a key sit in an insertion-ordered dict (not a list, whose
``remove`` made N abandoned waits cost O(N**2)), and a counter's threshold waits (barriers)
are grouped by threshold, so an ``add`` that does not reach one wakes nobody.

**Queue items promised to a waiter.** torch's client pops in two requests: a WAIT on the
queue's key, then a POP. A wait answered because of a queue's items (at once, or woken by a
push) therefore *promises* one item to its owner (the server's connection), and until that
owner pops, the item is invisible to everyone else: another wait does not count it, another
pop does not take it, a push wakes a new waiter only for an item nobody was promised. So a
woken client always finds its item, however the requests of several clients interleave
(torch's own server answers such a second wait at once, and one of the two poppers then gets
``QueueEmptyError``). A promise ends with its owner's pop, or with any other request of the
owner, or its connection (``release``): the item is then offered to the next waiter.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Hashable, Iterable, Sequence

from ..errors import DistStoreError, DistStoreTimeoutError

__all__ = [
    "I64_MAX",
    "I64_MIN",
    "KeyValueState",
    "barrier_timeout_error",
    "format_keys",
    "parse_counter",
    "timeout_error",
]

#: Counters are signed 64-bit integers, as in torch's stores.
I64_MIN, I64_MAX = -(2**63), 2**63 - 1


def format_keys(keys: Iterable[bytes]) -> str:
    """Render keys for an error message."""
    return ", ".join(repr(k.decode(errors="backslashreplace")) for k in keys)


def timeout_error(
    keys: Sequence[bytes], missing: Iterable[bytes], waited: float
) -> DistStoreTimeoutError:
    """Build the error for a wait on ``keys`` that gave up after ``waited`` seconds."""
    return DistStoreTimeoutError(
        # "timeout": torch's word, which scripts (and torch's tests) match.
        f"store wait timeout: timed out after {waited * 1000:.0f} ms waiting for keys "
        f"[{format_keys(keys)}]; still missing: [{format_keys(missing)}]"
    )


def barrier_timeout_error(
    key: bytes, arrived: int | None, world_size: int, waited: float
) -> DistStoreTimeoutError:
    """Build the error for a barrier on ``key`` that gave up after ``waited`` seconds."""
    count = "?" if arrived is None else str(arrived)
    return DistStoreTimeoutError(
        f"store barrier {format_keys([key])} timed out after {waited * 1000:.0f} ms: "
        f"{count} of {world_size} arrived"
    )


def parse_counter(key: bytes, value: bytes, op: str = "add") -> int:
    """The integer an ASCII counter holds (``op`` names the operation in the error).

    Raises:
        DistStoreError: the value is not an integer.
    """
    try:
        return int(value)
    except ValueError:
        raise DistStoreError(
            f"{op} on key {format_keys([key])}: its value {value[:64]!r} is not an integer"
        ) from None


class _Waiter:
    """A wait for keys; called when its future is done, it unregisters itself."""

    __slots__ = ("future", "keys", "missing", "owner", "state")

    def __init__(
        self,
        state: KeyValueState,
        future: asyncio.Future[None],
        missing: set[bytes],
        keys: Sequence[bytes],
        owner: Hashable | None,
    ) -> None:
        self.state = state
        self.future = future
        self.missing = missing
        self.keys = keys
        self.owner = owner

    def __call__(self, _future: asyncio.Future[None]) -> None:
        self.state._forget(self)


class KeyValueState:
    """Keys, values, queues and the waiters on them, for one event loop.

    Reads and writes need no event loop (``FileStore`` replays its log into one from a
    thread); only the ``watch`` methods do.
    """

    def __init__(self) -> None:
        self._data: dict[bytes, bytes] = {}
        self._queues: dict[bytes, deque[bytes]] = {}
        # key -> the waits that still miss it (dicts as ordered sets: O(1) removal).
        self._waiters: dict[bytes, dict[_Waiter, None]] = {}
        # counter key -> threshold -> the futures waiting for the counter to reach it.
        self._thresholds: dict[bytes, dict[int, dict[asyncio.Future[None], None]]] = {}
        # queue key -> the owners promised one of its items each, oldest first.
        self._promised: dict[bytes, list[Hashable]] = {}
        #: owner -> the queue keys it holds a promise on (see the module's docstring).
        self.promise_owners: dict[Hashable, list[bytes]] = {}

    def __repr__(self) -> str:
        return f"<KeyValueState keys={len(self._data)} queues={len(self._queues)}>"

    # -- reads ---------------------------------------------------------------------------
    def get(self, key: bytes) -> bytes | None:
        """Return the value of ``key`` or ``None``."""
        return self._data.get(key)

    def exists(self, key: bytes) -> bool:
        """Whether ``key`` holds a value or a queue with an item nobody was promised."""
        if key in self._data:
            return True
        queue = self._queues.get(key)
        return queue is not None and len(queue) > len(self._promised.get(key, ()))

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
        """The number of pending waits and counter watches (a leak check for servers)."""
        waits = {id(w) for ws in self._waiters.values() for w in ws}
        return len(waits) + sum(
            len(fs) for targets in self._thresholds.values() for fs in targets.values()
        )

    def queue_len(self, key: bytes) -> int:
        """The number of values in queue ``key``."""
        queue = self._queues.get(key)
        return len(queue) if queue else 0

    # -- writes --------------------------------------------------------------------------
    def set(self, key: bytes, value: bytes) -> None:
        """Set ``key`` and wake its waiters."""
        self._data[key] = value
        if key in self._waiters or key in self._thresholds:
            self._wake(key)

    def add(self, key: bytes, amount: int, op: str = "add") -> int:
        """Add to the ASCII-decimal counter ``key`` (missing = 0) and return the new value.

        ``op`` names the operation in error messages (a barrier counts with ``add``).

        Raises:
            DistStoreError: the current value is not an integer, or the sum does not fit in
                a signed 64-bit integer; the key is left unchanged.
        """
        old = self._data.get(key)
        if old is None:
            new = amount
        else:
            try:
                new = int(old) + amount
            except ValueError:
                parse_counter(key, old, op)  # raises, naming the key and the value
                raise
        # Literal bounds (I64_MIN, I64_MAX): this is the hottest line of a store server.
        if not -9223372036854775808 <= new <= 9223372036854775807:
            raise DistStoreError(
                f"{op} on key {format_keys([key])}: the result {new} does not fit in a signed "
                "64-bit integer"
            )
        self._data[key] = b"%d" % new
        if key in self._waiters or key in self._thresholds:
            self._wake(key)
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

    def delete_prefix(self, prefix: bytes) -> list[bytes]:
        """Delete every key that starts with ``prefix``; return them (in insertion order).
        Waiters are not affected."""
        doomed = [k for k in self._data if k.startswith(prefix)]
        for key in doomed:
            del self._data[key]
        return doomed

    def append(self, key: bytes, value: bytes) -> None:
        """Append to ``key`` (creating it) and wake its waiters."""
        self.set(key, self._data.get(key, b"") + value)

    def queue_push(self, key: bytes, value: bytes) -> None:
        """Push onto queue ``key`` and wake the first wait it completes (one value, one
        popper, as torch's server does: waking every wait on the key would send all its
        blocking poppers to take one value, and torch's clients, which wait and then pop,
        would get ``QueueEmptyError`` where one value is pushed at a time)."""
        self._queues.setdefault(key, deque()).append(value)
        if key in self._waiters:
            self._wake_one(key)

    def queue_push_front(self, key: bytes, value: bytes) -> None:
        """Put ``value`` at the head of queue ``key`` (the next pop returns it) and wake the
        first wait it completes, as :meth:`queue_push` does: where a pop that was cancelled
        after it took ``value`` puts it back."""
        self._queues.setdefault(key, deque()).appendleft(value)
        if key in self._waiters:
            self._wake_one(key)

    def queue_pop(self, key: bytes, owner: Hashable | None = None) -> bytes | None:
        """Pop the oldest value of queue ``key``: the one promised to ``owner`` if it holds
        a promise on ``key``, else one nobody was promised; ``None`` if there is none."""
        queue = self._queues.get(key)
        if not queue:
            return None
        promised = self._promised.get(key)
        if promised:
            if owner is not None and owner in promised:
                self._unpromise(owner, key)
            elif len(queue) <= len(promised):
                return None
        value = queue.popleft()
        if not queue:
            del self._queues[key]
        return value

    def release(self, owner: Hashable) -> None:
        """Drop ``owner``'s promises (it sent another request, or went away) and offer each
        item to the next waiter of its queue."""
        for key in list(self.promise_owners.get(owner, ())):
            self._unpromise(owner, key)
            if key in self._waiters:
                self._wake_one(key)

    def _promise(self, owner: Hashable, keys: Iterable[bytes]) -> None:
        """Promise ``owner`` an item of each queue among ``keys`` that its wait was answered for."""
        for key in keys:
            if key not in self._data and self.exists(key):
                self._promised.setdefault(key, []).append(owner)
                self.promise_owners.setdefault(owner, []).append(key)

    def _unpromise(self, owner: Hashable, key: bytes) -> None:
        promised = self._promised[key]
        promised.remove(owner)
        if not promised:
            del self._promised[key]
        keys = self.promise_owners[owner]
        keys.remove(key)
        if not keys:
            del self.promise_owners[owner]

    def _wake_one(self, key: bytes) -> None:
        """Complete the first wait that an item of queue ``key`` completes, if there is one."""
        waiters = self._waiters[key]
        for waiter in waiters:
            if waiter.missing == {key} and not waiter.future.done():
                del waiters[waiter]
                if not waiters:
                    del self._waiters[key]
                waiter.missing.clear()
                if waiter.owner is not None:
                    self._promise(waiter.owner, waiter.keys)
                waiter.future.set_result(None)
                return

    # -- waiting -------------------------------------------------------------------------
    def watch(
        self,
        keys: Sequence[bytes],
        loop: asyncio.AbstractEventLoop | None = None,
        owner: Hashable | None = None,
    ) -> asyncio.Future[None]:
        """Return a future (of ``loop``, default: the running one) resolved once every key
        exists.

        With an ``owner`` (a torch client's connection, which pops after its wait), the wait
        answered promises the owner an item of each queue among ``keys`` (see the module's
        docstring). Cancelling the future unregisters it, so abandoned waits leave nothing
        behind.
        """
        # A server passes its loop: looking it up costs a getpid() system call on 3.11.
        future: asyncio.Future[None] = (loop or asyncio.get_running_loop()).create_future()
        missing = {k for k in keys if not self.exists(k)}
        if not missing:
            if owner is not None:
                self._promise(owner, keys)
            future.set_result(None)
            return future
        waiter = _Waiter(self, future, missing, keys, owner)
        for key in missing:
            self._waiters.setdefault(key, {})[waiter] = None
        future.add_done_callback(waiter)
        return future

    def counter(self, key: bytes) -> int:
        """The value of the ASCII counter ``key`` (missing: 0).

        Raises:
            DistStoreError: the value is not an integer.
        """
        value = self._data.get(key)
        return 0 if value is None else parse_counter(key, value)

    def watch_count(
        self, key: bytes, target: int, loop: asyncio.AbstractEventLoop | None = None
    ) -> asyncio.Future[None]:
        """Return a future (of ``loop``, default: the running one) resolved once the counter
        ``key`` holds ``target`` or more.

        Writes of ``key`` that leave it below every threshold wake nobody; a value that is
        not an integer counts as below. Cancelling the future unregisters it.
        """
        future: asyncio.Future[None] = (loop or asyncio.get_running_loop()).create_future()
        if self._reached(key, target):
            future.set_result(None)
            return future
        self._thresholds.setdefault(key, {}).setdefault(target, {})[future] = None
        future.add_done_callback(lambda f: self._forget_threshold(key, target, f))
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

    async def barrier(self, key: bytes, world_size: int, timeout: float | None) -> None:
        """Count this caller in at the counter ``key`` and wait until ``world_size`` are.

        Raises:
            DistStoreError: the counter holds something that is not an integer.
            DistTimeoutError: naming the count reached after ``timeout`` seconds.
        """
        self.add(key, 1, "barrier")
        future = self.watch_count(key, world_size)
        if future.done():
            return
        start = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                await future
        except TimeoutError:
            raise barrier_timeout_error(
                key, self.count_or_none(key), world_size, time.monotonic() - start
            ) from None

    def count_or_none(self, key: bytes) -> int | None:
        """The value of the counter ``key`` (missing: 0), or ``None`` if not an integer."""
        try:
            return self.counter(key)
        except DistStoreError:
            return None

    def _reached(self, key: bytes, target: int) -> bool:
        count = self.count_or_none(key)
        return count is not None and count >= target

    def _wake(self, key: bytes) -> None:
        thresholds = self._thresholds.get(key)
        if thresholds:
            count = self.count_or_none(key)
            if count is not None:
                for target in [t for t in thresholds if t <= count]:
                    for future in thresholds.pop(target):
                        if not future.done():
                            future.set_result(None)
                if not thresholds:
                    del self._thresholds[key]
        waiters = self._waiters.pop(key, None)
        if not waiters:
            return
        for waiter in waiters:
            waiter.missing.discard(key)
            if not waiter.missing and not waiter.future.done():
                if waiter.owner is not None:
                    self._promise(waiter.owner, waiter.keys)
                waiter.future.set_result(None)

    def _forget(self, waiter: _Waiter) -> None:
        for key in waiter.missing:
            waiters = self._waiters.get(key)
            if waiters is not None and waiters.pop(waiter, False) is None and not waiters:
                del self._waiters[key]

    def _forget_threshold(self, key: bytes, target: int, future: asyncio.Future[None]) -> None:
        thresholds = self._thresholds.get(key)
        if thresholds is None:
            return
        futures = thresholds.get(target)
        if futures is None or futures.pop(future, False) is not None:
            return
        if not futures:
            del thresholds[target]
            if not thresholds:
                del self._thresholds[key]
