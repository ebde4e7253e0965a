"""The agreement between the launchers of a multi-node ``aiodist-run`` job, through node 0's store.

Node 0's launcher hosts the store (:func:`open_store`), which its workers use too; the other
launchers connect to it. With ``--rdzv-backend=etcd`` the store is in etcd and every launcher
is its client; the leader (:meth:`Coordinator.lead`) does what node 0 does. A
:class:`Coordinator` holds what they agree on there: each node's claim and so the global
ranks, heartbeats (a silent node raises :class:`NodeLostError`), when an attempt may start,
its first failure, and the counters of the nodes done with it. The supervision of the local
workers that uses it is in :mod:`aiodist.launcher`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import uuid
from typing import Any, NamedTuple

from ..errors import DistError, DistNetworkError, DistTimeoutError, DistUsageError
from ..store import EtcdStore, Store
from ..store.tcp import TCPStore
from ._cli import LaunchConfig
from ._workers import WorkerFailure

logger = logging.getLogger(__name__)

#: Keys of the launchers themselves live under this prefix; everything else in the store
#: belongs to the workers and is deleted between attempts.
LAUNCHER_PREFIX = "aiodist-run/"


class NodeLostError(DistNetworkError):
    """Another node's launcher, or node 0's store, stopped answering.

    Attributes:
        node: the node whose heartbeats stopped, or ``None`` for the store's.
    """

    # Re-exported by aiodist.launcher, where it is public: tracebacks and pickles keep naming
    # the module it was always in.
    __module__ = "aiodist.launcher"

    def __init__(self, message: str, node: int | None = None) -> None:
        super().__init__(message)
        self.node = node


class Round(NamedTuple):
    """This node's place in one attempt: what its workers are told."""

    attempt: int
    node_rank: int
    nnodes: int
    rank_base: int
    world_size: int
    #: Whether this node was taken into the attempt as it ran (``--nnodes=MIN:MAX`` with
    #: ``--restart-policy=failed``): its workers join the running world.
    joined: bool = False


