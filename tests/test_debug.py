"""The flight recorder, its dumps (on demand, on a timeout, on SIGUSR1), the analysis CLI and
monitored_barrier's report of missing ranks."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aiodist
import aiodist.debug
from aiodist.errors import DistTimeoutError, DistUsageError
from aiodist.testing import run_world, run_world_processes

AR4 = "all_reduce(shape=(4,), dtype=float32, op=SUM)"


async def acli(*paths: Path) -> str:
    """Run the CLI from a running loop (a blocking subprocess call would fight the loop over
    its child)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "aiodist.debug", *map(str, paths), stdout=subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0
    return out.decode()


def cli(*paths: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "aiodist.debug", *map(str, paths)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return done.stdout


@pytest.mark.both_loops
@pytest.mark.parametrize("transport", ["tcp", "local"])
async def test_recorder_holds_the_ops_in_order(transport: str) -> None:
    async def fn(rank: int, size: int) -> dict[str, Any]:
        x = np.ones(4, np.float32)
        await aiodist.all_reduce(x)
        await aiodist.broadcast(np.zeros((2, 3), np.int64), 1)
        await aiodist.all_gather_object([None, None], rank)
        if rank == 0:
            await aiodist.send(np.ones(3), 1, tag=7)
        else:
            await aiodist.recv(np.empty(3), 0, tag=7)
        await aiodist.barrier()
        return aiodist.debug.dump()

    dumps = await run_world(fn, 2, timeout=20, transport=transport)  # type: ignore[arg-type]
    for rank, d in enumerate(dumps):
        assert d["rank"] == rank and d["world_size"] == 2 and d["ops_recorded"] == 5
        ops = d["ops"]
        assert [(o["op"], o["seq"], o["p2p"]) for o in ops] == [
            ("all_reduce", 0, False),
            ("broadcast", 1, False),
            ("all_gather_object", 2, False),  # two sequence numbers: 2 and 3
            ("send" if rank == 0 else "recv", 7, True),
            ("barrier", 4, False),
        ]
        assert [o["call"] for o in ops] == [
            AR4,
            "broadcast(shape=(2, 3), dtype=int64, src=1)",
            "all_gather_object()",
            "send" if rank == 0 else "recv",
            "barrier()",
        ]
        for o in ops[:-1]:  # the barrier is still running while it dumps... or done
            assert o["state"] == "completed" and o["error"] is None
            assert o["queued"] <= o["started"] <= o["ended"]
            assert 0 <= o["duration_s"] < 10
            assert o["peers"] == [0, 1] and o["group"] == 0


async def test_ring_keeps_the_last_n(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIODIST_FR_BUFFER_SIZE", "3")

    async def fn(rank: int, size: int) -> dict[str, Any]:
        for _ in range(10):
            await aiodist.all_reduce(np.ones(4, np.float32))
        return aiodist.debug.dump()

    (d,) = await run_world(fn, 1, timeout=20)
    assert d["ops_recorded"] == 10
    assert [o["seq"] for o in d["ops"]] == [7, 8, 9]
    monkeypatch.setenv("AIODIST_FR_BUFFER_SIZE", "zero")  # logged, the default is kept
    (d,) = await run_world(fn, 1, timeout=20)
    assert len(d["ops"]) == 10


async def test_dump_on_timeout_and_the_cli_names_the_rank_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIODIST_FR_DUMP_DIR", str(tmp_path))
    # The SIGUSR1 dump is tested in real processes below; a handler on pytest's own loop
    # would outlive the test.
    monkeypatch.setattr(aiodist.debug, "install_signal_handler", lambda: False)

    async def fn(rank: int, size: int) -> str:
        group = await aiodist.new_group(timeout=1.0)
        await aiodist.all_reduce(np.ones(2), group=group)
        if rank == 1:  # never calls the second all_reduce
            await asyncio.sleep(3.0)
            aiodist.debug.dump(tmp_path / "rank1.json")
            return "skipped"
        with pytest.raises(DistTimeoutError) as info:
            await aiodist.all_reduce(np.ones(4, np.float32), group=group)
        return str(info.value)

    got = await run_world(fn, 2, timeout=20)
    assert "did not complete within the group timeout of 1 s" in got[0]
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert rank0["ops"][-1]["call"] == AR4
    assert rank0["ops"][-1]["state"] == "started"  # dumped as it timed out
    assert await acli(tmp_path / "rank0.json", tmp_path / "rank1.json") == (
        f"group 1: op #1 {AR4} is the first op not completed by every rank\n"
        "group 1: behind: rank 1 never called op #1\n"
        "  rank 0: started\n"
        "  rank 1: not called; last op #0 all_reduce(shape=(2,), dtype=float64, op=SUM) "
        "completed\n"
    )


async def test_cli_reports_mismatched_ops(tmp_path: Path) -> None:
    async def fn(rank: int, size: int) -> None:
        x = np.ones(4, np.float32)
        await aiodist.all_reduce(x)
        with pytest.raises(DistUsageError):
            await (aiodist.all_reduce(x) if rank == 0 else aiodist.broadcast(x, 0))
        aiodist.debug.dump(tmp_path / f"rank{rank}.json")

    await run_world(fn, 2, timeout=20)
    lines = (await acli(tmp_path / "rank0.json", tmp_path / "rank1.json")).splitlines()
    bc = "broadcast(shape=(4,), dtype=float32, src=0)"
    assert lines[0] == f"group 0: mismatch at op #1: rank 0 called {AR4}; rank 1 called {bc}"
    assert lines[1] == f"group 0: op #1 {AR4} is the first op not completed by every rank"
    assert lines[2].startswith("  rank 0: failed (DistUsageError: collective mismatch: rank 0")
    assert lines[3].startswith("  rank 1: failed (DistUsageError: collective mismatch: rank 1")
    assert len(lines) == 4


def test_cli_help_lists_the_status_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "aiodist.debug", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert out.startswith(
        "usage: python -m aiodist.debug DUMP.json [DUMP.json ...]\n"
        "       python -m aiodist.debug status [--store HOST:PORT] ...\n"
    ), out
    assert "\ncommands:\n  status      the live view of a running job" in out, out


async def dump_on_sigusr1(rank: int, size: int) -> dict[str, Any]:
    """Run a few ops, then signal this process; the handler init installed writes the dump."""
    for _ in range(3):
        await aiodist.all_reduce(np.ones(4, np.float32))
    await aiodist.barrier()
    path = Path(os.environ["AIODIST_FR_DUMP_DIR"]) / f"rank{rank}.json"
    os.kill(os.getpid(), signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while not path.exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return json.loads(path.read_text())


@pytest.mark.multiprocess
def test_sigusr1_dumps_every_rank(tmp_path: Path) -> None:
    dumps = run_world_processes(
        dump_on_sigusr1, 2, timeout=60, env={"AIODIST_FR_DUMP_DIR": str(tmp_path)}
    )
    assert [d["rank"] for d in dumps] == [0, 1]
    assert dumps[0]["pid"] != dumps[1]["pid"]
    assert [o["op"] for o in dumps[1]["ops"]] == ["all_reduce"] * 3 + ["barrier"]
    assert cli(tmp_path / "rank0.json", tmp_path / "rank1.json") == (
        "group 0: all ranks completed op #3\n"
    )


def test_signal_handler_is_opt_in(tmp_path: Path) -> None:
    assert signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None)  # not at import
    try:
        assert aiodist.debug.install_signal_handler(tmp_path)
        assert getattr(signal.getsignal(signal.SIGUSR1), "_aiodist", False)
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    os.environ.pop("AIODIST_FR_DUMP_DIR", None)
    with pytest.raises(DistUsageError, match="needs a directory or AIODIST_FR_DUMP_DIR"):
        aiodist.debug.install_signal_handler()


@pytest.mark.parametrize(
    ("wait_all", "arriving", "named"),
    [(True, [], "Ranks 1, 2"), (False, [], "Rank 1"), (False, [1], "Rank 2")],
)
async def test_monitored_barrier_names_missing_ranks(
    wait_all: bool, arriving: list[int], named: str
) -> None:
    async def fn(rank: int, size: int) -> str:
        if rank == 0:
            with pytest.raises(DistTimeoutError) as info:
                await aiodist.monitored_barrier(timeout=0.5, wait_all_ranks=wait_all)
            return str(info.value)
        if rank in arriving:
            with pytest.raises(aiodist.DistError):
                await aiodist.monitored_barrier(timeout=5)
        else:
            await asyncio.sleep(1.5)
        return ""

    got = await run_world(fn, 3, timeout=20)
    assert got[0] == (
        f"monitored_barrier: rank 0: {named} failed to pass monitoredBarrier within 0.5 s"
    )
