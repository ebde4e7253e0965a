"""Arrays in shared memory, which a group's ranks on the same host read in place.

``empty(shape, dtype, ws)`` and ``zeros(shape, dtype, ws)`` return an ordinary numpy array
whose memory the peers of any :class:`~aiodist.collectives.shm.NodeWorkspace` on this
host can map. A collective of a workspace on such an array skips the copy into the
workspace (peers read it where it is) and, for ``all_reduce`` when every rank's array is
shared, the copy out as well (each rank writes its reduced slice straight into every
rank's array). Any workspace: the one it was made for, a subgroup's, or the workspace of
the world that replaced it (``shrink_group``, ``admit``), so an array outlives the group
it was made for and stays a shared array for the next.

Lifetime rules:

* **Allocation is local.** Each call creates an unnamed file in ``/dev/shm``
  (``O_TMPFILE``: it never has a name, so nothing can be left behind, whatever happens to
  the process), reserves every byte with ``posix_fallocate`` (a full ``/dev/shm`` is a
  :class:`~aiodist.transport._shm_segment.SharedMemoryError` naming the size, never a
  ``SIGBUS`` later) and maps it. No message is exchanged: ranks allocate independently,
  in any order, any number of arrays.
* **Peers map it lazily.** The first collective of a workspace that reads the array
  publishes ``(allocation id, descriptor, offset)`` (the ids are unique in the process);
  each peer opens ``/proc/<pid>/fd/<descriptor>`` (the allocating rank holds the array, so
  the descriptor is valid) and caches the mapping for later calls.
* **Freed when the last view goes.** The memory stays valid on this rank as long as any
  view of the array exists (slices and reshapes included). When the last one is dropped,
  the descriptor is closed, this rank's mapping removed, and the allocation id recorded
  in the freed list, in shared memory, of every workspace that published it; every peer
  drops its cached mapping at its next collective on that workspace (or when it closes
  the workspace). The kernel returns the memory once the last mapping, on any rank, is
  gone.
* **One rank dropping its array affects nobody else.** Every rank's array is a separate
  allocation, and a peer needs it only while a collective runs, during which the caller
  holds it. A rank may use a shared array in one call and a private one in the next.
* **Do not modify it while a collective that uses it runs** (true of every array), and
  remember that peers *write* into it during ``all_reduce`` (their slices of the result).
* **It outlives the workspace**: after ``ws.aclose()`` the array stays valid here, and
  other workspaces read it in place as before; smaller than ``DIRECT_MIN_BYTES``, it is
  copied like any array.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import itertools
import logging
import math
import mmap
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from .._arrays._intake import check_dtype
from ..errors import DistUsageError
from ..transport._shm_segment import SHM_DIR, SharedMemoryError, reserve

__all__ = ["Location", "Owner", "check", "empty", "locate", "zeros"]

logger = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE


class Owner(Protocol):
    """What this module needs of the workspace whose collectives read an array in place
    (a :class:`~aiodist.collectives.shm.NodeWorkspace`, which imports this module)."""

    @property
    def closed(self) -> bool:
        """Whether the workspace is closed: it takes no new arrays."""

    def note_freed(self, alloc_id: int) -> None:
        """Record that this rank's array ``alloc_id`` is gone, so peers unmap it."""


class Location(NamedTuple):
    """Where a shared array lives, as a peer needs to know to map it."""

    alloc_id: int
    fd: int
    size: int
    offset: int


class _Allocation:
    __slots__ = ("addr", "fd", "id", "published", "size")

    def __init__(self, alloc_id: int, fd: int, size: int, addr: int) -> None:
        self.id = alloc_id
        self.fd = fd
        self.size = size
        self.addr = addr
        # The workspaces whose peers may have mapped it (told when it is freed).
        self.published: weakref.WeakSet[Owner] = weakref.WeakSet()


# Live allocations of this process, by start address (sorted), for locate().
_lock = threading.Lock()
_holder: int | None = None  # the thread that holds _lock
_starts: list[int] = []
_by_start: dict[int, _Allocation] = {}
_ids = itertools.count(1)
# Allocations freed while their thread held _lock (see _free), left out of the index by
# the next holder before it looks anything up.
_freed: collections.deque[_Allocation] = collections.deque()


@contextlib.contextmanager
def _index() -> Iterator[None]:
    """Hold the index of live allocations, brought up to date."""
    global _holder
    with _lock:
        _holder = threading.get_ident()
        try:
            while _freed:
                _unindex(_freed.popleft())
            yield
        finally:
            _holder = None


