"""torch's wire of the TCPStore client, for a ``torch.distributed.TCPStore`` server.

torch's wire answers strictly in order and acknowledges no write, so :class:`TorchChannel`
keeps its main connection for requests that are answered at once (a queue of futures, each
with the parser of its reply) and runs each wait (``wait``, ``barrier``, and the waits behind
``get``, ``multi_get`` and a blocking ``queue_pop``) on a spare connection of its own,
cancelled with CANCEL_WAIT when its time runs out. :func:`torch_validate` is the VALIDATE and
PING exchange that opens every connection (with a special nonce, also the probe of
``wire="auto"``). The server side of this wire is ``_server_torch.py``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from ..errors import DistNetworkError, DistProtocolError, DistStoreError, QueueEmptyError
from ._base import settled
from ._client_connection import (
    MAX_REPLY_VALUE,
    SERVER_GRACE,
    Channel,
    ClientConnection,
    ReplySink,
    TimedOut,
    connect,
    remaining_from,
)
from ._state import format_keys
from ._wire import (
    I64,
    TORCH_READY,
    TORCH_STOP_WAITING,
    TORCH_VALIDATE_MAGIC,
    TORCH_WAIT_CANCELED,
    U8,
    U32,
    U64,
    Incomplete,
    Reader,
    TorchOp,
    torch_request,
)

__all__ = ["TorchChannel", "torch_validate"]

logger = logging.getLogger(__name__)


# torch-wire reply parsers: each reads one reply or raises Incomplete.
_Parser = Callable[[Reader], Any]


def _p_bytes(r: Reader) -> bytes:
    return r.blob64(MAX_REPLY_VALUE, "value")


def _p_i64(r: Reader) -> int:
    return r.i64()


def _p_list(r: Reader) -> list[bytes]:
    return [_p_bytes(r) for _ in range(r.i64())]


def _p_queue_pop(r: Reader) -> bytes | None:
    return _p_bytes(r) if r.i64() > 0 else None


def _p_flag(r: Reader) -> bool:
    return r.i64() != 0


def _p_ready(r: Reader) -> bool:
    return r.u8() == TORCH_READY


#: opcode, u64 key length: the head of a torch-wire set or add.
_T_SET_HEAD = struct.Struct("<BQ")
_T_SET, _T_ADD = int(TorchOp.SET), int(TorchOp.ADD)


def _p_many(n: int) -> _Parser:
    return lambda r: [_p_bytes(r) for _ in range(n)]


async def _read_pop(conn: ClientConnection) -> bytes | None:
    """Read the answer to a QUEUE_POP: the value, or ``None`` where the queue was empty."""
    (count,) = I64.unpack(await conn.read_exactly(8))
    if count <= 0:
        return None
    (size,) = U64.unpack(await conn.read_exactly(8))
    if size > MAX_REPLY_VALUE:
        raise DistProtocolError(f"torch store sent a {size}-byte queue item")
    return await conn.read_exactly(size)


async def torch_validate(conn: ClientConnection, nonce: int, timeout: float | None) -> int:
    """Send torch's VALIDATE and a PING of ``nonce``; return the server's answer to the PING."""
    conn.write(
        U8.pack(TorchOp.VALIDATE)
        + U32.pack(TORCH_VALIDATE_MAGIC)
        + U8.pack(TorchOp.PING)
        + U32.pack(nonce)
    )
    reply: int = U32.unpack(await conn.read_exactly(4, timeout))[0]
    return reply


class TorchChannel(Channel, ReplySink):
    """torch's wire: in-order replies on the main connection, waits on spare connections."""

    wire = "torch"

    def __init__(
        self, conn: ClientConnection, host: str, port: int, max_key_size: int, max_value_size: int
    ) -> None:
        self._conn = conn
        self._host = host
        self._port = port
        self.max_key_size = max_key_size
        self.max_value_size = max_value_size
        self._fifo: deque[tuple[asyncio.Future[Any], _Parser, bytes | None]] = deque()
        self._spare: list[ClientConnection] = []
        # torch's server closes the connection when an add finds a non-integer; the client
        # then reports that add as a store error and reconnects once for the next request.
        self._reopen = False
        self._waiting: set[ClientConnection] = set()
        conn.sink = self
        if conn.buf:
            del conn.buf[: self.feed(conn.buf)]

    @property
    def pending(self) -> int:
        return len(self._fifo) + len(self._waiting)

    def feed(self, buf: bytes | bytearray) -> int:
        pos = 0
        fifo = self._fifo
        while fifo and pos < len(buf):
            future, parser, _add_key = fifo[0]
            reader = Reader(buf, pos)
            try:
                value = parser(reader)
            except Incomplete:
                break
            except DistProtocolError as exc:
                logger.error("torch store %s sent a bad reply: %s", self._conn.where, exc)
                self._conn.close()
                break
            fifo.popleft()
            pos = reader.pos
            if not future.done():
                future.set_result(value)
        return pos

    def lost(self, conn: ClientConnection) -> None:
        fifo, self._fifo = self._fifo, deque()
        for i, (future, _parser, add_key) in enumerate(fifo):
            if future.done():
                continue
            if i == 0 and add_key is not None and conn.error is None and not conn.closed_here:
                self._reopen = True
                future.set_exception(
                    DistStoreError(
                        f"add on key {format_keys([add_key[1:]])} failed: the torch store "
                        "server closed the connection, as it does when the add fails (a "
                        "value that is not an integer, or a sum past 64 bits)"
                    )
                )
            else:
                future.set_exception(conn.lost_error())

    async def _main(self) -> ClientConnection:
        conn = self._conn
        if conn.is_lost:
            if not self._reopen:
                raise conn.lost_error()
            self._reopen = False
            conn = await connect(self._host, self._port, SERVER_GRACE, conn.peer_timeout)
            if await torch_validate(conn, os.getpid(), SERVER_GRACE) != os.getpid():
                conn.close()
                raise DistProtocolError(f"torch store {conn.where} failed the PING check")
            self._conn = conn
            conn.sink = self
        return conn

    async def _call(self, request: bytes, parser: _Parser, add_key: bytes | None = None) -> Any:
        conn = await self._main()
        future: asyncio.Future[Any] = conn.loop.create_future()
        self._fifo.append((future, parser, add_key))
        conn.write(request)
        # A cancelled caller leaves its entry in the queue: the reply still arrives in order.
        return await future

    def _request(
        self, request: bytes, parser: _Parser, add_key: bytes | None = None
    ) -> Awaitable[Any]:
        """Send a request that is answered at once; the reply's future, or (to reconnect
        after the server dropped a failed add) a coroutine."""
        conn = self._conn
        if conn.is_lost:
            return self._call(request, parser, add_key)
        future: asyncio.Future[Any] = conn.loop.create_future()
        self._fifo.append((future, parser, add_key))
        conn.write(request)
        return future

    async def _send(self, request: bytes) -> None:
        (await self._main()).write(request)

    def _post(self, request: bytes) -> Awaitable[None]:
        # Requests with no reply (set, append, ...): torch's wire acknowledges nothing.
        conn = self._conn
        if conn.is_lost:
            return self._send(request)
        conn.write(request)
        done: asyncio.Future[None] = conn.loop.create_future()
        done.set_result(None)
        return done

    def set(self, key: bytes, value: bytes) -> Awaitable[None]:
        return self._post(_T_SET_HEAD.pack(_T_SET, len(key)) + key + U64.pack(len(value)) + value)

    async def get(self, key: bytes, timeout: float | None) -> bytes:
        await self.wait([key], timeout)
        value: bytes = await self._request(torch_request(TorchOp.GET, key), _p_bytes)
        return value

    def add(self, key: bytes, amount: int) -> Awaitable[int]:
        request = _T_SET_HEAD.pack(_T_ADD, len(key)) + key + I64.pack(amount)
        return self._request(request, _p_i64, key)

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> Awaitable[bytes]:
        request = torch_request(TorchOp.COMPARE_SET, key, expected, desired)
        return self._request(request, _p_bytes)

    def check(self, keys: list[bytes]) -> Awaitable[bool]:
        return self._request(torch_request(TorchOp.CHECK, keys), _p_ready)

    async def wait(self, keys: list[bytes], timeout: float | None) -> None:
        # Ask on the main connection first: it is ordered after this client's own writes.
        if await self.check(keys):
            return
        start = time.monotonic()
        if await self._wait_on_spare(torch_request(TorchOp.WAIT, keys), timeout, start):
            return
        missing = [k for k in keys if not await self.check([k])]
        if missing:
            raise TimedOut(missing, time.monotonic() - start)
        # The keys arrived while the cancel was on its way.

    async def lease(self, key: bytes, value: bytes, append: bool) -> bool:
        return False  # torch's server has no leases

    async def barrier(self, key: bytes, world_size: int, timeout: float | None) -> None:
        start = time.monotonic()
        request = torch_request(TorchOp.BARRIER, key, world_size)
        try:
            if await self._wait_on_spare(request, timeout, start):
                return
        except DistNetworkError:
            # A torch server drops the connection when the counter is not an integer.
            if await self._counter(key) is None and not self._conn.is_lost:
                value = await self._call(torch_request(TorchOp.GET, key), _p_bytes)
                raise DistStoreError(
                    f"barrier on key {format_keys([key[1:]])}: its value {value[:64]!r} is "
                    "not an integer"
                ) from None
            raise
        count = await self._counter(key)
        if count is None or count < world_size:
            raise TimedOut([key], time.monotonic() - start, count)

    async def _counter(self, key: bytes) -> int | None:
        value: bytes = await self._call(torch_request(TorchOp.GET, key), _p_bytes)
        try:
            return int(value)
        except ValueError:
            return None

    async def _wait_on_spare(
        self,
        request: bytes,
        timeout: float | None,
        start: float,
        then: Callable[[ClientConnection], Awaitable[None]] | None = None,
    ) -> bool:
        """Send a waiting request on a spare connection; return whether it was answered.

        ``then`` runs on that connection once the wait is answered (a queue pop). On timeout
        the wait is cancelled (CANCEL_WAIT) and False returned; the connection goes back to
        the spares when it is left in a known state.
        """
        conn = await self._spare_conn(timeout)
        self._waiting.add(conn)
        reusable = False
        try:
            conn.write(request)
            try:
                reply = await conn.read_exactly(1, remaining_from(start, timeout))
            except TimeoutError:
                await self._cancel_wait(conn)
                reusable = True
                return False
            if reply[0] != TORCH_STOP_WAITING:
                raise DistProtocolError(f"torch store answered a wait with {reply!r}")
            if then is not None:
                await then(conn)
            reusable = True
            return True
        finally:
            self._waiting.discard(conn)
            if reusable and not conn.is_lost:
                self._spare.append(conn)
            else:
                conn.close()

    @staticmethod
    async def _cancel_wait(conn: ClientConnection) -> None:
        conn.write(torch_request(TorchOp.CANCEL_WAIT))
        reply = await conn.read_exactly(1, SERVER_GRACE)
        if reply[0] == TORCH_STOP_WAITING:
            # The wake raced the cancel: the cancel's own answer follows.
            reply = await conn.read_exactly(1, SERVER_GRACE)
        if reply[0] != TORCH_WAIT_CANCELED:
            raise DistProtocolError(f"torch store answered CANCEL_WAIT with {reply!r}")

    async def _spare_conn(self, timeout: float | None) -> ClientConnection:
        while self._spare:
            conn = self._spare.pop()
            if not conn.is_lost:
                return conn
        conn = await connect(self._host, self._port, timeout, self._conn.peer_timeout)
        try:
            if await torch_validate(conn, os.getpid(), timeout) != os.getpid():
                raise DistProtocolError(f"torch store {conn.where} failed the PING check")
        except BaseException:
            conn.close()
            raise
        return conn

    def delete(self, key: bytes) -> Awaitable[bool]:
        return self._request(torch_request(TorchOp.DELETE_KEY, key), _p_flag)

    async def delete_prefix(self, prefix: bytes) -> int:
        # torch's wire has no such request: the keys, then a deletion of each (pipelined).
        doomed = [k for k in await self.list_keys() if k.startswith(prefix)]
        return sum(await asyncio.gather(*(self.delete(k) for k in doomed)))

    def num_keys(self) -> Awaitable[int]:
        return self._request(torch_request(TorchOp.GETNUMKEYS), _p_i64)

    def list_keys(self) -> Awaitable[list[bytes]]:
        return self._request(torch_request(TorchOp.LIST_KEYS), _p_list)

    async def multi_get(self, keys: list[bytes], timeout: float | None) -> list[bytes]:
        await self.wait(keys, timeout)
        request = torch_request(TorchOp.MULTI_GET, keys)
        value: list[bytes] = await self._call(request, _p_many(len(keys)))
        return value

    def multi_set(self, items: list[tuple[bytes, bytes]]) -> Awaitable[None]:
        flat = [b for item in items for b in item]
        # torch's layout: count of pairs, then key, value, key, value...
        parts = [U8.pack(TorchOp.MULTI_SET), I64.pack(len(items))]
        parts += [I64.pack(len(b)) + b for b in flat]
        return self._post(b"".join(parts))

    def append(self, key: bytes, value: bytes) -> Awaitable[None]:
        return self._post(torch_request(TorchOp.APPEND, key, value))

    def queue_push(self, key: bytes, value: bytes) -> Awaitable[None]:
        return self._post(torch_request(TorchOp.QUEUE_PUSH, key, value))

    async def queue_pop(self, key: bytes, block: bool, timeout: float | None) -> bytes:
        request = torch_request(TorchOp.QUEUE_POP, key)
        if not block:
            conn = await self._main()
            answer: asyncio.Future[Any] = conn.loop.create_future()
            self._fifo.append((answer, _p_queue_pop, None))
            conn.write(request)
            value = await self._keep_popped(key, answer)
            if value is None:
                raise QueueEmptyError(f"queue {format_keys([key[1:]])} is empty")
            assert isinstance(value, bytes)
            return value
        # As torch's client: a wait for the key, then the pop, on one connection, which a
        # server may have promised the item to (aiodist's does, see store/_state.py).
        popped: list[bytes | None] = []

        async def pop(conn: ClientConnection) -> None:
            conn.write(request)
            popped.append(await self._keep_popped(key, asyncio.ensure_future(_read_pop(conn))))

        start = time.monotonic()
        wait = torch_request(TorchOp.WAIT, [key])
        while True:  # an item taken by a client that does not wait first: wait again
            if not await self._wait_on_spare(wait, timeout, start, pop):
                raise TimedOut([key], time.monotonic() - start)
            value = popped.pop()
            if value is not None:
                return value

    async def _keep_popped(self, key: bytes, answer: asyncio.Future[Any]) -> Any:
        """Await the answer to a pop of queue ``key``; cancelled meanwhile, wait for the
        answer (the server pops at once and answers in order) and put back what it took, at
        the end: torch's wire cannot put a value first. (Shielded: a cancelled task cancels
        the future it awaits, and the value in a reply still to come would be dropped.)"""
        try:
            return await asyncio.shield(answer)
        except asyncio.CancelledError:
            await settled(answer, SERVER_GRACE)
            if answer.done() and not answer.cancelled() and answer.exception() is None:
                taken = answer.result()
                if taken is not None and not self._conn.is_lost:
                    self.queue_push(key, taken)  # (written now: a post, no reply)
            raise

    def queue_push_front(self, key: bytes, value: bytes) -> Awaitable[None]:
        # torch's wire has no way to put a value first: at the end, then.
        return self.queue_push(key, value)

    def queue_len(self, key: bytes) -> Awaitable[int]:
        return self._request(torch_request(TorchOp.QUEUE_LEN, key), _p_i64)

    def close(self) -> None:
        self._conn.close()
        for conn in (*self._spare, *self._waiting):
            conn.close()
        self._spare.clear()
