"""TCPStore: the network store, client and (for the master) server, on asyncio.

The client speaks one of two wires. aiodist's own protocol tags every request with an id, so
one connection carries any number of concurrent requests: a pending ``wait`` never holds up a
``set`` from the same process, and waits are timed on the server (no polling). torch's wire
answers strictly in order, so the torch-wire client keeps its main connection for requests
that answer at once and runs each wait on a spare connection of its own.

User keys go on the wire as ``"/" + key`` on both wires, the way torch's client sends them, so
torch and aiodist clients of one server see the same keys under the same names.

This module holds :class:`TCPStore` (creation, the server it may host, the Store API) and the
choice of wire when it connects. Each wire's client is a channel of its own module,
``_client_aiodist.py`` and ``_client_torch.py``, over the connection and channel interface of
``_client_connection.py``; the server is ``_server.py``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Sequence
from typing import Literal

from .._util._auth import resolve_token
from .._util._speaking import speaking
from .._util._timeouts import DEFAULT_STORE_TIMEOUT, Timeout, to_seconds
from ..errors import DistNetworkError, DistProtocolError, DistTimeoutError, DistUsageError
from ._base import Store, Value, check_lengths, check_world_size, encode_key, encode_value
from ._client_aiodist import AiodistChannel, handshake_aiodist
from ._client_connection import Channel, ClientConnection, TimedOut, connect, remaining_from
from ._client_torch import TorchChannel, torch_validate
from ._server import TCPStoreServer, TorchPolicy
from ._sockets import resolve_peer_timeout
from ._state import I64_MAX, I64_MIN, barrier_timeout_error, timeout_error
from ._wire import DEFAULT_MAX_KEY_SIZE, DEFAULT_MAX_VALUE_SIZE, UPGRADE_NONCE, UPGRADE_REPLY

__all__ = ["TCPStore", "TCPStoreServer", "Wire"]

logger = logging.getLogger(__name__)

Wire = Literal["auto", "aiodist", "torch"]

#: The key every TCPStore adds 1 to when it is created with a world size (torch's name).
_JOIN_KEY = b"init/"


async def _joined(server: TCPStoreServer, world_size: int) -> str:
    return f"{server.state.count_or_none(_JOIN_KEY)} of {world_size} have joined"


async def _open_channel(
    host: str,
    port: int,
    wire: str,
    token: bytes | None,
    timeout: float | None,
    max_key_size: int,
    max_value_size: int,
    peer_timeout: float,
) -> Channel:
    """Connect and run the handshake of ``wire``, within ``timeout``.

    A connection dropped before the handshake ends is tried again while time is left: a
    server short of descriptors, or with many connections of this address still in their
    handshake, closes the oldest of them. (A torch-wire client is not: a server that does
    not let it in drops it the same way.)
    """
    start = time.monotonic()
    pause = 0.01
    while True:
        conn = await connect(host, port, remaining_from(start, timeout), peer_timeout)
        try:
            return await _handshake(
                conn, host, port, wire, token, start, timeout, max_key_size, max_value_size
            )
        except DistNetworkError as exc:
            left = remaining_from(start, timeout)
            if wire == "torch" or (left is not None and left <= pause):
                raise
            logger.debug("store %s:%d dropped the handshake (%s): trying again", host, port, exc)
            await asyncio.sleep(pause)
            pause = min(2 * pause, 1.0)


async def _handshake(
    conn: ClientConnection,
    host: str,
    port: int,
    wire: str,
    token: bytes | None,
    start: float,
    timeout: float | None,
    max_key_size: int,
    max_value_size: int,
) -> Channel:
    """The handshake of ``wire`` on the new connection ``conn`` (closed if it fails)."""
    left = remaining_from(start, timeout)
    try:
        if wire == "auto":
            reply = await torch_validate(conn, UPGRADE_NONCE, left)
            if reply == UPGRADE_NONCE:
                wire = "torch"
                if token is not None:
                    logger.warning(
                        "store at %s:%d is a torch TCPStore server: the auth token is not used",
                        host,
                        port,
                    )
            elif reply == UPGRADE_REPLY:
                wire = "aiodist"
            else:
                raise DistProtocolError(
                    f"{host}:{port} answered the store probe with {reply:#x}: "
                    "it is not a store server"
                )
        elif wire == "torch" and await torch_validate(conn, os.getpid(), left) != os.getpid():
            raise DistProtocolError(f"torch store {host}:{port} failed the PING check")
        if wire == "torch":
            return TorchChannel(conn, host, port, max_key_size, max_value_size)
        server_key, server_value = await handshake_aiodist(conn, token, left)
        return AiodistChannel(
            conn, min(max_key_size, server_key), min(max_value_size, server_value)
        )
    except TimeoutError:
        conn.close()
        raise DistNetworkError(
            f"the store at {host}:{port} did not answer the {wire} handshake within "
            f"{time.monotonic() - start:.1f} s"
        ) from None
    except BaseException:
        conn.close()
        raise


def _check_world_size(world_size: int | None) -> None:
    """Check ``TCPStore.create``'s ``world_size``.

    Raises:
        DistUsageError: not a positive integer (in torch's words for 0).
    """
    if world_size is not None and (
        isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1
    ):
        zero = "TCPStore world size cannot be 0: " if world_size == 0 else ""  # torch's
        raise DistUsageError(
            f"{zero}TCPStore world_size must be a positive int, got {world_size!r}"
        )


async def _serve(
    server: TCPStoreServer, host_name: str, port: int, listen_fd: int | None
) -> tuple[int, str]:
    """Start the master's ``server``; return its port and the host its clients on this
    host connect to."""
    # On a loop and thread of its own: it answers while this process's loop is
    # blocked (user code, a long step), which would otherwise stall the whole job.
    await server.start(host_name, port, listen_fd, thread=True)
    if server.host in ("0.0.0.0", "::"):
        return server.port, "127.0.0.1" if server.host == "0.0.0.0" else "::1"
    return server.port, host_name


async def _join(
    channel: Channel,
    server: TCPStoreServer | None,
    world_size: int,
    seconds: float | None,
    where: str,
) -> None:
    """Add this instance to torch's ``init/`` counter; with ``server`` (the master's, when
    it waits for its workers), wait until ``world_size`` instances joined."""
    await channel.add(_JOIN_KEY, 1)
    if server is not None:
        joined = server.wait_for_count(_JOIN_KEY, world_size, seconds)
        await speaking(
            joined,
            functools.partial(_joined, server, world_size),
            f"TCPStore: the store at {where} waits for its "
            f"{world_size} clients (world_size) to join",
        )


class TCPStore(Store):
    """A store served over TCP, shared by processes on any host that can reach it.

    Create it with :meth:`create`. The master (``is_master=True``) runs a
    :class:`TCPStoreServer` on the current event loop; every instance, master included, is a
    client of it. The server accepts unmodified ``torch.distributed.TCPStore`` clients on the
    same port, and the client can use a torch TCPStore server (``wire="torch"``, or detected
    with ``wire="auto"``).

    Attributes:
        host: the host name the store was created with.
        port: the server's port (the one picked when created with port 0).
        wire: the protocol in use, ``"aiodist"`` or ``"torch"``.
        server: the server this instance hosts, or ``None``.
    """

    def __init__(
        self,
        channel: Channel,
        host: str = "",
        port: int = 0,
        timeout: Timeout = None,
        *,
        server: TCPStoreServer | None = None,
        token: bytes | None = None,
    ) -> None:
        if not isinstance(channel, Channel):
            raise DistUsageError(
                "make a TCPStore with `await aiodist.TCPStore.create(host_name, port, ...)` "
                "(aiodist.sync.TCPStore is the blocking form with torch's constructor)"
            )
        super().__init__(timeout)
        self._channel = channel
        self.host = host
        self.port = port
        self.server = server
        self._token = token
        self._closed = False

    @property
    def wire(self) -> str:
        """The protocol this client speaks with its server, ``"aiodist"`` or ``"torch"``."""
        return self._channel.wire

    def local_address(self) -> str | None:
        """The local end of this client's connection: the address that reaches the server."""
        return self._channel.local_address()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"pending={self._channel.pending}"
        return (
            f"<TCPStore {self.host}:{self.port} wire={self.wire} "
            f"master={self.server is not None} timeout={self.timeout} {state}>"
        )

    @classmethod
    async def create(
        cls,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: Timeout = None,
        wait_for_workers: bool = True,
        *,
        auth_token: str | bytes | None = None,
        wire: Wire = "auto",
        max_key_size: int = DEFAULT_MAX_KEY_SIZE,
        max_value_size: int = DEFAULT_MAX_VALUE_SIZE,
        allow_unauthenticated_torch: TorchPolicy = False,
        peer_timeout: float | None = None,
        master_listen_fd: int | None = None,
    ) -> TCPStore:
        """Connect to (and, as master, first start) the store at ``host_name:port``.

        Args:
            host_name: the server's address; the master listens on exactly this address.
            port: the server's port; the master may pass 0 to pick a free one.
            world_size: the number of store instances of the job. Each one adds itself to
                torch's ``init/`` counter; the master waits for all of them when
                ``wait_for_workers``. ``None``: no join handshake.
            is_master: start the server here, on an event loop and thread of its own, so
                that it answers while this process's loop is blocked.
            timeout: seconds (or ``timedelta``) for connecting, joining, ``get`` and
                ``wait``; default 300 s.
            wait_for_workers: the master waits for ``world_size`` instances to join.
            auth_token: shared secret (HMAC-SHA256 challenge-response); ``None`` reads
                ``$AIODIST_AUTH_TOKEN``. The master's server then refuses clients without it.
            wire: ``"aiodist"``, ``"torch"`` (a torch TCPStore server) or ``"auto"``.
            max_key_size: the largest key in bytes (the server's limit, for the master).
            max_value_size: the largest value in bytes (the server's limit, for the master).
            allow_unauthenticated_torch: with a token, which torch clients (they cannot
                prove it) the master's server still lets in: ``False`` none, ``True``
                all, ``"job_hosts"`` those from an address a client with the token
                connected from, as this process's user when on this machine.
            peer_timeout: seconds after which a connection whose peer's host went silent
                (no FIN, no RST) is dropped: pending requests then fail with
                ``DistNetworkError``, and the master's server releases that client's waits.
                ``None`` reads ``$AIODIST_PEER_TIMEOUT``, else 8 s. A busy or stopped
                process is not affected (its kernel keeps answering).
            master_listen_fd: for the master, a TCP socket the caller bound (to ``port``,
                unless 0), which the server listens on and takes over, as in torch.

        Raises:
            DistUsageError: bad arguments (world_size 0, unknown wire, bad limits), or the
                master's open-file limit is too low for ``world_size`` clients.
            DistNetworkError: the port is in use (master), or the server cannot be reached
                within the timeout (the message names host:port and the time).
            DistStoreTimeoutError: the master's workers did not all join in time (as torch:
                "Timed out after N seconds waiting for clients. k/n clients joined.").
            DistStoreError: authentication was refused.
            DistProtocolError: the server speaks another protocol version.
        """
        if wire not in ("auto", "aiodist", "torch"):
            raise DistUsageError(f"wire must be 'auto', 'aiodist' or 'torch', got {wire!r}")
        _check_world_size(world_size)
        seconds = to_seconds(timeout, DEFAULT_STORE_TIMEOUT)
        token = resolve_token(auth_token)
        peer = resolve_peer_timeout(peer_timeout)
        server = None
        connect_host = host_name
        if is_master:
            server = TCPStoreServer(
                auth_token=token,
                allow_unauthenticated_torch=allow_unauthenticated_torch,
                max_key_size=max_key_size,
                max_value_size=max_value_size,
                peer_timeout=peer,
                expected_clients=world_size,
            )
            port, connect_host = await _serve(server, host_name, port, master_listen_fd)
        channel: Channel | None = None
        try:
            channel = await speaking(
                _open_channel(
                    connect_host, port, wire, token, seconds, max_key_size, max_value_size, peer
                ),
                None,
                f"TCPStore: connecting to the store at {connect_host}:{port} (is its host "
                "up, and are the address and port right? MASTER_ADDR and MASTER_PORT for "
                "env://)",
            )
            store = cls(channel, host_name, port, seconds, server=server, token=token)
            if world_size is not None:
                waiter = server if wait_for_workers else None
                await _join(channel, waiter, world_size, seconds, f"{host_name}:{port}")
        except BaseException:
            if channel is not None:
                channel.close()
            if server is not None:
                await server.aclose()
            raise
        return store

    # -- helpers -------------------------------------------------------------------------
    def _key(self, key: str) -> bytes:
        raw = b"/" + (key.encode() if type(key) is str else encode_key(key))
        if len(raw) > self._channel.max_key_size:
            raise DistUsageError(
                f"key of {len(raw)} bytes exceeds the store's max_key_size of "
                f"{self._channel.max_key_size} bytes"
            )
        return raw

    def _value(self, value: Value) -> bytes:
        data = encode_value(value)
        if len(data) > self._channel.max_value_size:
            raise DistUsageError(
                f"value of {len(data)} bytes exceeds the store's max_value_size of "
                f"{self._channel.max_value_size} bytes"
            )
        return data

    def _check_open(self) -> None:
        if self._closed:
            raise DistUsageError(f"{self!r} is closed")

    @staticmethod
    def _timed_out(keys: list[bytes], exc: TimedOut) -> DistTimeoutError:
        return timeout_error(
            [k[1:] for k in keys], [k[1:] if k[:1] == b"/" else k for k in exc.missing], exc.waited
        )

    # -- the Store interface ---------------------------------------------------------------
    async def set(self, key: str, value: Value) -> None:
        """Store ``value`` under ``key`` and wake its waiters.

        Raises:
            DistUsageError: the key or value is too large, or the store is closed.
            DistNetworkError: the server went away.
        """
        self._check_open()
        await self._channel.set(self._key(key), self._value(value))

    async def get(self, key: str) -> bytes:
        """Return the value of ``key``, waiting up to the store timeout for it.

        Raises:
            DistTimeoutError: the key did not appear in time (the message names it).
            DistNetworkError: the server went away.
        """
        self._check_open()
        raw = self._key(key)
        try:
            return await self._channel.get(raw, self.timeout)
        except TimedOut as exc:
            raise self._timed_out([raw], exc) from None

    async def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the ASCII counter ``key`` (missing: 0) and return the result.

        Raises:
            DistStoreError: the key holds something that is not an integer (unchanged).
            DistUsageError: ``amount`` is not a 64-bit integer.
            DistNetworkError: the server went away.
        """
        if self._closed:
            self._check_open()
        if type(amount) is not int:
            if isinstance(amount, bool) or not isinstance(amount, int):
                raise DistUsageError(f"add amount must be an int, got {type(amount).__name__}")
            amount = int(amount)
        if not I64_MIN <= amount <= I64_MAX:
            raise DistUsageError(f"add amount {amount} does not fit in 64 bits")
        return await self._channel.add(self._key(key), amount)

    async def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        """torch's compare-and-set; see :meth:`Store.compare_set`.

        Raises:
            DistUsageError: a value is too large.
            DistNetworkError: the server went away.
        """
        self._check_open()
        return await self._channel.compare_set(
            self._key(key), self._value(expected), self._value(desired)
        )

    async def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        """Wait until every key exists (``timeout`` defaults to the store timeout).

        Raises:
            DistTimeoutError: naming the keys still missing and the time waited.
            DistNetworkError: the server went away.
        """
        self._check_open()
        seconds = to_seconds(timeout, self.timeout)
        raw = [self._key(k) for k in keys]
        if not raw:
            return
        try:
            await self._channel.wait(raw, seconds)
        except TimedOut as exc:
            raise self._timed_out(raw, exc) from None

    async def check(self, keys: Sequence[str]) -> bool:
        """Return whether every key exists, without waiting.

        Raises:
            DistNetworkError: the server went away.
        """
        self._check_open()
        raw = [self._key(k) for k in keys]
        return True if not raw else await self._channel.check(raw)

    async def delete_key(self, key: str) -> bool:
        """Delete ``key``; return whether it existed.

        Raises:
            DistNetworkError: the server went away.
        """
        self._check_open()
        return await self._channel.delete(self._key(key))

    async def delete_prefix(self, prefix: str) -> int:
        """Delete every key that starts with ``prefix``; return how many it deleted (one
        request on the aiodist wire; on torch's, the keys and then a deletion of each).

        Raises:
            DistNetworkError: the server went away.
        """
        self._check_open()
        return await self._channel.delete_prefix(self._key(prefix))

    async def num_keys(self) -> int:
        """Return the number of keys on the server (torch's ``init/`` counter included).

        Raises:
            DistNetworkError: the server went away.
        """
        self._check_open()
        return await self._channel.num_keys()

    async def list_keys(self) -> list[str]:
        """Return the user keys (those set through a TCPStore client), as torch does.

        Raises:
            DistNetworkError: the server went away.
        """
        self._check_open()
        raw = await self._channel.list_keys()
        return [k[1:].decode(errors="surrogateescape") for k in raw if k[:1] == b"/"]

    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Return the values of ``keys``, waiting for all of them like :meth:`get`.

        Raises:
            DistTimeoutError: a key did not appear in time.
            DistNetworkError: the server went away.
        """
        self._check_open()
        raw = [self._key(k) for k in keys]
        if not raw:
            return []
        try:
            return await self._channel.multi_get(raw, self.timeout)
        except TimedOut as exc:
            raise self._timed_out(raw, exc) from None

    async def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        """Set every key to its value in one request.

        Raises:
            DistUsageError: the sequences differ in length, or an entry is too large.
            DistNetworkError: the server went away.
        """
        self._check_open()
        check_lengths(keys, values)
        items = [(self._key(k), self._value(v)) for k, v in zip(keys, values, strict=True)]
        if items:
            await self._channel.multi_set(items)

    async def append(self, key: str, value: Value) -> None:
        """Append ``value`` to ``key``, creating it if missing.

        Raises:
            DistUsageError: the value (or, on aiodist's wire, the result) is too large.
            DistNetworkError: the server went away.
        """
        self._check_open()
        await self._channel.append(self._key(key), self._value(value))

    async def lease(self, key: str, value: Value | None, *, append: bool = False) -> bool:
        """Have the server set ``key`` to ``value`` (or, with ``append``, append it) when
        this client's connection ends.

        See :meth:`Store.lease`. On torch's wire (a torch server) there are no leases.

        Raises:
            DistNetworkError: the server went away.
        """
        self._check_open()
        return await self._channel.lease(
            self._key(key), b"" if value is None else self._value(value), append
        )

    async def queue_push(self, key: str, value: Value) -> None:
        """Push ``value`` onto the FIFO queue ``key``.

        Raises:
            DistUsageError: the value is too large.
            DistNetworkError: the server went away.
        """
        self._check_open()
        await self._channel.queue_push(self._key(key), self._value(value))

    async def queue_push_front(self, key: str, value: Value) -> None:
        """Put ``value`` at the head of queue ``key`` (see :meth:`Store.queue_push_front`);
        on torch's wire, which cannot, at its end.

        Raises:
            DistUsageError: the value is too large.
            DistNetworkError: the server went away.
        """
        self._check_open()
        await self._channel.queue_push_front(self._key(key), self._value(value))

    async def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Pop the oldest value of queue ``key``.

        Cancelled (or given up by the client's deadline), it never loses its value: one the
        server popped for it goes back at the head of the queue (on torch's wire, at the
        end), before any later request of this client is served.

        Raises:
            QueueEmptyError: ``block`` is false and the queue is empty.
            DistTimeoutError: ``block`` is true and nothing arrived within the store timeout.
            DistNetworkError: the server went away.
        """
        self._check_open()
        raw = self._key(key)
        try:
            return await self._channel.queue_pop(raw, block, self.timeout)
        except TimedOut as exc:
            raise self._timed_out([raw], exc) from None

    async def queue_len(self, key: str) -> int:
        """Return the number of values in queue ``key``.

        Raises:
            DistNetworkError: the server went away.
        """
        self._check_open()
        return await self._channel.queue_len(self._key(key))

    async def barrier(self, key: str, world_size: int, timeout: Timeout = None) -> None:
        """Count in at ``key`` and wait until ``world_size`` callers have (torch's barrier).

        One request: the server counts and answers every caller when the last one arrives.
        The counter is the one :meth:`add` uses on ``key``, shared with torch clients'
        ``barrier``.

        Raises:
            DistUsageError: ``world_size`` is not a positive int, or the store is closed.
            DistStoreError: ``key`` holds something that is not an integer.
            DistTimeoutError: fewer than ``world_size`` arrived in time (the message names
                the key and the count reached); this caller stays counted in.
            DistNetworkError: the server went away.
        """
        self._check_open()
        world = check_world_size(world_size)
        seconds = to_seconds(timeout, self.timeout)
        raw = self._key(key)
        try:
            await self._channel.barrier(raw, world, seconds)
        except TimedOut as exc:
            raise barrier_timeout_error(raw[1:], exc.count, world, exc.waited) from None

    async def clone(self) -> TCPStore:
        """Open a new connection to the same server, with this store's settings.

        Raises:
            DistNetworkError: the server cannot be reached.
        """
        self._check_open()
        channel = self._channel
        host = self.host
        if self.server is not None and self.server.host in ("0.0.0.0", "::"):
            host = "127.0.0.1" if self.server.host == "0.0.0.0" else "::1"
        new = await _open_channel(
            host,
            self.port,
            channel.wire,
            self._token,
            self.timeout,
            channel.max_key_size,
            channel.max_value_size,
            channel.peer_timeout,
        )
        return TCPStore(new, self.host, self.port, self.timeout, token=self._token)

    async def aclose(self) -> None:
        """Close the connection; the master also stops its server. Closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        self._channel.close()
        if self.server is not None:
            await self.server.aclose()
