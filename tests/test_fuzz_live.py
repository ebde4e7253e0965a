"""10,000 fuzzed frames against a job's live TCPStore server and its ranks' transports; the
ranks must then still compute a correct all_reduce (checked against numpy).

The frames are mutations of valid ones (lengths set to edge values, bytes flipped, cut
short, stray bytes), made by a seeded generator so every run sends the same bytes: torch
wire requests and aiodist frames to the store, and fuzzed handshakes to each rank. None of
them may harm the job. Last, after a valid authenticated handshake as a rank that never
started, a corrupted frame stream: that rank is then broken, and so is the world (its
failure domain), so every rank must fail, naming the corruption.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import struct
from typing import Any

import numpy as np
import pytest
import raw_peer
from fuzz_helpers import TORCH_VALIDATE, exchange, until
from raw_peer import HANDSHAKE, HEADER

import aiodist
from aiodist import DistNetworkError, DistProtocolError
from aiodist.group import ProcessGroup, resolve_group
from aiodist.store import _wire
from aiodist.store._wire import TorchOp

TOKEN = b"live fuzz token"
PHANTOMS = 10  # ranks that never start: fuzzed peers pose as them
WORLD = 2 + PHANTOMS
# Rank 0 names the phantom's stream; rank 1 names rank 0's abort and its cause.
CORRUPTION = rf"rank {WORLD - 1} sent a (frame header announcing|message of) \d+ bytes"
EDGES = [0, 1, 5, 255, 2**16, 2**31, 2**32 - 1, 2**40, 2**48, 2**63, 2**64 - 1]


class Fuzzer:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.sent = 0

    def key(self) -> bytes:
        return b"fz/" + self.rng.randbytes(self.rng.randrange(0, 8))

    def mutate(self, frame: bytes) -> bytes:
        """Leave it valid (half the time) or break it in one of several ways."""
        rng = self.rng
        choice = rng.randrange(8)
        if choice < 4 or not frame:
            return frame
        if choice == 4:  # a length field (at a random 4- or 8-byte position) lies
            size = rng.choice([4, 8])
            at = rng.randrange(0, max(1, len(frame) - size + 1))
            value = rng.choice(EDGES) % (1 << (8 * size))
            patched = frame[:at] + value.to_bytes(size, "little") + frame[at + size :]
            return patched[: len(frame)]
        if choice == 5:  # one byte flipped
            at = rng.randrange(len(frame))
            return frame[:at] + bytes([frame[at] ^ (1 << rng.randrange(8))]) + frame[at + 1 :]
        if choice == 6:  # cut short
            return frame[: rng.randrange(len(frame))]
        return frame + rng.randbytes(rng.randrange(1, 16))  # stray bytes

    def torch_frame(self) -> bytes:
        rng = self.rng
        op = rng.choice(list(TorchOp))
        key, value = self.key(), rng.randbytes(rng.randrange(0, 32))
        if op in (TorchOp.SET, TorchOp.APPEND, TorchOp.QUEUE_PUSH):
            frame = _wire.torch_request(op, key, value)
        elif op in (TorchOp.ADD, TorchOp.BARRIER):
            frame = _wire.torch_request(op, key, rng.randrange(-3, 4))
        elif op in (TorchOp.GET, TorchOp.DELETE_KEY, TorchOp.QUEUE_POP, TorchOp.QUEUE_LEN):
            frame = _wire.torch_request(op, key)
        elif op in (TorchOp.CHECK, TorchOp.WAIT, TorchOp.MULTI_GET):
            frame = _wire.torch_request(op, [self.key() for _ in range(rng.randrange(3))])
        elif op in (TorchOp.PING, TorchOp.VALIDATE):
            frame = bytes([op]) + struct.pack("<I", rng.randrange(2**32))
        elif op == TorchOp.COMPARE_SET:
            frame = _wire.torch_request(op, key, value, value[::-1])
        elif op == TorchOp.MULTI_SET:
            frame = bytes([op]) + struct.pack("<Q", 1) + _wire.blob64(key) + _wire.blob64(value)
        else:
            frame = bytes([op])
        return self.mutate(frame)

    def aiodist_frame(self) -> bytes:
        rng = self.rng
        op = rng.choice(list(_wire.Op))
        timeout = struct.pack("<d", rng.choice([-1.0, 0.0, 0.01, 1e9]))
        key, value = _wire.blob32(self.key()), _wire.blob32(rng.randbytes(rng.randrange(32)))
        bodies = {
            _wire.Op.SET: key + value,
            _wire.Op.GET: timeout + key,
            _wire.Op.ADD: key + struct.pack("<q", rng.randrange(-5, 5)),
            _wire.Op.COMPARE_SET: key + value + value,
            _wire.Op.WAIT: timeout + struct.pack("<I", 1) + key,
            _wire.Op.CHECK: struct.pack("<I", 1) + key,
            _wire.Op.DELETE_KEY: key,
            _wire.Op.MULTI_GET: timeout + struct.pack("<I", 1) + key,
            _wire.Op.MULTI_SET: struct.pack("<I", 1) + key + value,
            _wire.Op.APPEND: key + value,
            _wire.Op.QUEUE_PUSH: key + value,
            _wire.Op.QUEUE_POP: timeout + bytes([rng.randrange(2)]) + key,
            _wire.Op.QUEUE_LEN: key,
            _wire.Op.CANCEL: struct.pack("<I", rng.randrange(64)),
        }
        return self.mutate(_wire.encode_frame(rng.randrange(64), op, bodies.get(op, b"")))

    def peer_frame(self, gid: int) -> bytes:
        rng = self.rng
        tag = (rng.choice([0, gid, rng.randrange(2**64)]), rng.randrange(8), rng.randrange(4))
        roll = rng.random()
        if roll < 0.02:
            return HEADER.pack(*tag, rng.choice([2**47 + 5, 2**48, 2**64 - 2]))
        if roll < 0.04:
            return HEADER.pack(*tag, 2**64 - 1)
        payload = rng.randbytes(rng.randrange(0, 64))
        return HEADER.pack(*tag, len(payload)) + payload

    def handshake(self) -> bytes:
        rng = self.rng
        fields: list[Any] = [
            raw_peer.MAGIC,
            raw_peer.VERSION,
            0,
            1,
            2,
            WORLD,
            bytes(32),
            bytes(32),
            raw_peer.STAGING,
        ]
        at = rng.randrange(len(fields))
        fields[at] = {
            0: rng.randbytes(4),
            1: rng.randrange(2**16),
            2: rng.randrange(5),
            3: rng.randrange(4),
            4: rng.randrange(2**32),
            5: rng.randrange(2**32),
            6: rng.randbytes(32),
            7: rng.randbytes(32),
            8: rng.randrange(2**64),
        }[at]
        return self.mutate(HANDSHAKE.pack(*fields) + rng.randbytes(rng.randrange(40)))

    async def store(self, port: int, torch: bool, frames: int, per_conn: int = 50) -> None:
        while frames:
            n = min(per_conn, frames)
            make = self.torch_frame if torch else self.aiodist_frame
            head = (
                TORCH_VALIDATE
                if torch
                else _wire.CLIENT_HELLO.pack(_wire.AIODIST_MAGIC, _wire.PROTOCOL_VERSION, bytes(32))
            )
            await exchange(("127.0.0.1", port), head + b"".join(make() for _ in range(n)))
            self.sent += n
            frames -= n

    async def peer(
        self, address: tuple[str, int], target: int, phantom: int, gid: int, n: int
    ) -> None:
        _, writer, reply, verified = await raw_peer.connect(address, phantom, target, WORLD, TOKEN)
        assert verified and reply[2] == raw_peer.ACCEPT
        stream = b"".join(self.peer_frame(gid) for _ in range(n - 1))
        # At least one malformed frame: a length no payload has, and no control message's
        # text length (a step of 0 would make it a goodbye).
        stream += HEADER.pack(gid, 0, 2**64 - 1, 2**64 - 1)
        at = 0
        # The rank drops the connection at the first malformed header: writes may then fail.
        with contextlib.suppress(ConnectionError):
            while at < len(stream):
                step = self.rng.choice([1, 33, 4096, len(stream)])
                writer.write(stream[at : at + step])
                at += step
                await writer.drain()
            writer.write_eof()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
        self.sent += n

    async def handshakes(self, address: tuple[str, int], n: int) -> None:
        for _ in range(n):
            await exchange(address, self.handshake())
            self.sent += 1


async def test_ten_thousand_fuzzed_frames_then_a_correct_all_reduce() -> None:
    server = aiodist.TCPStoreServer()
    await server.start("127.0.0.1", 0)
    go = asyncio.Event()
    rng = np.random.default_rng(0)
    inputs = [[rng.standard_normal(1000), rng.integers(-100, 100, 257)] for _ in range(2)]
    loop = asyncio.get_running_loop()
    ready: list[asyncio.Future[dict[str, Any]]] = [loop.create_future(), loop.create_future()]

    fuzzed = asyncio.Event()
    finished = asyncio.Event()  # the phantom ranks stay until the end

    async def rank_fn(rank: int) -> list[np.ndarray]:
        aiodist.group.isolate_context()  # ranks as tasks of one process
        store = await aiodist.TCPStore.create("127.0.0.1", server.port, timeout=10)
        # Over TCP, whose peer protocol the fuzzer speaks (ranks sharing memory refuse TCP).
        await aiodist.init_process_group(
            "cpu",
            store=store,
            rank=rank,
            world_size=WORLD,
            timeout=30,
            auth_token=TOKEN,
            shared_memory=False,
        )
        try:
            # Every rank takes part in making the group; the phantom ranks then only wait:
            # the fuzzer poses as them to ranks 0 and 1, which never heard from them.
            sub = await aiodist.new_group([0, 1])
            if rank >= 2:
                await finished.wait()
                return []
            assert isinstance(sub, ProcessGroup)
            warm = np.ones(4)
            await aiodist.all_reduce(warm, group=sub)
            assert warm.tolist() == [2.0] * 4
            if rank == 0:
                await store.set("guard/key", b"guard value")
            transport = resolve_group(None, "test")._world.transport
            ready[rank].set_result({"transport": transport, "gid": sub.group_id})
            await go.wait()
            outs = []
            for x in inputs[rank]:
                y = x.copy()
                await aiodist.all_reduce(y, group=sub)
                outs.append(y)
            assert await store.get("guard/key") == b"guard value"
            fuzzed.set()
            cause = await sub.wait_aborted()  # the world's: every group of it
            assert cause is not None
            # Rank 0 read the corrupted stream; rank 1 lost rank 0, which aborted.
            expected = DistProtocolError if rank == 0 else DistNetworkError
            with pytest.raises(expected, match=CORRUPTION):
                await aiodist.all_reduce(y, group=sub)
            return outs
        finally:
            await aiodist.destroy_process_group()
            await store.aclose()

    ranks = [asyncio.ensure_future(rank_fn(r)) for r in range(WORLD)]
    try:
        # A rank that fails before it is ready fails the test at once.
        await asyncio.wait(
            [asyncio.gather(*ready), *ranks[:2]], timeout=30, return_when="FIRST_COMPLETED"
        )
        for task in ranks:
            if task.done():
                task.result()
        info = [f.result() for f in ready]
        clients, waiters = server.num_clients, server.state.waiter_count
        fuzzer = Fuzzer(seed=20261130)
        await fuzzer.store(server.port, torch=True, frames=4000)
        await fuzzer.store(server.port, torch=False, frames=4000)
        for target in (0, 1):
            await fuzzer.handshakes(info[target]["transport"].address, 1000)
        assert fuzzer.sent == 10_000
        # Every fuzzed connection is gone, the store holds no leftover waiter.
        await until(lambda: server.num_clients == clients, "closing the store's fuzz connections")
        await until(lambda: server.state.waiter_count == waiters, "dropping fuzzed waiters")
        for target in (0, 1):
            t = info[target]["transport"]
            await until(lambda t=t: len(t.live) == 1, "closing the transport's fuzz connections")
            assert t.connected_peers() == [1 - target]
        go.set()
        await asyncio.wait_for(fuzzed.wait(), 30)
        t = info[0]["transport"]
        await fuzzer.peer(t.address, 0, WORLD - 1, info[0]["gid"], 100)
        results = await asyncio.wait_for(asyncio.gather(*ranks[:2]), 30)
        finished.set()
        await asyncio.wait_for(asyncio.gather(*ranks[2:]), 30)
    finally:
        go.set()
        finished.set()
        for task in ranks:
            task.cancel()
        await asyncio.gather(*ranks, return_exceptions=True)
        await server.aclose()
    for i, expected in enumerate(np.add(*pair) for pair in zip(*inputs, strict=True)):
        for rank in range(2):
            np.testing.assert_allclose(results[rank][i], expected, rtol=1e-12)
            assert results[rank][i].dtype == inputs[rank][i].dtype
