"""The async public API: ``init_process_group``, collectives, point-to-point, object ops.

Collectives and point-to-point operations return a :class:`~aiodist.group.Work` at once
(``await`` it for the result); what talks to the network to set up or tear down
(``init_process_group``, ``new_group``, ``destroy_process_group``) is a coroutine; the
introspection functions are plain functions. Keyword names follow ``torch.distributed``:
``src``/``dst`` are global ranks, ``group_src``/``group_dst`` ranks within ``group``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from . import group as _group
from ._auth import resolve_token
from ._ops import ReduceOp
from ._timeouts import Timeout, to_seconds
from .backends import cpu as _cpu
from .errors import DistUsageError
from .group import (
    DEFAULT_PG_TIMEOUT,
    NON_GROUP_MEMBER,
    NonGroupMember,
    ProcessGroup,
    Work,
    new_group,
    new_subgroups,
    parse_backend,
    resolve_group,
    start_world,
)
from .store import PrefixStore, Store

__all__ = [
    "NON_GROUP_MEMBER",
    "P2POp",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "gather",
    "gather_object",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "irecv",
    "is_initialized",
    "isend",
    "monitored_barrier",
    "new_group",
    "new_subgroups",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
]

logger = logging.getLogger(__name__)

Group = ProcessGroup | NonGroupMember | None


# -- set-up and tear-down -------------------------------------------------------------------
async def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: Timeout = None,
    world_size: int = -1,
    rank: int = -1,
    store: Store | None = None,
    group_name: str = "",
    *,
    auth_token: str | bytes | None = None,
) -> ProcessGroup:
    """Join the job's ranks into the default process group of the current context.

    Either hand over a ``store`` (then ``rank`` and ``world_size`` are required), or an
    ``init_method`` URL for :func:`aiodist.rendezvous.rendezvous` (``None`` means
    ``"env://"``: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). The ranks then
    publish their transport addresses in the store under a namespace of their own
    (``aiodist/<group_name>/<generation>/``, the generation counting the times this world
    size joined under that name), so several jobs or restarts can share one store.

    The default group lives in a :class:`contextvars.ContextVar`: the task that calls this
    (and tasks it creates afterwards) see it; other tasks of the same loop can hold other
    worlds.

    Args:
        backend: ``"cpu"`` (alias ``"gloo"``), ``"cpu:gloo,cuda:nccl"`` or ``None`` (cpu).
        init_method: rendezvous URL; exclusive with ``store``.
        timeout: limit of each operation (seconds or ``timedelta``), also the rendezvous
            and connection timeout; default 30 minutes as in torch.
        world_size: the number of ranks (required with ``store``).
        rank: this process's rank (required with ``store``).
        store: an already connected store shared by all ranks.
        group_name: namespace of this job's keys in the store.
        auth_token: shared secret that the TCPStore made by the rendezvous and every
            connection between ranks must prove they hold (HMAC challenge-response);
            ``None`` reads ``$AIODIST_AUTH_TOKEN``; unset means no authentication. Every
            rank needs the same token.

    Returns:
        The default :class:`ProcessGroup`.

    Raises:
        DistUsageError: already initialized, both or wrong ``store``/``init_method``
            arguments, bad rank or world size, or an unknown backend.
        DistTimeoutError: the rendezvous or the connections did not complete in time.
        DistNetworkError: the store or a peer could not be reached.
    """
    if _group.peek_world() is not None:
        raise DistUsageError("trying to initialize the default process group twice")
    name = parse_backend(backend)
    seconds = to_seconds(timeout, DEFAULT_PG_TIMEOUT)
    token = resolve_token(auth_token)
    if not isinstance(group_name, str):
        raise DistUsageError(f"group_name must be a string, got {type(group_name).__name__}")
    owned: list[Store] = []
    if store is not None:
        if init_method is not None:
            raise DistUsageError("init_process_group: pass either store or init_method, not both")
        if not isinstance(store, Store):
            raise DistUsageError(
                f"init_process_group: store must be an aiodist Store, got {type(store).__name__}"
            )
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
            raise DistUsageError(
                f"init_process_group: world_size must be a positive int with store=, "
                f"got {world_size!r}"
            )
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise DistUsageError(
                f"init_process_group: rank must be in [0, {world_size}) with store=, got {rank!r}"
            )
    else:
        from .rendezvous import rendezvous

        store, rank, world_size = await rendezvous(
            init_method or "env://", rank, world_size, timeout=seconds, auth_token=token
        )
        owned.append(store)
    try:
        namespace = f"aiodist/{group_name or 'default_pg'}"
        joined = await store.add(f"{namespace}/joined/{world_size}", 1)
        prefixed = PrefixStore(f"{namespace}/{world_size}/{(joined - 1) // world_size}", store)
        transport = await _connect(prefixed, rank, world_size, seconds, token)
    except BaseException:
        for s in owned:
            await s.aclose()
        raise
    logger.debug("rank %d/%d joined %s", rank, world_size, prefixed.prefix)
    if os.environ.get("AIODIST_FR_DUMP_DIR"):
        # Opted in through the environment (aiodist-run passes it on to its workers).
        from .debug import install_signal_handler

        install_signal_handler()
    return start_world(transport, prefixed, backend=name, timeout=seconds, owned=owned)


async def _connect(
    store: Store, rank: int, world_size: int, timeout: float | None, token: bytes | None
) -> Any:
    from .transport.tcp import TCPTransport

    # Listen on loopback unless the job spans hosts: AIODIST_HOST names the address to
    # listen on and publish; a non-loopback MASTER_ADDR means "all interfaces".
    host = os.environ.get("AIODIST_HOST")
    if host is None:
        master = os.environ.get("MASTER_ADDR", "127.0.0.1")
        host = "127.0.0.1" if master in ("localhost", "::1") or master.startswith("127.") else ""
    return await TCPTransport.create(
        store, rank, world_size, host=host, timeout=timeout, auth_token=token
    )


async def destroy_process_group(group: Group = None) -> None:
    """Destroy ``group``, or (``None`` or the default group) every group of this context.

    Destroying the default group fails the operations still running, closes every
    connection and task the world opened (and the store, if ``init_process_group`` made it)
    and leaves the context uninitialized. Later operations on a destroyed group raise at
    once.

    Raises:
        DistUsageError: not initialized, or ``group`` is not a process group.
    """
    if isinstance(group, NonGroupMember):
        return
    world = _group.current_world("destroy_process_group")
    if group is None or group is world.default_group:
        _group.set_current_world(None)
        await world.close()
        return
    if not isinstance(group, ProcessGroup) or group.world is not world:
        raise DistUsageError(f"destroy_process_group: invalid process group {group!r}")
    await group.destroy()


def is_initialized() -> bool:
    """Return whether the current context has a default process group."""
    return _group.peek_world() is not None


def get_rank(group: Group = None) -> int:
    """Return this rank in ``group`` (default: the global rank); ``-1`` for a non-member.

    Raises:
        DistUsageError: not initialized.
    """
    if isinstance(group, NonGroupMember):
        return -1
    return resolve_group(group, "get_rank").rank


def get_world_size(group: Group = None) -> int:
    """Return the number of ranks in ``group``; ``-1`` for a non-member.

    Raises:
        DistUsageError: not initialized.
    """
    if isinstance(group, NonGroupMember):
        return -1
    return resolve_group(group, "get_world_size").size


def get_backend(group: Group = None) -> str:
    """Return the backend name of ``group`` (``"cpu"``).

    Raises:
        DistUsageError: not initialized, or a non-member sentinel.
    """
    return resolve_group(group, "get_backend").backend


def get_process_group_ranks(group: Group = None) -> list[int]:
    """Return the global ranks of ``group``, in group-rank order.

    Raises:
        DistUsageError: not initialized, or a non-member sentinel.
    """
    return list(resolve_group(group, "get_process_group_ranks").ranks)


def get_group_rank(group: Group, global_rank: int) -> int:
    """Return the group rank of ``global_rank`` in ``group``.

    Raises:
        DistUsageError: ``global_rank`` is not in the group.
    """
    return resolve_group(group, "get_group_rank").group_rank(global_rank, "global_rank")


def get_global_rank(group: Group, group_rank: int) -> int:
    """Return the global rank of ``group_rank`` in ``group``.

    Raises:
        DistUsageError: ``group_rank`` is out of range.
    """
    return resolve_group(group, "get_global_rank").global_rank(group_rank)


# -- helpers ---------------------------------------------------------------------------------
def _root(
    pg: ProcessGroup,
    op: str,
    global_rank: int | None,
    group_rank: int | None,
    names: tuple[str, str],
    default: int | None = 0,
) -> int | None:
    """Resolve a ``src``/``group_src`` pair to a group rank (``default`` when neither)."""
    if global_rank is not None and group_rank is not None:
        raise DistUsageError(f"{op}: pass either {names[0]} or {names[1]}, not both")
    if group_rank is not None:
        pg.global_rank(group_rank, f"{op}: {names[1]}")
        return group_rank
    if global_rank is not None:
        return pg.group_rank(global_rank, f"{op}: {names[0]}")
    return default


def _rooted(
    op: str,
    group: Group,
    global_rank: int | None,
    group_rank: int | None,
    names: tuple[str, str],
) -> tuple[ProcessGroup, int]:
    pg = resolve_group(group, op)
    with pg.checking(op):
        root = _root(pg, op, global_rank, group_rank, names)
    assert root is not None
    return pg, root


# -- collectives -----------------------------------------------------------------------------
def all_reduce(tensor: Any, op: ReduceOp | int = ReduceOp.SUM, group: Group = None) -> Work[Any]:
    """Reduce ``tensor`` across the group, in place on every rank.

    Args:
        tensor: a writable C-contiguous numpy array (or CPU DLPack tensor), same shape and
            dtype on every rank.
        op: the reduction.
        group: the group (default: the world).

    Returns:
        A :class:`Work` whose result is ``tensor``.

    Raises:
        DistUsageError: bad array, or an op the dtype cannot take (the group is aborted,
            so the peers fail too).
        DistNetworkError: the group was aborted earlier.
    """
    return _cpu.all_reduce(resolve_group(group, "all_reduce"), tensor, op)


def broadcast(
    tensor: Any, src: int | None = None, group: Group = None, group_src: int | None = None
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
    pg, root = _rooted("broadcast", group, src, group_src, ("src", "group_src"))
    return _cpu.broadcast(pg, tensor, root)


def reduce(
    tensor: Any,
    dst: int | None = None,
    op: ReduceOp | int = ReduceOp.SUM,
    group: Group = None,
    group_dst: int | None = None,
) -> Work[Any]:
    """Reduce ``tensor`` of every rank into ``tensor`` of rank ``dst``.

    The other ranks' arrays are left unchanged (and may be read-only).

    Returns:
        A :class:`Work` whose result is ``tensor``.

    Raises:
        DistUsageError: bad array, op or destination.
    """
    pg, root = _rooted("reduce", group, dst, group_dst, ("dst", "group_dst"))
    return _cpu.reduce(pg, tensor, root, op)


def all_gather(tensor_list: list[Any], tensor: Any, group: Group = None) -> Work[Any]:
    """Gather ``tensor`` of every rank into ``tensor_list[rank]`` on every rank.

    Returns:
        A :class:`Work` whose result is ``tensor_list``.

    Raises:
        DistUsageError: the list is not one array per rank, or an entry differs from
            ``tensor`` in shape or dtype.
    """
    return _cpu.all_gather(resolve_group(group, "all_gather"), tensor_list, tensor)


def all_gather_into_tensor(output_tensor: Any, input_tensor: Any, group: Group = None) -> Work[Any]:
    """Gather ``input_tensor`` of every rank, concatenated in rank order, into ``output_tensor``.

    ``output_tensor`` holds ``group size`` times the elements of ``input_tensor`` (any
    shape, e.g. ``(size * n, ...)`` or ``(size, n, ...)``).

    Returns:
        A :class:`Work` whose result is ``output_tensor``.

    Raises:
        DistUsageError: sizes or dtypes do not fit.
    """
    pg = resolve_group(group, "all_gather_into_tensor")
    return _cpu.all_gather_into_tensor(pg, output_tensor, input_tensor)


def gather(
    tensor: Any,
    gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: Group = None,
    group_dst: int | None = None,
) -> Work[Any]:
    """Gather ``tensor`` of every rank into ``gather_list`` on rank ``dst``.

    ``gather_list`` is given on the destination only (one array per rank).

    Returns:
        A :class:`Work` whose result is ``gather_list``.

    Raises:
        DistUsageError: a bad list, or a list given on another rank.
    """
    pg, root = _rooted("gather", group, dst, group_dst, ("dst", "group_dst"))
    return _cpu.gather(pg, tensor, gather_list, root)


def scatter(
    tensor: Any,
    scatter_list: list[Any] | None = None,
    src: int | None = None,
    group: Group = None,
    group_src: int | None = None,
) -> Work[Any]:
    """Copy ``scatter_list[i]`` of rank ``src`` into ``tensor`` of group rank ``i``.

    Returns:
        A :class:`Work` whose result is ``tensor``.

    Raises:
        DistUsageError: a bad list, or a list given on another rank.
    """
    pg, root = _rooted("scatter", group, src, group_src, ("src", "group_src"))
    return _cpu.scatter(pg, tensor, scatter_list, root)


def reduce_scatter(
    output: Any, input_list: list[Any], op: ReduceOp | int = ReduceOp.SUM, group: Group = None
) -> Work[Any]:
    """Reduce ``input_list[i]`` of every rank into ``output`` of group rank ``i``.

    Returns:
        A :class:`Work` whose result is ``output``.

    Raises:
        DistUsageError: the list is not one array per rank shaped like ``output``.
    """
    return _cpu.reduce_scatter(resolve_group(group, "reduce_scatter"), output, input_list, op)


def reduce_scatter_tensor(
    output: Any, input: Any, op: ReduceOp | int = ReduceOp.SUM, group: Group = None
) -> Work[Any]:
    """Reduce-scatter ``input`` (``group size`` blocks of ``output``'s size) into ``output``.

    Returns:
        A :class:`Work` whose result is ``output``.

    Raises:
        DistUsageError: sizes or dtypes do not fit.
    """
    pg = resolve_group(group, "reduce_scatter_tensor")
    return _cpu.reduce_scatter_tensor(pg, output, input, op)


def all_to_all(
    output_tensor_list: list[Any], input_tensor_list: list[Any], group: Group = None
) -> Work[Any]:
    """Send ``input_tensor_list[i]`` to group rank ``i``; receive into ``output_tensor_list[j]``.

    Returns:
        A :class:`Work` whose result is ``output_tensor_list``.

    Raises:
        DistUsageError: lists of the wrong length or mixed dtypes.
    """
    pg = resolve_group(group, "all_to_all")
    return _cpu.all_to_all(pg, output_tensor_list, input_tensor_list)


def all_to_all_single(
    output: Any,
    input: Any,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: Group = None,
) -> Work[Any]:
    """Split ``input`` along dimension 0, send piece ``i`` to rank ``i``, concatenate into ``output``.

    Without split sizes, dimension 0 is split evenly.

    Returns:
        A :class:`Work` whose result is ``output``.

    Raises:
        DistUsageError: split sizes that do not add up, or mismatched dtypes or trailing
            dimensions.
    """
    pg = resolve_group(group, "all_to_all_single")
    return _cpu.all_to_all_single(pg, output, input, output_split_sizes, input_split_sizes)


def barrier(group: Group = None, device_ids: Sequence[int] | None = None) -> Work[None]:
    """Wait until every rank of ``group`` has entered the barrier.

    ``device_ids`` is accepted for torch compatibility and ignored.

    Raises:
        DistNetworkError: the group was aborted earlier.
    """
    return _cpu.barrier(resolve_group(group, "barrier"))


def monitored_barrier(
    group: Group = None, timeout: Timeout = None, wait_all_ranks: bool = False
) -> Work[None]:
    """A barrier that names the ranks which did not arrive within ``timeout``.

    Every rank checks in with group rank 0, which releases them all once everyone arrived.
    If some rank does not arrive in time, rank 0 fails with :class:`DistTimeoutError`
    naming it (with ``wait_all_ranks``, naming every missing rank), and the group is
    aborted so the other ranks fail too.

    Args:
        group: the group (default: the world).
        timeout: how long to wait; default the group's timeout.
        wait_all_ranks: collect every missing rank instead of stopping at the first.

    Raises:
        DistTimeoutError: (from the work) ranks missing at the deadline.
    """
    pg = resolve_group(group, "monitored_barrier")
    return _cpu.monitored_barrier(pg, timeout, wait_all_ranks)


# -- point to point -------------------------------------------------------------------------
def isend(
    tensor: Any,
    dst: int | None = None,
    group: Group = None,
    tag: int = 0,
    group_dst: int | None = None,
) -> Work[None]:
    """Send ``tensor`` to rank ``dst`` with ``tag``.

    The work completes once the transport no longer needs ``tensor`` (not when the peer
    has received it). Messages with the same tag between two ranks arrive in order.

    Raises:
        DistUsageError: no or invalid destination (sending to oneself included), bad tag.
    """
    pg = resolve_group(group, "send")
    with pg.checking("send"):
        peer = _root(pg, "send", dst, group_dst, ("dst", "group_dst"), default=None)
        if peer is None:
            raise DistUsageError("send: a destination is required (dst or group_dst)")
    return _cpu.send(pg, tensor, peer, tag)


def irecv(
    tensor: Any,
    src: int | None = None,
    group: Group = None,
    tag: int = 0,
    group_src: int | None = None,
) -> Work[int]:
    """Receive a message with ``tag`` into ``tensor`` from rank ``src`` (``None``: any rank).

    Returns:
        A :class:`Work` whose result is the sender: its global rank, or its group rank
        when ``group_src`` was used.

    Raises:
        DistUsageError: invalid source (oneself included), bad tag, read-only array; the
            work fails with it if the message's size differs from ``tensor``'s.
    """
    pg = resolve_group(group, "recv")
    with pg.checking("recv"):
        peer = _root(pg, "recv", src, group_src, ("src", "group_src"), default=None)
    return _cpu.recv(pg, tensor, peer, tag, group_ranks=group_src is not None)


#: In the async API ``send`` and ``recv`` return a :class:`Work` like ``isend``/``irecv``.
send = isend
recv = irecv


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

    Raises:
        DistUsageError: an empty list, an entry that is not a :class:`P2POp`, or ops on
            different groups.
    """
    if not isinstance(p2p_op_list, list | tuple) or not p2p_op_list:
        raise DistUsageError("batch_isend_irecv: p2p_op_list must be a non-empty list of P2POp")
    for p in p2p_op_list:
        if not isinstance(p, P2POp):
            raise DistUsageError(f"batch_isend_irecv: expected P2POp entries, got {p!r}")
    if len({id(p.group) for p in p2p_op_list}) != 1:
        raise DistUsageError("batch_isend_irecv: every P2POp of a batch must use the same group")
    works: list[Work[Any]] = []
    for p in p2p_op_list:
        if p.op is isend:
            works.append(isend(p.tensor, p.peer, p.group, p.tag, p.group_peer))
        else:
            works.append(irecv(p.tensor, p.peer, p.group, p.tag, p.group_peer))
    return works


# -- object collectives ----------------------------------------------------------------------
def broadcast_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: Group = None,
    device: object = None,
    group_src: int | None = None,
) -> Work[list[Any]]:
    """Broadcast the picklable objects of ``object_list`` from ``src``, in place elsewhere.

    Every rank passes a list of the same length; the sizes of the pickles travel first.
    Unpickling runs code chosen by the sender: use only between trusted ranks.
    ``device`` is accepted for torch compatibility and ignored.

    Returns:
        A :class:`Work` whose result is ``object_list``.

    Raises:
        DistUsageError: not a non-empty list, or an object that cannot be pickled.
    """
    pg, root = _rooted("broadcast_object_list", group, src, group_src, ("src", "group_src"))
    return _cpu.broadcast_object_list(pg, object_list, root)


