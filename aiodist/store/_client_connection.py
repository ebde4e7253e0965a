"""What every TCPStore client connection has, whichever wire it speaks.

A client reaches its server through a :class:`Channel`: the raw-key operations of one wire
(keys already carry their ``"/"``, values are already bytes), implemented for aiodist's
protocol in ``_client_aiodist.py`` and for torch's in ``_client_torch.py``. Both run over
:class:`ClientConnection`, one TCP connection that is read plainly during the handshake and
then hands every byte to its channel (a :class:`ReplySink`); :func:`connect` opens one,
retrying until the caller's deadline. A wait that runs out of time raises :class:`TimedOut`,
which ``TCPStore`` (``tcp.py``) turns into a message naming the caller's own keys.
"""

from __future__ import annotations

import abc
import asyncio
import random
import time
from collections.abc import Awaitable
from typing import cast

from ..errors import DistNetworkError
from ._sockets import configure_stream

__all__ = [
    "MAX_REPLY_VALUE",
    "SERVER_GRACE",
    "Channel",
    "ClientConnection",
    "ReplySink",
    "TimedOut",
    "connect",
    "remaining_from",
]

#: Replies from a server are trusted further than requests, but still bounded.
MAX_REPLY_VALUE = 2**32
#: Extra time the client gives a server-timed wait before deciding the server is stuck.
SERVER_GRACE = 10.0


class TimedOut(Exception):
    """A wait ran out of time; the caller turns it into a message naming its own keys."""

    def __init__(self, missing: list[bytes], waited: float, count: int | None = None) -> None:
        self.missing = missing
        self.waited = waited
        # A barrier's timeout also reports the count its counter reached.
        self.count = count


def _lost(where: str, exc: BaseException | None) -> DistNetworkError:
    detail = f": {exc}" if exc is not None else " (the server closed it)"
    return DistNetworkError(f"lost the connection to the store at {where}{detail}")


class ReplySink(abc.ABC):
    """What a connection hands its bytes to once the handshake is done: a wire's channel."""

    @abc.abstractmethod
    def feed(self, buf: bytes | bytearray) -> int:
        """Take the complete replies at the start of ``buf``; return the bytes used."""

    @abc.abstractmethod
    def lost(self, conn: ClientConnection) -> None: ...


class ClientConnection(asyncio.Protocol):
    """One TCP connection: plain reads during the handshake, then a sink parses replies."""

    def __init__(self, where: str, peer_timeout: float) -> None:
        self.where = where
        self.peer_timeout = peer_timeout
        # Looked up once: asyncio.get_running_loop() costs a getpid() call on Python 3.11.
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.sink: ReplySink | None = None
        self.error: BaseException | None = None
        self.is_lost = False
        self.closed_here = False
        self._need = 0
        self._need_future: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)
        configure_stream(transport, self.peer_timeout)

    def data_received(self, data: bytes) -> None:
        sink = self.sink
        if sink is not None:
            if not self.buf:
                # The usual read holds whole replies: parse them in place, keep the rest.
                used = sink.feed(data)
                if used < len(data):
                    self.buf += data[used:]
                return
            self.buf += data
            used = sink.feed(self.buf)
            if used:
                del self.buf[:used]
            return
        self.buf += data
        if (
            self._need_future is not None
            and len(self.buf) >= self._need
            and not self._need_future.done()
        ):
            self._need_future.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_lost = True
        self.error = exc
        self.transport = None
        if self._need_future is not None and not self._need_future.done():
            self._need_future.set_result(None)
        if self.sink is not None:
            self.sink.lost(self)

    def lost_error(self) -> DistNetworkError:
        if self.closed_here:
            return DistNetworkError(f"the connection to the store at {self.where} was closed")
        return _lost(self.where, self.error)

    def write(self, data: bytes) -> None:
        if self.transport is None:
            raise self.lost_error()
        self.transport.write(data)

    async def read_exactly(self, n: int, timeout: float | None = None) -> bytes:
        async with asyncio.timeout(timeout):
            while len(self.buf) < n:
                if self.is_lost:
                    raise self.lost_error()
                self._need = n
                self._need_future = self.loop.create_future()
                try:
                    await self._need_future
                finally:
                    self._need_future = None
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    def close(self) -> None:
        self.closed_here = True
        if self.transport is not None:
            self.transport.close()


#: The least time a connection attempt is begun with: a refusal, even on loopback, is read
#: on a later turn of the loop, which a loaded machine may take tens of milliseconds to reach.
_ATTEMPT_FLOOR = 0.1


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _describe(exc: OSError) -> str:
    """An OS error as a reader wants it: its text, else its class and errno."""
    text = str(exc)
    if text:
        return text
    return f"{type(exc).__name__} (errno {exc.errno})" if exc.errno else type(exc).__name__


