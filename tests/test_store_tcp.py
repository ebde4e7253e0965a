"""TCPStore: semantics on both wires, pipelining, the join handshake, auth and size limits."""

from __future__ import annotations

import asyncio
import socket
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator

import pytest

import aiodist
from aiodist.store import _wire
from aiodist.testing import check_store, free_port


async def _master(**kwargs: object) -> aiodist.TCPStore:
    kwargs.setdefault("timeout", 5)
    return await aiodist.TCPStore.create("127.0.0.1", 0, is_master=True, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
async def store() -> AsyncIterator[aiodist.TCPStore]:
    s = await _master()
    yield s
    await s.aclose()


# -- conformance --------------------------------------------------------------------------
@pytest.mark.both_loops
@pytest.mark.parametrize("wire", ["aiodist", "torch", "auto"])
async def test_conformance_kit(wire: str) -> None:
    async def factory() -> aiodist.Store:
        return await _master(wire=wire)

    await check_store(factory)


async def test_conformance_kit_under_prefix_store() -> None:
    masters: list[aiodist.TCPStore] = []

    async def factory() -> aiodist.Store:
        masters.append(await _master())
        return aiodist.PrefixStore("pg", masters[-1])

    try:
        await check_store(factory)
    finally:
        for master in masters:
            await master.aclose()


# -- basic semantics ------------------------------------------------------------------------
@pytest.mark.both_loops
async def test_port_zero_and_repr(store: aiodist.TCPStore) -> None:
    assert store.port > 0
    assert store.wire == "aiodist"
    assert store.server is not None and store.server.port == store.port
    assert repr(store) == (
        f"<TCPStore 127.0.0.1:{store.port} wire=aiodist master=True timeout=5.0 pending=0>"
    )
    assert repr(store.server) == (
        f"<TCPStoreServer 127.0.0.1:{store.port} clients=1 keys=0 waiters=0 auth=off>"
    )


async def test_values_counters_and_compare_set(store: aiodist.TCPStore) -> None:
    await store.set("k", "text")
    await store.set("b", b"\x00\xff")
    assert await store.get("k") == b"text"
    assert await store.get("b") == b"\x00\xff"
    assert await store.add("n", 3) == 3
    assert await store.add("n", -5) == -2
    assert await store.get("n") == b"-2"
    # compare_set: missing+empty creates; missing+non-empty returns expected; match swaps.
    assert await store.compare_set("c", "", "one") == b"one"
    assert await store.compare_set("absent", "x", "y") == b"x"
    assert not await store.check(["absent"])
    assert await store.compare_set("c", "one", "two") == b"two"
    assert await store.compare_set("c", "zzz", "three") == b"two"
    assert await store.delete_key("c")
    assert not await store.delete_key("c")


async def test_get_waits_for_another_client(store: aiodist.TCPStore) -> None:
    other = await store.clone()
    try:
        getter = asyncio.ensure_future(other.get("later"))
        await asyncio.sleep(0.05)
        assert not getter.done()
        await store.set("later", b"v")
        assert await getter == b"v"
    finally:
        await other.aclose()


@pytest.mark.both_loops
@pytest.mark.parametrize("wire", ["aiodist", "torch"])
async def test_wait_timeout_names_keys_and_store_stays_usable(wire: str) -> None:
    store = await _master(wire=wire)
    try:
        await store.set("a", b"1")
        start = time.monotonic()
        with pytest.raises(
            aiodist.DistTimeoutError,
            match=r"timed out after \d+ ms waiting for keys \['a', 'b'\]; still missing: \['b'\]",
        ):
            await store.wait(["a", "b"], timeout=0.2)
        assert 0.15 < time.monotonic() - start < 3
        store.set_timeout(0.1)
        with pytest.raises(aiodist.DistTimeoutError, match=r"still missing: \['nope'\]"):
            await store.get("nope")
        assert await store.add("a", 1) == 2
        assert store.server is not None
        await asyncio.sleep(0.01)
        assert store.server.state.waiter_count == 0
    finally:
        await store.aclose()


async def test_list_keys_hides_the_join_counter_but_num_keys_counts_it() -> None:
    store = await _master(world_size=1)
    try:
        await store.set("x", b"1")
        assert await store.list_keys() == ["x"]
        assert await store.num_keys() == 2  # "x" and torch's "init/"
    finally:
        await store.aclose()


@pytest.mark.both_loops
async def test_queues_fifo_and_empty(store: aiodist.TCPStore) -> None:
    for i in range(5):
        await store.queue_push("q", str(i))
    assert await store.queue_len("q") == 5
    assert [await store.queue_pop("q") for _ in range(5)] == [b"0", b"1", b"2", b"3", b"4"]
    with pytest.raises(aiodist.QueueEmptyError, match=r"queue 'q' is empty"):
        await store.queue_pop("q", block=False)
    popper = asyncio.ensure_future(store.queue_pop("q"))
    await asyncio.sleep(0.05)
    assert not popper.done()
    await store.queue_push("q", b"late")
    assert await popper == b"late"
    store.set_timeout(0.1)
    with pytest.raises(aiodist.DistTimeoutError, match=r"still missing: \['q'\]"):
        await store.queue_pop("q")


# -- pipelining -----------------------------------------------------------------------------
@pytest.mark.both_loops
@pytest.mark.parametrize("wire", ["aiodist", "torch"])
async def test_pending_wait_does_not_block_a_set_on_the_same_client(wire: str) -> None:
    store = await _master(wire=wire)
    try:
        waiter = asyncio.ensure_future(store.wait(["go"]))
        await asyncio.sleep(0.05)
        # Same client object: the set must get through while the wait is pending.
        await asyncio.wait_for(store.set("go", b"1"), 2)
        await asyncio.wait_for(waiter, 2)
    finally:
        await store.aclose()


async def test_a_thousand_concurrent_awaits_on_one_client(store: aiodist.TCPStore) -> None:
    getters = [asyncio.ensure_future(store.get(f"k{i}")) for i in range(500)]
    adds = [store.add("n", 1) for _ in range(500)]
    results = await asyncio.gather(*adds, *(store.set(f"k{i}", str(i)) for i in range(500)))
    assert sorted(results[:500]) == list(range(1, 501))
    assert await asyncio.gather(*getters) == [str(i).encode() for i in range(500)]
    assert await store.get("n") == b"500"


@pytest.mark.both_loops
async def test_request_ids_wrap_past_zero_and_past_ids_still_waiting(
    store: aiodist.TCPStore,
) -> None:
    # After 2**32 requests the id counter wraps. It used to reach 0 (the id CANCEL frames
    # carry) and then the id of a wait still pending: that wait's future was replaced (it
    # never resolved) and the server refused the new request as a reused id.
    channel = store._channel
    first = asyncio.ensure_future(store.get("late"))
    await asyncio.sleep(0.05)
    assert set(channel._pending) == {1}  # type: ignore[attr-defined]
    channel._next_rid = 0xFFFFFFFE  # type: ignore[attr-defined]
    waits = [asyncio.ensure_future(store.get(k)) for k in ("a", "b", "c")]
    await asyncio.sleep(0.05)
    assert set(channel._pending) == {1, 0xFFFFFFFF, 2, 3}  # type: ignore[attr-defined]
    assert store.server is not None
    assert store.server.state.waiter_count == 4
    for key in ("a", "b", "c", "late"):
        await store.set(key, key.encode())
    assert await asyncio.wait_for(asyncio.gather(first, *waits), 5) == [b"late", b"a", b"b", b"c"]
    assert store.server.state.waiter_count == 0


@pytest.mark.both_loops
async def test_leases_are_carried_out_when_a_client_goes_without_withdrawing_them(
    store: aiodist.TCPStore,
) -> None:
    # Three clients go: each has leases that set a key (the first one wins), that append
    # to a key (every one lands), and one it withdrew (nothing happens). The server carries
    # out a client's leases together, as its connection ends.
    await store.set("taken", b"already")
    for name in ("a", "b", "c"):
        client = await store.clone()
        assert await client.lease("first", f"{name} went")
        assert await client.lease("taken", f"{name} went")
        assert await client.lease("log", f"{name};", append=True)
        assert await client.lease("withdrawn", "never")
        assert await client.lease(f"went/{name}", "yes")
        await client.lease("withdrawn", None)
        await client.aclose()
        assert await store.get(f"went/{name}") == b"yes"
    assert await store.get("log") == b"a;b;c;"
    assert await store.get("first") == b"a went"
    assert await store.get("taken") == b"already"
    assert not await store.check(["withdrawn"])
    # A client holds one lease per key: withdrawing it ends either kind.
    client = await store.clone()
    await client.lease("log", "d;", append=True)
    await client.lease("log", None)
    await client.lease("went/d", "yes")
    await client.aclose()
    assert await store.get("went/d") == b"yes"
    assert await store.get("log") == b"a;b;c;"


# -- world size join ------------------------------------------------------------------------
async def test_master_waits_for_workers_to_join() -> None:
    port = free_port()
    master = asyncio.ensure_future(
        aiodist.TCPStore.create("127.0.0.1", port, world_size=3, is_master=True, timeout=5)
    )
    await asyncio.sleep(0.1)
    assert not master.done()
    workers = [
        await aiodist.TCPStore.create("127.0.0.1", port, world_size=3, timeout=5) for _ in range(2)
    ]
    store = await asyncio.wait_for(master, 5)
    assert store.server is not None
    assert store.server.state.get(b"init/") == b"3"  # torch's raw join key, no "/" prefix
    assert await store.num_keys() == 1
    for s in (*workers, store):
        await s.aclose()


async def test_join_timeout_says_how_many_joined() -> None:
    start = time.monotonic()
    with pytest.raises(aiodist.DistTimeoutError, match=r"1/3 clients joined"):
        await aiodist.TCPStore.create("127.0.0.1", 0, world_size=3, is_master=True, timeout=0.3)
    assert time.monotonic() - start < 3


async def test_world_size_zero_is_a_usage_error() -> None:
    with pytest.raises(aiodist.DistUsageError, match=r"world_size must be a positive int, got 0"):
        await aiodist.TCPStore.create("127.0.0.1", 0, world_size=0, is_master=True)


# -- server ----------------------------------------------------------------------------------
async def test_server_binds_only_the_given_address() -> None:
    async with await aiodist.TCPStoreServer().start("127.0.0.1", 0) as server:
        assert server.host == "127.0.0.1"
        # 127.0.0.2 is loopback too, but the server did not bind it.
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.2", server.port)
        store = await aiodist.TCPStore.create("127.0.0.1", server.port, timeout=5)
        await store.set("k", b"v")
        assert server.state.get(b"/k") == b"v"
        assert server.num_clients == 1
        await store.aclose()


async def test_server_without_client_serves_several_stores_and_clone() -> None:
    async with await aiodist.TCPStoreServer().start("127.0.0.1", 0) as server:
        a = await aiodist.TCPStore.create("127.0.0.1", server.port, timeout=5)
        b = await a.clone()
        assert b.server is None and b.port == server.port
        await a.set("x", b"1")
        assert await b.get("x") == b"1"
        await a.aclose()
        await b.aclose()
    with pytest.raises(aiodist.DistUsageError, match="is closed"):
        await a.get("x")


async def test_bad_arguments() -> None:
    with pytest.raises(aiodist.DistUsageError, match=r"await aiodist.TCPStore.create\(host_name"):
        aiodist.TCPStore("127.0.0.1", 29500)  # type: ignore[arg-type]
    with pytest.raises(aiodist.DistUsageError, match=r"wire must be 'auto', 'aiodist' or 'torch'"):
        await aiodist.TCPStore.create("127.0.0.1", 0, is_master=True, wire="grpc")  # type: ignore[arg-type]
    with pytest.raises(aiodist.DistUsageError, match=r"max_key_size must be an integer"):
        aiodist.TCPStoreServer(max_key_size=0)
    with pytest.raises(aiodist.DistUsageError, match=r"auth_token must not be empty"):
        aiodist.TCPStoreServer(auth_token="")
    store = await _master()
    try:
        with pytest.raises(aiodist.DistUsageError, match="add amount must be an int"):
            await store.add("n", 1.5)  # type: ignore[arg-type]
        with pytest.raises(aiodist.DistUsageError, match="multi_set got 2 keys but 1 values"):
            await store.multi_set(["a", "b"], [b"1"])
    finally:
        await store.aclose()


# -- auth -----------------------------------------------------------------------------------
async def test_auth_right_token_works() -> None:
    store = await _master(auth_token="s3cret")
    try:
        other = await aiodist.TCPStore.create("127.0.0.1", store.port, auth_token=b"s3cret")
        await other.set("k", b"v")
        assert await store.get("k") == b"v"
        await other.aclose()
        assert "auth=on" in repr(store.server)
    finally:
        await store.aclose()


@pytest.mark.parametrize("wire", ["aiodist", "auto"])
async def test_auth_wrong_or_missing_token_is_refused(
    wire: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AIODIST_AUTH_TOKEN", raising=False)
    store = await _master(auth_token="s3cret")
    try:
        with pytest.raises(aiodist.DistStoreError, match=r"rejected the auth token"):
            await aiodist.TCPStore.create(
                "127.0.0.1", store.port, auth_token="wrong", wire=wire, timeout=2
            )
        with pytest.raises(aiodist.DistStoreError, match=r"requires authentication: pass auth_to"):
            await aiodist.TCPStore.create("127.0.0.1", store.port, wire=wire, timeout=2)
        assert await store.add("still", 1) == 1
    finally:
        await store.aclose()


async def test_auth_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIODIST_AUTH_TOKEN", "from-env")
    store = await _master()
    try:
        assert "auth=on" in repr(store.server)
        other = await aiodist.TCPStore.create("127.0.0.1", store.port, timeout=2)
        await other.set("k", b"1")
        await other.aclose()
        monkeypatch.delenv("AIODIST_AUTH_TOKEN")
        with pytest.raises(aiodist.DistStoreError, match="requires authentication"):
            await aiodist.TCPStore.create("127.0.0.1", store.port, timeout=2)
    finally:
        await store.aclose()


async def test_auth_refuses_torch_clients_unless_allowed() -> None:
    store = await _master(auth_token="s3cret")
    try:
        with pytest.raises(aiodist.DistNetworkError, match="lost the connection"):
            await aiodist.TCPStore.create("127.0.0.1", store.port, wire="torch", timeout=2)
    finally:
        await store.aclose()
    store = await _master(auth_token="s3cret", allow_unauthenticated_torch=True)
    try:
        torch_client = await aiodist.TCPStore.create(
            "127.0.0.1", store.port, wire="torch", timeout=2
        )
        await torch_client.set("k", b"t")
        assert await store.get("k") == b"t"
        await torch_client.aclose()
    finally:
        await store.aclose()


# -- size limits ------------------------------------------------------------------------------
async def test_client_side_size_limits_name_size_and_limit() -> None:
    store = await _master(max_key_size=16, max_value_size=100)
    try:
        with pytest.raises(
            aiodist.DistUsageError, match=r"key of 21 bytes exceeds the store's max_key_size of 16"
        ):
            await store.set("k" * 20, b"v")
        with pytest.raises(
            aiodist.DistUsageError,
            match=r"value of 101 bytes exceeds the store's max_value_size of 100",
        ):
            await store.set("k", b"v" * 101)
        # A client asking for larger limits still gets the server's.
        other = await aiodist.TCPStore.create("127.0.0.1", store.port, max_value_size=10**6)
        with pytest.raises(aiodist.DistUsageError, match=r"max_value_size of 100 bytes"):
            await other.set("k", b"v" * 101)
        await other.append("k", b"v" * 60)
        with pytest.raises(
            aiodist.DistUsageError, match=r"append would make key 'k' 120 bytes long, past the"
        ):
            await other.append("k", b"v" * 60)
        assert await other.get("k") == b"v" * 60
        await other.aclose()
        assert await store.add("ok", 1) == 1
    finally:
        await store.aclose()


def _raw_client(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(_wire.CLIENT_HELLO.pack(_wire.AIODIST_MAGIC, _wire.PROTOCOL_VERSION, b"n" * 32))
    hello = _recv_exactly(sock, _wire.SERVER_HELLO.size)
    assert hello[:4] == _wire.AIODIST_MAGIC
    return sock


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError(f"connection closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def _recv_frame(sock: socket.socket) -> tuple[int, int, bytes]:
    (length,) = struct.unpack("<I", _recv_exactly(sock, 4))
    body = _recv_exactly(sock, length)
    rid, status = struct.unpack_from("<IB", body)
    return rid, status, body[5:]


async def test_server_side_size_limits_keep_the_connection() -> None:
    server = await aiodist.TCPStoreServer(max_key_size=16, max_value_size=100).start()
    try:

        def talk() -> list[tuple[int, int, bytes]]:
            with _raw_client(server.port) as sock:
                # A value past max_value_size inside an acceptable frame.
                sock.sendall(
                    _wire.encode_frame(
                        7, _wire.Op.SET, _wire.blob32(b"/k"), _wire.blob32(b"v" * 101)
                    )
                )
                first = _recv_frame(sock)
                # A frame far past the request limit: answered at once, its body skipped.
                huge = 10 * 1024 * 1024
                sock.sendall(struct.pack("<IIB", huge + 5, 8, _wire.Op.SET))
                second = _recv_frame(sock)
                sock.sendall(b"\x00" * huge)
                sock.sendall(_wire.encode_frame(9, _wire.Op.PING))
                third = _recv_frame(sock)
                return [first, second, third]

        first, second, third = await asyncio.to_thread(talk)
        assert first[:2] == (7, _wire.Status.USAGE_ERROR)
        assert first[2] == b"value of 101 bytes exceeds the limit of 100 bytes"
        assert second[:2] == (8, _wire.Status.USAGE_ERROR)
        assert second[2].startswith(b"request of 10485765 bytes exceeds the server's limit of")
        assert third == (9, _wire.Status.OK, b"")
        assert server.state.num_keys() == 0
    finally:
        await server.aclose()


# -- protocol version ---------------------------------------------------------------------------
async def test_server_answers_a_version_mismatch_with_its_version_and_closes() -> None:
    async with await aiodist.TCPStoreServer().start() as server:

        def talk() -> tuple[bytes, bytes]:
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
                sock.sendall(_wire.CLIENT_HELLO.pack(_wire.AIODIST_MAGIC, 99, b"n" * 32))
                hello = _recv_exactly(sock, _wire.SERVER_HELLO.size)
                return hello, sock.recv(10)

        hello, rest = await asyncio.to_thread(talk)
        assert _wire.SERVER_HELLO.unpack(hello)[:2] == (_wire.AIODIST_MAGIC, _wire.PROTOCOL_VERSION)
        assert rest == b""


async def test_client_reports_a_server_of_another_protocol_version() -> None:
    async def old_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(_wire.CLIENT_HELLO.size)
        writer.write(_wire.SERVER_HELLO.pack(_wire.AIODIST_MAGIC, 99, 0, 10, 10, b"s" * 32))
        await writer.drain()
        await reader.read()
        writer.close()

    server = await asyncio.start_server(old_server, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(
            aiodist.DistProtocolError,
            match=r"speaks aiodist store protocol version 99, this client speaks version 5",
        ):
            await aiodist.TCPStore.create("127.0.0.1", port, wire="aiodist", timeout=2)
    finally:
        server.close()
        await server.wait_closed()


# -- many processes -------------------------------------------------------------------------------
_ADDER = textwrap.dedent(
    """
    import asyncio, sys
    import aiodist

    async def main(port):
        store = await aiodist.TCPStore.create("127.0.0.1", port, timeout=30)
        for _ in range(1000):
            await store.add("total", 1)
        await store.aclose()

    asyncio.run(main(int(sys.argv[1])))
    """
)


@pytest.mark.multiprocess
async def test_sixteen_processes_add_exactly() -> None:
    async with await aiodist.TCPStoreServer().start() as server:
        procs = [
            await asyncio.create_subprocess_exec(
                sys.executable, "-c", _ADDER, str(server.port), stderr=subprocess.PIPE
            )
            for _ in range(16)
        ]
        results = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), 90)
        for proc, (_out, err) in zip(procs, results, strict=True):
            assert proc.returncode == 0, err.decode()
        assert server.state.get(b"/total") == b"16000"


_BLOCKED_HOST = textwrap.dedent(
    """
    import asyncio, sys, time
    import numpy as np
    import aiodist
    from aiodist.rendezvous import rendezvous

    async def main(rank, port):
        if rank == 0:
            store = await aiodist.TCPStore.create(
                "127.0.0.1", port, world_size=3, is_master=True, wait_for_workers=False,
                timeout=60,
            )
            print("hosting", flush=True)
            time.sleep(5)  # this rank's event loop is blocked: nothing of it runs
            met = await store.check(["met/1", "met/2"])
        else:
            sys.stdin.readline()  # (imported: go once rank 0 hosts the store)
            store, _, _ = await rendezvous(
                f"tcp://127.0.0.1:{port}", rank=rank, world_size=3, timeout=60
            )
            # The two others first meet through the store, while rank 0 sleeps.
            await store.set(f"hello/{rank}", b"here")
            await store.get(f"hello/{3 - rank}")
            await store.set(f"met/{rank}", b"")
            met = True
        pg = await aiodist.init_process_group("cpu", store=store, rank=rank, world_size=3)
        x = np.array([rank + 1.0])
        await aiodist.all_reduce(x)
        print(f"met while rank 0 slept: {met}; sum {x[0]:g}; {pg.size} ranks", flush=True)
        await aiodist.destroy_process_group()
        await store.add("left", 1)
        if rank == 0:  # (the others' last requests go to this rank's server)
            await store.barrier("left", 4)
        await store.aclose()

    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
    """
)


@pytest.mark.multiprocess
def test_a_rank_blocked_in_its_event_loop_still_serves_the_store_it_hosts() -> None:
    # The store's server runs apart from the loop of the rank that hosts it: a long
    # blocking step there used to stall every store request of the job.
    port = free_port()
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _BLOCKED_HOST, str(rank), str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (1, 2, 0)
    ]
    others, host = ranks[:2], ranks[2]
    try:
        assert host.stdout is not None
        assert host.stdout.readline() == "hosting\n", host.communicate(timeout=10)
        for proc in others:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outs = [proc.communicate(timeout=60) for proc in (host, *others)]
    finally:
        for proc in ranks:
            proc.kill()
            proc.communicate()
    for proc, (out, err) in zip((host, *others), outs, strict=True):
        assert proc.returncode == 0, err
        assert out.splitlines()[-1] == "met while rank 0 slept: True; sum 6; 3 ranks", out


def _liveness_options(sock: socket.socket) -> tuple[int, int, int, int, int]:
    return (
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY),
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
    )


@pytest.mark.both_loops
@pytest.mark.parametrize("wire", ["aiodist", "torch"])
async def test_connections_bound_peer_silence_on_both_ends(
    wire: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A peer whose host vanishes without FIN or RST is noticed by keepalive probes (2 s idle,
    # every 1 s) and TCP_USER_TIMEOUT, on the client's sockets and the server's alike.
    monkeypatch.setenv("AIODIST_PEER_TIMEOUT", "4.5")
    async with await aiodist.TCPStoreServer(peer_timeout=3).start() as server:
        store = await aiodist.TCPStore.create("127.0.0.1", server.port, wire=wire, timeout=5)  # type: ignore[arg-type]
        with pytest.raises(aiodist.DistTimeoutError):
            await store.wait(["absent"], timeout=0.05)  # on torch's wire: a spare connection
        assert server.num_clients == (1 if wire == "aiodist" else 2)
        for conn in server._connections:
            server_sock = conn._transport.get_extra_info("socket")  # type: ignore[union-attr]
            assert _liveness_options(server_sock) == (1, 1, 2, 1, 3000)
        client_sock = store._channel._conn.transport.get_extra_info("socket")  # type: ignore[attr-defined]
        assert _liveness_options(client_sock) == (1, 1, 2, 1, 4500)
        await store.aclose()


async def test_peer_timeout_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(aiodist.DistUsageError, match=r"peer_timeout must be a finite number"):
        aiodist.TCPStoreServer(peer_timeout=0.5)
    monkeypatch.setenv("AIODIST_PEER_TIMEOUT", "soon")
    with pytest.raises(aiodist.DistUsageError, match=r"AIODIST_PEER_TIMEOUT='soon' is not"):
        await aiodist.TCPStore.create("127.0.0.1", 1, timeout=1)
