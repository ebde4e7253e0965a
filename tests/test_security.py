"""Security: one shared secret for the store and every peer connection, bound listeners,
bounded lengths wherever a peer announces one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import raw_peer
from netns_helpers import IPV4, Hosts
from numpy._core.multiarray import _reconstruct
from raw_peer import HEADER, frame
from store_attacks import (
    VALIDATE,
    ServerProcess,
    closed_within,
    idle_sockets,
    torch_add,
    torch_set_head,
)
from transport_attacks import MESSAGE, TAG as ATTACK_TAG, RankProcess

import aiodist
import aiodist._assembly._join
from aiodist import collectives
from aiodist._util._auth import auth_mac, derive_key
from aiodist.collectives.shm_workspace import NodeWorkspace
from aiodist.debug import gather_status
from aiodist.group import Plan, resolve_group
from aiodist.serving import _wire as serving_wire
from aiodist.store import _server as store_server
from aiodist.store._wire import (
    AIODIST_MAGIC,
    CLIENT_HELLO,
    PROTOCOL_VERSION,
    Op,
    blob32,
    encode_frame,
)
from aiodist.testing import free_port, run_world
from aiodist.transport import tcp
from aiodist.transport._shm_segment import (
    SHM_DIR,
    ProcessId,
    Segment,
    SharedMemoryError,
    job_prefix,
    open_checked,
    peer_fd_path,
    peer_path,
    this_process,
)
from aiodist.transport._shm_signal import Bell
from aiodist.transport.base import OpComm, PeerDirectory
from aiodist.transport.shm import ShmTransport
from aiodist.transport.tcp import TCPTransport

pytestmark = pytest.mark.both_loops

T = (7, 1, 0)
TOKEN = b"correct horse battery staple"
#: The loops a server or rank in a process of its own runs on, for the attacks on it.
SERVER_LOOPS = ["uvloop", "asyncio"]


@pytest.fixture(autouse=True)
def _no_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIODIST_AUTH_TOKEN", raising=False)


async def transports(
    store: aiodist.Store, tokens: list[bytes | None], **kw: Any
) -> list[TCPTransport]:
    n = len(tokens)
    return [
        await TCPTransport.create(PeerDirectory(store), r, n, timeout=5, auth_token=tok, **kw)
        for r, tok in enumerate(tokens)
    ]


async def close_all(ts: list[TCPTransport]) -> None:
    for t in ts:
        await t.aclose()


async def eof_or_reset(reader: asyncio.StreamReader) -> bytes:
    """Read until the peer closes; a reset (unread bytes on its side) counts as closed, and so
    does a broken pipe (our own unsent bytes met the closed socket first: the transport reports
    that error to the reader)."""
    with contextlib.suppress(ConnectionResetError, BrokenPipeError):
        return await asyncio.wait_for(reader.read(), 5)
    return b""


# -- peer connections ---------------------------------------------------------------------------
async def test_ranks_with_the_same_token_talk() -> None:
    ts = await transports(aiodist.HashStore(timeout=5), [TOKEN, TOKEN])
    try:
        out = bytearray(5)
        fut = ts[1].recv_into(0, T, memoryview(out))
        await ts[0].send(1, T, memoryview(b"hello"))
        assert await fut == 0 and out == b"hello"
        assert "auth=on" in repr(ts[0])
    finally:
        await close_all(ts)


async def test_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIODIST_AUTH_TOKEN", TOKEN.decode())
    ts = await transports(aiodist.HashStore(timeout=5), [None, TOKEN])
    try:
        out = bytearray(2)
        fut = ts[0].recv_into(1, T, memoryview(out))
        await ts[1].send(0, T, memoryview(b"ok"))
        assert await fut == 1 and out == b"ok"
    finally:
        await close_all(ts)


async def test_rank_without_the_token_is_refused_and_the_others_keep_working() -> None:
    ts = await transports(aiodist.HashStore(timeout=5), [TOKEN, None, TOKEN])
    try:
        with pytest.raises(
            aiodist.DistNetworkError,
            match=r"authentication with rank 0 failed: it requires an auth token and this "
            r"rank has none",
        ):
            await ts[1].send(0, T, memoryview(b"x"))
        with pytest.raises(
            aiodist.DistNetworkError,
            match=r"authentication with rank 1 failed: this rank has an auth token and "
            r"rank 1 has none",
        ):
            await ts[2].send(1, T, memoryview(b"x"))
        out = bytearray(1)
        fut = ts[0].recv_into(2, T, memoryview(out))
        await ts[2].send(0, T, memoryview(b"y"))
        assert await fut == 2 and out == b"y"
        assert ts[0].mailbox.num_staged() == 0
    finally:
        await close_all(ts)


async def test_wrong_token_is_named_on_the_connecting_side() -> None:
    ts = await transports(aiodist.HashStore(timeout=5), [TOKEN, b"another token"])
    try:
        fut = ts[0].recv_into(None, T, memoryview(bytearray(1)))
        with pytest.raises(
            aiodist.DistNetworkError,
            match=r"authentication with rank 0 failed: it could not prove it holds this "
            r"rank's auth token \(the ranks' tokens differ\)",
        ):
            await ts[1].send(0, T, memoryview(b"x"))
        await asyncio.sleep(0.1)
        assert not fut.done()  # nothing from the impostor reached rank 0
        fut.cancel()
    finally:
        await close_all(ts)


async def test_unauthenticated_bytes_never_reach_a_receive() -> None:
    """No frame of a peer that has not proven the token is read, so no pickle is loaded."""
    ts = await transports(aiodist.HashStore(timeout=5), [TOKEN, TOKEN])
    t0 = ts[0]
    evil = pickle.dumps(print)  # what an object collective would unpickle
    got = bytearray(len(evil))
    fut = t0.recv_into(None, T, memoryview(got))
    try:
        # 1. A hello without the auth flag: told why, then dropped.
        reader, writer = await asyncio.open_connection(*t0.address)
        writer.write(raw_peer.hello(1, 2, auth=False) + frame(T, evil))
        reply = raw_peer.HANDSHAKE.unpack(await reader.readexactly(raw_peer.HANDSHAKE.size))
        assert reply[2] == raw_peer.REFUSED and reply[3] & raw_peer.FLAG_AUTH
        assert await eof_or_reset(reader) == b""
        writer.close()
        # 2. Claims the auth flag, then sends frames instead of a proof.
        reader, writer = await asyncio.open_connection(*t0.address)
        writer.write(raw_peer.hello(1, 2, auth=True) + frame(T, evil))
        reply = raw_peer.HANDSHAKE.unpack(await reader.readexactly(raw_peer.HANDSHAKE.size))
        assert reply[2] == raw_peer.ACCEPT
        assert await eof_or_reset(reader) == b""
        writer.close()
        # 3. A proof made with the wrong token.
        reader, writer, _, verified = await raw_peer.connect(t0.address, 1, 0, 2, b"guess")
        assert not verified  # rank 0's proof does not verify with the wrong token either
        writer.write(frame(T, evil))
        assert await eof_or_reset(reader) == b""
        writer.close()
        await asyncio.sleep(0.1)
        assert not fut.done() and t0.mailbox.num_staged() == 0
        assert t0.connected_peers() == []
        # The real rank 1 still gets in.
        await ts[1].send(0, T, memoryview(evil))
        assert await fut == 1 and bytes(got) == evil
    finally:
        await close_all(ts)


async def test_object_collectives_over_an_authenticated_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AIODIST_AUTH_TOKEN", "group secret")

    async def fn(rank: int, size: int) -> list[Any]:
        assert "auth=on" in repr(resolve_group(None, "test")._world.transport)
        out: list[Any] = [None] * size
        await aiodist.all_gather_object(out, {"rank": rank})
        return out

    assert await run_world(fn, 3) == [[{"rank": r} for r in range(3)]] * 3


async def test_init_process_group_auth_token_covers_store_and_peers() -> None:
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"

    async def rank_fn(rank: int) -> float:
        aiodist.group.isolate_context()  # ranks as tasks of one process
        await aiodist.init_process_group(
            "cpu", init_method=url, rank=rank, world_size=2, timeout=20, auth_token="s3cret"
        )
        try:
            assert "auth=on" in repr(resolve_group(None, "test")._world.transport)
            x = np.array([rank + 1.0, 10.0 * rank])
            await aiodist.all_reduce(x)
            if rank == 0:
                with pytest.raises(aiodist.DistStoreError, match="requires authentication"):
                    await aiodist.TCPStore.create("127.0.0.1", port, timeout=2)
            await aiodist.barrier()
            return float(x.sum())
        finally:
            await aiodist.destroy_process_group()

    assert await asyncio.gather(rank_fn(0), rank_fn(1)) == [13.0, 13.0]


# -- posing as a rank ---------------------------------------------------------------------------
def _claim(address: tuple[str, int], rank: int, token: bytes | None) -> tuple[Any, ...]:
    """A stranger's hello claiming ``rank`` of 2 (with the auth flag if ``token``, and a
    proof made with it); the answer, once the connection is closed."""
    with socket.create_connection(address, timeout=5) as s:
        nonce = os.urandom(32)
        s.sendall(raw_peer.hello(rank, 2, auth=token is not None, nonce=nonce))
        reply = raw_peer.HANDSHAKE.unpack(s.recv(raw_peer.HANDSHAKE.size, socket.MSG_WAITALL))
        with contextlib.suppress(ConnectionError):  # (it may be closed already)
            if token is not None:
                ids = raw_peer.IDS.pack(rank, 1 - rank, 2)
                s.sendall(auth_mac(token, b"peer/connect", reply[6], nonce + ids))
            s.sendall(frame(T, b"stranger"))
            while s.recv(65536):
                pass
        return reply


async def test_without_a_secret_anyone_can_pose_as_a_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """No token: the first process to say it is rank 1 is rank 1 for rank 0, which receives
    what it sends. The real rank 1 is then refused, and says why within the peer timeout
    instead of waiting for the connect timeout."""
    monkeypatch.setenv("AIODIST_PEER_TIMEOUT", "1")
    ts = await transports(aiodist.HashStore(timeout=5), [None, None])
    try:
        _, writer, reply, _ = await raw_peer.connect(ts[0].address, 1, 0, 2, None)
        assert reply[2] == raw_peer.ACCEPT
        writer.write(frame(T, b"stranger"))
        got = bytearray(8)
        assert await ts[0].recv_into(1, T, memoryview(got)) == 1 and got == b"stranger"
        start = time.monotonic()
        with pytest.raises(
            aiodist.DistNetworkError,
            match=r"^lost connection to rank 0: it refused this rank's connection: it is "
            r"connected already to another process that claimed to be rank 1: without a "
            r"secret, anyone who can reach a rank's port can pose as a rank \(give every rank "
            r"the same auth_token / AIODIST_AUTH_TOKEN\)$",
        ):
            await ts[1].send(0, T, memoryview(b"realrank"))
        assert time.monotonic() - start < 4
        writer.close()
    finally:
        await close_all(ts)


@pytest.mark.parametrize("token", [TOKEN, None], ids=["secret", "none"])
async def test_a_strangers_hello_never_breaks_a_ranks_connection(
    token: bytes | None, caplog: pytest.LogCaptureFixture
) -> None:
    """Ranks 0 and 1 are connected; strangers claiming either (with a guessed proof where
    the job has a secret) are refused, told that the rank is held, and the ranks' own
    connection carries on in both directions."""
    ts = await transports(aiodist.HashStore(timeout=5), [token, token])

    async def exchange(data: bytes) -> None:
        for src, dst in [(0, 1), (1, 0)]:
            out = bytearray(len(data))
            fut = ts[dst].recv_into(src, T, memoryview(out))
            await ts[src].send(dst, T, memoryview(data))
            assert await fut == src and out == data

    try:
        await exchange(b"before")
        guess = None if token is None else b"a guess"
        for victim, claimed in [(0, 1), (1, 0)]:
            reply = await asyncio.to_thread(_claim, ts[victim].address, claimed, guess)
            assert reply[2] == raw_peer.REJECT and reply[3] & raw_peer.FLAG_HELD, reply
        await exchange(b"after!")
        assert ts[0].connected_peers() == [1] and ts[1].connected_peers() == [0]
        assert ts[0].mailbox.num_staged() == ts[1].mailbox.num_staged() == 0
        if token is None:
            assert (
                "which it is connected to already: without a secret, another process may "
                "have posed as rank 1" in caplog.text
            )
    finally:
        await close_all(ts)


async def test_with_a_secret_a_strangers_claim_keeps_nobody_out() -> None:
    """A stranger claims rank 1 first and holds its handshake open (it cannot prove the
    token): the real rank 1 connects meanwhile and is rank 1; the stranger is dropped."""
    ts = await transports(aiodist.HashStore(timeout=5), [TOKEN, TOKEN])
    try:
        reader, writer = await asyncio.open_connection(*ts[0].address)
        writer.write(raw_peer.hello(1, 2, auth=True, nonce=os.urandom(32)))
        reply = raw_peer.HANDSHAKE.unpack(await reader.readexactly(raw_peer.HANDSHAKE.size))
        assert reply[2] == raw_peer.ACCEPT  # (it now waits for the stranger's proof)
        out = bytearray(8)
        fut = ts[0].recv_into(None, T, memoryview(out))
        await ts[1].send(0, T, memoryview(b"realrank"))
        assert await fut == 1 and out == b"realrank"
        writer.write(bytes(32) + frame(T, b"stranger"))
        assert await eof_or_reset(reader) == b""
        writer.close()
        assert ts[0].connected_peers() == [1] and ts[0].mailbox.num_staged() == 0
    finally:
        await close_all(ts)


async def test_a_connection_proved_late_is_not_taken_for_an_impostor(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Rank 1 connects to rank 0 (through a relay that holds its proof back a while): it
    counts the connection as open once it sent the proof, rank 0 only once it checked it.
    Rank 0 connecting to rank 1 meanwhile is told that rank 1 is connected to a process
    claiming rank 0, which is rank 0 itself: it waits for its proof to arrive, and both
    messages go through the one connection."""
    store = aiodist.HashStore(timeout=5)
    ts = await transports(store, [TOKEN, TOKEN])
    release = asyncio.Event()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*ts[0].address)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, hold: bool) -> None:
            if hold:
                dst.write(await src.readexactly(raw_peer.HANDSHAKE.size))
                await release.wait()
            while data := await src.read(65536):
                dst.write(data)
            dst.close()

        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    await store.set("transport/tcp/0", f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        got = [bytearray(3), bytearray(3)]
        # (From any rank: a receive from a rank connects to it at once.)
        futs = [ts[r].recv_into(None, T, memoryview(got[r])) for r in (0, 1)]
        await ts[1].send(0, T, memoryview(b"one"))
        assert ts[1].connected_peers() == [0] and ts[0].connected_peers() == []
        sent = ts[0].send(1, T, memoryview(b"two"))
        await asyncio.sleep(0.3)  # (rank 1 refused rank 0's connection: rank 0 waits)
        assert not sent.done()
        release.set()
        await asyncio.wait_for(sent, 5)
        assert await asyncio.gather(*futs) == [1, 0] and got == [b"one", b"two"]
        assert ts[0].connected_peers() == [1] and ts[1].connected_peers() == [0]
        assert "refused" not in caplog.text
    finally:
        await close_all(ts)
        server.close()


# -- the transport before a peer is let in -----------------------------------------------------
async def test_a_connection_in_its_handshake_costs_a_rank_a_few_kib() -> None:
    """100 connections send a hello claiming rank 1, with the auth flag, and never prove
    the token: rank 0 answers each, holds no read buffer for any (less than 16 KiB of
    Python memory apiece, asyncio's objects included; a read buffer alone is 64 KiB), and
    lets none in."""
    ts = await transports(aiodist.HashStore(timeout=5), [TOKEN, TOKEN])
    t0 = ts[0]
    count = 100

    def claim() -> list[socket.socket]:
        socks = [
            socket.create_connection(t0.address, timeout=5, source_address=(f"127.0.0.{i}", 0))
            for i in range(2, 2 + count)
        ]
        for s in socks:
            s.sendall(raw_peer.hello(1, 2, auth=True, nonce=os.urandom(32)))
        for s in socks:
            assert len(s.recv(raw_peer.HANDSHAKE.size, socket.MSG_WAITALL)) == 90
        return socks

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        socks = await asyncio.to_thread(claim)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    try:
        assert held < count * 16 << 10, f"{held / count:.0f} bytes per connection"
        assert t0.connected_peers() == [] and t0.mailbox.num_staged() == 0
    finally:
        for s in socks:
            s.close()
        await close_all(ts)


async def test_a_ranks_handshakes_of_one_address_are_capped_the_oldest_goes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tcp, "MIN_HANDSHAKES_PER_HOST", 4)
    ts = await transports(aiodist.HashStore(timeout=5), [TOKEN, TOKEN])
    t0 = ts[0]
    try:
        crowd = [
            await asyncio.open_connection(*t0.address, local_addr=("127.0.0.2", 0))
            for _ in range(6)
        ]
        other = await asyncio.open_connection(*t0.address, local_addr=("127.0.0.3", 0))
        # The two oldest of 127.0.0.2 are closed at once; the rest, and 127.0.0.3's, wait.
        for reader, _ in crowd[:2]:
            assert await eof_or_reset(reader) == b""
        for reader, _ in [*crowd[2:], other]:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(reader.read(1), 0.3)
        out = bytearray(2)
        fut = t0.recv_into(None, T, memoryview(out))
        await ts[1].send(0, T, memoryview(b"ok"))
        assert await fut == 1 and out == b"ok"
        for _, writer in [*crowd, other]:
            writer.close()
    finally:
        await close_all(ts)


