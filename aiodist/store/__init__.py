"""Key/value stores: the bootstrap layer every process group stands on.

May import: :mod:`aiodist._util` and :mod:`aiodist.errors` only.
"""

from ._base import Store, Value
from .etcd import EtcdStore
from .file import FileStore
from .hash import HashStore
from .prefix import PrefixStore
from .tcp import TCPStore, TCPStoreServer

__all__ = [
    "EtcdStore",
    "FileStore",
    "HashStore",
    "PrefixStore",
    "Store",
    "TCPStore",
    "TCPStoreServer",
    "Value",
]