def all_gather_object(object_list: list[Any], obj: Any, group: Group = None) -> Work[list[Any]]:
    """Gather the picklable ``obj`` of every rank into ``object_list`` (one slot per rank).

    Returns:
        A :class:`Work` whose result is ``object_list``.

    Raises:
        DistUsageError: the list length is not the group size, or ``obj`` cannot be pickled.
    """
    pg = resolve_group(group, "all_gather_object")
    return _cpu.all_gather_object(pg, object_list, obj)


def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: Group = None,
    group_dst: int | None = None,
) -> Work[list[Any] | None]:
    """Gather the picklable ``obj`` of every rank into ``object_gather_list`` on ``dst``.

    Returns:
        A :class:`Work` whose result is ``object_gather_list`` (``None`` elsewhere).

    Raises:
        DistUsageError: a bad list on the destination, a list on another rank, or ``obj``
            cannot be pickled.
    """
    pg, root = _rooted("gather_object", group, dst, group_dst, ("dst", "group_dst"))
    return _cpu.gather_object(pg, obj, object_gather_list, root)


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int | None = None,
    group: Group = None,
    group_src: int | None = None,
) -> Work[list[Any]]:
    """Send ``scatter_object_input_list[i]`` of ``src`` to rank ``i``'s output list slot 0.

    Returns:
        A :class:`Work` whose result is ``scatter_object_output_list``.

    Raises:
        DistUsageError: bad lists, or an object that cannot be pickled.
    """
    pg, root = _rooted("scatter_object_list", group, src, group_src, ("src", "group_src"))
    return _cpu.scatter_object_list(pg, scatter_object_output_list, scatter_object_input_list, root)
