"""Rank, world size and master from the variables that launchers and clusters set.

The unit tests feed ``read_cluster_env`` and ``env://`` the variables each launcher sets;
the process tests run real ranks (``tests/cluster_worker.py``) with the environment a
Kubernetes controller gives its pods, under ``aiodist-run`` or alone, and check their
all_reduce against numpy. SLURM and MPI run for real in ``test_slurm.py`` and
``test_mpirun.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_helpers import (
    HOSTLISTS,
    LAUNCHER_PREFIXES,
    WORKER,
    check,
    run_reports,
)

import aiodist
from aiodist._util._cluster import (
    VARIABLES,
    expand_hostlist,
    first_host,
    launcher_default,
    read_cluster_env,
)
from aiodist.launcher import parse_args
from aiodist.rendezvous import get_node_local_rank, rendezvous
from aiodist.testing import free_port


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No launcher variable from outside; whatever a test (or env://) sets is undone after."""
    for name in {*VARIABLES, *(k for k in os.environ if k.startswith(LAUNCHER_PREFIXES))}:
        monkeypatch.setenv(name, "")  # recorded, so that teardown restores the original
        monkeypatch.delenv(name)
    yield


# -- Slurm host lists ----------------------------------------------------------------------------
@pytest.mark.parametrize(("hostlist", "hosts"), HOSTLISTS.items())
def test_hostlist_expansion(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts
    assert first_host(hostlist) == hosts[0]


def test_first_host_does_not_expand_the_rest() -> None:
    assert first_host("rack7-n[0000-9999999999],x") == "rack7-n0000"


@pytest.mark.parametrize(
    ("hostlist", "why"),
    [
        ("node[01-", "unbalanced or nested '\\[' at position 4"),
        ("n[1[2]]", "unbalanced or nested '\\[' at position 1"),
        ("n1]", "'\\]' without '\\[' at position 2"),
        ("n[3-1]", "the range '3-1' runs backwards"),
        ("n[a-b]", "\\[a-b\\] holds 'a-b', not a number or a range N-M"),
        ("n[1-2-3]", "holds '1-2-3'"),
        ("n[]", "\\[\\] holds ''"),
        ("n[1-3,]", "\\[1-3,\\] holds ''"),
        ("node[1-3]x", "text 'x' after the last bracket"),
        ("a b", "white space at position 1"),
        ("", "no host in it"),
        (",", "no host in it"),
    ],
)
def test_malformed_hostlists_are_named(hostlist: str, why: str) -> None:
    with pytest.raises(aiodist.DistUsageError) as info:
        expand_hostlist(hostlist, "SLURM_JOB_NODELIST")
    message = f"SLURM_JOB_NODELIST={hostlist!r} is not a valid Slurm host list: "
    assert str(info.value).startswith(message)
    assert info.match(why)


# -- what each launcher sets ---------------------------------------------------------------------
def test_torchrun_variables() -> None:
    job = read_cluster_env(
        {
            "RANK": "3",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "h0",
            "MASTER_PORT": "29500",
        }
    )
    assert (job.rank.value, job.world_size.value, job.local_rank and job.local_rank.value) == (
        3,
        8,
        1,
    )
    assert (job.master_addr.value, job.master_port.value) == ("h0", 29500)
    assert (job.rank.source, job.master_port.source) == ("RANK=3", "MASTER_PORT=29500")


# The variables of one rank of `mpirun -np 4` (Open MPI 4.1.4, Debian 12), as printed by env.
OPEN_MPI_RANK_2 = {
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    "OMPI_MCA_ess_base_jobid": "1082916865",
    "PMIX_NAMESPACE": "1082916865",
    "PMIX_RANK": "2",
}


def test_open_mpi_on_one_node_uses_loopback_and_a_port_from_the_job_id() -> None:
    job = read_cluster_env(OPEN_MPI_RANK_2)
    port = 20000 + zlib.crc32(b"1082916865") % 10000
    assert (job.rank.value, job.world_size.value, job.local_rank and job.local_rank.value) == (
        2,
        4,
        2,
    )
    assert (job.master_addr.value, job.master_port.value) == ("127.0.0.1", port)
    assert job.master_addr.source == (
        "loopback, every rank on this node (OMPI_COMM_WORLD_LOCAL_SIZE=4 == OMPI_COMM_WORLD_SIZE=4)"
    )
    assert job.master_port.source == (
        f"{port} = 20000 + crc32(OMPI_MCA_ess_base_jobid=1082916865) % 10000"
    )
    # Open MPI 5 (PRRTE) names the job only in PMIX_NAMESPACE.
    v5 = {**OPEN_MPI_RANK_2, "PMIX_NAMESPACE": "prterun-vm-4242@1"}
    del v5["OMPI_MCA_ess_base_jobid"]
    assert (
        read_cluster_env(v5).master_port.value == 20000 + zlib.crc32(b"prterun-vm-4242@1") % 10000
    )


def test_mpich_hydra_variables() -> None:
    # `mpiexec.mpich -n 2` (MPICH 4.0.2): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS.
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    job = read_cluster_env({**env, "MASTER_PORT": "4000"})
    assert (job.rank.value, job.world_size.value, job.local_rank and job.local_rank.value) == (
        1,
        2,
        1,
    )
    assert job.master_addr.value == "127.0.0.1"
    # This test process was not started by hydra_pmi_proxy, so no port is derived for it.
    with pytest.raises(aiodist.DistUsageError, match="MPICH's hydra exports no job id"):
        read_cluster_env(env)


# One task of `srun -n 4` in job 12345, step 3 (Slurm 22.05 sets both spellings of the step).
SLURM_TASK_1 = {
    "SLURM_PROCID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_JOB_ID": "12345",
    "SLURM_STEP_ID": "3",
    "SLURM_STEPID": "3",
    "SLURM_STEP_NODELIST": "gpu-a100-[007-009]",
    "SLURM_JOB_NODELIST": "gpu-a100-[001-009]",
    "SLURM_NODELIST": "gpu-a100-[007-009]",
}


def test_slurm_task_derives_the_master_from_the_node_list_and_the_job_id() -> None:
    job = read_cluster_env(SLURM_TASK_1)
    assert (job.rank.value, job.world_size.value, job.local_rank and job.local_rank.value) == (
        1,
        4,
        1,
    )
    assert job.master_addr.value == "gpu-a100-007"  # the step's first node, not the job's
    assert job.master_addr.source == "the first host of SLURM_STEP_NODELIST=gpu-a100-[007-009]"
    assert job.master_port.value == 20000 + (10 * 12345 + 3) % 10000 == 23453
    assert job.master_port.source == (
        "23453 = 20000 + (10 * SLURM_JOB_ID=12345 + SLURM_STEP_ID=3 % 10) % 10000"
    )
    older = {
        k: v for k, v in SLURM_TASK_1.items() if k not in ("SLURM_STEP_NODELIST", "SLURM_NODELIST")
    }
    assert read_cluster_env(older).master_addr.value == "gpu-a100-001"
    only = {k: v for k, v in SLURM_TASK_1.items() if "NODELIST" not in k}
    assert read_cluster_env({**only, "SLURM_NODELIST": "c[3-4]"}).master_addr.value == "c3"
    # Steps of one job differ, consecutive jobs too.
    ports = {
        read_cluster_env(
            {**SLURM_TASK_1, "SLURM_JOB_ID": job_id, "SLURM_STEP_ID": step}
        ).master_port.value
        for job_id in ("12345", "12346")
        for step in ("0", "1", "2")
    }
    assert len(ports) == 6 and all(20000 <= p < 30000 for p in ports)
    # MASTER_ADDR / MASTER_PORT still win.
    job = read_cluster_env({**SLURM_TASK_1, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "1234"})
    assert (job.master_addr.value, job.master_port.value) == ("10.1.2.3", 1234)


def test_a_slurm_batch_script_of_one_task_needs_no_srun() -> None:
    batch = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": "n1",
    }
    job = read_cluster_env(batch)
    assert (job.rank.value, job.world_size.value, job.master_addr.value) == (0, 1, "n1")
    assert job.master_port.value == 20000 + 770


