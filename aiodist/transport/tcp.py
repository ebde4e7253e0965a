"""The TCP transport: one non-blocking socket per pair of ranks, driven by the event loop.

Each connection is a plain non-blocking socket watched with ``loop.add_reader`` and
``loop.add_writer`` (both uvloop and the standard loop support these), not an asyncio
``Transport``/``Protocol`` pair. Owning the socket gives three things the protocol API does
not: a send is written by the ``send`` call itself when the socket has room, so its future
resolves before the caller yields; the transport knows exactly when the kernel has taken
the last byte of a user's buffer (an asyncio transport only reports its buffer size); and
the receive path can poll the socket for a few microseconds before the loop sleeps,
which cuts small-message latency by a factor of three or more.

Wire format, after a 16-byte handshake each way (magic, version, kind, rank, world size)::

    frame := group:u64 seq:u64 step:u64 nbytes:u64 (little endian) | nbytes of payload

A payload goes straight into the posted receive's memory when the receive was posted
before the header arrived, and into a staging buffer otherwise (see ``_mailbox``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import time
from collections import deque
from collections.abc import Coroutine
from typing import Any

from .._timeouts import Timeout, to_seconds
from ..errors import DistNetworkError, DistProtocolError, DistTimeoutError, DistUsageError
from ..store import Store
from ._mailbox import Inbound, Mailbox, as_bytes, fail_future, lost_peer_error
from .base import Tag, Transport

__all__ = ["TCPTransport"]

logger = logging.getLogger(__name__)

_MAGIC = b"AIOD"
_VERSION = 1
_HELLO, _ACCEPT, _REJECT = 0, 1, 2
# magic, version, kind, rank, world size
_HANDSHAKE = struct.Struct("<4sHHII")
# group id, sequence number, step, payload length
_HEADER = struct.Struct("<QQQQ")
_HEADER_SIZE = _HEADER.size
# A length this large is garbage, not a message: refuse to allocate a staging buffer for it.
_MAX_MESSAGE = 1 << 48

#: Bytes written per connection per loop turn. On loopback the sender's syscall also does
#: the receiver's TCP work; one 32 MiB write stalls the loop 6-12 ms, 1 MiB well under 1 ms.
WRITE_BUDGET = 1 << 20
#: Bytes read per connection per loop turn before giving other callbacks their turn.
READ_BUDGET = 2 << 20
# Payload bytes still to come at or above which reads go straight into the destination
# (smaller ones go through the read buffer, which also picks up the following headers).
_DIRECT_MIN = 16 << 10
_RX_BUFFER = 256 << 10
# At most this many buffers per sendmsg call (Linux allows 1024).
_IOV_MAX = 64
#: Seconds a rank polls its sockets without sleeping when a receive is not yet satisfied.
SPIN_SECONDS = 50e-6
#: How long ``aclose`` lets queued sends drain before closing the sockets.
CLOSE_DRAIN_SECONDS = 5.0
DEFAULT_CONNECT_TIMEOUT = 300.0


def _address_key(rank: int) -> str:
    return f"transport/addr/{rank}"


class _Out:
    """A queued slice of an outgoing frame; ``fut`` is set on the frame's last slice."""

    __slots__ = ("fut", "view")

    def __init__(self, view: memoryview, fut: asyncio.Future[None] | None) -> None:
        self.view = view
        self.fut = fut


