"""Byte layouts of the two store protocols: torch's TCPStore wire and aiodist's own.

Nothing here touches a socket: these are the encoders and incremental parsers that the
server (``_server.py``) and the client (``tcp.py``) share. No pickle; every length read off
the wire is checked against a limit before anything is allocated for it.

torch's wire (torch >= 2.4): a 1-byte opcode, then arguments; integers are little-endian,
byte strings are a u64 length then the bytes. There is no request id and no length header,
so requests are parsed by opcode and replies come back in request order.

aiodist's wire: a 38-byte hello (``AIOS``, u16 version, 32-byte nonce) answered by a 51-byte
server hello (``AIOS``, u16 version, u8 flags, u32 max key size, u64 max value size, 32-byte
nonce), an optional HMAC-SHA256 challenge-response, then frames in both directions::

    u32 body length | u32 request id | u8 opcode (request) or status (response) | payload

Byte strings inside a payload are a u32 length then the bytes; a response's single value is
the rest of the frame. Request ids let one connection carry many requests at once and answer
them in any order.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence

from .._util._auth import AUTH_MAC_SIZE, NONCE_SIZE, auth_mac
from ..errors import DistProtocolError

__all__ = [
    "AIODIST_MAGIC",
    "AUTH_MAC_SIZE",
    "CLIENT_HELLO",
    "DEFAULT_MAX_KEY_SIZE",
    "DEFAULT_MAX_VALUE_SIZE",
    "FLAG_AUTH",
    "FRAME_HEAD",
    "NONCE_SIZE",
    "PROTOCOL_VERSION",
    "SERVER_HELLO",
    "TORCH_MAX_KEYS",
    "TORCH_NOT_READY",
    "TORCH_READY",
    "TORCH_STOP_WAITING",
    "TORCH_WAIT_CANCELED",
    "TORCH_VALIDATE_MAGIC",
    "UPGRADE_NONCE",
    "UPGRADE_REPLY",
    "Incomplete",
    "Op",
    "Reader",
    "Status",
    "TorchOp",
    "auth_mac",
    "blob32",
    "blob64",
    "encode_frame",
    "max_request_size",
    "parse_torch_request",
    "torch_request",
]

#: The first four bytes of an aiodist store connection (the transport's peer links use
#: ``AIOD``). torch's first byte is always 0 (VALIDATE), so the server tells the two apart by
#: the first byte.
AIODIST_MAGIC = b"AIOS"
#: Bumped whenever the frame layout or an opcode's meaning changes, or an opcode is added
#: (3: QUEUE_PUSH_FRONT; 4: LEASE_APPEND; 5: DELETE_PREFIX).
PROTOCOL_VERSION = 5
FLAG_AUTH = 0x01

#: Limits a server applies unless told otherwise (torch's libuv server allows 8 KiB keys and
#: 8 MiB values; aiodist's defaults are roomier but still bounded).
DEFAULT_MAX_KEY_SIZE = 64 * 1024
DEFAULT_MAX_VALUE_SIZE = 64 * 1024 * 1024
#: torch's own bound on the number of keys one request may name.
TORCH_MAX_KEYS = 128 * 1024

TORCH_VALIDATE_MAGIC = 0x3C85F7CE
#: A PING nonce no torch client sends (torch uses its pid, and pids stay below 2**22). A client
#: that does not know which server it faces sends it right after VALIDATE: a torch server
#: echoes it, an aiodist server answers UPGRADE_REPLY and switches the connection to the
#: aiodist protocol. torch's libuv server never answers bytes that do not start with VALIDATE,
#: so probing with the aiodist hello first would hang instead of failing.
UPGRADE_NONCE = 0xA10D1570
UPGRADE_REPLY = UPGRADE_NONCE ^ 0xFFFFFFFF

U8 = struct.Struct("<B")
U16 = struct.Struct("<H")
U32 = struct.Struct("<I")
I64 = struct.Struct("<q")
U64 = struct.Struct("<Q")
F64 = struct.Struct("<d")
#: body length, request id, opcode or status.
FRAME_HEAD = struct.Struct("<IIB")
#: magic, version, nonce.
CLIENT_HELLO = struct.Struct(f"<4sH{NONCE_SIZE}s")
#: magic, version, flags, max key size, max value size, nonce.
SERVER_HELLO = struct.Struct(f"<4sHBIQ{NONCE_SIZE}s")


class TorchOp(enum.IntEnum):
    """torch's ``QueryType`` opcodes (TCPStoreBackend.hpp, torch 2.13)."""

    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16
    LIST_KEYS = 17
    BARRIER = 18


