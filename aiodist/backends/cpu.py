"""The CPU backend: numpy arrays (and CPU DLPack tensors) over the group's transport.

Its intake (:func:`aiodist._arrays._intake.as_array`) turns each array argument into the C-contiguous
numpy array the algorithms of :mod:`aiodist.collectives` take, or refuses it naming the
argument; the operations' argument rules are in :mod:`aiodist.group._operations`. Its data paths:
the transport algorithms (:mod:`aiodist.collectives`); for a group whose ranks all share
this host, the direct algorithms of a shared-memory workspace (:mod:`aiodist.collectives.shm`);
for a group spread over hosts with several of its ranks on some, the two-level algorithms
(:mod:`aiodist.collectives.two_level`).
Object collectives, barriers and point to point run here for every backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from .. import collectives
from .._arrays._intake import as_array, byte_view
from .._arrays._reduce import ReduceOp
from .._util._environment import turned_off
from ..collectives import _shared_array, objects, shm, two_level
from ..collectives.two_level import HostPlan
from ..errors import (
    DistError,
    DistNetworkError,
    DistProtocolError,
    DistTimeoutError,
    DistUsageError,
)
from ..group import Plan, ProcessGroup
from ..group._operations import OPERATIONS, Call
from ..group._work import Inline, handed_over, rejected_on_transport
from ..store import PrefixStore
from ..transport._shm_segment import SharedMemoryError
from ..transport.base import OpComm, fails_alone, rejection_text
from ..transport.shm import default_job_key
from . import Backend, Path

__all__ = ["BACKEND", "PATHS", "on_transport"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_NAME = "cpu"  # the backend's name, which keys its workspace in a group's paths

Array = npt.NDArray[Any]


async def _setup(group: ProcessGroup) -> None:
    # A group whose ranks all share memory, served by this backend alone, runs its
    # collectives in a shared-memory workspace: the direct algorithms of collectives.shm.
    # (With a second backend, which one a rejected call belonged to may not be known, and
    # so whether its place was a turn in the workspace.)
    transport = group.world.transport
    local = transport.local_ranks
    if group.size > 1 and len(group.backends) == 1 and set(group.ranks) <= set(local):
        ws = await _agreed_workspace(group, len(local))
        if ws is not None:
            group.paths[_NAME] = _Workspace(ws)
            group.inline_ops.update(_inline_ops(group, ws))
        return
    # A group over several hosts, with several of its ranks on some, works in two levels.
    plan = HostPlan.of_group(transport.hosts, group.ranks, group.rank)
    if plan is not None and not turned_off("AIODIST_TWO_LEVEL"):
        group.paths[_NAME] = _TwoLevel(plan)


#: Errors a member's failed workspace set-up is raised as on the other members, by name.
_FAILURES: dict[str, type[DistError]] = {
    cls.__name__: cls
    for cls in (DistUsageError, DistTimeoutError, DistNetworkError, DistProtocolError)
}


async def _agreed_workspace(group: ProcessGroup, local: int) -> shm.NodeWorkspace | None:
    """Make the group's workspace with its members, who all end with the same outcome.

    A group's data path decides which operations take turns in the workspace, so every
    member must agree on whether there is one. A member that cannot make or map it records
    why (the first failure wins) and the others stop waiting for it at once: shared memory
    that cannot be had (``SharedMemoryError``: ``/dev/shm`` too small, say) leaves the group
    on the transport's algorithms on every member (logged); any other failure is raised on
    every member, naming the one where it happened. A member whose set-up succeeded then
    waits for every other member's outcome (or the first failure) before it keeps the
    workspace.

    Raises:
        DistError: a member could not set up the workspace (not for lack of shared memory).
    """
    store = PrefixStore(f"shm/ws/{group.group_id}", group.world.store)
    making = asyncio.ensure_future(
        shm.NodeWorkspace.create(
            store,
            group.rank,
            group.size,
            ranks=group.ranks,
            local_world_size=local,
            job_key=default_job_key(),
            # Within the group's own timeout (init_process_group's, new_group's): a rank
            # that never comes must not hold the others for the workspace's default 300 s.
            timeout=group.timeout,
        )
    )
    failure = asyncio.ensure_future(_first_failure(store))
    ws: shm.NodeWorkspace | None = None
    own: BaseException | None = None
    decided = False
    try:
        if await _unless_failed(making, failure) is not None:
            try:
                ws = making.result()
            except Exception as exc:
                own = exc
                await store.compare_set(_FAILED, "", f"{type(exc).__name__}|{group.rank}|{exc}")
        # Every member's outcome, or the first failure, decides.
        met = await _unless_failed(store.barrier(_DECIDED, group.size, group.timeout), failure)
        if met is not None:
            met.result()
        decided = True
        if not await store.check([_FAILED]):
            return ws
        kind, rank, reason = (await store.get(_FAILED)).decode(errors="replace").split("|", 2)
    except BaseException:
        if ws is not None:
            await ws.aclose()
        if not decided:
            with contextlib.suppress(Exception):
                # (Best effort: the others then stop waiting for this member.)
                why = f"DistNetworkError|{group.rank}|it stopped setting up"
                await asyncio.wait_for(store.compare_set(_FAILED, "", why), 1)
        raise
    finally:
        for task in (making, failure):
            task.cancel()
        await asyncio.gather(making, failure, return_exceptions=True)
    if ws is not None:
        await ws.aclose()
    if kind == SharedMemoryError.__name__:
        logger.warning(
            "%r: no shared-memory workspace, its collectives run over the transport: group "
            "rank %s: %s",
            group,
            rank,
            reason,
        )
        return None
    if own is not None and int(rank) == group.rank:
        raise own
    raise _FAILURES.get(kind, DistError)(
        f"setting up the shared-memory workspace of {group!r}: group rank {rank} failed: "
        f"{kind}: {reason}"
    )


async def _first_failure(store: PrefixStore) -> None:
    # Returns once a member recorded a failure (the store's own timeout is waited again).
    while True:
        try:
            await store.wait([_FAILED])
            return
        except DistTimeoutError:
            continue


async def _unless_failed(
    step: Awaitable[T], failure: asyncio.Future[None]
) -> asyncio.Future[T] | None:
    """Await ``step`` unless a member's failure is recorded first (then ``step`` is
    cancelled and this returns ``None``); return the ended step, holding its outcome."""
    task = asyncio.ensure_future(step)
    await asyncio.wait((task, failure), return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        return task
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


# The keys of the agreement on a group's workspace (in its namespace, shm/ws/<group id>).
_FAILED, _DECIDED = "failed", "decided"


class _Workspace:
    """A group's shared-memory workspace (its :class:`~aiodist.group.DataPath`).

    Every operation whose algorithm has a direct twin (:data:`_DIRECT`) takes a turn in it,
    whatever its arguments, rejected or not: the turns are the same on every rank.
    """

    def __init__(self, ws: shm.NodeWorkspace) -> None:
        self.ws = ws

    def __repr__(self) -> str:
        return f"<shared-memory workspace {self.ws!r}>"

    def abort(self, cause: BaseException) -> None:
        self.ws.abort(cause)

    async def aclose(self) -> None:
        await self.ws.aclose()


class _TwoLevel:
    """A group's hosts, for the two-level algorithms (its
    :class:`~aiodist.group.DataPath`; the algorithms run over the transport, in no order
    of their own, and hold nothing to release)."""

    def __init__(self, plan: HostPlan) -> None:
        self.plan = plan

    def __repr__(self) -> str:
        return f"<two levels: {self.plan!r}>"

    def abort(self, cause: BaseException) -> None:
        return None

    async def aclose(self) -> None:
        return None


def _hosts(group: ProcessGroup) -> HostPlan | None:
    """The group's plan of hosts, when its collectives work in two levels."""
    path = group.paths.get(_NAME)
    return path.plan if isinstance(path, _TwoLevel) else None


