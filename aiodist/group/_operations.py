"""Every operation, declared once: its argument rules, its fingerprint and its result.

An :class:`Operation` is what a call of ``aiodist.<name>`` means, whatever device its arrays
live on. Its *check* takes the backend's array *intake* (how that backend turns an argument
into one of its arrays, or refuses it, naming the argument), the group and the call's
arguments; it applies torch's argument rules, fingerprints the call and returns a
:class:`Call`: which algorithm it needs (one of :data:`ALGORITHMS`), that algorithm's
arguments in a fixed form, and the :class:`~aiodist.group.Work`'s result. A backend is an
intake plus, per algorithm, a data path that turns a :class:`Call` into a
:class:`~aiodist.group.Plan` (:meth:`aiodist.backends.Backend.from_paths`); the public API
(``_api.py``), its blocking twins (``sync.py``) and the fingerprint table are checked against
:data:`OPERATIONS` by ``tests/test_operations.py``.

The algorithms and their arguments (``x`` an array, ``op`` a :class:`~aiodist.ReduceOp`,
``factor`` the premultiplier of ``PREMUL_SUM`` or ``None``, ``root``/``peer`` group ranks):

==========================  ==============================================================
``all_reduce``              ``(x, op, factor)``
``all_reduce_coalesced``    ``(xs, op, factor)``: every array of ``xs`` reduced in place
``broadcast``               ``(x, root)``
``reduce``                  ``(x, root, op, factor)``: only the root's ``x`` is written
``all_gather``              ``(outs, x, whole)``: ``whole`` is the one array ``outs`` are
                            the rows of (``all_gather_single``), else ``None``
``all_gather_coalesced``    ``(rows, xs)``: ``rows[r][i]`` receives rank ``r``'s ``xs[i]``
``gather``                  ``(outs or None, x, root)``
``scatter``                 ``(out, ins or None, root)``
``reduce_scatter``          ``(out, ins, op, factor)``
``all_to_all``              ``(outs, ins)``: blocks may differ in size
``barrier``                 ``()``
``monitored_barrier``       ``(ranks, seconds, wait_all_ranks)``
``send`` / ``recv``         ``(peer, x)`` / ``(peer or None, out, ranks or None)``: the
                            result is the sender, a group rank when ``ranks`` is given
object collectives          see :mod:`aiodist.collectives.objects` (run on the CPU)
==========================  ==============================================================
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol

import numpy as np

from .._arrays._fingerprint import NO_FINGERPRINT, fingerprint
from .._arrays._reduce import PremulSum, ReduceOp, check_reduce_op
from .._util._timeouts import Timeout, to_seconds
from ..errors import DistUsageError

if TYPE_CHECKING:
    from . import ProcessGroup

__all__ = ["ALGORITHMS", "HOST_ALGORITHMS", "OPERATIONS", "Call", "Intake", "Operation"]


class Intake(Protocol):
    """A backend's way of taking one array argument: ``intake(value, writable=, name=)``
    returns the backend's array, or raises ``DistUsageError`` naming the argument (``name``);
    ``writable``: the operation writes into it."""

    def __call__(self, value: object, /, *, writable: bool, name: str) -> Any: ...


#: How an operation's blocking twin (``aiodist.sync``) returns: torch's collectives return
#: ``None`` or, with ``async_op=True``, a Work; ``isend``/``irecv`` a Work at once; ``recv``
#: the sender; object collectives ``None`` once done.
Returns = Literal["async_op", "work", "result", "none"]

#: The algorithms that run on the CPU whatever device a group's arrays live on: their
#: bytes are the host's (a barrier's tokens, pickled objects).
HOST_ALGORITHMS = frozenset(
    {
        "barrier",
        "monitored_barrier",
        "broadcast_objects",
        "all_gather_objects",
        "gather_objects",
        "scatter_objects",
        "send_objects",
        "recv_objects",
    }
)

#: The algorithms an operation may need; a backend's data paths are keyed by these.
ALGORITHMS = HOST_ALGORITHMS | {
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_coalesced",
    "gather",
    "scatter",
    "reduce_scatter",
    "all_to_all",
    "send",
    "recv",
}


class Call(NamedTuple):
    """One call, checked: what its operation's algorithm takes.

    Attributes:
        args: the algorithm's arguments, in the form the module docstring gives.
        fingerprint: the call's fingerprint (every rank's must match).
        output: the Work's result when the algorithm returns ``None``.
    """

    args: tuple[Any, ...] = ()
    fingerprint: bytes = NO_FINGERPRINT
    output: Any = None


@dataclass(frozen=True, slots=True)
class Operation:
    """One operation.

    Attributes:
        name: the name its calls are issued under (in errors, the flight recorder and the
            backends' tables).
        check: ``check(intake, group, *args) -> Call``; raises ``DistUsageError`` naming
            the bad argument.
        algorithm: the algorithm that runs it (one of :data:`ALGORITHMS`).
        public: the public functions that issue it (``aiodist.<name>``), each with what its
            blocking twin in ``aiodist.sync`` returns (:data:`Returns`).
        nseq: the sequence numbers one call takes (its algorithm gets one ``OpComm`` each).
        alias_of: the operation this one is another name of (torch 2.13 deprecated
            ``all_gather_into_tensor`` for ``all_gather_single``).
    """

    name: str
    check: Callable[..., Call]
    algorithm: str
    public: Mapping[str, Returns]
    nseq: int = 1
    alias_of: str | None = None


#: Every operation by the name it is issued under (aliases included).
OPERATIONS: dict[str, Operation] = {}


def _operation(
    name: str,
    returns: Returns = "async_op",
    *,
    algorithm: str | None = None,
    nseq: int = 1,
    public: Mapping[str, Returns] | None = None,
    aliases: Sequence[str] = (),
) -> Callable[[Callable[..., Call]], Callable[..., Call]]:
    def declare(check: Callable[..., Call]) -> Callable[..., Call]:
        runs = algorithm or name
        assert runs in ALGORITHMS, runs
        OPERATIONS[name] = Operation(name, check, runs, public or {name: returns}, nseq)
        for alias in aliases:
            OPERATIONS[alias] = Operation(alias, check, runs, {alias: returns}, nseq, name)
        return check

    return declare


# -- torch's argument rules ------------------------------------------------------------------
_SRC, _DST = ("src", "group_src"), ("dst", "group_dst")


def _describe(a: Any) -> str:
    # "shape (2, 3) and dtype float32": an array, in error messages.
    return f"shape {tuple(a.shape)} and dtype {a.dtype}"


def _check_like(a: Any, like: Any, name: str, like_name: str) -> None:
    if a.dtype != like.dtype or a.shape != like.shape:
        raise DistUsageError(
            f"{name} has {_describe(a)} but {like_name} has {_describe(like)}; they must match"
        )


def _array_list(intake: Intake, arrays: object, size: int, name: str, writable: bool) -> list[Any]:
    """Check a list of one array per group rank; return the backend's arrays."""
    if not isinstance(arrays, list | tuple):
        raise DistUsageError(
            f"{name} must be a list of {size} arrays (one per rank), got {type(arrays).__name__}"
        )
    if len(arrays) != size:
        what = "is empty" if not arrays else f"has {len(arrays)} entries"
        raise DistUsageError(f"{name} {what}; it needs {size} arrays, one per rank")
    out = [intake(a, writable=writable, name=f"{name}[{i}]") for i, a in enumerate(arrays)]
    for i, a in enumerate(out[1:], 1):
        if a.dtype != out[0].dtype:
            raise DistUsageError(
                f"{name} mixes dtypes: {name}[0] is {out[0].dtype} but {name}[{i}] is "
                f"{a.dtype}; every entry must have the same dtype"
            )
    return out


def _like_list(
    intake: Intake, arrays: object, size: int, name: str, writable: bool, like: Any, like_name: str
) -> list[Any]:
    out = _array_list(intake, arrays, size, name, writable)
    for i, a in enumerate(out):
        _check_like(a, like, f"{name}[{i}]", like_name)
    return out


def _absent_on_non_root(value: object, name: str, root: int) -> None:
    if value is not None and not (isinstance(value, list | tuple) and not value):
        raise DistUsageError(f"{name} must only be given on the root rank (group rank {root})")


def _check_concat(big: Any, small: Any, n: int, big_name: str, small_name: str) -> None:
    if big.dtype != small.dtype or big.size != n * small.size:
        raise DistUsageError(
            f"{big_name} has {_describe(big)} but must hold {n} x {small_name} "
            f"({_describe(small)}): {n * small.size} elements of {small.dtype}"
        )


def _rows(a: Any, n: int) -> list[Any]:
    # Views of ``a`` as ``n`` flat rows (an explicit width: -1 cannot be inferred at size 0).
    return list(a.reshape(n, a.size // n))


def _root(pg: ProcessGroup, global_rank: int | None, group_rank: int | None, names: Any) -> int:
    root = pg.root(global_rank, group_rank, names)
    assert root is not None  # a default is given
    return root


def _factor(op: object) -> float | None:
    return op.factor if isinstance(op, PremulSum) else None


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


def _split_rows(a: Any, splits: list[int]) -> list[Any]:
    parts, offset = [], 0
    for s in splits:
        parts.append(a[offset : offset + s])
        offset += s
    return parts


# -- reductions ------------------------------------------------------------------------------
def _all_reduce_op(op: object, dtype: Any) -> ReduceOp:
    """``check_reduce_op`` with torch's words for a reduction that complex arrays refuse
    (``"all_reduce does not support ... on complex tensors"``, which scripts match)."""
    try:
        return check_reduce_op(op, dtype)
    except DistUsageError:
        if np.dtype(dtype).kind != "c" or not isinstance(op, int):
            raise
        name = ReduceOp(op).name
        raise DistUsageError(
            f"all_reduce does not support ReduceOp.{name} on complex tensors (dtype {dtype}): "
            "complex arrays take SUM, AVG, PRODUCT and PREMUL_SUM"
        ) from None


@_operation("all_reduce")
def _all_reduce(intake: Intake, pg: ProcessGroup, tensor: object, op: object) -> Call:
    # A program repeats the same few calls: a numpy array that the intake takes as it is
    # (writable, C-contiguous) and a plain ReduceOp pass the checks exactly as the last call
    # with the same intake, dtype, shape and op did, so what that one found is reused.
    key = None
    if type(tensor) is np.ndarray and type(op) is ReduceOp:
        flags = tensor.flags
        if flags.writeable and flags.c_contiguous:
            key = (intake, tensor.dtype, tensor.shape, op)
            known = _checked_all_reduce.get(key)
            if known is not None:
                return Call((tensor, *known[0]), known[1], tensor)
    x = intake(tensor, writable=True, name="tensor")
    rop = _all_reduce_op(op, x.dtype)
    fp = fingerprint("all_reduce", dtype=x.dtype, shape=x.shape, reduce_op=rop)
    call = Call((x, rop, _factor(op)), fp, tensor)
    if key is not None and x is tensor:
        if len(_checked_all_reduce) >= _CHECKED_SIZE:  # a few call shapes; never unbounded
            _checked_all_reduce.clear()
        _checked_all_reduce[key] = (call.args[1:], fp)
    return call


#: What the checks of an all_reduce found, by (intake, dtype, shape, op): the algorithm's
#: arguments after the array, and the fingerprint (see ``_all_reduce``).
_checked_all_reduce: dict[tuple[object, ...], tuple[tuple[Any, ...], bytes]] = {}
_CHECKED_SIZE = 1024


#: The reductions that reduce a complex array as the pairs of reals it is made of.
_ELEMENTWISE_ON_REALS = frozenset({ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PREMUL_SUM})


@_operation("all_reduce_coalesced")
def _all_reduce_coalesced(intake: Intake, pg: ProcessGroup, tensors: object, op: object) -> Call:
    if not isinstance(tensors, list | tuple) or not tensors:
        raise DistUsageError("tensors must be a non-empty list of arrays")
    xs = [intake(t, writable=True, name=f"tensors[{i}]") for i, t in enumerate(tensors)]
    rop = _all_reduce_op(op, xs[0].dtype)
    for x in xs[1:]:
        _all_reduce_op(op, x.dtype)  # a complex array among them refuses MAX, MIN...
    # As torch: complex arrays may come with arrays of their real dtype (complex64 with
    # float32), and are then reduced as pairs of reals, which only the sums allow.
    reals = [x.reshape(-1).view(x.real.dtype) if x.dtype.kind == "c" else x for x in xs]
    for i, x in enumerate(reals[1:], 1):
        if x.dtype != reals[0].dtype:
            raise DistUsageError(
                f"tensors mixes dtypes: tensors[0] is {xs[0].dtype} but tensors[{i}] is "
                f"{xs[i].dtype}; every entry must have the same dtype (or be complex of it)"
            )
    if any(x.dtype != xs[0].dtype for x in xs):
        if rop not in _ELEMENTWISE_ON_REALS:
            raise DistUsageError(
                f"ReduceOp.{rop.name} cannot reduce complex and real arrays together "
                "(complex arrays go as pairs of reals: only SUM, AVG and PREMUL_SUM)"
            )
        xs = reals
    total = sum(x.size for x in xs)
    # One flat all_reduce to the peers: it matches whatever lists add up alike.
    fp = fingerprint("all_reduce", dtype=xs[0].dtype, shape=(total,), reduce_op=rop)
    return Call((xs, rop, _factor(op)), fp, tensors)


@_operation("reduce")
def _reduce(
    intake: Intake,
    pg: ProcessGroup,
    tensor: object,
    dst: int | None,
    op: object,
    group_dst: int | None,
) -> Call:
    root = _root(pg, dst, group_dst, _DST)
    # The other ranks' arrays are only read.
    x = intake(tensor, writable=pg.rank == root, name="tensor")
    rop = check_reduce_op(op, x.dtype)
    fp = fingerprint("reduce", dtype=x.dtype, shape=x.shape, root=root, reduce_op=rop)
    return Call((x, root, rop, _factor(op)), fp, tensor)


@_operation("reduce_scatter")
def _reduce_scatter(
    intake: Intake, pg: ProcessGroup, output: object, input_list: object, op: object
) -> Call:
    out = intake(output, writable=True, name="output")
    ins = _like_list(intake, input_list, pg.size, "input_list", False, out, "output")
    rop = check_reduce_op(op, out.dtype)
    fp = fingerprint("reduce_scatter", dtype=out.dtype, shape=out.shape, reduce_op=rop)
    return Call((out, ins, rop, _factor(op)), fp, output)


@_operation("reduce_scatter_single", algorithm="reduce_scatter", aliases=("reduce_scatter_tensor",))
def _reduce_scatter_single(
    intake: Intake, pg: ProcessGroup, output: object, input: object, op: object
) -> Call:
    out = intake(output, writable=True, name="output")
    x = intake(input, writable=False, name="input")
    _check_concat(x, out, pg.size, "input", "output")
    rop = check_reduce_op(op, out.dtype)
    fp = fingerprint("reduce_scatter_single", dtype=out.dtype, shape=out.shape, reduce_op=rop)
    flat = out.reshape(-1)
    return Call((flat, _rows(x, pg.size), rop, _factor(op)), fp, output)


# -- data movement --------------------------------------------------------------------------
@_operation("broadcast")
def _broadcast(
    intake: Intake, pg: ProcessGroup, tensor: object, src: int | None, group_src: int | None
) -> Call:
    root = _root(pg, src, group_src, _SRC)
    x = intake(tensor, writable=pg.rank != root, name="tensor")
    fp = fingerprint("broadcast", dtype=x.dtype, shape=x.shape, root=root)
    return Call((x, root), fp, tensor)


@_operation("all_gather")
def _all_gather(intake: Intake, pg: ProcessGroup, tensor_list: object, tensor: object) -> Call:
    x = intake(tensor, writable=False, name="tensor")
    outs = _like_list(intake, tensor_list, pg.size, "tensor_list", True, x, "tensor")
    fp = fingerprint("all_gather", dtype=x.dtype, shape=x.shape)
    return Call((outs, x, None), fp, tensor_list)


@_operation("all_gather_single", algorithm="all_gather", aliases=("all_gather_into_tensor",))
def _all_gather_single(intake: Intake, pg: ProcessGroup, output: object, input: object) -> Call:
    x = intake(input, writable=False, name="input_tensor")
    out = intake(output, writable=True, name="output_tensor")
    _check_concat(out, x, pg.size, "output_tensor", "input_tensor")
    fp = fingerprint("all_gather_single", dtype=x.dtype, shape=x.shape)
    return Call((_rows(out, pg.size), x.reshape(-1), out), fp, output)


@_operation("all_gather_coalesced")
def _all_gather_coalesced(
    intake: Intake, pg: ProcessGroup, output_lists: object, inputs: object
) -> Call:
    if not isinstance(inputs, list | tuple) or not inputs:
        raise DistUsageError("input_tensor_list must be a non-empty list of arrays")
    if not isinstance(output_lists, list | tuple) or len(output_lists) != pg.size:
        raise DistUsageError(
            f"output_tensor_lists must be a list of {pg.size} lists (one per rank), one "
            "array each per input"
        )
    xs = [intake(x, writable=False, name=f"input_tensor_list[{i}]") for i, x in enumerate(inputs)]
    rows = []
    for r, row in enumerate(output_lists):
        if not isinstance(row, list | tuple) or len(row) != len(xs):
            raise DistUsageError(
                f"output_tensor_lists[{r}] must be a list of {len(xs)} arrays, one per input"
            )
        outs = [
            intake(o, writable=True, name=f"output_tensor_lists[{r}][{i}]")
            for i, o in enumerate(row)
        ]
        for i, (o, x) in enumerate(zip(outs, xs, strict=True)):
            _check_like(o, x, f"output_tensor_lists[{r}][{i}]", f"input_tensor_list[{i}]")
        rows.append(outs)
    # One flat gather of every input's bytes.
    total = sum(x.nbytes for x in xs)
    fp = fingerprint("all_gather", dtype=np.dtype(np.uint8), shape=(total,))
    return Call((rows, xs), fp, output_lists)


@_operation("gather")
def _gather(
    intake: Intake,
    pg: ProcessGroup,
    tensor: object,
    gather_list: object,
    dst: int | None,
    group_dst: int | None,
) -> Call:
    root = _root(pg, dst, group_dst, _DST)
    x = intake(tensor, writable=False, name="tensor")
    outs = None
    if pg.rank == root:
        outs = _like_list(intake, gather_list, pg.size, "gather_list", True, x, "tensor")
    else:
        _absent_on_non_root(gather_list, "gather_list", root)
    fp = fingerprint("gather", dtype=x.dtype, shape=x.shape, root=root)
    return Call((outs, x, root), fp, gather_list)


@_operation("gather_single", algorithm="gather", aliases=("gather_into_tensor",))
def _gather_single(
    intake: Intake,
    pg: ProcessGroup,
    tensor: object,
    gather_tensor: object,
    dst: int | None,
    group_dst: int | None,
) -> Call:
    root = _root(pg, dst, group_dst, _DST)
    x = intake(tensor, writable=False, name="tensor")
    rows = None
    if pg.rank == root:
        if gather_tensor is None:
            raise DistUsageError(
                f"gather_tensor must be given on the destination rank (group rank {root})"
            )
        out = intake(gather_tensor, writable=True, name="gather_tensor")
        _check_concat(out, x, pg.size, "gather_tensor", "tensor")
        rows = _rows(out, pg.size)
    fp = fingerprint("gather_single", dtype=x.dtype, shape=x.shape, root=root)
    return Call((rows, x.reshape(-1), root), fp, gather_tensor if pg.rank == root else None)


@_operation("scatter")
def _scatter(
    intake: Intake,
    pg: ProcessGroup,
    tensor: object,
    scatter_list: object,
    src: int | None,
    group_src: int | None,
) -> Call:
    root = _root(pg, src, group_src, _SRC)
    out = intake(tensor, writable=True, name="tensor")
    ins = None
    if pg.rank == root:
        ins = _like_list(intake, scatter_list, pg.size, "scatter_list", False, out, "tensor")
    else:
        _absent_on_non_root(scatter_list, "scatter_list", root)
    fp = fingerprint("scatter", dtype=out.dtype, shape=out.shape, root=root)
    return Call((out, ins, root), fp, tensor)


@_operation("all_to_all")
def _all_to_all(intake: Intake, pg: ProcessGroup, output_list: object, input_list: object) -> Call:
    outs = _array_list(intake, output_list, pg.size, "output_tensor_list", True)
    ins = _array_list(intake, input_list, pg.size, "input_tensor_list", False)
    if outs[0].dtype != ins[0].dtype:
        raise DistUsageError(
            f"output_tensor_list has dtype {outs[0].dtype} but input_tensor_list has dtype "
            f"{ins[0].dtype}; they must match"
        )
    fp = fingerprint("all_to_all", dtype=ins[0].dtype)
    return Call((outs, ins), fp, output_list)


@_operation("all_to_all_single", algorithm="all_to_all")
def _all_to_all_single(
    intake: Intake,
    pg: ProcessGroup,
    output: object,
    input: object,
    output_split_sizes: Sequence[int] | None,
    input_split_sizes: Sequence[int] | None,
) -> Call:
    out = intake(output, writable=True, name="output")
    x = intake(input, writable=False, name="input")
    if out.dtype != x.dtype or 0 in (out.ndim, x.ndim) or out.shape[1:] != x.shape[1:]:
        raise DistUsageError(
            f"output has {_describe(out)} and input has {_describe(x)}; they need the same "
            "dtype and the same trailing dimensions"
        )
    n = pg.size
    outs = _split_rows(out, _splits(output_split_sizes, out.shape[0], n, "output_split_sizes"))
    ins = _split_rows(x, _splits(input_split_sizes, x.shape[0], n, "input_split_sizes"))
    fp = fingerprint("all_to_all_single", dtype=x.dtype)
    return Call((outs, ins), fp, output)


# -- synchronisation -------------------------------------------------------------------------
_BARRIER = Call((), fingerprint("barrier"))


@_operation("barrier")
def _barrier(intake: Intake, pg: ProcessGroup) -> Call:
    return _BARRIER


@_operation("monitored_barrier", "none")
def _monitored_barrier(
    intake: Intake, pg: ProcessGroup, timeout: Timeout, wait_all_ranks: bool
) -> Call:
    seconds = to_seconds(timeout, pg.timeout)
    args = (pg.ranks, seconds, bool(wait_all_ranks))
    return Call(args, fingerprint("monitored_barrier"))


# -- point to point (the peer comes as a group rank, already checked) ------------------------
@_operation("send", public={"isend": "work", "send": "none"})
def _send(intake: Intake, pg: ProcessGroup, peer: int, tensor: object) -> Call:
    return Call((peer, intake(tensor, writable=False, name="tensor")))


@_operation("recv", public={"irecv": "work", "recv": "result"})
def _recv(
    intake: Intake, pg: ProcessGroup, peer: int | None, tensor: object, group_ranks: bool
) -> Call:
    return Call(
        (peer, intake(tensor, writable=True, name="tensor"), pg.ranks if group_ranks else None)
    )


# -- object collectives: pickled, sizes first, on the CPU -----------------------------------
def _dumps(obj: object, name: str, op: str) -> Any:
    try:
        data = pickle.dumps(obj)
    except Exception as exc:
        error = _usage_error_like(type(exc))
        text = f"{op}: {name} cannot be pickled: {type(exc).__name__}: {exc}"
        raise error(text) from exc
    return np.frombuffer(data, np.uint8)


def _usage_error_like(cls: type[Exception]) -> type[DistUsageError]:
    """A ``DistUsageError`` that is also ``cls``, the class of what pickle raised.

    torch lets pickle's own exception through (``AttributeError`` for a local class, say),
    and callers catch that; the usage error rejects the operation on every rank as ours do.
    """
    error = _PICKLING_ERRORS.get(cls)
    if error is None:
        try:
            error = type(cls.__name__, (DistUsageError, cls), {"__module__": __name__})
        except TypeError:  # a class that cannot be a base beside ours (its instance layout)
            error = DistUsageError
        _PICKLING_ERRORS[cls] = error
    return error


_PICKLING_ERRORS: dict[type[Exception], type[DistUsageError]] = {}


def _object_list(value: object, name: str, size: int | None = None) -> list[Any]:
    if not isinstance(value, list):
        raise DistUsageError(f"{name} must be a list, got {type(value).__name__}")
    if size is not None and len(value) != size:
        raise DistUsageError(f"{name} has {len(value)} entries; it needs {size}, one per rank")
    if not value:
        raise DistUsageError(f"{name} is empty")
    return value


def _weights_only(value: object) -> bool:
    """torch's ``weights_only``: the received objects are unpickled as data only."""
    if not isinstance(value, bool):
        raise DistUsageError(f"weights_only must be True or False, got {value!r}")
    return value


@_operation("broadcast_object_list", "none", algorithm="broadcast_objects", nseq=2)
def _broadcast_object_list(
    intake: Intake,
    pg: ProcessGroup,
    object_list: object,
    src: int | None,
    group_src: int | None,
    weights_only: object,
) -> Call:
    root = _root(pg, src, group_src, _SRC)
    objs = _object_list(object_list, "object_list")
    data_only = _weights_only(weights_only)
    mine = pg.rank == root
    op = "broadcast_object_list"
    payloads = [_dumps(o, f"object_list[{i}]", op) for i, o in enumerate(objs)] if mine else []
    fp = fingerprint(op, root=root)
    return Call((objs, payloads, root, data_only), fp)


@_operation("all_gather_object", "none", algorithm="all_gather_objects", nseq=2)
def _all_gather_object(
    intake: Intake, pg: ProcessGroup, object_list: object, obj: object, weights_only: object
) -> Call:
    objs = _object_list(object_list, "object_list", pg.size)
    payload = _dumps(obj, "obj", "all_gather_object")
    return Call((objs, payload, _weights_only(weights_only)), _ALL_GATHER_OBJECT_FP)


_ALL_GATHER_OBJECT_FP = fingerprint("all_gather_object")


@_operation("gather_object", "none", algorithm="gather_objects", nseq=2)
def _gather_object(
    intake: Intake,
    pg: ProcessGroup,
    obj: object,
    object_gather_list: object,
    dst: int | None,
    group_dst: int | None,
    weights_only: object,
) -> Call:
    root = _root(pg, dst, group_dst, _DST)
    data_only = _weights_only(weights_only)
    objs = None
    if pg.rank == root:
        objs = _object_list(object_gather_list, "object_gather_list", pg.size)
    else:
        _absent_on_non_root(object_gather_list, "object_gather_list", root)
    fp = fingerprint("gather_object", root=root)
    return Call((objs, _dumps(obj, "obj", "gather_object"), root, data_only), fp)


@_operation("scatter_object_list", "none", algorithm="scatter_objects", nseq=2)
def _scatter_object_list(
    intake: Intake,
    pg: ProcessGroup,
    output_list: object,
    input_list: object,
    src: int | None,
    group_src: int | None,
    weights_only: object,
) -> Call:
    root = _root(pg, src, group_src, _SRC)
    data_only = _weights_only(weights_only)
    if isinstance(output_list, list) and not output_list:
        raise DistUsageError(  # torch's words
            "Expected argument scatter_object_output_list to be a list of size at least 1 "
            "(it receives this rank's object), got an empty list"
        )
    outs = _object_list(output_list, "scatter_object_output_list")
    payloads = []
    if pg.rank == root:
        ins = _object_list(input_list, "scatter_object_input_list", pg.size)
        payloads = [
            _dumps(o, f"scatter_object_input_list[{i}]", "scatter_object_list")
            for i, o in enumerate(ins)
        ]
    # (On the other ranks the input list is ignored, whatever it holds, as torch documents.)
    fp = fingerprint("scatter_object_list", root=root)
    return Call((outs, payloads, root, data_only), fp)


@_operation("send_object_list", "none", algorithm="send_objects")
def _send_object_list(intake: Intake, pg: ProcessGroup, peer: int, object_list: object) -> Call:
    objs = _object_list(object_list, "object_list")
    payloads = [_dumps(o, f"object_list[{i}]", "send_object_list") for i, o in enumerate(objs)]
    sizes = np.array([p.size for p in payloads], np.int64)
    return Call((peer, sizes, np.concatenate(payloads)))


@_operation("recv_object_list", "result", algorithm="recv_objects")
def _recv_object_list(
    intake: Intake,
    pg: ProcessGroup,
    peer: int | None,
    object_list: object,
    group_ranks: bool,
    weights_only: object,
) -> Call:
    objs = _object_list(object_list, "object_list")
    return Call((peer, objs, pg.ranks, group_ranks, _weights_only(weights_only)))
