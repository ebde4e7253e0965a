"""The CPU backend: numpy arrays (and CPU DLPack tensors) over the group's transport.

Its intake (:func:`aiodist._arrays.as_array`) turns each array argument into the C-contiguous
numpy array the algorithms of :mod:`aiodist.collectives` take, or refuses it naming the
argument; the operations' argument rules are in :mod:`aiodist._operations`. Its data paths:
the transport algorithms (:mod:`aiodist.collectives`); for a group whose ranks all share
this host, the direct algorithms of a shared-memory workspace (:mod:`aiodist.collectives.shm`);
for a group spread over hosts with several of its ranks on some, the two-level algorithms
(:mod:`aiodist.collectives.two_level`).
Object collectives, barriers and point to point run here for every backend.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import _shared_array, collectives
from .._arrays import as_array, byte_view
from .._environment import turned_off
from .._operations import OPERATIONS, Call
from .._ops import ReduceOp
from ..collectives import objects, shm, two_level
from ..collectives.two_level import HostPlan
from ..group import Plan, ProcessGroup
from ..store import PrefixStore
from ..transport._shm_segment import SharedMemoryError
from ..transport.base import OpComm
from ..transport.shm import default_job_key
from . import Backend, Path

__all__ = ["BACKEND", "PATHS", "on_transport"]

logger = logging.getLogger(__name__)

_NAME = "cpu"  # the backend's name, which keys its workspace in a group's paths

Array = npt.NDArray[Any]


async def _setup(group: ProcessGroup) -> None:
    # A group whose ranks all share memory, served by this backend alone, runs its
    # collectives in a shared-memory workspace: the direct algorithms of collectives.shm.
    # (With a second backend a rank whose call was rejected could not tell whether its
    # peers took a turn in the workspace.)
    transport = group.world.transport
    local = transport.local_ranks
    if group.size > 1 and len(group.backends) == 1 and set(group.ranks) <= set(local):
        workspace = _Workspace(group, len(local))
        await workspace.get()
        group.paths[_NAME] = workspace
        return
    # A group over several hosts, with several of its ranks on some, works in two levels.
    plan = HostPlan.of_group(transport.hosts, group.ranks, group.rank)
    if plan is not None and not turned_off("AIODIST_TWO_LEVEL"):
        group.paths[_NAME] = _TwoLevel(plan)


_Turn = tuple["asyncio.Future[None] | None", "asyncio.Future[None]"]


class _Workspace:
    """A group's shared-memory workspace, created when the group is set up (its
    :class:`~aiodist.group.DataPath`, which keeps the order of the group's operations).

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


class _TwoLevel:
    """A group's hosts, for the two-level algorithms (its
    :class:`~aiodist.group.DataPath`; the algorithms run over the transport, in no order
    of their own, and hold nothing to release)."""

    def __init__(self, plan: HostPlan) -> None:
        self.plan = plan

    def __repr__(self) -> str:
        return f"<two levels: {self.plan!r}>"

    def covers(self, name: str) -> bool:
        return False

    def waiting_for(self) -> list[int]:
        return []

    async def skip(self, reason: str) -> None:
        return None

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
    ws = group.paths.get(_NAME)
    ready = ws.get() if isinstance(ws, _Workspace) else None
    if ready is not None and ready.done() and not ready.cancelled() and not ready.exception():
        workspace = ready.result()
        if not workspace.closed:
            try:
                return _shared_array.empty(dims, dt, workspace)
            except SharedMemoryError as exc:
                logger.warning("%s; using an ordinary array", exc)
    return np.zeros(dims, dt) if zeroed else np.empty(dims, dt)


# -- data paths ------------------------------------------------------------------------------
def on_transport(algorithm: Callable[..., Coroutine[Any, Any, Any]]) -> Path:
    """The path that runs ``algorithm(*comms, *call.args)`` over the group's transport."""

    def path(group: ProcessGroup, call: Call) -> Plan:
        return Plan(algorithm, call.args, call.fingerprint, call.output)

    return path


