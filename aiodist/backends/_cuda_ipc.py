"""The IPC data path: every rank reads the others' exchange buffers directly on the device.

Each rank of a group owns one *slab*, a device buffer of fixed size exported with CUDA IPC
and mapped by every other rank of the host (several ranks on one GPU included), so
``slabs[r]`` is rank ``r``'s slab seen from here. An operation goes through the slabs in
rounds of at most a slab's size; each round is:

1. every rank copies (its part of) its input into its own slab;
2. a barrier over the CPU transport says every slab holds its round;
3. the device reads the peers' slabs: copies them out, or reduces them (``all_reduce``:
   rank ``r`` reduces block ``r`` of all slabs into block ``r`` of its own slab, then after
   a second barrier every rank copies every reduced block into its output);
4. a last barrier says every rank is done reading, so the slabs may take the next round.

Each step's device work is complete before the barrier after it (the mover returns when
the device has finished), so a barrier orders memory across processes. Operations of one
group share the slabs and run one at a time, in sequence order (the caller holds the
group's lock). Every block of a reduction is reduced by one rank and copied to all, so
every rank ends with the same bits.

Written against a mover with ``copy`` and ``reduce`` (see
:class:`~aiodist.backends._cuda_staged.Mover`), so the CPU suite runs the same rounds with
host buffers as slabs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from .. import collectives
from .._arrays._reduce import ReduceOp
from ..transport.base import OpComm
from ._cuda_staged import chunks

__all__ = [
    "SlabMover",
    "ipc_all_gather",
    "ipc_all_reduce",
    "ipc_broadcast",
    "ipc_gather",
    "ipc_reduce",
    "ipc_reduce_scatter",
    "ipc_scatter",
]

logger = logging.getLogger(__name__)

# Steps of round k's barriers: (k * _BARRIERS + i + 1) << 32.
_BARRIERS = 3


class SlabMover(Protocol):
    """The device steps the IPC path needs."""

    async def copy(self, pairs: Sequence[tuple[Any, Any]]) -> None:
        """Copy each source into its destination (device memory); return once done."""
        ...

    async def reduce(
        self, op: ReduceOp, dtype: np.dtype[Any], out: Any, ins: list[Any], factor: float | None
    ) -> None:
        """Reduce ``ins`` into ``out`` (``out`` may be ``ins[0]``); return once done."""
        ...


async def _barrier(comm: OpComm, round_: int, i: int) -> None:
    await collectives.barrier(comm.from_step((round_ * _BARRIERS + i + 1) << 32))


def _blocks(size: int, itemsize: int, n: int) -> list[tuple[int, int]]:
    items = size // itemsize
    return [(items * j // n * itemsize, items * (j + 1) // n * itemsize) for j in range(n)]


def _part(slab: int, n: int) -> int:
    """Bytes of each rank's region of a slab, 256-aligned so every typed view is aligned."""
    return slab // n // 256 * 256


def _rotated(items: list[Any], first: int) -> list[Any]:
    """``items`` starting at index ``first`` (the reducing rank's own contribution first)."""
    return items[first:] + items[:first]


async def ipc_all_reduce(
    comm: OpComm,
    mover: SlabMover,
    slabs: Sequence[Any],
    x: Any,
    dtype: np.dtype[Any],
    op: ReduceOp,
    factor: float | None = None,
) -> None:
    """Reduce the device buffer ``x`` (flat uint8) across the ranks, in place."""
    n, me = comm.size, comm.rank
    for k, (lo, hi) in enumerate(chunks(x.nbytes, dtype.itemsize, slabs[me].nbytes)):
        size = hi - lo
        await mover.copy([(slabs[me][:size], x[lo:hi])])
        await _barrier(comm, k, 0)
        blocks = _blocks(size, dtype.itemsize, n)
        a, b = blocks[me]
        ins = _rotated([slab[a:b] for slab in slabs], me)
        await mover.reduce(op, dtype, ins[0], ins, factor)
        await _barrier(comm, k, 1)
        await mover.copy([(x[lo + a : lo + b], slabs[r][a:b]) for r, (a, b) in enumerate(blocks)])
        await _barrier(comm, k, 2)