class _Conn:
    """One established connection to a peer: the send queue and the frame reader."""

    __slots__ = (
        "_dest",
        "_doff",
        "_drem",
        "_inbound",
        "_rend",
        "_rstart",
        "_rx",
        "_rxv",
        "closed",
        "fd",
        "loop",
        "mailbox",
        "out",
        "owner",
        "peer",
        "sock",
        "writing",
    )

    def __init__(self, owner: TCPTransport, peer: int, sock: socket.socket) -> None:
        self.owner = owner
        self.peer = peer
        self.sock = sock
        self.fd = sock.fileno()
        self.loop = owner._loop
        self.mailbox = owner._mailbox
        self.out: deque[_Out] = deque()
        self.writing = False
        self.closed = False
        self._rx = bytearray(_RX_BUFFER)
        self._rxv = memoryview(self._rx)
        self._rstart = 0
        self._rend = 0
        self._inbound: Inbound | None = None
        self._dest = self._rxv[:0]
        self._doff = 0
        self._drem = 0
        self.loop.add_reader(self.fd, self.on_readable)

    def __repr__(self) -> str:
        return f"<_Conn rank {self.owner.rank} -> {self.peer} queued={len(self.out)}>"

    # -- sending ---------------------------------------------------------------------------

    def send(self, header: bytes, data: memoryview, fut: asyncio.Future[None]) -> None:
        out = self.out
        if out:
            # Frames leave in order: behind what is already queued.
            if data:
                out.append(_Out(memoryview(header), None))
                out.append(_Out(data, fut))
            else:
                out.append(_Out(memoryview(header), fut))
            return
        size = len(data)
        try:
            if not size:
                sent = self.sock.send(header)
            elif size <= WRITE_BUDGET:
                sent = self.sock.sendmsg((header, data))
            else:
                sent = self.sock.sendmsg((header, data[:WRITE_BUDGET]))
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            fail_future(fut, lost_peer_error(self.peer, f"send failed: {exc}"))
            self.owner._lose(self.peer, f"send failed: {exc}")
            return
        if sent == _HEADER_SIZE + size:
            fut.set_result(None)
            return
        if sent < _HEADER_SIZE:
            out.append(_Out(memoryview(header)[sent:], None if size else fut))
            rest = data
        else:
            rest = data[sent - _HEADER_SIZE :]
        if rest:
            out.append(_Out(rest, fut))
        self._start_writing()

    def _start_writing(self) -> None:
        if not self.writing:
            self.writing = True
            self.loop.add_writer(self.fd, self.on_writable)

    def on_writable(self) -> None:
        out = self.out
        budget = WRITE_BUDGET
        while out and budget > 0:
            views: list[memoryview] = []
            want = 0
            for item in out:
                view = item.view
                if want + len(view) > budget:
                    view = view[: budget - want]
                views.append(view)
                want += len(view)
                if want >= budget or len(views) >= _IOV_MAX:
                    break
            try:
                sent = self.sock.sendmsg(views)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self.owner._lose(self.peer, f"send failed: {exc}")
                return
            budget -= sent
            self._consume(sent)
            if sent < want:  # the socket buffer is full
                break
        if not out and self.writing:
            self.writing = False
            self.loop.remove_writer(self.fd)

    def _consume(self, sent: int) -> None:
        out = self.out
        while sent:
            item = out[0]
            size = len(item.view)
            if sent < size:
                item.view = item.view[sent:]
                return
            sent -= size
            out.popleft()
            if item.fut is not None and not item.fut.done():
                item.fut.set_result(None)
        # Zero-length remainders cannot be queued, so nothing else completes here.

    # -- receiving -------------------------------------------------------------------------

    def on_readable(self) -> None:
        if self.closed:
            return
        sock = self.sock
        budget = READ_BUDGET
        try:
            while budget > 0:
                if self._drem >= _DIRECT_MIN:
                    # The read buffer is empty here (it is drained into the destination
                    # before reading more), so the payload's bytes go straight to it.
                    doff = self._doff
                    want = min(self._drem, budget)
                    got = sock.recv_into(self._dest[doff : doff + want])
                    if not got:
                        self.owner._lose(self.peer, "connection closed by peer")
                        return
                    budget -= got
                    self._doff = doff + got
                    self._drem -= got
                    if not self._drem:
                        self._finish_inbound()
                else:
                    if self._rstart == self._rend:
                        self._rstart = self._rend = 0
                    elif _RX_BUFFER - self._rend < _HEADER_SIZE:
                        left = self._rend - self._rstart
                        self._rx[:left] = self._rx[self._rstart : self._rend]
                        self._rstart, self._rend = 0, left
                    want = _RX_BUFFER - self._rend
                    got = sock.recv_into(self._rxv[self._rend :])
                    if not got:
                        self.owner._lose(self.peer, "connection closed by peer")
                        return
                    budget -= got
                    self._rend += got
                    if not self._parse():
                        return
                if got < want:  # drained what the kernel had: skip the EAGAIN round trip
                    return
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.owner._lose(self.peer, f"receive failed: {exc}")

    def _finish_inbound(self) -> None:
        inbound = self._inbound
        assert inbound is not None
        self._inbound = None
        inbound.done()

    def _parse(self) -> bool:
        """Consume what the read buffer holds; return False if the connection was dropped."""
        rx = self._rx
        while True:
            avail = self._rend - self._rstart
            if self._inbound is None:
                if avail < _HEADER_SIZE:
                    return True
                group, seq, step, nbytes = _HEADER.unpack_from(rx, self._rstart)
                self._rstart += _HEADER_SIZE
                if nbytes >= _MAX_MESSAGE:
                    self.owner._lose(
                        self.peer,
                        f"frame header announces {nbytes} bytes",
                        DistProtocolError(
                            f"rank {self.peer} sent a frame header announcing {nbytes} bytes: "
                            "not an aiodist peer, or a corrupted stream"
                        ),
                    )
                    return False
                inbound = self.mailbox.incoming(self.peer, (group, seq, step), nbytes)
                if nbytes:
                    self._inbound = inbound
                    self._dest = inbound.buffer
                    self._doff = 0
                    self._drem = nbytes
            else:
                if not avail:
                    return True
                take = min(avail, self._drem)
                doff, rstart = self._doff, self._rstart
                self._dest[doff : doff + take] = self._rxv[rstart : rstart + take]
                self._doff = doff + take
                self._rstart = rstart + take
                self._drem -= take
                if not self._drem:
                    self._finish_inbound()

    def close(self) -> list[_Out]:
        """Stop watching and close the socket; return what was still queued."""
        if self.closed:
            return []
        self.closed = True
        self.loop.remove_reader(self.fd)
        if self.writing:
            self.writing = False
            self.loop.remove_writer(self.fd)
        self.sock.close()
        queued = list(self.out)
        self.out.clear()
        return queued