#: torch's reply codes.
TORCH_READY = 0
TORCH_NOT_READY = 1
TORCH_STOP_WAITING = 0
TORCH_WAIT_CANCELED = 1


class Op(enum.IntEnum):
    """aiodist-protocol request opcodes."""

    SET = 1
    GET = 2
    ADD = 3
    COMPARE_SET = 4
    WAIT = 5
    CHECK = 6
    DELETE_KEY = 7
    NUM_KEYS = 8
    LIST_KEYS = 9
    MULTI_GET = 10
    MULTI_SET = 11
    APPEND = 12
    QUEUE_PUSH = 13
    QUEUE_POP = 14
    QUEUE_LEN = 15
    #: Abandon the request whose id is the payload; it gets no response.
    CANCEL = 16
    PING = 17
    #: f64 timeout, i64 world size, key: count in at the counter ``key``, answer once it
    #: reaches the world size (a timeout reply ends with the i64 count reached).
    BARRIER = 18
    #: key, value: when this connection ends, set ``key`` to ``value`` if it is not set
    #: already (an empty value withdraws the lease on ``key``, of either kind).
    LEASE = 19
    #: key, value: put ``value`` at the head of queue ``key`` (a cancelled pop gives back
    #: what it took).
    QUEUE_PUSH_FRONT = 20
    #: key, value: when this connection ends, append ``value`` to ``key`` (an empty value
    #: withdraws the lease on ``key``, of either kind).
    LEASE_APPEND = 21
    #: prefix: delete every key that starts with it; the reply is the i64 count deleted.
    DELETE_PREFIX = 22


class Status(enum.IntEnum):
    """aiodist-protocol response status: OK or the kind of error the client must raise."""

    OK = 0
    STORE_ERROR = 1
    USAGE_ERROR = 2
    #: payload: f64 seconds waited, u32 count, the keys still missing.
    TIMEOUT = 3
    QUEUE_EMPTY = 4
    PROTOCOL_ERROR = 5


class Incomplete(Exception):
    """More bytes are needed before the message can be parsed."""


_INCOMPLETE = Incomplete()


def max_request_size(max_key_size: int, max_value_size: int) -> int:
    """The largest aiodist request body a server with these limits accepts."""
    return max_value_size + max_key_size + 64 * 1024


class Reader:
    """A cursor over received bytes; raises :class:`Incomplete` when they run out.

    Length-prefixed strings are checked against a limit before they are sliced, so a
    hostile length costs nothing but an error.
    """

    __slots__ = ("buf", "end", "pos")

    def __init__(self, buf: bytes | bytearray, pos: int = 0, end: int | None = None) -> None:
        self.buf = buf
        self.pos = pos
        self.end = len(buf) if end is None else end

    def _take(self, n: int) -> int:
        start = self.pos
        if start + n > self.end:
            raise _INCOMPLETE
        self.pos = start + n
        return start

    def u8(self) -> int:
        start = self._take(1)
        return self.buf[start]

    def u32(self) -> int:
        value: int = U32.unpack_from(self.buf, self._take(4))[0]
        return value

    def i64(self) -> int:
        value: int = I64.unpack_from(self.buf, self._take(8))[0]
        return value

    def u64(self) -> int:
        value: int = U64.unpack_from(self.buf, self._take(8))[0]
        return value

    def f64(self) -> float:
        value: float = F64.unpack_from(self.buf, self._take(8))[0]
        return value

    def raw(self, n: int) -> bytes:
        start = self._take(n)
        return bytes(self.buf[start : start + n])

    def rest(self) -> bytes:
        start = self.pos
        self.pos = self.end
        return bytes(self.buf[start : self.end])

    def _blob(self, head: struct.Struct, limit: int, what: str) -> bytes:
        # The hottest parsing path: inlined rather than built on u32()/raw().
        start = self.pos
        body = start + head.size
        if body > self.end:
            raise _INCOMPLETE
        n: int = head.unpack_from(self.buf, start)[0]
        if n > limit:
            raise DistProtocolError(f"{what} of {n} bytes exceeds the limit of {limit} bytes")
        stop = body + n
        if stop > self.end:
            raise _INCOMPLETE
        self.pos = stop
        return bytes(self.buf[body:stop])

    def blob64(self, limit: int, what: str) -> bytes:
        """A torch-wire string: u64 length, then the bytes."""
        return self._blob(U64, limit, what)

    def blob32(self, limit: int, what: str) -> bytes:
        """An aiodist-wire string: u32 length, then the bytes."""
        return self._blob(U32, limit, what)


