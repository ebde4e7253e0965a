"""env:// under a real SLURM: slurmctld, slurmd and munged on one node, jobs started with srun.

The cluster lives in a network namespace of its own (its daemons' ports touch nothing
outside), configured by a slurm.conf generated in a temporary directory. Needs root (the
namespace, and Slurm's daemons running as root) and Debian's ``slurm-wlm`` and ``munge``,
which ``scripts/test.sh`` installs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cluster_helpers import HOSTLISTS, WORKER, clean_env, expected_sum

from aiodist._util._cluster import expand_hostlist

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess]

TOOLS = (
    "munged",
    "slurmctld",
    "slurmd",
    "srun",
    "salloc",
    "sbatch",
    "sinfo",
    "scontrol",
    "nsenter",
    "ip",
)


def _require_tools() -> None:
    if os.geteuid() != 0:
        pytest.skip("a SLURM cluster needs root: a network namespace, and daemons run as root")
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if not missing:
        return
    if shutil.which("apt-get") is None:
        pytest.skip(f"{', '.join(missing)} not installed, and no apt-get to install them")
    pytest.fail(
        f"{', '.join(missing)} not installed: apt-get install slurm-wlm munge iproute2 "
        "(scripts/test.sh does)"
    )


@dataclass
class Slurm:
    """A running single-node cluster; ``run`` executes a command inside its namespace."""

    conf: Path
    ns_pid: int
    workdir: Path

    def run(self, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["nsenter", "-t", str(self.ns_pid), "-n", *cmd],
            env=clean_env(SLURM_CONF=str(self.conf), PYTHONUNBUFFERED="1"),
            cwd=self.workdir,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def _wait(what: str, done: object, timeout: float, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout
    while not done():  # type: ignore[operator]
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in logs if p.exists())
            pytest.fail(f"{what} did not happen within {timeout} s\n{tails}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    _require_tools()
    d = tmp_path_factory.mktemp("slurm")
    d.chmod(0o700)  # munged refuses a key or socket in a directory others may write
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    conf = d / "slurm.conf"
    conf.write_text(
        textwrap.dedent(
            f"""\
            ClusterName=aiodist
            SlurmctldHost=localhost
            SlurmUser=root
            SlurmdUser=root
            AuthType=auth/munge
            CredType=cred/munge
            AuthInfo=socket={d}/munge.sock
            StateSaveLocation={d}/state
            SlurmdSpoolDir={d}/spool
            SlurmctldPidFile={d}/slurmctld.pid
            SlurmdPidFile={d}/slurmd.pid
            SlurmctldLogFile={d}/slurmctld.log
            SlurmdLogFile={d}/slurmd.log
            ProctrackType=proctrack/linuxproc
            TaskPlugin=task/none
            SchedulerType=sched/builtin
            SelectType=select/cons_tres
            SelectTypeParameters=CR_CPU
            MpiDefault=none
            ReturnToService=2
            # Four CPUs on a machine that may have two: trust this file, not the hardware.
            SlurmdParameters=config_overrides
            NodeName=localhost CPUs=4 State=UNKNOWN
            PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
            """
        )
    )
    # Slurm 22.05 resolves no name, localhost included, in a namespace whose only addresses
    # are 127.0.0.1 and ::1 ("getaddrinfo() failed"); one more loopback address is enough.
    holder = subprocess.Popen(
        ["unshare", "-n", "sh", "-c", "ip link set lo up && ip addr add 127.0.0.2/8 dev lo "
         "&& echo ready && exec sleep 3600"],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []
    logs = [d / "munged.log", d / "slurmctld.log", d / "slurmd.log", d / "daemons.out"]
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        holder.stdout.close()
        cluster = Slurm(conf, holder.pid, d)
        ns = ["nsenter", "-t", str(holder.pid), "-n"]
        for cmd in (
            ["munged", "-F", "--force", f"--key-file={key}", f"--socket={d}/munge.sock",
             f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log", f"--seed-file={d}/seed"],
            ["slurmctld", "-D", "-i", "-f", str(conf)],
            ["slurmd", "-D", "-f", str(conf), "-N", "localhost"],
        ):  # fmt: skip
            with (d / "daemons.out").open("ab") as out:
                procs.append(subprocess.Popen([*ns, *cmd], stdout=out, stderr=out, cwd=d))
            if cmd[0] == "munged":
                _wait("munged's socket", (d / "munge.sock").exists, 20, logs)

        def idle() -> bool:
            r = cluster.run("sinfo", "-h", "-N", "-o", "%T", timeout=20)
            return r.stdout.strip() == "idle"

        _wait("the node going idle", idle, 60, logs)
        yield cluster
    finally:
        for proc in reversed([*procs, holder]):  # type: ignore[list-item]
            proc.terminate()
        for proc in reversed([*procs, holder]):  # type: ignore[list-item]
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def reports(out: str) -> list[dict[str, object]]:
    return sorted(
        (json.loads(line) for line in out.splitlines()), key=lambda r: int(str(r["rank"]))
    )


def test_srun_ranks_join_through_env(slurm: Slurm) -> None:
    result = slurm.run("srun", "-n", "4", sys.executable, WORKER)
    assert result.returncode == 0, result.stdout + result.stderr
    got = reports(result.stdout)
    assert [r["rank"] for r in got] == [0, 1, 2, 3]
    assert {r["sum"] for r in got} == {expected_sum(4)}
    for r in got:
        env = r["env"]
        assert isinstance(env, dict)
        assert (r["rank_source"], r["world_size_source"]) == (
            f"SLURM_PROCID={r['rank']}",
            "SLURM_NTASKS=4",
        )
        assert r["local_rank"] == int(env["SLURM_LOCALID"])
        assert "MASTER_ADDR" not in env and "MASTER_PORT" not in env
        assert r["master_addr"] == "localhost"
        assert r["master_addr_source"] == "the first host of SLURM_STEP_NODELIST=localhost"
        job, step = int(env["SLURM_JOB_ID"]), int(env["SLURM_STEP_ID"])
        assert r["master_port"] == 20000 + (10 * job + step % 10) % 10000
        assert r["exported_master"] == f"localhost:{r['master_port']}"


def test_concurrent_steps_of_one_job_get_their_own_ports(slurm: Slurm) -> None:
    step = f"srun -n 2 {sys.executable} {WORKER}"
    result = slurm.run("salloc", "-n", "4", "sh", "-c", f"{step} & {step} & wait")
    assert result.returncode == 0, result.stdout + result.stderr
    got = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(got) == 4
    ports = {r["env"]["SLURM_STEP_ID"]: r["master_port"] for r in got}  # type: ignore[index]
    assert len(ports) == 2 and len(set(ports.values())) == 2
    assert all(r["sum"] == expected_sum(2) for r in got)


def test_a_batch_script_without_srun_is_refused(slurm: Slurm) -> None:
    submit = f"{sys.executable} {WORKER}"
    result = slurm.run("sbatch", "--parsable", "-n", "2", "-o", "batch.out", "--wrap", submit)
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip().split(";")[0]
    # Poll the job ourselves: sbatch --wait checks only every few seconds.
    state = ""
    deadline = time.monotonic() + 60
    while "JobState=FAILED" not in state and "JobState=COMPLETED" not in state:
        assert time.monotonic() < deadline, state
        time.sleep(0.1)
        state = slurm.run("scontrol", "-o", "show", "job", job_id, timeout=20).stdout
    assert "JobState=FAILED" in state and "ExitCode=1:0" in state, state
    output = (slurm.workdir / "batch.out").read_text()
    assert (
        "aiodist.errors.DistUsageError: Error initializing aiodist using env:// rendezvous: "
        "SLURM_NTASKS=2 but SLURM_STEP_ID is not set: this process is the batch script, not "
        "one of the 2 tasks; start the ranks with srun"
    ) in output


def test_host_lists_expand_as_scontrol_does(slurm: Slurm) -> None:
    for hostlist, hosts in HOSTLISTS.items():
        result = slurm.run("scontrol", "show", "hostnames", hostlist, timeout=20)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == hosts == expand_hostlist(hostlist)
