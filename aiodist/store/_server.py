"""The TCPStore server: one asyncio server speaking aiodist's protocol and torch's on one port.

Every connection starts in a detection state: a first byte of 0 is torch's VALIDATE, the four
bytes ``AIOS`` open the aiodist protocol, anything else is garbage and the connection is
closed. The store itself is a :class:`KeyValueState`, so the server holds no store semantics
of its own: it parses, calls the state, and encodes replies. Requests that must wait (a get of
a missing key, a wait, a blocking queue pop, a barrier) park a future of the state with a
timer, woken by the write that satisfies them; nothing ever blocks the loop for one client,
and a parked request costs a future and a timer, not a task.

The common requests (aiodist ``set``/``get``/``add``, torch ``set``/``get``/``add``/``check``)
take a fast path that parses them straight out of the bytes the loop handed over; everything
else, and anything unusual about those (a split frame, an error), goes through the general
parser. Replies to one read leave in one write.

A client that does not read its replies cannot make the server hold more than the
transport's high-water mark plus one read's replies: when the transport asks to pause
writing, the connection stops reading requests and holds replies to its woken waits until
the client drains what was sent.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import math
import os
import socket
import stat
import struct
import time
from collections.abc import Callable, Sequence
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
from ._sockets import configure_socket, ensure_open_files, resolve_peer_timeout
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
    blob64,
    encode_frame,
    max_request_size,
    parse_torch_request,
)

__all__ = ["TCPStoreServer", "resolve_token"]

logger = logging.getLogger(__name__)

#: Read no more than this per connection before answering what was read (bounds the bytes
#: a single fast client can make the loop chew through in one turn).
_HIGH_WATER = 4 * 1024 * 1024
#: Replies to one read are written once this many bytes are waiting, so that a client which
#: does not read is paused after this much, not after a whole read's worth of large values.
_FLUSH_BYTES = 256 * 1024
#: Requests one connection may have waiting at once (each holds a future and a timer).
MAX_WAITING_PER_CONNECTION = 16384

#: The listen backlog asked for; the kernel caps it at net.core.somaxconn.
_BACKLOG = 65535

_DETECT, _TORCH, _TORCH_READY, _HELLO, _AUTH, _FRAMES, _CLOSED = range(7)

# Opcodes as plain ints: comparing against enum members costs ~70 ns each on CPython 3.11.
_OP_SET, _OP_GET, _OP_ADD = int(Op.SET), int(Op.GET), int(Op.ADD)
_T_SET, _T_GET, _T_ADD, _T_CHECK = (
    int(TorchOp.SET),
    int(TorchOp.GET),
    int(TorchOp.ADD),
    int(TorchOp.CHECK),
)
_T_QUEUE_LEN, _T_LIST_KEYS = int(TorchOp.QUEUE_LEN), int(TorchOp.LIST_KEYS)
_OK = int(Status.OK)
#: body length, request id, status, i64 (an ``add`` reply in one pack).
_OK_I64 = struct.Struct("<IIBq")
#: body length, request id, opcode, and a first u32 (the key's length, in set and add).
_HEAD_KEY = struct.Struct("<IIBI")
_TORCH_READY_BYTE = U8.pack(TORCH_READY)
_TORCH_NOT_READY_BYTE = U8.pack(TORCH_NOT_READY)

#: What a torch client in the server's own process is told, through the log, about the two
#: calls that cannot be served to it (see ``_Connection._torch_same_process``).
_SAME_PROCESS_HAZARD = (
    "torch's TCPStore.queue_len() and list_keys() keep the GIL while they wait for the "
    "reply, and this server, running in the same process, needs the GIL to send it"
)


class _Close(Exception):
    """Drop this connection (garbage, protocol violation, refused client)."""


def _display(key: bytes) -> str:
    """A key as its user knows it: clients send user keys as "/" + key."""
    return format_keys([key[1:] if key[:1] == b"/" else key])


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


def _blobs(values: Sequence[bytes]) -> list[bytes]:
    return [U32.pack(len(values)), *(blob32(v) for v in values)]


_INET = (socket.AF_INET, socket.AF_INET6)


def _endpoint(address: tuple[Any, ...]) -> tuple[str, int]:
    """(host, port) of a socket address, IPv4-mapped IPv6 written as IPv4 (torch's client
    connects to an IPv4 server from an IPv6 socket)."""
    host = str(address[0])
    return (host[7:] if host.startswith("::ffff:") else host), int(address[1])


def _own_socket(local: tuple[Any, ...], remote: tuple[Any, ...]) -> int | None:
    """The descriptor, in this process, of the TCP socket bound to ``local`` and connected to
    ``remote``, or ``None`` when no such socket is open here."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return None
    local, remote = _endpoint(local), _endpoint(remote)
    for name in names:
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            with socket.socket(fileno=os.dup(fd)) as sock:
                if sock.type != socket.SOCK_STREAM or sock.family not in _INET:
                    continue  # Unix sockets (a subprocess's stdio, say) have str addresses
                if (
                    _endpoint(sock.getsockname()) == local
                    and _endpoint(sock.getpeername()) == remote
                ):
                    return fd
        except OSError:
            continue
    return None


