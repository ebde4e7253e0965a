"""A client of etcd's v3 HTTP/JSON gateway, on asyncio streams, that fails over between members.

etcd serves its v3 API as JSON over HTTP/1.1 on the client port (``POST /v3/kv/range``,
``/v3/kv/txn``, ``/v3/watch``, ...): bytes fields are base64, 64-bit integers are strings,
and a field at its default value is left out of an answer. A streamed call (``/v3/watch``,
``/v3/lease/keepalive``) answers with a chunked body of newline-separated
``{"result": ...}`` objects.

:class:`EtcdClient` keeps idle keep-alive connections to the member it uses. When a member
cannot be reached, or a connection to it ends before the answer came, the request goes to
the next member of the list; when a member answers that the cluster is between leaders, the
request is tried again a moment later. Every request can be sent again safely: the store
makes each of its writes that must not happen twice a transaction that checks it did not
happen already (see ``etcd.py``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from ..errors import DistNetworkError, DistStoreError, DistUsageError
from ._sockets import configure_stream

__all__ = [
    "Compacted",
    "EtcdClient",
    "EtcdError",
    "Endpoint",
    "Watch",
    "b64",
    "compare",
    "key_range",
    "kvs_of",
    "parse_endpoints",
    "prefix_end",
    "revision_of",
    "unb64",
]

logger = logging.getLogger(__name__)

Endpoint = tuple[str, int]

#: The idle connections kept per client (more concurrent requests open more, then close them).
_MAX_IDLE = 8
#: The longest a request goes on being retried while members answer that the cluster has no
#: leader (an election after a member's loss takes about a second) or cannot be reached.
UNAVAILABLE_RETRY = 10.0
#: gRPC status codes (``code`` in an error answer) that mean "try again", not "refused".
_RETRY_CODES = {4, 14}  # DEADLINE_EXCEEDED, UNAVAILABLE
#: The largest answer header the client reads (an etcd answer's headers are a few hundred
#: bytes), and the largest line of a streamed answer.
_MAX_HEADER = 64 * 1024
_MAX_LINE = 64 * 1024 * 1024


def b64(data: bytes) -> str:
    """``data`` as etcd's JSON gateway spells bytes."""
    return base64.b64encode(data).decode()


def unb64(text: str | None) -> bytes:
    """The bytes of a base64 field of an answer (a missing field is empty)."""
    return base64.b64decode(text) if text else b""


def parse_endpoints(text: str, what: str = "etcd endpoints") -> list[Endpoint]:
    """Parse ``host:port[,host:port...]`` (IPv6 hosts in brackets; the port defaults to 2379).

    Raises:
        DistUsageError: the list is empty or an entry is malformed (the message names it).
    """
    endpoints: list[Endpoint] = []
    for item in text.split(","):
        item = item.strip()
        if item.startswith("http://"):
            item = item.removeprefix("http://").rstrip("/")
        if not item:
            raise DistUsageError(f"{what} {text!r}: an empty entry, expected host:port")
        host, sep, port = item.rpartition(":")
        if not sep or "]" in port:
            host, port = item, "2379"
        host = host.strip("[]")
        try:
            number = int(port)
        except ValueError:
            raise DistUsageError(f"{what} {text!r}: {item!r} has an invalid port") from None
        if not host or not 0 < number < 2**16:
            raise DistUsageError(f"{what} {text!r}: {item!r} is not host:port")
        endpoints.append((host, number))
    return endpoints


