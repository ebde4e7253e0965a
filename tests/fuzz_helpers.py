"""Shared pieces of the fuzz tests: hypothesis settings, byte strategies, socket helpers."""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from collections.abc import Callable

from hypothesis import HealthCheck, settings, strategies as st

from aiodist.store import _wire

#: Fixed, derandomized examples: the same inputs on every run and every machine.
FUZZ = settings(
    derandomize=True,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)


def fuzz(max_examples: int) -> settings:
    """The fuzz settings with a budget of ``max_examples`` inputs."""
    return settings(FUZZ, max_examples=max_examples)


U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
I64 = struct.Struct("<q")
F64 = struct.Struct("<d")

#: Lengths at and around every boundary a parser might get wrong.
EDGE_LENGTHS = st.sampled_from(
    [0, 1, 4, 5, 31, 32, 33, 255, 4096, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**40, 2**48, 2**63]
)


def length_field(head: struct.Struct) -> st.SearchStrategy[Callable[[int], int]]:
    """How a generated length field relates to the bytes that follow: exact or a lie."""
    limit = 2 ** (8 * head.size) - 1
    return st.one_of(
        st.just(lambda n: n),
        st.integers(-3, 3).map(lambda d: lambda n: max(0, min(limit, n + d))),
        EDGE_LENGTHS.map(lambda v: lambda n: min(limit, v)),
    )


def blob(head: struct.Struct, limit: int = 64) -> st.SearchStrategy[bytes]:
    """A length-prefixed byte string whose length field may lie."""
    return st.builds(
        lambda data, fix: head.pack(fix(len(data))) + data,
        st.binary(max_size=limit),
        length_field(head),
    )


async def exchange(address: tuple[str, int], data: bytes, timeout: float = 5.0) -> bytes:
    """Send ``data`` on a fresh connection, half-close, and read until the other side closes.

    A reset (the other side dropped the connection with bytes unread) counts as closed.
    """
    reader, writer = await asyncio.open_connection(*address)
    received = b""
    try:
        with contextlib.suppress(ConnectionError):
            writer.write(data)
            await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        with contextlib.suppress(ConnectionError):
            received = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return received


async def until(predicate: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    """Wait until ``predicate()`` holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        await asyncio.sleep(0.002)


TORCH_VALIDATE = bytes([_wire.TorchOp.VALIDATE]) + U32.pack(_wire.TORCH_VALIDATE_MAGIC)
