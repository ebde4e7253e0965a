"""The serving examples under load: requests/s and latency, /health while a worker stalls,
and how long a killed worker costs.

Each example (``examples/serving_aiohttp.py``, ``examples/serving_fastapi.py``) runs under
``aiodist-run --standalone --nproc-per-node=3`` on uvloop and on the standard loop
(``AIODIST_LOOP``); this process is the client (aiohttp's, on uvloop), over loopback:

- **load**: a fixed number of ``POST /predict`` requests (a 4 x 16 float32 batch each,
  every answer checked against numpy) at concurrency 1, 8 and 32: requests/s, p50, p99;
- **stall**: at concurrency 8, worker rank 2 is stopped (SIGSTOP) for 2 s while requests
  are in flight, so a collective waits on it; meanwhile ``GET /health`` is asked every
  10 ms on a connection of its own: its p50/p99/max while the worker is stopped, and the
  longest request;
- **faults** (``--faults N``): the ranks as separate processes around a store hosted here
  (as a launcher that restarts only the failed worker would): rank 1 is stopped, a request
  sent, rank 1 SIGKILLed; seconds from the kill to the request's 503 and to /health's
  503, and from starting rank 1 again to the next correct answer.

    unshare -n bash -c 'ip link set lo up && .venv/bin/python bench/serving.py'

(``unshare -n`` needs root; ``unshare -rn`` works without.) The tables are printed and written
to a temporary folder, or with ``--write`` to ``bench/results/serving.md`` (``--out``: another
path).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import uvloop

from aiodist.testing import free_port

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from serving_helpers import (  # noqa: E402  (the path above)
    EXAMPLES,
    Client,
    Launched,
    Ranks,
    descendants,
    load_example,
    ready,
    reference,
    wait_until,
)

BATCH = 4


def rank_of(pid: int) -> int | None:
    try:
        for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if entry.startswith(b"RANK="):
                return int(entry[5:])
    except OSError:
        pass
    return None


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q)) if values else float("nan")


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


async def post(session: aiohttp.ClientSession, url: str, x: np.ndarray) -> tuple[int, Any]:
    async with session.post(url, data=json.dumps({"x": x.tolist()})) as r:
        return r.status, json.loads(await r.read())


async def load(
    session: aiohttp.ClientSession,
    url: str,
    weights: tuple[np.ndarray, np.ndarray],
    requests: int,
    concurrency: int,
) -> dict[str, Any]:
    """``requests`` requests from ``concurrency`` tasks; latencies, rate, wrong answers."""
    rng = np.random.default_rng(concurrency)
    xs = [rng.standard_normal((BATCH, 16)).astype(np.float32) for _ in range(64)]
    expected = [reference(x, weights) for x in xs]
    latencies: list[float] = []
    wrong = 0
    todo = iter(range(requests))

    async def worker() -> None:
        nonlocal wrong
        for i in todo:
            x = xs[i % len(xs)]
            t = time.perf_counter()
            status, body = await post(session, url, x)
            latencies.append(time.perf_counter() - t)
            y = np.array(body["y"], np.float32) if status == 200 else None
            if y is None or not np.allclose(y, expected[i % len(xs)], rtol=1e-5, atol=1e-5):
                wrong += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return {
        "rps": requests / wall,
        "p50": percentile(latencies, 50),
        "p99": percentile(latencies, 99),
        "wrong": wrong,
    }


async def stall(
    job: Launched, port: int, weights: tuple[np.ndarray, np.ndarray], seconds: float
) -> dict[str, Any]:
    """/health latency while worker rank 2 is stopped under a concurrency-8 load."""
    assert job.proc is not None
    pids = {rank_of(p): p for p in descendants(job.proc.pid)}
    url = f"http://127.0.0.1:{port}"
    health: list[tuple[float, float, int]] = []  # (start, latency, status)
    requests: list[float] = []
    stop = asyncio.Event()
    x = np.ones((BATCH, 16), np.float32)

    async def poll_health() -> None:
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                t = time.perf_counter()
                async with session.get(url + "/health") as r:
                    await r.read()
                    health.append((t, time.perf_counter() - t, r.status))
                await asyncio.sleep(0.01)

    async def keep_loading(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            t = time.perf_counter()
            status, body = await post(session, url + "/predict", x)
            requests.append(time.perf_counter() - t)
            assert status == 200, body
            np.testing.assert_allclose(
                np.array(body["y"], np.float32), reference(x, weights), rtol=1e-5, atol=1e-5
            )

    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.ensure_future(keep_loading(session)) for _ in range(8)]
        poller = asyncio.ensure_future(poll_health())
        await asyncio.sleep(1.0)
        os.kill(pids[2], signal.SIGSTOP)
        stopped = time.perf_counter()
        await asyncio.sleep(seconds)
        os.kill(pids[2], signal.SIGCONT)
        resumed = time.perf_counter()
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*tasks, poller)
    during = [lat for t, lat, _ in health if stopped <= t < resumed]
    return {
        "latencies": during,
        "not_200": sum(1 for t, _, s in health if stopped <= t < resumed and s != 200),
        "longest_request": max(requests),
    }


async def faults(example: str, kind: str, repeats: int) -> list[dict[str, float]]:
    """Kill rank 1 mid-request and start it again, ``repeats`` times in one job."""
    weights = load_example(example).weights()
    x = np.ones((BATCH, 16), np.float32)
    port = free_port()
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        async with (
            Ranks(EXAMPLES / example, 3, Path(logs), PORT=str(port)) as ranks,
            Client(kind, port) as client,
        ):
            for rank in range(3):
                await ranks.start(rank)
            await ready(client)
            for _ in range(repeats):
                ranks.signal(1, signal.SIGSTOP)

                async def timed() -> tuple[int, float]:
                    status, _ = await client.predict(x)
                    return status, time.perf_counter()

                request = asyncio.ensure_future(timed())
                await asyncio.sleep(0.3)
                ranks.signal(1, signal.SIGKILL)
                killed = time.perf_counter()

                async def unhealthy() -> float | None:
                    status, _ = await client.health()
                    return time.perf_counter() if status == 503 else None

                seen = await wait_until(unhealthy, 10, "/health 503", 0.005)
                status, failed = await request
                assert status == 503
                await ranks.start(1)
                restarted = time.perf_counter()

                async def answered() -> float | None:
                    status, body = await client.predict(x)
                    if status != 200:
                        return None
                    y = np.array(body["y"], np.float32)
                    assert np.allclose(y, reference(x, weights), rtol=1e-5, atol=1e-5)
                    return time.perf_counter()

                back = await wait_until(answered, 20, "an answer after the restart", 0.01)
                rows.append(
                    {
                        "request failed": failed - killed,
                        "health 503": seen - killed,
                        "answering again": back - restarted,
                    }
                )
    return rows


async def run_job(
    example: str, loop: str, args: argparse.Namespace, concurrency: list[int]
) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    """One job of ``example`` on ``loop``: every load cell, then the stall."""
    weights = load_example(example).weights()
    port = free_port()
    cells = {}
    with tempfile.TemporaryDirectory() as tmp:
        launched = Launched(
            EXAMPLES / example, 3, Path(tmp) / "job.log", PORT=str(port), AIODIST_LOOP=loop
        )
        async with launched as job, Client("aiohttp", port) as client:
            await ready(client)
            url = f"http://127.0.0.1:{port}/predict"
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
                await load(session, url, weights, 200, 8)  # warm up
                for c in concurrency if args.requests else []:
                    cells[c] = await load(session, url, weights, args.requests, c)
            stalled = await stall(job, port, weights, args.stall)
    return cells, stalled


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--requests", type=int, default=1000, help="requests per load cell (0: no load cells)"
    )
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--examples", default="aiohttp,fastapi")
    parser.add_argument("--loops", default="uvloop,asyncio")
    parser.add_argument("--repeat", type=int, default=3, help="jobs per example and loop")
    parser.add_argument("--stall", type=float, default=2.0, help="seconds rank 2 is stopped")
    parser.add_argument("--faults", type=int, default=5, help="kill/restart rounds per example")
    parser.add_argument(
        "--write", action="store_true", help="write bench/results/serving.md (else a temp folder)"
    )
    parser.add_argument("--out", type=Path, help="the results file (overrides --write's)")
    args = parser.parse_args()
    # Committed results change only on purpose: without --write they go to a fresh folder.
    if args.out is None:
        args.out = (
            ROOT / "bench" / "results" / "serving.md"
            if args.write
            else Path(tempfile.mkdtemp(prefix="aiodist-bench-"), "serving.md")
        )
    concurrency = [int(c) for c in args.concurrency.split(",")]
    clients = {"aiohttp": "aiohttp", "fastapi": "httpx"}
    names, loops = args.examples.split(","), args.loops.split(",")
    args.load_before = os.getloadavg()[0]

    # The loops take turns, so that load from elsewhere on the machine falls on both.
    loads: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    stalls: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rep in range(args.repeat):
        for name in names:
            for loop in loops if rep % 2 == 0 else loops[::-1]:
                cells, stalled = await run_job(f"serving_{name}.py", loop, args, concurrency)
                for c, row in cells.items():
                    loads.setdefault((name, loop, c), []).append(row)
                stalls.setdefault((name, loop), []).append(stalled)
                print(rep, name, loop, cells, stalled, flush=True)
    fault_rows = []
    for name in names if args.faults else []:
        rows = await faults(f"serving_{name}.py", clients[name], args.faults)
        fault_rows.append((name, rows))
        print(name, "faults", rows, flush=True)

    load_rows = [
        (name, loop, c, {k: statistics.median(r[k] for r in runs) for k in ("rps", "p50", "p99")}
         | {"wrong": sum(r["wrong"] for r in runs)})
        for (name, loop, c), runs in loads.items()
    ]  # fmt: skip
    stall_rows = []
    for (name, loop), runs in stalls.items():
        during = [lat for r in runs for lat in r["latencies"]]
        stall_rows.append(
            (
                name,
                loop,
                {
                    "samples": len(during),
                    "p50": percentile(during, 50),
                    "p99": percentile(during, 99),
                    "max": max(during),
                    "not_200": sum(r["not_200"] for r in runs),
                    "longest_request": max(r["longest_request"] for r in runs),
                },
            )
        )
    args.load_after = os.getloadavg()[0]
    text = report(args, load_rows, stall_rows, fault_rows)
    print(text)
    args.out.write_text(text)
    print(f"wrote {args.out}")


def report(
    args: argparse.Namespace,
    load_rows: list[tuple[str, str, int, dict[str, Any]]],
    stall_rows: list[tuple[str, str, dict[str, Any]]],
    fault_rows: list[tuple[str, list[dict[str, float]]]],
) -> str:
    lines = [
        "# Serving",
        "",
        f"`python bench/serving.py` ({platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}): the examples under `aiodist-run --standalone "
        "--nproc-per-node=3` (rank 0 serves HTTP, ranks 1 and 2 hold the shards), the client "
        "in the benchmark's process (aiohttp, uvloop), all on one machine over loopback. "
        f"Each request is a {BATCH} x 16 float32 batch; every answer is checked against numpy. "
        "The machine's load average (other work included) was "
        f"{args.load_before:.1f} at the start and {args.load_after:.1f} at the end.",
    ]
    if load_rows:
        lines += [
            "",
            f"## Load ({args.requests} requests per row)",
            "",
            f"Median of {args.repeat} jobs per server and loop (the loops took turns).",
            "",
            "| server | loop | concurrency | requests/s | p50 (ms) | p99 (ms) | wrong answers |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
    for name, loop, c, row in load_rows:
        lines.append(
            f"| {name} | {loop} | {c} | {row['rps']:.0f} | {ms(row['p50'])} | "
            f"{ms(row['p99'])} | {row['wrong']} |"
        )
    if load_rows:
        lines += [
            "",
            "Standard loop against uvloop, p50 at concurrency 8 (target: at most 1.3x):",
            "",
        ]
    for name in dict.fromkeys(r[0] for r in load_rows):
        p50 = {loop: row["p50"] for n, loop, c, row in load_rows if n == name and c == 8}
        if "uvloop" in p50 and "asyncio" in p50:
            lines.append(f"- {name}: {p50['asyncio'] / p50['uvloop']:.2f}x")
    lines += [
        "",
        f"## /health while worker rank 2 is stopped for {args.stall:g} s",
        "",
        "Concurrency-8 load; `GET /health` every 10 ms on its own connection; the columns "
        "count only the health checks sent while rank 2 was stopped, pooled over "
        f"{args.repeat} jobs (target: p99 at most 5 ms).",
        "",
        "| server | loop | health checks | p50 (ms) | p99 (ms) | max (ms) | not 200 | longest request (s) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, loop, row in stall_rows:
        lines.append(
            f"| {name} | {loop} | {row['samples']} | {ms(row['p50'])} | {ms(row['p99'])} | "
            f"{ms(row['max'])} | {row['not_200']} | {row['longest_request']:.2f} |"
        )
    if fault_rows:
        lines += [
            "",
            "## A worker killed mid-request, then restarted",
            "",
            "Seconds, median (max) of the rounds: from the SIGKILL of rank 1 (stopped, with a "
            "request waiting on it) to that request's 503 and to `/health` answering 503; from "
            "starting rank 1 again (a new Python process) to the next correct answer. Rank 0 "
            "keeps running and rebuilds the group in-process (target: each under 2 s).",
            "",
            "| server | rounds | request failed | /health 503 | answering again |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for name, rows in fault_rows:
            cells = []
            for key in ("request failed", "health 503", "answering again"):
                values = [r[key] for r in rows]
                cells.append(f"{statistics.median(values):.2f} ({max(values):.2f})")
            lines.append(f"| {name} | {len(rows)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    uvloop.run(main())