class EtcdError(DistStoreError):
    """etcd refused a request (the answer's gRPC ``code`` and message)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class _Lost(Exception):
    """A connection failed or ended before its answer was complete: try another member."""


class _Connection:
    """One HTTP/1.1 keep-alive connection to a member."""

    def __init__(
        self, endpoint: Endpoint, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.endpoint = endpoint
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, endpoint: Endpoint, timeout: float, peer_timeout: float) -> _Connection:
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(*endpoint, limit=_MAX_LINE)
        except (OSError, TimeoutError) as exc:
            raise _Lost(f"cannot connect: {exc or type(exc).__name__}") from None
        configure_stream(writer.transport, peer_timeout)
        return cls(endpoint, reader, writer)

    def local_address(self) -> str | None:
        name = self.writer.get_extra_info("sockname")
        return str(name[0]) if name else None

    def close(self) -> None:
        self.writer.close()

    async def send(self, path: str, body: bytes) -> None:
        host, port = self.endpoint
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        try:
            self.writer.write(head + body)
            await self.writer.drain()
        except OSError as exc:
            raise _Lost(f"sending failed: {exc}") from None

    async def _line(self) -> bytes:
        try:
            line = await self.reader.readuntil(b"\n")
        except asyncio.IncompleteReadError:
            raise _Lost("the member closed the connection") from None
        except (OSError, asyncio.LimitOverrunError, ValueError) as exc:
            raise _Lost(f"reading failed: {exc}") from None
        return line

    async def _exactly(self, n: int) -> bytes:
        try:
            return await self.reader.readexactly(n)
        except asyncio.IncompleteReadError:
            raise _Lost("the member closed the connection") from None
        except OSError as exc:
            raise _Lost(f"reading failed: {exc}") from None

    async def head(self) -> tuple[int, dict[str, str]]:
        """Read an answer's status line and headers."""
        status = (await self._line()).split(None, 2)
        if len(status) < 2 or not status[0].startswith(b"HTTP/1.") or not status[1].isdigit():
            raise DistStoreError(f"etcd at {self.where}: not an HTTP answer: {status!r}")
        headers: dict[str, str] = {}
        size = 0
        while (line := await self._line()) not in (b"\r\n", b"\n"):
            size += len(line)
            if size > _MAX_HEADER:
                raise DistStoreError(f"etcd at {self.where}: an answer's headers are too long")
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return int(status[1]), headers

    async def chunks(self, headers: dict[str, str]) -> AsyncIterator[bytes]:
        """The body of an answer, as it arrives."""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size_line = (await self._line()).split(b";")[0].strip()
                try:
                    size = int(size_line, 16)
                except ValueError:
                    raise DistStoreError(
                        f"etcd at {self.where}: a bad chunk size {size_line!r}"
                    ) from None
                if size == 0:
                    while (await self._line()) not in (b"\r\n", b"\n"):
                        pass  # trailers
                    return
                yield await self._exactly(size)
                await self._exactly(2)
        elif "content-length" in headers:
            yield await self._exactly(int(headers["content-length"]))
        else:
            try:
                yield await self.reader.read()
            except OSError as exc:
                raise _Lost(f"reading failed: {exc}") from None

    @property
    def where(self) -> str:
        return f"{self.endpoint[0]}:{self.endpoint[1]}"

    def reusable(self, headers: dict[str, str]) -> bool:
        return headers.get("connection", "").lower() != "close" and not self.reader.at_eof()


def _decode(where: str, status: int, body: bytes) -> dict[str, Any]:
    try:
        answer = json.loads(body) if body.strip() else {}
    except ValueError:
        raise DistStoreError(
            f"etcd at {where} answered HTTP {status} with {body[:200]!r}: not JSON "
            "(is it etcd's client port?)"
        ) from None
    if not isinstance(answer, dict):
        raise DistStoreError(f"etcd at {where} answered {body[:200]!r}")
    if "error" in answer or status != 200:
        message = (
            answer.get("message") or answer.get("error") or body[:200].decode(errors="replace")
        )
        code = answer.get("code", 2)
        raise EtcdError(f"etcd at {where}: {message}", int(code))
    result = answer.get("result", answer)
    if not isinstance(result, dict):
        raise DistStoreError(f"etcd at {where} answered {body[:200]!r}")
    if "error" in result:  # a streamed call's failure arrives as a result
        error = result["error"]
        raise EtcdError(
            f"etcd at {where}: {error.get('message', error)}", int(error.get("code", 2))
        )
    return result


