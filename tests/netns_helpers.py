"""Pretend hosts for tests: network namespaces joined by a veth pair (two hosts, IPv4 and
IPv6 on it), or by veths to a bridge (three hosts).

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

    def __init__(self, names: list[str], veths: list[str], addresses: list[str]) -> None:
        self.names = names
        self.veths = veths
        #: Each host's IPv4 address.
        self.addresses = addresses

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program on host ``i``."""
        return ["ip", "netns", "exec", self.names[i]]

    def link(self, i: int, up: bool) -> None:
        """Take host ``i``'s end of the link down (no FIN, no RST: the host vanishes) or up."""
        ip("-n", self.names[i], "link", "set", self.veths[i], "up" if up else "down")


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    """Two namespaces joined by a veth pair, with IPV4 and IPV6 addresses; removed after."""
    yield from _hosts(2)


@pytest.fixture
def three_hosts() -> Iterator[Hosts]:
    """Three namespaces, each with a veth to one bridge (10.99.0.1-3); removed after."""
    yield from _hosts(3)


def _hosts(count: int) -> Iterator[Hosts]:
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (ip) is not installed")
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    tag = f"{os.getpid() % 100000}"
    names = [f"aiodh{tag}{chr(97 + i)}" for i in range(count)]
    veths = [f"vh{chr(97 + i)}{tag}" for i in range(count)]
    addresses = [f"10.99.0.{i + 1}" for i in range(count)]
    bridge = f"aiodbr{tag}"
    try:
        ip("netns", "add", names[0])
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.strip()}")
    # From here a failure is an error, not a missing capability: a clash with what an
    # earlier fixture left, say.
    try:
        for ns in names[1:]:
            ip("netns", "add", ns)
        if count == 2:
            ip("link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        else:
            ip("link", "add", bridge, "type", "bridge")
            ip("link", "set", bridge, "up")
            for i, veth in enumerate(veths):
                ip("link", "add", veth, "type", "veth", "peer", "name", f"vb{i}{tag}")
                ip("link", "set", f"vb{i}{tag}", "master", bridge, "up")
        for i, (ns, veth) in enumerate(zip(names, veths, strict=True)):
            ip("link", "set", veth, "netns", ns)
            ip("-n", ns, "addr", "add", f"{addresses[i]}/24", "dev", veth)
            if count == 2:
                ip("-n", ns, "addr", "add", f"{IPV6[i]}/64", "dev", veth, "nodad")
            ip("-n", ns, "link", "set", veth, "up")
            ip("-n", ns, "link", "set", "lo", "up")
    except BaseException:
        _remove(names, veths, bridge)
        raise
    try:
        yield Hosts(names, veths, addresses)
    finally:
        _remove(names, veths, bridge)


def _remove(names: list[str], veths: list[str], bridge: str) -> None:
    for ns, veth in zip(names, veths, strict=True):
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        # The veth first, which deletes its peer at once: a namespace is dismantled later,
        # in the background, and the next fixture's links of the same names would clash.
        subprocess.run(["ip", "-n", ns, "link", "del", veth], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    subprocess.run(["ip", "link", "del", bridge], capture_output=True)
