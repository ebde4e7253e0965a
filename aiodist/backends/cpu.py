"""The CPU backend: numpy arrays (and CPU DLPack tensors) over the group's transport.

Each validate function here checks its arguments the way only this rank can (dtypes,
shapes, list lengths, writability; see :func:`aiodist._arrays.as_array`), turns them into
the C-contiguous numpy arrays the algorithms of :mod:`aiodist.collectives` take, and returns
the :class:`~aiodist.group.Plan` that runs one of them. A failed check raises
:class:`~aiodist.errors.DistUsageError`; the group layer then rejects the operation (see
:mod:`aiodist.group`), so no peer waits for this rank and the group stays usable.
Point-to-point validate functions get the peer as a group rank, already checked.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import _shared_array, collectives
from .._arrays import as_array, byte_view
from .._fingerprint import fingerprint
from .._ops import PremulSum, ReduceOp, check_reduce_op
from .._timeouts import Timeout, to_seconds
from ..collectives import shm
from ..errors import DistError, DistProtocolError, DistTimeoutError, DistUsageError
from ..group import Plan, ProcessGroup
from ..store import PrefixStore
from ..transport._shm_segment import SharedMemoryError
from ..transport.base import OpComm
from ..transport.shm import default_job_key
from . import Backend

__all__ = ["BACKEND", "MAX_OBJECT_SIZE"]

logger = logging.getLogger(__name__)

Array = npt.NDArray[Any]


async def _setup(group: ProcessGroup) -> None:
    # A group whose ranks all share memory, served by this backend alone, runs its
    # collectives in a shared-memory workspace: the direct algorithms of collectives.shm.
    # (With a second backend a rank whose call was rejected could not tell whether its
    # peers took a turn in the workspace.)
    local = group.world.transport.local_ranks
    if group.size > 1 and len(group.backends) == 1 and set(group.ranks) <= set(local):
        workspace = _Workspace(group, len(local))
        await workspace.get()
        group.sequencer = workspace


#: The CPU backend's table.
BACKEND = Backend("cpu", "cpu", setup=_setup)

# The transport algorithm each direct shared-memory algorithm stands in for.
_DIRECT = {
    collectives.all_reduce: shm.all_reduce,
    collectives.broadcast: shm.broadcast,
    collectives.reduce: shm.reduce,
    collectives.all_gather: shm.all_gather,
    collectives.gather: shm.gather,
    collectives.scatter: shm.scatter,
    collectives.reduce_scatter: shm.reduce_scatter,
    collectives.all_to_all: shm.all_to_all,
    collectives.barrier: shm.barrier,
}
_DIRECT_OPS = frozenset(
    {
        "all_reduce",
        "broadcast",
        "reduce",
        "all_gather",
        "all_gather_into_tensor",
        "gather",
        "scatter",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_to_all",
        "all_to_all_single",
        "barrier",
    }
)


_Turn = tuple["asyncio.Future[None] | None", "asyncio.Future[None]"]


class _Workspace:
    """A group's shared-memory workspace, created when the group is set up (a :class:`Sequencer`).

    Turns are reserved when operations are issued (in issue order, the same on every rank),
    and each enters the workspace only after the one before it did: the order in which
    their tasks happen to wake up does not matter.
    """

    def __init__(self, group: ProcessGroup, local_world_size: int) -> None:
        self._group = group
        self._local_world_size = local_world_size
        self._ready: asyncio.Future[shm.NodeWorkspace] | None = None
        self._last: asyncio.Future[None] | None = None

    def reserve(self) -> _Turn:
        """Reserve the next turn: ``(the previous turn's entry, this turn's entry)``."""
        previous, self._last = self._last, asyncio.get_running_loop().create_future()
        return previous, self._last

    async def enter(self, turn: _Turn) -> shm.NodeWorkspace:
        """Wait for the previous turn to have entered; return the workspace.

        The caller must enter the workspace (call an algorithm of ``collectives.shm``) right
        after this returns, before it awaits anything else.
        """
        previous, mine = turn
        try:
            if previous is not None:
                await previous
            return await self.get()
        finally:
            # The next turn may line up now: this one is next in the workspace's order.
            mine.set_result(None)

    def __repr__(self) -> str:
        return f"<shared-memory workspace of {self._group!r}>"

    def covers(self, name: str) -> bool:
        return name in _DIRECT_OPS

    def waiting_for(self) -> list[int]:
        ready = self._ready
        if ready is None or not ready.done() or ready.exception() is not None:
            return []
        return ready.result().waiting_for()

    def get(self) -> asyncio.Future[shm.NodeWorkspace]:
        """The workspace; its creation (collective over the group) starts at the first call."""
        if self._ready is None:
            self._ready = asyncio.ensure_future(self._create())
        return self._ready

    async def _create(self) -> shm.NodeWorkspace:
        group = self._group
        # Within the group's own timeout (init_process_group's, new_group's): a rank that
        # never comes must not hold the others for the workspace's default 300 s.
        return await shm.NodeWorkspace.create(
            PrefixStore(f"shm/ws/{group.group_id}", group.world.store),
            group.rank,
            group.size,
            ranks=group.ranks,
            local_world_size=self._local_world_size,
            job_key=default_job_key(),
            timeout=group.timeout,
        )

    def skip(self, reason: str) -> Coroutine[Any, Any, None]:
        return self._skip(self.reserve(), reason)

    async def _skip(self, turn: _Turn, reason: str) -> None:
        await shm.skip(await self.enter(turn), reason)

    def abort(self, cause: BaseException) -> None:
        ready = self._ready
        if ready is not None and ready.done() and not ready.cancelled() and not ready.exception():
            ready.result().abort(cause)

    async def aclose(self) -> None:
        if self._ready is not None and not self._ready.cancelled():
            if self._ready.done() and self._ready.exception() is None:
                await self._ready.result().aclose()
            else:
                self._ready.cancel()


def _empty(group: ProcessGroup, dims: tuple[int, ...], dt: np.dtype[Any], zeroed: bool) -> Array:
    # In shared memory when the group has a workspace (its ranks all share this host);
    # a /dev/shm that cannot hold it is logged and gives an ordinary array.
    ws = group.sequencer
    ready = ws.get() if isinstance(ws, _Workspace) else None
    if ready is not None and ready.done() and not ready.cancelled() and not ready.exception():
        workspace = ready.result()
        if not workspace.closed:
            try:
                return _shared_array.empty(dims, dt, workspace)
            except SharedMemoryError as exc:
                logger.warning("%s; using an ordinary array", exc)
    return np.zeros(dims, dt) if zeroed else np.empty(dims, dt)


BACKEND.empty = _empty


async def _in_workspace(
    comm: OpComm, ws: _Workspace, turn: _Turn, algorithm: Any, fp: bytes, *args: Any
) -> None:
    await algorithm(await ws.enter(turn), *args, fingerprint=fp)


def _direct(group: ProcessGroup, name: str, plan: Plan) -> Plan:
    """``plan``, run by the direct shared-memory algorithm when the group has a workspace."""
    ws = group.sequencer
    if not isinstance(ws, _Workspace) or name not in _DIRECT_OPS:
        return plan
    direct = _DIRECT.get(plan.algorithm)
    if direct is None:  # (a variant with a transport algorithm of its own: premultiplied)
        return plan
    args = (ws, ws.reserve(), direct, plan.fingerprint, *plan.args)
    return Plan(_in_workspace, args, plan.fingerprint, plan.output, sequenced=True)


def _op(name: str) -> Callable[[Callable[..., Plan]], Callable[..., Plan]]:
    """Register a validate function of ``name``, turned direct where the group allows."""

    def register(fn: Callable[..., Plan]) -> Callable[..., Plan]:
        def validate(group: ProcessGroup, *args: Any) -> Plan:
            return _direct(group, name, fn(group, *args))

        validate.__doc__ = fn.__doc__
        BACKEND.ops[name] = validate
        return fn

    return register


# Fingerprints of the calls that have no arguments to compare.
_BARRIER_FP = fingerprint("barrier")
_MONITORED_BARRIER_FP = fingerprint("monitored_barrier")
_ALL_GATHER_OBJECT_FP = fingerprint("all_gather_object")

_SRC, _DST = ("src", "group_src"), ("dst", "group_dst")


# -- argument checks ----------------------------------------------------------------------
def _describe(a: Array) -> str:
    return f"shape {tuple(a.shape)} and dtype {a.dtype}"


def _check_like(a: Array, like: Array, name: str, like_name: str) -> None:
    if a.dtype != like.dtype or a.shape != like.shape:
        raise DistUsageError(
            f"{name} has {_describe(a)} but {like_name} has {_describe(like)}; they must match"
        )


def _array_list(arrays: object, size: int, name: str, *, writable: bool) -> list[Array]:
    """Check a list of one array per group rank and return it as numpy arrays."""
    if not isinstance(arrays, list | tuple):
        raise DistUsageError(
            f"{name} must be a list of {size} arrays (one per rank), got {type(arrays).__name__}"
        )
    if len(arrays) != size:
        what = "is empty" if not arrays else f"has {len(arrays)} entries"
        raise DistUsageError(f"{name} {what}; it needs {size} arrays, one per rank")
    out = [as_array(a, writable=writable, name=f"{name}[{i}]") for i, a in enumerate(arrays)]
    for i, a in enumerate(out[1:], 1):
        if a.dtype != out[0].dtype:
            raise DistUsageError(
                f"{name} mixes dtypes: {name}[0] is {out[0].dtype} but {name}[{i}] is "
                f"{a.dtype}; every entry must have the same dtype"
            )
    return out


def _absent_on_non_root(value: object, name: str, root: int) -> None:
    if value is not None and not (isinstance(value, list | tuple) and not value):
        raise DistUsageError(f"{name} must only be given on the root rank (group rank {root})")


def _flat_rows(a: Array, rows: int) -> list[Array]:
    # An explicit width: numpy cannot infer -1 for a 0-size array.
    return list(a.reshape(rows, a.size // rows))


def _check_concat(big: Array, small: Array, n: int, big_name: str, small_name: str) -> None:
    if big.dtype != small.dtype or big.size != n * small.size:
        raise DistUsageError(
            f"{big_name} has {_describe(big)} but must hold {n} x {small_name} "
            f"({_describe(small)}): {n * small.size} elements of {small.dtype}"
        )


def _root(
    pg: ProcessGroup, global_rank: int | None, group_rank: int | None, names: tuple[str, str]
) -> int:
    root = pg.root(global_rank, group_rank, names)
    assert root is not None  # a default is given
    return root


# -- collectives ----------------------------------------------------------------------------
@_op("all_reduce")
def all_reduce(pg: ProcessGroup, tensor: object, op: object) -> Plan:
    """Reduce ``tensor`` across the group in place; see :func:`aiodist.all_reduce`."""
    x = as_array(tensor, writable=True, name="tensor")
    rop = check_reduce_op(op, x.dtype)
    fp = fingerprint("all_reduce", dtype=x.dtype, shape=x.shape, reduce_op=rop)
    if isinstance(op, PremulSum):
        return Plan(_premul_all_reduce, (x, op.factor), fp, tensor)
    return Plan(collectives.all_reduce, (x, rop), fp, tensor)


async def _premul_all_reduce(comm: OpComm, x: Array, factor: float) -> None:
    np.multiply(x, x.dtype.type(factor), out=x)
    await collectives.all_reduce(comm, x, ReduceOp.SUM)


@BACKEND.op("all_reduce_coalesced")
def all_reduce_coalesced(pg: ProcessGroup, tensors: object, op: object) -> Plan:
    """Reduce every array of ``tensors`` in place, as one message per step."""
    if not isinstance(tensors, list | tuple) or not tensors:
        raise DistUsageError("tensors must be a non-empty list of arrays")
    xs = _array_list(tensors, len(tensors), "tensors", writable=True)
    rop = check_reduce_op(op, xs[0].dtype)
    total = sum(x.size for x in xs)
    fp = fingerprint("all_reduce", dtype=xs[0].dtype, shape=(total,), reduce_op=rop)
    return Plan(_all_reduce_coalesced, (xs, rop), fp, tensors)


async def _all_reduce_coalesced(comm: OpComm, xs: list[Array], op: ReduceOp) -> None:
    flat = np.concatenate([x.reshape(-1) for x in xs])
    await collectives.all_reduce(comm, flat, op)
    offset = 0
    for x in xs:
        x.reshape(-1)[:] = flat[offset : offset + x.size]
        offset += x.size


@_op("broadcast")
def broadcast(pg: ProcessGroup, tensor: object, src: int | None, group_src: int | None) -> Plan:
    """Copy the root's ``tensor`` into every rank's; see :func:`aiodist.broadcast`."""
    root = _root(pg, src, group_src, _SRC)
    x = as_array(tensor, writable=pg.rank != root, name="tensor")
    fp = fingerprint("broadcast", dtype=x.dtype, shape=x.shape, root=root)
    return Plan(collectives.broadcast, (x, root), fp, tensor)


@_op("reduce")
def reduce(
    pg: ProcessGroup, tensor: object, dst: int | None, op: object, group_dst: int | None
) -> Plan:
    """Reduce ``tensor`` into the root's; see :func:`aiodist.reduce`."""
    root = _root(pg, dst, group_dst, _DST)
    # The other ranks' arrays are only read (the tree accumulates in scratch memory).
    x = as_array(tensor, writable=pg.rank == root, name="tensor")
    rop = check_reduce_op(op, x.dtype)
    fp = fingerprint("reduce", dtype=x.dtype, shape=x.shape, root=root, reduce_op=rop)
    if isinstance(op, PremulSum):
        return Plan(_premul_reduce, (x, root, op.factor), fp, tensor)
    return Plan(collectives.reduce, (x, root, rop), fp, tensor)