async def test_refused_connections_are_logged_sparingly(caplog: pytest.LogCaptureFixture) -> None:
    """300 connections that send garbage or a hello without the token: rank 0 says so once
    in ten seconds (then with the count of those it did not say), not 300 times."""
    ts = await transports(aiodist.HashStore(timeout=5), [TOKEN, TOKEN])

    def knock() -> None:
        for _ in range(150):
            for data in (b"GET / HTTP/1.1\r\n\r\n", raw_peer.hello(1, 2, auth=False)):
                with socket.create_connection(ts[0].address, timeout=5) as s:
                    s.sendall(data)
                    with contextlib.suppress(ConnectionResetError):
                        while s.recv(4096):
                            pass

    try:
        start = time.monotonic()
        await asyncio.to_thread(knock)
        elapsed = time.monotonic() - start
    finally:
        await close_all(ts)
    said = [r.getMessage() for r in caplog.records if r.name.startswith("aiodist.transport")]
    assert len(said) <= 1 + elapsed // 10, said
    assert said[0].startswith("rank 0 dropped a connection from 127.0.0.1: a peer sent b'G"), said


@pytest.mark.parametrize("rank_loop", SERVER_LOOPS)
@pytest.mark.parametrize(
    "sources", [["127.0.0.1"], [f"127.0.0.{i}" for i in range(2, 12)]], ids=["one", "ten"]
)
def test_idle_connections_leave_the_real_rank_served(
    rank_loop: str, sources: list[str], tmp_path: Path
) -> None:
    """130 connections that never say a word, against rank 0 of a world of 2 in a process
    that may open 128 files (from one address: its cap per address; from ten: its
    descriptors run out), then the real rank 1: its message arrives, and rank 0 neither
    spins nor floods its log."""
    store = str(tmp_path / "store")
    with RankProcess(rank_loop, TOKEN.decode(), store, nofile=128) as rank0:
        cpu = rank0.cpu()
        start = time.monotonic()
        socks = idle_sockets(rank0.port, 130, sources)

        async def rank1() -> None:
            directory = PeerDirectory(aiodist.FileStore(store, timeout=20))
            t = await TCPTransport.create(directory, 1, 2, timeout=20, auth_token=TOKEN)
            try:
                await t.send(0, ATTACK_TAG, memoryview(MESSAGE))
            finally:
                await t.aclose()

        try:
            asyncio.run(rank1())
            got = rank0.message()
        finally:
            for s in socks:
                s.close()
        elapsed = time.monotonic() - start
        cpu = rank0.cpu() - cpu
    assert got == f"1 {MESSAGE.hex()}"
    assert cpu < 0.5 * elapsed + 0.5, f"{cpu:.1f} s of CPU in {elapsed:.1f} s"
    lines = rank0.stderr.count(b"\n")
    assert lines < 20, f"{lines} lines of log:\n{rank0.stderr[-3000:].decode()}"


