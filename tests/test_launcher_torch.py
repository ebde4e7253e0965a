"""Interoperability with torch: torch gloo workers under aiodist-run, aiodist workers under
torch's own ``torchrun``."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cluster_helpers import clean_env

from aiodist.testing import free_port

pytest.importorskip("torch", reason="torch is not installed: the interoperability tests need it")

pytestmark = [pytest.mark.multiprocess, pytest.mark.torch]

HERE = Path(__file__).parent
TORCH_WORKER = str(HERE / "launcher_torch_worker.py")
WORKER = str(HERE / "launcher_worker.py")


def run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=clean_env())


def ranks_of(out: str) -> dict[int, str]:
    return {int(m[1]): m[2] for m in re.finditer(r"^\[rank(\d+)\]: (.*)$", out, re.M)}


def test_torch_gloo_workers_under_aiodist_run() -> None:
    result = run([sys.executable, "-m", "aiodist.run", "--nproc-per-node=2", TORCH_WORKER])
    assert result.returncode == 0, result.stderr[-3000:]
    assert ranks_of(result.stdout) == dict.fromkeys(range(2), "torch attempt=0 sum=3 expected=3")


def test_torch_gloo_workers_restart_cleanly() -> None:
    """torchrun's own restart fails here in most runs (stale gloo keys in its store)."""
    result = run(
        [sys.executable, "-m", "aiodist.run", "--nproc-per-node=2", "--max-restarts=1",
         TORCH_WORKER, "crash-once"]
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert ranks_of(result.stdout) == dict.fromkeys(range(2), "torch attempt=1 sum=3 expected=3")
    assert "attempt 0 failed: rank 1 (node 0) exited with exit code 3" in result.stderr


def test_torch_gloo_workers_forked_from_a_starter_that_imported_torch() -> None:
    result = run(
        [sys.executable, "-m", "aiodist.run", "--nproc-per-node=2", "--max-restarts=1",
         "--preload=torch,torch.distributed", TORCH_WORKER, "crash-once"]
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert ranks_of(result.stdout) == dict.fromkeys(range(2), "torch attempt=1 sum=3 expected=3")


@pytest.mark.parametrize("mode", ["sync-allreduce", "allreduce"])
def test_aiodist_workers_under_torchrun(mode: str) -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torch's torchrun script is not installed next to this python")
    port = free_port()
    # torchrun hosts its own (torch) TCPStore; the aiodist workers join it as clients.
    result = run([torchrun, "--nproc-per-node=2", f"--master-port={port}", WORKER, mode])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("sum=3 expected=3") == 2