class Coordinator:
    """What the launchers of a job agree on through node 0's store.

    Keys (under ``aiodist-run/<run_id>/``): ``hb/<token>`` heartbeat counters; ``node/<node>``
    a node's claim (token and worker count); ``a<k>/go`` attempt ``k`` may start (set by
    node 0); ``a<k>/failure`` the first failure of attempt ``k`` (compare-and-set, so every node
    reports the same one); ``a<k>/done/<node>`` and ``a<k>/ack/<node>`` once a node's workers
    finished and once it saw the job end; an ``a<k>/stopped`` counter. With
    ``--nnodes=MIN:MAX`` the nodes of each attempt come together anew (:meth:`join_round`):
    ``a<k>/arrived`` counts them in, ``a<k>/claim/<i>`` holds the ``i``-th one's claim,
    ``a<k>/members`` the arrivals node 0 took, in node-rank order, and ``a<k>/node/<n>`` the
    claim of node ``n`` (``a<k>/nodes`` of them). With ``--restart-policy=failed`` as well,
    the workers outlive a change of nodes, and so does the attempt: a lost node is left
    behind (``a<k>/lost/<n>``, counted in ``a<k>/lost``) while ``MIN`` others remain, and a
    node that comes is taken in (:meth:`take_in`: a new ``a<k>/node/<n>``, and
    ``a<k+1>/took/<i>`` for its arrival ``i``).
    Every request is bounded by the lost-node timeout, so a vanished store is an error, not a
    hang; the supervisor is the only task using the store, so requests never overlap.
    """

    def __init__(self, store: Store, cfg: LaunchConfig) -> None:
        self._store = store
        self._cfg = cfg
        self._p = f"{LAUNCHER_PREFIX}{cfg.run_id}/"
        self._token = uuid.uuid4().hex
        #: The other nodes of this attempt: token -> (node rank, heartbeat count, since).
        self._beats: dict[str, tuple[int, int, float]] = {}
        #: This node's rank in its attempt, the worker count of each node of it by node rank,
        #: and those left behind (see :meth:`follow`).
        self._me = cfg.node_rank
        self._sizes: list[int] = []
        self.left: set[int] = set()
        self._lost_seen = 0

    def __repr__(self) -> str:
        return f"<Coordinator node={self._cfg.node_rank}/{self._cfg.nnodes} run={self._cfg.run_id}>"

    async def _op(self, what: str, coro: Any) -> Any:
        try:
            async with asyncio.timeout(self._cfg.lost_after):
                return await coro
        except TimeoutError:
            raise NodeLostError(
                f"{self._cfg.store_name} did not answer {what} within {self._cfg.lost_after:g} s"
            ) from None
        except (DistError, OSError) as exc:
            if isinstance(exc, DistUsageError):
                raise
            raise NodeLostError(f"lost {self._cfg.store_name} during {what}: {exc}") from exc

    async def lead(self) -> bool:
        """With the store in etcd: whether this node leads the job (starts the attempts),
        as node 0's launcher does when it hosts the store: node 0 of a fixed count, or with
        MIN:MAX nodes the first launcher to claim it.

        Raises:
            NodeLostError: the store stopped answering.
        """
        if not self._cfg.elastic:
            return self._cfg.node_rank == 0
        claim = self._store.compare_set(f"{self._p}leader", b"", self._token)
        return bool(await self._op("the join", claim) == self._token.encode())

    async def clear(self) -> None:
        """With the store in etcd, the leader at the end of the job: delete the job's keys,
        so that the run id can be used again."""
        with contextlib.suppress(NodeLostError):
            for key in await self._op("the cleanup", self._store.list_keys()):
                await self._op("the cleanup", self._store.delete_key(key))

    async def join(self) -> Round:
        """Register this node (a fixed node count); return its place in the job.

        Raises:
            DistUsageError: another launcher already joined with this node rank.
            DistTimeoutError: not every node joined within the join timeout.
            NodeLostError: the store stopped answering.
        """
        cfg, s = self._cfg, self._store
        await self._op("the heartbeat", s.add(f"{self._p}hb/{self._token}", 1))
        mine = f"{self._token} {cfg.nproc_per_node}".encode()
        got = await self._op("the join", s.compare_set(f"{self._p}node/{cfg.node_rank}", b"", mine))
        if got != mine:
            raise DistUsageError(
                f"another launcher already joined run {cfg.run_id!r} as node {cfg.node_rank}: "
                "give every node a different --node-rank"
            )
        keys = [f"{self._p}node/{i}" for i in range(cfg.nnodes)]
        deadline = time.monotonic() + cfg.join_timeout
        while not await self._op("the join", s.check(keys)):
            if time.monotonic() > deadline:
                missing = [i for i, k in enumerate(keys) if not await s.check([k])]
                raise DistTimeoutError(
                    f"nodes {missing} did not join run {cfg.run_id!r} at "
                    f"{cfg.master_addr}:{cfg.master_port} within {cfg.join_timeout:g} s"
                )
            await asyncio.sleep(cfg.monitor_interval)
        claims = [v.decode().split() for v in await self._op("the join", s.multi_get(keys))]
        return self._place(0, claims, cfg.node_rank)

    def _place(self, attempt: int, claims: list[list[str]], node_rank: int) -> Round:
        """This node's :class:`Round` among the nodes whose claims (token, worker count) are
        ``claims``, in node-rank order; the others' heartbeats are watched from now on."""
        self._me, self._sizes, self.left, self._lost_seen = node_rank, [], set(), 0
        self._beats = {}
        self._add_nodes(claims)
        sizes = self._sizes
        return Round(attempt, node_rank, len(claims), sum(sizes[:node_rank]), sum(sizes))

    def _add_nodes(self, claims: list[list[str]]) -> None:
        """Watch the heartbeats of the nodes whose claims are ``claims``, the next node ranks."""
        now = time.monotonic()
        for token, size in claims:
            node = len(self._sizes)
            self._sizes.append(int(size))
            if node != self._me:
                self._beats[token] = (node, -1, now)

    @property
    def live(self) -> list[int]:
        """The node ranks of this node's attempt not left behind, this node's included."""
        return [n for n in range(len(self._sizes)) if n not in self.left]

    async def join_round(self, attempt: int, hosting: bool) -> Round | None:
        """With ``--nnodes=MIN:MAX``: come to ``attempt`` with the other nodes; return this
        node's place in it, or in a later attempt if ``attempt`` was full (this node waits
        as a spare, and its arrival tells the running nodes that one is waiting).

        The node hosting the store closes each attempt: once ``MAX`` nodes came, or once
        ``MIN`` did and ``last_call_timeout`` passed; it takes itself and the first others
        to come, up to ``MAX``, in that order. ``None``: the job ended while this node
        waited (:meth:`end`).

        Raises:
            DistTimeoutError: fewer than ``MIN`` nodes came within the join timeout.
            NodeLostError: the store stopped answering.
        """
        cfg, s = self._cfg, self._store
        assert cfg.max_nnodes is not None
        while True:
            a = f"{self._p}a{attempt}/"
            await self._op("the join", s.add(f"{self._p}hb/{self._token}", 1))
            mine = f"{self._token} {cfg.nproc_per_node}"
            arrival = await self._op("the join", s.add(f"{a}arrived", 1)) - 1
            await self._op("the join", s.set(f"{a}claim/{arrival}", mine))
            if hosting:
                await self._close(attempt, arrival)
            while not await self._op("the join", s.check([f"{a}members"])):
                if await self._op("the join", s.check([f"{self._p}end"])):
                    return None
                if cfg.restart_policy == "failed":
                    took = f"{a}took/{arrival}"
                    if await self._op("the join", s.check([took])):
                        running, node = map(int, (await self._op("the join", s.get(took))).split())
                        return await self._taken_in(running, node)
                await asyncio.sleep(cfg.monitor_interval)
            members = [int(i) for i in (await self._op("the join", s.get(f"{a}members"))).split()]
            if arrival in members:
                keys = [f"{a}claim/{i}" for i in members]
                claims = [v.decode().split() for v in await self._op("the join", s.multi_get(keys))]
                return self._place(attempt, claims, members.index(arrival))
            logger.info("attempt %d started without this node: waiting for the next", attempt)
            attempt += 1

    async def _taken_in(self, attempt: int, node: int) -> Round:
        """This node's :class:`Round` as node ``node``, taken into ``attempt`` as it runs."""
        self._me, self._sizes, self.left, self._lost_seen = node, [], set(), 0
        self._beats = {}
        await self.follow(attempt)
        live, sizes = self.live, self._sizes
        base = sum(sizes[n] for n in live if n < node)
        return Round(attempt, node, len(live), base, sum(sizes[n] for n in live), joined=True)

    async def _close(self, attempt: int, mine: int) -> None:
        """The store's node: decide who takes part in ``attempt`` (see :meth:`join_round`)."""
        cfg, s = self._cfg, self._store
        assert cfg.max_nnodes is not None
        key = f"{self._p}a{attempt}/arrived"
        deadline = time.monotonic() + cfg.join_timeout
        enough_since: float | None = None
        while True:
            arrived = int(await self._op("the join", s.add(key, 0)))
            now = time.monotonic()
            if arrived >= cfg.nnodes and enough_since is None:
                enough_since = now
            if arrived >= cfg.max_nnodes or (
                enough_since is not None and now - enough_since >= cfg.last_call_timeout
            ):
                break
            if enough_since is None and now > deadline:
                raise DistTimeoutError(
                    f"only {arrived} of at least {cfg.nnodes} nodes joined run {cfg.run_id!r} "
                    f"at {cfg.master_addr}:{cfg.master_port} within {cfg.join_timeout:g} s"
                )
            await asyncio.sleep(cfg.monitor_interval)
        a = f"{self._p}a{attempt}/"
        # (An arrival that an attempt took in as it ran is no longer waiting here.)
        waiting = [i for i in range(arrived) if i != mine]
        taken = [await self._op("the join", s.check([f"{a}took/{i}"])) for i in waiting]
        others = [i for i, took in zip(waiting, taken, strict=True) if not took]
        members = [mine, *others[: cfg.max_nnodes - 1]]
        await self.release(attempt)
        claims = await self._op("the join", s.multi_get([f"{a}claim/{i}" for i in members]))
        keys = [f"{a}node/{n}" for n in range(len(members))]
        await self._op("the start", s.multi_set([*keys, f"{a}nodes"], [*claims, str(len(members))]))
        await self._op("the start", s.set(f"{a}members", " ".join(map(str, members))))

    async def take_in(self, attempt: int, arrival: int) -> int:
        """The store's node, with ``--restart-policy=failed``: take the node that arrived
        ``arrival``-th for the next attempt into ``attempt``, which goes on; return its node
        rank (every node watches its heartbeats from its next :meth:`follow`).

        Raises:
            NodeLostError: the store stopped answering.
        """
        s = self._store
        a, later = f"{self._p}a{attempt}/", f"{self._p}a{attempt + 1}/"
        claim = await self._op("the join", s.get(f"{later}claim/{arrival}"))
        node = int(await self._op("the join", s.add(f"{a}nodes", 1))) - 1
        await self._op("the join", s.set(f"{a}node/{node}", claim))
        await self._op("the join", s.set(f"{later}took/{arrival}", f"{attempt} {node}"))
        return node

    async def follow(self, attempt: int) -> list[int]:
        """With ``--restart-policy=failed`` and MIN:MAX nodes: take up the nodes taken into
        ``attempt`` since the last call (their heartbeats are watched from now on) and those
        left behind (no longer watched); return the node ranks newly left behind.

        Raises:
            NodeLostError: the store stopped answering.
        """
        s, a = self._store, f"{self._p}a{attempt}/"
        nodes = int(await self._op("the roster", s.add(f"{a}nodes", 0)))
        if nodes > len(self._sizes):
            keys = [f"{a}node/{n}" for n in range(len(self._sizes), nodes)]
            claims = await self._op("the roster", s.multi_get(keys))
            self._add_nodes([c.decode().split() for c in claims])
        lost = int(await self._op("the roster", s.add(f"{a}lost", 0)))
        if lost == self._lost_seen:
            return []
        self._lost_seen = lost
        left = [n for n in self.live if await self._op("the roster", s.check([f"{a}lost/{n}"]))]
        self.left.update(left)
        self._beats = {t: beat for t, beat in self._beats.items() if beat[0] not in self.left}
        return left

    async def leave_behind(self, attempt: int, node: int, why: str) -> None:
        """Record that ``attempt`` goes on without ``node`` (lost: ``why``); every node
        takes it up at its next :meth:`follow`.

        Raises:
            NodeLostError: the store stopped answering.
        """
        s, a = self._store, f"{self._p}a{attempt}/"
        if await self._op("the roster", s.compare_set(f"{a}lost/{node}", b"", why)) == why.encode():
            await self._op("the roster", s.add(f"{a}lost", 1))

    async def mark(self, attempt: int, name: str) -> None:
        """Record ``a<attempt>/<name>/<this node>`` (its workers are done, it saw the end)."""
        await self._op(name, self._store.set(f"{self._p}a{attempt}/{name}/{self._me}", b"1"))

    async def marked(self, attempt: int, name: str, nodes: list[int]) -> bool:
        """Whether every node of ``nodes`` recorded ``name`` (see :meth:`mark`)."""
        keys = [f"{self._p}a{attempt}/{name}/{n}" for n in nodes]
        return not keys or bool(await self._op(name, self._store.check(keys)))

    async def end(self, status: int) -> None:
        """The store's node, with MIN:MAX nodes: the job ended with exit ``status``; nodes
        still waiting to join stop waiting."""
        with contextlib.suppress(NodeLostError):
            await self._op("the end", self._store.set(f"{self._p}end", str(status)))

    async def waiting(self, attempt: int) -> bool:
        """Whether a node came for the attempt after ``attempt`` (it waits to join)."""
        key = f"{self._p}a{attempt + 1}/arrived"
        return int(await self._op("a check for waiting nodes", self._store.add(key, 0))) > 0

    async def beat(self) -> None:
        """Send this node's heartbeat and check everyone else's.

        Raises:
            NodeLostError: a node's heartbeat did not move for the lost-node timeout.
        """
        cfg, s = self._cfg, self._store
        await self._op("a heartbeat", s.add(f"{self._p}hb/{self._token}", 1))
        others = sorted(self._beats)
        values = await self._op("a heartbeat", s.multi_get([f"{self._p}hb/{t}" for t in others]))
        now = time.monotonic()
        for token, raw in zip(others, values, strict=True):
            node, count, since = self._beats[token]
            if int(raw) != count:
                self._beats[token] = (node, int(raw), now)
            elif now - since > cfg.lost_after:
                raise NodeLostError(
                    f"node {node} stopped sending heartbeats {now - since:.1f} s ago: its "
                    "launcher died or the network to it failed",
                    node,
                )

    async def count(self, attempt: int, name: str) -> int:
        """Read the counter ``a<attempt>/<name>``."""
        return int(await self._op(name, self._store.add(f"{self._p}a{attempt}/{name}", 0)))

    async def increment(self, attempt: int, name: str) -> None:
        """Add one to the counter ``a<attempt>/<name>``."""
        await self._op(name, self._store.add(f"{self._p}a{attempt}/{name}", 1))

    async def publish_failure(self, attempt: int, failure: WorkerFailure) -> WorkerFailure:
        """Record ``failure`` unless another was first; return the one recorded."""
        mine = failure.to_json().encode()
        got = await self._op(
            "the failure report",
            self._store.compare_set(f"{self._p}a{attempt}/failure", b"", mine),
        )
        return WorkerFailure.from_json(got)

    async def failure(self, attempt: int) -> WorkerFailure | None:
        """The failure recorded for ``attempt``, if any."""
        key = f"{self._p}a{attempt}/failure"
        if not await self._op("the failure check", self._store.check([key])):
            return None
        return WorkerFailure.from_json(await self._op("the failure check", self._store.get(key)))

    async def released(self, attempt: int) -> bool:
        """Whether node 0 let ``attempt`` start."""
        return bool(await self._op("the start", self._store.check([f"{self._p}a{attempt}/go"])))

    async def release(self, attempt: int) -> None:
        """Node 0: let ``attempt`` start, after emptying the store of the workers' keys.

        The workers of the previous attempt are all dead by now (every node reported them
        stopped), so nothing writes worker keys while they are deleted. Emptying the store
        protects torch workers too, whose keys (``/default_pg/...``) cannot be namespaced.
        """
        if attempt > 0:
            stale = [
                k
                for k in await self._op("the cleanup", self._store.list_keys())
                if not k.startswith(LAUNCHER_PREFIX)
            ]
            for key in stale:
                await self._op("the cleanup", self._store.delete_key(key))
            logger.debug("deleted %d keys of attempt %d", len(stale), attempt - 1)
        await self._op("the start", self._store.set(f"{self._p}a{attempt}/go", b"1"))