class _Peer:
    """What this rank knows about one other rank."""

    __slots__ = ("conn", "connecting", "error", "pending", "rank", "waiter")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.conn: _Conn | None = None
        # Our own connection attempt, while it runs.
        self.connecting: asyncio.Task[None] | None = None
        # Resolved when a connection is established, whichever side initiated it.
        self.waiter: asyncio.Future[None] | None = None
        # Frames sent before the connection existed, in order.
        self.pending: list[tuple[bytes, memoryview, asyncio.Future[None]]] = []
        self.error: BaseException | None = None


class TCPTransport(Transport):
    """A transport over TCP sockets, one connection per pair of ranks that talk.

    Every rank listens on an ephemeral port and publishes ``host:port`` in the store under
    ``transport/addr/<rank>``. A rank connects to a peer the first time it sends to it or
    posts a receive from it, so a rank of a ring holds two connections, not ``n - 1``.
    When two ranks connect to each other at once, the connection opened by the lower rank
    is kept and the other is refused during the handshake.

    Receives land directly in the caller's memory; sends are written from the caller's
    memory and their futures resolve once the kernel has taken every byte. When a peer's
    connection is lost, every pending send to it and receive from it (and every
    any-source receive) fails at once with :class:`~aiodist.errors.DistNetworkError`
    naming the rank.

    Create instances with :meth:`create`.

    Attributes:
        rank: this transport's global rank.
        world_size: the number of ranks in the world.
        address: the ``(host, port)`` this rank listens on.
    """

    #: Open transports in this process; polling only pays off when the peers are elsewhere.
    _open_count = 0

    def __init__(
        self,
        store: Store,
        rank: int,
        world_size: int,
        listener: socket.socket,
        host: str,
        timeout: float | None,
        spin: float | None,
        auto_spin: bool,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self._store = store
        self._loop = asyncio.get_running_loop()
        self._listener: socket.socket | None = listener
        self.address: tuple[str, int] = (host, listener.getsockname()[1])
        self._timeout = timeout
        self._spin = spin
        self._spin_auto = auto_spin
        self._spinning = False
        self._mailbox = Mailbox(rank)
        self._peers = [_Peer(r) for r in range(world_size)]
        self._conns: list[_Conn] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed: BaseException | None = None
        self._loop.add_reader(listener.fileno(), self._on_acceptable)
        TCPTransport._open_count += 1

    @classmethod
    async def create(
        cls,
        store: Store,
        rank: int,
        world_size: int,
        *,
        host: str = "127.0.0.1",
        timeout: Timeout = None,
        local_world_size: int | None = None,
        spin: float | None = None,
    ) -> TCPTransport:
        """Listen on ``host`` (ephemeral port) and publish the address in ``store``.

        Args:
            store: the job's store (already namespaced for this world); only used to
                publish and look up listening addresses.
            rank: this rank, in ``[0, world_size)``.
            world_size: the number of ranks.
            host: the address to listen on and to publish; a wildcard (``""``,
                ``"0.0.0.0"``, ``"::"``) publishes this machine's host name instead.
            timeout: seconds (or ``timedelta``) allowed for looking up a peer's address and
                connecting to it; ``None`` means 300 s.
            local_world_size: how many ranks run on this machine; by default the
                ``LOCAL_WORLD_SIZE`` environment variable, else ``world_size``. Receives
                poll their socket for up to 50 µs before sleeping only when this is at most
                the number of CPUs this process may use.
            spin: seconds to poll before sleeping, overriding the automatic choice
                (``0`` never polls).

        Returns:
            The listening transport. Connections are opened when first needed.

        Raises:
            DistUsageError: ``rank``, ``world_size``, ``timeout`` or ``spin`` is invalid.
            OSError: the listening socket could not be created.
        """
        if not isinstance(world_size, int) or world_size < 1:
            raise DistUsageError(f"world_size must be a positive integer, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise DistUsageError(f"rank must be in [0, {world_size}), got {rank!r}")
        seconds = to_seconds(timeout, DEFAULT_CONNECT_TIMEOUT)
        auto_spin = spin is None
        if spin is None:
            local = local_world_size
            if local is None:
                local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            if local <= len(os.sched_getaffinity(0)):
                spin = SPIN_SECONDS
        elif spin < 0:
            raise DistUsageError(f"spin must be a non-negative number of seconds, got {spin}")
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(
            host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, _, _, _, sockaddr = infos[0]
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setblocking(False)
            listener.bind(sockaddr)
            listener.listen(min(max(world_size, 128), 4096))
            public = host if host not in ("", "0.0.0.0", "::") else socket.gethostname()
            self = cls(store, rank, world_size, listener, public, seconds, spin, auto_spin)
        except BaseException:
            listener.close()
            raise
        try:
            await store.set(_address_key(rank), f"{public}:{self.address[1]}")
        except BaseException:
            await self.aclose()
            raise
        logger.debug("rank %d listening on %s:%d", rank, public, self.address[1])
        return self

    def __repr__(self) -> str:
        state = "closed" if self._closed is not None else "open"
        return (
            f"<TCPTransport rank={self.rank}/{self.world_size} "
            f"address={self.address[0]}:{self.address[1]} "
            f"connected={self.connected_peers()} {state}>"
        )

    def connected_peers(self) -> list[int]:
        """Return the ranks this transport holds an open connection to."""
        return [c.peer for c in self._conns]

    # -- the Transport interface -----------------------------------------------------------

    def send(self, peer: int, tag: Tag, data: memoryview) -> asyncio.Future[None]:
        """Send ``data`` to rank ``peer`` without copying it.

        The future resolves once the kernel holds every byte (the caller may then reuse
        ``data``), and fails with ``DistNetworkError`` if the peer is lost first.

        Raises:
            DistUsageError: ``peer`` is out of range, the tag is malformed, or ``data`` is
                not contiguous.
        """
        data = as_bytes(data, writable=False)
        try:
            header = _HEADER.pack(tag[0], tag[1], tag[2], len(data))
        except (struct.error, TypeError, IndexError):
            raise DistUsageError(
                f"a tag must be three integers in [0, 2**64) (group id, seq, step), got {tag!r}"
            ) from None
        fut: asyncio.Future[None] = self._loop.create_future()
        try:
            p = self._peers[peer]
        except (IndexError, TypeError):
            raise DistUsageError(
                f"peer must be a rank in [0, {self.world_size}), got {peer!r}"
            ) from None
        if peer < 0:
            raise DistUsageError(f"peer must be a rank in [0, {self.world_size}), got {peer}")
        conn = p.conn
        if conn is not None:
            conn.send(header, data, fut)
        elif self._closed is not None:
            fail_future(fut, self._closed)
        elif p.error is not None:
            fail_future(fut, p.error)
        elif peer == self.rank:
            self._mailbox.deliver(peer, (tag[0], tag[1], tag[2]), data)
            fut.set_result(None)
        else:
            p.pending.append((header, data, fut))
            self._connect_soon(p)
        return fut

    def recv_into(self, peer: int | None, tag: Tag, out: memoryview) -> asyncio.Future[int]:
        """Receive the next ``tag`` message from ``peer`` (``None``: any rank) into ``out``.

        The future resolves to the sender's rank; it fails with ``DistUsageError`` if the
        message has another length than ``out``, with ``DistNetworkError`` if the peer is
        lost first.

        Raises:
            DistUsageError: ``peer`` is out of range, the tag is malformed, or ``out`` is
                read-only or not contiguous.
        """
        if peer is not None and (not isinstance(peer, int) or not 0 <= peer < self.world_size):
            raise DistUsageError(f"peer must be a rank in [0, {self.world_size}), got {peer!r}")
        try:
            _HEADER.pack(tag[0], tag[1], tag[2], 0)
        except (struct.error, TypeError, IndexError):
            raise DistUsageError(
                f"a tag must be three integers in [0, 2**64) (group id, seq, step), got {tag!r}"
            ) from None
        fut = self._mailbox.post(peer, tag, as_bytes(out, writable=True))
        if not fut.done():
            if peer is not None and peer != self.rank:
                p = self._peers[peer]
                if p.conn is None and p.error is None and self._closed is None:
                    # Connect now so that a peer that is already gone is noticed.
                    self._connect_soon(p)
            if self._spin and not self._spinning and self._conns:
                self._spinning = True
                self._loop.call_soon(self._poll, fut)
        return fut

    def abort(self, exc: BaseException) -> None:
        """Fail every pending send and receive with ``exc`` and close every socket at once."""
        if self._closed is not None:
            return
        self._closed = exc
        TCPTransport._open_count -= 1
        if self._listener is not None:
            self._loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
        for task in self._tasks:
            task.cancel()
        for p in self._peers:
            for _, _, fut in p.pending:
                fail_future(fut, exc)
            p.pending.clear()
            if p.waiter is not None:
                fail_future(p.waiter, exc)
        for conn in self._conns:
            for item in conn.close():
                if item.fut is not None:
                    fail_future(item.fut, exc)
            self._peers[conn.peer].conn = None
        self._conns.clear()
        self._mailbox.abort(exc)
        logger.debug("rank %d transport aborted: %s", self.rank, exc)

    async def aclose(self) -> None:
        """Let queued sends drain (up to 5 s), then close every socket and the listener.

        Pending receives fail with ``DistNetworkError``. Closing twice is harmless.
        """
        if self._closed is None:
            queued = [item.fut for c in self._conns for item in c.out if item.fut is not None]
            queued += [fut for p in self._peers for _, _, fut in p.pending]
            if queued:
                await asyncio.wait(queued, timeout=CLOSE_DRAIN_SECONDS)
            self.abort(DistNetworkError(f"the transport of rank {self.rank} was closed"))
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- polling ---------------------------------------------------------------------------

    def _poll(self, fut: asyncio.Future[int]) -> None:
        # Runs once the task that posted ``fut`` has yielded (its own sends are written by
        # then). Polling the sockets for a few microseconds catches a peer's quick answer
        # without the cost of sleeping in epoll and being woken again.
        self._spinning = False
        assert self._spin is not None
        if (
            fut.done()
            or self._closed is not None
            # Several transports in one process: the peers likely share this loop, and
            # polling would only keep them from running.
            or (self._spin_auto and TCPTransport._open_count > 1)
        ):
            return
        deadline = time.perf_counter() + self._spin
        conns = tuple(self._conns)  # a lost connection leaves the list while we iterate
        while True:
            for conn in conns:
                conn.on_readable()
            if fut.done() or self._closed is not None or time.perf_counter() >= deadline:
                return
            os.sched_yield()

    # -- connections -----------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _connect_soon(self, p: _Peer) -> None:
        if p.connecting is None and p.waiter is None:
            p.waiter = self._loop.create_future()
            p.connecting = self._spawn(self._connect(p))

    async def _connect(self, p: _Peer) -> None:
        peer = p.rank
        waiter = p.waiter
        assert waiter is not None
        sock: socket.socket | None = None
        try:
            async with asyncio.timeout(self._timeout):
                address = (await self._store.get(_address_key(peer))).decode()
                host, _, port = address.rpartition(":")
                infos = await self._loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
                family, _, _, _, sockaddr = infos[0]
                sock = socket.socket(family, socket.SOCK_STREAM)
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    await self._loop.sock_connect(sock, sockaddr)
                except OSError as exc:
                    raise DistNetworkError(
                        f"lost connection to rank {peer}: cannot connect to {address}: {exc}"
                    ) from exc
                await self._loop.sock_sendall(
                    sock, _HANDSHAKE.pack(_MAGIC, _VERSION, _HELLO, self.rank, self.world_size)
                )
                kind, their_rank = await self._read_handshake(sock, address)
                if their_rank != peer:
                    raise DistProtocolError(
                        f"the address published by rank {peer} ({address}) is rank {their_rank}'s"
                    )
                p.connecting = None
                if kind == _ACCEPT:
                    self._establish(peer, sock)
                    sock = None
                    return
                # Refused: the peer's own connection to us is the one kept.
                sock.close()
                sock = None
                await asyncio.shield(waiter)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            self._fail_peer(
                p,
                DistTimeoutError(
                    f"connecting to rank {peer} took more than {self._timeout} s "
                    "(its address never appeared in the store, or it did not answer)"
                ),
            )
        except (DistNetworkError, DistProtocolError) as exc:
            self._fail_peer(p, exc)
        except Exception as exc:
            self._fail_peer(p, lost_peer_error(peer, f"connecting failed: {exc!r}"))
        finally:
            p.connecting = None
            if sock is not None:
                sock.close()

    async def _read_handshake(self, sock: socket.socket, who: str) -> tuple[int, int]:
        buf = bytearray(_HANDSHAKE.size)
        view = memoryview(buf)
        got = 0
        while got < len(buf):
            n = await self._loop.sock_recv_into(sock, view[got:])
            if not n:
                raise DistNetworkError(f"{who} closed the connection during the handshake")
            got += n
        magic, version, kind, rank, world_size = _HANDSHAKE.unpack(buf)
        if magic != _MAGIC or kind not in (_HELLO, _ACCEPT, _REJECT):
            raise DistProtocolError(f"{who} sent {bytes(buf)!r}, not an aiodist handshake")
        if version != _VERSION:
            raise DistProtocolError(
                f"{who} speaks transport protocol version {version}, this rank {_VERSION}"
            )
        if world_size != self.world_size:
            raise DistProtocolError(
                f"{who} belongs to a world of {world_size} ranks, this one has {self.world_size}"
            )
        if not 0 <= rank < self.world_size or rank == self.rank:
            raise DistProtocolError(f"{who} claims to be rank {rank}")
        return kind, rank

    def _on_acceptable(self) -> None:
        listener = self._listener
        while listener is not None:
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # Out of file descriptors and the like: the peer's connect will time out.
                logger.warning("rank %d could not accept a connection: %s", self.rank, exc)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._spawn(self._accept(sock, f"{addr[0]}:{addr[1]}"))

    async def _accept(self, sock: socket.socket, who: str) -> None:
        keep = False
        try:
            async with asyncio.timeout(self._timeout):
                kind, peer = await self._read_handshake(sock, f"the connection from {who}")
            if kind != _HELLO:
                raise DistProtocolError(f"the connection from {who} did not start with a hello")
            p = self._peers[peer]
            # Keep one connection per pair: if both ranks are connecting, the lower rank's
            # wins; a peer that is already connected or failed is refused.
            accept = (
                p.conn is None and p.error is None and (p.connecting is None or peer < self.rank)
            )
            reply = _HANDSHAKE.pack(
                _MAGIC, _VERSION, _ACCEPT if accept else _REJECT, self.rank, self.world_size
            )
            # Sixteen bytes on a fresh socket: written at once.
            await self._loop.sock_sendall(sock, reply)
            if accept:
                self._establish(peer, sock)
                keep = True
        except asyncio.CancelledError:
            raise
        except DistProtocolError as exc:
            logger.warning("rank %d dropped a connection: %s", self.rank, exc)
        except (OSError, TimeoutError) as exc:
            logger.debug("rank %d: handshake with %s failed: %r", self.rank, who, exc)
        finally:
            if not keep:
                sock.close()

    def _establish(self, peer: int, sock: socket.socket) -> None:
        p = self._peers[peer]
        if self._closed is not None or p.conn is not None:
            # Closed meanwhile; a second connection cannot happen by the tie-break rule.
            sock.close()
            return
        conn = _Conn(self, peer, sock)
        p.conn = conn
        self._conns.append(conn)
        if p.waiter is not None and not p.waiter.done():
            p.waiter.set_result(None)
        p.waiter = None
        pending, p.pending = p.pending, []
        for header, data, fut in pending:
            conn.send(header, data, fut)
        logger.debug("rank %d connected to rank %d", self.rank, peer)

    def _lose(self, peer: int, reason: str, exc: BaseException | None = None) -> None:
        """Drop the connection to ``peer`` and fail everything that depends on it."""
        self._fail_peer(self._peers[peer], exc or lost_peer_error(peer, reason))

    def _fail_peer(self, p: _Peer, exc: BaseException) -> None:
        if p.error is not None or self._closed is not None:
            return
        p.error = exc
        conn = p.conn
        if conn is not None:
            p.conn = None
            self._conns.remove(conn)
            for item in conn.close():
                if item.fut is not None:
                    fail_future(item.fut, exc)
        for _, _, fut in p.pending:
            fail_future(fut, exc)
        p.pending.clear()
        if p.waiter is not None:
            fail_future(p.waiter, exc)
            p.waiter = None
        if p.connecting is not None and p.connecting is not asyncio.current_task():
            p.connecting.cancel()
        self._mailbox.fail_peer(p.rank, exc)
        logger.info("rank %d lost rank %d: %s", self.rank, p.rank, exc)
