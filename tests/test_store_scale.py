"""The store server with many clients: barriers, wake-ups, bounded buffers, open-file limits.

Speed at scale is measured by ``bench/scale.py``; these tests check the behaviour that makes
it scale: a barrier's counting wakes nobody until the count is reached, abandoned waits are
dropped one by one, a client that stops reading cannot make the server buffer without bound,
and too low an open-file limit is a clear error before any client connects.
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator

import pytest
from fuzz_helpers import until

import aiodist
from aiodist.store import _server, _wire
from aiodist.store._state import KeyValueState

pytestmark = pytest.mark.both_loops  # the standard loop (asyncio.run, uvicorn) too

F64 = _wire.F64


# -- the state --------------------------------------------------------------------------------
def _record(woken: list[int], i: int, _future: asyncio.Future[None]) -> None:
    woken.append(i)


async def test_counter_threshold_waits_wake_only_when_reached() -> None:
    state = KeyValueState()
    woken: list[int] = []
    futures = [state.watch_count(b"c", 500) for _ in range(500)]
    for i, future in enumerate(futures):
        future.add_done_callback(functools.partial(_record, woken, i))
    for _ in range(499):
        state.add(b"c", 1)
    await asyncio.sleep(0)
    assert woken == [] and state.waiter_count == 500
    state.set(b"c", b"not a number")  # a value that is not a count wakes nobody either
    state.set(b"c", b"499")
    await asyncio.sleep(0)
    assert woken == []
    state.add(b"c", 1)
    await asyncio.sleep(0)
    assert sorted(woken) == list(range(500)) and state.waiter_count == 0
    # A threshold already reached resolves at once; one never reached is dropped on cancel.
    assert state.watch_count(b"c", 3).done()
    later = state.watch_count(b"c", 10**6)
    later.cancel()
    await asyncio.sleep(0)
    assert state.waiter_count == 0


async def test_thousands_of_abandoned_waits_are_dropped() -> None:
    state = KeyValueState()
    waits = [state.watch([b"k", b"other"]) for _ in range(4096)]
    assert state.waiter_count == 4096
    for future in waits[::2]:
        future.cancel()
    await asyncio.sleep(0)
    assert state.waiter_count == 2048
    state.set(b"k", b"1")
    state.set(b"other", b"2")
    await asyncio.sleep(0)
    assert all(f.done() and not f.cancelled() for f in waits[1::2])
    assert state.waiter_count == 0


# -- many clients -------------------------------------------------------------------------------
@pytest.fixture
async def server() -> AsyncIterator[aiodist.TCPStoreServer]:
    async with await aiodist.TCPStoreServer(expected_clients=300).start() as srv:
        yield srv


@pytest.mark.parametrize("wire", ["aiodist", "torch"])
async def test_a_ring_of_clients_rendezvous_and_leave_nothing_behind(
    wire: str, server: aiodist.TCPStoreServer
) -> None:
    world = 64 if wire == "torch" else 256
    stores = await asyncio.gather(
        *(
            aiodist.TCPStore.create("127.0.0.1", server.port, wire=wire, timeout=30)  # type: ignore[arg-type]
            for _ in range(world)
        )
    )

    async def rank(r: int, store: aiodist.TCPStore) -> list[bytes]:
        await store.add("join", 1)
        await store.set(f"addr/{r}", f"host-{r}")
        got = await store.multi_get([f"addr/{(r - 1) % world}", f"addr/{(r + 1) % world}"])
        await store.barrier("ready", world)
        return got

    results = await asyncio.wait_for(
        asyncio.gather(*(rank(r, s) for r, s in enumerate(stores))), 60
    )
    for r, got in enumerate(results):
        assert got == [f"host-{(r - 1) % world}".encode(), f"host-{(r + 1) % world}".encode()]
    assert server.state.get(b"/join") == server.state.get(b"/ready") == str(world).encode()
    for store in stores:
        await store.aclose()
    await until(
        lambda: (server.num_clients, server.state.waiter_count) == (0, 0),
        "the server forgot every client and its waits",
    )


# -- a client that does not read ----------------------------------------------------------------
async def _raw_client(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(_wire.CLIENT_HELLO.pack(_wire.AIODIST_MAGIC, _wire.PROTOCOL_VERSION, b"n" * 32))
    hello = b""
    while len(hello) < _wire.SERVER_HELLO.size:
        hello += await asyncio.to_thread(sock.recv, _wire.SERVER_HELLO.size - len(hello))
    sock.setblocking(False)
    return sock


def _get(rid: int, key: bytes) -> bytes:
    return _wire.encode_frame(rid, _wire.Op.GET, F64.pack(30.0) + _wire.blob32(key))


def _connection(server: aiodist.TCPStoreServer) -> _server._Connection:
    (conn,) = server._connections
    return conn


def _paused(server: aiodist.TCPStoreServer) -> bool:
    """Whether the server's one connection stopped reading (its client reads no replies)."""
    return len(server._connections) == 1 and _connection(server)._paused


