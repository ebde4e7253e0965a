"""Store at scale: N simulated ranks rendezvous through one store, aiodist's and torch's.

Each rank is a real store client with its own TCP connection; the ranks are spread over a few
worker processes. A run has two timed phases:

1. connect: every rank opens its client (aiodist: ``TCPStore.create``; torch:
   ``torch.distributed.TCPStore(..., is_master=False)``);
2. rendezvous: every rank ``add``s 1 to a join counter, ``set``s its address, fetches its two
   ring neighbours' addresses with ``multi_get`` (which waits for them) and passes a
   ``barrier`` through the store. The time runs from the start signal to the last rank out.

Configurations (one fresh server process per run):

* ``aiodist``: aiodist's server, aiodist clients (asyncio, one loop per worker, aiodist wire);
* ``torch``: torch's TCPStore server (libuv backend), torch clients (one thread per rank:
  torch's client is blocking, and releases the GIL while it waits);
* ``aiodist-torch``: aiodist's server, the same torch clients: the servers compared alone.

Per run it records the phase times, store calls per second during the rendezvous (4 per
rank), the server's CPU time and peak RSS (``VmHWM``), descriptors open in the server and per
rank in the workers. Cost per rank (server CPU, server memory, time) should stay flat as N
grows.

A second table, ``shrink`` (aiodist's server and clients), times the store's part of a shrink
after a loss: each rank holds its failure domain's leases in the world's namespace
(``aiodist.group._world.FailureDomain``, as every rank of a world does); the last rank's connection
ends without a goodbye (as when its process is killed), and the time runs

1. told: from that until every survivor's domain has heard of it (the store's ``departed``
   key, which every rank watches);
2. agreement: from the start signal until the last survivor is through what
   ``shrink_group(lost_ranks())`` asks of the store: which ranks are gone
   (``aiodist._assembly._membership.gone_for_good``), the vote on the ranks to exclude (``vote``) and
   whether the new world stands once every survivor formed it (``stands``); the new world's
   connections are left out (they are a rendezvous, timed above). Target: 0.5 s at 1024
   ranks. It also counts the store requests each survivor made. Needs torch for the torch configurations (``pip install torch==2.13.0``; without it
they are left out, saying so) and matplotlib for the plot (``pip install -e '.[bench]'``;
without it the results are still written, and the plot skipped).

Usage::

    python bench/scale.py [--ranks 256,1024,4096] [--procs 8] [--repeat 3]
                          [--configs aiodist,torch,aiodist-torch,shrink] [--write]
                          [--out FILE] [--plot FILE]

The table goes to ``scale.md`` and the plot to ``scale.png`` in a temporary folder, or with
``--write`` to ``bench/results/scale.md`` and ``docs/images/scale.png`` (``--out``,
``--plot``: other paths; ``--plot ''``: none); the table first, then the plot. ``--replot
RESULTS`` draws the plot of a results file again, without measuring.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiodist import PrefixStore
from aiodist._util._timeouts import Timeout
from aiodist.store import Value

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
STORE_TIMEOUT = 600.0

_AIODIST_SERVER = """
import asyncio, sys
import aiodist
from aiodist._util._loop import loop_factory

