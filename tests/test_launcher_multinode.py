"""aiodist-run with several nodes: one world from two launchers, and a node lost mid-run.

The loopback tests run two launchers on one machine. The ``netns`` tests build two "hosts":
two network namespaces joined by a veth pair, 10.99.0.1/24 and 10.99.0.2/24 (addresses that
exist only inside those namespaces), each running its own launcher; the test creates and
removes them, and skips where the machine does not allow it.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import clean_env
from netns_helpers import IPV4, Hosts
from proc_helpers import track

from aiodist.testing import free_port

pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).parent
WORKER = str(HERE / "launcher_worker.py")
RUN = [sys.executable, "-m", "aiodist.run"]
FAST_LOSS = "--rdzv-conf=keep_alive_interval=0.5,keep_alive_max_attempt=4"


def node(prefix: list[str], *args: str) -> subprocess.Popen[str]:
    return track(
        subprocess.Popen(
            [*prefix, *RUN, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
            cwd=HERE.parent,
        )
    )


def wait_ready(proc: subprocess.Popen[str], n: int) -> None:
    assert proc.stdout is not None
    ready = 0
    while ready < n:
        line = proc.stdout.readline()
        assert line, "the launcher's stdout closed before every worker was ready"
        ready += line.rstrip().endswith(": ready")


def ranks_of(out: str) -> dict[int, str]:
    return {int(m[1]): m[2] for m in re.finditer(r"^\[rank(\d+)\]: (.*)$", out, re.M)}


# -- two launchers on one machine -----------------------------------------------------------------
def test_two_nodes_on_loopback_form_one_world() -> None:
    port = str(free_port())
    common = ["--nnodes=2", f"--master-port={port}", "--nproc-per-node=2"]
    # Node 1 may start first: it waits for node 0's store.
    n1 = node([], *common, "--node-rank=1", WORKER, "allreduce")
    time.sleep(0.3)
    n0 = node([], *common, "--node-rank=0", WORKER, "allreduce")
    out0, err0 = n0.communicate(timeout=60)
    out1, err1 = n1.communicate(timeout=60)
    assert (n0.returncode, n1.returncode) == (0, 0), err0 + err1
    assert ranks_of(out0) == {0: "sum=10 expected=10", 1: "sum=10 expected=10"}
    assert ranks_of(out1) == {2: "sum=10 expected=10", 3: "sum=10 expected=10"}


def test_nodes_agree_on_ranks_with_different_sizes() -> None:
    port = str(free_port())
    n0 = node([], "--nnodes=2", f"--master-port={port}", "--nproc-per-node=1", WORKER, "env")
    n1 = node(
        [], "--nnodes=2", "--node-rank=1", f"--master-port={port}", "--nproc-per-node=3",
        WORKER, "env",
    )  # fmt: skip
    envs = {}
    for proc in (n0, n1):
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        envs |= {r: json.loads(v) for r, v in ranks_of(out).items()}
    assert sorted(envs) == [0, 1, 2, 3]
    assert [envs[r]["GROUP_RANK"] for r in range(4)] == ["0", "1", "1", "1"]
    assert [envs[r]["LOCAL_RANK"] for r in range(4)] == ["0", "0", "1", "2"]
    assert {envs[r]["WORLD_SIZE"] for r in range(4)} == {"4"}
    assert [envs[r]["LOCAL_WORLD_SIZE"] for r in range(4)] == ["1", "3", "3", "3"]
    assert {envs[r]["GROUP_WORLD_SIZE"] for r in range(4)} == {"2"}


def test_duplicate_node_rank_is_refused() -> None:
    port = str(free_port())
    args = ["--nnodes=3", f"--master-port={port}", "--rdzv-conf=join_timeout=20", WORKER, "env"]
    n0 = node([], *args)
    a = node([], "--node-rank=1", *args)
    time.sleep(0.5)
    b = node([], "--node-rank=1", *args)
    _out, err = b.communicate(timeout=60)
    for proc in (n0, a):
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert b.returncode == 2
    assert "another launcher already joined run 'none' as node 1" in err


def test_join_timeout_names_missing_nodes() -> None:
    port = str(free_port())
    n0 = node(
        [], "--nnodes=3", f"--master-port={port}", "--rdzv-conf=join_timeout=1", WORKER, "env"
    )
    _out, err = n0.communicate(timeout=60)
    assert n0.returncode == 1
    assert f"nodes [1, 2] did not join run 'none' at 127.0.0.1:{port} within 1 s" in err


def test_unreachable_node0_is_an_error() -> None:
    port = str(free_port())
    proc = node(
        [], "--nnodes=2", "--node-rank=1", f"--master-port={port}",
        "--rdzv-conf=join_timeout=1", WORKER, "env",
    )  # fmt: skip
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert f"127.0.0.1:{port}" in err


def test_failure_on_one_node_stops_the_other_and_restarts_both() -> None:
    port = str(free_port())
    common = ["--nnodes=2", f"--master-port={port}", "--nproc-per-node=2", "--max-restarts=1"]
    n0 = node([], *common, WORKER, "crash-once", "3")
    n1 = node([], *common, "--node-rank=1", WORKER, "crash-once", "3")
    out0, err0 = n0.communicate(timeout=60)
    out1, err1 = n1.communicate(timeout=60)
    assert (n0.returncode, n1.returncode) == (0, 0), err0 + err1
    assert ranks_of(out0) == {0: "attempt=1 sum=10", 1: "attempt=1 sum=10"}
    assert ranks_of(out1) == {2: "attempt=1 sum=10", 3: "attempt=1 sum=10"}
    for err in (err0, err1):
        assert "attempt 0 failed: rank 3 (node 1) exited with exit code 3; restarting" in err


@pytest.mark.parametrize(
    ("failing", "where"), [(1, "local rank 0 on node 1"), (0, "local rank 0 on node 0")]
)
def test_failure_summary_reaches_every_node(failing: int, where: str) -> None:
    port = str(free_port())
    common = ["--nnodes=2", f"--master-port={port}", "--shutdown-timeout=2"]
    n0 = node([], *common, WORKER, "fail", str(failing), "9")
    n1 = node([], *common, "--node-rank=1", WORKER, "fail", str(failing), "9")
    _out0, err0 = n0.communicate(timeout=60)
    _out1, err1 = n1.communicate(timeout=60)
    assert (n0.returncode, n1.returncode) == (1, 1)
    pattern = rf"root cause: rank {failing} \({where}, pid \d+\) failed first, with exit code 9"
    for err in (err0, err1):
        assert re.search(pattern, err), err
        assert "failing on purpose" in err


def test_signalled_node_stops_the_job_without_restart() -> None:
    port = str(free_port())
    common = ["--nnodes=2", f"--master-port={port}", "--max-restarts=2"]
    n0 = node([], *common, WORKER, "signals")
    n1 = node([], *common, "--node-rank=1", WORKER, "signals")
    wait_ready(n0, 1)
    wait_ready(n1, 1)
    n1.send_signal(signal.SIGTERM)
    _out1, _err1 = n1.communicate(timeout=60)
    _out0, err0 = n0.communicate(timeout=60)
    assert (n0.returncode, n1.returncode) == (1, 128 + signal.SIGTERM)
    assert "root cause: the launcher of node 1 was stopped by signal SIGTERM (15)" in err0
    assert "restarting" not in err0


# -- two hosts: network namespaces joined by a veth pair (netns_helpers.hosts) -------------------
def _common(nproc: int = 2) -> list[str]:
    return [
        "--nnodes=2", f"--master-addr={IPV4[0]}", "--master-port=29400",
        f"--nproc-per-node={nproc}", FAST_LOSS,
    ]  # fmt: skip


@pytest.mark.netns
def test_two_hosts_form_one_world(hosts: Hosts) -> None:
    host_a, host_b = hosts.prefix(0), hosts.prefix(1)
    n1 = node(host_b, *_common(), "--node-rank=1", WORKER, "allreduce")
    n0 = node(host_a, *_common(), "--node-rank=0", WORKER, "allreduce")
    out0, err0 = n0.communicate(timeout=60)
    out1, err1 = n1.communicate(timeout=60)
    assert (n0.returncode, n1.returncode) == (0, 0), err0 + err1
    assert ranks_of(out0) == {0: "sum=10 expected=10", 1: "sum=10 expected=10"}
    assert ranks_of(out1) == {2: "sum=10 expected=10", 3: "sum=10 expected=10"}


@pytest.mark.netns
@pytest.mark.parametrize(
    ("killed", "mode"), [(1, "hang"), (0, "hang"), (1, "signals"), (0, "signals")]
)
def test_killed_node_makes_the_other_exit(hosts: Hosts, killed: int, mode: str) -> None:
    """``hang`` workers run collectives across the nodes; ``signals`` workers only sleep, so
    only the launchers' heartbeats can notice the lost node."""
    host_a, host_b = hosts.prefix(0), hosts.prefix(1)
    n0 = node(host_a, *_common(), "--shutdown-timeout=2", WORKER, mode)
    n1 = node(host_b, *_common(), "--shutdown-timeout=2", "--node-rank=1", WORKER, mode)
    wait_ready(n0, 2)
    wait_ready(n1, 2)
    victim, survivor = (n1, n0) if killed == 1 else (n0, n1)
    t0 = time.monotonic()
    # SIGKILL: the launcher cannot say goodbye; its workers die with it (parent-death signal).
    victim.kill()
    victim.communicate(timeout=30)
    _out, err = survivor.communicate(timeout=60)
    elapsed = time.monotonic() - t0
    assert survivor.returncode == 1, err
    assert elapsed < 30
    if mode == "signals" and killed == 1:
        assert "node 1 stopped sending heartbeats" in err
        # The summary says what a fixed node count means, and what would let the job go on.
        assert "root cause: node 1 was lost" in err, err
        assert "a job of --nnodes=2 runs on exactly that many nodes and ends when one" in err
        assert "with --nnodes=MIN:MAX and --restart-policy=failed the other nodes go on" in err
    elif mode == "signals":
        assert f"the store at {IPV4[0]}:29400 (node 0)" in err
    else:
        # A worker noticed its dead peer (or the launcher noticed the node) first.
        assert "aiodist-run: the job failed" in err or "(node 0)" in err or "node 1 stopped" in err


