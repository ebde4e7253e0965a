"""Collectives for a group whose ranks all live on one host, straight through shared memory.

The algorithms here run in a :class:`~aiodist.collectives.shm_workspace.NodeWorkspace` (its
module describes the segment, the rounds and barriers, the turn-taking and how failures
spread); they use only its interface internal to aiodist. The workspace's public names are
re-exported here.

``all_reduce`` of a large array, per block of ``block_bytes``: each rank copies the parts
of its block that others reduce into its slot; barrier; rank ``k`` reduces slice ``k`` of
the block, reading every rank's slot (its own array directly), into its slot and its
array; barrier; each rank copies the other slices of the result out. Up to
``SMALL_BYTES`` one round does: every rank copies its array in and, after one barrier,
reduces all slots itself, in rank order, so results are bitwise equal everywhere.

Inputs allocated with :func:`aiodist.collectives._shared_array.empty` for this workspace (from
``DIRECT_MIN_BYTES``) are not copied in: peers map them and read them in place. When every
rank's ``all_reduce`` input is shared, rank ``k`` writes its reduced slice straight into
every rank's array: no copy out either, and two barriers for the whole operation.

Every function takes the workspace first and otherwise the arguments of the matching
function in :mod:`aiodist.collectives` (validated by the caller), and, keyword-only, the
call's ``fingerprint`` and its ``ticket`` (:meth:`NodeWorkspace.reserve`, taken when the
operation was issued; ``None``: the next one when it enters). Operations on a workspace
run one at a time in ticket order, which must be the same on every rank. After its first
barrier each checks that every rank called the same operation (fingerprint and size);
if not, every rank raises the same ``DistUsageError`` and the workspace stays usable.
A peer that closes its workspace or whose process ends fails only what still needs it;
any other failure breaks the workspace (details in :mod:`aiodist.collectives.shm_workspace`).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import numpy as np

from .._arrays._fingerprint import fingerprint as _fingerprint
from .._arrays._reduce import UFUNCS, ReduceOp, finish_into
from ..errors import DistUsageError
from ._common import split
from .shm_workspace import (
    DEFAULT_BLOCK_BYTES,
    REJECTED,
    Array,
    Bytes,
    Call,
    NodeWorkspace,
    Turn,
    WorkspaceStatistics,
)

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "DIRECT_MIN_BYTES",
    "REJECTED",
    "SMALL_BYTES",
    "NodeWorkspace",
    "WorkspaceStatistics",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "barrier_in_turn",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "skip",
    "small_all_reduce_in_turn",
]

#: ``all_reduce`` up to this size takes one round in which every rank reduces everything.
SMALL_BYTES = 16 << 10
#: Inputs in shared arrays smaller than this are copied like private ones.
DIRECT_MIN_BYTES = 64 << 10

_NOTHING: Bytes = np.empty(0, np.uint8)


def _fp(name: str, x: Array | None, fp: bytes | None, *, root: int = -1, op: int = 255) -> bytes:
    if fp is not None:
        return fp
    if x is None:
        return _fingerprint(name, root=root, reduce_op=op)
    return _fingerprint(name, dtype=x.dtype, shape=x.shape, root=root, reduce_op=op)


def _u8(a: Array) -> Bytes:
    return a.reshape(-1).view(np.uint8)


def _fold(op: ReduceOp, dest: Array, srcs: Sequence[Array], n: int) -> None:
    """``dest = srcs[0] op srcs[1] op ...`` in rank order, then the op's final step."""
    ufunc = UFUNCS[op]
    ufunc(srcs[0], srcs[1], out=dest)
    for src in srcs[2:]:
        ufunc(dest, src, out=dest)
    finish_into(op, dest, n)


def _in_place(pieces: Sequence[Array] | None) -> Sequence[Array] | None:
    """``pieces`` for :meth:`NodeWorkspace.begin` to offer peers in place (if they are
    shared arrays), or ``None`` when they are too small for mapping them to pay."""
    if pieces is not None and sum(a.nbytes for a in pieces) >= DIRECT_MIN_BYTES:
        return pieces
    return None


