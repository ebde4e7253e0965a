"""One shared-memory link: the two rings between this rank and one local peer.

A :class:`ShmLink` writes this rank's messages into its ring in the peer's segment, reads the
peer's messages from the peer's ring in this rank's segment, and rings the peer's doorbell
when the peer sleeps. It belongs to a :class:`~aiodist.transport.shm.ShmTransport`, which
sets the links up, decides when and how many bytes they move, and fails what depends on a
peer that is lost.

Layout. Every rank creates one segment in ``/dev/shm`` holding a control page and one
single-producer single-consumer ring per local peer *sending to it*; every peer maps it.
The control page holds the owner's state (open, closed in order, aborted) and its sleeping
flag; a ring's header holds ``head`` (bytes written, stored only by the sender), ``tail``
(bytes consumed, stored only by the receiver) and ``want`` (the sender waits for space),
each on a cache line of its own. Both counters only grow; ``pos & (size - 1)`` is the
offset in the ring. A message is the TCP transport's 64-byte header (group, seq, step,
length, the operation's fingerprint) followed by the payload, padded to 64 bytes, so a
header never wraps around the end of the ring.

Data path. ``ShmTransport.send`` queues a message on its link, which copies the header and
payload into the ring at once when there is room (a small send's future is resolved before
``send`` returns); a large payload is streamed in ``CHUNK_BYTES`` pieces, ``head`` published
after each, so the receiver copies out while the sender copies in. A receiver that sleeps is
rung after each piece when the host's ranks fit its CPUs, else once per turn: there each ring
is a trip through the scheduler for both, and the receiver has no CPU to copy out meanwhile.
The receiver asks the mailbox where a message goes when its header arrives
(``Mailbox.incoming``): the posted receive's own memory, or a staging buffer, and copies
straight there. What the receiver
stages is bounded by flow control (``_flow``, the same messages as TCP's): a message that
does not fit the peer's credit is announced and its payload waits for the receive. Messages
leave in order, except the pieces of the payloads of cleared messages (``bulk``): each waits
until no other message is queued, so that an announcement or a clearance is not held up
behind a payload. The receiver always reads its ring: what a peer may write unasked is
bounded.

Waiting for room. A sender waiting for room pairs its ``want`` flag with the receiver's
``tail`` as the doorbell pairs ``head`` with the sleeping flag (``_shm_signal`` has the
argument): it stores ``want``, fences, and loads ``tail`` once more; the receiver stores
``tail``, fences, and loads ``want`` (and rings only if it is set).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Protocol

import numpy as np

from ..errors import DistProtocolError
from ._failures import fail_future
from ._flow import PeerFlow
from ._frames import BYE, HEADER, MAX_MESSAGE, ControlText, is_control, open_message
from ._mailbox import Inbound, Mailbox
from ._shm_pull import pulling_turned_on, read_memory
from ._shm_segment import ProcessId, Segment
from ._shm_signal import Bell, PeerWatch, fence

__all__ = [
    "LinkOwner",
    "ABORTED",
    "CHUNK_BYTES",
    "CLOSED",
    "CTRL_BYTES",
    "OPEN",
    "RING_HDR_BYTES",
    "TURN_BYTES",
    "W_MAGIC",
    "W_SLEEP",
    "W_STATE",
    "QueuedSend",
    "ShmLink",
    "control_send",
    "leave_cause",
]

_HEADER = HEADER
_HDR = _HEADER.size
_ALIGN_MASK = 63
# The segment's layout is named for the transport too: it lays segments out, checks their
# magic and publishes its own state.
CTRL_BYTES = 4096
# Word indices in the control page (each on a cache line of its own).
W_MAGIC, W_STATE, W_SLEEP = 0, 8, 16
# Where in the control page an aborting owner leaves its cause: a u32 length, then UTF-8.
# (A message may be half written into a ring when the owner aborts, so the cause cannot
# follow it there.)
_CAUSE_AT = 1024
_CAUSE_MAX = CTRL_BYTES - _CAUSE_AT - 4
RING_HDR_BYTES = 256
# Word indices in a ring's header, relative to its first word.
_R_HEAD, _R_TAIL, _R_WANT = 0, 8, 16
# Owner states; 0 while setting up.
OPEN, CLOSED, ABORTED = 1, 2, 3
_EMPTY = memoryview(b"")

#: A large payload is published to the receiver in pieces of this size.
CHUNK_BYTES = 256 << 10
#: Bytes moved (both directions together) per loop turn.
TURN_BYTES = 1 << 20
#: A payload larger than this is offered even when the credit covers it (announced as
#: credited: the receiver copies it from this rank's memory at once, into the receive or a
#: staging buffer). Through the ring it takes two copies, each read on another CPU than
#: the one that wrote it, and waits for the receiver to drain a ring it fills; from about
#: 1 MiB on that costs more than the announcement's round trip.
OFFERED_ABOVE = 512 << 10
#: Bytes of an offered payload copied from the peer's memory per loop turn (about a
#: millisecond: the loop's other work is not held up for long).
PULL_STEP = 4 << 20

logger = logging.getLogger(__name__)


class QueuedSend:
    """A queued send: its header, payload, future and how far it has been written."""

    __slots__ = ("data", "fut", "header", "off")

    def __init__(self, header: bytes, data: memoryview, fut: asyncio.Future[None]) -> None:
        self.header = header
        self.data = data
        self.fut = fut
        self.off = -1  # -1: the header is not written yet


def _retrieve(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()


def leave_cause(buf: memoryview, text: str) -> None:
    """Write why this rank aborts into its control page ``buf``, before its state says
    aborted (the peers read it with :meth:`ShmLink.peer_cause`)."""
    data = text.encode(errors="replace")[:_CAUSE_MAX]
    buf[_CAUSE_AT + 4 : _CAUSE_AT + 4 + len(data)] = data
    buf[_CAUSE_AT : _CAUSE_AT + 4] = len(data).to_bytes(4, "little")


def control_send(frame: bytes, fut: asyncio.Future[None]) -> QueuedSend:
    """A control message as a send: its header, then its text as the payload."""
    return QueuedSend(frame[:_HDR], memoryview(frame)[_HDR:], fut)


class LinkOwner(Protocol):
    """What a link asks of the transport that owns it
    (:class:`aiodist.transport.shm.ShmTransport`)."""

    rank: int
    mailbox: Mailbox
    #: The staging bound per peer (bytes), for the link's flow control.
    staging: int
    #: The node segment the rings live in.
    seg: Segment | None
    loop: asyncio.AbstractEventLoop
    #: Why the transport closed, once it has.
    closed: BaseException | None
    #: Counts the completions links made; the poller sees it move.
    completions: int
    #: Counts the bytes links copied from their peers' memory.
    pulled_bytes: int

    @property
    def polls(self) -> bool:
        """Whether the transport polls for its peers' writes (its rank has a CPU of its
        own), so that a sleeping receiver it writes to need not be rung at once."""

    def schedule(self) -> None:
        """Make sure the poller runs soon."""

    def peer_exited(self, link: ShmLink) -> None:
        """``link``'s peer closed, aborted or ended."""

    def lose(self, link: ShmLink, exc: BaseException) -> None:
        """``link`` failed with ``exc``: fail what waits on its peer."""


