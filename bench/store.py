"""Store benchmark: aiodist's TCPStore server against torch's (libuv) in the same run.

For each server, operation (set, get, add) and number of concurrent clients (1, 8, 64, 256)
it reports total ops/s and p50/p99 latency. Clients are aiodist TCPStore connections spread
over a few worker processes, each connection running one request at a time. The same client
code drives both servers over torch's wire, so those rows compare the servers alone; the
aiodist-wire rows show what aiodist clients get from aiodist's server. torch's wire does not
acknowledge ``set``, so torch-wire ``set`` rows time a set followed by a ``check`` of the same
key (one round trip, two requests).

It also times a rendezvous: N clients each ``add`` a counter, the one that brings it to N sets
a key, and everyone ``wait``s for that key; the time is from the start signal until the last
client returns.

aiodist's server runs as a TCPStore that hosts it runs it: on an event loop and thread of its
own (``TCPStoreServer.start(thread=True)``), beside the process's idle main loop; with
``--profile-server``, on the main loop, which cProfile sees.

Usage::

    python bench/store.py [--duration 1.0] [--clients 1,8,64,256] [--rendezvous 64,256]
                          [--procs 4] [--repeat 3] [--write] [--out FILE]

The tables are printed and written to a temporary folder, or with ``--write`` to
``bench/results/store.md`` (``--out``: another path). Without torch
(``pip install torch==2.13.0``) the rows of torch's server are left out; the torch-wire rows
against aiodist's server need no torch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

_AIODIST_SERVER = """
import asyncio, sys
import aiodist
from aiodist._util._loop import loop_factory

async def main(thread):
    server = await aiodist.TCPStoreServer().start("127.0.0.1", 0, thread=thread)
    print(server.port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.aclose()

with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
    if len(sys.argv) > 1:
        import cProfile
        cProfile.run("runner.run(main(False))", sys.argv[1])
    else:
        runner.run(main(True))
"""

_TORCH_SERVER = """
import sys
from datetime import timedelta
import torch.distributed as dist

store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=600),
                      wait_for_workers=False, use_libuv=True)