class EtcdClient:
    """Requests to an etcd cluster through its JSON gateway, failing over between members.

    Args:
        endpoints: the members' client addresses, tried in this order.
        connect_timeout: seconds a connection attempt to one member may take.
        peer_timeout: seconds after which a connection whose member went silent (its host
            vanished) is dropped, so that the request moves to another member.
    """

    def __init__(
        self, endpoints: Sequence[Endpoint], connect_timeout: float, peer_timeout: float
    ) -> None:
        if not endpoints:
            raise DistUsageError("an etcd client needs at least one endpoint")
        self.endpoints = list(endpoints)
        self._connect_timeout = connect_timeout
        self._peer_timeout = peer_timeout
        # The member requests go to; it moves on when that one fails.
        self._current = 0
        self._idle: list[_Connection] = []
        self._local: str | None = None
        self._closed: str | None = None

    def __repr__(self) -> str:
        return f"<EtcdClient {self.where} idle={len(self._idle)}>"

    @property
    def where(self) -> str:
        """The endpoints, as ``host:port,host:port``."""
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def local_address(self) -> str | None:
        """The local address of the last connection made to a member."""
        return self._local

    def close(self, reason: str = "it is closed") -> None:
        """Close the idle connections; later requests raise ``DistNetworkError`` with
        ``reason``."""
        self._closed = self._closed or reason
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    async def _connect(self) -> _Connection:
        """A connection to the current member, or to the next one that answers.

        Raises:
            _Lost: no member could be reached (one round through the list).
        """
        while self._idle:
            conn = self._idle.pop()
            if conn.endpoint == self.endpoints[self._current] and not conn.reader.at_eof():
                return conn
            conn.close()
        errors = []
        for _ in range(len(self.endpoints)):
            endpoint = self.endpoints[self._current]
            try:
                conn = await _Connection.open(endpoint, self._connect_timeout, self._peer_timeout)
            except _Lost as exc:
                errors.append(f"{endpoint[0]}:{endpoint[1]}: {exc}")
                self._fail_over(endpoint)
                continue
            self._local = conn.local_address()
            return conn
        raise _Lost("; ".join(errors))

    def _fail_over(self, endpoint: Endpoint) -> None:
        """Move on from ``endpoint`` (unless another request has already moved on)."""
        if self.endpoints[self._current] == endpoint and len(self.endpoints) > 1:
            self._current = (self._current + 1) % len(self.endpoints)
            logger.info(
                "etcd member %s:%d failed: going on with %s:%d",
                *endpoint,
                *self.endpoints[self._current],
            )

    def _release(self, conn: _Connection, headers: dict[str, str]) -> None:
        if not self._closed and len(self._idle) < _MAX_IDLE and conn.reusable(headers):
            self._idle.append(conn)
        else:
            conn.close()

    async def _retrying(self, attempt: Any) -> Any:
        """Run ``attempt(conn)`` on a member, moving on while members fail or have no leader.

        Raises:
            DistNetworkError: no member could be reached, or the cluster had no leader, for
                :data:`UNAVAILABLE_RETRY` seconds (the message names the members and why).
            EtcdError: etcd refused the request.
        """
        start = time.monotonic()
        delay = 0.05
        while True:
            if self._closed:
                raise DistNetworkError(f"the etcd store at {self.where}: {self._closed}")
            conn: _Connection | None = None
            try:
                conn = await self._connect()
                return await attempt(conn)
            except _Lost as exc:
                if conn is not None:
                    conn.close()
                    self._fail_over(conn.endpoint)
                why = str(exc)
            except EtcdError as exc:
                if exc.code not in _RETRY_CODES:
                    raise
                why = str(exc)
            except BaseException:
                if conn is not None:
                    conn.close()  # cancelled mid-answer: the connection cannot be reused
                raise
            if time.monotonic() - start > UNAVAILABLE_RETRY:
                raise DistNetworkError(
                    f"the etcd store at {self.where} could not be reached for "
                    f"{time.monotonic() - start:.1f} s: {why}"
                )
            logger.debug("etcd request failed (%s): trying again", why)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def call(self, path: str, request: dict[str, Any]) -> dict[str, Any]:
        """POST ``request`` to ``path`` and return the answer (a streamed one's first result).

        Raises:
            DistNetworkError: no member answered (see :meth:`_retrying`).
            EtcdError: etcd refused the request.
        """
        body = json.dumps(request).encode()

        async def attempt(conn: _Connection) -> dict[str, Any]:
            await conn.send(path, body)
            status, headers = await conn.head()
            data = b"".join([chunk async for chunk in conn.chunks(headers)])
            try:
                return _decode(conn.where, status, data.split(b"\n", 1)[0] if data else data)
            finally:
                self._release(conn, headers)

        result: dict[str, Any] = await self._retrying(attempt)
        return result

    async def open_stream(self, path: str, request: dict[str, Any]) -> EtcdStream:
        """POST ``request`` to ``path`` and return its streamed answer, once it started.

        Raises:
            DistNetworkError: no member answered.
            EtcdError: etcd refused the request.
        """
        body = json.dumps(request).encode()

        async def attempt(conn: _Connection) -> EtcdStream:
            await conn.send(path, body)
            status, headers = await conn.head()
            stream = EtcdStream(conn, status, headers)
            try:
                stream.first = await stream.next()
            except BaseException:
                stream.close()
                raise
            return stream

        stream: EtcdStream = await self._retrying(attempt)
        return stream


