"""Key/value stores: the bootstrap layer every process group stands on."""

from ._base import Store, Value
from .hash import HashStore

__all__ = ["HashStore", "Store", "Value"]
