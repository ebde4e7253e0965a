"""The staged data path: device memory through host buffers, moved by the CPU transport.

Every algorithm here takes the operation's :class:`~aiodist.transport.base.OpComm` and a
:class:`Mover`, the device seen as four asynchronous steps: copy device -> host, copy
host -> device, reduce on the device, and buffers (host staging memory, device scratch).
The bytes between ranks move with the CPU algorithms of :mod:`aiodist.collectives` over
host buffers; reductions happen on the device, never on the host:

* ``all_reduce`` is a reduce-scatter and an all-gather, both as pairwise exchanges of the
  ranks' blocks (``all_to_all``), with the device reducing the block this rank owns between
  them: each rank sends and receives ``2 (n-1)/n`` of the array, as a ring does.
* ``reduce`` gathers the contributions on the root, which reduces them on the device;
  ``reduce_scatter`` exchanges blocks and reduces the one it receives.
* the others stage, move and copy back.

Arrays are processed in chunks of :data:`CHUNK_BYTES` (``reduce``-ing ops: a whole number
of elements), up to :data:`WINDOW` chunks at once, so one chunk's copies overlap another's
transfer. Each chunk's messages travel under steps of their own (:meth:`OpComm.from_step`). Every
rank cuts the same chunks, since the sizes agree across ranks (the fingerprint checks it);
``all_to_all``, whose blocks may differ in size between ranks, moves in one round.

Device buffers are flat ``uint8`` views (cupy arrays on a GPU). :class:`HostMover` is the
same device interface over numpy memory, which is how the CPU suite runs these algorithms
over real transports.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from .. import collectives
from .._arrays._reduce import ReduceOp
from ..transport.base import OpComm
from ._cuda_tables import reduce_many

__all__ = [
    "CHUNK_BYTES",
    "WINDOW",
    "HostMover",
    "Mover",
    "chunks",
    "staged_all_gather",
    "staged_all_reduce",
    "staged_all_to_all",
    "staged_broadcast",
    "staged_gather",
    "staged_recv",
    "staged_reduce",
    "staged_reduce_scatter",
    "staged_scatter",
    "staged_send",
]

logger = logging.getLogger(__name__)

#: Bytes per chunk of a staged operation (per rank's block, for the block collectives).
CHUNK_BYTES = 4 << 20
#: Chunks in flight at once.
WINDOW = 2
# Each chunk's messages use steps from (chunk * _PHASES + phase + 1) << _STEP_BITS on, far
# above the steps one CPU algorithm uses.
_PHASES = 2
_STEP_BITS = 32

Host = npt.NDArray[np.uint8]


class Mover(Protocol):
    """The device as the staged path sees it. Device buffers are flat uint8 arrays."""

    async def host(self, nbytes: int) -> Host:
        """A host staging buffer (pinned memory on a GPU)."""
        ...

    async def scratch(self, nbytes: int) -> Any:
        """A device scratch buffer."""
        ...

    async def to_host(self, pairs: Sequence[tuple[Host, Any]]) -> None:
        """Copy each device buffer into its host buffer; return once all are done."""
        ...

    async def to_device(self, pairs: Sequence[tuple[Any, Host]]) -> None:
        """Copy each host buffer into its device buffer; return once all are done."""
        ...

    async def reduce(
        self, op: ReduceOp, dtype: np.dtype[Any], out: Any, ins: list[Any], factor: float | None
    ) -> None:
        """Reduce ``ins`` (rank order) into ``out`` on the device (see ``reduce_many``)."""
        ...


class HostMover:
    """The :class:`Mover` of host memory: numpy buffers, copies and reductions done at once.

    The staged algorithms run over it unchanged; the CPU suite uses it to test them.
    """

    async def host(self, nbytes: int) -> Host:
        """A fresh host buffer."""
        return np.empty(nbytes, np.uint8)

    async def scratch(self, nbytes: int) -> Host:
        """A fresh scratch buffer (host memory too)."""
        return np.empty(nbytes, np.uint8)

    async def to_host(self, pairs: Sequence[tuple[Host, Host]]) -> None:
        """Copy each source into its destination."""
        for dst, src in pairs:
            np.copyto(dst, src)

    async def to_device(self, pairs: Sequence[tuple[Host, Host]]) -> None:
        """Copy each source into its destination."""
        for dst, src in pairs:
            np.copyto(dst, src)

    async def copy(self, pairs: Sequence[tuple[Host, Host]]) -> None:
        """Copy each source into its destination (the IPC path's device-to-device copy)."""
        for dst, src in pairs:
            np.copyto(dst, src)

    async def reduce(
        self, op: ReduceOp, dtype: np.dtype[Any], out: Host, ins: list[Host], factor: float | None
    ) -> None:
        """Reduce with numpy, exactly as the device does with cupy."""
        reduce_many(np, op, dtype, out, ins, factor=factor)


def _sub(comm: OpComm, chunk: int, phase: int = 0) -> OpComm:
    # One chunk's (or phase's) messages: steps numbered apart from every other chunk's.
    return comm.from_step((chunk * _PHASES + phase + 1) << _STEP_BITS)


def chunks(nbytes: int, itemsize: int = 1, chunk_bytes: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """Byte ranges ``[lo, hi)`` covering ``nbytes``, each a whole number of items."""
    step = max(itemsize, chunk_bytes - chunk_bytes % itemsize)
    return [(lo, min(lo + step, nbytes)) for lo in range(0, nbytes, step)]


async def _pipeline(count: int, run: Callable[[int], Awaitable[None]], window: int) -> None:
    """Run ``run(0) ... run(count - 1)``, up to ``window`` at once, started in order.

    The first failure cancels the chunks still running and is raised.
    """
    if count == 1:
        await run(0)
        return
    running: set[asyncio.Future[None]] = set()
    failure: BaseException | None = None
    try:
        for c in range(count):
            while len(running) >= window and failure is None:
                failure = await _settle_some(running)
            if failure is not None:
                break
            running.add(asyncio.ensure_future(run(c)))
        while running and failure is None:
            failure = await _settle_some(running)
    finally:
        for task in running:
            task.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)
    if failure is not None:
        raise failure


async def _settle_some(running: set[asyncio.Future[None]]) -> BaseException | None:
    done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
    first = None
    for task in done:
        running.discard(task)
        exc = task.exception()
        if exc is not None and first is None:
            first = exc
    return first


def _blocks(lo: int, hi: int, itemsize: int, n: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into ``n`` blocks of whole items (sizes differ by one item at most)."""
    items = (hi - lo) // itemsize
    edges = [lo + (items * j // n) * itemsize for j in range(n + 1)]
    return list(itertools.pairwise(edges))


# -- reductions --------------------------------------------------------------------------------
async def staged_all_reduce(
    comm: OpComm,
    mover: Mover,
    x: Any,
    dtype: np.dtype[Any],
    op: ReduceOp,
    factor: float | None = None,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    window: int = WINDOW,
) -> None:
    """Reduce the device buffer ``x`` (flat uint8, ``dtype`` elements) across ranks in place."""
    n, me = comm.size, comm.rank
    spans = chunks(x.nbytes, dtype.itemsize, chunk_bytes)

    async def chunk(c: int) -> None:
        lo, hi = spans[c]
        staged = await mover.host(hi - lo)
        await mover.to_host([(staged, x[lo:hi])])
        blocks = [(a - lo, b - lo) for a, b in _blocks(lo, hi, dtype.itemsize, n)]
        mine = blocks[me][1] - blocks[me][0]
        received = await mover.host(n * mine)
        rows = [received[i * mine : (i + 1) * mine] for i in range(n)]
        parts = [staged[a:b] for a, b in blocks]
        await collectives.all_to_all(_sub(comm, c, 0), rows, parts)
        device = await mover.scratch(n * mine)
        await mover.to_device([(device, received)])
        device_rows = [device[i * mine : (i + 1) * mine] for i in range(n)]
        await mover.reduce(op, dtype, device_rows[0], device_rows, factor)
        await mover.to_host([(rows[0], device_rows[0])])
        await collectives.all_to_all(_sub(comm, c, 1), parts, [rows[0]] * n)
        await mover.to_device([(x[lo:hi], staged)])

    await _pipeline(len(spans), chunk, window)


async def staged_reduce(
    comm: OpComm,
    mover: Mover,
    x: Any,
    dtype: np.dtype[Any],
    op: ReduceOp,
    root: int,
    factor: float | None = None,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    window: int = WINDOW,
) -> None:
    """Reduce every rank's ``x`` into the root's; the other ranks' ``x`` is only read."""
    n, is_root = comm.size, comm.rank == root
    spans = chunks(x.nbytes, dtype.itemsize, chunk_bytes)

    async def chunk(c: int) -> None:
        lo, hi = spans[c]
        size = hi - lo
        staged = await mover.host(size)
        await mover.to_host([(staged, x[lo:hi])])
        gathered = await mover.host(n * size) if is_root else None
        rows = None if gathered is None else [gathered[i * size : (i + 1) * size] for i in range(n)]
        await collectives.gather(_sub(comm, c), rows, staged, root)
        if gathered is not None:
            device = await mover.scratch(n * size)
            await mover.to_device([(device, gathered)])
            ins = [device[i * size : (i + 1) * size] for i in range(n)]
            await mover.reduce(op, dtype, x[lo:hi], ins, factor)

    await _pipeline(len(spans), chunk, window)


async def staged_reduce_scatter(
    comm: OpComm,
    mover: Mover,
    out: Any,
    ins: Sequence[Any],
    dtype: np.dtype[Any],
    op: ReduceOp,
    factor: float | None = None,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    window: int = WINDOW,
) -> None:
    """Reduce ``ins[i]`` across ranks into rank ``i``'s ``out`` (all the same size)."""
    n = comm.size
    spans = chunks(out.nbytes, dtype.itemsize, chunk_bytes)

    async def chunk(c: int) -> None:
        lo, hi = spans[c]
        size = hi - lo
        staged = await mover.host(n * size)
        parts = [staged[j * size : (j + 1) * size] for j in range(n)]
        await mover.to_host([(parts[j], ins[j][lo:hi]) for j in range(n)])
        received = await mover.host(n * size)
        rows = [received[i * size : (i + 1) * size] for i in range(n)]
        await collectives.all_to_all(_sub(comm, c), rows, parts)
        device = await mover.scratch(n * size)
        await mover.to_device([(device, received)])
        contributions = [device[i * size : (i + 1) * size] for i in range(n)]
        await mover.reduce(op, dtype, out[lo:hi], contributions, factor)

    await _pipeline(len(spans), chunk, window)


# -- data movement -------------------------------------------------------------------------------
async def staged_broadcast(
    comm: OpComm,
    mover: Mover,
    x: Any,
    root: int,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    window: int = WINDOW,
) -> None:
    """Copy the root's ``x`` into every rank's."""
    is_root = comm.rank == root
    spans = chunks(x.nbytes, 1, chunk_bytes)

    async def chunk(c: int) -> None:
        lo, hi = spans[c]
        staged = await mover.host(hi - lo)
        if is_root:
            await mover.to_host([(staged, x[lo:hi])])
        await collectives.broadcast(_sub(comm, c), staged, root)
        if not is_root:
            await mover.to_device([(x[lo:hi], staged)])

    await _pipeline(len(spans), chunk, window)


async def staged_all_gather(
    comm: OpComm,
    mover: Mover,
    outs: Sequence[Any],
    x: Any,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    window: int = WINDOW,
) -> None:
    """Copy every rank's ``x`` into ``outs[rank]`` on every rank."""
    n = comm.size
    spans = chunks(x.nbytes, 1, chunk_bytes)

    async def chunk(c: int) -> None:
        lo, hi = spans[c]
        size = hi - lo
        staged = await mover.host(size)
        await mover.to_host([(staged, x[lo:hi])])
        gathered = await mover.host(n * size)
        rows = [gathered[i * size : (i + 1) * size] for i in range(n)]
        await collectives.all_gather(_sub(comm, c), rows, staged)
        await mover.to_device([(outs[i][lo:hi], rows[i]) for i in range(n)])

    await _pipeline(len(spans), chunk, window)


async def staged_gather(
    comm: OpComm,
    mover: Mover,
    outs: Sequence[Any] | None,
    x: Any,
    root: int,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    window: int = WINDOW,
) -> None:
    """Copy every rank's ``x`` into the root's ``outs[rank]`` (``outs`` only on the root)."""
    n = comm.size
    spans = chunks(x.nbytes, 1, chunk_bytes)

    async def chunk(c: int) -> None:
        lo, hi = spans[c]
        size = hi - lo
        staged = await mover.host(size)
        await mover.to_host([(staged, x[lo:hi])])
        gathered = await mover.host(n * size) if outs is not None else None
        rows = None if gathered is None else [gathered[i * size : (i + 1) * size] for i in range(n)]
        await collectives.gather(_sub(comm, c), rows, staged, root)
        if outs is not None and rows is not None:
            await mover.to_device([(outs[i][lo:hi], rows[i]) for i in range(n)])

    await _pipeline(len(spans), chunk, window)


async def staged_scatter(
    comm: OpComm,
    mover: Mover,
    out: Any,
    ins: Sequence[Any] | None,
    root: int,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    window: int = WINDOW,
) -> None:
    """Copy the root's ``ins[rank]`` into every rank's ``out`` (``ins`` only on the root)."""
    n = comm.size
    spans = chunks(out.nbytes, 1, chunk_bytes)

    async def chunk(c: int) -> None:
        lo, hi = spans[c]
        size = hi - lo
        rows = None
        if ins is not None:
            staged = await mover.host(n * size)
            rows = [staged[i * size : (i + 1) * size] for i in range(n)]
            await mover.to_host([(rows[i], ins[i][lo:hi]) for i in range(n)])
        mine = await mover.host(size)
        await collectives.scatter(_sub(comm, c), mine, rows, root)
        await mover.to_device([(out[lo:hi], mine)])

    await _pipeline(len(spans), chunk, window)


def _cut(buffer: Host, sizes: Sequence[int]) -> list[Host]:
    offsets = np.cumsum([0, *sizes]).tolist()
    return [buffer[offsets[i] : offsets[i + 1]] for i in range(len(sizes))]


async def staged_all_to_all(
    comm: OpComm, mover: Mover, outs: Sequence[Any], ins: Sequence[Any]
) -> None:
    """Send ``ins[i]`` to rank ``i`` and receive rank ``j``'s block into ``outs[j]``.

    One round: the blocks may differ in size between ranks, so chunk counts would too.
    """
    in_sizes = [a.nbytes for a in ins]
    out_sizes = [a.nbytes for a in outs]
    staged_in = _cut(await mover.host(sum(in_sizes)), in_sizes)
    staged_out = _cut(await mover.host(sum(out_sizes)), out_sizes)
    await mover.to_host(list(zip(staged_in, ins, strict=True)))
    await collectives.all_to_all(comm, staged_out, staged_in)
    await mover.to_device(list(zip(outs, staged_out, strict=True)))


async def staged_send(comm: OpComm, mover: Mover, peer: int, x: Any) -> None:
    """Send the device buffer ``x`` to group rank ``peer``."""
    staged = await mover.host(x.nbytes)
    await mover.to_host([(staged, x)])
    await comm.send(peer, 0, staged.data)


async def staged_recv(comm: OpComm, mover: Mover, peer: int | None, out: Any) -> int:
    """Receive into the device buffer ``out`` from ``peer`` (``None``: any); return the sender."""
    staged = await mover.host(out.nbytes)
    sender = await comm.recv_into(peer, 0, staged.data)
    await mover.to_device([(out, staged)])
    return sender
