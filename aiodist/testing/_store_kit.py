"""A conformance kit for stores: every Store method and semantic, checked against real stores.

``await check_store(factory)`` runs each check on a fresh store from ``factory`` (and on a
second client of it, from ``await store.clone()``). ``check_sync_store(factory)`` runs the
same checks against a blocking store (``aiodist.sync``), calling its methods from several
threads at once. A failed check raises ``AssertionError`` naming the check and what differed.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Protocol

from .._util._timeouts import Timeout
from ..errors import DistStoreError, DistTimeoutError, DistUsageError, QueueEmptyError
from ..store._base import Store, Value

__all__ = ["SyncStoreLike", "check_store", "check_sync_store"]

#: How long the checks let a wait run before it must time out (seconds).
SHORT = 0.05
#: How long a check gives an awaited operation to complete before failing (seconds).
LONG = 10.0


class SyncStoreLike(Protocol):
    """The blocking store interface ``check_sync_store`` checks (``aiodist.sync.Store``)."""

    @property
    def timeout(self) -> timedelta | None: ...
    def set_timeout(self, timeout: Timeout) -> None: ...
    def set(self, key: str, value: Value) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, amount: int) -> int: ...
    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes: ...
    def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None: ...
    def check(self, keys: Sequence[str]) -> bool: ...
    def delete_key(self, key: str) -> bool: ...
    def delete_prefix(self, prefix: str) -> int: ...
    def num_keys(self) -> int: ...
    def list_keys(self) -> list[str]: ...
    def multi_get(self, keys: Sequence[str]) -> list[bytes]: ...
    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None: ...
    def append(self, key: str, value: Value) -> None: ...
    def queue_push(self, key: str, value: Value) -> None: ...
    def queue_pop(self, key: str, block: bool = True) -> bytes: ...
    def queue_push_front(self, key: str, value: Value) -> None: ...
    def queue_len(self, key: str) -> int: ...
    def barrier(self, key: str, world_size: int, timeout: Timeout = None) -> None: ...
    def clone(self) -> SyncStoreLike: ...
    def close(self) -> None: ...


# -- helpers -------------------------------------------------------------------------------
def _fail(check: str, message: str) -> AssertionError:
    return AssertionError(f"store conformance check {check!r} failed: {message}")


def _eq(check: str, what: str, actual: object, expected: object) -> None:
    if actual != expected:
        raise _fail(check, f"{what}: expected {expected!r}, got {actual!r}")


@contextlib.asynccontextmanager
async def _raises(check: str, what: str, exc_type: type[BaseException],
                  match: str | None = None) -> AsyncIterator[None]:  # fmt: skip
    try:
        yield
    except exc_type as exc:
        if match is not None and not re.search(match, str(exc)):
            raise _fail(check, f"{what}: message {str(exc)!r} does not match {match!r}") from exc
        return
    except Exception as exc:
        raise _fail(
            check, f"{what}: expected {exc_type.__name__}, got {type(exc).__name__}: {exc}"
        ) from exc
    raise _fail(check, f"{what}: expected {exc_type.__name__}, nothing was raised")


async def _done(check: str, what: str, aw: Awaitable[Any]) -> Any:
    try:
        async with asyncio.timeout(LONG):
            return await aw
    except TimeoutError:
        raise _fail(check, f"{what} did not complete within {LONG} s") from None


async def _still_pending(check: str, what: str, task: asyncio.Future[Any]) -> None:
    await asyncio.sleep(0.05)
    if task.done():
        raise _fail(check, f"{what} completed before it should have: {task!r}")


# -- the checks ----------------------------------------------------------------------------
async def _check_set_get(store: Store) -> None:
    c = "set/get"
    await store.set("k", b"v1")
    _eq(c, "get after set", await store.get("k"), b"v1")
    await store.set("k", "v2")
    _eq(c, "get after overwrite with str", await store.get("k"), b"v2")
    await store.set("empty", b"")
    _eq(c, "empty value", await store.get("empty"), b"")
    binary = bytes(range(256)) * 4
    await store.set("bin", binary)
    _eq(c, "binary value", await store.get("bin"), binary)
    await store.set("ключ/日本", "значение")
    _eq(c, "non-ASCII key and value", await store.get("ключ/日本"), "значение".encode())
    other = await store.clone()
    try:
        _eq(c, "value seen through a clone", await other.get("k"), b"v2")
        await other.set("from-clone", b"x")
        _eq(c, "clone's write seen by the original", await store.get("from-clone"), b"x")
    finally:
        await other.aclose()


async def _check_get_waits(store: Store) -> None:
    c = "get waits for a later set"
    other = await store.clone()
    try:
        getter = asyncio.ensure_future(store.get("late"))
        waiter = asyncio.ensure_future(store.wait(["late", "late2"]))
        await _still_pending(c, "get of a missing key", getter)
        await other.set("late", b"here")
        _eq(c, "get woken by another client's set", await _done(c, "get", getter), b"here")
        await _still_pending(c, "wait on a key still missing", waiter)
        await other.set("late2", b"")
        await _done(c, "wait", waiter)
    finally:
        await other.aclose()


async def _check_wait_timeout(store: Store) -> None:
    c = "wait timeout"
    await store.set("present", b"1")
    start = time.monotonic()
    async with _raises(c, "wait on a missing key", DistTimeoutError, r"absent'"):
        await store.wait(["present", "absent"], timeout=SHORT)
    waited = time.monotonic() - start
    if not SHORT * 0.9 <= waited <= SHORT + 5:
        raise _fail(c, f"wait(timeout={SHORT}) returned after {waited:.3f} s")
    async with _raises(c, "wait with a timedelta", DistTimeoutError, r"absent'"):
        await store.wait(["absent"], timeout=timedelta(seconds=SHORT))
    _eq(c, "store usable after a timed-out wait", await store.add("present", 1), 2)
    old = store.timeout
    store.set_timeout(SHORT)
    try:
        async with _raises(c, "get of a missing key past the store timeout", DistTimeoutError,
                           r"absent'"):  # fmt: skip
            await store.get("absent")
        async with _raises(c, "multi_get past the store timeout", DistTimeoutError, r"absent'"):
            await store.multi_get(["present", "absent"])
    finally:
        store.set_timeout(old)
    await store.set("absent", b"now")
    _eq(c, "get after the timeouts", await store.get("absent"), b"now")
    await _done(c, "wait on present keys", store.wait(["present", "absent"], timeout=SHORT))


async def _check_add(store: Store) -> None:
    c = "add"
    _eq(c, "add on a missing key", await store.add("n", 5), 5)
    _eq(c, "counter stored as ASCII", await store.get("n"), b"5")
    _eq(c, "negative add", await store.add("n", -7), -2)
    _eq(c, "negative counter stored as ASCII", await store.get("n"), b"-2")
    _eq(c, "add 0", await store.add("n", 0), -2)
    await store.set("m", b"40")
    _eq(c, "add to a value set as text", await store.add("m", 2), 42)
    big = 2**62
    _eq(c, "large add", await store.add("big", big), big)
    # Counters are signed 64-bit integers, as in torch.
    async with _raises(c, "add past 2**63 - 1", DistStoreError, r"big"):
        await store.add("big", big)
    _eq(c, "value unchanged after the overflowing add", await store.get("big"), b"%d" % big)
    _eq(c, "store usable after the overflowing add", await store.add("after", 1), 1)


async def _check_add_non_number(store: Store) -> None:
    c = "add on a non-number"
    await store.set("text", b"abc")
    async with _raises(c, "add on b'abc'", DistStoreError, r"text"):
        await store.add("text", 1)
    _eq(c, "value unchanged after the failed add", await store.get("text"), b"abc")
    _eq(c, "store usable after the failed add", await store.add("other", 3), 3)


async def _check_compare_set(store: Store) -> None:
    c = "compare_set"
    _eq(c, "missing key, expected empty: created",
        await store.compare_set("cs1", b"", b"new"), b"new")  # fmt: skip
    _eq(c, "the created value", await store.get("cs1"), b"new")
    _eq(c, "missing key, expected non-empty: returns expected",
        await store.compare_set("cs2", b"old", b"new"), b"old")  # fmt: skip
    _eq(c, "missing key, expected non-empty: not created", await store.check(["cs2"]), False)
    _eq(c, "present, matching: swapped", await store.compare_set("cs1", "new", "newer"), b"newer")
    _eq(c, "the swapped value", await store.get("cs1"), b"newer")
    _eq(c, "present, mismatching: returns current",
        await store.compare_set("cs1", b"wrong", b"x"), b"newer")  # fmt: skip
    _eq(c, "present, mismatching: unchanged", await store.get("cs1"), b"newer")


async def _check_check_and_delete(store: Store) -> None:
    c = "check/delete_key"
    _eq(c, "check([])", await store.check([]), True)
    _eq(c, "check of a missing key", await store.check(["d"]), False)
    await store.set("d", b"1")
    await store.set("e", b"1")
    _eq(c, "check of present keys", await store.check(["d", "e"]), True)
    _eq(c, "check of present and missing keys", await store.check(["d", "nope"]), False)
    _eq(c, "delete_key of a present key", await store.delete_key("d"), True)
    _eq(c, "check after delete", await store.check(["d"]), False)
    _eq(c, "delete_key of a missing key", await store.delete_key("d"), False)
    _eq(c, "other key kept", await store.get("e"), b"1")
    await store.set("d", b"again")
    _eq(c, "set after delete", await store.get("d"), b"again")


async def _check_delete_prefix(store: Store) -> None:
    c = "delete_prefix"
    await store.multi_set(["dp/a", "dp/b/c", "dpx", "kept"], [b"1", b"2", b"3", b"4"])
    await store.queue_push("dp/q", b"item")
    other = await store.clone()
    try:
        _eq(c, "keys deleted under dp/", await other.delete_prefix("dp/"), 2)
        _eq(c, "a deleted key", await store.check(["dp/a"]), False)
        _eq(c, "a nested deleted key", await store.check(["dp/b/c"]), False)
        _eq(c, "keys outside the prefix", await store.multi_get(["dpx", "kept"]), [b"3", b"4"])
        _eq(c, "a queue under the prefix is kept", await store.queue_len("dp/q"), 1)
        _eq(c, "deleting again", await store.delete_prefix("dp/"), 0)
        await store.set("dp/a", b"again")
        _eq(c, "set after delete_prefix", await store.get("dp/a"), b"again")
        # Stores may hold keys of their own (torch's TCPStore keeps "init/"): "" deletes
        # every key that list_keys shows.
        listed = await store.list_keys()
        _eq(c, 'keys deleted by delete_prefix("")', await store.delete_prefix(""), len(listed))
        _eq(c, 'keys left after delete_prefix("")', await store.list_keys(), [])
    finally:
        await other.aclose()


async def _check_num_and_list_keys(store: Store) -> None:
    c = "num_keys/list_keys"
    # Stores may hold keys of their own (torch's TCPStore keeps "init/"): count from here.
    base = await store.num_keys()
    before = set(await store.list_keys())
    await store.set("lk/a", b"1")
    await store.add("lk/b", 1)
    await store.multi_set(["lk/c"], [b"3"])
    _eq(c, "num_keys after three new keys", await store.num_keys(), base + 3)
    _eq(c, "list_keys after three new keys",
        set(await store.list_keys()) - before, {"lk/a", "lk/b", "lk/c"})  # fmt: skip
    await store.set("lk/a", b"overwritten")
    _eq(c, "num_keys after an overwrite", await store.num_keys(), base + 3)
    await store.delete_key("lk/b")
    _eq(c, "num_keys after a delete", await store.num_keys(), base + 2)
    _eq(c, "list_keys after a delete", set(await store.list_keys()) - before, {"lk/a", "lk/c"})


async def _check_multi(store: Store) -> None:
    c = "multi_get/multi_set"
    await store.multi_set(["m1", "m2", "m3"], [b"1", "2", b""])
    _eq(c, "multi_get", await store.multi_get(["m3", "m1", "m2"]), [b"", b"1", b"2"])
    _eq(c, "get after multi_set", await store.get("m2"), b"2")
    _eq(c, "multi_get([])", await store.multi_get([]), [])
    async with _raises(c, "multi_set with more keys than values", DistUsageError, r"2 keys"):
        await store.multi_set(["x", "y"], [b"1"])
    _eq(c, "nothing set by the rejected multi_set", await store.check(["x"]), False)
    other = await store.clone()
    try:
        getter = asyncio.ensure_future(store.multi_get(["m1", "later"]))
        await _still_pending(c, "multi_get with a missing key", getter)
        await other.multi_set(["later"], [b"L"])
        _eq(c, "multi_get woken by a set", await _done(c, "multi_get", getter), [b"1", b"L"])
    finally:
        await other.aclose()


async def _check_append(store: Store) -> None:
    c = "append"
    await store.append("ap", b"ab")
    _eq(c, "append creates the key", await store.get("ap"), b"ab")
    await store.append("ap", "cd")
    _eq(c, "append concatenates", await store.get("ap"), b"abcd")
    waiter = asyncio.ensure_future(store.get("ap2"))
    await _still_pending(c, "get of a missing key", waiter)
    await store.append("ap2", b"x")
    _eq(c, "append wakes a get", await _done(c, "get", waiter), b"x")


async def _check_queues(store: Store) -> None:
    c = "queues"
    for item in (b"1", b"2", b"3"):
        await store.queue_push("q", item)
    _eq(c, "queue_len after three pushes", await store.queue_len("q"), 3)
    popped = [await store.queue_pop("q") for _ in range(3)]
    _eq(c, "FIFO order", popped, [b"1", b"2", b"3"])
    _eq(c, "queue_len when empty", await store.queue_len("q"), 0)
    _eq(c, "queue_len of an unknown queue", await store.queue_len("never"), 0)
    async with _raises(c, "non-blocking pop on an empty queue", QueueEmptyError):
        await store.queue_pop("q", block=False)
    other = await store.clone()
    try:
        popper = asyncio.ensure_future(store.queue_pop("q"))
        await _still_pending(c, "blocking pop on an empty queue", popper)
        await other.queue_push("q", b"woken")
        _eq(c, "blocking pop woken by a push", await _done(c, "queue_pop", popper), b"woken")
        await other.queue_push("q", "text")
        _eq(c, "pop of a str push", await store.queue_pop("q", block=False), b"text")
    finally:
        await other.aclose()
    old = store.timeout
    store.set_timeout(SHORT)
    try:
        async with _raises(c, "blocking pop past the store timeout", DistTimeoutError, r"q'"):
            await store.queue_pop("q")
    finally:
        store.set_timeout(old)
    await store.queue_push("q", b"after")
    _eq(c, "queue usable after a timed-out pop", await store.queue_pop("q"), b"after")


async def _check_set_timeout(store: Store) -> None:
    c = "set_timeout"
    old = store.timeout
    try:
        store.set_timeout(timedelta(seconds=7))
        _eq(c, "timeout after set_timeout(timedelta(seconds=7))", store.timeout, 7.0)
        store.set_timeout(1.5)
        _eq(c, "timeout after set_timeout(1.5)", store.timeout, 1.5)
        async with _raises(c, "negative timeout", DistUsageError, r"negative"):
            store.set_timeout(-1)
        _eq(c, "timeout kept after a rejected value", store.timeout, 1.5)
    finally:
        store.set_timeout(old)
    _eq(c, "timeout restored", store.timeout, old)


async def _check_concurrency(store: Store) -> None:
    c = "concurrent awaits on one store"
    gate = asyncio.ensure_future(store.wait(["gate"]))
    getter = asyncio.ensure_future(store.get("gate"))
    await _still_pending(c, "wait on the gate key", gate)
    # While two waits are pending on this object, other requests on it must still progress.
    results = await _done(c, "50 concurrent adds", asyncio.gather(
        *(store.add("counter", 1) for _ in range(50))))  # fmt: skip
    _eq(c, "results of 50 concurrent adds", sorted(results), list(range(1, 51)))
    await _done(c, "20 concurrent sets", asyncio.gather(
        *(store.set(f"par/{i}", str(i)) for i in range(20))))  # fmt: skip
    values = await _done(c, "20 concurrent gets", asyncio.gather(
        *(store.get(f"par/{i}") for i in range(20))))  # fmt: skip
    _eq(c, "values of concurrent gets", values, [str(i).encode() for i in range(20)])
    if gate.done():
        raise _fail(c, "the wait on the gate key finished before the gate was set")
    await store.set("gate", b"open")
    await _done(c, "wait on the gate", gate)
    _eq(c, "get on the gate", await _done(c, "get on the gate", getter), b"open")
    # A cancelled wait must leave the store usable. (The short timeout bounds the call where
    # cancelling cannot reach it: a blocking store's call in a worker thread.)
    old = store.timeout
    store.set_timeout(SHORT)
    try:
        cancelled = asyncio.ensure_future(store.get("never-set"))
        await asyncio.sleep(0.02)
        cancelled.cancel()
        with contextlib.suppress(asyncio.CancelledError, DistTimeoutError):
            await cancelled
    finally:
        store.set_timeout(old)
    _eq(c, "store usable after a cancelled get", await store.add("counter", 1), 51)


async def _check_barrier(store: Store) -> None:
    c = "barrier"
    await _done(c, "a barrier of one", store.barrier("b1", 1))
    _eq(c, "the barrier's counter", await store.get("b1"), b"1")
    others = [await store.clone(), await store.clone()]
    try:
        first = asyncio.ensure_future(store.barrier("b3", 3))
        await _still_pending(c, "a barrier of three with one arrived", first)
        second = asyncio.ensure_future(others[0].barrier("b3", 3, timeout=LONG))
        await _still_pending(c, "a barrier of three with two arrived", second)
        await _done(c, "the third arrival", others[1].barrier("b3", 3))
        await _done(c, "the first two arrivals", asyncio.gather(first, second))
        _eq(c, "the counter after three arrivals", await store.get("b3"), b"3")
    finally:
        for other in others:
            await other.aclose()
    async with _raises(
        c,
        "a barrier that times out",
        DistTimeoutError,
        r"store barrier '([^']*/)?lonely' timed out after \d+ ms: 1 of 2 arrived",
    ):
        await store.barrier("lonely", 2, timeout=SHORT)
    old = store.timeout
    store.set_timeout(SHORT)
    try:
        async with _raises(c, "the store timeout applies", DistTimeoutError, r"2 of 3 arrived"):
            await store.barrier("lonely", 3)
    finally:
        store.set_timeout(old)
    for bad in (0, -1, True, 2.0):
        async with _raises(c, f"world_size={bad!r}", DistUsageError, r"world_size"):
            await store.barrier("bad", bad)  # type: ignore[arg-type]
    await store.set("text", b"abc")
    async with _raises(
        c, "a barrier on a non-number", DistStoreError, r"^barrier on key .*text': .*not an integer"
    ):
        await store.barrier("text", 2)
    _eq(c, "store usable after the failed barrier", await store.add("after", 1), 1)


async def _check_clone_and_close(store: Store) -> None:
    c = "clone/close"
    other = await store.clone()
    async with other as entered:
        if entered is not other:
            raise _fail(c, f"`async with store` gave {entered!r}, not the store")
        await other.set("cc", b"1")
        _eq(c, "clone's write seen by the original", await store.get("cc"), b"1")
        await store.set("cc2", b"2")
        _eq(c, "original's write seen by the clone", await other.get("cc2"), b"2")
    await other.aclose()  # closing twice is harmless
    _eq(c, "original usable after its clone closed", await store.add("cc3", 1), 1)
    third = await store.clone()
    try:
        _eq(c, "a later clone sees the data", await third.get("cc"), b"1")
    finally:
        await third.aclose()


_CHECKS: tuple[Callable[[Store], Awaitable[None]], ...] = (
    _check_set_get,
    _check_get_waits,
    _check_wait_timeout,
    _check_add,
    _check_add_non_number,
    _check_compare_set,
    _check_check_and_delete,
    _check_delete_prefix,
    _check_num_and_list_keys,
    _check_multi,
    _check_append,
    _check_queues,
    _check_set_timeout,
    _check_concurrency,
    _check_barrier,
    _check_clone_and_close,
)


async def check_store(factory: Callable[[], Awaitable[Store]]) -> None:
    """Check that the stores ``factory`` makes behave like aiodist stores.

    Each check gets a fresh store from ``factory``, and a second client of the same data from
    ``await store.clone()`` where it needs one, and closes both afterwards. The checks cover
    every method of :class:`~aiodist.store.Store`: values and 64-bit counters, waits woken by
    other clients, timeouts that name the missing keys and leave the store usable,
    compare_set's four cases, queues, barriers, clones, concurrent awaits on one object, and
    closing.

    Args:
        factory: an async callable returning a new, empty store each time.

    Raises:
        AssertionError: a check failed; the message names it and what differed.
    """
    for check in _CHECKS:
        store = await factory()
        try:
            await check(store)
        finally:
            await store.aclose()


class _ThreadedStore(Store):
    """An async view of a blocking store: each call runs in a worker thread of the loop."""

    def __init__(self, store: SyncStoreLike) -> None:
        super().__init__(None)
        self._sync = store

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    @property
    def timeout(self) -> float | None:
        timeout = self._sync.timeout
        return None if timeout is None else timeout.total_seconds()

    def set_timeout(self, timeout: Timeout) -> None:
        self._sync.set_timeout(timeout)

    async def set(self, key: str, value: Value) -> None:
        await self._call(self._sync.set, key, value)

    async def get(self, key: str) -> bytes:
        result: bytes = await self._call(self._sync.get, key)
        return result

    async def add(self, key: str, amount: int) -> int:
        result: int = await self._call(self._sync.add, key, amount)
        return result

    async def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        result: bytes = await self._call(self._sync.compare_set, key, expected, desired)
        return result

    async def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        await self._call(self._sync.wait, keys, timeout)

    async def check(self, keys: Sequence[str]) -> bool:
        result: bool = await self._call(self._sync.check, keys)
        return result

    async def delete_key(self, key: str) -> bool:
        result: bool = await self._call(self._sync.delete_key, key)
        return result

    async def delete_prefix(self, prefix: str) -> int:
        result: int = await self._call(self._sync.delete_prefix, prefix)
        return result

    async def num_keys(self) -> int:
        result: int = await self._call(self._sync.num_keys)
        return result

    async def list_keys(self) -> list[str]:
        result: list[str] = await self._call(self._sync.list_keys)
        return result

    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        result: list[bytes] = await self._call(self._sync.multi_get, keys)
        return result

    async def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        await self._call(self._sync.multi_set, keys, values)

    async def append(self, key: str, value: Value) -> None:
        await self._call(self._sync.append, key, value)

    async def queue_push(self, key: str, value: Value) -> None:
        await self._call(self._sync.queue_push, key, value)

    async def queue_pop(self, key: str, block: bool = True) -> bytes:
        result: bytes = await self._call(self._sync.queue_pop, key, block)
        return result

    async def queue_push_front(self, key: str, value: Value) -> None:
        await self._call(self._sync.queue_push_front, key, value)

    async def queue_len(self, key: str) -> int:
        result: int = await self._call(self._sync.queue_len, key)
        return result

    async def barrier(self, key: str, world_size: int, timeout: Timeout = None) -> None:
        await self._call(self._sync.barrier, key, world_size, timeout)

    async def clone(self) -> Store:
        return _ThreadedStore(await self._call(self._sync.clone))

    async def aclose(self) -> None:
        await self._call(self._sync.close)


def check_sync_store(factory: Callable[[], SyncStoreLike]) -> None:
    """Check that the blocking stores ``factory`` makes behave like aiodist stores.

    Runs the checks of :func:`check_store` against stores such as ``aiodist.sync.HashStore()``,
    calling their blocking methods from worker threads, several at once: this also checks
    that the blocking store can be used from many threads. Must be called from a thread
    without a running event loop.

    Args:
        factory: a callable returning a new, empty blocking store each time.

    Raises:
        AssertionError: a check failed; the message names it and what differed.
    """

    async def make() -> Store:
        return _ThreadedStore(await asyncio.to_thread(factory))

    async def main() -> None:
        # Enough threads for the concurrency check's pending waits plus its parallel calls.
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(max_workers=16, thread_name_prefix="store-kit") as pool:
            loop.set_default_executor(pool)
            await check_store(make)

    asyncio.run(main())
