"""The blocking facade: ``import aiodist.sync as dist``, with ``torch.distributed``'s names.

Everything here runs the async core on one event loop that lives in a daemon thread of this
process (``aiodist-loop``; uvloop when installed, or as ``$AIODIST_LOOP`` says: ``auto``,
``uvloop``, ``asyncio``). The thread starts on the first blocking call and stops at interpreter
exit. No global event-loop policy is touched, so the caller's own asyncio code is unaffected.
The thread and the hand-offs to it live in :mod:`aiodist.sync._loop_thread`, the blocking stores
in :mod:`aiodist.sync._stores`; this module is the API and re-exports them.

Every blocking call goes through one of those hand-offs, each of which

* refuses to run on the loop thread itself (that would deadlock) with a ``DistUsageError``,
* on Ctrl-C (``KeyboardInterrupt`` in the calling thread) cancels the operation on the loop
  and re-raises at once,
* may be used from any number of threads at the same time.

A process that ends with its default group still open (most ``torch.distributed`` scripts
never call ``destroy_process_group``) leaves the group as it exits, at interpreter exit and
at the end of a ``multiprocessing`` child of any start method (which skips ``atexit``):
it lets its operations in flight finish, then leaves as ``destroy_process_group`` would,
telling its peers that it exited; a rank hosting the store keeps it up until the others
have left. A process that ends on an exception aborts the group instead, so that its peers
fail at once, naming it, rather than wait for it.

The package is the blocking facade: this module (the twins), ``_loop_thread`` (the
event-loop thread and the hand-offs to it) and ``_stores`` (the blocking stores). It may
import the async API, :mod:`aiodist.debug`, :mod:`aiodist.device_mesh` and everything
below them.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import logging
import multiprocessing
import multiprocessing.util
import os
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator, Sequence
from datetime import timedelta
from typing import Any, Self, TypeVar
from urllib.parse import parse_qsl

from .. import (
    _api as _aio_api,
    backends as _backends,
    device_mesh as _device_mesh,
    group as _group,
    rendezvous as _rendezvous,
)
from .._arrays._reduce import PremulSum, ReduceOp, make_premul_sum, reduce_op
from .._util._timeouts import DEFAULT_PG_TIMEOUT, Timeout
from ..errors import (
    DistBackendError,
    DistError,
    DistNetworkError,
    DistStoreError,
    DistStoreTimeoutError,
    DistTimeoutError,
    DistUsageError,
    QueueEmptyError,
)
from ..group import NON_GROUP_MEMBER, NonGroupMember, ProcessGroup
from ..group._operations import OPERATIONS
from ..group._recorder import DUMP_DIR_ENV, comm_name, record_comm
from ..rendezvous import get_node_local_rank
from ._loop_thread import Outcome, loop_thread, on_loop, run, start_operation
from ._stores import (
    EtcdStore,
    FileStore,
    HashStore,
    PrefixStore,
    Store,
    TCPStore,
    any_store_open,
    close_all_stores,
)
from ._work import Work

__all__ = [
    "Backend",
    "DebugLevel",
    "DeviceMesh",
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "DistStoreTimeoutError",
    "DistTimeoutError",
    "DistUsageError",
    "EtcdStore",
    "FileStore",
    "GroupMember",
    "HashStore",
    "NON_GROUP_MEMBER",
    "admit",
    "SHRINK_ABORT",
    "SHRINK_DEFAULT",
    "P2POp",
    "PrefixStore",
    "PremulSum",
    "ProcessGroup",
    "QueueEmptyError",
    "ReduceOp",
    "Store",
    "TCPStore",
    "Work",
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
    "breakpoint",
    "broadcast",
    "broadcast_object_list",
    "default_pg_timeout",
    "destroy_process_group",
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
    "get_node_local_rank",
    "get_pg_count",
    "get_process_group_ranks",
    "get_rank",
    "empty",
    "zeros",
    "get_world_size",
    "group",
    "init_device_mesh",
    "init_process_group",
    "irecv",
    "is_available",
    "is_backend_available",
    "is_gloo_available",
    "is_initialized",
    "is_mpi_available",
    "is_nccl_available",
    "is_torchelastic_launched",
    "is_ucc_available",
    "is_xccl_available",
    "isend",
    "make_premul_sum",
    "monitored_barrier",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "recv",
    "record_comm",
    "recv_object_list",
    "recover",
    "reduce",
    "reduce_op",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "register_rendezvous_handler",
    "rendezvous",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
    "set_debug_level",
    "set_debug_level_from_env",
    "join_process_group",
    "lost_ranks",
    "shrink_group",
    "split_group",
    "set_timeout",
    "supports_complex",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# -- process groups ---------------------------------------------------------------------------
# The default group is process-wide (see aiodist.group): the world initialised here is the
# one every blocking call, and the async API on the loop thread, sees.
_init_lock = threading.Lock()

Group = ProcessGroup | NonGroupMember | None

#: torch's default process-group timeout.
#: The process group timeout when none is given (torch's ``default_pg_timeout``): 30 min.
default_pg_timeout = timedelta(seconds=DEFAULT_PG_TIMEOUT)


def _named(start: Callable[[], T]) -> Callable[[], T]:
    """``start``, to be called on the loop thread under this thread's :func:`record_comm` name."""
    name = comm_name()
    if name is None:
        return start

    def named() -> T:
        with record_comm(name):
            return start()

    return named


