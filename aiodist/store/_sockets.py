"""Socket settings shared by the store's server and client: liveness, latency, open files;
and who is at the other end of a connection from this machine.

A store connection must notice a peer whose host vanished (power loss, a cut link: no FIN, no
RST) within a bounded time, yet never drop a peer that is merely busy or stopped (its kernel
keeps acknowledging). TCP does both when asked: keepalive probes find an idle connection's
silent peer, ``TCP_USER_TIMEOUT`` bounds how long sent data (and probes) may go unacknowledged,
and neither needs anything from the peer's process.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import resource
import socket
import struct

from .._util._timeouts import DEFAULT_PEER_TIMEOUT
from ..errors import DistUsageError

__all__ = [
    "PEER_TIMEOUT_ENV",
    "configure_socket",
    "configure_stream",
    "ensure_open_files",
    "local_peer_uid",
    "plain_host",
    "resolve_peer_timeout",
]

logger = logging.getLogger(__name__)

#: The environment variable that sets the peer timeout, in seconds (default
#: ``DEFAULT_PEER_TIMEOUT``: with the moment it takes to tell every rank, a vanished host is
#: known within 10 s).
PEER_TIMEOUT_ENV = "AIODIST_PEER_TIMEOUT"
#: The smallest peer timeout: keepalive timers count whole seconds.
_MIN_PEER_TIMEOUT = 1.0


def resolve_peer_timeout(value: float | None = None) -> float:
    """Return the peer timeout in seconds: ``value``, else ``$AIODIST_PEER_TIMEOUT``, else 8.

    Raises:
        DistUsageError: the value (or the variable) is not a finite number of at least 1 s.
    """
    source = "peer_timeout"
    if value is None:
        raw = os.environ.get(PEER_TIMEOUT_ENV)
        if raw is None or not raw.strip():
            return DEFAULT_PEER_TIMEOUT
        source = f"${PEER_TIMEOUT_ENV}"
        try:
            value = float(raw)
        except ValueError:
            raise DistUsageError(f"{source}={raw!r} is not a number of seconds") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DistUsageError(f"{source} must be a number of seconds, got {type(value).__name__}")
    if not math.isfinite(value) or value < _MIN_PEER_TIMEOUT:
        raise DistUsageError(
            f"{source} must be a finite number of seconds >= {_MIN_PEER_TIMEOUT:g}, got {value!r}"
        )
    return float(value)


def configure_stream(transport: asyncio.BaseTransport, peer_timeout: float) -> None:
    """Set a store connection's socket options (see :func:`configure_socket`)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        configure_socket(sock, peer_timeout)


def configure_socket(sock: socket.socket, peer_timeout: float) -> None:
    """Set a store socket's options: no Nagle delay, and a bounded peer silence.

    Keepalive probes start after 2 s of silence and repeat every second; ``TCP_USER_TIMEOUT``
    drops the connection once sent data or probes have gone unacknowledged for
    ``peer_timeout`` seconds, so a vanished host is noticed about ``peer_timeout`` after it
    went silent. A stopped or busy process is unaffected: its kernel answers the probes.
    On a listening socket the options carry over to every connection it accepts (Linux
    copies them into the new socket and starts its keepalive timer), which spares a server
    six system calls per client.
    """
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    idle = 2 if peer_timeout >= 3 else 1
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
            # Without TCP_USER_TIMEOUT (not Linux) the probe count is what bounds the wait.
            probes = max(1, math.ceil(peer_timeout - idle))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, min(probes, 127))
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(peer_timeout * 1000))
    except OSError as exc:
        logger.debug("could not set the store connection's socket options: %s", exc)


def _open_files() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 64


def ensure_open_files(more: int, what: str) -> None:
    """Make room for ``more`` descriptors beyond those open now, raising the soft limit.

    The soft ``RLIMIT_NOFILE`` is raised towards the hard one when it is too low (many
    systems start processes at a soft limit of 1024).

    Raises:
        DistUsageError: even the hard limit is too low; the message names the limit and what
            needs the descriptors.
    """
    needed = _open_files() + more
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or needed <= soft:
        return
    if hard != resource.RLIM_INFINITY and needed > hard:
        raise DistUsageError(
            f"{what} needs about {needed} open files, but this process may open at most "
            f"{hard} (the hard RLIMIT_NOFILE limit): raise it (ulimit -Hn; LimitNOFILE= "
            "for a systemd unit; nofile in /etc/security/limits.conf) or use fewer clients"
        )
    target = hard if hard != resource.RLIM_INFINITY else needed
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as exc:
        raise DistUsageError(
            f"{what} needs about {needed} open files, but the soft RLIMIT_NOFILE limit is "
            f"{soft} and raising it to {target} failed: {exc}"
        ) from exc
    logger.debug("raised the open-file limit from %d to %d for %s", soft, target, what)


def plain_host(address: object) -> str:
    """The host of a socket address, an IPv4-mapped IPv6 one written as IPv4 (a dual-stack
    server sees IPv4 clients that way); ``""`` for anything else (a Unix socket)."""
    if not isinstance(address, tuple) or not address:
        return ""
    host = str(address[0])
    return host[7:] if host.startswith("::ffff:") and "." in host else host


def _proc_net_key(host: str, port: int) -> tuple[str, str] | None:
    """How ``/proc/net/tcp`` (or ``tcp6``) writes ``host:port``: the file, and the address
    as the kernel prints it (32-bit words of the address in host byte order, then the port)."""
    try:
        packed = socket.inet_pton(socket.AF_INET, host)
        table = "tcp"
    except OSError:
        try:
            packed = socket.inet_pton(socket.AF_INET6, host.partition("%")[0])
        except OSError:
            return None
        table = "tcp6"
    words = struct.unpack(f"={len(packed) // 4}I", packed)
    return table, "".join(f"{w:08X}" for w in words) + f":{port:04X}"


def local_peer_uid(server: object, client: object) -> int | None:
    """The user owning the client end of a TCP connection, when that end is on this machine.

    ``server`` and ``client`` are the connection's socket addresses as the server sees
    them. The client's socket is looked up in ``/proc/net/tcp`` and ``tcp6`` (this network
    namespace's sockets, with their owners); ``None`` when it is not there: the client is
    on another host (or its socket just closed).
    """
    if not isinstance(server, tuple) or not isinstance(client, tuple):
        return None
    client_key = _proc_net_key(plain_host(client), int(client[1]))
    server_key = _proc_net_key(plain_host(server), int(server[1]))
    if client_key is None or server_key is None or client_key[0] != server_key[0]:
        return None
    table, local, remote = client_key[0], client_key[1], server_key[1]
    try:
        with open(f"/proc/net/{table}") as f:
            next(f, None)  # the header
            for line in f:
                # sl local_address rem_address st queues timer retransmits uid ...
                fields = line.split()
                if len(fields) > 7 and fields[1] == local and fields[2] == remote:
                    return int(fields[7])
    except OSError:
        pass
    return None
