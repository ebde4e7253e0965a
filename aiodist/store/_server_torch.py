"""The torch wire of the store server: unmodified ``torch.distributed.TCPStore`` clients.

torch's TCPStore protocol (layouts in ``_wire.py``) has no request ids and no error replies:
requests are answered strictly in order, a failed request drops the connection (as torch's
own server does), and a connection has at most one outstanding WAIT or BARRIER, answered by a
STOP_WAITING byte whenever it is satisfied. The first request must be VALIDATE; an aiodist
client probing which server this is sends a PING with a magic nonce next and is switched to
aiodist's wire. torch clients cannot prove the token: a server with one decides, as soon as
VALIDATE is parsed, whether this client may use the store on torch's wire (see
``TCPStoreServer``'s ``allow_unauthenticated_torch``); if not, the probe is all it may send
next, checked byte by byte as it arrives, and anything else closes the connection. A torch
client that lives in the server's own process needs care of its own
(see :meth:`TorchWire._torch_same_process`).

:class:`TorchWire` holds all of it, as methods of the server's connection class (which joins
it with :class:`~aiodist.store._server_aiodist.AiodistWire` over the shared
:class:`~aiodist.store._server_connection.ServerConnection`); the client side of this wire is
``_client_torch.py``'s ``TorchChannel``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
import struct
from collections.abc import Callable
from typing import Any

from ..errors import DistProtocolError, DistStoreError
from ._server_connection import (
    FLUSH_BYTES,
    MODE_DETECT,
    MODE_PROBE,
    MODE_TORCH_READY,
    CloseConnection,
    ConnectionServer,
    ServerConnection,
)
from ._wire import (
    I64,
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
    Reader,
    TorchOp,
    blob64,
    parse_torch_request,
)

__all__ = ["TorchWire"]

logger = logging.getLogger(__name__)

# Opcodes as plain ints: comparing against enum members costs ~70 ns each on CPython 3.11.
_T_SET, _T_GET, _T_ADD, _T_CHECK = (
    int(TorchOp.SET),
    int(TorchOp.GET),
    int(TorchOp.ADD),
    int(TorchOp.CHECK),
)
_T_QUEUE_LEN, _T_LIST_KEYS = int(TorchOp.QUEUE_LEN), int(TorchOp.LIST_KEYS)
_T_QUEUE_POP = int(TorchOp.QUEUE_POP)
_TORCH_READY_BYTE = U8.pack(TORCH_READY)
_TORCH_NOT_READY_BYTE = U8.pack(TORCH_NOT_READY)
#: The one request a torch-wire connection that is not let in may send after VALIDATE.
_UPGRADE_PROBE = U8.pack(TorchOp.PING) + U32.pack(UPGRADE_NONCE)

#: What a torch client in the server's own process is told, through the log, about the two
#: calls that cannot be served to it (see ``TorchWire._torch_same_process``).
_SAME_PROCESS_HAZARD = (
    "torch's TCPStore.queue_len() and list_keys() keep the GIL while they wait for the "
    "reply, and this server, running in the same process, needs the GIL to send it"
)

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


class TorchWire(ServerConnection):
    """The torch wire's part of a server connection: its requests and its one wait.

    Only ever a base of the server's connection class.
    """

    __slots__ = ()

    def __init__(self, server: ConnectionServer) -> None:
        super().__init__(server)
        # The one outstanding WAIT/BARRIER of this connection.
        self._torch_wait: asyncio.Future[None] | None = None
        self._torch_wait_notified = False
        self._torch_requests = 0
        self._same_process = False

    def _torch_lost(self) -> None:
        """Abandon the wait of a connection that ended, and the queue item it was promised."""
        if self._torch_wait is not None:
            self._torch_wait.cancel()
            self._torch_wait = None
        if self in self._state.promise_owners:
            self._state.release(self)

    # -- torch protocol ------------------------------------------------------------------
    def _fast_torch(self, data: bytes) -> int:
        """Answer the whole set/get/add/check requests at the start of ``data``.

        Returns the bytes used; like ``_fast_frames`` it leaves anything else to the general
        parser. Replies keep request order: they go to ``_out`` ahead of any the general
        parser adds for later requests; a read that is exactly one add is answered straight
        on the transport.
        """
        n = len(data)
        if self in self._state.promise_owners:
            return 0  # its next request ends the promise: the general parser sees to it
        if n >= 17 and data[0] == _T_ADD:
            # The most common read of all, one add: no loop, no list.
            (klen,) = U64.unpack_from(data, 1)
            if klen + 17 == n and klen <= self._max_key:
                try:
                    total = self._state.add(data[9 : n - 8], I64.unpack_from(data, n - 8)[0])
                except DistStoreError:
                    pass  # the general parser drops the connection, as torch's does
                else:
                    transport = self._transport
                    assert transport is not None
                    transport.write(I64.pack(total))
                    return n
        state = self._state
        out = self._out
        max_key = self._max_key
        unpack_u64 = U64.unpack_from
        size = len(data)
        pos = 0
        out_bytes = 0
        while size - pos >= 9 and out_bytes < FLUSH_BYTES:
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
            raise CloseConnection(f"torch protocol: {exc}") from None
        self._torch_requests += 1
        if self._torch_requests == 1:
            if op != TorchOp.VALIDATE or args[0] != TORCH_VALIDATE_MAGIC:
                raise CloseConnection("torch protocol: the first request is not VALIDATE")
            if server.admits_torch(self._transport):
                self._admit()
            else:
                self._mode = MODE_PROBE
            return reader.pos
        if self._torch_requests == 2:
            if op == TorchOp.PING and args[0] == UPGRADE_NONCE:
                self._upgrade()
                return reader.pos
            self._mode = MODE_TORCH_READY
            if op == TorchOp.PING and args[0] == os.getpid():
                self._torch_same_process()
        try:
            self._torch_request(op, args)
        except DistStoreError as exc:
            # torch's server drops the connection on a failed request (it has no error reply).
            raise CloseConnection(f"torch protocol: {exc}") from None
        return reader.pos

    def _probe(self, buf: bytes | bytearray, pos: int) -> int:
        """After VALIDATE from a client the server does not let in on torch's wire: only an
        aiodist client's probe may follow, and the first byte that differs from it ends
        the connection (nothing of a torch request is ever buffered)."""
        got = bytes(buf[pos : pos + len(_UPGRADE_PROBE)])
        if not _UPGRADE_PROBE.startswith(got):
            why = self._server.torch_refusal()
            raise CloseConnection(f"refusing a torch-protocol client: {why}")
        if len(got) < len(_UPGRADE_PROBE):
            raise Incomplete
        self._upgrade()
        return pos + len(_UPGRADE_PROBE)

    def _upgrade(self) -> None:
        # An aiodist client probing which server this is: switch it to our protocol.
        self._out.append(U32.pack(UPGRADE_REPLY))
        self._mode = MODE_DETECT

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
            raise CloseConnection(
                f"torch protocol: refusing {TorchOp(op).name} from a torch client in this "
                f"process: {_SAME_PROCESS_HAZARD}; the client timed out waiting for the reply"
            )
        if op != _T_QUEUE_POP and self in self._state.promise_owners:
            # A wait answered for a queue item, followed by anything but the pop: the item
            # goes to the next waiter.
            self._state.release(self)
        handler = _TORCH_HANDLERS.get(op)
        if handler is None:  # VALIDATE again
            raise CloseConnection(f"torch protocol: unexpected opcode {TorchOp(op).name}")
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
        # Its owner is this connection: the pop that follows a wait for a queue gets the item
        # the wait was answered for.
        self._torch_watch(self._state.watch(keys, self._loop, self))

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
        # torch's reply: the queue's length (0: empty, the client raises), then the value.
        state = self._state
        length = state.queue_len(key)
        value = state.queue_pop(key, self)
        if self in state.promise_owners:
            state.release(self)  # promised items of other queues: a wait on several keys
        if value is None:
            self._out.append(I64.pack(0))
        else:
            self._out.append(I64.pack(length))
            self._out.append(blob64(value))

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
        if self._transport is not None and self._mode == MODE_TORCH_READY and not self._out:
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


#: torch opcode -> handler, called with the parsed arguments.
_TORCH_HANDLERS: dict[int, Callable[..., None]] = {
    TorchOp.SET: TorchWire._t_set,
    TorchOp.COMPARE_SET: TorchWire._t_compare_set,
    TorchOp.GET: TorchWire._t_get,
    TorchOp.ADD: TorchWire._t_add,
    TorchOp.CHECK: TorchWire._t_check,
    TorchOp.WAIT: TorchWire._t_wait,
    TorchOp.GETNUMKEYS: TorchWire._t_num_keys,
    TorchOp.DELETE_KEY: TorchWire._t_delete_key,
    TorchOp.APPEND: TorchWire._t_append,
    TorchOp.MULTI_GET: TorchWire._t_multi_get,
    TorchOp.MULTI_SET: TorchWire._t_multi_set,
    TorchOp.CANCEL_WAIT: TorchWire._torch_cancel_wait,
    TorchOp.PING: TorchWire._t_ping,
    TorchOp.QUEUE_PUSH: TorchWire._t_queue_push,
    TorchOp.QUEUE_POP: TorchWire._t_queue_pop,
    TorchOp.QUEUE_LEN: TorchWire._t_queue_len,
    TorchOp.LIST_KEYS: TorchWire._t_list_keys,
    TorchOp.BARRIER: TorchWire._t_barrier,
}
