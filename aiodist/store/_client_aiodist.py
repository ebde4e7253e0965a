"""The aiodist wire of the TCPStore client: handshake, then requests tagged with ids.

aiodist's own protocol (layouts in ``_wire.py``) opens with a hello and an optional HMAC
challenge-response (:func:`handshake_aiodist`), then tags every request with an id, so one
connection carries any number of concurrent requests, answered in any order: a pending
``wait`` never holds up a ``set`` from the same process, and waits are timed on the server (no
polling). :class:`AiodistChannel` keeps a future per request id. The server side of this wire
is ``_server_aiodist.py``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import struct
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import (
    DistProtocolError,
    DistStoreError,
    DistTimeoutError,
    DistUsageError,
    QueueEmptyError,
)
from ._base import settled
from ._client_connection import (
    MAX_REPLY_VALUE,
    SERVER_GRACE,
    Channel,
    ClientConnection,
    ReplySink,
    TimedOut,
)
from ._wire import (
    AIODIST_MAGIC,
    AUTH_MAC_SIZE,
    CLIENT_HELLO,
    F64,
    FLAG_AUTH,
    FRAME_HEAD,
    I64,
    NONCE_SIZE,
    PROTOCOL_VERSION,
    SERVER_HELLO,
    U8,
    U32,
    Incomplete,
    Op,
    Reader,
    Status,
    auth_mac,
    blob32,
    encode_frame,
    max_request_size,
)

__all__ = ["AiodistChannel", "handshake_aiodist"]

logger = logging.getLogger(__name__)

_OK = int(Status.OK)
#: Request ids run 1..2**32-1: id 0 is what CANCEL frames carry.
_MAX_RID = 0xFFFFFFFF


def _timeout_arg(timeout: float | None) -> bytes:
    return F64.pack(-1.0 if timeout is None else timeout)


def _keys_arg(keys: Sequence[bytes]) -> list[bytes]:
    return [U32.pack(len(keys)), *(blob32(k) for k in keys)]


def _read_blobs(payload: bytes) -> list[bytes]:
    reader = Reader(payload)
    return [reader.blob32(MAX_REPLY_VALUE, "value") for _ in range(reader.u32())]


_Decoder = Callable[[bytes], Any]
#: body length, request id, opcode, key length: the head of an add request.
_ADD_HEAD = struct.Struct("<IIBI")
_SET, _ADD, _COMPARE_SET, _CHECK = int(Op.SET), int(Op.ADD), int(Op.COMPARE_SET), int(Op.CHECK)
_DELETE_KEY, _NUM_KEYS, _LIST_KEYS = int(Op.DELETE_KEY), int(Op.NUM_KEYS), int(Op.LIST_KEYS)
_MULTI_SET, _APPEND = int(Op.MULTI_SET), int(Op.APPEND)
_QUEUE_PUSH, _QUEUE_LEN = int(Op.QUEUE_PUSH), int(Op.QUEUE_LEN)
_QUEUE_PUSH_FRONT, _DELETE_PREFIX = int(Op.QUEUE_PUSH_FRONT), int(Op.DELETE_PREFIX)


def _nothing(payload: bytes) -> None:
    return None


def _ok(reply: asyncio.Future[Any]) -> bytes | None:
    """The payload of a successful reply (``(status, payload)``), else ``None``."""
    if not reply.done() or reply.cancelled() or reply.exception() is not None:
        return None
    status, payload = reply.result()
    return payload if status == _OK else None


def _retrieve(done: asyncio.Future[Any]) -> None:
    # Marks a failure as seen: a future nobody awaits any more.
    if not done.cancelled():
        done.exception()


def _given_back(done: asyncio.Future[None]) -> None:
    if not done.cancelled() and done.exception() is not None:
        logger.warning("a cancelled queue_pop could not give its value back: %s", done.exception())


def _i64(payload: bytes) -> int:
    value: int = I64.unpack(payload)[0]
    return value


def _bytes(payload: bytes) -> bytes:
    return payload


def _flag(payload: bytes) -> bool:
    return payload == b"\x01"


class AiodistChannel(Channel, ReplySink):
    """aiodist's protocol: request ids, out-of-order replies, server-side waits."""

    wire = "aiodist"

    def __init__(self, conn: ClientConnection, max_key_size: int, max_value_size: int) -> None:
        self._conn = conn
        self.max_key_size = max_key_size
        self.max_value_size = max_value_size
        self._max_request = max_request_size(max_key_size, max_value_size)
        # request id -> (future, decoder): a decoder turns an OK reply's payload into the
        # future's result; None hands (status, payload) to ``_call``.
        self._pending: dict[int, tuple[asyncio.Future[Any], _Decoder | None]] = {}
        self._next_rid = 0
        conn.sink = self
        if conn.buf:
            del conn.buf[: self.feed(conn.buf)]

    @property
    def pending(self) -> int:
        return len(self._pending)

    def feed(self, buf: bytes | bytearray) -> int:
        pos = 0
        size = len(buf)
        pending = self._pending
        unpack = FRAME_HEAD.unpack_from
        while size - pos >= 9:
            length, rid, status = unpack(buf, pos)
            end = pos + 4 + length
            if end > size:
                break
            entry = pending.pop(rid, None)
            if entry is not None and not entry[0].done():
                future, decode = entry
                if decode is _i64 and status == _OK and length == 13:
                    # An add's reply: the most frequent, decoded in place.
                    future.set_result(I64.unpack_from(buf, pos + 9)[0])
                    pos = end
                    continue
                payload = buf[pos + 9 : end]
                if type(payload) is not bytes:
                    payload = bytes(payload)
                if decode is None:
                    future.set_result((status, payload))
                elif status != _OK:
                    future.set_exception(self._error(status, payload))
                else:
                    try:
                        future.set_result(decode(payload))
                    except (struct.error, ValueError, Incomplete) as exc:
                        future.set_exception(
                            DistProtocolError(f"malformed reply from {self._conn.where}: {exc}")
                        )
            pos = end
        return pos

    def lost(self, conn: ClientConnection) -> None:
        pending, self._pending = self._pending, {}
        for future, _decode in pending.values():
            if not future.done():
                future.set_exception(conn.lost_error())

    def _new_rid(self) -> int:
        rid = self._next_rid + 1
        if rid > _MAX_RID or rid in self._pending:
            rid = self._free_rid(rid)
        self._next_rid = rid
        return rid

    def _free_rid(self, rid: int) -> int:
        # Never 0 (CANCEL frames carry it), and never an id still in use: after 2**32
        # requests the count wraps while a long wait (an abort watch) may hold a low id.
        pending = self._pending
        while rid > _MAX_RID or rid in pending:
            rid = rid + 1 if rid < _MAX_RID else 1
        return rid

    def _submit(self, op: int, payload: bytes, decode: _Decoder | None) -> asyncio.Future[Any]:
        """Send one request; return the future of its reply (decoded by ``decode``).

        Raises:
            DistNetworkError: the connection is lost.
            DistUsageError: the request is larger than the server accepts.
        """
        conn = self._conn
        if conn.is_lost:
            raise conn.lost_error()
        if len(payload) + 5 > self._max_request:
            raise DistUsageError(
                f"request of {len(payload) + 5} bytes exceeds the store's limit of "
                f"{self._max_request} bytes (max_key_size={self.max_key_size}, "
                f"max_value_size={self.max_value_size})"
            )
        rid = self._new_rid()
        future: asyncio.Future[Any] = conn.loop.create_future()
        self._pending[rid] = (future, decode)
        conn.write(FRAME_HEAD.pack(len(payload) + 5, rid, op) + payload)
        return future

    async def _call(
        self,
        op: Op,
        *parts: bytes,
        deadline: float | None = None,
        taken: Callable[[bytes], asyncio.Future[None] | None] | None = None,
    ) -> bytes:
        """A request that may wait on the server: on cancellation it is cancelled there too,
        and a server that stays silent past ``deadline`` plus a grace is reported.

        ``taken`` is called with the payload of a successful reply that the caller gave up
        on (cancelled or timed out): a reply parsed in the turn the cancellation came, or
        one the server sent before it saw the cancel (a pop gives its value back so).
        """
        future = self._submit(op, b"".join(parts), None)
        rid = self._next_rid
        conn = self._conn
        # (A cancelled task cancels the future it awaits: shielded, the reply still lands.)
        reply = future if taken is None else asyncio.shield(future)
        try:
            if deadline is None:
                status, payload = await reply
            else:
                async with asyncio.timeout(deadline + SERVER_GRACE):
                    status, payload = await reply
        except BaseException as exc:
            # Cancelled or given up: tell the server to drop the request (and its waiter).
            if taken is not None:
                # (A server silent past the deadline is not waited for again.)
                silent = isinstance(exc, TimeoutError)
                if await self._abandon(rid, future, taken, 0.0 if silent else SERVER_GRACE):
                    raise asyncio.CancelledError from None  # (cancelled meanwhile)
            elif self._pending.pop(rid, None) is not None and not conn.is_lost:
                conn.write(encode_frame(0, Op.CANCEL, U32.pack(rid)))
            if isinstance(exc, TimeoutError):
                raise DistTimeoutError(
                    f"the store at {conn.where} did not answer a {op.name} request within "
                    f"{(deadline or 0.0) + SERVER_GRACE:.1f} s"
                ) from None
            raise
        if status == _OK:
            result: bytes = payload
            return result
        raise self._error(status, payload)

    async def _abandon(
        self,
        rid: int,
        future: asyncio.Future[Any],
        taken: Callable[[bytes], asyncio.Future[None] | None],
        grace: float,
    ) -> bool:
        """Give up request ``rid`` (see ``_call``'s ``taken``) and know its outcome within
        ``grace`` seconds: what it took is given back (``taken`` sends the request that
        does, awaited here) before this returns; past the grace, a reply that comes later
        gives back all the same. Returns whether the caller was cancelled meanwhile."""
        conn = self._conn
        cancelled = False
        if not future.done() and not conn.is_lost:
            conn.write(encode_frame(0, Op.CANCEL, U32.pack(rid)))
            # The server answers in order: by its answer to this ping, the request has
            # answered (served before the cancel reached the server) or been dropped.
            ping = self._submit(int(Op.PING), b"", _nothing)
            ping.add_done_callback(_retrieve)  # (its failure, a lost connection, is the pop's)
            cancelled = await settled(ping, grace)
            if not ping.done():
                # A server silent past the grace: a reply that comes later still gives back.
                def late(reply: asyncio.Future[Any]) -> None:
                    payload = _ok(reply)
                    if payload is not None:
                        taken(payload)

                future.add_done_callback(late)
                return cancelled
        self._pending.pop(rid, None)
        payload = _ok(future)
        if payload is not None:
            giving = taken(payload)
            if giving is not None:
                cancelled = await settled(giving, grace) or cancelled
        return cancelled

    @staticmethod
    def _error(status: int, payload: bytes) -> Exception:
        if status == Status.TIMEOUT:
            reader = Reader(payload)
            waited = reader.f64()
            missing = [reader.blob32(MAX_REPLY_VALUE, "key") for _ in range(reader.u32())]
            # A barrier's timeout ends with the count reached (-1: not an integer).
            count = reader.i64() if reader.end - reader.pos >= 8 else None
            return TimedOut(missing, waited, None if count is None or count < 0 else count)
        message = payload.decode(errors="replace")
        if status == Status.STORE_ERROR:
            return DistStoreError(message)
        if status == Status.USAGE_ERROR:
            return DistUsageError(message)
        if status == Status.QUEUE_EMPTY:
            return QueueEmptyError(message)
        return DistProtocolError(f"store server error (status {status}): {message}")

    def set(self, key: bytes, value: bytes) -> asyncio.Future[None]:
        return self._submit(_SET, blob32(key) + blob32(value), _nothing)

    async def get(self, key: bytes, timeout: float | None) -> bytes:
        return await self._call(Op.GET, _timeout_arg(timeout), blob32(key), deadline=timeout)

    def add(self, key: bytes, amount: int) -> asyncio.Future[int]:
        # ``_submit`` spelled out: the most frequent request (a key is within the limits).
        conn = self._conn
        transport = conn.transport
        if transport is None:
            raise conn.lost_error()
        rid = self._next_rid + 1
        if rid > _MAX_RID or rid in self._pending:
            rid = self._free_rid(rid)
        self._next_rid = rid
        future: asyncio.Future[int] = conn.loop.create_future()
        self._pending[rid] = (future, _i64)
        transport.write(_ADD_HEAD.pack(len(key) + 17, rid, _ADD, len(key)) + key + I64.pack(amount))
        return future

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> asyncio.Future[bytes]:
        payload = blob32(key) + blob32(expected) + blob32(desired)
        return self._submit(_COMPARE_SET, payload, _bytes)

    async def wait(self, keys: list[bytes], timeout: float | None) -> None:
        await self._call(Op.WAIT, _timeout_arg(timeout), *_keys_arg(keys), deadline=timeout)

    def check(self, keys: list[bytes]) -> asyncio.Future[bool]:
        return self._submit(_CHECK, b"".join(_keys_arg(keys)), _flag)

    def delete(self, key: bytes) -> asyncio.Future[bool]:
        return self._submit(_DELETE_KEY, blob32(key), _flag)

    def delete_prefix(self, prefix: bytes) -> asyncio.Future[int]:
        return self._submit(_DELETE_PREFIX, blob32(prefix), _i64)

    def num_keys(self) -> asyncio.Future[int]:
        return self._submit(_NUM_KEYS, b"", _i64)

    def list_keys(self) -> asyncio.Future[list[bytes]]:
        return self._submit(_LIST_KEYS, b"", _read_blobs)

    async def multi_get(self, keys: list[bytes], timeout: float | None) -> list[bytes]:
        payload = await self._call(
            Op.MULTI_GET, _timeout_arg(timeout), *_keys_arg(keys), deadline=timeout
        )
        return _read_blobs(payload)

    def multi_set(self, items: list[tuple[bytes, bytes]]) -> asyncio.Future[None]:
        parts = [U32.pack(len(items))]
        for key, value in items:
            parts += (blob32(key), blob32(value))
        return self._submit(_MULTI_SET, b"".join(parts), _nothing)

    def append(self, key: bytes, value: bytes) -> asyncio.Future[None]:
        return self._submit(_APPEND, blob32(key) + blob32(value), _nothing)

    def queue_push(self, key: bytes, value: bytes) -> asyncio.Future[None]:
        return self._submit(_QUEUE_PUSH, blob32(key) + blob32(value), _nothing)

    async def queue_pop(self, key: bytes, block: bool, timeout: float | None) -> bytes:
        def give_back(value: bytes) -> asyncio.Future[None] | None:
            if self._conn.is_lost:
                logger.warning("a cancelled queue_pop lost its value with the connection")
                return None
            giving = self.queue_push_front(key, value)
            giving.add_done_callback(_given_back)
            return giving

        return await self._call(
            Op.QUEUE_POP,
            _timeout_arg(timeout),
            U8.pack(block),
            blob32(key),
            deadline=timeout if block else None,
            taken=give_back,
        )

    def queue_push_front(self, key: bytes, value: bytes) -> asyncio.Future[None]:
        return self._submit(_QUEUE_PUSH_FRONT, blob32(key) + blob32(value), _nothing)

    def queue_len(self, key: bytes) -> asyncio.Future[int]:
        return self._submit(_QUEUE_LEN, blob32(key), _i64)

    async def barrier(self, key: bytes, world_size: int, timeout: float | None) -> None:
        await self._call(
            Op.BARRIER, _timeout_arg(timeout), I64.pack(world_size), blob32(key), deadline=timeout
        )

    async def lease(self, key: bytes, value: bytes, append: bool) -> bool:
        await self._call(Op.LEASE_APPEND if append else Op.LEASE, blob32(key), blob32(value))
        return True

    def close(self) -> None:
        self._conn.close()


