"""The flight recorder: the last operations of each rank, dumped as JSON when things go wrong.

Every world keeps a ring of the last ``AIODIST_FR_BUFFER_SIZE`` operations (default 2000):
operation, group, sequence number, the call (shape, dtype, root, reduce op), peers, state
(``queued``, ``started``, ``completed``, ``failed``), timestamps and the error. Recording costs
one small object per operation and no I/O.

A rank's record is written as JSON

* when one of its operations times out (``DistTimeoutError``), into ``AIODIST_FR_DUMP_DIR``
  if that is set;
* on ``SIGUSR1``, once :func:`install_signal_handler` was called (``init_process_group`` does
  so when ``AIODIST_FR_DUMP_DIR`` is set, e.g. for the workers of ``aiodist-run``);
* on demand: :func:`dump`.

``python -m aiodist.debug DUMP.json...`` reads the dumps of all ranks and says which rank is
behind, at which operation, what every rank was doing there, and which operations the ranks
called differently.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from ._fingerprint import NO_FINGERPRINT, describe
from .errors import DistUsageError

__all__ = [
    "DEFAULT_BUFFER_SIZE",
    "FlightRecorder",
    "OpRecord",
    "analyze",
    "dump",
    "install_signal_handler",
    "main",
]

logger = logging.getLogger(__name__)

#: Operations each rank remembers unless ``AIODIST_FR_BUFFER_SIZE`` says otherwise.
DEFAULT_BUFFER_SIZE = 2000
_BUFFER_ENV = "AIODIST_FR_BUFFER_SIZE"
_DIR_ENV = "AIODIST_FR_DUMP_DIR"

# Every live recorder of this process (ranks may be tasks of one loop), for SIGUSR1.
_recorders: weakref.WeakSet[FlightRecorder] = weakref.WeakSet()
# Loops that already run the SIGUSR1 dump.
_loops_with_handler: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()


class OpRecord:
    """One operation as the flight recorder keeps it."""

    __slots__ = (
        "ended",
        "error",
        "fp",
        "group",
        "op",
        "p2p",
        "peers",
        "queued",
        "seq",
        "started",
        "state",
    )

    def __init__(
        self, op: str, group: int, seq: int, fp: bytes, peers: Sequence[int], p2p: bool
    ) -> None:
        self.op = op
        self.group = group
        self.seq = seq
        self.fp = fp
        self.peers = peers
        self.p2p = p2p
        self.state = "queued"
        self.queued = time.time()
        self.started = 0.0
        self.ended = 0.0
        self.error: str | None = None

    def __repr__(self) -> str:
        return f"<OpRecord {self.op} group={self.group} seq={self.seq} {self.state}>"

    def start(self) -> None:
        """Mark the operation as running."""
        self.state = "started"
        self.started = time.time()

    def finish(self, exc: BaseException | None) -> None:
        """Mark the operation as completed, or failed with ``exc`` (the first outcome stays)."""
        if self.ended:
            return
        self.ended = time.time()
        if exc is None:
            self.state = "completed"
        else:
            self.state = "failed"
            self.error = f"{type(exc).__name__}: {exc}"

    def to_json(self) -> dict[str, Any]:
        """Return the record as a JSON-ready dict."""
        start = self.started or self.queued
        return {
            "op": self.op,
            "group": self.group,
            "seq": self.seq,
            "p2p": self.p2p,
            "call": self.op if self.fp == NO_FINGERPRINT else describe(self.fp),
            "peers": list(self.peers),
            "state": self.state,
            "queued": self.queued,
            "started": self.started or None,
            "ended": self.ended or None,
            "duration_s": round(self.ended - start, 6) if self.ended else None,
            "error": self.error,
        }


def _buffer_size() -> int:
    text = os.environ.get(_BUFFER_ENV)
    if text is None:
        return DEFAULT_BUFFER_SIZE
    try:
        size = int(text)
    except ValueError:
        size = 0
    if size < 1:
        # Not worth failing a job over: the recorder is a debugging aid.
        logger.warning(
            "%s must be a positive integer, got %r; keeping %d ops",
            _BUFFER_ENV,
            text,
            DEFAULT_BUFFER_SIZE,
        )
        return DEFAULT_BUFFER_SIZE
    return size


class FlightRecorder:
    """A ring of one rank's last operations.

    Args:
        rank: the rank's global rank.
        world_size: the number of ranks.
        size: how many operations to keep; default ``AIODIST_FR_BUFFER_SIZE`` or 2000 (a
            value that is not a positive integer is logged and ignored).
    """

    def __init__(self, rank: int, world_size: int, size: int | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.size = _buffer_size() if size is None else size
        self._ring: list[OpRecord | None] = [None] * self.size
        self._count = 0
        _recorders.add(self)

    def __repr__(self) -> str:
        return f"<FlightRecorder rank={self.rank} ops={self._count} size={self.size}>"

    def record(
        self, op: str, group: int, seq: int, fp: bytes, peers: Sequence[int], p2p: bool = False
    ) -> OpRecord:
        """Add a newly issued operation, dropping the oldest when the ring is full."""
        rec = OpRecord(op, group, seq, fp, peers, p2p)
        self._ring[self._count % self.size] = rec
        self._count += 1
        return rec

    def records(self) -> list[OpRecord]:
        """Return the kept operations, oldest first."""
        n = min(self._count, self.size)
        start = self._count - n
        return [r for i in range(start, self._count) if (r := self._ring[i % self.size])]

    def to_json(self) -> dict[str, Any]:
        """Return the whole record of this rank as a JSON-ready dict."""
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "pid": os.getpid(),
            "time": time.time(),
            "ops_recorded": self._count,
            "ops": [r.to_json() for r in self.records()],
        }

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the record as JSON to ``path`` and return it."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(out)  # a reader never sees half a dump
        return out

    def default_path(self, directory: str | os.PathLike[str]) -> Path:
        """Return this rank's dump file in ``directory``: ``rank<N>.json``."""
        return Path(directory) / f"rank{self.rank}.json"

    def dump_on_timeout(self) -> Path | None:
        """Write the record into ``AIODIST_FR_DUMP_DIR``, if set (called on a timeout)."""
        directory = os.environ.get(_DIR_ENV)
        if not directory:
            logger.info("rank %d: set %s to dump the flight recorder", self.rank, _DIR_ENV)
            return None
        try:
            path = self.write(self.default_path(directory))
        except OSError as exc:
            logger.warning("rank %d: could not dump the flight recorder: %s", self.rank, exc)
            return None
        logger.warning("rank %d: flight recorder dumped to %s", self.rank, path)
        return path