def _empty(group: ProcessGroup, dims: tuple[int, ...], dt: np.dtype[Any], zeroed: bool) -> Array:
    # In shared memory when the group has a workspace (its ranks all share this host);
    # a /dev/shm that cannot hold it is logged and gives an ordinary array.
    path = group.paths.get(_NAME)
    if isinstance(path, _Workspace) and not path.ws.closed:
        try:
            return _shared_array.empty(dims, dt, path.ws)
        except SharedMemoryError as exc:
            logger.warning("%s; using an ordinary array", exc)
    return np.zeros(dims, dt) if zeroed else np.empty(dims, dt)


# -- data paths ------------------------------------------------------------------------------
def on_transport(algorithm: Callable[..., Awaitable[Any]]) -> Path:
    """The path that runs ``algorithm(*comms, *call.args)`` over the group's transport."""

    def path(group: ProcessGroup, call: Call) -> Plan:
        return Plan(algorithm, call.args, call.fingerprint, call.output)

    return path


def _direct(
    group: ProcessGroup,
    call: Call,
    algorithm: str,
    args: tuple[Any, ...],
    then: Callable[[], object] | None = None,
) -> Plan:
    """``algorithm(*args)``, then ``then()``: in a turn of the group's shared-memory
    workspace when it has one (the algorithm's direct twin), in two levels when the group
    spreads over hosts (its two-level twin, where there is one), else over the transport."""
    flat, direct = _DIRECT[algorithm]
    path = group.paths.get(_NAME)
    waiting_for = None
    run: Callable[..., Any] = flat
    if isinstance(path, _Workspace):
        run, args = _in_turn, (path.ws, direct, call.fingerprint, *args)
        waiting_for = path.ws.waiting_for
    elif isinstance(path, _TwoLevel) and algorithm in _TWO_LEVEL:
        run, args = _TWO_LEVEL[algorithm], (path.plan, *args)
    if then is not None:
        run, args = _followed_by, (run, then, *args)
    return Plan(run, args, call.fingerprint, call.output, waiting_for=waiting_for)


