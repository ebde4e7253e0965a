"""reduce_scatter over a ring, pipelined in chunks; the inputs are never written."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import numpy.typing as npt

from .._arrays import byte_view
from .._ops import ReduceOp, finish_into, reduce_into
from ..transport.base import OpComm
from ._common import SCRATCH, WINDOW, Flight, chunk_size, copy_into, num_chunks, split, typed

__all__ = ["reduce_scatter"]

logger = logging.getLogger(__name__)


async def reduce_scatter(
    comm: OpComm,
    out: npt.NDArray[Any],
    ins: Sequence[npt.NDArray[Any]],
    op: ReduceOp,
    *,
    chunk_bytes: int | None = None,
) -> None:
    """Reduce block ``i`` of every rank's ``ins`` into ``out`` of rank ``i``.

    A ring of ``n-1`` steps: in step ``s`` rank ``r`` sends its partial result for block
    ``(r-s-1) % n`` to the right and receives the partial result for block ``(r-s-2) % n``
    from the left, adds its own ``ins`` block to it and passes it on; in the last step the
    block received is its own, reduced straight into ``out``. Partial results live in
    scratch chunks (``ins`` stays untouched); chunks are forwarded as they complete, with
    receives posted :data:`WINDOW` chunks ahead.

    Args:
        comm: This operation's view of the group.
        out: C-contiguous output, ``ins[i]``'s size and dtype.
        ins: ``comm.size`` C-contiguous arrays of equal size; ``ins[i]`` is this rank's
            contribution to rank ``i``'s result. Not modified.
        op: A reduction that the dtype can take.
        chunk_bytes: Pipelining unit; by default chosen from the block size.

    Raises:
        DistNetworkError: a peer was lost.
        DistUsageError: the peers' arrays differ in size.
    """
    n, rank = comm.size, comm.rank
    if n == 1:
        await copy_into(out, ins[0])
        finish_into(op, out, 1)
        return
    flat_out = out.reshape(-1)
    flat_ins = [a.reshape(-1) for a in ins]
    itemsize = out.itemsize
    pieces = split(flat_out.size, num_chunks(out.nbytes, chunk_size(out.nbytes, chunk_bytes)))
    nchunks = len(pieces)
    max_chunk = max(hi - lo for lo, hi in pieces)
    right, left = (rank + 1) % n, (rank - 1) % n
    outb = byte_view(out)
    first = byte_view(ins[(rank - 1) % n])
    total = (n - 1) * nchunks
    last_step = n - 2
    # A slot holds a partial result from its receive until its forwarding send is done,
    # so twice the window is needed for receives to run a window ahead.
    nslots = 2 * WINDOW if last_step > 0 else 0
    slots = [SCRATCH.get(max_chunk * itemsize) for _ in range(nslots)]
    slot_sends: list[asyncio.Future[None] | None] = [None] * nslots
    recvs: dict[int, asyncio.Future[int]] = {}
    flight = Flight()

    async def post(i: int) -> None:
        s, c = divmod(i, nchunks)
        lo, hi = pieces[c]
        if s == last_step:
            buf = outb[lo * itemsize : hi * itemsize]
        else:
            slot = i % nslots
            pending = slot_sends[slot]
            if pending is not None and not pending.done():
                await pending
            buf = slots[slot][: (hi - lo) * itemsize].data
        recvs[i] = flight.add(comm.recv_into(left, i, buf))
        if s == 0:
            flight.add(comm.send(right, c, first[lo * itemsize : hi * itemsize]))

    try:
        for i in range(min(WINDOW, total)):
            await post(i)
        for i in range(total):
            s, c = divmod(i, nchunks)
            lo, hi = pieces[c]
            await recvs.pop(i)
            if s == last_step:
                reduce_into(op, flat_out[lo:hi], flat_ins[rank][lo:hi])
                finish_into(op, flat_out[lo:hi], n)
            else:
                slot = i % nslots
                part = typed(slots[slot], out.dtype, hi - lo)
                reduce_into(op, part, flat_ins[(rank - s - 2) % n][lo:hi])
                slot_sends[slot] = flight.add(
                    comm.send(right, i + nchunks, slots[slot][: (hi - lo) * itemsize].data)
                )
            if i + WINDOW < total:
                await post(i + WINDOW)
            if i % WINDOW == WINDOW - 1:
                await asyncio.sleep(0)
        await flight.drain()
    except BaseException:
        # A cancelled receive may still be filled by its message: the scratch is not reused.
        flight.abandon()
        raise
    for buf in slots:
        SCRATCH.put(buf)
