"""Every environment variable aiodist reads, and the ``AIODIST_*`` ones its launcher sets.

One table, :data:`VARIABLES`: the documentation's "Environment variables" page renders it,
and ``tests/test_environment_table.py`` fails when the package names an ``AIODIST_*``
variable the table lacks, or when a row's modules no longer mention its variable. Each
variable is read where it takes effect; the on/off switches share :func:`turned_off`.

Text in backquotes (```AIODIST_SHM=0```) is shown as code.
"""

from __future__ import annotations

import os
from typing import Literal, NamedTuple

__all__ = ["VARIABLES", "Variable", "turned_off"]


def turned_off(name: str) -> bool:
    """Whether the switch ``name`` (on unless set) is ``0``, ``false``, ``no`` or ``off``."""
    return os.environ.get(name, "1").strip().lower() in ("0", "false", "no", "off")


class Variable(NamedTuple):
    """One environment variable.

    Attributes:
        name: the variable (``PET_<OPTION>`` stands for a family).
        origin: ``"aiodist"`` for aiodist's own, ``"torch"`` for torch's (and NCCL's) names.
        default: what holds when it is unset.
        meaning: what it does.
        read_by: what reads it (or, for a variable only set, who sets it).
        modules: the modules that read or set it.
    """

    name: str
    origin: Literal["aiodist", "torch"]
    default: str
    meaning: str
    read_by: str
    modules: tuple[str, ...]


