"""The TCP transport: one connection per pair of ranks, an asyncio ``BufferedProtocol`` each.

Wire format. After connecting, the connecting rank sends an 82-byte hello and the accepting
rank answers with 82 bytes (``<4sHHHII32s32s``: magic ``AIOD``, version, kind, flags, rank,
world size, nonce, proof; kind is hello, accept, reject or refused). With a shared secret
(``auth_token``, flag bit 0), the answer's proof is an HMAC of the token over both nonces,
the ranks and the world size, and the connecting rank checks it, then sends 32 bytes of
proof of its own, which the accepting rank checks before it reads a single frame. A side
without the token, or with another one, is refused and never gets to send a frame. Then
both directions carry frames::

    frame := group:u64 seq:u64 step:u64 nbytes:u64 fingerprint:32s | nbytes of payload

Three lengths that no payload can have mark control frames, whose ``step`` is the length of
the UTF-8 text that follows: ``2**64 - 1`` says goodbye (the sender closes in order; the
text says why it leaves, e.g. that its process is exiting),
``2**64 - 2`` rejects operation ``(group, seq)`` with the text as the reason, ``2**64 - 3``
says the sender is aborting, with the text as the cause. An aborting rank writes that last
frame only at a frame boundary, then shuts down its sending side and keeps reading until
the peer closes: closing a socket with unread bytes would send a reset, and a reset makes
the peer's kernel drop the frame before the peer reads it.

Receiving. ``get_buffer`` hands the loop a slice of the posted receive's own memory while a
payload of 16 KiB or more is arriving (no copy at all), otherwise a 64 KiB read buffer that
picks up several small frames per read. A payload whose receive is not posted yet goes to a
staging buffer (see ``_mailbox``). At most 2 MiB are read per connection per loop turn:
then reading pauses until the next turn.

Sending. Frames are handed to the asyncio transport as memoryviews of the caller's memory,
at most 1 MiB per connection per loop turn. The write-buffer limits are zero, so the
transport calls ``pause_writing`` as soon as it keeps any byte and ``resume_writing`` once it
holds none; a send's future resolves only then, when no buffer of the loop refers to the
caller's memory any more.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import time
from collections import deque
from collections.abc import Coroutine, Iterable
from typing import Any, cast

from .._auth import AUTH_MAC_SIZE, NONCE_SIZE, auth_mac, resolve_token, verify_mac
from .._fingerprint import NO_FINGERPRINT
from .._timeouts import DEFAULT_SETUP_TIMEOUT, Timeout, to_seconds
from ..errors import (
    DistError,
    DistNetworkError,
    DistProtocolError,
    DistTimeoutError,
    DistUsageError,
    map_exceptions,
)
from ..store._sockets import resolve_peer_timeout
from ._frames import (
    ABORTING,
    BYE,
    HEADER,
    MAX_MESSAGE,
    REJECTION,
    ControlText,
    control_frame,
    is_control,
)
from ._mailbox import Inbound, Mailbox, as_bytes, fail_future
from .base import (
    CLOSED_REASON,
    Departure,
    PeerDirectory,
    Tag,
    Transport,
    abort_text,
    departure_of,
    lost_peer_error,
    peer_aborted_error,
)

__all__ = ["TCPTransport"]

logger = logging.getLogger(__name__)

_MAGIC = b"AIOD"
_VERSION = 5
# REFUSED: the two sides disagree on authentication (one has a token, the other not).
_HELLO, _ACCEPT, _REJECT, _REFUSED = 0, 1, 2, 3
_FLAG_AUTH = 0x01
# magic, version, kind, flags, rank, world size, nonce, proof (zeros without a token)
_HANDSHAKE = struct.Struct(f"<4sHHHII{NONCE_SIZE}s{AUTH_MAC_SIZE}s")
_NO_PROOF = bytes(AUTH_MAC_SIZE)
# Roles of the two proofs, so neither can be reflected back as the other.
_ROLE_ACCEPT, _ROLE_CONNECT = b"peer/accept", b"peer/connect"
_IDS = struct.Struct("<III")
_HEADER = HEADER
_HEADER_SIZE = _HEADER.size
#: Seconds an aborting rank keeps a connection it said goodbye on, waiting for the peer to
#: close it first (see the module docstring).
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
# Up to this payload size a frame is joined into one bytes object and written at once.
_JOIN_MAX = 64 << 10
#: Seconds a rank polls its sockets without sleeping when a receive is not yet satisfied.
SPIN_SECONDS = 50e-6
#: After this many polls in a row that ran out of time, receives skip polling for a while
#: (2, 4, 8, ... receives, at most ``POLL_MAX_SKIP``).
POLL_MISSES_BEFORE_BACKOFF = 3
POLL_MAX_SKIP = 64
#: How long ``aclose`` lets queued sends drain before closing the connections.
CLOSE_DRAIN_SECONDS = 5.0
#: How long leaving waits for the store to record it, and a failed connect for the store to
#: say whether the peer left meanwhile.
LEFT_CHECK_SECONDS = 1.0

_HANDSHAKING, _OPEN, _DONE = 0, 1, 2


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _enable_keepalive(sock: socket.socket, peer_timeout: float) -> None:
    # A peer whose host vanishes sends neither FIN nor RST: probe idle connections (a rank
    # waiting for a message) so that its loss is noticed within the peer timeout. Unlike the
    # store's connections these get no TCP_USER_TIMEOUT: a peer busy for longer than that with
    # our data unread in its buffers (a zero window) is not gone. The store's lease of every
    # rank tells everyone else when a host vanishes (see aiodist._world).
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


class _Conn(asyncio.BufferedProtocol):
    """One connection: the handshake, then the frame reader and the send queue."""

    def __init__(self, owner: TCPTransport, peer: int | None) -> None:
        self.owner = owner
        self.loop = owner._loop
        self.mailbox = owner.mailbox
        # Known when we connect; learned from the hello when we accept.
        self.peer = peer
        self.accepted = peer is None
        self.state = _HANDSHAKING
        self.transport: asyncio.Transport | None = None
        self.fd = -1
        # Resolved with True (accepted) or False (refused) for the connecting side.
        self.handshake: asyncio.Future[bool] = self.loop.create_future()
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
        # Sending: frames not yet handed to the transport, and futures of frames handed
        # over but possibly still referenced by the transport's buffer.
        self._queue: deque[tuple[memoryview, asyncio.Future[None] | None]] = deque()
        self._handed: list[asyncio.Future[None]] = []
        self._write_paused = False
        self._flush_scheduled = False
        self._gather = False
        # Receiving.
        self._rx = bytearray(_RX_BUFFER)
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

    def __repr__(self) -> str:
        return f"<_Conn rank {self.owner.rank} <-> {self.peer} state={self.state}>"

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
            _enable_keepalive(sock, self.owner._peer_timeout)
        self.owner._live.add(self)
        if self.owner._closed is not None:
            self.state = _DONE
            transport.abort()
            return
        if self.peer is not None:
            transport.write(self._handshake_message(_HELLO, _NO_PROOF))
        elif self.owner._timeout is not None:
            self._timer = self.loop.call_later(self.owner._timeout, self._handshake_timeout)

    def _handshake_message(self, kind: int, proof: bytes) -> bytes:
        owner = self.owner
        flags = _FLAG_AUTH if owner._token is not None else 0
        return _HANDSHAKE.pack(
            _MAGIC, _VERSION, kind, flags, owner.rank, owner.world_size, self._nonce, proof
        )

    def _proof(self, role: bytes, first: bytes, second: bytes, connector: int) -> bytes:
        # Bound to both nonces (no replay), the role (no reflection), both ranks and the
        # world size (no splicing of one pair's exchange into another's).
        owner = self.owner
        token = owner._token
        assert token is not None and self.peer is not None
        acceptor = self.peer if connector == owner.rank else owner.rank
        ids = _IDS.pack(connector, acceptor, owner.world_size)
        return auth_mac(token, role, first, second + ids)

    def _handshake_timeout(self) -> None:
        if self.state == _HANDSHAKING and self.transport is not None:
            logger.debug("rank %d: a connection sent no handshake in time", self.owner.rank)
            self.state = _DONE
            self.transport.abort()

    def _handshake_failed(self, exc: BaseException) -> None:
        self.state = _DONE
        if not self.handshake.done():
            self.handshake.set_exception(exc)
            self.handshake.exception()  # the connecting task reads it, or has gone
        if self.peer is None or not isinstance(exc, DistNetworkError):
            logger.warning("rank %d dropped a connection: %s", self.owner.rank, exc)
        assert self.transport is not None
        self.transport.abort()

    def _on_handshake(self) -> None:
        if self._want_proof is not None:
            return self._on_proof()
        owner = self.owner
        magic, version, kind, flags, rank, world_size, nonce, proof = _HANDSHAKE.unpack(self._hs)
        who = f"rank {self.peer}" if self.peer is not None else "a connecting peer"
        if magic != _MAGIC or kind not in (_HELLO, _ACCEPT, _REJECT, _REFUSED):
            return self._handshake_failed(
                DistProtocolError(
                    f"{who} sent {bytes(self._hs[:16])!r}..., not an aiodist handshake"
                )
            )
        if version != _VERSION:
            return self._handshake_failed(
                DistProtocolError(
                    f"{who} speaks transport protocol version {version}, this rank {_VERSION}"
                )
            )
        if world_size != owner.world_size or not 0 <= rank < world_size or rank == owner.rank:
            return self._handshake_failed(
                DistProtocolError(
                    f"{who} says it is rank {rank} of {world_size}; this is rank "
                    f"{owner.rank} of {owner.world_size}"
                )
            )
        self._peer_nonce = nonce
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
        if kind == _REFUSED or peer_auth != (owner._token is not None):
            return self._handshake_failed(_auth_mismatch(self.peer, peer_auth))
        if kind not in (_ACCEPT, _REJECT):
            return self._handshake_failed(DistProtocolError(f"{who} answered a hello with a hello"))
        if owner._token is not None:
            want = self._proof(_ROLE_ACCEPT, self._nonce, nonce, owner.rank)
            if not verify_mac(proof, want):
                return self._handshake_failed(
                    DistNetworkError(
                        f"authentication with rank {self.peer} failed: it could not prove it "
                        "holds this rank's auth token (the ranks' tokens differ)"
                    )
                )
        if kind == _REJECT:
            # The peer's own connection to us is the one kept.
            self.state = _DONE
            self.handshake.set_result(False)
            self.transport.close()
            return None
        if owner._token is not None:
            self.transport.write(self._proof(_ROLE_CONNECT, nonce, self._nonce, owner.rank))
        return self._open()

    def _on_hello(self, kind: int, rank: int, peer_auth: bool) -> None:
        owner = self.owner
        assert self.transport is not None
        if kind != _HELLO:
            return self._handshake_failed(
                DistProtocolError("a connecting peer did not start with a hello")
            )
        if peer_auth != (owner._token is not None):
            # Tell the peer why, so that it fails with a clear message; then drop it.
            self.transport.write(self._handshake_message(_REFUSED, _NO_PROOF))
            logger.warning(
                "rank %d refused a connection from a peer claiming rank %d: %s",
                owner.rank,
                rank,
                "it has no auth token" if owner._token is not None else "it has an auth token",
            )
            self.state = _DONE
            self.transport.close()
            return None
        self.peer = rank
        keep = owner._accepts(rank)
        proof = _NO_PROOF
        if owner._token is not None:
            proof = self._proof(_ROLE_ACCEPT, self._peer_nonce, self._nonce, rank)
        self.transport.write(self._handshake_message(_ACCEPT if keep else _REJECT, proof))
        if not keep:
            self.state = _DONE
            self.transport.close()
            return None
        if owner._token is not None:
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
        self.state = _OPEN
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.handshake.done():
            self.handshake.set_result(True)
        self.owner._establish(self)

    def connection_lost(self, exc: Exception | None) -> None:
        owner = self.owner
        owner._live.discard(self)
        if self._timer is not None:
            self._timer.cancel()
        if not self.lost.done():
            self.lost.set_result(None)
        state, self.state = self.state, _DONE
        if state == _HANDSHAKING:
            error = DistNetworkError(
                f"connection to rank {self.peer} closed during the handshake: {exc or 'EOF'}"
            )
            if not self.handshake.done():
                self.handshake.set_exception(error)
                self.handshake.exception()
        elif state == _OPEN:
            peer = self.peer
            assert peer is not None
            if self.bye is not None and self._inbound is None:
                reason = f"it {self.bye}"
                owner._lose(peer, reason, departure=Departure.LEFT)
            else:
                # Whatever the peer sent before is read by now: only what it did not send
                # fails.
                reason = (
                    f"connection lost: {exc}"
                    if exc
                    else "it went away without a goodbye (its process ended without leaving "
                    "the process group, or was killed)"
                )
                owner._lose(peer, reason, departure=Departure.GONE)
            self._fail_sends(lost_peer_error(peer, reason))  # if the peer had failed before

    def orphaned(self) -> None:
        """Forget a connection whose ``create_connection`` call failed or was cancelled.

        The loop closed its transport itself; uvloop may have called ``connection_made``
        first and then never calls ``connection_lost``.
        """
        self.owner._live.discard(self)
        self.state = _DONE
        if not self.lost.done():
            self.lost.set_result(None)

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows at once

    # -- sending ---------------------------------------------------------------------------

    def send(self, header: bytes, data: memoryview, fut: asyncio.Future[None]) -> None:
        if self._queue or self._write_paused or self._flush_scheduled:
            # Frames leave in order: behind what is already queued.
            self._queue.append((memoryview(header), None if data else fut))
            if data:
                self._queue.append((data, fut))
            return
        transport = self.transport
        assert transport is not None
        size = len(data)
        if size > WRITE_BUDGET:
            self._queue.append((memoryview(header), None))
            self._queue.append((data, fut))
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

    def _after_write(self, fut: asyncio.Future[None]) -> None:
        # pause_writing ran inside write() if the transport kept any of the bytes.
        if self._write_paused:
            self._handed.append(fut)
        elif not fut.done():  # the sender may have given up on it (an aborted operation)
            fut.set_result(None)

    def _flush(self) -> None:
        # Hand up to WRITE_BUDGET bytes of queued frames to the transport.
        self._flush_scheduled = False
        transport = self.transport
        if transport is None or self.state != _OPEN:
            return
        queue = self._queue
        budget = WRITE_BUDGET
        views: list[memoryview] = []
        while queue and budget > 0 and not self._write_paused:
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
                self._handed.append(fut)
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
            if queue and not self._flush_scheduled:
                # More to write: next loop turn, so other callbacks get theirs.
                self._flush_scheduled = True
                self.loop.call_soon(self._flush)

    def _resolve_handed(self) -> None:
        handed, self._handed = self._handed, []
        for fut in handed:
            if not fut.done():
                fut.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._resolve_handed()
        if self._queue and not self._flush_scheduled:
            self._flush()

    def _fail_sends(self, exc: BaseException) -> None:
        for fut in self._handed:
            fail_future(fut, exc)
        self._handed.clear()
        for _, queued in self._queue:
            if queued is not None:
                fail_future(queued, exc)
        self._queue.clear()

    def close_after(self, frame: bytes | None) -> None:
        """Write ``frame`` after the frames already queued, then close without losing it.

        The frame is written only at a frame boundary (nothing of ours still queued). Then
        the sending side is shut down and the connection read, and dropped, until the peer
        closes its end (at most :data:`ABORT_LINGER_SECONDS`): closing with unread bytes
        would reset the connection and make the peer's kernel drop our last frame.
        """
        transport, state = self.transport, self.state
        if transport is None or state == _DONE:
            return  # whoever moved the connection to _DONE closed its transport
        self.state = _DONE
        if state != _OPEN or not transport.can_write_eof():
            transport.abort()
            return
        if frame is not None and not self._queue:
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
        if self.state == _DONE:
            return self._rxv  # closing: whatever still arrives is read and dropped
        if self.state == _HANDSHAKING:
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
        if self.state == _HANDSHAKING:
            self._hs_got += nbytes
            if self._hs_got == len(self._hs):
                self._on_handshake()
            elif (
                self._want_proof is None
                and self._hs[: min(self._hs_got, 4)] != _MAGIC[: min(self._hs_got, 4)]
            ):
                # Garbage (a port scanner, an HTTP client): drop it now, not at the timeout.
                self._handshake_failed(
                    DistProtocolError(
                        f"a peer sent {bytes(self._hs[: self._hs_got])!r}, not an aiodist handshake"
                    )
                )
            return
        if self.state != _OPEN:
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
        if self.state == _OPEN and self.transport is not None:
            self.transport.resume_reading()

    def poll(self) -> None:
        """Read what the socket holds now, without waiting (see ``TCPTransport._poll``)."""
        if self.state != _OPEN or self._read_paused or self.fd < 0:
            return
        while True:
            try:
                got = os.readv(self.fd, (self.get_buffer(-1),))
            except OSError:  # nothing there (EAGAIN), or an error the loop will report
                return
            if not got:  # EOF: the loop sees it too and reports it
                return
            self.buffer_updated(got)
            if self.state != _OPEN or self._read_paused:
                return

    def _said(self, kind: int, text: str) -> None:
        # A goodbye (closing follows) or the cause the peer aborts for.
        if kind == BYE:
            self.bye = text
        else:
            assert self.peer is not None
            self.owner._peer_aborted(self.peer, text)

    def _finish_inbound(self) -> None:
        inbound = self._inbound
        assert inbound is not None
        self._inbound = None
        inbound.done()

    def _parse(self) -> None:
        rx = self._rx
        assert self.peer is not None
        while self.state == _OPEN:
            avail = self._rend - self._rstart
            if self._inbound is None:
                if avail < _HEADER_SIZE:
                    return
                group, seq, step, nbytes, fp = _HEADER.unpack_from(rx, self._rstart)
                self._rstart += _HEADER_SIZE
                if is_control(nbytes, step):
                    self._inbound = ControlText(
                        nbytes, group, seq, step, self.peer, self.mailbox, self._said
                    )
                    self._doff = 0
                    self._drem = step
                    if not step:
                        self._finish_inbound()
                    continue
                if nbytes >= MAX_MESSAGE:
                    self.owner._lose(
                        self.peer,
                        "",
                        DistProtocolError(
                            f"rank {self.peer} sent a frame header announcing {nbytes} bytes: "
                            "not an aiodist peer, or a corrupted stream"
                        ),
                    )
                    return
                try:
                    inbound = self.mailbox.incoming(self.peer, (group, seq, step), nbytes, fp)
                except MemoryError:
                    # A message nobody posted a receive for yet is staged in memory of its
                    # own: a length no allocation can hold must fail this peer, not the loop.
                    self.owner._lose(
                        self.peer,
                        "",
                        DistProtocolError(
                            f"rank {self.peer} sent a message of {nbytes} bytes, more than "
                            "this rank can allocate to hold it"
                        ),
                    )
                    return
                if nbytes:
                    self._inbound = inbound
                    self._doff = 0
                    self._drem = nbytes
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


class _Peer:
    """What this rank knows about one other rank."""

    __slots__ = ("conn", "connecting", "error", "pending", "rank", "waiter")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.conn: _Conn | None = None
        # Our own connection attempt, while it runs.
        self.connecting: asyncio.Task[None] | None = None
        # Resolved when a connection is established, whichever side opened it.
        self.waiter: asyncio.Future[None] | None = None
        # Frames sent before the connection existed, in order.
        self.pending: list[tuple[bytes, memoryview, asyncio.Future[None]]] = []
        self.error: BaseException | None = None


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
    ) -> None:
        super().__init__(rank, world_size, mailbox)
        self.address = address
        self._directory = directory
        self._loop = asyncio.get_running_loop()
        self._server: asyncio.Server | None = None
        self._timeout = timeout
        self._spin = spin
        self._spin_auto = auto_spin
        self._spinning = False
        # Polls that ran out of time in a row, and receives left to skip polling for.
        self._poll_misses = 0
        self._poll_skip = 0
        self._peers = [_Peer(r) for r in range(world_size)]
        # Ranks another transport of this rank reaches: they never connect over TCP.
        self._elsewhere: frozenset[int] = frozenset()
        self._conns: list[_Conn] = []
        # Connections whose transport exists and has not reported connection_lost yet.
        self._live: set[_Conn] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed: BaseException | None = None
        self._token = token
        self._peer_timeout = resolve_peer_timeout()
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

        Returns:
            The listening transport. Connections are opened when first needed.

        Raises:
            DistUsageError: ``rank``, ``world_size``, ``timeout`` or ``spin`` is invalid,
                or the token is empty.
            OSError: the listening socket could not be created.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise DistUsageError(f"world_size must be a positive integer, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise DistUsageError(f"rank must be in [0, {world_size}), got {rank!r}")
        seconds = to_seconds(timeout, DEFAULT_SETUP_TIMEOUT)
        token = resolve_token(auth_token)
        auto_spin = spin is None
        if spin is None:
            local = local_world_size
            if local is None:
                local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            spin = SPIN_SECONDS if local <= len(os.sched_getaffinity(0)) else 0.0
        elif not isinstance(spin, int | float) or spin < 0:
            raise DistUsageError(f"spin must be a non-negative number of seconds, got {spin!r}")
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
            address = (public, int(listener.getsockname()[1]))
        except BaseException:
            listener.close()
            raise
        self = cls(
            directory, rank, world_size, address, seconds, float(spin), auto_spin, token, mailbox
        )
        try:
            self._server = await loop.create_server(
                lambda: _Conn(self, None), sock=listener, backlog=min(max(world_size, 128), 4096)
            )
            await directory.publish(rank, _format_address(public, address[1]))
        except BaseException:
            listener.close()
            await self.aclose()
            raise
        logger.debug("rank %d listening on %s:%d", rank, public, address[1])
        return self

    def __repr__(self) -> str:
        state = "closed" if self._closed is not None else "open"
        return (
            f"<TCPTransport rank={self.rank}/{self.world_size} "
            f"address={self.address[0]}:{self.address[1]} "
            f"connected={self.connected_peers()} "
            f"auth={'on' if self._token is not None else 'off'} {state}>"
        )

    def connected_peers(self) -> list[int]:
        """Return the ranks this transport holds an open connection to."""
        return [c.peer for c in self._conns if c.peer is not None]

    # -- the Transport interface -----------------------------------------------------------

    def send(self, peer: int, tag: Tag, data: memoryview) -> asyncio.Future[None]:
        """Send ``data`` to rank ``peer`` without copying it.

        The future resolves once no buffer of the event loop refers to ``data`` (the caller
        may then reuse it), and fails with ``DistNetworkError`` if the peer is lost first.

        Raises:
            DistUsageError: ``peer`` is out of range, the tag is malformed, or ``data`` is
                not contiguous.
        """
        data = as_bytes(data, writable=False)
        try:
            fp = self.mailbox.fingerprint_of(tag[0], tag[1])
            header = _HEADER.pack(tag[0], tag[1], tag[2], len(data), fp)
        except (struct.error, TypeError, IndexError):
            raise DistUsageError(
                f"a tag must be three integers in [0, 2**64) (group id, seq, step), got {tag!r}"
            ) from None
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < self.world_size:
            raise DistUsageError(f"peer must be a rank in [0, {self.world_size}), got {peer!r}")
        fut: asyncio.Future[None] = self._loop.create_future()
        if peer == self.rank and self._closed is None:
            self.mailbox.deliver(peer, (tag[0], tag[1], tag[2]), data, fp)
            fut.set_result(None)
        else:
            self._send_frame(self._peers[peer], header, data, fut)
        return fut

    def _send_frame(
        self, p: _Peer, header: bytes, data: memoryview, fut: asyncio.Future[None]
    ) -> None:
        conn = p.conn
        if conn is not None:
            conn.send(header, data, fut)
        elif self._closed is not None:
            fail_future(fut, self._closed)
        elif p.error is not None:
            fail_future(fut, p.error)
        else:
            p.pending.append((header, data, fut))
            self._connect_soon(p)

    def send_reject(self, peer: int, group: int, seq: int, reason: str) -> None:
        """Tell ``peer`` that this rank rejected operation ``(group, seq)``, and why."""
        if peer == self.rank:
            self.mailbox.reject(peer, group, seq, reason)
            return
        fut: asyncio.Future[None] = self._loop.create_future()
        # Nobody waits for it: a peer that is gone needs no rejection.
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        frame = control_frame(REJECTION, group, seq, reason)
        self._send_frame(self._peers[peer], frame, memoryview(b""), fut)

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
        try:
            _HEADER.pack(tag[0], tag[1], tag[2], 0, NO_FINGERPRINT)
        except (struct.error, TypeError, IndexError):
            raise DistUsageError(
                f"a tag must be three integers in [0, 2**64) (group id, seq, step), got {tag!r}"
            ) from None
        fut = self.mailbox.post(peer, tag, as_bytes(out, writable=True))
        if not fut.done():
            if peer is not None and peer != self.rank:
                p = self._peers[peer]
                if p.conn is None and p.error is None and self._closed is None:
                    # Connect now, so that a peer that is already gone is noticed.
                    self._connect_soon(p)
            if self._spin and not self._spinning and self._conns:
                if self._poll_skip:
                    self._poll_skip -= 1
                else:
                    self._spinning = True
                    self._loop.call_soon(self._poll, fut)
        return fut

    def abort(self, exc: BaseException) -> None:
        """Fail every pending send and receive with ``exc`` and drop every connection."""
        if self._closed is not None:
            return
        self._closed = exc
        TCPTransport._open_count -= 1
        if self._server is not None:
            self._server.close()
        for task in self._tasks:
            task.cancel()
        for p in self._peers:
            for _, _, fut in p.pending:
                fail_future(fut, exc)
            p.pending.clear()
            if p.waiter is not None:
                fail_future(p.waiter, exc)
            p.conn = None
        # Connected peers learn why before their connection drops.
        frame = control_frame(ABORTING, 0, 0, abort_text(exc))
        for conn in list(self._live):
            conn.close_after(frame)
            conn._fail_sends(exc)
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
        if self._closed is None:
            queued = [f for c in self._conns for _, f in c._queue if f is not None]
            queued += [f for c in self._conns for f in c._handed]
            queued += [fut for p in self._peers for _, _, fut in p.pending]
            if queued:
                await asyncio.wait(queued, timeout=CLOSE_DRAIN_SECONDS)
            if reason is not None and self._closed is None:
                await self._withdraw(reason)
            if self._closed is None:
                bye = control_frame(BYE, 0, 0, reason or CLOSED_REASON)
                for conn in self._conns:
                    conn.close_after(bye)
                self.abort(DistNetworkError(f"the transport of rank {self.rank} was closed"))
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._live:  # their sockets are closed once connection_lost has run
            _, late = await asyncio.wait([c.lost for c in self._live], timeout=CLOSE_DRAIN_SECONDS)
            if late:
                logger.warning(
                    "rank %d: %d connections did not report connection_lost within %g s",
                    self.rank,
                    len(late),
                    CLOSE_DRAIN_SECONDS,
                )
        if self._server is not None:
            await self._server.wait_closed()

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
                conn.poll()
            if fut.done() or self._closed is not None:
                self._poll_misses = 0
                return
            if time.perf_counter() >= deadline:
                break
            os.sched_yield()
        # The answer did not come in time: the peer is slow, or the CPUs are busy with
        # other work and polling only takes one from the peer. Back off exponentially.
        self._poll_misses += 1
        if self._poll_misses >= POLL_MISSES_BEFORE_BACKOFF:
            self._poll_skip = min(1 << self._poll_misses, POLL_MAX_SKIP)

    # -- connections -----------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _connect_soon(self, p: _Peer) -> None:
        if p.connecting is None and p.waiter is None:
            p.waiter = self._loop.create_future()
            p.connecting = self._spawn(self._connect(p, p.waiter))

    def reached_elsewhere(self, peers: Iterable[int]) -> None:
        """Refuse connections claiming one of ``peers``: another transport reaches them."""
        self._elsewhere = frozenset(peers)

    def _accepts(self, peer: int) -> bool:
        # One connection per pair: if both ranks are connecting, the lower rank's wins;
        # a peer that is already connected, or failed, is refused.
        p = self._peers[peer]
        if self._closed is not None or p.conn is not None or p.error is not None:
            return False
        if peer in self._elsewhere:
            logger.warning(
                "rank %d refused a TCP connection from a peer claiming rank %d, "
                "which it reaches through shared memory",
                self.rank,
                peer,
            )
            return False
        return p.connecting is None or peer < self.rank

    async def _connect(self, p: _Peer, waiter: asyncio.Future[None]) -> None:
        peer = p.rank
        if p.conn is not None or waiter.done():
            # The peer's own connection was accepted (or the peer failed) between spawning
            # this task and its first step: nothing left to do.
            if p.connecting is asyncio.current_task():
                p.connecting = None
            return
        conn = _Conn(self, peer)
        try:
            async with asyncio.timeout(self._timeout):
                address = await self._directory.lookup(peer)
                host, port = _parse_address(address)
                try:
                    with map_exceptions(
                        {OSError: DistNetworkError},
                        f"lost connection to rank {peer}: cannot connect to {address}",
                    ):
                        await self._loop.create_connection(lambda: conn, host, port)
                except BaseException:
                    conn.orphaned()
                    raise
                accepted = await conn.handshake
                p.connecting = None
                if not accepted:
                    await asyncio.shield(waiter)
        except asyncio.CancelledError:
            if conn.transport is not None and conn.state != _OPEN:
                conn.transport.abort()
            raise
        except TimeoutError:
            if conn.transport is not None and conn.state != _OPEN:
                conn.transport.abort()
            self._fail_peer(
                p,
                DistTimeoutError(
                    f"connecting to rank {peer} took more than {self._timeout} s "
                    "(its address never appeared in the store, or it did not answer)"
                ),
            )
        except Exception as exc:
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

    def _establish(self, conn: _Conn) -> None:
        peer = conn.peer
        assert peer is not None and conn.transport is not None
        p = self._peers[peer]
        if self._closed is not None or p.conn is not None or p.error is not None:
            # Closed meanwhile; a second connection cannot happen by the tie-break rule.
            conn.state = _DONE
            conn.transport.abort()
            return
        p.conn = conn
        self._conns.append(conn)
        if p.waiter is not None and not p.waiter.done():
            p.waiter.set_result(None)
        p.waiter = None
        pending, p.pending = p.pending, []
        for header, data, fut in pending:
            conn.send(header, data, fut)
        logger.debug("rank %d connected to rank %d", self.rank, peer)

    def peer_gone(self, peer: int, exc: BaseException) -> None:
        """``peer`` went away without a goodbye (the store says so): read what it sent, then
        fail what still needs it, a connection still forming included."""
        p = self._peers[peer]
        if p.error is not None or self._closed is not None or peer == self.rank:
            return
        if p.conn is not None:
            p.conn.poll()  # its last frames may sit in the socket, unread
        if p.error is None:
            self._fail_peer(p, exc)

    def _peer_aborted(self, peer: int, cause: str) -> None:
        """``peer`` said it is aborting, and why: it is lost, with that cause."""
        self._fail_peer(self._peers[peer], peer_aborted_error(peer, cause))

    def _lose(
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
        if p.error is not None or self._closed is not None:
            return
        p.error = exc
        conn = p.conn
        if conn is not None:
            p.conn = None
            self._conns.remove(conn)
            conn._fail_sends(exc)
            conn.state = _DONE
            if conn.transport is not None:
                conn.transport.abort()
        for _, _, fut in p.pending:
            fail_future(fut, exc)
        p.pending.clear()
        if p.waiter is not None:
            fail_future(p.waiter, exc)
            p.waiter = None
        if p.connecting is not None and p.connecting is not asyncio.current_task():
            p.connecting.cancel()
        self.mailbox.fail_peer(p.rank, exc)
        level = logging.WARNING if departure_of(exc) is None else logging.DEBUG
        logger.log(level, "rank %d: %s", self.rank, exc)
