"""barrier by dissemination."""

from __future__ import annotations

import logging

from ..transport.base import OpComm
from ._common import EMPTY, Flight

__all__ = ["barrier"]

logger = logging.getLogger(__name__)


async def barrier(comm: OpComm) -> None:
    """Return once every rank of ``comm`` has entered the barrier.

    Dissemination: in round ``k`` rank ``r`` signals ``r + 2**k`` and waits for
    ``r - 2**k``; after ``ceil(log2 n)`` rounds every rank has heard, directly or through
    others, from every rank. Messages are empty.

    Args:
        comm: This operation's view of the group.

    Raises:
        DistNetworkError: a peer was lost.
    """
    n, rank = comm.size, comm.rank
    flight = Flight()
    try:
        dist, step = 1, 0
        while dist < n:
            recv = flight.add(comm.recv_into((rank - dist) % n, step, memoryview(bytearray())))
            flight.add(comm.send((rank + dist) % n, step, EMPTY))
            await recv
            dist <<= 1
            step += 1
        await flight.drain()
    except BaseException:
        flight.abandon()
        raise