async def _premul_reduce(comm: OpComm, x: Array, root: int, factor: float) -> None:
    # Only the root's array is the caller's to change.
    scaled = np.multiply(x, x.dtype.type(factor), out=x if comm.rank == root else None)
    await collectives.reduce(comm, scaled, root, ReduceOp.SUM)


@_op("all_gather")
def all_gather(pg: ProcessGroup, tensor_list: object, tensor: object) -> Plan:
    """Gather every rank's ``tensor`` into ``tensor_list``; see :func:`aiodist.all_gather`."""
    x = as_array(tensor, writable=False, name="tensor")
    outs = _array_list(tensor_list, pg.size, "tensor_list", writable=True)
    for i, o in enumerate(outs):
        _check_like(o, x, f"tensor_list[{i}]", "tensor")
    fp = fingerprint("all_gather", dtype=x.dtype, shape=x.shape)
    return Plan(collectives.all_gather, (outs, x), fp, tensor_list)


@_op("all_gather_into_tensor")
def all_gather_into_tensor(pg: ProcessGroup, output: object, input: object) -> Plan:
    """Gather every rank's ``input`` into one ``output``; see the public function."""
    x = as_array(input, writable=False, name="input_tensor")
    out = as_array(output, writable=True, name="output_tensor")
    _check_concat(out, x, pg.size, "output_tensor", "input_tensor")
    fp = fingerprint("all_gather_into_tensor", dtype=x.dtype, shape=x.shape)
    return Plan(collectives.all_gather, (_flat_rows(out, pg.size), x.reshape(-1)), fp, output)


