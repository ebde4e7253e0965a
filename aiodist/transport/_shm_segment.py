"""Shared-memory segments in ``/dev/shm``: naming, reservation, mapping, cleanup, host identity.

Lifecycle of a named segment (the transport's rings, a group's workspace):

1. The creator makes ``/dev/shm/aiodist-<job>-<kind><rank>-<pid>-<start>-<nonce>`` with
   ``O_CREAT | O_EXCL`` (mode 0600) and reserves every byte with ``posix_fallocate``, so a
   full ``/dev/shm`` is a :class:`SharedMemoryError` naming the size at creation, never a
   ``SIGBUS`` on first touch later.
2. It publishes the name through the store; every local peer maps it.
3. Once every peer has said so (a store barrier), the creator unlinks the name. The memory
   lives on until the last mapping goes, and nothing is left in ``/dev/shm`` whatever
   happens to the processes afterwards (exit, ``SIGKILL``).

Peers learn these names (and, for the workspace's doorbells and shared arrays, a pid and a
descriptor to open as ``/proc/<pid>/fd/<fd>``) from the store, which whoever can write it
controls. So a peer's path is never opened as published: :func:`peer_path` rebuilds it in
``/dev/shm`` from a name checked to be exactly one that rank's process could have made, and
every peer file is opened without following a symlink (``O_NOFOLLOW``, where the path
allows) and checked before and once open (:func:`open_checked`): a regular file of the
expected size, or a FIFO for a doorbell, on ``/dev/shm``'s filesystem, owned by this user.

Between 1 and 3 a name exists. If setup fails, the creator unlinks on its way out; if the
creator is killed in that window, the name carries its pid and start time, so
:func:`remove_leftovers` (run by every setup, and by survivors of a failed one) recognises
a file whose creator is gone and removes it. A restart of the job with the same job key
therefore cleans its predecessor's leftovers by name prefix, and never touches a file of
a process that is still alive.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import mmap
import os
import platform
import re
import secrets
import socket
import stat
from typing import NamedTuple

from .._util._environment import turned_off
from ..errors import DistError

__all__ = [
    "SHM_DIR",
    "free_bytes",
    "ProcessId",
    "Segment",
    "SharedMemoryError",
    "host_key",
    "is_alive",
    "job_prefix",
    "make_fifo",
    "open_checked",
    "peer_fd_path",
    "peer_path",
    "remove_leftovers",
    "reserve",
    "segment_path",
    "this_process",
    "unavailable_reason",
]

logger = logging.getLogger(__name__)

#: Where segments live: a tmpfs that every process of the host (or container) sees.
SHM_DIR = "/dev/shm"

#: Architectures whose memory order is total store order, which the signalling protocol
#: relies on (see ``_shm_signal``): stores become visible in program order, loads are not
#: reordered with loads.
_TSO_MACHINES = frozenset({"x86_64", "amd64", "i386", "i486", "i586", "i686", "x86"})


class SharedMemoryError(DistError):
    """Shared memory cannot be used here (disabled, unsupported, or ``/dev/shm`` is full).

    The message says why; callers may fall back to TCP for the ranks concerned.
    """


class ProcessId(NamedTuple):
    """A process, unambiguously: its pid and its start time (clock ticks since boot), so
    that a recycled pid is never mistaken for the process that held it before."""

    pid: int
    start: int


def _start_time(pid: int) -> int | None:
    """The start time of process ``pid`` from ``/proc/<pid>/stat``; ``None`` if it is gone
    (a zombie, killed but not yet reaped by its parent, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Fields 3 (state) and 22 (start time); the command name (field 2) may hold spaces and
    # parentheses, so count from the last ")".
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


_THIS: ProcessId | None = None


def this_process() -> ProcessId:
    """Return this process's :class:`ProcessId` (computed once per process).

    Raises:
        SharedMemoryError: ``/proc`` does not describe this process.
    """
    global _THIS
    pid = os.getpid()
    if _THIS is None or _THIS.pid != pid:  # a forked child has a pid of its own
        start = _start_time(pid)
        if start is None:
            raise SharedMemoryError(f"/proc/{pid}/stat is unreadable: /proc is not mounted")
        _THIS = ProcessId(pid, start)
    return _THIS


def is_alive(proc: ProcessId) -> bool:
    """Return whether ``proc`` still runs (a zombie counts as gone only once reaped)."""
    try:
        return _start_time(proc.pid) == proc.start
    except PermissionError:  # /proc mounted with hidepid: assume the best
        return True


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def host_key() -> str:
    """Return a string equal for exactly the processes that can share memory segments.

    It combines the boot id (``/proc/sys/kernel/random/boot_id``: the same machine, this
    boot), the host name, and the inodes of the network namespace (``/proc/self/ns/net``),
    so ranks in different network namespaces count as different hosts; containers usually
    have a ``/dev/shm`` of their own too. Two more parts make the key exact for this
    transport: the pid namespace (peers watch each other's pids for liveness) and the
    device and inode of ``/dev/shm`` (a segment is only visible inside the same mount).
    """
    parts = [_read("/proc/sys/kernel/random/boot_id"), socket.gethostname()]
    for ns in ("net", "pid"):
        try:
            parts.append(f"{ns}:{os.stat(f'/proc/self/ns/{ns}').st_ino}")
        except OSError:
            parts.append(f"{ns}:?")
    try:
        st = os.stat(SHM_DIR)
        parts.append(f"shm:{st.st_dev}:{st.st_ino}")
    except OSError:
        parts.append("shm:?")
    return "/".join(parts)


_PIDFD_OK: bool | None = None


def _pidfd_works() -> bool:
    global _PIDFD_OK
    if _PIDFD_OK is None:
        try:
            os.close(os.pidfd_open(os.getpid()))
            _PIDFD_OK = True
        except (AttributeError, OSError):
            _PIDFD_OK = False
    return _PIDFD_OK


def free_bytes() -> int:
    """Bytes free in ``/dev/shm`` now (0 when it cannot be read)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def unavailable_reason() -> str | None:
    """Return why shared memory cannot be used in this process, or ``None`` if it can.

    Reasons: ``AIODIST_SHM=0`` in the environment; an architecture whose memory order is
    weaker than x86-64's (the lock-free rings rely on total store order); no writable
    ``/dev/shm``; no ``pidfd_open`` (Linux >= 5.3; peers watch each other's liveness with
    it).
    """
    if turned_off("AIODIST_SHM"):
        return "shared memory is disabled by AIODIST_SHM=0"
    machine = platform.machine().lower()
    if machine not in _TSO_MACHINES:
        return (
            f"shared memory needs total store order (x86-64); this machine is {machine!r}, "
            "whose memory order the lock-free rings cannot rely on from Python"
        )
    if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK | os.X_OK):
        return f"{SHM_DIR} is missing or not writable"
    if not hasattr(os, "posix_fallocate"):
        return "os.posix_fallocate is not available"
    if not _pidfd_works():
        return "pidfd_open is not available (Linux >= 5.3 needed to watch peers' liveness)"
    return None


def job_prefix(job_key: str) -> str:
    """Return the file-name prefix of every segment of the job ``job_key``."""
    digest = hashlib.sha256(job_key.encode()).hexdigest()[:12]
    return f"aiodist-{digest}-"


def segment_path(job_key: str, kind: str, rank: int) -> str:
    """Return a fresh path for a segment (or doorbell) of ``kind`` created by ``rank``.

    The name carries the creator's pid and start time (for :func:`remove_leftovers`) and a
    random part, so two creators never pick the same name.
    """
    me = this_process()
    name = f"{job_prefix(job_key)}{kind}{rank}-{me.pid}-{me.start}-{secrets.token_hex(4)}"
    return os.path.join(SHM_DIR, name)


_NONCE = re.compile(r"[0-9a-f]{8}")


def peer_path(published: object, job_key: str, kind: str, rank: int, proc: ProcessId) -> str:
    """The path of rank ``rank``'s file of ``kind`` (as :func:`segment_path` names it) whose
    path the rank published as ``published``, rebuilt from its checked name.

    Args:
        published: what the peer's record in the store says.
        job_key: the job's key (the file-name prefix of every segment of the job).
        kind: what the file is (``"w"`` a workspace, ``"wb"`` its doorbell, ...).
        rank: the rank that made it.
        proc: that rank's process, as its record says.

    Raises:
        SharedMemoryError: ``published`` is not ``/dev/shm/<name>`` with a name that rank's
            process could have made for ``kind`` in this job.
    """
    text = str(published)
    name = text[len(SHM_DIR) + 1 :]
    prefix = f"{job_prefix(job_key)}{kind}{rank}-{proc.pid}-{proc.start}-"
    if (
        text[: len(SHM_DIR) + 1] != SHM_DIR + "/"
        or not name.startswith(prefix)
        or not _NONCE.fullmatch(name[len(prefix) :])
    ):
        raise SharedMemoryError(
            f"rank {rank} published {text[:200]!r} as its shared-memory file: not a name "
            f"its process could have made ({SHM_DIR}/{prefix}<8 hex digits>); refusing it"
        )
    return os.path.join(SHM_DIR, name)


def open_checked(path: str, flags: int, *, fifo: bool = False, size: int | None = None) -> int:
    """Open a peer's shared-memory file ``path`` and check what it is; return the descriptor.

    A path in ``/dev/shm`` is opened with ``O_NOFOLLOW`` (a symlink there is refused); a
    ``/proc/<pid>/fd/<fd>`` path cannot be (it is a link by nature), so for both what counts
    is the check of the file, before and once open: a FIFO if ``fifo``, else a regular file
    of ``size`` bytes; on ``/dev/shm``'s filesystem; owned by this process's user.

    Raises:
        OSError: the file cannot be opened (it is missing, or ``/proc`` forbids it).
        SharedMemoryError: it is something else than what was asked for (a symlink too).
    """
    link = path.startswith("/proc/")
    if not link:
        flags |= os.O_NOFOLLOW
    # Looked at before it is opened too: opening a device has effects of its own.
    _check(path, os.stat(path, follow_symlinks=link), fifo, size)
    fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        _check(path, os.fstat(fd), fifo, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check(path: str, st: os.stat_result, fifo: bool, size: int | None) -> None:
    """Raise ``SharedMemoryError`` unless ``st`` describes a peer's shared-memory file."""
    if not (stat.S_ISFIFO(st.st_mode) if fifo else stat.S_ISREG(st.st_mode)):
        wrong = f"not a {'FIFO' if fifo else 'regular file'}"
    elif st.st_dev != os.stat(SHM_DIR).st_dev:
        wrong = f"not on {SHM_DIR}'s filesystem"
    elif st.st_uid != os.geteuid():
        wrong = f"owned by user {st.st_uid}, not by this process's ({os.geteuid()})"
    elif size is not None and st.st_size != size:
        wrong = f"{st.st_size} bytes long, expected {size}"
    else:
        return
    raise SharedMemoryError(f"the shared-memory file {path} is {wrong}; refusing it")


def peer_fd_path(proc: ProcessId, fd: object) -> str:
    """``/proc/<pid>/fd/<fd>``: the file process ``proc`` holds open as descriptor ``fd``
    (a doorbell, a shared array), to open with :func:`open_checked`.

    Raises:
        SharedMemoryError: ``fd``, from the peer's record, is not a descriptor number.
    """
    if isinstance(fd, bool) or not isinstance(fd, int) or fd < 0:
        raise SharedMemoryError(f"process {proc.pid} published {fd!r} as a descriptor")
    return f"/proc/{proc.pid}/fd/{fd}"


def _creator(name: str, prefix: str) -> ProcessId | None:
    # <prefix><kind><rank>-<pid>-<start>-<nonce>
    parts = name[len(prefix) :].split("-")
    if len(parts) != 4:
        return None
    try:
        return ProcessId(int(parts[1]), int(parts[2]))
    except ValueError:
        return None


def remove_leftovers(job_key: str) -> list[str]:
    """Remove the job's segment files whose creating process no longer exists.

    Files of live processes are never touched, so this is safe while other ranks of the
    job (or another world of it) set up their segments.

    Returns:
        The paths removed.
    """
    prefix = job_prefix(job_key)
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(prefix):
            continue
        creator = _creator(name, prefix)
        if creator is None or is_alive(creator):
            continue
        path = os.path.join(SHM_DIR, name)
        with contextlib.suppress(FileNotFoundError, PermissionError):
            os.unlink(path)
            removed.append(path)
    if removed:
        logger.info("removed %d shared-memory leftovers of exited processes", len(removed))
    return removed


def reserve(fd: int, size: int, what: str) -> None:
    """Reserve ``size`` bytes of the file ``fd`` so that touching them can never fault.

    Raises:
        SharedMemoryError: the filesystem cannot hold them (the message names the size
            needed and the space free, and that the caller may fall back to TCP).
    """
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        try:
            st = os.statvfs(SHM_DIR)
            free = f"{st.f_bavail * st.f_frsize} bytes are free"
        except OSError:
            free = "its free space is unknown"
        reason = "it is full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else str(exc)
        raise SharedMemoryError(
            f"cannot reserve {size} bytes of shared memory in {SHM_DIR} for {what}: {reason} "
            f"({free}); enlarge {SHM_DIR} (docker: --shm-size), or fall back to TCP "
            "(AIODIST_SHM=0)"
        ) from exc


class Segment:
    """A shared-memory mapping of a file in ``/dev/shm``.

    Attributes:
        path: the file's path (it may already be unlinked).
        size: the mapping's size in bytes.
        buf: a writable byte view of the whole mapping.
        words: the same memory as native unsigned 64-bit words. An aligned word is read
            and written with one instruction, so a reader never sees half a store.
    """

    def __init__(self, path: str, mm: mmap.mmap, *, owner: bool) -> None:
        self.path = path
        self.size = len(mm)
        self._mm: mmap.mmap | None = mm
        self._owner = owner
        self._linked = owner
        self.buf = memoryview(mm)
        self.words = self.buf.cast("Q")

    def __repr__(self) -> str:
        state = "linked" if self._linked else "unlinked"
        return f"<Segment {os.path.basename(self.path)} {self.size} bytes {state}>"

    @classmethod
    def create(cls, path: str, size: int, what: str) -> Segment:
        """Create the file ``path`` with ``size`` reserved (zeroed) bytes and map it.

        Raises:
            SharedMemoryError: ``/dev/shm`` cannot hold the segment, or the file cannot be
                created.
        """
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise SharedMemoryError(f"cannot create {path} for {what}: {exc}") from exc
        try:
            reserve(fd, size, what)
            mm = mmap.mmap(fd, size)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(path, mm, owner=True)

    @classmethod
    def attach(cls, path: str, size: int) -> Segment:
        """Map the existing segment ``path`` (a peer's: see :func:`peer_path`), which must
        be a regular file of ``size`` bytes (see :func:`open_checked`).

        Raises:
            SharedMemoryError: the file is missing, a symlink, or not such a file.
        """
        try:
            fd = open_checked(path, os.O_RDWR, size=size)
        except OSError as exc:
            raise SharedMemoryError(f"cannot open the shared-memory segment {path}: {exc}") from exc
        try:
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(path, mm, owner=False)

    def unlink(self) -> None:
        """Remove the file name (the creator's job); the mappings stay valid."""
        if self._linked:
            self._linked = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def close(self) -> None:
        """Unlink (if created here and still linked) and unmap. Closing twice is harmless.

        Views that other code still holds keep the memory mapped until they are dropped.
        """
        self.unlink()
        mm, self._mm = self._mm, None
        if mm is None:
            return
        try:
            self.words.release()
            self.buf.release()
            mm.close()
        except BufferError:  # something still holds a view: the mapping goes with it
            logger.debug("segment %s stays mapped until its last view is dropped", self.path)


def make_fifo(path: str) -> int:
    """Create the FIFO ``path`` and open it for reading and writing, non-blocking.

    Opening it for both keeps it readable by the event loop without ever reporting end of
    file, and lets peers open it for writing at any time.

    Raises:
        SharedMemoryError: the FIFO cannot be created.
    """
    try:
        os.mkfifo(path, 0o600)
    except OSError as exc:
        raise SharedMemoryError(f"cannot create the doorbell {path}: {exc}") from exc
    try:
        return os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
