"""The CPU backend: numpy arrays (and CPU DLPack tensors) over the group's transport.

Each function here checks its arguments the way only this rank can (dtypes, shapes, list
lengths, writability; see :func:`aiodist._arrays.as_array`), turns them into the
C-contiguous numpy arrays the algorithms of :mod:`aiodist.collectives` take, and launches
the operation on the group. Ranks passed in are group ranks, already range-checked. A failed
check raises :class:`~aiodist.errors.DistUsageError` and aborts the group (see
:meth:`~aiodist.group.ProcessGroup.checking`), so no peer waits for this rank forever.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import collectives
from .._arrays import as_array, byte_view
from .._fingerprint import fingerprint
from .._ops import check_reduce_op
from .._timeouts import Timeout, to_seconds
from ..errors import DistError, DistProtocolError, DistTimeoutError, DistUsageError
from ..group import ProcessGroup, Work
from ..transport.base import OpComm, Transport

__all__ = [
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
]

logger = logging.getLogger(__name__)

Array = npt.NDArray[Any]

#: The largest user tag of a point-to-point message (tags travel as unsigned 64-bit).
MAX_TAG = 2**63 - 1

# Fingerprints of the calls that have no arguments to compare.
_BARRIER_FP = fingerprint("barrier")
_MONITORED_BARRIER_FP = fingerprint("monitored_barrier")
_ALL_GATHER_OBJECT_FP = fingerprint("all_gather_object")


# -- argument checks ----------------------------------------------------------------------
def _describe(a: Array) -> str:
    return f"shape {tuple(a.shape)} and dtype {a.dtype}"


def _check_like(a: Array, like: Array, name: str, like_name: str) -> None:
    if a.dtype != like.dtype or a.shape != like.shape:
        raise DistUsageError(
            f"{name} has {_describe(a)} but {like_name} has {_describe(like)}; they must match"
        )


def _array_list(arrays: object, size: int, name: str, *, writable: bool, op: str) -> list[Array]:
    """Check a list of one array per group rank and return it as numpy arrays."""
    if not isinstance(arrays, list | tuple):
        raise DistUsageError(
            f"{op}: {name} must be a list of {size} arrays (one per rank), "
            f"got {type(arrays).__name__}"
        )
    if len(arrays) != size:
        what = "is empty" if not arrays else f"has {len(arrays)} entries"
        raise DistUsageError(f"{op}: {name} {what}; it needs {size} arrays, one per rank")
    out = [as_array(a, writable=writable, name=f"{name}[{i}]") for i, a in enumerate(arrays)]
    for i, a in enumerate(out[1:], 1):
        if a.dtype != out[0].dtype:
            raise DistUsageError(
                f"{op}: {name} mixes dtypes: {name}[0] is {out[0].dtype} but {name}[{i}] is "
                f"{a.dtype}; every entry must have the same dtype"
            )
    return out


def _absent_on_non_root(value: object, name: str, op: str, root: int) -> None:
    if value is not None and not (isinstance(value, list | tuple) and not value):
        raise DistUsageError(
            f"{op}: {name} must only be given on the root rank (group rank {root})"
        )


def _flat_rows(a: Array, rows: int) -> list[Array]:
    # An explicit width: numpy cannot infer -1 for a 0-size array.
    return list(a.reshape(rows, a.size // rows))


def _p2p_peer(pg: ProcessGroup, peer: int, op: str) -> int:
    if peer == pg.rank:
        raise DistUsageError(
            f"{op}: peer group rank {peer} is this rank; a rank cannot {op} to or from itself"
        )
    return pg.ranks[peer]


def _check_tag(tag: object, op: str) -> int:
    if not isinstance(tag, int) or isinstance(tag, bool) or not 0 <= tag <= MAX_TAG:
        raise DistUsageError(f"{op}: tag must be an int in [0, 2**63), got {tag!r}")
    return tag


# -- collectives ----------------------------------------------------------------------------
def all_reduce(pg: ProcessGroup, tensor: object, op: object) -> Work[Any]:
    """Reduce ``tensor`` across the group in place; see :func:`aiodist.all_reduce`."""
    with pg.checking("all_reduce"):
        x = as_array(tensor, writable=True, name="tensor")
        rop = check_reduce_op(op, x.dtype)

    async def body(comm: OpComm) -> Any:
        await collectives.all_reduce(comm, x, rop)
        return tensor

    return pg.launch(
        "all_reduce",
        body,
        fingerprint=fingerprint("all_reduce", dtype=x.dtype, shape=x.shape, reduce_op=rop),
    )


def broadcast(pg: ProcessGroup, tensor: object, root: int) -> Work[Any]:
    """Copy the root's ``tensor`` into every rank's; see :func:`aiodist.broadcast`."""
    with pg.checking("broadcast"):
        x = as_array(tensor, writable=pg.rank != root, name="tensor")

    async def body(comm: OpComm) -> Any:
        await collectives.broadcast(comm, x, root)
        return tensor

    return pg.launch(
        "broadcast",
        body,
        fingerprint=fingerprint("broadcast", dtype=x.dtype, shape=x.shape, root=root),
    )


def reduce(pg: ProcessGroup, tensor: object, root: int, op: object) -> Work[Any]:
    """Reduce ``tensor`` into the root's; see :func:`aiodist.reduce`."""
    with pg.checking("reduce"):
        # The other ranks' arrays are only read (the tree accumulates in scratch memory).
        x = as_array(tensor, writable=pg.rank == root, name="tensor")
        rop = check_reduce_op(op, x.dtype)

    async def body(comm: OpComm) -> Any:
        await collectives.reduce(comm, x, root, rop)
        return tensor

    fp = fingerprint("reduce", dtype=x.dtype, shape=x.shape, root=root, reduce_op=rop)
    return pg.launch("reduce", body, fingerprint=fp)


