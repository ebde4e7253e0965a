"""aiodist-run with ``--nnodes=MIN:MAX``: the job starts with the nodes that came, takes in a
node that comes later, and goes on without a node that is lost.

Three launchers on this machine (one worker each) meet at one loopback address; the first
to listen there hosts the store. Their workers run steps of an all_reduce until the test
asks them to stop, recording the world size of each step.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import clean_env
from netns_helpers import Hosts
from proc_helpers import track

from aiodist.testing import free_port

pytestmark = pytest.mark.multiprocess

_WORKER = """
import asyncio, os, sys, time
import numpy as np
import aiodist

log, stop = sys.argv[1], sys.argv[2]

async def main():
    await aiodist.init_process_group(timeout=30)
    rank, size = aiodist.get_rank(), aiodist.get_world_size()
    step = 0
    while True:
        # Every rank stops at the same step: the stop file is voted on.
        flag = np.array([float(os.path.exists(stop))])
        await aiodist.all_reduce(flag)
        with open(log, "a") as f:
            f.write(f"{os.environ['GROUP_RANK']} {rank} {size} {step}\\n")
        if flag[0] > 0:
            break
        step += 1
        await asyncio.sleep(0.05)
    await aiodist.destroy_process_group()

asyncio.run(main())
"""


class _Job:
    """One job's launchers, their worker's log and its stop file; ``master`` is the
    rendezvous address, and a ``prefix`` runs a launcher on another host."""

    def __init__(self, tmp_path: Path, master: str = "127.0.0.1", nnodes: str = "2:3") -> None:
        self.worker = tmp_path / "worker.py"
        self.worker.write_text(_WORKER)
        self.log = tmp_path / "steps.log"
        self.stop = tmp_path / "stop"
        self.master, self.nnodes = master, nnodes
        self.port = free_port()

    def first_node(self, prefix: Sequence[str] = ()) -> subprocess.Popen[str]:
        """A launcher that hosts the store: the others start once it listens."""
        proc = self.node(prefix)
        probe = f"import socket; socket.create_connection(({self.master!r}, {self.port}))"
        deadline = time.monotonic() + 60
        while subprocess.run(
            [*prefix, sys.executable, "-c", probe], capture_output=True
        ).returncode:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        return proc

    def node(self, prefix: Sequence[str] = ()) -> subprocess.Popen[str]:
        args = [
            f"--nnodes={self.nnodes}",
            "--nproc-per-node=1",
            f"--master-addr={self.master}",
            f"--master-port={self.port}",
            "--rdzv-id=elastic-test",
            "--monitor-interval=0.1",
            "--max-restarts=2",
            "--rdzv-conf=last_call_timeout=1,keep_alive_interval=0.5,keep_alive_max_attempt=4",
            str(self.worker),
            str(self.log),
            str(self.stop),
        ]
        return track(
            subprocess.Popen(
                [*prefix, sys.executable, "-m", "aiodist.run", *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=clean_env(),
                start_new_session=True,  # (its group: the launcher and its workers)
            )
        )

    def sizes(self) -> list[int]:
        """The world size of every step recorded so far, in order."""
        if not self.log.exists():
            return []
        return [int(line.split()[2]) for line in self.log.read_text().splitlines() if line]

    def wait_for(self, size: int, *procs: subprocess.Popen[str]) -> None:
        """Until a step of a world of ``size`` ranks is recorded (a no-hang guard of 60 s)."""
        self._until(lambda: size in self.sizes(), size, procs)

    def wait_for_next(self, size: int, *procs: subprocess.Popen[str]) -> None:
        """Until the last step recorded is one of a world of ``size`` ranks."""
        self._until(lambda: self.sizes()[-1] == size, size, procs)

    def _until(self, done: Any, size: int, procs: tuple[subprocess.Popen[str], ...]) -> None:
        deadline = time.monotonic() + 60
        while not done():
            for p in procs:
                if p.poll() is not None:
                    raise AssertionError(f"a launcher ended: {p.communicate()}")
            assert time.monotonic() < deadline, f"no world of {size}: {self.sizes()}"
            time.sleep(0.1)

    def finish(self, *procs: subprocess.Popen[str]) -> list[tuple[int, str]]:
        self.stop.touch()
        outcomes = []
        for p in procs:
            _, err = p.communicate(timeout=60)
            outcomes.append((p.returncode, err))
        return outcomes


def test_a_node_that_comes_later_is_taken_in(tmp_path: Path) -> None:
    job = _Job(tmp_path)
    first = [job.first_node(), job.node()]
    # MIN=2 came: after the last call (1 s) they start without waiting for a third.
    job.wait_for(2, *first)
    third = job.node()
    job.wait_for(3, *first, third)
    outcomes = job.finish(*first, third)
    for rc, err in outcomes:
        assert rc == 0, err
        assert "restart" not in err, err
    for _, err in outcomes[:2]:
        assert "nodes are waiting to join: the nodes meet again" in err, err
    assert "attempt 0 started without this node: waiting for the next" in outcomes[2][1]
    sizes = job.sizes()
    assert sizes[0] == 2 and sizes[-1] == 3 and sorted(set(sizes)) == [2, 3]
    # The last step, on every rank of the new world: nodes 0-2, ranks 0-2.
    last = [line.split() for line in job.log.read_text().splitlines()[-3:]]
    assert sorted(int(node) for node, _, _, _ in last) == [0, 1, 2]
    assert sorted(int(rank) for _, rank, _, _ in last) == [0, 1, 2]


def test_the_others_go_on_without_a_lost_node(tmp_path: Path) -> None:
    job = _Job(tmp_path)
    nodes = [job.first_node(), job.node(), job.node()]
    job.wait_for(3, *nodes)
    os.killpg(nodes[2].pid, signal.SIGKILL)  # a launcher and its worker, without a word
    nodes[2].communicate()
    survivors = nodes[:2]
    job.wait_for_next(2, *survivors)
    for rc, err in job.finish(*survivors):
        assert rc == 0, err
        assert "restarting the workers (1 of 2 restarts left)" in err, err
    last = [line.split() for line in job.log.read_text().splitlines()[-2:]]
    assert sorted(int(rank) for _, rank, _, _ in last) == [0, 1]
    assert all(int(size) == 2 for _, _, size, _ in last)


def test_a_silent_node_is_left_behind(tmp_path: Path) -> None:
    job = _Job(tmp_path)
    nodes = [job.first_node(), job.node(), job.node()]
    job.wait_for(3, *nodes)
    # Only the launcher stops: its worker runs on, so nothing but the launcher's silence (its
    # heartbeats stop) tells the others.
    os.kill(nodes[2].pid, signal.SIGSTOP)
    try:
        survivors = nodes[:2]
        job.wait_for_next(2, *survivors)
        outcomes = job.finish(*survivors)
    finally:
        os.killpg(nodes[2].pid, signal.SIGKILL)
        _, silent = nodes[2].communicate()
    # (Nodes rank by arrival: the second and third launchers may have come in either order.)
    node = re.search(r"attempt 0: node (\d) of 3", silent)
    assert node is not None, silent
    for rc, err in outcomes:
        assert rc == 0, err
        assert f"node {node[1]} was lost" in err, err
        assert "restarting the workers (1 of 2 restarts left)" in err, err


@pytest.mark.netns
def test_min_max_across_hosts(three_hosts: Hosts, tmp_path: Path) -> None:
    # Launchers on three hosts (network namespaces on a bridge), no variable set: the job
    # starts with two, takes in the third, and goes on with two when the third is lost.
    job = _Job(tmp_path, master=three_hosts.addresses[0], nnodes="2:3")
    first = [job.first_node(three_hosts.prefix(0)), job.node(three_hosts.prefix(1))]
    job.wait_for(2, *first)
    third = job.node(three_hosts.prefix(2))
    job.wait_for(3, *first, third)
    os.killpg(third.pid, signal.SIGKILL)
    third.communicate()
    job.wait_for_next(2, *first)
    for rc, err in job.finish(*first):
        assert rc == 0, err
        assert "nodes are waiting to join: the nodes meet again" in err, err
        assert "restarting the workers (1 of 2 restarts left)" in err, err
    last = [line.split() for line in job.log.read_text().splitlines()[-2:]]
    assert sorted(int(rank) for _, rank, _, _ in last) == [0, 1]
    assert all(int(size) == 2 for _, _, size, _ in last)
