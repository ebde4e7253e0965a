"""reduce_scatter over a ring, pipelined in chunks; the inputs are never written."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy.typing as npt

from .._arrays._intake import byte_view
from .._arrays._reduce import ReduceOp, finish_into, reduce_into
from ..transport.base import OpComm
from ._common import SCRATCH, Dataflow, chunk_size, copy_into, num_chunks, split, typed

__all__ = ["SLOTS", "reduce_scatter"]

logger = logging.getLogger(__name__)

#: Chunks in their intermediate ring steps at once.
SLOTS = 8


# The ring reduce_scatter: ``n-1`` steps. In step ``k`` rank ``r`` receives from the left
# the partial result for block ``(r-k-2) % n``, combines its own ``ins`` block into it and
# sends it to the right as step ``k+1``; step 0 sends block ``(r-1) % n`` of ``ins`` as it
# is, and the last step's block is our own, received straight into ``out``. Blocks are cut
# into chunks handled the moment they land (future callbacks), so steps overlap.
#
# Partial results live in scratch (``ins`` is never written): each chunk travels through
# its intermediate steps in one of ``slots`` slots of two buffers, one being received
# into while the other is sent from. A receive is posted as soon as its buffer is free,
# before the neighbour can send into it, and every receive into ``out`` is posted up
# front, so the transport never has to stage a message.
async def reduce_scatter(
    comm: OpComm,
    out: npt.NDArray[Any],
    ins: Sequence[npt.NDArray[Any]],
    op: ReduceOp,
    *,
    chunk_bytes: int | None = None,
    slots: int = SLOTS,
) -> None:
    """Reduce block ``i`` of every rank's ``ins`` into ``out`` of rank ``i`` (a ring: above).

    Args:
        comm: This operation's view of the group.
        out: C-contiguous output, ``ins[i]``'s size and dtype.
        ins: ``comm.size`` C-contiguous arrays of equal size; ``ins[i]`` is this rank's
            contribution to rank ``i``'s result. Not modified.
        op: A reduction that the dtype can take.
        chunk_bytes: Pipelining unit in bytes (default 512 KiB).
        slots: Chunks in their intermediate steps at once (scratch: 2 x slots x chunk).

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
    pieces = split(flat_out.size, num_chunks(out.nbytes, chunk_size(chunk_bytes)))
    nchunks = len(pieces)
    right, left = (rank + 1) % n, (rank - 1) % n
    outb = byte_view(out)
    first = byte_view(ins[(rank - 1) % n])
    final = n - 2  # the step whose block is ours, received into out
    # Steps 0 .. final-1 go through scratch; the slot of a chunk is free again once all
    # final - 0 of its sends from scratch (steps 1 .. final) have left.
    nslots = min(slots, nchunks) if final > 0 else 0
    max_chunk = max(hi - lo for lo, hi in pieces)
    bufs = [[SCRATCH.get(max_chunk * itemsize) for _ in range(2)] for _ in range(nslots)]
    sent = [0] * nchunks
    flow = Dataflow(nchunks * (n - 1))

    def view(c: int, k: int) -> memoryview:
        lo, hi = pieces[c]
        return bufs[c % nslots][k % 2][: (hi - lo) * itemsize].data

    def send_first(c: int) -> None:
        lo, hi = pieces[c]
        flow.flight.add(comm.send(right, c, first[lo * itemsize : hi * itemsize]))

    def send_all_first() -> None:
        for c in range(nslots if final else nchunks):
            send_first(c)

    def post_first(c: int) -> None:
        for k in range(min(2, final)):
            post(k, c)

    def start(c: int) -> None:
        post_first(c)
        send_first(c)

    def post(k: int, c: int) -> None:
        flow.on(comm.recv_into(left, k * nchunks + c, view(c, k)), on_partial, k, c)

    def on_partial(k: int, c: int) -> None:
        lo, hi = pieces[c]
        part = typed(bufs[c % nslots][k % 2], out.dtype, hi - lo)
        reduce_into(op, part, flat_ins[(rank - k - 2) % n][lo:hi])
        flow.on(comm.send(right, (k + 1) * nchunks + c, view(c, k)), on_sent, k, c)
        flow.finish_one()

    def on_sent(k: int, c: int) -> None:
        # The buffer of step k is free: it takes step k + 2's receive, if any.
        if k + 2 < final:
            post(k + 2, c)
        sent[c] += 1
        if sent[c] == final and c + nslots < nchunks:
            start(c + nslots)

    def on_final(c: int) -> None:
        lo, hi = pieces[c]
        part = flat_out[lo:hi]
        reduce_into(op, part, flat_ins[rank][lo:hi])
        finish_into(op, part, n)
        flow.finish_one()

    def begin() -> None:
        for c, (lo, hi) in enumerate(pieces):
            buf = outb[lo * itemsize : hi * itemsize]
            flow.on(comm.recv_into(left, final * nchunks + c, buf), on_final, c)
        for c in range(nslots):
            post_first(c)
        flow.start_sends(comm, out.nbytes, left, right, send_all_first)

    await flow.run(begin, [slot for pair in bufs for slot in pair])