_BACKLOG = """
import asyncio, subprocess
from aiodist.store import HashStore
from aiodist.transport.base import PeerDirectory
from aiodist.transport import tcp
from aiodist.transport.tcp import TCPTransport

async def main():
    for size in (2, 500, 5000):
        t = await TCPTransport.create(PeerDirectory(HashStore()), 0, size)
        ss = ["ss", "-ltnH", f"sport = :{t.address[1]}"]
        print(size, subprocess.run(ss, capture_output=True, text=True).stdout.split()[2])
        await t.aclose()

asyncio.run(main())
"""


def test_a_ranks_listen_backlog_is_sized_to_the_world() -> None:
    """Room for every other rank connecting at once (with the kernel's cap raised, in a
    network namespace of its own, so that the cap is not what is seen)."""
    if os.geteuid() != 0:
        pytest.skip("raising net.core.somaxconn in a network namespace needs root")
    raise_cap = "ip link set lo up && echo 65535 > /proc/sys/net/core/somaxconn"
    proc = subprocess.run(
        [
            "unshare",
            "-n",
            "sh",
            "-c",
            f'{raise_cap} && exec "$0" -c "$1"',
            sys.executable,
            _BACKLOG,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:3] == ["2 128", "500 500", "5000 5000"], proc.stdout


# -- listeners bind the given interface ---------------------------------------------------------
async def test_transport_listener_binds_only_the_given_address() -> None:
    t = await TCPTransport.create(PeerDirectory(aiodist.HashStore()), 0, 1, host="127.0.0.2")
    try:
        host, port = t.address
        assert host == "127.0.0.2"
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)
        _, writer = await asyncio.open_connection("127.0.0.2", port)
        writer.close()
    finally:
        await t.aclose()


