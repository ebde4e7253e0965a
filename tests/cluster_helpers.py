"""Shared by the cluster tests: the worker, a clean environment, running ranks, numpy's sum."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from cluster_worker import contribution

from aiodist._util._cluster import VARIABLES

WORKER = str(Path(__file__).parent / "cluster_worker.py")
#: Variables of launchers and clusters that a test's child must not inherit from outside.
LAUNCHER_PREFIXES = ("PET_", "TORCHELASTIC_", "SLURM_", "OMPI_", "PMI", "MPI_", "AIODIST_")


# What `scontrol show hostnames` of Slurm 22.05 prints for each (test_slurm.py re-checks the
# valid ones against the real scontrol).
HOSTLISTS = {
    "node[01-04,07]": ["node01", "node02", "node03", "node04", "node07"],
    "a[1-2]b[3-4]": ["a1b3", "a1b4", "a2b3", "a2b4"],
    "my-node-[8-10],gpu-a100-[001-003],login": [
        "my-node-8", "my-node-9", "my-node-10", "gpu-a100-001", "gpu-a100-002",
        "gpu-a100-003", "login",
    ],
    "n1,,n2": ["n1", "n2"],
    "x[01-2]": ["x01", "x02"],
    "x[1-02]": ["x1", "x2"],
    "n[009-011]": ["n009", "n010", "n011"],
    "[1-2]": ["1", "2"],
    "a[1-2][3-4]": ["a13", "a14", "a23", "a24"],
    "n[2,1]": ["n2", "n1"],
    "localhost": ["localhost"],
}  # fmt: skip


def expected_sum(world_size: int) -> float:
    """The sum of the all_reduced array, computed by numpy in this process."""
    return float(sum(contribution(r) for r in range(world_size)).sum())


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in VARIABLES and not k.startswith(LAUNCHER_PREFIXES)
    }
    return {**env, **extra}


def run_reports(
    commands: list[list[str]], envs: list[dict[str, str]], timeout: float = 90
) -> list[dict[str, object]]:
    """Run the commands at once, each with its variables; the workers' reports by rank."""
    procs = [
        subprocess.Popen(
            cmd, env=clean_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for cmd, env in zip(commands, envs, strict=True)
    ]
    reports = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err}"
            # aiodist-run prefixes each line with "[rankN]: ".
            reports.extend(json.loads(line.split("]: ", 1)[-1]) for line in out.splitlines())
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return sorted(reports, key=lambda r: int(str(r["rank"])))


def check(reports: list[dict[str, object]], world_size: int) -> None:
    """Every rank reported once, and every all_reduce matched numpy's sum."""
    assert [r["rank"] for r in reports] == list(range(world_size))
    assert {r["world_size"] for r in reports} == {world_size}
    assert {r["sum"] for r in reports} == {expected_sum(world_size)}
