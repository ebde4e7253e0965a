"""The async public API: ``init_process_group``, collectives, point-to-point, object ops.

Collectives and point-to-point operations return a :class:`~aiodist.group.Work` at once
(``await`` it for the result); what talks to the network to set up or tear down
(``init_process_group``, ``new_group``, ``destroy_process_group``) is a coroutine; the
introspection functions are plain functions. Keyword names follow ``torch.distributed``:
``src``/``dst`` are global ranks, ``group_src``/``group_dst`` ranks within ``group``.

Each function only names its operation and hands its arguments to the group: the group
reserves the operation's number, and :func:`aiodist.backends.plan` sends the call to the
backend that serves the device its arrays live on, whose checks either pass (the operation
starts) or reject it (see :mod:`aiodist.group`).

Deadlines. Every collective and point-to-point function takes a keyword-only ``timeout``
(seconds or ``timedelta``): the operation's own deadline, instead of the group's timeout.
When it passes, the operation fails with ``DistTimeoutError`` naming the ranks that did not
arrive, and the world is aborted (its peers are part-way through it), so every rank learns
at once; a server then rebuilds the group. That differs from stopping to wait:
``asyncio.timeout`` (or ``wait_for``) around ``await work`` ends only the caller's wait,
and the operation keeps its place and completes or fails on its own. ``Work.wait(timeout)``
is torch's: a deadline counted from the wait, failing the operation and aborting the group.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import numpy.typing as npt

from . import _subgroups, backends as _backends, group as _group
from ._auth import resolve_token
from ._operations import OPERATIONS
from ._ops import PremulSum, ReduceOp
from ._recorder import record_comm
from ._timeouts import Timeout, to_seconds
from .errors import DistNetworkError, DistUsageError
from .group import (
    DEFAULT_PG_TIMEOUT,
    NON_GROUP_MEMBER,
    NonGroupMember,
    ProcessGroup,
    Work,
    resolve_group,
    start_world,
)
from .store import PrefixStore, Store
from .transport.base import Transport

__all__ = [
    "NON_GROUP_MEMBER",
    "DebugLevel",
    "P2POp",
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
    "destroy_process_group",
    "empty",
    "gather",
    "gather_object",
    "get_backend",
    "get_backend_config",
    "get_debug_level",
    "get_default_backend_for_device",
    "get_global_rank",
    "get_group_rank",
    "get_pg_count",
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
    "new_subgroups_by_enumeration",
    "recv",
    "record_comm",
    "recv_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
    "set_debug_level",
    "split_group",
    "supports_complex",
    "zeros",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")
Array = npt.NDArray[Any]

Group = ProcessGroup | NonGroupMember | None
Op = ReduceOp | int | PremulSum


def _collective(
    name: str, group: Group, args: tuple[Any, ...], timeout: Timeout = None
) -> Work[Any]:
    if isinstance(group, NonGroupMember):
        return _group.not_in_group(name, stacklevel=4)
    nseq = OPERATIONS[name].nseq
    return resolve_group(group, name).issue(name, _backends.plan, args, nseq, timeout=timeout)


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
    shared_memory: bool | None = None,
) -> ProcessGroup:
    """Join the job's ranks into the default process group.

    Either hand over a ``store`` (then ``rank`` and ``world_size`` are required), or an
    ``init_method`` URL for :func:`aiodist.rendezvous.rendezvous` (``None`` means
    ``"env://"``: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). The ranks then
    publish their transport addresses in the store under a namespace of their own
    (``aiodist/<group_name>/<world_size>/<generation>/``, the generation counting the times
    this rank joined under that name), so several jobs or restarts can share one store.

    The default group is process-wide, as in torch: every task and thread of the process
    sees it (a context made with :func:`aiodist.group.isolate_context` holds its own).

    Args:
        backend: ``"cpu"`` (alias ``"gloo"``), ``"cuda"`` (alias ``"nccl"``), torch's
            per-device form ``"cpu:gloo,cuda:nccl"``, a registered backend, or ``None``
            (every backend available here, chosen per call by where the arrays live).
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
        shared_memory: whether ranks on one host talk through shared memory: ``None``
            (default) when every rank of the host can (``AIODIST_SHM=0`` turns it off,
            and one rank that cannot keeps its whole host on TCP, logged); ``True``
            likewise, but raise if a rank of this host cannot; ``False`` never (TCP only).
            Every rank must pass the same value.

    Returns:
        The default :class:`ProcessGroup`.

    Raises:
        DistUsageError: already initialized, both or wrong ``store``/``init_method``
            arguments, bad rank or world size, or an unknown or unavailable backend.
        DistTimeoutError: the rendezvous or the connections did not complete in time.
        DistNetworkError: the store or a peer could not be reached.
    """
    if _group.peek_world() is not None:
        raise DistUsageError(_group.TWICE)
    name, devices = _backends.available(backend)
    seconds = to_seconds(timeout, DEFAULT_PG_TIMEOUT)
    token = resolve_token(auth_token)
    if not isinstance(group_name, str):
        raise DistUsageError(f"group_name must be a string, got {type(group_name).__name__}")
    if shared_memory is not None and not isinstance(shared_memory, bool):
        raise DistUsageError(
            f"init_process_group: shared_memory must be True, False or None, got {shared_memory!r}"
        )
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
        # Counted per rank: the n-th join of every rank meets in generation n, however the
        # ranks restart (all of them, or only the failed one while the others rebuild).
        generation = await store.add(f"{namespace}/joined/{world_size}/{rank}", 1) - 1
        prefixed = PrefixStore(f"{namespace}/{world_size}/{generation}", store)
        if generation:
            # This rank left the previous generation for good: ranks still forming it
            # learn that it can never be complete.
            earlier = PrefixStore(f"{namespace}/{world_size}/{generation - 1}", store)
            await earlier.set(_LEFT, f"rank {rank} (it joined a later generation)")
        try:
            transport = await _unless_left(
                prefixed, _connect(prefixed, rank, world_size, seconds, token, shared_memory)
            )
        except BaseException as exc:
            # Nor is this generation, once this rank stops joining it.
            why = "cancelled" if isinstance(exc, asyncio.CancelledError) else repr(exc)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    prefixed.set(_LEFT, f"rank {rank} (it stopped joining: {why})"), 5
                )
            raise
    except BaseException:
        for s in owned:
            await s.aclose()
        raise
    logger.debug("rank %d/%d joined %s", rank, world_size, prefixed.prefix)
    if os.environ.get("AIODIST_FR_DUMP_DIR"):
        # Opted in through the environment (aiodist-run passes it on to its workers).
        from .debug import install_signal_handler

        install_signal_handler()
    pg = start_world(
        transport, prefixed, backend=name, backends=devices, timeout=seconds, owned=owned
    )
    try:
        await _backends.setup(pg)
    except BaseException:
        _group.set_current_world(None)
        await pg.world.aclose()
        raise
    return pg


#: The key set in a world's namespace when one of its ranks leaves it before it formed.
_LEFT = "left_by"
#: How often ranks forming a world check that it is still possible (seconds).
_LEFT_POLL = 0.5


async def left_by(store: Store) -> str | None:
    """Which rank of the world whose keys ``store`` holds left it while it formed, if any.

    Such a world can never have every rank: the rank joined a later generation, or its
    ``init_process_group`` failed or was cancelled. ``store`` is the world's (``World.store``).
    """
    if not await store.check([_LEFT]):
        return None
    return (await store.get(_LEFT)).decode()


async def _unless_left(store: Store, joining: Coroutine[Any, Any, Transport]) -> Transport:
    """Await ``joining`` a world, unless one of its ranks leaves it meanwhile.

    Raises:
        DistNetworkError: naming that rank; joining again joins the next generation.
    """
    task = asyncio.ensure_future(joining)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_LEFT_POLL)
            if done:
                return task.result()
            who = await left_by(store)
            if who is not None:
                raise DistNetworkError(
                    f"init_process_group: this generation of the process group can never be "
                    f"complete: {who} left it; call init_process_group again to join the next"
                )
    except BaseException:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if not task.cancelled() and task.exception() is None:
            # Connected in the same turn this rank gave up (cancelled, or the world was
            # left): nobody else will close the listener and connections.
            await task.result().aclose()
        raise


async def _connect(
    store: Store,
    rank: int,
    world_size: int,
    timeout: float | None,
    token: bytes | None,
    shared_memory: bool | None,
) -> Transport:
    from .transport._address import listen_host
    from .transport._shm_segment import SharedMemoryError
    from .transport.base import PeerDirectory
    from .transport.routed import RoutedTransport
    from .transport.shm import ShmTransport, plan_shared_memory
    from .transport.tcp import TCPTransport

    host = listen_host(store.local_address())
    tcp = await TCPTransport.create(
        PeerDirectory(store), rank, world_size, host=host, timeout=timeout, auth_token=token
    )
    if world_size == 1 or shared_memory is False:
        return tcp
    try:
        # Ranks on one host talk through shared memory, the others over TCP: every rank of a
        # host makes the same choice, from one list in the store.
        local, refused = await plan_shared_memory(store, rank, world_size, timeout=timeout)
        if len(local) == 1:
            return tcp
        if refused is not None:
            if shared_memory:
                raise DistUsageError(
                    f"init_process_group: shared_memory=True, but ranks {local} of this host "
                    f"cannot share memory: {refused}"
                )
            logger.info("rank %d: ranks %s talk over TCP: %s", rank, local, refused)
            return tcp
        try:
            shm = await ShmTransport.create(
                store, rank, world_size, local, mailbox=tcp.mailbox, timeout=timeout
            )
        except SharedMemoryError as exc:
            # Only this rank could not, after every rank of the host agreed: it leaves this
            # generation, and its peers hear why (see _unless_left) instead of waiting.
            raise DistUsageError(
                f"rank {rank}: shared memory with ranks {local} failed after they agreed to "
                f"use it: {exc}; set AIODIST_SHM=0 on every rank to use TCP only"
            ) from exc
        return RoutedTransport(tcp, shm)
    except BaseException:
        await tcp.aclose()
        raise


async def destroy_process_group(group: Group = None) -> None:
    """Destroy ``group``, or (``None`` or the default group) every group of the default world.

    Destroying the default group fails the operations still running, closes every
    connection and task the world opened (and the store, if ``init_process_group`` made it)
    and leaves the process uninitialized. Later operations on a destroyed group raise at
    once.

    Raises:
        DistUsageError: not initialized, or ``group`` is not a process group.
    """
    if isinstance(group, NonGroupMember):
        return
    world = _group.current_world("destroy_process_group")
    if group is None:
        group = world.default_group
    if not isinstance(group, ProcessGroup) or group.world is not world:
        raise DistUsageError(f"destroy_process_group: invalid process group {group!r}")
    await group.destroy()


def is_initialized() -> bool:
    """Return whether the default process group is initialized."""
    return _group.peek_world() is not None


def get_rank(group: Group = None) -> int:
    """Return this rank in ``group`` (default: the global rank); ``-1`` for a non-member.

    Raises:
        DistUsageError: not initialized.
    """
    if isinstance(group, NonGroupMember):
        return -1
    return resolve_group(group, "get_rank").rank


def empty(shape: int | tuple[int, ...], dtype: npt.DTypeLike, *, group: Group = None) -> Array:
    """Return an uninitialised numpy array that ``group``'s collectives read in place.

    When every rank of ``group`` is on this host (shared memory on), the array lives in
    shared memory: a collective of ``group`` on it skips the copy into the group's
    workspace, and ``all_reduce`` on such arrays on every rank also skips the copy out
    (each rank writes its slice of the result into every rank's array). Otherwise (ranks
    on several hosts, ``AIODIST_SHM=0``, a ``/dev/shm`` too small: logged) it is an
    ordinary array, so the same code runs anywhere. Not collective: each rank allocates
    its own, in any order.

    Lifetime: the memory lives as long as any view of the array does (peers drop their
    mappings at their next collective); it stays valid after the group is destroyed, and
    with another group it is copied like any array. Do not touch it while a collective
    that uses it runs: in ``all_reduce`` the peers write into it.

    Raises:
        DistUsageError: a bad shape or dtype, not initialized, or not a member of ``group``.
    """
    return _backends.empty(resolve_group(group, "empty"), "empty", shape, dtype, zeroed=False)


def zeros(shape: int | tuple[int, ...], dtype: npt.DTypeLike, *, group: Group = None) -> Array:
    """Like :func:`empty`, filled with zeros."""
    return _backends.empty(resolve_group(group, "zeros"), "zeros", shape, dtype, zeroed=True)


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


def get_backend_config(group: Group = None) -> str:
    """Return the backend serving each device kind of ``group``: ``"cpu:cpu"``, or
    ``"cpu:cpu,cuda:cuda"`` (torch's ``get_backend_config``, in aiodist's backend names).

    Raises:
        DistUsageError: not initialized, or a non-member sentinel.
    """
    pg = resolve_group(group, "get_backend_config")
    return ",".join(f"{device}:{name}" for device, name in pg.backends.items())


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


def get_pg_count() -> int:
    """Return how many process groups this world has made, the default group included.

    Raises:
        DistUsageError: not initialized.
    """
    return _group.current_world("get_pg_count").group_count


def get_default_backend_for_device(device: str) -> str:
    """Return the backend that serves ``device`` (``"cpu"`` or ``"cuda"``, ``"cuda:1"``).

    Raises:
        DistUsageError: a device kind aiodist has no backend for.
    """
    kind = str(device).split(":")[0].strip().lower()
    if kind not in ("cpu", "cuda"):
        raise DistUsageError(f"no backend serves device {device!r}; aiodist has cpu and cuda")
    return kind


def supports_complex(reduce_op: Op) -> bool:
    """Return whether ``reduce_op`` can reduce complex arrays (not MIN, MAX or bitwise ops)."""
    if isinstance(reduce_op, PremulSum):
        return True
    return int(reduce_op) not in (
        ReduceOp.MIN,
        ReduceOp.MAX,
        ReduceOp.BAND,
        ReduceOp.BOR,
        ReduceOp.BXOR,
    )


class DebugLevel(enum.IntEnum):
    """How much aiodist logs, as torch's ``TORCH_DISTRIBUTED_DEBUG`` levels.

    ``OFF`` logs warnings only, ``INFO`` adds set-up and tear-down, ``DETAIL`` everything
    (connections, every abort path).
    """

    OFF = 0
    INFO = 1
    DETAIL = 2


_LOG_LEVELS = {
    DebugLevel.OFF: logging.WARNING,
    DebugLevel.INFO: logging.INFO,
    DebugLevel.DETAIL: logging.DEBUG,
}


def set_debug_level(level: DebugLevel | str) -> None:
    """Set how much the ``aiodist`` loggers log (``OFF``, ``INFO`` or ``DETAIL``).

    Raises:
        DistUsageError: an unknown level.
    """
    try:
        chosen = DebugLevel[level.upper()] if isinstance(level, str) else DebugLevel(level)
    except (KeyError, ValueError):
        raise DistUsageError(f"debug level must be OFF, INFO or DETAIL, got {level!r}") from None
    logging.getLogger("aiodist").setLevel(_LOG_LEVELS[chosen])


def get_debug_level() -> DebugLevel:
    """Return the level :func:`set_debug_level` set (``OFF`` by default)."""
    level = logging.getLogger("aiodist").getEffectiveLevel()
    if level <= logging.DEBUG:
        return DebugLevel.DETAIL
    return DebugLevel.INFO if level <= logging.INFO else DebugLevel.OFF


# -- groups ------------------------------------------------------------------------------------
async def new_group(
    ranks: Sequence[int] | None = None,
    timeout: Timeout = None,
    backend: str | None = None,
) -> ProcessGroup | NonGroupMember:
    """Create a process group of the given global ranks.

    Every rank of the default group must call ``new_group`` with the same arguments in the
    same order (members and non-members alike), so that the group gets the same id
    everywhere; the ranks check through the store that they agree. Group ranks follow the
    sorted global ranks.

    Args:
        ranks: global ranks of the members; ``None`` means every rank.
        timeout: per-operation timeout of the new group; ``None`` inherits the default
            group's.
        backend: ``None`` inherits the default group's backend.

    Returns:
        The new group on members, :data:`NON_GROUP_MEMBER` on other ranks.

    Raises:
        DistUsageError: not initialized, an empty list, a duplicate or out-of-range rank,
            ranks that differ between the ranks (raised on every rank; the world stays
            usable), or an unknown backend.
        DistTimeoutError: some rank did not call ``new_group`` in time.
    """
    world = _group.current_world("new_group")
    world.default_group.check_usable("new_group")
    if backend is None:
        name, devices = world.backend, dict(world.backends)
    else:
        name, devices = _backends.parse_backend(backend)
    seconds = world.timeout if timeout is None else to_seconds(timeout, None)
    group = await _subgroups.new_group(
        world, ranks, backend=name, backends=devices, timeout=seconds
    )
    if isinstance(group, ProcessGroup):
        await _backends.setup(group)
    return group


async def new_subgroups(
    group_size: int | None = None,
    group: ProcessGroup | None = None,
    timeout: Timeout = None,
    backend: str | None = None,
) -> tuple[ProcessGroup, list[ProcessGroup | NonGroupMember]]:
    """Split the ranks of ``group`` into consecutive subgroups of ``group_size`` ranks.

    Every rank of the default group must call it with the same arguments.

    Args:
        group_size: ranks per subgroup; ``None`` makes one subgroup of every rank of
            ``group``.
        group: the group to split (global ranks are taken from it); default the world.
        timeout: per-operation timeout of the subgroups.
        backend: backend of the subgroups; ``None`` inherits.

    Returns:
        ``(this rank's subgroup, every subgroup)``; entries of subgroups this rank is not in
        are :data:`NON_GROUP_MEMBER`.

    Raises:
        DistUsageError: ``group_size`` is not positive, or does not divide the group size.
    """
    parent = resolve_group(group, "new_subgroups")
    size = parent.size if group_size is None else group_size
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0 or parent.size % size:
        raise DistUsageError(
            f"new_subgroups: group_size {group_size!r} must be a positive int dividing the "
            f"group size {parent.size}"
        )
    lists = [list(parent.ranks[i : i + size]) for i in range(0, parent.size, size)]
    mine, groups = await new_subgroups_by_enumeration(lists, timeout, backend)
    assert mine is not None  # this rank is in the parent group, so in one subgroup
    return mine, groups


async def new_subgroups_by_enumeration(
    ranks_per_subgroup_list: Sequence[Sequence[int]],
    timeout: Timeout = None,
    backend: str | None = None,
) -> tuple[ProcessGroup | None, list[ProcessGroup | NonGroupMember]]:
    """Create one subgroup per list of global ranks; every rank calls it the same way.

    Returns:
        ``(this rank's subgroup or None, every subgroup)``.

    Raises:
        DistUsageError: a rank in two lists, or a bad list.
    """
    seen: set[int] = set()
    for ranks in ranks_per_subgroup_list:
        overlap = seen.intersection(ranks)
        if overlap:
            raise DistUsageError(
                f"new_subgroups_by_enumeration: rank {min(overlap)} is in more than one subgroup"
            )
        seen.update(ranks)
    mine: ProcessGroup | None = None
    groups: list[ProcessGroup | NonGroupMember] = []
    for ranks in ranks_per_subgroup_list:
        sub = await new_group(ranks, timeout, backend)
        groups.append(sub)
        if isinstance(sub, ProcessGroup):
            mine = sub
    return mine, groups


async def split_group(
    parent_pg: ProcessGroup | None = None,
    split_ranks: Sequence[Sequence[int]] | None = None,
    timeout: Timeout = None,
    group_desc: str | None = None,
) -> ProcessGroup | None:
    """Split ``parent_pg`` into the groups of ``split_ranks`` (global ranks); return this rank's.

    Every rank of the world calls it with the same lists; ranks in none of them get ``None``.

    Raises:
        DistUsageError: ``split_ranks`` missing, a rank outside the parent, or in two lists.
    """
    parent = resolve_group(parent_pg, "split_group")
    if not split_ranks:
        raise DistUsageError("split_group: split_ranks must be a non-empty list of rank lists")
    outside = {r for ranks in split_ranks for r in ranks} - set(parent.ranks)
    if outside:
        raise DistUsageError(f"split_group: ranks {sorted(outside)} are not in the parent group")
    mine, _ = await new_subgroups_by_enumeration(split_ranks, timeout)
    return mine


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

    The work completes once the transport no longer needs ``tensor`` (not when the peer
    has received it). Messages with the same tag between two ranks arrive in order. A send
    whose checks fail is rejected: the receive that would have taken its message fails
    with the reason instead.

    Raises:
        DistUsageError: no or invalid destination (sending to oneself included), bad tag,
            bad array.
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
    *,
    timeout: Timeout = None,
) -> Work[None]:
    """Send the picklable objects of ``object_list`` to rank ``dst`` (see :func:`recv_object_list`).

    ``device`` is accepted for torch compatibility and ignored.

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
    *,
    timeout: Timeout = None,
) -> Work[int]:
    """Receive objects sent with :func:`send_object_list` into ``object_list``, in place.

    ``object_list`` must have as many entries as the sender's list. Unpickling runs code
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
    args = (object_list, group_src is not None)
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
    *,
    timeout: Timeout = None,
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
    args = (object_list, src, group_src)
    return _collective("broadcast_object_list", group, args, timeout=timeout)


def all_gather_object(
    object_list: list[Any], obj: Any, group: Group = None, *, timeout: Timeout = None
) -> Work[list[Any]]:
    """Gather the picklable ``obj`` of every rank into ``object_list`` (one slot per rank).

    Returns:
        A :class:`Work` whose result is ``object_list``.

    Raises:
        DistUsageError: the list length is not the group size, or ``obj`` cannot be pickled.
    """
    return _collective("all_gather_object", group, (object_list, obj), timeout=timeout)


def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: Group = None,
    group_dst: int | None = None,
    *,
    timeout: Timeout = None,
) -> Work[list[Any] | None]:
    """Gather the picklable ``obj`` of every rank into ``object_gather_list`` on ``dst``.

    Returns:
        A :class:`Work` whose result is ``object_gather_list`` (``None`` elsewhere).

    Raises:
        DistUsageError: a bad list on the destination, a list on another rank, or ``obj``
            cannot be pickled.
    """
    args = (obj, object_gather_list, dst, group_dst)
    return _collective("gather_object", group, args, timeout=timeout)


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int | None = None,
    group: Group = None,
    group_src: int | None = None,
    *,
    timeout: Timeout = None,
) -> Work[list[Any]]:
    """Send ``scatter_object_input_list[i]`` of ``src`` to rank ``i``'s output list slot 0.

    Returns:
        A :class:`Work` whose result is ``scatter_object_output_list``.

    Raises:
        DistUsageError: bad lists, or an object that cannot be pickled.
    """
    args = (scatter_object_output_list, scatter_object_input_list, src, group_src)
    return _collective("scatter_object_list", group, args, timeout=timeout)
