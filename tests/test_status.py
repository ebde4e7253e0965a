"""The live view: ``python -m aiodist.debug status`` names the rank the others wait for, with
its stack, while the job runs; a rank that cannot answer is named as such, in time."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import aiodist
from aiodist.debug import format_status, gather_status
from aiodist.testing import start_world_processes


def stuck_in_user_code(seconds: float) -> None:
    time.sleep(seconds)  # blocks the rank's event loop: nothing of aiodist runs


async def _rank_two_hangs(rank: int, size: int) -> None:
    x = np.ones(2)
    await aiodist.all_reduce(x)  # op #0, on every rank
    if rank == 2:
        stuck_in_user_code(120)
    await aiodist.all_reduce(x)  # op #1: ranks 0 and 1 wait in it for rank 2


def _status(address: tuple[str, int], *extra: str) -> subprocess.CompletedProcess[str]:
    host, port = address
    return subprocess.run(
        [sys.executable, "-m", "aiodist.debug", "status", f"--store={host}:{port}", *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _until(condition: str, address: tuple[str, int]) -> str:
    """The status view once ``condition`` appears in it (ranks take a moment to get there)."""
    for _ in range(100):
        proc = _status(address)
        if proc.returncode == 0 and re.search(condition, proc.stdout):
            return proc.stdout
        # Before the world forms, the view says there is none yet.
        assert proc.returncode == 0 or "holds no world" in proc.stderr, proc.stderr
        time.sleep(0.1)
    raise AssertionError(f"{condition!r} never appeared; last view:\n{proc.stdout}")


@pytest.mark.multiprocess
def test_the_view_names_the_hung_rank_and_shows_its_stack() -> None:
    env = {"AIODIST_STATUS": "1"}
    with start_world_processes(_rank_two_hangs, 3, env=env, timeout=120) as world:
        waiting = r"op #1\) started for [\d.]+ s; waiting on rank 2"
        out = _until(rf"rank 0 .*{waiting}[\s\S]*rank 1 .*{waiting}", world.store_address)
        pids = [p.pid for p in world.procs]
        for rank in (0, 1):
            assert re.search(
                rf"^rank {rank} \(pid {pids[rank]}, 127\.0\.0\.1:\d+\): all_reduce\(shape"
                rf"=\(2,\), dtype=float64, op=SUM\) \(group 0 op #1\) started for [\d.]+ s; waiting on rank 2$",
                out,
                re.MULTILINE,
            ), out
        assert re.search(
            rf"^rank 2 \(pid {pids[2]}, 127\.0\.0\.1:\d+\): no operation in flight; last: "
            r"all_reduce\(shape=\(2,\), dtype=float64, op=SUM\) \(group 0 op #0\) completed$",
            out,
            re.MULTILINE,
        ), out
        # Only the stacks of the rank waited for, and in them where it hangs.
        assert re.findall(r"^stacks of rank (\d+)", out, re.MULTILINE) == ["2"], out
        stacks = out.split(f"stacks of rank 2 (pid {pids[2]}):", 1)[1]
        assert "in stuck_in_user_code" in stacks and "time.sleep(seconds)" in stacks, out
        # The user's main thread first, aiodist's own threads after it.
        threads = re.findall(r"^  thread (\S+):$", stacks, re.MULTILINE)
        assert threads[0] == "MainThread", threads

        # A rank whose process cannot answer at all (stopped) is named, within the deadline.
        os.kill(pids[2], signal.SIGSTOP)
        try:
            proc = _status(world.store_address, "--timeout=1")
        finally:
            os.kill(pids[2], signal.SIGCONT)
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout
        assert re.search(r"^rank 2: no answer within 1 s$", out, re.MULTILINE), out
        assert re.search(rf"^rank 0 .*{waiting}$", out, re.MULTILINE), out


def test_the_view_shows_the_main_thread_first_and_aiodists_threads_last() -> None:
    stacks = {
        "aiodist-loop": '  File "aiodist/_loop_thread.py", line 1, in main\n',
        "ThreadPoolExecutor-0_0": '  File "concurrent/futures/thread.py", line 1, in _worker\n',
        "loader": '  File "train.py", line 3, in load\n',
        "MainThread": '  File "train.py", line 9, in <module>\n',
    }
    entry = {
        "rank": 0,
        "address": "127.0.0.1:1",
        "status": {
            "pid": 1,
            "time": 0.0,
            "ranks": [{"rank": 0, "in_flight": [], "recent": [], "last_error": None}],
            "stacks": stacks,
        },
    }
    out = format_status([entry])
    threads = re.findall(r"^  thread (\S+):$", out, re.MULTILINE)
    assert threads == ["MainThread", "loader", "aiodist-loop", "ThreadPoolExecutor-0_0"], out


async def test_the_view_says_when_the_store_has_no_world() -> None:
    async with await aiodist.TCPStore.create("127.0.0.1", 0, is_master=True) as store:
        with pytest.raises(aiodist.DistError, match="holds no world of the job 'default_pg'"):
            await gather_status(store)


_HANGING_WORKER = """
import asyncio, os, time
import numpy as np
import aiodist

