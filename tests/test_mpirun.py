"""env:// under MPI launchers: Open MPI's mpirun and MPICH's mpiexec (hydra), on one node.

The ranks get nothing but what the launcher sets: env:// takes the rank from
``OMPI_COMM_WORLD_RANK`` / ``PMI_RANK``, sees that every rank is local, and derives the
master (loopback, a port from the job's identity). Debian's ``openmpi-bin`` and ``mpich``
provide the launchers; ``scripts/test.sh`` installs them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from cluster_helpers import WORKER, check, clean_env, run_reports

pytestmark = [pytest.mark.mpi, pytest.mark.multiprocess]


def launcher(name: str, package: str) -> list[str]:
    path = shutil.which(name)
    if path is None:
        if shutil.which("apt-get") is None:
            pytest.skip(f"{name} not installed, and no apt-get to install {package}")
        pytest.fail(f"{name} not installed: apt-get install {package} (scripts/test.sh does)")
    return [path]


def open_mpi(np: int) -> list[str]:
    cmd = launcher("mpirun.openmpi", "openmpi-bin")
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")  # Open MPI refuses root without it
    # More ranks than cores is fine here: the ranks mostly wait on each other.
    return [*cmd, "--oversubscribe", "-np", str(np), sys.executable, WORKER]


def test_mpirun_ranks_join_through_env() -> None:
    reports = run_reports([open_mpi(4)], [{}])
    check(reports, 4)
    for r in reports:
        env = r["env"]
        assert isinstance(env, dict)
        assert "MASTER_ADDR" not in env and "MASTER_PORT" not in env
        assert (r["rank_source"], r["world_size_source"]) == (
            f"OMPI_COMM_WORLD_RANK={r['rank']}",
            "OMPI_COMM_WORLD_SIZE=4",
        )
        assert r["local_rank"] == r["rank"]
        assert r["master_addr"] == "127.0.0.1"
        job = env["OMPI_MCA_ess_base_jobid"]
        assert r["master_port"] == 20000 + zlib.crc32(job.encode()) % 10000
        assert r["exported_master"] == f"127.0.0.1:{r['master_port']}"


def test_concurrent_mpirun_jobs_get_their_own_ports(tmp_path: Path) -> None:
    # Each job its own temporary folder: two mpiruns started at once race to create Open
    # MPI's session folder under the same one ("mkdir ... File exists", orte_init fails).
    procs = []
    for job in range(2):
        (tmp_path / str(job)).mkdir()
        env = clean_env(TMPDIR=str(tmp_path / str(job)))
        procs.append(subprocess.Popen(open_mpi(2), env=env, stdout=subprocess.PIPE, text=True))
    outputs = [proc.communicate(timeout=90)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    ports = [{json.loads(line)["master_port"] for line in out.splitlines()} for out in outputs]
    assert all(len(p) == 1 for p in ports) and ports[0] != ports[1]


def test_mpich_ranks_join_through_env() -> None:
    cmd = [*launcher("mpiexec.mpich", "mpich"), "-n", "4", sys.executable, WORKER]
    reports = run_reports([cmd], [{}])
    check(reports, 4)
    for r in reports:
        assert (r["rank_source"], r["world_size_source"]) == (f"PMI_RANK={r['rank']}", "PMI_SIZE=4")
        assert r["local_rank"] == r["rank"]
        assert r["master_addr"] == "127.0.0.1"
        # hydra exports no job id: the port comes from its proxy's pid, shared by every rank.
        assert str(r["master_port_source"]).startswith(
            f"{r['master_port']} = 20000 + crc32('hydra:"
        )
    assert len({r["master_port"] for r in reports}) == 1