#: What each operation's blocking twin returns, as its declaration says.
_RETURNS = {name: how for op in OPERATIONS.values() for name, how in op.public.items()}


def _twin(name: str) -> Callable[..., Any]:
    """Make the blocking twin of the async operation ``aiodist.<name>``, with torch's signature.

    What it returns is declared with the operation (:mod:`aiodist.group._operations`):
    ``"async_op"`` (torch's collectives: ``None``, or a :class:`Work` with ``async_op=True``,
    the parameter placed right after ``group`` as in torch), ``"work"`` (``isend``/``irecv``:
    a :class:`Work` at once), ``"result"`` (the operation's result once done: ``recv``'s
    sender) or ``"none"`` (blocks, returns ``None``).
    """
    fn: Callable[..., _group.Work[Any]] = getattr(_aio_api, name)
    mode = _RETURNS[name]
    signature = inspect.signature(fn)
    params = list(signature.parameters.values())
    names = [p.name for p in params]
    group_at = names.index("group") if "group" in names else None
    async_op_at = None
    if mode == "async_op":
        assert group_at is not None
        async_op_at = group_at + 1
        params.insert(async_op_at, inspect.Parameter("async_op", _POSITIONAL, default=False))
    signature = signature.replace(parameters=params, return_annotation=inspect.Signature.empty)

    def twin(*args: Any, **kwargs: Any) -> Any:
        # (By position rather than through signature.bind, which costs more than a small
        # operation; the async function checks the arguments.)
        async_op = False
        if async_op_at is not None:
            if len(args) > async_op_at:
                async_op = args[async_op_at]
                args = args[:async_op_at] + args[async_op_at + 1 :]
            else:
                async_op = kwargs.pop("async_op", False)
        if group_at is not None:
            group = args[group_at] if len(args) > group_at else kwargs.get("group")
            if isinstance(group, NonGroupMember):
                # As torch: a warning, nothing done, the members unaffected.
                _group.warn_not_in_group(twin.__name__, stacklevel=2)
                return -1 if mode == "result" else None
        start = _named(lambda: fn(*args, **kwargs))
        # Made on the loop thread, which is where the async work's callbacks may be added.
        if mode == "work" or async_op:
            return on_loop(lambda: Work(start()))
        result = start_operation(name, start, _track)
        return result if mode == "result" else None

    twin.__name__ = twin.__qualname__ = name
    twin.__signature__ = signature  # type: ignore[attr-defined]
    returns = {
        "async_op": "``None``; with ``async_op=True`` a :class:`Work` at once.",
        "work": "a :class:`Work` at once.",
        "result": "the operation's result, once it is done.",
        "none": "``None``, once the operation is done.",
    }[mode]
    twin.__doc__ = (
        f"Blocking twin of :func:`aiodist.{name}` (torch's signature); returns {returns}\n\n"
        + inspect.cleandoc(fn.__doc__ or "")
    )
    return twin


_POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD


def _track(work: _group.Work[T], done: Outcome[T]) -> None:
    # On the loop thread (or standing in for it): settle ``done`` with the operation's
    # outcome, at once when it ended as it started.
    if work.is_completed():
        _settle(work, done)
    else:
        work.add_done_callback(functools.partial(_settle, done=done))


def _settle(work: _group.Work[T], done: Outcome[T]) -> None:
    exc = work.exception()
    if exc is not None:
        done.set_exception(exc)
    else:
        done.set_result(work.result())


class Backend(str):
    """Backend names, as in ``torch.distributed.Backend``: ``Backend("GLOO") == "gloo"``.

    Raises:
        DistUsageError: the name is not a backend aiodist knows.
    """

    CPU = "cpu"
    CUDA = "cuda"
    GLOO = "gloo"
    NCCL = "nccl"

    def __new__(cls, name: str) -> Self:
        if not isinstance(name, str):
            raise DistUsageError(f"backend must be a string, got {type(name).__name__}")
        _backends.parse_backend(name)  # a name check, as torch's
        return super().__new__(cls, name.strip().lower())


def is_available() -> bool:
    """Return ``True``: aiodist's process groups are always available."""
    return True


def is_backend_available(backend: str) -> bool:
    """Return whether ``init_process_group(backend)`` can work in this build."""
    try:
        _, devices = _backends.parse_backend(backend)
    except DistUsageError:
        return False
    return any(_backends.is_backend_available(name) for name in devices.values())


def is_gloo_available() -> bool:
    """Return ``True``: ``"gloo"`` names the CPU backend."""
    return True


def is_nccl_available() -> bool:
    """Return whether the CUDA backend (``"nccl"``) can run here (cupy is installed)."""
    return _backends.is_backend_available("cuda")


def is_mpi_available() -> bool:
    """Return ``False``: aiodist has no MPI backend (it runs under MPI launchers, though)."""
    return False


def is_ucc_available() -> bool:
    """Return ``False``: aiodist has no UCC backend."""
    return False


def is_xccl_available() -> bool:
    """Return ``False``: aiodist has no XCCL backend."""
    return False


def is_torchelastic_launched() -> bool:
    """Return whether a torchrun-style launcher started this process (``TORCHELASTIC_RUN_ID``)."""
    return os.environ.get("TORCHELASTIC_RUN_ID") is not None


class _GroupMemberMeta(type):
    @property
    def WORLD(cls) -> ProcessGroup | None:
        """The default group once initialised, else ``None``."""
        world = _group.peek_world()
        return None if world is None else world.default_group


class GroupMember(metaclass=_GroupMemberMeta):
    """torch's group constants: ``WORLD`` (the default group) and ``NON_GROUP_MEMBER``."""

    NON_GROUP_MEMBER = NON_GROUP_MEMBER


