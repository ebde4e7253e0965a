"""Waking a rank that sleeps on shared memory, and noticing a peer process that is gone.

Every rank owns a *doorbell*: a FIFO in ``/dev/shm`` that it opens for reading and writing
and hands to its event loop (``loop.add_reader``). A peer that made progress the rank is
waiting for (wrote a message, freed ring space, arrived at a barrier) writes one byte into
it, but only when the rank has said, through a *sleeping flag* in shared memory, that it
is not polling. A FIFO works between any processes that share ``/dev/shm``, including
processes started independently and in different network namespaces (an abstract unix
socket for passing an eventfd would not). When to poll instead of sleeping is
:mod:`aiodist._util._wait`'s policy, the same for every layer.

Memory ordering. Shared words are written by exactly one process each; x86-64 is TSO:

* **Publishing data.** A writer copies the payload, then stores the index that covers it
  (a ring's head, a barrier counter); a reader loads the index, then the payload. TSO keeps
  stores in program order and loads in program order, and each access from Python is a
  separate C call (the compiler cannot move memory accesses across an opaque call), so a
  reader that sees the new index sees the data. Indices are aligned 8-byte words accessed
  through a ``memoryview`` of format ``"Q"`` (one 8-byte ``memcpy``, a single ``mov``), so
  none is ever seen half-written.
* **Going to sleep.** The sleeper stores ``sleeping = 1``, then loads the index to see
  whether there is anything to do; the writer stores the index, then loads ``sleeping`` to
  see whether to ring. TSO lets a load pass an earlier store to another address (the store
  buffer), so both loads could see the old values: the sleeper sleeps on data it missed,
  the writer does not ring. A full barrier between the store and the load on *both* sides
  rules that out (one of them must see the other's store). Python has no fence
  instruction, but acquiring an uncontended :class:`threading.Lock` is an atomic
  compare-and-swap (``sem_trywait`` in CPython 3.11's locks, ``PyMutex`` from 3.13), which on
  x86 is a ``LOCK``-prefixed instruction and a full barrier: :func:`fence` does that
  (about 80 ns).
* **Safety net.** If that argument failed somewhere (or a doorbell byte were lost), a
  sleeping rank with work pending re-checks shared memory on a timer (1 ms, doubling to
  50 ms): a lost wake-up costs latency, never a hang.

On weaker memory orders (ARM, POWER) the first point does not hold either: publication
would need release/acquire barriers Python cannot issue. :func:`~._shm_segment.
unavailable_reason` refuses those machines, and callers use TCP.

A peer process that is gone is noticed through a pidfd (``os.pidfd_open``), which the
loop watches: it becomes readable the moment the process exits, whether it closed in
order, crashed or was killed. Its start time is checked too, so a recycled pid is never
mistaken for the peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Callable

from ._shm_segment import ProcessId, is_alive, make_fifo, open_checked

__all__ = ["Bell", "Doorbell", "PeerWatch", "fence"]

logger = logging.getLogger(__name__)


_FENCE_LOCK = threading.Lock()
_acquire = _FENCE_LOCK.acquire
_release = _FENCE_LOCK.release


def fence() -> None:
    """A full memory barrier: no load after it is performed before a store ahead of it."""
    _acquire()
    _release()


class Doorbell:
    """This rank's wake-up FIFO, read by the event loop.

    Args:
        path: where to create the FIFO (unlinked once every peer has opened it).

    Raises:
        SharedMemoryError: the FIFO cannot be created.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = make_fifo(path)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._linked = True

    def __repr__(self) -> str:
        return f"<Doorbell fd={self.fd} {os.path.basename(self.path)}>"

    def listen(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
        """Call ``callback()`` from ``loop`` whenever a byte arrives (drain it there)."""
        self._loop = loop
        loop.add_reader(self.fd, callback)

    def drain(self) -> None:
        """Read every byte the peers wrote."""
        with contextlib.suppress(BlockingIOError):
            while len(os.read(self.fd, 4096)) == 4096:
                pass

    def unlink(self) -> None:
        """Remove the FIFO's name; open descriptors keep working."""
        if self._linked:
            self._linked = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def close(self) -> None:
        """Stop listening, unlink and close. Closing twice is harmless."""
        self.unlink()
        if self.fd < 0:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.fd)
        os.close(self.fd)
        self.fd = -1


class Bell:
    """A peer's doorbell, opened for writing.

    Args:
        path: the FIFO (a peer's: see :func:`~._shm_segment.peer_path`), or the
            ``/proc/<pid>/fd/<fd>`` of a process that holds it open (see
            :func:`~._shm_segment.peer_fd_path`); checked to be a FIFO of this user in
            ``/dev/shm`` (see :func:`~._shm_segment.open_checked`).

    Raises:
        OSError: the FIFO does not exist or nobody has it open for reading.
        SharedMemoryError: the file is not such a FIFO (a symlink is not).
    """

    def __init__(self, path: str) -> None:
        self.fd = open_checked(path, os.O_WRONLY | os.O_NONBLOCK, fifo=True)

    def ring(self) -> bool:
        """Wake the peer; return ``False`` if its doorbell is gone (the peer closed it)."""
        try:
            os.write(self.fd, b"\x01")
        except BlockingIOError:  # the FIFO is full of bytes the peer has not read: awake
            pass
        except (BrokenPipeError, OSError):
            return False
        return True

    def close(self) -> None:
        """Close the descriptor. Closing twice is harmless."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class PeerWatch:
    """Calls ``on_exit()`` from the loop once the peer process ``proc`` has exited.

    A peer in this very process (ranks as tasks of one loop) is not watched: it goes away
    only by closing or aborting, which it announces in shared memory.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, proc: ProcessId, on_exit: Callable[[], None]
    ) -> None:
        self.proc = proc
        self._loop = loop
        self._fd = -1
        self._on_exit = on_exit
        if proc.pid == os.getpid():
            return
        try:
            fd = os.pidfd_open(proc.pid)
        except ProcessLookupError:
            loop.call_soon(on_exit)
            return
        if not is_alive(proc):  # gone, its pid perhaps recycled before we watched it
            os.close(fd)
            loop.call_soon(on_exit)
            return
        self._fd = fd
        loop.add_reader(fd, self._exited)

    def __repr__(self) -> str:
        return f"<PeerWatch pid={self.proc.pid} fd={self._fd}>"

    def _exited(self) -> None:
        self.close()
        self._on_exit()

    def close(self) -> None:
        """Stop watching. Closing twice is harmless."""
        if self._fd >= 0:
            if not self._loop.is_closed():
                self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1
