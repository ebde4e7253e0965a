"""Flow control between this rank and one peer: what a receiver stages is bounded.

A message that arrives before its receive is posted is staged: the receiver keeps a copy
until the receive comes. Each rank bounds the bytes it stages per peer (its *staging bound*,
``staging_bytes``, :data:`DEFAULT_STAGING_BYTES` unless ``$AIODIST_STAGING_BYTES`` says
otherwise) and tells the peer when they connect. A message then goes one of three ways
(the wire format is in :mod:`aiodist.transport._frames`):

* **Eager**: sent at once if it fits in the sender's *credit*, the bytes the receiver may
  still have to stage for it; the credit starts at the receiver's bound. The receiver gives
  the bytes of its messages back unless it stages them (they go to a posted receive), and
  those of a staged message once it was copied into its receive or dropped, in batches
  (:data:`CREDIT_BATCH`).
* **Rendezvous**: a message that does not fit is announced instead (ready to send, a header
  without payload). The receive that takes the announcement clears it (clear to send, named
  by the announcement's *ticket*), and the payload follows, straight into that receive's
  memory, in pieces of a MiB. An announcement costs no credit and is always read, so a
  receive of a later message is never stuck behind one whose receive is not posted yet:
  rank 0 sending a large message tagged 1 and then a small one tagged 2 to rank 1, which
  receives 2 before 1, completes. The pieces of payloads may be overtaken by the link's
  other messages (they are routed by ticket and offset, not matched), so an announcement or
  a clearance waits at most one piece behind them: two ranks exchanging large messages
  clear each other's while their own payloads stream.
* **Free**: a message whose receive is known to be posted (a collective's, once its receiver
  signalled that it posted its receives) or an empty one is sent at once outside the credit.

Over shared memory the rendezvous may take **one copy** instead of two
(:mod:`aiodist.transport._shm_pull`): the sender *offers* the address of the payload just
before it announces it; a receiver whose link can read the sender's memory (its
:class:`Reader`) copies the payload into the receive itself instead of clearing it, says it
*took* it, and the receive completes once the sender *vouches* that it kept the payload
unchanged until then (it withdraws the message instead if its send ended first: a copy made
while the caller may have been writing the memory is never delivered). A read the kernel
refuses clears the message instead, as without an offer.

Over shared memory a payload larger than the link's *eager limit* (``PeerFlow.eager_limit``)
is offered even when the credit covers it: through the ring it would take two copies. It
is announced as *credited* (the sender takes the credit as for an eager message), and the
receiver asks for it at once, copying it into the receive that took it or, if none did yet,
into a staging buffer, as it stages an eager message: such a send still completes without
waiting for its receive. A peer that clears an offer instead of copying it cannot read this
rank's memory: the limit is lifted, and such payloads go eagerly again.

A rendezvous that cannot complete is released, never left waiting. The receiver *refuses*
an announced message that a receive took without its payload (the sizes differ, the
operation's fingerprints differ, or the operation was rejected): the send fails with
``DistUsageError`` giving the receiver's reason. The sender *withdraws* an announced message
whose send ended before it was cleared (cancelled, or failed): the receive that takes it, or
took it, fails with ``DistUsageError``. A lost peer fails the sends waiting for it like any
other, at once.

One :class:`PeerFlow` per peer holds both directions' state; the transport owns it, feeds
it the control messages that arrive, and gives it a function that writes frames to the peer.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from typing import Protocol

import numpy as np

from .._arrays._fingerprint import NO_FINGERPRINT
from ..errors import DistUsageError
from ._failures import fail_future, given_up_by_peer
from ._frames import (
    CREDIT,
    CREDITED,
    CTS,
    EAGER,
    FREE,
    HEADER,
    MAX_MESSAGE,
    OFFER,
    PAYLOAD,
    PIECE,
    REFUSE,
    RTS,
    TAKEN,
    VOUCHED,
    WITHDRAW,
    control_frame,
)
from ._mailbox import Tag

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "STAGING_BYTES_ENV",
    "PeerFlow",
    "Reader",
    "Write",
    "resolve_staging_bytes",
]

#: Bytes a rank stages at most per peer for receives not posted yet, by default. The credit
#: also covers what is on its way (a loopback connection's kernel buffers hold several MiB
#: of a stream): with 4 MiB, a stream of 256 KiB messages into posted receives (the
#: one-way rows of ``bench/transport.py``) had 187 of 1024 announced, with 16 MiB 5.
DEFAULT_STAGING_BYTES = 16 << 20
#: Credit is given back once this much (or a quarter of the bound) is freed: one small
#: message per 4 MiB received (each costs the receiver a write and the sender a read).
CREDIT_BATCH = 4 << 20
#: The environment variable that sets the staging bound, in bytes.
STAGING_BYTES_ENV = "AIODIST_STAGING_BYTES"
_EMPTY = memoryview(b"")

#: Writes one frame to the peer: its header, its payload, the future to resolve once the
#: payload's memory is no longer referred to (``None`` for a control message: nobody waits
#: for it, and it is dropped if the peer is gone), and whether it is a piece of the payload
#: of a cleared message (which later frames may overtake).
Write = Callable[[bytes, memoryview, "asyncio.Future[None] | None", bool], None]


class Reader(Protocol):
    """A link that copies announced payloads from its peer's memory itself."""

    def pull(self, ticket: int, address: int) -> None:
        """Copy the payload of announced message ``ticket``, offered at ``address``, into
        the receive that took it; then call :meth:`PeerFlow.took`, or
        :meth:`PeerFlow.copy_instead` if the peer's memory cannot be read."""

    def complete(self, ticket: int) -> None:
        """The sender vouched for the payload of ``ticket``: complete its receive."""