def all_gather(pg: ProcessGroup, tensor_list: object, tensor: object) -> Work[Any]:
    """Gather every rank's ``tensor`` into ``tensor_list``; see :func:`aiodist.all_gather`."""
    with pg.checking("all_gather"):
        x = as_array(tensor, writable=False, name="tensor")
        outs = _array_list(tensor_list, pg.size, "tensor_list", writable=True, op="all_gather")
        for i, o in enumerate(outs):
            _check_like(o, x, f"all_gather: tensor_list[{i}]", "tensor")

    async def body(comm: OpComm) -> Any:
        await collectives.all_gather(comm, outs, x)
        return tensor_list

    return pg.launch(
        "all_gather", body, fingerprint=fingerprint("all_gather", dtype=x.dtype, shape=x.shape)
    )


def all_gather_into_tensor(pg: ProcessGroup, output: object, input: object) -> Work[Any]:
    """Gather every rank's ``input`` into one ``output``; see the public function."""
    with pg.checking("all_gather_into_tensor"):
        x = as_array(input, writable=False, name="input_tensor")
        out = as_array(output, writable=True, name="output_tensor")
        _check_concat(out, x, pg.size, "all_gather_into_tensor", "output_tensor", "input_tensor")

    async def body(comm: OpComm) -> Any:
        await collectives.all_gather(comm, _flat_rows(out, pg.size), x.reshape(-1))
        return output

    fp = fingerprint("all_gather_into_tensor", dtype=x.dtype, shape=x.shape)
    return pg.launch("all_gather_into_tensor", body, fingerprint=fp)


def _check_concat(
    big: Array, small: Array, n: int, op: str, big_name: str, small_name: str
) -> None:
    if big.dtype != small.dtype or big.size != n * small.size:
        raise DistUsageError(
            f"{op}: {big_name} has {_describe(big)} but must hold {n} x {small_name} "
            f"({_describe(small)}): {n * small.size} elements of {small.dtype}"
        )


