"""Fuzzing the store protocols: torch's wire and aiodist's frames, against the parsers and a
live server over real sockets.

Properties, for every input: the server answers or closes that connection (never crashes,
never reaches the loop's exception handler, which fails the test), its connection and
waiter counts return to what they were, and a well-behaved client's keys are intact and it
keeps working.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import pytest
from fuzz_helpers import (
    F64,
    I64,
    TORCH_VALIDATE,
    U32,
    U64,
    blob,
    exchange,
    fuzz,
    length_field,
    until,
)
from hypothesis import given, strategies as st

import aiodist
from aiodist.errors import DistProtocolError
from aiodist.store import _wire
from aiodist.store._wire import Incomplete, Reader, TorchOp

MAX_KEY, MAX_VALUE = 256, 4096
TOKEN = b"fuzz token"

# -- torch wire ---------------------------------------------------------------------------------
fuzz_keys = st.binary(max_size=12).map(lambda k: b"fz/" + k)
small_ints = st.one_of(st.integers(-3, 3), st.sampled_from([-(2**63), 2**63 - 1, 2**31, 1000]))


def _torch_keys(keys: list[bytes]) -> bytes:
    return U64.pack(len(keys)) + b"".join(_wire.blob64(k) for k in keys)


def _torch_multi_set(pairs: list[tuple[bytes, bytes]]) -> bytes:
    body = b"".join(_wire.blob64(k) + _wire.blob64(v) for k, v in pairs)
    return bytes([TorchOp.MULTI_SET]) + U64.pack(len(pairs)) + body


values = st.binary(max_size=64)
key_lists = st.lists(fuzz_keys, max_size=3)
#: Requests torch's client could send, one strategy per opcode layout.
torch_valid = st.one_of(
    st.builds(
        lambda op, k, v: _wire.torch_request(op, k, v),
        st.sampled_from([TorchOp.SET, TorchOp.APPEND, TorchOp.QUEUE_PUSH]),
        fuzz_keys,
        values,
    ),
    st.builds(lambda k, n: _wire.torch_request(TorchOp.ADD, k, n), fuzz_keys, small_ints),
    st.builds(lambda k, n: _wire.torch_request(TorchOp.BARRIER, k, n), fuzz_keys, small_ints),
    st.builds(
        lambda op, k: _wire.torch_request(op, k),
        st.sampled_from([TorchOp.GET, TorchOp.DELETE_KEY, TorchOp.QUEUE_POP, TorchOp.QUEUE_LEN]),
        fuzz_keys,
    ),
    st.builds(
        lambda op, ks: bytes([op]) + _torch_keys(ks),
        st.sampled_from([TorchOp.CHECK, TorchOp.WAIT, TorchOp.MULTI_GET]),
        key_lists,
    ),
    st.sampled_from([TorchOp.GETNUMKEYS, TorchOp.CANCEL_WAIT, TorchOp.LIST_KEYS]).map(
        lambda op: bytes([op])
    ),
    st.builds(lambda n: bytes([TorchOp.PING]) + U32.pack(n), st.integers(0, 2**32 - 1)),
    st.builds(
        lambda k, a, b: _wire.torch_request(TorchOp.COMPARE_SET, k, a, b), fuzz_keys, values, values
    ),
    st.lists(st.tuples(fuzz_keys, values), max_size=3).map(_torch_multi_set),
)
#: Requests of torch's shape with lying lengths, unknown opcodes and stray bytes.
torch_arg = st.one_of(
    blob(U64),
    small_ints.map(I64.pack),
    st.integers(0, 2**32 - 1).map(U32.pack),
    st.builds(
        lambda fix, ks: U64.pack(fix(len(ks))) + b"".join(ks),
        length_field(U64),
        st.lists(blob(U64, 8), max_size=3),
    ),
    st.binary(max_size=9),
)
torch_garbled = st.builds(
    lambda op, args: bytes([op]) + b"".join(args),
    st.integers(0, 255),
    st.lists(torch_arg, max_size=4),
)
torch_streams = st.builds(
    lambda validate, reqs: (TORCH_VALIDATE if validate else b"") + b"".join(reqs),
    st.booleans(),
    st.lists(st.one_of(torch_valid, torch_garbled), max_size=6),
)

# -- aiodist wire -------------------------------------------------------------------------------
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, 1e-9, 1e300]),
)
aiodist_part = st.one_of(
    blob(U32),
    st.integers(0, 2**32 - 1).map(U32.pack),
    small_ints.map(I64.pack),
    floats.map(F64.pack),
    st.binary(max_size=8),
)
opcodes = st.one_of(st.sampled_from([int(op) for op in _wire.Op]), st.integers(0, 255))


def _frame(rid: int, op: int, parts: list[bytes], fix: object) -> bytes:
    payload = b"".join(parts)
    body = fix(len(payload) + 5)  # type: ignore[operator]
    return _wire.FRAME_HEAD.pack(body, rid, op) + payload


aiodist_frames = st.builds(
    _frame,
    st.integers(0, 2**32 - 1),
    opcodes,
    st.lists(aiodist_part, max_size=4),
    st.one_of(st.just(lambda n: n), length_field(U32)),
)
keys32 = fuzz_keys.map(_wire.blob32)
#: Requests of the right layout for their opcode, with request ids that repeat.
aiodist_valid = st.builds(
    lambda rid, request: _wire.encode_frame(rid, *request),
    st.integers(0, 3),
    st.one_of(
        st.tuples(
            st.just(_wire.Op.SET), st.builds(bytes.__add__, keys32, values.map(_wire.blob32))
        ),
        st.tuples(st.just(_wire.Op.GET), st.builds(bytes.__add__, floats.map(F64.pack), keys32)),
        st.tuples(
            st.sampled_from([_wire.Op.WAIT, _wire.Op.MULTI_GET, _wire.Op.CHECK]),
            st.builds(
                lambda t, ks, op_has_timeout: (
                    (F64.pack(t) if op_has_timeout else b"") + U32.pack(len(ks)) + b"".join(ks)
                ),
                floats,
                st.lists(keys32, max_size=3),
                st.booleans(),
            ),
        ),
        st.tuples(
            st.just(_wire.Op.QUEUE_POP),
            st.builds(
                lambda t, b, k: F64.pack(t) + bytes([b]) + k, floats, st.integers(0, 1), keys32
            ),
        ),
        st.tuples(
            st.just(_wire.Op.ADD), st.builds(bytes.__add__, keys32, small_ints.map(I64.pack))
        ),
        st.tuples(st.just(_wire.Op.CANCEL), st.integers(0, 3).map(U32.pack)),
        st.tuples(
            st.sampled_from([_wire.Op.NUM_KEYS, _wire.Op.LIST_KEYS, _wire.Op.PING]), st.just(b"")
        ),
    ),
)
hellos = st.builds(
    lambda version, nonce: _wire.CLIENT_HELLO.pack(_wire.AIODIST_MAGIC, version, nonce),
    st.one_of(st.just(_wire.PROTOCOL_VERSION), st.integers(0, 2**16 - 1)),
    st.binary(min_size=32, max_size=32),
)
aiodist_streams = st.builds(
    lambda hello, frames, tail: hello + b"".join(frames) + tail,
    hellos,
    st.lists(st.one_of(aiodist_frames, aiodist_valid), max_size=6),
    st.binary(max_size=16),
)


# -- the parsers, directly ----------------------------------------------------------------------
def _parse_all(data: bytes) -> list[object]:
    """Parse torch requests until the bytes run out or one is rejected."""
    reader = Reader(data)
    out: list[object] = []
    while reader.pos < len(data):
        start = reader.pos
        try:
            out.append(_wire.parse_torch_request(reader, MAX_KEY, MAX_VALUE))
        except Incomplete:
            reader.pos = start
            out.append("incomplete")
            break
        except DistProtocolError as exc:
            out.append(("rejected", str(exc)))
            break
    return out


@fuzz(400)
@given(data=st.one_of(torch_streams, st.binary(max_size=200)), cut=st.integers(0, 400))
def test_torch_parser_accepts_or_rejects_cleanly(data: bytes, cut: int) -> None:
    """Only three outcomes: a request, Incomplete, or DistProtocolError naming the problem."""
    whole = _parse_all(data)
    for item in whole:
        if isinstance(item, tuple) and item[0] == "rejected":
            assert "opcode" in item[1] or "limit" in item[1], item
    # Bytes arriving in two pieces: the first piece parses to a prefix of the whole.
    head = _parse_all(data[: min(cut, len(data))])
    complete = [r for r in head if r != "incomplete"]
    assert whole[: len(complete)] == complete


@fuzz(300)
@given(head=st.sampled_from([U32, U64]), data=st.binary(max_size=80), limit=st.integers(0, 64))
def test_length_prefixed_strings_respect_the_limit(head: object, data: bytes, limit: int) -> None:
    reader = Reader(data)
    try:
        got = reader.blob32(limit, "key") if head is U32 else reader.blob64(limit, "key")
    except Incomplete:
        return
    except DistProtocolError as exc:
        assert f"exceeds the limit of {limit} bytes" in str(exc)
        return
    assert len(got) <= limit and reader.pos == len(got) + (4 if head is U32 else 8)


# -- a live server ------------------------------------------------------------------------------
class Live:
    """A server, a well-behaved client, and the counts every example must return to."""

    def __init__(self, server: aiodist.TCPStoreServer, good: aiodist.TCPStore) -> None:
        self.server = server
        self.good = good
        self.clients = server.num_clients
        self.waiters = server.state.waiter_count
        self.count = 0

    async def check(self) -> None:
        server = self.server
        await until(lambda: server.num_clients == self.clients, "closing fuzz connections")
        await until(lambda: server.state.waiter_count == self.waiters, "dropping waiters")
        assert await self.good.get("guard/key") == b"guard value"
        self.count += 1
        assert await self.good.add("guard/count", 1) == self.count
        await self.good.set("guard/echo", b"%d" % self.count)
        assert await self.good.get("guard/echo") == b"%d" % self.count


async def _live(**options: object) -> AsyncIterator[Live]:
    server = aiodist.TCPStoreServer(max_key_size=MAX_KEY, max_value_size=MAX_VALUE, **options)  # type: ignore[arg-type]
    async with await server.start("127.0.0.1", 0):
        token = options.get("auth_token")
        async with await aiodist.TCPStore.create(
            "127.0.0.1",
            server.port,
            timeout=5,
            auth_token=token,  # type: ignore[arg-type]
        ) as good:
            await good.set("guard/key", b"guard value")
            yield Live(server, good)


@pytest.fixture
async def live() -> AsyncIterator[Live]:
    async for x in _live():
        yield x


@pytest.fixture
async def live_auth() -> AsyncIterator[Live]:
    async for x in _live(auth_token=TOKEN):
        yield x


@fuzz(150)
@given(data=st.one_of(torch_streams, st.binary(max_size=120)))
async def test_live_server_survives_fuzzed_torch_requests(live: Live, data: bytes) -> None:
    await exchange(("127.0.0.1", live.server.port), data)
    await live.check()


@fuzz(300)
@given(data=aiodist_streams)
async def test_live_server_survives_fuzzed_aiodist_frames(live: Live, data: bytes) -> None:
    await exchange(("127.0.0.1", live.server.port), data)
    await live.check()


@fuzz(100)
@given(data=st.one_of(aiodist_streams, torch_streams), proof=st.binary(max_size=40))
async def test_live_server_with_a_token_admits_nobody_without_it(
    live_auth: Live, data: bytes, proof: bytes
) -> None:
    if data.startswith(_wire.AIODIST_MAGIC):
        hello, rest = data[: _wire.CLIENT_HELLO.size], data[_wire.CLIENT_HELLO.size :]
        data = hello + proof + rest
    got = await exchange(("127.0.0.1", live_auth.server.port), data)
    # At most the server's hello and a failed verdict: no reply to any request.
    if data.startswith(_wire.AIODIST_MAGIC):
        assert len(got) <= _wire.SERVER_HELLO.size + 1
        assert got[_wire.SERVER_HELLO.size :] in (b"", b"\x01")
    else:
        assert got == b""
    await live_auth.check()


# -- regressions: what the fuzzing found --------------------------------------------------------
async def _hello(port: int) -> tuple[object, object]:
    import asyncio

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_wire.CLIENT_HELLO.pack(_wire.AIODIST_MAGIC, _wire.PROTOCOL_VERSION, bytes(32)))
    await reader.readexactly(_wire.SERVER_HELLO.size)
    return reader, writer


@pytest.mark.both_loops
@pytest.mark.parametrize("op", [_wire.Op.WAIT, _wire.Op.GET, _wire.Op.QUEUE_POP])
async def test_nan_timeout_is_a_usage_error(live: Live, op: _wire.Op) -> None:
    """A NaN deadline would break the ordering of the loop's timer heap for every client."""
    reader, writer = await _hello(live.server.port)
    key = _wire.blob32(b"never")
    body = {
        _wire.Op.WAIT: F64.pack(math.nan) + U32.pack(1) + key,
        _wire.Op.GET: F64.pack(math.nan) + key,
        _wire.Op.QUEUE_POP: F64.pack(math.nan) + b"\x01" + key,
    }[op]
    writer.write(_wire.encode_frame(9, op, body))  # type: ignore[attr-defined]
    head = await reader.readexactly(_wire.FRAME_HEAD.size)  # type: ignore[attr-defined]
    length, rid, status = _wire.FRAME_HEAD.unpack(head)
    message = await reader.readexactly(length - 5)  # type: ignore[attr-defined]
    assert (rid, status, message) == (9, _wire.Status.USAGE_ERROR, b"the request's timeout is NaN")
    writer.close()  # type: ignore[attr-defined]
    await live.check()


@pytest.mark.both_loops
async def test_request_id_reused_by_a_waiting_request_leaks_nothing(live: Live) -> None:
    """Two waits under one id used to orphan the first: its waiter outlived the connection."""
    reader, writer = await _hello(live.server.port)
    wait = _wire.encode_frame(7, _wire.Op.WAIT, F64.pack(-1.0) + U32.pack(1) + _wire.blob32(b"n"))
    writer.write(wait + wait)  # type: ignore[attr-defined]
    head = await reader.readexactly(_wire.FRAME_HEAD.size)  # type: ignore[attr-defined]
    length, rid, status = _wire.FRAME_HEAD.unpack(head)
    message = await reader.readexactly(length - 5)  # type: ignore[attr-defined]
    assert (rid, status) == (7, _wire.Status.USAGE_ERROR)
    assert message == b"request id 7 is already used by a waiting request"
    assert live.server.state.waiter_count == live.waiters + 1
    writer.close()  # type: ignore[attr-defined]
    await live.check()