def resolve_staging_bytes(value: int | None = None) -> int:
    """Return the staging bound per peer: ``value``, else ``$AIODIST_STAGING_BYTES``, else
    :data:`DEFAULT_STAGING_BYTES`.

    Raises:
        DistUsageError: the value (or the variable) is not a non-negative integer.
    """
    source = "staging_bytes"
    if value is None:
        raw = os.environ.get(STAGING_BYTES_ENV, "").strip()
        if not raw:
            return DEFAULT_STAGING_BYTES
        source = f"${STAGING_BYTES_ENV}"
        try:
            value = int(raw)
        except ValueError:
            raise DistUsageError(f"{source}={raw!r} is not a number of bytes") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DistUsageError(f"{source} must be a non-negative number of bytes, got {value!r}")
    return value


class PeerFlow:
    """Flow control with one peer: credit, announced messages and tickets, both ways.

    Args:
        peer: the peer's global rank.
        limit: this rank's staging bound for the peer (what it grants it).
        write: writes a frame to the peer (see :data:`Write`).

    Attributes:
        peer: the peer's global rank.
        limit: this rank's staging bound for the peer.
        credit: bytes this rank may still send to the peer eagerly (the peer's grant, less
            what it holds).
    """

    __slots__ = (
        "_batch",
        "_next_ticket",
        "_offers",
        "_received",
        "_returned",
        "_staged",
        "_taken",
        "_tickets_in",
        "_waiting",
        "_write",
        "credit",
        "eager_limit",
        "limit",
        "offering",
        "peer",
        "reader",
    )

    def __init__(self, peer: int, limit: int, write: Write) -> None:
        self.peer = peer
        self.limit = limit
        self.credit = 0
        self._write = write
        # Sending: the next announcement's ticket, and the announced sends not cleared yet.
        self._next_ticket = 0
        self._waiting: dict[int, tuple[memoryview, asyncio.Future[None]]] = {}
        # Receiving: announcements read so far (the next one's ticket); the bytes of eager
        # messages received, given back, and staged now (they are not given back while
        # staged: received - returned >= staged, and what the peer may send is bounded by
        # limit - (received - returned)).
        self._tickets_in = 0
        self._received = 0
        self._returned = 0
        self._staged = 0
        # A credit message per message freed would double the small messages: batches.
        self._batch = max(1, min(limit // 4, CREDIT_BATCH))
        #: Whether this rank offers the payloads it announces (the peer may read them).
        self.offering = False
        #: The largest payload sent eagerly; a larger one within the credit is announced
        #: as credited instead (see the module).
        self.eager_limit = MAX_MESSAGE
        #: The link that copies offered payloads itself (``None``: they are cleared).
        self.reader: Reader | None = None
        # Receiving: the addresses offered for announced messages not cleared yet, and the
        # tickets whose payloads were copied and wait for the sender's word.
        self._offers: dict[int, int] = {}
        self._taken: set[int] = set()

    def __repr__(self) -> str:
        return (
            f"<PeerFlow rank {self.peer} credit={self.credit} announced={len(self._waiting)} "
            f"staged={self._staged}/{self.limit}>"
        )

    # -- sending ---------------------------------------------------------------------------

    def send(
        self, tag: Tag, data: memoryview, fp: bytes, fut: asyncio.Future[None], cleared: bool
    ) -> None:
        """Send ``data`` tagged ``tag`` the way its size and the credit allow (see the
        module); ``fut`` resolves once the payload's memory is no longer referred to.

        ``cleared``: the caller knows the receive is posted (free of the credit).
        """
        header = self.header(tag, len(data), fp, cleared)
        if header is None:
            self.announce(tag, data, fp, fut)
        else:
            self._write(header, data, fut, False)

    def header(self, tag: Tag, nbytes: int, fp: bytes, cleared: bool) -> bytes | None:
        """Return the header of a message of ``nbytes`` that goes at once (eager, its credit
        taken, or free); ``None`` if it must be announced (:meth:`announce`).

        The common case of :meth:`send`, for a transport's own fast path: packing the header
        checks the tag (``struct.error``, ``TypeError`` or ``IndexError`` for a malformed
        one, before anything is taken).
        """
        if cleared or not nbytes:
            return HEADER.pack(tag[0], tag[1], tag[2], FREE | nbytes, fp)
        if nbytes > self.credit or nbytes > self.eager_limit:
            return None
        header = HEADER.pack(tag[0], tag[1], tag[2], EAGER | nbytes, fp)
        self.credit -= nbytes
        return header

    def announce(self, tag: Tag, data: memoryview, fp: bytes, fut: asyncio.Future[None]) -> None:
        """Announce ``data`` tagged ``tag``: its payload goes once the peer clears it, at
        once if the credit covers it (credited: the peer may stage it).

        Packing the header checks the tag, before anything else happens (see
        :meth:`header`).
        """
        n = len(data)
        credited = n <= self.credit  # (then only the eager limit kept it from going eagerly)
        header = HEADER.pack(tag[0], tag[1], tag[2], (CREDITED if credited else RTS) | n, fp)
        if credited:
            self.credit -= n
        ticket = self._next_ticket
        self._next_ticket += 1
        self._waiting[ticket] = (data, fut)
        fut.add_done_callback(functools.partial(self._given_up, ticket))
        if self.offering and data:
            address = np.frombuffer(data, np.uint8).ctypes.data
            self._write(*_split(control_frame(OFFER, ticket, address)), None, False)
        self._write(header, _EMPTY, None, False)

    def cleared(self, ticket: int) -> None:
        """The peer cleared the announced message ``ticket``: send its payload."""
        waiting = self._waiting.get(ticket)
        if waiting is None:
            return  # withdrawn meanwhile
        data, fut = waiting
        if fut.done():  # given up, and not withdrawn yet: the caller may reuse the memory
            self._given_up(ticket, fut)
            return
        del self._waiting[ticket]
        n = len(data)
        if self.offering:
            # An offer the peer cleared instead of copying: it cannot read this rank's
            # memory (most often the kernel's leave), so announcing what the credit covers
            # gains nothing: such payloads go eagerly again.
            self.eager_limit = MAX_MESSAGE
        for start in range(0, n, PIECE):
            piece = data[start : start + PIECE]
            last = start + PIECE >= n  # its future stands for every piece: they go in order
            header = HEADER.pack(ticket, start, 0, PAYLOAD | len(piece), NO_FINGERPRINT)
            self._write(header, piece, fut if last else None, True)

    def taken(self, ticket: int) -> None:
        """The peer copied the payload of the announced message ``ticket`` from this rank's
        memory: vouch for it, unless the send ended first (then it is withdrawn)."""
        waiting = self._waiting.get(ticket) if self.offering else None
        if waiting is None:
            return  # withdrawn already (or never offered: not a word to heed)
        fut = waiting[1]
        if fut.done():  # ended, not withdrawn yet: the caller may have written the memory
            self._given_up(ticket, fut)
            return
        del self._waiting[ticket]
        self._control(VOUCHED, ticket)
        fut.set_result(None)

    def refused(self, ticket: int, reason: str) -> None:
        """The peer took the announced message ``ticket`` without its payload, for ``reason``."""
        waiting = self._waiting.pop(ticket, None)
        if waiting is not None:
            error = DistUsageError(f"rank {self.peer} refused the message: {reason}")
            fail_future(waiting[1], given_up_by_peer(error))

    def granted(self, nbytes: int) -> None:
        """The peer gave ``nbytes`` of credit back."""
        self.credit += nbytes

    def waiting(self) -> list[asyncio.Future[None]]:
        """Return the futures of the sends whose announced messages are not cleared yet."""
        return [fut for _, fut in self._waiting.values()]

    def fail(self, exc: BaseException) -> None:
        """The peer is gone: fail every send that waits to be cleared with ``exc``."""
        waiting, self._waiting = self._waiting, {}
        for _, fut in waiting.values():
            fail_future(fut, exc)
        self._offers.clear()
        self._taken.clear()

    def _given_up(self, ticket: int, fut: asyncio.Future[None]) -> None:
        # The send ended before its message was cleared: tell the receiver, whose receive
        # would otherwise wait for a payload that never comes.
        if self._waiting.pop(ticket, None) is None:
            return  # cleared, refused, or the peer is gone
        exc = None if fut.cancelled() else fut.exception()
        reason = "its send was cancelled" if exc is None else f"{type(exc).__name__}: {exc}"
        self._control(WITHDRAW, ticket, reason)

    # -- receiving -------------------------------------------------------------------------

    def arrive(self, nbytes: int) -> bool:
        """Count an eager message of ``nbytes`` in (the mailbox says if it stages it, see
        :meth:`hold`); ``False`` if the peer had no credit for it.

        Once every earlier message that was not staged adds up to a batch, its credit goes
        back (once per batch, not per message: this runs for every small message).
        """
        received = self._received
        if received + nbytes - self._returned > self.limit:
            return False
        self._received = received + nbytes
        free = received - self._staged - self._returned
        if free >= self._batch:
            self._give_back(free)
        return True

    def hold(self, nbytes: int) -> None:
        """The message just counted in is staged: its credit stays until :meth:`release`."""
        self._staged += nbytes

    def release(self, nbytes: int) -> None:
        """A staged message of ``nbytes`` was delivered or dropped."""
        self._staged -= nbytes
        free = self._received - self._staged - self._returned
        if free >= self._batch:
            self._give_back(free)

    def _give_back(self, nbytes: int) -> None:
        self._returned += nbytes
        self._control(CREDIT, nbytes)

    def take_ticket(self) -> int:
        """Return the ticket of the announcement just read (they are numbered in order)."""
        ticket = self._tickets_in
        self._tickets_in += 1
        return ticket

    def clear(self, ticket: int) -> None:
        """Its receive is posted: copy the payload of the peer's announced message
        ``ticket`` from the peer's memory if it was offered and the link can, else tell the
        peer it may come."""
        address = self._offers.pop(ticket, None)
        if address is not None and self.reader is not None:
            self.reader.pull(ticket, address)
        else:
            self._control(CTS, ticket)

    def offered(self, ticket: int, address: int) -> None:
        """The peer offered the payload of its announced message ``ticket`` at ``address``."""
        if self.reader is not None and ticket >= self._tickets_in:
            self._offers[ticket] = address

    def took(self, ticket: int, *, wanted: bool = True) -> None:
        """The reader copied the payload of announced message ``ticket``: tell the peer,
        and wait for its word (:meth:`vouched`); or (not ``wanted``) its receive is gone
        and nothing was copied: the peer's send ends, and nothing waits for its word."""
        if wanted:
            self._taken.add(ticket)
        self._control(TAKEN, ticket)

    def copy_instead(self, ticket: int) -> None:
        """The reader could not copy the payload of ``ticket``: the peer sends it."""
        self._control(CTS, ticket)

    def vouched(self, ticket: int) -> None:
        """The peer kept the payload of ``ticket`` unchanged until it was copied."""
        if ticket in self._taken:
            self._taken.remove(ticket)
            assert self.reader is not None
            self.reader.complete(ticket)

    def withdrawn(self, ticket: int) -> None:
        """The peer gave up its announced message ``ticket`` (the mailbox fails its
        receive): nothing of it is copied or completed."""
        self._offers.pop(ticket, None)
        self._taken.discard(ticket)

    def refuse(self, ticket: int, reason: str) -> None:
        """Tell the peer its announced message ``ticket`` was taken without its payload."""
        self._offers.pop(ticket, None)
        self._control(REFUSE, ticket, reason)

    def _control(self, kind: int, group: int, text: str = "") -> None:
        self._write(*_split(control_frame(kind, group, text=text)), None, False)


def _split(frame: bytes) -> tuple[bytes, memoryview]:
    """A whole control frame as the header and the text :data:`Write` takes."""
    return frame[: HEADER.size], memoryview(frame)[HEADER.size :]