async def ipc_reduce(
    comm: OpComm,
    mover: SlabMover,
    slabs: Sequence[Any],
    x: Any,
    dtype: np.dtype[Any],
    op: ReduceOp,
    root: int,
    factor: float | None = None,
) -> None:
    """Reduce every rank's ``x`` into the root's; the others' ``x`` is only read."""
    me = comm.rank
    for k, (lo, hi) in enumerate(chunks(x.nbytes, dtype.itemsize, slabs[me].nbytes)):
        size = hi - lo
        await mover.copy([(slabs[me][:size], x[lo:hi])])
        await _barrier(comm, k, 0)
        if me == root:
            await mover.reduce(op, dtype, x[lo:hi], [s[:size] for s in slabs], factor)
        await _barrier(comm, k, 2)


async def ipc_reduce_scatter(
    comm: OpComm,
    mover: SlabMover,
    slabs: Sequence[Any],
    out: Any,
    ins: Sequence[Any],
    dtype: np.dtype[Any],
    op: ReduceOp,
    factor: float | None = None,
) -> None:
    """Reduce ``ins[i]`` across the ranks into rank ``i``'s ``out``."""
    n, me = comm.size, comm.rank
    part = _part(slabs[me].nbytes, n)
    for k, (lo, hi) in enumerate(chunks(out.nbytes, dtype.itemsize, part)):
        size = hi - lo
        await mover.copy([(slabs[me][j * part : j * part + size], ins[j][lo:hi]) for j in range(n)])
        await _barrier(comm, k, 0)
        mine = [slab[me * part : me * part + size] for slab in slabs]
        await mover.reduce(op, dtype, out[lo:hi], mine, factor)
        await _barrier(comm, k, 2)


async def ipc_broadcast(
    comm: OpComm, mover: SlabMover, slabs: Sequence[Any], x: Any, root: int
) -> None:
    """Copy the root's ``x`` into every rank's."""
    me = comm.rank
    for k, (lo, hi) in enumerate(chunks(x.nbytes, 1, slabs[me].nbytes)):
        if me == root:
            await mover.copy([(slabs[me][: hi - lo], x[lo:hi])])
        await _barrier(comm, k, 0)
        if me != root:
            await mover.copy([(x[lo:hi], slabs[root][: hi - lo])])
        await _barrier(comm, k, 2)


async def ipc_all_gather(
    comm: OpComm, mover: SlabMover, slabs: Sequence[Any], outs: Sequence[Any], x: Any
) -> None:
    """Copy every rank's ``x`` into ``outs[rank]`` on every rank."""
    me = comm.rank
    for k, (lo, hi) in enumerate(chunks(x.nbytes, 1, slabs[me].nbytes)):
        size = hi - lo
        await mover.copy([(slabs[me][:size], x[lo:hi])])
        await _barrier(comm, k, 0)
        await mover.copy([(o[lo:hi], slab[:size]) for o, slab in zip(outs, slabs, strict=True)])
        await _barrier(comm, k, 2)


async def ipc_gather(
    comm: OpComm,
    mover: SlabMover,
    slabs: Sequence[Any],
    outs: Sequence[Any] | None,
    x: Any,
    root: int,
) -> None:
    """Copy every rank's ``x`` into the root's ``outs[rank]`` (``outs`` only on the root)."""
    me = comm.rank
    for k, (lo, hi) in enumerate(chunks(x.nbytes, 1, slabs[me].nbytes)):
        size = hi - lo
        await mover.copy([(slabs[me][:size], x[lo:hi])])
        await _barrier(comm, k, 0)
        if outs is not None:
            await mover.copy([(o[lo:hi], s[:size]) for o, s in zip(outs, slabs, strict=True)])
        await _barrier(comm, k, 2)


async def ipc_scatter(
    comm: OpComm,
    mover: SlabMover,
    slabs: Sequence[Any],
    out: Any,
    ins: Sequence[Any] | None,
    root: int,
) -> None:
    """Copy the root's ``ins[rank]`` into every rank's ``out`` (``ins`` only on the root)."""
    n, me = comm.size, comm.rank
    part = _part(slabs[me].nbytes, n)
    for k, (lo, hi) in enumerate(chunks(out.nbytes, 1, part)):
        size = hi - lo
        if ins is not None:
            await mover.copy(
                [(slabs[me][r * part : r * part + size], ins[r][lo:hi]) for r in range(n)]
            )
        await _barrier(comm, k, 0)
        await mover.copy([(out[lo:hi], slabs[root][me * part : me * part + size])])
        await _barrier(comm, k, 2)
