"""TCPStore: the network store, client and (for the master) server, on asyncio.

The client speaks one of two wires. aiodist's own protocol tags every request with an id, so
one connection carries any number of concurrent requests: a pending ``wait`` never holds up a
``set`` from the same process, and waits are timed on the server (no polling). torch's wire
answers strictly in order, so the torch-wire client keeps its main connection for requests
that answer at once and runs each wait on a spare connection of its own.

User keys go on the wire as ``"/" + key`` on both wires, the way torch's client sends them, so
torch and aiodist clients of one server see the same keys under the same names.
"""

from __future__ import annotations

import abc
import asyncio
import hmac
import logging
import os
import random
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, cast

from .._timeouts import DEFAULT_STORE_TIMEOUT, Timeout, to_seconds
from ..errors import (
    DistNetworkError,
    DistProtocolError,
    DistStoreError,
    DistTimeoutError,
    DistUsageError,
    QueueEmptyError,
)
from ._base import Store, Value, check_lengths, check_world_size, encode_key, encode_value
from ._server import TCPStoreServer, resolve_token
from ._sockets import configure_stream, resolve_peer_timeout
from ._state import I64_MAX, I64_MIN, barrier_timeout_error, format_keys, timeout_error
from ._wire import (
    AIODIST_MAGIC,
    AUTH_MAC_SIZE,
    CLIENT_HELLO,
    DEFAULT_MAX_KEY_SIZE,
    DEFAULT_MAX_VALUE_SIZE,
    F64,
    FLAG_AUTH,
    FRAME_HEAD,
    I64,
    NONCE_SIZE,
    PROTOCOL_VERSION,
    SERVER_HELLO,
    TORCH_READY,
    TORCH_STOP_WAITING,
    TORCH_VALIDATE_MAGIC,
    TORCH_WAIT_CANCELED,
    U8,
    U32,
    U64,
    UPGRADE_NONCE,
    UPGRADE_REPLY,
    Incomplete,
    Op,
    Reader,
    Status,
    TorchOp,
    auth_mac,
    blob32,
    encode_frame,
    max_request_size,
    torch_request,
)

__all__ = ["TCPStore", "TCPStoreServer", "Wire"]

logger = logging.getLogger(__name__)

Wire = Literal["auto", "aiodist", "torch"]

#: The key every TCPStore adds 1 to when it is created with a world size (torch's name).
_JOIN_KEY = b"init/"
#: Replies from a server are trusted further than requests, but still bounded.
_MAX_REPLY_VALUE = 2**32
#: Extra time the client gives a server-timed wait before deciding the server is stuck.
_SERVER_GRACE = 10.0
_OK = int(Status.OK)
#: Request ids run 1..2**32-1: id 0 is what CANCEL frames carry.
_MAX_RID = 0xFFFFFFFF


class _TimedOut(Exception):
    """A wait ran out of time; the caller turns it into a message naming its own keys."""

    def __init__(self, missing: list[bytes], waited: float, count: int | None = None) -> None:
        self.missing = missing
        self.waited = waited
        # A barrier's timeout also reports the count its counter reached.
        self.count = count


def _lost(where: str, exc: BaseException | None) -> DistNetworkError:
    detail = f": {exc}" if exc is not None else " (the server closed it)"
    return DistNetworkError(f"lost the connection to the store at {where}{detail}")


class _Sink(abc.ABC):
    @abc.abstractmethod
    def feed(self, buf: bytes | bytearray) -> int:
        """Take the complete replies at the start of ``buf``; return the bytes used."""

    @abc.abstractmethod
    def lost(self, conn: _Conn) -> None: ...


class _Conn(asyncio.Protocol):
    """One TCP connection: plain reads during the handshake, then a sink parses replies."""

    def __init__(self, where: str, peer_timeout: float) -> None:
        self.where = where
        self.peer_timeout = peer_timeout
        # Looked up once: asyncio.get_running_loop() costs a getpid() call on Python 3.11.
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.sink: _Sink | None = None
        self.error: BaseException | None = None
        self.is_lost = False
        self.closed_here = False
        self._need = 0
        self._need_future: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)
        configure_stream(transport, self.peer_timeout)

    def data_received(self, data: bytes) -> None:
        sink = self.sink
        if sink is not None:
            if not self.buf:
                # The usual read holds whole replies: parse them in place, keep the rest.
                used = sink.feed(data)
                if used < len(data):
                    self.buf += data[used:]
                return
            self.buf += data
            used = sink.feed(self.buf)
            if used:
                del self.buf[:used]
            return
        self.buf += data
        if (
            self._need_future is not None
            and len(self.buf) >= self._need
            and not self._need_future.done()
        ):
            self._need_future.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_lost = True
        self.error = exc
        self.transport = None
        if self._need_future is not None and not self._need_future.done():
            self._need_future.set_result(None)
        if self.sink is not None:
            self.sink.lost(self)

    def lost_error(self) -> DistNetworkError:
        if self.closed_here:
            return DistNetworkError(f"the connection to the store at {self.where} was closed")
        return _lost(self.where, self.error)

    def write(self, data: bytes) -> None:
        if self.transport is None:
            raise self.lost_error()
        self.transport.write(data)

    async def read_exactly(self, n: int, timeout: float | None = None) -> bytes:
        async with asyncio.timeout(timeout):
            while len(self.buf) < n:
                if self.is_lost:
                    raise self.lost_error()
                self._need = n
                self._need_future = self.loop.create_future()
                try:
                    await self._need_future
                finally:
                    self._need_future = None
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    def close(self) -> None:
        self.closed_here = True
        if self.transport is not None:
            self.transport.close()


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _describe(exc: OSError) -> str:
    """An OS error as a reader wants it: its text, else its class and errno."""
    text = str(exc)
    if text:
        return text
    return f"{type(exc).__name__} (errno {exc.errno})" if exc.errno else type(exc).__name__


