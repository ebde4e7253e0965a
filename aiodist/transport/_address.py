"""Which local address a rank listens on and publishes for its peers.

In order: ``AIODIST_HOST`` (an address, or ``""``/``0.0.0.0``/``::`` for every interface);
``AIODIST_SOCKET_IFNAME`` or torch's ``GLOO_SOCKET_IFNAME`` (an interface name, whose address
is used); the local end of the rank's connection to the store (the interface that reaches the
store is the one the other hosts reach this one through: a plain ``tcp://10.0.0.1:29500``
then works across hosts with no variable set); without a store connection (an in-process or
file store), loopback unless ``MASTER_ADDR`` names another host (then every interface).
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct

from ..errors import DistUsageError

__all__ = ["interface_address", "listen_host"]

logger = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915
_IFNAME_VARS = ("AIODIST_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


def interface_address(name: str, variable: str) -> str:
    """Return the address of network interface ``name`` (IPv4 first, else global IPv6).

    Raises:
        DistUsageError: no interface of that name, or it has no address; the message names
            ``variable`` and the interfaces that exist.
    """
    names = [n for _, n in socket.if_nameindex()]
    if name not in names:
        raise DistUsageError(
            f"{variable}={name!r}: no such network interface; this host has {', '.join(names)}"
        )
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            return socket.inet_ntoa(packed[20:24])
        except OSError:
            pass  # no IPv4 address: look for an IPv6 one
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                hexaddr, _, _, scope, _, dev = line.split()
                if dev == name and int(scope, 16) == 0:  # global scope
                    return str(ipaddress.IPv6Address(bytes.fromhex(hexaddr)))
    except OSError:
        pass
    raise DistUsageError(f"{variable}={name!r}: the interface has no usable address")


def listen_host(store_address: str | None) -> str:
    """Return the address to listen on and publish (see the module docstring).

    Args:
        store_address: the local end of this rank's store connection, or ``None``.

    Raises:
        DistUsageError: an interface variable names an interface this host lacks.
    """
    host = os.environ.get("AIODIST_HOST")
    if host is not None:
        return host
    for variable in _IFNAME_VARS:
        name = os.environ.get(variable)
        if name:
            # torch's form may list several interfaces; the first one is used.
            return interface_address(name.split(",")[0].strip(), variable)
    if store_address:
        return store_address
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    loopback = master in ("localhost", "::1") or master.startswith("127.")
    return "127.0.0.1" if loopback else ""
