"""The flight recorder's dumps, and the command line that reads them.

Every world keeps a ring of its last operations (:mod:`aiodist.group._recorder`). A rank's record is written as JSON

* when one of its operations times out (``DistTimeoutError``), into ``AIODIST_FR_DUMP_DIR``
  if that is set;
* on ``SIGUSR1``, once :func:`install_signal_handler` was called (``init_process_group`` does
  so when ``AIODIST_FR_DUMP_DIR`` is set, e.g. for the workers of ``aiodist-run``);
* on demand: :func:`dump`.

``python -m aiodist.debug DUMP.json...`` reads the dumps of all ranks and says which rank is
behind, at which operation, what every rank was doing there, and which operations the ranks
called differently.

The live view needs no dump and stops nothing: with ``AIODIST_STATUS=1`` in every rank's
environment (``aiodist-run --status-port`` sets it), ``python -m aiodist.debug status``
asks every rank of the running job, through the store, what it is doing now: its operation
in flight and on whom it waits, its last operations and error, and the stacks of the ranks
the others wait for (see :func:`gather_status`).

The package is observation: this module (dumps, their analysis, the live view's
gathering; ``python -m aiodist.debug`` runs :func:`main`) and ``_status`` (each process's
status endpoint). It learns of each world this process joins through
:func:`aiodist._assembly._join.observe_worlds`. It may import :mod:`aiodist._assembly` and
everything below; never the API beside it or the facades above.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from .._util._auth import resolve_token
from ..errors import DistError, DistUsageError
from ..group._recorder import DUMP_DIR_ENV, FlightRecorder, OpRecord, live_recorders
from ..store import Store
from . import _status
from ._status import format_status, serve_status

__all__ = [
    "FlightRecorder",
    "OpRecord",
    "analyze",
    "dump",
    "format_status",
    "gather_status",
    "install_signal_handler",
    "main",
    "serve_status",
]

logger = logging.getLogger(__name__)

# Loops that already run the SIGUSR1 dump.
_loops_with_handler: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()


def dump(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Return the flight record of the current context's rank, and write it as JSON.

    Args:
        path: the file to write; ``None`` writes ``rank<N>.json`` into
            ``AIODIST_FR_DUMP_DIR`` when that is set, else nothing.

    Returns:
        The record (what the file holds).

    Raises:
        DistUsageError: the default process group is not initialized here.
        OSError: the file cannot be written.
    """
    from ..group import current_world

    recorder = current_world("aiodist.debug.dump").recorder
    data = recorder.to_json()
    if path is None and os.environ.get(DUMP_DIR_ENV):
        path = recorder.default_path(os.environ[DUMP_DIR_ENV])
    if path is not None:
        recorder.write(path)
    return data


class _WorldWatch:
    """Watches each world this process joins (see
    :func:`aiodist._assembly._join.observe_worlds`): the dump on ``SIGUSR1`` when
    ``AIODIST_FR_DUMP_DIR`` asks for it, the live view's endpoint when it is on."""

    def joining(self) -> None:
        if os.environ.get(DUMP_DIR_ENV):
            # Opted in through the environment (aiodist-run passes it on to its workers).
            install_signal_handler()

    async def joined(self, lobby: Store, rank: int, token: Callable[[], bytes | None]) -> None:
        if _status.status_enabled():
            await _status.register_status(lobby, rank, token())


#: The watcher the package has told of every world this process joins.
WORLD_WATCH = _WorldWatch()


def install_signal_handler(directory: str | os.PathLike[str] | None = None) -> bool:
    """Dump every rank of this process into ``directory`` when it receives ``SIGUSR1``.

    Called from a running event loop, the handler is registered with the loop
    (``loop.add_signal_handler``) and lives as long as the loop; otherwise with
    :func:`signal.signal`.

    Args:
        directory: where ``rank<N>.json`` files go; default ``AIODIST_FR_DUMP_DIR``.

    Returns:
        Whether a handler is in place (only the main thread can install one, and a handler
        the program installed itself is left alone).

    Raises:
        DistUsageError: no directory given and ``AIODIST_FR_DUMP_DIR`` is not set.
    """
    target = directory if directory is not None else os.environ.get(DUMP_DIR_ENV)
    if not target:
        raise DistUsageError(f"install_signal_handler needs a directory or {DUMP_DIR_ENV}")
    if threading.current_thread() is not threading.main_thread():
        logger.info("not installing the SIGUSR1 flight recorder dump: not the main thread")
        return False
    try:
        loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    if loop is not None and loop in _loops_with_handler:
        return True
    current = signal.getsignal(signal.SIGUSR1)
    if current not in (signal.SIG_DFL, None) and not getattr(current, "_aiodist", False):
        logger.info("SIGUSR1 already has a handler; the flight recorder leaves it")
        return False
    where = Path(target)

    def dump_all() -> None:
        for recorder in live_recorders():
            try:
                recorder.write(recorder.default_path(where))
            except OSError as exc:
                logger.warning("rank %d: flight recorder dump failed: %s", recorder.rank, exc)

    if loop is not None:
        loop.add_signal_handler(signal.SIGUSR1, dump_all)
        _loops_with_handler.add(loop)
        return True

    def handler(signum: int, frame: FrameType | None) -> None:
        dump_all()

    handler._aiodist = True  # type: ignore[attr-defined]
    signal.signal(signal.SIGUSR1, handler)
    return True


