"""PrefixStore: a namespace inside another store."""

from __future__ import annotations

from collections.abc import Sequence

from .._util._timeouts import Timeout
from ..errors import DistUsageError
from ._base import Store, Value

__all__ = ["PrefixStore"]


class PrefixStore(Store):
    """A view of ``store`` in which every key ``k`` is stored as ``prefix + "/" + k``.

    Nesting composes as in torch: ``PrefixStore("a", PrefixStore("b", s))`` stores ``k`` under
    ``b/a/k``. ``list_keys`` and ``num_keys`` only see the keys inside this prefix (with the
    prefix removed); torch's ``num_keys`` counts the whole underlying store instead, which
    makes a process group's key count depend on everything else sharing the store.

    A PrefixStore borrows ``store``: closing it does not close ``store``. A store returned by
    :meth:`clone` owns the cloned underlying store and closes it.

    Args:
        prefix: the namespace; ``"/"`` is added between it and each key.
        store: the async store to wrap.

    Raises:
        DistUsageError: ``store`` is ``None`` or not an async :class:`Store`, or ``prefix`` is
            not a string.
    """

    def __init__(self, prefix: str, store: Store) -> None:
        if store is None:
            raise DistUsageError("PrefixStore needs an underlying store, got None")
        if not isinstance(store, Store):
            raise DistUsageError(
                f"PrefixStore needs an aiodist Store, got {type(store).__name__}; "
                "blocking stores are wrapped with aiodist.sync.PrefixStore"
            )
        if not isinstance(prefix, str):
            raise DistUsageError(f"PrefixStore prefix must be str, got {type(prefix).__name__}")
        super().__init__(store.timeout)
        self._prefix = prefix + "/"
        self._store = store
        self._owns_store = False
        self._closed = False

    def __repr__(self) -> str:
        return f"<PrefixStore prefix={self._prefix!r} store={self._store!r}>"

    @property
    def prefix(self) -> str:
        """The string put in front of every key (the prefix given, plus ``"/"``)."""
        return self._prefix

    async def lease(self, key: str, value: Value | None, *, append: bool = False) -> bool:
        """The underlying store's lease on the prefixed key (see :meth:`Store.lease`)."""
        return await self._store.lease(self._key(key), value, append=append)

    @property
    def lease_lapse(self) -> float:
        """The underlying store's (see :attr:`Store.lease_lapse`)."""
        return self._store.lease_lapse

    def local_address(self) -> str | None:
        """The underlying store's local address (see :meth:`Store.local_address`)."""
        return self._store.local_address()

    @property
    def underlying_store(self) -> Store:
        """The store this one writes into."""
        return self._store

    @property
    def timeout(self) -> float | None:
        """The underlying store's timeout (the two are one setting)."""
        return self._store.timeout

    def set_timeout(self, timeout: Timeout) -> None:
        """Set the underlying store's timeout (seconds or ``timedelta``; ``None`` = forever).

        Raises:
            DistUsageError: the timeout is negative or of the wrong type.
        """
        self._store.set_timeout(timeout)

    def _key(self, key: str) -> str:
        if not isinstance(key, str):
            raise DistUsageError(f"store keys must be str, got {type(key).__name__}")
        return self._prefix + key

    def _keys(self, keys: Sequence[str]) -> list[str]:
        if isinstance(keys, str):
            raise DistUsageError("keys must be a sequence of str, got a single str")
        return [self._key(k) for k in keys]

    async def set(self, key: str, value: Value) -> None:
        await self._store.set(self._key(key), value)

    async def get(self, key: str) -> bytes:
        return await self._store.get(self._key(key))

    async def add(self, key: str, amount: int) -> int:
        return await self._store.add(self._key(key), amount)

    async def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        return await self._store.compare_set(self._key(key), expected, desired)

    async def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        await self._store.wait(self._keys(keys), timeout)

    async def check(self, keys: Sequence[str]) -> bool:
        return await self._store.check(self._keys(keys))

    async def delete_key(self, key: str) -> bool:
        return await self._store.delete_key(self._key(key))

    async def delete_prefix(self, prefix: str) -> int:
        """Delete the keys of this namespace that start with ``prefix`` (all of them, for
        ``""``), through the underlying store's :meth:`Store.delete_prefix`."""
        return await self._store.delete_prefix(self._key(prefix))

    async def num_keys(self) -> int:
        """Return the number of keys inside this prefix."""
        return len(await self.list_keys())

    async def list_keys(self) -> list[str]:
        """Return the keys inside this prefix, without it."""
        n = len(self._prefix)
        return [k[n:] for k in await self._store.list_keys() if k.startswith(self._prefix)]

    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return await self._store.multi_get(self._keys(keys))

    async def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        await self._store.multi_set(self._keys(keys), values)

    async def append(self, key: str, value: Value) -> None:
        await self._store.append(self._key(key), value)

    async def queue_push(self, key: str, value: Value) -> None:
        await self._store.queue_push(self._key(key), value)

    async def barrier(self, key: str, world_size: int, timeout: Timeout = None) -> None:
        """The underlying store's barrier on the prefixed key.

        Raises:
            DistUsageError: ``world_size`` is not a positive int.
            DistStoreError: ``key`` holds something that is not an integer.
            DistTimeoutError: fewer than ``world_size`` arrived in time.
        """
        await self._store.barrier(self._key(key), world_size, timeout)

    async def queue_pop(self, key: str, block: bool = True) -> bytes:
        return await self._store.queue_pop(self._key(key), block)

    async def queue_push_front(self, key: str, value: Value) -> None:
        await self._store.queue_push_front(self._key(key), value)

    async def queue_len(self, key: str) -> int:
        return await self._store.queue_len(self._key(key))

    async def clone(self) -> PrefixStore:
        """Return a PrefixStore with the same prefix over a clone of the underlying store."""
        clone = PrefixStore(self._prefix[:-1], await self._store.clone())
        clone._owns_store = True
        return clone

    async def aclose(self) -> None:
        """Close the underlying store if this PrefixStore owns it (see the class docs)."""
        if self._closed:
            return
        self._closed = True
        if self._owns_store:
            await self._store.aclose()