class EtcdStream:
    """A streamed answer: :meth:`next` returns each result as it arrives.

    A stream holds its connection until :meth:`close`. A failure of the connection raises
    ``DistNetworkError`` naming the member; the caller starts a new stream where this one
    stopped (a watch, at the revision after the last one it saw).
    """

    def __init__(self, conn: _Connection, status: int, headers: dict[str, str]) -> None:
        self._conn = conn
        self._status = status
        self._chunks = conn.chunks(headers)
        self._buf = b""
        self.first: dict[str, Any] = {}

    @property
    def where(self) -> str:
        """The member this stream comes from."""
        return self._conn.where

    async def next(self) -> dict[str, Any]:
        """The next result.

        Raises:
            _Lost: the connection failed or the stream ended.
            EtcdError: the stream ended with an error (e.g. a compacted revision).
        """
        while b"\n" not in self._buf:
            try:
                chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                if self._buf.strip():
                    break
                raise _Lost("the member ended the stream") from None
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return _decode(self._conn.where, self._status, line)

    def close(self) -> None:
        """Drop the connection (a stream's connection is never reused)."""
        self._conn.close()


async def next_or_lost(stream: EtcdStream) -> dict[str, Any]:
    """``stream.next()``, with a lost connection as ``DistNetworkError``.

    Raises:
        DistNetworkError: the connection to the member failed.
        EtcdError: the stream ended with an error.
    """
    try:
        return await stream.next()
    except _Lost as exc:
        raise DistNetworkError(f"etcd at {stream.where}: {exc}") from None


def prefix_end(key: bytes) -> bytes:
    """The end of the etcd range of every key that starts with ``key``."""
    stripped = key.rstrip(b"\xff")
    return stripped[:-1] + bytes([stripped[-1] + 1]) if stripped else b"\0"


def key_range(key: bytes, *, prefix: bool = False, **options: Any) -> dict[str, Any]:
    request: dict[str, Any] = {"key": b64(key), **options}
    if prefix:
        request["range_end"] = b64(prefix_end(key))
    return request


def compare(key: bytes, target: str, value: int) -> dict[str, Any]:
    field_name = {"MOD": "mod_revision", "VERSION": "version"}[target]
    return {"key": b64(key), "target": target, "result": "EQUAL", field_name: str(value)}


def kvs_of(response: dict[str, Any]) -> list[dict[str, Any]]:
    """The key/values of a range answer (a transaction's item or a plain range)."""
    kvs: list[dict[str, Any]] = response.get("response_range", response).get("kvs", [])
    return kvs


def revision_of(answer: dict[str, Any]) -> int:
    return int(answer.get("header", {}).get("revision", 0))


class Compacted(Exception):
    """The history a watch needed was compacted: read the state again."""


class Watch:
    """An etcd watch of one key or range from a revision on, resumed across member failures."""

    def __init__(self, client: EtcdClient, key: bytes, end: bytes | None, after: int) -> None:
        self._client = client
        self._request: dict[str, Any] = {"key": b64(key)}
        if end is not None:
            self._request["range_end"] = b64(end)
        self._next = after + 1
        self._stream: EtcdStream | None = None

    async def events(self) -> list[dict[str, Any]]:
        """The next events (each ``{"type": "PUT"|"DELETE", "kv": {...}}``).

        Raises:
            Compacted: the revisions to resume from are gone.
            DistNetworkError: no member can be reached.
        """
        while True:
            if self._stream is None:
                request = {"create_request": {**self._request, "start_revision": str(self._next)}}
                self._stream = await self._client.open_stream("/v3/watch", request)
                self._check(self._stream.first)
            try:
                result = await next_or_lost(self._stream)
            except DistNetworkError as exc:
                # The member failed: resume on another one where this watch stopped.
                logger.debug("etcd watch interrupted (%s): resuming", exc)
                self.close()
                continue
            self._check(result)
            events: list[dict[str, Any]] = result.get("events", [])
            if events:
                self._next = int(events[-1]["kv"].get("mod_revision", 0)) + 1
                return events

    def _check(self, result: dict[str, Any]) -> None:
        if int(result.get("compact_revision", 0)) > 0 or result.get("canceled"):
            self.close()
            raise Compacted(result.get("cancel_reason", "compacted"))

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
