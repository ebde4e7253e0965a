"""The node workspace: the shared memory in which the direct collectives of
:mod:`aiodist.collectives.shm` run, for a group whose ranks all live on one host.

A :class:`NodeWorkspace` is one segment per group that every rank maps: per rank a control
area (an arrival counter, a sleeping flag, a state word, why it aborted, and two *call
records*: what it called, where its inputs are, or why it rejected the call) and a slot of two buffers of ``block_bytes``. There are no
messages: an operation is a sequence of *rounds*; in a round each rank writes its own slot
buffer, all ranks pass a barrier, then each reads the others'. A barrier is each rank
storing its own counter (no atomics needed: every word has exactly one writer) and waiting
until every other counter has caught up, polling briefly and then sleeping on its doorbell
(``transport._shm_signal`` has the memory-ordering argument).

Rounds are numbered across operations and alternate between the two slot buffers and the
two call records, so a rank writes buffer ``p`` again only after a barrier that every peer
reaches once done reading it: a rank that races ahead into its next round or operation
writes the other buffer while slower peers still read this one. A call record is read
once, right after the operation's first barrier, for the same reason.

Operations on a workspace run one at a time, each in its *turn*: a ticket taken with
:meth:`NodeWorkspace.reserve` when the operation is issued (the group's issue order, the same
on every rank), or when it enters if it took none. A turn is entered only after every
earlier ticket's turn has ended: this is the one order of a group's operations in shared
memory, whatever order their tasks happen to wake up in (:class:`Turn`). After its first barrier each checks that every rank called the
same operation (fingerprint and size); if not, every rank raises the same
``DistUsageError`` and the workspace stays usable. A peer that closes its workspace or
whose process ends (it left, exited or was killed) fails only what still needs it: a
barrier it reached before it went still completes, and every later operation raises
``DistNetworkError`` naming it. Any other failure (a peer that aborted, a cancelled
operation) breaks the workspace: every rank raises ``DistNetworkError`` naming the rank
lost, as soon as its pidfd or doorbell fires.

The algorithms use an interface internal to aiodist, listed in :class:`NodeWorkspace`'s
docstring, with :class:`Turn` and :class:`Call`: nothing else of this module.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from .._arrays._fingerprint import mismatch_error
from .._util._timeouts import DEFAULT_SETUP_TIMEOUT, Timeout, to_seconds
from .._util._wait import OVERSUBSCRIBED_SPIN_SECONDS, SPIN_SECONDS, ranks_fit, spin_until
from ..errors import DistNetworkError, DistProtocolError, DistUsageError
from ..store import Store
from ..transport import _shm_setup
from ..transport._shm_segment import (
    ProcessId,
    Segment,
    SharedMemoryError,
    host_key,
    is_alive,
    open_checked,
    peer_fd_path,
    peer_path,
    remove_leftovers,
    segment_path,
    this_process,
    unavailable_reason,
)
from ..transport._shm_signal import Bell, Doorbell, PeerWatch, fence
from ..transport.base import (
    Departure,
    abort_text,
    fails_alone,
    lost_peer_error,
    peer_aborted_error,
)
from ..transport.shm import default_job_key
from . import _shared_array

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "REJECTED",
    "YIELD_SECONDS",
    "Array",
    "Bytes",
    "Call",
    "NodeWorkspace",
    "Turn",
    "workspace_bytes",
    "WorkspaceStatistics",
]

logger = logging.getLogger(__name__)

#: The call record of a rank that rejected its operation (no real fingerprint is all ones).
REJECTED = b"\xff" * 32

#: Bytes of each of a rank's two slot buffers: the unit of pipelining.
DEFAULT_BLOCK_BYTES = 1 << 20
#: A long operation yields to the event loop once this much time has passed since the last.
YIELD_SECONDS = 0.5e-3

_VERSION = 3
_MAGIC = int.from_bytes(b"AIODWS01", "little")
# Byte offsets in a rank's control area. Words that different ranks write never share a
# cache line.
_C_COUNT, _C_SLEEP, _C_STATE, _C_CANMAP = 0, 64, 128, 192
_C_FREED = 256  # count, then a ring of _FREED_SLOTS allocation ids
_FREED_SLOTS = 64
_C_MAGIC = 784  # in rank 0's area: marks the segment as a workspace
# Why this rank aborted, then why it rejected the operation of each parity's call record
# (read once, with the record): UTF-8, zero-padded.
_C_REASONS = 1024
_REASON_BYTES = 1024
_C_RECORDS = _C_REASONS + 3 * _REASON_BYTES  # two call records
# A call record: fingerprint, size, flags (bit 0: inputs shared; bits 8+: input pieces);
# then per input piece (allocation id, fd, allocation size, offset); then per rank the
# bytes sent to it and expected from it (all_to_all).
_DESC = struct.Struct("<32sQQ")
_ENTRY = struct.Struct("<QQQQ")
_SIZES = struct.Struct("<QQ")
_FLAG_SHARED = 1
_OPEN, _CLOSED, _ABORTED = 1, 2, 3
_RECHECK_FIRST, _RECHECK_MAX = 1e-3, 50e-3

Array = npt.NDArray[Any]
Bytes = npt.NDArray[np.uint8]
_NOTHING: Bytes = np.empty(0, np.uint8)


def _record_bytes(size: int) -> int:
    return -(-(64 + size * (_ENTRY.size + _SIZES.size)) // 64) * 64


def _ctrl_bytes(size: int) -> int:
    need = _C_RECORDS + 2 * _record_bytes(size)
    return -(-need // mmap.PAGESIZE) * mmap.PAGESIZE


class WorkspaceStatistics(NamedTuple):
    """Counters of a :class:`NodeWorkspace`.

    Attributes:
        ops: operations started.
        in_place: operations that read some rank's input in place (a shared array).
        mapped: peers' shared arrays mapped here now.
    """

    ops: int
    in_place: int
    mapped: int


class Call(NamedTuple):
    """What every rank published for the running operation, read after its first barrier
    (internal to aiodist: made by :meth:`NodeWorkspace.check`).

    Attributes:
        p: the parity of the operation's first round (its slot buffers and call records).
        shared: per rank, whether peers read its inputs in place.
        entries: per rank whose inputs are shared (other than this one), where each piece is.
        sizes: per rank ``[(bytes sent to j, bytes expected from j) for each rank j]``
            (all_to_all; empty otherwise).
    """

    p: int
    shared: list[bool]
    entries: list[list[_shared_array.Location]]
    sizes: list[list[tuple[int, int]]]


def workspace_bytes(size: int) -> int:
    """Bytes of ``/dev/shm`` the workspace of a group of ``size`` ranks reserves, with the
    default block size."""
    return size * (_ctrl_bytes(size) + 2 * _default_block_bytes(size))


def _default_block_bytes(size: int) -> int:
    return max(DEFAULT_BLOCK_BYTES, -(-64 * size // mmap.PAGESIZE) * mmap.PAGESIZE)


def _check_records(
    records: dict[int, dict[str, Any]], record: dict[str, Any], rank: int, block: int, total: int
) -> None:
    """Check that every rank's record is of this host and version (this rank's: ``record``)
    and asks for the same workspace.

    Raises:
        DistUsageError: naming the first rank that differs.
    """
    for r, rec in records.items():
        if rec.get("v") != _VERSION or rec.get("host") != record["host"]:
            raise DistUsageError(
                f"group rank {r} cannot share a workspace with group rank {rank}: it "
                f"is on another host (its host key {rec.get('host')!r}, ours "
                f"{record['host']!r}) or runs another aiodist version"
            )
        if rec.get("block") != block or rec.get("size") != total:
            raise DistUsageError(
                f"group rank {r} asked for {rec.get('block')}-byte workspace blocks, "
                f"group rank {rank} for {block}; every rank must pass the same"
            )


def _open_bells(
    records: dict[int, dict[str, Any]],
    procs: dict[int, ProcessId],
    job: str,
    bells: dict[int, Bell],
    gone: Callable[[int, Exception], Exception],
) -> bool:
    """Open every rank's doorbell (into ``bells``) through ``/proc/<pid>/fd/<fd>``, as
    peers' shared arrays are mapped, else by its name; return whether the first way worked
    for every rank.

    Raises:
        Exception: ``gone(r, exc)``: rank ``r``'s doorbell would not open either way.
    """
    can_map = True
    for r, rec in records.items():
        try:
            bells[r] = Bell(peer_fd_path(procs[r], rec["bell_fd"]))
        except OSError:
            can_map = False
            try:
                bells[r] = Bell(peer_path(rec["bell"], job, "wb", r, procs[r]))
            except OSError as exc:
                raise gone(r, exc) from exc
    return can_map


class NodeWorkspace:
    """Shared memory for the direct collectives of one group, all of whose ranks are local.

    Create it with :meth:`create` (collective), pass it to the functions of
    :mod:`aiodist.collectives.shm`, close it with :meth:`aclose` (or :meth:`abort`).

    Internal to aiodist, for those functions only (not API): the turn (:meth:`reserve` when
    the operation is issued; :meth:`enter_now` or :meth:`enter`, then :meth:`leave`), :meth:`begin`, :meth:`next_round`,
    :meth:`sync`, the checks (:meth:`same_calls`, :meth:`check_calls`, :meth:`check`,
    :meth:`fail_consistently`), the data (:attr:`slots`, :meth:`typed_slots`,
    :meth:`peer_piece`), :meth:`publish_reason`, :meth:`maybe_yield` and :attr:`names`.

    Attributes:
        rank: this rank's index in the group.
        size: the number of ranks in the group.
        block_bytes: the pipelining unit (bytes of each slot buffer).
        names: the group's global ranks, for messages (internal).
        slots: ``slots[j][p]``, rank ``j``'s slot buffer ``p`` as bytes (internal; emptied
            once closed).
    """

    def __init__(
        self,
        rank: int,
        size: int,
        block_bytes: int,
        seg: Segment | None,
        doorbell: Doorbell | None,
        spin: float,
        names: Sequence[int],
    ) -> None:
        self.rank = rank
        self.size = size
        self.block_bytes = block_bytes
        self.names = list(names)
        self._loop = asyncio.get_running_loop()
        self._seg = seg
        self._doorbell = doorbell
        self._spin = spin
        self._peers = [j for j in range(size) if j != rank]
        self._bells: dict[int, Bell] = {}
        self._watches: dict[int, PeerWatch] = {}
        self._procs: dict[int, ProcessId] = {}
        self._direct_ok = False
        self._error: BaseException | None = None
        # Peers that closed or whose process ended, with the error for what still needs them.
        self._gone: dict[int, BaseException] = {}
        self._closed = False
        self._waiter: asyncio.Future[None] | None = None
        # Arrivals at barriers and slot rounds so far: the same on every rank.
        self._count = 0
        self._round = 0
        self._ops = 0
        self._in_place = 0
        self._busy = False
        # Turns: tickets handed out so far, the ticket whose turn is (or comes) next, and
        # the operations waiting for theirs, by ticket.
        self._issued = 0
        self._next = 0
        self._waiting: dict[int, asyncio.Future[None]] = {}
        # The error of the running operation that every rank raises alike, if any.
        self._consistent: BaseException | None = None
        self._last_yield = 0.0
        # Peers' shared arrays mapped here: (rank, allocation id) -> bytes.
        self._maps: dict[tuple[int, int], Bytes] = {}
        self._freed_seen = [0] * size
        self._freed_lock = threading.Lock()
        self._views: dict[tuple[int, np.dtype[Any], int | tuple[int, ...]], list[Array]] = {}
        self._ctrl = ctrl = _ctrl_bytes(size)
        self._rec = _record_bytes(size)
        if seg is None:
            return
        self._words = seg.words
        self._buf = seg.buf
        self._mem: Bytes = np.frombuffer(seg.buf, dtype=np.uint8)
        self._count_w = [(j * ctrl + _C_COUNT) // 8 for j in range(size)]
        self._sleep_w = [(j * ctrl + _C_SLEEP) // 8 for j in range(size)]
        self._state_w = [(j * ctrl + _C_STATE) // 8 for j in range(size)]
        self._peer_count_w = [self._count_w[j] for j in self._peers]
        # Where each rank's call record of each parity is: [parity][rank] -> byte offset.
        self._records = [
            [j * ctrl + _C_RECORDS + p * self._rec for j in range(size)] for p in range(2)
        ]
        base = size * ctrl
        self.slots = [
            [self._mem[base + (2 * j + p) * block_bytes :][:block_bytes] for p in range(2)]
            for j in range(size)
        ]
        self._slot_views = [[slot.data for slot in pair] for pair in self.slots]

    # -- setup and teardown ----------------------------------------------------------------

    @classmethod
    async def create(
        cls,
        store: Store,
        rank: int,
        size: int,
        *,
        timeout: Timeout = None,
        block_bytes: int | None = None,
        spin: float | None = None,
        local_world_size: int | None = None,
        job_key: str | None = None,
        ranks: Sequence[int] | None = None,
    ) -> NodeWorkspace:
        """Create (rank 0) or map (the others) the group's workspace; collective.

        Rank 0 creates the segment in ``/dev/shm`` and reserves it; every rank creates a
        doorbell, publishes under ``shm/ws/<rank>`` in ``store``, maps what the others
        published and says so under ``shm/ws/mapped/<rank>``; then the names are unlinked,
        so nothing remains in ``/dev/shm`` whatever happens to the processes afterwards.
        On any failure this rank unlinks what it created (and names left by peers that
        died) before raising.

        Args:
            store: a store namespaced for this group (only keys under ``shm/`` are used).
            rank: this rank's index in the group.
            size: the number of ranks in the group; all must be on this host.
            timeout: seconds (or ``timedelta``) for the ranks to meet; ``None``: 300 s.
            block_bytes: bytes per slot buffer (a multiple of 4096, at least 64 per rank);
                ``None``: 1 MiB.
            spin: seconds a barrier polls before sleeping; ``None``: 50 µs when the
                host's ranks fit on this process's CPUs, else 200 µs giving the CPU away
                at each round (:data:`~aiodist._util._wait.OVERSUBSCRIBED_SPIN_SECONDS`); 0 (never poll) when
                another rank shares this process.
            local_world_size: how many ranks run on this host, of every group (for the
                polling decision); ``None``: ``$LOCAL_WORLD_SIZE``, else ``size``.
            job_key: the job's identity for segment names (see
                :func:`aiodist.transport.shm.default_job_key`).
            ranks: the group's global ranks, for error messages (default: group ranks).

        Returns:
            The workspace.

        Raises:
            SharedMemoryError: shared memory is unavailable or ``/dev/shm`` cannot hold the
                workspace (the message names the size); the caller may use the transport
                algorithms instead.
            DistUsageError: a bad argument, or ranks on different hosts or with different
                ``block_bytes``.
            DistTimeoutError: a rank did not arrive in time (the ranks are named).
            DistNetworkError: a rank exited during setup.
        """
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise DistUsageError(f"size must be a positive integer, got {size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise DistUsageError(f"rank must be in [0, {size}), got {rank!r}")
        if block_bytes is None:
            block_bytes = _default_block_bytes(size)
        elif (
            isinstance(block_bytes, bool)
            or not isinstance(block_bytes, int)
            or block_bytes < 64 * size
            or block_bytes % mmap.PAGESIZE
        ):
            raise DistUsageError(
                f"block_bytes must be a multiple of {mmap.PAGESIZE} of at least 64 per rank, "
                f"got {block_bytes!r}"
            )
        if spin is not None and (
            isinstance(spin, bool) or not isinstance(spin, int | float) or spin < 0
        ):
            raise DistUsageError(f"spin must be a non-negative number of seconds, got {spin!r}")
        if local_world_size is None:
            local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
        elif isinstance(local_world_size, bool) or not isinstance(local_world_size, int):
            raise DistUsageError(f"local_world_size must be an int, got {local_world_size!r}")
        names = list(range(size)) if ranks is None else list(ranks)
        if len(names) != size:
            raise DistUsageError(f"ranks must list {size} global ranks, got {names}")
        seconds = to_seconds(timeout, DEFAULT_SETUP_TIMEOUT)
        reason = unavailable_reason()
        if reason is not None:
            logger.info("no shared-memory workspace: %s", reason)
            raise SharedMemoryError(reason)
        if size == 1:
            return cls(rank, size, block_bytes, None, None, 0.0, names)
        job = default_job_key() if job_key is None else job_key
        remove_leftovers(job)
        loop = asyncio.get_running_loop()
        deadline = None if seconds is None else loop.time() + seconds
        local = max(size, local_world_size)
        return await cls._setup(store, rank, size, block_bytes, spin, local, job, deadline, names)

    @classmethod
    async def _setup(
        cls,
        store: Store,
        rank: int,
        size: int,
        block: int,
        spin: float | None,
        local: int,
        job: str,
        deadline: float | None,
        names: list[int],
    ) -> NodeWorkspace:
        me = this_process()
        ctrl = _ctrl_bytes(size)
        total = size * (ctrl + 2 * block)
        what = f"setting up the shared-memory workspace of group rank {rank}"
        seg: Segment | None = None
        doorbell: Doorbell | None = None
        bells: dict[int, Bell] = {}
        self: NodeWorkspace | None = None
        try:
            if rank == 0:
                seg = Segment.create(
                    segment_path(job, "w", rank),
                    total,
                    f"the workspace of a group of {size} ranks ({2 * block} bytes per rank)",
                )
                seg.words[_C_MAGIC // 8] = _MAGIC
            doorbell = Doorbell(segment_path(job, "wb", rank))
            record = {
                "v": _VERSION,
                "host": host_key(),
                "pid": me.pid,
                "start": me.start,
                "seg": "" if seg is None else seg.path,
                "size": total,
                "block": block,
                "bell": doorbell.path,
                "bell_fd": doorbell.fd,
            }
            records = await _shm_setup.exchange(
                store, "shm/ws", rank, range(size), record, deadline, what
            )
            _check_records(records, record, rank, block, total)
            procs = {r: _shm_setup.process_of(r, rec, what) for r, rec in records.items()}

            def gone(r: int, exc: Exception) -> Exception:
                """What to raise when rank ``r``'s file would not open: its process exited
                (and its files were swept away as leftovers), or ``exc``."""
                if is_alive(procs[r]):
                    return exc
                return DistNetworkError(f"{what}: rank {r} (pid {procs[r].pid}) exited")

            if seg is None:
                try:
                    # (The store says where; only a name rank 0 could have made is opened.)
                    seg = Segment.attach(peer_path(records[0]["seg"], job, "w", 0, procs[0]), total)
                except SharedMemoryError as exc:
                    raise gone(0, exc) from exc
                if seg.words[_C_MAGIC // 8] != _MAGIC:
                    raise DistProtocolError(f"{seg.path} is not an aiodist workspace")
            # Peers' shared arrays are mapped through /proc/<pid>/fd/<fd>: check that this
            # works by opening their doorbells that way.
            can_map = _open_bells(records, procs, job, bells, gone)
            seg.words[(rank * ctrl + _C_CANMAP) // 8] = 1 + int(can_map)
            seg.words[(rank * ctrl + _C_SLEEP) // 8] = 1
            await _shm_setup.barrier(
                store, "shm/ws/mapped", rank, range(size), deadline, procs, what
            )
            # Every rank has mapped the segment and opened our doorbell: unlink both.
            seg.unlink()
            doorbell.unlink()
            if spin is None:
                same_process = any(p.pid == me.pid for p in procs.values())
                spin = SPIN_SECONDS if ranks_fit(local) else OVERSUBSCRIBED_SPIN_SECONDS
                if same_process:  # (polling would only keep the others off the loop)
                    spin = 0.0
            self = cls(rank, size, block, seg, doorbell, float(spin), names)
            self._bells = bells
            self._procs = procs
            self._direct_ok = all(seg.words[(j * ctrl + _C_CANMAP) // 8] == 2 for j in range(size))
            self._words[self._state_w[rank]] = _OPEN
            doorbell.listen(self._loop, self._on_bell)
            for r, proc in procs.items():
                self._watches[r] = PeerWatch(
                    self._loop, proc, functools.partial(self._peer_gone, r)
                )
        except BaseException:
            if self is not None:
                self._release()
            else:
                for b in bells.values():
                    b.close()
                if doorbell is not None:
                    doorbell.close()
                if seg is not None:
                    seg.close()
            remove_leftovers(job)
            raise
        return self

    def __repr__(self) -> str:
        state = "closed" if self._closed else "broken" if self._error else "open"
        return (
            f"<NodeWorkspace rank={self.rank}/{self.size} block={self.block_bytes} "
            f"ops={self._ops} {state}>"
        )

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` or :meth:`abort` was called (or an operation failed it)."""
        return self._closed

    def statistics(self) -> WorkspaceStatistics:
        """Return the workspace's counters."""
        return WorkspaceStatistics(self._ops, self._in_place, len(self._maps))

    def abort(self, exc: BaseException) -> None:
        """Fail the running and every later operation with ``exc``; the peers' operations
        fail with ``DistNetworkError`` naming this rank. Aborting twice is harmless."""
        if not self._closed:
            self._shutdown(exc, _ABORTED)

    async def aclose(self) -> None:
        """Close the workspace; later operations raise ``DistUsageError``, peers waiting
        for this rank raise ``DistNetworkError`` naming it. Closing twice is harmless."""
        if not self._closed:
            self._shutdown(DistUsageError(f"{self!r} is closed"), _CLOSED)

    def _shutdown(self, exc: BaseException, state: int) -> None:
        self._closed = True
        if self._error is None:
            self._error = exc
        if self._seg is not None:
            if state == _ABORTED:
                self.publish_reason(abort_text(exc))
            self._words[self._state_w[self.rank]] = state
            fence()
            for bell in self._bells.values():
                bell.ring()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
            waiter.exception()
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()
        self._waiting.clear()
        self._release()

    def _release(self) -> None:
        for watch in self._watches.values():
            watch.close()
        for bell in self._bells.values():
            bell.close()
        if self._doorbell is not None:
            self._doorbell.close()
        self._maps.clear()
        self._views.clear()
        if self._seg is not None:
            self.slots = []
            for pair in self._slot_views:
                for view in pair:
                    view.release()
            self._slot_views = []
            self._mem = _NOTHING
            with self._freed_lock:  # an array's finalizer may be writing its freed list
                self._closed = True
                self._seg.close()

    # -- shared arrays ---------------------------------------------------------------------

    def note_freed(self, alloc_id: int) -> None:
        """Record that this rank's shared array ``alloc_id`` is gone, so peers unmap it.

        Called by the array's finalizer, from whichever thread dropped it last.
        """
        with self._freed_lock:
            if self._seg is None or self._closed:
                return
            base = (self.rank * self._ctrl + _C_FREED) // 8
            count = self._words[base] + 1
            self._words[base + 1 + count % _FREED_SLOTS] = alloc_id
            self._words[base] = count  # after the id: a peer that sees the count sees it

    def _forget_freed(self) -> None:
        if not self._maps:
            return
        words = self._words
        for j in self._peers:
            base = (j * self._ctrl + _C_FREED) // 8
            count = words[base]
            seen = self._freed_seen[j]
            if count == seen:
                continue
            self._freed_seen[j] = count
            if count - seen >= _FREED_SLOTS:  # too far behind: drop all, remap on use
                for key in [key for key in self._maps if key[0] == j]:
                    del self._maps[key]
                continue
            for c in range(seen + 1, count + 1):
                self._maps.pop((j, words[base + 1 + c % _FREED_SLOTS]), None)

    def peer_piece(self, call: Call, j: int, i: int, nbytes: int) -> Bytes:
        """The first ``nbytes`` of peer ``j``'s shared input piece ``i``."""
        alloc_id, fd, size, offset = call.entries[j][i]
        mem = self._maps.get((j, alloc_id))
        if mem is None:
            path = peer_fd_path(self._procs[j], fd)
            try:
                fdn = open_checked(path, os.O_RDWR, size=size)
            except OSError as exc:
                raise DistNetworkError(
                    f"cannot map the shared array of rank {self.names[j]} ({path}): {exc}"
                ) from exc
            try:
                mem = np.frombuffer(mmap.mmap(fdn, size), dtype=np.uint8)
            finally:
                os.close(fdn)
            self._maps[j, alloc_id] = mem
        return mem[offset : offset + nbytes]

    # -- an operation's life: turn, call record, check -------------------------------------

    def reserve(self) -> int:
        """Take the next ticket: the operation that holds it enters after every operation
        that took an earlier one (see :meth:`enter`)."""
        ticket = self._issued
        self._issued += 1
        return ticket

    def enter_now(self, ticket: int | None = None) -> bool:
        """Take the turn of ``ticket`` (``None``: a new ticket) if it is next and free (else
        :meth:`enter`)."""
        if self._busy or self._error is not None or self._gone:
            return False
        if ticket is None:
            if self._issued != self._next:
                return False
            ticket = self.reserve()
        elif ticket != self._next:
            return False
        self._start_turn()
        return True

    def _start_turn(self) -> None:
        self._busy = True
        self._ops += 1
        self._consistent = None
        self._last_yield = time.perf_counter()

    async def enter(self, ticket: int | None = None) -> None:
        """Wait for the turn of ``ticket`` (``None``: a new ticket), or raise why there will
        be none; every call that returns must end in :meth:`leave`."""
        if ticket is None:
            ticket = self.reserve()
        if self._error is not None:
            raise self._error
        for exc in self._gone.values():
            raise exc  # a member is gone: no later operation can complete
        if self._busy or ticket != self._next:
            fut = self._waiting[ticket] = self._loop.create_future()
            try:
                await fut
            except BaseException as exc:
                self._waiting.pop(ticket, None)
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    self.leave(exc)  # handed the turn just now: pass it on, and fail
                elif not self._closed:
                    # Our turn is part of every rank's sequence: skipping it desynchronises
                    # the group. Fail the workspace (nothing new if it failed already).
                    self._shutdown(self._given_up(exc), _ABORTED)
                raise
        self._start_turn()

    def leave(self, exc: BaseException | None) -> None:
        """End the operation's turn with its outcome and hand the turn on; an ``exc`` not
        raised through :meth:`fail_consistently` breaks the workspace."""
        if exc is not None and exc is not self._consistent and not self._closed:
            # The ranks may now be at different points of the operation: nothing after it
            # can be trusted. Tell the peers, so that they fail instead of waiting.
            self._shutdown(self._given_up(exc), _ABORTED)
        self._busy = False
        self._next += 1
        fut = self._waiting.pop(self._next, None)
        if fut is not None and not fut.done():
            self._busy = True
            fut.set_result(None)

    def _given_up(self, exc: BaseException) -> BaseException:
        if isinstance(exc, asyncio.CancelledError):
            return DistNetworkError(
                f"rank {self.names[self.rank]} cancelled a shared-memory operation"
            )
        return exc

    def fail_consistently(self, exc: DistUsageError) -> None:
        """Raise ``exc``, which every rank raises alike at the same point (it was found in
        shared memory after a barrier): the workspace stays usable, and the group (see
        :func:`~aiodist.transport.base.fails_alone`)."""
        self._consistent = fails_alone(exc)
        raise exc

    def next_round(self) -> int:
        """Start the operation's next round; return its parity (which slot buffers)."""
        p = self._round & 1
        self._round += 1
        return p

    def begin(
        self,
        fp: bytes,
        nbytes: int,
        pieces: Sequence[Array] | None = None,
        sizes: Sequence[tuple[int, int]] | None = None,
        reason: str = "",
    ) -> tuple[int, bool]:
        """Start the operation's first round and publish its call record.

        ``pieces`` are the inputs peers may read in place: they do if they are shared arrays
        of this workspace (the caller passes them only when that is worth it). ``sizes`` are
        the bytes sent to and expected from each rank (all_to_all). ``reason``: why this rank
        rejected the operation (``fp`` :data:`REJECTED`).

        Returns:
            The round's buffer, and whether peers read ``pieces`` in place.
        """
        p = self._round & 1
        self._round += 1
        if fp == REJECTED:
            self.publish_reason(reason, p)  # (before the record: a peer that sees it reads it)
        at = self._records[p][self.rank]
        flags = 0
        if pieces is not None and self._direct_ok:
            locs = [_shared_array.locate(a, self) for a in pieces]
            if None not in locs:
                flags = _FLAG_SHARED | (len(locs) << 8)
                for i, loc in enumerate(locs):
                    _ENTRY.pack_into(self._buf, at + 64 + i * _ENTRY.size, *loc)  # type: ignore[misc]
        _DESC.pack_into(self._buf, at, fp, nbytes, flags)
        if sizes is not None:
            at += 64 + self.size * _ENTRY.size
            for j, (sent, expected) in enumerate(sizes):
                _SIZES.pack_into(self._buf, at + j * _SIZES.size, sent, expected)
        return p, bool(flags)

    def same_calls(self, p: int) -> None:
        """:meth:`check_calls` for the hot path: compare the raw records (fingerprint and
        size) first."""
        buf = self._buf
        at = self._records[p]
        first = buf[at[0] : at[0] + 40]
        for b in at[1:]:
            if buf[b : b + 40] != first:
                self.check_calls(p)

    def check_calls(self, p: int) -> list[tuple[bytes, int, int]]:
        """After the first barrier: check that every rank called the same operation (the
        same fingerprint and size), and return every rank's ``(fingerprint, size, flags)``;
        else :meth:`fail_consistently` with a ``DistUsageError``."""
        unpack, buf = _DESC.unpack_from, self._buf
        descs = [unpack(buf, at) for at in self._records[p]]
        rejected = [j for j, (fp, _, _) in enumerate(descs) if fp == REJECTED]
        if rejected and len(rejected) < self.size:
            j = rejected[0]
            reason = self._reason(j, p)
            rejection = DistUsageError(f"rejected by rank {self.names[j]}: {reason}")
            # Who rejected and why, for the group layer to name the operation.
            rejection.rejected_by = self.names[j]  # type: ignore[attr-defined]
            rejection.reason = reason  # type: ignore[attr-defined]
            self.fail_consistently(rejection)
        fp0, n0, _ = descs[0]
        for j, (fp, nb, _) in enumerate(descs):
            if fp != fp0:
                self.fail_consistently(
                    mismatch_error(self.names[0], fp0, self.names[j], fp, 0, self._ops)
                )
            if nb != n0:
                self.fail_consistently(
                    DistUsageError(
                        f"collective mismatch: rank {self.names[0]} passed {n0} bytes and rank "
                        f"{self.names[j]} {nb} bytes to operation #{self._ops}"
                    )
                )
        return descs

    def check(self, p: int, *, sizes: bool = False) -> Call:
        """:meth:`check_calls`, then read what every rank published (once: a fast peer's
        next call record overwrites it)."""
        buf, n = self._buf, self.size
        base = self._records[p]
        descs = self.check_calls(p)
        shared = [bool(flags & _FLAG_SHARED) for _, _, flags in descs]
        entries: list[list[_shared_array.Location]] = [[] for _ in range(n)]
        for j, (_, _, flags) in enumerate(descs):
            if shared[j] and j != self.rank:
                entries[j] = [
                    _shared_array.Location(*_ENTRY.unpack_from(buf, base[j] + 64 + i * _ENTRY.size))
                    for i in range(flags >> 8)
                ]
        table: list[list[tuple[int, int]]] = []
        if sizes:
            off = 64 + n * _ENTRY.size
            table = [
                [_SIZES.unpack_from(buf, at + off + i * _SIZES.size) for i in range(n)]
                for at in base
            ]
        if any(shared):
            self._in_place += 1
            self._forget_freed()
        return Call(p, shared, entries, table)

    def publish_reason(self, reason: str, p: int | None = None) -> None:
        """Tell the peers why this rank aborted (``p`` ``None``), or why it rejected the
        operation whose call record of parity ``p`` says :data:`REJECTED` (see
        :meth:`begin`), in its reason areas."""
        text = reason.encode(errors="replace")[: _REASON_BYTES - 1]
        at = self._reason_at(self.rank, p)
        self._buf[at : at + _REASON_BYTES] = text.ljust(_REASON_BYTES, b"\0")

    def _reason_at(self, j: int, p: int | None) -> int:
        return j * self._ctrl + _C_REASONS + (0 if p is None else 1 + p) * _REASON_BYTES

    def _reason(self, j: int, p: int | None = None) -> str:
        at = self._reason_at(j, p)
        return bytes(self._buf[at : at + _REASON_BYTES]).rstrip(b"\0").decode(errors="replace")

    async def maybe_yield(self) -> None:
        """Let the event loop run if this operation has held it for :data:`YIELD_SECONDS`;
        raise the workspace's error if it was closed or aborted meanwhile."""
        if time.perf_counter() - self._last_yield >= YIELD_SECONDS:
            await asyncio.sleep(0)
            self._last_yield = time.perf_counter()
            if self._error is not None:  # aborted meanwhile: the memory is gone
                raise self._error

    # -- barriers ---------------------------------------------------------------------------

    async def sync(self) -> None:
        """Arrive, and return once every rank has arrived as often (a full barrier)."""
        if not self.arrive():
            await self.all_arrived()

    def arrive(self) -> bool:
        """Arrive at the next barrier and spin a moment for the peers; return whether every
        rank has arrived as often (else :meth:`all_arrived` waits for the rest)."""
        self._count = target = self._count + 1
        words = self._words
        words[self._count_w[self.rank]] = target
        fence()  # our counter, then their sleeping flags (see transport._shm_signal)
        for j in self._peers:
            if words[self._sleep_w[j]]:
                self._bells[j].ring()
        if self._reached(target):
            return True
        return bool(self._spin) and spin_until(functools.partial(self._reached, target), self._spin)

    async def all_arrived(self) -> None:
        """Return once every rank has arrived at the barrier :meth:`arrive` arrived at."""
        await self._wait(self._count)

    def waiting_for(self) -> list[int]:
        """The group ranks that have not yet arrived where this rank waits (a barrier)."""
        if not self._busy or self._closed:
            return []
        words = self._words
        return [j for j in self._peers if words[self._count_w[j]] < self._count]

    def _reached(self, target: int) -> bool:
        words = self._words
        # A plain loop: half the cost of all() over a generator, and this runs in spins.
        for w in self._peer_count_w:  # noqa: SIM110
            if words[w] < target:
                return False
        return True

    async def _wait(self, target: int) -> None:
        # (After arrive()'s spin: the peers are late, this rank sleeps on its doorbell.)
        words = self._words
        my_sleep = self._sleep_w[self.rank]
        recheck = _RECHECK_FIRST
        try:
            while True:
                self._check_peers(target)
                fut = self._loop.create_future()
                self._waiter = fut
                words[my_sleep] = 1
                fence()  # our flag, then their counters
                if self._reached(target):
                    return
                timer = self._loop.call_later(recheck, _wake, fut)
                try:
                    await fut
                finally:
                    timer.cancel()
                if self._error is not None:  # woken, then aborted: the memory is gone
                    raise self._error
                if self._reached(target):
                    return
                recheck = min(recheck * 2, _RECHECK_MAX)
        finally:
            self._waiter = None
            if not self._closed:
                words[my_sleep] = 0

    def _on_bell(self) -> None:
        if self._doorbell is None or self._doorbell.fd < 0:
            return
        self._doorbell.drain()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _check_peers(self, target: int) -> None:
        """Raise if the barrier to ``target`` can no longer complete: a peer aborted, or one
        that has not arrived yet is gone (one that arrived before it went does not count)."""
        if self._error is None:
            for j in self._peers:
                if self._words[self._state_w[j]] in (_CLOSED, _ABORTED):
                    self._peer_gone(j)
        if self._error is not None:
            raise self._error
        for j, exc in self._gone.items():
            if self._words[self._count_w[j]] < target:
                # The same on every rank that waits for it: no need to abort the workspace
                # (nor the group, for a peer that left in order).
                self._consistent = exc
                raise exc

    def _peer_gone(self, j: int) -> None:
        """Peer ``j`` closed, aborted, or its process ended.

        An aborted peer fails the workspace. One that closed or whose process ended fails
        only the waits it has not reached (see :meth:`_check_peers`): the waiter is woken
        to look.
        """
        if self._error is not None or j in self._gone:
            return
        state = self._words[self._state_w[j]]
        name = self.names[j]
        waiter = self._waiter
        if state != _ABORTED:
            if state == _CLOSED:
                reason, how = "it closed the shared-memory workspace", Departure.LEFT
                self._gone[j] = fails_alone(lost_peer_error(name, reason, how))
            else:
                reason, how = f"its process (pid {self._procs[j].pid}) exited", Departure.GONE
                self._gone[j] = lost_peer_error(name, reason, how)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
            return
        exc = peer_aborted_error(name, self._reason(j))
        self._error = exc
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
            waiter.exception()
        if self._busy:
            logger.warning("group rank %d: %s", self.rank, exc)

    # -- views for the algorithms ----------------------------------------------------------

    def typed_slots(
        self, p: int, dtype: np.dtype[Any], shape: int | tuple[int, ...]
    ) -> list[Array]:
        """Every rank's slot buffer ``p`` viewed as an array of ``dtype`` and ``shape``."""
        key = (p, dtype, shape)
        views = self._views.get(key)
        if views is None:
            count = shape if isinstance(shape, int) else int(np.prod(shape))
            nbytes = count * dtype.itemsize
            views = [self.slots[j][p][:nbytes].view(dtype).reshape(shape) for j in range(self.size)]
            if len(self._views) > 256:
                self._views.clear()
            self._views[key] = views
        return views


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Turn:
    """``async with Turn(ws, ticket)``: run an operation in its turn (``ticket`` from
    :meth:`NodeWorkspace.reserve`; ``None`` takes the next one on entering); a failure that
    is not consistent across ranks breaks the workspace (internal to aiodist)."""

    __slots__ = ("ticket", "ws")

    def __init__(self, ws: NodeWorkspace, ticket: int | None = None) -> None:
        self.ws = ws
        self.ticket = ticket

    async def __aenter__(self) -> None:
        await self.ws.enter(self.ticket)

    async def __aexit__(self, et: object, exc: BaseException | None, tb: object) -> None:
        self.ws.leave(exc)