async def _connect(host: str, port: int, timeout: float | None, peer_timeout: float) -> _Conn:
    """Connect, retrying with jittered exponential backoff until ``timeout`` runs out.

    Raises:
        DistNetworkError: naming host:port, the time spent, the number of attempts and the
            last error the OS reported (or that the last attempt got no answer).
    """
    loop = asyncio.get_running_loop()
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    delay = 0.01
    attempts = 0
    last_error: OSError | None = None
    unanswered = False
    while True:
        conn = _Conn(f"{host}:{port}", peer_timeout)
        attempts += 1
        try:
            async with asyncio.timeout(_remaining(deadline)):
                await loop.create_connection(lambda c=conn: c, host, port)  # type: ignore[misc]
            return conn
        except TimeoutError:
            # Cut off by our deadline (TimeoutError is an OSError, with no text): the host
            # neither accepted nor refused in the time that was left.
            unanswered = True
        except OSError as exc:
            last_error, unanswered = exc, False
        left = _remaining(deadline)
        pause = random.uniform(delay / 2, delay)
        delay = min(delay * 2, 1.0)
        if left is not None and pause >= left:
            # No time for another real attempt: wait out the deadline, then report the
            # outcome of the last one that had time to run.
            await asyncio.sleep(left)
            left = 0.0
        if left is not None and left <= 0:
            tried = f"{attempts} attempt{'s' if attempts != 1 else ''} to connect to {host}:{port}"
            if unanswered:
                cause = "the last one got no answer before the deadline"
                if last_error is not None:
                    cause += f"; the error before it was: {_describe(last_error)}"
            elif last_error is not None:
                cause = f"the last error was: {_describe(last_error)}"
            else:
                cause = "no attempt got an answer"
            raise DistNetworkError(
                f"could not connect to the store at {host}:{port} within "
                f"{time.monotonic() - start:.1f} s ({tried}; {cause})"
            ) from last_error
        await asyncio.sleep(pause)


# -- channels: the raw-key operations of one wire ---------------------------------------------
class _Channel(abc.ABC):
    wire: str
    max_key_size: int
    max_value_size: int
    _conn: _Conn

    @property
    def peer_timeout(self) -> float:
        return self._conn.peer_timeout

    def local_address(self) -> str | None:
        transport = self._conn.transport
        sockname = transport.get_extra_info("sockname") if transport is not None else None
        return sockname[0] if isinstance(sockname, tuple) else None

    @property
    @abc.abstractmethod
    def pending(self) -> int: ...

    # Each returns an awaitable: a coroutine, or (for requests answered at once) the reply's
    # future itself, which spares two coroutine frames per request.
    @abc.abstractmethod
    def set(self, key: bytes, value: bytes) -> Awaitable[None]: ...
    @abc.abstractmethod
    def get(self, key: bytes, timeout: float | None) -> Awaitable[bytes]: ...
    @abc.abstractmethod
    def add(self, key: bytes, amount: int) -> Awaitable[int]: ...
    @abc.abstractmethod
    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> Awaitable[bytes]: ...
    @abc.abstractmethod
    def wait(self, keys: list[bytes], timeout: float | None) -> Awaitable[None]: ...
    @abc.abstractmethod
    def check(self, keys: list[bytes]) -> Awaitable[bool]: ...
    @abc.abstractmethod
    def delete(self, key: bytes) -> Awaitable[bool]: ...
    @abc.abstractmethod
    def num_keys(self) -> Awaitable[int]: ...
    @abc.abstractmethod
    def list_keys(self) -> Awaitable[list[bytes]]: ...
    @abc.abstractmethod
    def multi_get(self, keys: list[bytes], timeout: float | None) -> Awaitable[list[bytes]]: ...
    @abc.abstractmethod
    def multi_set(self, items: list[tuple[bytes, bytes]]) -> Awaitable[None]: ...
    @abc.abstractmethod
    def append(self, key: bytes, value: bytes) -> Awaitable[None]: ...
    @abc.abstractmethod
    def queue_push(self, key: bytes, value: bytes) -> Awaitable[None]: ...
    @abc.abstractmethod
    def queue_pop(self, key: bytes, block: bool, timeout: float | None) -> Awaitable[bytes]: ...
    @abc.abstractmethod
    def queue_len(self, key: bytes) -> Awaitable[int]: ...
    @abc.abstractmethod
    def barrier(self, key: bytes, world_size: int, timeout: float | None) -> Awaitable[None]: ...
    @abc.abstractmethod
    def lease(self, key: bytes, value: bytes) -> Awaitable[bool]: ...
    @abc.abstractmethod
    def close(self) -> None: ...


def _timeout_arg(timeout: float | None) -> bytes:
    return F64.pack(-1.0 if timeout is None else timeout)


def _keys_arg(keys: Sequence[bytes]) -> list[bytes]:
    return [U32.pack(len(keys)), *(blob32(k) for k in keys)]


