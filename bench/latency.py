"""Per-call latency of small operations: aiodist against Open MPI and gloo, in one run.

Run (in a private network namespace: torch's store does reverse DNS):

    unshare -n bash -c 'ip link set lo up && .venv/bin/python bench/latency.py'

Options: ``--ranks 2,4``, ``--transports shm,tcp``, ``--calls 2000`` (per round), ``--rounds
5``, ``--loop auto|asyncio``; the results go to a temporary folder, or with ``--write`` to
``bench/results/latency.md`` and ``docs/images/latency.png`` (``--out``, ``--plot``: other
paths; ``--plot ''``: none). Needs ``mpirun`` and ``pip install mpi4py torch``;
the plot needs matplotlib.

Every world of the run is one ``mpirun`` launch (one process per rank, all on this host) in
which each process joins four libraries at once, and every row times them round after round
in turn, so that a change in the machine's load hits them alike:

* ``async``: aiodist's async API, ``await aiodist.all_reduce(x)``;
* ``sync``: ``aiodist.sync``, the blocking facade a ported torch script uses;
* ``gloo``: ``torch.distributed`` with gloo, on tensors sharing the numpy arrays' memory;
* ``MPI``: mpi4py over Open MPI.

A world runs on one transport: ``shm`` is each library's default on one host (aiodist's
node workspace, Open MPI's shared-memory BTL); ``tcp`` is loopback TCP for all
(``AIODIST_SHM=0``; Open MPI with ``--mca btl tcp,self``). gloo always uses TCP.

Each call is timed on its own (``perf_counter`` around it) after an MPI barrier that lines
the ranks up for the round; a cell is the median and the 99th percentile of every call of
every round, on the slowest rank (for ping-pong: rank 0's round trip, the other ranks wait).
``spread`` is the largest over the smallest of the per-round medians. ``idle CPU`` is the
share of one CPU a process used while its aiodist worlds (one of each kind) had nothing to
do: during the first second after the last operation, and during the next one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import os
import pickle
import shutil
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


# -- one rank -----------------------------------------------------------------------------------


def _calls(rank: int, comm: Any, aio: Any) -> dict[str, dict[str, Any]]:
    """The operations of every row, per library: a callable doing one call (an awaitable
    for ``async``)."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from aiodist import sync

    table: dict[str, dict[str, Any]] = {}
    for row, (op, size) in ROWS.items():
        x = np.zeros(max(size // 8, 1), np.float64)  # (zeros: sums never overflow)
        t = torch.from_numpy(x)
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
            table[row] = {
                "async": aio.barrier,
                "sync": sync.barrier,
                "gloo": dist.barrier,
                "MPI": comm.Barrier,
            }
        else:
            table[row] = _pingpong(rank, x, t, comm, aio)
    return table


def _pingpong(rank: int, x: np.ndarray, t: Any, comm: Any, aio: Any) -> dict[str, Any]:
    """Rank 0 sends to rank 1 and waits for the answer; rank 1 answers; the others idle."""
    import torch.distributed as dist

    from aiodist import sync

    if rank > 1:

        async def idle() -> None:
            return None

        return dict.fromkeys(LIBS, lambda: None) | {"async": idle}
    peer = 1 - rank
    pairs = {  # (send, receive) of each library
        "async": (lambda: aio.send(x, dst=peer), lambda: aio.recv(x, src=peer)),
        "sync": (lambda: sync.send(x, dst=peer), lambda: sync.recv(x, src=peer)),
        "gloo": (lambda: dist.send(t, dst=peer), lambda: dist.recv(t, src=peer)),
        "MPI": (lambda: comm.Send(x, dest=peer), lambda: comm.Recv(x, source=peer)),
    }
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
    """One rank, started by mpirun."""
    import mpi4py

    mpi4py.rc.thread_level = "funneled"  # only this thread calls MPI
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    import aiodist
    from aiodist import sync
    from aiodist._default import isolate_context
    from aiodist._loop import loop_factory

    cfg = json.loads(Path(tmp, "config.json").read_text())
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n))
    if cfg["transport"] == "tcp":
        os.environ["AIODIST_SHM"] = "0"
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
    table = _calls(rank, comm, aiodist)
    samples: dict[tuple[str, str], list[np.ndarray]] = {}
    for row, libs in table.items():
        for lib, fn in libs.items():  # warm up, untimed
            comm.Barrier()
            if lib == "async":
                run(_timed_async(fn, WARMUP))
            else:
                _timed(fn, WARMUP)
        for _ in range(cfg["rounds"]):
            for lib, fn in libs.items():
                comm.Barrier()
                if lib == "async":
                    got = run(_timed_async(fn, cfg["calls"]))
                else:
                    got = _timed(fn, cfg["calls"])
                samples.setdefault((row, lib), []).append(got)
    comm.Barrier()
    idle = []
    for _ in range(2):
        cpu = time.process_time()
        run(asyncio.sleep(1.0))
        idle.append(time.process_time() - cpu)
    info = {
        "aiodist": aiodist.__version__,
        "torch": torch.__version__,
        "mpi": MPI.Get_library_version().replace("\0", "").split(",")[0],
        "loop": type(loop).__module__.split(".")[0],
    }
    everything = comm.gather({"samples": samples, "idle": idle, "info": info}, root=0)
    sync.destroy_process_group()
    run(aiodist.destroy_process_group())
    loop.close()
    dist.destroy_process_group()
    if rank == 0:
        Path(tmp, "result.pkl").write_bytes(pickle.dumps(everything))


