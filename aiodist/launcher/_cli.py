"""The command line of ``aiodist-run``: torchrun's flags, parsed into a :class:`LaunchConfig`.

:func:`get_args_parser` declares the flags (each also read from ``PET_<DEST>``, as torchrun's
are, and the node rank from the cluster); :func:`parse_args` validates them into a frozen
:class:`LaunchConfig`, the only thing the rest of the launcher reads. :mod:`aiodist.launcher`
re-exports the public names defined here.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from .._util._cluster import launcher_default
from ..errors import DistUsageError
from ..store._etcd_client import parse_endpoints
from ._workers import Std

logger = logging.getLogger("aiodist.launcher")

_DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
_TRUE = ("1", "true", "yes", "on")


class _EnvDefault(argparse.Action):
    """An option whose default may come from ``PET_<DEST>`` as in torchrun, or the cluster.

    The node rank also comes from a Kubernetes Indexed Job's ``JOB_COMPLETION_INDEX``, or
    an elastic PyTorchJob's pod name (:func:`aiodist._util._cluster.launcher_default`).
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
        help="number of nodes: N, or MIN:MAX to start with at least MIN and up to MAX, "
        "take in nodes that come later and go on without lost ones (default 1:1)",
    )
    add(
        *_flag("--nproc-per-node"),
        action=_EnvDefault,
        default="1",
        help="workers per node: an integer, gpu for one per GPU, cpu for one per CPU, or "
        "auto for one per GPU if there are any, else per CPU (default 1)",
    )
    add(
        *_flag("--node-rank"),
        action=_EnvDefault,
        type=int,
        default=0,
        help="rank of this node, 0 <= K < nnodes; node 0 hosts the store (default "
        "PET_NODE_RANK, else a Kubernetes Indexed Job's JOB_COMPLETION_INDEX, else 0); "
        "ignored with MIN:MAX nodes, whose ranks follow their arrival",
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
        choices=["static", "c10d", "etcd", "etcd-v2"],
        help="where the job's store is: static and c10d, node 0's launcher hosts it; etcd "
        "and etcd-v2 (the same), an etcd cluster at --rdzv-endpoint, so that no node's loss "
        "takes the store with it",
    )
    add(
        *_flag("--rdzv-endpoint"),
        action=_EnvDefault,
        default="",
        help="HOST[:PORT] of node 0's store; overrides --master-addr/--master-port. With "
        "--rdzv-backend=etcd: HOST:PORT[,HOST:PORT...] of the etcd members (default "
        "127.0.0.1:2379; port 2379 if left out)",
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
        help="single node; the store listens on 127.0.0.1, on --master-port if given, else "
        "on a free port (logged)",
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
        *_flag("--log-line-prefix-template"),
        action=_EnvDefault,
        default=os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
        help="the prefix of each console line of a worker, with ${rank}, ${local_rank}, "
        "${role_name} and ${hostname} replaced (default [rank${rank}]:)",
    )
    add(
        *_flag("--virtual-local-rank"),
        action=_EnvFlag,
        help="give every worker LOCAL_RANK=0 and only its own GPU (CUDA_VISIBLE_DEVICES: the "
        "local rank's entry of the launcher's list, or the local rank), as torchrun does",
    )
    add(
        *_flag("--run-path"),
        action=_EnvFlag,
        help="run the script as a path with python -u, as by default; as in torchrun, it "
        "takes precedence over --no-python and --module",
    )
    add(
        *_flag("--no-python"),
        action=_EnvFlag,
        help="run the script as an executable, without python",
    )
    add(
        "--preload",
        action=_EnvDefault,
        default="",
        help="comma-separated modules (numpy,aiodist.sync) that one starter process imports "
        "once; every worker is then a fork of it instead of a new Python, which saves each "
        "worker, and each replacement started while the others run, the time of those imports",
    )
    add(
        *_flag("--status-port"),
        action=_EnvDefault,
        type=int,
        default=None,
        help="serve the live view of every rank (python -m aiodist.debug status) over HTTP "
        "on this port, 0 for any free one; the workers get AIODIST_STATUS=1",
    )
    add(
        *_flag("--status-host"),
        action=_EnvDefault,
        default="127.0.0.1",
        help="the address the live view listens on (default 127.0.0.1: this machine only)",
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
        nnodes: number of nodes (the least, with ``max_nnodes``).
        nproc_per_node: workers on this node.
        node_rank: this node's rank (ignored with ``max_nnodes``).
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
        status_port: where the launcher serves the live view of the ranks (``None``: it
            does not; 0: any free port).
        status_host: the address the live view listens on.
        virtual_local_rank: every worker sees ``LOCAL_RANK=0`` and only its own GPU.
        line_prefix: the template of a worker's console prefix (``None``: ``[rank<N>]:``).
        max_nnodes: the most nodes, with ``--nnodes=MIN:MAX`` (``None``: a fixed count).
        last_call_timeout: with ``max_nnodes``, seconds the store's node waits for more
            nodes once ``nnodes`` have come.
        preload: modules a starter process imports once, the workers being forks of it
            (empty: each worker is a new process).
        etcd_endpoints: with ``--rdzv-backend=etcd``, the etcd members' ``host:port``
            (empty: node 0's launcher hosts the store).
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
    status_port: int | None = None
    status_host: str = "127.0.0.1"
    virtual_local_rank: bool = False
    line_prefix: str | None = None
    max_nnodes: int | None = None
    last_call_timeout: float = 30.0
    preload: tuple[str, ...] = ()
    etcd_endpoints: tuple[str, ...] = ()

    @property
    def elastic(self) -> bool:
        """Whether the node count may change (``--nnodes=MIN:MAX`` with ``MIN < MAX``)."""
        return self.max_nnodes is not None

    @property
    def etcd_prefix(self) -> str:
        """With the store in etcd, the prefix of the job's keys there."""
        return f"/aiodist-run/{self.run_id}/"

    @property
    def etcd_url(self) -> str | None:
        """The job's store in etcd as a rendezvous URL (``None``: node 0's launcher hosts
        the store)."""
        if not self.etcd_endpoints:
            return None
        return f"etcd://{','.join(self.etcd_endpoints)}{quote(self.etcd_prefix)}"

    @property
    def store_name(self) -> str:
        """The job's store, as messages name it."""
        if self.etcd_endpoints:
            return f"the etcd store at {','.join(self.etcd_endpoints)}"
        return f"the store at {self.master_addr}:{self.master_port} (node 0)"


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


def _parse_nnodes(text: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` -> ``(MIN, MAX)``."""
    parts = text.split(":")
    try:
        sizes = [int(p) for p in parts]
    except ValueError:
        raise DistUsageError(f"--nnodes={text!r} is not valid: expected N or MIN:MAX") from None
    if len(sizes) > 2 or min(sizes) < 1 or sizes[0] > sizes[-1]:
        raise DistUsageError(
            f"--nnodes={text!r} is not valid: expected N >= 1 or MIN:MAX with 1 <= MIN <= MAX"
        )
    return sizes[0], sizes[-1]


def _cuda_devices() -> tuple[int, str]:
    """The number of CUDA devices cupy sees, and why none when it is 0."""
    try:
        import cupy
    except ImportError:
        return 0, "cupy is not installed"
    try:
        return int(cupy.cuda.runtime.getDeviceCount()), "cupy found no CUDA device"
    except Exception as exc:  # (cupy's CUDARuntimeError: no driver, no device)
        return 0, f"{type(exc).__name__}: {exc}"


def _parse_nproc(text: str) -> int:
    if text in ("gpu", "auto"):
        # As torchrun: one worker per GPU; auto counts CPUs when there is none.
        count, why = _cuda_devices()
        if count:
            return count
        if text == "gpu":
            raise DistUsageError(f"--nproc-per-node=gpu: no GPU to count ({why})")
    if text in ("auto", "cpu"):
        return os.cpu_count() or 1
    try:
        nproc = int(text)
    except ValueError:
        raise DistUsageError(
            f"--nproc-per-node={text!r} is not valid: expected a positive integer, gpu, auto or cpu"
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


#: c10d rendezvous settings of torchrun that mean nothing here (node 0's store is the
#: rendezvous): accepted and ignored, so that torchrun command lines run unchanged.
_C10D_ONLY_CONF = (
    "close_timeout",
    "heartbeat_timeout",
    "read_timeout",
    "cas_backoff_max_seconds",
    "is_host",
    "store_type",
)


def _parse_rdzv_conf(text: str) -> dict[str, float]:
    known = {
        "join_timeout": 600.0,
        "timeout": 600.0,
        "keep_alive_interval": 5.0,
        "keep_alive_max_attempt": 3.0,
        "last_call_timeout": 30.0,
    }
    conf: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if sep and key in _C10D_ONLY_CONF:
            logger.info(
                "--rdzv-conf %s is c10d's and ignored: node 0's store is the rendezvous", key
            )
            continue
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
    for key in ("keep_alive_interval", "keep_alive_max_attempt", "last_call_timeout"):
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


def _check_supervision(ns: argparse.Namespace) -> None:
    """Check the flags that say how workers are supervised (restarts, intervals, status).

    Raises:
        DistUsageError: naming the first flag with an invalid value.
    """
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
    if ns.status_port is not None and not 0 <= int(ns.status_port) < 65536:
        raise DistUsageError(f"--status-port={ns.status_port} is not a port number")


def _parse_ranks_filter(value: str, nproc: int) -> frozenset[int] | None:
    """``--local-ranks-filter``: the local ranks whose output is shown (``None``: all).

    Raises:
        DistUsageError: not comma-separated local ranks of this node.
    """
    if not value.strip():
        return None
    try:
        filt = frozenset(int(r) for r in value.split(","))
    except ValueError:
        raise DistUsageError(
            f"--local-ranks-filter={value!r} is not valid: expected "
            "comma-separated local ranks like 0,2"
        ) from None
    if not filt <= set(range(nproc)):
        raise DistUsageError(f"--local-ranks-filter={value!r} names ranks outside 0..{nproc - 1}")
    return filt


def _worker_command(ns: argparse.Namespace) -> list[str]:
    """The command that starts a worker, before its script's arguments."""
    if ns.run_path:
        return [sys.executable, "-u", ns.training_script]
    if ns.no_python:
        return [ns.training_script]
    if ns.module:
        return [sys.executable, "-u", "-m", ns.training_script]
    return [sys.executable, "-u", ns.training_script]


def parse_args(argv: Sequence[str] | None = None) -> LaunchConfig:
    """Parse and validate an ``aiodist-run`` command line.

    Raises:
        DistUsageError: a flag has an invalid value or flags contradict each other.
        SystemExit: argparse rejected the command line (unknown flag, missing script).
    """
    ns = get_args_parser().parse_args(argv)
    nnodes, max_nnodes = _parse_nnodes(str(ns.nnodes))
    elastic = max_nnodes > nnodes
    nproc = _parse_nproc(str(ns.nproc_per_node))
    conf = _parse_rdzv_conf(str(ns.rdzv_conf))
    node_rank = 0 if elastic else int(ns.node_rank)
    if not 0 <= node_rank < nnodes:
        raise DistUsageError(f"--node-rank={node_rank} is not valid with --nnodes={nnodes}")
    master_addr, master_port = str(ns.master_addr), ns.master_port
    run_id = str(ns.rdzv_id)
    etcd: tuple[str, ...] = ()
    if ns.standalone:
        if max_nnodes != 1:
            raise DistUsageError(f"--standalone runs one node, but --nnodes={ns.nnodes}")
        if ns.rdzv_backend in ("etcd", "etcd-v2"):
            # As torchrun: --standalone means a store of its own on this machine.
            logger.info("--standalone: the launcher hosts the store, not etcd")
        # (On --master-port when given: where `python -m aiodist.debug status` finds it.)
        master_addr, run_id = "127.0.0.1", uuid.uuid4().hex[:12]
        master_port = 0 if master_port is None else master_port
    elif ns.rdzv_backend in ("etcd", "etcd-v2"):
        # (Without an endpoint: etcd's own default client address.)
        members = parse_endpoints(str(ns.rdzv_endpoint or "127.0.0.1:2379"), "--rdzv-endpoint")
        etcd = tuple(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in members)
        # (The first member stands for "where the store is": the workers listen on the
        # address that reaches it.)
        master_addr, master_port = members[0]
    elif ns.rdzv_endpoint:
        master_addr, master_port = _parse_endpoint(str(ns.rdzv_endpoint), 29400)
    elif master_port is None:
        # torchrun does the same switch: one node and no port asked for means any free port.
        master_port = 0 if max_nnodes == 1 else 29500
    master_port = int(master_port)
    if not 0 <= master_port < 65536 or (master_port == 0 and max_nnodes > 1):
        raise DistUsageError(
            f"--master-port={master_port} is not valid"
            + (": several nodes need a fixed port" if master_port == 0 else "")
        )
    _check_supervision(ns)
    if ns.module and ns.no_python and not ns.run_path:
        raise DistUsageError("--module and --no-python cannot be used together")
    preload = tuple(name.strip() for name in str(ns.preload).split(",") if name.strip())
    if preload and ns.no_python and not ns.run_path:
        raise DistUsageError(
            f"--preload={ns.preload} needs Python workers: --no-python runs an executable"
        )
    filt = _parse_ranks_filter(str(ns.local_ranks_filter), nproc)
    cmd = _worker_command(ns)
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
        status_port=None if ns.status_port is None else int(ns.status_port),
        status_host=str(ns.status_host),
        virtual_local_rank=bool(ns.virtual_local_rank),
        line_prefix=ns.log_line_prefix_template,
        max_nnodes=max_nnodes if elastic else None,
        last_call_timeout=conf["last_call_timeout"],
        preload=preload,
        etcd_endpoints=etcd,
    )