def dump(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Return the flight record of the current context's rank, and write it as JSON.

    Args:
        path: the file to write; ``None`` writes ``rank<N>.json`` into
            ``AIODIST_FR_DUMP_DIR`` when that is set, else nothing.

    Returns:
        The record (what the file holds).

    Raises:
        DistUsageError: the default process group is not initialized here.
        OSError: the file cannot be written.
    """
    from .group import current_world

    recorder: FlightRecorder = current_world("aiodist.debug.dump").recorder
    data = recorder.to_json()
    if path is None and os.environ.get(_DIR_ENV):
        path = recorder.default_path(os.environ[_DIR_ENV])
    if path is not None:
        recorder.write(path)
    return data


def install_signal_handler(directory: str | os.PathLike[str] | None = None) -> bool:
    """Dump every rank of this process into ``directory`` when it receives ``SIGUSR1``.

    Called from a running event loop, the handler is registered with the loop
    (``loop.add_signal_handler``) and lives as long as the loop; otherwise with
    :func:`signal.signal`.

    Args:
        directory: where ``rank<N>.json`` files go; default ``AIODIST_FR_DUMP_DIR``.

    Returns:
        Whether a handler is in place (only the main thread can install one, and a handler
        the program installed itself is left alone).

    Raises:
        DistUsageError: no directory given and ``AIODIST_FR_DUMP_DIR`` is not set.
    """
    target = directory if directory is not None else os.environ.get(_DIR_ENV)
    if not target:
        raise DistUsageError(f"install_signal_handler needs a directory or {_DIR_ENV}")
    if threading.current_thread() is not threading.main_thread():
        logger.info("not installing the SIGUSR1 flight recorder dump: not the main thread")
        return False
    try:
        loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    if loop is not None and loop in _loops_with_handler:
        return True
    current = signal.getsignal(signal.SIGUSR1)
    if current not in (signal.SIG_DFL, None) and not getattr(current, "_aiodist", False):
        logger.info("SIGUSR1 already has a handler; the flight recorder leaves it")
        return False
    where = Path(target)

    def dump_all() -> None:
        for recorder in list(_recorders):
            try:
                recorder.write(recorder.default_path(where))
            except OSError as exc:
                logger.warning("rank %d: flight recorder dump failed: %s", recorder.rank, exc)

    if loop is not None:
        loop.add_signal_handler(signal.SIGUSR1, dump_all)
        _loops_with_handler.add(loop)
        return True

    def handler(signum: int, frame: FrameType | None) -> None:
        dump_all()

    handler._aiodist = True  # type: ignore[attr-defined]
    signal.signal(signal.SIGUSR1, handler)
    return True


# -- analysis of the dumps of all ranks --------------------------------------------------------
def analyze(dumps: Sequence[dict[str, Any]]) -> str:
    """Explain the state of a job from its ranks' dumps: who is behind, where, and mismatches.

    For each group, the first operation that has not completed on every rank that called
    it, or that some rank never called, is where the job stands; the ranks that did not
    start it are behind. Operations (same group and sequence number) that ranks called
    differently are listed as mismatches.

    Args:
        dumps: the records of the ranks, as :func:`dump` returns them.

    Returns:
        The report, one line per finding.
    """
    by_rank = {int(d["rank"]): d for d in dumps}
    ranks = sorted(by_rank)
    lines: list[str] = []
    # group -> rank -> seq -> op record (collectives only; the newest record wins)
    groups: dict[int, dict[int, dict[int, dict[str, Any]]]] = {}
    for rank in ranks:
        for op in by_rank[rank]["ops"]:
            if not op["p2p"]:
                groups.setdefault(op["group"], {}).setdefault(rank, {})[op["seq"]] = op
    if not groups:
        return "no collective operations recorded"
    for gid in sorted(groups):
        per_rank = groups[gid]
        members = [r for r in ranks if r in per_rank or gid == 0]
        for seq in sorted({s for ops in per_rank.values() for s in ops}):
            calls = {r: per_rank[r][seq]["call"] for r in members if seq in per_rank.get(r, {})}
            if len(set(calls.values())) > 1:
                text = "; ".join(f"rank {r} called {c}" for r, c in calls.items())
                lines.append(f"group {gid}: mismatch at op #{seq}: {text}")
        last = {r: max(per_rank.get(r, {}), default=-1) for r in members}
        top = max(last.values())
        stuck = None
        for seq in sorted({s for ops in per_rank.values() for s in ops}):
            states = [per_rank.get(r, {}).get(seq) for r in members]
            if any(s is None and last[r] < seq for r, s in zip(members, states, strict=True)):
                stuck = seq
                break
            if any(s is not None and s["state"] != "completed" for s in states):
                stuck = seq
                break
        if stuck is None:
            lines.append(f"group {gid}: all ranks completed op #{top}")
            continue
        call = next(per_rank[r][stuck]["call"] for r in members if stuck in per_rank.get(r, {}))
        behind = [r for r in members if stuck not in per_rank.get(r, {})]
        head = f"group {gid}: op #{stuck} {call} is the first op not completed by every rank"
        lines.append(head)
        if behind:
            lines.append(
                f"group {gid}: behind: {'rank' if len(behind) == 1 else 'ranks'} "
                f"{', '.join(map(str, behind))} never called op #{stuck}"
            )
        for r in members:
            rec = per_rank.get(r, {}).get(stuck)
            if rec is not None:
                what = rec["state"] + (f" ({rec['error']})" if rec["error"] else "")
                lines.append(f"  rank {r}: {what}")
            elif last[r] >= 0:
                prev = per_rank[r][last[r]]
                lines.append(
                    f"  rank {r}: not called; last op #{last[r]} {prev['call']} {prev['state']}"
                )
            else:
                lines.append(f"  rank {r}: not called; no op recorded")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line: ``python -m aiodist.debug DUMP.json...``."""
    parser = argparse.ArgumentParser(
        prog="python -m aiodist.debug",
        description="Say which rank is behind, and where, from the flight recorder dumps "
        "of all ranks.",
    )
    parser.add_argument("dumps", nargs="+", help="the JSON dumps, one per rank")
    args = parser.parse_args(argv)
    dumps = []
    for name in args.dumps:
        try:
            dumps.append(json.loads(Path(name).read_text()))
        except (OSError, ValueError) as exc:
            parser.error(f"cannot read {name}: {exc}")
    sys.stdout.write(analyze(dumps) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