def _inline_ops(group: ProcessGroup, ws: shm.NodeWorkspace) -> dict[str, Inline]:
    """What ``group`` runs at once in its workspace when the turn is free
    (:attr:`~aiodist.group.ProcessGroup.inline_ops`): an all_reduce of a small numpy array
    by a plain reduction, and a barrier. Anything else declines (``None``): the general
    path plans it, and rejects it, telling the peers, when its checks fail."""
    check_all_reduce = OPERATIONS["all_reduce"].check
    barrier_fp = OPERATIONS["barrier"].check(as_array, group).fingerprint

    def rest_of(started: Coroutine[Any, Any, None], fp: bytes, output: Any) -> Plan:
        return Plan(handed_over, (started,), fp, output, waiting_for=ws.waiting_for)

    def all_reduce(args: tuple[Any, ...]) -> tuple[Any, bytes, Plan | None] | None:
        tensor, op = args
        if (
            type(tensor) is not np.ndarray
            or type(op) is not ReduceOp
            or tensor.nbytes > shm.SMALL_BYTES
        ):
            return None
        try:
            call = check_all_reduce(as_array, group, tensor, op)
        except DistUsageError:
            return None
        if not ws.enter_now():
            return None
        x, rop, _ = call.args
        fp = call.fingerprint
        started = shm.small_all_reduce_in_turn(ws, x, rop, fp)
        return tensor, fp, None if started is None else rest_of(started, fp, tensor)

    def barrier(args: tuple[Any, ...]) -> tuple[Any, bytes, Plan | None] | None:
        if not ws.enter_now():
            return None
        started = shm.barrier_in_turn(ws, barrier_fp)
        return None, barrier_fp, None if started is None else rest_of(started, barrier_fp, None)

    return {"all_reduce": all_reduce, "barrier": barrier}