@BACKEND.op("all_gather_coalesced")
def all_gather_coalesced(pg: ProcessGroup, output_lists: object, inputs: object) -> Plan:
    """Gather each array of ``inputs`` into the matching list of ``output_lists``."""
    if not isinstance(inputs, list | tuple) or not inputs:
        raise DistUsageError("input_tensor_list must be a non-empty list of arrays")
    if not isinstance(output_lists, list | tuple) or len(output_lists) != pg.size:
        raise DistUsageError(
            f"output_tensor_lists must be a list of {pg.size} lists (one per rank), one "
            "array each per input"
        )
    xs = [as_array(x, writable=False, name=f"input_tensor_list[{i}]") for i, x in enumerate(inputs)]
    rows = []
    for r, row in enumerate(output_lists):
        if not isinstance(row, list | tuple) or len(row) != len(xs):
            raise DistUsageError(
                f"output_tensor_lists[{r}] must be a list of {len(xs)} arrays, one per input"
            )
        outs = [
            as_array(o, writable=True, name=f"output_tensor_lists[{r}][{i}]")
            for i, o in enumerate(row)
        ]
        for i, (o, x) in enumerate(zip(outs, xs, strict=True)):
            _check_like(o, x, f"output_tensor_lists[{r}][{i}]", f"input_tensor_list[{i}]")
        rows.append(outs)
    flat = np.concatenate([byte_view(x) for x in xs]) if xs else np.zeros(0, np.uint8)
    fp = fingerprint("all_gather", dtype=np.uint8, shape=flat.shape)
    return Plan(_all_gather_coalesced, (rows, xs, flat), fp, output_lists)


