"""HashStore: an in-process store on the current event loop."""

from __future__ import annotations

from collections.abc import Sequence

from .._util._timeouts import Timeout, to_seconds
from ..errors import QueueEmptyError
from ._base import Store, Value, check_lengths, check_world_size, encode_key, encode_value
from ._state import KeyValueState

__all__ = ["HashStore"]


class HashStore(Store):
    """A store held in this process's memory, shared by every clone.

    Useful for ranks that run as tasks of one event loop (the test suite does this), and as
    the reference implementation of the store semantics.
    """

    def __init__(self, timeout: Timeout = None, *, _state: KeyValueState | None = None) -> None:
        super().__init__(timeout)
        self._state = _state if _state is not None else KeyValueState()

    def __repr__(self) -> str:
        return f"<HashStore keys={self._state.num_keys()} timeout={self.timeout}>"

    async def set(self, key: str, value: Value) -> None:
        self._state.set(encode_key(key), encode_value(value))

    async def get(self, key: str) -> bytes:
        k = encode_key(key)
        await self._state.wait([k], self.timeout)
        value = self._state.get(k)
        assert value is not None  # wait() returned, so the key exists
        return value

    async def add(self, key: str, amount: int) -> int:
        return self._state.add(encode_key(key), int(amount))

    async def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        return self._state.compare_set(
            encode_key(key), encode_value(expected), encode_value(desired)
        )

    async def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        deadline = to_seconds(timeout, self.timeout)
        await self._state.wait([encode_key(k) for k in keys], deadline)

    async def check(self, keys: Sequence[str]) -> bool:
        return self._state.check(encode_key(k) for k in keys)

    async def delete_key(self, key: str) -> bool:
        return self._state.delete(encode_key(key))

    async def delete_prefix(self, prefix: str) -> int:
        return len(self._state.delete_prefix(encode_key(prefix)))

    async def num_keys(self) -> int:
        return self._state.num_keys()

    async def list_keys(self) -> list[str]:
        return [k.decode(errors="surrogateescape") for k in self._state.list_keys()]

    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        encoded = [encode_key(k) for k in keys]
        await self._state.wait(encoded, self.timeout)
        return [self._state.get(k) or b"" for k in encoded]

    async def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        check_lengths(keys, values)
        for key, value in zip(keys, values, strict=True):
            self._state.set(encode_key(key), encode_value(value))

    async def append(self, key: str, value: Value) -> None:
        self._state.append(encode_key(key), encode_value(value))

    async def queue_push(self, key: str, value: Value) -> None:
        self._state.queue_push(encode_key(key), encode_value(value))

    async def queue_push_front(self, key: str, value: Value) -> None:
        self._state.queue_push_front(encode_key(key), encode_value(value))

    async def queue_pop(self, key: str, block: bool = True) -> bytes:
        # (Nothing is taken across an await: a cancelled pop has taken nothing.)
        k = encode_key(key)
        while True:
            value = self._state.queue_pop(k)
            if value is not None:
                return value
            if not block:
                raise QueueEmptyError(f"queue {key!r} is empty")
            await self._state.wait([k], self.timeout)

    async def queue_len(self, key: str) -> int:
        return self._state.queue_len(encode_key(key))

    async def barrier(self, key: str, world_size: int, timeout: Timeout = None) -> None:
        """Count in at ``key`` and wait until ``world_size`` callers have (see ``Store``).

        Raises:
            DistUsageError: ``world_size`` is not a positive int.
            DistStoreError: ``key`` holds something that is not an integer.
            DistTimeoutError: fewer than ``world_size`` arrived in time.
        """
        world = check_world_size(world_size)
        await self._state.barrier(encode_key(key), world, to_seconds(timeout, self.timeout))

    async def clone(self) -> HashStore:
        return HashStore(self.timeout, _state=self._state)

    async def aclose(self) -> None:
        """Nothing to release: the data lives as long as some clone refers to it."""
