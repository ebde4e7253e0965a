"""A host that vanishes is noticed within 10 s; a rank that is merely busy or stopped is not.

Vanishing is a veth link taken down between two network namespaces: no FIN, no RST, as when a
host loses power or a switch port dies. Every rank raises DistNetworkError naming the rank
that went, whichever side hosts the store. A rank that holds the GIL for longer than the peer
timeout, or is stopped (SIGSTOP) for a while, raises nothing: its kernel keeps answering.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netns_helpers import IPV4, Hosts

from aiodist.testing import free_port

WORKER = Path(__file__).with_name("vanish_worker.py")
#: The store's port inside the test's own network namespaces (nothing else listens there).
PORT = 29533
#: What the library promises by default.
NOTICED_WITHIN = 10.0


class Rank:
    """A worker process and the JSON events it prints."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )

    def event(self, timeout: float = 30) -> dict[str, object]:
        assert self.proc.stdout is not None
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            # The workers print whole lines: once the pipe is readable, readline returns.
            if not select.select([self.proc.stdout], [], [], end - time.monotonic())[0]:
                break
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(
                    f"the rank ended: {self.proc.stderr.read() if self.proc.stderr else ''}"
                )
            if line.startswith("{"):
                return json.loads(line)
        raise AssertionError("no event in time")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()  # waits, and closes the pipes


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIODIST_", "MASTER_"))}
    return {**env, **extra}


@pytest.mark.netns
@pytest.mark.parametrize(("host_rank", "vanishing"), [(0, 1), (0, 0), (1, 0)])
def test_a_vanished_host_is_noticed_by_every_rank(
    hosts: Hosts, host_rank: int, vanishing: int
) -> None:
    addr = IPV4[host_rank]
    ranks = [
        Rank(
            [
                *hosts.prefix(r),
                sys.executable,
                str(WORKER),
                "wait",
                str(r),
                addr,
                str(PORT),
                str(host_rank),
            ],
            _env(),
        )
        for r in range(2)
    ]
    try:
        for r in ranks:
            assert r.event()["event"] == "ready"
        # Rank 0 enters its all_reduce right after "ready" (if the loss reaches it first,
        # the all_reduce raises at once); rank 1 sleeps.
        gone = time.time()
        hosts.link(vanishing, up=False)
        for rank, r in enumerate(ranks):
            # Every rank's group learns of it; rank 0, waiting in an all_reduce, raises too.
            events = {}
            while "aborted" not in events or (rank == 0 and "error" not in events):
                e = r.event(timeout=NOTICED_WITHIN + 10)
                events[str(e["event"])] = e
            for e in events.values():
                assert float(e["t"]) - gone < NOTICED_WITHIN, (rank, float(e["t"]) - gone, e)
            if rank == 0:
                assert events["error"]["type"] == "DistNetworkError", events
            # Each names the rank it lost: the other one, or (the vanished side) the store.
            msg = str(events["aborted"]["msg"])
            assert f"rank {1 - rank}" in msg or "lost the store" in msg, events
    finally:
        for r in ranks:
            r.close()


def _two_local(scenario: str, **env: str) -> list[Rank]:
    port = free_port()
    return [
        Rank(
            [sys.executable, str(WORKER), scenario, str(r), "127.0.0.1", str(port), "0"],
            _env(**env),
        )
        for r in range(2)
    ]


@pytest.mark.multiprocess
def test_a_rank_holding_the_gil_past_the_peer_timeout_is_not_gone() -> None:
    ranks = _two_local("busy", AIODIST_PEER_TIMEOUT="3", VANISH_BUSY="6")
    try:
        for r in ranks:
            assert r.event()["event"] == "ready"
        for r in ranks:
            done = r.event(timeout=30)
            assert done["event"] == "done" and done["value"] == 4.0, done
    finally:
        for r in ranks:
            r.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize("stopped_for", [1.0, 6.0])
def test_a_stopped_rank_is_not_gone(stopped_for: float) -> None:
    ranks = _two_local("stopped", AIODIST_PEER_TIMEOUT="3")
    try:
        for r in ranks:
            assert r.event()["event"] == "ready"
        os.kill(ranks[1].proc.pid, signal.SIGSTOP)
        time.sleep(stopped_for)
        os.kill(ranks[1].proc.pid, signal.SIGCONT)
        for r in ranks:
            done = r.event(timeout=30)
            assert done["event"] == "done" and done["value"] == 4.0, done
    finally:
        for r in ranks:
            r.close()
