"""Reading a local peer's memory directly (Linux's ``process_vm_readv``), for the single-copy
path of large messages between ranks of one host.

A message too large for the receiver's credit is announced (see
:mod:`aiodist.transport._flow`); over shared memory its sender also offers the address of its
payload, and the receiver, whose receive is posted, copies the payload from the sender's
memory into the receive's in one copy, where the ring would take two (into the ring, out of
it). It needs the kernel's leave to read the peer (same user, and Yama's ``ptrace_scope`` 0,
or 1 for a parent reading its child): without it, :func:`read_memory` raises
``PermissionError`` and the link goes back to the ring for good.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import sys
from collections.abc import Callable
from typing import Any

from .._util._environment import turned_off

__all__ = ["AVAILABLE", "PULL_ENV", "read_memory", "pulling_turned_on"]

#: The environment variable that turns the single-copy path off (``0``).
PULL_ENV = "AIODIST_SHM_PULL"


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _bind() -> Callable[..., Any] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    readv: Callable[..., Any] = fn
    return readv


_readv = _bind()
#: Whether this platform can read another process's memory at all.
AVAILABLE = _readv is not None


def pulling_turned_on() -> bool:
    """Whether links may read their peers' memory: the platform can, and ``$AIODIST_SHM_PULL``
    does not turn it off."""
    return AVAILABLE and not turned_off(PULL_ENV)


def read_memory(pid: int, address: int, dest: int, nbytes: int) -> None:
    """Copy ``nbytes`` from ``address`` in process ``pid`` to ``dest`` in this process.

    Raises:
        PermissionError: the kernel does not let this process read ``pid``'s memory.
        OSError: the process is gone (``ESRCH``), or the range is not mapped there
            (``EFAULT``), or any other failure of the system call.
    """
    assert _readv is not None
    done = 0
    while done < nbytes:
        local = _IoVec(dest + done, nbytes - done)
        remote = _IoVec(address + done, nbytes - done)
        got = _readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            code = ctypes.get_errno() if got < 0 else errno.EFAULT
            raise OSError(code, f"reading rank memory of pid {pid}: {os.strerror(code)}")
        done += got
