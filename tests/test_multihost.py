"""Ranks on two hosts (network namespaces) find each other with no variable set.

Each rank listens on, and publishes, the local end of its connection to the store: the
interface that reaches the store is the one the other host reaches it through.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from netns_helpers import IPV4, IPV6, Hosts

import aiodist
from aiodist.transport._address import interface_address, listen_host

WORKER = Path(__file__).with_name("multihost_worker.py")
PORT = 29517

_CLEAN_ENV = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("AIODIST_", "MASTER_", "GLOO_")) and k not in ("RANK", "WORLD_SIZE")
}


def _run_two(hosts: Hosts, mode: str, addr: str, per_host: int = 1) -> list[dict[str, Any]]:
    n = 2 * per_host
    procs = [
        subprocess.Popen(
            [
                *hosts.prefix(r // per_host),
                *(sys.executable, str(WORKER), mode, str(r), addr, str(PORT), str(n)),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_CLEAN_ENV,
        )
        for r in range(n)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.netns
@pytest.mark.parametrize("mode", ["tcp", "env", "store"])
def test_two_hosts_need_no_variable(hosts: Hosts, mode: str) -> None:
    results = _run_two(hosts, mode, IPV4[0])
    for r in results:
        assert r["sum"] == [3.0] * 4
    # Each listens on its own address on the link, which is where the store was reached from.
    assert [r["listening"] for r in results] == list(IPV4)


@pytest.mark.netns
def test_two_ranks_per_host_share_memory_and_reach_the_other_host_over_tcp(
    hosts: Hosts,
) -> None:
    results = _run_two(hosts, "mixed", IPV4[0], per_host=2)
    n = 4
    for rank, r in enumerate(results):
        assert r["shared_memory_with"] == ([0, 1] if rank < 2 else [2, 3])
        assert r["sum"] == (np.arange(6.0) * sum(range(1, n + 1))).tolist()
        assert r["gathered"] == [[float(k)] * 2 for k in range(n)]
        assert r["broadcast"] == [float(n - 1)] * 3
        assert r["all_to_all"] == [rank + 10.0 * k for k in range(n)]
        assert r["ring"] == [float((rank - 1) % n)] * 2


@pytest.mark.netns
def test_two_hosts_over_ipv6(hosts: Hosts) -> None:
    results = _run_two(hosts, "tcp", IPV6[0])
    assert [r["sum"] for r in results] == [[3.0] * 4] * 2
    assert [r["listening"] for r in results] == list(IPV6)


def test_interface_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("AIODIST_HOST", "AIODIST_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "MASTER_ADDR"):
        monkeypatch.delenv(variable, raising=False)
    assert listen_host("10.1.2.3") == "10.1.2.3"
    assert listen_host(None) == "127.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    assert listen_host(None) == ""  # another host's store, reached without a connection
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert listen_host("10.1.2.3") == "127.0.0.1"
    monkeypatch.setenv("AIODIST_SOCKET_IFNAME", "nosuch0")
    with pytest.raises(
        aiodist.DistUsageError,
        match=r"AIODIST_SOCKET_IFNAME='nosuch0': no such network interface; this host has lo",
    ):
        listen_host("10.1.2.3")
    monkeypatch.setenv("AIODIST_HOST", "127.0.0.5")
    assert listen_host("10.1.2.3") == "127.0.0.5"
    assert interface_address("lo", "X") == "127.0.0.1"


@pytest.mark.netns
def test_survivors_on_two_hosts_shrink_the_world_without_a_killed_rank(hosts: Hosts) -> None:
    n = 4  # two per host; rank 3 (the second host) kills itself
    procs = [
        subprocess.Popen(
            [
                *hosts.prefix(r // 2),
                sys.executable,
                str(WORKER),
                "shrink",
                str(r),
                IPV4[0],
                str(PORT),
                str(n),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_CLEAN_ENV,
        )
        for r in range(n)
    ]
    outcomes = [p.communicate(timeout=60) for p in procs]
    assert procs[3].returncode == -9
    for rank in range(3):
        out, err = outcomes[rank]
        assert procs[rank].returncode == 0, err
        result = json.loads(out.strip().splitlines()[-1])
        assert result["lost"] == [3]
        assert result["now"] == [rank, 3]
        assert result["sum"] == (np.arange(4.0) * (1 + 2 + 3)).tolist()
        # The new world shares memory on the first host again; the second host has one rank.
        assert result["shared_memory_with"] == ([0, 1] if rank < 2 else [2])