async def _all_gather_coalesced(
    comm: OpComm, rows: list[list[Array]], xs: list[Array], flat: Array
) -> None:
    gathered = np.zeros((comm.size, flat.size), np.uint8)
    await collectives.all_gather(comm, list(gathered), flat)
    for r, outs in enumerate(rows):
        offset = 0
        for o in outs:
            n = o.nbytes
            byte_view(o)[:] = gathered[r, offset : offset + n].data
            offset += n


@_op("gather")
def gather(
    pg: ProcessGroup,
    tensor: object,
    gather_list: object,
    dst: int | None,
    group_dst: int | None,
) -> Plan:
    """Gather every rank's ``tensor`` on the root; see :func:`aiodist.gather`."""
    root = _root(pg, dst, group_dst, _DST)
    x = as_array(tensor, writable=False, name="tensor")
    outs: list[Array] | None = None
    if pg.rank == root:
        outs = _array_list(gather_list, pg.size, "gather_list", writable=True)
        for i, o in enumerate(outs):
            _check_like(o, x, f"gather_list[{i}]", "tensor")
    else:
        _absent_on_non_root(gather_list, "gather_list", root)
    fp = fingerprint("gather", dtype=x.dtype, shape=x.shape, root=root)
    return Plan(collectives.gather, (outs, x, root), fp, gather_list)


