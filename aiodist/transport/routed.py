"""One transport per kind of peer behind one interface: shared memory to the ranks on this
host, TCP to the others.

Both transports deliver into one mailbox, so receives from any source, fingerprints and
rejections span them; a send or a receive goes to the transport that reaches its peer.
"""

from __future__ import annotations

import asyncio

from .base import Tag, Transport
from .shm import ShmTransport
from .tcp import TCPTransport

__all__ = ["RoutedTransport"]


class RoutedTransport(Transport):
    """Shared memory to ``shm.local_ranks``, TCP to every other rank.

    Args:
        tcp: the TCP transport (reaches every rank).
        shm: the shared-memory transport, sharing ``tcp``'s mailbox.

    Attributes:
        tcp: the TCP transport.
        shm: the shared-memory transport.
    """

    def __init__(self, tcp: TCPTransport, shm: ShmTransport) -> None:
        super().__init__(tcp.rank, tcp.world_size, tcp.mailbox)
        assert shm.mailbox is tcp.mailbox, "both transports must share one mailbox"
        self.tcp = tcp
        self.shm = shm
        self.local_ranks = shm.local_ranks
        self.hosts = tcp.hosts
        self._local = frozenset(shm.local_ranks)
        tcp.reached_elsewhere(self._local)

    def __repr__(self) -> str:
        return f"<RoutedTransport shm to {sorted(self._local)}, tcp to the rest: {self.tcp!r}>"

    @property
    def address(self) -> tuple[str, int]:
        """The address the TCP transport listens on."""
        return self.tcp.address

    def _for(self, peer: int | None) -> Transport:
        # Any-source receives are posted once, through the shared mailbox; the shared-memory
        # transport also polls its rings for them.
        return self.shm if peer is None or peer in self._local else self.tcp

    def send(
        self, peer: int, tag: Tag, data: memoryview, *, cleared: bool = False
    ) -> asyncio.Future[None]:
        """Send through the transport that reaches ``peer`` (see :meth:`Transport.send`)."""
        return self._for(peer).send(peer, tag, data, cleared=cleared)

    def recv_into(self, peer: int | None, tag: Tag, out: memoryview) -> asyncio.Future[int]:
        """Receive through the transport that reaches ``peer`` (see :meth:`Transport.recv_into`)."""
        return self._for(peer).recv_into(peer, tag, out)

    def send_reject(self, peer: int, group: int, seq: int, reason: str) -> None:
        """Tell ``peer`` of a rejection through the transport that reaches it."""
        self._for(peer).send_reject(peer, group, seq, reason)

    def peer_gone(self, peer: int, exc: BaseException) -> None:
        """Tell the transport that reaches ``peer`` that it went without a goodbye."""
        self._for(peer).peer_gone(peer, exc)

    def abort(self, exc: BaseException) -> None:
        """Abort both transports."""
        self.shm.abort(exc)
        self.tcp.abort(exc)

    async def aclose(self, reason: str | None = None) -> None:
        """Close both transports in order, telling the peers ``reason``."""
        await self.shm.aclose(reason)
        await self.tcp.aclose(reason)
