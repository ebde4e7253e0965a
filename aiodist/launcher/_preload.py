"""Starting workers by forking a process that has imported their modules already (``--preload``).

A fresh Python worker spends most of its start-up importing: about 0.2 s of CPU for
``numpy`` and ``aiodist.sync`` on a small host. When a worker is replaced while the others
train (``--restart-policy=failed``), that time is taken from them. With ``aiodist-run
--preload=MODULES`` the launcher starts one *starter* process that imports the modules once;
every worker is then a fork of it, and runs its script as ``python -u`` would (``__main__``,
``sys.argv``, ``sys.path[0]``, exit status, traceback) with its own environment, session and
standard streams.

The launcher and its starter talk over a ``SOCK_SEQPACKET`` socket pair, one JSON object per
message, the worker's standard streams passed with ``SCM_RIGHTS``:

* starter -> launcher: ``{"ready": true}`` once the modules are imported, or ``{"error": text}``
  (and it exits); ``{"started": id, "pid": pid}`` or ``{"failed": id, "error": text}`` for each
  start; ``{"exited": pid, "status": code}`` when a worker ends (negative: the signal);
* launcher -> starter: ``{"start": id, "argv": [...], "env": {...}, "cwd": path}`` with two
  descriptors (the worker's stdout and stderr; its stdin is ``/dev/null``); ``{"reap": pid}``
  once it has read the exit.

A worker that exited stays a zombie until the launcher sends ``reap``, so its process id
cannot be recycled while the launcher may still signal its process group. The workers die with
the starter (``PR_SET_PDEATHSIG``), and the starter dies with the launcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import importlib
import itertools
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import DistUsageError

__all__ = ["ForkedProcess", "Starter", "die_with_parent"]


_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Looked up once in the parent: the child between fork and exec must not load libraries.
_PRCTL = _load_prctl()


def die_with_parent(parent: int) -> None:
    """Runs in a new worker (or the starter of ``--preload``): get SIGKILL when the process
    that started it, ``parent``, dies."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # The launcher may have died between fork and prctl; the death signal would never come.
    if os.getppid() != parent:
        os._exit(1)


_MAX_MESSAGE = 1 << 20
_STREAMS = 2
#: The starter's command: ``python -u -c _BOOT <socket fd> <module>...``.
_BOOT = "from aiodist.launcher._preload import main; main()"
#: The files of the frames between the starter's command and a worker's script.
_OURS = frozenset({"<string>", __file__, runpy.__file__, "<frozen runpy>"})


# -- the starter process ----------------------------------------------------------------------


def _send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    socket.send_fds(sock, [json.dumps(message).encode()], list(fds))


@dataclass
class _Request:
    """A worker to run in this (forked) process."""

    argv: list[str]
    env: dict[str, str]
    cwd: str

    def run(self) -> None:
        """Run the worker's script or module as ``python -u <argv>`` would, as ``__main__``."""
        os.chdir(self.cwd)
        os.environ.clear()
        os.environ.update(self.env)
        # A fork shares its parent's random state; a fresh process would not.
        if "numpy.random" in sys.modules:
            sys.modules["numpy.random"].seed()
        if self.argv[0] == "-m":
            sys.argv = ["-m", *self.argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(self.argv[1], run_name="__main__", alter_sys=True)
            return
        script = self.argv[0]
        if not os.path.exists(script):
            sys.stderr.write(
                f"{sys.executable}: can't open file {os.path.abspath(script)!r}: "
                "[Errno 2] No such file or directory\n"
            )
            raise SystemExit(2)
        sys.argv = list(self.argv)
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


def _serve(sock: socket.socket) -> _Request | None:
    """Start workers until the launcher closes the socket; in a worker, return its request."""
    starter = os.getpid()
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ, None)
    while True:
        for key, _ in selector.select():
            if key.data is not None:  # a worker's pidfd: it exited
                pid = key.data
                selector.unregister(key.fd)
                os.close(key.fd)
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
                assert info is not None
                killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
                _send(
                    sock, {"exited": pid, "status": -info.si_status if killed else info.si_status}
                )
                continue
            data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, _STREAMS)
            if not data:
                return None
            message = json.loads(data)
            if "reap" in message:
                os.waitpid(message["reap"], 0)
                continue
            try:
                pid = os.fork()
            except OSError as exc:
                _send(sock, {"failed": message["start"], "error": str(exc)})
                for fd in fds:
                    os.close(fd)
                continue
            if pid == 0:
                for other in list(selector.get_map().values()):
                    if other.data is not None:
                        os.close(other.fd)
                selector.close()
                sock.close()
                os.setsid()
                die_with_parent(starter)
                for target, fd in enumerate([os.open(os.devnull, os.O_RDONLY), *fds]):
                    os.dup2(fd, target)
                    os.close(fd)
                return _Request(message["argv"], message["env"], message["cwd"])
            for fd in fds:
                os.close(fd)
            selector.register(os.pidfd_open(pid), selectors.EVENT_READ, pid)
            _send(sock, {"started": message["start"], "pid": pid})


