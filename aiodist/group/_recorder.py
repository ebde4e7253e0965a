"""The flight recorder's runtime: a ring of each rank's last operations.

Every world keeps one :class:`FlightRecorder` of its last ``AIODIST_FR_BUFFER_SIZE``
operations (default 2000): operation, group, sequence number, the call (shape, dtype, root,
reduce op), peers, state (``queued``, ``started``, ``completed``, ``failed``), timestamps and
the error, and the name :func:`record_comm` gave it. Recording costs one small object per
operation and no I/O. Writing the records out and reading them back is :mod:`aiodist.debug`'s.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from .._arrays._fingerprint import NO_FINGERPRINT, describe
from ..errors import DistUsageError

__all__ = [
    "DEFAULT_BUFFER_SIZE",
    "DUMP_DIR_ENV",
    "FlightRecorder",
    "OpRecord",
    "comm_name",
    "live_recorders",
    "payload_nbytes",
    "record_comm",
    "set_observer",
]

logger = logging.getLogger(__name__)

#: Operations each rank remembers unless ``AIODIST_FR_BUFFER_SIZE`` says otherwise.
DEFAULT_BUFFER_SIZE = 2000
_BUFFER_ENV = "AIODIST_FR_BUFFER_SIZE"
#: Where dumps go when a timeout or a signal asks for one.
DUMP_DIR_ENV = "AIODIST_FR_DUMP_DIR"

# Every live recorder of this process (ranks may be tasks of one loop), for SIGUSR1.
_recorders: weakref.WeakSet[FlightRecorder] = weakref.WeakSet()


def live_recorders() -> list[FlightRecorder]:
    """Return the flight recorders of every world alive in this process."""
    return list(_recorders)


_comm_name: ContextVar[str | None] = ContextVar("aiodist_comm_name", default=None)


@contextlib.contextmanager
def record_comm(name: str) -> Iterator[None]:
    """Give the operations issued inside the block the name ``name`` (torch's ``record_comm``).

    The flight recorder keeps it with each of them (``"name"`` in :mod:`aiodist.debug`'s
    dumps), so that a dump says which part of a program issued what. It applies to the
    current task or thread (a context variable), across every group; blocks nest.

    Raises:
        DistUsageError: ``name`` is not a string.
    """
    if not isinstance(name, str):
        raise DistUsageError(f"record_comm: name must be a string, got {type(name).__name__}")
    token = _comm_name.set(name)
    try:
        yield
    finally:
        _comm_name.reset(token)


def comm_name() -> str | None:
    """The name :func:`record_comm` gives operations issued here now, if any."""
    return _comm_name.get()


class OpRecord:
    """One operation as the flight recorder keeps it."""

    __slots__ = (
        "ended",
        "error",
        "fp",
        "group",
        "name",
        "nbytes",
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
        self.name = _comm_name.get()
        #: Bytes of the arrays the operation was given; counted only for the metrics.
        self.nbytes = 0

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
        if observer is not None:
            observer(self)

    def to_json(self) -> dict[str, Any]:
        """Return the record as a JSON-ready dict."""
        start = self.started or self.queued
        return {
            "op": self.op,
            "name": self.name,
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


#: Called with every record that ends, once :mod:`aiodist.metrics` is enabled.
observer: Callable[[OpRecord], None] | None = None


def set_observer(fn: Callable[[OpRecord], None]) -> None:
    """Call ``fn`` with every operation's record when it ends (see :mod:`aiodist.metrics`)."""
    global observer
    observer = fn


def payload_nbytes(args: Sequence[Any]) -> int:
    """Bytes of the arrays among an operation's arguments (and in lists of them)."""
    total = 0
    for arg in args:
        if isinstance(arg, (list, tuple)):
            total += sum(getattr(a, "nbytes", 0) for a in arg)
        elif not isinstance(arg, (int, float)):
            total += getattr(arg, "nbytes", 0)
    return total


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
        #: The time the recorder (its world) was made; of two recorders of one rank number
        #: in a process, the newer is the current world's.
        self.created = time.time()
        _recorders.add(self)

    def __repr__(self) -> str:
        return f"<FlightRecorder rank={self.rank} ops={self._count} size={self.size}>"

    @property
    def count(self) -> int:
        """How many operations were recorded, the dropped ones included."""
        return self._count

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
        directory = os.environ.get(DUMP_DIR_ENV)
        if not directory:
            logger.info("rank %d: set %s to dump the flight recorder", self.rank, DUMP_DIR_ENV)
            return None
        try:
            path = self.write(self.default_path(directory))
        except OSError as exc:
            logger.warning("rank %d: could not dump the flight recorder: %s", self.rank, exc)
            return None
        logger.warning("rank %d: flight recorder dumped to %s", self.rank, path)
        return path