def _buffered(conn: _server._Connection) -> int:
    assert conn._transport is not None
    return conn._transport.get_write_buffer_size()


async def _read_replies(sock: socket.socket, count: int, value: bytes) -> list[int]:
    """Read ``count`` replies carrying ``value``; return their request ids."""
    loop = asyncio.get_running_loop()
    data = bytearray()
    rids: list[int] = []
    while len(rids) < count:
        data += await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), 10)
        while len(data) >= 9:
            length, rid, status = _wire.FRAME_HEAD.unpack_from(data)
            if len(data) < 4 + length:
                break
            assert status == _wire.Status.OK and bytes(data[9 : 4 + length]) == value
            rids.append(rid)
            del data[: 4 + length]
    return rids


# Replies the server may hold for one client: the transport's high-water mark, a flush
# (256 KiB) and one value; the kernel's socket buffers hold the rest.
_BOUND = 4 << 20


async def test_a_client_that_does_not_read_cannot_grow_the_servers_buffers(
    server: aiodist.TCPStoreServer,
) -> None:
    value = b"x" * (1 << 20)
    server.state.set(b"big", value)
    sock = await _raw_client(server.port)
    try:
        # 200 gets of a 1 MiB value, 200 MiB of replies, and the client reads none of them.
        await asyncio.get_running_loop().sock_sendall(
            sock, b"".join(_get(rid, b"big") for rid in range(1, 201))
        )
        await until(lambda: _paused(server), "the server paused the client that does not read")
        assert _buffered(_connection(server)) < _BOUND
        # Reading resumes the server, which answers every request, in order.
        assert await _read_replies(sock, 200, value) == list(range(1, 201))
    finally:
        sock.close()


async def test_woken_waits_of_a_client_that_does_not_read_are_held_back(
    server: aiodist.TCPStoreServer,
) -> None:
    sock = await _raw_client(server.port)
    try:
        await asyncio.get_running_loop().sock_sendall(
            sock, b"".join(_get(rid, b"later") for rid in range(1, 101))
        )
        await until(lambda: server.state.waiter_count == 100, "100 waits parked")
        value = b"y" * (1 << 20)
        server.state.set(b"later", value)  # wakes 100 waits: 100 MiB of replies
        await until(
            lambda: _paused(server) and bool(_connection(server)._deferred),
            "the server paused the client and held its woken waits back",
        )
        assert _buffered(_connection(server)) < _BOUND
        assert sorted(await _read_replies(sock, 100, value)) == list(range(1, 101))
        assert server.state.waiter_count == 0
    finally:
        sock.close()


async def test_waits_per_connection_are_bounded(
    server: aiodist.TCPStoreServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_server, "MAX_WAITING_PER_CONNECTION", 8)
    store = await aiodist.TCPStore.create("127.0.0.1", server.port, wire="aiodist", timeout=10)
    waits = [asyncio.ensure_future(store.get(f"k{i}")) for i in range(8)]
    await until(lambda: server.state.waiter_count == 8, "8 waits parked")
    with pytest.raises(aiodist.DistUsageError, match=r"already has 8 requests waiting"):
        await store.get("one too many")
    await store.multi_set([f"k{i}" for i in range(8)], [b"v"] * 8)
    assert await asyncio.gather(*waits) == [b"v"] * 8
    assert await store.get("k0") == b"v"
    await store.aclose()


# -- open files ---------------------------------------------------------------------------------
_LIMITED = """
    import asyncio, resource, sys
    import aiodist

    soft, hard = int(sys.argv[1]), int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    async def main():
        try:
            server = await aiodist.TCPStoreServer(expected_clients=1000).start()
        except aiodist.DistUsageError as exc:
            print("refused:", exc)
            return
        print("started, soft limit now", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        await server.aclose()

    asyncio.run(main())
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize(("soft", "hard"), [(256, 256), (256, 4096)])
def test_open_file_limit_is_raised_or_named(soft: int, hard: int) -> None:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_LIMITED), str(soft), str(hard)],
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ,
    )
    assert out.returncode == 0, out.stderr
    if hard < 1000:
        assert out.stdout.startswith("refused: a store server for 1000 clients needs about 10"), (
            out.stdout
        )
        assert (
            "but this process may open at most 256 (the hard RLIMIT_NOFILE limit): raise it"
            in out.stdout
        )
    else:
        assert out.stdout.strip() == f"started, soft limit now {hard}"