#: ``dist.group.WORLD``, as torch spells it.
group = GroupMember


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: Timeout = default_pg_timeout,
    world_size: int = -1,
    rank: int = -1,
    store: Store | None = None,
    group_name: str = "",
    pg_options: object = None,
    device_id: object = None,
    enable_reconfigure: bool = False,
    *,
    auth_token: str | bytes | None = None,
    shared_memory: bool | None = None,
) -> None:
    """Join this process to the default process group, with torch's rules.

    ``init_method`` and ``store`` are exclusive; with neither, ``init_method="env://"``; with
    ``store``, ``rank`` and ``world_size`` are required. ``backend``: ``"cpu"``/``"gloo"``,
    ``"cuda"``/``"nccl"``, ``"cpu:gloo,cuda:nccl"`` or ``None``. ``pg_options``,
    ``device_id`` and ``enable_reconfigure`` are accepted for torch compatibility and ignored.

    Args:
        backend: the backend name.
        init_method: a rendezvous URL (``env://``, ``tcp://...``, ``file://...``).
        timeout: per-operation and rendezvous timeout (``timedelta`` or seconds).
        world_size: the number of processes.
        rank: this process's rank.
        store: a blocking store shared by every rank (``aiodist.sync.TCPStore`` etc.).
        group_name: namespace of this job's keys in the store.
        pg_options: ignored.
        device_id: ignored.
        enable_reconfigure: ignored: a world of aiodist changes its members with
            :func:`shrink_group` and :func:`admit` whatever it was given.
        auth_token: shared secret for the store the rendezvous makes and for every
            connection between ranks (``None``: ``$AIODIST_AUTH_TOKEN``, if set).
        shared_memory: whether ranks on one host talk through shared memory (see
            :func:`aiodist.init_process_group`): ``None`` when they can, ``True`` or raise,
            ``False`` never.

    Raises:
        DistUsageError: initialized already, conflicting or missing arguments, an unknown
            backend, or a store that is not a blocking aiodist store.
        DistTimeoutError: the other ranks did not arrive in time.
        DistNetworkError: the store or a peer could not be reached.
    """
    if store is not None and not isinstance(store, Store):
        raise DistUsageError(
            "init_process_group: store must be a blocking aiodist.sync store (TCPStore, "
            f"FileStore, HashStore, PrefixStore, EtcdStore), got {type(store).__name__}"
        )
    with _init_lock:
        if _group.peek_world() is not None:
            raise DistUsageError(_group.TWICE)
        run(
            _aio_api.init_process_group(
                backend, init_method, timeout, world_size, rank,
                None if store is None else store.async_store, group_name,
                auth_token=auth_token, shared_memory=shared_memory,
            )
        )  # fmt: skip
    _joined()


def join_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: Timeout = default_pg_timeout,
    store: Store | None = None,
    group_name: str = "",
    *,
    auth_token: str | bytes | None = None,
    shared_memory: bool | None = None,
    state: Sequence[Any] = (),
) -> None:
    """Join a running world as a new rank, when its members next call :func:`admit`.

    See :func:`aiodist.join_process_group`; ``store`` is a blocking store here, and
    ``state`` receives rank 0's arrays, as the members pass them to ``admit(state=...)``.

    Raises:
        DistUsageError: initialized already, or bad arguments.
        DistTimeoutError: not admitted within ``timeout``.
        DistNetworkError: the store or a member could not be reached.
    """
    if store is not None and not isinstance(store, Store):
        raise DistUsageError(
            "join_process_group: store must be a blocking aiodist.sync store (TCPStore, "
            f"FileStore, HashStore, PrefixStore, EtcdStore), got {type(store).__name__}"
        )
    with _init_lock:
        if _group.peek_world() is not None:
            raise DistUsageError(_group.TWICE)
        run(
            _aio_api.join_process_group(
                backend, init_method, timeout, None if store is None else store.async_store,
                group_name, auth_token=auth_token, shared_memory=shared_memory,
                state=state,
            )
        )  # fmt: skip
    _joined()


def _joined() -> None:
    # This process now holds the default world: leave it at exit, and dump on SIGUSR1 when
    # asked to (from the main thread, not the loop's: it dumps there while the main thread
    # waits for a blocking call).
    _leave_at_child_exit()
    if os.environ.get(DUMP_DIR_ENV):
        from ..debug import install_signal_handler

        install_signal_handler()


