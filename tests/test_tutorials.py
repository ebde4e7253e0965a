"""Public torch tutorials, ported by the import line, as users run them: none of them calls
``destroy_process_group()``, so every rank leaves as its process ends, while the others may
still be finishing. Each runs several times in a row beside two busy CPUs (where a rank that
exits normally used to be taken for a crash), with 2, 3 and 4 ranks, both event loops,
shared memory and TCP, and every start method. Every run must pass.

``bench/exits.py`` runs the same programs 50 times each and counts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from aiodist.testing import free_port

pytestmark = pytest.mark.multiprocess

TUTORIALS = Path(__file__).parent / "tutorials"
RUNS = 2


@pytest.fixture
def two_cpu_hogs() -> Iterator[None]:
    """Two processes that keep both CPUs of the machine busy while the test runs."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def _command(program: str, world: int, start: str) -> list[str]:
    script = str(TUTORIALS / f"{program}.py")
    if start == "launcher":
        run = [sys.executable, "-m", "aiodist.run", "--standalone", f"--nproc-per-node={world}"]
        return [*run, script]
    return [sys.executable, script, str(world), str(free_port()), start]


def _env(loop: str, shm: bool) -> dict[str, str]:
    return {**os.environ, "AIODIST_LOOP": loop, "AIODIST_SHM": "1" if shm else "0"}


# (program, ranks, event loop, shared memory, how it starts: a multiprocessing start method,
# or the launcher): every program with 2, 3 and 4 ranks, each loop, shared memory and TCP.
CASES = [
    ("ring_allreduce", 4, "uvloop", True, "fork"),
    ("ring_allreduce", 4, "asyncio", False, "fork"),
    ("ring_allreduce", 3, "uvloop", False, "spawn"),
    ("ring_allreduce", 2, "asyncio", True, "forkserver"),
    ("collectives", 4, "asyncio", True, "launcher"),
    ("collectives", 3, "uvloop", False, "launcher"),
    ("collectives", 2, "uvloop", True, "launcher"),
    ("spawn_sgd", 4, "uvloop", False, "spawn"),
    ("spawn_sgd", 3, "asyncio", True, "spawn"),
]


@pytest.mark.parametrize(("program", "world", "loop", "shm", "start"), CASES)
@pytest.mark.usefixtures("two_cpu_hogs")
def test_tutorial_passes_every_run(
    program: str, world: int, loop: str, shm: bool, start: str
) -> None:
    for run in range(RUNS):
        proc = subprocess.run(
            _command(program, world, start),
            env=_env(loop, shm),
            capture_output=True,
            text=True,
            timeout=60,
        )
        what = f"run {run + 1} of {RUNS}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        assert proc.returncode == 0, what
        assert "Error" not in proc.stderr, what
        # Every rank printed its checked result.
        done = {
            "ring_allreduce": f"has data {world * (world + 1) / 2}",
            "collectives": "all collectives gave the documented results",
            "spawn_sgd": "weights match the single-process reference",
        }[program]
        assert proc.stdout.count(done) == world, what
