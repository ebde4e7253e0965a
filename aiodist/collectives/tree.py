"""broadcast and reduce over a binomial tree, pipelined in chunks for large messages."""

from __future__ import annotations

import logging
from typing import Any

import numpy.typing as npt

from .._arrays._intake import byte_view
from .._arrays._reduce import ReduceOp, finish_into, reduce_into
from ..transport.base import OpComm
from ._common import (
    READY_BYTES,
    SCRATCH,
    Dataflow,
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
    With more than two ranks messages are cut into chunks and every rank forwards a chunk
    to its children as soon as it has it, so for large messages the levels of the tree work
    at the same time.

    Args:
        comm: This operation's view of the group.
        x: C-contiguous array, same shape and dtype on every rank; written on non-roots.
        root: Group rank that holds the data.
        chunk_bytes: Pipelining unit in bytes (default 512 KiB).

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
    # Chunks only pay where a rank forwards what it receives (more than two ranks).
    nchunks = num_chunks(x.nbytes, chunk_size(chunk_bytes)) if n > 2 else 1
    pieces = split(x.nbytes, nchunks)
    targets = [(child + root) % n for child in children]
    handshake = x.nbytes >= READY_BYTES
    have = [parent is None] * nchunks
    ready = dict.fromkeys(targets, not handshake)
    flow = Dataflow(0 if parent is None else nchunks)

    def on_chunk(c: int) -> None:
        have[c] = True
        lo, hi = pieces[c]
        for peer in targets:
            if ready[peer]:
                flow.flight.add(comm.send(peer, c, xb[lo:hi]))
        flow.finish_one()

    def on_ready(peer: int) -> None:
        if not ready[peer]:
            ready[peer] = True
            for c, (lo, hi) in enumerate(pieces):
                if have[c]:
                    flow.flight.add(comm.send(peer, c, xb[lo:hi]))

    try:
        if parent is not None:
            src = (parent + root) % n
            for c, (lo, hi) in enumerate(pieces):
                flow.on(comm.recv_into(src, c, xb[lo:hi]), on_chunk, c)
            flow.signal_ready(comm, src)
            flow.stay_awake(comm, x.nbytes)
        if parent is None:
            flow.stay_awake(comm, x.nbytes)
        for peer in targets:
            # Small messages go at once; the signal is taken either way (see READY_BYTES).
            flow.after_ready(comm, peer, on_ready, peer)
            if parent is None and not handshake:
                for c, (lo, hi) in enumerate(pieces):
                    flow.flight.add(comm.send(peer, c, xb[lo:hi]))
    except BaseException:
        flow.flight.abandon()
        raise
    await flow.wait()


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
    results with its own data, chunk by chunk as the chunks land, and passes each chunk to
    its parent at once. Leaves send straight from ``x``; inner ranks accumulate in scratch
    memory, the root in ``x``.

    Args:
        comm: This operation's view of the group.
        x: C-contiguous array, same shape and dtype on every rank.
        root: Group rank that receives the result.
        op: A reduction that ``x.dtype`` can take.
        chunk_bytes: Pipelining unit in bytes (default 512 KiB).

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
    pieces = split(flat.size, num_chunks(x.nbytes, chunk_size(chunk_bytes)))
    xb = byte_view(x)
    handshake = x.nbytes >= READY_BYTES
    if not sources:
        assert parent is not None
        await _reduce_leaf(comm, x, pieces, (parent + root) % n, handshake)
        return
    nsrc = len(sources)
    # Every child's whole message has a receive posted up front (children send at once;
    # anything not posted would be staged by the transport, in as much memory, plus a copy).
    recv_bufs = [SCRATCH.get(x.nbytes) for _ in range(nsrc)]
    acc_buf = SCRATCH.get(x.nbytes) if parent is not None else None
    acc = flat if acc_buf is None else typed(acc_buf, x.dtype, flat.size)
    accb = xb if acc_buf is None else acc_buf[: x.nbytes].data
    arrived = [0] * len(pieces)
    complete = [False] * len(pieces)
    upward = None if parent is None else (parent + root) % n
    parent_ready = [not handshake]
    flow = Dataflow(len(pieces))

    def send_up(c: int) -> None:
        assert upward is not None
        lo, hi = pieces[c]
        flow.flight.add(comm.send(upward, c, accb[lo * itemsize : hi * itemsize]))

    def on_parent_ready() -> None:
        if not parent_ready[0]:
            parent_ready[0] = True
            for c in range(len(pieces)):
                if complete[c]:
                    send_up(c)

    def on_chunk(c: int) -> None:
        arrived[c] += 1
        if arrived[c] < nsrc:
            return
        lo, hi = pieces[c]
        part = acc[lo:hi]
        if acc_buf is not None:
            part[...] = flat[lo:hi]
        # Children's contributions in a fixed order, whatever order they arrived in.
        for buf in recv_bufs:
            reduce_into(op, part, typed(buf, x.dtype, flat.size)[lo:hi])
        complete[c] = True
        if upward is None:
            finish_into(op, part, n)
        elif parent_ready[0]:
            send_up(c)
        flow.finish_one()

    def start() -> None:
        for c, (lo, hi) in enumerate(pieces):
            for peer, buf in zip(sources, recv_bufs, strict=True):
                view = buf[lo * itemsize : hi * itemsize].data
                flow.on(comm.recv_into(peer, c, view), on_chunk, c)
        for peer in sources:
            flow.signal_ready(comm, peer)
        flow.stay_awake(comm, nsrc * x.nbytes)
        if upward is not None:
            # Taken whatever the size (see READY_BYTES); waited for only when large.
            flow.after_ready(comm, upward, on_parent_ready)

    await flow.run(start, recv_bufs if acc_buf is None else [*recv_bufs, acc_buf])


async def _reduce_leaf(
    comm: OpComm, x: npt.NDArray[Any], pieces: list[tuple[int, int]], dst: int, handshake: bool
) -> None:
    """A leaf's part of :func:`reduce`: send ``x`` to its parent ``dst`` chunk by chunk,
    once the parent said it is ready when ``handshake`` (a large message)."""
    xb = byte_view(x)
    itemsize = x.itemsize
    leaf = Dataflow(0)

    def send_all() -> None:
        for c, (lo, hi) in enumerate(pieces):
            leaf.flight.add(comm.send(dst, c, xb[lo * itemsize : hi * itemsize]))

    def on_ready() -> None:
        if handshake:
            send_all()

    def start() -> None:
        # Small messages go at once; the signal is taken either way (see READY_BYTES).
        if not handshake:
            send_all()
        leaf.after_ready(comm, dst, on_ready)
        leaf.stay_awake(comm, x.nbytes)

    await leaf.run(start)