def destroy_process_group(group: Group = None) -> None:
    """Destroy ``group``, or with ``None`` every group and the default one.

    Destroying the default group closes its connections; when no blocking store is still
    open, the stores dropped without being closed are closed and the event-loop thread
    stops too (a later call starts a new one), so ``init_process_group`` may be called
    again. It returns within the bounds of :func:`aiodist.destroy_process_group`: the rank
    whose process serves the store waits until every rank has left.

    Raises:
        DistUsageError: not initialized, or ``group`` is not a process group of this world.
    """
    with _init_lock:
        world = _group.peek_world()
        run(_aio_api.destroy_process_group(group))
        ended = world is not None and (group is None or group is world.default_group)
        if ended and not any_store_open():
            close_all_stores()  # (those dropped unclosed: a stopped loop would not answer)
            loop_thread.stop()


def is_initialized() -> bool:
    """Return whether this process has a default process group."""
    return _group.peek_world() is not None


# Introspection reads the world's state, which only the loop thread changes.
get_rank = _aio_api.get_rank
get_world_size = _aio_api.get_world_size
get_backend = _aio_api.get_backend
get_backend_config = _aio_api.get_backend_config
get_process_group_ranks = _aio_api.get_process_group_ranks
get_group_rank = _aio_api.get_group_rank
get_global_rank = _aio_api.get_global_rank
get_pg_count = _aio_api.get_pg_count
get_default_backend_for_device = _aio_api.get_default_backend_for_device
set_timeout = _aio_api.set_timeout
supports_complex = _aio_api.supports_complex
DebugLevel = _aio_api.DebugLevel
get_debug_level = _aio_api.get_debug_level
set_debug_level = _aio_api.set_debug_level
register_rendezvous_handler = _rendezvous.register_rendezvous_handler
# Allocation reads the group's workspace, which exists once the group does.
empty = _aio_api.empty
zeros = _aio_api.zeros


def set_debug_level_from_env() -> None:
    """Set the debug level from ``TORCH_DISTRIBUTED_DEBUG`` (``OFF``, ``INFO``, ``DETAIL``).

    Raises:
        DistUsageError: the variable holds an unknown level.
    """
    set_debug_level(os.environ.get("TORCH_DISTRIBUTED_DEBUG", "OFF"))


def rendezvous(
    url: str, rank: int = -1, world_size: int = -1, **kwargs: Any
) -> Iterator[tuple[Store, int, int]]:
    """Rendezvous through ``url``; yield ``(blocking store, rank, world_size)`` once, as torch.

    As torch's, the URL is checked at the call, before the first ``next()``: an unknown
    scheme, and a URL that carries ``rank`` or ``world_size`` when they are passed too.

    Raises:
        DistUsageError: at the call: a malformed URL, an unknown scheme ("No rendezvous
            handler for ..."), a URL with node-specific arguments given twice ("The url: ...
            has node-specific arguments(rank, world_size) already."; torch raises an
            ``AssertionError``); at ``next()``: missing parameters (named).
        DistTimeoutError: at ``next()``: the other ranks did not arrive in time.
    """
    _rendezvous.resolve(url, rank, world_size)
    if rank != -1 or world_size != -1:
        query = url.split("#", 1)[0].partition("?")[2]
        if {"rank", "world_size"} & {k for k, _ in parse_qsl(query)}:
            raise DistUsageError(
                f"The url: {url} has node-specific arguments(rank, world_size) already. "
                "Pass them in the url or as arguments, not both"
            )
    return _rendezvous_steps(url, rank, world_size, kwargs)


def _rendezvous_steps(
    url: str, rank: int, world_size: int, kwargs: dict[str, Any]
) -> Iterator[tuple[Store, int, int]]:
    store, r, n = run(_rendezvous.rendezvous(url, rank, world_size, **kwargs))
    yield Store(store), r, n


def _sync_group_call(fn: Callable[..., Coroutine[Any, Any, T]]) -> Callable[..., T]:
    """The blocking twin of a coroutine function that makes groups; torch's extra
    arguments (``pg_options``, ``use_local_synchronization``, ``group_desc``) are ignored."""

    def twin(*args: Any, **kwargs: Any) -> T:
        for extra in ("pg_options", "use_local_synchronization", "group_desc"):
            kwargs.pop(extra, None)
        result: T = run(fn(*args, **kwargs))
        return result

    twin.__name__ = twin.__qualname__ = fn.__name__
    twin.__doc__ = f"Blocking twin of :func:`aiodist.{fn.__name__}`.\n\n" + inspect.cleandoc(
        fn.__doc__ or ""
    )
    twin.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]  # (for help())
    return twin


