"""Per-call latency of small operations: aiodist against Open MPI and gloo, in one run.

Run (in a private network namespace: torch's store does reverse DNS):

    unshare -n bash -c 'ip link set lo up && .venv/bin/python bench/latency.py'

Options: ``--ranks 2,4``, ``--transports shm,tcp``, ``--calls 2000`` (per round), ``--rounds
5``, ``--loop auto|asyncio``; the results go to a temporary folder, or with ``--write`` to
``bench/results/latency.md`` and ``docs/images/latency.png`` (``--out``, ``--plot``: other
paths; ``--plot ''``: none). The results file is written before the plot, which needs
matplotlib (``pip install -e '.[bench]'``); ``--replot RESULTS`` draws the plot of a results
file again without measuring. The gloo column needs torch (``pip install torch==2.13.0``),
the MPI column ``mpirun`` and mpi4py (``apt-get install -y openmpi-bin libopenmpi-dev``,
``pip install mpi4py``); without them the script leaves those columns out and says why.

Every world of the run is one launch (one process per rank, all on this host: ``mpirun``
when MPI is there) in which each process joins every library at once, and every row times
them round after round in turn, so that a change in the machine's load hits them alike:

* ``async``: aiodist's async API, ``await aiodist.all_reduce(x)``;
* ``sync``: ``aiodist.sync``, the blocking facade a ported torch script uses;
* ``gloo``: ``torch.distributed`` with gloo, on tensors sharing the numpy arrays' memory;
* ``MPI``: mpi4py over Open MPI.

A world runs on one transport: ``shm`` is each library's default on one host (aiodist's
node workspace, Open MPI's shared-memory BTL); ``tcp`` is loopback TCP for all
(``AIODIST_SHM=0``; Open MPI with ``--mca btl tcp,self``). gloo always uses TCP.

Each round is timed twice, after a barrier that lines the ranks up (MPI's, or
``aiodist.sync``'s without MPI). *Back to back*, as the OSU micro-benchmarks and MPI users
quote it: ``--calls`` calls timed as one loop, divided by the count, which includes the slow
calls and the ranks drifting apart; a cell is the median over the rounds of the slowest rank's
average. *Per call*: each call timed on its own (``perf_counter`` around it); a cell is the
median and the 99th percentile of every call of every round, on the slowest rank (for
ping-pong: rank 0's round trip, the other ranks wait). ``spread`` is the largest over the
smallest of the per-round medians. ``idle CPU`` is the
share of one CPU a process used while its aiodist worlds (one of each kind) had nothing to
do: during the first second after the last operation, and during the next one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import importlib.util
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
from compare import mpi_available  # (bench/ is the script's directory)

LIBS = ("async", "sync", "gloo", "MPI")
#: Row name -> (operation, bytes).
ROWS = {
    "all_reduce 8 B": ("all_reduce", 8),
    "all_reduce 1 KiB": ("all_reduce", 1024),
    "all_reduce 64 KiB": ("all_reduce", 65536),
    "broadcast 8 B": ("broadcast", 8),
    "barrier": ("barrier", 0),
    "send/recv 8 B round trip": ("pingpong", 8),
}
WARMUP = 50
#: Row names on the plot's axis.
SHORT = {
    "all_reduce 8 B": "all_reduce\n8 B",
    "all_reduce 1 KiB": "all_reduce\n1 KiB",
    "all_reduce 64 KiB": "all_reduce\n64 KiB",
    "broadcast 8 B": "broadcast\n8 B",
    "send/recv 8 B round trip": "send/recv\nround trip",
}


# -- one rank -----------------------------------------------------------------------------------


def _calls(rank: int, comm: Any, aio: Any, libs: list[str]) -> dict[str, dict[str, Any]]:
    """The operations of every row, per library of ``libs``: a callable doing one call (an
    awaitable for ``async``)."""
    from aiodist import sync

    torch = dist = MPI = None
    if "gloo" in libs:
        import torch
        import torch.distributed as dist
    if "MPI" in libs:
        from mpi4py import MPI

    table: dict[str, dict[str, Any]] = {}
    for row, (op, size) in ROWS.items():
        x = np.zeros(max(size // 8, 1), np.float64)  # (zeros: sums never overflow)
        t = torch.from_numpy(x) if torch is not None else None
        if op == "all_reduce":
            table[row] = {
                "async": lambda x=x: aio.all_reduce(x),
                "sync": lambda x=x: sync.all_reduce(x),
                "gloo": lambda t=t: dist.all_reduce(t),
                "MPI": lambda x=x: comm.Allreduce(MPI.IN_PLACE, x),
            }
        elif op == "broadcast":
            table[row] = {
                "async": lambda x=x: aio.broadcast(x, src=0),
                "sync": lambda x=x: sync.broadcast(x, src=0),
                "gloo": lambda t=t: dist.broadcast(t, src=0),
                "MPI": lambda x=x: comm.Bcast(x, root=0),
            }
        elif op == "barrier":
            table[row] = {"async": aio.barrier, "sync": sync.barrier}
            if dist is not None:
                table[row]["gloo"] = dist.barrier
            if comm is not None:
                table[row]["MPI"] = comm.Barrier
        else:
            table[row] = _pingpong(rank, x, t, comm, aio)
        table[row] = {lib: fn for lib, fn in table[row].items() if lib in libs}
    return table


def _pingpong(rank: int, x: np.ndarray, t: Any, comm: Any, aio: Any) -> dict[str, Any]:
    """Rank 0 sends to rank 1 and waits for the answer; rank 1 answers; the others idle."""
    from aiodist import sync

    if t is not None:
        import torch.distributed as dist

    if rank > 1:

        async def idle() -> None:
            return None

        return dict.fromkeys(LIBS, lambda: None) | {"async": idle}
    peer = 1 - rank
    pairs = {  # (send, receive) of each library
        "async": (lambda: aio.send(x, dst=peer), lambda: aio.recv(x, src=peer)),
        "sync": (lambda: sync.send(x, dst=peer), lambda: sync.recv(x, src=peer)),
    }
    if t is not None:
        pairs["gloo"] = (lambda: dist.send(t, dst=peer), lambda: dist.recv(t, src=peer))
    if comm is not None:
        pairs["MPI"] = (lambda: comm.Send(x, dest=peer), lambda: comm.Recv(x, source=peer))
    ordered = {lib: pair if rank == 0 else pair[::-1] for lib, pair in pairs.items()}

    async def round_trip() -> None:
        first, then = ordered["async"]
        await first()
        await then()

    table: dict[str, Any] = {
        lib: (lambda first=first, then=then: (first(), then()))
        for lib, (first, then) in ordered.items()
    }
    table["async"] = round_trip
    return table


async def _back_to_back_async(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        await fn()
    return (time.perf_counter() - start) / calls


def _back_to_back(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


async def _timed_async(fn: Callable[[], Any], calls: int) -> np.ndarray:
    now = time.perf_counter
    out = np.empty(calls)
    for i in range(calls):
        start = now()
        await fn()
        out[i] = now() - start
    return out


def _timed(fn: Callable[[], Any], calls: int) -> np.ndarray:
    now = time.perf_counter
    out = np.empty(calls)
    for i in range(calls):
        start = now()
        fn()
        out[i] = now() - start
    return out


def worker(tmp: str) -> None:
    """One rank, started by mpirun, or by this script (``RANK``, ``WORLD_SIZE``) without MPI."""
    import aiodist
    from aiodist import sync
    from aiodist._util._loop import loop_factory
    from aiodist.group import isolate_context

    cfg = json.loads(Path(tmp, "config.json").read_text())
    libs: list[str] = cfg["libs"]
    comm = MPI = torch = dist = None
    if "MPI" in libs:
        import mpi4py

        mpi4py.rc.thread_level = "funneled"  # only this thread calls MPI
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, n = comm.Get_rank(), comm.Get_size()
    else:
        rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n))
    if cfg["transport"] == "tcp":
        os.environ["AIODIST_SHM"] = "0"
    if "gloo" in libs:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        warnings.filterwarnings("ignore", category=FutureWarning)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp}/gloo",
            rank=rank,
            world_size=n,
            timeout=timedelta(seconds=120),
        )
    # The async world lives in a context of its own, so that the sync facade's world can be
    # this process's default group beside it.
    loop = loop_factory(cfg["loop"])()
    ctx = contextvars.copy_context()
    ctx.run(isolate_context)

    def run(coro: Any) -> Any:
        return loop.run_until_complete(loop.create_task(coro, context=ctx))

    # (TCPStore rendezvous, the usual one: a FileStore's polling would count as idle CPU.)
    async_url, sync_url = (f"tcp://127.0.0.1:{port}" for port in cfg["ports"])
    run(aiodist.init_process_group("cpu", init_method=async_url, rank=rank, world_size=n))
    sync.init_process_group("cpu", init_method=sync_url, rank=rank, world_size=n)
    # Lines the ranks up before each batch: MPI's barrier, or the sync facade's without MPI.
    line_up = comm.Barrier if comm is not None else sync.barrier
    table = _calls(rank, comm, aiodist, libs)
    samples: dict[tuple[str, str], list[np.ndarray]] = {}
    in_a_row: dict[tuple[str, str], list[float]] = {}
    for row, calls in table.items():
        for lib, fn in calls.items():  # warm up, untimed
            line_up()
            if lib == "async":
                run(_timed_async(fn, WARMUP))
            else:
                _timed(fn, WARMUP)
        for _ in range(cfg["rounds"]):
            for lib, fn in calls.items():
                line_up()
                if lib == "async":
                    average = run(_back_to_back_async(fn, cfg["calls"]))
                else:
                    average = _back_to_back(fn, cfg["calls"])
                in_a_row.setdefault((row, lib), []).append(average)
                line_up()
                if lib == "async":
                    got = run(_timed_async(fn, cfg["calls"]))
                else:
                    got = _timed(fn, cfg["calls"])
                samples.setdefault((row, lib), []).append(got)
    line_up()
    idle = []
    for _ in range(2):
        cpu = time.process_time()
        run(asyncio.sleep(1.0))
        idle.append(time.process_time() - cpu)
    info = {
        "aiodist": aiodist.__version__,
        "torch": torch.__version__ if torch is not None else "",
        "mpi": MPI.Get_library_version().replace("\0", "").split(",")[0] if MPI else "",
        "loop": type(loop).__module__.split(".")[0],
    }
    result = {"samples": samples, "in_a_row": in_a_row, "idle": idle, "info": info}
    Path(tmp, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    line_up()  # every rank's file is there before any rank leaves
    sync.destroy_process_group()
    run(aiodist.destroy_process_group())
    loop.close()
    if dist is not None:
        dist.destroy_process_group()


# -- the run ------------------------------------------------------------------------------------


def run_world(
    n: int, transport: str, args: argparse.Namespace, libs: list[str]
) -> list[dict[str, Any]]:
    """Launch one world (under mpirun when MPI is measured) and return each rank's samples."""
    from aiodist.testing import free_port

    with tempfile.TemporaryDirectory(prefix="aiodist-latency-") as tmp:
        cfg = {
            "transport": transport,
            "calls": args.calls,
            "rounds": args.rounds,
            "loop": args.loop,
            "ports": [free_port(), free_port()],
            "libs": libs,
        }
        Path(tmp, "config.json").write_text(json.dumps(cfg))
        env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE=str(n))
        command = [sys.executable, __file__, "--worker", tmp]
        if "MPI" in libs:
            mpirun = ["mpirun", "-n", str(n), "--bind-to", "none"]
            if os.geteuid() == 0:
                mpirun.append("--allow-run-as-root")
            if n > (os.cpu_count() or 1):
                mpirun.append("--oversubscribe")  # which also makes Open MPI yield as it waits
            if transport == "tcp":
                mpirun += ["--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo"]
            subprocess.run([*mpirun, *command], env=env, check=True, timeout=args.world_timeout)
        else:
            procs = [subprocess.Popen(command, env=dict(env, RANK=str(r))) for r in range(n)]
            try:
                for p in procs:
                    p.wait(timeout=args.world_timeout)
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
            if any(p.returncode for p in procs):
                raise RuntimeError(f"{n} ranks, {transport}: a rank failed (see above)")
        return [pickle.loads(Path(tmp, f"rank{r}.pkl").read_bytes()) for r in range(n)]


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (row, lib): median and p99 on the slowest rank, and the per-round spread."""
    cells: dict[tuple[str, str], dict[str, float]] = {}
    for key in ranks[0]["samples"]:
        row = key[0]
        timed = ranks[:1] if ROWS[row][0] == "pingpong" else ranks
        per_rank = [np.concatenate(r["samples"][key]) for r in timed]
        rounds = [
            max(float(np.median(r["samples"][key][i])) for r in timed)
            for i in range(len(ranks[0]["samples"][key]))
        ]
        # Back to back: each round's slowest rank, then the median round.
        averages = [max(r["in_a_row"][key][i] for r in timed) for i in range(len(rounds))]
        cells[key] = {
            "median": max(float(np.median(s)) for s in per_rank),
            "p99": max(float(np.percentile(s, 99)) for s in per_rank),
            "b2b": float(np.median(averages)),
            "spread": max(rounds) / min(rounds),
        }
    idle = [max(r["idle"][i] for r in ranks) for i in range(2)]
    libs = [lib for lib in LIBS if any(k[1] == lib for k in cells)]
    return {"cells": cells, "idle": idle, "info": ranks[0]["info"], "libs": libs}


def us(seconds: float) -> str:
    v = seconds * 1e6
    return f"{v:.1f}" if v < 100 else f"{v:.0f}"


def table(n: int, transport: str, s: dict[str, Any]) -> list[str]:
    c, libs = s["cells"], s["libs"]
    lines = [f"### {n} ranks, {transport}", ""]
    head = ["operation", *libs, *(f"{lib}/async" for lib in libs[1:])]
    lines += [
        "Back to back: µs per call of a loop of calls (slowest rank, median round); ratios "
        "are the other's over aiodist async's (above 1: aiodist is faster).",
        "",
        "| " + " | ".join(head) + " |",
        "| --- |" + " ---: |" * (len(head) - 1),
    ]
    for row in ROWS:
        a = c[(row, "async")]["b2b"]
        cols = [us(c[(row, lib)]["b2b"]) for lib in libs]
        ratios = [f"{c[(row, lib)]['b2b'] / a:.2f}x" for lib in libs[1:]]
        lines.append(f"| {row} | {' | '.join(cols)} | {' | '.join(ratios)} |")
    head = ["operation", *libs, *(f"{lib}/async" for lib in libs[1:]), "sync spread"]
    lines += [
        "",
        "Per call: median / p99 in µs (slowest rank); ratios are the other's median over "
        "aiodist async's.",
        "",
        "| " + " | ".join(head) + " |",
        "| --- |" + " ---: |" * (len(head) - 1),
    ]
    for row in ROWS:
        a = c[(row, "async")]["median"]
        cols = [f"{us(c[(row, lib)]['median'])} / {us(c[(row, lib)]['p99'])}" for lib in libs]
        ratios = [f"{c[(row, lib)]['median'] / a:.2f}x" for lib in libs[1:]]
        lines.append(
            f"| {row} | {' | '.join(cols)} | {' | '.join(ratios)} | "
            f"{c[(row, 'sync')]['spread']:.2f}x |"
        )
    idle = ", ".join(f"{100 * v:.2f} %" for v in s["idle"])
    lines += ["", f"Idle CPU (first second, second second): {idle} of one CPU.", ""]
    return lines


def targets(worlds: dict[tuple[int, str], dict[str, Any]]) -> list[str]:
    """The targets, met or missed, from this run: back-to-back averages (MPI's beside)."""
    lines = ["## Targets", ""]

    def check(text: str, value: float, limit: float, unit: str = "µs") -> None:
        shown = us(value) if unit == "µs" else f"{value:.2f}"
        mark = "met" if value <= limit else f"missed by {value / limit:.1f}x"
        lines.append(
            f"- {text}: {shown} {unit} (target <= {limit if unit != 'µs' else us(limit)}"
            f" {unit}): {mark}"
        )

    def b2b(c: dict[tuple[str, str], dict[str, float]], row: str, lib: str) -> str:
        mpi = c.get((row, "MPI"))
        return f"{lib}" + (f"; MPI {us(mpi['b2b'])} µs" if mpi else "")

    if (2, "shm") in worlds:
        c = worlds[(2, "shm")]["cells"]
        row = "all_reduce 8 B"
        check(f"2 ranks, {row}, {b2b(c, row, 'async')}", c[(row, "async")]["b2b"], 8e-6)
        check(f"2 ranks, {row}, {b2b(c, row, 'sync')}", c[(row, "sync")]["b2b"], 10e-6)
        check(
            f"2 ranks, barrier, {b2b(c, 'barrier', 'async')}", c[("barrier", "async")]["b2b"], 6e-6
        )
        for row in ("all_reduce 8 B", "all_reduce 1 KiB", "all_reduce 64 KiB"):
            ratio = c[(row, "sync")]["b2b"] / c[(row, "async")]["b2b"]
            check(f"2 ranks, {row}, sync / async", ratio, 1.3, "x")
    if (4, "shm") in worlds:
        c = worlds[(4, "shm")]["cells"]
        cpus = len(os.sched_getaffinity(0))
        row = "all_reduce 8 B"
        check(
            f"4 ranks on {cpus} CPUs, {row}, {b2b(c, row, 'async')}",
            c[(row, "async")]["b2b"],
            60e-6,
        )
    for (n, transport), s in worlds.items():
        check(
            f"{n} ranks, {transport}: idle CPU in the second idle second",
            100 * s["idle"][1],
            1.0,
            "% of a CPU",
        )
    return [*lines, ""]


def plot(worlds: dict[tuple[int, str], dict[str, Any]], path: str) -> None:
    """Median per call of every row, one panel per world; legible at 800 pixels wide."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)")
        return
    rows = (len(worlds) + 1) // 2
    # 8 inches at 100 dpi: shown at the page's width (about 800 pixels) the 12-point labels
    # are 16 pixels high, the smallest 14.
    fig, axes = plt.subplots(rows, 2, figsize=(8, 4.6 * rows), squeeze=False, sharey="row")
    libs = [lib for lib in LIBS if any(lib in s["libs"] for s in worlds.values())]
    width = 0.8 / len(libs)
    for ax, ((n, transport), s) in zip(axes.flat, worlds.items(), strict=False):
        for i, lib in enumerate(libs):
            if lib not in s["libs"]:
                continue
            values = [s["cells"][(row, lib)]["median"] * 1e6 for row in ROWS]
            offset = (i - (len(libs) - 1) / 2) * width
            ax.bar(np.arange(len(ROWS)) + offset, values, width, label=lib)
        ax.set_yscale("log")
        ax.set_title(f"{n} ranks, {transport}", fontsize=13)
        ax.set_xticks(
            np.arange(len(ROWS)),
            [SHORT.get(r, r) for r in ROWS],
            rotation=40,
            ha="right",
            rotation_mode="anchor",
            fontsize=11,
        )
        ax.tick_params(axis="y", labelsize=11)
        ax.grid(axis="y", alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("median µs per call", fontsize=12)
    for ax in list(axes.flat)[len(worlds) :]:
        ax.set_visible(False)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(libs), fontsize=12, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (4.6 * rows)))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


def read_results(path: str) -> dict[tuple[int, str], dict[str, Any]]:
    """The medians of a results file this script wrote, as ``plot`` takes them."""
    worlds: dict[tuple[int, str], dict[str, Any]] = {}
    world = None
    header: list[str] = []
    for line in Path(path).read_text().splitlines():
        if line.startswith("### "):
            ranks, _, transport = line[4:].partition(" ranks, ")
            world = worlds[(int(ranks), transport.strip())] = {"cells": {}, "libs": []}
            header = []
        elif world is not None and line.startswith("| operation |"):
            header = [c.strip() for c in line.strip("| \n").split("|")]
            world["libs"] = [lib for lib in LIBS if lib in header]
        elif world is not None and header and line.startswith("| ") and "---" not in line:
            cells = [c.strip() for c in line.strip("| \n").split("|")]
            if cells[0] in ROWS and " / " in line:  # (the per-call table)
                for lib in world["libs"]:
                    median = float(cells[header.index(lib)].split(" / ")[0])
                    world["cells"][(cells[0], lib)] = {"median": median * 1e-6}
    if not worlds:
        raise SystemExit(f"{path}: no table of bench/latency.py in it")
    return worlds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--transports", default="shm,tcp")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loop", default="auto", choices=("auto", "asyncio"))
    parser.add_argument("--world-timeout", type=float, default=900)
    parser.add_argument(
        "--write",
        action="store_true",
        help="write bench/results/latency.md and docs/images/latency.png (else a temp folder)",
    )
    parser.add_argument("--out", help="the results file (overrides --write's)")
    parser.add_argument("--plot", help="the plot ('' for none; overrides --write's)")
    parser.add_argument(
        "--replot", metavar="RESULTS", help="only draw the plot of this results file again"
    )
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    if args.out is None or args.plot is None:
        folder = Path("." if args.write else tempfile.mkdtemp(prefix="aiodist-bench-"))
        if args.out is None:
            args.out = str(
                folder / "bench/results/latency.md" if args.write else folder / "latency.md"
            )
        if args.plot is None:
            args.plot = str(
                folder / "docs/images/latency.png" if args.write else folder / "latency.png"
            )
    if args.replot:
        if args.plot:
            plot(read_results(args.replot), args.plot)
        return
    libs = ["async", "sync"]
    left_out = []
    if importlib.util.find_spec("torch") is not None:
        libs.append("gloo")
    else:
        print("gloo skipped: torch is not installed (pip install torch==2.13.0)", flush=True)
        left_out.append("gloo (no torch)")
    use_mpi, mpi_note = mpi_available()
    if use_mpi:
        libs.append("MPI")
    else:
        print(f"MPI skipped: {mpi_note}", flush=True)
        left_out.append(f"MPI ({mpi_note})")
    worlds: dict[tuple[int, str], dict[str, Any]] = {}
    for n in map(int, args.ranks.split(",")):
        for transport in args.transports.split(","):
            print(f"{n} ranks, {transport} ...", flush=True)
            worlds[(n, transport)] = summarize(run_world(n, transport, args, libs))
            print("\n".join(table(n, transport, worlds[(n, transport)])), flush=True)
    info = next(iter(worlds.values()))["info"]
    versions = [f"aiodist {info['aiodist']} (async API on {info['loop']})"]
    if info["torch"]:
        versions.append(f"torch {info['torch']} (gloo)")
    if info["mpi"]:
        versions.append(f"{info['mpi']} (mpi4py)")
    lines = [
        "# Latency of small operations",
        "",
        f"`{' '.join(['python', *sys.argv])}` on {time.strftime('%Y-%m-%d')}: "
        f"{len(os.sched_getaffinity(0))} CPUs, {', '.join(versions)}; {args.rounds} rounds of "
        f"{args.calls} calls per cell. How it measures: the docstring of `bench/latency.py`."
        + (f" Left out: {'; '.join(left_out)}." if left_out else ""),
        "",
        *targets(worlds),
    ]
    for (n, transport), s in worlds.items():
        lines += table(n, transport, s)
    print("\n".join(targets(worlds)))
    # The results first, so that a failing plot cannot lose them.
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        Path(args.out).write_text("\n".join(lines))
        print(f"wrote {args.out}")
    if args.plot:
        plot(worlds, args.plot)


if __name__ == "__main__":
    main()
