"""Message matching shared by every transport.

A :class:`Mailbox` pairs incoming messages with posted receives. Receives for one
``(peer, tag)`` match messages in the order the peer sent them; a receive with
``peer=None`` takes the oldest unmatched message with its tag from any peer. A message that
arrives before its receive is posted is staged (copied once into a buffer of its own) and
copied out when the receive is posted.

Transports that stream bytes (TCP, shared memory) ask :meth:`Mailbox.incoming` where the
``n`` bytes of a message whose header they just read should go: straight into the posted
receive's memory when there is one (no copy at all), otherwise into a staging buffer.
In-process transports call :meth:`Mailbox.deliver`, which does the same with one memcpy.

Streaming transports bound what is staged per peer (see :mod:`aiodist.transport._flow`): a
staged message holds its sender's credit (a :class:`Flow`) until it is delivered or dropped,
and a message too large for the credit is only announced (:meth:`Mailbox.announce`). An
announcement is matched like a message; the receive that takes it asks the sender to send
the payload, which then lands in that receive's memory (:meth:`Mailbox.cleared_payload`),
or copies it from the sender's memory (:meth:`Mailbox.cleared_memory`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from typing import Protocol

import numpy as np

from .._arrays._fingerprint import NO_FINGERPRINT, mismatch_error
from ..errors import DistUsageError
from ._failures import Departure, departure_of, fail_future, fails_alone, given_up_by_peer

__all__ = [
    "Flow",
    "Inbound",
    "Mailbox",
    "MailboxListener",
    "Tag",
]

logger = logging.getLogger(__name__)

#: ``(group id, sequence number, step)``: the identity of one message of one operation.
Tag = tuple[int, int, int]


class MailboxListener(Protocol):
    """What a mailbox tells the layer above it (the process groups of the rank)."""

    def on_mismatch(self, group: int, seq: int, exc: DistUsageError) -> None:
        """A peer's message of ``(group, seq)`` belongs to another call than this rank's."""

    def on_reject(self, peer: int, group: int, seq: int, reason: str) -> None:
        """``peer`` rejected its operation ``(group, seq)`` before sending any data of it."""

    def on_lost(self, peer: int, exc: BaseException) -> None:
        """``peer`` is gone: it left, went away, or failed (:func:`departure_of` says which)."""


class Flow(Protocol):
    """What the mailbox asks of the flow control of the link a message came by
    (:class:`aiodist.transport._flow.PeerFlow`)."""

    def hold(self, nbytes: int) -> None:
        """A message of ``nbytes`` sent eagerly is staged: its credit is not given back."""

    def release(self, nbytes: int) -> None:
        """A staged message of ``nbytes`` was delivered or dropped: its credit may go back."""

    def take_ticket(self) -> int:
        """Return the ticket of the announcement just read."""

    def clear(self, ticket: int) -> None:
        """Ask the sender for the payload of announced message ``ticket``."""

    def refuse(self, ticket: int, reason: str) -> None:
        """Tell the sender announced message ``ticket`` was taken without its payload."""


def _mismatch(peer: int, tag: Tag, expected: int, received: int) -> DistUsageError:
    return DistUsageError(
        f"message size mismatch on tag {tag} from rank {peer}: the receive expects "
        f"{expected} bytes, the message has {received} bytes"
    )


def _withdrawal(peer: int, tag: Tag, reason: str) -> DistUsageError:
    error = DistUsageError(f"rank {peer} withdrew its message tagged {tag}: {reason}")
    return given_up_by_peer(error)


class _Recv:
    """A posted receive."""

    __slots__ = ("fut", "left", "order", "out", "peer", "tag")

    def __init__(
        self, fut: asyncio.Future[int], out: memoryview, peer: int | None, tag: Tag, order: int
    ) -> None:
        self.fut = fut
        self.out = out
        self.peer = peer
        self.tag = tag
        self.order = order
        #: Once it took an announced message: the bytes of its payload still to come.
        self.left = 0


#: Bytes of a staged message copied into its receive per loop turn: copying 64 MiB in one
#: go would hold the loop for several milliseconds.
DELIVER_STEP = 1 << 20


def _deliver(out: memoryview, staged: _Staged, fut: asyncio.Future[int], peer: int) -> None:
    """Copy a staged message into its receive's memory, resolve the receive, and release
    the message (its sender's credit).

    Large messages are copied a :data:`DELIVER_STEP` at a time, one piece per loop turn;
    a receive failed meanwhile (an abort, a destroy) stops the copy.
    """
    assert staged.buf is not None
    n = staged.nbytes
    if fut.done():
        staged.release()
        return
    if n <= DELIVER_STEP:
        out[:] = staged.buf.data
        fut.set_result(peer)
        staged.release()
        return
    src = staged.buf.data
    loop = fut.get_loop()

    def copy_from(start: int) -> None:
        if fut.done():
            staged.release()
            return
        end = min(start + DELIVER_STEP, n)
        out[start:end] = src[start:end]
        if end < n:
            loop.call_soon(copy_from, end)
        else:
            fut.set_result(peer)
            staged.release()

    copy_from(0)


def _staged_payload_ended(staged: _Staged, fut: asyncio.Future[int]) -> None:
    """A staged credited payload (``Mailbox._stage_announced``) is in, or never will be:
    deliver it as :meth:`Inbound.done` does, or put the failure in its place in the order
    as for an announced message (the receive that takes it fails)."""
    staged.complete = True
    exc = fut.exception()  # (never cancelled: the mailbox fails its receives)
    if exc is None:
        if staged.claim is not None:
            _deliver(staged.claim.out, staged, staged.claim.fut, staged.peer)
        elif staged.queue is None:  # taken by a receive that failed: dropped
            staged.release()
        return
    staged.error = exc
    if staged.claim is not None:
        fail_future(staged.claim.fut, exc)
    staged.release()


class _Staged:
    """A message that arrived before its receive: complete, still arriving, or announced."""

    __slots__ = (
        "buf",
        "claim",
        "complete",
        "error",
        "flow",
        "fp",
        "lender",
        "nbytes",
        "order",
        "peer",
        "queue",
        "ticket",
    )

    def __init__(
        self,
        nbytes: int,
        peer: int,
        order: int,
        queue: deque[_Staged],
        fp: bytes,
        error: BaseException | None = None,
        *,
        ticket: int = -1,
        flow: Flow | None = None,
    ) -> None:
        self.nbytes = nbytes
        #: The bytes, for a message sent eagerly. Uninitialised: the transport writes every
        #: byte, and zeroing 64 MiB up front (as bytearray(n) does) held the loop for tens
        #: of milliseconds.
        self.buf = np.empty(nbytes, np.uint8) if ticket < 0 and error is None else None
        self.fp = fp
        self.peer = peer
        self.order = order
        #: Set for the place of a message its sender rejected or gave up, or of an announced
        #: one whose sender is lost: the receive fails with it.
        self.error = error
        self.complete = error is not None
        # The receive that took this message while its bytes were still arriving.
        self.claim: _Recv | None = None
        # The staging queue this message sits in, until a receive takes it.
        self.queue: deque[_Staged] | None = queue
        #: For an announced message: its ticket, and the flow control that clears it.
        self.ticket = ticket
        self.flow = flow
        #: The flow control whose credit this message holds while it is staged (an eager
        #: message's; see :meth:`release`).
        self.lender: Flow | None = None

    def release(self) -> None:
        """This message is no longer staged: the sender's credit may go back."""
        lender, self.lender = self.lender, None
        if lender is not None:
            lender.release(self.nbytes)


class Inbound:
    """Where the bytes of one incoming message go.

    The transport writes exactly ``len(buffer)`` bytes into :attr:`buffer`, then calls
    :meth:`done`; or calls :meth:`fail` if the message can no longer arrive.

    Attributes:
        buffer: the flat byte view to fill: the posted receive's own memory, a staging
            buffer, or a scratch buffer when the message is to be discarded.
        peer: the sender's global rank.
    """

    __slots__ = ("_mailbox", "_recv", "_staged", "_ticket", "buffer", "peer", "tag")

    def __init__(
        self,
        mailbox: Mailbox,
        peer: int,
        tag: Tag,
        buffer: memoryview,
        recv: _Recv | None = None,
        staged: _Staged | None = None,
        ticket: int = -1,
    ) -> None:
        self._mailbox = mailbox
        self.peer = peer
        self.tag = tag
        self.buffer = buffer
        self._recv = recv
        self._staged = staged
        # For a piece of an announced message's payload: the announcement's ticket.
        self._ticket = ticket

    def __repr__(self) -> str:
        kind = "direct" if self._recv else "staged" if self._staged else "discard"
        return f"<Inbound from rank {self.peer} {len(self.buffer)} bytes {kind}>"

    def done(self) -> None:
        """Record that every byte of :attr:`buffer` was written."""
        self._mailbox._inflight.discard(self)
        staged = self._staged
        if staged is not None:
            staged.complete = True
            claim = staged.claim
            if claim is not None:
                # Size was checked when the receive claimed the message.
                _deliver(claim.out, staged, claim.fut, self.peer)
            elif staged.queue is None:  # taken by a receive that failed: dropped
                staged.release()
            return
        recv = self._recv
        if recv is not None:
            if self._ticket >= 0:  # a piece of an announced message's payload
                recv.left -= len(self.buffer)
                if recv.left:
                    return
                self._mailbox._cleared.pop((self.peer, self._ticket), None)
            if not recv.fut.done():
                recv.fut.set_result(self.peer)

    def fail(self, exc: BaseException) -> None:
        """Give up on this message: fail the receive waiting for it, drop staged bytes."""
        self._mailbox._inflight.discard(self)
        if self._recv is not None:
            fail_future(self._recv.fut, exc)
        staged = self._staged
        if staged is not None:
            if staged.queue is not None:
                staged.queue.remove(staged)
                staged.queue = None
            if staged.claim is not None:
                fail_future(staged.claim.fut, exc)
            staged.release()  # the rest of its bytes goes nowhere: it is staged no more

    def discard(self, exc: BaseException) -> None:
        """Send the rest of this message's bytes nowhere, and fail whoever waited for it.

        The transport keeps filling :attr:`buffer`, which is now scratch memory: the bytes
        of a message of a rejected operation never reach the caller's array.
        """
        self.fail(exc)
        self._recv = self._staged = None
        self.buffer = memoryview(bytearray(len(self.buffer)))


class Mailbox:
    """Matches incoming messages with posted receives for one rank.

    Args:
        rank: the global rank that owns this mailbox (used in error messages).
        world_size: the number of ranks, so that any-source receives fail once every
            other rank is gone.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._order = 0
        # Receives waiting for a message, oldest first: per (peer, tag), and per tag for
        # any-source receives.
        self._posted: dict[tuple[int, Tag], deque[_Recv]] = {}
        self._posted_any: dict[Tag, deque[_Recv]] = {}
        # Messages no receive has taken yet, oldest first: tag -> peer -> queue.
        self._staged: dict[Tag, dict[int, deque[_Staged]]] = {}
        self._inflight: set[Inbound] = set()
        # Receives that took an announced message, by (peer, ticket): its payload comes, in
        # pieces.
        self._cleared: dict[tuple[int, int], _Recv] = {}
        # Peers that are gone, with the error for receives from them; ``_broken`` holds
        # those that were lost rather than closed in order, which fails any-source receives.
        self._lost: dict[int, BaseException] = {}
        self._broken: BaseException | None = None
        self._exc: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # The fingerprint of each collective this rank has issued and not finished, by
        # (group, seq): what its peers' messages of that operation must carry.
        self._ops: dict[tuple[int, int], bytes] = {}
        # Per group, the low watermark of its sequence: every collective numbered below it
        # has ended on this rank, so a message of one of them can only be a leftover of an
        # operation that failed (rejected, or failed here alone) and is dropped on arrival.
        # The ones that ended above it wait there until the watermark passes them.
        self._floor: dict[int, int] = {}
        self._ended: dict[int, set[int]] = {}
        # Operations killed before they ended (a peer rejected them, here or before this
        # rank issued them), by (group, seq): their messages are dropped on arrival and
        # their receives fail with the reason. Forgotten once they end.
        self._killed: dict[tuple[int, int], DistUsageError] = {}
        #: Told (soon, from the loop) about mismatched calls and about peers' rejections.
        #: Without one, a mismatch aborts the mailbox and a rejection kills the operation.
        self.listener: MailboxListener | None = None

    def __repr__(self) -> str:
        return (
            f"<Mailbox rank={self.rank} posted={self.num_posted()} "
            f"staged={self.num_staged()} lost={sorted(self._lost)}>"
        )

    def num_posted(self) -> int:
        """Return how many receives wait for a message."""
        return sum(len(q) for q in self._posted.values()) + sum(
            len(q) for q in self._posted_any.values()
        )

    def num_staged(self) -> int:
        """Return how many messages wait for a receive (complete or still arriving)."""
        return sum(len(q) for by_peer in self._staged.values() for q in by_peer.values())

    def has_posted(self) -> bool:
        """Return whether any receive waits for a message."""
        return bool(self._posted) or bool(self._posted_any)

    def waiting_for(self, group: int, seq: int) -> list[int]:
        """Return the peers with a posted receive for a step of operation ``(group, seq)``."""
        posted = {
            peer
            for (peer, tag), queue in self._posted.items()
            if tag[0] == group and tag[1] == seq and any(not r.fut.done() for r in queue)
        }
        posted.update(
            peer
            for (peer, _), recv in self._cleared.items()
            if recv.tag[0] == group and recv.tag[1] == seq and not recv.fut.done()
        )
        return sorted(posted)

    def lost(self, peer: int) -> BaseException | None:
        """Return the error that ended ``peer``'s connection, if it was lost."""
        return self._exc if self._exc is not None else self._lost.get(peer)

    def begin(self, group: int, seq: int, fp: bytes) -> None:
        """Record that this rank issued operation ``(group, seq)`` with fingerprint ``fp``.

        Messages of it that arrived before are checked now; later ones when they arrive.
        An operation without a fingerprint (:data:`NO_FINGERPRINT`) is not checked.
        """
        if fp == NO_FINGERPRINT:
            return
        self._ops[group, seq] = fp
        if self._staged:
            for tag, by_peer in self._staged.items():
                if tag[0] == group and tag[1] == seq:
                    for peer, queue in by_peer.items():
                        if queue and queue[0].fp != fp and queue[0].fp != NO_FINGERPRINT:
                            self._report(group, seq, fp, peer, queue[0].fp)
                            return

    def end(self, group: int, seq: int) -> None:
        """Record that collective ``(group, seq)`` ended on this rank (every collective of
        a group ends, in any order): forget what was kept of it; a message of it that still
        arrives is dropped."""
        self._ops.pop((group, seq), None)
        if self._killed:
            self._killed.pop((group, seq), None)
        floor = self._floor.get(group, 0)
        if seq != floor:
            if seq > floor:
                self._ended.setdefault(group, set()).add(seq)
            return
        floor += 1
        ended = self._ended.get(group)
        if ended:
            while floor in ended:
                ended.remove(floor)
                floor += 1
        self._floor[group] = floor

    def has_ended(self, group: int, seq: int) -> bool:
        """Whether collective ``(group, seq)`` has ended on this rank."""
        if seq < self._floor.get(group, 0):
            return True
        ended = self._ended.get(group)
        return ended is not None and seq in ended

    def forget_group(self, group: int) -> None:
        """Drop what is kept of ``group``'s collectives (the group was destroyed here)."""
        self._floor.pop(group, None)
        self._ended.pop(group, None)
        for key in [k for k in self._killed if k[0] == group]:
            del self._killed[key]

    def fingerprint_of(self, group: int, seq: int) -> bytes:
        """Return the fingerprint that messages of operation ``(group, seq)`` carry."""
        return self._ops.get((group, seq), NO_FINGERPRINT)

    def _report(
        self, group: int, seq: int, mine: bytes, peer: int, theirs: bytes
    ) -> DistUsageError:
        exc = mismatch_error(self.rank, mine, peer, theirs, group, seq)
        # Soon rather than now: the caller is parsing a stream or issuing an operation,
        # and the listener aborts everything.
        loop = asyncio.get_running_loop()
        if self.listener is None:
            loop.call_soon(self.abort, exc)
        else:
            loop.call_soon(self.listener.on_mismatch, group, seq, exc)
        return exc

    # -- rejected operations -------------------------------------------------------------

    def reject(self, peer: int, group: int, seq: int, reason: str) -> None:
        """Record that ``peer`` rejected its operation ``(group, seq)``, giving ``reason``.

        Transports call this when a peer's rejection arrives. The listener decides what it
        means (:meth:`kill` for a collective, :meth:`poison` for a point-to-point send);
        without a listener the operation is killed.
        """
        if self.listener is not None:
            self.listener.on_reject(peer, group, seq, reason)
        else:
            self.kill(group, seq, DistUsageError(f"rank {peer} rejected {group}/{seq}: {reason}"))

    def kill(self, group: int, seq: int, exc: DistUsageError) -> None:
        """Drop every message of operation ``(group, seq)``, now and when more arrive.

        Receives of it that are posted, or posted later, fail with ``exc`` (marked with
        :func:`fails_alone`); messages staged for it are freed; one still arriving goes to
        scratch memory; its announced messages are refused (their senders' sends fail with
        ``exc``'s text), now and when more arrive. Nothing is kept once the operation ends
        here (its late messages are dropped by the group's watermark), nor for one that has
        ended already.
        """
        if self.has_ended(group, seq):
            return
        key = (group, seq)
        self._killed[key] = fails_alone(exc)
        for inbound in [i for i in self._inflight if i.tag[0] == group and i.tag[1] == seq]:
            inbound.discard(exc)
        for tag in [t for t in self._staged if t[0] == group and t[1] == seq]:
            for queue in self._staged.pop(tag).values():
                for staged in queue:
                    staged.queue = None
                    if staged.flow is not None and staged.error is None:
                        staged.flow.refuse(staged.ticket, str(exc))
                    staged.release()
        for ticket in [
            t for t, r in self._cleared.items() if r.tag[0] == group and r.tag[1] == seq
        ]:
            # Its payload, if it still comes, goes to scratch memory.
            fail_future(self._cleared.pop(ticket).fut, exc)
        for k in [k for k in self._posted if k[1][0] == group and k[1][1] == seq]:
            for recv in self._posted.pop(k):
                fail_future(recv.fut, exc)
        for tag in [t for t in self._posted_any if t[0] == group and t[1] == seq]:
            for recv in self._posted_any.pop(tag):
                fail_future(recv.fut, exc)

    def poison(self, peer: int, group: int, seq: int | None, exc: DistUsageError) -> None:
        """Put ``exc`` in the place of the next message from ``peer`` tagged ``(group, seq)``.

        This is how a rejected point-to-point send reaches its receiver: the receive that
        would have taken the message (posted now or later) fails with ``exc`` instead, and
        the messages after it keep their order. ``seq=None`` (the sender could not name a
        tag) fails the receives from ``peer`` in ``group`` that are posted now; nothing is
        kept for later ones, which could not be told apart from receives of other messages.
        """
        if self._exc is not None:
            return
        if seq is None:
            for key in [k for k in self._posted if k[0] == peer and k[1][0] == group]:
                for posted in self._posted.pop(key):
                    fail_future(posted.fut, exc)
            return
        tag = (group, seq, 0)
        recv = self._take_posted(peer, tag)
        if recv is not None:
            fail_future(recv.fut, exc)
            return
        queue = self._staged.setdefault(tag, {}).setdefault(peer, deque())
        queue.append(_Staged(0, peer, self._next_order(), queue, NO_FINGERPRINT, exc))

    def _next_order(self) -> int:
        self._order += 1
        return self._order

    def post(self, peer: int | None, tag: Tag, out: memoryview) -> asyncio.Future[int]:
        """Post a receive of the next ``tag`` message from ``peer`` (``None``: any) into ``out``.

        ``out`` must be a flat byte view (see :func:`~aiodist.transport.base.as_bytes`). The future resolves to the
        sender's rank once the bytes are in ``out``.
        """
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        if self._killed:
            dead = self._killed.get((tag[0], tag[1]))
            if dead is not None:
                fail_future(fut, dead)
                return fut
        staged = self._take_staged(peer, tag)
        if staged is not None:
            if staged.error is not None:
                fail_future(fut, staged.error)
                return fut
            error: DistUsageError | None = None
            if staged.fp != NO_FINGERPRINT:
                mine = self._ops.get((tag[0], tag[1]))
                if mine is not None and mine != staged.fp:
                    error = mismatch_error(self.rank, mine, staged.peer, staged.fp, *tag[:2])
            if error is None and staged.nbytes != len(out):
                error = _mismatch(staged.peer, tag, len(out), staged.nbytes)
            if error is not None:
                # The message is consumed: an announced one is refused; if one is still
                # arriving, its bytes go nowhere.
                fail_future(fut, error)
                if staged.flow is not None:
                    staged.flow.refuse(staged.ticket, str(error))
                if staged.complete:  # (else once its last byte is in)
                    staged.release()
                return fut
            recv = _Recv(fut, out, peer, tag, 0)
            if staged.flow is not None:
                recv.left = staged.nbytes
                self._cleared[staged.peer, staged.ticket] = recv
                staged.flow.clear(staged.ticket)
            elif staged.complete:
                _deliver(out, staged, fut, staged.peer)
            else:
                staged.claim = recv
            return fut
        exc = self._exc
        if exc is None:
            exc = self._lost.get(peer) if peer is not None else self._any_source_error()
        if exc is not None:
            fail_future(fut, exc)
            return fut
        recv = _Recv(fut, out, peer, tag, self._next_order())
        if peer is None:
            self._posted_any.setdefault(tag, deque()).append(recv)
        else:
            self._posted.setdefault((peer, tag), deque()).append(recv)
        return fut

    def _take_staged(self, peer: int | None, tag: Tag) -> _Staged | None:
        by_peer = self._staged.get(tag)
        if by_peer is None:
            return None
        if peer is None:
            # The oldest message with this tag from any peer.
            src = min(by_peer, key=lambda p: by_peer[p][0].order)
        elif peer in by_peer:
            src = peer
        else:
            return None
        queue = by_peer[src]
        staged = queue.popleft()
        staged.queue = None
        if not queue:
            del by_peer[src]
            if not by_peer:
                del self._staged[tag]
        return staged

    def _take_posted(self, peer: int, tag: Tag) -> _Recv | None:
        # The oldest live receive among those for (peer, tag) and the any-source ones.
        key = (peer, tag)
        best: _Recv | None = None
        queue = self._posted.get(key)
        if queue is not None:
            while queue and queue[0].fut.done():  # cancelled by the caller
                queue.popleft()
            if queue:
                best = queue[0]
            else:
                del self._posted[key]
        any_queue = self._posted_any.get(tag)
        if any_queue is not None:
            while any_queue and any_queue[0].fut.done():
                any_queue.popleft()
            if any_queue:
                if best is None or any_queue[0].order < best.order:
                    best = any_queue.popleft()
                    if not any_queue:
                        del self._posted_any[tag]
                    return best
            else:
                del self._posted_any[tag]
        if best is not None:
            assert queue is not None
            queue.popleft()
            if not queue:
                del self._posted[key]
        return best

    def incoming(
        self,
        peer: int,
        tag: Tag,
        nbytes: int,
        fp: bytes = NO_FINGERPRINT,
        lender: Flow | None = None,
    ) -> Inbound:
        """Return where the ``nbytes`` bytes of a message from ``peer`` tagged ``tag`` go.

        The caller fills ``Inbound.buffer`` and calls ``Inbound.done()``. The message is
        matched now, so messages from one peer must be announced in the order it sent them.
        A message whose fingerprint ``fp`` differs from that of the operation this rank
        issued under the same ``(group, seq)`` is discarded (its bytes never reach a
        receive's memory) and reported to the :attr:`listener`. ``lender``: the flow
        control whose credit the message holds while it is staged (an eager message).
        """
        if (
            self._exc is not None
            or (self._killed and (tag[0], tag[1]) in self._killed)
            or self.has_ended(tag[0], tag[1])
        ):
            # Aborted, or a message of a killed or ended operation: read and dropped.
            return Inbound(self, peer, tag, memoryview(bytearray(nbytes)))
        if fp != NO_FINGERPRINT:
            mine = self._ops.get((tag[0], tag[1]))
            if mine is not None and mine != fp:
                self._report(tag[0], tag[1], mine, peer, fp)
                inbound = Inbound(self, peer, tag, memoryview(bytearray(nbytes)))
                if nbytes == 0:
                    inbound.done()
                else:
                    self._inflight.add(inbound)
                return inbound
        recv = self._take_posted(peer, tag)
        if recv is None:
            by_peer = self._staged.setdefault(tag, {})
            queue = by_peer.get(peer)
            if queue is None:
                queue = by_peer[peer] = deque()
            staged = _Staged(nbytes, peer, self._next_order(), queue, fp)
            queue.append(staged)
            if lender is not None:
                staged.lender = lender
                lender.hold(nbytes)
            assert staged.buf is not None
            inbound = Inbound(self, peer, tag, staged.buf.data, staged=staged)
        elif len(recv.out) != nbytes:
            fail_future(recv.fut, _mismatch(peer, tag, len(recv.out), nbytes))
            inbound = Inbound(self, peer, tag, memoryview(bytearray(nbytes)))
        else:
            inbound = Inbound(self, peer, tag, recv.out, recv=recv)
        if nbytes == 0:
            inbound.done()
        else:
            self._inflight.add(inbound)
        return inbound

    def announce(
        self, peer: int, tag: Tag, nbytes: int, fp: bytes, flow: Flow, *, credited: bool = False
    ) -> None:
        """Match the announcement of a message from ``peer`` tagged ``tag`` whose ``nbytes``
        bytes wait for their receive, as :meth:`incoming` matches a message.

        ``flow`` numbers the announcement and carries the answer: once a receive takes it
        (now, or when posted), the payload is asked for; a receive that fails on it (its
        length or the fingerprint ``fp`` differ), or a rejected operation, refuses it.
        A ``credited`` message (its sender took credit for it) that no receive takes now is
        staged: its payload is asked for at once, into a staging buffer.
        """
        ticket = flow.take_ticket()
        if self._exc is not None:
            return  # aborting: the peer's connection is about to go
        dead = self._killed.get((tag[0], tag[1])) if self._killed else None
        if dead is not None:
            flow.refuse(ticket, str(dead))
            return
        if self.has_ended(tag[0], tag[1]):
            flow.refuse(ticket, f"operation {tag[0]}/{tag[1]} has ended on rank {self.rank}")
            return
        if fp != NO_FINGERPRINT:
            mine = self._ops.get((tag[0], tag[1]))
            if mine is not None and mine != fp:
                flow.refuse(ticket, str(self._report(tag[0], tag[1], mine, peer, fp)))
                return
        recv = self._take_posted(peer, tag)
        if recv is None and credited:
            self._stage_announced(peer, tag, nbytes, fp, flow, ticket)
        elif recv is None:
            by_peer = self._staged.setdefault(tag, {})
            queue = by_peer.setdefault(peer, deque())
            queue.append(
                _Staged(nbytes, peer, self._next_order(), queue, fp, ticket=ticket, flow=flow)
            )
        elif len(recv.out) != nbytes:
            error = _mismatch(peer, tag, len(recv.out), nbytes)
            fail_future(recv.fut, error)
            flow.refuse(ticket, str(error))
        else:
            recv.left = nbytes
            self._cleared[peer, ticket] = recv
            flow.clear(ticket)

    def _stage_announced(
        self, peer: int, tag: Tag, nbytes: int, fp: bytes, flow: Flow, ticket: int
    ) -> None:
        # Staged as an eager message still arriving (holding its sender's credit), filled
        # through a receive of the mailbox's own in _cleared, where the payload's pieces, the
        # copy, a withdrawal and a lost peer find it; complete when that receive is.
        queue = self._staged.setdefault(tag, {}).setdefault(peer, deque())
        staged = _Staged(nbytes, peer, self._next_order(), queue, fp)
        queue.append(staged)
        staged.lender = flow
        flow.hold(nbytes)
        assert staged.buf is not None
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(functools.partial(_staged_payload_ended, staged))
        filler = _Recv(fut, staged.buf.data, peer, tag, 0)
        filler.left = nbytes
        self._cleared[peer, ticket] = filler
        flow.clear(ticket)

    def cleared_payload(self, peer: int, ticket: int, offset: int, nbytes: int) -> Inbound:
        """Return where the ``nbytes`` bytes at ``offset`` of the payload of ``peer``'s
        announced message ``ticket`` go: the memory of the receive that took the
        announcement (it completes with the last piece), or scratch memory if it was dropped
        meanwhile (its operation rejected, the rank aborting)."""
        recv = self._cleared.get((peer, ticket))
        if recv is None or self._exc is not None:
            return Inbound(self, peer, (0, 0, 0), memoryview(bytearray(nbytes)))
        if offset + nbytes > len(recv.out) or nbytes > recv.left:  # a broken peer
            del self._cleared[peer, ticket]
            fail_future(recv.fut, _mismatch(peer, recv.tag, len(recv.out), offset + nbytes))
            return Inbound(self, peer, recv.tag, memoryview(bytearray(nbytes)))
        out = recv.out[offset : offset + nbytes]
        inbound = Inbound(self, peer, recv.tag, out, recv=recv, ticket=ticket)
        self._inflight.add(inbound)
        return inbound

    def cleared_memory(self, peer: int, ticket: int) -> memoryview | None:
        """The memory of the receive that took ``peer``'s announced message ``ticket``, for
        a link that copies the payload from the sender's memory itself; ``None`` once the
        receive is gone (failed, or the message withdrawn)."""
        recv = self._cleared.get((peer, ticket))
        return None if recv is None or self._exc is not None or recv.fut.done() else recv.out

    def pulled(self, peer: int, ticket: int) -> None:
        """The sender vouched for the payload of ``ticket`` copied into its receive."""
        recv = self._cleared.pop((peer, ticket), None)
        if recv is not None and not recv.fut.done():
            recv.fut.set_result(peer)

    def withdrawn(self, peer: int, ticket: int, reason: str) -> None:
        """``peer`` gave up its announced message ``ticket`` for ``reason``: the receive that
        took it, or takes it, fails with ``DistUsageError``."""
        recv = self._cleared.pop((peer, ticket), None)
        if recv is not None:
            fail_future(recv.fut, _withdrawal(peer, recv.tag, reason))
            return
        for tag, by_peer in self._staged.items():
            for staged in by_peer.get(peer, ()):
                if staged.ticket == ticket and staged.flow is not None:
                    # Its place in the order stays: the receive that takes it fails.
                    staged.error = _withdrawal(peer, tag, reason)
                    staged.complete, staged.flow = True, None
                    return

    def deliver(self, peer: int, tag: Tag, data: memoryview, fp: bytes = NO_FINGERPRINT) -> None:
        """Match a whole message that is already in memory, copying it once."""
        inbound = self.incoming(peer, tag, len(data), fp)
        if data:
            inbound.buffer[:] = data
            inbound.done()

    def _any_source_error(self) -> BaseException | None:
        if self._broken is not None:
            return self._broken
        others = self.world_size - 1
        if self._lost and len(self._lost.keys() - {self.rank}) >= others:
            return next(reversed(self._lost.values()))  # the last rank to go
        return None

    def listen(self, listener: MailboxListener) -> None:
        """Make ``listener`` the :attr:`listener`, and tell it now of the peers lost so far.

        A world is built on a transport that is already connected: a peer may die while
        it is being built, and the world must hear of it like of any later loss.
        """
        self.listener = listener
        for peer, exc in list(self._lost.items()):
            if peer != self.rank:
                listener.on_lost(peer, exc)

    def fail_peer(self, peer: int, exc: BaseException) -> None:
        """Record that ``peer`` is gone and fail the receives that wait for it.

        Receives from ``peer`` fail now and later. Any-source receives fail too, unless the
        peer left in order (:attr:`Departure.LEFT`) and other ranks may still send.
        Messages from ``peer`` that arrived completely stay deliverable; those it only
        announced fail the receives that take them. The listener hears
        of it in every case.
        """
        if self._exc is not None or peer in self._lost:
            return
        self._lost[peer] = exc
        graceful = departure_of(exc) is Departure.LEFT
        if not graceful and self._broken is None:
            self._broken = exc
        if self.listener is not None:
            # Soon: the transport is in the middle of dropping the connection.
            asyncio.get_running_loop().call_soon(self.listener.on_lost, peer, exc)
        for inbound in [i for i in self._inflight if i.peer == peer]:
            inbound.fail(exc)
        for key in [k for k in self._posted if k[0] == peer]:
            for recv in self._posted.pop(key):
                fail_future(recv.fut, exc)
        for ticket in [t for t in self._cleared if t[0] == peer]:
            fail_future(self._cleared.pop(ticket).fut, exc)
        for by_peer in self._staged.values():
            for staged in by_peer.get(peer, ()):
                if staged.flow is not None and staged.error is None:
                    # Announced, so its payload never comes: the receive that takes it fails.
                    staged.error, staged.complete, staged.flow = exc, True, None
        any_exc = self._any_source_error()
        if any_exc is not None:
            for queue in self._posted_any.values():
                for recv in queue:
                    fail_future(recv.fut, any_exc)
            self._posted_any.clear()

    def abort(self, exc: BaseException) -> None:
        """Fail every pending receive with ``exc``; later receives fail at once."""
        if self._exc is not None:
            return
        self._exc = exc
        for inbound in list(self._inflight):
            inbound.fail(exc)
        for queues in (self._posted.values(), self._posted_any.values()):
            for queue in queues:
                for recv in queue:
                    fail_future(recv.fut, exc)
        for recv in self._cleared.values():
            fail_future(recv.fut, exc)
        self._posted.clear()
        self._posted_any.clear()
        self._cleared.clear()
        self._staged.clear()