# The pod environments below are the variables the controllers write into the pod spec:
# - Kubeflow PyTorchJob (kubeflow/training-operator v1.9.0, pkg/controller.v1/pytorch/
#   envvar.go setPodEnv, master.go MasterEnvVarGenerator, elastic.go ElasticEnvVarGenerator):
#   MASTER_ADDR = PET_MASTER_ADDR = "<job>-master-0", MASTER_PORT = PET_MASTER_PORT = the
#   master container's port (23456 by default), RANK = PET_NODE_RANK = the pod's index
#   (workers count from 1), WORLD_SIZE = pods * nprocPerNode (1 for "auto"), PET_NNODES =
#   pods, PET_NPROC_PER_NODE = nprocPerNode ("auto" by default); elastic jobs instead get
#   PET_RDZV_ENDPOINT = "<job>-worker-0:<port>", PET_RDZV_BACKEND, PET_NNODES = "MIN:MAX".
# - Kubeflow Trainer v2 (kubeflow/trainer, pkg/runtime/framework/plugins/torch/torch.go
#   EnforceMLPolicy, names in pkg/constants/constants.go): PET_NNODES, PET_NPROC_PER_NODE,
#   PET_NODE_RANK (from the pod's job-completion-index), PET_MASTER_ADDR =
#   "<trainjob>-node-0-0.<trainjob>", PET_MASTER_PORT = 29400; and, as in every Indexed
#   Job's pod, JOB_COMPLETION_INDEX.
# - Indexed Jobs (kubernetes/kubernetes, pkg/controller/job/indexed_job_utils.go
#   addCompletionIndexEnvVariable; job_controller.go sets the pod's hostname to
#   "<job>-<index>"): JOB_COMPLETION_INDEX only.
def pytorchjob_pod(index: int, pods: int, port: int, nproc: str = "auto") -> dict[str, str]:
    per_pod = int(nproc) if nproc.isdigit() else 1
    return {
        "MASTER_ADDR": "127.0.0.1", "PET_MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port), "PET_MASTER_PORT": str(port),
        "RANK": str(index), "PET_NODE_RANK": str(index),
        "WORLD_SIZE": str(pods * per_pod), "PET_NNODES": str(pods),
        "PET_NPROC_PER_NODE": nproc, "PYTHONUNBUFFERED": "1",
    }  # fmt: skip


