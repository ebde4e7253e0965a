"""How a rank joins a world: its namespace in the store, its transport, its backends.

:func:`join_world` is what ``init_process_group`` does once it has a store, a rank and a
world size (from the caller, or from the rendezvous): the rank counts its joins to find its
generation's namespace, connects its transport (TCP, and shared memory to the ranks of its
host), builds the world and lets each backend set up the default group. A rank that gives up
while its world forms says so in the store (:func:`left_by`), so the others stop waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import sys
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from .. import backends as _backends, group as _group
from .._util._auth import resolve_token
from ..errors import DistError, DistNetworkError, DistUsageError
from ..group import CURRENT, Connect, Membership, ProcessGroup, World, start_world
from ..store import PrefixStore, Store
from ..transport._address import listen_host
from ..transport.base import Transport
from ._forming import Forming

__all__ = [
    "Observer",
    "observe_worlds",
    "CURRENT",
    "RANK_MARK",
    "announce",
    "connect_members",
    "connector",
    "job_store",
    "join_world",
    "leave_forming",
    "left_by",
    "open_world",
]

logger = logging.getLogger(__name__)


class Observer(Protocol):
    """What watches the worlds this process joins (:mod:`aiodist.debug`'s flight-recorder
    dumps and live view; the package sets it, see :func:`observe_worlds`)."""

    def joining(self) -> None:
        """A world is about to start on this process."""

    async def joined(self, lobby: Store, rank: int, token: Callable[[], bytes | None]) -> None:
        """The world of ``lobby`` leased this process's ``rank``; ``token`` reads the job's
        secret (read only when needed: it may raise)."""


_observers: list[Observer] = []


def observe_worlds(observer: Observer) -> None:
    """Have ``observer`` told of each world this process joins from now on."""
    _observers.append(observer)


async def join_world(
    store: Store,
    rank: int,
    world_size: int,
    owned: list[Store],
    *,
    name: str,
    backend: str,
    backends: Mapping[str, str],
    timeout: float | None,
    token: bytes | None,
    shared_memory: bool | None,
) -> ProcessGroup:
    """Join the world of ``world_size`` ranks that ``store`` gathers, as ``rank``; return
    its default group (now the default here).

    ``name`` is the job's namespace in the store (``group_name``); ``owned`` are the stores
    this rank made for it, closed with the world (or now, if joining fails).

    Raises:
        DistTimeoutError: the connections did not complete in time.
        DistNetworkError: a peer could not be reached, or one left the world as it formed.
        DistUsageError: shared memory was required and cannot be had.
    """

    forming: Forming | None = None
    try:
        job = job_store(store, name)
        # Counted per rank: the n-th join of every rank meets in generation n, however the
        # ranks restart (all of them, or only the failed one while the others rebuild).
        generation = await job.add(f"joined/{world_size}/{rank}", 1) - 1
        prefixed = PrefixStore(f"{world_size}/{generation}", job)
        if generation:
            # This rank left the previous generation for good: ranks still forming it
            # learn that it can never be complete.
            earlier = PrefixStore(f"{world_size}/{generation - 1}", job)
            await earlier.set(_LEFT, f"rank {rank} (it joined a later generation)")
        forming = Forming(job, prefixed, rank, world_size, backend, generation)
        await forming.enter()
        membership = Membership(connector(timeout, token, shared_memory), job)
        transport = await connect_members(
            prefixed, rank, world_size, membership.connect, forming=forming
        )
    except BaseException:
        if forming is not None:
            await forming.leave()
        for s in owned:
            await s.aclose()
        raise
    logger.debug("rank %d/%d joined generation %d", rank, world_size, generation)
    try:
        pg = await open_world(
            transport,
            prefixed,
            backend=backend,
            backends=backends,
            timeout=timeout,
            owned=owned,
            membership=membership,
        )
    finally:
        await forming.leave()
    if generation and rank == 0:
        # Every rank formed this generation, so none forms the one before any more: the
        # note that its ranks joined a later one (above) did its work. (Written after that
        # generation's last rank left and swept it, it would stay.)
        with contextlib.suppress(DistError):
            await earlier.delete_key(_LEFT)
    return pg


async def open_world(
    transport: Transport,
    store: Store,
    *,
    backend: str,
    backends: Mapping[str, str],
    timeout: float | None,
    owned: list[Store],
    membership: Membership,
) -> ProcessGroup:
    """Build the world of a connected ``transport``, make it the default here, let the
    backends set up its default group and announce it to the processes waiting to join;
    return its default group (the world is closed again if a step fails)."""
    for observer in _observers:
        observer.joining()
    pg = start_world(
        transport,
        store,
        backend=backend,
        backends=backends,
        timeout=timeout,
        owned=owned,
        membership=membership,
    )
    try:
        await pg.world.domain.leased()
        connect = membership.connect
        for observer in _observers:
            await observer.joined(
                membership.lobby,
                pg.rank,
                lambda: connect.token if isinstance(connect, _Connector) else resolve_token(None),
            )
        await _backends.setup(pg)  # (the last step that needs the store on every rank)
        await announce(pg.world)
    except BaseException:
        _group.set_current_world(None)
        await pg.world.aclose()
        raise
    return pg


async def announce(world: World) -> None:
    """Record in the job's namespace that ``world`` is its world now, for the processes
    that wait to join it (they give up when every rank of it has left); and tell the
    launcher that started this process (``aiodist-run``) its rank in it."""
    membership = world.membership
    if membership is None:
        return
    _tell_launcher(membership.lobby, world.rank)
    if world.rank != 0:
        return
    await membership.lobby.set(CURRENT, f"{membership.path_of(world.store)}|{world.size}")


#: What a worker of ``aiodist-run`` writes on a line of its own to its stdout and its stderr
#: each time it joins a world, followed by its rank and BEL: the launcher takes the line out
#: and prefixes the worker's later lines with that rank, also after a shrink or an admission.
#: In the streams themselves, so the new prefix starts exactly after the lines written before
#: (a message on another channel could overtake them or fall behind). An OSC escape: a
#: terminal shows nothing should one reach it.
RANK_MARK = b"\x1b]aiodist-rank;"


def _tell_launcher(job: Store, rank: int) -> None:
    if not all(os.environ.get(v) for v in ("AIODIST_RUN_ID", "GROUP_RANK", "LOCAL_RANK")):
        return  # (not a worker of aiodist-run)
    # Only the job's world (its namespace right on the store the launcher gave): a world the
    # worker forms in a namespace of its own numbers its ranks as it pleases.
    root = job.underlying_store if isinstance(job, PrefixStore) else job
    if isinstance(root, PrefixStore):
        return
    mark = RANK_MARK + b"%d\x07\n" % rank
    for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
        # What the script wrote before goes first (its buffered text, then the mark).
        try:
            if stream is not None:
                stream.flush()
            os.write(fd, mark)
        except (OSError, ValueError) as exc:  # (a closed stream or descriptor)
            logger.debug("could not tell the launcher this rank (%d): %s", rank, exc)


def job_store(store: Store, name: str) -> PrefixStore:
    """The namespace in ``store`` of the job named ``name`` (``group_name``)."""
    return PrefixStore(f"aiodist/{name or 'default_pg'}", store)


#: The key set in a world's namespace when one of its ranks leaves it before it formed.
_LEFT = "left_by"


@dataclass(frozen=True)
class _Connector:
    """How this rank connects to the ranks of a world (see :func:`connector`)."""

    timeout: float | None
    token: bytes | None
    shared_memory: bool | None

    async def __call__(self, store: Store, rank: int, world_size: int) -> Transport:
        return await _connect(
            store,
            rank,
            world_size,
            timeout=self.timeout,
            token=self.token,
            shared_memory=self.shared_memory,
        )


def connector(timeout: float | None, token: bytes | None, shared_memory: bool | None) -> Connect:
    """How this rank connects to the ranks of a world: TCP, and shared memory with the ranks
    of its host unless ``shared_memory`` is ``False`` (see ``init_process_group``). A world
    keeps it (``Membership.connect``) to connect its members again when they change."""
    return _Connector(timeout, token, shared_memory)


_warned_open = False


def _warn_if_open(host: str, token: bytes | None) -> None:
    """Say once per process that this rank listens beyond loopback without a secret (not
    under ``aiodist-run``, which says so itself, for the whole job)."""
    global _warned_open
    if token is not None or _warned_open or os.environ.get("AIODIST_RUN_ID"):
        return
    try:
        if host == "localhost" or ipaddress.ip_address(host.partition("%")[0]).is_loopback:
            return
    except ValueError:
        pass  # every interface (""), or a host name
    _warned_open = True
    logger.warning(
        "this rank listens on %s without a secret: anyone who can reach its port or the "
        "store's can pose as a rank, change the job's keys, and send what the object "
        "collectives unpickle; pass auth_token= (or set AIODIST_AUTH_TOKEN) with the same "
        "value on every rank, or run it with aiodist-run",
        host or "every interface",
    )


async def _shm_room(store: Store, rank: int, world_size: int, local: list[int]) -> str | None:
    """Why ``/dev/shm`` is too small for what the ranks ``local`` of this host would reserve
    there (their rings, and the default group's workspace when the world is this host), or
    ``None`` when it has room. The host's lowest rank looks and the others read its verdict
    from the store, so that every rank of the host makes the same choice (Docker gives
    containers 64 MiB unless told otherwise)."""
    from ..collectives.shm_workspace import workspace_bytes
    from ..transport._shm_segment import SHM_DIR, free_bytes
    from ..transport.shm import bytes_needed

    key = f"shm/room/{local[0]}"
    if rank == local[0]:
        need = bytes_needed(len(local))
        if len(local) == world_size:
            need += workspace_bytes(len(local))
        free = free_bytes()
        verdict = (
            ""
            if free >= need
            else f"{SHM_DIR} has {free} bytes free, but the {len(local)} ranks of this host "
            f"would reserve {need} there; enlarge it (docker: --shm-size) for shared memory"
        )
        await store.set(key, verdict)
    else:
        verdict = (await store.get(key)).decode()
    return verdict or None


async def connect_members(
    store: Store,
    rank: int,
    size: int,
    connect: Connect,
    op: str = "init_process_group",
    *,
    forming: Forming | None = None,
) -> Transport:
    """Connect ``rank`` to the other ranks of the world of ``size`` gathering in ``store``.

    Unless one of them gives up meanwhile: a rank that fails, is cancelled, or whose process
    ends (its lease on the store) while the world forms makes the others raise at once
    (``op``, the call that forms the world, starts the message). With ``forming`` (a rank's
    ``init_process_group``), the ranks also check that they agree on the world, and a long
    wait says which ranks have not arrived.

    Raises:
        DistNetworkError: a rank left the world as it formed (named).
        DistUsageError: the ranks disagree on the world size or the backend (both named).
        DistTimeoutError: the connections did not complete in time.
    """
    # (Stores without connections hold no leases: there a rank that dies is waited for.)
    await store.lease(_LEFT, f"rank {rank} (its process ended while the world formed)")
    try:
        transport = await _unless_left(store, connect(store, rank, size), op, forming)
        try:
            await store.lease(_LEFT, None)
        except BaseException:
            await transport.aclose()
            raise
    except BaseException as exc:
        # This world can never be complete once this rank stops joining it.
        why = "cancelled" if isinstance(exc, asyncio.CancelledError) else repr(exc)
        await leave_forming(store, f"rank {rank} (it stopped joining: {why})")
        raise
    return transport


async def leave_forming(store: Store, who: str) -> None:
    """Tell the ranks forming the world whose keys ``store`` holds that ``who`` will not
    join it: they raise instead of waiting (best effort: the store may be gone)."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(store.set(_LEFT, who), 5)


#: How often ranks forming a world check that it is still possible (seconds).
_LEFT_POLL = 0.5


async def left_by(store: Store) -> str | None:
    """Which rank of the world whose keys ``store`` holds left it while it formed, if any.

    Such a world can never have every rank: the rank joined a later generation, or its
    ``init_process_group`` failed or was cancelled. ``store`` is the world's (``World.store``).
    """
    if not await store.check([_LEFT]):
        return None
    return (await store.get(_LEFT)).decode()


async def _unless_left(
    store: Store, joining: Coroutine[Any, Any, Transport], op: str, forming: Forming | None
) -> Transport:
    """Await ``joining`` a world, unless one of its ranks leaves it meanwhile, or (with
    ``forming``) the ranks disagree on it; a long wait says whom it waits for.

    Raises:
        DistNetworkError: naming that rank; joining again joins the next generation.
        DistUsageError: the ranks disagree on the world size or the backend.
    """
    task = asyncio.ensure_future(joining)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_LEFT_POLL)
            if done:
                return task.result()
            if forming is not None:
                await forming.poll()
            who = await left_by(store)
            if who is not None:
                again = "; call init_process_group again to join the next"
                raise DistNetworkError(
                    f"{op}: this generation of the process group can never be complete: "
                    f"{who} left it{again if op == 'init_process_group' else ''}"
                )
    except BaseException:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if not task.cancelled() and task.exception() is None:
            # Connected in the same turn this rank gave up (cancelled, or the world was
            # left): nobody else will close the listener and connections.
            await task.result().aclose()
        raise


