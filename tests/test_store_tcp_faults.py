"""TCPStore under faults: garbage bytes, dead clients, dead servers, busy ports, refusals."""

from __future__ import annotations

import asyncio
import signal
import socket
import struct
import sys
import textwrap
import time
from collections.abc import AsyncIterator

import pytest

import aiodist
from aiodist.store import _wire
from aiodist.testing import free_port


@pytest.fixture
async def server() -> AsyncIterator[aiodist.TCPStoreServer]:
    async with await aiodist.TCPStoreServer().start("127.0.0.1", 0) as srv:
        yield srv


async def _client(srv: aiodist.TCPStoreServer, **kwargs: object) -> aiodist.TCPStore:
    kwargs.setdefault("timeout", 5)
    return await aiodist.TCPStore.create("127.0.0.1", srv.port, **kwargs)  # type: ignore[arg-type]


def _send_and_read_until_closed(port: int, chunks: list[bytes]) -> bytes:
    """Send ``chunks`` on a raw socket, then read until the server closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        for chunk in chunks:
            sock.sendall(chunk)
        received = b""
        while data := sock.recv(65536):
            received += data
        return received


async def _until(predicate: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


_VALIDATE = bytes([_wire.TorchOp.VALIDATE]) + struct.pack("<I", _wire.TORCH_VALIDATE_MAGIC)

GARBAGE = {
    "http": [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"],
    "torch-without-validate": [b"\x00\x11\x22\x33\x44"],
    "torch-unknown-opcode": [_VALIDATE, b"\x63"],
    "torch-oversized-key": [_VALIDATE, b"\x01" + struct.pack("<Q", 2**40)],
    "aiodist-short-frame": [
        _wire.CLIENT_HELLO.pack(_wire.AIODIST_MAGIC, _wire.PROTOCOL_VERSION, b"n" * 32),
        struct.pack("<I", 2),
    ],
    "aiodist-unknown-opcode": [
        _wire.CLIENT_HELLO.pack(_wire.AIODIST_MAGIC, _wire.PROTOCOL_VERSION, b"n" * 32),
        _wire.encode_frame(1, 250),
    ],
    "aiodist-truncated-request": [
        _wire.CLIENT_HELLO.pack(_wire.AIODIST_MAGIC, _wire.PROTOCOL_VERSION, b"n" * 32),
        _wire.encode_frame(1, _wire.Op.SET, struct.pack("<I", 100)),
    ],
}


@pytest.mark.both_loops
@pytest.mark.parametrize("kind", sorted(GARBAGE))
async def test_garbage_closes_only_that_connection(
    kind: str, server: aiodist.TCPStoreServer, caplog: pytest.LogCaptureFixture
) -> None:
    good = await _client(server)
    await good.set("kept", b"1")
    waiter = asyncio.ensure_future(good.get("later"))
    await asyncio.to_thread(_send_and_read_until_closed, server.port, GARBAGE[kind])
    assert "closing connection from 127.0.0.1" in caplog.text
    # Everyone else is served as before, and nothing was lost.
    await good.set("later", b"2")
    assert await waiter == b"2"
    assert await good.get("kept") == b"1"
    assert await good.add("n", 1) == 1
    await good.aclose()


async def test_torch_requests_split_byte_by_byte_are_parsed(
    server: aiodist.TCPStoreServer,
) -> None:
    request = (
        _VALIDATE
        + _wire.torch_request(_wire.TorchOp.SET, b"/k", b"value")
        + _wire.torch_request(_wire.TorchOp.GET, b"/k")
    )

    def talk() -> bytes:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for i in range(len(request)):
                sock.sendall(request[i : i + 1])
                time.sleep(0.001)
            return sock.recv(100)

    assert await asyncio.to_thread(talk) == struct.pack("<Q", 5) + b"value"


async def test_aiodist_frames_split_anywhere_are_parsed(server: aiodist.TCPStoreServer) -> None:
    hello = _wire.CLIENT_HELLO.pack(_wire.AIODIST_MAGIC, _wire.PROTOCOL_VERSION, b"n" * 32)
    frames = _wire.encode_frame(
        1, _wire.Op.SET, _wire.blob32(b"/k"), _wire.blob32(b"v" * 300)
    ) + _wire.encode_frame(2, _wire.Op.GET, struct.pack("<d", 5.0), _wire.blob32(b"/k"))

    def talk(step: int) -> bytes:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(hello)
            received = b""
            for i in range(0, len(frames), step):
                sock.sendall(frames[i : i + step])
                time.sleep(0.0005)
            want = _wire.SERVER_HELLO.size + 9 + 9 + 300
            while len(received) < want:
                received += sock.recv(65536)
            return received[_wire.SERVER_HELLO.size :]

    for step in (1, 7, 1000):
        replies = await asyncio.to_thread(talk, step)
        assert replies == _wire.encode_frame(1, _wire.Status.OK) + _wire.encode_frame(
            2, _wire.Status.OK, b"v" * 300
        )


async def test_add_on_a_non_number_keeps_connection_and_value(
    server: aiodist.TCPStoreServer,
) -> None:
    store = await _client(server)
    await store.set("t", b"abc")
    with pytest.raises(
        aiodist.DistStoreError, match=r"add on key 't': its value b'abc' is not an integer"
    ):
        await store.add("t", 1)
    assert await store.get("t") == b"abc"
    assert await store.add("n", 2) == 2
    await store.aclose()


async def test_disconnect_mid_request_is_cleaned_up(server: aiodist.TCPStoreServer) -> None:
    store = await _client(server)
    other = await _client(server)
    for _ in range(3):
        asyncio.ensure_future(other.get("never")).add_done_callback(lambda f: f.exception())
    waiter = asyncio.ensure_future(other.wait(["a", "b"]))
    waiter.add_done_callback(lambda f: f.exception())
    await _until(lambda: server.state.waiter_count == 4)
    # Half a request, then the client goes away.
    half = _wire.encode_frame(1, _wire.Op.SET, _wire.blob32(b"/x"), _wire.blob32(b"y" * 100))
    hello = _wire.CLIENT_HELLO.pack(_wire.AIODIST_MAGIC, _wire.PROTOCOL_VERSION, b"n" * 32)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(hello + half[:20])
    await other.aclose()
    await _until(lambda: server.state.waiter_count == 0 and server.num_clients == 1)
    assert not await store.check(["x"])
    await store.aclose()


async def test_every_lost_lease_is_recorded_in_the_order_the_connections_ended(
    server: aiodist.TCPStoreServer,
) -> None:
    watcher = await _client(server)
    clients = {name: await _client(server) for name in "abcd"}
    for name, client in clients.items():
        assert await client.lease("departed", f"{name} is gone")
    await clients["d"].lease("departed", None)  # withdrawn: never recorded
    # The first lost lease takes the key; each later one the next free key/<n>. A reader
    # parked on the next record learns of every one.
    next_record = asyncio.ensure_future(watcher.get("departed/1"))
    for ended, name in enumerate("bca", 1):
        await clients[name].aclose()
        await _until(lambda ended=ended: server.num_clients == 5 - ended)
    assert await watcher.get("departed") == b"b is gone"
    assert await next_record == b"c is gone"
    assert await watcher.get("departed/2") == b"a is gone"
    await clients["d"].aclose()
    await _until(lambda: server.num_clients == 1)
    assert not await watcher.check(["departed/3"])
    # A key set by hand is not overwritten either: the lease takes the next free key.
    await watcher.set("left", "by hand")
    late = await _client(server)
    await late.lease("left", "lost")
    await late.aclose()
    assert await watcher.get("left/1") == b"lost"
    assert await watcher.get("left") == b"by hand"
    await watcher.aclose()


@pytest.mark.both_loops
async def test_a_client_reset_is_not_news_at_info_level(
    server: aiodist.TCPStoreServer, caplog: pytest.LogCaptureFixture
) -> None:
    # What a killed client's process leaves: a connection reset (SO_LINGER 0 sends the RST).
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(_wire.CLIENT_HELLO.pack(_wire.AIODIST_MAGIC, _wire.PROTOCOL_VERSION, b"n" * 32))
    await reader.readexactly(_wire.SERVER_HELLO.size)  # (admitted: the server has no token)
    with caplog.at_level("DEBUG", logger="aiodist.store"):
        deadline = time.monotonic() + 5
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
        while server.num_clients:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
    lost = [r for r in caplog.records if "lost the connection" in r.getMessage()]
    assert [r.levelname for r in lost] == ["DEBUG"], lost
    assert "Connection reset by peer" in lost[0].getMessage()


async def test_cancelled_wait_is_removed_from_the_server(server: aiodist.TCPStoreServer) -> None:
    store = await _client(server)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(store.get("k"), 0.1)
    await _until(lambda: server.state.waiter_count == 0)
    assert store._channel.pending == 0
    await store.set("k", b"v")
    assert await store.get("k") == b"v"
    await store.aclose()


async def test_torch_wire_wait_timeout_keeps_the_connection(
    server: aiodist.TCPStoreServer,
) -> None:
    store = await _client(server, wire="torch")
    with pytest.raises(aiodist.DistTimeoutError, match=r"still missing: \['k'\]"):
        await store.wait(["k"], timeout=0.1)
    await _until(lambda: server.state.waiter_count == 0)
    await store.set("k", b"v")
    assert await store.get("k") == b"v"
    await store.aclose()


async def test_torch_wire_add_on_a_non_number(server: aiodist.TCPStoreServer) -> None:
    store = await _client(server, wire="torch")
    await store.set("t", b"abc")
    with pytest.raises(aiodist.DistStoreError, match=r"add on key 't' failed: the torch store"):
        await store.add("t", 1)
    assert await store.get("t") == b"abc"
    assert await store.add("n", 5) == 5
    await store.aclose()


@pytest.mark.both_loops
@pytest.mark.parametrize("wire", ["aiodist", "torch"])
async def test_server_closing_fails_pending_requests_at_once(wire: str) -> None:
    srv = await aiodist.TCPStoreServer().start()
    store = await _client(srv, wire=wire)
    pending = asyncio.ensure_future(store.get("never"))
    await asyncio.sleep(0.05)
    start = time.monotonic()
    await srv.aclose()
    with pytest.raises(aiodist.DistNetworkError, match=r"lost the connection to the store at"):
        await pending
    assert time.monotonic() - start < 2
    with pytest.raises(aiodist.DistNetworkError, match=r"lost the connection"):
        await store.set("k", b"v")
    await store.aclose()


_SERVER_PROCESS = textwrap.dedent(
    """
    import asyncio, sys
    import aiodist

    async def main():
        server = await aiodist.TCPStoreServer().start("127.0.0.1", 0)
        print(server.port, flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
    """
)


@pytest.mark.multiprocess
@pytest.mark.parametrize("wire", ["aiodist", "torch"])
async def test_killed_server_process_gives_network_error_within_seconds(wire: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _SERVER_PROCESS, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        port = int(await asyncio.wait_for(proc.stdout.readline(), 30))
        store = await aiodist.TCPStore.create("127.0.0.1", port, timeout=300, wire=wire)
        await store.set("k", b"v")
        pending = [asyncio.ensure_future(store.get("never")) for _ in range(3)]
        await asyncio.sleep(0.1)
        start = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        for fut in pending:
            with pytest.raises(aiodist.DistNetworkError, match=rf"127\.0\.0\.1:{port}"):
                await asyncio.wait_for(fut, 10)
        assert time.monotonic() - start < 5
        await store.aclose()
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


@pytest.mark.both_loops
async def test_connect_gives_up_after_the_timeout_naming_the_address() -> None:
    port = free_port()
    start = time.monotonic()
    # The message says what was tried and the last error the OS gave (it once ended in an
    # empty cause: "... within 0.5 s: ").
    with pytest.raises(
        aiodist.DistNetworkError,
        match=rf"could not connect to the store at 127\.0\.0\.1:{port} within 0\.[5-9] s "
        rf"\(\d+ attempts to connect to 127\.0\.0\.1:{port}; the last error was: "
        r"\[Errno 111\] .+\)$",
    ):
        await aiodist.TCPStore.create("127.0.0.1", port, timeout=0.5)
    assert 0.5 <= time.monotonic() - start < 3


@pytest.mark.both_loops
async def test_connect_to_a_host_that_never_answers_says_so() -> None:
    # A listener whose accept queue is full drops SYNs: the connect neither succeeds nor
    # fails, as with a host that vanished.
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    port = full.getsockname()[1]
    queued = socket.create_connection(("127.0.0.1", port))
    try:
        with pytest.raises(
            aiodist.DistNetworkError,
            match=rf"could not connect to the store at 127\.0\.0\.1:{port} within 0\.[5-9] s "
            rf"\(1 attempt to connect to 127\.0\.0\.1:{port}; the last one got no answer "
            r"before the deadline\)$",
        ):
            await aiodist.TCPStore.create("127.0.0.1", port, timeout=0.5)
    finally:
        queued.close()
        full.close()


async def test_connect_retries_until_the_server_appears() -> None:
    port = free_port()
    client = asyncio.ensure_future(aiodist.TCPStore.create("127.0.0.1", port, timeout=10))
    await asyncio.sleep(0.3)
    assert not client.done()
    async with await aiodist.TCPStoreServer().start("127.0.0.1", port):
        store = await asyncio.wait_for(client, 5)
        await store.set("k", b"v")
        await store.aclose()


async def test_port_in_use_names_the_port(server: aiodist.TCPStoreServer) -> None:
    with pytest.raises(
        aiodist.DistNetworkError,
        match=rf"cannot listen on 127\.0\.0\.1:{server.port}: .*\(the port is in use\)",
    ):
        await aiodist.TCPStore.create("127.0.0.1", server.port, is_master=True)


async def test_silent_server_gives_a_handshake_error() -> None:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    port = silent.getsockname()[1]
    try:
        with pytest.raises(
            aiodist.DistNetworkError,
            match=rf"the store at 127\.0\.0\.1:{port} did not answer the auto handshake",
        ):
            await aiodist.TCPStore.create("127.0.0.1", port, timeout=0.3)
    finally:
        silent.close()