async def handshake_aiodist(
    conn: ClientConnection, token: bytes | None, timeout: float | None
) -> tuple[int, int]:
    """Run the aiodist hello (and auth); return the server's key and value size limits."""
    nonce = os.urandom(NONCE_SIZE)
    conn.write(CLIENT_HELLO.pack(AIODIST_MAGIC, PROTOCOL_VERSION, nonce))
    hello = await conn.read_exactly(SERVER_HELLO.size, timeout)
    magic, version, flags, max_key, max_value, server_nonce = SERVER_HELLO.unpack(hello)
    if magic != AIODIST_MAGIC:
        raise DistProtocolError(
            f"{conn.where} answered the aiodist hello with {hello[:8]!r}: "
            "it is not an aiodist store server"
        )
    if version != PROTOCOL_VERSION:
        raise DistProtocolError(
            f"the store at {conn.where} speaks aiodist store protocol version {version}, "
            f"this client speaks version {PROTOCOL_VERSION}: use the same aiodist version "
            "on every host"
        )
    if flags & FLAG_AUTH:
        if token is None:
            raise DistStoreError(
                f"the store at {conn.where} requires authentication: pass auth_token= "
                "or set AIODIST_AUTH_TOKEN"
            )
        conn.write(auth_mac(token, b"store/client", server_nonce, nonce))
        verdict = await conn.read_exactly(1, timeout)
        if verdict != b"\x00":
            raise DistStoreError(
                f"the store at {conn.where} rejected the auth token (tokens differ)"
            )
        proof = await conn.read_exactly(AUTH_MAC_SIZE, timeout)
        if not hmac.compare_digest(proof, auth_mac(token, b"store/server", nonce, server_nonce)):
            raise DistStoreError(
                f"the store at {conn.where} could not prove it holds the auth token"
            )
    return max_key, max_value
