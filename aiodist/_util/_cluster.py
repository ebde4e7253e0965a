"""The job's shape from the environment its launcher left: rank, world size, local rank, master.

``env://`` and ``aiodist-run`` read the variables of the launchers jobs already run under.
:func:`read_cluster_env` turns ``os.environ`` into a :class:`ClusterEnv` whose every value
carries the variable it came from (``SLURM_PROCID=3``), so that an error can say what it saw.

Rank, world size and local rank, each the first one set:

===========================  ========================  =========================  ===============================
started by                   rank                      world size                 local rank
===========================  ========================  =========================  ===============================
torchrun, aiodist-run,       ``RANK``                  ``WORLD_SIZE``             ``LOCAL_RANK``
Kubeflow PyTorchJob
Open MPI's ``mpirun``        ``OMPI_COMM_WORLD_RANK``  ``OMPI_COMM_WORLD_SIZE``   ``OMPI_COMM_WORLD_LOCAL_RANK``
MPICH / Intel MPI (hydra)    ``PMI_RANK``              ``PMI_SIZE``               ``MPI_LOCALRANKID``
SLURM's ``srun``             ``SLURM_PROCID``          ``SLURM_NTASKS``           ``SLURM_LOCALID``
Kubernetes, one process      ``PET_NODE_RANK``,        ``PET_NNODES``
per pod                      ``JOB_COMPLETION_INDEX``
===========================  ========================  =========================  ===============================

The master (the host and port of rank 0's store), the first rule that applies:

1. ``MASTER_ADDR`` / ``MASTER_PORT``, else ``PET_MASTER_ADDR`` / ``PET_MASTER_PORT`` (Kubeflow).
2. An MPI job whose ranks all run on one node (``OMPI_COMM_WORLD_LOCAL_SIZE`` or
   ``MPI_LOCALNRANKS`` equal to the world size): ``127.0.0.1``.
3. A SLURM task started by ``srun``: the first host of ``SLURM_STEP_NODELIST``, else
   ``SLURM_JOB_NODELIST``, else ``SLURM_NODELIST``, expanded from Slurm's compressed form
   (``node[01-04,07]``). The step's list comes first because a step may run on part of
   the job's nodes; srun's block and cyclic distributions both put task 0 on the step's
   first node.

A derived port is ``20000 + n % 10000``: below Linux's ephemeral range (32768-60999, where
the kernel picks the ports of outgoing connections), so no client socket holds it, and
different for concurrent jobs on one node. ``n`` is the job's identity:

* SLURM: ``10 * SLURM_JOB_ID + SLURM_STEP_ID % 10``: consecutive jobs get ports 10 apart
  and the steps of one job (``srun ... &`` several times) differ.
* Open MPI: the CRC-32 of ``OMPI_MCA_ess_base_jobid`` (Open MPI 4) or ``PMIX_NAMESPACE``
  (Open MPI 5), which every rank of one ``mpirun`` shares.
* MPICH's hydra on one node: the CRC-32 of the process id of the ``hydra_pmi_proxy`` that
  started the ranks (hydra exports no job id); across nodes, set ``MASTER_PORT``.

Set-ups that cannot work raise :class:`~aiodist.errors.DistUsageError` naming the variables
and values seen: a malformed number or node list, a rank out of range, two launchers whose
worlds have the same size but put this process at different ranks (``RANK=1`` and
``SLURM_PROCID=2``), a SLURM batch script of several tasks that was not started by
``srun``, a Kubernetes pod meant to run several processes started without a launcher, and
a master that is neither set nor derivable. Under a torchrun-compatible launcher
(``TORCHELASTIC_RUN_ID`` set) its variables describe this process and the others describe
the launcher, so they are not compared.

Kubernetes (Kubeflow PyTorchJob, Kubeflow Trainer's JobSets, Indexed Jobs): ``aiodist-run``
reads torchrun's ``PET_<FLAG>`` variables, and its node rank, when ``PET_NODE_RANK`` is
unset, from ``JOB_COMPLETION_INDEX`` (an Indexed Job's pod index) or, in an elastic
PyTorchJob, from the pod's host name (:func:`launcher_default`). An Indexed Job's pods are
reachable by name through a headless Service named in the pod template's ``subdomain``:
pod ``K`` is ``<job-name>-K.<service-name>``, so its master is
``MASTER_ADDR=<job-name>-0.<service-name>`` (see ``examples/kubernetes/``).
"""

