"""Byte movement between ranks: the Transport interface and its implementations."""

from .base import OpComm, Tag, Transport
from .local import LocalTransport

__all__ = ["LocalTransport", "OpComm", "Tag", "Transport"]
