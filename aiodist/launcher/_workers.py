"""The launcher's local worker group: processes, their output and how they are stopped.

Each worker runs in its own session (so a signal reaches everything it spawned through its
process group) and dies with the launcher (``PR_SET_PDEATHSIG``), so killing a launcher with
SIGKILL never leaves orphaned workers holding ports. Output is read from pipes in chunks,
split into lines and written to the console with a ``[rankN]: `` prefix and/or to per-rank log
files. The last lines of every worker's stderr are kept for the failure summary.

A worker that failed can be replaced in its slot while the others keep running
(:meth:`WorkerGroup.replace`, for ``--restart-policy=failed``). Stopping the group is
SIGTERM (or the signal the launcher received), a grace period, then SIGKILL; afterwards
:meth:`WorkerGroup.shutdown_report` says how each worker ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import json
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from .._assembly._join import RANK_MARK
from ._preload import ForkedProcess, Starter, die_with_parent

logger = logging.getLogger(__name__)

__all__ = ["Std", "WorkerFailure", "WorkerGroup", "WorkerSpec", "describe_exit"]

#: How many stderr lines of each worker the failure summary can show.
TAIL_LINES = 40
_READ_CHUNK = 1 << 16


class Std(enum.IntFlag):
    """Which standard streams a ``--redirects``/``--tee`` setting covers (torch's values)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


def default_prefix(rank: int) -> str:
    """What starts a worker's console lines unless ``--log-line-prefix-template`` says."""
    return f"[rank{rank}]: "


def _marked_rank(rest: bytes) -> int | None:
    """The rank in a mark's ``rest`` (what follows :data:`RANK_MARK`: digits, then BEL), or
    ``None`` if it is no mark."""
    digits, bel, _ = rest.partition(b"\x07")
    return int(digits) if bel and digits.isdigit() else None


@dataclass(frozen=True)
class WorkerSpec:
    """Everything needed to start one worker process.

    Attributes:
        rank: the global rank.
        local_rank: the rank on this node.
        cmd: the command line.
        env: the complete environment of the process.
        redirect: streams written to the log files only.
        tee: streams written to the log files and to the console.
        console: whether the console shows this worker at all (``--local-ranks-filter``).
        log_dir: where ``stdout.log``/``stderr.log`` go when ``redirect | tee`` asks for them.
        error_file: the path given as ``TORCHELASTIC_ERROR_FILE``.
        prefix: what starts each of its lines on the console, given its rank (by default
            ``[rankN]: ``); a worker that says it has a new rank (:data:`RANK_MARK`) has its
            later lines start with the new rank's.
    """

    rank: int
    local_rank: int
    cmd: Sequence[str]
    env: Mapping[str, str]
    redirect: Std
    tee: Std
    console: bool
    log_dir: Path
    error_file: Path
    prefix: Callable[[int], str] = default_prefix


@dataclass
class WorkerFailure:
    """How one worker failed: what the launcher reports as the root cause.

    Attributes:
        rank: global rank of the worker.
        local_rank: its rank on its node.
        node_rank: the node it ran on.
        pid: its process id.
        exitcode: the exit status (negative: killed by signal ``-exitcode``).
        timestamp: when the launcher saw it exit (Unix seconds).
        stderr_tail: the last lines it wrote to stderr.
        error: the ``message`` of the error file the worker wrote, if it wrote one.
        error_traceback: the traceback from that error file, if any.
        restarts: how many times this rank had been restarted on its own before this
            failure (``--restart-policy=failed``).
        finished: global ranks of its node that had exited with status 0 before it (their
            script ended: not a failure, even if this worker's error names them).
    """

    rank: int
    local_rank: int
    node_rank: int
    pid: int
    exitcode: int
    timestamp: float
    stderr_tail: list[str] = field(default_factory=list)
    error: str | None = None
    error_traceback: str | None = None
    restarts: int = 0
    finished: list[int] = field(default_factory=list)

    def to_json(self) -> str:
        """Serialise for the store, so every node can print the same summary."""
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerFailure:
        """Inverse of :meth:`to_json`."""
        return cls(**json.loads(text))


def describe_exit(exitcode: int) -> str:
    """``'exit code 3'`` or ``'signal SIGKILL (9)'`` for a process return code."""
    if exitcode >= 0:
        return f"exit code {exitcode}"
    signum = -exitcode
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = "unknown signal"
    return f"signal {name} ({signum})"


class _Worker:
    """One running worker and the tasks that pump its output."""

    def __init__(self, spec: WorkerSpec, proc: asyncio.subprocess.Process | ForkedProcess) -> None:
        self.spec = spec
        self.proc = proc
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.exitcode: int | None = None
        self.files: list[BinaryIO] = []
        self.pumps: list[asyncio.Task[None]] = []
        self.reaper: asyncio.Task[None] | None = None
        #: When the launcher sent the stop signal (monotonic seconds), and which signal.
        self.stop_sent: tuple[float, int] | None = None
        #: Why the launcher sent SIGKILL, if it did.
        self.killed: str | None = None
        self.exited_at: float | None = None

    def __repr__(self) -> str:
        state = "running" if self.exitcode is None else describe_exit(self.exitcode)
        return f"<Worker rank={self.spec.rank} pid={self.proc.pid} {state}>"

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` to the worker's process group while the worker is alive."""
        if self.exitcode is not None or self.proc.returncode is not None:
            # Once reaped, the process group id may be recycled: never signal it.
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signum)


class WorkerGroup:
    """The workers of one attempt on this node.

    Args:
        node_rank: this node's rank, for failure reports.
        stdout: where console output of the workers' stdout goes (bytes).
        stderr: where console output of the workers' stderr goes (bytes).
        starter: where the workers are forked from (``--preload``); ``None``: each is a new
            process.
    """

    def __init__(
        self, node_rank: int, stdout: BinaryIO, stderr: BinaryIO, starter: Starter | None = None
    ) -> None:
        self._node_rank = node_rank
        self._starter = starter
        self._stdout = stdout
        self._stderr = stderr
        self._workers: list[_Worker] = []
        self._changed = asyncio.Event()
        self._exit_order: list[_Worker] = []

    def __repr__(self) -> str:
        running = sum(w.exitcode is None for w in self._workers)
        return (
            f"<WorkerGroup node={self._node_rank} workers={len(self._workers)} running={running}>"
        )

    @property
    def changed(self) -> asyncio.Event:
        """Set whenever a worker exits; the supervisor clears it after looking."""
        return self._changed

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers, in local rank order."""
        return [w.proc.pid for w in self._workers]

    def running(self) -> int:
        """How many workers have not exited yet."""
        return sum(w.exitcode is None for w in self._workers)

    def first_failure(self) -> WorkerFailure | None:
        """The failure of the first worker that exited unsuccessfully, or ``None``.

        A worker that :meth:`replace` replaced no longer counts.
        """
        finished: list[int] = []
        for worker in self._exit_order:
            if worker.exitcode:
                failure = self._failure(worker)
                failure.finished = finished
                return failure
            finished.append(worker.spec.rank)
        return None

    async def start(self, specs: Sequence[WorkerSpec]) -> None:
        """Start one process per spec.

        Raises:
            OSError: a process could not be started (e.g. the script is not executable).
        """
        for spec in specs:
            self._workers.append(await self._spawn(spec))

    async def replace(self, spec: WorkerSpec) -> None:
        """Start ``spec`` in the slot of the exited worker with the same local rank.

        The other workers are left alone; the exit of the replaced worker no longer counts
        as a failure of this group.

        Raises:
            ValueError: no worker has that local rank, or it is still running.
            OSError: the process could not be started.
        """
        slot = next(
            (i for i, w in enumerate(self._workers) if w.spec.local_rank == spec.local_rank), None
        )
        if slot is None or self._workers[slot].exitcode is None:
            raise ValueError(f"local rank {spec.local_rank} has no exited worker to replace")
        old = self._workers[slot]
        self._workers[slot] = await self._spawn(spec)
        self._exit_order.remove(old)

    async def _spawn(self, spec: WorkerSpec) -> _Worker:
        files: dict[str, BinaryIO] = {}
        if spec.redirect | spec.tee:
            spec.log_dir.mkdir(parents=True, exist_ok=True)
        for name, flag in (("stdout", Std.OUT), ("stderr", Std.ERR)):
            if (spec.redirect | spec.tee) & flag:
                files[name] = open(spec.log_dir / f"{name}.log", "wb")  # noqa: ASYNC230, SIM115
        spec.error_file.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            spec.error_file.unlink()
        proc: asyncio.subprocess.Process | ForkedProcess
        try:
            if self._starter is not None:
                proc = await self._starter.spawn(spec.cmd, spec.env)
            else:
                proc = await asyncio.create_subprocess_exec(
                    *spec.cmd,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    env=dict(spec.env),
                    start_new_session=True,
                    preexec_fn=functools.partial(die_with_parent, os.getpid()),
                )
        except OSError as exc:
            for f in files.values():
                f.close()
            raise OSError(
                exc.errno, f"cannot start rank {spec.rank}: {spec.cmd[0]}: {exc.strerror}"
            ) from exc
        worker = _Worker(spec, proc)
        worker.files = list(files.values())
        assert proc.stdout is not None and proc.stderr is not None
        for reader, name, flag, console in (
            (proc.stdout, "stdout", Std.OUT, self._stdout),
            (proc.stderr, "stderr", Std.ERR, self._stderr),
        ):
            show = spec.console and not (spec.redirect & flag)
            worker.pumps.append(
                asyncio.create_task(
                    self._pump(
                        worker,
                        reader,
                        console if show else None,
                        files.get(name),
                        keep_tail=flag is Std.ERR,
                    ),
                    name=f"aiodist-run rank{spec.rank} {name}",
                )
            )
        worker.reaper = asyncio.create_task(
            self._reap(worker), name=f"aiodist-run rank{spec.rank} wait"
        )
        logger.debug("started rank %d (pid %d): %s", spec.rank, proc.pid, list(spec.cmd))
        return worker

    async def _pump(
        self,
        worker: _Worker,
        reader: asyncio.StreamReader,
        console: BinaryIO | None,
        file: BinaryIO | None,
        keep_tail: bool,
    ) -> None:
        # (Each stream follows the worker's rank by the marks in it: see RANK_MARK.)
        prefix = worker.spec.prefix(worker.spec.rank).encode()
        pending = b""
        while True:
            chunk = await reader.read(_READ_CHUNK)
            if not chunk:
                break
            data = pending + chunk
            lines = data.split(b"\n")
            pending = lines.pop()
            prefix = self._emit_marked(worker, lines, prefix, console, file, keep_tail)
        if pending:
            self._emit_marked(worker, [pending], prefix, console, file, keep_tail)

    def _emit_marked(
        self,
        worker: _Worker,
        lines: list[bytes],
        prefix: bytes,
        console: BinaryIO | None,
        file: BinaryIO | None,
        keep_tail: bool,
    ) -> bytes:
        """Emit ``lines`` of ``worker``, taking out the marks of its new ranks; return the
        prefix its next lines get."""
        start = 0
        for i, line in enumerate(lines):
            at = line.find(RANK_MARK)
            if at < 0:
                continue
            rank = _marked_rank(line[at + len(RANK_MARK) :])
            if rank is None:
                continue  # (not a mark after all: the line stays as it is)
            before = lines[start:i]
            if at:
                before.append(line[:at])  # (a line the script had not ended)
            self._emit(worker, before, prefix, console, file, keep_tail)
            prefix = worker.spec.prefix(rank).encode()
            start = i + 1
        self._emit(worker, lines[start:], prefix, console, file, keep_tail)
        return prefix

    def _emit(
        self,
        worker: _Worker,
        lines: list[bytes],
        prefix: bytes,
        console: BinaryIO | None,
        file: BinaryIO | None,
        keep_tail: bool,
    ) -> None:
        if not lines:
            return
        if keep_tail:
            worker.tail.extend(line.decode(errors="replace") for line in lines)
        if file is not None:
            file.write(b"".join(line + b"\n" for line in lines))
            file.flush()
        if console is not None:
            # A worker's partial line is only printed once complete, so lines of different
            # ranks never interleave mid-line.
            console.write(b"".join(prefix + line + b"\n" for line in lines))
            console.flush()

    async def _reap(self, worker: _Worker) -> None:
        exitcode = await worker.proc.wait()
        worker.exited_at = time.monotonic()
        # Drain the pipes so the failure summary has the worker's last words; a grandchild
        # that inherited the pipes may keep them open, so do not wait for it forever.
        _done, pending = await asyncio.wait(worker.pumps, timeout=2.0)
        for task in pending:
            task.cancel()
        for f in worker.files:
            f.close()
        worker.exitcode = exitcode
        self._exit_order.append(worker)
        logger.debug(
            "rank %d (pid %d) exited: %s",
            worker.spec.rank,
            worker.proc.pid,
            describe_exit(exitcode),
        )
        self._changed.set()

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` to every running worker's process group."""
        for worker in self._workers:
            worker.send_signal(signum)

    def kill(self, reason: str) -> None:
        """SIGKILL every running worker now; ``reason`` goes into :meth:`shutdown_report`."""
        for worker in self._workers:
            if worker.exitcode is None:
                worker.killed = worker.killed or reason
                worker.send_signal(signal.SIGKILL)

    def begin_stop(self, signum: int = signal.SIGTERM) -> None:
        """Send ``signum`` to every running worker not yet asked to stop.

        Each worker's grace period (see :meth:`stop`) counts from the moment it was sent its
        stop signal, so a launcher that forwards a signal at once and waits for the workers
        later does not extend the grace period, and no worker gets the signal twice (a
        second SIGTERM means "exit now" to many servers).
        """
        now = time.monotonic()
        for worker in self._workers:
            if worker.exitcode is None and worker.stop_sent is None:
                worker.stop_sent = (now, signum)
                worker.send_signal(signum)

    async def stop(self, grace: float, first: int = signal.SIGTERM) -> None:
        """Stop every worker: ``first`` (SIGTERM), then SIGKILL ``grace`` seconds later.

        Workers already sent a stop signal by :meth:`begin_stop` keep their deadline.
        Returns once every worker has exited and its output is drained.
        """
        self.begin_stop(first)
        while True:
            waiting = [w for w in self._workers if w.exitcode is None and w.killed is None]
            if not waiting:
                break
            now = time.monotonic()
            sent = {w: w.stop_sent or (now, first) for w in waiting}
            late = [w for w in waiting if now >= sent[w][0] + grace]
            if late:
                logger.warning(
                    "workers still running %.1f s after %s: sending SIGKILL to %s",
                    grace,
                    signal.Signals(sent[late[0]][1]).name,
                    _ranks(late),
                )
                for worker in late:
                    name = signal.Signals(sent[worker][1]).name
                    worker.killed = f"did not exit within the {grace:g} s grace period after {name}"
                    worker.send_signal(signal.SIGKILL)
                continue
            deadline = min(t for t, _sig in sent.values()) + grace
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, deadline - now)):
                    await self._changed.wait()
        while self.running():
            self._changed.clear()
            await self._changed.wait()

    def shutdown_report(self) -> list[tuple[int, str]]:
        """How each worker sent a stop signal ended: ``(logging level, message)`` pairs.

        A worker that exited 0, or with the stop signal's conventional status (killed by it,
        or ``128 + N`` from a handler), stopped cleanly (INFO); one killed after the grace
        period, or that exited with another status, is a WARNING.
        """
        report = []
        for w in self._workers:
            if w.stop_sent is None or w.exitcode is None or w.exited_at is None:
                continue
            sent, signum = w.stop_sent
            name = signal.Signals(signum).name
            who = f"rank {w.spec.rank} (pid {w.proc.pid})"
            after = w.exited_at - sent
            if w.killed is not None and w.exitcode == -signal.SIGKILL:
                report.append((logging.WARNING, f"{who} {w.killed}: killed with SIGKILL"))
            elif w.exitcode in (0, -signum, 128 + signum):
                report.append(
                    (
                        logging.INFO,
                        f"{who} stopped {after:.2f} s after {name}, "
                        f"with {describe_exit(w.exitcode)}",
                    )
                )
            else:
                report.append(
                    (
                        logging.WARNING,
                        f"{who} exited with {describe_exit(w.exitcode)} {after:.2f} s after {name}",
                    )
                )
        return report

    def _failure(self, worker: _Worker) -> WorkerFailure:
        assert worker.exitcode is not None
        error, trace = _read_error_file(worker.spec.error_file)
        return WorkerFailure(
            rank=worker.spec.rank,
            local_rank=worker.spec.local_rank,
            node_rank=self._node_rank,
            pid=worker.proc.pid,
            exitcode=worker.exitcode,
            timestamp=time.time(),
            stderr_tail=list(worker.tail),
            error=error,
            error_traceback=trace,
        )


def _ranks(workers: Sequence[_Worker]) -> str:
    """``'rank 3'`` or ``'ranks 0, 2'``."""
    ranks = ", ".join(str(w.spec.rank) for w in workers)
    return f"rank {ranks}" if len(workers) == 1 else f"ranks {ranks}"


def _read_error_file(path: Path) -> tuple[str | None, str | None]:
    """Read torchelastic's error file format (written by ``@record`` in torch workers)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None, None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        extra = message.get("extraInfo") or {}
        trace = extra.get("py_callstack") if isinstance(extra, dict) else None
        return str(message.get("message", "")), (str(trace) if trace else None)
    if isinstance(message, str):
        return message, None
    return None, None
