"""A world as it forms: what each rank joins, whether the ranks agree, who has arrived.

Worlds of different sizes live in different namespaces of a job's store (``<world size>/
<generation>``), so ranks given different world sizes would wait for each other in silence
until the timeout. While a rank forms its world (``init_process_group``), it records what it
joins under ``forming/<rank>`` in the job's namespace (:class:`FormingRank`), emptied once
the world formed or the attempt ended, and compares it with rank 0's (:class:`Forming`); a
long wait says which ranks have not arrived; the live view reads the records
(:func:`forming_worlds`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from .._util._speaking import SlowWait
from ..errors import DistUsageError
from ..store import PrefixStore, Store

__all__ = ["Forming", "FormingRank", "forming_worlds"]

#: The key set in a world's namespace when its ranks disagree on what world they form.
_MISMATCH = "mismatch"
#: Where each rank of a job records, while it forms a world, what it joins: the world size,
#: the backend, the generation, its process (``forming/<rank>`` in the job's namespace,
#: emptied once its world formed or its attempt ended; ``ended/<id>`` is its lease).
_FORMING = "forming"
# The most ranks a message lists by number.
_LISTED = 16


def _ranks_text(ranks: Sequence[int]) -> str:
    shown = ", ".join(map(str, ranks[:_LISTED]))
    return f"[{shown}{f', ... ({len(ranks)} in all)' if len(ranks) > _LISTED else ''}]"


@dataclass(frozen=True)
class FormingRank:
    """What a rank said it joins while its world forms (see :func:`forming_worlds`).

    Attributes:
        rank: the rank.
        world_size: the world size it was given.
        backend: the backend it was given.
        generation: the generation of its world (how many times it joined before).
        pid: its process.
        host: its host's name.
        since: when it began (seconds since the epoch, its clock).
    """

    rank: int
    world_size: int
    backend: str
    generation: int
    pid: int
    host: str
    since: float

    @property
    def who(self) -> str:
        """The rank and its process, for messages."""
        return f"rank {self.rank} (pid {self.pid} on {self.host})"


def _parse_forming(rank: int, raw: bytes) -> tuple[FormingRank, str] | None:
    # A record and its id; None for an emptied record, or one this version cannot read.
    if not raw:
        return None
    try:
        d = json.loads(raw)
        return FormingRank(
            rank,
            int(d["world_size"]),
            str(d["backend"]),
            int(d["generation"]),
            int(d["pid"]),
            str(d["host"]),
            float(d["since"]),
        ), str(d["id"])
    except (ValueError, KeyError, TypeError):
        return None


class Forming:
    """One rank's part in forming its world (``init_process_group``): its record in the
    job's namespace, the check that the ranks agree on the world, and who has arrived.

    Every rank compares its world size and backend with rank 0's record (one store read
    per poll until rank 0 has one); a rank that disagrees records the mismatch in both
    worlds' namespaces, so every rank forming either world raises at once with a message
    naming both values. A rank's record is emptied when its world formed or its attempt
    ended; its lease (``ended/<id>``) marks it over if its process dies while forming.
    """

    def __init__(
        self,
        job: PrefixStore,
        world: Store,
        rank: int,
        size: int,
        backend: str,
        generation: int,
    ) -> None:
        self._job = job
        self._world = world
        self._me = FormingRank(
            rank, size, backend, generation, os.getpid(), socket.gethostname(), time.time()
        )
        self._id = uuid.uuid4().hex
        self._agreed = rank == 0  # (rank 0 compares with nobody: the others compare with it)
        self._left = False
        self._clock = SlowWait(
            f"rank {rank}: init_process_group waits for the {size} ranks of its world",
            self._who_is_missing,
        )

    def __repr__(self) -> str:
        return f"<Forming {self._me.who} world_size={self._me.world_size}>"

    async def enter(self) -> None:
        """Record this rank as forming, arrived in its world, and check rank 0 at once.

        Raises:
            DistUsageError: this rank disagrees with rank 0 (both are named).
        """
        me = self._me
        record = {**dataclasses.asdict(me), "id": self._id}
        del record["rank"]
        await self._job.set(f"{_FORMING}/{me.rank}", json.dumps(record))
        await self._job.lease(f"ended/{self._id}", "1")
        await self._world.append("arrived", f"{me.rank},")
        await self.check()

    async def leave(self) -> None:
        """Empty this rank's record (best effort: the store may be gone)."""
        if self._left:
            return
        self._left = True
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5):
                await self._job.set(f"{_FORMING}/{self._me.rank}", "")
                await self._job.lease(f"ended/{self._id}", None)

    async def check(self) -> None:
        """Raise if the ranks disagree on the world (this rank with rank 0, or another
        rank of this world with its rank 0: see the class).

        Raises:
            DistUsageError: naming both ranks and both values.
        """
        if await self._world.check([_MISMATCH]):
            raise DistUsageError((await self._world.get(_MISMATCH)).decode(errors="replace"))
        if self._agreed or not await self._job.check([f"{_FORMING}/0"]):
            return
        parsed = _parse_forming(0, await self._job.get(f"{_FORMING}/0"))
        if parsed is None:
            return
        first, ident = parsed
        me = self._me
        differ = [
            (attr, getattr(first, attr), getattr(me, attr))
            for attr in ("world_size", "backend")
            if getattr(first, attr) != getattr(me, attr)
        ]
        if not differ:
            self._agreed = True
            return
        if await self._job.check([f"ended/{ident}"]):
            return  # (a record its process left behind as it died)
        text = (
            "init_process_group: the ranks disagree on the "
            + " and the ".join(attr.replace("_", " ") for attr, _, _ in differ)
            + f": {first.who} has "
            + ", ".join(f"{attr}={theirs!r}" for attr, theirs, _ in differ)
            + f", {me.who} has "
            + ", ".join(f"{attr}={mine!r}" for attr, _, mine in differ)
            + "; every rank must pass the same (with env://, WORLD_SIZE)"
        )
        theirs = PrefixStore(f"{first.world_size}/{first.generation}", self._job)
        with contextlib.suppress(Exception):
            await asyncio.gather(
                theirs.compare_set(_MISMATCH, "", text),
                self._world.compare_set(_MISMATCH, "", text),
            )
        raise DistUsageError(text)

    async def poll(self) -> None:
        """What a rank that waits for the others does at each look: :meth:`check`, and say
        which ranks have not arrived when a warning is due (see :mod:`aiodist._util._speaking`).

        Raises:
            DistUsageError: the ranks disagree on the world.
        """
        await self.check()
        await self._clock.tick()

    async def _who_is_missing(self) -> str:
        arrived = await self._world.get("arrived")
        here = sorted({int(r) for r in arrived.decode().split(",") if r})
        missing = [r for r in range(self._me.world_size) if r not in here]
        text = f"ranks {_ranks_text(missing)} have not arrived (ranks {_ranks_text(here)} have)"
        if missing and self._me.rank == min(here, default=0):
            elsewhere = await _forming_elsewhere(self._job, missing)
            if elsewhere:
                text += "; " + elsewhere
        return text


