"""The interface between collective algorithms and whatever moves bytes between ranks.

A :class:`Transport` connects one rank to the other ranks of a world (global ranks). Every
message carries a :data:`Tag`; a receive matches the first message from its peer with the
same tag, in the order they were sent, so many collectives can be in flight on one
connection and never mix. :class:`OpComm` is the narrow view one collective algorithm gets:
group ranks, and steps instead of whole tags.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable, Sequence

from ..errors import DistUsageError

__all__ = ["OpComm", "Tag", "Transport"]

#: ``(group id, sequence number, step)``: the identity of one message of one operation.
Tag = tuple[int, int, int]


class Transport(abc.ABC):
    """Moves byte buffers between this rank and its peers, without copying where it can."""

    rank: int
    world_size: int

    @abc.abstractmethod
    def send(self, peer: int, tag: Tag, data: memoryview) -> asyncio.Future[None]:
        """Send the bytes of ``data`` to global rank ``peer``, tagged ``tag``.

        ``data`` is not copied: the returned future resolves once the transport no longer
        refers to it, so the caller may then reuse the memory. The future fails with
        ``DistNetworkError`` if the peer is lost or has closed. ``peer`` may be this rank.

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
    def abort(self, exc: BaseException) -> None:
        """Fail every pending send and receive with ``exc`` and drop all connections.

        Peers see this rank as lost. Later calls fail with ``exc``; aborting twice is
        harmless.
        """

    def waiting_for(self, group: int, seq: int) -> list[int]:
        """Return the peers whose messages of operation ``(group, seq)`` are still awaited.

        Used to name the ranks an operation that timed out was waiting for. Transports
        without a mailbox return an empty list.
        """
        mailbox = getattr(self, "_mailbox", None)
        return [] if mailbox is None else mailbox.waiting_for(group, seq)

    def begin_op(self, group: int, seq: int, fingerprint: bytes) -> None:
        """Record that collective ``(group, seq)`` was issued here with ``fingerprint``.

        Its messages then carry the fingerprint, and a peer's message of the same
        ``(group, seq)`` with another one is reported to the mismatch handler instead of
        being delivered. Transports without a mailbox check nothing.
        """
        mailbox = getattr(self, "_mailbox", None)
        if mailbox is not None:
            mailbox.begin(group, seq, fingerprint)

    def end_op(self, group: int, seq: int) -> None:
        """Forget the fingerprint of collective ``(group, seq)``, which has finished."""
        mailbox = getattr(self, "_mailbox", None)
        if mailbox is not None:
            mailbox.end(group, seq)

    def set_mismatch_handler(self, handler: Callable[[int, int, DistUsageError], None]) -> None:
        """Call ``handler(group, seq, error)`` when a peer's call differs from ours."""
        mailbox = getattr(self, "_mailbox", None)
        if mailbox is not None:
            mailbox.on_mismatch = handler

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close every connection and listener in order. Closing twice is harmless.

        Pending receives fail with ``DistNetworkError``. Peers see an orderly close: their
        receives from this rank fail, their any-source receives keep waiting for others.
        """


class OpComm:
    """One operation's view of a transport: group ranks and numbered steps.

    A collective algorithm sees only ``rank``, ``size``, :meth:`send` and :meth:`recv_into`;
    the group id and sequence number of the operation are bound in, and group ranks are
    translated to the transport's global ranks.
    """

    __slots__ = ("_group_id", "_ranks", "_seq", "_transport", "rank", "size")

    def __init__(
        self, transport: Transport, ranks: Sequence[int], rank: int, group_id: int, seq: int
    ) -> None:
        self._transport = transport
        self._ranks = ranks
        self._group_id = group_id
        self._seq = seq
        self.rank = rank
        self.size = len(ranks)

    def __repr__(self) -> str:
        return f"<OpComm rank={self.rank}/{self.size} group={self._group_id} seq={self._seq}>"

    def send(self, peer: int, step: int, data: memoryview) -> asyncio.Future[None]:
        """Send ``data`` to group rank ``peer`` as step ``step`` of this operation."""
        return self._transport.send(self._ranks[peer], (self._group_id, self._seq, step), data)

    def recv_into(self, peer: int, step: int, out: memoryview) -> asyncio.Future[int]:
        """Receive step ``step`` of this operation from group rank ``peer`` into ``out``."""
        return self._transport.recv_into(self._ranks[peer], (self._group_id, self._seq, step), out)