def trainer_pod(index: int, nodes: int, nproc: int, port: int) -> dict[str, str]:
    return {
        "PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": str(nproc),
        "PET_NODE_RANK": str(index), "JOB_COMPLETION_INDEX": str(index),
        "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port),
    }  # fmt: skip


def test_kubernetes_pod_variables() -> None:
    job = read_cluster_env(pytorchjob_pod(2, 3, 23456))
    assert (job.rank.source, job.world_size.source, job.master_port.value) == (
        "RANK=2", "WORLD_SIZE=3", 23456
    )  # fmt: skip
    job = read_cluster_env(trainer_pod(1, 3, 1, 29400))
    assert (job.rank.source, job.world_size.source) == ("PET_NODE_RANK=1", "PET_NNODES=3")
    assert (job.master_addr.source, job.master_port.source) == (
        "PET_MASTER_ADDR=127.0.0.1", "PET_MASTER_PORT=29400"
    )  # fmt: skip
    indexed = {
        "JOB_COMPLETION_INDEX": "2",
        "WORLD_SIZE": "3",
        "MASTER_ADDR": "train-0.train",
        "MASTER_PORT": "29500",
    }
    job = read_cluster_env(indexed)
    assert (job.rank.source, job.world_size.value, job.master_addr.value) == (
        "JOB_COMPLETION_INDEX=2", 3, "train-0.train"
    )  # fmt: skip


def test_arguments_override_the_environment() -> None:
    env = {**SLURM_TASK_1, "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    job = read_cluster_env(env, rank=0, world_size=2)
    assert (job.rank.source, job.world_size.source) == (
        "the rank argument",
        "the world size argument",
    )


def test_local_rank_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPI_LOCALRANKID", "3")
    assert get_node_local_rank() == 3
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "2")
    assert get_node_local_rank() == 2