@_op("scatter")
def scatter(
    pg: ProcessGroup,
    tensor: object,
    scatter_list: object,
    src: int | None,
    group_src: int | None,
) -> Plan:
    """Send ``scatter_list[i]`` from the root to rank ``i``; see :func:`aiodist.scatter`."""
    root = _root(pg, src, group_src, _SRC)
    out = as_array(tensor, writable=True, name="tensor")
    ins: list[Array] | None = None
    if pg.rank == root:
        ins = _array_list(scatter_list, pg.size, "scatter_list", writable=False)
        for i, a in enumerate(ins):
            _check_like(a, out, f"scatter_list[{i}]", "tensor")
    else:
        _absent_on_non_root(scatter_list, "scatter_list", root)
    fp = fingerprint("scatter", dtype=out.dtype, shape=out.shape, root=root)
    return Plan(collectives.scatter, (out, ins, root), fp, tensor)


@_op("reduce_scatter")
def reduce_scatter(pg: ProcessGroup, output: object, input_list: object, op: object) -> Plan:
    """Reduce ``input_list[i]`` across ranks into rank ``i``'s ``output``."""
    out = as_array(output, writable=True, name="output")
    ins = _array_list(input_list, pg.size, "input_list", writable=False)
    for i, a in enumerate(ins):
        _check_like(a, out, f"input_list[{i}]", "output")
    rop = check_reduce_op(op, out.dtype)
    fp = fingerprint("reduce_scatter", dtype=out.dtype, shape=out.shape, reduce_op=rop)
    if isinstance(op, PremulSum):
        return Plan(_premul_reduce_scatter, (out, ins, op.factor), fp, output)
    return Plan(collectives.reduce_scatter, (out, ins, rop), fp, output)


async def _premul_reduce_scatter(comm: OpComm, out: Array, ins: list[Array], factor: float) -> None:
    scaled = [np.multiply(a, a.dtype.type(factor)) for a in ins]
    await collectives.reduce_scatter(comm, out, scaled, ReduceOp.SUM)


@_op("reduce_scatter_tensor")
def reduce_scatter_tensor(pg: ProcessGroup, output: object, input: object, op: object) -> Plan:
    """Reduce-scatter one concatenated ``input`` into ``output``; see the public function."""
    out = as_array(output, writable=True, name="output")
    x = as_array(input, writable=False, name="input")
    _check_concat(x, out, pg.size, "input", "output")
    rop = check_reduce_op(op, out.dtype)
    fp = fingerprint("reduce_scatter_tensor", dtype=out.dtype, shape=out.shape, reduce_op=rop)
    rows = _flat_rows(x, pg.size)
    if isinstance(op, PremulSum):
        return Plan(_premul_reduce_scatter, (out.reshape(-1), rows, op.factor), fp, output)
    return Plan(collectives.reduce_scatter, (out.reshape(-1), rows, rop), fp, output)


@_op("all_to_all")
def all_to_all(pg: ProcessGroup, output_list: object, input_list: object) -> Plan:
    """Send ``input_list[i]`` to rank ``i``, receive ``output_list[j]`` from rank ``j``."""
    outs = _array_list(output_list, pg.size, "output_tensor_list", writable=True)
    ins = _array_list(input_list, pg.size, "input_tensor_list", writable=False)
    if outs[0].dtype != ins[0].dtype:
        raise DistUsageError(
            f"output_tensor_list has dtype {outs[0].dtype} but input_tensor_list has dtype "
            f"{ins[0].dtype}; they must match"
        )
    fp = fingerprint("all_to_all", dtype=ins[0].dtype)
    return Plan(collectives.all_to_all, (outs, ins), fp, output_list)


