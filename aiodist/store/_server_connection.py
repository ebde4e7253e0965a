"""What every connection of the store server has, whichever wire it turns out to speak.

The store server (``_server.py``) serves two wires on one port, and a connection learns which
one from the client's first bytes; a probing aiodist client may even start on torch's wire and
switch. So a connection is one object: :class:`ServerConnection` here holds its transport
side (the input buffer, the replies batched for one write, back-pressure, closing), the wires'
classes (``_server_aiodist.py``, ``_server_torch.py``) add their requests on top of it, and
the server's connection class joins the two. The connection's states (:data:`MODE_DETECT` and
the rest) live here because both wires and the server move a connection between them.

Until a connection is *admitted* (its client proved the token, or needed none, or it is a
torch client the server lets in) it may hold only :data:`UNADMITTED_BYTES` of unread input
and must finish its handshake within the server's deadline; the server keeps count of such
connections per address (see ``ConnectionServer``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from ._state import KeyValueState

__all__ = [
    "ConnectionServer",
    "FLUSH_BYTES",
    "UNADMITTED_BYTES",
    "MODE_AUTH",
    "MODE_CLOSED",
    "MODE_DETECT",
    "MODE_FRAMES",
    "MODE_HELLO",
    "MODE_PROBE",
    "MODE_TORCH",
    "MODE_TORCH_READY",
    "CloseConnection",
    "ServerConnection",
]

#: Replies to one read are written once this many bytes are waiting, so that a client which
#: does not read is paused after this much, not after a whole read's worth of large values.
FLUSH_BYTES = 256 * 1024
#: The most unread input a connection may hold before it is admitted: every handshake
#: message fits in a few dozen bytes, so more is an attempt to make the server buffer.
UNADMITTED_BYTES = 4096

# What a connection is reading: its first bytes (which wire?), torch's requests (before and
# after the first one past VALIDATE), the upgrade probe that is all a torch-wire connection
# the server does not let in may send after VALIDATE, aiodist's hello, auth reply and frames;
# or nothing more.
(
    MODE_DETECT,
    MODE_TORCH,
    MODE_TORCH_READY,
    MODE_PROBE,
    MODE_HELLO,
    MODE_AUTH,
    MODE_FRAMES,
    MODE_CLOSED,
) = range(8)


logger = logging.getLogger(__name__)


class ConnectionServer(Protocol):
    """What a client's connection asks of the server that accepted it
    (:class:`aiodist.store._server.TCPStoreServer`)."""

    state: KeyValueState
    max_key_size: int
    max_value_size: int
    #: The largest aiodist request body the limits allow.
    max_request: int
    #: Seconds of silence after which a client is taken for gone.
    peer_timeout: float
    #: The shared secret a client proves (``None``: none asked).
    token: bytes | None

    def arrived(self, conn: ServerConnection) -> None:
        """``conn`` was accepted: it starts its handshake."""

    def gone(self, conn: ServerConnection) -> None:
        """``conn``'s socket closed."""

    def settled(self, conn: ServerConnection) -> None:
        """``conn`` was admitted, refused or is gone: it is no longer in its handshake."""

    def say(self, message: str) -> None:
        """Log a warning about refused clients (at a bounded rate)."""

    def trust_host(self, host: str) -> None:
        """Record that a client holding the token connected from ``host``."""

    def admits_torch(self, transport: asyncio.BaseTransport | None) -> bool:
        """Whether the torch-wire client at the other end of ``transport`` may use the store."""

    def torch_refusal(self) -> str:
        """Why a torch-wire client is not let in, as the log says."""


class CloseConnection(Exception):
    """Drop this connection (garbage, protocol violation, refused client)."""


class ServerConnection(asyncio.Protocol):
    """A client connection's transport side: input buffer, batched replies, back-pressure.

    The wire classes subclass it and the server's connection class joins them; it is never
    made on its own.
    """

    # The wires' attributes are declared here too: Python lets only one line of a class's
    # bases add slots, and the connection class has a wire class of each kind as its bases.
    __slots__ = (
        "_admitted",
        "_buf",
        "_client_nonce",
        "_deadline",
        "_deferred",
        "_discard",
        "_leases",
        "_loop",
        "_max_key",
        "_max_value",
        "_max_waiting",
        "_mode",
        "_nonce",
        "_out",
        "_out_bytes",
        "_parked",
        "_paused",
        "_peer",
        "_peer_host",
        "_same_process",
        "_server",
        "_state",
        "_torch_requests",
        "_torch_wait",
        "_torch_wait_notified",
        "_transport",
    )

    def __init__(self, server: ConnectionServer) -> None:
        self._server = server
        self._state = server.state
        self._max_key = server.max_key_size
        self._max_value = server.max_value_size
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._mode = MODE_DETECT
        self._out: list[bytes] = []
        self._out_bytes = 0
        self._peer = ""
        # The transport asked to pause writing: the client is not reading its replies.
        self._paused = False
        # Bytes still to skip of an oversized request that was refused without reading it.
        self._discard = 0
        # Whether the client proved the token (or needed none, or is a torch client let
        # in); until then, the handshake's timer and the peer's address for the server's
        # count of such connections.
        self._admitted = False
        self._deadline: asyncio.TimerHandle | None = None
        self._peer_host = ""

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

    def _admit(self) -> None:
        """The client may now use the store: lift the limits of the handshake."""
        if not self._admitted:
            self._admitted = True
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            self._server.settled(self)

    def refuse(self, why: str, *, graceful: bool = False) -> None:
        """Close this connection and say why (refusals before admission are counted, not
        each logged). ``graceful``: after the replies written so far."""
        if self._admitted:
            logger.warning("store server: closing connection from %s: %s", self.peer, why)
        else:
            self._server.say(f"store server: closing connection from {self.peer}: {why}")
            self._server.settled(self)  # (so that it is not picked to be closed again)
        if graceful:
            self._shutdown()
        else:
            self.abort()

    def pause_writing(self) -> None:
        # The client is not reading its replies: stop reading its requests until it does.
        self._paused = True
        if self._transport is not None:
            self._transport.pause_reading()

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
        self._mode = MODE_CLOSED
        transport = self._transport
        if transport is not None:
            if transport.get_write_buffer_size():
                transport.abort()
            else:
                transport.close()

    def abort(self) -> None:
        """Close this connection at once, dropping what is not written."""
        self._mode = MODE_CLOSED
        if self._transport is not None:
            self._transport.abort()