async def connect(
    host: str, port: int, timeout: float | None, peer_timeout: float
) -> ClientConnection:
    """Connect, retrying with jittered exponential backoff until ``timeout`` runs out.

    Raises:
        DistNetworkError: naming host:port, the time spent, the number of attempts and the
            last error the OS reported (or that the last attempt got no answer).
    """
    loop = asyncio.get_running_loop()
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    delay = 0.01
    attempts = 0
    last_error: OSError | None = None
    unanswered = False
    while True:
        conn = ClientConnection(f"{host}:{port}", peer_timeout)
        attempts += 1
        try:
            async with asyncio.timeout(_remaining(deadline)):
                await loop.create_connection(lambda c=conn: c, host, port)  # type: ignore[misc]
            return conn
        except TimeoutError:
            # Cut off by our deadline (TimeoutError is an OSError, with no text): the host
            # neither accepted nor refused in the time that was left.
            unanswered = True
        except OSError as exc:
            last_error, unanswered = exc, False
        left = _remaining(deadline)
        pause = random.uniform(delay / 2, delay)
        delay = min(delay * 2, 1.0)
        if left is not None and pause + _ATTEMPT_FLOOR >= left:
            # No time for another real attempt (one begun a moment before the deadline is cut
            # before the OS's answer is read, and would hide the last error): wait out the
            # deadline, then report the outcome of the last one that had time to run.
            await asyncio.sleep(left)
            left = 0.0
        if left is not None and left <= 0:
            tried = f"{attempts} attempt{'s' if attempts != 1 else ''} to connect to {host}:{port}"
            if unanswered:
                cause = "the last one got no answer before the deadline"
                if last_error is not None:
                    cause += f"; the error before it was: {_describe(last_error)}"
            elif last_error is not None:
                cause = f"the last error was: {_describe(last_error)}"
            else:
                cause = "no attempt got an answer"
            raise DistNetworkError(
                f"could not connect to the store at {host}:{port} within "
                f"{time.monotonic() - start:.1f} s ({tried}; {cause})"
            ) from last_error
        await asyncio.sleep(pause)


def remaining_from(start: float, timeout: float | None) -> float | None:
    return None if timeout is None else max(0.0, timeout - (time.monotonic() - start))


class Channel(abc.ABC):
    """The raw-key operations of one wire, the interface ``TCPStore`` calls."""

    wire: str
    max_key_size: int
    max_value_size: int
    _conn: ClientConnection

    @property
    def peer_timeout(self) -> float:
        return self._conn.peer_timeout

    def local_address(self) -> str | None:
        transport = self._conn.transport
        sockname = transport.get_extra_info("sockname") if transport is not None else None
        return sockname[0] if isinstance(sockname, tuple) else None

    @property
    @abc.abstractmethod
    def pending(self) -> int: ...

    # Each returns an awaitable: a coroutine, or (for requests answered at once) the reply's
    # future itself, which spares two coroutine frames per request.
    @abc.abstractmethod
    def set(self, key: bytes, value: bytes) -> Awaitable[None]: ...
    @abc.abstractmethod
    def get(self, key: bytes, timeout: float | None) -> Awaitable[bytes]: ...
    @abc.abstractmethod
    def add(self, key: bytes, amount: int) -> Awaitable[int]: ...
    @abc.abstractmethod
    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> Awaitable[bytes]: ...
    @abc.abstractmethod
    def wait(self, keys: list[bytes], timeout: float | None) -> Awaitable[None]: ...
    @abc.abstractmethod
    def check(self, keys: list[bytes]) -> Awaitable[bool]: ...
    @abc.abstractmethod
    def delete(self, key: bytes) -> Awaitable[bool]: ...
    @abc.abstractmethod
    def delete_prefix(self, prefix: bytes) -> Awaitable[int]: ...
    @abc.abstractmethod
    def num_keys(self) -> Awaitable[int]: ...
    @abc.abstractmethod
    def list_keys(self) -> Awaitable[list[bytes]]: ...
    @abc.abstractmethod
    def multi_get(self, keys: list[bytes], timeout: float | None) -> Awaitable[list[bytes]]: ...
    @abc.abstractmethod
    def multi_set(self, items: list[tuple[bytes, bytes]]) -> Awaitable[None]: ...
    @abc.abstractmethod
    def append(self, key: bytes, value: bytes) -> Awaitable[None]: ...
    @abc.abstractmethod
    def queue_push(self, key: bytes, value: bytes) -> Awaitable[None]: ...
    @abc.abstractmethod
    def queue_pop(self, key: bytes, block: bool, timeout: float | None) -> Awaitable[bytes]: ...
    @abc.abstractmethod
    def queue_push_front(self, key: bytes, value: bytes) -> Awaitable[None]: ...
    @abc.abstractmethod
    def queue_len(self, key: bytes) -> Awaitable[int]: ...
    @abc.abstractmethod
    def barrier(self, key: bytes, world_size: int, timeout: float | None) -> Awaitable[None]: ...
    @abc.abstractmethod
    def lease(self, key: bytes, value: bytes, append: bool) -> Awaitable[bool]: ...
    @abc.abstractmethod
    def close(self) -> None: ...
