"""The message header both streaming transports (TCP, shared memory) write, and their
control messages.

Every message is a 64-byte header followed by its payload::

    header := group:u64 seq:u64 step:u64 nbytes:u64 fingerprint:32s   (little endian)

Three lengths that no payload can have mark control messages, whose ``step`` is the length
of the UTF-8 text that follows: :data:`BYE` (the sender closes in order; the text says why it
leaves), :data:`REJECTION` (the sender rejected operation ``(group, seq)``; the text is why)
and :data:`ABORTING` (the sender is aborting; the text is the cause).
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from .._fingerprint import FINGERPRINT_SIZE, NO_FINGERPRINT
from ._mailbox import Mailbox

__all__ = [
    "ABORTING",
    "BYE",
    "HEADER",
    "MAX_MESSAGE",
    "MAX_REASON",
    "REJECTION",
    "ControlText",
    "control_frame",
    "is_control",
]

#: group id, sequence number, step, payload length, the operation's fingerprint
HEADER = struct.Struct(f"<QQQQ{FINGERPRINT_SIZE}s")
#: A payload this large is garbage, not a message: nothing is allocated for it.
MAX_MESSAGE = 1 << 48
BYE = (1 << 64) - 1
REJECTION = (1 << 64) - 2
ABORTING = (1 << 64) - 3
#: The longest text a control message carries; longer ones are cut.
MAX_REASON = 16 << 10


def control_frame(kind: int, group: int, seq: int, text: str = "") -> bytes:
    """Return a whole control message: header and text."""
    data = text.encode(errors="replace")[:MAX_REASON]
    return HEADER.pack(group, seq, len(data), kind, NO_FINGERPRINT) + data


def is_control(nbytes: int, step: int) -> bool:
    """Whether a header with this length and step announces a control message with text."""
    return nbytes in (BYE, REJECTION, ABORTING) and step <= MAX_REASON


class ControlText:
    """Where the text of a control message goes while it arrives (an inbound, like the
    mailbox's: the transport fills :attr:`buffer`, then calls :meth:`done`).

    Args:
        kind: :data:`BYE`, :data:`REJECTION` or :data:`ABORTING`.
        group: the header's group.
        seq: the header's sequence number.
        nbytes: the length of the text.
        peer: the sender.
        mailbox: the receiving rank's mailbox (rejections go there).
        said: called with the kind and the text of a :data:`BYE` or :data:`ABORTING`
            message: the transport notes the goodbye, or loses the peer naming the cause.
    """

    __slots__ = ("_said", "buffer", "group", "kind", "mailbox", "peer", "seq")

    def __init__(
        self,
        kind: int,
        group: int,
        seq: int,
        nbytes: int,
        peer: int,
        mailbox: Mailbox,
        said: Callable[[int, str], None],
    ) -> None:
        self.kind = kind
        self.group = group
        self.seq = seq
        self.peer = peer
        self.mailbox = mailbox
        self._said = said
        self.buffer = memoryview(bytearray(nbytes))

    def done(self) -> None:
        """The whole text arrived: hand it on."""
        text = bytes(self.buffer).decode(errors="replace")
        if self.kind == REJECTION:
            self.mailbox.reject(self.peer, self.group, self.seq, text)
        else:
            self._said(self.kind, text)