def _read_blobs(payload: bytes) -> list[bytes]:
    reader = Reader(payload)
    return [reader.blob32(_MAX_REPLY_VALUE, "value") for _ in range(reader.u32())]


_Decoder = Callable[[bytes], Any]
#: body length, request id, opcode, key length: the head of an add request.
_ADD_HEAD = struct.Struct("<IIBI")
_SET, _ADD, _COMPARE_SET, _CHECK = int(Op.SET), int(Op.ADD), int(Op.COMPARE_SET), int(Op.CHECK)
_DELETE_KEY, _NUM_KEYS, _LIST_KEYS = int(Op.DELETE_KEY), int(Op.NUM_KEYS), int(Op.LIST_KEYS)
_MULTI_SET, _APPEND = int(Op.MULTI_SET), int(Op.APPEND)
_QUEUE_PUSH, _QUEUE_LEN = int(Op.QUEUE_PUSH), int(Op.QUEUE_LEN)


def _nothing(payload: bytes) -> None:
    return None


def _i64(payload: bytes) -> int:
    value: int = I64.unpack(payload)[0]
    return value


def _bytes(payload: bytes) -> bytes:
    return payload


def _flag(payload: bytes) -> bool:
    return payload == b"\x01"


class _AiodistChannel(_Channel, _Sink):
    """aiodist's protocol: request ids, out-of-order replies, server-side waits."""

    wire = "aiodist"

    def __init__(self, conn: _Conn, max_key_size: int, max_value_size: int) -> None:
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

    def lost(self, conn: _Conn) -> None:
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

    async def _call(self, op: Op, *parts: bytes, deadline: float | None = None) -> bytes:
        """A request that may wait on the server: on cancellation it is cancelled there too,
        and a server that stays silent past ``deadline`` plus a grace is reported."""
        future = self._submit(op, b"".join(parts), None)
        rid = self._next_rid
        conn = self._conn
        try:
            if deadline is None:
                status, payload = await future
            else:
                async with asyncio.timeout(deadline + _SERVER_GRACE):
                    status, payload = await future
        except BaseException as exc:
            # Cancelled or given up: tell the server to drop the request (and its waiter).
            if self._pending.pop(rid, None) is not None and not conn.is_lost:
                conn.write(encode_frame(0, Op.CANCEL, U32.pack(rid)))
            if isinstance(exc, TimeoutError):
                raise DistTimeoutError(
                    f"the store at {conn.where} did not answer a {op.name} request within "
                    f"{(deadline or 0.0) + _SERVER_GRACE:.1f} s"
                ) from None
            raise
        if status == _OK:
            result: bytes = payload
            return result
        raise self._error(status, payload)

    @staticmethod
    def _error(status: int, payload: bytes) -> Exception:
        if status == Status.TIMEOUT:
            reader = Reader(payload)
            waited = reader.f64()
            missing = [reader.blob32(_MAX_REPLY_VALUE, "key") for _ in range(reader.u32())]
            # A barrier's timeout ends with the count reached (-1: not an integer).
            count = reader.i64() if reader.end - reader.pos >= 8 else None
            return _TimedOut(missing, waited, None if count is None or count < 0 else count)
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
        return await self._call(
            Op.QUEUE_POP,
            _timeout_arg(timeout),
            U8.pack(block),
            blob32(key),
            deadline=timeout if block else None,
        )

    def queue_len(self, key: bytes) -> asyncio.Future[int]:
        return self._submit(_QUEUE_LEN, blob32(key), _i64)

    async def barrier(self, key: bytes, world_size: int, timeout: float | None) -> None:
        await self._call(
            Op.BARRIER, _timeout_arg(timeout), I64.pack(world_size), blob32(key), deadline=timeout
        )

    async def lease(self, key: bytes, value: bytes) -> bool:
        await self._call(Op.LEASE, blob32(key), blob32(value))
        return True

    def close(self) -> None:
        self._conn.close()


# torch-wire reply parsers: each reads one reply or raises Incomplete.
_Parser = Callable[[Reader], Any]


def _p_bytes(r: Reader) -> bytes:
    return r.blob64(_MAX_REPLY_VALUE, "value")


def _p_i64(r: Reader) -> int:
    return r.i64()


def _p_u8(r: Reader) -> int:
    return r.u8()


def _p_u32(r: Reader) -> int:
    return r.u32()


def _p_list(r: Reader) -> list[bytes]:
    return [_p_bytes(r) for _ in range(r.i64())]


def _p_queue_pop(r: Reader) -> bytes | None:
    return _p_bytes(r) if r.i64() > 0 else None


def _p_flag(r: Reader) -> bool:
    return r.i64() != 0


def _p_ready(r: Reader) -> bool:
    return r.u8() == TORCH_READY


#: opcode, u64 key length: the head of a torch-wire set or add.
_T_SET_HEAD = struct.Struct("<BQ")
_T_SET, _T_ADD = int(TorchOp.SET), int(TorchOp.ADD)


def _p_many(n: int) -> _Parser:
    return lambda r: [_p_bytes(r) for _ in range(n)]


async def _torch_validate(conn: _Conn, nonce: int, timeout: float | None) -> int:
    conn.write(
        U8.pack(TorchOp.VALIDATE)
        + U32.pack(TORCH_VALIDATE_MAGIC)
        + U8.pack(TorchOp.PING)
        + U32.pack(nonce)
    )
    reply: int = U32.unpack(await conn.read_exactly(4, timeout))[0]
    return reply


