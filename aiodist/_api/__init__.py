"""The async public API: ``init_process_group``, groups, and (from :mod:`aiodist._api._collectives`)
the collectives, point-to-point and object operations.

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

The package is the async API that :mod:`aiodist` re-exports: this module (setting up,
joining, changing and tearing down groups), ``_queries`` (what a group is: rank, size,
backend; timeouts, the debug level) and ``_collectives`` (every operation). It may import
everything below it (:mod:`aiodist._assembly`, the backends, the group core, the
rendezvous, the stores); never the observation package beside it or the facades above.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, TypeVar

from .. import backends as _backends, group as _group
from .._assembly import _membership, _subgroups
from .._assembly._join import connector, job_store, join_world
from .._assembly._membership import SHRINK_ABORT, SHRINK_DEFAULT
from .._util._auth import resolve_token
from .._util._timeouts import Timeout, to_seconds
from ..errors import DistNetworkError, DistUsageError
from ..group import (
    DEFAULT_PG_TIMEOUT,
    NON_GROUP_MEMBER,
    NonGroupMember,
    ProcessGroup,
    resolve_group,
)
from ..group._recorder import record_comm
from ..store import Store
from ._collectives import (
    Group,
    P2POp,
    all_gather,
    all_gather_coalesced,
    all_gather_into_tensor,
    all_gather_object,
    all_gather_single,
    all_reduce,
    all_reduce_coalesced,
    all_to_all,
    all_to_all_single,
    barrier,
    batch_isend_irecv,
    broadcast,
    broadcast_object_list,
    gather,
    gather_into_tensor,
    gather_object,
    gather_single,
    irecv,
    isend,
    monitored_barrier,
    recv,
    recv_object_list,
    reduce,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
    scatter,
    scatter_object_list,
    send,
    send_object_list,
)
from ._queries import (  # re-exported: this module is the API's index
    DebugLevel,
    empty,
    get_backend,
    get_backend_config,
    get_debug_level,
    get_default_backend_for_device,
    get_global_rank,
    get_group_rank,
    get_pg_count,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    given_name,
    is_initialized,
    set_debug_level,
    set_timeout,
    supports_complex,
    zeros,
)

__all__ = [
    "NON_GROUP_MEMBER",
    "admit",
    "SHRINK_ABORT",
    "SHRINK_DEFAULT",
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
    "gather_into_tensor",
    "gather_object",
    "gather_single",
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
    "join_process_group",
    "lost_ranks",
    "isend",
    "monitored_barrier",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "recv",
    "record_comm",
    "recover",
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
    "shrink_group",
    "split_group",
    "set_timeout",
    "supports_complex",
    "zeros",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")


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
    sees it (a context made with ``aiodist.group.isolate_context()`` holds its own).

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
    name, devices, seconds, token = _options(
        "init_process_group", backend, timeout, auth_token, group_name, shared_memory
    )
    store, rank, world_size, owned = await _reach_store(
        "init_process_group", init_method, store, rank, world_size, seconds, token
    )
    return await join_world(
        store,
        rank,
        world_size,
        owned,
        name=group_name,
        backend=name,
        backends=devices,
        timeout=seconds,
        token=token,
        shared_memory=shared_memory,
    )


async def join_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: Timeout = None,
    store: Store | None = None,
    group_name: str = "",
    *,
    auth_token: str | bytes | None = None,
    shared_memory: bool | None = None,
    state: Sequence[Any] = (),
) -> ProcessGroup:
    """Join a running world as a new rank, when its members next call :func:`admit`.

    For a process started after the world formed: a replacement for a lost rank, or one more
    worker. It registers in the job's store and waits (up to ``timeout``) until the members
    admit it; it then gets the next free rank (after the members', in the order the waiting
    processes registered) and the world's default group, with every member. ``state``
    receives the members' state, written in place (the arrays the members pass to
    ``admit(state=...)``, alike in number, shapes and dtypes); or receive it with ordinary
    collectives (a ``broadcast`` from rank 0).

    The arguments are :func:`init_process_group`'s, without ``rank`` and ``world_size``:
    ``store`` (connected to the job's store), or an ``init_method`` URL that reaches it
    (``"env://"``, as under ``aiodist-run``). ``group_name`` names the job, as the members
    gave it.

    Returns:
        The default :class:`ProcessGroup` of the grown world.

    Raises:
        DistUsageError: already initialized, or bad arguments (as ``init_process_group``).
        DistTimeoutError: not admitted within ``timeout`` (the members did not call
            :func:`admit`).
        DistNetworkError: the store could not be reached, or the job's world ended (every
            member left) before it admitted this process.

    A process started before the job's world formed (under ``aiodist-run
    --restart-policy=failed``, the replacement of a worker lost during start-up) finds no
    world to join: it takes its rank (``RANK``, from ``env://``) in the world being formed,
    as ``init_process_group`` would, and ``state`` is left as it is; should a world be
    formed without it meanwhile, it waits to be admitted to that one instead.

    A member lost while the grown world forms or sends the state does not end the wait:
    the members go on without it (:func:`recover`), and this process leaves the grown
    world, registers again and waits (within the same ``timeout``) for their next
    ``admit``.
    """
    name, devices, seconds, token = _options(
        "join_process_group", backend, timeout, auth_token, group_name, shared_memory
    )
    store, rank, world_size, owned = await _reach_store(
        "join_process_group", init_method, store, None, None, seconds, token
    )
    membership = _group.Membership(
        connector(seconds, token, shared_memory), job_store(store, group_name)
    )

    async def receive(pg: ProcessGroup) -> None:
        for x in state:
            await broadcast(x, src=0, group=pg)

    async def form() -> ProcessGroup:
        # This process's rank in the job's world as it forms, as init_process_group takes it
        # (the job's stores stay with the caller until it is whole).
        return await join_world(
            store,
            rank,
            world_size,
            [],
            name=group_name,
            backend=name,
            backends=devices,
            timeout=seconds,
            token=token,
            shared_memory=shared_memory,
        )

    return await _membership.join(
        membership,
        backend=name,
        backends=devices,
        timeout=seconds,
        owned=owned,
        receive=receive,
        form=form if rank >= 0 else None,
    )


async def admit(group: ProcessGroup | None = None, *, state: Sequence[Any] = ()) -> list[int]:
    """Admit the processes waiting to join (:func:`join_process_group`); return their ranks.

    Every member of the default group calls it at the same point (a step boundary of
    training, say), like a collective. When processes are waiting, the members and they form
    a grown world: the members keep their ranks, the new processes take the next ones in the
    order they registered, and the grown world becomes the default (the old one is closed,
    with every other group of it). Then the new ranks get rank 0's ``state`` (broadcast, in
    order), or send them what they need yourself, for instance ``await
    aiodist.broadcast(weights, src=0)``. With nobody waiting it changes nothing and costs a
    few store requests.

    Args:
        group: the default group (``None``); only the default group admits.
        state: arrays to send from rank 0 to the admitted ranks (which pass theirs to
            ``join_process_group(state=...)``); sent only when someone was admitted.

    Returns:
        The ranks of the admitted processes in the grown world (empty: nobody was waiting).

    Raises:
        DistUsageError: not initialized, ``group`` is not the default group, or a world
            made outside ``init_process_group``.
        DistError: the world was aborted (shrink it first, see :func:`shrink_group`).
        DistNetworkError: the store could not be reached, or a member was lost while the
            grown world formed or the state was sent (go on with :func:`recover`).

    A process being admitted that is lost while the grown world forms admits nobody this
    time (logged, and ``[]`` returned): the members' world is as it was, and the other
    processes that were being admitted wait for the next ``admit``.
    """
    pg = resolve_group(group, "admit")
    if pg is not pg.world.default_group:
        raise DistUsageError("admit: only the default group admits new processes")
    admitted = await _membership.admit(pg.world)
    if admitted:
        for x in state:
            await broadcast(x, src=0)
    return admitted


async def recover(error: BaseException, group: ProcessGroup | None = None) -> list[int]:
    """Go on without the ranks that are gone, after an operation failed with ``error``.

    The step of an elastic loop that follows a failed collective: when ranks of ``group``
    (default: the default group) left for good (:func:`lost_ranks`), shrink it to the others
    (:func:`shrink_group`, every survivor calls this) and return the lost ranks, in the old
    numbering; when none is gone, the failure was something else (a deadline, a bad call),
    and ``error`` is raised again rather than hidden::

        try:
            await aiodist.all_reduce(grad)
        except aiodist.DistError as exc:
            await aiodist.recover(exc)
            continue  # redo the step with the survivors

    A rank lost while the survivors shrink (a second failure) is left out too: they shrink
    again, and the ranks returned are every one lost.

    Raises:
        BaseException: ``error``, when no rank of the group is lost.
        DistError: as :func:`shrink_group`.
    """
    pg = resolve_group(group, "recover")
    # A lost connection means a rank went: its record in the store may be moments behind.
    lost = await _membership.lost(pg, expected=isinstance(error, DistNetworkError))
    if not lost:
        raise error
    # Another rank may go while the survivors shrink: some counted it lost and some not
    # (their votes differ), or it died before or after it voted (the new group cannot form).
    # Every survivor then fails the same attempt, and each tries again with the ranks lost
    # by now. A failure for any other reason repeats: give up after as many attempts as
    # there are ranks to lose.
    attempts = pg.size - len(lost)
    while True:
        try:
            await shrink_group(lost, pg)
            return lost
        except (DistNetworkError, DistUsageError):
            attempts -= 1
            if attempts <= 0:
                raise
            lost = await _membership.lost(pg, expected=True)


def _options(
    op: str,
    backend: str | None,
    timeout: Timeout,
    auth_token: str | bytes | None,
    group_name: object,
    shared_memory: object,
) -> tuple[str, dict[str, str], float | None, bytes | None]:
    """Check what joining a world takes, as ``op``; return the backend's name, the backend
    of each device, the timeout in seconds and the token.

    Raises:
        DistUsageError: a default group exists here already, or an argument is wrong.
    """
    if _group.peek_world() is not None:
        raise DistUsageError(_group.TWICE)
    name, devices = _backends.available(backend)
    name = given_name(backend, name)
    if not isinstance(group_name, str):
        raise DistUsageError(f"group_name must be a string, got {type(group_name).__name__}")
    if shared_memory is not None and not isinstance(shared_memory, bool):
        raise DistUsageError(
            f"{op}: shared_memory must be True, False or None, got {shared_memory!r}"
        )
    return name, devices, to_seconds(timeout, DEFAULT_PG_TIMEOUT), resolve_token(auth_token)


async def _reach_store(
    op: str,
    init_method: str | None,
    store: Store | None,
    rank: int | None,
    world_size: int | None,
    timeout: float | None,
    token: bytes | None,
) -> tuple[Store, int, int, list[Store]]:
    """The job's store, this rank and the world size (from the arguments, else the
    rendezvous), and the stores made for it. ``None`` for ``rank`` and ``world_size``: a
    joining process, which has neither yet (-1 is returned for them with ``store``)."""
    joining = rank is None
    if store is not None:
        if init_method is not None:
            raise DistUsageError(f"{op}: pass either store or init_method, not both")
        if not isinstance(store, Store):
            raise DistUsageError(
                f"{op}: store must be an aiodist Store, got {type(store).__name__}"
            )
        if joining:
            return store, -1, -1, []
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
            raise DistUsageError(
                f"init_process_group: world_size must be a positive int with store=, "
                f"got {world_size!r}"
            )
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise DistUsageError(
                f"init_process_group: rank must be in [0, {world_size}) with store=, got {rank!r}"
            )
        return store, rank, world_size, []
    from ..rendezvous import rendezvous

    store, rank, world_size = await rendezvous(
        init_method or "env://",
        -1 if rank is None else rank,
        -1 if world_size is None else world_size,
        timeout=timeout,
        auth_token=token,
    )
    return store, rank, world_size, [store]


async def destroy_process_group(group: Group = None) -> None:
    """Destroy ``group``, or (``None`` or the default group) every group of the default world.

    Destroying the default group fails the operations still running, closes every
    connection and task the world opened (and the store, if ``init_process_group`` made it)
    and leaves the process uninitialized. Later operations on a destroyed group raise at
    once.

    How long it takes, whatever order the ranks leave in: a rank that does not serve the
    store returns within moments, and never waits longer than ``LEAVE_WAIT`` (5 s) for a
    store that does not answer (its host left, or stopped its event loop) plus the
    transport's own closing bound (5 s). The rank whose process serves the world's store
    (even a store the caller made) keeps it up until every rank has left or gone, at most
    the group's timeout, saying at intervals which ranks it waits for: the others may
    still need it, and the caller may close it, drop it or stop its loop next.

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
        name = given_name(backend, name)
    seconds = world.timeout if timeout is None else to_seconds(timeout, None)
    group = await _subgroups.new_group(
        world, ranks, backend=name, backends=devices, timeout=seconds
    )
    if isinstance(group, ProcessGroup):
        await _backends.setup(group)
    return group


