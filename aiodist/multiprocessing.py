"""``torch.multiprocessing.spawn`` without torch: start ``nprocs`` processes running ``fn(i, *args)``.

A script written for ``torch.multiprocessing`` ports with its import line::

    import aiodist.multiprocessing as mp
    import aiodist.sync as dist

    def run(rank, world_size):
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        ...

    if __name__ == "__main__":
        mp.spawn(run, args=(4,), nprocs=4, join=True)

As in torch, the parent waits for every process; the first one that fails makes the parent
stop the others (SIGTERM, then SIGKILL after a grace period) and raise
:class:`ProcessRaisedException` with the child's traceback, or
:class:`ProcessExitedException` when it exited with a non-zero status or a signal without
a Python exception. A child whose process group is still open when ``fn`` returns leaves it
as ``destroy_process_group`` would (see :mod:`aiodist.sync`).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from typing import Any

__all__ = [
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "spawn",
    "start_processes",
]

#: Seconds the survivors of a failed process get to exit after SIGTERM before SIGKILL.
STOP_GRACE_SECONDS = 30.0


class ProcessException(Exception):
    """A process started by :func:`spawn` failed.

    Attributes:
        msg: the message.
        error_index: the index (``i``) of the process that failed first.
        error_pid: its pid.
    """

    def __init__(self, msg: str, error_index: int, error_pid: int) -> None:
        super().__init__(msg)
        self.msg = msg
        self.error_index = error_index
        self.error_pid = error_pid

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.msg, self.error_index, self.error_pid)


class ProcessRaisedException(ProcessException):
    """The process failed with a Python exception; the message holds its traceback."""


class ProcessExitedException(ProcessException):
    """The process exited with a non-zero status, or was killed by a signal.

    Attributes:
        exit_code: the exit status (negative: killed by signal ``-exit_code``).
        signal_name: the signal's name, or ``None``.
    """

    def __init__(
        self,
        msg: str,
        error_index: int,
        error_pid: int,
        exit_code: int,
        signal_name: str | None = None,
    ) -> None:
        super().__init__(msg, error_index, error_pid)
        self.exit_code = exit_code
        self.signal_name = signal_name

    def __reduce__(self) -> tuple[Any, ...]:
        args = (self.msg, self.error_index, self.error_pid, self.exit_code, self.signal_name)
        return type(self), args


def _run_child(fn: Callable[..., object], i: int, args: Sequence[Any], error_file: str) -> None:
    """The target of each process: ``fn(i, *args)``, its traceback written on failure."""
    try:
        fn(i, *args)
    except KeyboardInterrupt:
        pass  # stopped by the parent (or Ctrl-C on the whole process group)
    except Exception as exc:
        with open(error_file, "w") as f:
            f.write(traceback.format_exc())
        # The exception stays attached: the exit handlers see what the process ends on.
        raise SystemExit(1) from exc


class ProcessContext:
    """The processes of one :func:`spawn` (``start_processes``) call.

    Attributes:
        processes: the ``multiprocessing`` processes, by index.
        error_files: where each writes its traceback if ``fn`` raises.
    """

    def __init__(self, processes: list[BaseProcess], error_files: list[str]) -> None:
        self.processes = processes
        self.error_files = error_files
        self._running = {p.sentinel: i for i, p in enumerate(processes)}

    def __repr__(self) -> str:
        return f"<ProcessContext nprocs={len(self.processes)} running={len(self._running)}>"

    def pids(self) -> list[int]:
        """The pids of the processes, by index."""
        return [int(p.pid or 0) for p in self.processes]

    def join(self, timeout: float | None = None, grace_period: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the processes; return whether all have ended.

        When one has failed, the others are stopped: after ``grace_period`` seconds (if
        given) SIGTERM, then SIGKILL after another grace period (30 s by default).

        Raises:
            ProcessRaisedException: the first failed process raised; its traceback.
            ProcessExitedException: it exited with a non-zero status or a signal.
        """
        if not self._running:
            return True
        ready = multiprocessing.connection.wait(list(self._running), timeout=timeout)
        failed = None
        for sentinel in ready:
            assert isinstance(sentinel, int)  # (what process sentinels are)
            i = self._running.pop(sentinel)
            self.processes[i].join()
            if self.processes[i].exitcode != 0:
                failed = i
                break
        if failed is None:
            return not self._running
        self._stop_others(grace_period)
        raise self._failure(failed)

    def _stop_others(self, grace_period: float | None) -> None:
        others = [self.processes[i] for i in self._running.values()]
        self._running.clear()
        if grace_period is not None:
            _join_all(others, grace_period)
        for p in others:
            if p.is_alive():
                p.terminate()
        _join_all(others, STOP_GRACE_SECONDS if grace_period is None else grace_period)
        for p in others:
            if p.is_alive():
                p.kill()
                p.join()

    def _failure(self, i: int) -> ProcessException:
        process = self.processes[i]
        pid = int(process.pid or 0)
        try:
            with open(self.error_files[i]) as f:
                trace = f.read()
        except OSError:
            code = int(process.exitcode or 0)
            if code < 0:
                try:
                    name = signal.Signals(-code).name
                except ValueError:
                    name = f"<Unknown signal {-code}>"
                return ProcessExitedException(
                    f"process {i} terminated with signal {name}", i, pid, code, name
                )
            return ProcessExitedException(
                f"process {i} terminated with exit code {code}", i, pid, code
            )
        return ProcessRaisedException(
            f"\n\n-- Process {i} terminated with the following error:\n{trace}", i, pid
        )


def _join_all(processes: Sequence[BaseProcess], timeout: float) -> None:
    """Wait until every one of ``processes`` has ended, or ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))


def spawn(
    fn: Callable[..., object],
    args: Sequence[Any] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
) -> ProcessContext | None:
    """Start ``nprocs`` processes running ``fn(i, *args)`` (``torch.multiprocessing.spawn``;
    ``start_processes`` is the same function, as in torch).

    ``fn`` must be importable by the children (a module-level function) with the default
    start method, ``"spawn"``; ``"fork"`` and ``"forkserver"`` are accepted too.

    Returns:
        ``None`` once every process has ended successfully (``join=True``), else the
        :class:`ProcessContext` at once.

    Raises:
        ProcessRaisedException: with ``join``, the first process that raised (its
            traceback is the message); the others were stopped.
        ProcessExitedException: with ``join``, the first that exited with a non-zero
            status or a signal; the others were stopped.
        ValueError: an unknown start method.
    """
    mp: Any = multiprocessing.get_context(start_method)
    processes: list[BaseProcess] = []
    error_files: list[str] = []
    for i in range(nprocs):
        fd, path = tempfile.mkstemp(prefix="aiodist-errorfile-", suffix=".txt")
        os.close(fd)
        os.unlink(path)  # (it exists again only if the process fails)
        process = mp.Process(target=_run_child, args=(fn, i, tuple(args), path), daemon=daemon)
        process.start()
        processes.append(process)
        error_files.append(path)
    context = ProcessContext(processes, error_files)
    if not join:
        return context
    try:
        while not context.join():
            pass
    finally:
        for path in error_files:
            if os.path.exists(path):
                os.unlink(path)
    return None


#: torch's other name for :func:`spawn`.
start_processes = spawn