def stuck_in_user_code():
    time.sleep(120)

async def main():
    await aiodist.init_process_group()
    x = np.ones(2)
    await aiodist.all_reduce(x)
    if aiodist.get_rank() == 2:
        stuck_in_user_code()
    await aiodist.all_reduce(x)

asyncio.run(main())
"""


RUN = [sys.executable, "-m", "aiodist.run"]


@pytest.mark.multiprocess
def test_the_launcher_serves_the_view(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(_HANGING_WORKER)
    launcher = subprocess.Popen(
        [
            *RUN,
            "--standalone",
            "--nproc-per-node=3",
            "--status-port=0",
            "--shutdown-grace=1",
            str(script),
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith(("AIODIST_", "MASTER_"))},
    )
    try:
        assert launcher.stderr is not None
        for line in launcher.stderr:
            found = re.search(
                r"live view of the ranks at (http://127\.0\.0\.1:\d+/)\?key=([0-9a-f]{64})", line
            )
            if found:
                break
        else:
            raise AssertionError("the launcher never said where its view is")
        url, key = found.group(1), found.group(2)
        # The job has a secret (the launcher made one up): no key, no view.
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(url, timeout=30)
        for _ in range(100):
            try:
                with urllib.request.urlopen(f"{url}?key={key}", timeout=30) as reply:
                    view = reply.read().decode()
            except urllib.error.HTTPError as exc:
                # 503 until the world has formed, saying so.
                assert exc.code == 503 and "holds no world" in exc.read().decode()
                view = ""
            if view.count("waiting on rank 2") == 2:
                break
            time.sleep(0.1)
        assert re.search(r"^rank 2 \(pid \d+, .*\): no operation in flight", view, re.M), view
        assert "in stuck_in_user_code" in view, view
        with urllib.request.urlopen(f"{url}json?key={key}", timeout=30) as reply:
            entries = json.loads(reply.read())
        assert [e["rank"] for e in entries] == [0, 1, 2]
        assert [len(e["status"]["ranks"][0]["in_flight"]) for e in entries] == [1, 1, 0]
    finally:
        launcher.send_signal(signal.SIGINT)  # rank 2, in time.sleep, is killed after 1 s
        launcher.communicate(timeout=60)


_WILDCARD = """
import asyncio, json, socket, urllib.request
from aiodist.debug._status import STATUS_KEY, register_status
from aiodist.store import HashStore

async def main():
    store = HashStore()
    await register_status(store, 3, None)  # AIODIST_STATUS_HOST="": every interface
    entry = (await store.get(STATUS_KEY)).decode()
    port = int(entry.rsplit(":", 1)[1].rstrip(","))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=10) as reply:
        answered = reply.status
    print(json.dumps([entry, socket.gethostname(), port, answered]))

asyncio.run(main())
"""


def test_an_endpoint_on_every_interface_is_recorded_under_the_host_name() -> None:
    # (A process of its own: the endpoint is started once per process.)
    proc = subprocess.run(
        [sys.executable, "-c", _WILDCARD],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "AIODIST_STATUS_HOST": ""},
    )
    assert proc.returncode == 0, proc.stderr
    entry, hostname, port, answered = json.loads(proc.stdout)
    assert entry == f"3={hostname}:{port},"
    assert answered == 200
