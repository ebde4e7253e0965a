"""A host that vanishes is noticed within 10 s; a rank that is merely busy or stopped is not.

Vanishing is a veth link taken down between two network namespaces: no FIN, no RST, as when a
host loses power or a switch port dies. Every rank raises DistNetworkError naming the rank
that went, whichever side hosts the store. A rank that holds the GIL for longer than the peer
timeout, or is stopped (SIGSTOP) for a while, raises nothing: its kernel keeps answering.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from netns_helpers import IPV4, Hosts

from aiodist.testing import free_port

WORKER = Path(__file__).with_name("vanish_worker.py")
#: What the library promises by default.
NOTICED_WITHIN = 10.0
#: How long rank 1 spins after "ready", before its all_reduce, in the stopped-rank test: the
#: test stops it within that time (it takes milliseconds).
STOP_WITHIN = 1.5


class Rank:
    """A worker process and the JSON events it prints (its stderr goes to a file, so that
    however much it writes there it never blocks on a pipe nobody reads)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._stderr, env=env)
        # Read from the pipe but not returned yet: the start of a line, or whole lines that
        # came in the same read (the pipe is no longer readable for those).
        self._unread = b""

    def event(self, timeout: float = 30) -> dict[str, object]:
        """The next event the rank prints, waiting at most ``timeout`` seconds for it."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        end = time.monotonic() + timeout
        while True:
            line, newline, rest = self._unread.partition(b"\n")
            if newline:
                self._unread = rest
                if line.startswith(b"{"):
                    return json.loads(line)
                continue
            left = end - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise AssertionError(f"no event within {timeout:g} s; stderr:\n{self.stderr()}")
            chunk = os.read(fd, 1 << 16)  # readable: returns at once, EOF included
            if not chunk:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(5)
                raise AssertionError(
                    f"the rank ended (exit code {self.proc.returncode}): {self.stderr()}"
                )
            self._unread += chunk

    def stderr(self) -> str:
        """What the rank wrote to stderr so far (read without moving the offset it writes at)."""
        fd = self._stderr.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()  # waits, and closes the pipe
        self._stderr.close()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIODIST_", "MASTER_"))}
    return {**env, **extra}


@pytest.mark.netns
@pytest.mark.parametrize(("host_rank", "vanishing"), [(0, 1), (0, 0), (1, 0)])
def test_a_vanished_host_is_noticed_by_every_rank(
    hosts: Hosts, host_rank: int, vanishing: int
) -> None:
    addr = IPV4[host_rank]
    # Any free port would do in these fresh namespaces; a free one of ours is as good.
    port = free_port()
    ranks = [
        Rank(
            [
                *hosts.prefix(r),
                sys.executable,
                str(WORKER),
                "wait",
                str(r),
                addr,
                str(port),
                str(host_rank),
            ],
            _env(),
        )
        for r in range(2)
    ]
    try:
        for r in ranks:
            assert r.event()["event"] == "ready"
        # Right away: rank 0 is entering or waiting in its all_reduce, rank 1 sleeps. Nothing
        # more is awaited: init_process_group has returned on both ranks, and the promise
        # holds from there (it returns only once the store holds both ranks' leases, so a
        # rank that vanishes at once is still noticed through its lease).
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


#: The ranks' peer timeout in the tests of their own connections' liveness, and how much
#: later than it the loss may be noticed (a liveness check a second, a window probe a second
#: at most where the kernel has TCP_RTO_MAX_MS, a busy machine).
LINK_PEER_TIMEOUT = 2.0
LINK_SLACK = 5.0


@pytest.mark.netns
@pytest.mark.parametrize("scenario", ["stream", "unread"])
def test_a_vanished_host_is_noticed_by_the_link_to_it(hosts: Hosts, scenario: str) -> None:
    # The store's connections use a peer timeout of 60 s: its lease of the vanished rank
    # tells nobody in time, so rank 0's own connection to rank 1 must notice. "stream": rank
    # 0's data is in flight, unacknowledged; "unread": rank 1 is busy (its window closed)
    # for twice the peer timeout, which is no loss, and then its host vanishes.
    port = free_port()
    env = _env(
        AIODIST_PEER_TIMEOUT=f"{LINK_PEER_TIMEOUT:g}", STORE_PEER_TIMEOUT="60", VANISH_BUSY="600"
    )
    ranks = [
        Rank(
            [
                *hosts.prefix(r),
                sys.executable,
                str(WORKER),
                scenario,
                str(r),
                IPV4[0],
                str(port),
                "0",
            ],
            env,
        )
        for r in range(2)
    ]
    try:
        for r in ranks:
            assert r.event()["event"] == "ready"
        time.sleep(0.5 if scenario == "stream" else 2 * LINK_PEER_TIMEOUT)
        gone = time.time()
        hosts.link(1, up=False)
        events = {}
        while "error" not in events:
            e = ranks[0].event(timeout=LINK_PEER_TIMEOUT + LINK_SLACK + 10)
            events[str(e["event"])] = e
        error = events["error"]
        assert error["type"] == "DistNetworkError", events
        assert "lost connection to rank 1: its host stopped answering" in str(error["msg"]), events
        assert float(error["t"]) - gone < LINK_PEER_TIMEOUT + LINK_SLACK, float(error["t"]) - gone
    finally:
        for r in ranks:
            r.close()


@pytest.mark.multiprocess
def test_a_busy_rank_with_its_window_closed_is_not_gone() -> None:
    # Rank 1 holds the GIL for three times the peer timeout while 8 MiB of rank 0's wait
    # unread: rank 0's kernel sees rank 1's window closed and probes it, and rank 1's kernel
    # answers. (TCP_USER_TIMEOUT would drop the connection here: Linux counts a closed
    # window against it however the probes are answered.)
    ranks = _two_local(
        "unread", AIODIST_PEER_TIMEOUT=f"{LINK_PEER_TIMEOUT:g}", VANISH_BUSY="6", AIODIST_SHM="0"
    )
    try:
        for r in ranks:
            assert r.event()["event"] == "ready"
        for r in ranks:
            done = r.event(timeout=30)
            assert done["event"] == "done" and done["value"] == 4.0, done
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


def _wait_until_stopped(pid: int, timeout: float = 10) -> None:
    """Wait until the process ``pid`` is stopped (state ``T`` in /proc), not merely signalled."""
    end = time.monotonic() + timeout
    while True:
        # The state follows the command name, which is in parentheses and may hold spaces.
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "T":
            return
        if time.monotonic() > end:
            raise AssertionError(f"process {pid} did not stop within {timeout:g} s ({state})")
        time.sleep(0.001)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stopped_for", [1.0, 6.0])
def test_a_stopped_rank_is_not_gone(stopped_for: float) -> None:
    # Rank 1 spins for STOP_WITHIN seconds between "ready" and its all_reduce, and is stopped
    # there: its all_reduce comes after the stop, so rank 0 waits in its own through it.
    # (The worker's "stopped" scenario runs the all_reduce at once: it has ended before a
    # signal sent after "ready" can arrive, and would stop a rank that nobody waits for.)
    ranks = _two_local("busy", AIODIST_PEER_TIMEOUT="3", VANISH_BUSY=str(STOP_WITHIN))
    try:
        for r in ranks:
            assert r.event()["event"] == "ready"
        pid = ranks[1].proc.pid
        os.kill(pid, signal.SIGSTOP)
        _wait_until_stopped(pid)
        time.sleep(stopped_for)  # the scenario itself: how long rank 1 stays stopped
        resumed = time.time()
        os.kill(pid, signal.SIGCONT)
        for r in ranks:
            done = r.event(timeout=30)
            assert done["event"] == "done" and done["value"] == 4.0, done
            # Both all_reduces ended after the stop (else it came too late to test anything).
            assert float(done["t"]) >= resumed, (done, resumed)
    finally:
        for r in ranks:
            r.close()
