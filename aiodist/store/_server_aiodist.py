"""The aiodist wire of the store server: handshake, frames, and requests that wait.

aiodist's own protocol (layouts in ``_wire.py``) opens with a hello and an optional HMAC
challenge-response, then carries frames tagged with request ids, so one connection can have
any number of requests in flight and have them answered in any order. That is what lets a
request wait on the server: a get of a missing key, a wait, a blocking queue pop or a barrier
*parks* a future of the state with a timer and is answered when a write wakes it or its timer
runs out, while the connection goes on serving the requests behind it. Leases (keys set when
the connection ends) are this wire's too.

:class:`AiodistWire` holds all of it, as methods of the server's connection class (which joins
it with :class:`~aiodist.store._server_torch.TorchWire` over the shared
:class:`~aiodist.store._server_connection.ServerConnection`); the client side of this wire is
``_client_aiodist.py``'s ``AiodistChannel``.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import math
import os
import struct
from collections.abc import Callable, Sequence

from ..errors import DistProtocolError, DistStoreError, DistUsageError
from ._server_connection import (
    FLUSH_BYTES,
    MODE_AUTH,
    MODE_FRAMES,
    CloseConnection,
    ConnectionServer,
    ServerConnection,
)
from ._state import format_keys
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
)

__all__ = ["AiodistWire"]

logger = logging.getLogger(__name__)

# Opcodes as plain ints: comparing against enum members costs ~70 ns each on CPython 3.11.
_OP_SET, _OP_GET, _OP_ADD = int(Op.SET), int(Op.GET), int(Op.ADD)
_OK = int(Status.OK)
#: body length, request id, status, i64 (an ``add`` reply in one pack).
_OK_I64 = struct.Struct("<IIBq")
#: body length, request id, opcode, and a first u32 (the key's length, in set and add).
_HEAD_KEY = struct.Struct("<IIBI")


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


class _Parked:
    """A request waiting on the state: its future, timer and how to answer it.

    Called when its future is done (it is the future's callback: no closure to allocate).
    """

    __slots__ = ("conn", "finish", "future", "keys", "rid", "start", "timeout", "timer", "world")

    def __init__(
        self,
        conn: AiodistWire,
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


class AiodistWire(ServerConnection):
    """The aiodist wire's part of a server connection: its requests, parked waits and leases.

    Only ever a base of the server's connection class, which hands it the server's limit on
    the requests one connection may have parked at once.
    """

    __slots__ = ()

    def __init__(self, server: ConnectionServer, max_waiting: int) -> None:
        super().__init__(server)
        # Requests waiting on the state, by request id, and those whose wait is over but
        # whose reply waits for the client to read (while paused).
        self._parked: dict[int, _Parked] = {}
        self._deferred: list[tuple[int, _Parked]] = []
        self._max_waiting = max_waiting
        # Keys to set (or append to) when this connection ends (leases): key -> (value,
        # whether to append it).
        self._leases: dict[bytes, tuple[bytes, bool]] = {}
        self._nonce = b""
        self._client_nonce = b""

    def _aiodist_lost(self) -> None:
        """Carry out the leases and abandon the waits of a connection that ended."""
        # A client that goes away without withdrawing its leases (its process died, or its
        # host can no longer be reached) has them carried out, each one recorded: a lease
        # whose key holds a value already (another client's lease came first) takes the next
        # free key of ``key/1``, ``key/2``, ... So when several clients lease one key (every
        # rank of a world its departure key), each departure is there, in the order the
        # connections ended, and a reader that waits on the next key learns of every one. An
        # appended value is added to the others' (within the server's value limit).
        for key, (value, append) in self._leases.items():
            if not append:
                slot, n = key, 0
                while self._state.get(slot):
                    n += 1
                    slot = b"%s/%d" % (key, n)
                self._state.set(slot, value)
            elif len(self._state.get(key) or b"") + len(value) <= self._max_value:
                self._state.append(key, value)
            else:
                logger.warning(
                    "store server: a lease of %s could not be carried out: appending to key "
                    "%s would pass max_value_size",
                    self.peer,
                    _display(key),
                )
        self._leases.clear()
        # Whatever this client was waiting for is abandoned: unregister it from the state.
        for parked in self._parked.values():
            self._drop(parked)
        self._parked.clear()
        self._deferred.clear()

    def _answer_deferred(self) -> None:
        """Answer the woken waits held back while the client was not reading."""
        deferred, self._deferred = self._deferred, []
        for i, (rid, parked) in enumerate(deferred):
            if self._paused:  # an answer filled the transport again: the rest waits
                self._deferred = deferred[i:] + self._deferred
                return
            if self._parked.get(rid) is parked:
                self._answer(rid, parked)

    # -- aiodist protocol: fast path -----------------------------------------------------
    def _fast_frames(self, data: bytes) -> int:
        """Answer the whole set/add/get frames at the start of ``data``; return bytes used.

        It stops at the first frame that is anything else or anything unusual (split,
        over a limit, failing, a get that must wait): the general parser takes it from there
        and produces the error, if any. A read that is exactly one add is answered straight
        on the transport instead of through ``_out``.
        """
        n = len(data)
        if n >= 21:
            # The most common read of all, one add: no loop, no list.
            length, rid, op, klen = _HEAD_KEY.unpack_from(data)
            if op == _OP_ADD and length + 4 == n == klen + 21 and klen <= self._max_key:
                try:
                    total = self._state.add(data[13 : n - 8], I64.unpack_from(data, n - 8)[0])
                except DistStoreError:
                    pass  # the general parser reports it
                else:
                    transport = self._transport
                    assert transport is not None
                    transport.write(_OK_I64.pack(13, rid, _OK, total))
                    return n
        state = self._state
        out = self._out
        max_key = self._max_key
        unpack_head = FRAME_HEAD.unpack_from
        unpack_u32 = U32.unpack_from
        size = len(data)
        pos = 0
        out_bytes = 0
        while size - pos >= 13 and out_bytes < FLUSH_BYTES:
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
        flags = FLAG_AUTH if server.token is not None else 0
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
            raise CloseConnection(
                f"client speaks aiodist store protocol version {version}, "
                f"this server speaks {PROTOCOL_VERSION}"
            )
        if flags:
            self._mode = MODE_AUTH
        else:
            self._mode = MODE_FRAMES
            self._admit()
        return pos + CLIENT_HELLO.size

    def _auth(self, buf: bytes | bytearray, pos: int) -> int:
        if len(buf) - pos < AUTH_MAC_SIZE:
            raise Incomplete
        token = self._server.token
        assert token is not None
        got = bytes(buf[pos : pos + AUTH_MAC_SIZE])
        want = auth_mac(token, b"store/client", self._nonce, self._client_nonce)
        if not hmac.compare_digest(got, want):
            self._out.append(U8.pack(1))
            raise CloseConnection("authentication failed (wrong auth token)")
        self._out.append(
            U8.pack(0) + auth_mac(token, b"store/server", self._client_nonce, self._nonce)
        )
        self._mode = MODE_FRAMES
        self._server.trust_host(self._peer_host)
        self._admit()
        return pos + AUTH_MAC_SIZE

    def _frame(self, buf: bytes | bytearray, pos: int, size: int) -> int:
        if size - pos < FRAME_HEAD.size:
            if size - pos >= 4 and U32.unpack_from(buf, pos)[0] < 5:
                raise CloseConnection("malformed frame (body shorter than its header)")
            raise Incomplete
        length, rid, op = FRAME_HEAD.unpack_from(buf, pos)
        server = self._server
        limit = server.max_request
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
            raise CloseConnection(f"malformed frame (body length {length})")
        end: int = pos + 4 + length
        if end > size:
            raise Incomplete
        reader = Reader(buf, pos + FRAME_HEAD.size, end)
        try:
            self._request(rid, op, reader)
        except Incomplete:
            raise CloseConnection(f"truncated request (opcode {op})") from None
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
            raise CloseConnection(f"unknown aiodist store opcode {op}")
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

    def _op_lease(self, rid: int, r: Reader, append: bool = False) -> None:
        key = r.blob32(self._max_key, "key")
        value = r.blob32(self._max_value, "value")
        if value:
            self._leases[key] = (value, append)
        else:
            self._leases.pop(key, None)
        self._reply(rid)

    def _op_lease_append(self, rid: int, r: Reader) -> None:
        self._op_lease(rid, r, append=True)

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

    def _op_delete_prefix(self, rid: int, r: Reader) -> None:
        prefix = r.blob32(self._max_key, "prefix")
        self._reply(rid, I64.pack(len(self._state.delete_prefix(prefix))))

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

    def _op_queue_push_front(self, rid: int, r: Reader) -> None:
        key = r.blob32(self._max_key, "key")
        self._state.queue_push_front(key, r.blob32(self._max_value, "value"))
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
        if len(self._parked) >= self._max_waiting:
            raise DistUsageError(
                f"this connection already has {self._max_waiting} requests waiting "
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


_AiodistHandler = Callable[[AiodistWire, int, Reader], None]
#: aiodist opcode -> handler; a dict rather than an if-chain keeps dispatch O(1).
_AIODIST_HANDLERS: dict[int, _AiodistHandler] = {
    Op.SET: AiodistWire._op_set,
    Op.GET: AiodistWire._op_get,
    Op.ADD: AiodistWire._op_add,
    Op.COMPARE_SET: AiodistWire._op_compare_set,
    Op.WAIT: AiodistWire._op_wait,
    Op.CHECK: AiodistWire._op_check,
    Op.DELETE_KEY: AiodistWire._op_delete_key,
    Op.NUM_KEYS: AiodistWire._op_num_keys,
    Op.LIST_KEYS: AiodistWire._op_list_keys,
    Op.MULTI_GET: AiodistWire._op_multi_get,
    Op.MULTI_SET: AiodistWire._op_multi_set,
    Op.APPEND: AiodistWire._op_append,
    Op.QUEUE_PUSH: AiodistWire._op_queue_push,
    Op.QUEUE_POP: AiodistWire._op_queue_pop,
    Op.QUEUE_LEN: AiodistWire._op_queue_len,
    Op.CANCEL: AiodistWire._op_cancel,
    Op.PING: AiodistWire._op_ping,
    Op.BARRIER: AiodistWire._op_barrier,
    Op.LEASE: AiodistWire._op_lease,
    Op.QUEUE_PUSH_FRONT: AiodistWire._op_queue_push_front,
    Op.LEASE_APPEND: AiodistWire._op_lease_append,
    Op.DELETE_PREFIX: AiodistWire._op_delete_prefix,
}
