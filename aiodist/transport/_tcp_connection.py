"""One TCP connection between two ranks: the handshake, then frames in both directions.

A :class:`TCPConnection` is the asyncio ``BufferedProtocol`` of one socket and speaks the
wire format that :mod:`aiodist.transport.tcp` describes. It belongs to a
:class:`~aiodist.transport.tcp.ConnectionOwner`, which decides which connections to keep, routes
sends to them and fails what depends on a peer that is lost; a connection reports to it what
it learns (a peer established, lost, or aborting) and delivers what it reads into the
transport's mailbox.

Before the handshake is done (with a token: before the peer proved it holds it), a
connection reads nothing but the handshake's fixed 90 bytes and the 32-byte proof, and holds
nothing more: its read buffer is made once it is established.

Receiving. ``get_buffer`` hands the loop a slice of the posted receive's own memory while a
payload of 16 KiB or more is arriving (no copy at all), otherwise a 64 KiB read buffer that
picks up several small frames per read. A payload whose receive is not posted yet goes to a
staging buffer (see ``_mailbox``), within the credit this rank granted the peer (see
``_flow``). At most 2 MiB are read per connection per loop turn: then reading pauses until
the next turn. Reading never stops for longer: what a peer may send unasked is bounded.

Sending. Frames are handed to the asyncio transport as memoryviews of the caller's memory,
at most 1 MiB per connection per loop turn. The write-buffer limits are zero, so the
transport calls ``pause_writing`` as soon as it keeps any byte and ``resume_writing`` once it
holds none; a send's future resolves only then, when no buffer of the loop refers to the
caller's memory any more. Frames leave in order, except the pieces of the payloads of
cleared messages (``bulk``): each waits until no other frame is queued, so that an
announcement or a clearance is not held up behind megabytes of data.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import sys
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

from .._util._auth import AUTH_MAC_SIZE, NONCE_SIZE, auth_mac, verify_mac
from ..errors import DistNetworkError, DistProtocolError
from ..store._sockets import plain_host
from ._failures import fail_future
from ._frames import BYE, HEADER, MAX_MESSAGE, ControlText, is_control, open_message
from ._mailbox import Inbound, Mailbox
from .base import Departure, lost_peer_error

if TYPE_CHECKING:
    from ._flow import PeerFlow

__all__ = [
    "ConnectionOwner",
    "ABORT_LINGER_SECONDS",
    "DONE",
    "HANDSHAKING",
    "LIVENESS_PERIOD",
    "OPEN",
    "READ_BUDGET",
    "WRITE_BUDGET",
    "TCPConnection",
]

logger = logging.getLogger(__name__)

_MAGIC = b"AIOD"
_VERSION = 6
# REFUSED: the two sides disagree on authentication (one has a token, the other not).
_HELLO, _ACCEPT, _REJECT, _REFUSED = 0, 1, 2, 3
_FLAG_AUTH = 0x01
# On a reject: the rejecting rank is connected already to a process that claimed the
# connecting rank's number (not the tie-break of two ranks connecting to each other).
_FLAG_HELD = 0x02
# magic, version, kind, flags, rank, world size, nonce, proof (zeros without a token), and
# the bytes the sender stages at most for the other side (its first credit)
_HANDSHAKE = struct.Struct(f"<4sHHHII{NONCE_SIZE}s{AUTH_MAC_SIZE}sQ")
_VERSION_END = 6  # the magic and the version: the handshake of every version starts so
_NO_PROOF = bytes(AUTH_MAC_SIZE)
# Roles of the two proofs, so neither can be reflected back as the other.
_ROLE_ACCEPT, _ROLE_CONNECT = b"peer/accept", b"peer/connect"
_IDS = struct.Struct("<III")
_HEADER = HEADER
_HEADER_SIZE = _HEADER.size
#: Seconds an aborting rank keeps a connection it said goodbye on, waiting for the peer to
#: close it first (see the wire format in :mod:`aiodist.transport.tcp`).
ABORT_LINGER_SECONDS = 2.0

#: Bytes handed to a connection's asyncio transport per loop turn. On loopback the sender's
#: syscall also does the receiver's TCP work; one 32 MiB write stalls the loop 6-12 ms.
WRITE_BUDGET = 1 << 20
#: Bytes read per connection per loop turn before reading pauses until the next turn.
READ_BUDGET = 2 << 20
# Payload bytes still to come at or above which reads go straight into the destination
# (smaller ones go through the read buffer, which also picks up the following headers).
_DIRECT_MIN = 16 << 10
_RX_BUFFER = 64 << 10
# What a connection that is closing reads (and drops) into when it never had a read buffer.
_DISCARD = memoryview(bytearray(4096))
# Up to this payload size a frame is joined into one bytes object and written at once.
_JOIN_MAX = 64 << 10

# A connection's states, named for the transport too: it checks them, and it moves a
# connection it drops to DONE.
HANDSHAKING, OPEN, DONE = 0, 1, 2


# -- liveness -----------------------------------------------------------------------------
# A peer whose host vanishes (power lost, a cut link) sends neither FIN nor RST. Two cases:
#
# * Nothing of ours is unacknowledged (this rank waits for a message): keepalive probes
#   start after a moment of silence, and the kernel drops the connection when they go
#   unanswered for the peer timeout.
# * Data of ours is unacknowledged: keepalive never probes then, and TCP retransmits for
#   about 15 minutes. ``TCP_USER_TIMEOUT`` is no answer here: Linux also drops a connection
#   whose peer kept its window closed for that long, though its kernel answers every window
#   probe, and a peer busy in its own code with our data unread (its event loop blocked by
#   a long computation) is not gone. So the connection asks its kernel instead
#   (``TCP_INFO``), about once a second while it waits for an acknowledgement: a peer
#   whose kernel acknowledges nothing, neither data nor window probes, for the peer
#   timeout is gone; a busy one keeps answering the probes.
#
# Where the kernel has it (Linux 6.15), ``TCP_RTO_MAX_MS`` keeps window probes (and
# retransmissions) at most a quarter of the peer timeout apart: otherwise they back off
# up to two minutes apart, and a host that vanishes while its window is closed is noticed
# at the next probe (its store lease tells every rank sooner: see aiodist.group._world).

#: ``struct tcp_info`` (Linux) up to ``tcpi_last_ack_recv``: the unanswered probes (byte 3),
#: the segments in flight (``tcpi_unacked``, byte 24) and the milliseconds since the peer
#: last acknowledged anything (byte 56).
_TCP_INFO = struct.Struct("<3xB20xI28xI")
_HAS_TCP_INFO = sys.platform == "linux" and hasattr(socket, "TCP_INFO")
#: The socket option that bounds the retransmission timeout (Linux 6.15; not yet a name in
#: every Python's socket module).
_TCP_RTO_MAX_MS = getattr(socket, "TCP_RTO_MAX_MS", 44)
#: Seconds between two liveness checks of a connection that waits for an acknowledgement
#: (at most; a quarter of the peer timeout when that is shorter).
LIVENESS_PERIOD = 1.0


def _enable_keepalive(sock: socket.socket, peer_timeout: float) -> None:
    # Keepalive for a silent peer while nothing of ours is unacknowledged, and a bounded
    # probe interval for the liveness check (see above).
    idle = 2 if peer_timeout >= 3 else 1
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
            probes = max(1, min(127, int(peer_timeout - idle)))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, probes)
    except OSError as exc:
        logger.debug("could not enable TCP keepalive: %s", exc)
    if _HAS_TCP_INFO:
        with contextlib.suppress(OSError):  # an older kernel: probes back off further
            rto_max = min(120_000, max(1000, int(peer_timeout * 250)))
            sock.setsockopt(socket.IPPROTO_TCP, _TCP_RTO_MAX_MS, rto_max)


def _auth_mismatch(peer: int, peer_auth: bool) -> DistNetworkError:
    if peer_auth:
        return DistNetworkError(
            f"authentication with rank {peer} failed: it requires an auth token and this "
            "rank has none (pass auth_token= or set AIODIST_AUTH_TOKEN on every rank)"
        )
    return DistNetworkError(
        f"authentication with rank {peer} failed: this rank has an auth token and rank "
        f"{peer} has none (give every rank the same auth_token / AIODIST_AUTH_TOKEN)"
    )


class ConnectionOwner(Protocol):
    """What a connection asks of the transport that owns it
    (:class:`aiodist.transport.tcp.TCPTransport`): the rank's place and settings
    (``timeout`` for a handshake, ``peer_timeout`` for a silent peer, ``staging``: the bytes
    staged per peer at most, ``token``: the secret a handshake proves), why it closed, the
    connections whose socket is open (``live``), and what it does as a connection arrives,
    settles, is established or lost; ``accepts``/``holds``: whether a connection from a
    peer is kept (one per pair of ranks) and whether this rank has one to it already."""

    rank: int
    world_size: int
    mailbox: Mailbox
    loop: asyncio.AbstractEventLoop
    timeout: float | None
    peer_timeout: float
    staging: int
    token: bytes | None
    closed: BaseException | None
    live: set[TCPConnection]

    def accepts(self, peer: int) -> bool: ...
    def holds(self, peer: int) -> bool: ...
    def arrived(self, conn: TCPConnection) -> None: ...
    def settled(self, conn: TCPConnection) -> None: ...
    def establish(self, conn: TCPConnection) -> None: ...
    def say(self, message: str) -> None: ...
    def peer_aborted(self, peer: int, cause: str) -> None: ...
    def lose(
        self,
        peer: int,
        reason: str,
        exc: BaseException | None = None,
        *,
        departure: Departure | None = None,
    ) -> None: ...


class TCPConnection(asyncio.BufferedProtocol):
    """One connection: the handshake, then the frame reader and the send queue."""

    def __init__(self, owner: ConnectionOwner, peer: int | None) -> None:
        self.owner = owner
        self.loop = owner.loop
        self.mailbox = owner.mailbox
        # Known when we connect; learned from the hello when we accept.
        self.peer = peer
        self.accepted = peer is None
        self.state = HANDSHAKING
        self.transport: asyncio.Transport | None = None
        self.fd = -1
        # Resolved with True (accepted) or False (refused) for the connecting side, and
        # whether the refusal said the peer is connected to someone claiming our rank.
        self.handshake: asyncio.Future[bool] = self.loop.create_future()
        self.held = False
        # The peer's address (accepting side): connections in their handshake are counted
        # per address.
        self.host = ""
        self.lost: asyncio.Future[None] = self.loop.create_future()
        # What the peer said when it said goodbye (it closes in order).
        self.bye: str | None = None
        self._hs = bytearray(_HANDSHAKE.size)
        self._hs_got = 0
        # Our nonce, the peer's, and the proof the peer must send next (accepting side).
        self._nonce = os.urandom(NONCE_SIZE)
        self._peer_nonce = b""
        self._want_proof: bytes | None = None
        self._timer: asyncio.TimerHandle | None = None
        # The peer's staging bound, from its handshake, and the flow control with it (the
        # transport's, once the connection is established).
        self.peer_staging = 0
        self.flow: PeerFlow | None = None
        # Sending: frames not yet handed to the transport, pieces of the payloads of
        # cleared messages waiting for the queue to empty (whole frames), and futures of
        # frames handed over but possibly still referenced by the transport's buffer.
        self.queue: deque[tuple[memoryview, asyncio.Future[None] | None]] = deque()
        self.bulk: deque[tuple[bytes, memoryview, asyncio.Future[None]]] = deque()
        self.handed: list[asyncio.Future[None]] = []
        self._write_paused = False
        self._flush_scheduled = False
        self._gather = False
        # Receiving: the read buffer is made once the connection is established.
        self._rx = bytearray()
        self._rxv = memoryview(self._rx)
        self._rstart = 0
        self._rend = 0
        # The message whose payload is arriving: a data message, or a control frame's text.
        self._inbound: Inbound | ControlText | None = None
        self._doff = 0
        self._drem = 0
        self._direct = False
        self._turn_bytes = 0
        self._read_paused = False
        # Liveness (see above): the socket asked, the next check, and since when (loop
        # time) the kernel has waited for an acknowledgement that has not come.
        self._sock: socket.socket | None = None
        self._liveness: asyncio.TimerHandle | None = None
        self._silent_since: float | None = None

    def __repr__(self) -> str:
        return f"<TCPConnection rank {self.owner.rank} <-> {self.peer} state={self.state}>"

    # -- connection and handshake ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not derive from asyncio.Transport but have its methods.
        transport = cast(asyncio.Transport, transport)
        self.transport = transport
        # Zero limits: pause_writing as soon as the transport keeps a byte of ours,
        # resume_writing once it holds none (then no send buffer is referenced any more).
        transport.set_write_buffer_limits(high=0, low=0)
        # uvloop's writelines gathers buffers into one writev; the standard loop's joins.
        self._gather = type(transport).__module__.startswith("uvloop")
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self.fd = sock.fileno()
            # The standard loop sets TCP_NODELAY only on sockets it creates with protocol
            # IPPROTO_TCP; accepted ones inherit protocol 0 and would keep Nagle's delay.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _enable_keepalive(sock, self.owner.peer_timeout)
            if _HAS_TCP_INFO and sock.family in (socket.AF_INET, socket.AF_INET6):
                self._sock = sock
        self.owner.live.add(self)
        if self.owner.closed is not None:
            self._drop_unopened(transport.abort)
            return
        if self.peer is not None:
            transport.write(self._handshake_message(_HELLO, _NO_PROOF))
            return
        self.host = plain_host(transport.get_extra_info("peername"))
        if self.owner.timeout is not None:
            self._timer = self.loop.call_later(self.owner.timeout, self._handshake_timeout)
        self.owner.arrived(self)

    def _handshake_message(self, kind: int, proof: bytes, flags: int = 0) -> bytes:
        owner = self.owner
        if owner.token is not None:
            flags |= _FLAG_AUTH
        return _HANDSHAKE.pack(
            _MAGIC,
            _VERSION,
            kind,
            flags,
            owner.rank,
            owner.world_size,
            self._nonce,
            proof,
            owner.staging,
        )

    def _proof(self, role: bytes, first: bytes, second: bytes, connector: int) -> bytes:
        # Bound to both nonces (no replay), the role (no reflection), both ranks and the
        # world size (no splicing of one pair's exchange into another's).
        owner = self.owner
        token = owner.token
        assert token is not None and self.peer is not None
        acceptor = self.peer if connector == owner.rank else owner.rank
        ids = _IDS.pack(connector, acceptor, owner.world_size)
        return auth_mac(token, role, first, second + ids)

    def _handshake_timeout(self) -> None:
        if self.state == HANDSHAKING and self.transport is not None:
            logger.debug("rank %d: a connection sent no handshake in time", self.owner.rank)
            self._drop_unopened(self.transport.abort)

    def evict(self, why: str) -> None:
        """Drop this accepted connection, still in its handshake, to make room (``why``)."""
        assert self.transport is not None
        self.owner.say(f"rank {self.owner.rank} dropped a connection from {self.host}: {why}")
        self._drop_unopened(self.transport.abort)

    def _handshake_failed(self, exc: BaseException) -> None:
        if not self.handshake.done():
            self.handshake.set_exception(exc)
            self.handshake.exception()  # the connecting task reads it, or has gone
        if self.accepted:
            # Whoever connects can cause this: said at most every few seconds.
            self.owner.say(f"rank {self.owner.rank} dropped a connection from {self.host}: {exc}")
        elif not isinstance(exc, DistNetworkError):
            logger.warning("rank %d dropped a connection: %s", self.owner.rank, exc)
        assert self.transport is not None
        self._drop_unopened(self.transport.abort)

    def _drop_unopened(self, close: Callable[[], None]) -> None:
        """Close (or abort) a connection dropped before it opened, and stop counting it as
        live at once: uvloop may never call ``connection_lost`` for a transport closed from
        its own read callback or accepted by a server that has closed, and
        :meth:`ConnectionOwner.aclose` would wait for it in vain."""
        self.state = DONE
        close()
        self.orphaned()

    def _on_handshake(self) -> None:
        if self._want_proof is not None:
            return self._on_proof()
        owner = self.owner
        magic, version, kind, flags, rank, world_size, nonce, proof, staging = _HANDSHAKE.unpack(
            self._hs
        )
        who = f"rank {self.peer}" if self.peer is not None else "a connecting peer"
        if magic != _MAGIC or kind not in (_HELLO, _ACCEPT, _REJECT, _REFUSED):
            return self._handshake_failed(
                DistProtocolError(
                    f"{who} sent {bytes(self._hs[:16])!r}..., not an aiodist handshake"
                )
            )
        if version != _VERSION:
            return self._handshake_failed(self._version_error(version))
        if world_size != owner.world_size or not 0 <= rank < world_size or rank == owner.rank:
            return self._handshake_failed(
                DistProtocolError(
                    f"{who} says it is rank {rank} of {world_size}; this is rank "
                    f"{owner.rank} of {owner.world_size}"
                )
            )
        self._peer_nonce = nonce
        self.peer_staging = staging
        peer_auth = bool(flags & _FLAG_AUTH)
        assert self.transport is not None
        if self.peer is None:  # we accepted this connection: decide whether to keep it
            return self._on_hello(kind, rank, peer_auth)
        if rank != self.peer:
            return self._handshake_failed(
                DistProtocolError(
                    f"the address published for rank {self.peer} belongs to rank {rank}"
                )
            )
        if kind == _REFUSED or peer_auth != (owner.token is not None):
            return self._handshake_failed(_auth_mismatch(self.peer, peer_auth))
        if kind not in (_ACCEPT, _REJECT):
            return self._handshake_failed(DistProtocolError(f"{who} answered a hello with a hello"))
        if owner.token is not None:
            want = self._proof(_ROLE_ACCEPT, self._nonce, nonce, owner.rank)
            if not verify_mac(proof, want):
                return self._handshake_failed(
                    DistNetworkError(
                        f"authentication with rank {self.peer} failed: it could not prove it "
                        "holds this rank's auth token (the ranks' tokens differ)"
                    )
                )
        if kind == _REJECT:
            # The peer's own connection to us is the one kept, or (held) the peer holds one
            # from a process that claimed our rank: the transport tells them apart.
            self.held = bool(flags & _FLAG_HELD)
            self.handshake.set_result(False)
            self._drop_unopened(self.transport.close)
            return None
        if owner.token is not None:
            self.transport.write(self._proof(_ROLE_CONNECT, nonce, self._nonce, owner.rank))
        return self._open()

    def _version_error(self, version: int) -> DistProtocolError:
        who = f"rank {self.peer}" if self.peer is not None else "a connecting peer"
        return DistProtocolError(
            f"{who} speaks transport protocol version {version}, this rank {_VERSION}"
        )

    def _on_hello(self, kind: int, rank: int, peer_auth: bool) -> None:
        owner = self.owner
        assert self.transport is not None
        if kind != _HELLO:
            return self._handshake_failed(
                DistProtocolError("a connecting peer did not start with a hello")
            )
        if peer_auth != (owner.token is not None):
            # Tell the peer why, so that it fails with a clear message; then drop it.
            self.transport.write(self._handshake_message(_REFUSED, _NO_PROOF))
            owner.say(
                f"rank {owner.rank} refused a connection from {self.host} claiming rank "
                f"{rank}: "
                + ("it has no auth token" if owner.token is not None else "it has an auth token")
            )
            self._drop_unopened(self.transport.close)
            return None
        self.peer = rank
        keep = owner.accepts(rank)
        # A claimant of a rank this rank is connected to is refused, and the connection
        # held stays: a stranger can be turned away, never take a connection over or break it.
        held = not keep and owner.holds(rank)
        proof = _NO_PROOF
        if owner.token is not None:
            proof = self._proof(_ROLE_ACCEPT, self._peer_nonce, self._nonce, rank)
        self.transport.write(
            self._handshake_message(_ACCEPT if keep else _REJECT, proof, _FLAG_HELD if held else 0)
        )
        if held and owner.token is None:
            # (With a token, it may be that rank itself, still checking the proof of the
            # connection this rank opened to it and holds.)
            owner.say(
                f"rank {owner.rank} refused a connection from {self.host} claiming rank {rank}, "
                f"which it is connected to already: without a secret, another process may "
                f"have posed as rank {rank}"
            )
        if not keep:
            self._drop_unopened(self.transport.close)
            return None
        if owner.token is not None:
            # Not one frame is read before the peer has proven that it holds the token.
            self._want_proof = self._proof(_ROLE_CONNECT, self._nonce, self._peer_nonce, rank)
            self._hs = bytearray(AUTH_MAC_SIZE)
            self._hs_got = 0
            return None
        return self._open()

    def _on_proof(self) -> None:
        assert self._want_proof is not None
        if not verify_mac(bytes(self._hs), self._want_proof):
            return self._handshake_failed(
                DistProtocolError(
                    f"a peer claiming rank {self.peer} failed authentication (wrong auth token)"
                )
            )
        self._want_proof = None
        return self._open()

    def _open(self) -> None:
        self.state = OPEN
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._rx = bytearray(_RX_BUFFER)
        self._rxv = memoryview(self._rx)
        if self.accepted:
            self.owner.settled(self)
        if not self.handshake.done():
            self.handshake.set_result(True)
        self.owner.establish(self)

    def connection_lost(self, exc: Exception | None) -> None:
        owner = self.owner
        owner.live.discard(self)
        if self.accepted:
            owner.settled(self)
        if self._timer is not None:
            self._timer.cancel()
        if self._liveness is not None:
            self._liveness.cancel()
            self._liveness = None
        if not self.lost.done():
            self.lost.set_result(None)
        state, self.state = self.state, DONE
        if state == HANDSHAKING:
            error = DistNetworkError(
                f"connection to rank {self.peer} closed during the handshake: {exc or 'EOF'}"
            )
            if not self.handshake.done():
                self.handshake.set_exception(error)
                self.handshake.exception()
        elif state == OPEN:
            peer = self.peer
            assert peer is not None
            if self.bye is not None and self._inbound is None:
                reason = f"it {self.bye}"
                owner.lose(peer, reason, departure=Departure.LEFT)
            else:
                # Whatever the peer sent before is read by now: only what it did not send
                # fails.
                reason = (
                    f"connection lost: {exc}"
                    if exc
                    else "it went away without a goodbye (its process ended without leaving "
                    "the process group, or was killed)"
                )
                owner.lose(peer, reason, departure=Departure.GONE)
            self.fail_sends(lost_peer_error(peer, reason))  # if the peer had failed before

    def orphaned(self) -> None:
        """Forget a connection whose transport is closed or closing without waiting for
        ``connection_lost``: its ``create_connection`` call failed or was cancelled (uvloop
        may have called ``connection_made`` first and then never calls ``connection_lost``),
        or it was dropped before it opened.
        """
        self.owner.live.discard(self)
        if self.accepted:
            self.owner.settled(self)
        self.state = DONE
        if not self.lost.done():
            self.lost.set_result(None)

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows at once

    # -- sending ---------------------------------------------------------------------------

    def send(
        self, header: bytes, data: memoryview, fut: asyncio.Future[None], bulk: bool = False
    ) -> None:
        """Write a frame: ``header``, then ``data``; ``fut`` resolves once the transport
        holds none of ``data``. ``bulk``: a piece of the payload of a cleared message, which
        frames sent later may overtake (it waits until no other frame is queued)."""
        if self._liveness is None and self._sock is not None:
            self._watch_liveness()
        if bulk and (self.queue or self.bulk):
            # Behind every other payload (they leave in order: a payload's last piece
            # stands for all of it), and behind the other frames queued now.
            self.bulk.append((header, data, fut))
            return
        if self.queue or self._write_paused or self._flush_scheduled:
            # Frames leave in order: behind what is already queued. (The queue holds at
            # most one bulk frame, the one being written: the others wait in self.bulk.)
            self._enqueue(header, data, fut)
            return
        transport = self.transport
        assert transport is not None
        size = len(data)
        if size > WRITE_BUDGET:
            self._enqueue(header, data, fut)
            self._flush()
            return
        if not size:
            transport.write(header)
        elif size <= _JOIN_MAX:
            # One small copy beats a gathered write: both loops have a fast path for one
            # buffer, and it is one syscall.
            transport.write(header + data)
        elif self._gather:
            transport.writelines((header, data))
        else:
            transport.write(header)
            transport.write(data)
        self._after_write(fut)

    def _watch_liveness(self) -> None:
        period = min(LIVENESS_PERIOD, self.owner.peer_timeout / 4)
        self._liveness = self.loop.call_later(period, self._check_liveness)

    def _check_liveness(self) -> None:
        """Drop the connection if the peer's kernel has acknowledged nothing, neither data
        nor window probes, for the peer timeout while it owed an acknowledgement; check
        again later while anything of ours is unacknowledged or unsent."""
        self._liveness = None
        sock = self._sock
        if self.state != OPEN or sock is None:
            return
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO.size)
            probes, unacked, last_ack_ms = _TCP_INFO.unpack(info)
        except (OSError, struct.error) as exc:
            logger.debug("rank %d: cannot read TCP_INFO: %s", self.owner.rank, exc)
            return
        now = self.loop.time()
        if unacked or probes:
            if self._silent_since is None or now - last_ack_ms / 1000 > self._silent_since:
                self._silent_since = now  # (an acknowledgement came since the last check)
            elif now - self._silent_since >= self.owner.peer_timeout:
                assert self.peer is not None
                self.owner.lose(
                    self.peer,
                    "its host stopped answering: nothing this rank sent it was acknowledged "
                    f"for {now - self._silent_since:.1f} s (the peer timeout, "
                    "$AIODIST_PEER_TIMEOUT; its kernel would answer if it were only busy)",
                    departure=Departure.GONE,
                )
                return
        else:
            self._silent_since = None
            if not (self.queue or self.bulk or self._write_paused):
                return  # nothing owed: the next send watches again
        self._watch_liveness()

    def _enqueue(self, header: bytes, data: memoryview, fut: asyncio.Future[None]) -> None:
        self.queue.append((memoryview(header), None if data else fut))
        if data:
            self.queue.append((data, fut))

    def _after_write(self, fut: asyncio.Future[None]) -> None:
        # pause_writing ran inside write() if the transport kept any of the bytes.
        if self._write_paused:
            self.handed.append(fut)
        elif not fut.done():  # the sender may have given up on it (an aborted operation)
            fut.set_result(None)

    def _flush(self) -> None:
        # Hand up to WRITE_BUDGET bytes of queued frames to the transport.
        self._flush_scheduled = False
        transport = self.transport
        if transport is None or self.state != OPEN:
            return
        queue = self.queue
        budget = WRITE_BUDGET
        views: list[memoryview] = []
        while budget > 0 and not self._write_paused:
            if not queue:
                if not self.bulk:
                    break
                # A frame boundary with nothing else to send: the next payload piece.
                self._enqueue(*self.bulk.popleft())
            view, fut = queue[0]
            if len(view) > budget:
                views.append(view[:budget])
                queue[0] = (view[budget:], fut)
                budget = 0
                break
            queue.popleft()
            views.append(view)
            budget -= len(view)
            if fut is not None:
                self.handed.append(fut)
        if views:
            if len(views) == 1:
                transport.write(views[0])
            elif self._gather:
                transport.writelines(views)
            else:
                for view in views:
                    transport.write(view)
        if not self._write_paused:
            self._resolve_handed()
            if (queue or self.bulk) and not self._flush_scheduled:
                # More to write: next loop turn, so other callbacks get theirs.
                self._flush_scheduled = True
                self.loop.call_soon(self._flush)

    def _resolve_handed(self) -> None:
        handed, self.handed = self.handed, []
        for fut in handed:
            if not fut.done():
                fut.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._resolve_handed()
        if (self.queue or self.bulk) and not self._flush_scheduled:
            self._flush()

    def fail_sends(self, exc: BaseException) -> None:
        for fut in self.handed:
            fail_future(fut, exc)
        self.handed.clear()
        for _, queued in self.queue:
            if queued is not None:
                fail_future(queued, exc)
        self.queue.clear()
        for _, _, fut in self.bulk:
            fail_future(fut, exc)
        self.bulk.clear()

    def close_after(self, frame: bytes | None) -> None:
        """Write ``frame`` after the frames already queued, then close without losing it.

        The frame is written only at a frame boundary (nothing of ours still queued). Then
        the sending side is shut down and the connection read, and dropped, until the peer
        closes its end (at most :data:`ABORT_LINGER_SECONDS`): closing with unread bytes
        would reset the connection and make the peer's kernel drop our last frame.
        """
        transport, state = self.transport, self.state
        if transport is None or state == DONE:
            return  # whoever moved the connection to DONE closed its transport
        if state != OPEN:
            self._drop_unopened(transport.abort)
            return
        self.state = DONE
        if not transport.can_write_eof():
            transport.abort()
            return
        if frame is not None and not self.queue:
            transport.write(frame)
        try:
            transport.write_eof()
        except OSError:
            # The peer is gone already (the standard loop's shutdown says ENOTCONN).
            transport.abort()
            return
        if self._read_paused:
            transport.resume_reading()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(ABORT_LINGER_SECONDS, transport.abort)

    # -- receiving -------------------------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.state == DONE:
            # Closing: whatever still arrives is read and dropped.
            return self._rxv if self._rx else _DISCARD
        if self.state == HANDSHAKING:
            # Read no further than the handshake: frames after it are read as frames.
            return memoryview(self._hs)[self._hs_got :]
        if self._drem >= _DIRECT_MIN:
            # The read buffer is empty here (it is drained into the destination before
            # reading more), so the payload's bytes go straight to their final place.
            self._direct = True
            doff = self._doff
            assert self._inbound is not None
            return self._inbound.buffer[doff : doff + min(self._drem, READ_BUDGET)]
        self._direct = False
        if self._rstart == self._rend:
            self._rstart = self._rend = 0
        elif _RX_BUFFER - self._rend < _HEADER_SIZE:
            left = self._rend - self._rstart
            self._rx[:left] = self._rx[self._rstart : self._rend]
            self._rstart, self._rend = 0, left
        return self._rxv[self._rend :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.state == HANDSHAKING:
            self._hs_got += nbytes
            got = self._hs_got
            if got == len(self._hs):
                self._on_handshake()
            elif self._want_proof is None and self._hs[: min(got, 4)] != _MAGIC[: min(got, 4)]:
                # Garbage (a port scanner, an HTTP client): drop it now, not at the timeout.
                self._handshake_failed(
                    DistProtocolError(
                        f"a peer sent {bytes(self._hs[:got])!r}, not an aiodist handshake"
                    )
                )
            elif self._want_proof is None and got >= _VERSION_END:
                # Another version's handshake may have another length: say so now rather
                # than wait for bytes that never come.
                version = int.from_bytes(self._hs[4:_VERSION_END], "little")
                if version != _VERSION:
                    self._handshake_failed(self._version_error(version))
            return
        if self.state != OPEN:
            return
        if self._direct:
            self._doff += nbytes
            self._drem -= nbytes
            if not self._drem:
                self._finish_inbound()
        else:
            self._rend += nbytes
            self._parse()
        # Bound the work of one loop turn: pause, and read on in the next turn.
        self._turn_bytes += nbytes
        if self._turn_bytes >= READ_BUDGET and not self._read_paused and self.transport:
            self._read_paused = True
            self.transport.pause_reading()
            self.loop.call_soon(self._resume_reading)

    def _resume_reading(self) -> None:
        self._turn_bytes = 0
        self._read_paused = False
        if self.state == OPEN and self.transport is not None:
            self.transport.resume_reading()

    def poll(self) -> None:
        """Read what the socket holds now, without waiting (see ``ConnectionOwner._poll``)."""
        if self.state != OPEN or self._read_paused or self.fd < 0:
            return
        while True:
            try:
                got = os.readv(self.fd, (self.get_buffer(-1),))
            except OSError:  # nothing there (EAGAIN), or an error the loop will report
                return
            if not got:  # EOF: the loop sees it too and reports it
                return
            self.buffer_updated(got)
            if self.state != OPEN or self._read_paused:
                return

    def _said(self, kind: int, text: str) -> None:
        # A goodbye (closing follows) or the cause the peer aborts for.
        if kind == BYE:
            self.bye = text
        else:
            assert self.peer is not None
            self.owner.peer_aborted(self.peer, text)

    def _finish_inbound(self) -> None:
        inbound = self._inbound
        assert inbound is not None
        self._inbound = None
        inbound.done()

    def _parse(self) -> None:
        rx = self._rx
        peer, flow = self.peer, self.flow
        assert peer is not None and flow is not None
        while self.state == OPEN:
            avail = self._rend - self._rstart
            if self._inbound is None:
                if avail < _HEADER_SIZE:
                    return
                group, seq, step, word, fp = _HEADER.unpack_from(rx, self._rstart)
                self._rstart += _HEADER_SIZE
                if is_control(word, step):
                    self._inbound = ControlText(
                        word, group, seq, step, peer, self.mailbox, flow, self._said
                    )
                    self._doff = 0
                    self._drem = step
                    if not step:
                        self._finish_inbound()
                    continue
                try:
                    inbound = open_message(self.mailbox, flow, peer, group, seq, step, word, fp)
                except DistProtocolError as exc:
                    self.owner.lose(peer, "", exc)
                    return
                except MemoryError:
                    # A message nobody posted a receive for yet is staged in memory of its
                    # own: a length no allocation can hold must fail this peer, not the loop.
                    self.owner.lose(
                        peer,
                        "",
                        DistProtocolError(
                            f"rank {peer} sent a message of {word & (MAX_MESSAGE - 1)} bytes, "
                            "more than this rank can allocate to hold it"
                        ),
                    )
                    return
                if inbound is not None:
                    self._inbound = inbound
                    self._doff = 0
                    self._drem = len(inbound.buffer)
            else:
                if not avail:
                    return
                take = min(avail, self._drem)
                doff, rstart = self._doff, self._rstart
                self._inbound.buffer[doff : doff + take] = self._rxv[rstart : rstart + take]
                self._doff = doff + take
                self._rstart = rstart + take
                self._drem -= take
                if not self._drem:
                    self._finish_inbound()
