"""Running the serving examples as real processes for the HTTP tests and the benchmark.

Two ways: :class:`Launched` runs a script under ``aiodist-run`` (as a user would); :class:`Ranks`
starts each rank as a process of its own around a store this process hosts, as a launcher
with a restart-only-the-failed-worker policy would, so a test can stop, kill and restart
one worker while rank 0 keeps running.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import httpx
import numpy as np

import aiodist

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
_JOB_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any job's variables, plus ``extra``."""
    drop = ("PET_", "TORCHELASTIC_", "AIODIST_", "GROUP_", "ROLE_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop) and k not in _JOB_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def load_example(name: str) -> ModuleType:
    """Import an example script as a module (its ``__main__`` part does not run)."""
    path = EXAMPLES / name
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference(x: np.ndarray, weights: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """The examples' MLP written out in one process: relu(x @ w1) @ w2."""
    w1, w2 = weights
    return np.maximum(x @ w1, 0) @ w2


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


async def joins(store: aiodist.Store, world_size: int) -> int:
    """How many times the ranks of a world of ``world_size`` joined the default group."""
    keys = [f"aiodist/default_pg/joined/{world_size}/{r}" for r in range(world_size)]
    return sum([await store.add(key, 0) for key in keys])


async def wait_until(predicate: Any, timeout: float, what: str, poll: float = 0.05) -> Any:
    """Call ``await predicate()`` until it returns something true; return that."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = await predicate()
        except (TimeoutError, OSError) as exc:  # the server is not up yet
            last = exc
        if last and not isinstance(last, BaseException):
            return last
        await asyncio.sleep(poll)
    raise AssertionError(f"{what}: not within {timeout} s (last: {last!r})")


class Launched:
    """``aiodist-run --standalone --nproc-per-node=N [args] script`` as a process, output to a file."""

    def __init__(
        self, script: Path, nproc: int, log: Path, args: tuple[str, ...] = (), **env: str
    ) -> None:
        self.script, self.nproc, self.log, self.args, self.env = script, nproc, log, args, env
        self.proc: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> Launched:
        with self.log.open("wb") as out:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "aiodist.run", "--standalone",
                f"--nproc-per-node={self.nproc}", *self.args, str(self.script),
                env=clean_env(**self.env), stdout=out, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        return self

    async def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM the launcher (it forwards it) and wait; return its exit code."""
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(self.proc.wait(), timeout)

    async def __aexit__(self, *exc: object) -> None:
        assert self.proc is not None
        left = descendants(self.proc.pid)
        try:
            await self.stop(30)
        finally:
            for pid in [self.proc.pid, *left]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


class Ranks:
    """The ranks of a job as separate processes around a store hosted here.

    Every rank gets torchrun's environment with ``TORCHELASTIC_USE_AGENT_STORE=True`` (as
    under ``aiodist-run``), so a rank can be killed and started again while the store and
    the other ranks stay up.
    """

    def __init__(self, script: Path, size: int, logs: Path, **env: str) -> None:
        self.script, self.size, self.logs, self.env = script, size, logs, env
        self.store: aiodist.TCPStore | None = None
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self._starts: dict[int, int] = {}

    async def __aenter__(self) -> Ranks:
        self.store = await aiodist.TCPStore.create("127.0.0.1", 0, is_master=True, timeout=60)
        return self

    async def start(self, rank: int) -> asyncio.subprocess.Process:
        assert self.store is not None
        n = self._starts[rank] = self._starts.get(rank, -1) + 1
        env = clean_env(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(self.size),
            LOCAL_WORLD_SIZE=str(self.size), MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(self.store.port), TORCHELASTIC_USE_AGENT_STORE="True", **self.env,
        )  # fmt: skip
        with (self.logs / f"rank{rank}.{n}.log").open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, str(self.script), env=env, stdout=out,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.procs[rank] = proc
        return proc

    def signal(self, rank: int, signum: int) -> None:
        self.procs[rank].send_signal(signum)

    async def __aexit__(self, *exc: object) -> None:
        procs = list(self.procs.values())
        for proc in procs:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), 20)
        finally:
            for proc in procs:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            assert self.store is not None
            await self.store.aclose()

    def output(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')}"
            for p in sorted(self.logs.glob("*.log"))
        )


class Client:
    """One interface over aiohttp's client and httpx: ``(status, JSON body)`` per request.

    A connection that fails (refused, or closed by a server shutting down) raises
    ``ConnectionError`` with either client.
    """

    def __init__(self, kind: str, port: int) -> None:
        self.kind, self.base = kind, f"http://127.0.0.1:{port}"
        self._aiohttp: aiohttp.ClientSession | None = None
        self._httpx: httpx.AsyncClient | None = None

    async def __aenter__(self) -> Client:
        if self.kind == "aiohttp":
            self._aiohttp = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        else:
            self._httpx = httpx.AsyncClient(timeout=30)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._aiohttp is not None:
            await self._aiohttp.close()
        if self._httpx is not None:
            await self._httpx.aclose()

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, Any]:
        url = self.base + path
        try:
            if self._aiohttp is not None:
                async with self._aiohttp.request(method, url, data=body) as r:
                    return r.status, json.loads(await r.read())
            assert self._httpx is not None
            response = await self._httpx.request(method, url, content=body)
            return response.status_code, response.json()
        except (aiohttp.ClientConnectionError, httpx.TransportError) as exc:
            raise ConnectionError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc

    async def health(self) -> tuple[int, Any]:
        return await self.request("GET", "/health")

    async def text(self, path: str) -> tuple[int, str, str]:
        """``GET path``: the status, the content type and the body as text."""
        if self._aiohttp is not None:
            async with self._aiohttp.get(self.base + path) as r:
                return r.status, r.headers["Content-Type"], await r.text()
        assert self._httpx is not None
        response = await self._httpx.get(self.base + path)
        return response.status_code, response.headers["Content-Type"], response.text

    async def predict(self, x: np.ndarray) -> tuple[int, Any]:
        return await self.request("POST", "/predict", json.dumps({"x": x.tolist()}).encode())


def error_text(body: Any) -> str:
    """The error message of a 4xx/5xx body: aiohttp's examples say "error", FastAPI "detail"."""
    return str(body.get("error", body.get("detail")))


async def ready(client: Client, timeout: float = 60) -> dict[str, Any]:
    async def healthy() -> dict[str, Any] | None:
        status, body = await client.health()
        return body if status == 200 else None

    body: dict[str, Any] = await wait_until(healthy, timeout, "the server became ready")
    return body