def gather(pg: ProcessGroup, tensor: object, gather_list: object, root: int) -> Work[Any]:
    """Gather every rank's ``tensor`` on the root; see :func:`aiodist.gather`."""
    with pg.checking("gather"):
        x = as_array(tensor, writable=False, name="tensor")
        outs: list[Array] | None = None
        if pg.rank == root:
            outs = _array_list(gather_list, pg.size, "gather_list", writable=True, op="gather")
            for i, o in enumerate(outs):
                _check_like(o, x, f"gather: gather_list[{i}]", "tensor")
        else:
            _absent_on_non_root(gather_list, "gather_list", "gather", root)

    async def body(comm: OpComm) -> Any:
        await collectives.gather(comm, outs, x, root)
        return gather_list

    fp = fingerprint("gather", dtype=x.dtype, shape=x.shape, root=root)
    return pg.launch("gather", body, fingerprint=fp)


def scatter(pg: ProcessGroup, tensor: object, scatter_list: object, root: int) -> Work[Any]:
    """Send ``scatter_list[i]`` from the root to rank ``i``; see :func:`aiodist.scatter`."""
    with pg.checking("scatter"):
        out = as_array(tensor, writable=True, name="tensor")
        ins: list[Array] | None = None
        if pg.rank == root:
            ins = _array_list(scatter_list, pg.size, "scatter_list", writable=False, op="scatter")
            for i, a in enumerate(ins):
                _check_like(a, out, f"scatter: scatter_list[{i}]", "tensor")
        else:
            _absent_on_non_root(scatter_list, "scatter_list", "scatter", root)

    async def body(comm: OpComm) -> Any:
        await collectives.scatter(comm, out, ins, root)
        return tensor

    fp = fingerprint("scatter", dtype=out.dtype, shape=out.shape, root=root)
    return pg.launch("scatter", body, fingerprint=fp)


def reduce_scatter(pg: ProcessGroup, output: object, input_list: object, op: object) -> Work[Any]:
    """Reduce ``input_list[i]`` across ranks into rank ``i``'s ``output``."""
    with pg.checking("reduce_scatter"):
        out = as_array(output, writable=True, name="output")
        ins = _array_list(input_list, pg.size, "input_list", writable=False, op="reduce_scatter")
        for i, a in enumerate(ins):
            _check_like(a, out, f"reduce_scatter: input_list[{i}]", "output")
        rop = check_reduce_op(op, out.dtype)

    async def body(comm: OpComm) -> Any:
        await collectives.reduce_scatter(comm, out, ins, rop)
        return output

    fp = fingerprint("reduce_scatter", dtype=out.dtype, shape=out.shape, reduce_op=rop)
    return pg.launch("reduce_scatter", body, fingerprint=fp)


def reduce_scatter_tensor(pg: ProcessGroup, output: object, input: object, op: object) -> Work[Any]:
    """Reduce-scatter one concatenated ``input`` into ``output``; see the public function."""
    with pg.checking("reduce_scatter_tensor"):
        out = as_array(output, writable=True, name="output")
        x = as_array(input, writable=False, name="input")
        _check_concat(x, out, pg.size, "reduce_scatter_tensor", "input", "output")
        rop = check_reduce_op(op, out.dtype)

    async def body(comm: OpComm) -> Any:
        await collectives.reduce_scatter(comm, out.reshape(-1), _flat_rows(x, pg.size), rop)
        return output

    fp = fingerprint("reduce_scatter_tensor", dtype=out.dtype, shape=out.shape, reduce_op=rop)
    return pg.launch("reduce_scatter_tensor", body, fingerprint=fp)