async def test_store_listener_binds_only_the_given_address() -> None:
    async with await aiodist.TCPStore.create("127.0.0.2", 0, is_master=True, timeout=5) as store:
        port = store.port
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)
        with pytest.raises(aiodist.DistNetworkError):
            await aiodist.TCPStore.create("127.0.0.1", port, timeout=0.5)
        async with await aiodist.TCPStore.create("127.0.0.2", port, timeout=5) as client:
            await client.set("k", b"v")
            assert await store.get("k") == b"v"


# -- lengths a peer announces ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("nbytes", "message"),
    [
        (1 << 48, r"rank 1 sent a frame header announcing 281474976710656 bytes"),
        # The ten largest lengths mark control messages; the next one is garbage.
        (2**64 - 11, r"announcing 18446744073709551605 bytes"),
        # Below the header bound, but more than a 47-bit address space can hold.
        ((1 << 47) + 5, r"rank 1 sent a message of 140737488355333 bytes, more than this rank "),
    ],
)
async def test_frame_length_is_bounded(nbytes: int, message: str) -> None:
    ts = await transports(aiodist.HashStore(timeout=5), [TOKEN, TOKEN])
    t0 = ts[0]
    try:
        reader, writer, _, verified = await raw_peer.connect(t0.address, 1, 0, 2, TOKEN)
        assert verified
        writer.write(HEADER.pack(*T, nbytes))
        with pytest.raises(aiodist.DistProtocolError, match=message):
            await asyncio.wait_for(t0.recv_into(1, (9, 9, 9), memoryview(bytearray(1))), 5)
        assert await eof_or_reset(reader) == b""
        writer.close()
        # Rank 0 lives on, and tells the next caller what happened to rank 1.
        with pytest.raises(aiodist.DistProtocolError, match=message):
            await t0.send(1, T, memoryview(b"x"))
    finally:
        await close_all(ts)


@pytest.mark.parametrize("announced", [1 << 60, -1, (1 << 40) + 1])
@pytest.mark.parametrize(
    "op", ["broadcast_object_list", "all_gather_object", "scatter_object_list"]
)
async def test_announced_object_size_is_bounded(op: str, announced: int) -> None:
    """Rank 1 announces an absurd pickle size; rank 0 gets a clear error, not a MemoryError."""

    async def liar(c_sizes: OpComm, c_data: OpComm) -> None:
        sizes = np.array([announced], np.int64)
        if op == "all_gather_object":
            await collectives.all_gather(c_sizes, list(np.zeros((2, 1), np.int64)), sizes)
        else:
            # broadcast_object_list: one size per object; scatter_object_list: one per rank.
            count = 1 if op == "broadcast_object_list" else 2
            await collectives.broadcast(c_sizes, np.repeat(sizes, count), 1)

    async def fn(rank: int, size: int) -> None:
        if rank == 1:
            await resolve_group(None, op).issue(op, lambda *_: Plan(liar), (), nseq=2)
            return
        match = rf"{op}: (group )?rank 1 announced a pickled object of {announced} bytes"
        with pytest.raises(aiodist.DistProtocolError, match=match):
            if op == "broadcast_object_list":
                await aiodist.broadcast_object_list([None], src=1)
            elif op == "all_gather_object":
                await aiodist.all_gather_object([None, None], "mine")
            else:
                await aiodist.scatter_object_list([None], None, src=1)

    await run_world(fn, 2, timeout=20)


# -- the launcher ------------------------------------------------------------------------------
WORKER = """
import json, os
import numpy as np
import aiodist.sync as dist
import aiodist

dist.init_process_group("gloo")
x = np.array([dist.get_rank() + 1.0])
dist.all_reduce(x)
refused = ""
token = os.environ["AIODIST_AUTH_TOKEN"]
if dist.get_rank() == 0:
    os.environ.pop("AIODIST_AUTH_TOKEN")
    try:
        dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=5)
    except aiodist.DistStoreError as exc:
        refused = str(exc)
print(json.dumps({"sum": float(x[0]), "refused": refused, "token": token}), flush=True)
dist.destroy_process_group()
"""


SYNC_WORKER = """
import sys
import numpy as np
import aiodist.sync as dist

rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, auth_token="tok"
)
x = np.array([rank + 1.0])
dist.all_reduce(x)
print(x[0], flush=True)
dist.destroy_process_group()
"""


@pytest.mark.multiprocess
def test_sync_init_process_group_takes_auth_token(tmp_path: Path) -> None:
    script = tmp_path / "sync_worker.py"
    script.write_text(SYNC_WORKER)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "AIODIST_AUTH_TOKEN"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert out.strip() == "3.0"


# -- the store before authentication ---------------------------------------------------------


