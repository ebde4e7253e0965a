"""The message header both streaming transports (TCP, shared memory) write, and their
control messages.

Every message is a 64-byte header followed by its payload::

    header := group:u64 seq:u64 step:u64 word:u64 fingerprint:32s   (little endian)

Below :data:`CONTROL`, ``word`` is a data message: its payload's length (under
:data:`MAX_MESSAGE`) plus its kind in the top byte (see :mod:`aiodist.transport._flow`):

* :data:`EAGER` (0): sent at once, within the credit the receiver granted.
* :data:`FREE`: sent at once outside the credit (empty, or its receive is known to be posted).
* :data:`RTS` ("ready to send"): announces a message of that length and carries no payload;
  the announcements of one direction of a link are numbered from 0 (their *tickets*).
* :data:`CREDITED`: announces a message as :data:`RTS` does, one the sender took credit for:
  the receiver asks for its payload at once, into a staging buffer if no receive took it.
* :data:`PAYLOAD`: a piece of the payload of the announced message whose ticket ``group``
  holds, once the receiver cleared it: the bytes from offset ``seq`` (``step`` and the
  fingerprint are zero). Pieces are written in order, :data:`PIECE` bytes each but the
  last, so that other messages are never held up for long behind a payload.

Lengths from :data:`CONTROL` up that no payload can have mark control messages, whose
``step`` is the length of the UTF-8 text that follows (zero for some): :data:`BYE` (the
sender closes in order; the text says why it leaves), :data:`REJECTION` (the sender
rejected operation ``(group, seq)``; the text is why), :data:`ABORTING` (the sender is
aborting; the text is the cause), :data:`CTS` ("clear to send" the announced message with
ticket ``group``), :data:`REFUSE` (the receiver took the announced message with ticket
``group`` without its payload; the text is why), :data:`WITHDRAW` (the sender gave up the
announced message with ticket ``group``; the text is why), :data:`CREDIT` (``group``
more bytes may be sent eagerly), and the single-copy path of shared memory
(:mod:`aiodist.transport._shm_pull`): :data:`OFFER` (the payload of the announced message
with ticket ``group`` is at address ``seq`` in the sender's memory; sent just before its
announcement), :data:`TAKEN` (the receiver copied that payload itself) and :data:`VOUCHED`
(the sender kept it unchanged until then: the copy is good).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Protocol

from .._arrays._fingerprint import FINGERPRINT_SIZE, NO_FINGERPRINT
from ..errors import DistProtocolError
from ._mailbox import Flow, Inbound, Mailbox

__all__ = [
    "LinkFlow",
    "ABORTING",
    "BYE",
    "CONTROL",
    "CREDIT",
    "CREDITED",
    "CTS",
    "EAGER",
    "FREE",
    "HEADER",
    "MAX_MESSAGE",
    "MAX_REASON",
    "OFFER",
    "PAYLOAD",
    "PIECE",
    "REFUSE",
    "REJECTION",
    "RTS",
    "TAKEN",
    "VOUCHED",
    "WITHDRAW",
    "ControlText",
    "control_frame",
    "is_control",
    "open_message",
]

#: group id, sequence number, step, payload length and kind, the operation's fingerprint
HEADER = struct.Struct(f"<QQQQ{FINGERPRINT_SIZE}s")
#: A payload this large is garbage, not a message: nothing is allocated for it.
MAX_MESSAGE = 1 << 48
_LENGTH = MAX_MESSAGE - 1
# Kinds of data message, in the top byte of the length word.
EAGER = 0
FREE = 1 << 56
RTS = 2 << 56
PAYLOAD = 3 << 56
CREDITED = 4 << 56
BYE = (1 << 64) - 1
REJECTION = (1 << 64) - 2
ABORTING = (1 << 64) - 3
CTS = (1 << 64) - 4
REFUSE = (1 << 64) - 5
WITHDRAW = (1 << 64) - 6
CREDIT = (1 << 64) - 7
OFFER = (1 << 64) - 8
TAKEN = (1 << 64) - 9
VOUCHED = (1 << 64) - 10
#: The smallest length word of a control message.
CONTROL = VOUCHED
#: The bytes of a payload piece (see :data:`PAYLOAD`).
PIECE = 1 << 20
#: The longest text a control message carries; longer ones are cut.
MAX_REASON = 16 << 10


class LinkFlow(Flow, Protocol):
    """What a link's reader asks of the flow control of its peer
    (:class:`aiodist.transport._flow.PeerFlow`), besides what the mailbox asks."""

    limit: int

    def arrive(self, nbytes: int) -> bool:
        """Count a message of ``nbytes`` sent eagerly: false when it oversteps the bound."""

    def cleared(self, ticket: int) -> None:
        """The receiver asked for the payload of this rank's announced message ``ticket``."""

    def granted(self, nbytes: int) -> None:
        """The receiver gave back ``nbytes`` of credit."""

    def refused(self, ticket: int, reason: str) -> None:
        """The receiver took this rank's announced message ``ticket`` without its payload."""

    def offered(self, ticket: int, address: int) -> None:
        """The sender offered the payload of its announced message ``ticket`` at
        ``address`` in its memory."""

    def taken(self, ticket: int) -> None:
        """The receiver copied the payload of this rank's announced message ``ticket``
        from this rank's memory itself."""

    def vouched(self, ticket: int) -> None:
        """The sender kept the payload of announced message ``ticket`` unchanged until this
        rank had copied it."""

    def withdrawn(self, ticket: int) -> None:
        """The sender gave up its announced message ``ticket``."""