class _TorchChannel(_Channel, _Sink):
    """torch's wire: in-order replies on the main connection, waits on spare connections."""

    wire = "torch"

    def __init__(
        self, conn: _Conn, host: str, port: int, max_key_size: int, max_value_size: int
    ) -> None:
        self._conn = conn
        self._host = host
        self._port = port
        self.max_key_size = max_key_size
        self.max_value_size = max_value_size
        self._fifo: deque[tuple[asyncio.Future[Any], _Parser, bytes | None]] = deque()
        self._spare: list[_Conn] = []
        # torch's server closes the connection when an add finds a non-integer; the client
        # then reports that add as a store error and reconnects once for the next request.
        self._reopen = False
        self._waiting: set[_Conn] = set()
        conn.sink = self
        if conn.buf:
            del conn.buf[: self.feed(conn.buf)]

    @property
    def pending(self) -> int:
        return len(self._fifo) + len(self._waiting)

    def feed(self, buf: bytes | bytearray) -> int:
        pos = 0
        fifo = self._fifo
        while fifo and pos < len(buf):
            future, parser, _add_key = fifo[0]
            reader = Reader(buf, pos)
            try:
                value = parser(reader)
            except Incomplete:
                break
            except DistProtocolError as exc:
                logger.error("torch store %s sent a bad reply: %s", self._conn.where, exc)
                self._conn.close()
                break
            fifo.popleft()
            pos = reader.pos
            if not future.done():
                future.set_result(value)
        return pos

    def lost(self, conn: _Conn) -> None:
        fifo, self._fifo = self._fifo, deque()
        for i, (future, _parser, add_key) in enumerate(fifo):
            if future.done():
                continue
            if i == 0 and add_key is not None and conn.error is None and not conn.closed_here:
                self._reopen = True
                future.set_exception(
                    DistStoreError(
                        f"add on key {format_keys([add_key[1:]])} failed: the torch store "
                        "server closed the connection, as it does when the add fails (a "
                        "value that is not an integer, or a sum past 64 bits)"
                    )
                )
            else:
                future.set_exception(conn.lost_error())

    async def _main(self) -> _Conn:
        conn = self._conn
        if conn.is_lost:
            if not self._reopen:
                raise conn.lost_error()
            self._reopen = False
            conn = await _connect(self._host, self._port, _SERVER_GRACE, conn.peer_timeout)
            if await _torch_validate(conn, os.getpid(), _SERVER_GRACE) != os.getpid():
                conn.close()
                raise DistProtocolError(f"torch store {conn.where} failed the PING check")
            self._conn = conn
            conn.sink = self
        return conn

    async def _call(self, request: bytes, parser: _Parser, add_key: bytes | None = None) -> Any:
        conn = await self._main()
        future: asyncio.Future[Any] = conn.loop.create_future()
        self._fifo.append((future, parser, add_key))
        conn.write(request)
        # A cancelled caller leaves its entry in the queue: the reply still arrives in order.
        return await future

    def _request(
        self, request: bytes, parser: _Parser, add_key: bytes | None = None
    ) -> Awaitable[Any]:
        """Send a request that is answered at once; the reply's future, or (to reconnect
        after the server dropped a failed add) a coroutine."""
        conn = self._conn
        if conn.is_lost:
            return self._call(request, parser, add_key)
        future: asyncio.Future[Any] = conn.loop.create_future()
        self._fifo.append((future, parser, add_key))
        conn.write(request)
        return future

    async def _send(self, request: bytes) -> None:
        (await self._main()).write(request)

    def _post(self, request: bytes) -> Awaitable[None]:
        # Requests with no reply (set, append, ...): torch's wire acknowledges nothing.
        conn = self._conn
        if conn.is_lost:
            return self._send(request)
        conn.write(request)
        done: asyncio.Future[None] = conn.loop.create_future()
        done.set_result(None)
        return done

    def set(self, key: bytes, value: bytes) -> Awaitable[None]:
        return self._post(_T_SET_HEAD.pack(_T_SET, len(key)) + key + U64.pack(len(value)) + value)

    async def get(self, key: bytes, timeout: float | None) -> bytes:
        await self.wait([key], timeout)
        value: bytes = await self._request(torch_request(TorchOp.GET, key), _p_bytes)
        return value

    def add(self, key: bytes, amount: int) -> Awaitable[int]:
        request = _T_SET_HEAD.pack(_T_ADD, len(key)) + key + I64.pack(amount)
        return self._request(request, _p_i64, key)

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> Awaitable[bytes]:
        request = torch_request(TorchOp.COMPARE_SET, key, expected, desired)
        return self._request(request, _p_bytes)

    def check(self, keys: list[bytes]) -> Awaitable[bool]:
        return self._request(torch_request(TorchOp.CHECK, keys), _p_ready)

    async def wait(self, keys: list[bytes], timeout: float | None) -> None:
        # Ask on the main connection first: it is ordered after this client's own writes.
        if await self.check(keys):
            return
        start = time.monotonic()
        if await self._wait_on_spare(torch_request(TorchOp.WAIT, keys), timeout, start):
            return
        missing = [k for k in keys if not await self.check([k])]
        if missing:
            raise _TimedOut(missing, time.monotonic() - start)
        # The keys arrived while the cancel was on its way.

    async def lease(self, key: bytes, value: bytes) -> bool:
        return False  # torch's server has no leases

    async def barrier(self, key: bytes, world_size: int, timeout: float | None) -> None:
        start = time.monotonic()
        request = torch_request(TorchOp.BARRIER, key, world_size)
        try:
            if await self._wait_on_spare(request, timeout, start):
                return
        except DistNetworkError:
            # A torch server drops the connection when the counter is not an integer.
            if await self._counter(key) is None and not self._conn.is_lost:
                value = await self._call(torch_request(TorchOp.GET, key), _p_bytes)
                raise DistStoreError(
                    f"barrier on key {format_keys([key[1:]])}: its value {value[:64]!r} is "
                    "not an integer"
                ) from None
            raise
        count = await self._counter(key)
        if count is None or count < world_size:
            raise _TimedOut([key], time.monotonic() - start, count)

    async def _counter(self, key: bytes) -> int | None:
        value: bytes = await self._call(torch_request(TorchOp.GET, key), _p_bytes)
        try:
            return int(value)
        except ValueError:
            return None

    async def _wait_on_spare(self, request: bytes, timeout: float | None, start: float) -> bool:
        """Send a waiting request on a spare connection; return whether it was answered.

        On timeout the wait is cancelled (CANCEL_WAIT) and False returned; the connection
        goes back to the spares when it is left in a known state.
        """
        conn = await self._spare_conn(timeout)
        self._waiting.add(conn)
        reusable = False
        try:
            conn.write(request)
            try:
                reply = await conn.read_exactly(1, _remaining_from(start, timeout))
            except TimeoutError:
                await self._cancel_wait(conn)
                reusable = True
                return False
            if reply[0] != TORCH_STOP_WAITING:
                raise DistProtocolError(f"torch store answered a wait with {reply!r}")
            reusable = True
            return True
        finally:
            self._waiting.discard(conn)
            if reusable and not conn.is_lost:
                self._spare.append(conn)
            else:
                conn.close()

    @staticmethod
    async def _cancel_wait(conn: _Conn) -> None:
        conn.write(torch_request(TorchOp.CANCEL_WAIT))
        reply = await conn.read_exactly(1, _SERVER_GRACE)
        if reply[0] == TORCH_STOP_WAITING:
            # The wake raced the cancel: the cancel's own answer follows.
            reply = await conn.read_exactly(1, _SERVER_GRACE)
        if reply[0] != TORCH_WAIT_CANCELED:
            raise DistProtocolError(f"torch store answered CANCEL_WAIT with {reply!r}")

    async def _spare_conn(self, timeout: float | None) -> _Conn:
        while self._spare:
            conn = self._spare.pop()
            if not conn.is_lost:
                return conn
        conn = await _connect(self._host, self._port, timeout, self._conn.peer_timeout)
        try:
            if await _torch_validate(conn, os.getpid(), timeout) != os.getpid():
                raise DistProtocolError(f"torch store {conn.where} failed the PING check")
        except BaseException:
            conn.close()
            raise
        return conn

    def delete(self, key: bytes) -> Awaitable[bool]:
        return self._request(torch_request(TorchOp.DELETE_KEY, key), _p_flag)

    def num_keys(self) -> Awaitable[int]:
        return self._request(torch_request(TorchOp.GETNUMKEYS), _p_i64)

    def list_keys(self) -> Awaitable[list[bytes]]:
        return self._request(torch_request(TorchOp.LIST_KEYS), _p_list)

    async def multi_get(self, keys: list[bytes], timeout: float | None) -> list[bytes]:
        await self.wait(keys, timeout)
        request = torch_request(TorchOp.MULTI_GET, keys)
        value: list[bytes] = await self._call(request, _p_many(len(keys)))
        return value

    def multi_set(self, items: list[tuple[bytes, bytes]]) -> Awaitable[None]:
        flat = [b for item in items for b in item]
        # torch's layout: count of pairs, then key, value, key, value...
        parts = [U8.pack(TorchOp.MULTI_SET), I64.pack(len(items))]
        parts += [I64.pack(len(b)) + b for b in flat]
        return self._post(b"".join(parts))

    def append(self, key: bytes, value: bytes) -> Awaitable[None]:
        return self._post(torch_request(TorchOp.APPEND, key, value))

    def queue_push(self, key: bytes, value: bytes) -> Awaitable[None]:
        return self._post(torch_request(TorchOp.QUEUE_PUSH, key, value))

    async def queue_pop(self, key: bytes, block: bool, timeout: float | None) -> bytes:
        start = time.monotonic()
        while True:
            if block:
                await self.wait([key], _remaining_from(start, timeout))
            value = await self._call(torch_request(TorchOp.QUEUE_POP, key), _p_queue_pop)
            if value is not None:
                assert isinstance(value, bytes)
                return value
            if not block:
                raise QueueEmptyError(f"queue {format_keys([key[1:]])} is empty")

    def queue_len(self, key: bytes) -> Awaitable[int]:
        return self._request(torch_request(TorchOp.QUEUE_LEN, key), _p_i64)

    def close(self) -> None:
        self._conn.close()
        for conn in (*self._spare, *self._waiting):
            conn.close()
        self._spare.clear()


