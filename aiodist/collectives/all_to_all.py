"""all_to_all by pairwise exchange."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy.typing as npt

from .._arrays._intake import byte_view
from ..transport.base import OpComm
from ._common import Dataflow

__all__ = ["all_to_all"]

logger = logging.getLogger(__name__)


async def all_to_all(
    comm: OpComm,
    outs: Sequence[npt.NDArray[Any]],
    ins: Sequence[npt.NDArray[Any]],
) -> None:
    """Send ``ins[j]`` to rank ``j``; ``outs[j]`` receives rank ``j``'s block for this rank.

    Pairwise exchange: in step ``k`` (``1 <= k < n``) rank ``r`` sends to ``r+k`` and
    receives from ``r-k``, so the sends of all ranks spread over distinct peers. Every
    receive is posted first (straight into ``outs``) and signalled ready at once; large
    blocks wait for their receiver's signal. The local block is copied once the sends are
    under way (a large one in pieces, between which the loop moves the blocks), never
    before the signals: a copy ahead of them would hold up every peer's sends to this rank
    by as long as it takes. Blocks may differ in size (zero included); ``outs[j]`` must
    have the size rank ``j`` sends.

    Args:
        comm: This operation's view of the group.
        outs: ``comm.size`` C-contiguous output arrays.
        ins: ``comm.size`` C-contiguous input arrays. Not modified.

    Raises:
        DistNetworkError: a peer was lost.
        DistUsageError: a block's size differs from the size its receiver expects.
    """
    n, rank = comm.size, comm.rank
    flow = Dataflow(0)
    try:
        # Every receive lands in its final place, so all are posted, and signalled, at once.
        for k in range(1, n):
            src = (rank - k) % n
            flow.flight.add(comm.recv_into(src, 0, byte_view(outs[src])))
            flow.signal_ready(comm, src)
        for k in range(1, n):
            dst = (rank + k) % n
            flow.send_when_ready(comm, dst, 0, byte_view(ins[dst]))
        moved = sum(outs[p].nbytes + ins[p].nbytes for p in range(n) if p != rank)
        flow.stay_awake(comm, moved)
        flow.copy(outs[rank], ins[rank])
    except BaseException:
        flow.flight.abandon()
        raise
    await flow.wait()
