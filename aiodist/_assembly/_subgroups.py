"""Subgroups: every rank of a world agrees, through the store, on each new group's ranks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import DistUsageError
from ..group import NON_GROUP_MEMBER, NonGroupMember, ProcessGroup, World, check_int

__all__ = ["new_group"]


async def new_group(
    world: World,
    ranks: Sequence[int] | None,
    *,
    backend: str,
    backends: Mapping[str, Any],
    timeout: float | None,
) -> ProcessGroup | NonGroupMember:
    """Create a process group of the given global ranks (see :func:`aiodist.new_group`).

    The group id is reserved first, then every rank of the world votes through the store
    with the ranks it was given; if any rank's list differs or fails its checks, every rank
    raises the same ``DistUsageError`` and the world stays usable.

    Raises:
        DistUsageError: this rank's list, or another rank's, was rejected.
        DistTimeoutError: some rank did not call ``new_group`` in time.
    """
    gid = world.allocate_group_id()
    try:
        members: list[int] | None = _check_ranks(ranks, world.size)
        problem = None
        vote = ",".join(map(str, members)) if members else ""
    except DistUsageError as exc:
        members, problem, vote = None, str(exc), "invalid"
    store, key = world.store, f"group/{gid}"
    agreed = (await store.compare_set(f"{key}/ranks", "", vote)).decode()
    if problem is None and agreed != vote:
        problem = (
            f"new_group: group {gid} is ranks [{agreed}] on another rank but ranks [{vote}] on "
            f"rank {world.rank}; every rank must call new_group with the same ranks in the "
            "same order"
        )
    if problem is not None:
        await store.compare_set(f"{key}/problem", "", f"rank {world.rank}: {problem}")
    await world.domain.meet(f"{key}/voted", world.size, timeout, "new_group")
    first = None
    if await store.check([f"{key}/problem"]):
        first = (await store.get(f"{key}/problem")).decode()
    # Every rank has read the outcome before any returns (see FailureDomain.meet); members
    # meet again once the group is set up.
    await world.domain.meet(f"{key}/read", world.size, timeout, "new_group")
    if first is not None:
        if problem is not None and first.startswith(f"rank {world.rank}:"):
            raise DistUsageError(problem)
        raise DistUsageError(f"new_group (group {gid}) was rejected by {first}")
    assert members is not None
    if world.rank not in members:
        return NON_GROUP_MEMBER
    return ProcessGroup(world, members, gid, backend, backends, timeout)


def _check_ranks(ranks: Sequence[int] | None, world_size: int) -> list[int]:
    if ranks is None:
        return list(range(world_size))
    try:
        members = list(ranks)
    except TypeError:
        raise DistUsageError(
            f"new_group: ranks must be a sequence of global ranks, got {type(ranks).__name__}"
        ) from None
    if not members:
        raise DistUsageError("new_group: ranks must not be empty")
    for r in members:
        check_int(r, "new_group: rank")
        if not 0 <= r < world_size:
            raise DistUsageError(
                f"new_group: rank {r} is out of range for a world of size {world_size}"
            )
    if len(set(members)) != len(members):
        raise DistUsageError(f"new_group: ranks {members} contain duplicates")
    return sorted(members)