@pytest.mark.parametrize("node_rank", [0, 1])
def test_signal_while_waiting_for_other_nodes(node_rank: int) -> None:
    # Node 0 waits for node 1 to join; node 1 waits to reach node 0's store.
    proc = node(
        [], "--nnodes=2", f"--node-rank={node_rank}", f"--master-port={free_port()}",
        WORKER, "env",
    )  # fmt: skip
    time.sleep(1.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert time.monotonic() - t0 < 5


async def test_a_worker_failing_while_the_node_polls_the_store_is_a_failure(
    tmp_path: Path,
) -> None:
    """The last worker of a node fails while the launcher waits for a store reply: the
    attempt ends with that failure (it once ended as a success, and the node then waited
    forever for the others to finish)."""
    import io

    from aiodist import launcher

    script = tmp_path / "fail.py"
    # Still running at the launcher's first look, so the exit falls in a store request.
    script.write_text("import time\ntime.sleep(0.5)\nraise SystemExit(9)\n")
    cfg = launcher.parse_args(["--nnodes=2", "--master-port=1", str(script)])
    run = launcher._Launcher(cfg, io.BytesIO(), io.BytesIO())  # type: ignore[arg-type]

    class SlowStore:
        """Answers only once the worker has exited (a store reply slower than the worker)."""

        left: frozenset[int] = frozenset()  # (no node was left behind)

        async def _reply(self) -> None:
            while run._group is not None and run._group.running():
                await asyncio.sleep(0.01)

        async def beat(self) -> None:
            await self._reply()

        async def failure(self, attempt: int) -> None:
            await self._reply()

        async def publish_failure(self, attempt: int, failure: Any) -> Any:
            return failure

        async def mark(self, attempt: int, name: str) -> None:
            raise AssertionError(f"the attempt was taken for a success ({name})")

    outcome = await asyncio.wait_for(run._run_attempt(SlowStore(), 0), 30)  # type: ignore[arg-type]
    assert outcome.failure is not None and outcome.failure.exitcode == 9