def main() -> None:
    """The starter: ``python -u -c _BOOT <socket fd> <module>...``."""
    sock = socket.socket(fileno=int(sys.argv[1]))
    try:
        for name in sys.argv[2:]:
            importlib.import_module(name)
    except BaseException:
        _send(sock, {"error": traceback.format_exc()})
        raise SystemExit(1) from None
    _send(sock, {"ready": True})
    try:
        request = _serve(sock)
    except (BrokenPipeError, ConnectionResetError):
        request = None  # the launcher closed its end before reading all we sent
    if request is None:
        return
    try:
        request.run()
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        # What python prints: the traceback from the script's first frame, not the starter's.
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in _OURS:
            tb = tb.tb_next
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        raise SystemExit(1) from None


# -- the launcher's side ----------------------------------------------------------------------


class _PipeProtocol(asyncio.StreamReaderProtocol):
    """A worker's output pipe: its transport closes at the end of the output (uvloop keeps a
    transport open when ``eof_received`` returns true, as the stream protocol's does)."""

    def eof_received(self) -> bool:
        super().eof_received()
        return False


class ForkedProcess:
    """A worker forked by the starter: what the launcher reads of an ``asyncio`` process.

    Attributes:
        pid: the worker's process id (also its process group's: it has a session of its own).
        returncode: its exit status once it ended (negative: killed by that signal), else None.
        stdout: its standard output.
        stderr: its standard error.
    """

    def __init__(self, pid: int, stdout: asyncio.StreamReader, stderr: asyncio.StreamReader):
        self.pid = pid
        self.returncode: int | None = None
        self.stdout = stdout
        self.stderr = stderr
        self._ended = asyncio.get_running_loop().create_future()

    def __repr__(self) -> str:
        return f"<ForkedProcess pid={self.pid} returncode={self.returncode}>"

    async def wait(self) -> int:
        """Wait until the worker ended; return its exit status."""
        return await asyncio.shield(self._ended)

    def _end(self, status: int) -> None:
        if self.returncode is None:
            self.returncode = status
            self._ended.set_result(status)