@pytest.mark.parametrize("server_loop", SERVER_LOOPS)
def test_unauthenticated_torch_clients_cost_the_store_nothing(server_loop: str) -> None:
    """4 torch-wire clients send VALIDATE, then a SET announcing 64 MiB, then 60 MiB of it
    without ever authenticating: the server's memory stays put and it drops them at once."""
    with ServerProcess(server_loop, TOKEN.decode()) as server:
        base = server.memory()["VmRSS"]
        start = time.monotonic()
        socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]

        def attack(sock: socket.socket) -> None:
            sock.settimeout(10)
            chunk = bytes(1 << 20)
            with contextlib.suppress(OSError):
                sock.sendall(VALIDATE + torch_set_head(b"k", 64 << 20))
                for _ in range(60):
                    sock.sendall(chunk)

        threads = [threading.Thread(target=attack, args=(s,)) for s in socks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        closed = [closed_within(s, max(0.1, 10 - (time.monotonic() - start))) for s in socks]
        grown = server.memory()["VmHWM"] - base
        for s in socks:
            s.close()
    assert grown < 32 << 20, f"the server grew by {grown >> 20} MiB"
    assert all(closed), f"still open after 10 s: {closed}"


@pytest.mark.parametrize("server_loop", SERVER_LOOPS)
@pytest.mark.parametrize(
    "sources", [["127.0.0.1"], [f"127.0.0.{i}" for i in range(2, 12)]], ids=["one", "ten"]
)
def test_idle_connections_leave_a_client_served(server_loop: str, sources: list[str]) -> None:
    """130 connections that never say a word, against a server that may open 128 files (from
    one address: its cap per address; from ten: its descriptors run out), then a client with
    the token: it is served, and the server neither spins nor floods its log."""
    with ServerProcess(server_loop, TOKEN.decode(), nofile=128) as server:
        cpu = server.cpu()
        start = time.monotonic()
        socks = idle_sockets(server.port, 130, sources)

        async def client() -> bytes:
            async with await aiodist.TCPStore.create(
                "127.0.0.1", server.port, auth_token=TOKEN, timeout=20
            ) as store:
                await store.set("k", b"v")
                return await store.get("k")

        try:
            got = asyncio.run(client())
        finally:
            for s in socks:
                s.close()
        elapsed = time.monotonic() - start
        cpu = server.cpu() - cpu
    assert got == b"v"
    assert cpu < 0.5 * elapsed + 0.5, f"{cpu:.1f} s of CPU in {elapsed:.1f} s"
    lines = server.stderr.count(b"\n")
    assert lines < 100, f"{lines} lines of log:\n{server.stderr[-3000:].decode()}"


async def test_a_silent_connection_is_closed_at_the_handshake_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(store_server, "HANDSHAKE_TIMEOUT", 0.5)
    async with await aiodist.TCPStore.create(
        "127.0.0.1", 0, is_master=True, auth_token=TOKEN, timeout=5
    ) as store:
        reader, writer = await asyncio.open_connection("127.0.0.1", store.port)
        writer.write(b"AIOS")  # the start of a hello, and then nothing
        start = time.monotonic()
        assert await eof_or_reset(reader) == b""
        assert time.monotonic() - start < 3
        writer.close()
        assert store.server is not None and store.server.num_clients == 1  # (its own client)


async def test_handshakes_of_one_address_are_capped_the_oldest_goes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(store_server, "MIN_HANDSHAKES_PER_HOST", 4)
    async with await aiodist.TCPStore.create(
        "127.0.0.1", 0, is_master=True, auth_token=TOKEN, timeout=5
    ) as store:
        crowd = [
            await asyncio.open_connection("127.0.0.1", store.port, local_addr=("127.0.0.2", 0))
            for _ in range(6)
        ]
        other = await asyncio.open_connection("127.0.0.1", store.port, local_addr=("127.0.0.3", 0))
        # The two oldest of 127.0.0.2 are closed at once; the rest, and 127.0.0.3's, wait.
        for reader, _ in crowd[:2]:
            assert await eof_or_reset(reader) == b""
        for reader, _ in [*crowd[2:], other]:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(reader.read(1), 0.3)
        async with await aiodist.TCPStore.create(
            "127.0.0.1", store.port, auth_token=TOKEN, timeout=5
        ) as client:
            await client.set("k", b"v")
        for _, writer in [*crowd, other]:
            writer.close()


async def test_bytes_before_the_proof_close_an_aiodist_connection() -> None:
    """A hello, then 1 MiB where the 32-byte proof should be: closed, nothing stored."""
    async with await aiodist.TCPStore.create(
        "127.0.0.1", 0, is_master=True, auth_token=TOKEN, timeout=5
    ) as store:
        reader, writer = await asyncio.open_connection("127.0.0.1", store.port)
        hello = CLIENT_HELLO.pack(AIODIST_MAGIC, PROTOCOL_VERSION, bytes(32))
        writer.write(hello + encode_frame(1, Op.SET, blob32(b"/k"), blob32(bytes(1 << 20))))
        assert await eof_or_reset(reader) != b"\x00"
        writer.close()
        assert not await store.check(["k"])


def _torch_wire_client(port: int, source: str, uid: int | None = None) -> str:
    """Add to a key through a client speaking torch's wire, from ``source`` (with a socket
    that user ``uid`` owns, if given); whether the server let it."""
    if uid is not None:
        os.seteuid(uid)  # (a socket belongs to whoever made it: the server looks it up)
    try:
        sock = socket.socket()
    finally:
        if uid is not None:
            os.seteuid(0)
    with sock:
        sock.settimeout(5)
        sock.bind((source, 0))
        sock.connect(("127.0.0.1", port))
        try:
            sock.sendall(VALIDATE + torch_add(b"/n", 1))
            got = sock.recv(8)
        except ConnectionResetError:
            got = b""
    return "added" if len(got) == 8 else "refused"


async def test_torch_clients_only_from_the_job_hosts_as_the_job_user() -> None:
    """``allow_unauthenticated_torch="job_hosts"`` (what aiodist-run's store uses): a torch
    client is let in from an address a client holding the token came from, and, on this
    machine, only as this user; the others are refused at their first request."""
    server = await aiodist.TCPStoreServer(
        auth_token=TOKEN, allow_unauthenticated_torch="job_hosts"
    ).start("127.0.0.1", 0)
    try:
        port = server.port
        # Nobody with the token has come from 127.0.0.1 yet.
        assert await asyncio.to_thread(_torch_wire_client, port, "127.0.0.1") == "refused"
        async with await aiodist.TCPStore.create("127.0.0.1", port, auth_token=TOKEN) as store:
            assert await asyncio.to_thread(_torch_wire_client, port, "127.0.0.1") == "added"
            assert await store.add("n", 0) == 1
            # Another address of this machine: no client with the token came from there.
            assert await asyncio.to_thread(_torch_wire_client, port, "127.0.0.2") == "refused"
            if os.geteuid() == 0:  # another user of this machine, from the job's address
                other = await asyncio.to_thread(_torch_wire_client, port, "127.0.0.1", 65534)
                assert other == "refused"
            assert await store.add("n", 0) == 1
    finally:
        await server.aclose()


def test_allow_unauthenticated_torch_takes_only_its_values() -> None:
    with pytest.raises(
        aiodist.DistUsageError,
        match=r"allow_unauthenticated_torch must be False, True or 'job_hosts', got 'yes'",
    ):
        aiodist.TCPStoreServer(auth_token=TOKEN, allow_unauthenticated_torch="yes")  # type: ignore[arg-type]


# -- a secret by default ---------------------------------------------------------------------
def _run_launcher(script: Path, *args: str, env: dict[str, str]) -> dict[str, Any]:
    """Run ``aiodist-run`` on ``script``; its workers' JSON lines by prefix, and stderr."""
    result = subprocess.run(
        [sys.executable, "-m", "aiodist.run", *args, str(script)],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    lines: dict[str, Any] = {"stderr": result.stderr}
    for line in result.stdout.splitlines():
        prefix, _, body = line.partition(": ")
        lines[prefix] = json.loads(body)
    return lines


def _launcher_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.pop("AIODIST_AUTH_TOKEN", None)
    return {**env, **extra}


@pytest.mark.multiprocess
def test_launcher_passes_the_token_to_workers(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = _launcher_env(AIODIST_AUTH_TOKEN="launcher secret")
    lines = _run_launcher(script, "--nproc-per-node=2", env=env)
    assert lines["[rank0]"]["sum"] == lines["[rank1]"]["sum"] == 3.0
    assert lines["[rank0]"]["token"] == "launcher secret"
    assert "requires authentication" in lines["[rank0]"]["refused"]


@pytest.mark.multiprocess
def test_a_job_without_a_token_gets_one(tmp_path: Path) -> None:
    """aiodist-run of one node makes a secret up: its store refuses a client without it,
    and the workers' transport and stores prove it; the two workers share it."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    lines = _run_launcher(script, "--nproc-per-node=2", env=_launcher_env())
    assert lines["[rank0]"]["sum"] == lines["[rank1]"]["sum"] == 3.0
    token = lines["[rank0]"]["token"]
    assert len(token) == 64 and int(token, 16) >= 0 and lines["[rank1]"]["token"] == token
    assert "requires authentication" in lines["[rank0]"]["refused"]
    assert "secret" not in lines["stderr"]  # (no warning: the job has one)


_TARGET = """
import asyncio, json, os, sys
from pathlib import Path
import numpy as np
import aiodist
from aiodist.group import resolve_group

async def main():
    await aiodist.init_process_group("gloo", shared_memory=False)  # (ranks talk over TCP)
    here, rank = Path(sys.argv[1]), aiodist.get_rank()
    transport = resolve_group(None, "the test")._world.transport
    if rank == 0:
        seen = {"address": transport.address, "connected": transport.connected_peers()}
        (here / "address.tmp").write_text(json.dumps(seen))
        (here / "address.tmp").rename(here / "address")
    while not (here / "go").exists():
        await asyncio.sleep(0.05)
    got = np.zeros(8, np.uint8)
    if rank == 1:
        await aiodist.send(np.frombuffer(b"realrank", np.uint8).copy(), dst=0)
    else:
        await aiodist.recv(got, src=1)
        print(json.dumps({"got": bytes(got).decode()}))
    await aiodist.destroy_process_group()

asyncio.run(main())
"""


@pytest.mark.multiprocess
def test_a_default_job_keeps_a_stranger_from_posing_as_a_rank(tmp_path: Path) -> None:
    """A job started as `aiodist-run` with no secret set, whose ranks talk over TCP: before
    rank 1 ever connected to rank 0, a stranger claiming to be rank 1 of 2 is refused, with
    the auth flag or without it, and what it sends never reaches rank 0, which receives the
    real rank 1's message."""
    script = tmp_path / "target.py"
    script.write_text(_TARGET)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "aiodist.run", "--nproc-per-node=2", str(script), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_launcher_env(),
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "address").exists():
            assert launcher.poll() is None and time.monotonic() < deadline, "no address"
            time.sleep(0.05)
        seen = json.loads((tmp_path / "address").read_text())
        assert seen["connected"] == []  # (so nothing but the secret keeps the stranger out)
        address = (seen["address"][0], seen["address"][1])
        refused = _claim(address, 1, None)
        assert refused[2] == raw_peer.REFUSED and refused[3] & raw_peer.FLAG_AUTH, refused
        guessed = _claim(address, 1, b"a guess")
        assert guessed[2] == raw_peer.ACCEPT  # (then its proof is wrong: it is dropped)
        (tmp_path / "go").touch()
        out, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, err
    lines = {
        line.partition(": ")[0]: json.loads(line.partition(": ")[2]) for line in out.splitlines()
    }
    assert lines["[rank0]"] == {"got": "realrank"}, out


@pytest.mark.multiprocess
def test_a_job_on_several_nodes_without_a_token_is_told(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text("print('{}')\n")
    port = free_port()
    common = ["--nnodes=2", f"--master-port={port}", "--nproc-per-node=1"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "aiodist.run", *common, f"--node-rank={n}", str(script)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=_launcher_env(),
        )
        for n in (0, 1)
    ]
    errs = [p.communicate(timeout=90)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    for err in errs:
        assert (
            f"this job spans several nodes and has no secret: anyone who can reach the store "
            f"at 127.0.0.1:{port}" in err
        ), err
        assert "Set AIODIST_AUTH_TOKEN to the same secret on every node" in err


async def test_a_rank_listening_beyond_loopback_without_a_secret_is_told(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AIODIST_HOST", "")  # every interface
    monkeypatch.delenv("AIODIST_RUN_ID", raising=False)
    monkeypatch.setattr(aiodist._assembly._join, "_warned_open", False)

    async def world(token: str | None) -> None:
        store = aiodist.HashStore(timeout=10)

        async def rank_fn(rank: int) -> None:
            aiodist.group.isolate_context()
            await aiodist.init_process_group(
                "cpu", store=store, rank=rank, world_size=2, timeout=20, auth_token=token
            )
            await aiodist.destroy_process_group()

        await asyncio.gather(rank_fn(0), rank_fn(1))

    await world("s3cret")
    assert "without a secret" not in caplog.text
    await world(None)
    await world(None)
    said = [r for r in caplog.records if "without a secret" in r.getMessage()]
    assert len(said) == 1, caplog.text  # once per process
    assert (
        said[0]
        .getMessage()
        .startswith(
            "this rank listens on every interface without a secret: anyone who can reach its "
            "port or the store's can pose as a rank"
        )
    )


_WAITING_WORKER = """
import time
import aiodist.sync as dist

dist.init_process_group("gloo")
print("ready", flush=True)
time.sleep(120)
"""

_INTRUDER = """
import asyncio, json, os, socket, sys
import aiodist

host, port, view = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
seen = {}

async def aiodist_client():
    try:
        async with await aiodist.TCPStore.create(host, port, timeout=5) as store:
            return "in: " + ",".join(await store.list_keys())
    except aiodist.DistError as exc:
        return str(exc)

seen["aiodist"] = asyncio.run(aiodist_client())
with socket.create_connection((host, port), timeout=5) as s:  # torch's wire
    s.sendall(bytes.fromhex(sys.argv[4]))
    try:
        seen["torch-wire"] = "in" if len(s.recv(8)) == 8 else "refused"
    except ConnectionResetError:
        seen["torch-wire"] = "refused"
try:
    import torch.distributed as td
except ImportError:
    pass
else:
    from datetime import timedelta
    try:
        td.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5)).add("n", 1)
        seen["torch"] = "in"
    except Exception as exc:
        seen["torch"] = type(exc).__name__
try:
    socket.create_connection((host, view), timeout=5).close()
    seen["view"] = "in"
except OSError as exc:
    seen["view"] = type(exc).__name__
print(json.dumps(seen))
"""


@pytest.mark.netns
@pytest.mark.multiprocess
def test_a_default_job_keeps_another_host_out(hosts: Hosts, tmp_path: Path) -> None:
    """A job started as `aiodist-run --master-addr=<host 0>` with no secret set: from host 1,
    neither an aiodist client, nor a client speaking torch's wire (nor torch's own), gets
    into its store, and the live view is not even reachable."""
    script = tmp_path / "worker.py"
    script.write_text(_WAITING_WORKER)
    port = free_port()
    launcher = subprocess.Popen(
        [*hosts.prefix(0), sys.executable, "-m", "aiodist.run", f"--master-addr={IPV4[0]}",
         f"--master-port={port}", "--nproc-per-node=2", "--status-port=0", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_launcher_env(),
    )  # fmt: skip
    try:
        assert launcher.stderr is not None and launcher.stdout is not None
        for line in launcher.stderr:
            found = re.search(r"live view of the ranks at http://127\.0\.0\.1:(\d+)/", line)
            if found:
                break
        else:
            raise AssertionError("the launcher never said where its view is")
        for _ in range(2):
            assert launcher.stdout.readline().endswith("ready\n")
        probe = VALIDATE + torch_add(b"/n", 1)
        intruder = subprocess.run(
            [*hosts.prefix(1), sys.executable, "-c", _INTRUDER, IPV4[0], str(port),
             found.group(1), probe.hex()],
            capture_output=True,
            text=True,
            timeout=120,
            env=_launcher_env(),
        )  # fmt: skip
        assert intruder.returncode == 0, intruder.stderr
        seen = json.loads(intruder.stdout)
        assert "requires authentication" in seen["aiodist"], seen
        assert seen["torch-wire"] == "refused", seen
        assert seen.get("torch", "DistNetworkError") != "in", seen
        assert seen["view"] == "ConnectionRefusedError", seen
    finally:
        launcher.send_signal(signal.SIGINT)
        launcher.communicate(timeout=60)


# -- paths from the store --------------------------------------------------------------------
JOB = "security-test-job"


def _name(kind: str, rank: int, proc: ProcessId, nonce: str = "0123abcd") -> str:
    return f"{SHM_DIR}/{job_prefix(JOB)}{kind}{rank}-{proc.pid}-{proc.start}-{nonce}"


def test_a_peer_path_is_rebuilt_from_a_name_its_process_could_have_made() -> None:
    me = this_process()
    good = _name("w", 0, me)
    assert peer_path(good, JOB, "w", 0, me) == good
    for bad in [
        "/etc/passwd",
        f"{SHM_DIR}/../etc/passwd",
        f"{SHM_DIR}/{job_prefix(JOB)}w0-{me.pid}-{me.start}-0123abcd/../../etc/passwd",
        good.replace(SHM_DIR, "/tmp"),
        good + "x",
        _name("w", 0, me, "0123ABCD"),
        _name("w", 1, me),  # another rank's
        _name("wb", 0, me),  # another kind
        _name("w", 0, ProcessId(me.pid + 1, me.start)),  # another process's
        f"{SHM_DIR}/{job_prefix('another job')}w0-{me.pid}-{me.start}-0123abcd",
        12,
    ]:
        with pytest.raises(SharedMemoryError, match="not a name its process could have made"):
            peer_path(bad, JOB, "w", 0, me)


@pytest.fixture
def victim(tmp_path: Path) -> Iterator[Path]:
    """A file of this user outside /dev/shm that an attacker wants a rank to write into."""
    path = tmp_path / "victim"
    path.write_bytes(b"precious" * 512)
    yield path
    assert path.read_bytes() == b"precious" * 512


def test_peer_files_are_checked_before_and_once_open(victim: Path, tmp_path: Path) -> None:
    me = this_process()
    made: list[str] = []

    def shm(kind: str) -> str:
        made.append(_name(kind, 0, me, f"{len(made):08x}"))
        return made[-1]

    try:
        link = shm("w")
        os.symlink(victim, link)  # a valid name, pointing elsewhere
        with pytest.raises(SharedMemoryError, match=r"is not a regular file; refusing it"):
            Segment.attach(link, 4096)
        with pytest.raises(SharedMemoryError, match=r"is not a FIFO; refusing it"):
            Bell(link)
        fifo = shm("w")
        os.mkfifo(fifo, 0o600)
        with pytest.raises(SharedMemoryError, match=r"is not a regular file; refusing it"):
            Segment.attach(fifo, 4096)
        plain = shm("wb")
        Path(plain).write_bytes(bytes(4096))
        with pytest.raises(SharedMemoryError, match=r"is not a FIFO; refusing it"):
            Bell(plain)
        with pytest.raises(SharedMemoryError, match=r"is 4096 bytes long, expected 8192"):
            Segment.attach(plain, 8192)
        if os.geteuid() == 0:
            os.chown(plain, 65534, 65534)
            with pytest.raises(SharedMemoryError, match=r"owned by user 65534, not by this"):
                Segment.attach(plain, 4096)
        # Through /proc: a descriptor of a file elsewhere is refused.
        with open(victim, "rb") as f:
            path = peer_fd_path(me, f.fileno())
            with pytest.raises(SharedMemoryError, match=rf"{path} is not on {SHM_DIR}'s"):
                open_checked(path, os.O_RDWR, size=4096)
        with pytest.raises(SharedMemoryError, match="published '3' as a descriptor"):
            peer_fd_path(me, "3")
    finally:
        for path in made:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


@pytest.mark.parametrize("where", ["elsewhere", "symlink"])
async def test_a_forged_workspace_record_maps_nothing(where: str, tmp_path: Path) -> None:
    """Rank 1 sets up a workspace; "rank 0" is whoever wrote its record in the store,
    pointing the segment at a file of ours (with the workspace's magic number in it, and
    the size rank 1 expects), directly or through a symlink with a valid name. Rank 1
    refuses it, and the file is untouched."""
    store = aiodist.HashStore(timeout=10)
    rank1 = asyncio.ensure_future(
        NodeWorkspace.create(store, 1, 2, timeout=10, job_key=JOB, block_bytes=4096)
    )
    mine = json.loads(await store.get("shm/ws/1"))
    me = this_process()
    content = bytearray(mine["size"])
    content[784:792] = b"AIODWS01"  # the magic number a workspace segment starts with
    victim = tmp_path / "victim"
    await asyncio.to_thread(victim.write_bytes, content)
    seg = str(victim)
    if where == "symlink":
        seg = _name("w", 0, me)
        os.symlink(victim, seg)
    forged = {**mine, "pid": me.pid, "start": me.start, "seg": seg}
    try:
        await store.set("shm/ws/0", json.dumps(forged))
        with pytest.raises(SharedMemoryError, match="refusing it"):
            await asyncio.wait_for(rank1, 10)
        assert await asyncio.to_thread(victim.read_bytes) == content
    finally:
        if where == "symlink":
            os.unlink(seg)


@pytest.mark.parametrize("forged", ["segment", "doorbell", "symlink"])
async def test_a_forged_transport_record_maps_and_rings_nothing(forged: str) -> None:
    """Rank 1 sets up the shared-memory transport; "rank 0" is whoever wrote its record in
    the store, pointing its rings at another job's segment (with the transport's magic
    number, of the size rank 1 maps), its doorbell at another job's FIFO, or its rings at a
    symlink with a valid name. Rank 1 refuses the record; nothing is written into either."""
    store = aiodist.HashStore(timeout=10)
    rank1 = asyncio.ensure_future(ShmTransport.create(store, 1, 2, timeout=10, job_key=JOB))
    mine = json.loads(await store.get("shm/t/1"))
    me = this_process()
    size = os.stat(mine["seg"]).st_size
    other = f"{SHM_DIR}/{job_prefix('another job')}"
    victims = {
        "segment": f"{other}t0-{me.pid}-{me.start}-0123abcd",
        "doorbell": f"{other}tb0-{me.pid}-{me.start}-0123abcd",
    }
    content = bytearray(size)
    content[:8] = b"AIODSHM1"  # the magic number a transport segment starts with
    await asyncio.to_thread(Path(victims["segment"]).write_bytes, content)
    os.mkfifo(victims["doorbell"], 0o600)
    # Rank 0's own files, as it would have made them, for what is not forged.
    own = {"seg": _name("t", 0, me), "bell": _name("tb", 0, me)}
    await asyncio.to_thread(Path(own["seg"]).write_bytes, content)
    os.mkfifo(own["bell"], 0o600)
    bells = [os.open(p, os.O_RDWR | os.O_NONBLOCK) for p in (victims["doorbell"], own["bell"])]
    link = _name("t", 0, me, "89abcdef")
    os.symlink(victims["segment"], link)
    record = {**mine, "pid": me.pid, "start": me.start, **own, "size": size}
    record.update(
        {"segment": {"seg": victims["segment"]}, "doorbell": {"bell": victims["doorbell"]},
         "symlink": {"seg": link}}[forged]
    )  # fmt: skip
    try:
        await store.set("shm/t/0", json.dumps(record))
        await store.set("shm/t/mapped/0", "")  # (its barrier: rank 1 goes on if it mapped)
        with pytest.raises(SharedMemoryError, match="refusing it"):
            transport = await asyncio.wait_for(rank1, 10)
            await transport.send(0, T, memoryview(b"written into it" * 8))  # (and rings)
            await transport.aclose()
        assert await asyncio.to_thread(Path(victims["segment"]).read_bytes) == content
        with pytest.raises(BlockingIOError):
            os.read(bells[0], 1)
    finally:
        for fd in bells:
            os.close(fd)
        for path in [*victims.values(), *own.values(), link]:
            os.unlink(path)


# -- the status endpoints ----------------------------------------------------------------------
_ENDPOINT = """
import asyncio, json, sys, urllib.error, urllib.request
from aiodist.debug._status import STATUS_KEY, register_status
from aiodist.store import HashStore

async def main():
    store = HashStore()
    await register_status(store, 0, sys.argv[1].encode())
    entry = (await store.get(STATUS_KEY)).decode()
    address = entry.split("=", 1)[1].split("#")[0]
    answers = {}
    for name, url, headers in [
        ("none", "/status", {}),
        ("wrong", "/status", {"Authorization": "Bearer " + "0" * 64}),
        ("bearer", "/status", {"Authorization": "Bearer " + sys.argv[2]}),
        ("query", "/status?key=" + sys.argv[2], {}),
    ]:
        request = urllib.request.Request(f"http://{address}{url}", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                answers[name] = reply.status
        except urllib.error.HTTPError as exc:
            answers[name] = exc.code
    print(json.dumps([entry, answers]))

asyncio.run(main())
"""


def test_a_status_endpoint_listens_on_loopback_and_wants_the_key() -> None:
    key = derive_key(TOKEN, "status")
    proc = subprocess.run(
        [sys.executable, "-c", _ENDPOINT, TOKEN.decode(), key],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("AIODIST_")},
    )
    assert proc.returncode == 0, proc.stderr
    entry, answers = json.loads(proc.stdout)
    assert re.fullmatch(r"0=127\.0\.0\.1:\d+#[0-9a-f]{32},", entry), entry
    assert answers == {"none": 401, "wrong": 401, "bearer": 200, "query": 200}


async def _job_with_entries(entries: str, size: int) -> aiodist.Store:
    store = aiodist.HashStore(timeout=5)
    job = aiodist._assembly._join.job_store(store, "")
    await job.set("current", f"somewhere|{size}")
    await job.set("status", entries)
    return store


async def test_the_view_asks_only_endpoints_signed_with_the_secret() -> None:
    """Whoever writes the store records "endpoints" of their own for ranks 0 and 1: the
    view does not ask them (it would send them the key), and says why."""
    asked: list[bytes] = []

    async def trap(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        asked.append(await reader.read(1000))
        writer.close()

    server = await asyncio.start_server(trap, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        forged = f"0=127.0.0.1:{port},1=127.0.0.1:{port}#{'0' * 32},"
        store = await _job_with_entries(forged, 2)
        entries = await gather_status(store, auth_token=TOKEN, timeout=1)
        assert [e["error"] for e in entries] == [
            "its recorded endpoint is not signed with the job's secret: not asked"
        ] * 2
        assert asked == []
    finally:
        server.close()


async def test_without_a_secret_the_view_asks_only_this_machine() -> None:
    asked: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        asked.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.0 200 OK\r\n\r\n" + json.dumps({"ranks": []}).encode())
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        store = await _job_with_entries(f"0=192.0.2.1:80,1=127.0.0.1:{port},", 2)
        entries = await gather_status(store, timeout=1)
        assert entries[0] == {
            "rank": 0,
            "error": "its recorded endpoint is not on this machine, and without the job's "
            "secret (AIODIST_AUTH_TOKEN) nothing in the store can be trusted: not asked",
        }
        assert entries[1]["status"] == {"ranks": []}
        assert len(asked) == 1 and b"Authorization" not in asked[0]
    finally:
        server.close()


# -- sizes an authenticated peer can ask for ------------------------------------------------------
class Call:
    """Pickles as a call of ``func`` with ``args`` (and ``state`` set on the result)."""

    def __init__(self, func: Any, args: tuple[Any, ...], state: Any = None) -> None:
        self.func, self.args, self.state = func, args, state

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args) if self.state is None else (self.func, self.args, self.state)


_MIB = bytes(1 << 20)
_OVER = "the pickle asks for more memory"
GREEDY = {
    "bytearray": (Call(bytearray, (1 << 40,)), f"{_OVER} (bytearray of 1099511627776)"),
    # One MiB in the pickle, copied 64 times through its memo.
    "copies": ([Call(bytearray, (_MIB,)) for _ in range(64)], f"{_OVER} (bytearray of 1048576)"),
    "set": (Call(set, (range(2_000_000),)), f"{_OVER} (set of 2000000)"),
    "array": (
        Call(_reconstruct, (np.ndarray, (1 << 40,), b"b")),
        f"{_OVER} (_reconstruct of 1099511627776)",
    ),
    "array-copies": (
        [
            Call(
                _reconstruct, (np.ndarray, (0,), b"b"), (1, (1 << 20,), np.dtype("u1"), False, _MIB)
            )
            for _ in range(64)
        ],
        f"{_OVER} (an array of 1048576)",
    ),
    "ndarray": (Call(np.ndarray, ((1 << 40,),)), "weights_only=True does not call numpy.ndarray"),
}


@pytest.mark.parametrize("kind", sorted(GREEDY))
async def test_weights_only_allocates_no_more_than_the_pickle_holds(kind: str) -> None:
    obj, why = GREEDY[kind]

    async def fn(rank: int, size: int) -> None:
        objects: list[Any] = [obj] if rank == 0 else [None]
        if rank == 0:
            await aiodist.broadcast_object_list(objects, src=0, weights_only=True)
            return
        with pytest.raises(aiodist.DistError) as refused:
            await aiodist.broadcast_object_list(objects, src=0, weights_only=True)
        assert str(refused.value).startswith(
            f"object_list[0]: received bytes did not unpickle: weights_only=True: {why}"
            if why.startswith(_OVER)
            else f"object_list[0]: received bytes did not unpickle: {why}"
        ), str(refused.value)

    await run_world(fn, 2, timeout=30)


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        ([["|O", [4]]], r"bad array spec in a serving header: \['\|O', \[4\]\]: the array has "
         r"unsupported dtype object"),
        ([["<U8", [4]]], r"the array has unsupported dtype <U8"),
        ([["|V8", [4]]], r"the array has unsupported dtype \|V8"),
        ([["<f8", [1 << 31, 8]]], r"announces arrays of 137438953472 bytes in all, more than "
         r"the limit of 17179869184"),
        ([["<f4", [1 << 30]]] * 17, r"announces arrays of 73014444032 bytes in all"),
        ([["<f4", [1]]] * 257, r"not a list of at most 256 array specs"),
        ([["<f4", [-1]]], r"shape \(-1,\)"),
        ([["<f4", "12"]], r"the shape is not a list"),
    ],
)  # fmt: skip
def test_a_serving_header_asks_for_numeric_arrays_of_bounded_size(
    specs: list[Any], message: str
) -> None:
    with pytest.raises(aiodist.DistProtocolError, match=message):
        serving_wire.new_arrays(specs)
    with pytest.raises(aiodist.DistProtocolError, match=message):
        serving_wire.unpack(np.zeros(0, np.uint8), specs)


async def test_a_client_dropped_during_its_handshake_tries_again() -> None:
    """The server closed this client's first connection (out of descriptors, say): it
    connects again, within its timeout, and is served."""
    async with await aiodist.TCPStore.create(
        "127.0.0.1", 0, is_master=True, auth_token=TOKEN, timeout=5
    ) as store:
        connections = 0
        relayed = asyncio.Event()

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                dst.write(data)
            dst.close()

        async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            if connections == 1:
                await reader.read(1)  # the first bytes of the handshake, then gone
            else:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", store.port)
                await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
                await up_writer.wait_closed()
                relayed.set()
            writer.close()
            await writer.wait_closed()

        relay_server = await asyncio.start_server(relay, "127.0.0.1", 0)
        port = relay_server.sockets[0].getsockname()[1]
        async with await aiodist.TCPStore.create(
            "127.0.0.1", port, auth_token=TOKEN, timeout=5
        ) as client:
            await client.set("k", b"v")
        await asyncio.wait_for(relayed.wait(), 5)
        relay_server.close()
        await relay_server.wait_closed()
        assert connections == 2 and await store.get("k") == b"v"


def _listen_backlog(port: int) -> int:
    """The backlog of the socket listening on ``port`` (``ss``, of iproute2: its send queue)."""
    out = subprocess.run(
        ["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True
    ).stdout.split()
    return int(out[2])


def _somaxconn() -> int:
    return int(Path("/proc/sys/net/core/somaxconn").read_text())


@pytest.mark.parametrize(("expected", "backlog"), [(None, 1024), (3000, 6000)])
async def test_the_listen_backlog_is_sized_to_the_clients_expected(
    expected: int | None, backlog: int
) -> None:
    server = await aiodist.TCPStoreServer(expected_clients=expected).start("127.0.0.1", 0)
    try:
        assert _listen_backlog(server.port) == min(backlog, _somaxconn())
    finally:
        await server.aclose()