async def lost_ranks(group: ProcessGroup | None = None) -> list[int]:
    """Return the ranks of ``group`` (group ranks) that left its world for good, sorted.

    Those are the ranks to pass to :func:`shrink_group` after a failure: ranks whose process
    ended or was killed, or whose host went away (their connection to the store ended
    without a goodbye), and ranks that left the process group or exited. Ranks that moved
    on to a shrunk group with this one are not lost. When the group's world has broken and
    no rank is recorded yet, it waits up to a second for one: a rank noticed through its
    connection is recorded in the store moments later.

    Raises:
        DistUsageError: not initialized, or not a process group.
        DistNetworkError: the store cannot be reached.
    """
    return await _membership.lost(resolve_group(group, "lost_ranks"))


async def shrink_group(
    ranks_to_exclude: list[int],
    group: ProcessGroup | None = None,
    shrink_flags: int = SHRINK_DEFAULT,
) -> ProcessGroup:
    """Go on without some ranks of ``group``: return a group of the others, renumbered in order.

    Only the remaining ranks call it, with the same list; they agree through the store.
    Shrinking the default group (``group=None``) forms a new world of the remaining ranks
    over new connections: it becomes the default (``get_rank()`` and ``get_world_size()``
    answer for it), and the old world is closed with every other group of it. That works on
    a healthy group, where excluded ranks leave by choice, and on one aborted because a rank
    was lost: the survivors exclude it and carry on, none of them restarting. Another group
    of a healthy world is replaced by a group of its remaining ranks (global ranks unchanged).

    The store must outlive the excluded ranks: it cannot be served by one of them.

    Args:
        ranks_to_exclude: ranks of ``group`` (group ranks) to leave out; this rank not among them.
        group: the group to shrink; ``None`` is the default group.
        shrink_flags: :data:`SHRINK_DEFAULT` lets the operations in flight on the group (for
            the default group: on every group) end first, each by its deadline at the latest;
            :data:`SHRINK_ABORT` fails them at once on this rank.

    Returns:
        The group of the remaining ranks.

    Raises:
        DistUsageError: (a ``ValueError``) ``ranks_to_exclude`` is empty, not a list of ints,
            has a rank out of range or twice, names every rank or this one; a bad flag; a
            destroyed group; or another remaining rank excluded other ranks (raised on every
            remaining rank; the group stays as it was).
        DistTimeoutError: a remaining rank did not call it within the group's timeout (named).
        DistNetworkError: the store cannot be reached, a remaining rank was lost while the
            new group formed, or a group other than the default belongs to an aborted world.
    """
    return await _membership.shrink(
        resolve_group(group, "shrink_group"), ranks_to_exclude, shrink_flags
    )