def _in_turn(
    comm: OpComm, ws: shm.NodeWorkspace, algorithm: Any, fp: bytes, *args: Any
) -> Coroutine[Any, Any, None]:
    # Called as the operation starts, in issue order: its ticket is its place in the turns.
    coro: Coroutine[Any, Any, None] = algorithm(ws, *args, fingerprint=fp, ticket=ws.reserve())
    return coro


def _followed_by(
    comm: OpComm, run: Callable[..., Awaitable[Any]], then: Callable[[], object], *args: Any
) -> Coroutine[Any, Any, None]:
    return _then(run(comm, *args), then)  # (run starts now: it may take a turn)


async def _then(started: Awaitable[Any], then: Callable[[], object]) -> None:
    await started
    then()


def _reject(group: ProcessGroup, algorithm: str | None, error: BaseException, tell: bool) -> Plan:
    """The plan of a rejected call: a turn of the workspace if an accepted call of the
    operation would take one (the peers' turns then fail alike), else
    :func:`~aiodist.backends.rejected_on_transport`."""
    path = group.paths.get(_NAME)
    if isinstance(path, _Workspace) and algorithm in _DIRECT:
        return Plan(_skip_turn, (path.ws, fails_alone(error)), waiting_for=path.ws.waiting_for)
    return rejected_on_transport(group, algorithm, error, tell)


def _skip_turn(
    comm: OpComm, ws: shm.NodeWorkspace, error: BaseException
) -> Coroutine[Any, Any, None]:
    return _skipped(ws, ws.reserve(), error)


async def _skipped(ws: shm.NodeWorkspace, ticket: int, error: BaseException) -> None:
    await shm.skip(ws, rejection_text(error), ticket=ticket)
    raise error


def _scaled(x: Array, factor: float) -> Array:
    # ``PREMUL_SUM``'s input: a scaled copy, so that the caller's array is only ever
    # written with the result (a call that fails leaves it as it was).
    scaled: Array = np.multiply(x, x.dtype.type(factor))
    return scaled


def _all_reduce(group: ProcessGroup, call: Call) -> Plan:
    x, op, factor = call.args
    if factor is None:
        return _direct(group, call, "all_reduce", (x, op))
    scaled = _scaled(x, factor)
    return _direct(
        group, call, "all_reduce", (scaled, ReduceOp.SUM), functools.partial(np.copyto, x, scaled)
    )


def _reduce(group: ProcessGroup, call: Call) -> Plan:
    x, root, op, factor = call.args
    if factor is None:
        return _direct(group, call, "reduce", (x, root, op))
    scaled = _scaled(x, factor)
    then = functools.partial(np.copyto, x, scaled) if group.rank == root else None
    return _direct(group, call, "reduce", (scaled, root, ReduceOp.SUM), then)


def _reduce_scatter(group: ProcessGroup, call: Call) -> Plan:
    out, ins, op, factor = call.args
    if factor is not None:
        ins, op = [_scaled(a, factor) for a in ins], ReduceOp.SUM
    return _direct(group, call, "reduce_scatter", (out, ins, op))


def _all_reduce_coalesced(group: ProcessGroup, call: Call) -> Plan:
    args = (*call.args, _hosts(group))
    return Plan(_coalesced_all_reduce, args, call.fingerprint, call.output)


async def _coalesced_all_reduce(
    comm: OpComm, xs: list[Array], op: ReduceOp, factor: float | None, hosts: HostPlan | None
) -> None:
    flat = np.concatenate([x.reshape(-1) for x in xs])
    if factor is not None:
        np.multiply(flat, flat.dtype.type(factor), out=flat)
        op = ReduceOp.SUM
    if hosts is None:
        await collectives.all_reduce(comm, flat, op)
    else:
        await two_level.all_reduce(comm, hosts, flat, op)
    offset = 0
    for x in xs:
        x.reshape(-1)[:] = flat[offset : offset + x.size]
        offset += x.size


