"""bench/gpu_check.py: its dry run exercises the whole script on the CPU."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"


@pytest.mark.multiprocess
def test_dry_run_writes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "gpu.md"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--budget", "100"],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for phase in ["== environment", "== device ceilings", "== correctness", "== all_reduce time"]:
        assert phase in proc.stdout
    assert "cpu x2: 44 passed, 0 failed" in proc.stdout
    page = out.read_text()
    assert "DRY RUN on the CPU" in page
    assert "| cpu | 1 | 22 | 0 |" in page and "| cpu | 2 | 44 | 0 |" in page
    for size in ("| 4096 |", "| 65536 |", "| 1048576 |"):
        assert size in page
    assert "Longest loop stall while timing: cpu x2" in page


def test_without_a_gpu_it_stops_at_once_saying_why(tmp_path: Path) -> None:
    cupy = importlib.util.find_spec("cupy") is not None
    if cupy:
        import cupy as cp

        if cp.cuda.is_available():
            pytest.skip("a GPU is present: the real run is bench/gpu_check.py itself")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "gpu.md")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    expected = "cupy found no CUDA device" if cupy else "cupy is not installed"
    assert f"gpu_check: {expected}" in proc.stderr
    assert "Traceback" not in proc.stderr
