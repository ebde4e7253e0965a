"""Byte movement between ranks: the Transport interface and its implementations."""

from .base import OpComm, Tag, Transport
from .local import LocalTransport
from .tcp import TCPTransport

__all__ = ["LocalTransport", "OpComm", "TCPTransport", "Tag", "Transport"]