from __future__ import annotations

import itertools
import os
import re
import socket
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Generic, TypeAlias, TypeVar

from ..errors import DistUsageError

__all__ = [
    "LOCAL_RANK_VARS",
    "RANK_VARS",
    "VARIABLES",
    "WORLD_SIZE_VARS",
    "ClusterEnv",
    "Sourced",
    "derived_port",
    "expand_hostlist",
    "first_host",
    "launcher_default",
    "read_cluster_env",
    "read_rank_and_world_size",
]

T = TypeVar("T")

#: The first port a job's identity maps to, and how many follow it.
PORT_BASE = 20000
PORT_SPAN = 10000


@dataclass(frozen=True)
class _Launcher:
    """One launcher's names for this process's place in its world."""

    name: str
    rank_var: str
    size_var: str
    local_rank_var: str | None


_TORCHRUN = _Launcher("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK")
_OPEN_MPI = _Launcher(
    "Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"
)
_HYDRA = _Launcher("MPICH/Intel MPI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID")
_SLURM = _Launcher("SLURM", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
_KUBEFLOW = _Launcher("Kubeflow", "PET_NODE_RANK", "PET_NNODES", None)
_INDEXED_JOB = _Launcher("an Indexed Job", "JOB_COMPLETION_INDEX", "PET_NNODES", None)
_LAUNCHERS = (_TORCHRUN, _OPEN_MPI, _HYDRA, _SLURM, _KUBEFLOW, _INDEXED_JOB)
_MPI = (_OPEN_MPI, _HYDRA)
_PER_POD = (_KUBEFLOW, _INDEXED_JOB)

#: Where each value is looked for, in order.
RANK_VARS = tuple(launcher.rank_var for launcher in _LAUNCHERS)
WORLD_SIZE_VARS = tuple(dict.fromkeys(launcher.size_var for launcher in _LAUNCHERS))
LOCAL_RANK_VARS = tuple(lr.local_rank_var for lr in _LAUNCHERS if lr.local_rank_var)
_MASTER_ADDR_VARS = ("MASTER_ADDR", "PET_MASTER_ADDR")
_MASTER_PORT_VARS = ("MASTER_PORT", "PET_MASTER_PORT")
_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_STEP_VARS = ("SLURM_STEP_ID", "SLURM_STEPID")
_LOCAL_SIZE_VARS = {_OPEN_MPI: "OMPI_COMM_WORLD_LOCAL_SIZE", _HYDRA: "MPI_LOCALNRANKS"}
_OPEN_MPI_JOB_VARS = ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")
#: Set by torchrun and aiodist-run in their workers' environment.
_UNDER_LAUNCHER_VAR = "TORCHELASTIC_RUN_ID"

#: Every variable this module reads (tests clear them for a clean slate).
VARIABLES = tuple(
    dict.fromkeys(
        [
            *RANK_VARS,
            *WORLD_SIZE_VARS,
            *LOCAL_RANK_VARS,
            *_MASTER_ADDR_VARS,
            *_MASTER_PORT_VARS,
            *_NODELIST_VARS,
            *_STEP_VARS,
            *_LOCAL_SIZE_VARS.values(),
            *_OPEN_MPI_JOB_VARS,
            _UNDER_LAUNCHER_VAR,
            "SLURM_JOB_ID",
            "PET_NPROC_PER_NODE",
            "PET_RDZV_ENDPOINT",
            "KUBERNETES_SERVICE_HOST",
        ]
    )
)


@dataclass(frozen=True)
class Sourced(Generic[T]):
    """A value and where it came from.

    Attributes:
        value: the value.
        source: how it was found, for messages: ``"SLURM_PROCID=3"``, ``"the rank argument"``.
        var: the environment variable it was read from, or ``None``.
    """

    value: T
    source: str
    var: str | None = None


@dataclass(frozen=True)
class ClusterEnv:
    """This process's place in the job, each value with its source.

    Attributes:
        rank: this process's rank.
        world_size: the number of processes.
        local_rank: the rank among the processes of this node, if a launcher said.
        master_addr: the host of rank 0's store.
        master_port: its port.
    """

    rank: Sourced[int]
    world_size: Sourced[int]
    local_rank: Sourced[int] | None
    master_addr: Sourced[str]
    master_port: Sourced[int]


def read_cluster_env(
    environ: Mapping[str, str] | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
) -> ClusterEnv:
    """Read this process's rank, world size, local rank and master from the environment.

    Args:
        environ: the environment (default ``os.environ``).
        rank: the rank, if the caller knows it (then the environment's is not read).
        world_size: the world size, if the caller knows it.

    Returns:
        The values, each with its source.

    Raises:
        DistUsageError: a value is missing, malformed or contradicted by another launcher's
            variables, or the master can be neither read nor derived; the message names the
            variables and the values it saw.
    """
    env = os.environ if environ is None else environ
    r, w = read_rank_and_world_size(env, rank=rank, world_size=world_size)
    launcher = _launcher_of(r, w)
    return ClusterEnv(
        rank=r,
        world_size=w,
        local_rank=_find_int(env, LOCAL_RANK_VARS),
        master_addr=_master_addr(env, launcher, w),
        master_port=_master_port(env, launcher, w),
    )


def read_rank_and_world_size(
    environ: Mapping[str, str] | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
) -> tuple[Sourced[int], Sourced[int]]:
    """Read this process's rank and the world size, checked against each other.

    Args:
        environ: the environment (default ``os.environ``).
        rank: the rank, if the caller knows it (then the environment's is not read).
        world_size: the world size, if the caller knows it.

    Returns:
        ``(rank, world_size)``, each with its source.

    Raises:
        DistUsageError: a value is missing or malformed, the rank is out of range, or the
            variables of two launchers contradict each other (see the module's notes).
    """
    env = os.environ if environ is None else environ
    r = _given("rank", rank) if rank is not None else _first_int(env, RANK_VARS)
    w = (
        _given("world size", world_size)
        if world_size is not None
        else _first_int(env, WORLD_SIZE_VARS)
    )
    _check_source_fits(env, r, w)
    if not env.get(_UNDER_LAUNCHER_VAR) and r.var is not None:
        _check_agreement(env, r, w)
    if w.value < 1:
        raise DistUsageError(f"world size must be positive, got {w.value} ({w.source})")
    if not 0 <= r.value < w.value:
        raise DistUsageError(
            f"rank {r.value} is out of range for world size {w.value} ({r.source}, {w.source})"
        )
    return r, w


# -- rank and world size ----------------------------------------------------------------------
def _given(what: str, value: int) -> Sourced[int]:
    return Sourced(value, f"the {what} argument")


def _int(name: str, text: str) -> int:
    # Stricter than int(), which takes "1_000" and non-ASCII digits for numbers.
    if not re.fullmatch(r"\s*[-+]?[0-9]+\s*", text):
        raise DistUsageError(f"{name} must be an integer, got {text!r}")
    return int(text)


def _find_int(env: Mapping[str, str], names: tuple[str, ...]) -> Sourced[int] | None:
    for name in names:
        text = env.get(name)
        if text:  # an empty value counts as unset, as in torch
            return Sourced(_int(name, text), f"{name}={text}", name)
    return None


def _first_int(env: Mapping[str, str], names: tuple[str, ...]) -> Sourced[int]:
    found = _find_int(env, names)
    if found is None:
        first, *others = names
        raise DistUsageError(
            f"environment variable {first} expected, but not set "
            f"(nor {', '.join(others[:-1])} or {others[-1]})"
        )
    return found


def _in_slurm_step(env: Mapping[str, str]) -> bool:
    """Whether this process is a task that ``srun`` started (the batch script is not)."""
    return any(env.get(name) for name in _STEP_VARS)


def _check_source_fits(env: Mapping[str, str], r: Sourced[int], w: Sourced[int]) -> None:
    """Refuse variables that describe something other than this process's place."""
    used = {r.var, w.var}
    if used & {_SLURM.rank_var, _SLURM.size_var} and not _in_slurm_step(env):
        tasks = env.get(_SLURM.size_var, "")
        if tasks.isdigit() and int(tasks) > 1:
            raise DistUsageError(
                f"{_SLURM.size_var}={tasks} but SLURM_STEP_ID is not set: this process is the "
                f"batch script, not one of the {tasks} tasks; start the ranks with srun "
                "(srun python script.py), or set RANK and WORLD_SIZE"
            )
    per_pod = {_KUBEFLOW.rank_var, _INDEXED_JOB.rank_var, _KUBEFLOW.size_var}
    nproc = env.get("PET_NPROC_PER_NODE", "")
    if used & per_pod and nproc not in ("", "1"):
        raise DistUsageError(
            f"PET_NPROC_PER_NODE={nproc} asks for a launcher to start the processes of each "
            f"pod, but this process was started alone ({r.source}, {w.source}); start the "
            "pod's command with aiodist-run, which reads the PET_ variables"
        )


def _launcher_values(env: Mapping[str, str], launcher: _Launcher) -> tuple[int, int] | None:
    rank, size = env.get(launcher.rank_var, ""), env.get(launcher.size_var, "")
    if not (rank.isdigit() and size.isdigit()):
        return None
    if launcher is _SLURM and not _in_slurm_step(env):
        return None
    return int(rank), int(size)


def _check_agreement(env: Mapping[str, str], r: Sourced[int], w: Sourced[int]) -> None:
    """Two launchers that describe worlds of one size must put this process at one rank.

    A world of another size is a launcher around this one (srun starting mpirun, an
    allocation's batch script), and is not compared.
    """
    for launcher in _LAUNCHERS:
        values = _launcher_values(env, launcher)
        if launcher.rank_var == r.var or values is None:
            continue
        rank, size = values
        if size == w.value and rank != r.value:
            raise DistUsageError(
                f"{r.source} and {launcher.rank_var}={rank} disagree, though both describe a "
                f"world of {size} processes ({w.source}, {launcher.size_var}={size}): unset "
                f"the variables that another launcher left behind, or pass rank= explicitly"
            )
    # A PyTorchJob pod meant to run N processes sets RANK to the pod's index and WORLD_SIZE
    # to pods * N; started without a launcher, the pod's one process would wait forever.
    nproc, nnodes = env.get("PET_NPROC_PER_NODE", ""), env.get("PET_NNODES", "")
    if (
        nproc.isdigit()
        and int(nproc) > 1
        and nnodes.isdigit()
        and w.value == int(nproc) * int(nnodes)
        and env.get("PET_NODE_RANK") == str(r.value)
        and not env.get("LOCAL_RANK")
    ):
        raise DistUsageError(
            f"{w.source} counts PET_NPROC_PER_NODE={nproc} processes on each of "
            f"PET_NNODES={nnodes} pods, but this process was started alone ({r.source}, "
            "LOCAL_RANK not set); start the pod's command with aiodist-run, which starts "
            f"the {nproc} processes"
        )


def _launcher_of(r: Sourced[int], w: Sourced[int]) -> _Launcher | None:
    for var in (r.var, w.var):
        for launcher in _LAUNCHERS:
            if var in (launcher.rank_var, launcher.size_var):
                return launcher
    return None


# -- the master -------------------------------------------------------------------------------
def _first_set(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        value = env.get(name)
        if value:
            return name, value
    return None


def _mpi_single_node(env: Mapping[str, str], launcher: _Launcher | None) -> str | None:
    """``"OMPI_COMM_WORLD_LOCAL_SIZE=4 == OMPI_COMM_WORLD_SIZE=4"`` if every rank is local."""
    if launcher not in _MPI:
        return None
    assert launcher is not None
    local_var = _LOCAL_SIZE_VARS[launcher]
    local, size = env.get(local_var, ""), env.get(launcher.size_var, "")
    if local and local == size:
        return f"{local_var}={local} == {launcher.size_var}={size}"
    return None


def _slurm_task(env: Mapping[str, str], w: Sourced[int]) -> bool:
    """Whether this process is a SLURM task of a world that is the job's world."""
    values = _launcher_values(env, _SLURM)
    ntasks = env.get(_SLURM.size_var, "")
    single = ntasks == "1" and w.value == 1  # a one-task batch script needs no srun
    return (values is not None and values[1] == w.value) or single


def _master_addr(
    env: Mapping[str, str], launcher: _Launcher | None, w: Sourced[int]
) -> Sourced[str]:
    found = _first_set(env, _MASTER_ADDR_VARS)
    if found:
        return Sourced(found[1], f"{found[0]}={found[1]}", found[0])
    local = _mpi_single_node(env, launcher)
    if local:
        return Sourced("127.0.0.1", f"loopback, every rank on this node ({local})")
    nodelist = _first_set(env, _NODELIST_VARS)
    if nodelist and _slurm_task(env, w):
        name, text = nodelist
        return Sourced(first_host(text, name), f"the first host of {name}={text}", name)
    message = "environment variable MASTER_ADDR expected, but not set"
    if launcher in _MPI:
        assert launcher is not None
        local_var = _LOCAL_SIZE_VARS[launcher]
        message += (
            f"; the {w.value} ranks of this {launcher.name} job run on several nodes "
            f"({launcher.size_var}={env.get(launcher.size_var)}, "
            f"{local_var}={env.get(local_var, '(not set)')}), so set MASTER_ADDR to the host "
            "of rank 0 for every rank (mpirun -x MASTER_ADDR=<host> ...)"
        )
    elif launcher is _SLURM:
        message += f" (nor {', '.join(_NODELIST_VARS[:-1])} or {_NODELIST_VARS[-1]})"
    elif launcher in _PER_POD:
        message += (
            "; in an Indexed Job with a headless Service, set "
            "MASTER_ADDR=<job-name>-0.<service-name>"
        )
    raise DistUsageError(message)


def derived_port(identity: int) -> int:
    """The port a job with this identity uses: ``20000 + identity % 10000``."""
    return PORT_BASE + identity % PORT_SPAN


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def _hydra_proxy_pid() -> int | None:
    """The pid of the ``hydra_pmi_proxy`` that started this process, if one did."""
    ppid = os.getppid()
    try:
        with open(f"/proc/{ppid}/comm") as f:
            return ppid if f.read().strip() == "hydra_pmi_proxy" else None
    except OSError:
        return None


def _master_port(
    env: Mapping[str, str], launcher: _Launcher | None, w: Sourced[int]
) -> Sourced[int]:
    found = _first_set(env, _MASTER_PORT_VARS)
    if found:
        name, text = found
        return Sourced(_int(name, text), f"{name}={text}", name)
    hint = ""
    if launcher is _OPEN_MPI:
        job_id = _first_set(env, _OPEN_MPI_JOB_VARS)
        if job_id:
            name, text = job_id
            port = derived_port(_crc(text))
            return Sourced(port, f"{port} = 20000 + crc32({name}={text}) % 10000", name)
    elif launcher is _HYDRA:
        pid = _hydra_proxy_pid() if _mpi_single_node(env, launcher) else None
        if pid is not None:
            port = derived_port(_crc(f"hydra:{pid}"))
            return Sourced(port, f"{port} = 20000 + crc32('hydra:{pid}') % 10000")
        hint = (
            "; MPICH's hydra exports no job id that every rank shares, so a job that spans "
            "nodes (or whose ranks hydra did not start directly) needs MASTER_PORT"
        )
    job_text = env.get("SLURM_JOB_ID")
    if job_text and _slurm_task(env, w):
        step_var, step_text = _first_set(env, _STEP_VARS) or ("SLURM_STEP_ID", "0")
        job, step = _int("SLURM_JOB_ID", job_text), _int(step_var, step_text)
        port = derived_port(10 * job + step % 10)
        source = f"{port} = 20000 + (10 * SLURM_JOB_ID={job} + {step_var}={step} % 10) % 10000"
        return Sourced(port, source, "SLURM_JOB_ID")
    raise DistUsageError("environment variable MASTER_PORT expected, but not set" + hint)


# -- Slurm host lists ---------------------------------------------------------------------------
_TOKEN = re.compile(r"\[(?P<ranges>[^\[\]]*)\]|(?P<text>[^\[\],\s]+)|(?P<comma>,)")
_RANGE = re.compile(r"(?P<lo>\d+)(?:-(?P<hi>\d+))?")
_HostPart: TypeAlias = str | tuple[tuple[str, int], ...]  # text, or ranges (first, last)


def _parse_hostlist(text: str, name: str) -> list[list[_HostPart]]:
    """Split ``a[1-2]b[3],c`` into items of literal text and bracketed ranges."""

    def bad(why: str) -> DistUsageError:
        return DistUsageError(f"{name}={text!r} is not a valid Slurm host list: {why}")

    items: list[list[_HostPart]] = [[]]
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            what = {"[": "unbalanced or nested '['", "]": "']' without '['"}
            raise bad(f"{what.get(text[pos], 'white space')} at position {pos}")
        pos = m.end()
        if m["comma"]:
            items.append([])
        elif m["text"] is not None:
            items[-1].append(m["text"])
        else:
            ranges = []
            for part in m["ranges"].split(","):
                r = _RANGE.fullmatch(part)
                if r is None:
                    raise bad(f"[{m['ranges']}] holds {part!r}, not a number or a range N-M")
                lo, hi = r["lo"], r["hi"] or r["lo"]
                if int(hi) < int(lo):
                    raise bad(f"the range {part!r} runs backwards")
                ranges.append((lo, int(hi)))
            items[-1].append(tuple(ranges))
    items = [item for item in items if item]  # Slurm skips empty items ("a,,b")
    if not items:
        raise bad("no host in it")
    for item in items:
        # As in Slurm, text may stand between brackets (rack[1-2]n[1-4]) but not after the last.
        if len(item) > 1 and isinstance(item[-1], str):
            raise bad(f"text {item[-1]!r} after the last bracket")
    return items


def _expand_part(part: _HostPart) -> Iterator[str]:
    if isinstance(part, str):
        yield part
        return
    for lo, hi in part:
        # Zero padding follows the first number of the range: [08-10] -> 08 09 10.
        for n in range(int(lo), hi + 1):
            yield str(n).zfill(len(lo))


def expand_hostlist(hostlist: str, name: str = "host list") -> list[str]:
    """Expand a Slurm host list: ``node[01-03,07],login`` -> ``node01 node02 node03 node07 login``.

    Several bracket groups in one name expand as Slurm does, the last varying fastest
    (``a[1-2]b[3-4]`` -> ``a1b3 a1b4 a2b3 a2b4``); the padding of each range is that of its
    first number.

    Args:
        hostlist: the compressed list, as in ``SLURM_JOB_NODELIST``.
        name: what to call it in an error message (the variable's name).

    Raises:
        DistUsageError: the list is empty or malformed (unbalanced or nested brackets,
            a range that is not ``N`` or ``N-M`` with ``N <= M``, text after the last bracket).
    """
    hosts: list[str] = []
    for item in _parse_hostlist(hostlist, name):
        hosts.extend("".join(p) for p in itertools.product(*map(_expand_part, item)))
    return hosts


def first_host(hostlist: str, name: str = "host list") -> str:
    """The first host of a Slurm host list, without expanding the rest.

    Raises:
        DistUsageError: the list is empty or malformed (see :func:`expand_hostlist`).
    """
    item = _parse_hostlist(hostlist, name)[0]
    return "".join(next(_expand_part(part)) for part in item)


# -- aiodist-run --------------------------------------------------------------------------------
def _rank_from_host_name(endpoint: str, hostname: str) -> int | None:
    """``K`` when ``hostname`` is ``<prefix>-K`` and the endpoint's host is ``<prefix>-0``."""
    host = endpoint.rsplit(":", 1)[0] if endpoint.count(":") == 1 else endpoint
    prefix = host.split(".", 1)[0]
    if not prefix.endswith("-0"):
        return None
    m = re.fullmatch(re.escape(prefix[:-1]) + r"(\d+)", hostname.split(".", 1)[0])
    return int(m[1]) if m else None


def launcher_default(dest: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The default the cluster gives ``aiodist-run``'s option ``dest``, or ``None``.

    ``PET_<DEST>`` as in torchrun (``PET_NPROC_PER_NODE``, ``PET_MASTER_ADDR``, ...). The node
    rank, when ``PET_NODE_RANK`` is unset, is ``JOB_COMPLETION_INDEX`` (a Kubernetes Indexed
    Job's pod index), or in a pod whose rendezvous host (``PET_RDZV_ENDPOINT`` or
    ``PET_MASTER_ADDR``) is named ``<prefix>-0``, the ``K`` of this pod's host name
    ``<prefix>-K``: an elastic Kubeflow PyTorchJob names its pods ``<job>-worker-K`` and points
    every pod at ``<job>-worker-0`` without giving a node rank.

    Args:
        dest: the option's destination name, e.g. ``"node_rank"``.
        environ: the environment (default ``os.environ``).

    Raises:
        Nothing: a malformed value is reported by the option's own validation.
    """
    env = os.environ if environ is None else environ
    value = env.get(f"PET_{dest.upper()}")
    if value is not None or dest != "node_rank":
        return value
    if env.get(_INDEXED_JOB.rank_var):
        return env[_INDEXED_JOB.rank_var]
    endpoint = _first_set(env, ("PET_RDZV_ENDPOINT", "PET_MASTER_ADDR"))
    if endpoint and env.get("KUBERNETES_SERVICE_HOST"):
        rank = _rank_from_host_name(endpoint[1], socket.gethostname())
        return None if rank is None else str(rank)
    return None