class _Parked:
    """A request waiting on the state: its future, timer and how to answer it.

    Called when its future is done (it is the future's callback: no closure to allocate).
    """

    __slots__ = ("conn", "finish", "future", "keys", "rid", "start", "timeout", "timer", "world")

    def __init__(
        self,
        conn: _Connection,
        rid: int,
        future: asyncio.Future[None],
        keys: list[bytes],
        finish: Callable[[], list[bytes] | None],
        start: float,
        timeout: float,
        world: int,
    ) -> None:
        self.conn = conn
        self.rid = rid
        self.future = future
        self.keys = keys
        self.finish = finish
        self.start = start
        self.timeout = timeout
        self.world = world
        self.timer: asyncio.TimerHandle | None = None

    def __call__(self, future: asyncio.Future[None]) -> None:
        self.conn._woken(self.rid, self, future)


class _Connection(asyncio.Protocol):
    """One client connection, in whichever protocol it turns out to speak."""

    __slots__ = (
        "_buf",
        "_client_nonce",
        "_deferred",
        "_discard",
        "_leases",
        "_loop",
        "_max_key",
        "_max_value",
        "_mode",
        "_nonce",
        "_out",
        "_out_bytes",
        "_parked",
        "_paused",
        "_peer",
        "_same_process",
        "_server",
        "_state",
        "_torch_requests",
        "_torch_wait",
        "_torch_wait_notified",
        "_transport",
    )

    def __init__(self, server: TCPStoreServer) -> None:
        self._server = server
        self._state = server.state
        self._max_key = server.max_key_size
        self._max_value = server.max_value_size
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._mode = _DETECT
        self._out: list[bytes] = []
        self._out_bytes = 0
        self._peer = ""
        # The transport asked to pause writing: the client is not reading its replies.
        self._paused = False
        # aiodist protocol: requests waiting on the state, by request id, and those whose
        # wait is over but whose reply waits for the client to read (while paused).
        self._parked: dict[int, _Parked] = {}
        # Keys to set when this connection ends (leases), with their values.
        self._leases: dict[bytes, bytes] = {}
        self._deferred: list[tuple[int, _Parked]] = []
        self._discard = 0
        self._nonce = b""
        self._client_nonce = b""
        # torch protocol: the one outstanding WAIT/BARRIER of this connection.
        self._torch_wait: asyncio.Future[None] | None = None
        self._torch_wait_notified = False
        self._torch_requests = 0
        self._same_process = False

    # -- asyncio callbacks ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        # Socket options (keepalive, user timeout, no delay) come from the listening socket.
        self._transport = cast(asyncio.Transport, transport)
        self._server._connections.add(self)

    @property
    def peer(self) -> str:
        """The client's address, for messages (looked up once, when first needed)."""
        if not self._peer and self._transport is not None:
            try:
                peer = self._transport.get_extra_info("peername")
            except OSError:  # the socket is already gone
                peer = None
            if isinstance(peer, tuple):
                self._peer = f"{peer[0]}:{peer[1]}"
        return self._peer or "?"

    def connection_lost(self, exc: Exception | None) -> None:
        self._mode = _CLOSED
        self._server._connections.discard(self)
        if exc is not None:
            logger.info("store server: lost the connection from %s: %s", self.peer, exc)
        # A client that goes away without withdrawing its leases (its process died, or its
        # host can no longer be reached) has them carried out: the first setter wins.
        for key, value in self._leases.items():
            self._state.compare_set(key, b"", value)
        self._leases.clear()
        # Whatever this client was waiting for is abandoned: unregister it from the state.
        for parked in self._parked.values():
            self._drop(parked)
        self._parked.clear()
        self._deferred.clear()
        if self._torch_wait is not None:
            self._torch_wait.cancel()
            self._torch_wait = None
        self._transport = None

    def pause_writing(self) -> None:
        # The client is not reading its replies: stop reading its requests until it does.
        self._paused = True
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._paused = False
        deferred, self._deferred = self._deferred, []
        for i, (rid, parked) in enumerate(deferred):
            if self._paused:  # an answer filled the transport again: the rest waits
                self._deferred = deferred[i:] + self._deferred
                return
            if self._parked.get(rid) is parked:
                self._answer(rid, parked)
        if self._buf and self._mode != _CLOSED and not self._paused:
            self._serve(b"")
        if self._transport is not None and not self._paused and self._mode != _CLOSED:
            self._transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        mode = self._mode
        if not self._buf and not self._discard and not self._paused:
            # The usual read holds whole requests of the common kinds: answer them straight
            # from ``data``; anything else goes on to the general parser.
            if mode == _FRAMES:
                n = len(data)
                if n >= 21:
                    # The most common read of all, one add: no loop, no list.
                    length, rid, op, klen = _HEAD_KEY.unpack_from(data)
                    if op == _OP_ADD and length + 4 == n == klen + 21 and klen <= self._max_key:
                        try:
                            total = self._state.add(
                                data[13 : n - 8], I64.unpack_from(data, n - 8)[0]
                            )
                        except DistStoreError:
                            pass  # the general parser reports it
                        else:
                            transport = self._transport
                            assert transport is not None
                            transport.write(_OK_I64.pack(13, rid, _OK, total))
                            return
                pos = self._fast_frames(data)
            elif mode == _TORCH_READY:
                n = len(data)
                if n >= 17 and data[0] == _T_ADD:
                    (klen,) = U64.unpack_from(data, 1)
                    if klen + 17 == n and klen <= self._max_key:
                        try:
                            total = self._state.add(
                                data[9 : n - 8], I64.unpack_from(data, n - 8)[0]
                            )
                        except DistStoreError:
                            pass  # the general parser drops the connection, as torch's does
                        else:
                            transport = self._transport
                            assert transport is not None
                            transport.write(I64.pack(total))
                            return
                pos = self._fast_torch(data)
            else:
                pos = 0
            if pos == len(data):
                out = self._out
                if out:  # _flush(), inlined on the hottest path
                    self._out = []
                    self._out_bytes = 0
                    transport = self._transport
                    assert transport is not None
                    transport.write(out[0] if len(out) == 1 else b"".join(out))
                return
            if pos:
                data = data[pos:]
        self._serve(data)

    # -- plumbing ------------------------------------------------------------------------
    def _serve(self, data: bytes) -> None:
        """Run the general parser over the buffered bytes and ``data``."""
        if self._mode == _CLOSED:
            return
        if self._discard:
            skip = min(self._discard, len(data))
            self._discard -= skip
            data = data[skip:]
            if not data and not self._buf:
                return
        buf: bytes | bytearray
        if self._buf:
            self._buf += data
            buf = self._buf
        else:
            buf = data
        try:
            pos = self._process(buf)
        except _Close as exc:
            logger.warning("store server: closing connection from %s: %s", self.peer, exc)
            self._flush()
            self._shutdown()
            return
        except Exception:
            logger.exception("store server: internal error serving %s; closing it", self.peer)
            self._abort()
            return
        if buf is data:
            if pos < len(data):
                self._buf += data[pos:]
        elif pos:
            del self._buf[:pos]
        self._flush()

    def _flush(self) -> None:
        if self._out and self._transport is not None:
            out = self._out
            self._out = []
            self._out_bytes = 0
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
                if self._paused:
                    break  # the rest waits in the buffer until the client reads
                mode = self._mode
                if mode == _FRAMES:
                    pos = self._frame(buf, pos, size)
                elif mode in (_TORCH, _TORCH_READY):
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
                if self._out_bytes > _FLUSH_BYTES:
                    self._flush()  # may pause writing, which stops this loop
        except Incomplete:
            pass
        if size - pos > _HIGH_WATER + self._server._max_request and not self._paused:
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

    # -- aiodist protocol: fast path -----------------------------------------------------
    def _fast_frames(self, data: bytes) -> int:
        """Answer the whole set/add/get frames at the start of ``data``; return bytes used.

        It stops at the first frame that is anything else or anything unusual (split,
        over a limit, failing, a get that must wait): the general parser takes it from there
        and produces the error, if any.
        """
        state = self._state
        out = self._out
        max_key = self._max_key
        unpack_head = FRAME_HEAD.unpack_from
        unpack_u32 = U32.unpack_from
        size = len(data)
        pos = 0
        out_bytes = 0
        while size - pos >= 13 and out_bytes < _FLUSH_BYTES:
            length, rid, op = unpack_head(data, pos)
            end = pos + 4 + length
            if end > size:
                break
            if op == _OP_ADD:
                (klen,) = unpack_u32(data, pos + 9)
                kend = pos + 13 + klen
                if klen > max_key or kend + 8 != end:
                    break
                try:
                    total = state.add(data[pos + 13 : kend], I64.unpack_from(data, kend)[0])
                except DistStoreError:
                    break
                out.append(_OK_I64.pack(13, rid, _OK, total))
            elif op == _OP_SET:
                (klen,) = unpack_u32(data, pos + 9)
                kend = pos + 13 + klen
                if klen > max_key or kend + 4 > end:
                    break
                (vlen,) = unpack_u32(data, kend)
                if vlen > self._max_value or kend + 4 + vlen != end:
                    break
                state.set(data[pos + 13 : kend], data[kend + 4 : end])
                out.append(FRAME_HEAD.pack(5, rid, _OK))
            elif op == _OP_GET:
                if length < 17:
                    break
                (klen,) = unpack_u32(data, pos + 17)
                if klen > max_key or pos + 21 + klen != end:
                    break
                value = state.get(data[pos + 21 : end])
                if value is None:
                    break
                out.append(FRAME_HEAD.pack(5 + len(value), rid, _OK) + value)
                out_bytes += len(value)
            else:
                break
            pos = end
        self._out_bytes += out_bytes
        return pos

    # -- aiodist protocol: handshake and general path -----------------------------------
    def _hello(self, buf: bytes | bytearray, pos: int) -> int:
        if len(buf) - pos < CLIENT_HELLO.size:
            raise Incomplete
        _magic, version, client_nonce = CLIENT_HELLO.unpack_from(buf, pos)
        server = self._server
        flags = FLAG_AUTH if server._token is not None else 0
        # The nonce only matters to the auth exchange: spare the system call without it.
        self._nonce = os.urandom(NONCE_SIZE) if flags else bytes(NONCE_SIZE)
        self._client_nonce = client_nonce
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
            self._error(
                rid,
                Status.USAGE_ERROR,
                f"request of {length} bytes exceeds the server's limit of {limit} bytes "
                f"(max_key_size={server.max_key_size}, "
                f"max_value_size={server.max_value_size})",
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
            self._error(rid, Status.USAGE_ERROR, str(exc))
        except DistStoreError as exc:
            self._error(rid, Status.STORE_ERROR, str(exc))
        except DistUsageError as exc:
            self._error(rid, Status.USAGE_ERROR, str(exc))
        return end

    def _error(self, rid: int, status: Status, message: str) -> None:
        self._out.append(encode_frame(rid, status, message.encode()))

    def _reply(self, rid: int, *parts: bytes) -> None:
        frame = encode_frame(rid, Status.OK, *parts)
        self._out_bytes += len(frame)
        self._out.append(frame)

    def _request(self, rid: int, op: int, r: Reader) -> None:
        handler = _AIODIST_HANDLERS.get(op)
        if handler is None:
            raise _Close(f"unknown aiodist store opcode {op}")
        handler(self, rid, r)

    def _op_set(self, rid: int, r: Reader) -> None:
        self._state.set(r.blob32(self._max_key, "key"), r.blob32(self._max_value, "value"))
        self._reply(rid)

    def _op_get(self, rid: int, r: Reader) -> None:
        timeout = _read_timeout(r)
        key = r.blob32(self._max_key, "key")
        value = self._state.get(key)
        if value is not None:
            self._reply(rid, value)
        else:
            self._park_keys(rid, [key], timeout, functools.partial(self._value_of, key))

    def _op_add(self, rid: int, r: Reader) -> None:
        key = r.blob32(self._max_key, "key")
        amount = r.i64()
        try:
            total = self._state.add(key, amount)
        except DistStoreError as exc:
            # Name the key as its user knows it (without the "/" clients put in front).
            raise DistStoreError(str(exc).replace(format_keys([key]), _display(key))) from None
        self._reply(rid, I64.pack(total))

    def _op_compare_set(self, rid: int, r: Reader) -> None:
        key = r.blob32(self._max_key, "key")
        expected = r.blob32(self._max_value, "value")
        self._reply(rid, self._state.compare_set(key, expected, r.blob32(self._max_value, "value")))

    def _op_lease(self, rid: int, r: Reader) -> None:
        key = r.blob32(self._max_key, "key")
        value = r.blob32(self._max_value, "value")
        if value:
            self._leases[key] = value
        else:
            self._leases.pop(key, None)
        self._reply(rid)

    def _op_wait(self, rid: int, r: Reader) -> None:
        timeout = _read_timeout(r)
        keys = self._keys(r)
        if self._state.check(keys):
            self._reply(rid)
        else:
            self._park_keys(rid, keys, timeout, list)

    def _op_check(self, rid: int, r: Reader) -> None:
        self._reply(rid, U8.pack(self._state.check(self._keys(r))))

    def _op_delete_key(self, rid: int, r: Reader) -> None:
        key = r.blob32(self._max_key, "key")
        self._reply(rid, U8.pack(self._state.delete(key)))

    def _op_num_keys(self, rid: int, r: Reader) -> None:
        self._reply(rid, I64.pack(self._state.num_keys()))

    def _op_list_keys(self, rid: int, r: Reader) -> None:
        self._reply(rid, *_blobs(self._state.list_keys()))

    def _op_multi_get(self, rid: int, r: Reader) -> None:
        timeout = _read_timeout(r)
        keys = self._keys(r)
        if self._state.check(keys):
            self._reply(rid, *self._values_of(keys))
        else:
            self._park_keys(rid, keys, timeout, functools.partial(self._values_of, keys))

    def _op_multi_set(self, rid: int, r: Reader) -> None:
        mk, mv = self._max_key, self._max_value
        n = r.u32()
        # Parse everything before writing anything: a bad entry leaves the store untouched.
        items = [(r.blob32(mk, "key"), r.blob32(mv, "value")) for _ in range(n)]
        for key, value in items:
            self._state.set(key, value)
        self._reply(rid)

    def _op_append(self, rid: int, r: Reader) -> None:
        mv = self._max_value
        key = r.blob32(self._max_key, "key")
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
        self._state.queue_push(r.blob32(self._max_key, "key"), r.blob32(self._max_value, "value"))
        self._reply(rid)

    def _op_queue_pop(self, rid: int, r: Reader) -> None:
        timeout = _read_timeout(r)
        block = r.u8()
        key = r.blob32(self._max_key, "key")
        value = self._state.queue_pop(key)
        if value is not None:
            self._reply(rid, value)
        elif not block:
            self._error(rid, Status.QUEUE_EMPTY, f"queue {_display(key)} is empty")
        else:
            self._park_keys(rid, [key], timeout, functools.partial(self._pop, key))

    def _op_queue_len(self, rid: int, r: Reader) -> None:
        key = r.blob32(self._max_key, "key")
        self._reply(rid, I64.pack(self._state.queue_len(key)))

    def _op_barrier(self, rid: int, r: Reader) -> None:
        timeout = _read_timeout(r)
        world = r.i64()
        key = r.blob32(self._max_key, "key")
        if world < 1:
            raise DistUsageError(f"barrier world_size must be at least 1, got {world}")
        self._check_parkable(rid)
        try:
            self._state.add(key, 1, "barrier")
        except DistStoreError as exc:
            raise DistStoreError(str(exc).replace(format_keys([key]), _display(key))) from None
        future = self._state.watch_count(key, world, self._loop)
        if future.done():
            self._reply(rid)
        else:
            self._park(rid, future, [key], timeout, list, world)

    def _op_cancel(self, rid: int, r: Reader) -> None:
        parked = self._parked.pop(r.u32(), None)
        if parked is not None:
            self._drop(parked)

    def _op_ping(self, rid: int, r: Reader) -> None:
        self._reply(rid)

    def _keys(self, r: Reader) -> list[bytes]:
        mk = self._max_key
        return [r.blob32(mk, "key") for _ in range(r.u32())]

    # -- aiodist protocol: parked requests -----------------------------------------------
    def _value_of(self, key: bytes) -> list[bytes]:
        return [self._state.get(key) or b""]

    def _values_of(self, keys: list[bytes]) -> list[bytes]:
        return _blobs([self._state.get(k) or b"" for k in keys])

    def _pop(self, key: bytes) -> list[bytes] | None:
        value = self._state.queue_pop(key)
        return None if value is None else [value]

    def _check_parkable(self, rid: int) -> None:
        if rid in self._parked:
            # A second waiting request under one id would orphan the first one's waiter,
            # which the disconnection could then no longer cancel.
            raise DistProtocolError(f"request id {rid} is already used by a waiting request")
        if len(self._parked) >= MAX_WAITING_PER_CONNECTION:
            raise DistUsageError(
                f"this connection already has {MAX_WAITING_PER_CONNECTION} requests waiting "
                "on the store; wait for some to finish (or use another connection)"
            )

    def _park_keys(
        self,
        rid: int,
        keys: list[bytes],
        timeout: float,
        finish: Callable[[], list[bytes] | None],
    ) -> None:
        self._check_parkable(rid)
        self._park(rid, self._state.watch(keys, self._loop), keys, timeout, finish, 0)

    def _park(
        self,
        rid: int,
        future: asyncio.Future[None],
        keys: list[bytes],
        timeout: float,
        finish: Callable[[], list[bytes] | None],
        world: int,
        start: float | None = None,
    ) -> None:
        loop = self._loop
        now = loop.time()
        parked = _Parked(
            self, rid, future, keys, finish, now if start is None else start, timeout, world
        )
        if timeout >= 0:
            left = max(0.0, parked.start + timeout - now)
            parked.timer = loop.call_later(left, self._expire, rid, parked)
        self._parked[rid] = parked
        future.add_done_callback(parked)

    def _woken(self, rid: int, parked: _Parked, future: asyncio.Future[None]) -> None:
        if future.cancelled() or self._parked.get(rid) is not parked:
            return
        if parked.timer is not None:
            parked.timer.cancel()
            parked.timer = None
        if self._paused:
            self._deferred.append((rid, parked))  # answered when the client reads again
        else:
            self._answer(rid, parked)

    def _answer(self, rid: int, parked: _Parked) -> None:
        del self._parked[rid]
        parts = parked.finish()
        if parts is None:
            # A queue pop that lost the value to another popper: wait again, same deadline.
            future = self._state.watch(parked.keys, self._loop)
            self._park(rid, future, parked.keys, parked.timeout, parked.finish, 0, parked.start)
            return
        self._send(encode_frame(rid, Status.OK, *parts))

    def _expire(self, rid: int, parked: _Parked) -> None:
        if self._parked.get(rid) is not parked:
            return
        del self._parked[rid]
        parked.timer = None
        parked.future.cancel()  # unregisters it from the state
        waited = self._loop.time() - parked.start
        state = self._state
        if parked.world:
            count = state.count_or_none(parked.keys[0])
            payload = [*_blobs(parked.keys), I64.pack(-1 if count is None else count)]
        else:
            payload = _blobs([k for k in parked.keys if not state.exists(k)])
        self._send(encode_frame(rid, Status.TIMEOUT, F64.pack(waited), *payload))

    @staticmethod
    def _drop(parked: _Parked) -> None:
        if parked.timer is not None:
            parked.timer.cancel()
            parked.timer = None
        parked.future.cancel()

    # -- torch protocol ------------------------------------------------------------------
    def _fast_torch(self, data: bytes) -> int:
        """Answer the whole set/get/add/check requests at the start of ``data``.

        Returns the bytes used; like ``_fast_frames`` it leaves anything else to the general
        parser. Replies keep request order: they go to ``_out`` ahead of any the general
        parser adds for later requests.
        """
        state = self._state
        out = self._out
        max_key = self._max_key
        unpack_u64 = U64.unpack_from
        size = len(data)
        pos = 0
        out_bytes = 0
        while size - pos >= 9 and out_bytes < _FLUSH_BYTES:
            op = data[pos]
            (klen,) = unpack_u64(data, pos + 1)
            if klen > max_key:
                break
            kend = pos + 9 + klen
            if op == _T_ADD:
                end = kend + 8
                if end > size:
                    break
                try:
                    total = state.add(data[pos + 9 : kend], I64.unpack_from(data, kend)[0])
                except DistStoreError:
                    break
                out.append(I64.pack(total))
            elif op == _T_SET:
                if kend + 8 > size:
                    break
                (vlen,) = unpack_u64(data, kend)
                end = kend + 8 + vlen
                if vlen > self._max_value or end > size:
                    break
                state.set(data[pos + 9 : kend], data[kend + 8 : end])
            elif op == _T_GET:
                end = kend
                if end > size:
                    break
                value = state.get(data[pos + 9 : kend]) or b""
                out.append(U64.pack(len(value)) + value)
                out_bytes += len(value)
            elif op == _T_CHECK and klen == 1:
                # A check of one key: the count (1) was read as klen; the key follows.
                if pos + 17 > size:
                    break
                (klen,) = unpack_u64(data, pos + 9)
                end = pos + 17 + klen
                if klen > max_key or end > size:
                    break
                ready = state.exists(data[pos + 17 : end])
                out.append(_TORCH_READY_BYTE if ready else _TORCH_NOT_READY_BYTE)
            else:
                break
            pos = end
        self._out_bytes += out_bytes
        return pos

    def _torch(self, buf: bytes | bytearray, pos: int) -> int:
        server = self._server
        reader = Reader(buf, pos)
        try:
            op, args = parse_torch_request(reader, server.max_key_size, server.max_value_size)
        except DistProtocolError as exc:
            raise _Close(f"torch protocol: {exc}") from None
        self._torch_requests += 1
        if self._torch_requests == 1:
            if op != TorchOp.VALIDATE or args[0] != TORCH_VALIDATE_MAGIC:
                raise _Close("torch protocol: the first request is not VALIDATE")
            return reader.pos
        if self._torch_requests == 2:
            if op == TorchOp.PING and args[0] == UPGRADE_NONCE:
                # An aiodist client probing which server this is: switch it to our protocol.
                self._out.append(U32.pack(UPGRADE_REPLY))
                self._mode = _DETECT
                return reader.pos
            if server._token is not None and not server.allow_unauthenticated_torch:
                raise _Close(
                    "refusing a torch-protocol client: this server requires an auth token "
                    "(start it with allow_unauthenticated_torch=True to admit torch clients)"
                )
            self._mode = _TORCH_READY
            if op == TorchOp.PING and args[0] == os.getpid():
                self._torch_same_process()
        try:
            self._torch_request(op, args)
        except DistStoreError as exc:
            # torch's server drops the connection on a failed request (it has no error reply).
            raise _Close(f"torch protocol: {exc}") from None
        return reader.pos

    def _torch_same_process(self) -> None:
        """Prepare for a torch client that lives in this very process.

        torch's client sends its pid in the first PING. When that is our pid and the
        client's socket is open, in blocking mode, in our own descriptor table (aiodist's
        torch-wire client sends its pid too, but never blocks), two of its calls can never be
        answered: ``queue_len()`` and ``list_keys()`` hold the GIL while they block in
        ``recv()``, which this server needs to run. Without a receive timeout they would
        hang the process for good; with one, torch raises ``DistNetworkError("Socket
        Timeout")`` after the peer timeout, and this connection is then closed rather than
        answered (the late reply would be read as the answer to the client's next request).
        """
        transport = self._transport
        if transport is None:
            return
        local = transport.get_extra_info("sockname")
        remote = transport.get_extra_info("peername")
        if not isinstance(local, tuple) or not isinstance(remote, tuple):
            return
        fd = _own_socket(remote, local)
        if fd is None or not os.get_blocking(fd):
            return  # another process, or a client on an event loop (it never blocks)
        self._same_process = True
        seconds = self._server.peer_timeout
        timeval = struct.pack("@ll", int(seconds), int((seconds % 1) * 1e6))
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        except OSError as exc:
            logger.debug("could not set a receive timeout on fd %d: %s", fd, exc)
        logger.warning(
            "store server: a torch TCPStore client in this process (pid %d) connected from "
            "%s; %s, so those two calls will fail after %.0f s (peer_timeout) and close that "
            "client: call them from another process",
            os.getpid(),
            self.peer,
            _SAME_PROCESS_HAZARD,
            seconds,
        )

    def _torch_request(self, op: int, args: tuple[Any, ...]) -> None:
        if self._same_process and op in (_T_QUEUE_LEN, _T_LIST_KEYS):
            raise _Close(
                f"torch protocol: refusing {TorchOp(op).name} from a torch client in this "
                f"process: {_SAME_PROCESS_HAZARD}; the client timed out waiting for the reply"
            )
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
        self._out.append(_TORCH_READY_BYTE if ready else _TORCH_NOT_READY_BYTE)

    def _t_wait(self, keys: list[bytes]) -> None:
        self._torch_watch(self._state.watch(keys, self._loop))

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
        self._state.add(counter, 1, "barrier")
        self._torch_watch(self._state.watch_count(counter, world, self._loop))

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
        if self._transport is not None and self._mode == _TORCH_READY and not self._out:
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
#: aiodist opcode -> handler; a dict rather than an if-chain keeps dispatch O(1).
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
    Op.BARRIER: _Connection._op_barrier,
    Op.LEASE: _Connection._op_lease,
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
        peer_timeout: seconds after which a client whose host went silent (no FIN, no RST)
            is dropped and its waits released; ``None`` reads ``$AIODIST_PEER_TIMEOUT``,
            else 8 s. A stopped or busy client is not affected (its kernel still answers).
        expected_clients: how many clients will connect at once (e.g. the world size):
            :meth:`start` raises this process's soft open-file limit to fit them.

    Raises:
        DistUsageError: a limit is not a positive integer, the token is empty, or the peer
            timeout is not a number of at least 1 s.
    """

    def __init__(
        self,
        *,
        auth_token: str | bytes | None = None,
        allow_unauthenticated_torch: bool = False,
        max_key_size: int = DEFAULT_MAX_KEY_SIZE,
        max_value_size: int = DEFAULT_MAX_VALUE_SIZE,
        state: KeyValueState | None = None,
        peer_timeout: float | None = None,
        expected_clients: int | None = None,
    ) -> None:
        for name, value, cap in (
            ("max_key_size", max_key_size, 2**32 - 1),
            ("max_value_size", max_value_size, 2**32 - 2**20),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= cap:
                raise DistUsageError(f"{name} must be an integer in 1..{cap}, got {value!r}")
        if expected_clients is not None and (
            isinstance(expected_clients, bool)
            or not isinstance(expected_clients, int)
            or expected_clients < 0
        ):
            raise DistUsageError(
                f"expected_clients must be a non-negative int, got {expected_clients!r}"
            )
        self._token = resolve_token(auth_token)
        self.allow_unauthenticated_torch = allow_unauthenticated_torch
        self.max_key_size = max_key_size
        self.max_value_size = max_value_size
        self.peer_timeout = resolve_peer_timeout(peer_timeout)
        self.expected_clients = expected_clients
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
            DistUsageError: already started, the port is out of range, or the open-file
                limit cannot fit ``expected_clients`` (the message names the limit).
            DistNetworkError: the address cannot be resolved or the port is in use.
        """
        if self._server is not None:
            raise DistUsageError(f"{self!r} is already started")
        if not 0 <= port <= 65535:
            raise DistUsageError(f"port must be in 0..65535, got {port}")
        if self.expected_clients:
            # One descriptor per client, and some slack for the ones a launcher or a
            # process group opens beside the store.
            ensure_open_files(
                self.expected_clients + 64,
                f"a store server for {self.expected_clients} clients",
            )
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
            configure_socket(sock, self.peer_timeout)
            sock.bind(addr)
            sock.setblocking(False)
            # The loop calls listen() itself, with a backlog of 100 unless told otherwise: a
            # thousand ranks connecting at once then overflow it (SYN cookies, resets, 1 s
            # retransmits). Ask for the most the kernel allows (net.core.somaxconn caps it).
            self._server = await loop.create_server(
                lambda: _Connection(self), sock=sock, backlog=_BACKLOG
            )
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
                await state.watch_count(key, target)
        except TimeoutError:
            count = state.count_or_none(key)
            raise DistTimeoutError(
                f"timed out after {time.monotonic() - start:.1f} s waiting for clients to "
                f"join the store at {self._host}:{self._port}: {count}/{target} clients joined"
            ) from None
        return state.counter(key)

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
