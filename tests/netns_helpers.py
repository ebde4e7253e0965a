"""Two "hosts" for tests: network namespaces joined by a veth pair, IPv4 and IPv6 on it.

The tests run inside a private network namespace (scripts/test.sh), so creating these needs
root and iproute2 but touches nothing outside the test.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator

import pytest

#: The addresses of host 0 and host 1 on the link between them.
IPV4 = ("10.99.0.1", "10.99.0.2")
IPV6 = ("fd99::1", "fd99::2")


def ip(*args: str) -> None:
    """Run ``ip ARGS``; raise with its message on failure."""
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    """The two namespaces: ``prefix(i)`` runs a command on host ``i``."""

    def __init__(self, names: list[str], veths: list[str]) -> None:
        self.names = names
        self.veths = veths

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program on host ``i``."""
        return ["ip", "netns", "exec", self.names[i]]

    def link(self, i: int, up: bool) -> None:
        """Take host ``i``'s end of the link down (no FIN, no RST: the host vanishes) or up."""
        ip("-n", self.names[i], "link", "set", self.veths[i], "up" if up else "down")


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    """Two namespaces joined by a veth pair, with IPV4 and IPV6 addresses; removed after."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (ip) is not installed")
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    tag = f"{os.getpid() % 100000}"
    names = [f"aiodh{tag}a", f"aiodh{tag}b"]
    veths = [f"vha{tag}", f"vhb{tag}"]
    try:
        for ns in names:
            ip("netns", "add", ns)
        ip("link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        for i, (ns, veth) in enumerate(zip(names, veths, strict=True)):
            ip("link", "set", veth, "netns", ns)
            ip("-n", ns, "addr", "add", f"{IPV4[i]}/24", "dev", veth)
            ip("-n", ns, "addr", "add", f"{IPV6[i]}/64", "dev", veth, "nodad")
            ip("-n", ns, "link", "set", veth, "up")
            ip("-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.strip()}")
    try:
        yield Hosts(names, veths)
    finally:
        for ns in names:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in pids.stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