new_group = _sync_group_call(_aio_api.new_group)
new_subgroups = _sync_group_call(_aio_api.new_subgroups)
new_subgroups_by_enumeration = _sync_group_call(_aio_api.new_subgroups_by_enumeration)
split_group = _sync_group_call(_aio_api.split_group)
shrink_group = _sync_group_call(_aio_api.shrink_group)
lost_ranks = _sync_group_call(_aio_api.lost_ranks)
admit = _sync_group_call(_aio_api.admit)
recover = _sync_group_call(_aio_api.recover)
#: ``shrink_group``'s flag to let the operations in flight end before shrinking.
SHRINK_DEFAULT = _aio_api.SHRINK_DEFAULT
#: ``shrink_group``'s flag to fail the operations in flight at once.
SHRINK_ABORT = _aio_api.SHRINK_ABORT
init_device_mesh = _sync_group_call(_device_mesh.init_device_mesh)
DeviceMesh = _device_mesh.DeviceMesh

# -- collectives and point to point: torch's signatures -----------------------------------
all_reduce = _twin("all_reduce")
all_reduce_coalesced = _twin("all_reduce_coalesced")
broadcast = _twin("broadcast")
reduce = _twin("reduce")
all_gather = _twin("all_gather")
all_gather_coalesced = _twin("all_gather_coalesced")
all_gather_single = _twin("all_gather_single")
all_gather_into_tensor = _twin("all_gather_into_tensor")
gather = _twin("gather")
gather_single = _twin("gather_single")
gather_into_tensor = _twin("gather_into_tensor")
scatter = _twin("scatter")
reduce_scatter = _twin("reduce_scatter")
reduce_scatter_single = _twin("reduce_scatter_single")
reduce_scatter_tensor = _twin("reduce_scatter_tensor")
all_to_all = _twin("all_to_all")
all_to_all_single = _twin("all_to_all_single")
barrier = _twin("barrier")
monitored_barrier = _twin("monitored_barrier")
isend = _twin("isend")
irecv = _twin("irecv")
send = _twin("send")
recv = _twin("recv")
broadcast_object_list = _twin("broadcast_object_list")
all_gather_object = _twin("all_gather_object")
gather_object = _twin("gather_object")
scatter_object_list = _twin("scatter_object_list")
send_object_list = _twin("send_object_list")
recv_object_list = _twin("recv_object_list")