# -- the run ------------------------------------------------------------------------------------


def run_world(n: int, transport: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Launch one world under mpirun and return each rank's samples."""
    from aiodist.testing import free_port

    with tempfile.TemporaryDirectory(prefix="aiodist-latency-") as tmp:
        cfg = {
            "transport": transport,
            "calls": args.calls,
            "rounds": args.rounds,
            "loop": args.loop,
            "ports": [free_port(), free_port()],
        }
        Path(tmp, "config.json").write_text(json.dumps(cfg))
        mpirun = ["mpirun", "-n", str(n), "--bind-to", "none"]
        if os.geteuid() == 0:
            mpirun.append("--allow-run-as-root")
        if n > (os.cpu_count() or 1):
            mpirun.append("--oversubscribe")  # which also makes Open MPI yield as it waits
        if transport == "tcp":
            mpirun += ["--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo"]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run(
            [*mpirun, sys.executable, __file__, "--worker", tmp],
            env=env,
            check=True,
            timeout=args.world_timeout,
        )
        return pickle.loads(Path(tmp, "result.pkl").read_bytes())  # type: ignore[no-any-return]


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
        cells[key] = {
            "median": max(float(np.median(s)) for s in per_rank),
            "p99": max(float(np.percentile(s, 99)) for s in per_rank),
            "spread": max(rounds) / min(rounds),
        }
    idle = [max(r["idle"][i] for r in ranks) for i in range(2)]
    return {"cells": cells, "idle": idle, "info": ranks[0]["info"]}


def us(seconds: float) -> str:
    v = seconds * 1e6
    return f"{v:.1f}" if v < 100 else f"{v:.0f}"


def table(n: int, transport: str, s: dict[str, Any]) -> list[str]:
    c = s["cells"]
    lines = [
        f"### {n} ranks, {transport}",
        "",
        "Median / p99 per call in µs (slowest rank); ratios are the other's median over "
        "aiodist async's (above 1: aiodist is faster).",
        "",
        "| operation | async | sync | gloo | MPI | sync/async | gloo/async | MPI/async |"
        " sync spread |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in ROWS:
        a = c[(row, "async")]["median"]
        cols = [f"{us(c[(row, lib)]['median'])} / {us(c[(row, lib)]['p99'])}" for lib in LIBS]
        ratios = [f"{c[(row, lib)]['median'] / a:.2f}x" for lib in LIBS[1:]]
        lines.append(
            f"| {row} | {' | '.join(cols)} | {' | '.join(ratios)} | "
            f"{c[(row, 'sync')]['spread']:.2f}x |"
        )
    idle = ", ".join(f"{100 * v:.2f} %" for v in s["idle"])
    lines += ["", f"Idle CPU (first second, second second): {idle} of one CPU.", ""]
    return lines


def targets(worlds: dict[tuple[int, str], dict[str, Any]]) -> list[str]:
    """The issue's targets, met or missed, from this run."""
    lines = ["## Targets", ""]

    def check(text: str, value: float, limit: float, unit: str = "µs") -> None:
        shown = us(value) if unit == "µs" else f"{value:.2f}"
        mark = "met" if value <= limit else f"missed by {value / limit:.1f}x"
        lines.append(
            f"- {text}: {shown} {unit} (target <= {limit if unit != 'µs' else us(limit)}"
            f" {unit}): {mark}"
        )

    if (2, "shm") in worlds:
        c = worlds[(2, "shm")]["cells"]
        check("2 ranks, all_reduce 8 B, async", c[("all_reduce 8 B", "async")]["median"], 5e-6)
        check("2 ranks, all_reduce 8 B, sync", c[("all_reduce 8 B", "sync")]["median"], 7e-6)
        check("2 ranks, barrier, async", c[("barrier", "async")]["median"], 5e-6)
        check("2 ranks, barrier, sync", c[("barrier", "sync")]["median"], 5e-6)
        for row in ("all_reduce 8 B", "all_reduce 1 KiB", "all_reduce 64 KiB"):
            ratio = c[(row, "sync")]["median"] / c[(row, "async")]["median"]
            check(f"2 ranks, {row}, sync / async", ratio, 1.3, "x")
        check(
            "2 ranks, all_reduce 8 B, sync spread",
            c[("all_reduce 8 B", "sync")]["spread"],
            2.0,
            "x",
        )
    if (4, "shm") in worlds:
        c = worlds[(4, "shm")]["cells"]
        cpus = len(os.sched_getaffinity(0))
        check(
            f"4 ranks on {cpus} CPUs, all_reduce 8 B, async",
            c[("all_reduce 8 B", "async")]["median"],
            100e-6,
        )
    if (2, "tcp") in worlds:
        c = worlds[(2, "tcp")]["cells"]
        check(
            "2 ranks, TCP only, all_reduce 8 B, async",
            c[("all_reduce 8 B", "async")]["median"],
            30e-6,
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
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install matplotlib)")
        return
    rows = (len(worlds) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(12, 5 * rows), squeeze=False)
    width = 0.2
    for ax, ((n, transport), s) in zip(axes.flat, worlds.items(), strict=False):
        for i, lib in enumerate(LIBS):
            values = [s["cells"][(row, lib)]["median"] * 1e6 for row in ROWS]
            ax.bar(np.arange(len(ROWS)) + (i - 1.5) * width, values, width, label=lib)
        ax.set_yscale("log")
        ax.set_title(f"{n} ranks, {transport}", fontsize=13)
        ax.set_xticks(
            np.arange(len(ROWS)),
            [r.replace(" round trip", "\nround trip") for r in ROWS],
            rotation=35,
            ha="right",
            fontsize=10,
        )
        ax.set_ylabel("median µs per call (log)", fontsize=11)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=11)
    for ax in list(axes.flat)[len(worlds) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


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
    if shutil.which("mpirun") is None:
        sys.exit("needs mpirun: apt-get install -y openmpi-bin libopenmpi-dev")
    for module in ("mpi4py", "torch"):
        try:
            __import__(module)
        except ImportError:
            sys.exit(f"needs {module}: pip install {module}")
    worlds: dict[tuple[int, str], dict[str, Any]] = {}
    for n in map(int, args.ranks.split(",")):
        for transport in args.transports.split(","):
            print(f"{n} ranks, {transport} ...", flush=True)
            worlds[(n, transport)] = summarize(run_world(n, transport, args))
            print("\n".join(table(n, transport, worlds[(n, transport)])), flush=True)
    info = next(iter(worlds.values()))["info"]
    lines = [
        "# Latency of small operations",
        "",
        f"`{' '.join(['python', *sys.argv])}` on {time.strftime('%Y-%m-%d')}: "
        f"{len(os.sched_getaffinity(0))} CPUs, aiodist {info['aiodist']} (async API on "
        f"{info['loop']}), "
        f"torch {info['torch']} (gloo), {info['mpi']} (mpi4py); {args.rounds} rounds of "
        f"{args.calls} calls per cell. How it measures: the docstring of `bench/latency.py`.",
        "",
        *targets(worlds),
    ]
    for (n, transport), s in worlds.items():
        lines += table(n, transport, s)
    print("\n".join(targets(worlds)))
    if args.out:
        Path(args.out).write_text("\n".join(lines))
        print(f"wrote {args.out}")
    if args.plot:
        plot(worlds, args.plot)


if __name__ == "__main__":
    main()
