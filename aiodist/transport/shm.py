"""The shared-memory transport: ranks on one host exchange messages through ring buffers.

Every rank creates one segment and one doorbell in ``/dev/shm`` and maps those of its local
peers (:meth:`ShmTransport.create`). Between two ranks, a
:class:`~aiodist.transport._shm_link.ShmLink` moves the messages: its module describes the
segment's layout, how a message is written and read, and how a sender waits for room. This
module sets the links up and runs them: at most ``TURN_BYTES`` are moved per loop turn, so a
64 MiB message never stalls the loop.

Waiting. See ``_shm_signal`` for the doorbell, the sleeping flag and why they cannot lose a
wake-up. A rank whose receive is not satisfied polls its rings after the posting task has
yielded, as :mod:`aiodist._util._wait`'s policy says (when no peer shares this process), then
sleeps on its doorbell; while it polls, or while a
pass over its rings is already scheduled, its flag tells peers not to ring. Peer processes
are watched through pidfds, so a peer that dies fails everything that depends on it at
once; messages it wrote completely before are still delivered.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import mmap
import os
import struct
import time
from collections.abc import Collection
from typing import Any

from .._util._timeouts import DEFAULT_SETUP_TIMEOUT, Timeout, to_seconds
from .._util._wait import HOT_SPIN_SECONDS, SPIN_SECONDS, Backoff, ranks_fit
from ..errors import DistNetworkError, DistProtocolError, DistUsageError
from ..store import Store
from . import _shm_setup
from ._failures import fail_future
from ._flow import resolve_staging_bytes
from ._frames import BYE, HEADER, REJECTION, control_frame
from ._mailbox import Mailbox
from ._shm_link import (
    ABORTED,
    CLOSED,
    CTRL_BYTES,
    OPEN,
    RING_HDR_BYTES,
    TURN_BYTES,
    W_MAGIC,
    W_SLEEP,
    W_STATE,
    ShmLink,
    control_send,
    leave_cause,
)
from ._shm_segment import (
    ProcessId,
    Segment,
    SharedMemoryError,
    host_key,
    peer_path,
    remove_leftovers,
    segment_path,
    this_process,
    unavailable_reason,
)
from ._shm_signal import Bell, Doorbell, PeerWatch, fence
from .base import (
    CLOSED_REASON,
    Departure,
    Tag,
    Transport,
    abort_text,
    as_bytes,
    check_tag,
    departure_of,
    lost_peer_error,
    peer_aborted_error,
)

__all__ = [
    "DEFAULT_RING_BYTES",
    "ShmTransport",
    "bytes_needed",
    "default_job_key",
    "find_local_ranks",
    "plan_hosts",
]

logger = logging.getLogger(__name__)

_VERSION = 2
_MAGIC = int.from_bytes(b"AIODSHM1", "little")

#: Bytes of ring per ordered pair of ranks (a power of two). With many local ranks the
#: rings shrink so that a rank's segment stays within 64 MiB (down to 256 KiB per ring).
DEFAULT_RING_BYTES = 4 << 20
_MIN_RING_BYTES = 4096
#: How long ``aclose`` lets queued sends drain before closing.
CLOSE_DRAIN_SECONDS = 5.0
#: A sleeping rank with work pending re-checks its rings after this long, doubling up to
#: ``_RECHECK_MAX`` (the safety net under the doorbell protocol).
_RECHECK_FIRST, _RECHECK_MAX = 1e-3, 50e-3


def default_job_key() -> str:
    """The job identity segment names are derived from when none is given: the launcher's
    run id (``AIODIST_RUN_ID``, ``TORCHELASTIC_RUN_ID``), else ``"default"``."""
    return os.environ.get("AIODIST_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or "default"


async def find_local_ranks(
    store: Store, rank: int, world_size: int, *, timeout: Timeout = None
) -> list[int]:
    """Return the ranks of the world that can share memory with this one (itself included).

    Collective over the whole world (see :func:`plan_shared_memory`).

    Raises:
        DistTimeoutError: a rank did not arrive within ``timeout`` (default: the store's).
    """
    local, _ = await plan_shared_memory(store, rank, world_size, timeout=timeout)
    return local


async def plan_shared_memory(
    store: Store,
    rank: int,
    world_size: int,
    *,
    timeout: Timeout = None,
    host: str | None = None,
) -> tuple[list[int], str | None]:
    """Return the ranks that share this rank's host, and why they cannot share memory.

    Collective over the whole world, in three store requests per rank whatever its size:
    each rank appends itself to its host's key (marked if shared memory is unavailable to
    it), passes a store barrier, and reads its host's key. Every rank of a host reads the
    same list, so they all make the same choice: shared memory only if none refuses.

    ``host`` is this rank's host key (default: :func:`host_key`).

    Returns:
        ``(local ranks, reason)``: ``reason`` is ``None`` when every local rank can use
        shared memory, else why one cannot (naming it).

    Raises:
        DistTimeoutError: a rank did not arrive within ``timeout`` (default: the store's).
    """
    mine = host_key() if host is None else host
    reason = unavailable_reason()
    key = f"shm/host/{hashlib.sha256(mine.encode()).hexdigest()[:16]}"
    await store.append(key, f"{rank}{'' if reason is None else '!'},")
    if reason is not None:
        await store.set(f"shm/why/{rank}", reason)
    await store.barrier("shm/hosts", world_size, to_seconds(timeout, store.timeout))
    entries = [e for e in (await store.get(key)).decode().split(",") if e]
    local = sorted(int(e.rstrip("!")) for e in entries)
    refusing = [int(e[:-1]) for e in entries if e.endswith("!")]
    if not refusing:
        return local, None
    if reason is None:
        reason = (await store.get(f"shm/why/{refusing[0]}")).decode()
    return local, f"rank {refusing[0]}: {reason}"


async def plan_hosts(
    store: Store, rank: int, world_size: int, local: list[int], *, timeout: Timeout = None
) -> tuple[tuple[int, ...], ...]:
    """Return the world's ranks by host, each host's in order and the hosts in the order of
    their first ranks, given the ranks of this host (``local``, from
    :func:`plan_shared_memory` on the same store).

    Collective over the world. A world on one host needs no request; otherwise the lowest
    rank of each host appends its host's ranks (as ranges, so the value stays small for
    hosts of consecutive ranks) to one key, and every rank passes a store barrier and reads
    the key: two requests per rank, three for the lowest.

    Raises:
        DistTimeoutError: a rank did not arrive within ``timeout`` (default: the store's).
        DistProtocolError: the hosts' lists do not cover the world exactly once.
    """
    if len(local) == world_size:
        return (tuple(local),)
    if rank == local[0]:
        await store.append("shm/plan", _shm_setup.ranks_text(local) + ";")
    await store.barrier("shm/planned", world_size, to_seconds(timeout, store.timeout))
    text = (await store.get("shm/plan")).decode()
    hosts = sorted(tuple(_shm_setup.ranks_of(entry)) for entry in text.split(";") if entry)
    if sorted(r for host in hosts for r in host) != list(range(world_size)):
        raise DistProtocolError(f"the hosts' rank lists {text!r} do not cover the world once")
    return tuple(hosts)


def bytes_needed(local_count: int) -> int:
    """Bytes of ``/dev/shm`` the transports of ``local_count`` ranks of one host reserve
    together with the default ring size (each rank: a ring to each peer, and a page)."""
    peers = local_count - 1
    return local_count * (peers * _default_ring_bytes(peers) + mmap.PAGESIZE)


def _default_ring_bytes(peers: int) -> int:
    size = DEFAULT_RING_BYTES
    while size > (256 << 10) and peers * size > (64 << 20):
        size >>= 1
    return size


def _checked_arguments(
    rank: int,
    world_size: int,
    local_ranks: Collection[int] | None,
    ring_bytes: int | None,
    spin: float | None,
) -> tuple[tuple[int, ...], int, float]:
    """:meth:`ShmTransport.create`'s arguments, checked: the ranks on this host (sorted),
    the ring size (``None``: the default for their number) and the spin in seconds (-1:
    decided once the peers' processes are known).

    Raises:
        DistUsageError: naming the first invalid argument.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise DistUsageError(f"world_size must be a positive integer, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise DistUsageError(f"rank must be in [0, {world_size}), got {rank!r}")
    local = tuple(sorted(set(range(world_size) if local_ranks is None else local_ranks)))
    if any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size for r in local):
        raise DistUsageError(f"local_ranks must be ranks in [0, {world_size}), got {local}")
    if rank not in local:
        raise DistUsageError(f"local_ranks {list(local)} must include this rank ({rank})")
    if ring_bytes is None:
        ring_bytes = _default_ring_bytes(len(local) - 1)
    elif (
        isinstance(ring_bytes, bool)
        or not isinstance(ring_bytes, int)
        or ring_bytes < _MIN_RING_BYTES
        or ring_bytes & (ring_bytes - 1)
    ):
        raise DistUsageError(
            f"ring_bytes must be a power of two of at least {_MIN_RING_BYTES}, got {ring_bytes!r}"
        )
    if spin is None:
        return local, ring_bytes, -1.0
    if isinstance(spin, bool) or not isinstance(spin, int | float) or spin < 0:
        raise DistUsageError(f"spin must be a non-negative number of seconds, got {spin!r}")
    return local, ring_bytes, float(spin)


def _check_records(
    records: dict[int, dict[str, Any]], host: str, rank: int, local: tuple[int, ...], cap: int
) -> None:
    """Check that every local rank's record (``records``) is of this host (``host``) and
    this version, and names the same local ranks and ring size as this rank.

    Raises:
        DistUsageError: naming the first rank that differs.
    """
    for r, rec in records.items():
        if rec.get("v") != _VERSION or rec.get("host") != host:
            raise DistUsageError(
                f"rank {r} cannot share memory with rank {rank}: it is on another "
                f"host (its host key {rec.get('host')!r}, ours {host!r}) "
                "or runs another aiodist version"
            )
        if rec.get("ranks") != list(local) or rec.get("ring") != cap:
            raise DistUsageError(
                f"rank {r} set up shared memory with local ranks {rec.get('ranks')} "
                f"and {rec.get('ring')}-byte rings, rank {rank} with {list(local)} "
                f"and {cap}-byte rings; every local rank must pass the same"
            )


def _map_peers(
    records: dict[int, dict[str, Any]],
    peers: list[int],
    procs: dict[int, ProcessId],
    job: str,
    size: int,
    attached: list[Segment],
    bells: list[Bell],
) -> str | None:
    """Map each peer's segment (into ``attached``) and open its doorbell (into ``bells``);
    return why that failed (``None``: it did not), for the barrier to tell every rank."""
    try:
        for r in peers:
            # Whoever can write the store wrote the record: only a file that rank's
            # process could have made is opened, and only as large as its rings.
            path = peer_path(records[r]["seg"], job, "t", r, procs[r])
            peer_seg = Segment.attach(path, size)
            attached.append(peer_seg)
            if peer_seg.words[W_MAGIC] != _MAGIC:
                raise DistProtocolError(
                    f"rank {r}'s shared-memory segment {peer_seg.path} is not an aiodist one"
                )
            bells.append(Bell(peer_path(records[r]["bell"], job, "tb", r, procs[r])))
    except (SharedMemoryError, OSError) as exc:
        # (A peer's files are gone if it exited and was swept away as leftovers: the
        # barrier then names it.)
        return str(exc)
    return None


class ShmTransport(Transport):
    """A transport between ranks on one host, through ring buffers in shared memory.

    It serves the ranks in ``local_ranks`` (sends to others are a usage error) and delivers
    into a :class:`~aiodist.transport._mailbox.Mailbox`, its own or one it shares with
    another transport (a per-peer router: TCP for remote ranks, this for local ones; give
    both the same mailbox). Message matching, fingerprints (``begin_op``/``end_op``),
    any-source receives, orderly close versus lost peers: all as the TCP transport. Sends
    to this rank itself go straight into the mailbox.

    Create instances with :meth:`create`, which is collective among ``local_ranks``.

    Attributes:
        rank: this transport's global rank.
        world_size: the number of ranks in the world.
        local_ranks: the global ranks on this host that this transport serves (with
            ``rank``).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        local_ranks: tuple[int, ...],
        mailbox: Mailbox,
        seg: Segment | None,
        doorbell: Doorbell | None,
        spin: float,
        staging: int,
    ) -> None:
        super().__init__(rank, world_size, mailbox)
        self.staging = staging
        self.local_ranks = local_ranks
        self.loop = asyncio.get_running_loop()
        self.seg = seg
        self._doorbell = doorbell
        self._spin = spin
        self._links: list[ShmLink] = []
        self._by_peer: dict[int, ShmLink] = {}
        self.closed: BaseException | None = None
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._recheck = _RECHECK_FIRST
        # Receives posted through this transport that were not satisfied at once.
        self._awaited: list[asyncio.Future[int]] = []
        # Messages received and sends finished so far: a poll stops when this moves.
        self.completions = 0
        #: Bytes of payloads this rank copied from its peers' memory itself (the single-copy
        #: path of large messages: :mod:`aiodist.transport._shm_pull`).
        self.pulled_bytes = 0
        # When receives skip polling for a while (polls ran out of time in a row).
        self._backoff = Backoff()

    # -- setup -----------------------------------------------------------------------------

    @classmethod
    async def create(
        cls,
        store: Store,
        rank: int,
        world_size: int,
        local_ranks: Collection[int] | None = None,
        *,
        mailbox: Mailbox | None = None,
        timeout: Timeout = None,
        ring_bytes: int | None = None,
        spin: float | None = None,
        job_key: str | None = None,
        staging_bytes: int | None = None,
    ) -> ShmTransport:
        """Set up the rings between ``rank`` and the other ranks of ``local_ranks``.

        Collective: every rank of ``local_ranks`` must call it with the same
        ``local_ranks`` and ``ring_bytes``. Each rank creates its segment and doorbell in
        ``/dev/shm``, publishes their names under ``shm/t/<rank>`` in ``store``, maps its
        peers', and once every peer has said it mapped them (``shm/t/mapped/<rank>``)
        unlinks both names: nothing remains in ``/dev/shm`` whatever happens to the
        processes afterwards. On any failure this rank unlinks what it created (and the
        names left by peers that died) before raising.

        Args:
            store: the job's store, already namespaced for this job and generation; only
                keys under ``shm/`` are used.
            rank: this rank, in ``[0, world_size)``.
            world_size: the number of ranks in the world.
            local_ranks: the ranks on this host to talk to, ``rank`` included (use
                :func:`find_local_ranks` to learn them); ``None``: every rank.
            mailbox: where messages are delivered; ``None`` creates one. Share one with
                another transport to route per peer.
            timeout: seconds (or ``timedelta``) allowed for the local ranks to meet;
                ``None`` means 300 s.
            ring_bytes: bytes per ring (a power of two, at least 4096); ``None`` chooses
                4 MiB, less with many local ranks.
            spin: seconds to poll before sleeping; ``None`` polls 50 µs when the local
                ranks fit on this process's CPUs and none shares this process, ``0``
                never polls.
            job_key: the job's identity, from which segment names derive (so that a
                restart removes its predecessor's leftovers); ``None`` uses
                :func:`default_job_key`.
            staging_bytes: the bytes of messages from one peer this rank holds at most
                for receives not posted yet; a message that does not fit waits for its
                receive (see :mod:`aiodist.transport._flow`). ``None`` reads
                ``$AIODIST_STAGING_BYTES``, else 16 MiB. Ranks may differ.

        Returns:
            The open transport.

        Raises:
            SharedMemoryError: shared memory cannot be used here (disabled with
                ``AIODIST_SHM=0``, not x86-64, ``/dev/shm`` full: the message names the
                size needed), or a local rank could not create or map a segment (every
                local rank raises it then, naming that rank); the caller may fall back to
                TCP.
            DistUsageError: a bad argument (``staging_bytes`` included), or a peer that is not on this host (its host
                key differs) or disagrees on ``local_ranks`` or ``ring_bytes``.
            DistTimeoutError: a local rank did not arrive in time (the ranks are named).
            DistNetworkError: a local rank exited during setup.
        """
        local, ring_bytes, spin_s = _checked_arguments(
            rank, world_size, local_ranks, ring_bytes, spin
        )
        peers = [r for r in local if r != rank]
        seconds = to_seconds(timeout, DEFAULT_SETUP_TIMEOUT)
        staging = resolve_staging_bytes(staging_bytes)
        reason = unavailable_reason()
        if reason is not None:
            logger.info("no shared-memory transport: %s", reason)
            raise SharedMemoryError(reason)
        if mailbox is None:
            mailbox = Mailbox(rank, world_size)
        elif mailbox.rank != rank or mailbox.world_size != world_size:
            raise DistUsageError(
                f"the mailbox belongs to rank {mailbox.rank} of {world_size}, not to rank "
                f"{rank} of {world_size}"
            )
        if not peers:
            return cls(rank, world_size, local, mailbox, None, None, 0.0, staging)
        job = default_job_key() if job_key is None else job_key
        remove_leftovers(job)
        loop = asyncio.get_running_loop()
        deadline = None if seconds is None else loop.time() + seconds
        return await cls._setup(
            store,
            rank,
            world_size,
            local,
            peers,
            mailbox,
            ring_bytes,
            spin_s,
            staging,
            job,
            deadline,
        )

    @classmethod
    async def _setup(
        cls,
        store: Store,
        rank: int,
        world_size: int,
        local: tuple[int, ...],
        peers: list[int],
        mailbox: Mailbox,
        cap: int,
        spin: float,
        staging: int,
        job: str,
        deadline: float | None,
    ) -> ShmTransport:
        me = this_process()
        size = CTRL_BYTES + len(peers) * (RING_HDR_BYTES + cap)
        what = f"setting up shared memory for rank {rank}"
        seg: Segment | None = None
        doorbell: Doorbell | None = None
        attached: list[Segment] = []
        bells: list[Bell] = []
        records: dict[int, dict[str, Any]] = {}
        self: ShmTransport | None = None
        try:
            # A rank that cannot create its segment or map a peer's says so to the others
            # (in its record, at the barrier), so that they all give up shared memory
            # together (SharedMemoryError: the caller falls back to TCP).
            record: dict[str, Any] = {"v": _VERSION, "host": host_key()}
            try:
                seg = Segment.create(
                    segment_path(job, "t", rank),
                    size,
                    f"the rings of rank {rank} ({len(peers)} x {cap} bytes)",
                )
                seg.words[W_MAGIC] = _MAGIC
                seg.words[W_SLEEP] = 1  # a rank that is not polling wants its doorbell rung
                doorbell = Doorbell(segment_path(job, "tb", rank))
            except SharedMemoryError as exc:
                # The others learn it from this record; this rank knows enough already.
                record["failed"] = f"rank {rank}: {exc}"
                await _shm_setup.publish(store, "shm/t", rank, record)
                raise SharedMemoryError(record["failed"]) from exc
            else:
                record.update(
                    pid=me.pid,
                    start=me.start,
                    seg=seg.path,
                    bell=doorbell.path,
                    ring=cap,
                    ranks=list(local),
                    staging=staging,
                )
            records = await _shm_setup.exchange(store, "shm/t", rank, local, record, deadline, what)
            failed = [str(records[r]["failed"]) for r in sorted(records) if "failed" in records[r]]
            if failed:
                raise SharedMemoryError(failed[0])
            _check_records(records, record["host"], rank, local, cap)
            procs = {r: _shm_setup.process_of(r, rec, what) for r, rec in records.items()}
            staged = {r: _shm_setup.count_of(r, rec, "staging", what) for r, rec in records.items()}
            failure = _map_peers(records, peers, procs, job, size, attached, bells)
            failure = await _shm_setup.barrier(
                store, "shm/t/mapped", rank, local, deadline, procs, what, failure
            )
            if failure is not None:
                raise SharedMemoryError(failure)
            # Every peer holds our segment and doorbell open: the names can go.
            seg.unlink()
            doorbell.unlink()
            if spin < 0:
                same_process = any(p.pid == me.pid for p in procs.values())
                spin = SPIN_SECONDS if ranks_fit(len(local)) and not same_process else 0.0
            self = cls(rank, world_size, local, mailbox, seg, doorbell, spin, staging)
            self._link(peers, procs, attached, bells, cap, staged)
            doorbell.listen(self.loop, self._on_bell)
            for link in self._links:
                link.watch = PeerWatch(
                    self.loop, link.proc, functools.partial(self.peer_exited, link)
                )
            seg.words[W_STATE] = OPEN
        except BaseException:
            if self is not None:
                self._release()
            else:
                for b in bells:
                    b.close()
                for s in attached:
                    s.close()
                if doorbell is not None:
                    doorbell.close()
                if seg is not None:
                    seg.close()
            # Names published by peers that died before unlinking them.
            remove_leftovers(job)
            raise
        logger.debug("rank %d: shared memory with ranks %s, %d-byte rings", rank, peers, cap)
        return self

    def _link(
        self,
        peers: list[int],
        procs: dict[int, ProcessId],
        attached: list[Segment],
        bells: list[Bell],
        cap: int,
        staged: dict[int, int],
    ) -> None:
        """Make the link to each peer, over its ring in the peer's segment (out) and its
        ring in this rank's (in), with its first credit: the peer's staging bound."""
        for i, r in enumerate(peers):
            senders_of_r = [s for s in self.local_ranks if s != r]
            out_ring = CTRL_BYTES + senders_of_r.index(self.rank) * (RING_HDR_BYTES + cap)
            in_ring = CTRL_BYTES + i * (RING_HDR_BYTES + cap)
            link = ShmLink(self, r, procs[r], attached[i], out_ring, in_ring, cap, bells[i])
            link.flow.granted(staged[r])  # the first credit: its bound
            self._links.append(link)
            self._by_peer[r] = link

    def __repr__(self) -> str:
        state = "closed" if self.closed is not None else "open"
        return (
            f"<ShmTransport rank={self.rank}/{self.world_size} local={list(self.local_ranks)} "
            f"{state} {self.mailbox!r}>"
        )

    # -- the Transport interface -----------------------------------------------------------

    def send(
        self, peer: int, tag: Tag, data: memoryview, *, cleared: bool = False
    ) -> asyncio.Future[None]:
        """Send ``data`` to the local rank ``peer``.

        The future resolves once the payload is in shared memory (the caller may then
        reuse ``data``); for a small message on a ring with room, before this returns; for
        one beyond the peer's staging bound, once the peer posted its receive and the
        payload followed. It fails with ``DistNetworkError`` if the peer is lost or has
        closed first.

        Raises:
            DistUsageError: ``peer`` is out of range or not served here, the tag is
                malformed, or ``data`` is not contiguous.
        """
        data = as_bytes(data, writable=False)
        link = self._link_for(peer)
        fut: asyncio.Future[None] = self.loop.create_future()
        if link is not None and link.error is None and self.closed is None:
            # The common case, kept short: packing the header checks the tag.
            try:
                fp = self.mailbox.fingerprint_of(tag[0], tag[1])
                header = link.flow.header(tag, len(data), fp, cleared)
                if header is None:
                    link.flow.announce(tag, data, fp, fut)
            except (struct.error, TypeError, IndexError):
                check_tag(tag)  # raises the usage error for a malformed tag
                raise
            if header is not None:
                link.write(header, data, fut)
            return fut
        check_tag(tag)
        if self.closed is not None:
            fail_future(fut, self.closed)
        elif link is not None:
            assert link.error is not None  # (an open link took the common case)
            fail_future(fut, link.error)
        else:  # to this rank itself
            fp = self.mailbox.fingerprint_of(tag[0], tag[1])
            self.mailbox.deliver(peer, (tag[0], tag[1], tag[2]), data, fp)
            fut.set_result(None)
        return fut

    def recv_into(self, peer: int | None, tag: Tag, out: memoryview) -> asyncio.Future[int]:
        """Receive the next ``tag`` message from ``peer`` (``None``: any rank) into ``out``.

        The future resolves to the sender's rank; it fails with ``DistUsageError`` if the
        message has another length than ``out``, with ``DistNetworkError`` if the peer is
        lost first.

        Raises:
            DistUsageError: ``peer`` is out of range or not served here, the tag is
                malformed, or ``out`` is read-only or not contiguous.
        """
        link = None if peer is None else self._link_for(peer)
        check_tag(tag)
        fut = self.mailbox.post(peer, tag, as_bytes(out, writable=True))
        if not fut.done() and self.closed is None:
            # The message may already wait in the ring.
            if link is not None:
                if link.error is None:
                    link.rx(TURN_BYTES)
            elif peer is None:
                for lk in self._links:
                    if lk.error is None:
                        lk.rx(TURN_BYTES)
            if not fut.done() and (link is not None or (peer is None and self._links)):
                self._awaited.append(fut)
                self.schedule()
        return fut

    def send_reject(self, peer: int, group: int, seq: int, reason: str) -> None:
        """Tell ``peer`` that this rank rejected operation ``(group, seq)``, and why."""
        link = self._link_for(peer)
        if link is None:
            self.mailbox.reject(peer, group, seq, reason)
            return
        frame = control_frame(REJECTION, group, seq, reason)
        link.write(frame[: HEADER.size], memoryview(frame)[HEADER.size :], None)

    def _link_for(self, peer: int) -> ShmLink | None:
        """The link to ``peer``; ``None`` for this rank itself."""
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < self.world_size:
            raise DistUsageError(f"peer must be a rank in [0, {self.world_size}), got {peer!r}")
        if peer == self.rank:
            return None
        link = self._by_peer.get(peer)
        if link is None:
            raise DistUsageError(
                f"rank {peer} is not served by this shared-memory transport (local ranks "
                f"{list(self.local_ranks)})"
            )
        return link

    def abort(self, exc: BaseException) -> None:
        """Fail every pending send and receive with ``exc``; peers see this rank as lost."""
        if self.closed is None:
            self._shutdown(exc, ABORTED)

    async def aclose(self, reason: str | None = None) -> None:
        """Let queued sends drain (up to 5 s), tell the peers this rank closes, and close.

        Pending receives fail with ``DistNetworkError``; peers see an orderly close (their
        receives from this rank fail once they took every message it sent, naming
        ``reason``; their any-source receives keep waiting for others). Closing twice is
        harmless.
        """
        if self.closed is None:
            queued = [s.fut for link in self._links for s in (*link.queue, *link.bulk)]
            queued += [f for link in self._links for f in link.flow.waiting()]
            if queued:
                await asyncio.wait(queued, timeout=CLOSE_DRAIN_SECONDS)
            if self.closed is None:
                exc = DistNetworkError(f"the transport of rank {self.rank} was closed")
                self._shutdown(exc, CLOSED, control_frame(BYE, 0, 0, reason or CLOSED_REASON))

    def _shutdown(self, exc: BaseException, state: int, last: bytes | None = None) -> None:
        self.closed = exc
        if last is not None:
            # The peers read this before they see our state change: the goodbye reaches them.
            for link in self._links:
                if link.error is None and not link.queue:
                    link.queue.append(control_send(last, self.loop.create_future()))
                    link.tx(len(last))
        if self.seg is not None:
            if state == ABORTED:
                leave_cause(self.seg.buf, abort_text(exc))
                fence()
            self.seg.words[W_STATE] = state
            fence()
        for link in self._links:
            if link.error is None:
                link.bell.ring()  # whatever its flag says: it must learn our state
            for s in (*link.queue, *link.bulk):
                fail_future(s.fut, exc)
            link.queue.clear()
            link.bulk.clear()
            link.flow.fail(exc)
        self.mailbox.abort(exc)
        self._release()
        logger.debug("rank %d shared-memory transport closed: %s", self.rank, exc)

    def _release(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for link in self._links:
            link.close()
        if self._doorbell is not None:
            self._doorbell.close()
        if self.seg is not None:
            self.seg.close()

    # -- moving bytes ----------------------------------------------------------------------

    @property
    def polls(self) -> bool:
        """Whether this transport polls for its peers' writes (each rank of the host has a
        CPU of its own) rather than sleeping on its doorbell."""
        return bool(self._spin)

    def schedule(self) -> None:
        if not self._scheduled and self.closed is None:
            self._scheduled = True
            # The service pass will look at every ring, and it ends in _sleep, which sets
            # the flag again and looks once more: until then peers need not ring (in a
            # 2-rank exchange both would, each while the other is about to look anyway).
            if self.seg is not None:
                self.seg.words[W_SLEEP] = 0
            self.loop.call_soon(self._service)

    def _pump(self, budget: int) -> int:
        moved = 0
        for link in self._links:
            if link.error is None:
                moved += link.rx(budget - moved)
                if (link.queue or link.bulk) and link.error is None:
                    moved += link.tx(budget - moved)
        return moved

    def _has_work(self) -> bool:
        if self._awaited:
            self._awaited = [f for f in self._awaited if not f.done()]
            if self._awaited:
                return True
        return any(link.queue or link.bulk or link.inbound is not None for link in self._links)

    def _service(self) -> None:
        # Move bytes until nothing moves or this turn's budget is spent; then poll for a
        # while, or sleep on the doorbell, if something is still awaited.
        self._scheduled = False
        if self.closed is not None:
            return
        budget = TURN_BYTES
        while budget > 0:
            moved = self._pump(budget)
            if not moved:
                break
            budget -= moved
            self._recheck = _RECHECK_FIRST
        if budget <= 0:
            self.schedule()
        elif self._spin and self._has_work() and not self._backoff.skips():
            self._poll()
        else:
            self._sleep()

    def _poll(self) -> None:
        words = self.seg.words  # type: ignore[union-attr]
        words[W_SLEEP] = 0  # peers need not ring while we look ourselves
        completions = self.completions
        moved_total = 0
        now = time.perf_counter
        start = now()
        hot, deadline = start + HOT_SPIN_SECONDS, start + self._spin
        try:
            # The policy of aiodist._util._wait.spin_until, save that a poll that moves data goes
            # on for another full spin: data flows, and polling keeps up with it.
            while self.closed is None:
                moved = self._pump(TURN_BYTES)
                if self.completions != completions:
                    self._backoff.polled(True)
                    break
                if moved:
                    moved_total += moved
                    if moved_total >= TURN_BYTES:
                        self.schedule()  # more next turn; the flag stays clear till then
                        return
                    deadline = now() + self._spin
                    continue
                t = now()
                if t >= deadline:
                    # Nothing came in time: the peer is slow, or busy CPUs make polling
                    # cost the peer its CPU.
                    self._backoff.polled(False)
                    break
                if t >= hot:
                    os.sched_yield()
        except BaseException:
            if self.closed is None:
                words[W_SLEEP] = 1  # never leave peers believing we look
            raise
        self._sleep()

    def _sleep(self) -> None:
        # Store the sleeping flag (and any ring's want flag was stored); after a barrier,
        # look once more before relying on the doorbell (see _shm_signal).
        if self.seg is None or self.closed is not None:
            return
        self.seg.words[W_SLEEP] = 1
        fence()
        if self._pump(TURN_BYTES):
            self._recheck = _RECHECK_FIRST
            self.schedule()
        elif self._timer is None and self._has_work():
            self._timer = self.loop.call_later(self._recheck, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._recheck = min(self._recheck * 2, _RECHECK_MAX)
        self._check_peers()
        self._service()

    def _on_bell(self) -> None:
        if self._doorbell is None or self.closed is not None:
            return
        self._doorbell.drain()
        self._check_peers()
        self._service()

    # -- peers that go away ----------------------------------------------------------------

    def _check_peers(self) -> None:
        for link in self._links:
            if link.error is None and link.peer_state() in (CLOSED, ABORTED):
                self.peer_exited(link)

    def peer_gone(self, peer: int, exc: BaseException) -> None:
        """``peer`` went away without a goodbye (the store says so): take what it wrote,
        then fail what still needs it."""
        for link in self._links:
            if link.peer == peer and link.error is None and self.closed is None:
                link.drain()
                self.lose(link, exc)

    def peer_exited(self, link: ShmLink) -> None:
        """The peer closed, aborted or its process ended: deliver what it wrote, then fail
        what depends on it."""
        if link.error is not None or self.closed is not None:
            return
        link.drain()  # (its goodbye, if it said one, is the last thing it wrote)
        state = link.peer_state()
        if state == CLOSED:
            error = lost_peer_error(link.peer, f"it {link.bye or CLOSED_REASON}", Departure.LEFT)
        elif state == ABORTED:
            error = peer_aborted_error(link.peer, link.peer_cause())
        else:
            reason = f"its process (pid {link.proc.pid}) exited"
            error = lost_peer_error(link.peer, reason, Departure.GONE)
        self.lose(link, error)

    def lose(self, link: ShmLink, exc: BaseException) -> None:
        if link.error is not None or self.closed is not None:
            return
        link.error = exc
        if link.watch is not None:
            link.watch.close()
        for s in (*link.queue, *link.bulk):
            fail_future(s.fut, exc)
        link.queue.clear()
        link.bulk.clear()
        link.flow.fail(exc)
        link.inbound = None  # the mailbox fails it with the peer
        self.mailbox.fail_peer(link.peer, exc)
        level = logging.WARNING if departure_of(exc) is None else logging.DEBUG
        logger.log(level, "rank %d: %s", self.rank, exc)