# -- wrong set-ups, through env:// ---------------------------------------------------------------
PREFIX = "Error initializing aiodist using env:// rendezvous: "


async def env_error(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> str:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(aiodist.DistUsageError) as info:
        await rendezvous("env://", timeout=5)
    message = str(info.value)
    assert message.startswith(PREFIX)
    return message[len(PREFIX) :]


async def test_malformed_node_list(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {**SLURM_TASK_1, "SLURM_STEP_NODELIST": "node[01-"}
    assert await env_error(monkeypatch, env) == (
        "SLURM_STEP_NODELIST='node[01-' is not a valid Slurm host list: "
        "unbalanced or nested '[' at position 4"
    )


async def test_rank_out_of_range(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {**SLURM_TASK_1, "SLURM_PROCID": "4"}
    assert await env_error(monkeypatch, env) == (
        "rank 4 is out of range for world size 4 (SLURM_PROCID=4, SLURM_NTASKS=4)"
    )
    env = {**OPEN_MPI_RANK_2, "OMPI_COMM_WORLD_RANK": "-1"}
    assert await env_error(monkeypatch, env) == (
        "rank -1 is out of range for world size 4 (OMPI_COMM_WORLD_RANK=-1, OMPI_COMM_WORLD_SIZE=4)"
    )


async def test_malformed_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {**SLURM_TASK_1, "SLURM_NTASKS": "four"}
    assert await env_error(monkeypatch, env) == "SLURM_NTASKS must be an integer, got 'four'"
    env = {**SLURM_TASK_1, "SLURM_JOB_ID": "12345_7"}  # an array job id is not a number
    assert await env_error(monkeypatch, env) == "SLURM_JOB_ID must be an integer, got '12345_7'"


async def test_two_launchers_that_disagree(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {**SLURM_TASK_1, "RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert await env_error(monkeypatch, env) == (
        "RANK=2 and SLURM_PROCID=1 disagree, though both describe a world of 4 processes "
        "(WORLD_SIZE=4, SLURM_NTASKS=4): unset the variables that another launcher left "
        "behind, or pass rank= explicitly"
    )
    env = {**trainer_pod(1, 3, 1, 29400), "JOB_COMPLETION_INDEX": "2"}
    assert (await env_error(monkeypatch, env)).startswith(
        "PET_NODE_RANK=1 and JOB_COMPLETION_INDEX=2 disagree"
    )


def test_launchers_around_this_one_are_not_compared() -> None:
    # srun started 2 tasks, each one a launcher of 4 ranks: different world sizes.
    nested = {
        **SLURM_TASK_1,
        "SLURM_NTASKS": "2",
        "RANK": "6",
        "WORLD_SIZE": "8",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1",
    }
    assert read_cluster_env(nested).rank.value == 6
    # Under torchrun or aiodist-run, their variables describe this process.
    launched = {
        **SLURM_TASK_1,
        "RANK": "3",
        "WORLD_SIZE": "4",
        "TORCHELASTIC_RUN_ID": "j",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1",
    }
    assert read_cluster_env(launched).rank.value == 3
    # mpirun inside an sbatch allocation: the batch script's SLURM values are no task's.
    in_batch = {**OPEN_MPI_RANK_2, "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "9"}
    assert read_cluster_env(in_batch).rank.value == 2


async def test_missing_master(monkeypatch: pytest.MonkeyPatch) -> None:
    multi_node = {**OPEN_MPI_RANK_2, "OMPI_COMM_WORLD_SIZE": "8"}
    assert await env_error(monkeypatch, multi_node) == (
        "environment variable MASTER_ADDR expected, but not set; the 8 ranks of this Open MPI "
        "job run on several nodes (OMPI_COMM_WORLD_SIZE=8, OMPI_COMM_WORLD_LOCAL_SIZE=4), so "
        "set MASTER_ADDR to the host of rank 0 for every rank (mpirun -x MASTER_ADDR=<host> ...)"
    )
    no_list = {k: v for k, v in SLURM_TASK_1.items() if "NODELIST" not in k}
    assert await env_error(monkeypatch, no_list) == (
        "environment variable MASTER_ADDR expected, but not set "
        "(nor SLURM_STEP_NODELIST, SLURM_JOB_NODELIST or SLURM_NODELIST)"
    )
    assert await env_error(monkeypatch, {"JOB_COMPLETION_INDEX": "1", "WORLD_SIZE": "2"}) == (
        "environment variable MASTER_ADDR expected, but not set; in an Indexed Job with a "
        "headless Service, set MASTER_ADDR=<job-name>-0.<service-name>"
    )


async def test_a_batch_script_of_several_tasks_is_not_a_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batch = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "3",
        "SLURM_JOB_ID": "5",
        "SLURM_JOB_NODELIST": "n1",
    }
    assert await env_error(monkeypatch, batch) == (
        "SLURM_NTASKS=3 but SLURM_STEP_ID is not set: this process is the batch script, not "
        "one of the 3 tasks; start the ranks with srun (srun python script.py), or set RANK "
        "and WORLD_SIZE"
    )


async def test_a_pod_meant_for_several_processes_started_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert await env_error(monkeypatch, pytorchjob_pod(1, 2, 23456, nproc="4")) == (
        "WORLD_SIZE=8 counts PET_NPROC_PER_NODE=4 processes on each of PET_NNODES=2 pods, but "
        "this process was started alone (RANK=1, LOCAL_RANK not set); start the pod's command "
        "with aiodist-run, which starts the 4 processes"
    )
    assert await env_error(monkeypatch, trainer_pod(1, 2, 4, 29400)) == (
        "PET_NPROC_PER_NODE=4 asks for a launcher to start the processes of each pod, but this "
        "process was started alone (PET_NODE_RANK=1, PET_NNODES=2); start the pod's command "
        "with aiodist-run, which reads the PET_ variables"
    )


@pytest.mark.both_loops
async def test_env_rendezvous_exports_a_derived_master(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_JOB_ID": "314",
        "SLURM_JOB_NODELIST": "localhost",
    }
    for name, value in batch.items():
        monkeypatch.setenv(name, value)
    store, rank, world_size = await rendezvous("env://", timeout=5)
    async with store:
        assert (rank, world_size) == (0, 1)
        assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("localhost", "23140")
        await store.set("k", b"v")
        assert await store.get("k") == b"v"


# -- aiodist-run ----------------------------------------------------------------------------------
def test_launcher_node_rank_from_kubernetes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "2")
    assert parse_args(["--nnodes=3", "--master-addr=h", "x.py"]).node_rank == 2
    monkeypatch.setenv("PET_NODE_RANK", "1")  # what Kubeflow Trainer sets beats the index
    assert parse_args(["--nnodes=3", "--master-addr=h", "x.py"]).node_rank == 1
    assert parse_args(["--nnodes=3", "--node-rank=0", "--master-addr=h", "x.py"]).node_rank == 0


@pytest.mark.parametrize(
    ("endpoint", "hostname", "rank"),
    [
        ("train-worker-0:23456", "train-worker-3", "3"),  # elastic PyTorchJob
        ("train-worker-0", "train-worker-0", "0"),
        ("t-node-0-0.t:29400", "t-node-0-2", "2"),  # a JobSet's pod names
        ("train-worker-0:23456", "other-worker-3", None),
        ("train-master-1:23456", "train-worker-3", None),
        ("10.0.0.1:23456", "train-worker-3", None),
    ],
)
def test_launcher_node_rank_from_the_pod_name(
    endpoint: str, hostname: str, rank: str | None
) -> None:
    if (
        os.geteuid() != 0
        or subprocess.run(["unshare", "-u", "true"], capture_output=True).returncode
    ):
        pytest.skip("needs root and unshare -u to give a process its own host name")
    code = (
        "import os, socket; socket.sethostname(os.environ['POD']); "
        "from aiodist._util._cluster import launcher_default; print(launcher_default('node_rank'))"
    )
    env = {
        **os.environ,
        "POD": hostname,
        "PET_RDZV_ENDPOINT": endpoint,
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
    }
    out = subprocess.run(
        ["unshare", "-u", sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(rank)
    # Outside Kubernetes the host name means nothing.
    assert launcher_default("node_rank", {"PET_RDZV_ENDPOINT": endpoint}) is None


# -- real ranks with a pod's environment ---------------------------------------------------------
@pytest.mark.multiprocess
def test_pytorchjob_pods_run_the_script_directly() -> None:
    port = free_port()
    envs = [pytorchjob_pod(i, 3, port) for i in range(3)]  # master-0, worker-0, worker-1
    reports = run_reports([[sys.executable, WORKER]] * 3, envs)
    check(reports, 3)
    assert [r["rank_source"] for r in reports] == ["RANK=0", "RANK=1", "RANK=2"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("controller", ["trainer", "indexed-job"])
def test_aiodist_run_in_pods(controller: str) -> None:
    """Two pods of two processes each: aiodist-run takes everything from the pod's variables."""
    port = free_port()
    cmd = [sys.executable, "-m", "aiodist.run", WORKER]
    if controller == "trainer":
        envs = [trainer_pod(i, 2, 2, port) for i in range(2)]
    else:
        # An Indexed Job gives only JOB_COMPLETION_INDEX; the manifest sets the rest.
        envs = [{"JOB_COMPLETION_INDEX": str(i)} for i in range(2)]
        cmd[3:3] = [
            "--nnodes=2",
            "--nproc-per-node=2",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
        ]
    reports = run_reports([cmd, cmd], envs)
    check(reports, 4)
    assert [r["local_rank"] for r in reports] == [0, 1, 0, 1]
    assert {r["master_port"] for r in reports} == {port}


# -- the manifests of examples/kubernetes --------------------------------------------------------
MANIFESTS = Path(__file__).parent.parent / "examples" / "kubernetes"


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] == "PyTorchJob":
        specs = doc["spec"]["pytorchReplicaSpecs"].values()
        return [c for s in specs for c in s["template"]["spec"]["containers"]]
    if doc["kind"] == "TrainJob":
        return [doc["spec"]["trainer"]]
    if doc["kind"] == "Job":
        return list(doc["spec"]["template"]["spec"]["containers"])
    return []


def test_example_manifests_start_aiodist_run() -> None:
    docs = {
        d["kind"]: d for p in MANIFESTS.glob("*.yaml") for d in yaml.safe_load_all(p.read_text())
    }
    assert set(docs) == {"PyTorchJob", "TrainJob", "Job", "Service"}
    for kind in ("PyTorchJob", "TrainJob", "Job"):
        for container in containers(docs[kind]):
            assert container["command"][0] == "aiodist-run"
            assert container["command"][-1] == "/app/data_parallel_sgd.py"
    # The pods that set their own volumes give the ranks a memory-backed /dev/shm.
    pods = [
        s["template"]["spec"] for s in docs["PyTorchJob"]["spec"]["pytorchReplicaSpecs"].values()
    ]
    pods.append(docs["Job"]["spec"]["template"]["spec"])
    for pod in pods:
        memory = [
            v["name"] for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"
        ]
        for container in pod["containers"]:
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert mounts["/dev/shm"] in memory, pod
    # The PyTorchJob operator finds the master's port by this container and port name.
    master = docs["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert master["containers"][0]["name"] == "pytorch"
    assert master["containers"][0]["ports"][0]["name"] == "pytorchjob-port"


def test_indexed_job_manifest_names_pod_0_through_its_service(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    docs = {d["kind"]: d for d in yaml.safe_load_all((MANIFESTS / "indexed-job.yaml").read_text())}
    job, service = docs["Job"], docs["Service"]
    name, pod = job["metadata"]["name"], job["spec"]["template"]["spec"]
    assert service["spec"]["clusterIP"] == "None"
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"] == {"job-name": name}  # the label the Job gives its pods
    assert job["spec"]["completionMode"] == "Indexed"
    # What pod 1's launcher makes of its command line and JOB_COMPLETION_INDEX=1.
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "1")
    cfg = parse_args(pod["containers"][0]["command"][1:])
    assert (cfg.node_rank, cfg.nnodes, cfg.nproc_per_node) == (1, job["spec"]["completions"], 2)
    assert (cfg.master_addr, cfg.master_port) == (f"{name}-0.{pod['subdomain']}", 29500)