async def _copy(ws: NodeWorkspace, dst: Array, src: Array) -> None:
    """Copy ``src`` into ``dst`` (same byte size), yielding to the loop between pieces."""
    d, s = _u8(dst), _u8(src)
    if d.size == 0 or d.ctypes.data == s.ctypes.data:
        return
    step = ws.block_bytes
    for lo in range(0, d.size, step):
        np.copyto(d[lo : lo + step], s[lo : lo + step])
        await ws.maybe_yield()


# -- all_reduce, reduce ----------------------------------------------------------------------


async def all_reduce(
    ws: NodeWorkspace,
    x: Array,
    op: ReduceOp,
    *,
    fingerprint: bytes | None = None,
    ticket: int | None = None,
) -> None:
    """Reduce ``x`` over every rank and leave the result in ``x`` on each.

    Args:
        ws: the group's workspace.
        x: C-contiguous array, same shape and dtype on every rank; reduced in place.
        op: a reduction that ``x.dtype`` can take.
        fingerprint: the call's fingerprint for the mismatch check (default: computed).

    Raises:
        DistUsageError: the ranks called different operations or sizes (every rank raises
            it; the workspace stays usable), or the workspace is closed.
        DistNetworkError: a rank died, closed or aborted the workspace.
    """
    if ws.size == 1:
        finish_into(op, x, 1)
        return
    fp = _fp("all_reduce", x, fingerprint, op=op)
    if x.nbytes > SMALL_BYTES:
        async with Turn(ws, ticket):
            await _reduce_blocks(ws, x, op, fp, None)
        return
    if not ws.enter_now(ticket):
        await ws.enter(ticket)
    rest = small_all_reduce_in_turn(ws, x, op, fp)
    if rest is not None:
        await rest


def small_all_reduce_in_turn(
    ws: NodeWorkspace, x: Array, op: ReduceOp, fp: bytes
) -> Coroutine[Any, Any, None] | None:
    """Run the all_reduce of a small ``x`` (at most :data:`SMALL_BYTES`, fingerprint ``fp``)
    in the turn this rank holds now, as far as it can without waiting: return ``None`` when
    it ended here, else the coroutine that ends it once the peers have arrived (the turn is
    held until then). Raises as :func:`all_reduce`.

    Kept lean, it is latency only (``bench/per_call.py`` has the breakdown), and callable
    outside a coroutine: the group runs a small operation at once when it can
    (:attr:`aiodist.group.ProcessGroup.inline_ops`).
    """
    try:
        p, _ = ws.begin(fp, x.nbytes)
        slots = ws.typed_slots(p, x.dtype, x.shape) if x.size else []
        if slots:
            slots[ws.rank][...] = x
        if not ws.arrive():
            return _rest_of_small_all_reduce(ws, x, op, p, slots)
        _fold_slots(ws, x, op, p, slots)
    except BaseException as exc:
        ws.leave(exc)
        raise
    ws.leave(None)
    return None


async def _rest_of_small_all_reduce(
    ws: NodeWorkspace, x: Array, op: ReduceOp, p: int, slots: list[Array]
) -> None:
    try:
        await ws.all_arrived()
        _fold_slots(ws, x, op, p, slots)
    except BaseException as exc:
        ws.leave(exc)
        raise
    ws.leave(None)


def _fold_slots(ws: NodeWorkspace, x: Array, op: ReduceOp, p: int, slots: list[Array]) -> None:
    # Every rank folds every slot in rank order: bitwise the same result everywhere.
    ws.same_calls(p)
    if slots:
        ufunc = UFUNCS[op]
        ufunc(slots[0], slots[1], out=x)
        for src in slots[2:]:
            ufunc(x, src, out=x)
        if op is ReduceOp.AVG:
            finish_into(op, x, ws.size)