async def _forming_elsewhere(job: PrefixStore, missing: list[int]) -> str:
    """Which of the ``missing`` ranks are forming a world under another ``group_name`` in
    the same store (a rank given another name waits in another namespace)."""
    root, ours = job.underlying_store, job.prefix.rstrip("/")
    keys: list[tuple[str, int, str]] = []
    for key in await root.list_keys():
        head, _, tail = key.rpartition(f"/{_FORMING}/")
        if head.startswith("aiodist/") and head != ours and tail.isdigit() and int(tail) in missing:
            keys.append((head.removeprefix("aiodist/"), int(tail), key))
    if not keys:
        return ""
    found = []
    raws = await root.multi_get([key for _, _, key in keys])
    for (name, rank, _), raw in zip(keys, raws, strict=True):
        parsed = _parse_forming(rank, raw)
        if parsed is not None:
            found.append(
                f"rank {rank} forms a world of {parsed[0].world_size} under group_name {name!r}"
            )
    return "; ".join(found) + (" (every rank must pass the same group_name)" if found else "")


async def forming_worlds(job: Store) -> list[FormingRank]:
    """The ranks of a job (``job``: its namespace, :func:`job_store`) forming a world now,
    by rank: what each said it joins, and since when (for the live view).

    Raises:
        DistError: the store cannot be reached.
    """
    ranks = []
    for key in await job.list_keys():
        head, _, rank = key.partition("/")
        if head == _FORMING and rank.isdigit():
            ranks.append(int(rank))
    if not ranks:
        return []
    ranks.sort()
    raws = await job.multi_get([f"{_FORMING}/{r}" for r in ranks])
    parsed = [p for r, raw in zip(ranks, raws, strict=True) if (p := _parse_forming(r, raw))]
    if not parsed:
        return []
    ended = await asyncio.gather(*(job.check([f"ended/{ident}"]) for _, ident in parsed))
    return [rec for (rec, _), gone in zip(parsed, ended, strict=True) if not gone]