class P2POp:
    """One send or receive of a :func:`batch_isend_irecv` batch (torch's ``P2POp``).

    Args:
        op: :func:`isend` or :func:`irecv` of this module (or ``send``/``recv``).
        tensor: the array to send or to receive into.
        peer: global rank of the peer.
        group: the group (default: the world).
        tag: the message tag.
        group_peer: the peer as a group rank, instead of ``peer``.

    Raises:
        DistUsageError: ``op`` is not one of those functions.
    """

    def __init__(
        self,
        op: Callable[..., Any],
        tensor: Any,
        peer: int | None = None,
        group: Group = None,
        tag: int = 0,
        group_peer: int | None = None,
    ) -> None:
        if op not in (isend, send, irecv, recv):
            raise DistUsageError(
                f"P2POp: op must be aiodist.sync.isend or aiodist.sync.irecv, got {op!r}"
            )
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

    Every entry is checked before any starts (see :func:`aiodist.batch_isend_irecv`).

    Raises:
        DistUsageError: an empty list, an entry that is not a :class:`P2POp`, ops on
            different groups, or an entry that failed its checks.
    """
    if not isinstance(p2p_op_list, list | tuple) or not p2p_op_list:
        raise DistUsageError("batch_isend_irecv: p2p_op_list must be a non-empty list of P2POp")
    for p in p2p_op_list:
        if not isinstance(p, P2POp):
            raise DistUsageError(f"batch_isend_irecv: expected P2POp entries, got {p!r}")
    ops = [
        _aio_api.P2POp(
            _aio_api.isend if p.op in (isend, send) else _aio_api.irecv,
            p.tensor,
            p.peer,
            p.group,
            p.tag,
            p.group_peer,
        )
        for p in p2p_op_list
    ]
    return on_loop(lambda: [Work(w) for w in _aio_api.batch_isend_irecv(ops)])


def breakpoint(rank: int = 0, skip: int = 0, timeout_s: float = 3600) -> None:
    """Stop rank ``rank`` in the debugger; the other ranks wait for it in a barrier.

    ``skip``: the first ``skip`` calls are ignored. ``timeout_s``: how long the others wait
    (the barrier's own deadline, not the group's timeout, which may be shorter than a
    debugging session).

    Raises:
        DistUsageError: not initialized.
    """
    global _breakpoints
    _breakpoints += 1
    if _breakpoints <= skip:
        return
    if get_rank() == rank:
        import pdb

        pdb.Pdb().set_trace(sys._getframe(1))
    barrier(timeout=timeout_s)


_breakpoints = 0


#: What the peers of a rank whose process ended with its group open are told: "rank N ...".
EXIT_REASON = "exited without calling destroy_process_group() (its script had ended)"


def _exit_failure() -> str | None:
    """How the process is ending, if not cleanly: the exception, or a non-zero status."""
    # A multiprocessing child runs its exit handlers in a ``finally`` around its target;
    # the interpreter runs atexit handlers after printing an uncaught exception.
    exc = sys.exc_info()[1] or getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if isinstance(exc, SystemExit):
        if exc.code in (None, 0):
            return None
        if exc.__cause__ is None and exc.__context__ is None:
            return f"exited with status {exc.code}"
        exc = exc.__cause__ or exc.__context__  # (``sys.exit(1)`` in an ``except``)
    if exc is None:
        return None
    return f"exited on an exception: {type(exc).__name__}: {exc}"


def _leave_world_at_exit() -> None:
    # The default world, left as destroy_process_group() would leave it: what is in flight
    # ends first (the peers may still need it), the peers hear that this rank exited. On an
    # exception, abort instead: the peers would otherwise wait for this rank.
    world = _group.peek_world()
    if world is None or world.closed:
        return
    _group.set_current_world(None)
    failure = _exit_failure()
    cause = None if failure is None else DistError(f"rank {world.rank} {failure}")
    run(world.finish(EXIT_REASON, failure=cause))


def _close_all_at_exit() -> None:
    # Leave the default group and close what is still open (a hosted server, FileStore
    # reference counts) so that peers see an orderly end, then stop the loop. Bounded:
    # exit must not hang on a dead peer.
    if loop_thread.ident is None:
        return  # (also in a forked child: the parent's loop thread is not here)
    try:
        _leave_world_at_exit()
    except BaseException as exc:  # exit goes on: a Ctrl-C here stops only the leaving
        logger.warning("leaving the process group at exit failed: %r", exc)
    close_all_stores()
    loop_thread.stop()


atexit.register(_close_all_at_exit)
_child_exit_pid: int | None = None


def _leave_at_child_exit() -> None:
    """In a ``multiprocessing`` child, run :func:`_close_all_at_exit` when its target ends.

    Such a child ends with ``os._exit``, so ``atexit`` handlers never run there; its exit
    handlers (``multiprocessing.util.Finalize``) do, inside a ``finally`` around the target,
    where ``sys.exc_info()`` shows the exception it ends on.
    """
    global _child_exit_pid
    if multiprocessing.parent_process() is None or _child_exit_pid == os.getpid():
        return
    _child_exit_pid = os.getpid()
    multiprocessing.util.Finalize(None, _close_all_at_exit, exitpriority=100)