async def _all_gather_coalesced(comm: OpComm, rows: list[list[Array]], xs: list[Array]) -> None:
    flat = np.concatenate([byte_view(x) for x in xs])
    gathered = np.zeros((comm.size, flat.size), np.uint8)
    await collectives.all_gather(comm, list(gathered), flat)
    for r, outs in enumerate(rows):
        offset = 0
        for o in outs:
            n = o.nbytes
            byte_view(o)[:] = gathered[r, offset : offset + n].data
            offset += n


def _send(comm: OpComm, peer: int, x: Array) -> asyncio.Future[None]:
    # The message takes its place among the peer's as the send is issued, even when the
    # operation then waits for a turn of the loop: a rejected send issued next, whose word
    # leaves at once, must not overtake it (see Mailbox.poison).
    return comm.send(peer, 0, byte_view(x))


async def _recv(comm: OpComm, peer: int | None, out: Array, ranks: tuple[int, ...] | None) -> int:
    sender = await comm.recv_into(peer, 0, byte_view(out))
    return sender if ranks is None else ranks.index(sender)


# The algorithms a workspace runs directly: their transport version and their direct one.
_DIRECT: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "all_reduce": (collectives.all_reduce, shm.all_reduce),
    "broadcast": (collectives.broadcast, shm.broadcast),
    "reduce": (collectives.reduce, shm.reduce),
    "all_gather": (collectives.all_gather, shm.all_gather),
    "gather": (collectives.gather, shm.gather),
    "scatter": (collectives.scatter, shm.scatter),
    "reduce_scatter": (collectives.reduce_scatter, shm.reduce_scatter),
    "all_to_all": (collectives.all_to_all, shm.all_to_all),
    "barrier": (collectives.barrier, shm.barrier),
}

# The algorithms with a two-level twin, for groups spread over hosts.
_TWO_LEVEL: dict[str, Callable[..., Any]] = {
    "all_reduce": two_level.all_reduce,
    "broadcast": two_level.broadcast,
    "reduce": two_level.reduce,
    "all_gather": two_level.all_gather,
    "reduce_scatter": two_level.reduce_scatter,
    "barrier": two_level.barrier,
}

#: Algorithm -> the CPU backend's data path.
PATHS: dict[str, Path] = {
    "all_reduce": _all_reduce,
    "all_reduce_coalesced": _all_reduce_coalesced,
    "broadcast": lambda g, c: _direct(g, c, "broadcast", c.args),
    "reduce": _reduce,
    "all_gather": lambda g, c: _direct(g, c, "all_gather", c.args[:2]),
    "all_gather_coalesced": on_transport(_all_gather_coalesced),
    "gather": lambda g, c: _direct(g, c, "gather", c.args),
    "scatter": lambda g, c: _direct(g, c, "scatter", c.args),
    "reduce_scatter": _reduce_scatter,
    "all_to_all": lambda g, c: _direct(g, c, "all_to_all", c.args),
    "barrier": lambda g, c: _direct(g, c, "barrier", ()),
    "monitored_barrier": on_transport(collectives.monitored_barrier),
    "send": on_transport(_send),
    "recv": on_transport(_recv),
    "broadcast_objects": on_transport(objects.broadcast_objects),
    "all_gather_objects": on_transport(objects.all_gather_objects),
    "gather_objects": on_transport(objects.gather_objects),
    "scatter_objects": on_transport(objects.scatter_objects),
    "send_objects": on_transport(objects.send_objects),
    "recv_objects": on_transport(objects.recv_objects),
}

#: The CPU backend.
BACKEND = Backend.from_paths(
    _NAME, "cpu", as_array, PATHS, setup=_setup, empty=_empty, reject=_reject
)