# -- the live view ----------------------------------------------------------------------------
async def gather_status(
    store: Store,
    *,
    group_name: str = "",
    timeout: float = 1.0,
    auth_token: str | bytes | None = None,
) -> list[dict[str, Any]]:
    """Ask every rank of the job's current world what it is doing, without stopping it.

    Each rank's process serves its status on a thread of its own when ``AIODIST_STATUS=1``
    is set (or after :func:`serve_status`), and records where in the store; this reads the
    addresses from ``store`` and asks every rank at once, so it returns within about
    ``timeout`` seconds even when a rank's event loop is blocked or its process is gone.
    With the job's secret, only the addresses the ranks signed with it are asked, with the
    key derived from it; without one, only those on this machine.

    Args:
        store: the job's store (a client of it will do: ``TCPStore.create(host, port)``).
        group_name: the job's ``group_name`` in ``init_process_group`` (default: none).
        timeout: seconds to wait for each rank's answer.
        auth_token: the job's secret (``None``: ``$AIODIST_AUTH_TOKEN``, if set).

    While ranks are forming a world (in ``init_process_group``, waiting for the others),
    that world is shown instead: ``{"rank", "forming"}`` for each rank that has arrived
    (what it joins and since when) and ``{"rank", "error"}`` for each that has not.

    Returns:
        One entry per rank, in rank order: ``{"rank", "address", "status"}``, where
        ``status`` holds the process's ``pid``, ``time``, its ``ranks`` (operations
        ``in_flight``, ``recent`` ones and the ``last_error``, as flight recorder records)
        and the ``stacks`` of its threads; or ``{"rank", "error"}`` for a rank that has no
        endpoint recorded or did not answer in time. :func:`format_status` makes it text.

    Raises:
        DistError: the store has no world of that job (none was formed yet), or cannot be
            reached.
        DistUsageError: the token is empty.
    """
    from .._assembly._forming import forming_worlds
    from .._assembly._join import CURRENT, job_store

    token = resolve_token(auth_token)
    job = job_store(store, group_name)
    forming = await forming_worlds(job)
    if forming:
        return _status.forming_entries(forming)
    if not await job.check([CURRENT]):
        raise DistError(
            f"the store holds no world of the job {group_name or 'default_pg'!r}, and no rank "
            "is forming one (init_process_group not called yet, or another group_name)"
        )
    return await _status.gather_status(job, timeout=timeout, token=token)