def control_frame(kind: int, group: int, seq: int = 0, text: str = "") -> bytes:
    """Return a whole control message: header and text."""
    data = text.encode(errors="replace")[:MAX_REASON]
    return HEADER.pack(group, seq, len(data), kind, NO_FINGERPRINT) + data


def is_control(word: int, step: int) -> bool:
    """Whether a header with this length word and step announces a control message."""
    return word >= CONTROL and step <= MAX_REASON


def open_message(
    mailbox: Mailbox,
    flow: LinkFlow,
    peer: int,
    group: int,
    seq: int,
    step: int,
    word: int,
    fp: bytes,
) -> Inbound | None:
    """Hand the header of a data message from ``peer`` to the mailbox; return where its
    payload goes, or ``None`` if it has none (empty, or an announcement).

    Raises:
        DistProtocolError: the length word is no data message's, or the peer sent an eager
            message beyond the credit this rank granted it.
        MemoryError: the message's memory cannot be allocated.
    """
    if word < MAX_MESSAGE:  # EAGER (kind 0): the common case first
        if not flow.arrive(word):
            raise DistProtocolError(
                f"rank {peer} sent a message of {word} bytes, more than this rank lets it "
                f"send before the receive is posted ({flow.limit} bytes staged at most)"
            )
        inbound = mailbox.incoming(peer, (group, seq, step), word, fp, flow)
        return inbound if word else None
    kind, nbytes = word & ~_LENGTH, word & _LENGTH
    if kind == FREE:
        inbound = mailbox.incoming(peer, (group, seq, step), nbytes, fp)
    elif kind == PAYLOAD:
        inbound = mailbox.cleared_payload(peer, group, seq, nbytes)
    elif kind == RTS:
        mailbox.announce(peer, (group, seq, step), nbytes, fp, flow)
        return None
    elif kind == CREDITED:
        if not flow.arrive(nbytes):
            raise DistProtocolError(
                f"rank {peer} announced a message of {nbytes} bytes as within its credit, "
                f"more than this rank lets it send before the receive is posted "
                f"({flow.limit} bytes staged at most)"
            )
        mailbox.announce(peer, (group, seq, step), nbytes, fp, flow, credited=True)
        return None
    else:
        raise DistProtocolError(
            f"rank {peer} sent a frame header announcing {word} bytes: not an aiodist peer, "
            "or a corrupted stream"
        )
    return inbound if nbytes else None


class ControlText:
    """Where the text of a control message goes while it arrives (an inbound, like the
    mailbox's: the transport fills :attr:`buffer`, then calls :meth:`done`).

    Args:
        kind: the control message's length word (:data:`BYE`, :data:`CTS`, ...).
        group: the header's group (a ticket or a credit for the flow's messages).
        seq: the header's sequence number.
        nbytes: the length of the text.
        peer: the sender.
        mailbox: the receiving rank's mailbox (rejections and withdrawals go there).
        flow: the flow control of the link it came by (clearances, refusals and credit go
            there).
        said: called with the kind and the text of a :data:`BYE` or :data:`ABORTING`
            message: the transport notes the goodbye, or loses the peer naming the cause.
    """

    __slots__ = ("_said", "buffer", "flow", "group", "kind", "mailbox", "peer", "seq")

    def __init__(
        self,
        kind: int,
        group: int,
        seq: int,
        nbytes: int,
        peer: int,
        mailbox: Mailbox,
        flow: LinkFlow,
        said: Callable[[int, str], None],
    ) -> None:
        self.kind = kind
        self.group = group
        self.seq = seq
        self.peer = peer
        self.mailbox = mailbox
        self.flow = flow
        self._said = said
        self.buffer = memoryview(bytearray(nbytes))

    def done(self) -> None:
        """The whole text arrived: hand it on."""
        text = bytes(self.buffer).decode(errors="replace")
        kind = self.kind
        if kind == CTS:
            self.flow.cleared(self.group)
        elif kind == CREDIT:
            self.flow.granted(self.group)
        elif kind == REFUSE:
            self.flow.refused(self.group, text)
        elif kind == WITHDRAW:
            self.flow.withdrawn(self.group)
            self.mailbox.withdrawn(self.peer, self.group, text)
        elif kind == OFFER:
            self.flow.offered(self.group, self.seq)
        elif kind == TAKEN:
            self.flow.taken(self.group)
        elif kind == VOUCHED:
            self.flow.vouched(self.group)
        elif kind == REJECTION:
            self.mailbox.reject(self.peer, self.group, self.seq, text)
        elif kind in (BYE, ABORTING):
            self._said(kind, text)
