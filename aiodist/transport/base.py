"""The interface between collective algorithms and whatever moves bytes between ranks.

A :class:`Transport` connects one rank to the other ranks of a world (global ranks). Every
message carries a :data:`Tag`; a receive matches the first message from its peer with the
same tag, in the order they were sent, so many operations can be in flight on one
connection and never mix. Matching is the job of the transport's
:class:`~aiodist.transport._mailbox.Mailbox`, which several transports of one rank may
share (one per kind of peer, behind a router). :class:`OpComm` is the narrow view one
algorithm gets: group ranks, and steps instead of whole tags.

Besides data, a transport carries two control messages: a *rejection* (an operation this
rank refused before sending any of its data, so the peers stop waiting for it) and, when a
rank aborts, the *reason* it gives its connected peers before it drops the connections.
"""

from __future__ import annotations

import abc
import asyncio
import struct
from collections.abc import Sequence

from ..errors import DistUsageError
from ..store import Store
from ._failures import (
    Departure,
    abort_text,
    departure_of,
    fails_alone,
    lost_peer_error,
    only_this_operation,
    peer_aborted_error,
    peer_gave_up,
)
from ._mailbox import Mailbox, Tag

__all__ = [
    "CLOSED_REASON",
    "Departure",
    "PHASES",
    "OpComm",
    "PeerDirectory",
    "Tag",
    "Transport",
    "abort_text",
    "as_bytes",
    "check_tag",
    "departure_of",
    "fails_alone",
    "lost_peer_error",
    "only_this_operation",
    "peer_aborted_error",
    "peer_gave_up",
    "rejection_text",
]

# Tags travel as three unsigned 64-bit integers on every transport, so every transport
# accepts exactly the same tags.
_TAG = struct.Struct("<QQQ")


def check_tag(tag: Tag) -> None:
    """Check that ``tag`` is three integers in ``[0, 2**64)``.

    Raises:
        DistUsageError: the tag has another shape or a value out of range.
    """
    try:
        _TAG.pack(*tag)
    except (struct.error, TypeError):
        raise DistUsageError(
            f"a tag must be three integers in [0, 2**64) (group id, seq, step), got {tag!r}"
        ) from None


def as_bytes(view: memoryview, *, writable: bool) -> memoryview:
    """Return ``view`` as a flat byte view of the same memory.

    Raises:
        DistUsageError: ``view`` is not C-contiguous, or ``writable`` is asked for and the
            memory is read-only.
    """
    if not isinstance(view, memoryview):  # numpy arrays and bytes-likes are welcome too
        view = memoryview(view)  # type: ignore[unreachable]
    if writable and view.readonly:
        raise DistUsageError("the receive buffer is read-only")
    if view.ndim == 1 and view.format == "B":
        return view
    if not view.c_contiguous:
        raise DistUsageError(
            f"buffers must be C-contiguous, got a memoryview of shape {view.shape} "
            f"and strides {view.strides}"
        )
    return view.cast("B")


#: What the peers of a transport closed without a reason are told: "rank N closed its
#: transport".
CLOSED_REASON = "closed its transport"
_LEFT = "left: "


def rejection_text(exc: BaseException) -> str:
    """What a rank tells the peers of an operation it rejects or fails alone because of
    ``exc``: a usage error's message, else the exception's name and message (the peers'
    error keeps the class of a lost rank: see ``ProcessGroup._rejection``)."""
    return str(exc) if isinstance(exc, DistUsageError) else f"{type(exc).__name__}: {exc}"


class PeerDirectory:
    """Where each rank of a world listens, kept in the world's store.

    A transport publishes its own address once and looks a peer's up the first time it
    connects to it; the directory is all it knows of the store.

    Args:
        store: the world's store (already namespaced for this world).
        kind: the transport kind, so that two transports of a rank do not collide.
    """

    def __init__(self, store: Store, kind: str = "tcp") -> None:
        self._store = store
        self._prefix = f"transport/{kind}/"

    def __repr__(self) -> str:
        return f"<PeerDirectory {self._prefix}* in {self._store!r}>"

    async def publish(self, rank: int, address: str) -> None:
        """Record that ``rank`` listens at ``address``."""
        await self._store.set(f"{self._prefix}{rank}", address)

    async def lookup(self, rank: int) -> str:
        """Return the address of ``rank``, waiting (the store's timeout) until it is known.

        Raises:
            DistTimeoutError: the rank did not publish an address in time.
            DistNetworkError: the store cannot be reached, or the rank has left (see
                :meth:`withdraw`; :func:`~aiodist.transport._mailbox.departure_of` tells).
        """
        address = (await self._store.get(f"{self._prefix}{rank}")).decode()
        if address.startswith(_LEFT):
            raise lost_peer_error(rank, f"it {address[len(_LEFT) :]}", Departure.LEFT)
        return address

    async def withdraw(self, rank: int, reason: str) -> None:
        """Record that ``rank`` no longer listens because it ``reason`` (it left the world)."""
        await self._store.set(f"{self._prefix}{rank}", _LEFT + reason)


