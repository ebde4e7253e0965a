"""``aiodist-run``: a torchrun-compatible launcher that hosts the store and supervises workers.

Usage is torchrun's: ``aiodist-run --nproc-per-node=4 train.py --lr 0.1``. The launcher of node 0
hosts an aiodist TCPStore server (which also speaks torch's TCPStore protocol) at
``MASTER_ADDR:MASTER_PORT``; every worker gets torchrun's environment
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ..., ``TORCHELASTIC_USE_AGENT_STORE=True``), so
``init_process_group("env://")`` works in aiodist workers and in unmodified torch workers.

Supervision runs on the launcher's own event loop: worker output is prefixed with the rank,
and the first failing worker stops the whole world at once. ``--max-restarts`` restarts, with
``--restart-policy=all`` (torchrun's behaviour), every node's group with the store emptied of
the failed attempt's keys; with ``--restart-policy=failed`` only the failed worker, while the
others and the store keep running (the survivors rebuild their process group in-process).
A signal the launcher handles is forwarded once to every worker's process group; workers
still running ``--shutdown-grace`` seconds later are killed, and the launcher says how each
one ended.

Several nodes (``--nnodes=N --node-rank=K --master-addr=HOST``) agree on ranks through the
store and watch each other with heartbeats there; see ``docs/architecture.md`` ("Launcher").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ._cluster import launcher_default
from ._loop import loop_factory
from ._workers import Std, WorkerFailure, WorkerGroup, WorkerSpec, describe_exit
from .errors import DistError, DistNetworkError, DistTimeoutError, DistUsageError
from .store import Store
from .store.tcp import TCPStore

logger = logging.getLogger(__name__)

__all__ = ["LaunchConfig", "NodeLostError", "get_args_parser", "main", "parse_args"]

#: Keys of the launchers themselves live under this prefix; everything else in the store
#: belongs to the workers and is deleted between attempts.
LAUNCHER_PREFIX = "aiodist-run/"
_DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
_TRUE = ("1", "true", "yes", "on")


# -- command line -------------------------------------------------------------------------
class _EnvDefault(argparse.Action):
    """An option whose default may come from ``PET_<DEST>`` as in torchrun, or the cluster.

    The node rank also comes from a Kubernetes Indexed Job's ``JOB_COMPLETION_INDEX``, or
    an elastic PyTorchJob's pod name (:func:`aiodist._cluster.launcher_default`).
    """

    def __init__(self, option_strings: list[str], dest: str, default: Any = None, **kw: Any):
        env = launcher_default(dest)
        super().__init__(option_strings, dest, default=env if env is not None else default, **kw)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)


class _EnvFlag(argparse.Action):
    """A boolean switch that ``PET_<DEST>=1`` also turns on."""

    def __init__(self, option_strings: list[str], dest: str, **kw: Any):
        env = os.environ.get(f"PET_{dest.upper()}", "")
        kw.pop("default", None)
        super().__init__(option_strings, dest, nargs=0, default=env.lower() in _TRUE, **kw)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, True)


def _flag(name: str) -> list[str]:
    """Both spellings of a long option: ``--nproc-per-node`` and ``--nproc_per_node``."""
    under = "--" + name[2:].replace("-", "_")
    return [name] if under == name else [name, under]


def get_args_parser() -> argparse.ArgumentParser:
    """Return the parser for ``aiodist-run``: torchrun's flags, names and defaults.

    Every option also reads its default from the environment variable ``PET_<DEST>``
    (``PET_NPROC_PER_NODE=4``), as torchrun's do.
    """
    p = argparse.ArgumentParser(
        prog="aiodist-run",
        description="Start and supervise the worker processes of an aiodist (or torch) job, "
        "with torchrun's command line.",
    )
    add = p.add_argument
    add(
        *_flag("--nnodes"),
        action=_EnvDefault,
        default="1:1",
        help="number of nodes, N or MIN:MAX with MIN == MAX (default 1:1)",
    )
    add(
        *_flag("--nproc-per-node"),
        action=_EnvDefault,
        default="1",
        help="workers per node: an integer, or auto/cpu for one per CPU (default 1)",
    )
    add(
        *_flag("--node-rank"),
        action=_EnvDefault,
        type=int,
        default=0,
        help="rank of this node, 0 <= K < nnodes; node 0 hosts the store (default "
        "PET_NODE_RANK, else a Kubernetes Indexed Job's JOB_COMPLETION_INDEX, else 0)",
    )
    add(
        *_flag("--master-addr"),
        action=_EnvDefault,
        default="127.0.0.1",
        help="address of node 0: node 0's store binds it, the others connect to it",
    )
    add(
        *_flag("--master-port"),
        action=_EnvDefault,
        type=int,
        default=None,
        help="port of node 0's store (default: a free port on one node, 29500 on several)",
    )
    add(
        *_flag("--local-addr"),
        action=_EnvDefault,
        default=None,
        help="this node's address, exported to the workers as AIODIST_HOST (the address "
        "their transport listens on and publishes); default with several nodes: the "
        "address this node uses to reach node 0",
    )
    add(
        *_flag("--rdzv-backend"),
        action=_EnvDefault,
        default="static",
        choices=["static", "c10d"],
        help="accepted for torchrun compatibility: both use node 0's store",
    )
    add(
        *_flag("--rdzv-endpoint"),
        action=_EnvDefault,
        default="",
        help="HOST[:PORT] of node 0's store; overrides --master-addr/--master-port",
    )
    add(
        *_flag("--rdzv-id"),
        action=_EnvDefault,
        default="none",
        help="job id, exported as TORCHELASTIC_RUN_ID and AIODIST_RUN_ID",
    )
    add(
        *_flag("--rdzv-conf"),
        action=_EnvDefault,
        default="",
        help="k=v,... with join_timeout (s, default 600), keep_alive_interval (s, 5) and "
        "keep_alive_max_attempt (3): a node silent for interval*attempts is lost",
    )
    add(
        "--standalone",
        action=_EnvFlag,
        help="single node; the store takes a free port on 127.0.0.1",
    )
    add(
        *_flag("--max-restarts"),
        action=_EnvDefault,
        type=int,
        default=0,
        help="restarts allowed after a failure (default 0): of the whole worker group "
        "(--restart-policy=all), or of each rank on its own (--restart-policy=failed)",
    )
    add(
        *_flag("--restart-policy"),
        action=_EnvDefault,
        default="all",
        choices=["all", "failed"],
        help="all: a failure stops every worker and restarts the group, as torchrun does; "
        "failed: only the failed worker is restarted (same rank, same store), the others "
        "keep running and must rebuild their process group themselves (default all)",
    )
    add(
        *_flag("--monitor-interval"),
        action=_EnvDefault,
        type=float,
        default=0.1,
        help="seconds between checks of the other nodes (default 0.1)",
    )
    add(
        *_flag("--start-method"),
        action=_EnvDefault,
        default="spawn",
        choices=["spawn", "fork", "forkserver"],
        help="accepted for torchrun compatibility: a script always runs as a new process",
    )
    add("--role", action=_EnvDefault, default="default", help="exported as ROLE_NAME")
    add("-m", "--module", action=_EnvFlag, help="run the script as a module, like python -m")
    add(
        *_flag("--no-python"),
        action=_EnvFlag,
        help="run the script as an executable, without python",
    )
    add(
        *_flag("--log-dir"),
        action=_EnvDefault,
        default=None,
        help="base directory of the per-rank logs: LOG_DIR/RUN_ID/attempt_K/RANK/",
    )
    add(
        "-r",
        "--redirects",
        action=_EnvDefault,
        default="0",
        help="send output to the log files only: 0 none, 1 stdout, 2 stderr, 3 both, "
        "or per local rank as 0:1,1:2",
    )
    add(
        "-t",
        "--tee",
        action=_EnvDefault,
        default="0",
        help="send output to the log files and the console (same values as --redirects)",
    )
    add(
        *_flag("--local-ranks-filter"),
        action=_EnvDefault,
        default="",
        help="show only these local ranks on the console, e.g. 0,3",
    )
    add(
        *_flag("--signals-to-handle"),
        action=_EnvDefault,
        default=_DEFAULT_SIGNALS,
        help="signals forwarded to the workers (default SIGTERM,SIGINT,SIGHUP,SIGQUIT)",
    )
    add(
        *_flag("--shutdown-grace"),
        *_flag("--shutdown-timeout"),
        dest="shutdown_timeout",
        action=_EnvDefault,
        type=float,
        default=float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")),
        help="seconds a worker has to exit after SIGTERM (or the signal the launcher "
        "received) before it gets SIGKILL (default TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30); "
        "--shutdown-timeout is torchrun's name",
    )
    add("training_script", help="the script (or module, or executable) every worker runs")
    add("training_script_args", nargs=argparse.REMAINDER, help="its arguments")
    return p


@dataclass(frozen=True)
class LaunchConfig:
    """A validated ``aiodist-run`` command line.

    Attributes:
        nnodes: number of nodes.
        nproc_per_node: workers on this node.
        node_rank: this node's rank.
        master_addr: node 0's address.
        master_port: node 0's store port; 0 picks a free one (single node only).
        local_addr: this node's address for the workers' transport, if given.
        run_id: the job id.
        max_restarts: restarts allowed after a failure: of the group (policy ``all``) or
            of each rank (policy ``failed``).
        restart_policy: ``"all"`` restarts every worker, ``"failed"`` only the failed one.
        monitor_interval: seconds between checks of the other nodes.
        join_timeout: seconds to wait for every node to join.
        lost_after: seconds of silence after which a node counts as lost.
        role: the role name.
        cmd: the command every worker runs.
        log_dir: base directory for logs (``None``: a temporary directory).
        redirects: per local rank, streams sent to the log files only.
        tees: per local rank, streams sent to the log files and the console.
        local_ranks_filter: local ranks shown on the console (``None``: all).
        signals: signals forwarded to the workers.
        shutdown_timeout: the grace period between the stop signal and SIGKILL.
    """

    nnodes: int
    nproc_per_node: int
    node_rank: int
    master_addr: str
    master_port: int
    local_addr: str | None
    run_id: str
    max_restarts: int
    restart_policy: str
    monitor_interval: float
    join_timeout: float
    lost_after: float
    role: str
    cmd: tuple[str, ...]
    log_dir: Path | None
    redirects: tuple[Std, ...]
    tees: tuple[Std, ...]
    local_ranks_filter: frozenset[int] | None
    signals: tuple[signal.Signals, ...]
    shutdown_timeout: float


def _parse_std(text: str, what: str, nproc: int) -> tuple[Std, ...]:
    """Parse ``3`` or ``0:1,1:2`` into one :class:`Std` per local rank."""
    text = text.strip()

    def std(value: str) -> Std:
        if value.strip() not in ("0", "1", "2", "3"):
            raise ValueError(value)
        return Std(int(value))

    try:
        if ":" not in text:
            return (std(text),) * nproc
        per_rank = [Std.NONE] * nproc
        for item in text.split(","):
            rank, value = item.split(":")
            if not 0 <= int(rank) < nproc:
                raise DistUsageError(
                    f"--{what}={text!r} names local rank {int(rank)}, but there are only "
                    f"{nproc} workers per node"
                )
            per_rank[int(rank)] = std(value)
        return tuple(per_rank)
    except ValueError as exc:
        if isinstance(exc, DistUsageError):
            raise
        raise DistUsageError(
            f"--{what}={text!r} is not valid: expected 0 (none), 1 (stdout), 2 (stderr), "
            "3 (both), or per local rank like 0:1,1:2"
        ) from None


def _parse_nnodes(text: str) -> int:
    parts = text.split(":")
    try:
        sizes = [int(p) for p in parts]
    except ValueError:
        raise DistUsageError(f"--nnodes={text!r} is not valid: expected N or MIN:MAX") from None
    if len(sizes) > 2 or min(sizes) < 1:
        raise DistUsageError(f"--nnodes={text!r} is not valid: expected N >= 1 or MIN:MAX")
    if len(sizes) == 2 and sizes[0] != sizes[1]:
        raise DistUsageError(
            f"--nnodes={text!r}: elastic node counts are not supported, give a fixed count "
            "(N or N:N)"
        )
    return sizes[0]


def _parse_nproc(text: str) -> int:
    if text in ("auto", "cpu"):
        return os.cpu_count() or 1
    try:
        nproc = int(text)
    except ValueError:
        raise DistUsageError(
            f"--nproc-per-node={text!r} is not valid: expected a positive integer, auto or cpu"
        ) from None
    if nproc < 1:
        raise DistUsageError(f"--nproc-per-node={text!r} is not valid: expected at least 1")
    return nproc


def _parse_endpoint(text: str, default_port: int) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or "]" in port:
        host, port = text, ""
    host = host.strip("[]")
    if not host:
        raise DistUsageError(f"--rdzv-endpoint={text!r} is not valid: expected HOST[:PORT]")
    try:
        return host, int(port) if port else default_port
    except ValueError:
        raise DistUsageError(f"--rdzv-endpoint={text!r} has an invalid port {port!r}") from None


def _parse_rdzv_conf(text: str) -> dict[str, float]:
    known = {
        "join_timeout": 600.0,
        "timeout": 600.0,
        "keep_alive_interval": 5.0,
        "keep_alive_max_attempt": 3.0,
    }
    conf: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in known:
            raise DistUsageError(
                f"--rdzv-conf item {item!r} is not valid: expected k=v with k one of "
                f"{', '.join(sorted(known))}"
            )
        try:
            conf[key] = float(value)
        except ValueError:
            raise DistUsageError(f"--rdzv-conf {key}={value!r} is not a number") from None
        if conf[key] <= 0:
            raise DistUsageError(f"--rdzv-conf {key}={value!r} must be positive")
    conf.setdefault("join_timeout", conf.get("timeout", known["join_timeout"]))
    for key in ("keep_alive_interval", "keep_alive_max_attempt"):
        conf.setdefault(key, known[key])
    return conf


def _parse_signals(text: str) -> tuple[signal.Signals, ...]:
    result = []
    for name in filter(None, (s.strip() for s in text.split(","))):
        try:
            result.append(signal.Signals[name if name.startswith("SIG") else "SIG" + name])
        except KeyError:
            raise DistUsageError(f"--signals-to-handle names an unknown signal {name!r}") from None
        if result[-1] in (signal.SIGKILL, signal.SIGSTOP):
            raise DistUsageError(f"--signals-to-handle: {name} cannot be caught")
    return tuple(result)


def parse_args(argv: Sequence[str] | None = None) -> LaunchConfig:
    """Parse and validate an ``aiodist-run`` command line.

    Raises:
        DistUsageError: a flag has an invalid value or flags contradict each other.
        SystemExit: argparse rejected the command line (unknown flag, missing script).
    """
    ns = get_args_parser().parse_args(argv)
    nnodes = _parse_nnodes(str(ns.nnodes))
    nproc = _parse_nproc(str(ns.nproc_per_node))
    conf = _parse_rdzv_conf(str(ns.rdzv_conf))
    node_rank = int(ns.node_rank)
    if not 0 <= node_rank < nnodes:
        raise DistUsageError(f"--node-rank={node_rank} is not valid with --nnodes={nnodes}")
    master_addr, master_port = str(ns.master_addr), ns.master_port
    run_id = str(ns.rdzv_id)
    if ns.standalone:
        if nnodes != 1:
            raise DistUsageError(f"--standalone runs one node, but --nnodes={nnodes}")
        master_addr, master_port, run_id = "127.0.0.1", 0, uuid.uuid4().hex[:12]
    elif ns.rdzv_endpoint:
        master_addr, master_port = _parse_endpoint(str(ns.rdzv_endpoint), 29400)
    elif master_port is None:
        # torchrun does the same switch: one node and no port asked for means any free port.
        master_port = 0 if nnodes == 1 else 29500
    master_port = int(master_port)
    if not 0 <= master_port < 65536 or (master_port == 0 and nnodes > 1):
        raise DistUsageError(
            f"--master-port={master_port} is not valid"
            + (": several nodes need a fixed port" if master_port == 0 else "")
        )
    if int(ns.max_restarts) < 0:
        raise DistUsageError(f"--max-restarts={ns.max_restarts} must not be negative")
    if ns.restart_policy not in ("all", "failed"):
        raise DistUsageError(
            f"--restart-policy={ns.restart_policy!r} is not valid: expected all or failed"
        )
    if float(ns.monitor_interval) <= 0:
        raise DistUsageError(f"--monitor-interval={ns.monitor_interval} must be positive")
    if float(ns.shutdown_timeout) < 0:
        raise DistUsageError(f"--shutdown-grace={ns.shutdown_timeout} must not be negative")
    if ns.module and ns.no_python:
        raise DistUsageError("--module and --no-python cannot be used together")
    filt: frozenset[int] | None = None
    if str(ns.local_ranks_filter).strip():
        try:
            filt = frozenset(int(r) for r in str(ns.local_ranks_filter).split(","))
        except ValueError:
            raise DistUsageError(
                f"--local-ranks-filter={ns.local_ranks_filter!r} is not valid: expected "
                "comma-separated local ranks like 0,2"
            ) from None
        if not filt <= set(range(nproc)):
            raise DistUsageError(
                f"--local-ranks-filter={ns.local_ranks_filter!r} names ranks outside 0..{nproc - 1}"
            )
    if ns.no_python:
        cmd = [ns.training_script]
    elif ns.module:
        cmd = [sys.executable, "-u", "-m", ns.training_script]
    else:
        cmd = [sys.executable, "-u", ns.training_script]
    return LaunchConfig(
        nnodes=nnodes,
        nproc_per_node=nproc,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=str(ns.local_addr) if ns.local_addr else None,
        run_id=run_id,
        max_restarts=int(ns.max_restarts),
        restart_policy=str(ns.restart_policy),
        monitor_interval=float(ns.monitor_interval),
        join_timeout=conf["join_timeout"],
        lost_after=conf["keep_alive_interval"] * conf["keep_alive_max_attempt"],
        role=str(ns.role),
        cmd=(*cmd, *ns.training_script_args),
        log_dir=Path(ns.log_dir) if ns.log_dir else None,
        redirects=_parse_std(str(ns.redirects), "redirects", nproc),
        tees=_parse_std(str(ns.tee), "tee", nproc),
        local_ranks_filter=filt,
        signals=_parse_signals(str(ns.signals_to_handle)),
        shutdown_timeout=float(ns.shutdown_timeout),
    )


# -- the store and the agreement between nodes ------------------------------------------------
class NodeLostError(DistNetworkError):
    """Another node's launcher, or node 0's store, stopped answering."""


class _Coordinator:
    """What the launchers of a job agree on through node 0's store.

    Keys (under ``aiodist-run/<run_id>/``): ``hb/<node>`` heartbeat counters; ``node/<node>``
    a node's claim (token and worker count); ``a<k>/go`` attempt ``k`` may start (set by
    node 0); ``a<k>/failure`` the first failure of attempt ``k`` (compare-and-set, so every node
    reports the same one); ``a<k>/done``, ``a<k>/stopped``, ``a<k>/acks`` counters.
    Every request is bounded by the lost-node timeout, so a vanished store is an error, not a
    hang; the supervisor is the only task using the store, so requests never overlap.
    """

    def __init__(self, store: Store, cfg: LaunchConfig) -> None:
        self._store = store
        self._cfg = cfg
        self._p = f"{LAUNCHER_PREFIX}{cfg.run_id}/"
        self._token = uuid.uuid4().hex
        self._beats: dict[int, tuple[int, float]] = {}

    def __repr__(self) -> str:
        return f"<Coordinator node={self._cfg.node_rank}/{self._cfg.nnodes} run={self._cfg.run_id}>"

    async def _op(self, what: str, coro: Any) -> Any:
        try:
            async with asyncio.timeout(self._cfg.lost_after):
                return await coro
        except TimeoutError:
            raise NodeLostError(
                f"the store at {self._cfg.master_addr}:{self._cfg.master_port} (node 0) did "
                f"not answer {what} within {self._cfg.lost_after:g} s"
            ) from None
        except (DistError, OSError) as exc:
            if isinstance(exc, DistUsageError):
                raise
            raise NodeLostError(
                f"lost the store at {self._cfg.master_addr}:{self._cfg.master_port} (node 0) "
                f"during {what}: {exc}"
            ) from exc

    async def join(self) -> tuple[int, int]:
        """Register this node; return (its first global rank, the world size).

        Raises:
            DistUsageError: another launcher already joined with this node rank.
            DistTimeoutError: not every node joined within the join timeout.
            NodeLostError: the store stopped answering.
        """
        cfg, s = self._cfg, self._store
        await self._op("the heartbeat", s.add(f"{self._p}hb/{cfg.node_rank}", 1))
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
        sizes = [int(v.split()[1]) for v in await self._op("the join", s.multi_get(keys))]
        now = time.monotonic()
        self._beats = {i: (0, now) for i in range(cfg.nnodes) if i != cfg.node_rank}
        return sum(sizes[: cfg.node_rank]), sum(sizes)

    async def beat(self) -> None:
        """Send this node's heartbeat and check everyone else's.

        Raises:
            NodeLostError: a node's heartbeat did not move for the lost-node timeout.
        """
        cfg, s = self._cfg, self._store
        await self._op("a heartbeat", s.add(f"{self._p}hb/{cfg.node_rank}", 1))
        others = sorted(self._beats)
        values = await self._op("a heartbeat", s.multi_get([f"{self._p}hb/{i}" for i in others]))
        now = time.monotonic()
        for node, raw in zip(others, values, strict=True):
            count, since = self._beats[node]
            if int(raw) != count:
                self._beats[node] = (int(raw), now)
            elif now - since > cfg.lost_after:
                raise NodeLostError(
                    f"node {node} stopped sending heartbeats {now - since:.1f} s ago: its "
                    "launcher died or the network to it failed"
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


# -- supervision ----------------------------------------------------------------------------
@dataclass
class _Outcome:
    """How one attempt ended on this node."""

    failure: WorkerFailure | None = None
    signum: int | None = None


class _Launcher:
    """One ``aiodist-run`` process: hosts or joins the store, then runs the attempts."""

    def __init__(self, cfg: LaunchConfig, stdout: BinaryIO, stderr: BinaryIO) -> None:
        self._cfg = cfg
        self._stdout = stdout
        self._stderr = stderr
        self._group: WorkerGroup | None = None
        self._signal: int | None = None
        self._interrupted = asyncio.Event()
        self._main: asyncio.Task[int] | None = None
        self._port = cfg.master_port
        self._local_addr: str | None = None
        self._rank_base = 0
        self._world_size = cfg.nproc_per_node * cfg.nnodes
        #: With ``--restart-policy=failed``: how many times each local rank was restarted.
        self._restarts = [0] * cfg.nproc_per_node
        self._log_base: Path = cfg.log_dir or Path(tempfile.mkdtemp(prefix="aiodist-run-"))
        self._keep_logs = cfg.log_dir is not None or any(cfg.redirects + cfg.tees)

    def __repr__(self) -> str:
        cfg = self._cfg
        return (
            f"<Launcher node={cfg.node_rank}/{cfg.nnodes} nproc={cfg.nproc_per_node} "
            f"store={cfg.master_addr}:{self._port} signal={self._signal}>"
        )

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self._signal is not None and self._group is not None:
            # A second signal: stop waiting politely.
            self._group.kill(
                f"was still running when the launcher received a second signal ({name})"
            )
            return
        logger.info(
            "received %s: stopping the workers (%g s grace period)",
            name,
            self._cfg.shutdown_timeout,
        )
        self._signal = signum
        self._interrupted.set()
        if self._group is not None:
            # Forwarded now, once; the supervision loop sees the flag, tells the other nodes,
            # waits out the grace period and reports how each worker ended.
            self._group.begin_stop(signum)
        elif self._main is not None:
            # No workers are running (joining, waiting for other nodes): just stop.
            self._main.cancel()

    async def run(self) -> int:
        """Run the job; return the launcher's exit status."""
        cfg = self._cfg
        loop = asyncio.get_running_loop()
        for sig in cfg.signals:
            loop.add_signal_handler(sig, self._on_signal, sig)
        self._main = asyncio.current_task()
        try:
            return await self._run()
        except asyncio.CancelledError:
            if self._signal is None or self._main is None:
                raise
            self._main.uncancel()
            return 128 + self._signal
        finally:
            for sig in cfg.signals:
                loop.remove_signal_handler(sig)
            if not self._keep_logs:
                shutil.rmtree(self._log_base, ignore_errors=True)

    async def _run(self) -> int:
        cfg = self._cfg
        store = await _open_store(cfg)
        self._port = store.port
        if cfg.nnodes > 1:
            self._local_addr = _route_to(cfg.master_addr, self._port)
        try:
            coord = _Coordinator(store, cfg)
            if cfg.nnodes > 1:
                logger.info(
                    "node %d of %d: %s the store at %s:%d",
                    cfg.node_rank,
                    cfg.nnodes,
                    "hosting" if store.server is not None else "joining",
                    cfg.master_addr,
                    self._port,
                )
            self._rank_base, self._world_size = await coord.join()
            return await self._attempts(coord)
        except NodeLostError as exc:
            logger.error("%s; the workers of node %d were stopped", exc, cfg.node_rank)
            return 1
        finally:
            if self._group is not None:
                await self._group.stop(cfg.shutdown_timeout)
            # Node 0 also stops its server here: every other node has seen the end by now.
            await store.aclose()

    async def _attempts(self, coord: _Coordinator) -> int:
        cfg = self._cfg
        for attempt in range(cfg.max_restarts + 1):
            await self._wait_release(coord, attempt)
            if self._signal is not None:
                return 128 + self._signal
            outcome = await self._run_attempt(coord, attempt)
            if outcome.failure is None and outcome.signum is None:
                await self._finish(coord, attempt)
                return 0
            failure = outcome.failure
            # A launcher stopped by a signal is gone for good: restarting cannot bring it back.
            # With --restart-policy=failed the attempt already used its restarts.
            restart = (
                cfg.restart_policy == "all"
                and failure is not None
                and failure.rank >= 0
                and attempt < cfg.max_restarts
            )
            # Node 0 starts the next attempt once every node (this one too) counted in here.
            with contextlib.suppress(NodeLostError):
                await coord.increment(attempt, "stopped")
                if not restart and cfg.node_rank == 0 and cfg.nnodes > 1:
                    await self._linger(coord, attempt)
            if outcome.signum is not None:
                return 128 + outcome.signum
            assert failure is not None
            if not restart:
                self._write_summary(failure, attempt)
                return 1
            logger.warning(
                "attempt %d failed: rank %d (node %d) exited with %s; restarting the "
                "workers (%d of %d restarts left)",
                attempt,
                failure.rank,
                failure.node_rank,
                describe_exit(failure.exitcode),
                cfg.max_restarts - attempt - 1,
                cfg.max_restarts,
            )
        return 1

    async def _linger(self, coord: _Coordinator, attempt: int) -> None:
        """Node 0 keeps the store up until every node has read the failure (or is lost)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._cfg.lost_after):
                while await coord.count(attempt, "stopped") < self._cfg.nnodes:
                    await asyncio.sleep(self._cfg.monitor_interval)

    async def _wait_release(self, coord: _Coordinator, attempt: int) -> None:
        """Node 0 starts ``attempt`` once every node stopped the previous one; others wait."""
        cfg = self._cfg
        if cfg.node_rank == 0:
            while attempt > 0 and await coord.count(attempt - 1, "stopped") < cfg.nnodes:
                await self._tick(coord)
            await coord.release(attempt)
            return
        while not await coord.released(attempt):
            await self._tick(coord)

    async def _tick(self, coord: _Coordinator) -> None:
        if self._cfg.nnodes > 1:
            await coord.beat()
        await asyncio.sleep(self._cfg.monitor_interval)

    def _spec(self, local: int, restarts: int) -> WorkerSpec:
        """The worker of local rank ``local`` after ``restarts`` restarts (of it or the group)."""
        cfg = self._cfg
        attempt_dir = self._log_base / cfg.run_id / f"attempt_{restarts}"
        rank = self._rank_base + local
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(local),
            WORLD_SIZE=str(self._world_size),
            LOCAL_WORLD_SIZE=str(cfg.nproc_per_node),
            GROUP_RANK=str(cfg.node_rank),
            GROUP_WORLD_SIZE=str(cfg.nnodes),
            ROLE_NAME=cfg.role,
            ROLE_RANK=str(rank),
            ROLE_WORLD_SIZE=str(self._world_size),
            MASTER_ADDR=cfg.master_addr,
            MASTER_PORT=str(self._port),
            TORCHELASTIC_USE_AGENT_STORE="True",
            TORCHELASTIC_RESTART_COUNT=str(restarts),
            TORCHELASTIC_MAX_RESTARTS=str(cfg.max_restarts),
            TORCHELASTIC_RUN_ID=cfg.run_id,
            TORCHELASTIC_ERROR_FILE=str(attempt_dir / str(rank) / "error.json"),
            AIODIST_RESTART_COUNT=str(restarts),
            AIODIST_RESTART_POLICY=cfg.restart_policy,
            AIODIST_RUN_ID=cfg.run_id,
            PYTHON_EXEC=sys.executable,
        )
        env.setdefault("OMP_NUM_THREADS", "1")
        if cfg.local_addr is not None:
            env["AIODIST_HOST"] = cfg.local_addr
        elif self._local_addr is not None:
            env.setdefault("AIODIST_HOST", self._local_addr)
        return WorkerSpec(
            rank=rank,
            local_rank=local,
            cmd=cfg.cmd,
            env=env,
            redirect=cfg.redirects[local],
            tee=cfg.tees[local],
            console=cfg.local_ranks_filter is None or local in cfg.local_ranks_filter,
            log_dir=attempt_dir / str(rank),
            error_file=attempt_dir / str(rank) / "error.json",
        )

    def _can_restart_alone(self, failure: WorkerFailure) -> bool:
        cfg = self._cfg
        return (
            cfg.restart_policy == "failed"
            and self._signal is None
            and self._restarts[failure.local_rank] < cfg.max_restarts
        )

    async def _restart_alone(self, group: WorkerGroup, failure: WorkerFailure) -> None:
        """Replace the failed worker; the others, and the store, keep running."""
        count = self._restarts[failure.local_rank] + 1
        self._restarts[failure.local_rank] = count
        logger.warning(
            "rank %d (pid %d) exited with %s; restarting it alone (its restart %d of %d), "
            "the other workers keep running",
            failure.rank,
            failure.pid,
            describe_exit(failure.exitcode),
            count,
            self._cfg.max_restarts,
        )
        await group.replace(self._spec(failure.local_rank, count))

    async def _run_attempt(self, coord: _Coordinator, attempt: int) -> _Outcome:
        cfg = self._cfg
        group = WorkerGroup(cfg.node_rank, self._stdout, self._stderr)
        self._group = group
        try:
            await group.start([self._spec(local, attempt) for local in range(cfg.nproc_per_node)])
            if self._keep_logs and attempt == 0 and any(cfg.redirects + cfg.tees):
                logger.info("worker logs: %s", self._log_base / cfg.run_id)
            while True:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(cfg.monitor_interval):
                        await _first(group.changed.wait(), self._interrupted.wait())
                group.changed.clear()
                if self._signal is not None:
                    # Tell the other nodes first: their workers would otherwise see this
                    # node's workers leave and fail, and report that as the root cause.
                    if cfg.nnodes > 1:
                        with contextlib.suppress(NodeLostError):
                            await coord.publish_failure(attempt, self._signal_failure())
                    await group.stop(cfg.shutdown_timeout, self._signal)
                    for level, message in group.shutdown_report():
                        logger.log(level, "%s", message)
                    return _Outcome(signum=self._signal)
                failure = group.first_failure()
                while failure is not None and self._can_restart_alone(failure):
                    await self._restart_alone(group, failure)
                    failure = group.first_failure()
                if failure is not None:
                    failure.restarts = self._restarts[failure.local_rank]
                    await group.stop(cfg.shutdown_timeout)
                    if cfg.nnodes > 1:
                        try:
                            failure = await coord.publish_failure(attempt, failure)
                        except NodeLostError:
                            self._write_summary(failure, attempt)
                            raise
                    return _Outcome(failure=failure)
                if cfg.nnodes > 1:
                    await coord.beat()
                    remote = await coord.failure(attempt)
                    if remote is not None:
                        logger.info(
                            "rank %d on node %d failed: stopping the workers of this node",
                            remote.rank,
                            remote.node_rank,
                        )
                        await group.stop(cfg.shutdown_timeout)
                        return _Outcome(failure=remote)
                # A worker that failed during the store requests above is handled at the top
                # of the loop, not taken for the end of a successful run.
                if not group.running() and group.first_failure() is None:
                    break
        except BaseException:
            await group.stop(cfg.shutdown_timeout)
            raise
        finally:
            self._group = None
        # This node is done; the job is done once every node is.
        if cfg.nnodes > 1:
            await coord.increment(attempt, "done")
            while await coord.count(attempt, "done") < cfg.nnodes:
                remote = await coord.failure(attempt)
                if remote is not None:
                    return _Outcome(failure=remote)
                if self._interrupted.is_set():
                    return _Outcome(signum=self._signal)
                await self._tick(coord)
        return _Outcome()

    async def _finish(self, coord: _Coordinator, attempt: int) -> None:
        """Node 0 keeps the store up until every other node has seen the job finish."""
        cfg = self._cfg
        if cfg.nnodes == 1:
            return
        if cfg.node_rank != 0:
            await coord.increment(attempt, "acks")
            return
        with contextlib.suppress(NodeLostError):
            while await coord.count(attempt, "acks") < cfg.nnodes - 1:
                await self._tick(coord)

    def _signal_failure(self) -> WorkerFailure:
        assert self._signal is not None
        return WorkerFailure(
            rank=-1,
            local_rank=-1,
            node_rank=self._cfg.node_rank,
            pid=os.getpid(),
            exitcode=-self._signal,
            timestamp=time.time(),
            stderr_tail=[
                f"the launcher of node {self._cfg.node_rank} received "
                f"{signal.Signals(self._signal).name}"
            ],
        )

    def _write_summary(self, failure: WorkerFailure, attempt: int) -> None:
        self._stderr.write(self._summary(failure, attempt).encode())
        self._stderr.flush()

    def _summary(self, f: WorkerFailure, attempt: int) -> str:
        cfg = self._cfg
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(f.timestamp))
        if f.rank < 0:
            head = f"the launcher of node {f.node_rank} was stopped by {describe_exit(f.exitcode)}"
        else:
            head = (
                f"rank {f.rank} (local rank {f.local_rank} on node {f.node_rank}, pid {f.pid}) "
                f"failed first, with {describe_exit(f.exitcode)} at {when}"
            )
        if cfg.restart_policy == "failed" and f.rank >= 0:
            times = "once" if f.restarts == 1 else f"{f.restarts} times"
            restarts = (
                f"rank {f.rank} had been restarted {times} (--max-restarts={cfg.max_restarts}, "
                "--restart-policy=failed)"
            )
        else:
            restarts = (
                f"attempt {attempt + 1} of {cfg.max_restarts + 1} "
                f"(--max-restarts={cfg.max_restarts})"
            )
        lines = [
            "",
            "=" * 72,
            "aiodist-run: the job failed",
            f"  root cause: {head}",
            f"  {restarts}; the other workers were stopped",
        ]
        if f.finished:
            which = ", ".join(map(str, sorted(f.finished)))
            lines.append(
                f"  {'rank' if len(f.finished) == 1 else 'ranks'} {which} of node "
                f"{f.node_rank} had finished before (exit code 0): not a failure, even where "
                "the error names them"
            )
        if f.error:
            lines.append(f"  error: {f.error}")
        if f.error_traceback:
            lines.append("  traceback (from the worker's error file):")
            lines += ["    " + s for s in f.error_traceback.rstrip().splitlines()[-30:]]
        elif f.stderr_tail:
            lines.append(
                f"  last lines of rank {f.rank}'s stderr:" if f.rank >= 0 else "  details:"
            )
            lines += ["    " + s for s in f.stderr_tail]
        lines += ["=" * 72, ""]
        return "\n".join(lines)


async def _first(*aws: Any) -> None:
    """Wait until the first of ``aws`` completes; cancel the rest."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``aiodist-run`` and ``python -m aiodist.run``.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        0 when every worker succeeded; 1 when a worker failed (after the allowed restarts) or
        a node was lost; 2 for a bad command line; 128 + N when stopped by signal N.
    """
    logging.basicConfig(level=logging.INFO, format="[aiodist-run] %(levelname)s: %(message)s")
    try:
        cfg = parse_args(argv)
    except DistUsageError as exc:
        sys.stderr.write(f"aiodist-run: error: {exc}\n")
        return 2
    launcher = _Launcher(cfg, sys.stdout.buffer, sys.stderr.buffer)
    try:
        with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
            return runner.run(launcher.run())
    except DistUsageError as exc:
        logger.error("%s", exc)
        return 2
    except DistError as exc:
        logger.error("%s", exc)
        return 1
    except OSError as exc:
        logger.error("%s", exc)
        return 1


# -- hosting and joining the store ----------------------------------------------------------
async def _open_store(cfg: LaunchConfig) -> TCPStore:
    """Node 0 hosts the store (its server also serves the workers); others connect to it.

    Raises:
        DistNetworkError: node 0 cannot listen on the address (e.g. the port is in use), or
            node 0's store could not be reached within the join timeout.
    """
    return await TCPStore.create(
        cfg.master_addr, cfg.master_port, is_master=cfg.node_rank == 0, timeout=cfg.join_timeout
    )


def _route_to(host: str, port: int) -> str | None:
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
