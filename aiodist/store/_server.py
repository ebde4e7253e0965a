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

The connection is one object whichever wire it speaks (a probing aiodist client starts on
torch's wire and switches), but its code is split by wire: ``_server_connection.py`` holds its
transport side (buffer, batched replies, back-pressure, closing), ``_server_aiodist.py`` and
``_server_torch.py`` each wire's requests, and the connection class here joins them with what
needs both: telling the wires apart, the general parser's loop, and the asyncio callbacks.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from types import TracebackType
from typing import Self, cast

from .._auth import resolve_token
from ..errors import DistNetworkError, DistTimeoutError, DistUsageError
from ._server_aiodist import AiodistWire
from ._server_connection import (
    FLUSH_BYTES,
    MODE_AUTH,
    MODE_CLOSED,
    MODE_DETECT,
    MODE_FRAMES,
    MODE_HELLO,
    MODE_TORCH,
    MODE_TORCH_READY,
    CloseConnection,
)
from ._server_torch import TorchWire
from ._sockets import configure_socket, ensure_open_files, resolve_peer_timeout
from ._state import KeyValueState
from ._wire import (
    AIODIST_MAGIC,
    DEFAULT_MAX_KEY_SIZE,
    DEFAULT_MAX_VALUE_SIZE,
    Incomplete,
    max_request_size,
)

__all__ = ["TCPStoreServer", "resolve_token"]

logger = logging.getLogger(__name__)

#: Read no more than this per connection before answering what was read (bounds the bytes
#: a single fast client can make the loop chew through in one turn).
_HIGH_WATER = 4 * 1024 * 1024
#: Requests one connection may have waiting at once (each holds a future and a timer).
MAX_WAITING_PER_CONNECTION = 16384

#: The listen backlog asked for; the kernel caps it at net.core.somaxconn.
_BACKLOG = 65535


class _Connection(AiodistWire, TorchWire):
    """One client connection, in whichever protocol it turns out to speak.

    ``AiodistWire`` comes first among its bases: its ``__init__`` takes the waiting limit and
    passes the server on to ``TorchWire``'s.
    """

    __slots__ = ()

    def __init__(self, server: TCPStoreServer) -> None:
        # The limit is read per connection, not once at import: a change to it applies to
        # the connections made after it.
        super().__init__(server, MAX_WAITING_PER_CONNECTION)

    # -- asyncio callbacks ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        # Socket options (keepalive, user timeout, no delay) come from the listening socket.
        self._transport = cast(asyncio.Transport, transport)
        self._server._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._mode = MODE_CLOSED
        self._server._connections.discard(self)
        if exc is not None:
            logger.info("store server: lost the connection from %s: %s", self.peer, exc)
        self._aiodist_lost()
        self._torch_lost()
        self._transport = None

    def resume_writing(self) -> None:
        self._paused = False
        self._answer_deferred()
        if self._buf and self._mode != MODE_CLOSED and not self._paused:
            self._serve(b"")
        if self._transport is not None and not self._paused and self._mode != MODE_CLOSED:
            self._transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        mode = self._mode
        if not self._buf and not self._discard and not self._paused:
            # The usual read holds whole requests of the common kinds: answer them straight
            # from ``data``; anything else goes on to the general parser.
            if mode == MODE_FRAMES:
                pos = self._fast_frames(data)
            elif mode == MODE_TORCH_READY:
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

    # -- the general parser --------------------------------------------------------------
    def _serve(self, data: bytes) -> None:
        """Run the general parser over the buffered bytes and ``data``."""
        if self._mode == MODE_CLOSED:
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
        except CloseConnection as exc:
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

    def _process(self, buf: bytes | bytearray) -> int:
        """Handle every complete request in ``buf``; return how many bytes were used."""
        pos = 0
        size = len(buf)
        try:
            while pos < size and self._mode != MODE_CLOSED:
                if self._paused:
                    break  # the rest waits in the buffer until the client reads
                mode = self._mode
                if mode == MODE_FRAMES:
                    pos = self._frame(buf, pos, size)
                elif mode in (MODE_TORCH, MODE_TORCH_READY):
                    pos = self._torch(buf, pos)
                elif mode == MODE_DETECT:
                    pos = self._detect(buf, pos)
                elif mode == MODE_HELLO:
                    pos = self._hello(buf, pos)
                elif mode == MODE_AUTH:
                    pos = self._auth(buf, pos)
                if self._discard:
                    # An oversized frame: drop what is buffered of it, skip the rest later.
                    drop = min(self._discard, size - pos)
                    pos += drop
                    self._discard -= drop
                if self._out_bytes > FLUSH_BYTES:
                    self._flush()  # may pause writing, which stops this loop
        except Incomplete:
            pass
        if size - pos > _HIGH_WATER + self._server._max_request and not self._paused:
            raise CloseConnection(f"{size - pos} bytes buffered without a complete request")
        return pos

    def _detect(self, buf: bytes | bytearray, pos: int) -> int:
        if buf[pos] == 0:
            self._mode = MODE_TORCH
            return pos
        if len(buf) - pos < len(AIODIST_MAGIC):
            if not AIODIST_MAGIC.startswith(bytes(buf[pos:])):
                raise CloseConnection(
                    f"not a store protocol (first bytes {bytes(buf[pos : pos + 8])!r})"
                )
            raise Incomplete
        if buf[pos : pos + len(AIODIST_MAGIC)] != AIODIST_MAGIC:
            raise CloseConnection(
                f"not a store protocol (first bytes {bytes(buf[pos : pos + 8])!r})"
            )
        self._mode = MODE_HELLO
        return pos


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
