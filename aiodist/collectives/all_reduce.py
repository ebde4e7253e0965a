"""all_reduce: recursive doubling for small messages, a pipelined ring for large ones."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from .._arrays import byte_view
from .._ops import ReduceOp, finish_into, reduce_into
from ..transport.base import OpComm
from ._common import SCRATCH, WINDOW, Flight, abandon, chunk_size, num_chunks, split, typed

__all__ = ["RING_THRESHOLD_BYTES", "all_reduce"]

logger = logging.getLogger(__name__)

#: Messages of at least this many bytes use the ring; smaller ones recursive doubling.
#: Measured over loopback TCP with 2 and 4 ranks (docs/architecture.md).
RING_THRESHOLD_BYTES = 64 * 1024

Algorithm = Literal["auto", "recursive_doubling", "ring"]


async def all_reduce(
    comm: OpComm, x: npt.NDArray[Any], op: ReduceOp, *, algorithm: Algorithm = "auto"
) -> None:
    """Reduce ``x`` over every rank of ``comm`` and leave the result in ``x`` on each.

    Below :data:`RING_THRESHOLD_BYTES` (and for any size with non-ring ``algorithm``)
    recursive doubling: ``log2(n)`` exchanges of the whole message, the fewest round trips;
    non-power-of-two sizes fold the extra ranks into partners first and send them the
    result last. From the threshold up a ring: reduce-scatter then all-gather over ``n``
    segments, each cut into chunks so that sending, receiving and reducing overlap, moving
    ``2(n-1)/n`` of the message per rank. Every rank ends with bitwise the same result.

    Args:
        comm: This operation's view of the group.
        x: C-contiguous array, same shape and dtype on every rank; reduced in place.
        op: A reduction that ``x.dtype`` can take (see :func:`aiodist._ops.check_reduce_op`).
        algorithm: ``"auto"`` chooses by size; the others force one (for tests and tuning).

    Raises:
        DistNetworkError: a peer was lost.
        DistUsageError: the peers' arrays differ in size.
    """
    if comm.size == 1:
        finish_into(op, x, 1)
        return
    if algorithm == "ring" or (algorithm == "auto" and x.nbytes >= RING_THRESHOLD_BYTES):
        await ring_all_reduce(comm, x, op)
    elif comm.size == 2:
        await _pair_all_reduce(comm, x, op)
    else:
        await _recursive_doubling(comm, x, op)


async def _pair_all_reduce(comm: OpComm, x: npt.NDArray[Any], op: ReduceOp) -> None:
    """Two ranks: one exchange. The common small case, kept free of bookkeeping."""
    peer = 1 - comm.rank
    tmp = np.empty_like(x)
    recv = comm.recv_into(peer, 0, byte_view(tmp))
    send = comm.send(peer, 0, byte_view(x))
    try:
        await recv
        # x may be modified only once the transport no longer refers to it.
        await send
    except BaseException:
        abandon((recv, send))
        raise
    reduce_into(op, x, tmp)
    finish_into(op, x, 2)


async def _recursive_doubling(comm: OpComm, x: npt.NDArray[Any], op: ReduceOp) -> None:
    n, rank = comm.size, comm.rank
    pof2 = 1 << (n.bit_length() - 1)
    rem = n - pof2
    xb = byte_view(x)
    tmp = np.empty_like(x)
    tb = byte_view(tmp)
    flight = Flight()
    last_step = pof2.bit_length() + 1
    try:
        # The first 2*rem ranks pair up; the even one of each pair hands its data to the
        # odd one, sits out the exchange and receives the result at the end.
        if rank < 2 * rem:
            if rank % 2 == 0:
                await flight.add(comm.send(rank + 1, 0, xb))
                await flight.add(comm.recv_into(rank + 1, last_step, xb))
                await flight.drain()
                return
            await flight.add(comm.recv_into(rank - 1, 0, tb))
            reduce_into(op, x, tmp)
            vrank = rank // 2
        else:
            vrank = rank - rem
        mask = 1
        step = 1
        while mask < pof2:
            vpeer = vrank ^ mask
            peer = vpeer * 2 + 1 if vpeer < rem else vpeer + rem
            recv = flight.add(comm.recv_into(peer, step, tb))
            send = flight.add(comm.send(peer, step, xb))
            await recv
            await send
            reduce_into(op, x, tmp)
            mask <<= 1
            step += 1
        finish_into(op, x, n)
        if rank < 2 * rem:
            flight.add(comm.send(rank - 1, last_step, xb))
        await flight.drain()
    except BaseException:
        flight.abandon()
        raise


async def ring_all_reduce(
    comm: OpComm, x: npt.NDArray[Any], op: ReduceOp, *, chunk_bytes: int | None = None
) -> None:
    """The ring all_reduce, callable directly with a chosen chunk size (tests, tuning).

    The message is cut into ``n`` segments and each segment into the same number of
    chunks. There are ``2(n-1)`` steps: in step ``k`` rank ``r`` sends segment
    ``(r-k) % n`` to its right neighbour and receives segment ``(r-k-1) % n`` from its left
    one; in the first ``n-1`` steps (reduce-scatter) the received chunk goes to a scratch
    buffer and is reduced into ``x``, in the last ``n-1`` (all-gather) it lands in ``x``
    directly. A chunk is sent on as soon as it was received (and reduced), so chunks of
    different steps are in flight at once; receives are posted :data:`WINDOW` chunks ahead.

    Receiving all-gather chunks straight into ``x`` while reduce-scatter sends of the same
    memory may still be queued is safe: each such chunk is the final value, which its
    owner can only have computed after our earlier send of that memory was delivered.
    """
    n, rank = comm.size, comm.rank
    if n == 1:
        finish_into(op, x, 1)
        return
    flat = x.reshape(-1)
    xb = byte_view(x)
    itemsize = x.itemsize
    segments = split(flat.size, n)
    seg_bytes = (segments[-1][1] - segments[-1][0]) * itemsize
    nchunks = num_chunks(seg_bytes, chunk_size(seg_bytes, chunk_bytes))
    # bounds[j][c]: element range of chunk c of segment j.
    bounds = [[(lo + a, lo + b) for a, b in split(hi - lo, nchunks)] for lo, hi in segments]
    max_chunk = max(b - a for seg in bounds for a, b in seg)
    right, left = (rank + 1) % n, (rank - 1) % n
    rs_steps = n - 1
    total = 2 * (n - 1) * nchunks
    slots = [SCRATCH.get(max_chunk * itemsize) for _ in range(WINDOW)]
    recvs: dict[int, asyncio.Future[int]] = {}
    flight = Flight()

    def post(i: int) -> None:
        k, c = divmod(i, nchunks)
        lo, hi = bounds[(rank - k - 1) % n][c]
        if k < rs_steps:
            buf = slots[i % WINDOW][: (hi - lo) * itemsize].data
        else:
            buf = xb[lo * itemsize : hi * itemsize]
        recvs[i] = flight.add(comm.recv_into(left, i, buf))
        if k == 0:
            # The first step sends our own data; sent as its receive is posted, so chunks
            # leave at the pace the peers take them in.
            slo, shi = bounds[rank][c]
            flight.add(comm.send(right, i, xb[slo * itemsize : shi * itemsize]))

    try:
        for i in range(min(WINDOW, total)):
            post(i)
        for i in range(total):
            k, c = divmod(i, nchunks)
            lo, hi = bounds[(rank - k - 1) % n][c]
            await recvs.pop(i)
            if k < rs_steps:
                reduce_into(op, flat[lo:hi], typed(slots[i % WINDOW], x.dtype, hi - lo))
                if k == rs_steps - 1:
                    # This chunk of our segment is complete: finish it before anyone sees it.
                    finish_into(op, flat[lo:hi], n)
            if i + WINDOW < total:
                post(i + WINDOW)
            if k < 2 * (n - 1) - 1:
                flight.add(comm.send(right, i + nchunks, xb[lo * itemsize : hi * itemsize]))
            if i % WINDOW == WINDOW - 1:
                # Received chunks may all be there already; let the loop breathe anyway.
                await asyncio.sleep(0)
        await flight.drain()
    except BaseException:
        # A cancelled receive may still be filled by its message: the scratch is not reused.
        flight.abandon()
        raise
    for slot in slots:
        SCRATCH.put(slot)
