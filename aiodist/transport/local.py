"""An in-process transport: ranks that are tasks of one event loop, bytes moved by memcpy."""

from __future__ import annotations

import asyncio
import logging

from ..errors import DistNetworkError, DistUsageError
from ._failures import fail_future
from .base import (
    CLOSED_REASON,
    Departure,
    Tag,
    Transport,
    abort_text,
    as_bytes,
    check_tag,
    lost_peer_error,
    peer_aborted_error,
)

__all__ = ["LocalTransport"]

logger = logging.getLogger(__name__)


class LocalTransport(Transport):
    """A transport between ranks that live in one process, on one event loop.

    A send copies the message straight into the receiver's posted buffer (or into a
    staging buffer when the receive is not posted yet), so its future is resolved when
    :meth:`send` returns. Closing or aborting one rank fails the receives that other ranks
    posted for it, as a lost connection would. Create the ranks together with
    :meth:`create_world`.

    Attributes:
        rank: this transport's global rank.
        world_size: the number of ranks in the world.
    """

    def __init__(self, rank: int, world_size: int, world: list[LocalTransport]) -> None:
        super().__init__(rank, world_size)
        self._world = world
        self._closed: BaseException | None = None

    @classmethod
    def create_world(cls, world_size: int) -> list[LocalTransport]:
        """Return ``world_size`` connected transports; element ``i`` is rank ``i``.

        Raises:
            DistUsageError: ``world_size`` is not a positive integer.
        """
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise DistUsageError(f"world_size must be a positive integer, got {world_size!r}")
        world: list[LocalTransport] = []
        world.extend(cls(rank, world_size, world) for rank in range(world_size))
        return world

    def __repr__(self) -> str:
        state = "closed" if self._closed is not None else "open"
        return f"<LocalTransport rank={self.rank}/{self.world_size} {state} {self.mailbox!r}>"

    def _check_peer(self, peer: int) -> None:
        if not isinstance(peer, int) or not 0 <= peer < self.world_size:
            raise DistUsageError(f"peer must be a rank in [0, {self.world_size}), got {peer!r}")

    def send(
        self, peer: int, tag: Tag, data: memoryview, *, cleared: bool = False
    ) -> asyncio.Future[None]:
        """Copy ``data`` to rank ``peer``; the returned future is already resolved.

        Nothing bounds what the receiver stages (its ranks share one process), so
        ``cleared`` changes nothing.

        Raises:
            DistUsageError: ``peer`` is out of range, the tag is malformed, or ``data`` is
                not contiguous.
        """
        self._check_peer(peer)
        check_tag(tag)
        data = as_bytes(data, writable=False)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Closing a rank records it as lost in every other rank's mailbox.
        exc = self._closed or self.mailbox.lost(peer)
        if exc is not None:
            fail_future(fut, exc)
            return fut
        fp = self.mailbox.fingerprint_of(tag[0], tag[1])
        self._world[peer].mailbox.deliver(self.rank, tag, data, fp)
        fut.set_result(None)
        return fut

    def recv_into(self, peer: int | None, tag: Tag, out: memoryview) -> asyncio.Future[int]:
        """Receive the next ``tag`` message from ``peer`` (``None``: any rank) into ``out``.

        Raises:
            DistUsageError: ``peer`` is out of range, the tag is malformed, or ``out`` is
                read-only or not contiguous.
        """
        if peer is not None:
            self._check_peer(peer)
        check_tag(tag)
        return self.mailbox.post(peer, tag, as_bytes(out, writable=True))

    def send_reject(self, peer: int, group: int, seq: int, reason: str) -> None:
        """Tell ``peer`` that this rank rejected operation ``(group, seq)``, and why."""
        self._check_peer(peer)
        if self._closed is None and self.mailbox.lost(peer) is None:
            self._world[peer].mailbox.reject(self.rank, group, seq, reason)

    def abort(self, exc: BaseException) -> None:
        """Fail this rank's pending receives with ``exc``; other ranks see it as lost.

        The other ranks' receives from this rank fail, naming ``exc`` as the cause, and so
        do their any-source receives.
        """
        self._close(exc, peer_aborted_error(self.rank, abort_text(exc)))

    async def aclose(self, reason: str | None = None) -> None:
        """Close this rank; its pending receives fail with ``DistNetworkError``.

        The other ranks' receives from this rank fail, naming ``reason`` (see
        :meth:`Transport.aclose`); their any-source receives keep waiting for the ranks
        that remain.
        """
        exc = DistNetworkError(f"the transport of rank {self.rank} was closed")
        self._close(
            exc, lost_peer_error(self.rank, f"it {reason or CLOSED_REASON}", Departure.LEFT)
        )

    def _close(self, exc: BaseException, lost: BaseException) -> None:
        # ``exc`` fails this rank's receives; ``lost`` the other ranks' receives from it.
        if self._closed is not None:
            return
        self._closed = exc
        self.mailbox.abort(exc)
        for other in self._world:
            if other is not self:
                other.mailbox.fail_peer(self.rank, lost)
        logger.debug("local transport rank %d closed: %s", self.rank, exc)
