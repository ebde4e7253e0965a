"""The async example runs under the launcher and every rank checks its result."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

EXAMPLE = Path(__file__).parent.parent / "examples" / "async_overlap.py"


def test_async_overlap_example_under_the_launcher() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "aiodist.run", "--standalone", "--nproc-per-node=2", str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    for rank in range(2):
        assert f"[rank{rank}]: rank {rank}/2: 8 buckets averaged and checked" in proc.stdout