class Transport(abc.ABC):
    """Moves byte buffers between this rank and its peers, without copying where it can.

    Attributes:
        rank: this rank (global).
        world_size: the number of ranks.
        mailbox: where incoming messages meet posted receives; shared with the other
            transports of this rank, if any.
        local_ranks: the ranks this one shares memory with, itself included.
    """

    def __init__(self, rank: int, world_size: int, mailbox: Mailbox | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.mailbox = mailbox if mailbox is not None else Mailbox(rank, world_size)
        #: The ranks this one shares memory with (itself included): collectives of a
        #: group within them may run in shared memory directly.
        self.local_ranks: tuple[int, ...] = (rank,)
        #: The world's ranks by host, when known: each host's ranks in order, the hosts in
        #: the order of their first ranks. ``None`` (unknown) makes every algorithm flat.
        self.hosts: tuple[tuple[int, ...], ...] | None = None

    @abc.abstractmethod
    def send(
        self, peer: int, tag: Tag, data: memoryview, *, cleared: bool = False
    ) -> asyncio.Future[None]:
        """Send the bytes of ``data`` to global rank ``peer``, tagged ``tag``.

        ``data`` is not copied: the returned future resolves once the transport no longer
        refers to it, so the caller may then reuse the memory. The future fails with
        ``DistNetworkError`` if the peer is lost or has closed. ``peer`` may be this rank.

        A streaming transport bounds what a peer stages for receives not posted yet: a
        message beyond the bound waits for its receive (see
        :mod:`aiodist.transport._flow`). ``cleared``: the caller knows the receive is
        posted (the peer said so), so the message goes at once, outside the bound.

        Raises:
            DistUsageError: at once, if ``peer`` is not a rank of the world, the tag is not
                three integers in ``[0, 2**64)``, or ``data`` is not C-contiguous.
        """

    @abc.abstractmethod
    def recv_into(self, peer: int | None, tag: Tag, out: memoryview) -> asyncio.Future[int]:
        """Receive the next message tagged ``tag`` from ``peer`` straight into ``out``.

        ``peer=None`` accepts the first matching message from any peer. The future resolves
        to the sender's global rank. A message whose length differs from ``out.nbytes``
        fails the future with ``DistUsageError`` naming both lengths (the message is
        consumed). The future fails with ``DistNetworkError`` if ``peer`` is lost or closes
        first; an any-source receive fails when a peer is lost, or when every other rank
        has closed.

        Raises:
            DistUsageError: at once, if ``peer`` is not a rank of the world, the tag is
                malformed, or ``out`` is read-only or not C-contiguous.
        """

    @abc.abstractmethod
    def send_reject(self, peer: int, group: int, seq: int, reason: str) -> None:
        """Tell ``peer`` that this rank rejected operation ``(group, seq)``, and why.

        Fire and forget: the rejection travels after every message sent to ``peer``
        before it, and reaches the peer's mailbox (see :meth:`Mailbox.reject`). A peer
        that is gone is not told.
        """

    @abc.abstractmethod
    def abort(self, exc: BaseException) -> None:
        """Fail every pending send and receive with ``exc`` and drop all connections.

        Connected peers are told ``str(exc)`` as the reason before their connection drops,
        where the transport can; they see this rank as lost. Later calls fail with
        ``exc``; aborting twice is harmless.
        """

    @abc.abstractmethod
    async def aclose(self, reason: str | None = None) -> None:
        """Close every connection and listener in order. Closing twice is harmless.

        Pending receives fail with ``DistNetworkError``. Peers see an orderly close (a
        :attr:`~aiodist.transport._failures.Departure.LEFT` departure): messages this rank
        sent before still reach them, their receives from this rank that nothing was sent
        for fail with ``"lost connection to rank N: it <reason>"``, and their any-source
        receives keep waiting for others. ``reason`` completes "rank N ..." (default
        :data:`CLOSED_REASON`).
        """

    def peer_gone(self, peer: int, exc: BaseException) -> None:
        """``peer`` went away without a goodbye, as the world learned elsewhere (the store).

        What it sent and this rank has not read yet is taken first; then everything that
        still needs it fails with ``exc``, as if its connection had ended (a host that
        vanished sends no FIN, and a connection to it may still be forming).
        """
        self.mailbox.fail_peer(peer, exc)

    def waiting_for(self, group: int, seq: int) -> list[int]:
        """Return the peers whose messages of operation ``(group, seq)`` are still awaited."""
        return self.mailbox.waiting_for(group, seq)


#: Phases of one operation (see :meth:`OpComm.part`): each numbers its steps from its own
#: base, above every step an algorithm uses (``collectives._common.READY_STEP`` included).
PHASES = 1 << 12
_PHASE_STEPS = 1 << 52


class OpComm:
    """One operation's view of a transport: group ranks and numbered steps.

    An algorithm sees only ``rank``, ``size``, :meth:`send` and :meth:`recv_into`; the
    group id and sequence number of the operation (the tag, for point-to-point messages)
    are bound in, and group ranks are translated to the transport's global ranks.
    """

    __slots__ = ("_base", "_cleared", "_group_id", "_ranks", "_seq", "_transport", "rank", "size")

    def __init__(
        self,
        transport: Transport,
        ranks: Sequence[int],
        rank: int,
        group_id: int,
        seq: int,
        *,
        base: int = 0,
    ) -> None:
        self._transport = transport
        self._ranks = ranks
        self._group_id = group_id
        self._seq = seq
        self._base = base
        # The group ranks that said they posted their receives for this view's messages.
        self._cleared: set[int] = set()
        self.rank = rank
        self.size = len(ranks)

    def __repr__(self) -> str:
        return f"<OpComm rank={self.rank}/{self.size} group={self._group_id} seq={self._seq}>"

    def part(self, members: Sequence[int], phase: int) -> OpComm:
        """The view of this operation that the ranks ``members`` (ranks of this view,
        this one among them) share in ``phase`` of an algorithm made of several.

        Its ranks are the positions in ``members``; its steps are numbered apart from
        every other phase's (``phase`` in ``[1, PHASES)``), so that an algorithm may run
        one collective per phase, side by side, over the same operation.
        """
        assert 0 < phase < PHASES, phase
        ranks = [self._ranks[m] for m in members]
        base = self._base + phase * _PHASE_STEPS
        return OpComm(
            self._transport, ranks, members.index(self.rank), self._group_id, self._seq, base=base
        )

    def from_step(self, base: int) -> OpComm:
        """The view of this operation whose step ``s`` is this view's step ``base + s``: a
        part of an algorithm (one chunk, one round) whose messages are numbered apart from
        the rest's."""
        return OpComm(
            self._transport,
            self._ranks,
            self.rank,
            self._group_id,
            self._seq,
            base=self._base + base,
        )

    def cleared_by(self, peer: int) -> None:
        """Group rank ``peer`` said that its receives for this view's messages to it are
        posted: they go at once from now on, without the transport's own handshake."""
        self._cleared.add(peer)

    def send(self, peer: int, step: int, data: memoryview) -> asyncio.Future[None]:
        """Send ``data`` to group rank ``peer`` as step ``step`` of this operation."""
        tag = (self._group_id, self._seq, self._base + step)
        return self._transport.send(self._ranks[peer], tag, data, cleared=peer in self._cleared)

    def reject(self, reason: str) -> None:
        """Tell the other ranks of the operation that this rank will send and receive
        nothing of it, and why: their parts of it fail with ``reason`` at once."""
        transport, me = self._transport, self._ranks[self.rank]
        for r in self._ranks:
            if r != me:
                transport.send_reject(r, self._group_id, self._seq, reason)

    def recv_into(self, peer: int | None, step: int, out: memoryview) -> asyncio.Future[int]:
        """Receive step ``step`` of this operation from group rank ``peer`` into ``out``.

        ``peer=None`` takes the message from whichever group member sends it first (the
        future's result is the sender's *global* rank).
        """
        source = None if peer is None else self._ranks[peer]
        return self._transport.recv_into(
            source, (self._group_id, self._seq, self._base + step), out
        )