async def new_subgroups(
    group_size: int | None = None,
    group: ProcessGroup | None = None,
    timeout: Timeout = None,
    backend: str | None = None,
) -> tuple[ProcessGroup, list[ProcessGroup | NonGroupMember]]:
    """Split the ranks of ``group`` into consecutive subgroups of ``group_size`` ranks.

    Every rank of the default group must call it. With ``group``, each rank may pass a
    group of its own, as torch allows (ranks 0 and 2 splitting ``[0, 2]`` while ranks 1
    and 3 split ``[1, 3]``): the ranks first share the subgroups each wants, and every rank
    makes all of them, in one order.

    Args:
        group_size: ranks per subgroup; ``None`` makes one subgroup of every rank of
            ``group``.
        group: the group to split (global ranks are taken from it); default the world.
        timeout: per-operation timeout of the subgroups.
        backend: backend of the subgroups; ``None`` inherits.

    Returns:
        ``(this rank's subgroup, the subgroups of this rank's group)``; entries of subgroups
        this rank is not in are :data:`NON_GROUP_MEMBER`.

    Raises:
        DistUsageError: ``group_size`` is not positive, or does not divide the group size
            (with ``group``: on every rank, naming the rank), or the groups that ranks passed
            overlap without being the same.
    """
    parent = resolve_group(group, "new_subgroups")
    size = parent.size if group_size is None else group_size
    problem = None
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0 or parent.size % size:
        problem = (
            f"new_subgroups: group_size {group_size!r} must be a positive int dividing the "
            f"group size {parent.size}"
        )
        lists = []
    else:
        lists = [list(parent.ranks[i : i + size]) for i in range(0, parent.size, size)]
    world = parent.world
    if group is None or parent is world.default_group:
        if problem is not None:
            raise DistUsageError(problem)
        mine, groups = await new_subgroups_by_enumeration(lists, timeout, backend)
        assert mine is not None  # this rank is in the parent group, so in one subgroup
        return mine, groups
    wanted: list[Any] = [None] * world.size
    await all_gather_object(wanted, (problem, lists), group=world.default_group)
    for rank, (theirs, _) in enumerate(wanted):
        if theirs is not None:
            raise DistUsageError(theirs if rank == world.rank else f"rank {rank}: {theirs}")
    union: list[list[int]] = []
    for _, theirs in wanted:
        union += [ranks for ranks in theirs if ranks not in union]
    mine, groups = await new_subgroups_by_enumeration(union, timeout, backend)
    assert mine is not None
    return mine, [groups[union.index(ranks)] for ranks in lists]


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