def _remaining_from(start: float, timeout: float | None) -> float | None:
    return None if timeout is None else max(0.0, timeout - (time.monotonic() - start))


async def _handshake_aiodist(
    conn: _Conn, token: bytes | None, timeout: float | None
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


async def _open_channel(
    host: str,
    port: int,
    wire: str,
    token: bytes | None,
    timeout: float | None,
    max_key_size: int,
    max_value_size: int,
    peer_timeout: float,
) -> _Channel:
    start = time.monotonic()
    conn = await _connect(host, port, timeout, peer_timeout)
    left = _remaining_from(start, timeout)
    try:
        if wire == "auto":
            reply = await _torch_validate(conn, UPGRADE_NONCE, left)
            if reply == UPGRADE_NONCE:
                wire = "torch"
                if token is not None:
                    logger.warning(
                        "store at %s:%d is a torch TCPStore server: the auth token is not used",
                        host,
                        port,
                    )
            elif reply == UPGRADE_REPLY:
                wire = "aiodist"
            else:
                raise DistProtocolError(
                    f"{host}:{port} answered the store probe with {reply:#x}: "
                    "it is not a store server"
                )
        elif wire == "torch" and await _torch_validate(conn, os.getpid(), left) != os.getpid():
            raise DistProtocolError(f"torch store {host}:{port} failed the PING check")
        if wire == "torch":
            return _TorchChannel(conn, host, port, max_key_size, max_value_size)
        server_key, server_value = await _handshake_aiodist(conn, token, left)
        return _AiodistChannel(
            conn, min(max_key_size, server_key), min(max_value_size, server_value)
        )
    except TimeoutError:
        conn.close()
        raise DistNetworkError(
            f"the store at {host}:{port} did not answer the {wire} handshake within "
            f"{time.monotonic() - start:.1f} s"
        ) from None
    except BaseException:
        conn.close()
        raise


class TCPStore(Store):
    """A store served over TCP, shared by processes on any host that can reach it.

    Create it with :meth:`create`. The master (``is_master=True``) runs a
    :class:`TCPStoreServer` on the current event loop; every instance, master included, is a
    client of it. The server accepts unmodified ``torch.distributed.TCPStore`` clients on the
    same port, and the client can use a torch TCPStore server (``wire="torch"``, or detected
    with ``wire="auto"``).

    Attributes:
        host: the host name the store was created with.
        port: the server's port (the one picked when created with port 0).
        wire: the protocol in use, ``"aiodist"`` or ``"torch"``.
        server: the server this instance hosts, or ``None``.
    """

    def __init__(
        self,
        channel: _Channel,
        host: str = "",
        port: int = 0,
        timeout: Timeout = None,
        *,
        server: TCPStoreServer | None = None,
        token: bytes | None = None,
    ) -> None:
        if not isinstance(channel, _Channel):
            raise DistUsageError(
                "make a TCPStore with `await aiodist.TCPStore.create(host_name, port, ...)` "
                "(aiodist.sync.TCPStore is the blocking form with torch's constructor)"
            )
        super().__init__(timeout)
        self._channel = channel
        self.host = host
        self.port = port
        self.server = server
        self._token = token
        self._closed = False

    @property
    def wire(self) -> str:
        """The protocol this client speaks with its server: ``"aiodist"`` or ``"torch"``."""
        return self._channel.wire

    def local_address(self) -> str | None:
        """The local end of this client's connection: the address that reaches the server."""
        return self._channel.local_address()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"pending={self._channel.pending}"
        return (
            f"<TCPStore {self.host}:{self.port} wire={self.wire} "
            f"master={self.server is not None} timeout={self.timeout} {state}>"
        )

    @classmethod
    async def create(
        cls,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: Timeout = None,
        wait_for_workers: bool = True,
        *,
        auth_token: str | bytes | None = None,
        wire: Wire = "auto",
        max_key_size: int = DEFAULT_MAX_KEY_SIZE,
        max_value_size: int = DEFAULT_MAX_VALUE_SIZE,
        allow_unauthenticated_torch: bool = False,
        peer_timeout: float | None = None,
    ) -> TCPStore:
        """Connect to (and, as master, first start) the store at ``host_name:port``.

        Args:
            host_name: the server's address; the master listens on exactly this address.
            port: the server's port; the master may pass 0 to pick a free one.
            world_size: the number of store instances of the job. Each one adds itself to
                torch's ``init/`` counter; the master waits for all of them when
                ``wait_for_workers``. ``None``: no join handshake.
            is_master: start the server here.
            timeout: seconds (or ``timedelta``) for connecting, joining, ``get`` and
                ``wait``; default 300 s.
            wait_for_workers: the master waits for ``world_size`` instances to join.
            auth_token: shared secret (HMAC-SHA256 challenge-response); ``None`` reads
                ``$AIODIST_AUTH_TOKEN``. The master's server then refuses clients without it.
            wire: ``"aiodist"``, ``"torch"`` (a torch TCPStore server) or ``"auto"``.
            max_key_size: the largest key in bytes (the server's limit, for the master).
            max_value_size: the largest value in bytes (the server's limit, for the master).
            allow_unauthenticated_torch: with a token, still let torch clients in.
            peer_timeout: seconds after which a connection whose peer's host went silent
                (no FIN, no RST) is dropped: pending requests then fail with
                ``DistNetworkError``, and the master's server releases that client's waits.
                ``None`` reads ``$AIODIST_PEER_TIMEOUT``, else 8 s. A busy or stopped
                process is not affected (its kernel keeps answering).

        Raises:
            DistUsageError: bad arguments (world_size 0, unknown wire, bad limits), or the
                master's open-file limit is too low for ``world_size`` clients.
            DistNetworkError: the port is in use (master), or the server cannot be reached
                within the timeout (the message names host:port and the time).
            DistTimeoutError: the master's workers did not all join in time ("k/n joined").
            DistStoreError: authentication was refused.
            DistProtocolError: the server speaks another protocol version.
        """
        if wire not in ("auto", "aiodist", "torch"):
            raise DistUsageError(f"wire must be 'auto', 'aiodist' or 'torch', got {wire!r}")
        if world_size is not None and (
            isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1
        ):
            raise DistUsageError(f"TCPStore world_size must be a positive int, got {world_size!r}")
        seconds = to_seconds(timeout, DEFAULT_STORE_TIMEOUT)
        token = resolve_token(auth_token)
        peer = resolve_peer_timeout(peer_timeout)
        server = None
        connect_host = host_name
        if is_master:
            server = TCPStoreServer(
                auth_token=token,
                allow_unauthenticated_torch=allow_unauthenticated_torch,
                max_key_size=max_key_size,
                max_value_size=max_value_size,
                peer_timeout=peer,
                expected_clients=world_size,
            )
            await server.start(host_name, port)
            port = server.port
            if server.host in ("0.0.0.0", "::"):
                connect_host = "127.0.0.1" if server.host == "0.0.0.0" else "::1"
        channel: _Channel | None = None
        try:
            channel = await _open_channel(
                connect_host, port, wire, token, seconds, max_key_size, max_value_size, peer
            )
            store = cls(channel, host_name, port, seconds, server=server, token=token)
            if world_size is not None:
                await channel.add(_JOIN_KEY, 1)
                if server is not None and wait_for_workers:
                    await server.wait_for_count(_JOIN_KEY, world_size, seconds)
        except BaseException:
            if channel is not None:
                channel.close()
            if server is not None:
                await server.aclose()
            raise
        return store

    # -- helpers -------------------------------------------------------------------------
    def _key(self, key: str) -> bytes:
        raw = b"/" + (key.encode() if type(key) is str else encode_key(key))
        if len(raw) > self._channel.max_key_size:
            raise DistUsageError(
                f"key of {len(raw)} bytes exceeds the store's max_key_size of "
                f"{self._channel.max_key_size} bytes"
            )
        return raw

    def _value(self, value: Value) -> bytes:
        data = encode_value(value)
        if len(data) > self._channel.max_value_size:
            raise DistUsageError(
                f"value of {len(data)} bytes exceeds the store's max_value_size of "
                f"{self._channel.max_value_size} bytes"
            )
        return data

    def _check_open(self) -> None:
        if self._closed:
            raise DistUsageError(f"{self!r} is closed")

    @staticmethod
    def _timed_out(keys: list[bytes], exc: _TimedOut) -> DistTimeoutError:
        return timeout_error(
            [k[1:] for k in keys], [k[1:] if k[:1] == b"/" else k for k in exc.missing], exc.waited
        )

    # -- the Store interface ---------------------------------------------------------------
    async def set(self, key: str, value: Value) -> None:
        """Store ``value`` under ``key`` and wake its waiters.

        Raises:
            DistUsageError: the key or value is too large, or the store is closed.
            DistNetworkError: the server went away.
        """
        self._check_open()
        await self._channel.set(self._key(key), self._value(value))

    async def get(self, key: str) -> bytes:
        """Return the value of ``key``, waiting up to the store timeout for it.

        Raises:
            DistTimeoutError: the key did not appear in time (the message names it).
            DistNetworkError: the server went away.
        """
        self._check_open()
        raw = self._key(key)
        try:
            return await self._channel.get(raw, self.timeout)
        except _TimedOut as exc:
            raise self._timed_out([raw], exc) from None

    async def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the ASCII counter ``key`` (missing: 0) and return the result.

        Raises:
            DistStoreError: the key holds something that is not an integer (unchanged).
            DistUsageError: ``amount`` is not a 64-bit integer.
            DistNetworkError: the server went away.
        """
        if self._closed:
            self._check_open()
        if type(amount) is not int:
            if isinstance(amount, bool) or not isinstance(amount, int):
                raise DistUsageError(f"add amount must be an int, got {type(amount).__name__}")
            amount = int(amount)
        if not I64_MIN <= amount <= I64_MAX:
            raise DistUsageError(f"add amount {amount} does not fit in 64 bits")
        return await self._channel.add(self._key(key), amount)

    async def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        """torch's compare-and-set; see :meth:`Store.compare_set`.

        Raises:
            DistUsageError: a value is too large.
            DistNetworkError: the server went away.
        """
        self._check_open()
        return await self._channel.compare_set(
            self._key(key), self._value(expected), self._value(desired)
        )

    async def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        """Wait until every key exists (``timeout`` defaults to the store timeout).

        Raises:
            DistTimeoutError: naming the keys still missing and the time waited.
            DistNetworkError: the server went away.
        """
        self._check_open()
        seconds = to_seconds(timeout, self.timeout)
        raw = [self._key(k) for k in keys]
        if not raw:
            return
        try:
            await self._channel.wait(raw, seconds)
        except _TimedOut as exc:
            raise self._timed_out(raw, exc) from None

    async def check(self, keys: Sequence[str]) -> bool:
        """Return whether every key exists, without waiting.

        Raises:
            DistNetworkError: the server went away.
        """
        self._check_open()
        raw = [self._key(k) for k in keys]
        return True if not raw else await self._channel.check(raw)

    async def delete_key(self, key: str) -> bool:
        """Delete ``key``; return whether it existed.

        Raises:
            DistNetworkError: the server went away.
        """
        self._check_open()
        return await self._channel.delete(self._key(key))

    async def num_keys(self) -> int:
        """Return the number of keys on the server (torch's ``init/`` counter included).

        Raises:
            DistNetworkError: the server went away.
        """
        self._check_open()
        return await self._channel.num_keys()

    async def list_keys(self) -> list[str]:
        """Return the user keys (those set through a TCPStore client), as torch does.

        Raises:
            DistNetworkError: the server went away.
        """
        self._check_open()
        raw = await self._channel.list_keys()
        return [k[1:].decode(errors="surrogateescape") for k in raw if k[:1] == b"/"]

    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Return the values of ``keys``, waiting for all of them like :meth:`get`.

        Raises:
            DistTimeoutError: a key did not appear in time.
            DistNetworkError: the server went away.
        """
        self._check_open()
        raw = [self._key(k) for k in keys]
        if not raw:
            return []
        try:
            return await self._channel.multi_get(raw, self.timeout)
        except _TimedOut as exc:
            raise self._timed_out(raw, exc) from None

    async def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        """Set every key to its value in one request.

        Raises:
            DistUsageError: the sequences differ in length, or an entry is too large.
            DistNetworkError: the server went away.
        """
        self._check_open()
        check_lengths(keys, values)
        items = [(self._key(k), self._value(v)) for k, v in zip(keys, values, strict=True)]
        if items:
            await self._channel.multi_set(items)

    async def append(self, key: str, value: Value) -> None:
        """Append ``value`` to ``key``, creating it if missing.

        Raises:
            DistUsageError: the value (or, on aiodist's wire, the result) is too large.
            DistNetworkError: the server went away.
        """
        self._check_open()
        await self._channel.append(self._key(key), self._value(value))

    async def lease(self, key: str, value: Value | None) -> bool:
        """Have the server set ``key`` to ``value`` when this client's connection ends.

        See :meth:`Store.lease`. On torch's wire (a torch server) there are no leases.

        Raises:
            DistNetworkError: the server went away.
        """
        self._check_open()
        return await self._channel.lease(
            self._key(key), b"" if value is None else self._value(value)
        )

    async def queue_push(self, key: str, value: Value) -> None:
        """Push ``value`` onto the FIFO queue ``key``.

        Raises:
            DistUsageError: the value is too large.
            DistNetworkError: the server went away.
        """
        self._check_open()
        await self._channel.queue_push(self._key(key), self._value(value))

    async def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Pop the oldest value of queue ``key``.

        Raises:
            QueueEmptyError: ``block`` is false and the queue is empty.
            DistTimeoutError: ``block`` is true and nothing arrived within the store timeout.
            DistNetworkError: the server went away.
        """
        self._check_open()
        raw = self._key(key)
        try:
            return await self._channel.queue_pop(raw, block, self.timeout)
        except _TimedOut as exc:
            raise self._timed_out([raw], exc) from None

    async def queue_len(self, key: str) -> int:
        """Return the number of values in queue ``key``.

        Raises:
            DistNetworkError: the server went away.
        """
        self._check_open()
        return await self._channel.queue_len(self._key(key))

    async def barrier(self, key: str, world_size: int, timeout: Timeout = None) -> None:
        """Count in at ``key`` and wait until ``world_size`` callers have (torch's barrier).

        One request: the server counts and answers every caller when the last one arrives.
        The counter is the one :meth:`add` uses on ``key``, shared with torch clients'
        ``barrier``.

        Raises:
            DistUsageError: ``world_size`` is not a positive int, or the store is closed.
            DistStoreError: ``key`` holds something that is not an integer.
            DistTimeoutError: fewer than ``world_size`` arrived in time (the message names
                the key and the count reached); this caller stays counted in.
            DistNetworkError: the server went away.
        """
        self._check_open()
        world = check_world_size(world_size)
        seconds = to_seconds(timeout, self.timeout)
        raw = self._key(key)
        try:
            await self._channel.barrier(raw, world, seconds)
        except _TimedOut as exc:
            raise barrier_timeout_error(raw[1:], exc.count, world, exc.waited) from None

    async def clone(self) -> TCPStore:
        """Open a new connection to the same server, with this store's settings.

        Raises:
            DistNetworkError: the server cannot be reached.
        """
        self._check_open()
        channel = self._channel
        host = self.host
        if self.server is not None and self.server.host in ("0.0.0.0", "::"):
            host = "127.0.0.1" if self.server.host == "0.0.0.0" else "::1"
        new = await _open_channel(
            host,
            self.port,
            channel.wire,
            self._token,
            self.timeout,
            channel.max_key_size,
            channel.max_value_size,
            channel.peer_timeout,
        )
        return TCPStore(new, self.host, self.port, self.timeout, token=self._token)

    async def aclose(self) -> None:
        """Close the connection; the master also stops its server. Closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        self._channel.close()
        if self.server is not None:
            await self.server.aclose()