async def _connect(
    store: Store,
    rank: int,
    world_size: int,
    *,
    timeout: float | None,
    token: bytes | None,
    shared_memory: bool | None,
) -> Transport:
    from ..transport._shm_segment import SharedMemoryError
    from ..transport.base import PeerDirectory
    from ..transport.routed import RoutedTransport
    from ..transport.shm import ShmTransport, plan_hosts, plan_shared_memory
    from ..transport.tcp import TCPTransport

    host = listen_host(store.local_address())
    _warn_if_open(host, token)
    tcp = await TCPTransport.create(
        PeerDirectory(store), rank, world_size, host=host, timeout=timeout, auth_token=token
    )
    if world_size == 1 or shared_memory is False:
        return tcp
    try:
        # Ranks on one host talk through shared memory, the others over TCP: every rank of a
        # host makes the same choice, from one list in the store. The hosts' lists let the
        # collectives of a world on several hosts work in two levels.
        local, refused = await plan_shared_memory(store, rank, world_size, timeout=timeout)
        tcp.hosts = await plan_hosts(store, rank, world_size, local, timeout=timeout)
        if len(local) == 1:
            return tcp
        small = None if refused is not None else await _shm_room(store, rank, world_size, local)
        if refused is not None or small is not None:
            if shared_memory:
                raise DistUsageError(
                    f"init_process_group: shared_memory=True, but ranks {local} of this host "
                    f"cannot share memory: {refused or small}"
                )
            # A small /dev/shm costs speed the user can get back: said louder.
            log = logger.info if small is None else logger.warning
            log("rank %d: ranks %s talk over TCP: %s", rank, local, refused or small)
            return tcp
        try:
            shm = await ShmTransport.create(
                store, rank, world_size, local, mailbox=tcp.mailbox, timeout=timeout
            )
        except SharedMemoryError as exc:
            # A rank of this host could not create or map its segment after all: every rank
            # of the host learnt it during the set-up, and they all use TCP.
            if shared_memory:
                raise DistUsageError(
                    f"init_process_group: shared_memory=True, but ranks {local} of this host "
                    f"could not set up shared memory: {exc}"
                ) from exc
            logger.warning("rank %d: ranks %s talk over TCP: %s", rank, local, exc)
            return tcp
        return RoutedTransport(tcp, shm)
    except BaseException:
        await tcp.aclose()
        raise
