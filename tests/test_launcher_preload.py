"""``aiodist-run --preload``: workers forked from a starter that imported their modules.

The tests start the real launcher as a process with real worker processes
(``tests/preload_worker.py``) and check what the workers saw and how they ended; the last two
drive the launcher's side of the starter (``Starter``) directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cluster_helpers import clean_env
from proc_helpers import track

from aiodist.errors import DistUsageError
from aiodist.launcher import parse_args
from aiodist.launcher._preload import ForkedProcess, Starter

pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).parent
WORKER = str(HERE / "preload_worker.py")
RUN = [sys.executable, "-m", "aiodist.run", "--standalone"]


def launch(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RUN, *args], capture_output=True, text=True, timeout=60, env=clean_env(), cwd=cwd
    )


def reports(stdout: str) -> list[dict[str, object]]:
    """The workers' JSON lines, without the launcher's ``[rankN]: `` prefixes."""
    found = [json.loads(line.split(": ", 1)[1]) for line in stdout.splitlines() if ": {" in line]
    return sorted(found, key=lambda r: (r["rank"], r["restarts"]))


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_preloaded_worker_runs_its_script_as_python_would() -> None:
    done = launch("--nproc-per-node=3", "--preload=numpy,aiodist.sync", WORKER, "report")
    assert done.returncode == 0, done.stderr
    found = reports(done.stdout)
    assert [r["rank"] for r in found] == [0, 1, 2]
    for r in found:
        assert r["preloaded"] == ["aiodist", "aiodist.sync", "numpy"]
        assert r["name"] == "__main__"
        assert r["argv"] == [WORKER, "report"]
        assert r["path0"] == str(HERE)
        assert r["session_leader"] is True
        assert r["stdin"] == ""
    # Forks of one starter (not of the launcher), each with its own random state.
    assert len({r["ppid"] for r in found}) == 1
    assert len({r["random"] for r in found}) == 3


def test_without_preload_a_worker_starts_a_new_python() -> None:
    done = launch("--nproc-per-node=2", WORKER, "report")
    assert done.returncode == 0, done.stderr
    assert [r["preloaded"] for r in reports(done.stdout)] == [[], []]


def test_a_preloaded_module_worker_runs_as_python_m() -> None:
    done = launch(
        "--nproc-per-node=2", "--preload=numpy", "-m", "preload_worker", "report", cwd=HERE
    )
    assert done.returncode == 0, done.stderr
    for r in reports(done.stdout):
        assert r["preloaded"] == ["aiodist", "numpy"]  # the starter is aiodist's own code
        assert r["name"] == "__main__"
        assert r["argv"] == [WORKER, "report"]
        assert r["path0"] == str(HERE)


def test_a_preloaded_worker_that_raises_fails_with_its_traceback() -> None:
    done = launch("--nproc-per-node=1", "--preload=numpy", WORKER, "raise")
    assert done.returncode == 1
    assert "with exit code 1" in done.stderr
    # As python prints it: from the script's frame on, none of the starter's.
    first = f'[rank0]: Traceback (most recent call last):\n[rank0]:   File "{WORKER}", line'
    assert first in done.stderr, done.stderr
    assert "[rank0]: ValueError: boom from rank 0\n" in done.stderr


def test_a_preloaded_worker_killed_by_a_signal_is_reported_so() -> None:
    done = launch("--nproc-per-node=2", "--preload=numpy", WORKER, "sigkill")
    assert done.returncode == 1
    assert "rank 1 (local rank 1 on node 0" in done.stderr
    assert "with signal SIGKILL (9)" in done.stderr


def test_a_failed_preloaded_worker_is_restarted_alone_from_the_same_starter() -> None:
    done = launch(
        "--nproc-per-node=2",
        "--preload=numpy",
        "--restart-policy=failed",
        "--max-restarts=1",
        WORKER,
        "crash-once",
    )
    assert done.returncode == 0, done.stderr
    found = reports(done.stdout)
    assert [(r["rank"], r["restarts"]) for r in found] == [(0, 0), (1, 0), (1, 1)]
    assert len({r["ppid"] for r in found}) == 1
    assert found[1]["pid"] != found[2]["pid"]


def test_a_module_that_cannot_be_preloaded_is_a_usage_error() -> None:
    done = launch("--nproc-per-node=2", "--preload=numpy,no_such_module_here", WORKER, "report")
    assert done.returncode == 2
    assert "--preload=numpy,no_such_module_here: the starter could not import them" in done.stderr
    assert "ModuleNotFoundError: No module named 'no_such_module_here'" in done.stderr
    assert "{" not in done.stdout  # no worker ran


def test_preload_needs_python_workers() -> None:
    with pytest.raises(DistUsageError, match=r"--preload=numpy needs Python workers"):
        parse_args(["--preload=numpy", "--no-python", "/bin/true"])


def start_ready(nproc: int) -> subprocess.Popen[str]:
    """A launcher of ``nproc`` preloaded workers in ``ready`` mode, once they all said so."""
    proc = track(
        subprocess.Popen(
            [*RUN, f"--nproc-per-node={nproc}", "--preload=numpy", WORKER, "ready"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
        )
    )
    assert proc.stdout is not None
    for _ in range(nproc):
        assert proc.stdout.readline().endswith(": ready\n")
    return proc


def readable_bytes(fd: int) -> int:
    """How many bytes the pipe ``fd`` holds, read without taking them."""
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]


def children(pid: int) -> list[int]:
    """The processes ``pid`` started that still have it as parent."""
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_preloaded_workers_and_their_starter_die_with_a_killed_launcher() -> None:
    proc = start_ready(2)
    [starter] = children(proc.pid)
    workers = children(starter)
    assert len(workers) == 2
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in [starter, *workers]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in [starter, *workers])


def test_preloaded_workers_are_stopped_by_the_launchers_signal() -> None:
    proc = start_ready(2)
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    assert err.count("stopped") >= 2 and "with signal SIGTERM (15)" in err, err


@pytest.mark.both_loops
async def test_the_starter_reports_each_workers_exit_status() -> None:
    env = clean_env(RANK="0", AIODIST_RESTART_COUNT="0")
    starter = await Starter.open(["numpy"], env)
    try:
        done = await starter.spawn([sys.executable, "-u", WORKER, "report"], env)
        assert json.loads(await done.stdout.readline())["rank"] == 0
        assert await done.wait() == 0
        killed = await starter.spawn([sys.executable, "-u", WORKER, "ready"], env)
        assert await killed.stdout.readline() == b"ready\n"
        os.kill(killed.pid, signal.SIGKILL)
        assert await killed.wait() == -signal.SIGKILL
        missing = await starter.spawn([sys.executable, "-u", str(HERE / "no_such.py")], env)
        assert await missing.wait() == 2
        assert b"can't open file" in await missing.stderr.read()
        with pytest.raises(ValueError, match="--preload runs Python workers only"):
            await starter.spawn(["/bin/true"], env)
        # Every exit was read, so the starter reaped every worker: no zombie is left.
        await asyncio.sleep(0.2)
        assert children(starter._proc.pid) == []
    finally:
        await starter.close()


async def children_left(starter: Starter, within: float = 10) -> list[int]:
    """The starter's children once none is left, or those left after ``within`` seconds."""
    deadline = time.monotonic() + within
    while children(starter._proc.pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return children(starter._proc.pid)


def wait_until_printed(stdout: asyncio.StreamReader) -> None:
    """Without letting the loop turn (a spawn would resume), wait until the worker's "ready"
    is in its pipe or was read from it already."""
    pipe = stdout._transport.get_extra_info("pipe").fileno()  # type: ignore[attr-defined]

    def printed() -> int:
        return readable_bytes(pipe) + len(stdout._buffer)  # type: ignore[attr-defined]

    deadline = time.monotonic() + 10
    while printed() < len(b"ready\n") and time.monotonic() < deadline:  # (two writes)
        time.sleep(0.01)  # (the loop must not turn)
    assert printed() == len(b"ready\n")


@contextlib.asynccontextmanager
async def bare_starter() -> AsyncIterator[tuple[Starter, dict[str, str]]]:
    """A starter that preloads nothing, and the environment of its workers; closed after."""
    env = clean_env(RANK="0", AIODIST_RESTART_COUNT="0")
    starter = await Starter.open([], env)
    try:
        yield starter, env
    finally:
        await starter.close()


def spawn_ready(starter: Starter, env: dict[str, str]) -> asyncio.Task[ForkedProcess]:
    """Start a worker that prints "ready", then sleeps, as a task of its own."""
    return asyncio.create_task(starter.spawn([sys.executable, "-u", WORKER, "ready"], env))


async def all_starts_answered(starter: Starter, env: dict[str, str]) -> None:
    """Start a worker that ends at once and wait for its end: the starter answers starts in
    order, so every earlier one has been answered, and the answer handled, by then."""
    worker = await starter.spawn([sys.executable, "-u", WORKER, "report"], env)
    assert await worker.wait() == 0


@pytest.mark.both_loops
async def test_a_worker_whose_start_was_cancelled_is_ended_and_reaped() -> None:
    async with bare_starter() as (starter, env):
        spawn = spawn_ready(starter, env)
        while not starter._starting:  # the request is sent once it is registered
            await asyncio.sleep(0)
        spawn.cancel()
        with pytest.raises(asyncio.CancelledError):
            await spawn
        # The starter may not have forked the worker yet: none left now proves nothing.
        await all_starts_answered(starter, env)
        assert await children_left(starter) == []


@pytest.mark.both_loops
async def test_a_start_answered_after_its_spawn_was_cancelled_but_before_it_resumed() -> None:
    # The order uvloop may take: the spawn is cancelled (its wake-up is scheduled), then the
    # starter's answer is read before the spawn resumes. The test reads it at that point itself.
    async with bare_starter() as (starter, env):
        spawn = spawn_ready(starter, env)
        while not starter._starting:  # sent now; its answer cannot have been read yet
            await asyncio.sleep(0)
        [(_, stdout, _)] = starter._starting.values()
        wait_until_printed(stdout)  # then closing its pipes does not end it
        answered, _, _ = select.select([starter._sock], [], [], 10)
        assert answered
        spawn.cancel()
        starter._receive()
        with pytest.raises(asyncio.CancelledError):
            await spawn
        assert await children_left(starter) == []
        assert starter._running == {}


@pytest.mark.both_loops
async def test_a_worker_started_before_its_spawn_was_cancelled_is_ended_and_reaped() -> None:
    # The other order: the starter's answer is read (the start succeeded) and the caller is
    # cancelled before its spawn resumes, so spawn never returns the worker to anyone. The
    # worker has printed by then, so closing its pipes does not end it: spawn must.
    async with bare_starter() as (starter, env):
        spawn = spawn_ready(starter, env)
        while not any(started.done() for started, _, _ in starter._starting.values()):
            await asyncio.sleep(0)
        [(_, stdout, _)] = starter._starting.values()
        wait_until_printed(stdout)
        assert not spawn.done()
        spawn.cancel()
        with pytest.raises(asyncio.CancelledError):
            await spawn
        assert await children_left(starter) == []
        assert starter._running == {}