# -- hosting and joining the store ----------------------------------------------------------
async def open_store(cfg: LaunchConfig, auth_token: bytes | None) -> Store:
    """Node 0 hosts the store (its server also serves the workers); others connect to it.
    With ``--rdzv-backend=etcd`` every node is a client of the etcd store.

    With ``auth_token``, a TCPStore requires it; torch clients, which cannot prove it, are let
    in from the job's hosts only (torch workers need the store).

    Raises:
        DistNetworkError: node 0 cannot listen on the address (e.g. the port is in use), or
            node 0's store (or etcd) could not be reached within the join timeout.
    """
    if cfg.etcd_endpoints:
        return await EtcdStore.create(cfg.etcd_endpoints, cfg.etcd_prefix, cfg.join_timeout)
    if cfg.elastic and _is_local(cfg.master_addr):
        # With MIN:MAX nodes, whichever launcher can listen on the address hosts the store
        # (as torchrun's c10d rendezvous does); the others find the port taken and connect.
        with contextlib.suppress(DistNetworkError):
            return await TCPStore.create(
                cfg.master_addr,
                cfg.master_port,
                is_master=True,
                timeout=cfg.join_timeout,
                auth_token=auth_token,
                allow_unauthenticated_torch="job_hosts",
            )
    return await TCPStore.create(
        cfg.master_addr,
        cfg.master_port,
        is_master=cfg.node_rank == 0 and not cfg.elastic,
        timeout=cfg.join_timeout,
        auth_token=auth_token,
        allow_unauthenticated_torch="job_hosts",
    )


def _is_local(host: str) -> bool:
    """Whether ``host`` is an address of this machine (one a socket here can bind)."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_DGRAM)
        family, _type, _proto, _canon, addr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind(addr)
        return True
    except OSError:
        return False


def route_to(host: str, port: int) -> str | None:
    """The local address this machine uses to reach ``host`` (no packet is sent).

    With several nodes, the workers' transport must listen on and publish an address the
    other nodes can reach; the one that reaches node 0 is the best guess without asking,
    and it avoids relying on the host name resolving to the right interface.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        family, _type, _proto, _canon, addr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(addr)
            return str(probe.getsockname()[0])
    except OSError as exc:
        logger.warning("cannot tell which local address reaches %s: %s", host, exc)
        return None
