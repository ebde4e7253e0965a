"""The async API's plain functions: what a group is (rank, size, ranks, backend), the
arrays a group's workspace shares, timeouts and the debug level.

None talks to the network; each reads the group it is given (the default group when none).
"""

from __future__ import annotations

import enum
import logging
from typing import Any

import numpy.typing as npt

from .. import backends as _backends, group as _group
from .._arrays._reduce import PremulSum, ReduceOp
from .._util._timeouts import Timeout, to_seconds
from ..errors import DistUsageError
from ..group import NonGroupMember, ProcessGroup, resolve_group
from ._collectives import Group, Op

Array = npt.NDArray[Any]


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

    Any group whose ranks share this host reads it in place, not only ``group``: a
    subgroup, or the group that replaces ``group`` (``shrink_group``, ``admit``), so a
    gradient buffer made once stays shared through membership changes.

    Lifetime: the memory lives as long as any view of the array does (peers drop their
    mappings at their next collective); it stays valid after the group is destroyed. Do
    not touch it while a collective that uses it runs: in ``all_reduce`` the peers write
    into it.

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


def given_name(backend: str | None, chosen: str) -> str:
    """A group's backend name: the one given, in lower case (``"gloo"``), as torch's
    ``get_backend`` answers (scripts compare it with what they passed); for ``None``, the
    backends chosen (``"cpu"``)."""
    return chosen if backend is None else backend.strip().lower()


def get_backend(group: Group = None) -> str:
    """Return the backend name of ``group``: the one given to ``init_process_group`` (or
    ``new_group``), in lower case (``"gloo"``, ``"cpu:gloo,cuda:nccl"``), as torch answers;
    for ``backend=None``, the backends chosen (``"cpu"``).

    Raises:
        DistUsageError: not initialized, or a non-member sentinel (in torch's words:
            ``Invalid process group specified``).
    """
    if isinstance(group, NonGroupMember):
        raise DistUsageError(
            "get_backend: Invalid process group specified: this rank is not a member of the "
            "group (new_group returned NON_GROUP_MEMBER here)"
        )
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


def set_timeout(timeout: Timeout, group: ProcessGroup | None = None) -> None:
    """Give the operations that ``group`` (default: the default group) issues from now on
    the deadline ``timeout`` (seconds or a ``timedelta``; ``None``: none); those in flight
    keep theirs. An operation's own ``timeout=`` still wins.

    Raises:
        DistUsageError: not initialized, ``group`` is not a process group of this rank, or
            ``timeout`` is not a duration.
    """
    resolve_group(group, "set_timeout").timeout = to_seconds(timeout)


def supports_complex(reduce_op: Op | None = None, *, reduceOp: Op | None = None) -> bool:
    """Return whether ``reduce_op`` can reduce complex arrays (not MIN, MAX or bitwise ops).

    ``reduceOp`` is torch's name of the argument.

    Raises:
        DistUsageError: no operation given, or both names.
    """
    if (reduce_op is None) == (reduceOp is None):
        raise DistUsageError("supports_complex takes one reduction: reduce_op (or reduceOp)")
    reduce_op = reduce_op if reduce_op is not None else reduceOp
    assert reduce_op is not None
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
