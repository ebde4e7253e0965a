"""What every connection of the store server has, whichever wire it turns out to speak.

The store server (``_server.py``) serves two wires on one port, and a connection learns which
one from the client's first bytes; a probing aiodist client may even start on torch's wire and
switch. So a connection is one object: :class:`ServerConnection` here holds its transport
side (the input buffer, the replies batched for one write, back-pressure, closing), the wires'
classes (``_server_aiodist.py``, ``_server_torch.py``) add their requests on top of it, and
the server's connection class joins the two. The connection's states (:data:`MODE_DETECT` and
the rest) live here because both wires and the server move a connection between them.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._server import TCPStoreServer

__all__ = [
    "FLUSH_BYTES",
    "MODE_AUTH",
    "MODE_CLOSED",
    "MODE_DETECT",
    "MODE_FRAMES",
    "MODE_HELLO",
    "MODE_TORCH",
    "MODE_TORCH_READY",
    "CloseConnection",
    "ServerConnection",
]

#: Replies to one read are written once this many bytes are waiting, so that a client which
#: does not read is paused after this much, not after a whole read's worth of large values.
FLUSH_BYTES = 256 * 1024

# What a connection is reading: its first bytes (which wire?), torch's requests (before and
# after the first one past VALIDATE), aiodist's hello, auth reply and frames; or nothing more.
(
    MODE_DETECT,
    MODE_TORCH,
    MODE_TORCH_READY,
    MODE_HELLO,
    MODE_AUTH,
    MODE_FRAMES,
    MODE_CLOSED,
) = range(7)


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
        "_buf",
        "_client_nonce",
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
        self._mode = MODE_DETECT
        self._out: list[bytes] = []
        self._out_bytes = 0
        self._peer = ""
        # The transport asked to pause writing: the client is not reading its replies.
        self._paused = False
        # Bytes still to skip of an oversized request that was refused without reading it.
        self._discard = 0

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

    def _abort(self) -> None:
        self._mode = MODE_CLOSED
        if self._transport is not None:
            self._transport.abort()
