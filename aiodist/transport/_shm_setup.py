"""Collective setup of shared memory among the ranks of one host, through the store.

Every wait here is bounded by the caller's deadline and watches the peers whose process
is already known: a peer that exits during setup fails it within ``_POLL_SECONDS``, a
peer that never comes fails it at the deadline, naming the ranks missing.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import DistNetworkError, DistProtocolError, DistTimeoutError
from ..store import Store
from ._shm_segment import ProcessId, is_alive

__all__ = ["barrier", "count_of", "exchange", "process_of", "publish", "ranks_of", "ranks_text"]

logger = logging.getLogger(__name__)

# How often a wait on the store stops to check that the peers it knows are still alive.
_POLL_SECONDS = 0.25


async def _wait_keys(
    store: Store,
    keys: Mapping[int, str],
    deadline: float | None,
    procs: Mapping[int, ProcessId],
    what: str,
) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    while True:
        left = None if deadline is None else deadline - loop.time()
        if left is not None and left <= 0:
            missing = [r for r, k in keys.items() if not await store.check([k])]
            if not missing:
                return
            raise DistTimeoutError(
                f"{what}: ranks {missing} did not arrive within {loop.time() - started:.3g} s"
            )
        try:
            step = _POLL_SECONDS if left is None else min(_POLL_SECONDS, left)
            await store.wait(list(keys.values()), timeout=step)
            return
        except DistTimeoutError:
            pass
        for r, proc in procs.items():
            if not is_alive(proc):
                raise DistNetworkError(f"{what}: rank {r} (pid {proc.pid}) exited")


def count_of(rank: int, record: Mapping[str, Any], field: str, what: str) -> int:
    """The non-negative integer ``field`` of rank ``rank``'s ``record``.

    Raises:
        DistProtocolError: the record has no such field, or something else in it.
    """
    value = record.get(field)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DistProtocolError(
            f"{what}: rank {rank} published {str(value)[:80]!r} as its {field}, not a "
            "non-negative integer"
        )
    return value


def process_of(rank: int, record: Mapping[str, Any], what: str) -> ProcessId:
    """The process that rank ``rank``'s ``record`` names (its pid and start time).

    Raises:
        DistProtocolError: the record names none.
    """
    return ProcessId(count_of(rank, record, "pid", what), count_of(rank, record, "start", what))


async def publish(store: Store, key: str, rank: int, record: Mapping[str, Any]) -> None:
    """Publish this rank's ``record`` under ``key/<rank>`` (for :func:`exchange`)."""
    await store.set(f"{key}/{rank}", json.dumps(record))


async def exchange(
    store: Store,
    key: str,
    rank: int,
    ranks: Sequence[int],
    record: Mapping[str, Any],
    deadline: float | None,
    what: str,
) -> dict[int, dict[str, Any]]:
    """Publish this rank's ``record`` under ``key/<rank>`` and return every peer's.

    Raises:
        DistTimeoutError: a peer did not publish before ``deadline`` (loop time).
        DistProtocolError: a peer's record is not what this version writes.
    """
    await publish(store, key, rank, record)
    keys = {r: f"{key}/{r}" for r in ranks if r != rank}
    await _wait_keys(store, keys, deadline, {}, what)
    values = await store.multi_get(list(keys.values()))
    records = {}
    for r, value in zip(keys, values, strict=True):
        try:
            rec = json.loads(value)
        except ValueError:
            rec = None
        if not isinstance(rec, dict):
            raise DistProtocolError(f"{what}: rank {r} published {value[:80]!r}, not a record")
        records[r] = rec
    return records


async def barrier(
    store: Store,
    key: str,
    rank: int,
    ranks: Sequence[int],
    deadline: float | None,
    procs: Mapping[int, ProcessId],
    what: str,
    failure: str | None = None,
) -> str | None:
    """Return once every rank of ``ranks`` has reached the barrier ``key``, saying whether
    it failed: the first ``"rank R: failure"`` any of them (this one included) passed, else
    ``None``. Every rank gets the same answer.

    Raises:
        DistTimeoutError: a peer did not arrive before ``deadline`` (loop time).
        DistNetworkError: a peer's process (``procs``) exited meanwhile.
    """
    await store.set(f"{key}/{rank}", "" if failure is None else failure)
    keys = {r: f"{key}/{r}" for r in ranks if r != rank}
    await _wait_keys(store, keys, deadline, procs, what)
    said = dict(zip(keys, await store.multi_get(list(keys.values())), strict=True))
    said[rank] = b"" if failure is None else failure.encode()
    failed = [r for r in sorted(said) if said[r]]
    return f"rank {failed[0]}: {said[failed[0]].decode()}" if failed else None


def ranks_text(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (``ranks`` sorted)."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


def ranks_of(text: str) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]`` (the inverse of :func:`ranks_text`)."""
    ranks: list[int] = []
    for run in text.split(","):
        lo, _, hi = run.partition("-")
        ranks.extend(range(int(lo), int(hi or lo) + 1))
    return ranks