class Starter:
    """The launcher's handle on a starter process that forks workers with ``modules`` loaded.

    Create it with :meth:`open`; :meth:`spawn` starts a worker; :meth:`close` ends the starter
    (after the workers: they die with it).
    """

    def __init__(self, proc: asyncio.subprocess.Process, sock: socket.socket) -> None:
        self._proc = proc
        self._sock = sock
        self._ids = itertools.count()
        #: Starts asked for and not answered yet: the future, and the worker's stdout, stderr.
        self._starting: dict[
            int, tuple[asyncio.Future[ForkedProcess], asyncio.StreamReader, asyncio.StreamReader]
        ] = {}
        self._running: dict[int, ForkedProcess] = {}
        self._closed = False
        asyncio.get_running_loop().add_reader(sock.fileno(), self._receive)

    def __repr__(self) -> str:
        return f"<Starter pid={self._proc.pid} workers={len(self._running)}>"

    @classmethod
    async def open(cls, modules: Sequence[str], env: Mapping[str, str]) -> Starter:
        """Start a starter that imports ``modules`` in the environment ``env``.

        Raises:
            DistUsageError: a module could not be imported (the message has its traceback).
            OSError: the starter process could not be started or ended at once.
        """
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with contextlib.ExitStack() as cleanup:
            cleanup.callback(ours.close)
            with theirs:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-u",
                    "-c",
                    _BOOT,
                    str(theirs.fileno()),
                    *modules,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.DEVNULL,
                    pass_fds=[theirs.fileno()],
                    env=dict(env),
                    start_new_session=True,
                    preexec_fn=functools.partial(die_with_parent, os.getpid()),
                )
            ours.setblocking(False)
            data = await asyncio.get_running_loop().sock_recv(ours, _MAX_MESSAGE)
            if not data:
                await proc.wait()
                raise OSError(f"the worker starter exited at once ({proc.returncode})")
            first = json.loads(data)
            if "error" in first:
                await proc.wait()
                raise DistUsageError(
                    f"--preload={','.join(modules)}: the starter could not import them:\n"
                    f"{first['error'].rstrip()}"
                )
            cleanup.pop_all()
        return cls(proc, ours)

    async def spawn(self, cmd: Sequence[str], env: Mapping[str, str]) -> ForkedProcess:
        """Start the worker ``cmd`` (``python -u`` then a script or ``-m module``, and its
        arguments) as a fork of the starter, with the environment ``env``.

        Raises:
            ValueError: ``cmd`` is not ``python -u ...`` with this launcher's Python.
            OSError: the starter could not fork, or is gone.
        """
        if list(cmd[:2]) != [sys.executable, "-u"] or len(cmd) < 3:
            raise ValueError(f"--preload runs Python workers only, not {list(cmd)}")
        if self._closed:
            raise OSError("the worker starter is gone")
        loop = asyncio.get_running_loop()
        pipes = [os.pipe(), os.pipe()]
        readers, transports = [], []
        for read_end, _ in pipes:
            reader = asyncio.StreamReader()
            transport, _protocol = await loop.connect_read_pipe(
                functools.partial(_PipeProtocol, reader),
                os.fdopen(read_end, "rb", 0),
            )
            readers.append(reader)
            transports.append(transport)
        request = next(self._ids)
        started: asyncio.Future[ForkedProcess] = loop.create_future()
        self._starting[request] = (started, readers[0], readers[1])
        message = {"start": request, "argv": list(cmd[2:]), "env": dict(env), "cwd": os.getcwd()}
        try:
            _send(self._sock, message, [pipes[0][1], pipes[1][1]])
            return await started
        except BaseException:
            if started.done() and not started.cancelled() and started.exception() is None:
                # Cancelled after the worker had started (its answer came first): nobody will
                # watch it, so end it, as _receive does when the answer comes second.
                os.kill(started.result().pid, signal.SIGKILL)
            for transport in transports:
                transport.close()
            raise
        finally:
            self._starting.pop(request, None)
            for _, write_end in pipes:
                os.close(write_end)

    def _receive(self) -> None:
        try:
            data = self._sock.recv(_MAX_MESSAGE, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._gone()
            return
        message = json.loads(data)
        if "started" in message:
            pid = message["pid"]
            starting = self._starting.get(message["started"])
            # Its spawn was cancelled, and has ended (gone from _starting) or not resumed yet
            # (uvloop runs this callback before a task's wake-up scheduled earlier): nobody
            # will watch this worker, so end it (the id is its until its exit is read below
            # and reaped).
            if starting is None or starting[0].done():
                os.kill(pid, signal.SIGKILL)
                return
            future, stdout, stderr = starting
            # Known before the worker's exit can be read: that message comes after this one.
            self._running[pid] = ForkedProcess(pid, stdout, stderr)
            future.set_result(self._running[pid])
        elif "failed" in message:
            if message["failed"] not in self._starting:
                return
            future = self._starting[message["failed"]][0]
            if not future.done():
                future.set_exception(OSError(f"cannot start a worker: {message['error']}"))
        elif "exited" in message:
            pid = message["exited"]
            if pid in self._running:
                self._running.pop(pid)._end(message["status"])
            with contextlib.suppress(OSError):
                _send(self._sock, {"reap": pid})

    def _gone(self) -> None:
        """The starter ended: its workers were killed with it (``PR_SET_PDEATHSIG``)."""
        if self._closed:
            return
        self._closed = True
        asyncio.get_running_loop().remove_reader(self._sock.fileno())
        for future, _, _ in self._starting.values():
            if not future.done():
                future.set_exception(OSError("the worker starter is gone"))
        for proc in self._running.values():
            proc._end(-signal.SIGKILL)
        self._running.clear()

    async def close(self) -> None:
        """End the starter (its remaining workers die with it) and wait for it."""
        self._gone()
        self._sock.close()
        await self._proc.wait()