VARIABLES: tuple[Variable, ...] = (
    Variable(
        "AIODIST_AUTH_TOKEN",
        "aiodist",
        "unset: no authentication (`aiodist-run` of one node makes one up)",
        "Shared secret of the job, when `auth_token=` is not passed: the store refuses "
        "clients without it, every connection between ranks proves it, and the status "
        "endpoints want the key derived from it. Set the same value on every rank (every "
        "node of an `aiodist-run` job).",
        "`init_process_group`, the stores, `aiodist-run`, `aiodist.debug`",
        ("aiodist._util._auth", "aiodist.launcher"),
    ),
    Variable(
        "AIODIST_HOST",
        "aiodist",
        "unset: see `AIODIST_SOCKET_IFNAME`",
        "The address a rank listens on and publishes to its peers; empty, `0.0.0.0` or `::`: "
        "every interface. `aiodist-run` sets it with several nodes (`--local-addr`).",
        "`init_process_group`",
        ("aiodist.transport._address", "aiodist.launcher", "aiodist.contrib.ray"),
    ),
    Variable(
        "AIODIST_SOCKET_IFNAME",
        "aiodist",
        "unset: the interface that reaches the store",
        "The network interface (`eth1`) whose address a rank listens on, when `AIODIST_HOST` "
        "is unset; of a comma-separated list, the first.",
        "`init_process_group`",
        ("aiodist.transport._address",),
    ),
    Variable(
        "AIODIST_PEER_TIMEOUT",
        "aiodist",
        "`8`",
        "Seconds of silence (TCP keepalive) after which a connection's peer host counts as "
        "gone; at least 1. Set the same value on every node.",
        "the stores, `init_process_group`",
        ("aiodist.store._sockets",),
    ),
    Variable(
        "AIODIST_WAIT_WARNING",
        "aiodist",
        "`300`",
        "Seconds between the warnings a long wait logs (the first comes at the first minute, "
        "or after this many seconds when shorter): `init_process_group` waiting for ranks "
        "(it names those that have not arrived), a collective waiting for a peer (named), "
        "a store connection being retried, a store host waiting for the others to leave.",
        "`init_process_group`, the operations, the stores, `destroy_process_group`",
        ("aiodist._util._speaking",),
    ),
    Variable(
        "AIODIST_SHM",
        "aiodist",
        "on",
        "`0`, `false`, `no` or `off`: ranks on one host talk over TCP instead of shared "
        "memory in `/dev/shm`. Set it on every rank.",
        "`init_process_group`, `empty`, `zeros`",
        ("aiodist.transport._shm_segment",),
    ),
    Variable(
        "AIODIST_SHM_PULL",
        "aiodist",
        "on",
        "`0`, `false`, `no` or `off`: a message too large for the receiver's staging bound "
        "goes through the shared-memory ring (two copies) instead of being copied once from "
        "the sender's memory (`process_vm_readv`). On by default where the kernel lets ranks "
        "of one user read each other's memory (Yama `ptrace_scope` 0); elsewhere the ring "
        "is used anyway.",
        "`init_process_group` (the shared-memory transport)",
        ("aiodist.transport._shm_pull",),
    ),
    Variable(
        "AIODIST_STAGING_BYTES",
        "aiodist",
        "`16777216` (16 MiB)",
        "Bytes of messages from one peer that a rank holds at most for receives it has not "
        "posted yet. A message that does not fit waits until its receive is posted, then "
        "goes straight into it; `0` stages nothing. Ranks may differ.",
        "`init_process_group` (the TCP and shared-memory transports)",
        ("aiodist.transport._flow",),
    ),
    Variable(
        "AIODIST_TWO_LEVEL",
        "aiodist",
        "on",
        "`0`, `false`, `no` or `off`: the collectives of a group over several hosts run flat "
        "(every rank in one ring or tree) instead of within each host first and across "
        "hosts once. For comparisons; set it on every rank.",
        "`init_process_group`, `new_group`",
        ("aiodist.backends.cpu",),
    ),
    Variable(
        "AIODIST_LOOP",
        "aiodist",
        "`auto`",
        "The event loop of the loops aiodist creates: `auto` (uvloop when installed), "
        "`uvloop` or `asyncio`. `aiodist.sync`'s thread runs the standard loop unless "
        "`uvloop` is asked for.",
        "`aiodist.sync`, `run_world_processes`, the pytest plugin (`--aiodist-loop`)",
        ("aiodist.sync._loop_thread", "aiodist.testing._world", "aiodist.testing.pytest_plugin"),
    ),
    Variable(
        "AIODIST_FR_DUMP_DIR",
        "aiodist",
        "unset: no dumps",
        "Directory where each rank writes its flight recorder (`rank<N>.json`) when an "
        "operation times out, and on `SIGUSR1` (`init_process_group` installs the handler).",
        "`init_process_group`, `aiodist.debug`",
        ("aiodist.group._recorder", "aiodist.debug"),
    ),
    Variable(
        "AIODIST_STATUS",
        "aiodist",
        "unset: no status endpoint",
        "`1`: every process that joins a world serves its ranks' operations and its threads' "
        "stacks on a thread of its own (HTTP, on `AIODIST_STATUS_HOST`) and records where in "
        "the store, for `python -m aiodist.debug status`. `aiodist-run --status-port` sets "
        "it.",
        "`init_process_group`, `aiodist.debug`",
        ("aiodist.debug._status",),
    ),
    Variable(
        "AIODIST_STATUS_HOST",
        "aiodist",
        "unset: `127.0.0.1`",
        "The address the status endpoints listen on; empty, `0.0.0.0` or `::`: every "
        "interface. `aiodist-run --status-port` sets it with several nodes (node 0's "
        "launcher asks every rank).",
        "`init_process_group`",
        ("aiodist.debug._status", "aiodist.launcher"),
    ),
    Variable(
        "AIODIST_FR_BUFFER_SIZE",
        "aiodist",
        "`2000`",
        "How many operations each world's flight recorder keeps; a value that is not a "
        "positive integer is logged and ignored.",
        "`init_process_group`",
        ("aiodist.group._recorder",),
    ),
    Variable(
        "AIODIST_CUDA_PATH",
        "aiodist",
        "unset: the best path that works",
        "`nccl`, `ipc` or `staged`: the CUDA backend's data path, forced; a forced path that "
        "cannot work is an error. Every rank that sets it must set the same value.",
        "the CUDA backend",
        ("aiodist.backends._cuda_path", "aiodist.backends.cuda"),
    ),
    Variable(
        "AIODIST_CUDA_IPC_BYTES",
        "aiodist",
        "`67108864` (64 MiB)",
        "Bytes of each rank's exchange buffer on the CUDA `ipc` path (at least 64 KiB); the "
        "same on every rank.",
        "the CUDA backend",
        ("aiodist.backends.cuda",),
    ),
    Variable(
        "AIODIST_RUN_ID",
        "aiodist",
        "`TORCHELASTIC_RUN_ID`, else `default`",
        "The job's id, which names its files in `/dev/shm`. `aiodist-run` sets it to `--rdzv-id`.",
        "`init_process_group`",
        ("aiodist.transport.shm", "aiodist.launcher"),
    ),
    Variable(
        "AIODIST_STORE_URL",
        "aiodist",
        "",
        "The store `env://` uses, e.g. `etcd://10.0.0.1:2379,10.0.0.2:2379/job7` (rank and "
        "world size still from the environment). `aiodist-run --rdzv-backend=etcd` sets it.",
        "`init_process_group`",
        ("aiodist.rendezvous", "aiodist.launcher"),
    ),
    Variable(
        "AIODIST_RESTART_COUNT",
        "aiodist",
        "",
        "The attempt, from 0 (as `TORCHELASTIC_RESTART_COUNT`).",
        "set by `aiodist-run` for its workers",
        ("aiodist.launcher",),
    ),
    Variable(
        "AIODIST_RESTART_POLICY",
        "aiodist",
        "",
        "`--restart-policy`: `all` or `failed`.",
        "set by `aiodist-run` for its workers",
        ("aiodist.launcher",),
    ),
    Variable(
        "RANK",
        "torch",
        "the scheduler's variables",
        "This process's rank, then `OMPI_COMM_WORLD_RANK`, `PMI_RANK`, `SLURM_PROCID`, ... "
        "`aiodist-run` sets it.",
        "`env://`",
        ("aiodist._util._cluster", "aiodist.launcher"),
    ),
    Variable(
        "WORLD_SIZE",
        "torch",
        "the scheduler's variables",
        "The number of ranks, then `OMPI_COMM_WORLD_SIZE`, `PMI_SIZE`, `SLURM_NTASKS`, ... "
        "`aiodist-run` sets it.",
        "`env://`",
        ("aiodist._util._cluster", "aiodist.launcher"),
    ),
    Variable(
        "LOCAL_RANK",
        "torch",
        "the scheduler's variables",
        "The rank among this node's ranks. `aiodist-run` sets it.",
        "`get_node_local_rank`",
        ("aiodist._util._cluster", "aiodist.launcher"),
    ),
    Variable(
        "LOCAL_WORLD_SIZE",
        "torch",
        "the group's size",
        "How many ranks share this machine: when they fit on its CPUs, a waiting rank polls "
        "briefly before it sleeps. `aiodist-run` sets it.",
        "the transports, `aiodist.sync`",
        (
            "aiodist._util._wait",
            "aiodist.collectives.shm_workspace",
            "aiodist.transport.tcp",
            "aiodist.launcher",
        ),
    ),
    Variable(
        "MASTER_ADDR",
        "torch",
        "`PET_MASTER_ADDR`, else derived",
        "The host of the job's store. Without a store connection, a loopback or unset "
        "value keeps the ranks on `127.0.0.1`. `aiodist-run` sets it.",
        "`env://`, `init_process_group`",
        (
            "aiodist._util._cluster",
            "aiodist.rendezvous",
            "aiodist.transport._address",
            "aiodist.launcher",
        ),
    ),
    Variable(
        "MASTER_PORT",
        "torch",
        "`PET_MASTER_PORT`, else derived",
        "The port of the job's store. `aiodist-run` sets it.",
        "`env://`",
        ("aiodist._util._cluster", "aiodist.rendezvous", "aiodist.launcher"),
    ),
    Variable(
        "TORCHELASTIC_USE_AGENT_STORE",
        "torch",
        "unset",
        "`True`: rank 0 joins the store at `MASTER_ADDR:MASTER_PORT` instead of hosting it. "
        "`aiodist-run` sets it.",
        "`env://`, `tcp://`",
        ("aiodist.rendezvous", "aiodist.launcher"),
    ),
    Variable(
        "TORCHELASTIC_RUN_ID",
        "torch",
        "unset",
        "Set: a torchrun-style launcher started this process (`is_torchelastic_launched()`), "
        "so `env://` trusts its variables over the scheduler's. `aiodist-run` sets it to "
        "`--rdzv-id`.",
        "`env://`, `aiodist.sync`",
        ("aiodist._util._cluster", "aiodist.sync", "aiodist.transport.shm", "aiodist.launcher"),
    ),
    Variable(
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
        "torch",
        "`30`",
        "Default of `--shutdown-timeout`: seconds a worker has to exit after `SIGTERM` "
        "before it gets `SIGKILL`.",
        "`aiodist-run`",
        ("aiodist.launcher._cli",),
    ),
    Variable(
        "PET_<OPTION>",
        "torch",
        "the option's default",
        "Default of each `aiodist-run` option (`PET_NPROC_PER_NODE=4`); the Kubernetes "
        "controllers set them.",
        "`aiodist-run`, `env://`",
        ("aiodist.launcher._cli", "aiodist._util._cluster"),
    ),
    Variable(
        "GLOO_SOCKET_IFNAME",
        "torch",
        "unset",
        "As `AIODIST_SOCKET_IFNAME`, which wins when both are set.",
        "`init_process_group`",
        ("aiodist.transport._address",),
    ),
    Variable(
        "TORCH_DISTRIBUTED_DEBUG",
        "torch",
        "`OFF`",
        "`OFF`, `INFO` or `DETAIL`: how much the `aiodist` loggers log, read only when "
        "`set_debug_level_from_env()` is called.",
        "`aiodist.sync.set_debug_level_from_env`",
        ("aiodist.sync",),
    ),
    Variable(
        "NCCL_MULTI_RANK_GPU_ENABLE",
        "torch",
        "unset",
        "`1`: the CUDA backend may use NCCL (2.30 or later) for ranks that share a GPU.",
        "the CUDA backend",
        ("aiodist.backends._cuda_path",),
    ),
)
