"""all_gather over a ring; gather and scatter straight between the root and each rank."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy.typing as npt

from .._arrays._intake import byte_view
from ..errors import DistUsageError
from ..transport.base import OpComm
from ._common import READY_BYTES, Dataflow, chunk_size, copy_into, num_chunks, split

__all__ = ["all_gather", "gather", "scatter"]

logger = logging.getLogger(__name__)


async def all_gather(
    comm: OpComm,
    outs: Sequence[npt.NDArray[Any]],
    x: npt.NDArray[Any],
    *,
    chunk_bytes: int | None = None,
) -> None:
    """Gather every rank's ``x`` into ``outs`` on every rank: ``outs[i]`` gets rank i's ``x``.

    A ring: in step ``s`` rank ``r`` passes block ``(r-s) % n`` to its right neighbour and
    receives block ``(r-s-1) % n`` from its left one, straight into ``outs``. Blocks are cut
    into chunks that are forwarded the moment they arrive (future callbacks), and every
    receive is posted up front (it needs no scratch), so the ``n-1`` steps overlap and the
    transport never stages a message. Each rank sends and receives
    ``(n-1)/n`` of the total once.

    Args:
        comm: This operation's view of the group.
        outs: ``comm.size`` C-contiguous arrays of ``x``'s dtype and size (possibly views
            of one large output).
        x: C-contiguous input, same size on every rank.
        chunk_bytes: Pipelining unit in bytes (default 512 KiB).

    Raises:
        DistNetworkError: a peer was lost.
        DistUsageError: the peers' arrays differ in size.
    """
    n, rank = comm.size, comm.rank
    if n == 1:
        await copy_into(outs[rank], x)
        return
    nbytes = x.nbytes
    pieces = split(nbytes, num_chunks(nbytes, chunk_size(chunk_bytes)))
    nchunks = len(pieces)
    views = [byte_view(o) for o in outs]
    xb = byte_view(x)
    right, left = (rank + 1) % n, (rank - 1) % n
    flow = Dataflow((n - 1) * nchunks)
    flow.stay_awake(comm, (n - 1) * nbytes)

    def send_first() -> None:
        for c, (lo, hi) in enumerate(pieces):
            flow.flight.add(comm.send(right, c, xb[lo:hi]))

    def on_block(s: int, c: int) -> None:
        # Block (rank - s - 1) arrived in step s: pass it on in step s + 1.
        if s < n - 2:
            lo, hi = pieces[c]
            view = views[(rank - s - 1) % n]
            flow.flight.add(comm.send(right, (s + 1) * nchunks + c, view[lo:hi]))
        flow.finish_one()

    try:
        for s in range(n - 1):
            view = views[(rank - s - 1) % n]
            for c, (lo, hi) in enumerate(pieces):
                flow.on(comm.recv_into(left, s * nchunks + c, view[lo:hi]), on_block, s, c)
        if nbytes >= READY_BYTES:
            flow.signal_ready(comm, left)
            flow.after_ready(comm, right, send_first)
            flow.copy(outs[rank], x)
        else:
            # Our own block first: while we copy, a late neighbour posts its receives.
            flow.copy(outs[rank], x)
            send_first()
    except BaseException:
        flow.flight.abandon()
        raise
    await flow.wait()


async def gather(
    comm: OpComm,
    outs: Sequence[npt.NDArray[Any]] | None,
    x: npt.NDArray[Any],
    root: int,
) -> None:
    """Gather every rank's ``x`` on rank ``root``: there ``outs[i]`` gets rank i's ``x``.

    Every rank sends its whole array straight to the root, which receives each into its
    place in ``outs``; nothing is forwarded, so each byte crosses one link once.

    Args:
        comm: This operation's view of the group.
        outs: On the root, ``comm.size`` C-contiguous arrays of ``x``'s dtype and size;
            ignored (pass ``None``) elsewhere.
        x: C-contiguous input, same size on every rank.
        root: Group rank that receives.

    Raises:
        DistNetworkError: a peer was lost.
        DistUsageError: the peers' arrays differ in size, or the root has no ``outs``.
    """
    if outs is None and comm.rank == root:
        raise DistUsageError("gather needs output arrays on the root")
    flow = Dataflow(0)
    try:
        if comm.rank == root:
            assert outs is not None
            for i in range(comm.size):
                if i != root:
                    flow.flight.add(comm.recv_into(i, 0, byte_view(outs[i])))
                    flow.signal_ready(comm, i)
            flow.stay_awake(comm, (comm.size - 1) * x.nbytes)
            flow.copy(outs[root], x)
        else:
            flow.send_when_ready(comm, root, 0, byte_view(x))
            flow.stay_awake(comm, x.nbytes)
    except BaseException:
        flow.flight.abandon()
        raise
    await flow.wait()


async def scatter(
    comm: OpComm,
    out: npt.NDArray[Any],
    ins: Sequence[npt.NDArray[Any]] | None,
    root: int,
) -> None:
    """Hand block ``i`` of the root's ``ins`` to rank ``i``, into its ``out``.

    The root sends each block straight to its rank (nothing is forwarded).

    Args:
        comm: This operation's view of the group.
        out: C-contiguous output, same size on every rank.
        ins: On the root, ``comm.size`` C-contiguous arrays of ``out``'s dtype and size;
            ignored (pass ``None``) elsewhere.
        root: Group rank that sends.

    Raises:
        DistNetworkError: a peer was lost.
        DistUsageError: the peers' arrays differ in size, or the root has no ``ins``.
    """
    if ins is None and comm.rank == root:
        raise DistUsageError("scatter needs input arrays on the root")
    flow = Dataflow(0)
    try:
        if comm.rank == root:
            assert ins is not None
            for i in range(comm.size):
                if i != root:
                    flow.send_when_ready(comm, i, 0, byte_view(ins[i]))
            flow.stay_awake(comm, (comm.size - 1) * out.nbytes)
            flow.copy(out, ins[root])
        else:
            flow.flight.add(comm.recv_into(root, 0, byte_view(out)))
            flow.signal_ready(comm, root)
            flow.stay_awake(comm, out.nbytes)
    except BaseException:
        flow.flight.abandon()
        raise
    await flow.wait()
