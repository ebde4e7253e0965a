"""Byte movement between ranks: the Transport interface and its implementations.

May import: the stores (the peer directory), :mod:`aiodist._arrays`, :mod:`aiodist._util`
and :mod:`aiodist.errors`.
"""

from .base import OpComm, Tag, Transport
from .local import LocalTransport
from .tcp import TCPTransport

__all__ = ["LocalTransport", "OpComm", "TCPTransport", "Tag", "Transport"]
