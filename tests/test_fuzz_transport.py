"""Fuzzing the transport's peer protocol (handshake and frame headers) over real sockets.

Properties: a live rank drops every connection that does not complete the authenticated
handshake, without touching its other connections or delivering a byte; after a valid
handshake, every complete frame before the first malformed header is delivered intact and
in order, the malformed header or the end of the stream fails only that peer with a clear
error, and nothing reaches the loop's exception handler (which fails the test).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import raw_peer
from fuzz_helpers import EDGE_LENGTHS, exchange, fuzz, until
from hypothesis import given, strategies as st
from raw_peer import HANDSHAKE, HEADER

import aiodist
from aiodist.transport.base import PeerDirectory
from aiodist.transport.tcp import TCPTransport

TOKEN = b"transport fuzz token"
T = (3, 0, 0)


# -- handshakes against a live rank -------------------------------------------------------------
@dataclass
class Live:
    t0: TCPTransport
    t1: TCPTransport
    rounds: int = 0

    async def check(self) -> None:
        t0 = self.t0
        self.rounds += 1
        payload = b"round %d" % self.rounds
        out = bytearray(len(payload))
        fut = t0.recv_into(1, T, memoryview(out))
        await self.t1.send(0, T, memoryview(payload))
        assert await fut == 1 and out == payload
        # Only the connection to rank 1 is left once the fuzzed one is closed.
        await until(lambda: len(t0.live) == 1, "dropping the fuzzed connection")
        assert t0.connected_peers() == [1]
        assert t0.mailbox.num_staged() == 0


@pytest.fixture
async def live() -> AsyncIterator[Live]:
    store = aiodist.HashStore(timeout=5)
    # World of 3: rank 2 never starts, so a fuzzed hello may claim to be it.
    t0 = await TCPTransport.create(PeerDirectory(store), 0, 3, timeout=5, auth_token=TOKEN)
    t1 = await TCPTransport.create(PeerDirectory(store), 1, 3, timeout=5, auth_token=TOKEN)
    live = Live(t0, t1)
    try:
        await live.check()
        yield live
    finally:
        await t1.aclose()
        await t0.aclose()


handshakes = st.builds(
    HANDSHAKE.pack,
    st.one_of(st.just(raw_peer.MAGIC), st.binary(min_size=4, max_size=4)),
    st.one_of(st.just(raw_peer.VERSION), st.integers(0, 2**16 - 1)),
    st.integers(0, 5),
    st.integers(0, 3),
    st.one_of(st.integers(0, 4), st.integers(0, 2**32 - 1)),
    st.one_of(st.just(3), st.integers(0, 2**32 - 1)),
    st.binary(min_size=32, max_size=32),
    st.binary(min_size=32, max_size=32),
    st.one_of(st.just(raw_peer.STAGING), st.integers(0, 2**64 - 1)),
)
tails = st.one_of(
    st.binary(max_size=48),
    st.builds(lambda n: HEADER.pack(*T, n), st.one_of(EDGE_LENGTHS, st.integers(0, 64))),
)


@fuzz(300)
@given(
    data=st.one_of(
        st.builds(
            lambda h, cut, tail: h[: len(h) - cut] + tail, handshakes, st.integers(0, 90), tails
        ),
        st.binary(max_size=120),
    )
)
async def test_live_rank_drops_every_unauthenticated_connection(live: Live, data: bytes) -> None:
    got = await exchange(live.t0.address, data)
    # At most one answer: a refusal, a rejection or a challenge, never frames.
    assert len(got) in (0, HANDSHAKE.size)
    await live.check()


# -- frames after a valid handshake -------------------------------------------------------------
@dataclass
class Frame:
    tag: tuple[int, int, int]
    payload: bytes
    #: "ok", "bye" (a goodbye: its step is the length of its text, the payload) or "kill"
    #: (a length no rank can hold).
    kind: str
    length: int = 0

    def encode(self) -> bytes:
        if self.kind == "bye":
            return (
                HEADER.pack(self.tag[0], self.tag[1], len(self.payload), 2**64 - 1) + self.payload
            )
        if self.kind == "kill":
            # A control message's length (2**64 - 3 and up) is garbage only with a text
            # longer than any control message may carry.
            step = 2**64 - 1 if self.length >= 2**64 - 3 else self.tag[2]
            return HEADER.pack(self.tag[0], self.tag[1], step, self.length) + self.payload
        return HEADER.pack(*self.tag, len(self.payload)) + self.payload


tags = st.tuples(st.integers(0, 2), st.integers(0, 2), st.sampled_from([0, 1, 2**64 - 1]))
frames = st.one_of(
    st.builds(Frame, tags, st.binary(max_size=300), st.just("ok")),
    st.builds(Frame, tags, st.binary(max_size=40), st.just("bye")),
    st.builds(
        Frame,
        tags,
        st.binary(max_size=16),
        st.just("kill"),
        st.sampled_from([2**47 + 5, 2**48, 2**63, 2**64 - 2]),
    ),
)


@fuzz(150)
@given(
    frames=st.lists(frames, max_size=12),
    cut=st.integers(0, 40),
    chunk=st.sampled_from([1, 7, 32, 1000, 1 << 20]),
)
async def test_frames_are_delivered_intact_until_the_first_malformed_one(
    frames: list[Frame], cut: int, chunk: int
) -> None:
    t0 = await TCPTransport.create(
        PeerDirectory(aiodist.HashStore(timeout=5)), 0, 2, timeout=5, auth_token=TOKEN
    )
    try:
        stream = b"".join(f.encode() for f in frames)
        stream = stream[: max(0, len(stream) - cut)]
        # What the model says rank 0 must hold: complete frames before the first kill.
        expected: list[Frame] = []
        killed = False
        offset = 0
        for f in frames:
            offset += len(f.encode())
            if f.kind == "kill":
                killed = offset - len(f.payload) <= len(stream)  # its header arrived
                break
            if offset > len(stream):
                break
            if f.kind == "ok":
                expected.append(f)
        _, writer, _, verified = await raw_peer.connect(t0.address, 1, 0, 2, TOKEN)
        assert verified
        for i in range(0, len(stream), chunk):
            writer.write(stream[i : i + chunk])
            await writer.drain()
        writer.write_eof()
        await until(lambda: t0.mailbox.lost(1) is not None, "rank 1 counted as gone")
        writer.close()
        for f in expected:
            out = bytearray(len(f.payload))
            assert await t0.recv_into(1, f.tag, memoryview(out)) == 1
            assert out == f.payload
        lost = t0.mailbox.lost(1)
        if killed:
            assert isinstance(lost, aiodist.DistProtocolError), lost
            assert "bytes" in str(lost)
        else:
            assert isinstance(lost, aiodist.DistNetworkError), lost
        with pytest.raises((aiodist.DistNetworkError, aiodist.DistProtocolError)):
            await t0.recv_into(1, (99, 0, 0), memoryview(bytearray(1)))
    finally:
        await t0.aclose()
    assert not t0.live
    await asyncio.sleep(0)