def all_to_all(pg: ProcessGroup, output_list: object, input_list: object) -> Work[Any]:
    """Send ``input_list[i]`` to rank ``i``, receive ``output_list[j]`` from rank ``j``."""
    with pg.checking("all_to_all"):
        outs = _array_list(
            output_list, pg.size, "output_tensor_list", writable=True, op="all_to_all"
        )
        ins = _array_list(input_list, pg.size, "input_tensor_list", writable=False, op="all_to_all")
        if outs[0].dtype != ins[0].dtype:
            raise DistUsageError(
                f"all_to_all: output_tensor_list has dtype {outs[0].dtype} but "
                f"input_tensor_list has dtype {ins[0].dtype}; they must match"
            )

    async def body(comm: OpComm) -> Any:
        await collectives.all_to_all(comm, outs, ins)
        return output_list

    return pg.launch("all_to_all", body, fingerprint=fingerprint("all_to_all", dtype=ins[0].dtype))


def _splits(sizes: Sequence[int] | None, dim0: int, n: int, name: str) -> list[int]:
    if sizes is None:
        if dim0 % n:
            raise DistUsageError(
                f"all_to_all_single: dimension 0 of {name.split('_')[0]} ({dim0}) is not "
                f"divisible by the group size {n}; pass {name}"
            )
        return [dim0 // n] * n
    try:
        splits = [int(s) for s in sizes]
    except (TypeError, ValueError):
        raise DistUsageError(f"all_to_all_single: {name} must be a list of {n} ints") from None
    if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != dim0:
        raise DistUsageError(
            f"all_to_all_single: {name} {splits} must be {n} non-negative sizes adding up to "
            f"dimension 0 ({dim0})"
        )
    return splits


def _split_rows(a: Array, splits: list[int]) -> list[Array]:
    offsets = np.cumsum([0, *splits])
    return [a[offsets[i] : offsets[i + 1]] for i in range(len(splits))]


def all_to_all_single(
    pg: ProcessGroup,
    output: object,
    input: object,
    output_split_sizes: Sequence[int] | None,
    input_split_sizes: Sequence[int] | None,
) -> Work[Any]:
    """Exchange slices of ``input`` along dimension 0; see the public function."""
    with pg.checking("all_to_all_single"):
        out = as_array(output, writable=True, name="output")
        x = as_array(input, writable=False, name="input")
        if out.dtype != x.dtype or 0 in (out.ndim, x.ndim) or out.shape[1:] != x.shape[1:]:
            raise DistUsageError(
                f"all_to_all_single: output has {_describe(out)} and input has "
                f"{_describe(x)}; they need the same dtype and the same trailing dimensions"
            )
        outs = _split_rows(
            out, _splits(output_split_sizes, out.shape[0], pg.size, "output_split_sizes")
        )
        ins = _split_rows(x, _splits(input_split_sizes, x.shape[0], pg.size, "input_split_sizes"))

    async def body(comm: OpComm) -> Any:
        await collectives.all_to_all(comm, outs, ins)
        return output

    fp = fingerprint("all_to_all_single", dtype=x.dtype)
    return pg.launch("all_to_all_single", body, fingerprint=fp)


def barrier(pg: ProcessGroup) -> Work[None]:
    """Wait until every rank of the group has called ``barrier``."""
    pg.check_usable("barrier")
    return pg.launch("barrier", collectives.barrier, fingerprint=_BARRIER_FP)


def monitored_barrier(pg: ProcessGroup, timeout: Timeout, wait_all_ranks: bool) -> Work[None]:
    """A barrier through group rank 0 that names the ranks that did not arrive in time."""
    with pg.checking("monitored_barrier"):
        seconds = to_seconds(timeout, pg.timeout)

    async def body(comm: OpComm) -> None:
        token = np.zeros(1, np.uint8)
        if comm.rank != 0:
            await comm.send(0, 0, byte_view(token))
            release = comm.recv_into(0, 1, byte_view(token))
            done, _ = await asyncio.wait([release], timeout=seconds)
            if not done:
                raise DistTimeoutError(
                    f"monitored_barrier: rank {pg.ranks[comm.rank]} was not released by rank "
                    f"{pg.ranks[0]} within {seconds:g} s"
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
                missing.append(pg.ranks[r])
                if not wait_all_ranks:
                    break
        if missing:
            raise DistTimeoutError(
                f"monitored_barrier: rank {pg.ranks[0]}: "
                f"{'rank' if len(missing) == 1 else 'ranks'} {', '.join(map(str, missing))} "
                f"failed to pass the monitored barrier within {seconds:g} s"
            )
        await asyncio.gather(*(comm.send(r, 1, byte_view(token)) for r in bufs))

    return pg.launch("monitored_barrier", body, fingerprint=_MONITORED_BARRIER_FP)


# -- point to point --------------------------------------------------------------------------
def send(pg: ProcessGroup, tensor: object, dst: int, tag: object) -> Work[None]:
    """Send ``tensor`` to group rank ``dst``; see :func:`aiodist.send`."""
    with pg.checking("send"):
        t = _check_tag(tag, "send")
        x = as_array(tensor, writable=False, name="tensor")
        peer = _p2p_peer(pg, dst, "send")

    async def body(transport: Transport, gid: int) -> None:
        await transport.send(peer, (gid, t, 0), byte_view(x))

    return pg.launch_p2p("send", t, body)


def recv(
    pg: ProcessGroup, tensor: object, src: int | None, tag: object, *, group_ranks: bool
) -> Work[int]:
    """Receive into ``tensor`` from group rank ``src`` (``None``: any); see :func:`aiodist.recv`.

    The work's result is the sender's rank: a group rank if ``group_ranks``, else global.
    """
    with pg.checking("recv"):
        t = _check_tag(tag, "recv")
        out = as_array(tensor, writable=True, name="tensor")
        peer = None if src is None else _p2p_peer(pg, src, "recv")

    async def body(transport: Transport, gid: int) -> int:
        sender = await transport.recv_into(peer, (gid, t, 0), byte_view(out))
        return pg.group_rank(sender) if group_ranks else sender

    return pg.launch_p2p("recv", t, body)


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


def _object_list(value: object, name: str, op: str, size: int | None = None) -> list[Any]:
    if not isinstance(value, list):
        raise DistUsageError(f"{op}: {name} must be a list, got {type(value).__name__}")
    if size is not None and len(value) != size:
        raise DistUsageError(
            f"{op}: {name} has {len(value)} entries; it needs {size}, one per rank"
        )
    if not value:
        raise DistUsageError(f"{op}: {name} is empty")
    return value


def _padded(rows: Sequence[Array], width: int) -> Array:
    out = np.zeros((len(rows), width), np.uint8)
    for i, r in enumerate(rows):
        out[i, : r.size] = r
    return out


def broadcast_object_list(pg: ProcessGroup, object_list: object, root: int) -> Work[list[Any]]:
    """Pickle the root's objects and unpickle them into every rank's ``object_list``."""
    with pg.checking("broadcast_object_list"):
        objs = _object_list(object_list, "object_list", "broadcast_object_list")
        if pg.rank == root:
            payloads = [_dumps(o, f"object_list[{i}]") for i, o in enumerate(objs)]
            sizes = np.array([p.size for p in payloads], np.int64)
        else:
            sizes = np.zeros(len(objs), np.int64)

    async def body(c_sizes: OpComm, c_data: OpComm) -> list[Any]:
        await collectives.broadcast(c_sizes, sizes, root)
        if pg.rank == root:
            data = np.concatenate(payloads)
        else:
            data = _bytes(
                sum(_checked_sizes(sizes, "broadcast_object_list", root)), "broadcast_object_list"
            )
        await collectives.broadcast(c_data, data, root)
        if pg.rank != root:
            offsets = np.cumsum([0, *sizes.tolist()])
            for i in range(len(objs)):
                objs[i] = _loads(data[offsets[i] : offsets[i + 1]], f"object_list[{i}]")
        return objs

    fp = fingerprint("broadcast_object_list", root=root)
    return pg.launch("broadcast_object_list", body, nseq=2, fingerprint=fp)


def all_gather_object(pg: ProcessGroup, object_list: object, obj: object) -> Work[list[Any]]:
    """Gather every rank's ``obj`` into ``object_list`` on every rank."""
    with pg.checking("all_gather_object"):
        objs = _object_list(object_list, "object_list", "all_gather_object", pg.size)
        mine = _dumps(obj, "obj")

    async def body(c_sizes: OpComm, c_data: OpComm) -> list[Any]:
        sizes = np.zeros(pg.size, np.int64)
        await collectives.all_gather(
            c_sizes, _flat_rows(sizes, pg.size), np.array([mine.size], np.int64)
        )
        width = max(_checked_sizes(sizes, "all_gather_object"))
        rows = _bytes((pg.size, width), "all_gather_object")
        await collectives.all_gather(c_data, list(rows), _padded([mine], width)[0])
        for i in range(pg.size):
            objs[i] = _loads(rows[i, : sizes[i]], f"object from group rank {i}")
        return objs

    return pg.launch("all_gather_object", body, nseq=2, fingerprint=_ALL_GATHER_OBJECT_FP)


def gather_object(
    pg: ProcessGroup, obj: object, object_gather_list: object, root: int
) -> Work[list[Any] | None]:
    """Gather every rank's ``obj`` into the root's ``object_gather_list``."""
    with pg.checking("gather_object"):
        objs: list[Any] | None = None
        if pg.rank == root:
            objs = _object_list(object_gather_list, "object_gather_list", "gather_object", pg.size)
        else:
            _absent_on_non_root(object_gather_list, "object_gather_list", "gather_object", root)
        mine = _dumps(obj, "obj")

    async def body(c_sizes: OpComm, c_data: OpComm) -> list[Any] | None:
        # Every rank learns the largest size, so all contributions pad to one width.
        sizes = np.zeros(pg.size, np.int64)
        await collectives.all_gather(
            c_sizes, _flat_rows(sizes, pg.size), np.array([mine.size], np.int64)
        )
        width = max(_checked_sizes(sizes, "gather_object"))
        rows = _bytes((pg.size, width), "gather_object") if objs is not None else None
        await collectives.gather(
            c_data, None if rows is None else list(rows), _padded([mine], width)[0], root
        )
        if objs is not None and rows is not None:
            for i in range(pg.size):
                objs[i] = _loads(rows[i, : sizes[i]], f"object from group rank {i}")
        return objs

    fp = fingerprint("gather_object", root=root)
    return pg.launch("gather_object", body, nseq=2, fingerprint=fp)


def scatter_object_list(
    pg: ProcessGroup, output_list: object, input_list: object, root: int
) -> Work[list[Any]]:
    """Send ``input_list[i]`` from the root to rank ``i``'s ``output_list[0]``."""
    with pg.checking("scatter_object_list"):
        outs = _object_list(output_list, "scatter_object_output_list", "scatter_object_list")
        payloads: list[Array] = []
        if pg.rank == root:
            ins = _object_list(
                input_list, "scatter_object_input_list", "scatter_object_list", pg.size
            )
            payloads = [_dumps(o, f"scatter_object_input_list[{i}]") for i, o in enumerate(ins)]
        else:
            _absent_on_non_root(
                input_list, "scatter_object_input_list", "scatter_object_list", root
            )
        sizes = np.array([p.size for p in payloads] or [0] * pg.size, np.int64)

    async def body(c_sizes: OpComm, c_data: OpComm) -> list[Any]:
        await collectives.broadcast(c_sizes, sizes, root)
        width = max(_checked_sizes(sizes, "scatter_object_list", root))
        row = _bytes(width, "scatter_object_list")
        rows = list(_padded(payloads, width)) if pg.rank == root else None
        await collectives.scatter(c_data, row, rows, root)
        outs[0] = _loads(row[: sizes[pg.rank]], "scattered object")
        return outs

    fp = fingerprint("scatter_object_list", root=root)
    return pg.launch("scatter_object_list", body, nseq=2, fingerprint=fp)