# -- analysis of the dumps of all ranks --------------------------------------------------------
def analyze(dumps: Sequence[dict[str, Any]]) -> str:
    """Explain the state of a job from its ranks' dumps: who is behind, where, and mismatches.

    For each group, the first operation that has not completed on every rank that called
    it, or that some rank never called, is where the job stands; the ranks that did not
    start it are behind. Operations (same group and sequence number) that ranks called
    differently are listed as mismatches.

    Args:
        dumps: the records of the ranks, as :func:`dump` returns them.

    Returns:
        The report, one line per finding.
    """
    by_rank = {int(d["rank"]): d for d in dumps}
    ranks = sorted(by_rank)
    lines: list[str] = []
    # group -> rank -> seq -> op record (collectives only; the newest record wins)
    groups: dict[int, dict[int, dict[int, dict[str, Any]]]] = {}
    for rank in ranks:
        for op in by_rank[rank]["ops"]:
            if not op["p2p"]:
                groups.setdefault(op["group"], {}).setdefault(rank, {})[op["seq"]] = op
    if not groups:
        return "no collective operations recorded"
    for gid in sorted(groups):
        per_rank = groups[gid]
        members = [r for r in ranks if r in per_rank or gid == 0]
        for seq in sorted({s for ops in per_rank.values() for s in ops}):
            calls = {r: per_rank[r][seq]["call"] for r in members if seq in per_rank.get(r, {})}
            if len(set(calls.values())) > 1:
                text = "; ".join(f"rank {r} called {c}" for r, c in calls.items())
                lines.append(f"group {gid}: mismatch at op #{seq}: {text}")
        last = {r: max(per_rank.get(r, {}), default=-1) for r in members}
        top = max(last.values())
        stuck = None
        for seq in sorted({s for ops in per_rank.values() for s in ops}):
            states = [per_rank.get(r, {}).get(seq) for r in members]
            if any(s is None and last[r] < seq for r, s in zip(members, states, strict=True)):
                stuck = seq
                break
            if any(s is not None and s["state"] != "completed" for s in states):
                stuck = seq
                break
        if stuck is None:
            lines.append(f"group {gid}: all ranks completed op #{top}")
            continue
        call = next(per_rank[r][stuck]["call"] for r in members if stuck in per_rank.get(r, {}))
        behind = [r for r in members if stuck not in per_rank.get(r, {})]
        head = f"group {gid}: op #{stuck} {call} is the first op not completed by every rank"
        lines.append(head)
        if behind:
            lines.append(
                f"group {gid}: behind: {'rank' if len(behind) == 1 else 'ranks'} "
                f"{', '.join(map(str, behind))} never called op #{stuck}"
            )
        for r in members:
            rec = per_rank.get(r, {}).get(stuck)
            if rec is not None:
                what = rec["state"] + (f" ({rec['error']})" if rec["error"] else "")
                lines.append(f"  rank {r}: {what}")
            elif last[r] >= 0:
                prev = per_rank[r][last[r]]
                lines.append(
                    f"  rank {r}: not called; last op #{last[r]} {prev['call']} {prev['state']}"
                )
            else:
                lines.append(f"  rank {r}: not called; no op recorded")
    return "\n".join(lines)


def _status_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m aiodist.debug status",
        description="Show what every rank of a running job is doing now, on whom it waits, "
        "and the stacks of the ranks waited for (the ranks need AIODIST_STATUS=1).",
    )
    default = None
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        default = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    parser.add_argument(
        "--store",
        default=default,
        required=default is None,
        help="the job's store, HOST:PORT (default: MASTER_ADDR:MASTER_PORT)",
    )
    parser.add_argument("--group-name", default="", help="the job's group_name, if any")
    parser.add_argument("--timeout", type=float, default=1.0, help="seconds per rank (1)")
    parser.add_argument("--json", action="store_true", help="print the raw status as JSON")
    args = parser.parse_args(argv)
    host, _, port = str(args.store).rpartition(":")
    if not host or not port.isdigit():
        parser.error(f"--store={args.store!r}: expected HOST:PORT")

    async def run() -> list[dict[str, Any]]:
        from ..store import TCPStore

        store = await TCPStore.create(host, int(port), timeout=max(args.timeout, 5.0))
        try:
            return await gather_status(store, group_name=args.group_name, timeout=args.timeout)
        finally:
            await store.aclose()

    try:
        entries = asyncio.run(run())
    except DistError as exc:
        sys.stderr.write(f"python -m aiodist.debug status: {exc}\n")
        return 1
    sys.stdout.write(json.dumps(entries, indent=1) if args.json else format_status(entries))
    sys.stdout.write("\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line: ``python -m aiodist.debug DUMP.json...`` (the dumps' analysis)
    or ``python -m aiodist.debug status [--store HOST:PORT]`` (the live view)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["status"]:
        return _status_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m aiodist.debug",
        usage="%(prog)s DUMP.json [DUMP.json ...]\n       %(prog)s status [--store HOST:PORT] ...",
        description="Say which rank is behind, and where, from the flight recorder dumps of\n"
        "all ranks; or, with `status`, what every rank of a running job does now.",
        epilog="commands:\n"
        "  status      the live view of a running job: what every rank does now, on\n"
        "              whom it waits, and the stacks of those waited for (while the\n"
        "              world forms: which ranks have arrived); see\n"
        "              python -m aiodist.debug status --help",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("dumps", nargs="+", help="the JSON dumps, one per rank")
    args = parser.parse_args(argv)
    dumps = []
    for name in args.dumps:
        try:
            dumps.append(json.loads(Path(name).read_text()))
        except (OSError, ValueError) as exc:
            parser.error(f"cannot read {name}: {exc}")
    sys.stdout.write(analyze(dumps) + "\n")
    return 0
