"""all_to_all by pairwise exchange."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy.typing as npt

from .._arrays import byte_view
from ..transport.base import OpComm
from ._common import WINDOW, Flight, copy_into

__all__ = ["all_to_all"]

logger = logging.getLogger(__name__)


async def all_to_all(
    comm: OpComm,
    outs: Sequence[npt.NDArray[Any]],
    ins: Sequence[npt.NDArray[Any]],
) -> None:
    """Send ``ins[j]`` to rank ``j``; ``outs[j]`` receives rank ``j``'s block for this rank.

    Pairwise exchange: in step ``k`` (``1 <= k < n``) rank ``r`` sends to ``r+k`` and
    receives from ``r-k``, so every rank talks to one new peer per step and no rank is
    flooded; sends run up to :data:`WINDOW` steps ahead of the receives that completed.
    Every receive is posted first (straight into ``outs``) and the local block is copied
    before the first send. Blocks may
    differ in size (zero included); ``outs[j]`` must have the size rank ``j`` sends.

    Args:
        comm: This operation's view of the group.
        outs: ``comm.size`` C-contiguous output arrays.
        ins: ``comm.size`` C-contiguous input arrays. Not modified.

    Raises:
        DistNetworkError: a peer was lost.
        DistUsageError: a block's size differs from the size its receiver expects.
    """
    n, rank = comm.size, comm.rank
    flight = Flight()
    try:
        # Every receive lands in its final place, so all are posted at once: a peer that
        # starts early never has its block staged by the transport.
        recvs = [
            flight.add(comm.recv_into((rank - k) % n, 0, byte_view(outs[(rank - k) % n])))
            for k in range(1, n)
        ]
        # Our own block first: while we copy, late peers catch up and post their receives.
        await copy_into(outs[rank], ins[rank])
        for k in range(1, n):
            dst = (rank + k) % n
            flight.add(comm.send(dst, 0, byte_view(ins[dst])))
            if k > WINDOW:
                await recvs[k - 1 - WINDOW]
        await flight.drain()
    except BaseException:
        flight.abandon()
        raise