class ShmLink:
    """Everything between this rank and one local peer: both rings, its doorbell, its pid."""

    def __init__(
        self,
        owner: LinkOwner,
        peer: int,
        proc: ProcessId,
        peer_seg: Segment,
        out_ring: int,
        in_ring: int,
        cap: int,
        bell: Bell,
    ) -> None:
        self.owner = owner
        self.peer = peer
        self.flow = PeerFlow(peer, owner.staging, self.write)
        if pulling_turned_on():
            # Large payloads take one copy, from one process's memory to the other's.
            self.flow.offering = True
            self.flow.reader = self
            self.flow.eager_limit = OFFERED_ABOVE
        self.proc = proc
        self.peer_seg = peer_seg
        self.cap = cap
        self.mask = cap - 1
        self.bell = bell
        self.watch: PeerWatch | None = None
        self.error: BaseException | None = None
        # What the peer said when it said goodbye (it closes in order).
        self.bye: str | None = None
        # Sending: our ring in the peer's segment; the peer's control words are there too.
        self.tx_buf = peer_seg.buf
        self.tx_words = peer_seg.words
        self.tx_data = out_ring + RING_HDR_BYTES
        w = out_ring // 8
        self.tx_head_w, self.tx_tail_w, self.tx_want_w = w + _R_HEAD, w + _R_TAIL, w + _R_WANT
        self.head = 0
        self.want = False
        # Messages to write in order (at most one payload piece among them, the one being
        # written), and the other payload pieces, which wait for the queue to empty.
        self.queue: deque[QueuedSend] = deque()
        self.bulk: deque[QueuedSend] = deque()
        # Receiving: the peer's ring in our own segment.
        seg = owner.seg
        assert seg is not None
        self.rx_buf = seg.buf
        self.rx_words = seg.words
        self.rx_data = in_ring + RING_HDR_BYTES
        w = in_ring // 8
        self.rx_head_w, self.rx_tail_w, self.rx_want_w = w + _R_HEAD, w + _R_TAIL, w + _R_WANT
        self.tail = 0
        # The message whose payload is arriving: a data message, or a control text.
        self.inbound: Inbound | ControlText | None = None
        self.doff = 0
        self.drem = 0

    def __repr__(self) -> str:
        return (
            f"<ShmLink rank {self.owner.rank} <-> {self.peer} queued={len(self.queue)} "
            f"receiving={self.inbound is not None} error={self.error!r}>"
        )

    def peer_state(self) -> int:
        return self.tx_words[W_STATE]

    def peer_cause(self) -> str:
        """What the peer aborted for (see :func:`leave_cause`), once its state says so."""
        fence()  # (the state was loaded before)
        buf = self.tx_buf
        n = min(int.from_bytes(buf[_CAUSE_AT : _CAUSE_AT + 4], "little"), _CAUSE_MAX)
        return bytes(buf[_CAUSE_AT + 4 : _CAUSE_AT + 4 + n]).decode(errors="replace")

    # -- sending ---------------------------------------------------------------------------

    def write(
        self,
        header: bytes,
        data: memoryview,
        fut: asyncio.Future[None] | None,
        bulk: bool = False,
    ) -> None:
        """Queue a message to the peer, and write it at once if nothing is queued (see
        :data:`aiodist.transport._flow.Write`)."""
        owner = self.owner
        if fut is None:
            # Nobody waits for a control message: a peer that is gone needs none.
            fut = owner.loop.create_future()
            fut.add_done_callback(_retrieve)
        if owner.closed is not None:
            fail_future(fut, owner.closed)
            return
        if self.error is not None:
            fail_future(fut, self.error)
            return
        send = QueuedSend(header, data, fut)
        if bulk and (self.queue or self.bulk):
            # Behind every other payload (they leave in order: a payload's last piece
            # stands for all of it), and behind the other messages queued now.
            self.bulk.append(send)
        elif self.queue:
            self.queue.append(send)
        else:
            self.queue.append(send)
            self.tx(TURN_BYTES)
        if self.queue or self.bulk:
            owner.schedule()

    def tx(self, budget: int) -> int:
        """Copy queued sends into the ring; return the bytes moved (at most ``budget``)."""
        if budget <= 0:
            # Nothing can move, so nothing is learnt: in particular the want flag of a
            # sender still waiting for room must stay set, or the receiver never rings.
            return 0
        queue = self.queue
        words = self.tx_words
        buf = self.tx_buf
        cap, mask, base = self.cap, self.mask, self.tx_data
        head = self.head
        tail = words[self.tx_tail_w]
        moved = 0
        blocked = False
        while budget > 0:
            if not queue:
                if not self.bulk:
                    break
                # A message boundary with nothing else to send: the next payload piece.
                queue.append(self.bulk.popleft())
            s = queue[0]
            free = cap - (head - tail)
            if s.off < 0:
                if free < _HDR:
                    blocked = True
                    break
                pos = base + (head & mask)
                buf[pos : pos + _HDR] = s.header
                head += _HDR
                free -= _HDR
                moved += _HDR
                budget -= _HDR
                s.off = 0
            data = s.data
            off = s.off
            left = len(data) - off
            if left:
                take = min(left, free, budget, CHUNK_BYTES)
                if take <= 0:
                    blocked = free <= 0
                    break
                start = head & mask
                first = min(take, cap - start)
                buf[base + start : base + start + first] = data[off : off + first]
                if first < take:
                    buf[base : base + take - first] = data[off + first : off + take]
                head += take
                moved += take
                budget -= take
                s.off = off = off + take
                if off < len(data):
                    # Publish this piece, so the receiver copies it out while we go on: if
                    # it sleeps, woken now when it has a CPU of its own (the transport
                    # polls), else by the ring below, once per turn. With more ranks than
                    # CPUs a ring per piece costs both ranks a trip through the scheduler
                    # per piece (4 ranks on 2 CPUs, each sending 4 MiB to the next: 20
                    # rings per exchange, 8 without, and half the time).
                    words[self.tx_head_w] = head
                    if self.owner.polls:
                        self._ring_if_sleeping()
                    tail = words[self.tx_tail_w]
                    continue
            head = (head + _ALIGN_MASK) & ~_ALIGN_MASK
            queue.popleft()
            if not s.fut.done():
                s.fut.set_result(None)
            self.owner.completions += 1
        if moved:
            self.head = head
            words[self.tx_head_w] = head
            self._ring_if_sleeping()
        if blocked != self.want:
            self.want = blocked
            words[self.tx_want_w] = int(blocked)
            if blocked:
                # Our store of want, a barrier, then one more load of tail (see
                # _shm_signal): a receiver that freed space before it could see the flag
                # did not ring, and we would sleep on a ring that has room.
                fence()
                if words[self.tx_tail_w] != tail:
                    return moved + self.tx(budget)
        return moved

    def _ring_if_sleeping(self) -> None:
        # Our store of head, a barrier, then the load of the peer's flag (see _shm_signal).
        fence()
        if self.tx_words[W_SLEEP] and not self.bell.ring():
            self.owner.loop.call_soon(self.owner.peer_exited, self)

    # -- receiving -------------------------------------------------------------------------

    def rx(self, budget: int) -> int:
        """Copy arrived bytes to where the mailbox says; return the bytes moved."""
        words = self.rx_words
        head = words[self.rx_head_w]
        tail = self.tail
        if head == tail:
            return 0
        buf = self.rx_buf
        cap, mask, base = self.cap, self.mask, self.rx_data
        mailbox = self.owner.mailbox
        moved = 0
        done: list[Inbound | ControlText] = []
        while tail != head and budget > 0:
            if self.inbound is None:
                group, seq, step, word, fp = _HEADER.unpack_from(buf, base + (tail & mask))
                tail += _HDR
                moved += _HDR
                budget -= _HDR
                if is_control(word, step):
                    control = ControlText(
                        word, group, seq, step, self.peer, mailbox, self.flow, self._said
                    )
                    if step:
                        self.inbound, self.doff, self.drem = control, 0, step
                    else:
                        self._control_done(control)
                    continue
                try:
                    inbound = open_message(
                        mailbox, self.flow, self.peer, group, seq, step, word, fp
                    )
                except DistProtocolError as exc:
                    self._publish_tail(tail)
                    self.owner.lose(self, exc)
                    return moved
                except MemoryError:
                    self._publish_tail(tail)
                    self.owner.lose(
                        self,
                        DistProtocolError(
                            f"rank {self.peer} sent a message of {word & (MAX_MESSAGE - 1)} "
                            "bytes, more than this rank can allocate to hold it"
                        ),
                    )
                    return moved
                if inbound is not None:
                    self.inbound = inbound
                    self.doff = 0
                    self.drem = len(inbound.buffer)
                continue
            take = min(head - tail, self.drem, budget)
            start = tail & mask
            first = min(take, cap - start)
            # Read the destination each time: a rejected operation's message is switched
            # to scratch memory while it arrives.
            assert self.inbound is not None
            dest, doff = self.inbound.buffer, self.doff
            dest[doff : doff + first] = buf[base + start : base + start + first]
            if first < take:
                dest[doff + first : doff + take] = buf[base : base + take - first]
            tail += take
            moved += take
            budget -= take
            self.doff = doff + take
            self.drem -= take
            if not self.drem:
                tail = (tail + _ALIGN_MASK) & ~_ALIGN_MASK
                arrived, self.inbound = self.inbound, None
                if isinstance(arrived, ControlText):
                    self._control_done(arrived)
                else:
                    done.append(arrived)
        self._publish_tail(tail)
        if done:
            self.owner.completions += len(done)
            for arrived in done:
                arrived.done()
        return moved

    # -- the single-copy path (the flow's Reader) -------------------------------------------

    def pull(self, ticket: int, address: int) -> None:
        """Copy the peer's payload of announced message ``ticket`` from ``address`` in its
        memory into the receive that took it, :data:`PULL_STEP` bytes per loop turn, from
        the next turn on (as a payload through the ring would: a receive failed at once,
        its operation rejected as it was posted, is never written)."""
        self.owner.loop.call_soon(self._pull_step, ticket, address, 0)

    def _pull_step(self, ticket: int, address: int, offset: int) -> None:
        out = self.owner.mailbox.cleared_memory(self.peer, ticket)
        if self.error is not None or self.owner.closed is not None:
            return  # (what waits on the peer fails with the link)
        if out is None:
            # The receive is gone (failed, or the message withdrawn): nothing is copied,
            # and the send ends as one whose payload went to a dropped receive does.
            self.flow.took(ticket, wanted=False)
            return
        end = min(len(out), offset + PULL_STEP)
        try:
            dest = np.frombuffer(out, np.uint8).ctypes.data
            read_memory(self.proc.pid, address + offset, dest + offset, end - offset)
            self.owner.pulled_bytes += end - offset
        except OSError as exc:
            if isinstance(exc, PermissionError):
                logger.info(
                    "rank %d cannot read the memory of rank %d (%s): its large messages "
                    "come through the ring",
                    self.owner.rank,
                    self.peer,
                    exc,
                )
                self.flow.reader = None
            # (Gone, or the range unmapped: the peer gave the send up, or died. Through the
            # ring it withdraws the message or its loss is seen, as for any message.)
            self.flow.copy_instead(ticket)
            return
        if end < len(out):
            self.owner.loop.call_soon(self._pull_step, ticket, address, end)
        else:
            self.flow.took(ticket)

    def complete(self, ticket: int) -> None:
        """The peer vouched for the payload of ``ticket`` copied by :meth:`pull`."""
        self.owner.completions += 1
        self.owner.mailbox.pulled(self.peer, ticket)

    def _control_done(self, text: ControlText) -> None:
        # Handed on at once, before the next message is matched: a peer's rejection of a
        # send takes the place of that message, and the message after it must not take the
        # receive that was waiting for it.
        self.owner.completions += 1
        text.done()

    def _publish_tail(self, tail: int) -> None:
        self.tail = tail
        words = self.rx_words
        words[self.rx_tail_w] = tail
        # Our store of tail, a barrier, then the loads of the sender's flags.
        fence()
        if words[self.rx_want_w] and self.tx_words[W_SLEEP] and not self.bell.ring():
            self.owner.loop.call_soon(self.owner.peer_exited, self)

    def _said(self, kind: int, text: str) -> None:
        # A goodbye: the peer's state says closed next.
        if kind == BYE:
            self.bye = text

    def drain(self) -> None:
        """Take everything the peer wrote (it is gone): complete messages are delivered."""
        while self.rx(1 << 62):
            pass

    def close(self) -> None:
        """Let go of the peer's segment, doorbell and process watch."""
        if self.watch is not None:
            self.watch.close()
        self.bell.close()
        self.tx_buf = self.rx_buf = _EMPTY
        self.peer_seg.close()
