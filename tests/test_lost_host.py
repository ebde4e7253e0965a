"""A lost host, not only a lost process: the other nodes of an elastic job go on without it.

Two network namespaces are the hosts (10.99.0.1, which hosts the store, and 10.99.0.2), each
with a launcher of two workers: ``aiodist-run --nnodes=1:2 --restart-policy=failed`` running
``examples/elastic_sgd.py``. At a random step host 1 is lost: its link goes down, and then
every process in it is killed, or (a host that stops answering without dying) only its link
goes down. Two CPU hogs run beside the job. Host 0's workers must shrink past host 1's, finish
with the weights one process computes, and their launcher must exit 0; a node that comes back
is taken in, and its workers admitted at the next admission point.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
from cluster_helpers import clean_env
from netns_helpers import IPV4, Hosts
from proc_helpers import track

from aiodist.testing import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.netns]

EXAMPLE = str(Path(__file__).parents[1] / "examples" / "elastic_sgd.py")
STEPS = 40
#: The workers' peer timeout and the launchers' lost-node timeout (1 s x 4): shorter than the
#: defaults (8 s, 15 s), so that many runs fit in a test; the sequence is the same.
PEER_TIMEOUT = "3"
KEEP_ALIVE = "--rdzv-conf=keep_alive_interval=1,keep_alive_max_attempt=4,last_call_timeout=30"
#: How long a run may take at most (a no-hang guard; a run takes 10 to 20 s beside the hogs).
RUN_TIMEOUT = 120


class Node:
    """One host's launcher; its output lines are collected as they come."""

    def __init__(self, hosts: Hosts, host: int, port: int, *extra: str) -> None:
        args = [
            "--nnodes=1:2",
            "--nproc-per-node=2",
            f"--master-addr={IPV4[0]}",
            f"--master-port={port}",
            "--rdzv-id=lost-host",
            "--restart-policy=failed",
            "--max-restarts=1",
            "--monitor-interval=0.1",
            "--shutdown-timeout=2",
            KEEP_ALIVE,
            EXAMPLE,
            f"--steps={STEPS}",
            "--step-seconds=0.1",
            "--kill-step=-1",
            "--log-steps",
            *extra,
        ]
        self.proc = track(
            subprocess.Popen(
                [*hosts.prefix(host), sys.executable, "-m", "aiodist.run", *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=clean_env(AIODIST_PEER_TIMEOUT=PEER_TIMEOUT),
            )
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream: IO[str], lines: list[str]) -> None:
        lines.extend(line.rstrip("\n") for line in stream)  # (each line as it comes)

    def wait_for(self, text: str, timeout: float = RUN_TIMEOUT) -> None:
        """Until a line of its workers' output holds ``text``."""
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.out):
            assert self.proc.poll() is None or self._any(text), self.report()
            assert time.monotonic() < deadline, f"no {text!r} within {timeout:g} s\n{self.report()}"
            time.sleep(0.02)

    def _any(self, text: str) -> bool:
        for reader in self._readers:
            reader.join(5)
        return any(text in line for line in self.out)

    def finish(self, timeout: float = RUN_TIMEOUT) -> int:
        """Its exit status, once it ended (and its output was read)."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the launcher did not end\n{self.report()}") from None
        for reader in self._readers:
            reader.join(5)
        return self.proc.returncode

    def report(self) -> str:
        return "\n".join(["-- stdout", *self.out, "-- stderr", *self.err])


@pytest.fixture(autouse=True)
def hogs() -> Iterator[None]:
    """Two processes that keep two CPUs busy for the test's length."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield
    for proc in procs:
        proc.kill()
        proc.wait()


def _lose(hosts: Hosts, host: int, kill: bool) -> None:
    """Take ``host`` off the link (no FIN, no RST); with ``kill``, end every process in it."""
    hosts.link(host, up=False)
    if kill:
        pids = subprocess.run(
            ["ip", "netns", "pids", hosts.names[host]], capture_output=True, text=True, check=True
        ).stdout.split()
        subprocess.run(["kill", "-9", *pids], capture_output=True)


def _check_survivors(node: Node) -> None:
    status = node.finish()
    assert status == 0, node.report()
    done = [line for line in node.out if "weights match the reference" in line]
    assert sorted(line.split("]: ", 1)[0] for line in done) == ["[rank0", "[rank1"], node.report()
    assert all(line.endswith("weights match the reference: True") for line in done), done
    assert any("ranks [2, 3] lost" in line for line in node.out), node.report()
    assert any("node 1 was lost: the attempt goes on without it" in e for e in node.err), (
        node.report()
    )


@pytest.mark.parametrize("kill", [True, False], ids=["killed", "silent"])
@pytest.mark.parametrize("run", range(3))
def test_the_other_host_lost_at_a_random_step(hosts: Hosts, kill: bool, run: int) -> None:
    step = random.Random(f"{kill}{run}").randrange(3, STEPS - 3)
    port = free_port()
    node0 = Node(hosts, 0, port)
    node1 = Node(hosts, 1, port)
    node0.wait_for(f"worker 0: step {step} done as rank 0 of 4")
    _lose(hosts, 1, kill)
    _check_survivors(node0)
    if kill:
        assert node1.finish() != 0  # (killed)
    else:
        # Cut off, it loses the store: it stops its workers and fails.
        assert node1.finish() == 1, node1.report()


def test_a_node_that_comes_back_is_taken_in(hosts: Hosts) -> None:
    port = free_port()
    # At their first admission point after the loss the members wait until the world is
    # whole again (--wait-for-replacements): the node that comes back is needed to finish.
    node0 = Node(hosts, 0, port, "--wait-for-replacements")
    Node(hosts, 1, port, "--wait-for-replacements")
    node0.wait_for("worker 0: step 8 done as rank 0 of 4")
    _lose(hosts, 1, kill=True)
    node0.wait_for("ranks [2, 3] lost; now rank 0 of 2")
    hosts.link(1, up=True)
    back = Node(hosts, 1, port, "--wait-for-replacements")
    assert back.finish() == 0, back.report()
    assert node0.finish() == 0, node0.report()
    admitted = [line for line in back.out if "admitted as rank" in line]
    assert len(admitted) == 2, back.report()
    done = [line for line in node0.out + back.out if "weights match the reference" in line]
    assert len(done) == 4 and all(line.endswith(": True") for line in done), done
    assert any("taken into attempt 0 as node 2" in line for line in node0.err), node0.report()
