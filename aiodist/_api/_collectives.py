"""The async API's operations: collectives, point to point and object collectives.

Each function returns a :class:`~aiodist.group.Work` at once (``await`` it for the result).
It only names its operation (declared in :mod:`aiodist.group._operations`) and hands its
arguments to the group, which reserves the operation's number and plans it with the backend
that serves the device its arrays live on (see :mod:`aiodist._api` for the deadlines every
function takes).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from .. import backends as _backends, group as _group
from .._arrays._reduce import PremulSum, ReduceOp
from .._util._timeouts import Timeout
from ..errors import DistUsageError
from ..group import NonGroupMember, ProcessGroup, Work, resolve_group
from ..group._operations import OPERATIONS

__all__ = [
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_into_tensor",
    "gather_object",
    "gather_single",
    "Group",
    "irecv",
    "isend",
    "monitored_barrier",
    "Op",
    "P2POp",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
]

logger = logging.getLogger(__name__)

#: A group argument: a group, the non-member sentinel, or ``None`` for the default group.
Group = ProcessGroup | NonGroupMember | None
#: A reduction argument.
Op = ReduceOp | int | PremulSum


def _collective(
    name: str, group: Group, args: tuple[Any, ...], timeout: Timeout = None
) -> Work[Any]:
    if isinstance(group, NonGroupMember):
        return _group.not_in_group(name, stacklevel=4)
    nseq = OPERATIONS[name].nseq
    pg = resolve_group(group, name)
    return pg.issue(name, _backends.plan, args, nseq, rejecter=_backends.reject, timeout=timeout)


# -- collectives -----------------------------------------------------------------------------
def all_reduce(
    tensor: Any, op: Op = ReduceOp.SUM, group: Group = None, *, timeout: Timeout = None
) -> Work[Any]:
    """Reduce ``tensor`` across the group, in place on every rank.

    Args:
        tensor: a writable C-contiguous array (numpy, a CPU DLPack tensor, or a CUDA array
            with the CUDA backend), same shape and dtype on every rank.
        op: the reduction.
        group: the group (default: the world).
        timeout: this operation's deadline (see the module docstring); default the
            group's timeout.

    Returns:
        A :class:`Work` whose result is ``tensor``.

    Raises:
        DistUsageError: bad array, or an op the dtype cannot take. The operation is
            rejected: the peers' works fail with the reason and the group stays usable.
        DistError: the group was aborted earlier (the error has the class of the cause).
    """
    return _collective("all_reduce", group, (tensor, op), timeout=timeout)


def all_reduce_coalesced(
    tensors: list[Any],
    op: Op = ReduceOp.SUM,
    group: Group = None,
    *,
    timeout: Timeout = None,
) -> Work[Any]:
    """Reduce every array of ``tensors`` in place, as one operation.

    Returns:
        A :class:`Work` whose result is ``tensors``.

    Raises:
        DistUsageError: an empty list, mixed dtypes, or an op the dtype cannot take.
    """
    return _collective("all_reduce_coalesced", group, (tensors, op), timeout=timeout)


def broadcast(
    tensor: Any,
    src: int | None = None,
    group: Group = None,
    group_src: int | None = None,
    *,
    timeout: Timeout = None,
) -> Work[Any]:
    """Copy ``tensor`` of rank ``src`` into ``tensor`` of every other rank.

    Args:
        tensor: the data on the source, the output elsewhere (writable there).
        src: global rank of the source (default group rank 0).
        group: the group (default: the world).
        group_src: the source as a group rank, instead of ``src``.

    Returns:
        A :class:`Work` whose result is ``tensor``.

    Raises:
        DistUsageError: bad array, or a source outside the group.
    """
    return _collective("broadcast", group, (tensor, src, group_src), timeout=timeout)


def reduce(
    tensor: Any,
    dst: int | None = None,
    op: Op = ReduceOp.SUM,
    group: Group = None,
    group_dst: int | None = None,
    *,
    timeout: Timeout = None,
) -> Work[Any]:
    """Reduce ``tensor`` of every rank into ``tensor`` of rank ``dst``.

    The other ranks' arrays are left unchanged (and may be read-only).

    Returns:
        A :class:`Work` whose result is ``tensor``.

    Raises:
        DistUsageError: bad array, op or destination.
    """
    return _collective("reduce", group, (tensor, dst, op, group_dst), timeout=timeout)


def all_gather(
    tensor_list: list[Any], tensor: Any, group: Group = None, *, timeout: Timeout = None
) -> Work[Any]:
    """Gather ``tensor`` of every rank into ``tensor_list[rank]`` on every rank.

    Returns:
        A :class:`Work` whose result is ``tensor_list``.

    Raises:
        DistUsageError: the list is not one array per rank, or an entry differs from
            ``tensor`` in shape or dtype.
    """
    return _collective("all_gather", group, (tensor_list, tensor), timeout=timeout)


def all_gather_coalesced(
    output_tensor_lists: list[list[Any]],
    input_tensor_list: list[Any],
    group: Group = None,
    *,
    timeout: Timeout = None,
) -> Work[Any]:
    """Gather each array of ``input_tensor_list`` from every rank, as one operation.

    ``output_tensor_lists[r][i]`` receives ``input_tensor_list[i]`` of group rank ``r``.

    Returns:
        A :class:`Work` whose result is ``output_tensor_lists``.

    Raises:
        DistUsageError: lists of the wrong length, or entries that do not match.
    """
    args = (output_tensor_lists, input_tensor_list)
    return _collective("all_gather_coalesced", group, args, timeout=timeout)


def all_gather_single(
    output_tensor: Any, input_tensor: Any, group: Group = None, *, timeout: Timeout = None
) -> Work[Any]:
    """Gather ``input_tensor`` of every rank, concatenated in rank order, into ``output_tensor``.

    ``output_tensor`` holds ``group size`` times the elements of ``input_tensor`` (any
    shape, e.g. ``(size * n, ...)`` or ``(size, n, ...)``).

    Returns:
        A :class:`Work` whose result is ``output_tensor``.

    Raises:
        DistUsageError: sizes or dtypes do not fit.
    """
    args = (output_tensor, input_tensor)
    return _collective("all_gather_single", group, args, timeout=timeout)


def all_gather_into_tensor(
    output_tensor: Any, input_tensor: Any, group: Group = None, *, timeout: Timeout = None
) -> Work[Any]:
    """:func:`all_gather_single` under its older name (torch 2.13 deprecates this one).

    A call matches a peer's call of :func:`all_gather_single` with the same arrays.
    """
    args = (output_tensor, input_tensor)
    return _collective("all_gather_into_tensor", group, args, timeout=timeout)


def gather(
    tensor: Any,
    gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: Group = None,
    group_dst: int | None = None,
    *,
    timeout: Timeout = None,
) -> Work[Any]:
    """Gather ``tensor`` of every rank into ``gather_list`` on rank ``dst``.

    ``gather_list`` is given on the destination only (one array per rank).

    Returns:
        A :class:`Work` whose result is ``gather_list``.

    Raises:
        DistUsageError: a bad list, or a list given on another rank.
    """
    return _collective("gather", group, (tensor, gather_list, dst, group_dst), timeout=timeout)


def gather_single(
    tensor: Any,
    gather_tensor: Any = None,
    dst: int | None = None,
    group: Group = None,
    group_dst: int | None = None,
    *,
    timeout: Timeout = None,
) -> Work[Any]:
    """Gather ``tensor`` of every rank into one array, ``gather_tensor``, on rank ``dst``.

    ``gather_tensor`` (given on the destination; ignored elsewhere) holds the group's
    arrays one after the other in rank order: ``size`` times as many elements as
    ``tensor``, flat or stacked (``(size, *tensor.shape)``).

    Returns:
        A :class:`Work` whose result is ``gather_tensor`` on the destination, ``None``
        elsewhere.

    Raises:
        DistUsageError: no ``gather_tensor`` on the destination, or one of another size or
            dtype.
    """
    args = (tensor, gather_tensor, dst, group_dst)
    return _collective("gather_single", group, args, timeout=timeout)


def gather_into_tensor(
    tensor: Any,
    gather_tensor: Any = None,
    dst: int | None = None,
    group: Group = None,
    group_dst: int | None = None,
    *,
    timeout: Timeout = None,
) -> Work[Any]:
    """:func:`gather_single` under its other name (torch 2.15 has both).

    A call matches a peer's call of :func:`gather_single` with the same arrays.
    """
    args = (tensor, gather_tensor, dst, group_dst)
    return _collective("gather_into_tensor", group, args, timeout=timeout)


def scatter(
    tensor: Any,
    scatter_list: list[Any] | None = None,
    src: int | None = None,
    group: Group = None,
    group_src: int | None = None,
    *,
    timeout: Timeout = None,
) -> Work[Any]:
    """Copy ``scatter_list[i]`` of rank ``src`` into ``tensor`` of group rank ``i``.

    Returns:
        A :class:`Work` whose result is ``tensor``.

    Raises:
        DistUsageError: a bad list, or a list given on another rank.
    """
    return _collective("scatter", group, (tensor, scatter_list, src, group_src), timeout=timeout)


def reduce_scatter(
    output: Any,
    input_list: list[Any],
    op: Op = ReduceOp.SUM,
    group: Group = None,
    *,
    timeout: Timeout = None,
) -> Work[Any]:
    """Reduce ``input_list[i]`` of every rank into ``output`` of group rank ``i``.

    Returns:
        A :class:`Work` whose result is ``output``.

    Raises:
        DistUsageError: the list is not one array per rank shaped like ``output``.
    """
    return _collective("reduce_scatter", group, (output, input_list, op), timeout=timeout)


def reduce_scatter_single(
    output: Any,
    input: Any,
    op: Op = ReduceOp.SUM,
    group: Group = None,
    *,
    timeout: Timeout = None,
) -> Work[Any]:
    """Reduce-scatter ``input`` (``group size`` blocks of ``output``'s size) into ``output``.

    Returns:
        A :class:`Work` whose result is ``output``.

    Raises:
        DistUsageError: sizes or dtypes do not fit.
    """
    return _collective("reduce_scatter_single", group, (output, input, op), timeout=timeout)


def reduce_scatter_tensor(
    output: Any,
    input: Any,
    op: Op = ReduceOp.SUM,
    group: Group = None,
    *,
    timeout: Timeout = None,
) -> Work[Any]:
    """:func:`reduce_scatter_single` under its older name (torch 2.13 deprecates this one).

    A call matches a peer's call of :func:`reduce_scatter_single` with the same arrays.
    """
    return _collective("reduce_scatter_tensor", group, (output, input, op), timeout=timeout)


def all_to_all(
    output_tensor_list: list[Any],
    input_tensor_list: list[Any],
    group: Group = None,
    *,
    timeout: Timeout = None,
) -> Work[Any]:
    """Send ``input_tensor_list[i]`` to group rank ``i``; receive into ``output_tensor_list[j]``.

    Returns:
        A :class:`Work` whose result is ``output_tensor_list``.

    Raises:
        DistUsageError: lists of the wrong length or mixed dtypes.
    """
    return _collective(
        "all_to_all", group, (output_tensor_list, input_tensor_list), timeout=timeout
    )


def all_to_all_single(
    output: Any,
    input: Any,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: Group = None,
    *,
    timeout: Timeout = None,
) -> Work[Any]:
    """Split ``input`` along dimension 0, send piece ``i`` to rank ``i``, concatenate into ``output``.

    Without split sizes, dimension 0 is split evenly.

    Returns:
        A :class:`Work` whose result is ``output``.

    Raises:
        DistUsageError: split sizes that do not add up, or mismatched dtypes or trailing
            dimensions.
    """
    args = (output, input, output_split_sizes, input_split_sizes)
    return _collective("all_to_all_single", group, args, timeout=timeout)


def barrier(
    group: Group = None, device_ids: Sequence[int] | None = None, *, timeout: Timeout = None
) -> Work[None]:
    """Wait until every rank of ``group`` has entered the barrier.

    ``device_ids`` is accepted for torch compatibility and ignored.

    Raises:
        DistError: the group was aborted earlier.
    """
    return _collective("barrier", group, (), timeout=timeout)


def monitored_barrier(
    group: Group = None, timeout: Timeout = None, wait_all_ranks: bool = False
) -> Work[None]:
    """A barrier that names the ranks which did not arrive within ``timeout``.

    Every rank checks in with group rank 0, which releases them all once everyone arrived.
    If some rank does not arrive in time, rank 0 fails with :class:`~aiodist.errors.DistTimeoutError`
    naming it (with ``wait_all_ranks``, naming every missing rank), and the group is
    aborted so the other ranks fail too.

    Args:
        group: the group (default: the world).
        timeout: how long to wait; default the group's timeout.
        wait_all_ranks: collect every missing rank instead of stopping at the first.

    Raises:
        DistTimeoutError: (from the work) ranks missing at the deadline.
    """
    return _collective("monitored_barrier", group, (timeout, wait_all_ranks))


# -- point to point -------------------------------------------------------------------------
def isend(
    tensor: Any,
    dst: int | None = None,
    group: Group = None,
    tag: int = 0,
    group_dst: int | None = None,
    *,
    timeout: Timeout = None,
) -> Work[None]:
    """Send ``tensor`` to rank ``dst`` with ``tag``.

    The work completes once the transport no longer needs ``tensor``: at once (not when
    the peer has received it) while the message fits in what the receiver stages for this
    rank (``$AIODIST_STAGING_BYTES``, 16 MiB by default, less what it holds already);
    a larger message waits until the receiver posts the matching receive, as gloo's and
    MPI's large sends do. Messages with the same tag between two ranks arrive in order. A
    send whose checks fail is rejected: the receive that would have taken its message
    fails with the reason instead.

    Raises:
        DistUsageError: no or invalid destination (sending to oneself included), bad tag,
            bad array; the work fails with it if the receive that took a message that
            waited for it has another size.
    """
    if isinstance(group, NonGroupMember):
        return _group.not_in_group("isend")
    pg = resolve_group(group, "send")
    return pg.issue_p2p(
        "send",
        _backends.plan,
        (tensor,),
        peer=dst,
        group_peer=group_dst,
        tag=tag,
        sends=True,
        timeout=timeout,
    )


def irecv(
    tensor: Any,
    src: int | None = None,
    group: Group = None,
    tag: int = 0,
    group_src: int | None = None,
    *,
    timeout: Timeout = None,
) -> Work[int]:
    """Receive a message with ``tag`` into ``tensor`` from rank ``src`` (``None``: any rank).

    Returns:
        A :class:`Work` whose result is the sender: its global rank, or its group rank
        when ``group_src`` was used.

    Raises:
        DistUsageError: invalid source (oneself included), bad tag, read-only array; the
            work fails with it if the message's size differs from ``tensor``'s, or if the
            sender rejected its send.
    """
    if isinstance(group, NonGroupMember):
        return _group.not_in_group("irecv", -1)
    pg = resolve_group(group, "recv")
    args = (tensor, group_src is not None)
    return pg.issue_p2p(
        "recv",
        _backends.plan,
        args,
        peer=src,
        group_peer=group_src,
        tag=tag,
        sends=False,
        timeout=timeout,
    )


#: In the async API ``send`` and ``recv`` return a :class:`Work` like ``isend``/``irecv``.
send = isend
recv = irecv


def send_object_list(
    object_list: list[Any],
    dst: int | None = None,
    group: Group = None,
    device: object = None,
    group_dst: int | None = None,
    use_batch: bool = False,
    weights_only: bool = False,
    *,
    timeout: Timeout = None,
) -> Work[None]:
    """Send the picklable objects of ``object_list`` to rank ``dst`` (see :func:`recv_object_list`).

    ``device`` and ``use_batch`` are accepted for torch compatibility and ignored, and so is
    ``weights_only``: the receiver's decides how it unpickles.

    Raises:
        DistUsageError: not a non-empty list, an object that cannot be pickled, or a bad
            destination.
    """
    if isinstance(group, NonGroupMember):
        return _group.not_in_group("send_object_list")
    pg = resolve_group(group, "send_object_list")
    return pg.issue_p2p(
        "send_object_list",
        _backends.plan,
        (object_list,),
        peer=dst,
        group_peer=group_dst,
        tag=0,
        sends=True,
        timeout=timeout,
    )


def recv_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: Group = None,
    device: object = None,
    group_src: int | None = None,
    use_batch: bool = False,
    weights_only: bool = False,
    *,
    timeout: Timeout = None,
) -> Work[int]:
    """Receive objects sent with :func:`send_object_list` into ``object_list``, in place.

    ``object_list`` must have as many entries as the sender's list. ``weights_only=True`` unpickles data only (builtin values, containers, numpy arrays) and
    refuses anything else with a :class:`~aiodist.errors.DistError`, as torch's
    ``weights_only``. ``device`` and ``use_batch`` are accepted for torch compatibility and
    ignored. Unpickling runs code
    chosen by the sender: use only between trusted ranks.

    Returns:
        A :class:`Work` whose result is the sender's rank (global, or the group rank when
        ``group_src`` was used).

    Raises:
        DistUsageError: not a non-empty list, or a list of another length than the sender's.
    """
    if isinstance(group, NonGroupMember):
        return _group.not_in_group("recv_object_list", -1)
    pg = resolve_group(group, "recv_object_list")
    args = (object_list, group_src is not None, weights_only)
    return pg.issue_p2p(
        "recv_object_list",
        _backends.plan,
        args,
        peer=src,
        group_peer=group_src,
        tag=0,
        sends=False,
        timeout=timeout,
    )


class P2POp:
    """One send or receive of a :func:`batch_isend_irecv` batch.

    Args:
        op: :func:`isend` or :func:`irecv` (``send``/``recv`` are the same functions).
        tensor: the array to send or receive into.
        peer: global rank of the peer.
        group: the group (default: the world).
        tag: the message tag.
        group_peer: the peer as a group rank, instead of ``peer``.

    Raises:
        DistUsageError: ``op`` is not isend or irecv.
    """

    def __init__(
        self,
        op: Callable[..., Work[Any]],
        tensor: Any,
        peer: int | None = None,
        group: Group = None,
        tag: int = 0,
        group_peer: int | None = None,
    ) -> None:
        if op is not isend and op is not irecv:
            raise DistUsageError(f"P2POp: op must be aiodist.isend or aiodist.irecv, got {op!r}")
        self.op = op
        self.tensor = tensor
        self.peer = peer
        self.group = group
        self.tag = tag
        self.group_peer = group_peer

    def __repr__(self) -> str:
        peer = f"group_peer={self.group_peer}" if self.peer is None else f"peer={self.peer}"
        return f"<P2POp {self.op.__name__} {peer} tag={self.tag}>"


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work[Any]]:
    """Start every send and receive of ``p2p_op_list``; return their works in order.

    Every entry is checked before any is started: if one fails its checks, none starts, the
    error names the entry, and the receivers of the batch's sends are told.

    Raises:
        DistUsageError: an empty list, an entry that is not a :class:`P2POp`, ops on
            different groups, or an entry that failed its checks.
    """
    if not isinstance(p2p_op_list, list | tuple) or not p2p_op_list:
        raise DistUsageError("batch_isend_irecv: p2p_op_list must be a non-empty list of P2POp")
    for p in p2p_op_list:
        if not isinstance(p, P2POp):
            raise DistUsageError(f"batch_isend_irecv: expected P2POp entries, got {p!r}")
    if len({id(p.group) for p in p2p_op_list}) != 1:
        raise DistUsageError("batch_isend_irecv: every P2POp of a batch must use the same group")
    if isinstance(p2p_op_list[0].group, NonGroupMember):
        work = _group.not_in_group("batch_isend_irecv")
        return [work for _ in p2p_op_list]
    pg = resolve_group(p2p_op_list[0].group, "batch_isend_irecv")
    entries = [
        (
            ("send", _backends.plan, (p.tensor,), p.peer, p.group_peer, p.tag)
            if p.op is isend
            else (
                "recv",
                _backends.plan,
                (p.tensor, p.group_peer is not None),
                p.peer,
                p.group_peer,
                p.tag,
            )
        )
        for p in p2p_op_list
    ]
    return pg.issue_batch(entries)


# -- object collectives ----------------------------------------------------------------------
def broadcast_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: Group = None,
    device: object = None,
    group_src: int | None = None,
    weights_only: bool = False,
    *,
    timeout: Timeout = None,
) -> Work[list[Any]]:
    """Broadcast the picklable objects of ``object_list`` from ``src``, in place elsewhere.

    Every rank passes a list of the same length; the sizes of the pickles travel first.
    Unpickling runs code chosen by the sender: use only between trusted ranks, or
    ``weights_only=True`` unpickles data only (builtin values, containers, numpy arrays) and
    refuses anything else with a :class:`~aiodist.errors.DistError`, as torch's
    ``weights_only``. ``device`` is accepted for torch compatibility and ignored.

    Returns:
        A :class:`Work` whose result is ``object_list``.

    Raises:
        DistUsageError: not a non-empty list, or an object that cannot be pickled.
    """
    args = (object_list, src, group_src, weights_only)
    return _collective("broadcast_object_list", group, args, timeout=timeout)


def all_gather_object(
    object_list: list[Any],
    obj: Any,
    group: Group = None,
    weights_only: bool = False,
    *,
    timeout: Timeout = None,
) -> Work[list[Any]]:
    """Gather the picklable ``obj`` of every rank into ``object_list`` (one slot per rank).

    ``weights_only=True`` unpickles data only (builtin values, containers, numpy arrays) and
    refuses anything else with a :class:`~aiodist.errors.DistError`, as torch's
    ``weights_only``.

    Returns:
        A :class:`Work` whose result is ``object_list``.

    Raises:
        DistUsageError: the list length is not the group size, or ``obj`` cannot be pickled.
    """
    args = (object_list, obj, weights_only)
    return _collective("all_gather_object", group, args, timeout=timeout)


def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: Group = None,
    group_dst: int | None = None,
    weights_only: bool = False,
    *,
    timeout: Timeout = None,
) -> Work[list[Any] | None]:
    """Gather the picklable ``obj`` of every rank into ``object_gather_list`` on ``dst``.

    ``weights_only=True`` unpickles data only (builtin values, containers, numpy arrays) and
    refuses anything else with a :class:`~aiodist.errors.DistError`, as torch's
    ``weights_only``.

    Returns:
        A :class:`Work` whose result is ``object_gather_list`` (``None`` elsewhere).

    Raises:
        DistUsageError: a bad list on the destination, a list on another rank, or ``obj``
            cannot be pickled.
    """
    args = (obj, object_gather_list, dst, group_dst, weights_only)
    return _collective("gather_object", group, args, timeout=timeout)


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int | None = None,
    group: Group = None,
    group_src: int | None = None,
    weights_only: bool = False,
    *,
    timeout: Timeout = None,
) -> Work[list[Any]]:
    """Send ``scatter_object_input_list[i]`` of ``src`` to rank ``i``'s output list slot 0.

    ``weights_only=True`` unpickles data only (builtin values, containers, numpy arrays) and
    refuses anything else with a :class:`~aiodist.errors.DistError`, as torch's
    ``weights_only``.

    Returns:
        A :class:`Work` whose result is ``scatter_object_output_list``.

    Raises:
        DistUsageError: bad lists, or an object that cannot be pickled.
    """
    args = (scatter_object_output_list, scatter_object_input_list, src, group_src, weights_only)
    return _collective("scatter_object_list", group, args, timeout=timeout)
