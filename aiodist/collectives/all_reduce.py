"""all_reduce: recursive doubling for small messages, a pipelined ring for large ones."""

from __future__ import annotations

import logging
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from .._arrays._intake import byte_view
from .._arrays._reduce import ReduceOp, finish_into, reduce_into
from ..transport.base import OpComm
from ._common import (
    SCRATCH,
    Dataflow,
    Flight,
    abandon,
    chunk_size,
    num_chunks,
    split,
    typed,
)

__all__ = ["RING_THRESHOLD_BYTES", "all_reduce"]

logger = logging.getLogger(__name__)

#: Messages of at least this many bytes use the ring; smaller ones recursive doubling.
#: Measured over loopback TCP with 2 and 4 ranks (docs/architecture.md).
RING_THRESHOLD_BYTES = 64 * 1024

#: Reduce-scatter chunks in flight at once in the ring (each holds one scratch chunk).
RING_SLOTS = 8

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
        op: A reduction that ``x.dtype`` can take (see :func:`aiodist._arrays._reduce.check_reduce_op`).
        algorithm: ``"auto"`` chooses by size; the others force one (for tests and tuning).

    Raises:
        DistNetworkError: a peer was lost.
        DistUsageError: the peers' arrays differ in size.
    """
    if comm.size == 1:
        finish_into(op, x, 1)
        return
    large = x.nbytes >= RING_THRESHOLD_BYTES
    if algorithm == "ring" or (algorithm == "auto" and large and comm.size > 2):
        await ring_all_reduce(comm, x, op)
    elif comm.size == 2:
        if large:
            await pair_all_reduce_pipelined(comm, x, op)
        else:
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


async def pair_all_reduce_pipelined(
    comm: OpComm,
    x: npt.NDArray[Any],
    op: ReduceOp,
    *,
    chunk_bytes: int | None = None,
    slots: int = RING_SLOTS,
) -> None:
    """Two ranks, large messages: the one exchange of recursive doubling, in chunks.

    Each rank sends every chunk of ``x`` and receives the peer's into a scratch slot; a
    chunk is reduced into ``x`` once it has arrived and our own send of it has left (the
    send reads ``x``). This moves the same bytes as a 2-rank ring in one step instead of
    two, with reductions overlapping the transfer. A slot's next chunk is sent and its
    receive posted when the slot frees, on both ranks alike, so chunks arrive where a
    receive waits for them.

    Args:
        comm: This operation's view of a two-rank group.
        x: C-contiguous array, same shape and dtype on both ranks; reduced in place.
        op: A reduction that ``x.dtype`` can take.
        chunk_bytes: Pipelining unit in bytes (default 512 KiB).
        slots: Chunks in flight at once (scratch memory: slots x chunk).

    Raises:
        DistNetworkError: the peer was lost.
        DistUsageError: the peers' arrays differ in size.
    """
    peer = 1 - comm.rank
    flat = x.reshape(-1)
    xb = byte_view(x)
    itemsize = x.itemsize
    pieces = split(flat.size, num_chunks(x.nbytes, chunk_size(chunk_bytes)))
    nchunks = len(pieces)
    nslots = min(slots, nchunks)
    max_chunk = max(hi - lo for lo, hi in pieces)
    scratch = [SCRATCH.get(max_chunk * itemsize) for _ in range(nslots)]
    flow = Dataflow(nchunks)
    # A chunk is reduced when both its receive and its send are done: count to two.
    ready = [0] * nchunks

    def post(c: int) -> None:
        lo, hi = pieces[c]
        buf = scratch[c % nslots][: (hi - lo) * itemsize].data
        flow.on(comm.recv_into(peer, c, buf), arrived, c)

    def send(c: int) -> None:
        lo, hi = pieces[c]
        flow.on(comm.send(peer, c, xb[lo * itemsize : hi * itemsize]), arrived, c)

    def send_first() -> None:
        for c in range(nslots):
            send(c)

    def arrived(c: int) -> None:
        ready[c] += 1
        if ready[c] < 2:
            return
        lo, hi = pieces[c]
        part = flat[lo:hi]
        reduce_into(op, part, typed(scratch[c % nslots], x.dtype, hi - lo))
        finish_into(op, part, 2)
        if c + nslots < nchunks:
            # Both ranks free this slot at about the same time: receive and send at once.
            post(c + nslots)
            send(c + nslots)
        flow.finish_one()

    try:
        for c in range(nslots):
            post(c)
        flow.start_sends(comm, x.nbytes, peer, peer, send_first)
    except BaseException:
        flow.flight.abandon()
        raise
    await flow.wait()
    for slot in scratch:
        SCRATCH.put(slot)


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


# The ring all_reduce. The message is cut into ``n`` segments and each segment into the
# same number of chunks. There are ``2(n-1)`` steps: in step ``k`` rank ``r`` sends segment
# ``(r-k) % n`` to its right neighbour and receives segment ``(r-k-1) % n`` from its left
# one. In the first ``n-1`` steps (reduce-scatter) a received chunk lands in a scratch
# slot and is reduced into ``x``; in the last ``n-1`` (all-gather) it lands in ``x``
# directly. Every chunk is handled the moment it arrives (future callbacks, no fixed
# order) and sent on at once, so all steps and chunks overlap.
#
# Receives are posted before the matching data can exist, so nothing is staged by the
# transport: all-gather receives are posted up front (their data is final, produced only
# after everything this rank contributes to it was delivered, so landing in ``x`` early
# cannot overwrite anything still needed); a reduce-scatter chunk travels through all its
# steps in one of ``slots`` scratch slots, and the receive of its next step is posted
# when its previous step is reduced, exactly when the neighbour sends it.
async def ring_all_reduce(
    comm: OpComm,
    x: npt.NDArray[Any],
    op: ReduceOp,
    *,
    chunk_bytes: int | None = None,
    slots: int = RING_SLOTS,
) -> None:
    """The ring all_reduce, callable directly with a chosen chunk size (tests, tuning):
    see the schedule above.

    Args:
        comm: This operation's view of the group.
        x: C-contiguous array, same shape and dtype on every rank; reduced in place.
        op: A reduction that ``x.dtype`` can take.
        chunk_bytes: Pipelining unit in bytes (default 512 KiB).
        slots: Reduce-scatter chunks in flight at once (scratch memory: slots x chunk).

    Raises:
        DistNetworkError: a peer was lost.
        DistUsageError: the peers' arrays differ in size.
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
    nchunks = num_chunks(seg_bytes, chunk_size(chunk_bytes))
    # bounds[j][c]: element range of chunk c of segment j.
    bounds = [[(lo + a, lo + b) for a, b in split(hi - lo, nchunks)] for lo, hi in segments]
    max_chunk = max(b - a for seg in bounds for a, b in seg)
    right, left = (rank + 1) % n, (rank - 1) % n
    last_rs = n - 2
    last = 2 * n - 3
    nslots = min(slots, nchunks)
    scratch = [SCRATCH.get(max_chunk * itemsize) for _ in range(nslots)]
    flow = Dataflow((last + 1) * nchunks)

    def chunk(k: int, c: int) -> tuple[int, int]:
        # The chunk received in step k (and sent on in step k + 1).
        return bounds[(rank - k - 1) % n][c]

    def send_own(c: int) -> None:
        # Step 0 of chunk c: our own data.
        lo, hi = bounds[rank][c]
        flow.flight.add(comm.send(right, c, xb[lo * itemsize : hi * itemsize]))

    def send_first() -> None:
        for c in range(nslots):
            send_own(c)

    def start_rs(c: int) -> None:
        post_rs(0, c)
        send_own(c)

    def post_rs(k: int, c: int) -> None:
        lo, hi = chunk(k, c)
        buf = scratch[c % nslots][: (hi - lo) * itemsize].data
        flow.on(comm.recv_into(left, k * nchunks + c, buf), on_rs, k, c)

    def on_rs(k: int, c: int) -> None:
        lo, hi = chunk(k, c)
        part = flat[lo:hi]
        reduce_into(op, part, typed(scratch[c % nslots], x.dtype, hi - lo))
        if k == last_rs:
            # This chunk of our own segment is complete: finish it before anyone sees it.
            finish_into(op, part, n)
            if c + nslots < nchunks:
                start_rs(c + nslots)
        else:
            post_rs(k + 1, c)
        flow.flight.add(comm.send(right, (k + 1) * nchunks + c, xb[lo * itemsize : hi * itemsize]))
        flow.finish_one()

    def on_ag(k: int, c: int) -> None:
        if k < last:
            lo, hi = chunk(k, c)
            flow.flight.add(
                comm.send(right, (k + 1) * nchunks + c, xb[lo * itemsize : hi * itemsize])
            )
        flow.finish_one()

    def start() -> None:
        for k in range(last_rs + 1, last + 1):
            for c in range(nchunks):
                lo, hi = chunk(k, c)
                buf = xb[lo * itemsize : hi * itemsize]
                flow.on(comm.recv_into(left, k * nchunks + c, buf), on_ag, k, c)
        for c in range(nslots):
            post_rs(0, c)
        flow.start_sends(comm, seg_bytes, left, right, send_first)

    await flow.run(start, scratch)