async def main():
    server = await aiodist.TCPStoreServer(expected_clients=int(sys.argv[1])).start("127.0.0.1", 0)
    print(server.port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.aclose()

with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
    runner.run(main())
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

#: config -> (server kind, client kind)
CONFIGS = {
    "aiodist": ("aiodist", "aiodist"),
    "torch": ("torch", "torch"),
    "aiodist-torch": ("aiodist", "torch"),
}
LABELS = {
    "aiodist": "aiodist server, aiodist clients",
    "torch": "torch server (libuv), torch clients",
    "aiodist-torch": "aiodist server, torch clients",
}
#: The configuration of the shrink table (aiodist's server and clients).
SHRINK = "shrink"
#: The key of the simulated shrink's vote (the first vote of the default group).
_VOTE_KEY = "shrink/0/1"


def _address(rank: int) -> bytes:
    return f"10.{(rank >> 16) & 255}.{(rank >> 8) & 255}.{rank & 255}:29500".encode()


def _cpu_seconds(pid: int) -> float:
    """CPU time of a process's live threads so far, in seconds (nanosecond resolution)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that just ended
    return total / 1e9


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# -- worker process ---------------------------------------------------------------------------
class _AiodistRanks:
    """This worker's ranks as aiodist clients, each a coroutine on one event loop."""

    def __init__(self, port: int, ranks: range, world: int) -> None:
        self.port, self.ranks, self.world = port, ranks, world
        self.stores: list[Any] = []

    async def connect(self) -> None:
        import aiodist

        self.stores = await asyncio.gather(
            *(
                aiodist.TCPStore.create(HOST, self.port, timeout=STORE_TIMEOUT, wire="aiodist")
                for _ in self.ranks
            )
        )

    async def rendezvous(self) -> list[float]:
        world = self.world

        async def one(rank: int, store: Any) -> float:
            await store.add("join", 1)
            await store.set(f"addr/{rank}", _address(rank))
            left, right = (rank - 1) % world, (rank + 1) % world
            got = await store.multi_get([f"addr/{left}", f"addr/{right}"])
            if got != [_address(left), _address(right)]:
                raise AssertionError(f"rank {rank} read neighbours {got}")
            await store.barrier("barrier", world)
            return time.monotonic()

        return list(
            await asyncio.gather(*(one(r, s) for r, s in zip(self.ranks, self.stores, strict=True)))
        )

    async def close(self) -> None:
        await asyncio.gather(*(s.aclose() for s in self.stores))
        self.stores = []


class _TorchRanks:
    """This worker's ranks as torch clients, one thread each (torch's client blocks)."""

    def __init__(self, port: int, ranks: range, world: int) -> None:
        import torch.distributed  # noqa: F401  (seconds to import: not inside a phase)

        self.port, self.ranks, self.world = port, ranks, world
        self.stores: dict[int, Any] = {}
        self.ends: dict[int, float] = {}
        self.errors: list[str] = []
        self._go = [threading.Event(), threading.Event(), threading.Event()]
        self._done = [threading.Semaphore(0) for _ in range(3)]
        self.threads = [threading.Thread(target=self._run, args=(r,)) for r in ranks]
        for t in self.threads:
            t.start()

    def _run(self, rank: int) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        world = self.world
        connected = False
        try:
            self._go[0].wait()
            store = dist.TCPStore(
                HOST, self.port, None, False, timedelta(seconds=STORE_TIMEOUT), False
            )
            self.stores[rank] = store
            connected = True
            self._done[0].release()
            self._go[1].wait()
            store.add("join", 1)
            store.set(f"addr/{rank}", _address(rank))
            left, right = (rank - 1) % world, (rank + 1) % world
            got = store.multi_get([f"addr/{left}", f"addr/{right}"])
            if got != [_address(left), _address(right)]:
                raise AssertionError(f"rank {rank} read neighbours {got}")
            store.barrier("barrier", world)
            self.ends[rank] = time.monotonic()
        except BaseException as exc:
            self.errors.append(f"rank {rank}: {exc!r}")
            if not connected:
                self._done[0].release()
        self._done[1].release()
        self._go[2].wait()
        self.stores.pop(rank, None)  # closes the connection

    def _phase(self, i: int) -> None:
        self._go[i].set()
        for _ in self.ranks:
            self._done[i].acquire()
        if self.errors:
            raise RuntimeError("; ".join(self.errors[:3]))

    async def connect(self) -> None:
        await asyncio.to_thread(self._phase, 0)

    async def rendezvous(self) -> list[float]:
        await asyncio.to_thread(self._phase, 1)
        return list(self.ends.values())

    async def close(self) -> None:
        self._go[2].set()
        for t in self.threads:
            await asyncio.to_thread(t.join)


class _Counted(PrefixStore):
    """A namespace of a store that counts the requests made through it."""

    requests = 0

    async def set(self, key: str, value: Value) -> None:
        self.requests += 1
        await super().set(key, value)

    async def get(self, key: str) -> bytes:
        self.requests += 1
        return await super().get(key)

    async def add(self, key: str, amount: int) -> int:
        self.requests += 1
        return await super().add(key, amount)

    async def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        self.requests += 1
        return await super().compare_set(key, expected, desired)

    async def append(self, key: str, value: Value) -> None:
        self.requests += 1
        await super().append(key, value)

    async def check(self, keys: Sequence[str]) -> bool:
        self.requests += 1
        return await super().check(keys)

    async def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        self.requests += 1
        await super().wait(keys, timeout)

    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        self.requests += 1
        return await super().multi_get(keys)

    async def lease(self, key: str, value: Value | None, *, append: bool = False) -> bool:
        self.requests += 1
        return await super().lease(key, value, append=append)


class _ShrinkRanks:
    """This worker's ranks of a world whose last rank is lost: each a store client and a
    failure domain on one event loop."""

    def __init__(self, port: int, ranks: range, world: int) -> None:
        self.port, self.ranks, self.world = port, ranks, world
        self.clients: list[Any] = []
        self.domains: list[Any] = []

    async def connect(self) -> None:
        import aiodist
        from aiodist.group._world import FailureDomain

        self.clients = await asyncio.gather(
            *(
                aiodist.TCPStore.create(HOST, self.port, timeout=STORE_TIMEOUT, wire="aiodist")
                for _ in self.ranks
            )
        )
        self.domains = [
            FailureDomain(
                _Counted("world", client),
                rank,
                self.world,
                on_abort=lambda cause: None,
                on_gone=lambda rank, cause: None,
                hosting=False,
                timeout=STORE_TIMEOUT,
            )
            for rank, client in zip(self.ranks, self.clients, strict=True)
        ]
        for domain in self.domains:
            domain.start()
        await asyncio.gather(*(d.leased() for d in self.domains))

    def _survivors(self) -> list[Any]:
        return [d for d in self.domains if d.rank != self.world - 1]

    async def kill(self) -> float:
        """End the last rank's connection (if it is here) without a goodbye; return when
        every survivor here was told."""
        if self.world - 1 in self.ranks:
            await self.clients[-1].aclose()
        await asyncio.gather(*(d.wait_ended() for d in self._survivors()))
        return time.monotonic()

    async def agree(self) -> tuple[float, list[int]]:
        """Every survivor here through the store's part of ``shrink_group(lost_ranks())``;
        return when the last was, and the requests each made."""
        from aiodist._assembly._membership import gone_for_good, stands, vote
        from aiodist.group._world import FailureDomain

        world = self.world
        survivors = self._survivors()
        before = [d.store.requests for d in survivors]
        # (Every survivor's list of the remaining ranks, which each rank makes for itself
        # in its own process: made once here, where thousands of ranks share two CPUs.)
        remaining = list(range(world - 1))

        async def one(domain: Any) -> None:
            lost = await gone_for_good(domain, range(world), expected=True)
            if lost != [world - 1]:
                raise AssertionError(f"rank {domain.rank} found {lost} lost")
            await vote(domain, _VOTE_KEY, lost, remaining, STORE_TIMEOUT, lambda r: r)
            # The new world's domain, as the rank forms it (its connections left out).
            successor = FailureDomain(
                PrefixStore(f"{_VOTE_KEY}/world", domain.store),
                domain.rank,  # (its rank among the remaining ranks: the lost one is last)
                len(remaining),
                on_abort=lambda cause: None,
                on_gone=lambda rank, cause: None,
                hosting=False,
                timeout=STORE_TIMEOUT,
            )
            why_not = await stands(successor, len(remaining), STORE_TIMEOUT)
            if why_not is not None:
                raise AssertionError(f"rank {domain.rank}: the new world fell: {why_not}")

        await asyncio.gather(*(one(d) for d in survivors))
        end = time.monotonic()
        return end, [d.store.requests - b for d, b in zip(survivors, before, strict=True)]

    async def close(self) -> None:
        # (The world is not left in order: the domains' watches end with their stores, or
        # are cancelled with the loop.)
        await asyncio.gather(*(c.aclose() for c in self.clients))
        self.clients, self.domains = [], []


async def _shrink_job(job: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()

    async def expect(word: str) -> None:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if line.strip() != word:
            raise RuntimeError(f"worker expected {word!r}, got {line!r}")

    ranks = _ShrinkRanks(job["port"], range(job["lo"], job["hi"]), job["world"])
    print("ready", flush=True)
    await expect("connect")
    await ranks.connect()
    print("connected", flush=True)
    await expect("kill")
    print(f"told {await ranks.kill()!r}", flush=True)
    await expect("go")
    end, requests = await ranks.agree()
    print(f"done {end!r} {json.dumps(requests, separators=(',', ':'))}", flush=True)
    await expect("close")
    await ranks.close()


async def _worker_job(job: dict[str, Any]) -> dict[str, Any]:
    loop = asyncio.get_running_loop()

    async def expect(word: str) -> None:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if line.strip() != word:
            raise RuntimeError(f"worker expected {word!r}, got {line!r}")

    ranks = range(job["lo"], job["hi"])
    cls = _AiodistRanks if job["client"] == "aiodist" else _TorchRanks
    group = cls(job["port"], ranks, job["world"])
    fds_before = _fds(os.getpid())
    print("ready", flush=True)
    await expect("connect")
    await group.connect()
    print(f"connected {time.monotonic()!r} {_fds(os.getpid()) - fds_before}", flush=True)
    await expect("go")
    ends = await group.rendezvous()
    print(f"done {max(ends)!r}", flush=True)
    await expect("close")
    await group.close()
    return {}


def _worker_main() -> None:
    import logging

    from aiodist._util._loop import loop_factory

    # (A shrink's survivors each say that a rank went, and the lost rank that it lost the
    # store: thousands of warnings.)
    logging.getLogger("aiodist").setLevel(logging.ERROR)
    for line in sys.stdin:
        job = json.loads(line)
        with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
            runner.run(_shrink_job(job) if job["client"] == SHRINK else _worker_job(job))
        print("closed", flush=True)


# -- orchestration ------------------------------------------------------------------------------
class _Workers:
    def __init__(self, n: int) -> None:
        self.procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(n)
        ]

    def send(self, line: str) -> None:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(line + "\n")
            p.stdin.flush()

    def expect(self, word: str) -> list[list[str]]:
        out = []
        for p in self.procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line.startswith(word):
                raise RuntimeError(f"worker {p.pid} said {line!r}, expected {word!r}")
            out.append(line.split()[1:])
        return out

    def close(self) -> None:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.close()
        for p in self.procs:
            p.wait(timeout=60)


def _start_server(kind: str, world: int) -> tuple[subprocess.Popen[str], int]:
    script = _AIODIST_SERVER if kind == "aiodist" else _TORCH_SERVER
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), str(world)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def run_once(workers: _Workers, config: str, world: int) -> dict[str, float]:
    """One rendezvous of ``world`` ranks in ``config``; returns its measurements."""
    server_kind, client_kind = CONFIGS[config]
    server, port = _start_server(server_kind, world)
    try:
        n = len(workers.procs)
        bounds = [world * i // n for i in range(n + 1)]
        for i, p in enumerate(workers.procs):
            job = {"port": port, "lo": bounds[i], "hi": bounds[i + 1], "world": world,
                   "client": client_kind}  # fmt: skip
            assert p.stdin is not None
            p.stdin.write(json.dumps(job) + "\n")
            p.stdin.flush()
        workers.expect("ready")
        rss_idle = _status_kib(server.pid, "VmRSS")
        fds_idle = _fds(server.pid)
        cpu0 = _cpu_seconds(server.pid)
        t0 = time.monotonic()
        workers.send("connect")
        connected = workers.expect("connected")
        t_connected = max(float(c[0]) for c in connected)
        client_fds = sum(int(c[1]) for c in connected)
        cpu1 = _cpu_seconds(server.pid)
        server_fds = _fds(server.pid) - fds_idle
        t1 = time.monotonic()
        workers.send("go")
        t_done = max(float(d[0]) for d in workers.expect("done"))
        cpu2 = _cpu_seconds(server.pid)
        peak = _status_kib(server.pid, "VmHWM")
        workers.send("close")
        workers.expect("closed")
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(timeout=60)
    rendezvous = t_done - t1
    return {
        "connect_ms": (t_connected - t0) * 1e3,
        "rendezvous_ms": rendezvous * 1e3,
        "calls_s": 4 * world / rendezvous,
        "cpu_connect_us_rank": (cpu1 - cpu0) / world * 1e6,
        "cpu_rdv_us_rank": (cpu2 - cpu1) / world * 1e6,
        "peak_rss_mib": peak / 1024,
        "rss_kib_rank": (peak - rss_idle) / world,
        "server_fds": server_fds,
        "client_fds_rank": client_fds / world,
    }


def run_shrink(workers: _Workers, world: int) -> dict[str, float]:
    """The store's part of a shrink of ``world`` ranks, the last one lost; returns its
    measurements."""
    server, port = _start_server("aiodist", world)
    try:
        n = len(workers.procs)
        bounds = [world * i // n for i in range(n + 1)]
        for i, p in enumerate(workers.procs):
            job = {"port": port, "lo": bounds[i], "hi": bounds[i + 1], "world": world,
                   "client": SHRINK}  # fmt: skip
            assert p.stdin is not None
            p.stdin.write(json.dumps(job) + "\n")
            p.stdin.flush()
        workers.expect("ready")
        workers.send("connect")
        workers.expect("connected")
        t_kill = time.monotonic()
        workers.send("kill")
        t_told = max(float(t[0]) for t in workers.expect("told"))
        cpu0 = _cpu_seconds(server.pid)
        t0 = time.monotonic()
        workers.send("go")
        done = workers.expect("done")
        cpu1 = _cpu_seconds(server.pid)
        workers.send("close")
        workers.expect("closed")
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(timeout=60)
    requests = [r for d in done for r in json.loads(d[1])]
    survivors = world - 1
    return {
        "told_ms": (t_told - t_kill) * 1e3,
        "agreement_ms": (max(float(d[0]) for d in done) - t0) * 1e3,
        "requests_median": statistics.median(requests),
        "requests_max": max(requests),
        "cpu_us_survivor": (cpu1 - cpu0) / survivors * 1e6,
    }


def _raise_open_files() -> None:
    # Children inherit the limit: the servers and the workers all need thousands.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _plot(rows: list[tuple[str, int, dict[str, float]]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)")
        return
    # 8 inches at 100 dpi: shown 800 pixels wide, the 12-point labels are 16 pixels high.
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    styles = {"aiodist": "o-", "torch": "s-", "aiodist-torch": "^--"}
    for config in CONFIGS:
        points = [(n, r) for c, n, r in rows if c == config]
        if not points:
            continue
        xs = [n for n, _ in points]
        ax.plot(
            xs,
            [r["rendezvous_ms"] for _, r in points],
            styles[config],
            label=LABELS[config],
            markersize=7,
            linewidth=2,
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.tick_params(labelsize=12)
    ax.set_xlabel("ranks (one TCP connection each)", fontsize=12)
    ax.set_ylabel("rendezvous time (ms, median)", fontsize=12)
    ax.set_title("Rendezvous through one store: add, set, 2 gets, barrier per rank", fontsize=13)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=12)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    print(f"wrote {path}")


def _read_results(path: Path) -> list[tuple[str, int, dict[str, float]]]:
    """The rendezvous times of a results file this script wrote, as ``_plot`` takes them."""
    configs = {label: config for config, label in LABELS.items()}
    rows = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) > 3 and cells[1] in configs:
            rows.append((configs[cells[1]], int(cells[0]), {"rendezvous_ms": float(cells[3])}))
    if not rows:
        raise SystemExit(f"{path}: no table of bench/scale.py in it")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", default="256,1024,4096")
    parser.add_argument("--procs", type=int, default=8, help="worker processes")
    parser.add_argument("--repeat", type=int, default=3, help="runs per cell (median kept)")
    parser.add_argument("--configs", default=",".join([*CONFIGS, SHRINK]))
    parser.add_argument(
        "--write",
        action="store_true",
        help="write bench/results/scale.md and docs/images/scale.png (else a temp folder)",
    )
    parser.add_argument("--out", help="the results file (overrides --write's)")
    parser.add_argument("--plot", help="the plot ('' for none; overrides --write's)")
    parser.add_argument(
        "--replot", metavar="RESULTS", help="only draw the plot of this results file again"
    )
    args = parser.parse_args()
    if args.worker:
        _worker_main()
        return
    _raise_open_files()
    # Committed results change only on purpose: without --write they go to a fresh folder.
    if args.out is None or args.plot is None:
        folder = ROOT if args.write else Path(tempfile.mkdtemp(prefix="aiodist-bench-"))
        if args.out is None:
            args.out = str(folder / "bench/results/scale.md" if args.write else folder / "scale.md")
        if args.plot is None:
            args.plot = str(
                folder / "docs/images/scale.png" if args.write else folder / "scale.png"
            )
    if args.replot:
        if args.plot:
            _plot(_read_results(Path(args.replot)), Path(args.plot))
        return
    configs = args.configs.split(",")
    if any("torch" in CONFIGS.get(c, ()) for c in configs):
        try:
            import torch  # noqa: F401
        except ImportError:
            print("torch is not installed (pip install torch==2.13.0): the torch rows are left out")
            configs = [c for c in configs if "torch" not in CONFIGS.get(c, ())]
    unknown = [c for c in configs if c not in CONFIGS and c != SHRINK]
    if unknown:
        parser.error(f"unknown configurations {unknown}: expected some of {[*CONFIGS, SHRINK]}")
    worlds = [int(x) for x in args.ranks.split(",")]
    workers = _Workers(args.procs)
    rows: list[tuple[str, int, dict[str, float]]] = []
    shrink_rows: list[tuple[int, dict[str, float]]] = []
    try:
        for world in worlds:
            runs: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
            for _ in range(args.repeat):
                # Interleaved, so that load from elsewhere on the machine hits all alike.
                for config in configs:
                    if config == SHRINK:
                        runs[config].append(run_shrink(workers, world))
                    else:
                        runs[config].append(run_once(workers, config, world))
            for config in configs:
                if config == SHRINK:
                    by_time = sorted(runs[config], key=lambda r: r["agreement_ms"])
                    median = dict(by_time[len(by_time) // 2])
                    median["told_ms"] = statistics.median(r["told_ms"] for r in runs[config])
                    shrink_rows.append((world, median))
                    print(
                        f"{world:5} ranks  {config:13}  told {median['told_ms']:8.1f} ms  "
                        f"agreement {median['agreement_ms']:8.1f} ms  requests per survivor "
                        f"{median['requests_median']:.0f} (max {median['requests_max']:.0f})  "
                        f"server cpu {median['cpu_us_survivor']:6.1f} us/survivor",
                        flush=True,
                    )
                    continue
                by_time = sorted(runs[config], key=lambda r: r["rendezvous_ms"])
                median = dict(by_time[len(by_time) // 2])
                median["connect_ms"] = statistics.median(r["connect_ms"] for r in runs[config])
                rows.append((config, world, median))
                print(
                    f"{world:5} ranks  {config:13}  connect {median['connect_ms']:8.1f} ms  "
                    f"rendezvous {median['rendezvous_ms']:8.1f} ms  "
                    f"{median['calls_s']:8.0f} calls/s  server cpu "
                    f"{median['cpu_connect_us_rank']:6.1f} + {median['cpu_rdv_us_rank']:6.1f} "
                    f"us/rank  peak rss {median['peak_rss_mib']:6.1f} MiB "
                    f"({median['rss_kib_rank']:5.2f} KiB/rank)  fds {median['server_fds']:.0f} "
                    f"server, {median['client_fds_rank']:.2f}/rank",
                    flush=True,
                )
    finally:
        workers.close()
    old = Path(args.out).read_text() if Path(args.out).exists() else ""
    old_rendezvous, _, old_shrink = old.partition(SHRINK_HEADING)
    sections = [_rendezvous_section(args, rows) if rows else old_rendezvous.strip("\n")]
    if shrink_rows:
        sections.append(_shrink_section(args, shrink_rows))
    elif old_shrink:
        sections.append(SHRINK_HEADING + old_shrink)
    text = "\n\n".join(s.strip("\n") for s in sections if s.strip()) + "\n"
    print()
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")
    if args.plot and rows:
        _plot(rows, Path(args.plot))


#: The heading of the shrink table in the results file: a run without the shrink keeps the
#: file's table, and one with the shrink alone keeps the rendezvous tables and their notes.
SHRINK_HEADING = "## Shrink after a loss"


def _rendezvous_section(
    args: argparse.Namespace, rows: list[tuple[str, int, dict[str, float]]]
) -> str:
    lines = [
        "# Store at scale",
        "",
        f"`python bench/scale.py --ranks {args.ranks} --procs {args.procs} --repeat "
        f"{args.repeat}` on {os.cpu_count()} CPUs, loopback; ranks spread over "
        f"{args.procs} worker processes, each rank a client with its own TCP connection; "
        "a fresh server process per run; median of the runs (by rendezvous time). "
        "Rendezvous per rank: add (join), set (address), multi_get (both ring neighbours), "
        "barrier; calls/s = 4 calls per rank over the rendezvous time. Server CPU and memory "
        "per rank cover the connect and rendezvous phases; peak RSS is the server's VmHWM.",
        "",
        "| ranks | configuration | connect (ms) | rendezvous (ms) | calls/s "
        "| server CPU connect (us/rank) | server CPU rendezvous (us/rank) "
        "| server peak RSS (MiB) | server RSS growth (KiB/rank) | server fds "
        "| client fds/rank |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for config, world, r in rows:
        lines.append(
            f"| {world} | {LABELS[config]} | {r['connect_ms']:.1f} | {r['rendezvous_ms']:.1f} "
            f"| {r['calls_s']:.0f} | {r['cpu_connect_us_rank']:.1f} "
            f"| {r['cpu_rdv_us_rank']:.1f} | {r['peak_rss_mib']:.1f} "
            f"| {r['rss_kib_rank']:.2f} | {r['server_fds']:.0f} | {r['client_fds_rank']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def _shrink_section(args: argparse.Namespace, rows: list[tuple[int, dict[str, float]]]) -> str:
    lines = [
        SHRINK_HEADING,
        "",
        f"`python bench/scale.py --ranks {args.ranks} --procs {args.procs} --repeat "
        f"{args.repeat} --configs {SHRINK}` on {os.cpu_count()} CPUs, loopback; aiodist's "
        f"server and clients, ranks spread over {args.procs} worker processes as above, a "
        "fresh server per run; median of the runs (by agreement time). Each rank holds its "
        "failure domain's leases in the world's namespace; the last rank's connection ends "
        "without a goodbye. Told: from then until every survivor's domain heard of it. "
        "Agreement: from the start signal until the last survivor is through the store's "
        "part of `shrink_group(lost_ranks())`: the ranks gone, the vote on the ranks to "
        "exclude, and whether the new world stands once every survivor formed it (the new "
        "world's connections left out). Requests: store requests each survivor made for "
        "it. Target: agreement <= 0.5 s at 1024 ranks.",
        "",
        "| ranks | survivors told (ms) | agreement (ms) | store requests per survivor "
        "(median) | (max) | server CPU (us/survivor) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for world, r in rows:
        lines.append(
            f"| {world} | {r['told_ms']:.1f} | {r['agreement_ms']:.1f} "
            f"| {r['requests_median']:.0f} | {r['requests_max']:.0f} "
            f"| {r['cpu_us_survivor']:.1f} |"
        )
    target = [r for world, r in rows if world == 1024]
    if target:
        ms = target[0]["agreement_ms"]
        verdict = "met" if ms <= 500 else "not met"
        lines += ["", f"Target, agreement <= 500 ms at 1024 ranks: {ms:.0f} ms ({verdict})."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
