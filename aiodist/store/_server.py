"""The TCPStore server: one asyncio server speaking aiodist's protocol and torch's on one port.

Every connection starts in a detection state: a first byte of 0 is torch's VALIDATE, the four
bytes ``AIOS`` open the aiodist protocol, anything else is garbage and the connection is
closed. The store itself is a :class:`KeyValueState`, so the server holds no store semantics
of its own: it parses, calls the state, and encodes replies. Requests that must wait (a get of
a missing key, a wait, a blocking queue pop, a torch barrier) become waiters on the state,
woken by the write that satisfies them; nothing ever blocks the loop for one client.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Coroutine, Sequence
from types import TracebackType
from typing import Any, Self, cast

from .._auth import resolve_token
from ..errors import (
    DistNetworkError,
    DistProtocolError,
    DistStoreError,
    DistTimeoutError,
    DistUsageError,
)
from ._state import KeyValueState, format_keys
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
    TORCH_NOT_READY,
    TORCH_READY,
    TORCH_STOP_WAITING,
    TORCH_VALIDATE_MAGIC,
    TORCH_WAIT_CANCELED,
    U8,
    U32,
    UPGRADE_NONCE,
    UPGRADE_REPLY,
    Incomplete,
    Op,
    Reader,
    Status,
    TorchOp,
    auth_mac,
    blob32,
    blob64,
    encode_frame,
    max_request_size,
    parse_torch_request,
)

__all__ = ["TCPStoreServer", "enable_keepalive", "resolve_token"]

logger = logging.getLogger(__name__)

#: Read no more than this per connection before answering what was read (bounds the bytes
#: a single fast client can make the loop chew through in one turn).
_HIGH_WATER = 4 * 1024 * 1024

_DETECT, _TORCH, _HELLO, _AUTH, _FRAMES, _CLOSED = range(6)


def enable_keepalive(transport: asyncio.BaseTransport) -> None:
    """Probe an idle store connection so a peer whose host vanished is noticed in ~1 min.

    Such a peer sends neither FIN nor RST; without probes a waiting client (or the server's
    waiters for a dead client) would sit there for hours.
    """
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 30)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 6)
    except OSError as exc:
        logger.debug("could not enable TCP keepalive: %s", exc)


class _Close(Exception):
    """Drop this connection (garbage, protocol violation, refused client)."""


class _WaitTimedOut(Exception):
    def __init__(self, missing: list[bytes], waited: float) -> None:
        self.missing = missing
        self.waited = waited


def _display(key: bytes) -> str:
    """A key as its user knows it: clients send user keys as "/" + key."""
    return format_keys([key[1:] if key[:1] == b"/" else key])


def _timeout_arg(seconds: float) -> float | None:
    return None if seconds < 0 else seconds


def _read_timeout(r: Reader) -> float:
    """A request's timeout in seconds: negative (or infinite) waits without limit.

    Raises:
        DistProtocolError: the timeout is NaN (as a timer deadline it would break the
            ordering of every other client's timers on the loop).
    """
    seconds = r.f64()
    if math.isnan(seconds):
        raise DistProtocolError("the request's timeout is NaN")
    return -1.0 if math.isinf(seconds) else seconds


class _Connection(asyncio.Protocol):
    """One client connection, in whichever protocol it turns out to speak."""

    def __init__(self, server: TCPStoreServer) -> None:
        self._server = server
        self._state = server.state
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._mode = _DETECT
        self._out: list[bytes] = []
        self._peer = "?"
        # aiodist protocol: requests waiting on the state, by request id.
        self._tasks: dict[int, asyncio.Task[list[bytes]]] = {}
        self._discard = 0
        self._nonce = b""
        self._client_nonce = b""
        # torch protocol: the one outstanding WAIT/BARRIER of this connection.
        self._torch_wait: asyncio.Future[None] | None = None
        self._torch_wait_notified = False
        self._torch_requests = 0

    # -- asyncio callbacks ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self._transport = cast(asyncio.Transport, transport)
        enable_keepalive(transport)
        peer = transport.get_extra_info("peername")
        self._peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self._server._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._mode = _CLOSED
        self._server._connections.discard(self)
        # Whatever this client was waiting for is abandoned: unregister it from the state.
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()
        if self._torch_wait is not None:
            self._torch_wait.cancel()
            self._torch_wait = None
        self._transport = None

    def pause_writing(self) -> None:
        # The client is not reading its replies: stop reading its requests until it does.
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        if self._transport is not None:
            self._transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self._mode == _CLOSED:
            return
        if self._discard:
            skip = min(self._discard, len(data))
            self._discard -= skip
            data = data[skip:]
            if not data:
                return
        # The usual read holds whole requests: parse it in place and buffer only leftovers.
        buf: bytes | bytearray
        if self._buf:
            self._buf += data
            buf = self._buf
        else:
            buf = data
        try:
            pos = self._process(buf)
        except _Close as exc:
            logger.warning("store server: closing connection from %s: %s", self._peer, exc)
            self._flush()
            self._shutdown()
            return
        except Exception:
            logger.exception("store server: internal error serving %s; closing it", self._peer)
            self._abort()
            return
        if buf is data:
            if pos < len(data):
                self._buf += data[pos:]
        elif pos:
            del self._buf[:pos]
        self._flush()

    # -- plumbing ------------------------------------------------------------------------
    def _flush(self) -> None:
        if self._out and self._transport is not None:
            out = self._out
            self._out = []
            self._transport.write(out[0] if len(out) == 1 else b"".join(out))

    def _send(self, data: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def _shutdown(self) -> None:
        # Close after the last reply (an auth verdict, a hello) is out, unless the client is
        # not reading: then drop it.
        self._mode = _CLOSED
        transport = self._transport
        if transport is not None:
            if transport.get_write_buffer_size():
                transport.abort()
            else:
                transport.close()

    def _abort(self) -> None:
        self._mode = _CLOSED
        if self._transport is not None:
            self._transport.abort()

    def _process(self, buf: bytes | bytearray) -> int:
        """Handle every complete request in ``buf``; return how many bytes were used."""
        pos = 0
        size = len(buf)
        try:
            while pos < size and self._mode != _CLOSED:
                mode = self._mode
                if mode == _FRAMES:
                    pos = self._frame(buf, pos, size)
                elif mode == _TORCH:
                    pos = self._torch(buf, pos)
                elif mode == _DETECT:
                    pos = self._detect(buf, pos)
                elif mode == _HELLO:
                    pos = self._hello(buf, pos)
                elif mode == _AUTH:
                    pos = self._auth(buf, pos)
                if self._discard:
                    # An oversized frame: drop what is buffered of it, skip the rest later.
                    drop = min(self._discard, size - pos)
                    pos += drop
                    self._discard -= drop
        except Incomplete:
            pass
        if size - pos > _HIGH_WATER + self._server._max_request:
            raise _Close(f"{size - pos} bytes buffered without a complete request")
        return pos

    def _detect(self, buf: bytes | bytearray, pos: int) -> int:
        if buf[pos] == 0:
            self._mode = _TORCH
            return pos
        if len(buf) - pos < len(AIODIST_MAGIC):
            if not AIODIST_MAGIC.startswith(bytes(buf[pos:])):
                raise _Close(f"not a store protocol (first bytes {bytes(buf[pos : pos + 8])!r})")
            raise Incomplete
        if buf[pos : pos + len(AIODIST_MAGIC)] != AIODIST_MAGIC:
            raise _Close(f"not a store protocol (first bytes {bytes(buf[pos : pos + 8])!r})")
        self._mode = _HELLO
        return pos

    # -- aiodist protocol ----------------------------------------------------------------
    def _hello(self, buf: bytes | bytearray, pos: int) -> int:
        if len(buf) - pos < CLIENT_HELLO.size:
            raise Incomplete
        _magic, version, client_nonce = CLIENT_HELLO.unpack_from(buf, pos)
        server = self._server
        self._nonce = os.urandom(NONCE_SIZE)
        self._client_nonce = client_nonce
        flags = FLAG_AUTH if server._token is not None else 0
        self._out.append(
            SERVER_HELLO.pack(
                AIODIST_MAGIC,
                PROTOCOL_VERSION,
                flags,
                server.max_key_size,
                server.max_value_size,
                self._nonce,
            )
        )
        if version != PROTOCOL_VERSION:
            # The client learns our version from the hello and raises the clear error.
            raise _Close(
                f"client speaks aiodist store protocol version {version}, "
                f"this server speaks {PROTOCOL_VERSION}"
            )
        self._mode = _AUTH if flags else _FRAMES
        return pos + CLIENT_HELLO.size

    def _auth(self, buf: bytes | bytearray, pos: int) -> int:
        if len(buf) - pos < AUTH_MAC_SIZE:
            raise Incomplete
        token = self._server._token
        assert token is not None
        got = bytes(buf[pos : pos + AUTH_MAC_SIZE])
        want = auth_mac(token, b"store/client", self._nonce, self._client_nonce)
        if not hmac.compare_digest(got, want):
            self._out.append(U8.pack(1))
            raise _Close("authentication failed (wrong auth token)")
        self._out.append(
            U8.pack(0) + auth_mac(token, b"store/server", self._client_nonce, self._nonce)
        )
        self._mode = _FRAMES
        return pos + AUTH_MAC_SIZE

    def _frame(self, buf: bytes | bytearray, pos: int, size: int) -> int:
        if size - pos < FRAME_HEAD.size:
            if size - pos >= 4 and U32.unpack_from(buf, pos)[0] < 5:
                raise _Close("malformed frame (body shorter than its header)")
            raise Incomplete
        length, rid, op = FRAME_HEAD.unpack_from(buf, pos)
        server = self._server
        limit = server._max_request
        if length > limit:
            # Answer at once and skip the body without buffering it: the connection stays
            # usable, and a huge length costs the server nothing.
            self._out.append(
                encode_frame(
                    rid,
                    Status.USAGE_ERROR,
                    f"request of {length} bytes exceeds the server's limit of {limit} bytes "
                    f"(max_key_size={server.max_key_size}, "
                    f"max_value_size={server.max_value_size})".encode(),
                )
            )
            self._discard = length - 5
            return pos + FRAME_HEAD.size
        if length < 5:
            raise _Close(f"malformed frame (body length {length})")
        end: int = pos + 4 + length
        if end > size:
            raise Incomplete
        reader = Reader(buf, pos + FRAME_HEAD.size, end)
        try:
            self._request(rid, op, reader)
        except Incomplete:
            raise _Close(f"truncated request (opcode {op})") from None
        except DistProtocolError as exc:
            self._out.append(encode_frame(rid, Status.USAGE_ERROR, str(exc).encode()))
        except DistStoreError as exc:
            self._out.append(encode_frame(rid, Status.STORE_ERROR, str(exc).encode()))
        except DistUsageError as exc:
            self._out.append(encode_frame(rid, Status.USAGE_ERROR, str(exc).encode()))
        return end

    def _reply(self, rid: int, *parts: bytes) -> None:
        self._out.append(encode_frame(rid, Status.OK, *parts))

    def _request(self, rid: int, op: int, r: Reader) -> None:
        handler = _AIODIST_HANDLERS.get(op)
        if handler is None:
            raise _Close(f"unknown aiodist store opcode {op}")
        handler(self, rid, r)

    def _op_set(self, rid: int, r: Reader) -> None:
        mk, mv = self._server.max_key_size, self._server.max_value_size
        self._state.set(r.blob32(mk, "key"), r.blob32(mv, "value"))
        self._reply(rid)

    def _op_get(self, rid: int, r: Reader) -> None:
        timeout = _read_timeout(r)
        key = r.blob32(self._server.max_key_size, "key")
        value = self._state.get(key)
        if value is not None:
            self._reply(rid, value)
        else:
            self._spawn(rid, self._get([key], timeout, single=True))

    def _op_add(self, rid: int, r: Reader) -> None:
        key = r.blob32(self._server.max_key_size, "key")
        amount = r.i64()
        try:
            total = self._state.add(key, amount)
        except DistStoreError:
            old = self._state.get(key) or b""
            raise DistStoreError(
                f"add on key {_display(key)}: its value {old[:64]!r} is not an integer"
            ) from None
        self._reply(rid, I64.pack(total))

    def _op_compare_set(self, rid: int, r: Reader) -> None:
        mk, mv = self._server.max_key_size, self._server.max_value_size
        key = r.blob32(mk, "key")
        expected = r.blob32(mv, "value")
        self._reply(rid, self._state.compare_set(key, expected, r.blob32(mv, "value")))

    def _op_wait(self, rid: int, r: Reader) -> None:
        timeout = _read_timeout(r)
        keys = self._keys(r)
        if self._state.check(keys):
            self._reply(rid)
        else:
            self._spawn(rid, self._wait(keys, timeout))

    def _op_check(self, rid: int, r: Reader) -> None:
        self._reply(rid, U8.pack(self._state.check(self._keys(r))))

    def _op_delete_key(self, rid: int, r: Reader) -> None:
        key = r.blob32(self._server.max_key_size, "key")
        self._reply(rid, U8.pack(self._state.delete(key)))

    def _op_num_keys(self, rid: int, r: Reader) -> None:
        self._reply(rid, I64.pack(self._state.num_keys()))

    def _op_list_keys(self, rid: int, r: Reader) -> None:
        self._reply(rid, *self._blobs(self._state.list_keys()))

    def _op_multi_get(self, rid: int, r: Reader) -> None:
        state = self._state
        timeout = _read_timeout(r)
        keys = self._keys(r)
        if state.check(keys):
            self._reply(rid, *self._blobs([state.get(k) or b"" for k in keys]))
        else:
            self._spawn(rid, self._get(keys, timeout, single=False))

    def _op_multi_set(self, rid: int, r: Reader) -> None:
        mk, mv = self._server.max_key_size, self._server.max_value_size
        n = r.u32()
        # Parse everything before writing anything: a bad entry leaves the store untouched.
        items = [(r.blob32(mk, "key"), r.blob32(mv, "value")) for _ in range(n)]
        for key, value in items:
            self._state.set(key, value)
        self._reply(rid)

    def _op_append(self, rid: int, r: Reader) -> None:
        mk, mv = self._server.max_key_size, self._server.max_value_size
        key = r.blob32(mk, "key")
        value = r.blob32(mv, "value")
        size = len(self._state.get(key) or b"") + len(value)
        if size > mv:
            raise DistUsageError(
                f"append would make key {_display(key)} {size} bytes long, "
                f"past the server's max_value_size of {mv} bytes"
            )
        self._state.append(key, value)
        self._reply(rid)

    def _op_queue_push(self, rid: int, r: Reader) -> None:
        mk, mv = self._server.max_key_size, self._server.max_value_size
        self._state.queue_push(r.blob32(mk, "key"), r.blob32(mv, "value"))
        self._reply(rid)

    def _op_queue_pop(self, rid: int, r: Reader) -> None:
        timeout = _read_timeout(r)
        block = r.u8()
        key = r.blob32(self._server.max_key_size, "key")
        value = self._state.queue_pop(key)
        if value is not None:
            self._reply(rid, value)
        elif not block:
            message = f"queue {_display(key)} is empty".encode()
            self._out.append(encode_frame(rid, Status.QUEUE_EMPTY, message))
        else:
            self._spawn(rid, self._queue_pop(key, timeout))

    def _op_queue_len(self, rid: int, r: Reader) -> None:
        key = r.blob32(self._server.max_key_size, "key")
        self._reply(rid, I64.pack(self._state.queue_len(key)))

    def _op_cancel(self, rid: int, r: Reader) -> None:
        task = self._tasks.pop(r.u32(), None)
        if task is not None:
            task.cancel()

    def _op_ping(self, rid: int, r: Reader) -> None:
        self._reply(rid)

    def _keys(self, r: Reader) -> list[bytes]:
        mk = self._server.max_key_size
        return [r.blob32(mk, "key") for _ in range(r.u32())]

    @staticmethod
    def _blobs(values: Sequence[bytes]) -> list[bytes]:
        return [U32.pack(len(values)), *(blob32(v) for v in values)]

    def _spawn(self, rid: int, coro: Coroutine[Any, Any, list[bytes]]) -> None:
        if rid in self._tasks:
            # A second waiting request under one id would orphan the first one's task and
            # waiter, which the disconnection could then no longer cancel.
            coro.close()
            raise DistProtocolError(f"request id {rid} is already used by a waiting request")
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks[rid] = task
        task.add_done_callback(functools.partial(self._waited, rid))

    def _waited(self, rid: int, task: asyncio.Task[list[bytes]]) -> None:
        if self._tasks.get(rid) is task:
            del self._tasks[rid]
        if task.cancelled():
            return  # cancelled by the client or by its disconnection: nobody to answer
        exc = task.exception()
        if exc is None:
            self._send(encode_frame(rid, Status.OK, *task.result()))
        elif isinstance(exc, _WaitTimedOut):
            payload = [F64.pack(exc.waited), *self._blobs(exc.missing)]
            self._send(encode_frame(rid, Status.TIMEOUT, *payload))
        else:
            logger.error("store server: request %d from %s failed", rid, self._peer, exc_info=exc)
            self._send(encode_frame(rid, Status.STORE_ERROR, f"server error: {exc}".encode()))

    async def _wait_keys(self, keys: list[bytes], timeout: float) -> None:
        state = self._state
        future = state.watch(keys)
        if future.done():
            return
        start = time.monotonic()
        try:
            async with asyncio.timeout(_timeout_arg(timeout)):
                await future
        except TimeoutError:
            missing = [k for k in keys if not state.exists(k)]
            raise _WaitTimedOut(missing, time.monotonic() - start) from None

    async def _wait(self, keys: list[bytes], timeout: float) -> list[bytes]:
        await self._wait_keys(keys, timeout)
        return []

    async def _get(self, keys: list[bytes], timeout: float, *, single: bool) -> list[bytes]:
        await self._wait_keys(keys, timeout)
        values = [self._state.get(k) or b"" for k in keys]
        return values if single else self._blobs(values)

    async def _queue_pop(self, key: bytes, timeout: float) -> list[bytes]:
        deadline = None if timeout < 0 else time.monotonic() + timeout
        start = time.monotonic()
        while True:
            value = self._state.queue_pop(key)
            if value is not None:
                return [value]
            left = -1.0 if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                await self._wait_keys([key], left)
            except _WaitTimedOut:
                raise _WaitTimedOut([key], time.monotonic() - start) from None

    # -- torch protocol ------------------------------------------------------------------
    def _torch(self, buf: bytes | bytearray, pos: int) -> int:
        server = self._server
        reader = Reader(buf, pos)
        try:
            op, args = parse_torch_request(reader, server.max_key_size, server.max_value_size)
        except DistProtocolError as exc:
            raise _Close(f"torch protocol: {exc}") from None
        first = self._torch_requests == 0
        self._torch_requests += 1
        if first:
            if op != TorchOp.VALIDATE or args[0] != TORCH_VALIDATE_MAGIC:
                raise _Close("torch protocol: the first request is not VALIDATE")
            return reader.pos
        if self._torch_requests == 2 and op == TorchOp.PING and args[0] == UPGRADE_NONCE:
            # An aiodist client probing which server this is: switch it to our protocol.
            self._out.append(U32.pack(UPGRADE_REPLY))
            self._mode = _DETECT
            return reader.pos
        if server._token is not None and not server.allow_unauthenticated_torch:
            raise _Close(
                "refusing a torch-protocol client: this server requires an auth token "
                "(start it with allow_unauthenticated_torch=True to admit torch clients)"
            )
        try:
            self._torch_request(op, args)
        except DistStoreError as exc:
            # torch's server drops the connection on a failed request (it has no error reply).
            raise _Close(f"torch protocol: {exc}") from None
        return reader.pos

    def _torch_request(self, op: int, args: tuple[Any, ...]) -> None:
        handler = _TORCH_HANDLERS.get(op)
        if handler is None:  # VALIDATE again
            raise _Close(f"torch protocol: unexpected opcode {TorchOp(op).name}")
        handler(self, *args)

    def _t_set(self, key: bytes, value: bytes) -> None:
        self._state.set(key, value)

    def _t_get(self, key: bytes) -> None:
        self._out.append(blob64(self._state.get(key) or b""))

    def _t_add(self, key: bytes, amount: int) -> None:
        self._out.append(I64.pack(self._state.add(key, amount)))

    def _t_compare_set(self, key: bytes, expected: bytes, desired: bytes) -> None:
        self._out.append(blob64(self._state.compare_set(key, expected, desired)))

    def _t_check(self, keys: list[bytes]) -> None:
        ready = self._state.check(keys)
        self._out.append(U8.pack(TORCH_READY if ready else TORCH_NOT_READY))

    def _t_wait(self, keys: list[bytes]) -> None:
        self._torch_watch(self._state.watch(keys))

    def _t_num_keys(self) -> None:
        self._out.append(I64.pack(self._state.num_keys()))

    def _t_delete_key(self, key: bytes) -> None:
        self._out.append(I64.pack(int(self._state.delete(key))))

    def _t_append(self, key: bytes, value: bytes) -> None:
        self._state.append(key, value)

    def _t_multi_get(self, keys: list[bytes]) -> None:
        self._out.extend(blob64(self._state.get(k) or b"") for k in keys)

    def _t_multi_set(self, items: list[bytes]) -> None:
        for i in range(0, len(items), 2):
            self._state.set(items[i], items[i + 1])

    def _t_ping(self, nonce: int) -> None:
        self._out.append(U32.pack(nonce))

    def _t_queue_push(self, key: bytes, value: bytes) -> None:
        self._state.queue_push(key, value)

    def _t_queue_pop(self, key: bytes) -> None:
        length = self._state.queue_len(key)
        self._out.append(I64.pack(length))
        if length:
            self._out.append(blob64(self._state.queue_pop(key) or b""))

    def _t_queue_len(self, key: bytes) -> None:
        self._out.append(I64.pack(self._state.queue_len(key)))

    def _t_list_keys(self) -> None:
        listed = self._state.list_keys()
        self._out.append(I64.pack(len(listed)))
        self._out.extend(blob64(k) for k in listed)

    def _t_barrier(self, counter: bytes, world: int) -> None:
        self._state.add(counter, 1)
        loop = asyncio.get_running_loop()
        self._torch_watch(loop.create_task(self._torch_barrier(counter, world)))

    async def _torch_barrier(self, key: bytes, world: int) -> None:
        state = self._state
        while int(state.get(key) or b"0") < world:
            await state.watch_change(key)

    def _torch_watch(self, future: asyncio.Future[None]) -> None:
        # torch allows one outstanding wait per connection; a new one replaces the old.
        if self._torch_wait is not None:
            self._torch_wait.cancel()
        self._torch_wait = future
        self._torch_wait_notified = False
        if future.done():
            self._torch_stop_waiting(future)
        else:
            future.add_done_callback(self._torch_stop_waiting)

    def _torch_stop_waiting(self, future: asyncio.Future[None]) -> None:
        if future is not self._torch_wait or future.cancelled() or self._torch_wait_notified:
            return
        self._torch_wait_notified = True
        self._torch_wait = None
        reply = U8.pack(TORCH_STOP_WAITING)
        if self._transport is not None and self._mode == _TORCH and not self._out:
            self._send(reply)
        else:
            self._out.append(reply)

    def _torch_cancel_wait(self) -> None:
        wait = self._torch_wait
        if wait is not None and wait.done() and not wait.cancelled():
            # Satisfied, but its STOP_WAITING is still queued: send it first, as torch does.
            self._torch_stop_waiting(wait)
        elif wait is not None:
            wait.cancel()
        self._torch_wait = None
        self._out.append(U8.pack(TORCH_WAIT_CANCELED))


_AiodistHandler = Callable[[_Connection, int, Reader], None]
#: aiodist opcode -> handler; a dict rather than an if-chain keeps dispatch O(1) (comparing
#: against enum members costs ~70 ns each on CPython 3.11).
_AIODIST_HANDLERS: dict[int, _AiodistHandler] = {
    Op.SET: _Connection._op_set,
    Op.GET: _Connection._op_get,
    Op.ADD: _Connection._op_add,
    Op.COMPARE_SET: _Connection._op_compare_set,
    Op.WAIT: _Connection._op_wait,
    Op.CHECK: _Connection._op_check,
    Op.DELETE_KEY: _Connection._op_delete_key,
    Op.NUM_KEYS: _Connection._op_num_keys,
    Op.LIST_KEYS: _Connection._op_list_keys,
    Op.MULTI_GET: _Connection._op_multi_get,
    Op.MULTI_SET: _Connection._op_multi_set,
    Op.APPEND: _Connection._op_append,
    Op.QUEUE_PUSH: _Connection._op_queue_push,
    Op.QUEUE_POP: _Connection._op_queue_pop,
    Op.QUEUE_LEN: _Connection._op_queue_len,
    Op.CANCEL: _Connection._op_cancel,
    Op.PING: _Connection._op_ping,
}

#: torch opcode -> handler, called with the parsed arguments.
_TORCH_HANDLERS: dict[int, Callable[..., None]] = {
    TorchOp.SET: _Connection._t_set,
    TorchOp.COMPARE_SET: _Connection._t_compare_set,
    TorchOp.GET: _Connection._t_get,
    TorchOp.ADD: _Connection._t_add,
    TorchOp.CHECK: _Connection._t_check,
    TorchOp.WAIT: _Connection._t_wait,
    TorchOp.GETNUMKEYS: _Connection._t_num_keys,
    TorchOp.DELETE_KEY: _Connection._t_delete_key,
    TorchOp.APPEND: _Connection._t_append,
    TorchOp.MULTI_GET: _Connection._t_multi_get,
    TorchOp.MULTI_SET: _Connection._t_multi_set,
    TorchOp.CANCEL_WAIT: _Connection._torch_cancel_wait,
    TorchOp.PING: _Connection._t_ping,
    TorchOp.QUEUE_PUSH: _Connection._t_queue_push,
    TorchOp.QUEUE_POP: _Connection._t_queue_pop,
    TorchOp.QUEUE_LEN: _Connection._t_queue_len,
    TorchOp.LIST_KEYS: _Connection._t_list_keys,
    TorchOp.BARRIER: _Connection._t_barrier,
}


class TCPStoreServer:
    """A store server on the current event loop, usable without any client of its own.

    It speaks aiodist's protocol and torch's TCPStore wire on the same port, so unmodified
    ``torch.distributed.TCPStore`` clients can share keys with aiodist clients (a launcher
    hosts one for its workers this way).

    Args:
        auth_token: shared secret that aiodist clients must prove they hold (HMAC-SHA256
            challenge-response). ``None`` reads ``$AIODIST_AUTH_TOKEN``; unset means no auth.
        allow_unauthenticated_torch: with a token set, still admit torch-protocol clients
            (which cannot authenticate). Refused by default.
        max_key_size: the largest key, in bytes, a client may send.
        max_value_size: the largest value, in bytes (also bounds a value grown by ``append``).
        state: the key/value state to serve (a fresh one by default).

    Raises:
        DistUsageError: a limit is not a positive integer or the token is empty.
    """

    def __init__(
        self,
        *,
        auth_token: str | bytes | None = None,
        allow_unauthenticated_torch: bool = False,
        max_key_size: int = DEFAULT_MAX_KEY_SIZE,
        max_value_size: int = DEFAULT_MAX_VALUE_SIZE,
        state: KeyValueState | None = None,
    ) -> None:
        for name, value, cap in (
            ("max_key_size", max_key_size, 2**32 - 1),
            ("max_value_size", max_value_size, 2**32 - 2**20),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= cap:
                raise DistUsageError(f"{name} must be an integer in 1..{cap}, got {value!r}")
        self._token = resolve_token(auth_token)
        self.allow_unauthenticated_torch = allow_unauthenticated_torch
        self.max_key_size = max_key_size
        self.max_value_size = max_value_size
        self._max_request = max_request_size(max_key_size, max_value_size)
        self.state = state if state is not None else KeyValueState()
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self._host = ""
        self._port = 0

    def __repr__(self) -> str:
        where = f"{self._host}:{self._port}" if self._server is not None else "not started"
        return (
            f"<TCPStoreServer {where} clients={len(self._connections)} "
            f"keys={self.state.num_keys()} waiters={self.state.waiter_count} "
            f"auth={'on' if self._token is not None else 'off'}>"
        )

    @property
    def host(self) -> str:
        """The address the server listens on."""
        return self._host

    @property
    def port(self) -> int:
        """The port the server listens on (the one picked, when started with port 0)."""
        return self._port

    @property
    def num_clients(self) -> int:
        """The number of connected clients."""
        return len(self._connections)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> Self:
        """Listen on exactly ``host`` (not every interface) and ``port`` (0 picks a free one).

        Pass ``"0.0.0.0"`` or ``"::"`` to listen on every interface.

        Raises:
            DistUsageError: already started, or the port is out of range.
            DistNetworkError: the address cannot be resolved or the port is in use.
        """
        if self._server is not None:
            raise DistUsageError(f"{self!r} is already started")
        if not 0 <= port <= 65535:
            raise DistUsageError(f"port must be in 0..65535, got {port}")
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
        except OSError as exc:
            raise DistNetworkError(f"store server cannot resolve host {host!r}: {exc}") from exc
        # Bind exactly one address: with "localhost" resolving to 127.0.0.1 and ::1, port 0
        # would otherwise give two sockets on two different ports.
        infos.sort(key=lambda info: info[0] != socket.AF_INET)
        family, _type, proto, _canon, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(min(socket.SOMAXCONN, 65535))
            sock.setblocking(False)
            self._server = await loop.create_server(lambda: _Connection(self), sock=sock)
        except OSError as exc:
            sock.close()
            raise DistNetworkError(
                f"store server cannot listen on {host}:{port}: {exc.strerror or exc}"
                + (" (the port is in use)" if exc.errno == 98 else "")
            ) from exc
        bound = sock.getsockname()
        self._host, self._port = str(bound[0]), int(bound[1])
        logger.debug("store server listening on %s:%d", self._host, self._port)
        return self

    async def wait_for_count(self, key: bytes, target: int, timeout: float | None) -> int:
        """Wait until the ASCII counter ``key`` reaches ``target``; return its value.

        Raises:
            DistTimeoutError: the counter stayed below ``target`` for ``timeout`` seconds.
        """
        state = self.state
        start = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                while (count := int(state.get(key) or b"0")) < target:
                    await state.watch_change(key)
        except TimeoutError:
            count = int(state.get(key) or b"0")
            raise DistTimeoutError(
                f"timed out after {time.monotonic() - start:.1f} s waiting for clients to "
                f"join the store at {self._host}:{self._port}: {count}/{target} clients joined"
            ) from None
        return count

    async def aclose(self) -> None:
        """Stop listening and drop every connection (their clients see the store go away)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for conn in list(self._connections):
            conn._abort()
        await server.wait_closed()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