def _splits(sizes: Sequence[int] | None, dim0: int, n: int, name: str) -> list[int]:
    if sizes is None:
        if dim0 % n:
            raise DistUsageError(
                f"dimension 0 of {name.split('_')[0]} ({dim0}) is not divisible by the group "
                f"size {n}; pass {name}"
            )
        return [dim0 // n] * n
    try:
        splits = [int(s) for s in sizes]
    except (TypeError, ValueError):
        raise DistUsageError(f"{name} must be a list of {n} ints") from None
    if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != dim0:
        raise DistUsageError(
            f"{name} {splits} must be {n} non-negative sizes adding up to dimension 0 ({dim0})"
        )
    return splits


def _split_rows(a: Array, splits: list[int]) -> list[Array]:
    offsets = np.cumsum([0, *splits])
    return [a[offsets[i] : offsets[i + 1]] for i in range(len(splits))]


@_op("all_to_all_single")
def all_to_all_single(
    pg: ProcessGroup,
    output: object,
    input: object,
    output_split_sizes: Sequence[int] | None,
    input_split_sizes: Sequence[int] | None,
) -> Plan:
    """Exchange slices of ``input`` along dimension 0; see the public function."""
    out = as_array(output, writable=True, name="output")
    x = as_array(input, writable=False, name="input")
    if out.dtype != x.dtype or 0 in (out.ndim, x.ndim) or out.shape[1:] != x.shape[1:]:
        raise DistUsageError(
            f"output has {_describe(out)} and input has {_describe(x)}; they need the same "
            "dtype and the same trailing dimensions"
        )
    outs = _split_rows(
        out, _splits(output_split_sizes, out.shape[0], pg.size, "output_split_sizes")
    )
    ins = _split_rows(x, _splits(input_split_sizes, x.shape[0], pg.size, "input_split_sizes"))
    fp = fingerprint("all_to_all_single", dtype=x.dtype)
    return Plan(collectives.all_to_all, (outs, ins), fp, output)


@_op("barrier")
def barrier(pg: ProcessGroup) -> Plan:
    """Wait until every rank of the group has called ``barrier``."""
    return Plan(collectives.barrier, (), _BARRIER_FP)


@BACKEND.op("monitored_barrier")
def monitored_barrier(pg: ProcessGroup, timeout: Timeout, wait_all_ranks: bool) -> Plan:
    """A barrier through group rank 0 that names the ranks that did not arrive in time."""
    seconds = to_seconds(timeout, pg.timeout)
    return Plan(
        _monitored_barrier, (pg.ranks, seconds, bool(wait_all_ranks)), _MONITORED_BARRIER_FP
    )


async def _monitored_barrier(
    comm: OpComm, ranks: tuple[int, ...], seconds: float | None, wait_all_ranks: bool
) -> None:
    token = np.zeros(1, np.uint8)
    if comm.rank != 0:
        await comm.send(0, 0, byte_view(token))
        release = comm.recv_into(0, 1, byte_view(token))
        done, _ = await asyncio.wait([release], timeout=seconds)
        if not done:
            raise DistTimeoutError(
                f"monitored_barrier: rank {ranks[comm.rank]} was not released by rank "
                f"{ranks[0]} within {seconds:g} s"
            )
        release.result()
        return
    bufs = {r: np.zeros(1, np.uint8) for r in range(1, comm.size)}
    arrivals = {comm.recv_into(r, 0, byte_view(b)): r for r, b in bufs.items()}
    loop = asyncio.get_running_loop()
    deadline = None if seconds is None else loop.time() + seconds
    missing: list[int] = []
    for fut, r in arrivals.items():
        left = None if deadline is None else max(0.0, deadline - loop.time())
        done, _ = await asyncio.wait([fut], timeout=left)
        if done:
            fut.result()
        else:
            missing.append(ranks[r])
            if not wait_all_ranks:
                break
    if missing:
        raise DistTimeoutError(
            f"monitored_barrier: rank {ranks[0]}: "
            f"{'rank' if len(missing) == 1 else 'ranks'} {', '.join(map(str, missing))} "
            f"failed to pass the monitored barrier within {seconds:g} s"
        )
    await asyncio.gather(*(comm.send(r, 1, byte_view(token)) for r in bufs))


# -- point to point --------------------------------------------------------------------------
@BACKEND.op("send")
def send(pg: ProcessGroup, peer: int, tensor: object) -> Plan:
    """Send ``tensor`` to group rank ``peer``; see :func:`aiodist.send`."""
    x = as_array(tensor, writable=False, name="tensor")
    return Plan(_send, (peer, x))


async def _send(comm: OpComm, peer: int, x: Array) -> None:
    await comm.send(peer, 0, byte_view(x))


@BACKEND.op("recv")
def recv(pg: ProcessGroup, peer: int | None, tensor: object, group_ranks: bool) -> Plan:
    """Receive into ``tensor`` from group rank ``peer`` (``None``: any); see :func:`aiodist.recv`.

    The work's result is the sender's rank: a group rank if ``group_ranks``, else global.
    """
    out = as_array(tensor, writable=True, name="tensor")
    return Plan(_recv, (peer, out, pg.ranks if group_ranks else None))


async def _recv(
    comm: OpComm, peer: int | None, out: Array, group_ranks: tuple[int, ...] | None
) -> int:
    sender = await comm.recv_into(peer, 0, byte_view(out))
    return sender if group_ranks is None else group_ranks.index(sender)


# -- object collectives ----------------------------------------------------------------------
def _dumps(obj: object, name: str) -> Array:
    try:
        data = pickle.dumps(obj)
    except Exception as exc:
        raise DistUsageError(f"{name} cannot be pickled: {type(exc).__name__}: {exc}") from exc
    return np.frombuffer(data, np.uint8)


#: The largest pickled object an object collective takes from a peer. Sizes are announced by
#: the peers before the bytes follow, so they are checked before anything is allocated.
MAX_OBJECT_SIZE = 1 << 40


def _checked_sizes(sizes: Array, op: str, root: int | None = None) -> list[int]:
    """The announced sizes as ints, each in ``[0, MAX_OBJECT_SIZE]``.

    Raises:
        DistProtocolError: a peer announced a negative or oversized object.
    """
    out = sizes.tolist()
    for i, n in enumerate(out):
        if not 0 <= n <= MAX_OBJECT_SIZE:
            who = f"rank {root}" if root is not None else f"group rank {i}"
            raise DistProtocolError(
                f"{op}: {who} announced a pickled object of {n} bytes (the limit is "
                f"{MAX_OBJECT_SIZE}): a corrupted stream or a peer that is not aiodist"
            )
    return [int(n) for n in out]


def _bytes(shape: int | tuple[int, int], op: str) -> Array:
    """Zeroed receive memory for pickled objects; a clear error when it cannot be had.

    Raises:
        DistError: the memory cannot be allocated.
    """
    try:
        return np.zeros(shape, np.uint8)
    except (MemoryError, ValueError) as exc:
        raise DistError(
            f"{op}: cannot allocate {shape} bytes for the peers' objects: {exc}"
        ) from exc


def _loads(buf: Array, name: str) -> Any:
    try:
        return pickle.loads(buf.tobytes())
    except Exception as exc:
        raise DistError(f"{name}: received bytes did not unpickle: {exc}") from exc


def _object_list(value: object, name: str, size: int | None = None) -> list[Any]:
    if not isinstance(value, list):
        raise DistUsageError(f"{name} must be a list, got {type(value).__name__}")
    if size is not None and len(value) != size:
        raise DistUsageError(f"{name} has {len(value)} entries; it needs {size}, one per rank")
    if not value:
        raise DistUsageError(f"{name} is empty")
    return value


def _padded(rows: Sequence[Array], width: int) -> Array:
    out = np.zeros((len(rows), width), np.uint8)
    for i, r in enumerate(rows):
        out[i, : r.size] = r
    return out


@BACKEND.op("broadcast_object_list")
def broadcast_object_list(
    pg: ProcessGroup, object_list: object, src: int | None, group_src: int | None
) -> Plan:
    """Pickle the root's objects and unpickle them into every rank's ``object_list``."""
    root = _root(pg, src, group_src, _SRC)
    objs = _object_list(object_list, "object_list")
    payloads = (
        [_dumps(o, f"object_list[{i}]") for i, o in enumerate(objs)] if pg.rank == root else []
    )
    fp = fingerprint("broadcast_object_list", root=root)
    return Plan(_broadcast_objects, (objs, payloads, root), fp)


async def _broadcast_objects(
    c_sizes: OpComm, c_data: OpComm, objs: list[Any], payloads: list[Array], root: int
) -> list[Any]:
    mine = c_sizes.rank == root
    sizes = np.array([p.size for p in payloads] if mine else [0] * len(objs), np.int64)
    await collectives.broadcast(c_sizes, sizes, root)
    if mine:
        data = np.concatenate(payloads)
    else:
        total = sum(_checked_sizes(sizes, "broadcast_object_list", root))
        data = _bytes(total, "broadcast_object_list")
    await collectives.broadcast(c_data, data, root)
    if not mine:
        offsets = np.cumsum([0, *sizes.tolist()])
        for i in range(len(objs)):
            objs[i] = _loads(data[offsets[i] : offsets[i + 1]], f"object_list[{i}]")
    return objs


@BACKEND.op("all_gather_object")
def all_gather_object(pg: ProcessGroup, object_list: object, obj: object) -> Plan:
    """Gather every rank's ``obj`` into ``object_list`` on every rank."""
    objs = _object_list(object_list, "object_list", pg.size)
    return Plan(_all_gather_objects, (objs, _dumps(obj, "obj")), _ALL_GATHER_OBJECT_FP)


async def _all_gather_objects(
    c_sizes: OpComm, c_data: OpComm, objs: list[Any], mine: Array
) -> list[Any]:
    n = c_sizes.size
    sizes = np.zeros(n, np.int64)
    await collectives.all_gather(c_sizes, _flat_rows(sizes, n), np.array([mine.size], np.int64))
    width = max(_checked_sizes(sizes, "all_gather_object"))
    rows = _bytes((n, width), "all_gather_object")
    await collectives.all_gather(c_data, list(rows), _padded([mine], width)[0])
    for i in range(n):
        objs[i] = _loads(rows[i, : sizes[i]], f"object from group rank {i}")
    return objs


@BACKEND.op("gather_object")
def gather_object(
    pg: ProcessGroup,
    obj: object,
    object_gather_list: object,
    dst: int | None,
    group_dst: int | None,
) -> Plan:
    """Gather every rank's ``obj`` into the root's ``object_gather_list``."""
    root = _root(pg, dst, group_dst, _DST)
    objs: list[Any] | None = None
    if pg.rank == root:
        objs = _object_list(object_gather_list, "object_gather_list", pg.size)
    else:
        _absent_on_non_root(object_gather_list, "object_gather_list", root)
    fp = fingerprint("gather_object", root=root)
    return Plan(_gather_objects, (objs, _dumps(obj, "obj"), root), fp)


async def _gather_objects(
    c_sizes: OpComm, c_data: OpComm, objs: list[Any] | None, mine: Array, root: int
) -> list[Any] | None:
    # Every rank learns the largest size, so all contributions pad to one width.
    n = c_sizes.size
    sizes = np.zeros(n, np.int64)
    await collectives.all_gather(c_sizes, _flat_rows(sizes, n), np.array([mine.size], np.int64))
    width = max(_checked_sizes(sizes, "gather_object"))
    rows = _bytes((n, width), "gather_object") if objs is not None else None
    await collectives.gather(
        c_data, None if rows is None else list(rows), _padded([mine], width)[0], root
    )
    if objs is not None and rows is not None:
        for i in range(n):
            objs[i] = _loads(rows[i, : sizes[i]], f"object from group rank {i}")
    return objs


@BACKEND.op("scatter_object_list")
def scatter_object_list(
    pg: ProcessGroup,
    output_list: object,
    input_list: object,
    src: int | None,
    group_src: int | None,
) -> Plan:
    """Send ``input_list[i]`` from the root to rank ``i``'s ``output_list[0]``."""
    root = _root(pg, src, group_src, _SRC)
    outs = _object_list(output_list, "scatter_object_output_list")
    payloads: list[Array] = []
    if pg.rank == root:
        ins = _object_list(input_list, "scatter_object_input_list", pg.size)
        payloads = [_dumps(o, f"scatter_object_input_list[{i}]") for i, o in enumerate(ins)]
    # (On the other ranks the input list is ignored, whatever it holds, as torch documents.)
    fp = fingerprint("scatter_object_list", root=root)
    return Plan(_scatter_objects, (outs, payloads, root), fp)


async def _scatter_objects(
    c_sizes: OpComm, c_data: OpComm, outs: list[Any], payloads: list[Array], root: int
) -> list[Any]:
    mine = c_sizes.rank == root
    sizes = np.array([p.size for p in payloads] if mine else [0] * c_sizes.size, np.int64)
    await collectives.broadcast(c_sizes, sizes, root)
    width = max(_checked_sizes(sizes, "scatter_object_list", root))
    row = _bytes(width, "scatter_object_list")
    rows = list(_padded(payloads, width)) if mine else None
    await collectives.scatter(c_data, row, rows, root)
    outs[0] = _loads(row[: sizes[c_sizes.rank]], "scattered object")
    return outs


@BACKEND.op("send_object_list")
def send_object_list(pg: ProcessGroup, peer: int, object_list: object) -> Plan:
    """Pickle ``object_list`` and send it to group rank ``peer`` (sizes first, then bytes)."""
    objs = _object_list(object_list, "object_list")
    payloads = [_dumps(o, f"object_list[{i}]") for i, o in enumerate(objs)]
    sizes = np.array([p.size for p in payloads], np.int64)
    return Plan(_send_objects, (peer, sizes, np.concatenate(payloads)))


async def _send_objects(comm: OpComm, peer: int, sizes: Array, data: Array) -> None:
    # The sizes travel as step 0, like a tensor sent with the same tag (as in torch).
    await asyncio.gather(comm.send(peer, 0, byte_view(sizes)), comm.send(peer, 1, byte_view(data)))


@BACKEND.op("recv_object_list")
def recv_object_list(
    pg: ProcessGroup, peer: int | None, object_list: object, group_ranks: bool
) -> Plan:
    """Receive objects sent with ``send_object_list`` into ``object_list``, in place."""
    objs = _object_list(object_list, "object_list")
    return Plan(_recv_objects, (peer, objs, pg.ranks, group_ranks))


async def _recv_objects(
    comm: OpComm, peer: int | None, objs: list[Any], ranks: tuple[int, ...], group_ranks: bool
) -> int:
    sizes = np.zeros(len(objs), np.int64)
    sender = await comm.recv_into(peer, 0, byte_view(sizes))
    source = ranks.index(sender)
    data = _bytes(sum(_checked_sizes(sizes, "recv_object_list", source)), "recv_object_list")
    await comm.recv_into(source, 1, byte_view(data))
    offsets = np.cumsum([0, *sizes.tolist()])
    for i in range(len(objs)):
        objs[i] = _loads(data[offsets[i] : offsets[i + 1]], f"object_list[{i}]")
    return source if group_ranks else sender
