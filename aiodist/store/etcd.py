"""EtcdStore: the store kept in an etcd cluster, so that it outlives any one host of the job.

Keys live under a prefix ``P`` (``/aiodist/`` unless given), in four families:

* ``P k/<n>/<key>``: the value of ``key`` (``n`` its length in bytes, so that no key's name
  is the beginning of another's), and ``P k/<n>/<key>/<id>`` the items of the queue ``key``,
  oldest first by etcd's creation revision. One etcd range, ``P k/<n>/<key>``, holds a key's
  value and its queue: a wait for the key to exist is one watch.
* ``P o/<client>/<seq>``: the outcome of a write that must not happen twice (see below),
  under the client's lease.
* ``P a/<client>``: present while the client's lease lives.
* ``P l/<client>/<key>``: a lease (:meth:`EtcdStore.lease`): ``=`` and the value ``key``
  takes if the client's lease lapses, or ``+`` and the value appended to it then.

Every store client holds an etcd lease (its *client id*), kept alive from a thread of its own
(``_etcd_keepalive.py``). Writes that read before they write (``add``, ``compare_set``,
``append``, ``queue_pop``, ``delete_key``) are etcd transactions that compare the
``mod_revision`` of what they read and go round again when another client wrote first. Each
such write, and ``queue_push``, also compares that its outcome record ``P o/<client>/<seq>`` is
absent and writes it: a request sent again after a member failed mid-answer then finds the
record of the first attempt instead of adding twice. Waits are etcd watches that start at
the revision after the read that missed, so no write in between is lost; nothing polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._util._timeouts import DEFAULT_STORE_TIMEOUT, Timeout, to_seconds
from ..errors import (
    DistNetworkError,
    DistStoreError,
    DistUsageError,
    QueueEmptyError,
)
from ._base import (
    Store,
    Value,
    check_lengths,
    check_world_size,
    encode_key,
    encode_value,
    settled,
)
from ._etcd_client import (
    Compacted,
    Endpoint,
    EtcdClient,
    EtcdError,
    Watch,
    b64,
    compare,
    key_range,
    kvs_of,
    parse_endpoints,
    prefix_end,
    revision_of,
    unb64,
)
from ._etcd_keepalive import keep_alive
from ._sockets import resolve_peer_timeout
from ._state import (
    I64_MAX,
    I64_MIN,
    barrier_timeout_error,
    format_keys,
    parse_counter,
    timeout_error,
)

__all__ = ["EtcdStore"]

logger = logging.getLogger(__name__)

#: The prefix keys live under when none is given.
DEFAULT_PREFIX = "/aiodist/"
#: The largest value a client writes (etcd refuses requests over 1.5 MiB by default).
DEFAULT_MAX_VALUE_SIZE = 1024 * 1024
#: etcd's shortest lease with its default timing (a shorter one is raised to it).
_MIN_LEASE_TTL = 2
#: Seconds between two tries of the lease keeper after the store failed it.
_KEEPER_RETRY = 1.0
#: Seconds, beyond its time to live, until a lapsed lease is carried out: etcd's leader looks
#: for lapsed leases every 0.5 s (a client then reads and writes the markers), and when the
#: leader died with the holder, the election of the next takes up to two election timeouts
#: (1 s each by default) and the new leader first extends every lease by one more.
_LAPSE_NOTICED = 4.0
#: The first byte of a lease marker's value: whether the lease sets its key or appends to it.
_SET, _APPEND = b"=", b"+"


#: What starts the names of the items that cancelled pops gave back (client ids, which
#: start the names of pushed items, are hexadecimal): they sort before every pushed item.
_GIVEN_BACK = b"\x00"
#: What follows it in the names of the items put first (``queue_push_front``): they sort
#: before those that pops gave back.
_FIRST = b"\x00"


#: How many keys one transaction of :meth:`EtcdStore.delete_prefix` deletes.
_DELETES_PER_TXN = 100


@dataclass
class _Write:
    """What a transaction writes if what it read is unchanged (``compares``), and returns."""

    compares: list[dict[str, Any]]
    ops: list[dict[str, Any]]
    result: bytes


@dataclass
class _Session:
    """A client's etcd lease: its id names the client's records, leases and liveness key."""

    lease: int
    ttl: int
    stop: Callable[[], None] = field(default=lambda: None)


class EtcdStore(Store):
    """A store kept in an etcd cluster (v3 API, through its HTTP/JSON gateway).

    Create it with :meth:`create`. The store has the semantics and errors of
    :class:`~aiodist.TCPStore`, and no process of the job hosts it: with three or five etcd
    members on different hosts, the job keeps its store when any one host is lost. Requests
    go to one member and move to the next of ``endpoints`` when it fails; a write that was
    in flight when its member failed happens once all the same.

    Each store client holds an etcd lease of ``lease_ttl`` seconds, renewed from a thread
    of its own: a client whose process dies (or whose host can no longer reach etcd) is
    known to be gone ``lease_ttl`` seconds later, which is what :meth:`lease` builds on.

    Attributes:
        endpoints: the etcd members' client addresses, ``(host, port)``.
        prefix: the prefix of every etcd key of this store.
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        session: _Session,
        timeout: Timeout = None,
        *,
        max_value_size: int = DEFAULT_MAX_VALUE_SIZE,
        _peer_timeout: float = 8.0,
    ) -> None:
        if not isinstance(client, EtcdClient):
            raise DistUsageError(
                "make an EtcdStore with `await aiodist.EtcdStore.create(endpoints, prefix)` "
                "(aiodist.sync.EtcdStore is the blocking form)"
            )
        super().__init__(timeout)
        self._client = client
        self.endpoints: list[Endpoint] = client.endpoints
        self.prefix = prefix
        self._root = prefix.encode()
        self._session = session
        self._me = b"%016x" % session.lease
        self._max_value = max_value_size
        self._peer_timeout = _peer_timeout
        self._seq = 0
        self._items = itertools.count()
        # Sequence numbers of the recorded writes in flight: records below the lowest are
        # no longer needed (their writes answered), and are deleted by a later write.
        self._inflight: set[int] = set()
        self._pruned = 0
        self._keeper: asyncio.Task[None] | None = None
        self._watches: set[Watch] = set()
        self._lost: str | None = None
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"lost ({self._lost})" if self._lost else "open"
        return (
            f"<EtcdStore {self._client.where} prefix={self.prefix!r} "
            f"lease={self._session.lease:x} timeout={self.timeout} {state}>"
        )

    @property
    def lease_lapse(self) -> float:
        """This client's etcd lease time to live, and 4 s more for etcd to see it lapse,
        even across the election of a new leader, and for another client to carry out the
        leases (see :attr:`Store.lease_lapse`)."""
        return self._session.ttl + _LAPSE_NOTICED

    @classmethod
    async def create(
        cls,
        endpoints: str | Sequence[str | Endpoint],
        prefix: str = DEFAULT_PREFIX,
        timeout: Timeout = None,
        *,
        lease_ttl: float | None = None,
        max_value_size: int = DEFAULT_MAX_VALUE_SIZE,
        peer_timeout: float | None = None,
    ) -> EtcdStore:
        """Connect to the etcd cluster at ``endpoints`` and take this client's lease.

        Args:
            endpoints: the members' client addresses: ``"host:port,host:port"``, or a
                sequence of ``"host:port"`` or ``(host, port)``; tried in this order.
            prefix: the etcd key prefix of this store (a ``"/"`` is added at its end if
                missing). Jobs sharing a cluster use different prefixes.
            timeout: seconds (or ``timedelta``) that ``get``, ``wait``, blocking ``queue_pop``
                and ``barrier`` wait, and that connecting may take; default 300 s.
            lease_ttl: seconds after which this client counts as gone once its process
                stopped renewing its lease (at least 2, etcd's shortest lease; whole
                seconds). ``None``: the peer timeout.
            max_value_size: the largest value in bytes.
            peer_timeout: seconds after which a connection whose member went silent (its
                host vanished) is dropped and the request moves to another member.
                ``None`` reads ``$AIODIST_PEER_TIMEOUT``, else 8 s.

        Raises:
            DistUsageError: malformed endpoints, prefix, lease_ttl or max_value_size.
            DistNetworkError: no member answered (the message names them and why).
            DistStoreError: etcd refused the lease.
        """
        if isinstance(endpoints, str):
            parsed = parse_endpoints(endpoints)
        else:
            parsed = [e if isinstance(e, tuple) else parse_endpoints(str(e))[0] for e in endpoints]
        if not parsed:
            raise DistUsageError("EtcdStore needs at least one endpoint")
        if not isinstance(prefix, str) or not prefix:
            raise DistUsageError(f"EtcdStore prefix must be a non-empty str, got {prefix!r}")
        prefix = prefix if prefix.endswith("/") else prefix + "/"
        if (
            isinstance(max_value_size, bool)
            or not isinstance(max_value_size, int)
            or (max_value_size < 1)
        ):
            raise DistUsageError(f"max_value_size must be a positive int, got {max_value_size!r}")
        seconds = to_seconds(timeout, DEFAULT_STORE_TIMEOUT)
        peer = resolve_peer_timeout(peer_timeout)
        ttl_seconds = peer if lease_ttl is None else lease_ttl
        if (
            isinstance(ttl_seconds, bool)
            or not isinstance(ttl_seconds, int | float)
            or not (math.isfinite(ttl_seconds) and ttl_seconds >= _MIN_LEASE_TTL)
        ):
            raise DistUsageError(
                f"lease_ttl must be a number of seconds >= {_MIN_LEASE_TTL}, got {lease_ttl!r}"
            )
        ttl = math.ceil(ttl_seconds)
        connect = min(seconds if seconds is not None else peer, peer)
        client = EtcdClient(parsed, connect_timeout=connect, peer_timeout=peer)
        try:
            answer = await client.call("/v3/lease/grant", {"TTL": str(ttl)})
        except BaseException:
            client.close()
            raise
        session = _Session(int(answer["ID"]), int(answer.get("TTL", ttl)))
        store = cls(
            client, prefix, session, seconds, max_value_size=max_value_size, _peer_timeout=peer
        )
        session.stop = keep_alive(parsed, session.lease, session.ttl, peer, store._on_lease_lost)
        return store

    def local_address(self) -> str | None:
        """The local address of this client's connection to etcd."""
        return self._client.local_address()

    # -- keys ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise DistUsageError(f"{self!r} is closed")
        if self._lost is not None:
            raise DistNetworkError(f"the etcd store at {self._client.where}: {self._lost}")

    def _data(self, key: bytes) -> bytes:
        """The etcd key of ``key``'s value (and the prefix of its queue's items)."""
        return self._root + b"k/%d/" % len(key) + key

    def _queue(self, key: bytes) -> bytes:
        return self._data(key) + b"/"

    def _marker(self, client: bytes, key: bytes = b"") -> bytes:
        return self._root + b"l/" + client + b"/" + key

    def _alive(self, client: bytes) -> bytes:
        return self._root + b"a/" + client

    def _record(self, seq: int) -> bytes:
        return self._root + b"o/" + self._me + b"/%016x" % seq

    def _value(self, value: Value) -> bytes:
        data = encode_value(value)
        if len(data) > self._max_value:
            raise DistUsageError(
                f"value of {len(data)} bytes exceeds the store's max_value_size of "
                f"{self._max_value} bytes"
            )
        return data

    def _user_key(self, etcd_key: bytes) -> bytes | None:
        """The store key whose value ``etcd_key`` holds (``None``: a queue item)."""
        rest = etcd_key[len(self._root) + 2 :]
        length, _, tail = rest.partition(b"/")
        return tail if length.isdigit() and len(tail) == int(length) else None

    # -- requests --------------------------------------------------------------------------
    async def _call(self, path: str, request: dict[str, Any]) -> dict[str, Any]:
        try:
            return await self._client.call(path, request)
        except EtcdError as exc:
            if "lease not found" in str(exc):
                self._on_lease_lost(f"its etcd lease {self._session.lease:x} lapsed")
                raise DistNetworkError(
                    f"the etcd store at {self._client.where}: {self._lost}"
                ) from None
            if "too large" in str(exc):
                raise DistUsageError(f"{exc} (etcd's --max-request-bytes)") from None
            raise

    async def _txn(
        self,
        compares: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        request: dict[str, Any] = {"success": success}
        if compares:
            request["compare"] = compares
        if failure:
            request["failure"] = failure
        return await self._call("/v3/kv/txn", request)

    async def _read(self, ranges: list[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
        """Read several ranges at one revision: (revision, one answer per range)."""
        answer = await self._txn([], [{"request_range": r} for r in ranges])
        return revision_of(answer), answer.get("responses", [])

    async def _transact(
        self,
        reads: list[dict[str, Any]],
        plan: Callable[[list[dict[str, Any]]], _Write | bytes | None],
        *,
        once: bool = True,
    ) -> tuple[bytes | None, int]:
        """Read ``reads``, let ``plan`` decide the write, and make it if nothing changed.

        ``plan`` gets the answers to ``reads`` and returns a :class:`_Write`, or the result
        when there is nothing to write (bytes, or ``None``). With ``once``, the write
        carries its outcome record, so that it happens once even when sent again (see the
        module's docstring). Returns the result and the revision it was read or written at.
        """
        record = b""
        if once:
            self._seq += 1
            seq = self._seq
            record = self._record(seq)
            self._inflight.add(seq)
        try:
            revision, ranges = await self._read(reads) if reads else (0, [])
            while True:
                write = plan(ranges)
                if not isinstance(write, _Write):
                    return write, revision
                compares, ops = list(write.compares), list(write.ops)
                failure = [{"request_range": r} for r in reads]
                if once:
                    compares.append(compare(record, "VERSION", 0))
                    ops.append(self._put(record, write.result, lease=True))
                    ops.extend(self._prune())
                    failure.insert(0, {"request_range": key_range(record)})
                answer = await self._txn(compares, ops, failure)
                revision = revision_of(answer)
                if answer.get("succeeded"):
                    return write.result, revision
                responses = answer.get("responses", [])
                if once:
                    recorded = kvs_of(responses.pop(0))
                    if recorded:  # an earlier try of this write went through
                        return unb64(recorded[0].get("value")), revision
                ranges = responses
        finally:
            if once:
                self._inflight.discard(seq)

    def _put(self, key: bytes, value: bytes, *, lease: bool = False) -> dict[str, Any]:
        request: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            request["lease"] = str(self._session.lease)
        return {"request_put": request}

    @staticmethod
    def _delete(key: bytes, *, prefix: bool = False) -> dict[str, Any]:
        return {"request_delete_range": key_range(key, prefix=prefix)}

    def _prune(self) -> list[dict[str, Any]]:
        """Delete the records of writes that were answered (every one below the lowest
        sequence number in flight)."""
        low = min(self._inflight)
        if low <= self._pruned + 1:
            return []
        self._pruned = low - 1
        start = self._record(0)
        return [{"request_delete_range": {"key": b64(start), "range_end": b64(self._record(low))}}]

    async def _until(
        self,
        key: bytes,
        *,
        prefix: bool,
        after: int,
        deadline: float | None,
        match: Callable[[dict[str, Any]], bool],
    ) -> bool:
        """Wait for an event on ``key`` (or its prefix) after revision ``after`` that
        ``match``-es; ``False`` if the deadline (``time.monotonic()``) passed first or the
        history was compacted (the caller reads again either way)."""
        watch = Watch(self._client, key, prefix_end(key) if prefix else None, after)
        self._watches.add(watch)
        try:
            async with asyncio.timeout_at(self._loop_deadline(deadline)):
                while True:
                    if any(match(e) for e in await watch.events()):
                        return True
        except (TimeoutError, Compacted):
            return False
        finally:
            watch.close()
            self._watches.discard(watch)

    @staticmethod
    def _loop_deadline(deadline: float | None) -> float | None:
        if deadline is None:
            return None
        return asyncio.get_running_loop().time() + max(deadline - time.monotonic(), 0)

    @staticmethod
    def _deadline(seconds: float | None) -> float | None:
        return None if seconds is None else time.monotonic() + seconds

    # -- the Store interface ---------------------------------------------------------------
    async def set(self, key: str, value: Value) -> None:
        """Store ``value`` under ``key`` and wake its waiters.

        Raises:
            DistUsageError: the value is too large, or the store is closed.
            DistNetworkError: no etcd member could be reached.
        """
        self._check_open()
        data = self._value(value)
        await self._call("/v3/kv/put", self._put(self._data(encode_key(key)), data)["request_put"])

    async def get(self, key: str) -> bytes:
        """Return the value of ``key``, waiting up to the store timeout for it.

        Raises:
            DistTimeoutError: the key did not appear in time (the message names it).
            DistNetworkError: no etcd member could be reached.
        """
        return (await self._wait_values([encode_key(key)], self.timeout))[0]

    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Return the values of ``keys``, waiting for all of them like :meth:`get`.

        Raises:
            DistTimeoutError: a key did not appear in time.
            DistNetworkError: no etcd member could be reached.
        """
        if not keys:
            self._check_open()
            return []
        return await self._wait_values([encode_key(k) for k in keys], self.timeout)

    async def _wait_values(self, keys: list[bytes], seconds: float | None) -> list[bytes]:
        self._check_open()
        start = time.monotonic()
        deadline = self._deadline(seconds)
        while True:
            revision, answers = await self._read([key_range(self._data(k)) for k in keys])
            found = [kvs_of(a) for a in answers]
            missing = [k for k, kv in zip(keys, found, strict=True) if not kv]
            if not missing:
                return [unb64(kv[0].get("value")) for kv in found]
            target = self._data(missing[0])
            if (
                not await self._until(
                    target,
                    prefix=False,
                    after=revision,
                    deadline=deadline,
                    match=lambda e: e.get("type", "PUT") == "PUT",
                )
                and deadline is not None
                and time.monotonic() >= deadline
            ):
                raise timeout_error(keys, missing, time.monotonic() - start) from None

    async def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        """Wait until every key exists (``timeout`` defaults to the store timeout).

        A key exists when it has a value or its queue has items, as in every store.

        Raises:
            DistTimeoutError: naming the keys still missing and the time waited.
            DistNetworkError: no etcd member could be reached.
        """
        self._check_open()
        seconds = to_seconds(timeout, self.timeout)
        raw = [encode_key(k) for k in keys]
        start = time.monotonic()
        deadline = self._deadline(seconds)
        while raw:
            revision, present = await self._exist(raw)
            missing = [k for k, there in zip(raw, present, strict=True) if not there]
            if not missing:
                return
            if (
                not await self._until(
                    self._data(missing[0]),
                    prefix=True,
                    after=revision,
                    deadline=deadline,
                    match=lambda e: e.get("type", "PUT") == "PUT",
                )
                and deadline is not None
                and time.monotonic() >= deadline
            ):
                raise timeout_error(raw, missing, time.monotonic() - start) from None

    async def _exist(self, keys: list[bytes]) -> tuple[int, list[bool]]:
        revision, answers = await self._read(
            [key_range(self._data(k), prefix=True, count_only=True) for k in keys]
        )
        return revision, [int(a.get("response_range", {}).get("count", 0)) > 0 for a in answers]

    async def check(self, keys: Sequence[str]) -> bool:
        """Return whether every key exists, without waiting.

        Raises:
            DistNetworkError: no etcd member could be reached.
        """
        self._check_open()
        raw = [encode_key(k) for k in keys]
        return True if not raw else all((await self._exist(raw))[1])

    async def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the ASCII counter ``key`` (missing: 0) and return the result.

        Raises:
            DistStoreError: the key holds something that is not an integer, or the sum does
                not fit in 64 bits (unchanged).
            DistUsageError: ``amount`` is not a 64-bit integer.
            DistNetworkError: no etcd member could be reached.
        """
        self._check_open()
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise DistUsageError(f"add amount must be an int, got {type(amount).__name__}")
        if not I64_MIN <= amount <= I64_MAX:
            raise DistUsageError(f"add amount {amount} does not fit in 64 bits")
        return (await self._add(encode_key(key), int(amount), "add"))[0]

    async def _add(self, key: bytes, amount: int, op: str) -> tuple[int, int]:
        target = self._data(key)

        def plan(ranges: list[dict[str, Any]]) -> _Write:
            kvs = kvs_of(ranges[0])
            old = parse_counter(key, unb64(kvs[0].get("value")), op) if kvs else 0
            new = old + amount
            if not I64_MIN <= new <= I64_MAX:
                raise DistStoreError(
                    f"{op} on key {format_keys([key])}: the result {new} does not fit in a "
                    "signed 64-bit integer"
                )
            mod = int(kvs[0].get("mod_revision", 0)) if kvs else 0
            value = b"%d" % new
            return _Write([compare(target, "MOD", mod)], [self._put(target, value)], value)

        result, revision = await self._transact([key_range(target)], plan)
        assert result is not None
        return int(result), revision

    async def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        """torch's compare-and-set; see :meth:`Store.compare_set`.

        Raises:
            DistUsageError: a value is too large.
            DistNetworkError: no etcd member could be reached.
        """
        self._check_open()
        target = self._data(encode_key(key))
        old, new = self._value(expected), self._value(desired)

        def plan(ranges: list[dict[str, Any]]) -> _Write | bytes:
            kvs = kvs_of(ranges[0])
            if not kvs:
                if old:
                    return old
                return _Write([compare(target, "MOD", 0)], [self._put(target, new)], new)
            current = unb64(kvs[0].get("value"))
            if current != old:
                return current
            mod = int(kvs[0]["mod_revision"])
            return _Write([compare(target, "MOD", mod)], [self._put(target, new)], new)

        result, _ = await self._transact([key_range(target)], plan)
        assert result is not None
        return result

    async def append(self, key: str, value: Value) -> None:
        """Append ``value`` to ``key``, creating it if missing.

        Raises:
            DistUsageError: the value, or the result, is too large.
            DistNetworkError: no etcd member could be reached.
        """
        self._check_open()
        target = self._data(encode_key(key))
        tail = self._value(value)

        def plan(ranges: list[dict[str, Any]]) -> _Write:
            kvs = kvs_of(ranges[0])
            old = unb64(kvs[0].get("value")) if kvs else b""
            mod = int(kvs[0].get("mod_revision", 0)) if kvs else 0
            new = self._value(old + tail)
            return _Write([compare(target, "MOD", mod)], [self._put(target, new)], b"")

        await self._transact([key_range(target)], plan)

    async def delete_key(self, key: str) -> bool:
        """Delete ``key``; return whether it existed.

        Raises:
            DistNetworkError: no etcd member could be reached.
        """
        self._check_open()
        target = self._data(encode_key(key))

        def plan(ranges: list[dict[str, Any]]) -> _Write | bytes:
            kvs = kvs_of(ranges[0])
            if not kvs:
                return b"0"
            mod = int(kvs[0]["mod_revision"])
            return _Write([compare(target, "MOD", mod)], [self._delete(target)], b"1")

        result, _ = await self._transact([key_range(target, keys_only=True)], plan)
        return result == b"1"

    async def delete_prefix(self, prefix: str) -> int:
        """Delete every key that starts with ``prefix``; return how many it deleted: the
        keys (one request), then their deletion in transactions of up to
        :data:`_DELETES_PER_TXN` (etcd's ``--max-txn-ops`` is 128 unless set otherwise).

        Raises:
            DistNetworkError: no etcd member could be reached.
        """
        self._check_open()
        start = encode_key(prefix)
        doomed = [self._data(k) for k in await self._keys() if k.startswith(start)]
        deleted = 0
        for i in range(0, len(doomed), _DELETES_PER_TXN):
            answer = await self._txn(
                [], [self._delete(k) for k in doomed[i : i + _DELETES_PER_TXN]]
            )
            for response in answer.get("responses", []):
                deleted += int(response.get("response_delete_range", {}).get("deleted", 0))
        return deleted

    async def _keys(self) -> list[bytes]:
        answer = await self._call("/v3/kv/range", key_range(self._root + b"k/", prefix=True,
                                                          keys_only=True))  # fmt: skip
        keys = (self._user_key(unb64(kv["key"])) for kv in kvs_of(answer))
        return [k for k in keys if k is not None]

    async def num_keys(self) -> int:
        """Return the number of keys that hold a value (queues are not counted, as in torch).

        Raises:
            DistNetworkError: no etcd member could be reached.
        """
        self._check_open()
        return len(await self._keys())

    async def list_keys(self) -> list[str]:
        """Return the keys that hold a value.

        Raises:
            DistNetworkError: no etcd member could be reached.
        """
        self._check_open()
        return [k.decode(errors="surrogateescape") for k in await self._keys()]

    async def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        """Set every key to its value in one transaction (the last value of a repeated key).

        Raises:
            DistUsageError: the sequences differ in length, or a value is too large.
            DistNetworkError: no etcd member could be reached.
        """
        self._check_open()
        check_lengths(keys, values)
        items = {
            self._data(encode_key(k)): self._value(v) for k, v in zip(keys, values, strict=True)
        }
        if items:
            await self._txn([], [self._put(k, v) for k, v in items.items()])

    async def queue_push(self, key: str, value: Value) -> None:
        """Push ``value`` onto the FIFO queue ``key``.

        Raises:
            DistUsageError: the value is too large.
            DistNetworkError: no etcd member could be reached.
        """
        self._check_open()
        data = self._value(value)
        # A name no other push uses: this client's id and the push's sequence number.
        item = self._queue(encode_key(key)) + self._me + b".%016x" % next(self._items)
        await self._transact([], lambda _: _Write([], [self._put(item, data)], b""))

    async def queue_push_front(self, key: str, value: Value) -> None:
        """Put ``value`` at the head of queue ``key`` (see :meth:`Store.queue_push_front`).

        Raises:
            DistUsageError: the value is too large.
            DistNetworkError: no etcd member could be reached.
        """
        self._check_open()
        data = self._value(value)
        revision, _ = await self._read([])
        # First among the items given back, later ones before earlier ones (the count falls
        # as the revision grows); this client's id and a count keep the name its own.
        place = (
            _FIRST + b"%016x" % (2**64 - 1 - revision) + self._me + b".%016x" % next(self._items)
        )
        await self._give_back(self._queue(encode_key(key)), place, data)

    async def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Pop the oldest value of queue ``key``.

        A pop cancelled while its transaction is in flight waits for it and puts what it
        took back at the head of the queue (before the cancellation goes on).

        Raises:
            QueueEmptyError: ``block`` is false and the queue is empty.
            DistTimeoutError: ``block`` is true and nothing arrived within the store timeout.
            DistNetworkError: no etcd member could be reached.
        """
        self._check_open()
        raw = encode_key(key)
        items = self._queue(raw)
        start = time.monotonic()
        deadline = self._deadline(self.timeout)
        while True:
            taking = asyncio.ensure_future(self._pop_once(items))
            try:
                value, order, revision = await asyncio.shield(taking)
            except asyncio.CancelledError:
                await settled(taking)
                if not taking.cancelled() and taking.exception() is None:
                    taken, order, _ = taking.result()
                    if taken is not None:
                        giving = asyncio.ensure_future(self._give_back(items, order, taken))
                        await settled(giving)
                        if not giving.cancelled() and giving.exception() is not None:
                            logger.warning(
                                "a cancelled queue_pop on %r could not put its value back: %s",
                                key,
                                giving.exception(),
                            )
                raise
            if value is not None:
                return value
            if not block:
                raise QueueEmptyError(f"queue {key!r} is empty")
            if (
                not await self._until(
                    items,
                    prefix=True,
                    after=revision,
                    deadline=deadline,
                    match=lambda e: e.get("type", "PUT") == "PUT",
                )
                and deadline is not None
                and time.monotonic() >= deadline
            ):
                raise timeout_error([raw], [raw], time.monotonic() - start) from None

    async def _pop_once(self, items: bytes) -> tuple[bytes | None, bytes, int]:
        """Pop the head of the queue whose items are under ``items``: the first item given
        back, else the oldest. Returns its value (``None``: empty), its place (what it is
        given back under if its pop is cancelled) and the revision read."""

        def plan(ranges: list[dict[str, Any]]) -> _Write | None:
            kvs = kvs_of(ranges[0]) or kvs_of(ranges[1])
            if not kvs:
                return None
            item = unb64(kvs[0]["key"])
            mod = int(kvs[0]["mod_revision"])
            name = item[len(items) :]
            # Its place: kept if it was given back before, else its creation's revision.
            order = (
                name[len(_GIVEN_BACK) :]
                if name.startswith(_GIVEN_BACK)
                else b"%016x" % int(kvs[0]["create_revision"])
            )
            value = unb64(kvs[0].get("value"))
            result = bytes([len(order)]) + order + value
            return _Write([compare(item, "MOD", mod)], [self._delete(item)], result)

        given_back = key_range(items + _GIVEN_BACK, prefix=True, sort_target="KEY", limit="1")
        oldest = key_range(items, prefix=True, sort_target="CREATE", sort_order="ASCEND", limit="1")
        result, revision = await self._transact([given_back, oldest], plan)
        if result is None:
            return None, b"", revision
        end = 1 + result[0]
        return result[end:], result[1:end], revision

    async def _give_back(self, items: bytes, order: bytes, value: bytes) -> None:
        # Under its place among the items given back: they sort by name before every item
        # pushed (a pop takes them first), in the order the queue had them.
        item = items + _GIVEN_BACK + order
        await self._transact([], lambda _: _Write([], [self._put(item, value)], b""))

    async def queue_len(self, key: str) -> int:
        """Return the number of values in queue ``key``.

        Raises:
            DistNetworkError: no etcd member could be reached.
        """
        self._check_open()
        answer = await self._call(
            "/v3/kv/range", key_range(self._queue(encode_key(key)), prefix=True, count_only=True)
        )
        return int(answer.get("count", 0))

    async def barrier(self, key: str, world_size: int, timeout: Timeout = None) -> None:
        """Count in at ``key`` and wait until ``world_size`` callers have (torch's barrier).

        The count is the counter ``add`` uses on ``key``; the wait is a watch of it.

        Raises:
            DistUsageError: ``world_size`` is not a positive int, or the store is closed.
            DistStoreError: ``key`` holds something that is not an integer.
            DistTimeoutError: fewer than ``world_size`` arrived in time (the message names
                the key and the count reached); this caller stays counted in.
            DistNetworkError: no etcd member could be reached.
        """
        self._check_open()
        world = check_world_size(world_size)
        seconds = to_seconds(timeout, self.timeout)
        raw = encode_key(key)
        start = time.monotonic()
        deadline = self._deadline(seconds)
        count, revision = await self._add(raw, 1, "barrier")
        target = self._data(raw)
        reached: list[int | None] = [count]

        def arrived(event: dict[str, Any]) -> bool:
            if event.get("type", "PUT") != "PUT":
                return False
            try:
                count = int(unb64(event["kv"].get("value")))
            except ValueError:
                reached[0] = None
                return False
            reached[0] = count
            return count >= world

        while reached[0] is None or reached[0] < world:
            if await self._until(target, prefix=False, after=revision, deadline=deadline,
                                 match=arrived):  # fmt: skip
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise barrier_timeout_error(raw, reached[0], world, time.monotonic() - start)
            # (The history was compacted: read the counter again.)
            revision, answers = await self._read([key_range(target)])
            kvs = kvs_of(answers[0])
            value = unb64(kvs[0].get("value")) if kvs else b"0"
            reached[0] = int(value) if value.lstrip(b"-").isdigit() else None

    # -- leases ----------------------------------------------------------------------------
    async def lease(self, key: str, value: Value | None, *, append: bool = False) -> bool:
        """Have ``key`` set to ``value`` (or, with ``append``, ``value`` appended to it) if
        this client's etcd lease lapses.

        See :meth:`Store.lease`. The lease lapses ``lease_ttl`` seconds after this process
        stopped renewing it (it died, or its host lost etcd), or when the store is closed;
        then another client of the store that holds leases itself sets ``key`` (unless it
        holds a non-empty value already) or appends to it, as a TCPStore server does when a
        client's connection ends. ``None`` (or an empty value) withdraws the lease.

        Raises:
            DistNetworkError: no etcd member could be reached, or this client's lease has
                lapsed already.
        """
        self._check_open()
        raw = encode_key(key)
        data = b"" if value is None else self._value(value)
        marker = self._marker(self._me, raw)
        if not data:
            await self._call("/v3/kv/deleterange", key_range(marker))
            return True
        if self._keeper is None:
            put = self._put(self._alive(self._me), b"", lease=True)["request_put"]
            await self._call("/v3/kv/put", put)
            self._keeper = asyncio.ensure_future(self._keep_leases())
        # Only while this client is alive: a marker written after its lease lapsed would
        # never be carried out.
        answer = await self._txn(
            [{**compare(self._alive(self._me), "VERSION", 0), "result": "GREATER"}],
            [self._put(marker, (_APPEND if append else _SET) + data)],
        )
        if not answer.get("succeeded"):
            self._on_lease_lost(f"its etcd lease {self._session.lease:x} lapsed")
            self._check_open()
        return True

    async def _keep_leases(self) -> None:
        """Carry out the leases of clients whose etcd lease lapsed, as long as this store
        is open: those found lapsed now, then each one as its liveness key goes."""
        alive_prefix = self._root + b"a/"
        while not self._closed and self._lost is None:
            try:
                revision, (alive, markers) = await self._read(
                    [
                        key_range(alive_prefix, prefix=True, keys_only=True),
                        key_range(self._root + b"l/", prefix=True, keys_only=True),
                    ]
                )
                living = {unb64(kv["key"])[len(alive_prefix) :] for kv in kvs_of(alive)}
                start = len(self._root) + 2
                owners = {unb64(kv["key"])[start : start + 16] for kv in kvs_of(markers)}
                for owner in owners - living:
                    await self._carry_out(owner)
                watch = Watch(self._client, alive_prefix, prefix_end(alive_prefix), revision)
                try:
                    while True:
                        for event in await watch.events():
                            if event.get("type") == "DELETE":
                                await self._carry_out(
                                    unb64(event["kv"]["key"])[len(alive_prefix) :]
                                )
                finally:
                    watch.close()
            except Compacted:
                continue
            except (DistNetworkError, DistStoreError) as exc:
                logger.warning("etcd store: carrying out leases failed (%s): retrying", exc)
                await asyncio.sleep(_KEEPER_RETRY)

    async def _carry_out(self, owner: bytes) -> None:
        """Set the keys of the leases of ``owner``, a client whose lease lapsed."""
        answer = await self._call("/v3/kv/range", key_range(self._marker(owner), prefix=True))
        for kv in kvs_of(answer):
            await self._carry_out_one(owner, kv)

    async def _carry_out_one(self, owner: bytes, kv: dict[str, Any]) -> None:
        """Set the key of the lease marker ``kv`` of ``owner``, unless it holds a value (or
        append to it), and delete the marker: once, whichever client of the store does it
        first."""
        marker = unb64(kv["key"])
        target = self._data(marker[len(self._marker(owner)) :])
        marked = unb64(kv.get("value"))
        kind, value = marked[:1], marked[1:]
        # (Only while the owner's lease is gone and the marker is the one read.)
        checks = [
            compare(self._alive(owner), "VERSION", 0),
            compare(marker, "MOD", int(kv["mod_revision"])),
        ]

        def plan(ranges: list[dict[str, Any]]) -> _Write | None:
            if not kvs_of(ranges[1]):
                return None  # another client carried it out
            kvs = kvs_of(ranges[0])
            old = unb64(kvs[0].get("value")) if kvs else b""
            if kind == _APPEND and len(old) + len(value) > self._max_value:
                logger.warning(
                    "etcd store: a lease on %r could not be carried out: appending to it "
                    "would pass max_value_size",
                    target,
                )
                return _Write(checks, [self._delete(marker)], b"")
            if kind != _APPEND and old:
                return _Write(checks, [self._delete(marker)], b"")  # set already
            mod = int(kvs[0]["mod_revision"]) if kvs else 0
            ops = [
                self._delete(marker),
                self._put(target, old + value if kind == _APPEND else value),
            ]
            return _Write([*checks, compare(target, "MOD", mod)], ops, b"")

        await self._transact(
            [key_range(target), key_range(marker, keys_only=True)], plan, once=False
        )
        logger.debug("carried out the lease on %r of a lapsed client", target)

    def _on_lease_lost(self, reason: str) -> None:
        """This client's lease lapsed: the others take it for gone; so must it."""
        if self._lost is not None or self._closed:
            return
        self._lost = reason
        logger.warning("etcd store at %s: %s", self._client.where, reason)
        self._client.close(reason)
        for watch in list(self._watches):
            watch.close()

    async def clone(self) -> EtcdStore:
        """Return a new client of the same store (its own lease and connections).

        Raises:
            DistNetworkError: no etcd member could be reached.
        """
        self._check_open()
        return await EtcdStore.create(
            self.endpoints,
            self.prefix,
            self.timeout,
            lease_ttl=self._session.ttl,
            max_value_size=self._max_value,
            peer_timeout=self._peer_timeout,
        )

    async def aclose(self) -> None:
        """Revoke this client's lease (its leases are carried out) and close. Closing twice
        is harmless."""
        if self._closed:
            return
        self._closed = True
        self._session.stop()
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(BaseException):
                await self._keeper
        if self._lost is None:
            try:
                async with asyncio.timeout(self._peer_timeout):
                    await self._client.call("/v3/lease/revoke", {"ID": str(self._session.lease)})
                    if self._keeper is not None:
                        await self._carry_out(self._me)
            except (DistNetworkError, DistStoreError, TimeoutError) as exc:
                logger.debug("closing the etcd store: %s", exc)
        self._client.close()
