"""aiodist: asyncio-native distributed process groups for numpy and cupy arrays.

The async API lives here (``import aiodist``); the blocking, ``torch.distributed``-shaped
API lives in :mod:`aiodist.sync`.
"""

import logging

from .errors import (
    DistError,
    DistNetworkError,
    DistProtocolError,
    DistStoreError,
    DistTimeoutError,
    DistUsageError,
    QueueEmptyError,
)
from .store import FileStore, HashStore, PrefixStore, Store

logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = "0.1.0"

__all__ = [
    "DistError",
    "DistNetworkError",
    "DistProtocolError",
    "DistStoreError",
    "DistTimeoutError",
    "DistUsageError",
    "FileStore",
    "HashStore",
    "PrefixStore",
    "QueueEmptyError",
    "Store",
    "__version__",
]
