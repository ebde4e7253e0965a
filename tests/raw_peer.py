"""A hand-written peer that speaks the transport's wire format byte by byte.

It follows the layout documented in ``aiodist/transport/tcp.py`` independently of the
implementation, so tests can act as a well-behaved, a hostile or a broken rank.
"""

from __future__ import annotations

import asyncio
import os
import struct
from typing import Any

from aiodist._util._auth import auth_mac

MAGIC = b"AIOD"
VERSION = 6
HELLO, ACCEPT, REJECT, REFUSED = 0, 1, 2, 3
FLAG_AUTH = 1
#: On a reject: the rank is connected already to a process that claimed the connecting rank.
FLAG_HELD = 2
# ..., nonce, proof, then the bytes the sender stages at most for the other side
HANDSHAKE = struct.Struct("<4sHHHII32s32sQ")
#: The staging bound a raw peer announces: what it lets the rank send it unannounced.
STAGING = 1 << 20
# group, seq, step, payload length, then a 32-byte fingerprint (zeros: not checked)
HEADER = struct.Struct("<QQQQ32x")
IDS = struct.Struct("<III")


def hello(rank: int, world_size: int, *, auth: bool, nonce: bytes = b"") -> bytes:
    """The connecting side's first 90 bytes."""
    flags = FLAG_AUTH if auth else 0
    return HANDSHAKE.pack(MAGIC, VERSION, HELLO, flags, rank, world_size, nonce, b"", STAGING)


def frame(tag: tuple[int, int, int], payload: bytes) -> bytes:
    """One frame: a 64-byte header and the payload."""
    return HEADER.pack(*tag, len(payload)) + payload


async def connect(
    address: tuple[str, int], rank: int, peer: int, world_size: int, token: bytes | None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, tuple[Any, ...], bool]:
    """Connect to rank ``peer`` as rank ``rank`` and run the handshake (with ``token``).

    Returns the stream pair, the peer's answer (magic, version, kind, flags, rank, world
    size, nonce, proof) and whether its proof checked out with ``token``. Our own proof is
    sent either way, so a wrong token can be tried on the other side.
    """
    reader, writer = await asyncio.open_connection(*address)
    nonce = os.urandom(32)
    writer.write(hello(rank, world_size, auth=token is not None, nonce=nonce))
    reply = HANDSHAKE.unpack(await reader.readexactly(HANDSHAKE.size))
    verified = False
    if token is not None and reply[2] == ACCEPT:
        ids = IDS.pack(rank, peer, world_size)
        verified = reply[7] == auth_mac(token, b"peer/accept", nonce, reply[6] + ids)
        writer.write(auth_mac(token, b"peer/connect", reply[6], nonce + ids))
    return reader, writer, reply, verified
