"""broadcast and reduce over a binomial tree, pipelined in chunks for large messages."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy.typing as npt

from .._arrays import byte_view
from .._ops import ReduceOp, finish_into, reduce_into
from ..transport.base import OpComm
from ._common import (
    SCRATCH,
    WINDOW,
    Flight,
    binomial_tree,
    chunk_size,
    num_chunks,
    split,
    typed,
)

__all__ = ["broadcast", "reduce"]

logger = logging.getLogger(__name__)


async def broadcast(
    comm: OpComm, x: npt.NDArray[Any], root: int, *, chunk_bytes: int | None = None
) -> None:
    """Copy ``x`` of rank ``root`` into ``x`` of every other rank.

    A binomial tree (``ceil(log2 n)`` rounds; the root feeds the largest subtree first).
    Messages are cut into chunks and every rank forwards a chunk to its children as soon as
    it has it, so for large messages the levels of the tree work at the same time.

    Args:
        comm: This operation's view of the group.
        x: C-contiguous array, same shape and dtype on every rank; written on non-roots.
        root: Group rank that holds the data.
        chunk_bytes: Pipelining unit; by default chosen from the message size.

    Raises:
        DistNetworkError: a peer was lost.
        DistUsageError: the peers' arrays differ in size.
    """
    n = comm.size
    if n == 1:
        return
    vrank = (comm.rank - root) % n
    parent, children = binomial_tree(vrank, n)
    xb = byte_view(x)
    pieces = split(x.nbytes, num_chunks(x.nbytes, chunk_size(x.nbytes, chunk_bytes)))
    targets = [(child + root) % n for child in children]
    flight = Flight()
    try:
        if parent is None:
            for c, (lo, hi) in enumerate(pieces):
                for peer in targets:
                    flight.add(comm.send(peer, c, xb[lo:hi]))
        else:
            src = (parent + root) % n
            recvs = [
                flight.add(comm.recv_into(src, c, xb[lo:hi])) for c, (lo, hi) in enumerate(pieces)
            ]
            for c, (lo, hi) in enumerate(pieces):
                await recvs[c]
                for peer in targets:
                    flight.add(comm.send(peer, c, xb[lo:hi]))
        await flight.drain()
    except BaseException:
        flight.abandon()
        raise


async def reduce(
    comm: OpComm,
    x: npt.NDArray[Any],
    root: int,
    op: ReduceOp,
    *,
    chunk_bytes: int | None = None,
) -> None:
    """Reduce ``x`` over every rank into ``x`` of rank ``root``; the others' ``x`` unchanged.

    A binomial tree, the broadcast's mirror: each rank combines its children's partial
    results with its own data, chunk by chunk, and passes the chunk to its parent. Leaves
    send straight from ``x``; inner ranks accumulate in scratch memory; the root in ``x``.

    Args:
        comm: This operation's view of the group.
        x: C-contiguous array, same shape and dtype on every rank.
        root: Group rank that receives the result.
        op: A reduction that ``x.dtype`` can take.
        chunk_bytes: Pipelining unit; by default chosen from the message size.

    Raises:
        DistNetworkError: a peer was lost.
        DistUsageError: the peers' arrays differ in size.
    """
    n = comm.size
    if n == 1:
        finish_into(op, x, 1)
        return
    vrank = (comm.rank - root) % n
    parent, children = binomial_tree(vrank, n)
    # Smallest subtree first: those partial results are ready soonest.
    sources = [(child + root) % n for child in reversed(children)]
    flat = x.reshape(-1)
    itemsize = x.itemsize
    pieces = split(flat.size, num_chunks(x.nbytes, chunk_size(x.nbytes, chunk_bytes)))
    xb = byte_view(x)
    flight = Flight()
    if not sources:
        assert parent is not None
        dst = (parent + root) % n
        try:
            for c, (lo, hi) in enumerate(pieces):
                flight.add(comm.send(dst, c, xb[lo * itemsize : hi * itemsize]))
            await flight.drain()
        except BaseException:
            flight.abandon()
            raise
        return
    max_chunk = max(hi - lo for lo, hi in pieces)
    nsrc = len(sources)
    slots = [SCRATCH.get(max_chunk * itemsize) for _ in range(WINDOW * nsrc)]
    acc_buf = SCRATCH.get(x.nbytes) if parent is not None else None
    acc = flat if acc_buf is None else typed(acc_buf, x.dtype, flat.size)
    accb = xb if acc_buf is None else acc_buf[: x.nbytes].data
    recvs: dict[tuple[int, int], asyncio.Future[int]] = {}

    def post(c: int) -> None:
        lo, hi = pieces[c]
        for j, peer in enumerate(sources):
            buf = slots[(c % WINDOW) * nsrc + j][: (hi - lo) * itemsize].data
            recvs[c, j] = flight.add(comm.recv_into(peer, c, buf))

    try:
        for c in range(min(WINDOW, len(pieces))):
            post(c)
        for c, (lo, hi) in enumerate(pieces):
            if acc_buf is not None:
                acc[lo:hi] = flat[lo:hi]
            for j in range(nsrc):
                await recvs.pop((c, j))
                reduce_into(op, acc[lo:hi], typed(slots[(c % WINDOW) * nsrc + j], x.dtype, hi - lo))
            if c + WINDOW < len(pieces):
                post(c + WINDOW)
            if parent is None:
                finish_into(op, acc[lo:hi], n)
            else:
                flight.add(comm.send((parent + root) % n, c, accb[lo * itemsize : hi * itemsize]))
            if c % WINDOW == WINDOW - 1:
                await asyncio.sleep(0)
        await flight.drain()
    except BaseException:
        # A cancelled receive may still be filled by its message: the scratch is not reused.
        flight.abandon()
        raise
    for slot in slots:
        SCRATCH.put(slot)
    if acc_buf is not None:
        SCRATCH.put(acc_buf)
