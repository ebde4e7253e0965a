"""Store connections notice a vanished peer host within the peer timeout, never a slow one.

A host that loses power or its link sends neither FIN nor RST: without keepalive probes and
``TCP_USER_TIMEOUT`` a client waiting on the store (or the server holding that client's
waits) would sit there for hours. A process that is busy or stopped (SIGSTOP) still has a
kernel that acknowledges, so it must keep its connection.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

import aiodist

PEER_TIMEOUT = 2.0
#: Detection takes the timeout plus up to one keepalive interval (1 s) and scheduling slack.
SLACK = 2.5

_WAITING_CLIENT = """
    import asyncio, sys, time
    import aiodist

    async def main():
        store = await aiodist.TCPStore.create(sys.argv[1], int(sys.argv[2]), timeout=60)
        await store.set("joined", b"1")
        print("waiting", flush=True)
        start = time.monotonic()
        try:
            print("got", await store.get("key"), flush=True)
        except aiodist.DistNetworkError as exc:
            print(f"lost after {time.monotonic() - start:.1f} s: {exc}", flush=True)

    asyncio.run(main())
"""


async def _until(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout} s")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def _spawn(
    script: str, *args: str, prefix: tuple[str, ...] = ()
) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *prefix,
        sys.executable,
        "-c",
        textwrap.dedent(script),
        *args,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "AIODIST_PEER_TIMEOUT": str(PEER_TIMEOUT)},
    )


async def _line(proc: asyncio.subprocess.Process, timeout: float = 30) -> str:
    assert proc.stdout is not None
    return (await asyncio.wait_for(proc.stdout.readline(), timeout)).decode().strip()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def veth_namespace() -> Iterator[tuple[str, str, str, str]]:
    """A network namespace joined to this one by a veth pair.

    Yields (namespace, our address, its address, its interface).
    """
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create a network namespace")
    tag = uuid.uuid4().hex[:8]
    ns, ours, theirs = f"aiodist-{tag}", f"va{tag}", f"vb{tag}"
    octet = int(tag[:2], 16) % 250 + 1
    ours_ip, theirs_ip = f"10.{octet}.7.1", f"10.{octet}.7.2"
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", ours, "type", "veth", "peer", "name", theirs)
        _ip("link", "set", theirs, "netns", ns)
        _ip("addr", "add", f"{ours_ip}/30", "dev", ours)
        _ip("link", "set", ours, "up")
        _ip("-n", ns, "addr", "add", f"{theirs_ip}/30", "dev", theirs)
        _ip("-n", ns, "link", "set", theirs, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        yield ns, ours_ip, theirs_ip, theirs
    finally:
        subprocess.run(["ip", "link", "del", ours], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


@pytest.mark.netns
@pytest.mark.multiprocess
async def test_client_whose_link_goes_down_gets_a_network_error_and_the_server_drops_it(
    veth_namespace: tuple[str, str, str, str],
) -> None:
    ns, server_ip, _client_ip, client_if = veth_namespace
    async with await aiodist.TCPStoreServer(peer_timeout=PEER_TIMEOUT).start(server_ip) as server:
        client = await _spawn(
            _WAITING_CLIENT, server_ip, str(server.port), prefix=("ip", "netns", "exec", ns)
        )
        try:
            assert await _line(client) == "waiting"
            await _until(lambda: server.state.waiter_count == 1, 10, "the client's wait")
            # The link vanishes: no FIN, no RST reaches either side.
            _ip("-n", ns, "link", "set", client_if, "down")
            down = time.monotonic()
            line = await _line(client, PEER_TIMEOUT + SLACK + 5)
            client_took = time.monotonic() - down
            assert line.startswith("lost after "), line
            assert f"lost the connection to the store at {server_ip}:{server.port}" in line
            assert client_took < PEER_TIMEOUT + SLACK, f"client noticed after {client_took:.1f} s"
            # The server drops the silent client and releases its wait, within the limit.
            server_took = await _until(
                lambda: server.num_clients == 0 and server.state.waiter_count == 0,
                PEER_TIMEOUT + SLACK,
                "the server dropping the vanished client",
            )
            assert time.monotonic() - down < PEER_TIMEOUT + SLACK + 0.5, server_took
            assert await asyncio.wait_for(client.wait(), 10) == 0
        finally:
            if client.returncode is None:
                client.kill()
                await client.wait()


@pytest.mark.both_loops
@pytest.mark.multiprocess
async def test_stopped_client_keeps_its_connection_and_its_wait() -> None:
    async with await aiodist.TCPStoreServer(peer_timeout=PEER_TIMEOUT).start() as server:
        client = await _spawn(_WAITING_CLIENT, "127.0.0.1", str(server.port))
        try:
            assert await _line(client) == "waiting"
            await _until(lambda: server.state.waiter_count == 1, 10, "the client's wait")
            client.send_signal(signal.SIGSTOP)
            await asyncio.sleep(PEER_TIMEOUT + SLACK)
            assert (server.num_clients, server.state.waiter_count) == (1, 1)
            client.send_signal(signal.SIGCONT)
            server.state.set(b"/key", b"still here")
            assert await _line(client) == "got b'still here'"
            assert await asyncio.wait_for(client.wait(), 10) == 0
        finally:
            if client.returncode is None:
                client.kill()
                await client.wait()


_SERVER = """
    import asyncio, sys
    import aiodist

    async def main():
        async with await aiodist.TCPStoreServer().start("127.0.0.1", 0) as server:
            print(server.port, flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    asyncio.run(main())
"""


@pytest.mark.multiprocess
async def test_stopped_server_keeps_its_clients() -> None:
    server = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        textwrap.dedent(_SERVER),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "AIODIST_PEER_TIMEOUT": str(PEER_TIMEOUT)},
    )
    try:
        port = int(await _line(server))
        store = await aiodist.TCPStore.create(
            "127.0.0.1", port, timeout=60, peer_timeout=PEER_TIMEOUT
        )
        other = await store.clone()
        waiting = asyncio.ensure_future(store.get("key"))
        await asyncio.sleep(0.1)
        server.send_signal(signal.SIGSTOP)
        # Requests sent to the stopped server sit in its kernel's buffer, acknowledged.
        adding = asyncio.ensure_future(store.add("n", 1))
        await asyncio.sleep(PEER_TIMEOUT + SLACK)
        assert not waiting.done() and not adding.done()
        server.send_signal(signal.SIGCONT)
        assert await asyncio.wait_for(adding, 10) == 1
        await other.set("key", b"v")
        assert await asyncio.wait_for(waiting, 10) == b"v"
        await other.aclose()
        await store.aclose()
    finally:
        if server.returncode is None:
            server.send_signal(signal.SIGCONT)
            server.kill()
        await server.wait()
