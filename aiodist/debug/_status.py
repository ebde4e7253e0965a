"""The live view of a running job: a status endpoint in each process, and the view of them all.

With ``AIODIST_STATUS=1`` (``aiodist-run --status-port`` sets it for its workers), every
process that forms a world starts one small HTTP server on a thread of its own, on loopback
unless ``AIODIST_STATUS_HOST`` names another address, and records ``host:port`` in the job's
namespace of the store (under ``status``). ``GET /status`` answers with what the process
knows now: for each of its ranks, the operations in flight and the last ones (from the
flight recorder) and the last error; and the stack of every thread.

With the job's secret (``auth_token`` / ``AIODIST_AUTH_TOKEN``), an endpoint answers only
requests that carry the key derived from it (``Authorization: Bearer KEY`` or ``?key=KEY``:
:func:`~aiodist._util._auth.derive_key`), and each rank signs the address it records with the
secret. Whoever gathers the view asks only the endpoints whose records are signed; in a job
without a secret, anyone who can write the store could record an address, so only the
endpoints on this machine are asked. The server runs on its own thread, so it answers while
the rank's event loop is blocked (a hung rank is exactly when the view is wanted); reading
the recorders needs no lock (each read is of a whole attribute, under the GIL) and stops
nothing.

:func:`gather_status` reads the endpoints of every rank of the job's current world through
the store, all at once, each within a deadline; :func:`format_status` says what every rank
is doing, on whom it waits, and shows the stacks of the ranks the others wait for.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
import urllib.parse
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .._util._auth import auth_mac, derive_key, resolve_token
from ..group._recorder import live_recorders
from ..store._base import Store

__all__ = [
    "STATUS_ENV",
    "STATUS_HOST_ENV",
    "authorized",
    "format_status",
    "forming_entries",
    "gather_status",
    "process_status",
    "serve_status",
    "status_enabled",
]

logger = logging.getLogger(__name__)

#: Set to ``1`` to give every process of the job a status endpoint.
STATUS_ENV = "AIODIST_STATUS"
#: The address the endpoints listen on (unset: ``127.0.0.1``; empty, ``0.0.0.0`` or ``::``:
#: every interface).
STATUS_HOST_ENV = "AIODIST_STATUS_HOST"
#: The key, in a job's namespace, where each rank appends ``N=host:port,`` (``#`` and a
#: signature before the comma with the job's secret): its endpoint (appended again by the
#: rank numbers of later worlds; the last valid entry of a rank wins).
STATUS_KEY = "status"
#: How many of a rank's last operations its status shows.
RECENT_OPS = 8
#: The most bytes read of one endpoint's answer (stacks of many threads fit).
_MAX_ANSWER = 64 << 20

_server: ThreadingHTTPServer | None = None
_server_thread: int | None = None
_server_lock = threading.Lock()


def status_enabled() -> bool:
    """Whether ``AIODIST_STATUS`` asks for status endpoints."""
    return os.environ.get(STATUS_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def process_status() -> dict[str, Any]:
    """What this process knows now: its ranks' operations and errors, and its threads' stacks."""
    now = time.time()
    ranks = []
    for recorder in sorted(live_recorders(), key=lambda r: (r.rank, r.created)):
        records = recorder.records()
        failed = [r for r in records if r.error is not None]
        ranks.append(
            {
                "rank": recorder.rank,
                "world_size": recorder.world_size,
                "ops_recorded": recorder.count,
                "in_flight": [r.to_json() for r in records if not r.ended],
                "recent": [r.to_json() for r in records[-RECENT_OPS:]],
                "last_error": failed[-1].to_json() if failed else None,
            }
        )
    names = {t.ident: t.name for t in threading.enumerate()}
    # Not the status server's own threads: the one accepting and the one answering.
    own = {threading.get_ident(), _server_thread}
    stacks = {
        names.get(ident, str(ident)): "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
        if ident not in own
    }
    return {"pid": os.getpid(), "time": now, "ranks": ranks, "stacks": stacks}


def authorized(key: str | None, target: str, authorization: str | None) -> bool:
    """Whether a request for ``target`` (path and query) with the ``Authorization`` header
    ``authorization`` carries ``key`` (``None``: no key is needed)."""
    if key is None:
        return True
    given = urllib.parse.parse_qs(urllib.parse.urlsplit(target).query).get("key", [""])[-1]
    if authorization is not None and authorization.startswith("Bearer "):
        given = authorization[len("Bearer ") :].strip()
    return hmac.compare_digest(given.encode(), key.encode())


class _StatusServer(ThreadingHTTPServer):
    #: The key requests must carry (``None``: none).
    key: str | None = None


class _Handler(BaseHTTPRequestHandler):
    server: _StatusServer

    def do_GET(self) -> None:
        if not authorized(self.server.key, self.path, self.headers.get("Authorization")):
            self.send_error(401, "the job's key is needed (Authorization: Bearer KEY)")
            return
        if self.path.split("?")[0] != "/status":
            self.send_error(404, "the status is at /status")
            return
        body = json.dumps(process_status()).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("status endpoint: " + format, *args)


def status_host() -> str:
    """Where the status endpoints listen: ``$AIODIST_STATUS_HOST``, else loopback."""
    host = os.environ.get(STATUS_HOST_ENV, "127.0.0.1").strip()
    return "0.0.0.0" if host in ("", "::") else host


def serve_status(host: str | None = None, auth_token: str | bytes | None = None) -> tuple[str, int]:
    """Start this process's status endpoint, once, on ``host`` (default: loopback, or
    ``$AIODIST_STATUS_HOST``) and a free port; return its address. Later calls return the
    running endpoint's address.

    With ``auth_token`` (``None``: ``$AIODIST_AUTH_TOKEN``, if set), it answers only requests
    that carry the key derived from it (``Authorization: Bearer KEY`` or ``?key=KEY``).

    Raises:
        DistUsageError: the token is empty.
    """
    global _server, _server_thread
    token = resolve_token(auth_token)
    with _server_lock:
        if _server is None:
            server = _StatusServer((status_host() if host is None else host, 0), _Handler)
            server.key = None if token is None else derive_key(token, "status")
            server.daemon_threads = True
            thread = threading.Thread(
                target=server.serve_forever, name="aiodist-status", daemon=True
            )
            thread.start()
            _server, _server_thread = server, thread.ident
            logger.info("status endpoint at http://%s:%d/status", *server.server_address[:2])
        address = _server.server_address
        return str(address[0]), int(address[1])


def _signature(token: bytes, entry: str) -> str:
    return auth_mac(token, b"status/entry", entry.encode(), b"").hex()[:32]


async def register_status(job: Store, rank: int, token: bytes | None) -> None:
    """Start the status endpoint (see :func:`serve_status`) and record it in the job's
    namespace ``job`` as ``rank``'s, signed with ``token`` when there is one. On every
    interface, what is recorded is this machine's host name, as the transport publishes
    it, so that other hosts reach it too."""
    addr, port = serve_status(auth_token=token)
    if addr in ("0.0.0.0", "::"):
        addr = socket.gethostname()
    entry = f"{rank}={addr}:{port}"
    if token is not None:
        entry += "#" + _signature(token, entry)
    await job.append(STATUS_KEY, entry + ",")


def _on_this_machine(host: str) -> bool:
    """Whether ``host`` (an address, or this machine's name) is one of this machine's."""
    if host in ("localhost", socket.gethostname()):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False  # (a name is not looked up: it came from the store)
    family = socket.AF_INET if address.version == 4 else socket.AF_INET6
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((host, 0))
        except OSError:
            return False
    return True


def _endpoints(recorded: str, size: int, token: bytes | None) -> dict[int, str | None]:
    """The endpoint to ask for each rank below ``size`` that recorded one: the last entry
    signed with ``token``, or without a token the last one on this machine; ``None`` for
    a rank whose entries are all refused."""
    out: dict[int, str | None] = {}
    for entry in filter(None, recorded.split(",")):
        body, _, signature = entry.partition("#")
        number, _, address = body.partition("=")
        with contextlib.suppress(ValueError):
            rank = int(number)
            if not 0 <= rank < size:
                continue
            if token is not None:
                good = hmac.compare_digest(signature, _signature(token, body))
            else:
                good = _on_this_machine(address.rpartition(":")[0].strip("[]"))
            if good:
                out[rank] = address
            else:
                out.setdefault(rank, None)
    return out


async def _fetch(address: str, timeout: float, key: str | None) -> dict[str, Any]:
    host, _, port = address.rpartition(":")
    credential = "" if key is None else f"Authorization: Bearer {key}\r\n"
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
        try:
            writer.write(f"GET /status HTTP/1.0\r\nHost: {address}\r\n{credential}\r\n".encode())
            raw = bytearray()
            while chunk := await reader.read(1 << 16):
                raw += chunk
                if len(raw) > _MAX_ANSWER:
                    raise ValueError(f"an answer of more than {_MAX_ANSWER} bytes")
        finally:
            writer.close()
    head, _, body = bytes(raw).partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/") or b" 200 " not in head.split(b"\r\n")[0]:
        raise ValueError(f"unexpected answer: {head[:80]!r}")
    status: dict[str, Any] = json.loads(body)
    return status


async def gather_status(
    job: Store, *, timeout: float = 1.0, token: bytes | None = None
) -> list[dict[str, Any]]:
    """Read the status of every rank of the job's current world, within ``timeout`` seconds.

    ``job`` is the job's namespace of the store (``aiodist/<group_name>``), ``token`` the
    job's secret. Each entry is ``{"rank": N, "address": ..., "status": {...}}``, or
    ``{"rank": N, "error": why}`` for a rank whose endpoint is not recorded (or not signed
    with the secret; without one, not on this machine) or did not answer in time (a process
    that ended, or one whose threads cannot run at all).
    """
    from .._assembly._join import CURRENT

    current = (await job.get(CURRENT)).decode()
    size = int(current.split("|")[1])
    recorded = (await job.get(STATUS_KEY)).decode() if await job.check([STATUS_KEY]) else ""
    endpoints = _endpoints(recorded, size, token)
    by_rank = {r: a for r, a in endpoints.items() if a is not None}
    key = None if token is None else derive_key(token, "status")
    results = await asyncio.gather(
        *(_fetch(by_rank[r], timeout, key) for r in sorted(by_rank)), return_exceptions=True
    )
    fetched = dict(zip(sorted(by_rank), results, strict=True))
    entries: list[dict[str, Any]] = []
    for rank in range(size):
        if rank in endpoints and rank not in by_rank:
            why = (
                "its recorded endpoint is not signed with the job's secret: not asked"
                if token is not None
                else "its recorded endpoint is not on this machine, and without the job's "
                "secret (AIODIST_AUTH_TOKEN) nothing in the store can be trusted: not asked"
            )
            entries.append({"rank": rank, "error": why})
            continue
        if rank not in by_rank:
            entries.append(
                {"rank": rank, "error": "no status endpoint recorded (AIODIST_STATUS unset?)"}
            )
            continue
        result = fetched[rank]
        if isinstance(result, BaseException):
            why = (
                f"no answer within {timeout:g} s"
                if isinstance(result, TimeoutError)
                else (f"{type(result).__name__}: {result}")
            )
            entries.append({"rank": rank, "address": by_rank[rank], "error": why})
        else:
            entries.append({"rank": rank, "address": by_rank[rank], "status": result})
    return entries


def forming_entries(forming: Sequence[Any]) -> list[dict[str, Any]]:
    """The entries of the live view for the ranks forming a world (``FormingRank``s, by
    rank): each arrived rank says what it joins and since when, each missing rank that it
    has not arrived. Ranks forming worlds of several sizes are all listed."""
    sizes = sorted({f.world_size for f in forming})
    entries: list[dict[str, Any]] = []
    arrived = {f.rank: f for f in forming}
    for rank in range(max(sizes)):
        f = arrived.get(rank)
        if f is None:
            entries.append(
                {
                    "rank": rank,
                    "error": "has not arrived: init_process_group not called yet, or it "
                    "cannot reach the store",
                }
            )
            continue
        entries.append(
            {
                "rank": rank,
                "forming": {
                    "world_size": f.world_size,
                    "generation": f.generation,
                    "backend": f.backend,
                    "pid": f.pid,
                    "host": f.host,
                    "since": f.since,
                },
            }
        )
    return entries


def _forming_text(entries: Sequence[dict[str, Any]]) -> str:
    forming = [e for e in entries if "forming" in e]
    sizes = sorted({e["forming"]["world_size"] for e in forming})
    here = [e["rank"] for e in forming]
    missing = [e["rank"] for e in entries if "forming" not in e]
    head = (
        f"a world of {sizes[0]} ranks is forming"
        if len(sizes) == 1
        else f"ranks disagree on the world size: {sizes}"
    )
    lines = [
        f"{head}: {_ranks(here)} arrived"
        + (f", {_ranks(missing)} not yet" if missing else ", waiting for each other")
    ]
    now = time.time()
    for entry in entries:
        f = entry.get("forming")
        if f is None:
            lines.append(f"rank {entry['rank']}: {entry['error']}")
        else:
            lines.append(
                f"rank {entry['rank']} (pid {f['pid']} on {f['host']}): in init_process_group "
                f"for {max(0.0, now - f['since']):.1f} s, world_size={f['world_size']}, "
                f"backend={f['backend']!r}, generation {f['generation']}"
            )
    return "\n".join(lines)


def _rank_view(entry: dict[str, Any]) -> dict[str, Any] | None:
    status = entry.get("status")
    if status is None:
        return None
    # The newest of the process's worlds where it has that rank (sorted by creation).
    views = [v for v in status["ranks"] if v["rank"] == entry["rank"]]
    return dict(views[-1]) if views else None


def _op_text(op: dict[str, Any], now: float) -> str:
    since = op["started"] or op["queued"]
    text = f"{op['call']} (group {op['group']} op #{op['seq']}) {op['state']}"
    if op["ended"] is None:
        text += f" for {now - since:.1f} s"
    if op["name"]:
        text += f" [{op['name']}]"
    return text


def format_status(entries: Sequence[dict[str, Any]]) -> str:
    """Say what every rank does, on whom it waits, and show the stacks of those waited for.

    A rank waits on the members of its operation's group that have not issued that
    operation yet (for a receive: its source). The stacks shown are those of the ranks
    waited for, and of every rank when nobody waits on anyone; each process's main thread
    first, aiodist's own threads last. For a world that is forming (entries with
    ``"forming"``), it says which ranks have arrived, since when, and which have not.
    """
    if any("forming" in e for e in entries):
        return _forming_text(entries)
    views = {e["rank"]: _rank_view(e) for e in entries}
    # group -> rank -> the highest sequence number it issued there
    issued: dict[int, dict[int, int]] = {}
    for rank, view in views.items():
        for op in (view or {}).get("recent", []) + (view or {}).get("in_flight", []):
            if not op["p2p"]:
                seqs = issued.setdefault(op["group"], {})
                seqs[rank] = max(seqs.get(rank, -1), op["seq"])
    lines: list[str] = []
    waited_for: set[int] = set()
    for entry in entries:
        rank, view = entry["rank"], views[entry["rank"]]
        if view is None:
            lines.append(f"rank {rank}: {entry.get('error', 'not in the world any more')}")
            continue
        now = float(entry["status"]["time"])
        where = f"rank {rank} (pid {entry['status']['pid']}, {entry['address']})"
        in_flight = view["in_flight"]
        if not in_flight:
            last = view["recent"][-1] if view["recent"] else None
            tail = f"; last: {_op_text(last, now)}" if last else "; no operation yet"
            lines.append(f"{where}: no operation in flight{tail}")
        for op in in_flight:
            if op["p2p"]:
                on = [p for p in op["peers"] if p != rank]
            else:
                seqs = issued.get(op["group"], {})
                on = [p for p in op["peers"] if p != rank and seqs.get(p, -1) < op["seq"]]
            waits = f"; waiting on {_ranks(on)}" if on else ""
            lines.append(f"{where}: {_op_text(op, now)}{waits}")
            waited_for.update(on)
        if view["last_error"] is not None:
            lines.append(f"  last error: {view['last_error']['error']}")
    show = sorted(waited_for) or sorted(r for r, v in views.items() if v is not None)
    for rank in show:
        entry = next(e for e in entries if e["rank"] == rank)
        if "status" not in entry:
            continue
        lines.append(f"\nstacks of rank {rank} (pid {entry['status']['pid']}):")
        for thread, stack in sorted(entry["status"]["stacks"].items(), key=_thread_order):
            lines.append(f"  thread {thread}:")
            lines.extend("    " + line for line in stack.rstrip().splitlines())
    return "\n".join(lines)


def _thread_order(item: tuple[str, str]) -> int:
    # The caller's main thread first, then the others it started, then aiodist's own (its
    # event loop, executors): what the user's code does is what is asked first.
    name = item[0]
    if name == "MainThread":
        return 0
    return 2 if name.startswith(("aiodist-", "asyncio_", "ThreadPoolExecutor")) else 1


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