def _unindex(alloc: _Allocation) -> None:
    _by_start.pop(alloc.addr, None)
    i = bisect.bisect_left(_starts, alloc.addr)
    if i < len(_starts) and _starts[i] == alloc.addr:
        del _starts[i]


def check(shape: object, dtype: npt.DTypeLike) -> tuple[tuple[int, ...], np.dtype[Any]]:
    """Return ``shape`` as a tuple and ``dtype`` as a numpy dtype, checked.

    Raises:
        DistUsageError: a shape that is not an int or a tuple of non-negative ints, or a
            dtype collectives do not accept.
    """
    dims = (shape,) if isinstance(shape, int) else shape
    try:
        out = tuple(int(d) for d in dims)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        raise DistUsageError(f"shape must be an int or a tuple of ints, got {shape!r}") from None
    if any(d < 0 for d in out) or any(isinstance(d, bool) for d in dims):  # type: ignore[attr-defined]
        raise DistUsageError(f"shape must hold non-negative ints, got {shape!r}")
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise DistUsageError(f"dtype must be a numpy dtype, got {dtype!r}: {exc}") from None
    check_dtype(dt, "the array")
    return out, dt


def empty(shape: int | tuple[int, ...], dtype: npt.DTypeLike, ws: Owner) -> npt.NDArray[Any]:
    """Return an uninitialised array in shared memory for collectives of ``ws``.

    Not collective: see the module docstring for who maps it and when it is freed.

    Args:
        shape: the array's shape.
        dtype: a dtype collectives accept.
        ws: a workspace of the caller's group (its collectives, and those of any other
            workspace on this host, read it in place).

    Returns:
        A C-contiguous, writable numpy array.

    Raises:
        DistUsageError: a bad shape or dtype, or ``ws`` is closed.
        SharedMemoryError: ``/dev/shm`` cannot hold it (the message names the size) or
            shared memory is unavailable.
    """
    dims, dt = check(shape, dtype)
    if ws.closed:
        raise DistUsageError(f"cannot allocate a shared array for {ws!r}: it is closed")
    nbytes = math.prod(dims) * dt.itemsize
    size = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
    try:
        fd = os.open(SHM_DIR, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise SharedMemoryError(f"cannot create a shared array in {SHM_DIR}: {exc}") from exc
    try:
        reserve(fd, size, f"a shared array of {nbytes} bytes")
        mm = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise
    base = np.frombuffer(mm, dtype=np.uint8)
    alloc = _Allocation(next(_ids), fd, size, base.ctypes.data)
    with _index():
        bisect.insort(_starts, alloc.addr)
        _by_start[alloc.addr] = alloc
    weakref.finalize(base, _free, alloc)
    return base[:nbytes].view(dt).reshape(dims)


def zeros(shape: int | tuple[int, ...], dtype: npt.DTypeLike, ws: Owner) -> npt.NDArray[Any]:
    """Like :func:`empty`, filled with zeros (fresh shared memory already reads as zero).

    Raises:
        DistUsageError: a bad shape or dtype, or ``ws`` is closed.
        SharedMemoryError: ``/dev/shm`` cannot hold it, or shared memory is unavailable.
    """
    return empty(shape, dtype, ws)


def _free(alloc: _Allocation) -> None:
    # Runs when the last view of the array is gone: on any thread, at exit, or inside the
    # garbage collector while this very thread holds the index (an allocation under it
    # can collect an array). Then it must not wait for the index (it would wait for
    # itself): it hands its part on to the next holder (a deque's append runs no Python
    # code), and what it interrupted does not look up a freed range.
    if _holder == threading.get_ident():
        _freed.append(alloc)
    else:
        with _index():
            _unindex(alloc)
    published = list(alloc.published)
    os.close(alloc.fd)
    for ws in published:
        ws.note_freed(alloc.id)


def locate(a: npt.NDArray[Any], ws: Owner) -> Location | None:
    """Return where ``a`` lives if it is (a view into) a shared array, else ``None``;
    ``ws``, whose peers are about to read it, is told when it is freed."""
    addr: int = a.__array_interface__["data"][0]
    with _index():
        i = bisect.bisect_right(_starts, addr) - 1
        if i < 0:
            return None
        alloc = _by_start[_starts[i]]
        if addr + a.nbytes > alloc.addr + alloc.size:
            return None
        alloc.published.add(ws)
    return Location(alloc.id, alloc.fd, alloc.size, addr - alloc.addr)
