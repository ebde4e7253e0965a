"""Security: one shared secret for the store and every peer connection, bound listeners,
bounded lengths wherever a peer announces one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import raw_peer
from raw_peer import HEADER, frame
from store_attacks import (
    VALIDATE,
    ServerProcess,
    closed_within,
    idle_sockets,
    torch_set_head,
)

import aiodist
from aiodist import collectives
from aiodist.group import Plan, resolve_group
from aiodist.testing import free_port, run_world
from aiodist.transport.base import OpComm, PeerDirectory
from aiodist.transport.tcp import TCPTransport

pytestmark = pytest.mark.both_loops

T = (7, 1, 0)
TOKEN = b"correct horse battery staple"


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
    """Read until the peer closes; a reset (unread bytes on its side) counts as closed."""
    with contextlib.suppress(ConnectionResetError):
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
        # The three largest lengths mark control messages; the next one is garbage.
        (2**64 - 4, r"announcing 18446744073709551612 bytes"),
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
if dist.get_rank() == 0:
    os.environ.pop("AIODIST_AUTH_TOKEN")
    try:
        dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=5)
    except aiodist.DistStoreError as exc:
        refused = str(exc)
print(json.dumps({"sum": float(x[0]), "refused": refused}), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.multiprocess
def test_launcher_passes_the_token_to_workers(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env["AIODIST_AUTH_TOKEN"] = "launcher secret"
    result = subprocess.run(
        [sys.executable, "-m", "aiodist.run", "--nproc-per-node=2", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    lines = {}
    for line in result.stdout.splitlines():
        prefix, _, body = line.partition(": ")
        lines[prefix] = json.loads(body)
    assert lines["[rank0]"]["sum"] == lines["[rank1]"]["sum"] == 3.0
    assert "requires authentication" in lines["[rank0]"]["refused"]


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
SERVER_LOOPS = ["uvloop", "asyncio"]


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