def blob64(data: bytes) -> bytes:
    """Encode a torch-wire string."""
    return U64.pack(len(data)) + data


def blob32(data: bytes) -> bytes:
    """Encode an aiodist-wire string."""
    return U32.pack(len(data)) + data


def encode_frame(rid: int, code: int, *parts: bytes) -> bytes:
    """Encode one aiodist frame (request or response) from its payload parts."""
    payload = parts[0] if len(parts) == 1 else b"".join(parts)
    return FRAME_HEAD.pack(len(payload) + 5, rid, code) + payload


# -- torch wire -------------------------------------------------------------------------------
def torch_request(op: TorchOp, *args: bytes | int | Sequence[bytes]) -> bytes:
    """Encode a torch-wire request: ints as i64, bytes as strings, lists as u64 n + strings."""
    out = [U8.pack(op)]
    for arg in args:
        if isinstance(arg, int):
            out.append(I64.pack(arg))
        elif isinstance(arg, bytes):
            out.append(blob64(arg))
        else:
            out.append(U64.pack(len(arg)))
            out.extend(blob64(item) for item in arg)
    return b"".join(out)


TorchRequest = tuple[int, tuple[bytes | int | list[bytes], ...]]


def parse_torch_request(reader: Reader, max_key: int, max_value: int) -> TorchRequest:
    """Parse one torch-wire request at ``reader.pos``.

    Raises:
        Incomplete: the request has not fully arrived yet (``reader.pos`` is then garbage).
        DistProtocolError: unknown opcode, or a length past the limits.
    """
    op = reader.u8()
    if op in _T_KEY_VALUE:
        return op, (reader.blob64(max_key, "key"), reader.blob64(max_value, "value"))
    if op in _T_KEY_INT:
        return op, (reader.blob64(max_key, "key"), reader.i64())
    if op in _T_KEY:
        return op, (reader.blob64(max_key, "key"),)
    if op in _T_KEYS:
        return op, (_torch_keys(reader, max_key),)
    if op in _T_NONE:
        return op, ()
    if op in _T_U32:
        return op, (reader.u32(),)
    if op == _T_COMPARE_SET:
        key = reader.blob64(max_key, "key")
        return op, (key, reader.blob64(max_value, "value"), reader.blob64(max_value, "value"))
    if op == _T_MULTI_SET:
        n = _torch_count(reader)
        items: list[bytes] = []
        for _ in range(n):
            items.append(reader.blob64(max_key, "key"))
            items.append(reader.blob64(max_value, "value"))
        return op, (items,)
    raise DistProtocolError(f"unknown torch store opcode {op}")


# Request layouts by opcode (sets of plain ints: membership is cheaper than enum compares).
_T_KEY_VALUE = frozenset(int(o) for o in (TorchOp.SET, TorchOp.APPEND, TorchOp.QUEUE_PUSH))
_T_KEY_INT = frozenset(int(o) for o in (TorchOp.ADD, TorchOp.BARRIER))
_T_KEY = frozenset(
    int(o) for o in (TorchOp.GET, TorchOp.DELETE_KEY, TorchOp.QUEUE_POP, TorchOp.QUEUE_LEN)
)
_T_KEYS = frozenset(int(o) for o in (TorchOp.CHECK, TorchOp.WAIT, TorchOp.MULTI_GET))
_T_NONE = frozenset(int(o) for o in (TorchOp.GETNUMKEYS, TorchOp.CANCEL_WAIT, TorchOp.LIST_KEYS))
_T_U32 = frozenset(int(o) for o in (TorchOp.PING, TorchOp.VALIDATE))
_T_COMPARE_SET = int(TorchOp.COMPARE_SET)
_T_MULTI_SET = int(TorchOp.MULTI_SET)


def _torch_count(reader: Reader) -> int:
    n = reader.u64()
    if n > TORCH_MAX_KEYS:
        raise DistProtocolError(f"request names {n} keys, more than the limit of {TORCH_MAX_KEYS}")
    return n


def _torch_keys(reader: Reader, max_key: int) -> list[bytes]:
    return [reader.blob64(max_key, "key") for _ in range(_torch_count(reader))]
