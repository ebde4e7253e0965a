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

Nobody who has not proven the token gets more than a few KiB of the server's memory or more
than a few seconds of a connection: before a connection is admitted (authenticated; or a
torch client the server lets in; or any client of a server without a token) it may hold
``UNADMITTED_BYTES`` of input and must finish its handshake within ``HANDSHAKE_TIMEOUT``;
the connections of one address still in their handshake are capped (the oldest goes), and
when the process runs out of file descriptors the server closes the oldest such connection
of the address with the most of them instead of spinning on ``accept``. The server accepts
connections itself for that reason, on either event loop, with a listen backlog sized to
the clients expected.

The connection is one object whichever wire it speaks (a probing aiodist client starts on
torch's wire and switches), but its code is split by wire: ``_server_connection.py`` holds its
transport side (buffer, batched replies, back-pressure, closing), ``_server_aiodist.py`` and
``_server_torch.py`` each wire's requests, and the connection class here joins them with what
needs both: telling the wires apart, the general parser's loop, and the asyncio callbacks.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import socket
import time
from types import TracebackType
from typing import Any, Literal, Self, cast

from .._util._auth import resolve_token
from ..errors import DistNetworkError, DistStoreError, DistStoreTimeoutError, DistUsageError
from ._server_aiodist import AiodistWire
from ._server_connection import (
    FLUSH_BYTES,
    MODE_AUTH,
    MODE_CLOSED,
    MODE_DETECT,
    MODE_FRAMES,
    MODE_HELLO,
    MODE_PROBE,
    MODE_TORCH,
    MODE_TORCH_READY,
    UNADMITTED_BYTES,
    CloseConnection,
    ServerConnection,
)
from ._server_thread import ServerThread
from ._server_torch import TorchWire
from ._sockets import (
    configure_socket,
    ensure_open_files,
    local_peer_uid,
    plain_host,
    resolve_peer_timeout,
)
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

#: Seconds a connection has to finish its hello and authentication (torch's VALIDATE).
HANDSHAKE_TIMEOUT = 10.0
#: Connections of one address that may be in their handshake at once, at the least (more
#: with more clients expected): past it, that address's oldest one is closed.
MIN_HANDSHAKES_PER_HOST = 128

#: The listen backlog: room for every client expected to connect at once, and some; the
#: kernel caps it at net.core.somaxconn.
_MIN_BACKLOG = 1024
_MAX_BACKLOG = 65535
#: Connections accepted per wake-up of the listening socket (then other callbacks run).
_ACCEPT_BATCH = 128
#: What ``accept`` says when this process (or the system) has no descriptor left.
_OUT_OF_FILES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: Seconds before accepting again when out of descriptors: after closing a connection still
#: in its handshake (its descriptor is released by the loop), or with none to close.
_RETRY_AFTER_CLOSING = 0.01
_RETRY_AFTER_NOTHING = 1.0
#: Seconds between two log messages about refused or dropped connections (the count of
#: those in between is given): an attacker must not be able to flood the log.
_LOG_INTERVAL = 10.0

#: Which torch-wire clients a server with a token lets in (see ``TCPStoreServer``).
TorchPolicy = bool | Literal["job_hosts"]


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
        self._peer_host = plain_host(transport.get_extra_info("peername"))
        self._deadline = self._loop.call_later(HANDSHAKE_TIMEOUT, self._expired)
        self._server.arrived(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._mode = MODE_CLOSED
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._server.gone(self)
        if exc is not None and self._admitted:
            # A reset is what a client's process that ended (killed, say) leaves: its leases
            # tell whom that concerns, so it is not news at every kill. Anything else (a
            # host gone silent past the peer timeout) is.
            reset = isinstance(exc, ConnectionResetError | BrokenPipeError)
            logger.log(
                logging.DEBUG if reset else logging.INFO,
                "store server: lost the connection from %s: %s",
                self.peer,
                exc,
            )
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
            self._flush()
            self.refuse(str(exc), graceful=True)
            return
        except Exception:
            logger.exception("store server: internal error serving %s; closing it", self.peer)
            self.abort()
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
                elif mode == MODE_PROBE:
                    pos = self._probe(buf, pos)
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
        if not self._admitted:
            if size - pos > UNADMITTED_BYTES:
                raise CloseConnection(f"{size - pos} bytes sent before authenticating")
        elif size - pos > _HIGH_WATER + self._server.max_request and not self._paused:
            raise CloseConnection(f"{size - pos} bytes buffered without a complete request")
        return pos

    def _expired(self) -> None:
        self._deadline = None
        if not self._admitted and self._mode != MODE_CLOSED:
            self.refuse(f"no authentication within {HANDSHAKE_TIMEOUT:g} s")

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
    """A store server on the current event loop, or on one of its own in a thread of its own
    (``start(thread=True)``), usable without any client of its own.

    It speaks aiodist's protocol and torch's TCPStore wire on the same port, so unmodified
    ``torch.distributed.TCPStore`` clients can share keys with aiodist clients (a launcher
    hosts one for its workers this way).

    Args:
        auth_token: shared secret that aiodist clients must prove they hold (HMAC-SHA256
            challenge-response). ``None`` reads ``$AIODIST_AUTH_TOKEN``; unset means no auth.
        allow_unauthenticated_torch: with a token set, which torch-protocol clients (they
            cannot authenticate) may still use the store: ``False`` none (the default),
            ``True`` all, ``"job_hosts"`` those connecting from an address that a client
            holding the token has connected from, and, when the client is on this machine,
            only if it runs as this process's user (``aiodist-run`` hosts its store so, for
            torch workers). The others are refused as soon as their VALIDATE is read.
        max_key_size: the largest key, in bytes, a client may send.
        max_value_size: the largest value, in bytes (also bounds a value grown by ``append``).
        state: the key/value state to serve (a fresh one by default).
        peer_timeout: seconds after which a client whose host went silent (no FIN, no RST)
            is dropped and its waits released; ``None`` reads ``$AIODIST_PEER_TIMEOUT``,
            else 8 s. A stopped or busy client is not affected (its kernel still answers).
        expected_clients: how many clients will connect at once (e.g. the world size):
            :meth:`start` raises this process's soft open-file limit to fit them, and
            sizes the listen backlog and the handshakes allowed per address for them.

    Raises:
        DistUsageError: a limit is not a positive integer, the token is empty, the peer
            timeout is not a number of at least 1 s, or ``allow_unauthenticated_torch`` is
            not one of its values.
    """

    def __init__(
        self,
        *,
        auth_token: str | bytes | None = None,
        allow_unauthenticated_torch: TorchPolicy = False,
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
        if allow_unauthenticated_torch not in (False, True, "job_hosts"):
            raise DistUsageError(
                "allow_unauthenticated_torch must be False, True or 'job_hosts', got "
                f"{allow_unauthenticated_torch!r}"
            )
        self.token = resolve_token(auth_token)
        self.allow_unauthenticated_torch = allow_unauthenticated_torch
        self.max_key_size = max_key_size
        self.max_value_size = max_value_size
        self.peer_timeout = resolve_peer_timeout(peer_timeout)
        self.expected_clients = expected_clients
        self.max_request = max_request_size(max_key_size, max_value_size)
        self.state = state if state is not None else KeyValueState()
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: The thread the server runs in, when it has one of its own (see start).
        self._thread: ServerThread | None = None
        self._connections: set[ServerConnection] = set()
        #: Connections being opened, and those still in their handshake by address (oldest
        #: first), each a subset of the connections.
        self._opening: set[asyncio.Task[Any]] = set()
        self._handshaking: dict[str, dict[ServerConnection, None]] = {}
        self._per_host = max(MIN_HANDSHAKES_PER_HOST, expected_clients or 0)
        #: The addresses that clients holding the token connected from.
        self._job_hosts: set[str] = set()
        self._resume: asyncio.TimerHandle | None = None
        #: Refusals not logged yet, and when the next message may be logged.
        self._refusals = 0
        self._quiet_until = 0.0
        self._host = ""
        self._port = 0

    def __repr__(self) -> str:
        where = f"{self._host}:{self._port}" if self._listener is not None else "not started"
        return (
            f"<TCPStoreServer {where} clients={len(self._connections)} "
            f"keys={self.state.num_keys()} waiters={self.state.waiter_count} "
            f"auth={'on' if self.token is not None else 'off'}>"
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

    async def start(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        listen_fd: int | None = None,
        *,
        thread: bool = False,
    ) -> Self:
        """Listen on exactly ``host`` (not every interface) and ``port`` (0 picks a free one).

        Pass ``"0.0.0.0"`` or ``"::"`` to listen on every interface. With ``listen_fd`` (torch's
        ``master_listen_fd``), listen on that socket instead, bound already by the caller (to
        ``port``, unless ``port`` is 0); the server takes it over and closes it.

        With ``thread``, the server runs on an event loop of its own (of the caller's loop's
        kind), in a daemon thread of its own (``aiodist-store-server``), so that it answers
        while the caller's loop is blocked; :meth:`wait_for_count` and :meth:`aclose` reach
        it there from any loop. (A TCPStore that hosts its server starts it so.)

        Raises:
            DistUsageError: already started, the port is out of range, ``listen_fd`` is not a
                TCP socket, or the open-file limit cannot fit ``expected_clients`` (the
                message names the limit).
            DistStoreError: ``listen_fd`` is bound to another port than ``port``.
            DistNetworkError: the address cannot be resolved or the port is in use.
        """
        if self._listener is not None or self._thread is not None:
            raise DistUsageError(f"{self!r} is already started")
        if not 0 <= port <= 65535:
            raise DistUsageError(f"port must be in 0..65535, got {port}")
        if thread:
            self._thread = ServerThread("aiodist-store-server")
            await self._thread.start()
            try:
                await self._thread.run(self._listen(host, port, listen_fd))
            except BaseException:
                await self._thread.stop()
                self._thread = None
                raise
        else:
            await self._listen(host, port, listen_fd)
        return self

    async def _listen(self, host: str, port: int, listen_fd: int | None) -> None:
        if self.expected_clients:
            # One descriptor per client, and some slack for the ones a launcher or a
            # process group opens beside the store.
            ensure_open_files(
                self.expected_clients + 64,
                f"a store server for {self.expected_clients} clients",
            )
        loop = asyncio.get_running_loop()
        if listen_fd is None:
            sock = await self._bound_socket(loop, host, port)
        else:
            sock = _adopted_socket(listen_fd, port)
        try:
            configure_socket(sock, self.peer_timeout)
            sock.setblocking(False)
            # Room for every client expected to connect at once: past the backlog, a
            # thousand ranks connecting together meet SYN cookies, resets and 1 s retransmits.
            sock.listen(min(_MAX_BACKLOG, max(_MIN_BACKLOG, 2 * (self.expected_clients or 0))))
            # Accepted here, not by loop.create_server: out of descriptors, the standard
            # loop retries accept() once per backlog entry, logging each time, and uvloop
            # drops the pending clients; this server frees a descriptor instead.
            loop.add_reader(sock.fileno(), self._accept)
        except OSError as exc:
            sock.close()
            raise _listen_error(host, port, exc) from exc
        self._listener, self._loop = sock, loop
        bound = sock.getsockname()
        self._host, self._port = str(bound[0]), int(bound[1])
        logger.debug("store server listening on %s:%d", self._host, self._port)

    async def _bound_socket(
        self, loop: asyncio.AbstractEventLoop, host: str, port: int
    ) -> socket.socket:
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
        except OSError as exc:
            sock.close()
            raise _listen_error(host, port, exc) from exc
        return sock

    # -- accepting, and the connections still in their handshake ----------------------------
    def _accept(self) -> None:
        listener, loop = self._listener, self._loop
        assert listener is not None and loop is not None
        for _ in range(_ACCEPT_BATCH):
            try:
                sock, _address = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                self._cannot_accept(exc)
                return
            sock.setblocking(False)
            task = loop.create_task(loop.connect_accepted_socket(lambda: _Connection(self), sock))
            self._opening.add(task)
            task.add_done_callback(functools.partial(self._opened, sock))

    def _opened(self, sock: socket.socket, task: asyncio.Task[Any]) -> None:
        self._opening.discard(task)
        if task.cancelled() or task.exception() is not None:
            sock.close()  # (the client went away first, or the server closed)

    def _cannot_accept(self, exc: OSError) -> None:
        """``accept`` failed: stop accepting for a moment rather than retry in a loop. Out of
        descriptors, first close the oldest connection still in its handshake of the
        address that has the most such connections, and accept again soon after."""
        assert self._listener is not None and self._loop is not None
        self._loop.remove_reader(self._listener.fileno())
        crowd = max(self._handshaking.values(), key=len, default=None)
        if exc.errno in _OUT_OF_FILES and crowd:
            next(iter(crowd)).refuse(f"out of file descriptors ({exc.strerror})")
            delay = _RETRY_AFTER_CLOSING
        elif exc.errno in _OUT_OF_FILES and self._opening:
            delay = _RETRY_AFTER_CLOSING  # (connections accepted just now, counted soon)
        else:
            self.say(
                f"store server: cannot accept clients ({exc.strerror or exc}) with "
                f"{len(self._connections)} connected: trying again in "
                f"{_RETRY_AFTER_NOTHING:g} s"
                + (" (raise the open-file limit: ulimit -n)" if exc.errno in _OUT_OF_FILES else "")
            )
            delay = _RETRY_AFTER_NOTHING
        self._resume = self._loop.call_later(delay, self._listen_again)

    def _listen_again(self) -> None:
        self._resume = None
        if self._listener is not None and self._loop is not None:
            self._loop.add_reader(self._listener.fileno(), self._accept)

    def arrived(self, conn: ServerConnection) -> None:
        if self._listener is None:
            conn.abort()  # opened as the server closed
            return
        self._connections.add(conn)
        mine = self._handshaking.setdefault(conn._peer_host, {})
        mine[conn] = None
        if len(mine) > self._per_host:
            next(iter(mine)).refuse(
                f"more than {self._per_host} connections from {conn._peer_host} in their handshake"
            )

    def settled(self, conn: ServerConnection) -> None:
        """``conn`` was admitted, refused or is gone: it is no longer in its handshake."""
        mine = self._handshaking.get(conn._peer_host)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self._handshaking[conn._peer_host]

    def gone(self, conn: ServerConnection) -> None:
        self._connections.discard(conn)
        self.settled(conn)

    def say(self, message: str) -> None:
        """Log a warning about refused clients, at most every ``_LOG_INTERVAL`` seconds
        (with the number of those not said since): an attacker cannot flood the log."""
        self._refusals += 1
        now = time.monotonic()
        if now < self._quiet_until:
            return
        more = self._refusals - 1
        self._refusals = 0
        self._quiet_until = now + _LOG_INTERVAL
        if more:
            message += f" ({more} more refusals since the last such message)"
        logger.warning("%s", message)

    # -- torch clients --------------------------------------------------------------------
    def trust_host(self, host: str) -> None:
        """Record that a client holding the token connected from ``host``."""
        self._job_hosts.add(host)

    def admits_torch(self, transport: asyncio.BaseTransport | None) -> bool:
        """Whether the torch-wire client at the other end of ``transport`` may use the
        store (see ``allow_unauthenticated_torch``)."""
        policy = self.allow_unauthenticated_torch
        if self.token is None or policy is True:
            return True
        if policy is False or transport is None:
            return False
        client = transport.get_extra_info("peername")
        if plain_host(client) not in self._job_hosts:
            return False
        uid = local_peer_uid(transport.get_extra_info("sockname"), client)
        return uid is None or uid == os.geteuid()

    def torch_refusal(self) -> str:
        """Why a torch-wire client is not let in, as the log says."""
        if self.allow_unauthenticated_torch == "job_hosts":
            return (
                "this server requires an auth token and lets torch clients in only from the "
                "job's hosts, as the job's user"
            )
        return (
            "this server requires an auth token (start it with "
            "allow_unauthenticated_torch=True to admit torch clients)"
        )

    async def wait_for_count(self, key: bytes, target: int, timeout: float | None) -> int:
        """Wait until the ASCII counter ``key`` reaches ``target``; return its value.

        Raises:
            DistStoreTimeoutError: the counter stayed below ``target`` for ``timeout`` seconds
                (a ``DistStoreError``, in torch's words, which scripts match).
        """
        if self._thread is not None:
            return await self._thread.run(self._wait_for_count(key, target, timeout))
        return await self._wait_for_count(key, target, timeout)

    async def _wait_for_count(self, key: bytes, target: int, timeout: float | None) -> int:
        state = self.state
        start = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                await state.watch_count(key, target)
        except TimeoutError:
            count = state.count_or_none(key)
            waited = time.monotonic() - start
            raise DistStoreTimeoutError(
                f"Timed out after {waited:.0f} seconds waiting for clients. {count}/{target} "
                f"clients joined. (the store at {self._host}:{self._port} waited {waited:.1f} s "
                "for every instance of the job to join)"
            ) from None
        return state.counter(key)

    async def aclose(self) -> None:
        """Stop listening and drop every connection (their clients see the store go away);
        a server with a thread of its own stops it too."""
        thread, self._thread = self._thread, None
        if thread is not None and not thread.here:
            return  # (a forked child: the server and its thread are the parent's)
        if thread is not None:
            try:
                await thread.run(self._close())
            finally:
                await thread.stop()
        else:
            await self._close()

    async def _close(self) -> None:
        listener, self._listener = self._listener, None
        if listener is None:
            return
        assert self._loop is not None
        self._loop.remove_reader(listener.fileno())
        listener.close()
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        for task in list(self._opening):
            task.cancel()
        for conn in list(self._connections):
            conn.abort()
        await asyncio.gather(*self._opening, return_exceptions=True)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


def _listen_error(host: str, port: int, exc: OSError) -> DistNetworkError:
    return DistNetworkError(
        # torch's words first: scripts match them.
        "The server socket has failed to listen on any local network address: "
        f"store server cannot listen on {host}:{port}: {exc.strerror or exc}"
        + (" (the port is in use)" if exc.errno == errno.EADDRINUSE else "")
    )


def _adopted_socket(fd: int, port: int) -> socket.socket:
    """The listening socket a caller bound (torch's ``master_listen_fd``), checked."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise DistUsageError(f"master_listen_fd {fd} is not a socket: {exc}") from None
    bound = sock.getsockname()
    if sock.type != socket.SOCK_STREAM or not isinstance(bound, tuple):
        sock.detach()  # (not ours to close)
        raise DistUsageError(f"master_listen_fd {fd} is not a TCP socket")
    if port and bound[1] != port:
        sock.close()
        raise DistStoreError(  # torch's words
            f"listen fd {fd} is bound to port {bound[1]}, expected to be bound to port {port}"
        )
    return sock
