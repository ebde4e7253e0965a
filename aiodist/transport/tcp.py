"""The TCP transport: one connection per pair of ranks, an asyncio ``BufferedProtocol`` each.

This module holds the transport (the listener, connecting to a peer when first needed, one
connection per pair, polling the sockets before sleeping, abort and close) and describes the
wire format. One connection's side of it, the handshake and reading and writing frames, is
:class:`~aiodist.transport._tcp_connection.TCPConnection`'s.

Wire format. After connecting, the connecting rank sends a 90-byte hello and the accepting
rank answers with 90 bytes (``<4sHHHII32s32sQ``: magic ``AIOD``, version, kind, flags, rank,
world size, nonce, proof, staging bound; kind is hello, accept, reject or refused; the
staging bound is the bytes the sender stages at most for the other side, which starts with
that much credit, see :mod:`aiodist.transport._flow`). With a shared secret
(``auth_token``, flag bit 0), the answer's proof is an HMAC of the token over both nonces,
the ranks and the world size, and the connecting rank checks it, then sends 32 bytes of
proof of its own, which the accepting rank checks before it reads a single frame. A side
without the token, or with another one, is refused and never gets to send a frame. A
reject with flag bit 1 says the rejecting rank is connected already to a process that
claimed the connecting rank (rather than keeping the other of two connections opened at
once). Then both directions carry frames::

    frame := group:u64 seq:u64 step:u64 word:u64 fingerprint:32s | payload

``word`` is the payload's length and the message's kind (eager, free, an announcement
without payload, the payload of a cleared announcement), or one of the lengths that no
payload can have that mark control frames, whose ``step`` is the length of the UTF-8 text
that follows: ``2**64 - 1`` says goodbye (the sender closes in order; the text says why it
leaves, e.g. that its process is exiting), ``2**64 - 2`` rejects operation ``(group, seq)``
with the text as the reason, ``2**64 - 3`` says the sender is aborting, with the text as the
cause; ``2**64 - 4`` to ``2**64 - 7`` are flow control (:mod:`aiodist.transport._frames` has
the details). An aborting rank writes that last frame only at a frame boundary, then shuts
down its sending side and keeps reading until the peer closes: closing a socket with unread
bytes would send a reset, and a reset makes the peer's kernel drop the frame before the peer
reads it.

Before a connection has finished its handshake, it costs the accepting rank the
handshake's bytes and a descriptor, for a bounded time and in a bounded number: it must
finish within the transport's timeout, the connections of one address in their handshake
are capped (past the cap that address's oldest goes), and out of file descriptors the
oldest such connection of the most crowded address is closed to accept the next, instead
of retrying ``accept`` in a loop. Such refusals are logged at most every few seconds.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import socket
import struct
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar

from .._util._auth import resolve_token
from .._util._timeouts import DEFAULT_SETUP_TIMEOUT, Timeout, to_seconds
from .._util._wait import SPIN_SECONDS, Backoff, local_ranks, ranks_fit, spin_until
from ..errors import (
    DistError,
    DistNetworkError,
    DistProtocolError,
    DistTimeoutError,
    DistUsageError,
    map_exceptions,
)
from ..store._sockets import resolve_peer_timeout
from ._failures import fail_future
from ._flow import PeerFlow, resolve_staging_bytes
from ._frames import ABORTING, BYE, REJECTION, control_frame
from ._mailbox import Mailbox
from ._tcp_connection import (
    ABORT_LINGER_SECONDS as ABORT_LINGER_SECONDS,  # the connection's now; still importable here
    DONE,
    OPEN,
    READ_BUDGET as READ_BUDGET,  # likewise
    WRITE_BUDGET as WRITE_BUDGET,  # likewise
    TCPConnection,
)
from .base import (
    CLOSED_REASON,
    Departure,
    PeerDirectory,
    Tag,
    Transport,
    abort_text,
    as_bytes,
    check_tag,
    departure_of,
    lost_peer_error,
    peer_aborted_error,
)

__all__ = ["TCPTransport"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: How long ``aclose`` lets queued sends drain before closing the connections.
CLOSE_DRAIN_SECONDS = 5.0
#: How long leaving waits for the store to record it, and a failed connect for the store to
#: say whether the peer left meanwhile.
LEFT_CHECK_SECONDS = 1.0
#: How often a rank whose connection to a peer is still forming looks whether the peer
#: left meanwhile.
TIE_RECHECK_SECONDS = 0.2
#: Connections of one address that may be in their handshake at once, at the least (the
#: world size, if larger): past it, that address's oldest one is closed.
MIN_HANDSHAKES_PER_HOST = 64
#: The listen backlog: room for every other rank connecting at once (the kernel caps it at
#: net.core.somaxconn).
_MIN_BACKLOG, _MAX_BACKLOG = 128, 65535
#: What ``accept`` says when this process (or the system) has no descriptor left.
_OUT_OF_FILES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: Seconds before accepting again after ``accept`` failed: after closing a connection still
#: in its handshake (the loop releases its descriptor), or with none to close.
_RETRY_AFTER_CLOSING = 0.01
ACCEPT_RETRY_SECONDS = 1.0
#: Seconds between two log messages about connections refused or dropped before their
#: handshake finished (the count of those in between is given): nobody can flood the log.
_LOG_INTERVAL = 10.0


def _close_unless_adopted(sock: socket.socket, task: asyncio.Task[None]) -> None:
    # An accepted socket whose transport was never made (the task was cancelled, even
    # before its first step, or failed) is closed here; a transport that was made owns it.
    if task.cancelled() or task.exception() is not None:
        sock.close()


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _retrieve(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()


class _Peer:
    """What this rank knows about one other rank, and where its frames go."""

    __slots__ = (
        "conn",
        "connecting",
        "error",
        "flow",
        "pending",
        "rank",
        "transport",
        "waiter",
    )

    def __init__(self, transport: TCPTransport, rank: int, staging: int) -> None:
        self.transport = transport
        self.rank = rank
        self.flow = PeerFlow(rank, staging, self.write)
        self.conn: TCPConnection | None = None
        # Our own connection attempt, while it runs.
        self.connecting: asyncio.Task[None] | None = None
        # Resolved when a connection is established, whichever side opened it.
        self.waiter: asyncio.Future[None] | None = None
        # What was sent before the connection existed, in order: how to write each once it
        # does (a message is framed then, when the peer's credit is known), and its future.
        self.pending: list[tuple[Callable[[], None], asyncio.Future[None]]] = []
        self.error: BaseException | None = None

    def write(
        self,
        header: bytes,
        data: memoryview,
        fut: asyncio.Future[None] | None,
        bulk: bool = False,
    ) -> None:
        """Write a frame to this peer (see :data:`aiodist.transport._flow.Write`)."""
        if fut is None:
            # Nobody waits for a control frame: a peer that is gone needs none.
            fut = self.transport.loop.create_future()
            fut.add_done_callback(_retrieve)
        conn = self.conn
        if conn is not None:
            conn.send(header, data, fut, bulk)
        elif self.transport.closed is not None:
            fail_future(fut, self.transport.closed)
        elif self.error is not None:
            fail_future(fut, self.error)
        else:
            self.pending.append((functools.partial(self.write, header, data, fut, bulk), fut))
            self.transport._connect_soon(self)


async def _bind(host: str) -> tuple[socket.socket, tuple[str, int]]:
    """A socket bound on ``host`` (a free port), and the address peers reach it at."""
    loop = asyncio.get_running_loop()
    wildcard = host in ("", "0.0.0.0", "::")
    infos = await loop.getaddrinfo(
        host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    family, _, _, _, sockaddr = infos[0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        if family == socket.AF_INET6 and wildcard:
            listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        listener.bind(sockaddr)
        public = socket.gethostname() if wildcard else host
        return listener, (public, int(listener.getsockname()[1]))
    except BaseException:
        listener.close()
        raise


class TCPTransport(Transport):
    """A transport over TCP, one connection per pair of ranks that talk.

    Every rank listens on an ephemeral port and publishes ``host:port`` in the world's
    :class:`~aiodist.transport.base.PeerDirectory`. A rank connects to a peer the first time it sends to it or
    posts a receive from it, so a rank of a ring holds two connections, not ``n - 1``.
    When two ranks connect to each other at once, the connection opened by the lower rank
    is kept and the other is refused during the handshake.

    Receives land directly in the caller's memory; sends are written from the caller's
    memory and their futures resolve once no buffer of the event loop refers to it. When a
    connection breaks, every pending send to that peer, every receive from it and every
    any-source receive fail at once with :class:`~aiodist.errors.DistNetworkError` naming
    the rank. A peer that closes in order (``aclose``) fails only the receives from it.

    Create instances with :meth:`create`.

    Attributes:
        rank: this transport's global rank.
        world_size: the number of ranks in the world.
        address: the ``(host, port)`` this rank listens on and published.
    """

    #: Open transports in this process; polling only pays off when the peers are elsewhere.
    _open_count = 0

    def __init__(
        self,
        directory: PeerDirectory,
        rank: int,
        world_size: int,
        address: tuple[str, int],
        timeout: float | None,
        spin: float,
        auto_spin: bool,
        token: bytes | None,
        mailbox: Mailbox | None,
        staging: int,
    ) -> None:
        super().__init__(rank, world_size, mailbox)
        self.address = address
        self._directory = directory
        self.loop = asyncio.get_running_loop()
        # The listening socket, accepted from by _accept while the transport is open.
        self._listener: socket.socket | None = None
        self.timeout = timeout
        self._spin = spin
        self._spin_auto = auto_spin
        self._spinning = False
        # When receives skip polling for a while (polls ran out of time in a row).
        self._backoff = Backoff()
        self.staging = staging
        self._peers = [_Peer(self, r, staging) for r in range(world_size)]
        # Ranks another transport of this rank reaches: they never connect over TCP.
        self._elsewhere: frozenset[int] = frozenset()
        self._conns: list[TCPConnection] = []
        # Connections whose transport exists and has not reported connection_lost yet.
        self.live: set[TCPConnection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.closed: BaseException | None = None
        self.token = token
        self.peer_timeout = resolve_peer_timeout()
        # Accepted sockets whose connection is not made yet, and the accepted connections
        # still in their handshake by address (oldest first).
        self._adopting = 0
        self._handshaking: dict[str, dict[TCPConnection, None]] = {}
        self._per_host = max(MIN_HANDSHAKES_PER_HOST, world_size)
        self._resume: asyncio.TimerHandle | None = None
        # Refusals not logged yet, and when the next message may be logged.
        self._refusals = 0
        self._quiet_until = 0.0
        TCPTransport._open_count += 1

    @classmethod
    async def create(
        cls,
        directory: PeerDirectory,
        rank: int,
        world_size: int,
        *,
        host: str = "127.0.0.1",
        mailbox: Mailbox | None = None,
        timeout: Timeout = None,
        local_world_size: int | None = None,
        spin: float | None = None,
        auth_token: str | bytes | None = None,
        staging_bytes: int | None = None,
    ) -> TCPTransport:
        """Listen on ``host`` (ephemeral port) and publish the address in ``directory``.

        Args:
            directory: where the world's ranks publish and look up listening addresses.
            rank: this rank, in ``[0, world_size)``.
            world_size: the number of ranks.
            host: the address to listen on and to publish; a wildcard (``""``,
                ``"0.0.0.0"``, ``"::"``) listens on every interface and publishes this
                machine's host name.
            mailbox: the mailbox to deliver into, when this transport shares it with
                another one of this rank; by default a mailbox of its own.
            timeout: seconds (or ``timedelta``) allowed for looking up a peer's address and
                connecting to it; ``None`` means 300 s.
            local_world_size: how many ranks run on this machine; by default the
                ``LOCAL_WORLD_SIZE`` environment variable, else ``world_size``. Receives
                poll their sockets for up to 50 µs before sleeping only when this is at most
                the number of CPUs this process may use.
            spin: seconds to poll before sleeping, overriding the automatic choice
                (``0`` never polls).
            auth_token: shared secret every peer connection must prove it holds (HMAC
                challenge-response in both directions); ``None`` reads
                ``$AIODIST_AUTH_TOKEN``; unset means no authentication. Every rank needs
                the same token.
            staging_bytes: the bytes of messages from one peer this rank holds at most
                for receives not posted yet; a message that does not fit waits for its
                receive (see :mod:`aiodist.transport._flow`). ``None`` reads
                ``$AIODIST_STAGING_BYTES``, else 16 MiB. Ranks may differ.

        Returns:
            The listening transport. Connections are opened when first needed.

        Raises:
            DistUsageError: ``rank``, ``world_size``, ``timeout``, ``spin`` or
                ``staging_bytes`` is invalid, or the token is empty.
            OSError: the listening socket could not be created.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise DistUsageError(f"world_size must be a positive integer, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise DistUsageError(f"rank must be in [0, {world_size}), got {rank!r}")
        seconds = to_seconds(timeout, DEFAULT_SETUP_TIMEOUT)
        token = resolve_token(auth_token)
        staging = resolve_staging_bytes(staging_bytes)
        auto_spin = spin is None
        if spin is None:
            local = local_ranks(world_size) if local_world_size is None else local_world_size
            spin = SPIN_SECONDS if ranks_fit(local) else 0.0
        elif not isinstance(spin, int | float) or spin < 0:
            raise DistUsageError(f"spin must be a non-negative number of seconds, got {spin!r}")
        loop = asyncio.get_running_loop()
        listener, address = await _bind(host)
        public = address[0]
        self = cls(
            directory,
            rank,
            world_size,
            address,
            seconds,
            float(spin),
            auto_spin,
            token,
            mailbox,
            staging,
        )
        try:
            self._listener = listener
            listener.listen(min(max(world_size, _MIN_BACKLOG), _MAX_BACKLOG))
            listener.setblocking(False)
            loop.add_reader(listener, self._accept)
            await directory.publish(rank, _format_address(public, address[1]))
        except BaseException:
            await self.aclose()
            raise
        logger.debug("rank %d listening on %s:%d", rank, public, address[1])
        return self

    def __repr__(self) -> str:
        state = "closed" if self.closed is not None else "open"
        return (
            f"<TCPTransport rank={self.rank}/{self.world_size} "
            f"address={self.address[0]}:{self.address[1]} "
            f"connected={self.connected_peers()} "
            f"auth={'on' if self.token is not None else 'off'} {state}>"
        )

    def connected_peers(self) -> list[int]:
        """Return the ranks this transport holds an open connection to."""
        return [c.peer for c in self._conns if c.peer is not None]

    # -- the Transport interface -----------------------------------------------------------

    def send(
        self, peer: int, tag: Tag, data: memoryview, *, cleared: bool = False
    ) -> asyncio.Future[None]:
        """Send ``data`` to rank ``peer`` without copying it.

        The future resolves once no buffer of the event loop refers to ``data`` (the caller
        may then reuse it): at once for a message within the peer's staging bound, once the
        peer posted its receive for a larger one. It fails with ``DistNetworkError`` if the
        peer is lost first.

        Raises:
            DistUsageError: ``peer`` is out of range, the tag is malformed, or ``data`` is
                not contiguous.
        """
        data = as_bytes(data, writable=False)
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < self.world_size:
            raise DistUsageError(f"peer must be a rank in [0, {self.world_size}), got {peer!r}")
        fut: asyncio.Future[None] = self.loop.create_future()
        p = self._peers[peer]
        conn = p.conn
        if conn is not None:
            # The common case, kept short: packing the header checks the tag.
            try:
                fp = self.mailbox.fingerprint_of(tag[0], tag[1])
                header = p.flow.header(tag, len(data), fp, cleared)
                if header is None:
                    p.flow.announce(tag, data, fp, fut)
            except (struct.error, TypeError, IndexError):
                check_tag(tag)  # raises the usage error for a malformed tag
                raise
            if header is not None:
                conn.send(header, data, fut)
            return fut
        check_tag(tag)
        fp = self.mailbox.fingerprint_of(tag[0], tag[1])
        if peer == self.rank and self.closed is None:
            self.mailbox.deliver(peer, (tag[0], tag[1], tag[2]), data, fp)
            fut.set_result(None)
        elif self.closed is not None:
            fail_future(fut, self.closed)
        elif p.error is not None:
            fail_future(fut, p.error)
        else:
            # Framed once connected, when the peer's credit is known.
            p.pending.append((functools.partial(p.flow.send, tag, data, fp, fut, cleared), fut))
            self._connect_soon(p)
        return fut

    def send_reject(self, peer: int, group: int, seq: int, reason: str) -> None:
        """Tell ``peer`` that this rank rejected operation ``(group, seq)``, and why."""
        if peer == self.rank:
            self.mailbox.reject(peer, group, seq, reason)
            return
        frame = control_frame(REJECTION, group, seq, reason)
        self._peers[peer].write(frame, memoryview(b""), None)

    def recv_into(self, peer: int | None, tag: Tag, out: memoryview) -> asyncio.Future[int]:
        """Receive the next ``tag`` message from ``peer`` (``None``: any rank) into ``out``.

        The future resolves to the sender's rank; it fails with ``DistUsageError`` if the
        message has another length than ``out``, with ``DistNetworkError`` if the peer is
        lost first.

        Raises:
            DistUsageError: ``peer`` is out of range, the tag is malformed, or ``out`` is
                read-only or not contiguous.
        """
        if peer is not None and (
            isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < self.world_size
        ):
            raise DistUsageError(f"peer must be a rank in [0, {self.world_size}), got {peer!r}")
        check_tag(tag)
        fut = self.mailbox.post(peer, tag, as_bytes(out, writable=True))
        if not fut.done():
            if peer is not None and peer != self.rank:
                p = self._peers[peer]
                if p.conn is None and p.error is None and self.closed is None:
                    # Connect now, so that a peer that is already gone is noticed.
                    self._connect_soon(p)
            if self._spin and not self._spinning and self._conns and not self._backoff.skips():
                self._spinning = True
                self.loop.call_soon(self._poll, fut)
        return fut

    def abort(self, exc: BaseException) -> None:
        """Fail every pending send and receive with ``exc`` and drop every connection."""
        if self.closed is not None:
            return
        self.closed = exc
        TCPTransport._open_count -= 1
        self._stop_listening()
        for task in self._tasks:
            task.cancel()
        for p in self._peers:
            for _, fut in p.pending:
                fail_future(fut, exc)
            p.pending.clear()
            p.flow.fail(exc)
            if p.waiter is not None:
                fail_future(p.waiter, exc)
            p.conn = None
        # Connected peers learn why before their connection drops.
        frame = control_frame(ABORTING, 0, 0, abort_text(exc))
        for conn in list(self.live):
            conn.close_after(frame)
            conn.fail_sends(exc)
        self._conns.clear()
        self.mailbox.abort(exc)
        logger.debug("rank %d transport aborted: %s", self.rank, exc)

    async def aclose(self, reason: str | None = None) -> None:
        """Let queued sends drain (up to 5 s), say goodbye to every peer and close.

        Pending receives fail with ``DistNetworkError``; peers see an orderly close (their
        receives from this rank fail, their any-source receives keep waiting for others).
        ``reason`` is what they are told (see :meth:`Transport.aclose`); once what was
        queued has left, it also replaces this rank's address in the directory, so that a
        peer that tries to connect later learns it at once. Closing twice is harmless.
        """
        if self.closed is None:
            queued = [f for c in self._conns for _, f in c.queue if f is not None]
            queued += [f for c in self._conns for f in c.handed]
            queued += [f for c in self._conns for _, _, f in c.bulk]
            queued += [f for p in self._peers for _, f in p.pending]
            queued += [f for p in self._peers for f in p.flow.waiting()]
            if queued:
                await asyncio.wait(queued, timeout=CLOSE_DRAIN_SECONDS)
            if reason is not None and self.closed is None:
                await self._withdraw(reason)
            if self.closed is None:
                bye = control_frame(BYE, 0, 0, reason or CLOSED_REASON)
                for conn in self._conns:
                    conn.close_after(bye)
                self.abort(DistNetworkError(f"the transport of rank {self.rank} was closed"))
        # Done tasks are dropped here rather than left to their done-callbacks: since
        # Python 3.12, gathering tasks that are all done does not yield to the loop, so
        # those callbacks would never get a turn.
        while self._tasks:
            tasks = tuple(self._tasks)
            await asyncio.gather(*tasks, return_exceptions=True)
            self._tasks.difference_update(tasks)
        if self.live:  # their sockets are closed once connection_lost has run
            _, late = await asyncio.wait([c.lost for c in self.live], timeout=CLOSE_DRAIN_SECONDS)
            if late:
                logger.warning(
                    "rank %d: %d connections did not report connection_lost within %g s",
                    self.rank,
                    len(late),
                    CLOSE_DRAIN_SECONDS,
                )

    async def _withdraw(self, reason: str) -> None:
        # Bounded, and never fatal: a store that is gone or slow must not hold up leaving.
        try:
            async with asyncio.timeout(LEFT_CHECK_SECONDS):
                await self._directory.withdraw(self.rank, reason)
        except (DistError, TimeoutError) as exc:
            logger.debug("rank %d: could not withdraw its address: %s", self.rank, exc)

    # -- polling ---------------------------------------------------------------------------

    def _poll(self, fut: asyncio.Future[int]) -> None:
        # Runs once the task that posted ``fut`` has yielded (its own sends are written by
        # then). Reading the sockets for a few microseconds catches a peer's quick answer
        # without the cost of sleeping in epoll and being woken again.
        self._spinning = False
        if (
            fut.done()
            or self.closed is not None
            # Several transports in one process: the peers likely share this loop, and
            # polling would only keep them from running.
            or (self._spin_auto and TCPTransport._open_count > 1)
        ):
            return
        conns = tuple(self._conns)  # a lost connection leaves the list while we iterate

        def answered() -> bool:
            for conn in conns:
                conn.poll()
            return fut.done() or self.closed is not None

        # An answer that does not come in time: the peer is slow, or the CPUs are busy
        # with other work and polling only takes one from the peer.
        self._backoff.polled(spin_until(answered, self._spin))

    # -- connections -----------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _accept(self) -> None:
        # Accepting is done here rather than by an asyncio.Server: a server closed while a
        # connection it accepted waits for its first step leaks that connection (CPython
        # 3.11), whereas each connection accepted here belongs to a task that abort cancels
        # and that closes the socket unless its transport took it. Out of descriptors, too,
        # neither loop's server is usable (the standard loop retries once per backlog
        # entry, logging each time; uvloop drops the waiting clients).
        assert self._listener is not None
        for _ in range(64):  # then let the loop run
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                self._cannot_accept(exc)
                return
            sock.setblocking(False)
            self._adopting += 1
            task = self._spawn(self._adopt(sock))
            task.add_done_callback(functools.partial(self._adopted, sock))

    def _adopted(self, sock: socket.socket, task: asyncio.Task[None]) -> None:
        self._adopting -= 1
        _close_unless_adopted(sock, task)

    def _cannot_accept(self, exc: OSError) -> None:
        """``accept`` failed: stop accepting for a moment rather than retry in a loop. Out of
        descriptors, first close the oldest connection still in its handshake of the
        address that has the most such connections, and accept again soon after."""
        assert self._listener is not None
        self.loop.remove_reader(self._listener)
        crowd = max(self._handshaking.values(), key=len, default=None)
        out_of_files = exc.errno in _OUT_OF_FILES
        if out_of_files and crowd:
            next(iter(crowd)).evict(f"out of file descriptors ({exc.strerror})")
            delay = _RETRY_AFTER_CLOSING
        elif out_of_files and self._adopting:
            delay = _RETRY_AFTER_CLOSING  # (connections accepted just now, counted soon)
        else:
            self.say(
                f"rank {self.rank} cannot accept connections ({exc.strerror or exc}): trying "
                f"again in {ACCEPT_RETRY_SECONDS:g} s"
                + (" (raise the open-file limit: ulimit -n)" if out_of_files else "")
            )
            delay = ACCEPT_RETRY_SECONDS
        self._resume = self.loop.call_later(delay, self._resume_accepting)

    def _resume_accepting(self) -> None:
        self._resume = None
        if self.closed is None and self._listener is not None:
            self.loop.add_reader(self._listener, self._accept)

    def arrived(self, conn: TCPConnection) -> None:
        """An accepted connection starts its handshake: past the cap of its address, that
        address's oldest connection in its handshake goes."""
        mine = self._handshaking.setdefault(conn.host, {})
        mine[conn] = None
        if len(mine) > self._per_host:
            next(iter(mine)).evict(
                f"more than {self._per_host} connections from {conn.host} in their handshake"
            )

    def settled(self, conn: TCPConnection) -> None:
        """``conn`` (accepted) is established, dropped or gone: not in its handshake."""
        mine = self._handshaking.get(conn.host)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self._handshaking[conn.host]

    def say(self, message: str) -> None:
        """Log a warning about a connection refused or dropped before its handshake
        finished, at most every ``_LOG_INTERVAL`` seconds (with the number of those not
        said since): whoever can connect can cause these, and must not flood the log."""
        self._refusals += 1
        now = time.monotonic()
        if now < self._quiet_until:
            return
        more = self._refusals - 1
        self._refusals = 0
        self._quiet_until = now + _LOG_INTERVAL
        if more:
            message += f" ({more} more such refusals since the last message)"
        logger.warning("%s", message)

    async def _adopt(self, sock: socket.socket) -> None:
        await self.loop.connect_accepted_socket(lambda: TCPConnection(self, None), sock)

    def _stop_listening(self) -> None:
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        if self._listener is not None:
            self.loop.remove_reader(self._listener)
            self._listener.close()
            self._listener = None

    def _connect_soon(self, p: _Peer) -> None:
        if p.connecting is None and p.waiter is None:
            p.waiter = self.loop.create_future()
            p.connecting = self._spawn(self._connect(p, p.waiter))

    def reached_elsewhere(self, peers: Iterable[int]) -> None:
        """Refuse connections claiming one of ``peers``: another transport reaches them."""
        self._elsewhere = frozenset(peers)

    def accepts(self, peer: int) -> bool:
        # One connection per pair: if both ranks are connecting, the lower rank's wins;
        # a peer that is already connected, or failed, is refused.
        p = self._peers[peer]
        if self.closed is not None or p.conn is not None or p.error is not None:
            return False
        if peer in self._elsewhere:
            self.say(
                f"rank {self.rank} refused a TCP connection from a peer claiming rank {peer}, "
                "which it reaches through shared memory"
            )
            return False
        return p.connecting is None or peer < self.rank

    def holds(self, peer: int) -> bool:
        """Whether this rank is connected to ``peer``: someone else claiming it is refused."""
        return self._peers[peer].conn is not None

    async def _connect(self, p: _Peer, waiter: asyncio.Future[None]) -> None:
        peer = p.rank
        if p.conn is not None or waiter.done():
            # The peer's own connection was accepted (or the peer failed) between spawning
            # this task and its first step: nothing left to do.
            if p.connecting is asyncio.current_task():
                p.connecting = None
            return
        conn = TCPConnection(self, peer)
        try:
            async with asyncio.timeout(self.timeout):
                address = await self._directory.lookup(peer)
                host, port = _parse_address(address)
                try:
                    with map_exceptions(
                        {OSError: DistNetworkError},
                        f"lost connection to rank {peer}: cannot connect to {address}",
                    ):
                        await self.loop.create_connection(lambda: conn, host, port)
                except BaseException:
                    conn.orphaned()
                    raise
                accepted = await self._unless_left(peer, conn.handshake)
                p.connecting = None
                if not accepted and conn.held:
                    await self._held(p, waiter)
                elif not accepted:
                    # The peer's own connection won the tie-break: it comes next.
                    await self._unless_left(peer, waiter)
        except asyncio.CancelledError:
            if conn.transport is not None and conn.state != OPEN:
                conn.transport.abort()
            raise
        except TimeoutError:
            if conn.transport is not None and conn.state != OPEN:
                conn.transport.abort()
            self._fail_peer(
                p,
                DistTimeoutError(
                    f"connecting to rank {peer} took more than {self.timeout} s "
                    "(its address never appeared in the store, or it did not answer)"
                ),
            )
        except Exception as exc:
            if conn.transport is not None and conn.state != OPEN:
                conn.transport.abort()
            # Connected meanwhile through the peer's own connection: this attempt lost the
            # tie-break (the peer may reset it mid-handshake) and the pair is fine.
            if p.conn is None:
                if not isinstance(exc, (DistNetworkError, DistProtocolError)):
                    exc = lost_peer_error(peer, f"connecting failed: {exc!r}")
                if departure_of(exc) is None and isinstance(exc, DistNetworkError):
                    exc = await self._left_since(peer, exc)
                if p.conn is None:
                    self._fail_peer(p, exc)
        finally:
            p.connecting = None

    async def _held(self, p: _Peer, waiter: asyncio.Future[None]) -> None:
        """The peer refused our connection: it holds one with a process that claimed our
        rank. That is this rank, if the peer opened that connection to us and its proof is
        still on its way (the peer counts the connection as open once it sent the proof,
        this rank once it checked it): the peer timeout leaves ample time for it to arrive.
        Otherwise another process posed as this rank, and this rank cannot reach the peer.

        Raises:
            DistNetworkError: the peer's connection did not come within the peer timeout.
        """
        try:
            async with asyncio.timeout(self.peer_timeout):
                await self._unless_left(p.rank, waiter)
        except TimeoutError:
            hint = (
                ""
                if self.token is not None
                else ": without a secret, anyone who can reach a rank's port can pose as a "
                "rank (give every rank the same auth_token / AIODIST_AUTH_TOKEN)"
            )
            raise lost_peer_error(
                p.rank,
                f"it refused this rank's connection: it is connected already to another "
                f"process that claimed to be rank {self.rank}{hint}",
            ) from None

    async def _unless_left(self, peer: int, fut: asyncio.Future[T]) -> T:
        """Wait for ``fut`` (a handshake, the peer's own connection), unless ``peer`` leaves.

        A peer that leaves while both ranks' connections form may close them before they
        can fail here (the kernel took them, its loop never did): its goodbye, which
        replaces its address, is looked for meanwhile.

        Raises:
            DistNetworkError: the peer left (a departure).
        """
        while True:
            done, _ = await asyncio.wait([fut], timeout=TIE_RECHECK_SECONDS)
            if done:
                return fut.result()
            try:
                await self._directory.lookup(peer)
            except DistNetworkError as left:
                if departure_of(left) is not None:
                    raise

    async def _left_since(self, peer: int, exc: DistNetworkError) -> DistNetworkError:
        """``exc``, or the peer's goodbye if it has left the world since it published its
        address (its listener is closed: connecting fails)."""
        try:
            async with asyncio.timeout(LEFT_CHECK_SECONDS):
                await self._directory.lookup(peer)
        except DistNetworkError as left:
            if departure_of(left) is not None:
                return left
        except (DistError, TimeoutError):
            pass
        return exc

    def establish(self, conn: TCPConnection) -> None:
        peer = conn.peer
        assert peer is not None and conn.transport is not None
        p = self._peers[peer]
        if self.closed is not None or p.conn is not None or p.error is not None:
            # Closed meanwhile; a second connection cannot happen by the tie-break rule.
            conn.state = DONE
            conn.transport.abort()
            return
        p.conn = conn
        conn.flow = p.flow
        p.flow.granted(conn.peer_staging)  # the first credit: the peer's staging bound
        self._conns.append(conn)
        if p.waiter is not None and not p.waiter.done():
            p.waiter.set_result(None)
        p.waiter = None
        pending, p.pending = p.pending, []
        for write, _ in pending:
            write()
        logger.debug("rank %d connected to rank %d", self.rank, peer)

    def peer_gone(self, peer: int, exc: BaseException) -> None:
        """``peer`` went away without a goodbye (the store says so): read what it sent, then
        fail what still needs it, a connection still forming included."""
        p = self._peers[peer]
        if p.error is not None or self.closed is not None or peer == self.rank:
            return
        if p.conn is not None:
            p.conn.poll()  # its last frames may sit in the socket, unread
        if p.error is None:
            self._fail_peer(p, exc)

    def peer_aborted(self, peer: int, cause: str) -> None:
        """``peer`` said it is aborting, and why: it is lost, with that cause."""
        self._fail_peer(self._peers[peer], peer_aborted_error(peer, cause))

    def lose(
        self,
        peer: int,
        reason: str,
        exc: BaseException | None = None,
        *,
        departure: Departure | None = None,
    ) -> None:
        """Drop the connection to ``peer`` and fail everything that depends on it."""
        self._fail_peer(self._peers[peer], exc or lost_peer_error(peer, reason, departure))

    def _fail_peer(self, p: _Peer, exc: BaseException) -> None:
        if p.error is not None or self.closed is not None:
            return
        p.error = exc
        conn = p.conn
        if conn is not None:
            p.conn = None
            self._conns.remove(conn)
            conn.fail_sends(exc)
            conn.state = DONE
            if conn.transport is not None:
                conn.transport.abort()
        for _, fut in p.pending:
            fail_future(fut, exc)
        p.pending.clear()
        p.flow.fail(exc)
        if p.waiter is not None:
            fail_future(p.waiter, exc)
            p.waiter = None
        if p.connecting is not None and p.connecting is not asyncio.current_task():
            p.connecting.cancel()
        self.mailbox.fail_peer(p.rank, exc)
        level = logging.WARNING if departure_of(exc) is None else logging.DEBUG
        logger.log(level, "rank %d: %s", self.rank, exc)