def _direct(group: ProcessGroup, call: Call, algorithm: str, args: tuple[Any, ...]) -> Plan:
    """``algorithm(*args)`` over the transport: its direct twin in the group's
    shared-memory workspace when the group has one, its two-level twin when the group
    spreads over hosts, else the flat algorithm."""
    transport, direct = _DIRECT[algorithm]
    path = group.paths.get(_NAME)
    if isinstance(path, _Workspace):
        turn = (path, path.reserve(), direct, call.fingerprint, *args)
        return Plan(_in_workspace, turn, call.fingerprint, call.output, sequenced=True)
    if isinstance(path, _TwoLevel) and algorithm in _TWO_LEVEL:
        return Plan(_TWO_LEVEL[algorithm], (path.plan, *args), call.fingerprint, call.output)
    return Plan(transport, args, call.fingerprint, call.output)


async def _in_workspace(
    comm: OpComm, ws: _Workspace, turn: _Turn, algorithm: Any, fp: bytes, *args: Any
) -> None:
    await algorithm(await ws.enter(turn), *args, fingerprint=fp)


def _all_reduce(group: ProcessGroup, call: Call) -> Plan:
    x, op, factor = call.args
    if factor is not None:  # (premultiplied: over the transport, in every group)
        args = (x, factor, _hosts(group))
        return Plan(_premul_all_reduce, args, call.fingerprint, call.output)
    return _direct(group, call, "all_reduce", (x, op))


async def _premul_all_reduce(comm: OpComm, x: Array, factor: float, hosts: HostPlan | None) -> None:
    np.multiply(x, x.dtype.type(factor), out=x)
    await _all_reduce_on(comm, hosts, x, ReduceOp.SUM)


async def _all_reduce_on(comm: OpComm, hosts: HostPlan | None, x: Array, op: ReduceOp) -> None:
    # all_reduce for the paths that prepare their data first: in two levels, or flat.
    if hosts is None:
        await collectives.all_reduce(comm, x, op)
    else:
        await two_level.all_reduce(comm, hosts, x, op)


def _reduce(group: ProcessGroup, call: Call) -> Plan:
    x, root, op, factor = call.args
    if factor is not None:
        args = (x, root, factor, _hosts(group))
        return Plan(_premul_reduce, args, call.fingerprint, call.output)
    return _direct(group, call, "reduce", (x, root, op))


async def _premul_reduce(
    comm: OpComm, x: Array, root: int, factor: float, hosts: HostPlan | None
) -> None:
    # Only the root's array is the caller's to change.
    scaled = np.multiply(x, x.dtype.type(factor), out=x if comm.rank == root else None)
    if hosts is None:
        await collectives.reduce(comm, scaled, root, ReduceOp.SUM)
    else:
        await two_level.reduce(comm, hosts, scaled, root, ReduceOp.SUM)


def _reduce_scatter(group: ProcessGroup, call: Call) -> Plan:
    out, ins, op, factor = call.args
    if factor is not None:
        args = (out, ins, factor, _hosts(group))
        return Plan(_premul_reduce_scatter, args, call.fingerprint, call.output)
    return _direct(group, call, "reduce_scatter", (out, ins, op))


async def _premul_reduce_scatter(
    comm: OpComm, out: Array, ins: list[Array], factor: float, hosts: HostPlan | None
) -> None:
    scaled = [np.multiply(a, a.dtype.type(factor)) for a in ins]
    if hosts is None:
        await collectives.reduce_scatter(comm, out, scaled, ReduceOp.SUM)
    else:
        await two_level.reduce_scatter(comm, hosts, out, scaled, ReduceOp.SUM)


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
    await _all_reduce_on(comm, hosts, flat, op)
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


async def _send(comm: OpComm, peer: int, x: Array) -> None:
    await comm.send(peer, 0, byte_view(x))


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

# The operations that take a turn in a workspace (the group layer asks, through the
# workspace's ``covers``, when one of them is rejected).
_DIRECT_OPS = frozenset(op.name for op in OPERATIONS.values() if op.algorithm in _DIRECT)

#: The CPU backend.
BACKEND = Backend.from_paths(_NAME, "cpu", as_array, PATHS, setup=_setup, empty=_empty)