async def reduce(
    ws: NodeWorkspace,
    x: Array,
    root: int,
    op: ReduceOp,
    *,
    fingerprint: bytes | None = None,
    ticket: int | None = None,
) -> None:
    """Reduce ``x`` over every rank into ``x`` of rank ``root``; the others' ``x`` unchanged.

    Raises:
        DistUsageError: the ranks called different operations, or the workspace is closed.
        DistNetworkError: a rank died, closed or aborted the workspace.
    """
    if ws.size == 1:
        finish_into(op, x, 1)
        return
    fp = _fp("reduce", x, fingerprint, root=root, op=op)
    async with Turn(ws, ticket):
        await _reduce_blocks(ws, x, op, fp, root)


async def _reduce_blocks(
    ws: NodeWorkspace, x: Array, op: ReduceOp, fp: bytes, root: int | None
) -> None:
    """all_reduce (``root`` None) or reduce, block by block through the slots."""
    n, k = ws.size, ws.rank
    flat = x.reshape(-1)
    dt = x.dtype
    total = flat.size
    per = max(1, ws.block_bytes // dt.itemsize)
    outputs = root is None or root == k
    p, mine_shared = ws.begin(fp, x.nbytes, _in_place([x]))
    lo = 0
    first = True
    while first or lo < total:
        if not first:
            p = ws.next_round()
        hi = min(total, lo + per)
        slices = split(hi - lo, n)
        slots = ws.typed_slots(p, dt, per)
        if not mine_shared:
            for j, (a, z) in enumerate(slices):
                if j != k and z > a:
                    np.copyto(slots[k][a:z], flat[lo + a : lo + z])
        await ws.sync()
        if first:
            first = False
            info = ws.check(p)
            if all(info.shared):
                await _reduce_direct(ws, info, x, op, root, slots[k])
                return
            sources = [
                ws.peer_piece(info, j, 0, x.nbytes).view(dt) if info.shared[j] and j != k else None
                for j in range(n)
            ]
        a, z = slices[k]
        if z > a:
            srcs = [
                flat[lo + a : lo + z]
                if j == k
                else src[lo + a : lo + z]
                if (src := sources[j]) is not None
                else slots[j][a:z]
                for j in range(n)
            ]
            dest = slots[k][a:z]
            _fold(op, dest, srcs, n)
            if outputs:
                np.copyto(flat[lo + a : lo + z], dest)
        await ws.sync()
        if outputs:
            for j, (a, z) in enumerate(slices):
                if j != k and z > a:
                    np.copyto(flat[lo + a : lo + z], slots[j][a:z])
        lo = hi
        await ws.maybe_yield()


async def _reduce_direct(
    ws: NodeWorkspace, info: Call, x: Array, op: ReduceOp, root: int | None, scratch: Array
) -> None:
    """Every rank's input is shared: rank k reduces its 1/n of the array from all of them
    and writes the result into every rank's array (the root's, for reduce)."""
    n, k = ws.size, ws.rank
    flat = x.reshape(-1)
    dt = x.dtype
    arrays = [flat if j == k else ws.peer_piece(info, j, 0, x.nbytes).view(dt) for j in range(n)]
    targets = arrays if root is None else [arrays[root]]
    a, z = split(flat.size, n)[k]
    per = scratch.size
    for lo in range(a, z, per):
        hi = min(z, lo + per)
        dest = scratch[: hi - lo]
        _fold(op, dest, [arr[lo:hi] for arr in arrays], n)
        for target in targets:
            np.copyto(target[lo:hi], dest)
        await ws.maybe_yield()
    await ws.sync()  # every slice is in every array; nobody reads ours any more


# -- one source per rank, many readers: broadcast, all_gather, gather -------------------------


async def broadcast(
    ws: NodeWorkspace,
    x: Array,
    root: int,
    *,
    fingerprint: bytes | None = None,
    ticket: int | None = None,
) -> None:
    """Copy ``x`` of rank ``root`` into ``x`` of every other rank.

    Raises:
        DistUsageError: the ranks called different operations, or the workspace is closed.
        DistNetworkError: a rank died, closed or aborted the workspace.
    """
    if ws.size == 1:
        return
    fp = _fp("broadcast", x, fingerprint, root=root)
    async with Turn(ws, ticket):
        await _spread(ws, fp, x, writers=(root,), outs=lambda j: x, reads=ws.rank != root)


async def all_gather(
    ws: NodeWorkspace,
    outs: Sequence[Array],
    x: Array,
    *,
    fingerprint: bytes | None = None,
    ticket: int | None = None,
) -> None:
    """Gather every rank's ``x`` into ``outs`` on every rank: ``outs[i]`` gets rank i's ``x``.

    Raises:
        DistUsageError: the ranks called different operations, or the workspace is closed.
        DistNetworkError: a rank died, closed or aborted the workspace.
    """
    if ws.size == 1:
        await _copy(ws, outs[0], x)
        return
    fp = _fp("all_gather", x, fingerprint)
    async with Turn(ws, ticket):
        await _spread(ws, fp, x, writers=range(ws.size), outs=outs.__getitem__, reads=True)


async def all_gather_into_tensor(
    ws: NodeWorkspace,
    out: Array,
    x: Array,
    *,
    fingerprint: bytes | None = None,
    ticket: int | None = None,
) -> None:
    """:func:`all_gather` into one array of ``size`` rows (``out.size == size * x.size``).

    Raises:
        DistUsageError: the ranks called different operations, or the workspace is closed.
        DistNetworkError: a rank died, closed or aborted the workspace.
    """
    # The fingerprint table knows this operation by its torch 2.13 name only.
    fp = _fp("all_gather_single", x, fingerprint)
    await all_gather(
        ws, list(out.reshape(ws.size, x.size)), x.reshape(-1), fingerprint=fp, ticket=ticket
    )


async def gather(
    ws: NodeWorkspace,
    outs: Sequence[Array] | None,
    x: Array,
    root: int,
    *,
    fingerprint: bytes | None = None,
    ticket: int | None = None,
) -> None:
    """Gather every rank's ``x`` on ``root``: there ``outs[i]`` gets rank i's ``x``
    (``outs`` is ``None`` on the other ranks).

    Raises:
        DistUsageError: the ranks called different operations, or the workspace is closed.
        DistNetworkError: a rank died, closed or aborted the workspace.
    """
    if ws.size == 1:
        assert outs is not None
        await _copy(ws, outs[0], x)
        return
    fp = _fp("gather", x, fingerprint, root=root)
    got = outs if outs is not None else ()
    async with Turn(ws, ticket):
        await _spread(
            ws, fp, x, writers=range(ws.size), outs=got.__getitem__, reads=ws.rank == root
        )


async def _spread(
    ws: NodeWorkspace,
    fp: bytes,
    x: Array,
    *,
    writers: Sequence[int],
    outs: Callable[[int], Array],
    reads: bool,
) -> None:
    """The ``writers``' ``x`` reach ``outs(j)`` (rank ``j``'s) on every rank that
    ``reads``: block by block through the slots, or read in place from shared arrays."""
    k = ws.rank
    src = _u8(x)
    nbytes = src.size
    writes = k in writers
    p, mine_shared = ws.begin(fp, nbytes, _in_place([x] if writes else None))
    per = ws.block_bytes
    lo = 0
    first = True
    any_shared = False
    while first or lo < nbytes:
        if not first:
            p = ws.next_round()
        hi = min(nbytes, lo + per)
        if writes and not mine_shared and hi > lo:
            np.copyto(ws.slots[k][p][: hi - lo], src[lo:hi])
        await ws.sync()
        if first:
            first = False
            info = ws.check(p)
            any_shared = any(info.shared[j] for j in writers)
            if all(info.shared[j] for j in writers):
                # Everything is read in place: no more rounds, one barrier at the end.
                if reads:
                    for j in writers:
                        whole = src if j == k else ws.peer_piece(info, j, 0, nbytes)
                        await _copy(ws, outs(j), whole)
                await ws.sync()
                return
            sources = [
                ws.peer_piece(info, j, 0, nbytes) if info.shared[j] and j != k else None
                for j in range(ws.size)
            ]
        if reads and hi > lo:
            for j in writers:
                out = _u8(outs(j))
                if j == k:
                    if out.ctypes.data != src.ctypes.data:
                        np.copyto(out[lo:hi], src[lo:hi])
                elif (shared := sources[j]) is not None:
                    np.copyto(out[lo:hi], shared[lo:hi])
                else:
                    np.copyto(out[lo:hi], ws.slots[j][p][: hi - lo])
        lo = hi
        await ws.maybe_yield()
    if any_shared:
        await ws.sync()  # peers read shared inputs in place until here


# -- one piece per pair of ranks: scatter, reduce_scatter, all_to_all -------------------------


class _Source:
    """``src(s, lo, hi)``: bytes ``[lo, hi)`` of sender ``s``'s piece for this rank, from
    its slot buffer of this round or in place."""

    __slots__ = ("c", "info", "p", "sizes", "ws")

    def __init__(
        self, ws: NodeWorkspace, info: Call, c: int, p: int, sizes: Callable[[int, int], int]
    ) -> None:
        self.ws = ws
        self.info = info
        self.c = c
        self.p = p
        self.sizes = sizes

    def __call__(self, s: int, lo: int, hi: int) -> Bytes:
        ws = self.ws
        k = ws.rank
        size = self.sizes(s, k)
        hi = min(hi, size)
        if hi <= lo:
            return _NOTHING
        if self.info.shared[s]:
            return ws.peer_piece(self.info, s, k, size)[lo:hi]
        return ws.slots[s][self.p][k * self.c :][: hi - lo]


async def _pieces(
    ws: NodeWorkspace,
    fp: bytes,
    nbytes: int,
    mine: Sequence[Bytes] | None,
    senders: Sequence[int],
    sizes: Callable[[Call], Callable[[int, int], int]],
    receive: Callable[[int, int, _Source], None],
    table: Sequence[tuple[int, int]] | None = None,
) -> None:
    """Every sender's piece for rank ``j`` reaches rank ``j``.

    ``mine[j]`` holds this rank's piece for rank ``j`` (``None`` unless it sends);
    ``sizes(call)(s, j)`` is the bytes rank ``s`` sends to ``j``; ``receive(lo, hi, src)``
    consumes bytes ``[lo, hi)`` of every piece for this rank. A round moves
    ``block_bytes / size`` bytes of every piece through the slots; pieces in shared arrays
    are read in place.
    """
    n, k = ws.size, ws.rank
    c = ws.block_bytes // n // 64 * 64
    p, mine_shared = ws.begin(fp, nbytes, _in_place(mine), table)
    lo = 0
    total = 0
    first = True
    any_shared = False
    while first or lo < total:
        if not first:
            p = ws.next_round()
        if mine is not None and not mine_shared:
            slot = ws.slots[k][p]
            for j in range(n):
                part = mine[j][lo : lo + c]
                if j != k and part.size:
                    np.copyto(slot[j * c : j * c + part.size], part)
        await ws.sync()
        if first:
            first = False
            info = ws.check(p, sizes=table is not None)
            size_of = sizes(info)
            if table is not None:
                _check_sizes(ws, info)
            any_shared = any(info.shared[s] for s in senders)
            total = max(size_of(s, j) for s in senders for j in range(n))
            if all(info.shared[s] for s in senders):
                # Everything is read in place: no rounds, one barrier at the end.
                src = _Source(ws, info, c, p, size_of)
                for start in range(0, total, ws.block_bytes):
                    receive(start, start + ws.block_bytes, src)
                    await ws.maybe_yield()
                await ws.sync()
                return
        receive(lo, lo + c, _Source(ws, info, c, p, size_of))
        lo += c
        await ws.maybe_yield()
    if any_shared:
        await ws.sync()  # peers read shared inputs in place until here


def _check_sizes(ws: NodeWorkspace, info: Call) -> None:
    n = ws.size
    for s in range(n):
        for j in range(n):
            sent = info.sizes[s][j][0]
            expected = info.sizes[j][s][1]
            if sent != expected:
                ws.fail_consistently(
                    DistUsageError(
                        f"all_to_all: rank {ws.names[s]} sends {sent} bytes to rank "
                        f"{ws.names[j]}, which expects {expected} bytes from it"
                    )
                )


async def scatter(
    ws: NodeWorkspace,
    out: Array,
    ins: Sequence[Array] | None,
    root: int,
    *,
    fingerprint: bytes | None = None,
    ticket: int | None = None,
) -> None:
    """Hand block ``i`` of the root's ``ins`` to rank ``i``, into its ``out`` (``ins`` is
    ``None`` on the other ranks).

    Raises:
        DistUsageError: the ranks called different operations, or the workspace is closed.
        DistNetworkError: a rank died, closed or aborted the workspace.
    """
    if ws.size == 1:
        assert ins is not None
        await _copy(ws, out, ins[0])
        return
    fp = _fp("scatter", out, fingerprint, root=root)
    k = ws.rank
    dst = _u8(out)
    mine = [_u8(a) for a in ins] if ins is not None and k == root else None
    size = out.nbytes

    def receive(lo: int, hi: int, src: _Source) -> None:
        piece = mine[k][lo:hi] if mine is not None else src(root, lo, hi)
        dst[lo : lo + piece.size] = piece

    async with Turn(ws, ticket):
        await _pieces(ws, fp, size, mine, (root,), lambda info: lambda s, j: size, receive)


async def reduce_scatter(
    ws: NodeWorkspace,
    out: Array,
    ins: Sequence[Array],
    op: ReduceOp,
    *,
    fingerprint: bytes | None = None,
    ticket: int | None = None,
) -> None:
    """Reduce block ``i`` of every rank's ``ins`` into ``out`` of rank ``i``.

    ``out`` must not overlap ``ins`` (peers may read ``ins`` while ``out`` is written).

    Raises:
        DistUsageError: the ranks called different operations, or the workspace is closed.
        DistNetworkError: a rank died, closed or aborted the workspace.
    """
    if ws.size == 1:
        await _copy(ws, out, ins[0])
        finish_into(op, out.reshape(-1), 1)
        return
    fp = _fp("reduce_scatter", out, fingerprint, op=op)
    n, k = ws.size, ws.rank
    dt = out.dtype
    mine = [_u8(a) for a in ins]
    dst = _u8(out)
    size = dst.size

    def receive(lo: int, hi: int, src: _Source) -> None:
        hi = min(hi, size)
        if hi > lo:
            srcs = [(mine[k][lo:hi] if s == k else src(s, lo, hi)).view(dt) for s in range(n)]
            _fold(op, dst[lo:hi].view(dt), srcs, n)

    async with Turn(ws, ticket):
        await _pieces(ws, fp, size, mine, range(n), lambda info: lambda s, j: size, receive)


async def reduce_scatter_tensor(
    ws: NodeWorkspace,
    out: Array,
    x: Array,
    op: ReduceOp,
    *,
    fingerprint: bytes | None = None,
    ticket: int | None = None,
) -> None:
    """:func:`reduce_scatter` of one array of ``size`` rows (``x.size == size * out.size``).

    Raises:
        DistUsageError: the ranks called different operations, or the workspace is closed.
        DistNetworkError: a rank died, closed or aborted the workspace.
    """
    # The fingerprint table knows this operation by its torch 2.13 name only.
    fp = _fp("reduce_scatter_single", out, fingerprint, op=op)
    rows = list(x.reshape(ws.size, out.size))
    await reduce_scatter(ws, out.reshape(-1), rows, op, fingerprint=fp, ticket=ticket)


async def all_to_all(
    ws: NodeWorkspace,
    outs: Sequence[Array],
    ins: Sequence[Array],
    *,
    fingerprint: bytes | None = None,
    ticket: int | None = None,
) -> None:
    """Send ``ins[j]`` to rank ``j``; ``outs[j]`` receives rank ``j``'s block for this rank.

    Blocks may differ in size (zero included); ``outs[j]`` must have the size rank ``j``
    sends, else every rank raises the same ``DistUsageError`` naming the pair.

    Raises:
        DistUsageError: the ranks called different operations, a block's size differs
            from the size its receiver expects, or the workspace is closed.
        DistNetworkError: a rank died, closed or aborted the workspace.
    """
    if ws.size == 1:
        await _copy(ws, outs[0], ins[0])
        return
    # Blocks differ in size between ranks: only the dtype must agree (sizes are checked
    # pair by pair).
    fp = fingerprint or _fingerprint("all_to_all", dtype=ins[0].dtype)
    n, k = ws.size, ws.rank
    mine = [_u8(a) for a in ins]
    dsts = [_u8(a) for a in outs]

    def receive(lo: int, hi: int, src: _Source) -> None:
        for s in range(n):
            piece = mine[k][lo:hi] if s == k else src(s, lo, hi)
            if piece.size:
                dsts[s][lo : lo + piece.size] = piece

    def sizes(info: Call) -> Callable[[int, int], int]:
        return lambda s, j: int(info.sizes[s][j][0])

    table = [(mine[j].size, dsts[j].size) for j in range(n)]
    async with Turn(ws, ticket):
        await _pieces(ws, fp, 0, mine, range(n), sizes, receive, table)


async def all_to_all_single(
    ws: NodeWorkspace,
    out: Array,
    x: Array,
    out_splits: Sequence[int] | None = None,
    in_splits: Sequence[int] | None = None,
    *,
    fingerprint: bytes | None = None,
    ticket: int | None = None,
) -> None:
    """:func:`all_to_all` on slices of ``x`` and ``out`` along dimension 0 (equal slices
    when the split sizes are ``None``; sizes validated by the caller).

    Raises:
        DistUsageError: the ranks called different operations or sizes disagree, or the
            workspace is closed.
        DistNetworkError: a rank died, closed or aborted the workspace.
    """
    fp = fingerprint or _fingerprint("all_to_all_single", dtype=x.dtype)
    n = ws.size
    await all_to_all(
        ws, _rows(out, out_splits, n), _rows(x, in_splits, n), fingerprint=fp, ticket=ticket
    )


def _rows(a: Array, splits: Sequence[int] | None, n: int) -> list[Array]:
    if splits is None:
        splits = [a.shape[0] // n] * n
    offsets = np.cumsum([0, *splits])
    return [a[int(offsets[i]) : int(offsets[i + 1])] for i in range(n)]


async def skip(ws: NodeWorkspace, reason: str, *, ticket: int | None = None) -> None:
    """Take this rank's turn for an operation it rejected (its checks failed).

    The peers' rounds of that operation then raise ``DistUsageError("rejected by rank R:
    <reason>")`` alike, and the workspace stays usable: every rank's sequence of operations
    still counts the rejected one.
    """
    if ws.size == 1:
        return
    async with Turn(ws, ticket):
        p, _ = ws.begin(REJECTED, 0, reason=reason)
        await ws.sync()
        ws.check_calls(p)  # raises nothing here: this rank's own record is the rejection


async def barrier(
    ws: NodeWorkspace, *, fingerprint: bytes | None = None, ticket: int | None = None
) -> None:
    """Return once every rank has entered the barrier.

    Raises:
        DistUsageError: the ranks called different operations, or the workspace is closed.
        DistNetworkError: a rank died, closed or aborted the workspace.
    """
    if ws.size == 1:
        return
    if not ws.enter_now(ticket):
        await ws.enter(ticket)
    rest = barrier_in_turn(ws, _fp("barrier", None, fingerprint))
    if rest is not None:
        await rest


def barrier_in_turn(ws: NodeWorkspace, fp: bytes) -> Coroutine[Any, Any, None] | None:
    """:func:`barrier` in the turn this rank holds now, as
    :func:`small_all_reduce_in_turn`: ``None`` when it ended here, else the coroutine that
    ends it."""
    try:
        p, _ = ws.begin(fp, 0)
        if not ws.arrive():
            return _rest_of_barrier(ws, p)
        ws.same_calls(p)
    except BaseException as exc:
        ws.leave(exc)
        raise
    ws.leave(None)
    return None


async def _rest_of_barrier(ws: NodeWorkspace, p: int) -> None:
    try:
        await ws.all_arrived()
        ws.same_calls(p)
    except BaseException as exc:
        ws.leave(exc)
        raise
    ws.leave(None)