print(store.port, flush=True)
sys.stdin.read()
"""


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _start_server(kind: str, profile: str | None) -> tuple[subprocess.Popen[str], int]:
    script = _AIODIST_SERVER if kind == "aiodist" else _TORCH_SERVER
    extra = [profile] if profile and kind == "aiodist" else []
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *extra],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


# -- worker process ---------------------------------------------------------------------------
async def _worker_job(job: dict[str, Any]) -> dict[str, Any]:
    import aiodist

    port, wire, conns = job["port"], job["wire"], job["conns"]
    stores = [
        await aiodist.TCPStore.create("127.0.0.1", port, timeout=120, wire=wire)
        for _ in range(conns)
    ]
    tag = f"{os.getpid()}"
    value = b"v" * 32
    for i, s in enumerate(stores):
        await s.set(f"{tag}-{i}", value)
    loop = asyncio.get_running_loop()
    print("ready", flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)  # the start signal
    result: dict[str, Any]
    if job["kind"] == "ops":
        op, duration = job["op"], job["duration"]
        stop_at = time.perf_counter() + duration
        lat: list[float] = []

        async def run(store: aiodist.TCPStore, key: str) -> None:
            perf = time.perf_counter
            while True:
                t0 = perf()
                if op == "get":
                    await store.get(key)
                elif op == "add":
                    await store.add(key + "n", 1)
                elif wire == "torch":
                    await store.set(key, value)
                    await store.check([key])
                else:
                    await store.set(key, value)
                t1 = perf()
                lat.append(t1 - t0)
                if t1 >= stop_at:
                    return

        start = time.perf_counter()
        cpu = time.process_time()
        await asyncio.gather(*(run(s, f"{tag}-{i}") for i, s in enumerate(stores)))
        result = {
            "ops": len(lat),
            "secs": time.perf_counter() - start,
            "lat": lat,
            "cpu": time.process_time() - cpu,
        }
    else:
        ends = []
        for rnd in range(job["rounds"]):
            counter, world = f"{job['name']}-{rnd}", job["world"]
            go = counter + "-go"

            async def join(store: aiodist.TCPStore) -> float:
                if await store.add(counter, 1) == world:  # noqa: B023
                    await store.set(go, b"1")  # noqa: B023
                await store.wait([go])  # noqa: B023
                return time.monotonic()

            ends.append(max(await asyncio.gather(*(join(s) for s in stores))))
            print("round", flush=True)
            if rnd + 1 < job["rounds"]:
                await loop.run_in_executor(None, sys.stdin.readline)
        result = {"ends": ends}
    for s in stores:
        await s.aclose()
    return result


def _worker_main() -> None:
    from aiodist._util._loop import loop_factory

    for line in sys.stdin:
        job = json.loads(line)
        with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
            result = runner.run(_worker_job(job))
        # Results can be large (every latency): pass them through a file, not the pipe.
        path = Path(job["result_dir"]) / f"{os.getpid()}.json"
        path.write_text(json.dumps(result))
        print(f"result {path}", flush=True)


class _Workers:
    def __init__(self, n: int) -> None:
        self.tmp = tempfile.mkdtemp(prefix="aiodist-bench-")
        self.procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(n)
        ]

    def _send(self, procs: list[subprocess.Popen[str]], line: str) -> None:
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(line + "\n")
            p.stdin.flush()

    def _expect(self, procs: list[subprocess.Popen[str]], word: str) -> list[str]:
        lines = []
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line.startswith(word):
                raise RuntimeError(f"worker said {line!r}, expected {word!r}")
            lines.append(line[len(word) :].strip())
        return lines

    def ops(self, port: int, wire: str, op: str, clients: int, duration: float) -> dict[str, Any]:
        procs = self.procs[: min(len(self.procs), clients)]
        per = [clients // len(procs) + (i < clients % len(procs)) for i in range(len(procs))]
        for p, conns in zip(procs, per, strict=True):
            job = {"kind": "ops", "port": port, "wire": wire, "op": op, "conns": conns,
                   "result_dir": self.tmp}  # fmt: skip
            self._send([p], json.dumps({**job, "duration": duration}))
        self._expect(procs, "ready")
        self._send(procs, "go")
        results = [json.loads(Path(r).read_text()) for r in self._expect(procs, "result")]
        lat = sorted(x for r in results for x in r["lat"])
        ops = sum(r["ops"] for r in results)
        secs = max(r["secs"] for r in results)
        return {
            "ops_s": ops / secs,
            "p50_us": lat[len(lat) // 2] * 1e6,
            "p99_us": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6,
            "secs": secs,
            "client_cpu_us": sum(r["cpu"] for r in results) / ops * 1e6,
        }

    def rendezvous(self, port: int, wire: str, world: int, rounds: int) -> float:
        procs = self.procs
        name = f"rdv-{wire}-{world}"
        per = [world // len(procs) + (i < world % len(procs)) for i in range(len(procs))]
        for p, conns in zip(procs, per, strict=True):
            job = {"kind": "rdv", "port": port, "wire": wire, "conns": conns, "name": name,
                   "result_dir": self.tmp}  # fmt: skip
            self._send([p], json.dumps({**job, "world": world, "rounds": rounds}))
        self._expect(procs, "ready")
        starts = []
        for _ in range(rounds):
            starts.append(time.monotonic())
            self._send(procs, "go")
            self._expect(procs, "round")
        results = [json.loads(Path(r).read_text()) for r in self._expect(procs, "result")]
        times = [max(r["ends"][i] for r in results) - starts[i] for i in range(rounds)]
        return statistics.median(times[1:] if rounds > 1 else times)  # round 0 warms up

    def close(self) -> None:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.close()
        for p in self.procs:
            p.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--duration", type=float, default=1.0)
    parser.add_argument("--clients", default="1,8,64,256")
    parser.add_argument("--rendezvous", default="64,256")
    parser.add_argument("--ops", default="set,get,add")
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3, help="runs per cell (median kept)")
    parser.add_argument("--profile-server", help="write a cProfile of aiodist's server here")
    parser.add_argument(
        "--write", action="store_true", help="write bench/results/store.md (else a temp folder)"
    )
    parser.add_argument("--out", help="the results file (overrides --write's)")
    args = parser.parse_args()
    if args.worker:
        _worker_main()
        return
    # Committed results change only on purpose: without --write they go to a fresh folder.
    if args.out is None:
        args.out = str(
            Path(__file__).resolve().parent / "results" / "store.md"
            if args.write
            else Path(tempfile.mkdtemp(prefix="aiodist-bench-"), "store.md")
        )
    configs = [("aiodist", "aiodist"), ("aiodist", "torch"), ("torch", "torch")]
    try:
        import torch  # noqa: F401
    except ImportError:
        print("torch is not installed (pip install torch==2.13.0): torch's server is left out")
        configs.remove(("torch", "torch"))
    kinds = dict.fromkeys(server for server, _ in configs)
    servers = {kind: _start_server(kind, args.profile_server) for kind in kinds}
    workers = _Workers(args.procs)
    rows = []
    rdv_rows = []
    try:
        for op in args.ops.split(","):
            for n in (int(x) for x in args.clients.split(",")):
                # Each cell is the median of --repeat runs, interleaved across the servers so
                # that load from other processes on the machine hits them alike.
                runs: dict[tuple[str, str], list[dict[str, Any]]] = {c: [] for c in configs}
                for _ in range(args.repeat):
                    for server, wire in configs:
                        pid = servers[server][0].pid
                        cpu = _cpu_seconds(pid)
                        one = workers.ops(servers[server][1], wire, op, n, args.duration)
                        cpu = _cpu_seconds(pid) - cpu
                        one["cpu_us"] = cpu / (one["ops_s"] * one["secs"]) * 1e6
                        runs[server, wire].append(one)
                for server, wire in configs:
                    ranked = sorted(runs[server, wire], key=lambda x: x["ops_s"])
                    r = ranked[len(ranked) // 2]
                    rows.append((op, n, server, wire, r))
                    print(
                        f"{op:4} {n:4} clients  {server:7} server, {wire:7} wire: "
                        f"{r['ops_s']:9.0f} ops/s  p50 {r['p50_us']:7.0f} us  "
                        f"p99 {r['p99_us']:7.0f} us  server cpu {r['cpu_us']:5.1f} us/op  "
                        f"client cpu {r['client_cpu_us']:5.1f} us/op",
                        flush=True,
                    )
        for n in (int(x) for x in args.rendezvous.split(",") if x):
            for server, wire in configs:
                t = workers.rendezvous(servers[server][1], wire, n, rounds=2 + 2 * args.repeat)
                rdv_rows.append((n, server, wire, t))
                print(f"rendezvous {n:4}  {server:7} server, {wire:7} wire: {t * 1e3:.1f} ms")
    finally:
        workers.close()
        for proc, _port in servers.values():
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(timeout=30)
    lines = [
        "# Store benchmark",
        "",
        f"`python bench/store.py --duration {args.duration} --repeat {args.repeat}` on "
        f"{os.cpu_count()} CPUs (median of {args.repeat} interleaved runs per cell), "
        f"loopback, clients in {args.procs} processes, one request at a time per connection. "
        "torch server = torch's TCPStore (libuv backend). torch-wire `set` = set + check. "
        "Server CPU: the server process's CPU time over the operations; client CPU: the "
        "worker processes' (they share the 2 CPUs with the server).",
        "",
        "| op | clients | server | wire | ops/s | p50 (us) | p99 (us) | server CPU (us/op) "
        "| client CPU (us/op) |",
        "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for op, n, server, wire, r in rows:
        lines.append(
            f"| {op} | {n} | {server} | {wire} | {r['ops_s']:.0f} | {r['p50_us']:.0f} "
            f"| {r['p99_us']:.0f} | {r['cpu_us']:.1f} | {r['client_cpu_us']:.1f} |"
        )
    lines += [
        "",
        "Rendezvous (N clients add a counter, the last sets a key, all wait on it; median of "
        f"{1 + 2 * args.repeat} rounds after a warm-up round):",
        "",
        "| clients | server | wire | time (ms) |",
        "| ---: | --- | --- | ---: |",
    ]
    lines += [f"| {n} | {s} | {w} | {t * 1e3:.1f} |" for n, s, w, t in rdv_rows]
    table = "\n".join(lines) + "\n"
    print()
    print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(table)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
