"""Real etcd servers for tests: one member, or a cluster of three, on loopback.

Each member gets a temporary data directory and ports the kernel found free; the fixtures
stop the members after the test. Tests that need etcd skip, saying why, only where its
binary (Debian's ``etcd-server`` package, installed by ``scripts/test.sh``) is missing.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ETCD = shutil.which("etcd")

needs_etcd = pytest.mark.skipif(
    ETCD is None,
    reason="etcd is not installed (Debian: apt-get install etcd-server; scripts/test.sh does it)",
)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Ports that are free now on ``host`` (held open together, so they differ)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


class Member:
    """One etcd member: its process, client port and data directory."""

    def __init__(
        self, name: str, host: str, client_port: int, peer_port: int, data_dir: Path
    ) -> None:
        self.name = name
        self.host = host
        self.client_port = client_port
        self.peer_port = peer_port
        self.data_dir = data_dir
        self.proc: subprocess.Popen[bytes] | None = None
        #: The command prefix that runs it on its host (``[]``: this namespace).
        self.prefix: list[str] = []

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def command(self, cluster: str) -> list[str]:
        assert ETCD is not None
        return [
            ETCD,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", f"http://{self.endpoint}",
            "--advertise-client-urls", f"http://{self.endpoint}",
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", cluster,
            "--initial-cluster-state", "new",
            "--initial-cluster-token", f"aiodist-test-{self.data_dir.parent.name}",
        ]  # fmt: skip

    def start(self, cluster: str, prefix: list[str] | None = None) -> None:
        self.prefix = prefix or []
        log = (self.data_dir.parent / f"{self.name}.log").open("wb")
        with log:
            self.proc = subprocess.Popen(
                [*(prefix or []), *self.command(cluster)], stdout=log, stderr=subprocess.STDOUT
            )

    def kill(self) -> None:
        """SIGKILL the member (no goodbye to the others) and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()


#: Exits 0 if the etcd member at argv[1] answers a linearizable read (run on its host).
_PROBE = """
import json, sys, urllib.request
request = urllib.request.Request(
    f"http://{sys.argv[1]}/v3/kv/range", data=json.dumps({"key": "AA=="}).encode()
)
try:
    with urllib.request.urlopen(request, timeout=2) as answer:
        sys.exit(0 if b"header" in answer.read() else 1)
except OSError:
    sys.exit(1)
"""


def _answers(member: Member) -> bool:
    """Whether ``member`` answers a linearizable read (asked from its host)."""
    if member.prefix:
        probe = [*member.prefix, sys.executable, "-c", _PROBE, member.endpoint]
        return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0
    import json
    import urllib.request

    request = urllib.request.Request(
        f"http://{member.endpoint}/v3/kv/range", data=json.dumps({"key": "AA=="}).encode()
    )
    try:
        with urllib.request.urlopen(request, timeout=2) as answer:
            return b"header" in answer.read()
    except OSError:
        return False


def wait_ready(members: list[Member], timeout: float = 30.0) -> None:
    """Wait until every member answers a linearizable read (the cluster has a leader)."""
    deadline = time.monotonic() + timeout
    for member in members:
        while True:
            assert member.proc is not None
            if member.proc.poll() is not None:
                log = (member.data_dir.parent / f"{member.name}.log").read_text()
                raise RuntimeError(f"etcd {member.name} exited: {log[-2000:]}")
            if _answers(member):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd {member.name} did not become ready in {timeout} s")
            time.sleep(0.05)


@contextlib.contextmanager
def etcd_cluster(
    base: Path,
    size: int = 1,
    hosts: list[str] | None = None,
    prefixes: list[list[str]] | None = None,
) -> Iterator[list[Member]]:
    """Start ``size`` etcd members (on ``hosts[i]``, run with the command ``prefixes[i]``,
    default loopback); stop them afterwards."""
    if ETCD is None:
        pytest.skip(needs_etcd.kwargs["reason"])
    hosts = hosts or ["127.0.0.1"] * size
    if prefixes is None:
        ports = free_ports(2 * size, hosts[0])
    else:
        # (Other hosts' ports cannot be probed from here: etcd's own, counted per host.)
        ports = []
        for i, host in enumerate(hosts):
            earlier = hosts[:i].count(host)
            ports += [2379 + 2 * earlier, 2380 + 2 * earlier]
    members = []
    for i in range(size):
        data = base / f"etcd{i}"
        data.mkdir(parents=True)
        members.append(Member(f"m{i}", hosts[i], ports[2 * i], ports[2 * i + 1], data))
    cluster = ",".join(f"{m.name}={m.peer_url}" for m in members)
    try:
        for i, member in enumerate(members):
            member.start(cluster, prefixes[i] if prefixes else None)
        wait_ready(members)
        yield members
    finally:
        for member in members:
            member.kill()


@pytest.fixture
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One etcd member on loopback: its ``host:port``."""
    with etcd_cluster(tmp_path_factory.mktemp("etcd")) as members:
        yield members[0].endpoint


@pytest.fixture
def etcd3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Member]]:
    """Three etcd members on loopback, one cluster."""
    with etcd_cluster(tmp_path_factory.mktemp("etcd3"), 3) as members:
        yield members
