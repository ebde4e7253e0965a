"""aiodist against torch's gloo and MPI on this machine, side by side, in one run.

Run (in a private network namespace: torch's store does reverse DNS, and nothing leaves the
machine; ``unshare -n`` needs root, ``unshare -rn`` works without):

    unshare -n bash -c 'ip link set lo up && .venv/bin/python bench/compare.py'

That is 2 and 4 ranks, every operation, 8 B .. 64 MiB, 5 repetitions; it prints the tables
and writes ``compare.md`` and ``compare_all_reduce.png`` to a temporary folder, or with
``--write`` to ``bench/results/compare.md`` and ``docs/images/compare_all_reduce.png``
(``--out``, ``--plot``: other paths; ``--plot ''``: none). The results file is written
first; the plot needs matplotlib (``pip install -e '.[bench]'``), and ``--replot RESULTS``
draws it again from a results file without measuring. A short run: ``--ranks 2 --ops all_reduce,barrier --sizes 8,1M,64M --reps 3``. MPI needs
``mpirun`` (Debian: ``apt-get install -y openmpi-bin libopenmpi-dev``) and ``pip install
mpi4py`` in this environment, gloo needs ``pip install torch==2.13.0``; without them their
columns are left out, with the reason printed.

One process per rank, all on this host. Every process joins every library, and every row
times them batch after batch in turn, so a change in the machine's load hits all alike:

* ``aiodist``: the async API on its default settings (shared memory between the ranks of
  one host, where the process group uses it);
* ``no-shm``: the same with ``AIODIST_SHM=0`` (TCP over loopback only): a second aiodist
  world in the same processes, set up with the variable set;
* ``shared`` (all_reduce only): arrays allocated in shared memory (``aiodist.empty`` when
  the package has it, else ``aiodist.collectives._shared_array`` with a workspace of the rank's own),
  reduced in place;
* ``gloo``: ``torch.distributed`` with gloo, on tensors that share the numpy arrays' memory;
* ``MPI``: mpi4py over Open MPI (its shared-memory transport between ranks of one host); the
  processes are started by ``mpirun``, which MPI needs;
* ``sync``: 8 B .. 64 KiB all_reduce through ``aiodist.sync`` (the blocking facade), with
  and without ``AIODIST_SHM=0``, timed after the rest (its world lives on a thread of its
  own, so it cannot take turns with the others).

A measurement is a batch of back-to-back operations after the library's own barrier, divided
by the batch length; each rank times its batches, the slowest rank counts, and a row shows
the median over the repetitions. Before the repetitions each library runs a few untimed
operations, then one timed one that sets its batch length (about ``--batch-ms`` long, agreed
by all ranks). Columns follow nccl-tests: ``size`` is the bytes of the whole operation (the
output of all_gather and gather, the input of reduce_scatter, scatter and all_to_all, one
message of send/recv), ``algbw = size / time``, ``busbw = algbw x`` 2(n-1)/n for all_reduce,
(n-1)/n for all_gather, gather, scatter, reduce_scatter and all_to_all, 1 for broadcast,
reduce and send/recv. send/recv is a ring: every rank sends to the next and receives from
the previous at once. Ratios are the other library's time over aiodist's (the busbw ratio;
above 1 means aiodist is faster). MPI has one form of all_gather, reduce_scatter and
all_to_all: its list and ``_tensor``/``_single`` rows time the same call.

``stall`` is the longest an aiodist rank's event loop went without running another task
during an operation (a task yielding in a loop watches it, in a separate pass after the
timed ones): wall time / CPU time of the loop's thread; with more ranks than CPUs the wall
time also counts the time the process waited for a CPU, so the targets use the CPU time
there. The machine's limits are measured in the same run: numpy copy and ``a += b``
bandwidth in one process, and loopback TCP throughput between two.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import importlib.util
import json
import os
import pickle
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Awaitable, Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OPS = [
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "send_recv",
]
SIZES = [8, 128, 1 << 10, 8 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
#: Sizes up to which ``aiodist.sync`` is timed (its cost is per call, not per byte).
SYNC_MAX = 64 << 10
LIBS = ["aiodist", "no-shm", "shared", "gloo", "mpi"]
AIODIST_LIBS = ("aiodist", "no-shm", "shared")
LABELS = {
    "aiodist": "aiodist",
    "no-shm": "aiodist, AIODIST_SHM=0",
    "shared": "aiodist, shared arrays",
    "gloo": "torch gloo",
    "mpi": "MPI",
}
SPLIT_OPS = {
    "all_gather",
    "all_gather_into_tensor",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
}
DTYPE = np.float32
MAX_ITERS = 2000
#: Passes of the stall watch per row and aiodist configuration.
STALL_PASSES = 3


def bus_factor(name: str, n: int) -> float:
    if name == "all_reduce":
        return 2 * (n - 1) / n
    if name in ("broadcast", "reduce", "send_recv", "barrier"):
        return 1.0
    return (n - 1) / n


def count_for(name: str, size: int, n: int) -> int:
    """Elements of the whole operation: at least one per rank, a multiple of n where split."""
    count = max(1, size // np.dtype(DTYPE).itemsize)
    if name in SPLIT_OPS:
        count = max(n, count - count % n)
    return count


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    for suffix, shift in (("K", 10), ("M", 20), ("G", 30)):
        if text.endswith(suffix):
            return int(float(text[:-1]) * (1 << shift))
    return int(text)


def fmt_size(size: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            return f"{size / (1 << shift):g} {unit}"
    return f"{size} B"


def fmt_time(t: float) -> str:
    if t < 1e-3:
        return f"{t * 1e6:.1f} µs"
    return f"{t * 1e3:.2f} ms"


# -- buffers and operations, per library --------------------------------------------------------


def make_buffers(name: str, count: int, n: int, rank: int, mpi: bool) -> dict[str, Any]:
    """Zeros (sums of anything else overflow float32 after enough operations)."""

    def z(k: int) -> np.ndarray:
        return np.zeros(k, DTYPE)

    block = count // n
    root = rank == 0
    if name in ("all_reduce", "broadcast", "reduce"):
        return {"x": z(count)}
    if name == "all_gather":
        return {"x": z(block), "outs": [z(block) for _ in range(n)], "out": mpi and z(count)}
    if name == "all_gather_into_tensor":
        return {"x": z(block), "out": z(count)}
    if name == "gather":
        return {
            "x": z(block),
            "outs": [z(block) for _ in range(n)] if root else None,
            "out": z(count) if root and mpi else None,
        }
    if name == "scatter":
        return {
            "out": z(block),
            "ins": [z(block) for _ in range(n)] if root else None,
            "x": z(count) if root and mpi else None,
        }
    if name == "reduce_scatter":
        return {"ins": [z(block) for _ in range(n)], "out": z(block), "x": mpi and z(count)}
    if name == "reduce_scatter_tensor":
        return {"x": z(count), "out": z(block)}
    if name == "all_to_all":
        return {
            "ins": [z(block) for _ in range(n)],
            "outs": [z(block) for _ in range(n)],
            "x": mpi and z(count),
            "out": mpi and z(count),
        }
    if name in ("all_to_all_single", "send_recv"):
        return {"x": z(count), "out": z(count)}
    return {}


def aiodist_op(name: str, b: dict[str, Any], pg: Any, rank: int, n: int) -> Callable[[], Any]:
    import aiodist

    nxt, prv = (rank + 1) % n, (rank - 1) % n
    ops: dict[str, Callable[[], Any]] = {
        "all_reduce": lambda: aiodist.all_reduce(b["x"], group=pg),
        "broadcast": lambda: aiodist.broadcast(b["x"], 0, group=pg),
        "reduce": lambda: aiodist.reduce(b["x"], 0, group=pg),
        "all_gather": lambda: aiodist.all_gather(b["outs"], b["x"], group=pg),
        "all_gather_into_tensor": lambda: aiodist.all_gather_into_tensor(
            b["out"], b["x"], group=pg
        ),
        "gather": lambda: aiodist.gather(b["x"], b["outs"], 0, group=pg),
        "scatter": lambda: aiodist.scatter(b["out"], b["ins"], 0, group=pg),
        "reduce_scatter": lambda: aiodist.reduce_scatter(b["out"], b["ins"], group=pg),
        "reduce_scatter_tensor": lambda: aiodist.reduce_scatter_tensor(b["out"], b["x"], group=pg),
        "all_to_all": lambda: aiodist.all_to_all(b["outs"], b["ins"], group=pg),
        "all_to_all_single": lambda: aiodist.all_to_all_single(b["out"], b["x"], group=pg),
        "barrier": lambda: aiodist.barrier(group=pg),
    }
    if name != "send_recv":
        return ops[name]

    async def send_recv() -> None:
        sent = aiodist.isend(b["x"], nxt, group=pg)
        received = aiodist.irecv(b["out"], prv, group=pg)
        await sent
        await received

    return send_recv


def torch_op(name: str, b: dict[str, Any], rank: int, n: int) -> Callable[[], Any]:
    import torch
    import torch.distributed as dist

    t = {k: torch.from_numpy(v) for k, v in b.items() if isinstance(v, np.ndarray)}
    lists = {k: [torch.from_numpy(a) for a in v] for k, v in b.items() if isinstance(v, list)}
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    ops: dict[str, Callable[[], Any]] = {
        "all_reduce": lambda: dist.all_reduce(t["x"]),
        "broadcast": lambda: dist.broadcast(t["x"], 0),
        "reduce": lambda: dist.reduce(t["x"], 0),
        "all_gather": lambda: dist.all_gather(lists["outs"], t["x"]),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(t["out"], t["x"]),
        "gather": lambda: dist.gather(t["x"], lists.get("outs"), 0),
        "scatter": lambda: dist.scatter(t["out"], lists.get("ins"), 0),
        "reduce_scatter": lambda: dist.reduce_scatter(t["out"], lists["ins"]),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(t["out"], t["x"]),
        "all_to_all": lambda: dist.all_to_all(lists["outs"], lists["ins"]),
        "all_to_all_single": lambda: dist.all_to_all_single(t["out"], t["x"]),
        "barrier": lambda: dist.barrier(),
    }
    if name != "send_recv":
        return ops[name]

    def send_recv() -> None:
        sent = dist.isend(t["x"], nxt)
        received = dist.irecv(t["out"], prv)
        sent.wait()
        received.wait()

    return send_recv


def mpi_op(name: str, b: dict[str, Any], comm: Any, rank: int, n: int) -> Callable[[], Any]:
    from mpi4py import MPI

    nxt, prv = (rank + 1) % n, (rank - 1) % n
    x, out = b.get("x"), b.get("out")
    if name == "all_reduce":
        return lambda: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
    if name == "broadcast":
        return lambda: comm.Bcast(x, root=0)
    if name == "reduce":
        if rank == 0:
            return lambda: comm.Reduce(MPI.IN_PLACE, x, op=MPI.SUM, root=0)
        return lambda: comm.Reduce(x, None, op=MPI.SUM, root=0)
    if name in ("all_gather", "all_gather_into_tensor"):
        return lambda: comm.Allgather(x, out)
    if name == "gather":
        return lambda: comm.Gather(x, out, root=0)
    if name == "scatter":
        return lambda: comm.Scatter(x, out, root=0)
    if name in ("reduce_scatter", "reduce_scatter_tensor"):
        return lambda: comm.Reduce_scatter_block(x, out, op=MPI.SUM)
    if name in ("all_to_all", "all_to_all_single"):
        return lambda: comm.Alltoall(x, out)
    if name == "send_recv":
        return lambda: comm.Sendrecv(x, dest=nxt, recvbuf=out, source=prv)
    return lambda: comm.Barrier()


# -- one rank --------------------------------------------------------------------------------


class Lib:
    """One library's way to run an operation and its barrier in this rank."""

    def __init__(
        self,
        op: Callable[[], Any],
        barrier: Callable[[], Any],
        *,
        is_async: bool,
    ) -> None:
        self.op = op
        self.barrier = barrier
        self.is_async = is_async

    async def run(self, times: int) -> None:
        if self.is_async:
            for _ in range(times):
                await self.op()
        else:
            for _ in range(times):
                self.op()

    async def batch(self, times: int) -> float:
        if self.is_async:
            await self.barrier()
        else:
            self.barrier()
        start = time.perf_counter()
        await self.run(times)
        return (time.perf_counter() - start) / times


async def max_stall(lib: Lib, times: int) -> tuple[float, float]:
    """The longest gap between two turns of a task that yields in a loop while ``lib`` runs
    ``times`` operations: in wall time and in CPU time of this thread."""
    gaps = [(0.0, 0.0)]
    done = False

    async def ticker() -> None:
        last, last_cpu = time.perf_counter(), time.thread_time()
        while not done:
            await asyncio.sleep(0)
            now, cpu = time.perf_counter(), time.thread_time()
            gaps.append((now - last, cpu - last_cpu))
            last, last_cpu = now, cpu

    await lib.barrier()
    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    await lib.run(times)
    done = True
    await tick
    return max(g[0] for g in gaps), max(g[1] for g in gaps)


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


#: How the report names the process group's transport (in the user documentation's words,
#: not the library's class names).
TRANSPORT_WORDS = {
    "RoutedTransport": "shared memory between the ranks of this host (TCP to other hosts)",
    "ShmTransport": "shared memory",
    "TCPTransport": "TCP over loopback",
}


def checkout_commit() -> str:
    """The commit of this checkout (``git log``; worktrees too), and how many files of
    aiodist/ differ from it; ``?`` without git."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True
        ).stdout.strip()

    try:
        commit = git("log", "-1", "--format=%h") or "?"
        changed = [line for line in git("status", "--porcelain", "aiodist").split("\n") if line]
    except OSError:
        return "?"
    if changed:
        commit += f" with uncommitted changes to {len(changed)} files of aiodist/"
    return commit


@contextlib.contextmanager
def terminated_as_exit() -> Iterator[None]:
    """SIGTERM and SIGHUP end the run through its ``finally`` clauses, as Ctrl-C does."""

    def stop(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    saved = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def describe_transport(pg: Any) -> str:
    transport = getattr(getattr(pg, "world", None), "transport", None)
    if transport is None:
        return "?"
    return TRANSPORT_WORDS.get(type(transport).__name__, type(transport).__name__)


class SharedArrays:
    """all_reduce on arrays in shared memory: the public API where it exists, else a
    workspace of this rank's own and the shared-memory algorithms on it."""

    def __init__(self, zeros: Callable[[int], Any], lib: Callable[[Any], Lib], how: str) -> None:
        self.zeros = zeros
        self.lib = lib
        self.how = how
        self.closers: list[Callable[[], Awaitable[None]]] = []

    @classmethod
    async def open(cls, pg: Any, tmp: str, rank: int, n: int) -> SharedArrays:
        import aiodist

        def barrier() -> Any:
            return aiodist.barrier(group=pg)

        public = getattr(aiodist, "empty", None)
        if public is not None:
            return cls(
                lambda count: public(count, DTYPE, group=pg),
                lambda x: Lib(lambda: aiodist.all_reduce(x, group=pg), barrier, is_async=True),
                "`aiodist.empty` arrays through `aiodist.all_reduce`",
            )
        from aiodist._arrays._reduce import ReduceOp
        from aiodist.collectives import _shared_array, shm
        from aiodist.collectives.shm import NodeWorkspace
        from aiodist.store import FileStore, PrefixStore

        store = FileStore(os.path.join(tmp, "workspace.store"))
        ws = await NodeWorkspace.create(
            PrefixStore("ws", store), rank, n, timeout=60, job_key=f"compare-{os.getpid()}"
        )
        self = cls(
            lambda count: _shared_array.zeros(count, DTYPE, ws),
            lambda x: Lib(
                lambda: shm.all_reduce(ws, x, ReduceOp.SUM),
                lambda: shm.barrier(ws),
                is_async=True,
            ),
            "`aiodist.collectives._shared_array` arrays through `aiodist.collectives.shm.all_reduce` on a "
            "workspace of their own (`aiodist.empty` does not exist yet)",
        )
        self.closers.append(ws.aclose)
        return self


async def rank_main(rank: int, n: int, tmp: str, cfg: dict[str, Any], comm: Any) -> dict[str, Any]:
    import aiodist
    from aiodist.group import isolate_context

    init = {"world_size": n, "rank": rank}
    pg = await aiodist.init_process_group("cpu", init_method=f"file://{tmp}/on.store", **init)
    # A second world in an isolated context, set up while AIODIST_SHM=0.
    off_context = contextvars.copy_context()
    off_context.run(isolate_context)

    async def init_off() -> Any:
        with environment(AIODIST_SHM="0"):
            return await aiodist.init_process_group(
                "cpu", init_method=f"file://{tmp}/off.store", **init
            )

    pg_off = await asyncio.create_task(init_off(), context=off_context)
    shared = await SharedArrays.open(pg, tmp, rank, n) if "all_reduce" in cfg["ops"] else None
    out: dict[str, Any] = {
        "times": {},
        "stall": {},
        "unsupported": {},
        "info": {
            "aiodist transport": describe_transport(pg),
            "AIODIST_SHM=0 transport": describe_transport(pg_off),
            "shared arrays": shared.how if shared else "",
        },
    }

    async def agree_max(values: list[float]) -> list[float]:
        v = np.array(values, np.float64)
        await aiodist.all_reduce(v, aiodist.ReduceOp.MAX, group=pg)
        return [float(a) for a in v]

    for name in cfg["ops"]:
        for size in [0] if name == "barrier" else cfg["sizes"]:
            count = count_for(name, size, n) if size else 0
            b = make_buffers(name, count, n, rank, comm is not None)
            libs: dict[str, Lib] = {
                "aiodist": Lib(
                    aiodist_op(name, b, pg, rank, n),
                    lambda: aiodist.barrier(group=pg),
                    is_async=True,
                ),
                "no-shm": Lib(
                    aiodist_op(name, b, pg_off, rank, n),
                    lambda: aiodist.barrier(group=pg_off),
                    is_async=True,
                ),
            }
            if name == "all_reduce" and shared is not None:
                libs["shared"] = shared.lib(shared.zeros(count))
            if cfg["gloo"]:
                import torch.distributed as dist

                libs["gloo"] = Lib(torch_op(name, b, rank, n), dist.barrier, is_async=False)
            if comm is not None:
                libs["mpi"] = Lib(mpi_op(name, b, comm, rank, n), comm.Barrier, is_async=False)
            if rank == 0 and cfg["verbose"]:
                print(f"  {n} ranks: {name} {fmt_size(size)}", file=sys.stderr, flush=True)
            # Untimed warm-up (connections, scratch buffers, page faults), then one timed
            # operation per library that sets its batch length; the slowest rank decides.
            warmup = 3 if size < (16 << 20) else 1
            first: list[float] = []
            for lib_name, lib in list(libs.items()):
                try:
                    await lib.run(warmup)
                except Exception as exc:
                    if lib_name in AIODIST_LIBS:
                        raise
                    out["unsupported"][name, lib_name] = str(exc).splitlines()[0][:120]
                    del libs[lib_name]
                    continue
                first.append(await lib.batch(1))
            per_op = await agree_max(first)
            iters = {
                lib_name: max(1, min(MAX_ITERS, int(cfg["batch_s"] / max(t, 1e-7))))
                for lib_name, t in zip(libs, per_op, strict=True)
            }
            for _ in range(cfg["reps"]):
                for lib_name, lib in libs.items():
                    t = await lib.batch(iters[lib_name])
                    out["times"].setdefault((name, size, lib_name), []).append(t)
            # Each pass's longest stall; the median of the passes (one preemption by another
            # process on a shared machine is not the library's stall).
            for lib_name in AIODIST_LIBS:
                if lib_name in libs:
                    times = max(2, min(20, iters[lib_name]))
                    passes = [await max_stall(libs[lib_name], times) for _ in range(STALL_PASSES)]
                    out["stall"][name, size, lib_name] = tuple(
                        statistics.median(p[i] for p in passes) for i in (0, 1)
                    )
            out["times"].setdefault(("count", name, size), []).append(count)
            del libs, b
    if shared is not None:
        for close in shared.closers:
            await close()
    await asyncio.create_task(aiodist.destroy_process_group(), context=off_context)
    await aiodist.destroy_process_group()
    return out


def sync_phase(rank: int, n: int, tmp: str, cfg: dict[str, Any]) -> dict[Any, list[float]]:
    """8 B .. 64 KiB all_reduce through ``aiodist.sync``, with shared memory on, then off."""
    import aiodist.sync as sdist

    sizes = [s for s in cfg["sizes"] if s <= SYNC_MAX]
    times: dict[Any, list[float]] = {}
    if "all_reduce" not in cfg["ops"] or not sizes:
        return times
    for lib_name, env in (("sync", {}), ("sync no-shm", {"AIODIST_SHM": "0"})):
        with environment(**env):
            sdist.init_process_group(
                "cpu",
                init_method=f"file://{tmp}/{lib_name.replace(' ', '-')}.store",
                world_size=n,
                rank=rank,
            )
        for size in sizes:
            x = np.zeros(count_for("all_reduce", size, n), DTYPE)
            for _ in range(3):
                sdist.all_reduce(x)
            sdist.barrier()
            start = time.perf_counter()
            sdist.all_reduce(x)
            first = np.array([time.perf_counter() - start])
            sdist.all_reduce(first, op=sdist.ReduceOp.MAX)
            iters = max(1, min(MAX_ITERS, int(cfg["batch_s"] / max(first[0], 1e-7))))
            for _ in range(cfg["reps"]):
                sdist.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    sdist.all_reduce(x)
                times.setdefault(("all_reduce", size, lib_name), []).append(
                    (time.perf_counter() - start) / iters
                )
        sdist.destroy_process_group()
    return times


def worker(tmp: str) -> None:
    """One rank: started by mpirun (OMPI_COMM_WORLD_RANK) or by this script (RANK)."""
    from aiodist._util._loop import loop_factory

    with open(os.path.join(tmp, "config.json")) as f:
        cfg = json.load(f)
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "-1")))
    os.environ.setdefault("LOCAL_RANK", str(rank))  # mpirun sets only OMPI_COMM_WORLD_*
    n = cfg["n"]
    comm = None
    if cfg["mpi"]:
        import mpi4py

        mpi4py.rc.thread_level = "funneled"  # only this thread calls MPI
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    if cfg["gloo"]:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        # torch 2.13 marks the *_tensor collectives deprecated; they are still gloo's fast path.
        warnings.filterwarnings("ignore", category=FutureWarning)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp}/gloo.store",
            world_size=n,
            rank=rank,
            timeout=timedelta(seconds=120),
        )
    with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
        result = runner.run(rank_main(rank, n, tmp, cfg, comm))
    result["times"].update(sync_phase(rank, n, tmp, cfg))
    if cfg["gloo"]:
        dist.destroy_process_group()
    with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


# -- the run: machine limits, worlds, merging -------------------------------------------------


def memory_limits() -> dict[str, float]:
    """numpy copy (bytes copied per second) and ``a += b`` (bytes of ``a`` per second)."""
    out = {}
    for size in (1 << 20, 64 << 20):
        a = np.ones(size // 4, np.float32)
        b = np.ones(size // 4, np.float32)
        reps = max(3, (256 << 20) // size)
        copies, adds = [], []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(reps):
                np.copyto(a, b)
            copies.append((time.perf_counter() - start) / reps)
            start = time.perf_counter()
            for _ in range(reps):
                a += b
            adds.append((time.perf_counter() - start) / reps)
        out[f"numpy copy, {fmt_size(size)}"] = size / statistics.median(copies)
        out[f"`a += b`, {fmt_size(size)}"] = size / statistics.median(adds)
    return out


def _tcp_sink(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        buf = bytearray(4 << 20)
        while s.recv_into(buf):
            pass


def tcp_limit(total: int = 1 << 30) -> float:
    """Loopback TCP throughput, one direction, between two processes (bytes per second)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        sink = subprocess.Popen(
            [sys.executable, __file__, "--tcp-sink", str(port)], stdin=subprocess.DEVNULL
        )
        conn, _ = server.accept()
    chunk = memoryview(bytearray(4 << 20))
    with conn:
        for _ in range(16):  # warm up: window growth
            conn.sendall(chunk)
        start = time.perf_counter()
        for _ in range(total // len(chunk)):
            conn.sendall(chunk)
        elapsed = time.perf_counter() - start
    sink.wait(30)
    return total / elapsed


def mpi_available() -> tuple[bool, str]:
    """Whether the MPI column can be measured, and what MPI is (or why not)."""
    if shutil.which("mpirun") is None:
        return False, "mpirun not found (apt-get install -y openmpi-bin libopenmpi-dev)"
    if importlib.util.find_spec("mpi4py") is None:
        return False, f"mpi4py is not installed in {sys.prefix} (pip install mpi4py)"
    probe = subprocess.run(
        [sys.executable, "-c", "from mpi4py import MPI; print(MPI.Get_library_version())"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if probe.returncode != 0:
        return False, f"mpi4py cannot load MPI: {probe.stderr.strip().splitlines()[-1:]}"
    # "Open MPI v4.1.4, package: ..." (NUL-padded by some builds): the name and version.
    return True, probe.stdout.replace("\0", "").strip().splitlines()[0].split(",")[0]


def run_world(n: int, args: argparse.Namespace, use_mpi: bool, use_gloo: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="aiodist-compare-") as tmp:
        cfg = {
            "n": n,
            "mpi": use_mpi,
            "gloo": use_gloo,
            "ops": args.ops,
            "sizes": args.sizes,
            "reps": args.reps,
            "batch_s": args.batch_ms / 1000,
            "verbose": args.verbose,
        }
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f)
        env = dict(os.environ, OMP_NUM_THREADS="1", LOCAL_WORLD_SIZE=str(n), WORLD_SIZE=str(n))
        command = [sys.executable, __file__, "--worker", tmp]
        if use_mpi:
            mpirun = ["mpirun", "-n", str(n), "--bind-to", "none"]
            if os.geteuid() == 0:
                mpirun.append("--allow-run-as-root")
            if n > (os.cpu_count() or 1):
                mpirun.append("--oversubscribe")  # also makes MPI yield when it waits
            procs = [subprocess.Popen(mpirun + command, env=env, start_new_session=True)]
        else:
            procs = [
                subprocess.Popen(
                    command, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), start_new_session=True
                )
                for r in range(n)
            ]
        try:
            deadline = time.monotonic() + args.world_timeout
            while any(p.poll() is None for p in procs):
                if any(p.returncode not in (None, 0) for p in procs):
                    raise RuntimeError(f"{n} ranks: a rank failed (its traceback is above)")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{n} ranks: no result within {args.world_timeout} s")
                time.sleep(0.2)
            if any(p.returncode != 0 for p in procs):
                raise RuntimeError(f"{n} ranks: a rank failed (its traceback is above)")
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        per_rank = []
        for r in range(n):
            with open(os.path.join(tmp, f"rank{r}.pkl"), "rb") as f:
                per_rank.append(pickle.load(f))
    merged: dict[str, Any] = {
        "times": {},
        "counts": {},
        "stall": {},
        "unsupported": per_rank[0]["unsupported"],
        "info": per_rank[0]["info"],
    }
    for key, reps in per_rank[0]["times"].items():
        if key[0] == "count":
            merged["counts"][key[1:]] = int(reps[0])
            continue
        # Per repetition the slowest rank; then the median over the repetitions.
        slowest = [max(pr["times"][key][i] for pr in per_rank) for i in range(len(reps))]
        merged["times"][key] = statistics.median(slowest)
    for key in per_rank[0]["stall"]:
        merged["stall"][key] = tuple(max(pr["stall"][key][i] for pr in per_rank) for i in (0, 1))
    return merged


# -- report ------------------------------------------------------------------------------------


def op_table(name: str, n: int, w: dict[str, Any], libs: list[str]) -> list[str]:
    """One nccl-tests-style table: per library time and busbw, ratios, aiodist's stalls."""
    factor = bus_factor(name, n)
    shown = [lib for lib in libs if any(k[0] == name and k[2] == lib for k in w["times"])]
    head = ["size", "count"]
    for lib in shown:
        short = "MPI" if lib == "mpi" else lib
        head += [f"{short} time", f"{short} busbw"] if name != "barrier" else [f"{short} time"]
    ratios = [
        (a, b)
        for a, b in (("aiodist", "gloo"), ("aiodist", "mpi"), ("no-shm", "gloo"), ("shared", "mpi"))
        if a in shown and b in shown
    ]
    head += [f"{a} / {b}".replace("mpi", "MPI") for a, b in ratios]
    stalls = [lib for lib in AIODIST_LIBS if lib in shown]
    head += [f"{lib} stall" for lib in stalls]
    lines = [
        f"### {name}, {n} ranks",
        "",
        "| " + " | ".join(head) + " |",
        "| " + " | ".join("---:" for _ in head) + " |",
    ]
    sizes = sorted({k[1] for k in w["times"] if k[0] == name})
    for size in sizes:
        count = w["counts"].get((name, size), 0)
        nbytes = count * np.dtype(DTYPE).itemsize
        cells = [fmt_size(nbytes) if name != "barrier" else "-", str(count) if count else "-"]
        for lib in shown:
            t = w["times"].get((name, size, lib))
            cells.append(fmt_time(t) if t else "")
            if name != "barrier":
                cells.append(f"{nbytes / t * factor / 1e9:.3f}" if t else "")
        for a, b in ratios:
            ta, tb = w["times"].get((name, size, a)), w["times"].get((name, size, b))
            cells.append(f"{tb / ta:.2f}x" if ta and tb else "")
        for lib in stalls:
            s = w["stall"].get((name, size, lib))
            cells.append(f"{s[0] * 1e3:.2f} / {s[1] * 1e3:.2f}" if s else "")
        lines.append("| " + " | ".join(cells) + " |")
    gone = {lib: why for (op, lib), why in w["unsupported"].items() if op == name}
    for lib, why in gone.items():
        lines += ["", f"{LABELS[lib]} cannot run {name} here: {why}"]
    return [*lines, ""]


def sync_table(n: int, w: dict[str, Any]) -> list[str]:
    """all_reduce through ``aiodist.sync`` next to the async API and gloo."""
    t = w["times"]
    sizes = sorted({k[1] for k in t if k[2] == "sync"})
    if not sizes:
        return []
    libs = [
        lib
        for lib in ("sync", "sync no-shm", "aiodist", "no-shm", "gloo", "mpi")
        if any(k[2] == lib for k in t)
    ]
    names = {"sync": "`aiodist.sync`", "sync no-shm": "`aiodist.sync`, AIODIST_SHM=0"}
    lines = [
        f"### all_reduce through the blocking facade, {n} ranks",
        "",
        "| size | " + " | ".join(names.get(lib, LABELS.get(lib, lib)) for lib in libs) + " |",
        "| ---: " * (len(libs) + 1) + "|",
    ]
    for size in sizes:
        cells = [fmt_size(w["counts"]["all_reduce", size] * 4)]
        cells += [
            fmt_time(t[key]) if (key := ("all_reduce", size, lib)) in t else "" for lib in libs
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


class Check:
    """One target: every row it applies to, scored against its limit."""

    def __init__(self, text: str) -> None:
        self.text = text
        #: (score, description): the value over its limit, or the needed ratio over the
        #: ratio reached; above 1 is a miss by that factor.
        self.rows: list[tuple[float, str]] = []
        self.notes: list[str] = []

    def at_most(self, value: float, limit: float, where: str, unit: str = "µs") -> None:
        over = f", {value / limit:.1f}x the limit" if value > limit else ""
        self.rows.append((value / limit, f"{where}: {value:.2f} {unit} (limit {limit:g}{over})"))

    def at_least(self, ratio: float, need: float, where: str) -> None:
        short = f", {1 - ratio / need:.0%} short" if ratio < need else ""
        self.rows.append((need / ratio, f"{where}: {ratio:.2f}x (needs {need:g}x{short})"))

    def line(self) -> str:
        notes = "".join(f" ({note})" for note in self.notes)
        if not self.rows:
            return f"- {self.text}: **not measured**{notes}"
        rows = sorted(self.rows, reverse=True)
        missed = [(score, d) for score, d in rows if score > 1]
        if not missed:
            verdict = f"**met** in {len(rows)} of {len(rows)} rows; closest: {rows[0][1]}"
        else:
            worst = "; ".join(d for _, d in missed[:3])
            more = f"; and {len(missed) - 3} more" if len(missed) > 3 else ""
            verdict = f"**missed** in {len(missed)} of {len(rows)} rows: {worst}{more}"
        return f"- {self.text}: {verdict}{notes}"


def targets(worlds: dict[int, dict[str, Any]], cpus: int) -> list[str]:
    checks = {
        "async": Check(
            "8 B all_reduce, async API, <= 5 µs with local ranks <= cores, <= 100 µs with more"
        ),
        "sync": Check("8 B all_reduce through `aiodist.sync`, <= 7 µs with local ranks <= cores"),
        "mpi": Check("all_reduce 1-64 MiB, copying path, busbw >= 0.5x MPI"),
        "shared": Check("all_reduce 1-64 MiB, shared arrays, busbw >= 1.2x MPI"),
        "gloo": Check("every collective from 64 KiB up >= 2x gloo"),
        "off": Check("`AIODIST_SHM=0`: every collective at every size >= 1.2x gloo"),
        "stall1": Check("event loop stall <= 1 ms for ops up to 1 MiB"),
        "stall5": Check("event loop stall <= 5 ms for any op"),
    }
    for n, w in sorted(worlds.items()):
        t = w["times"]
        fits = n <= cpus
        if ("all_reduce", 8, "aiodist") in t:
            limit = 5.0 if fits else 100.0
            checks["async"].at_most(t["all_reduce", 8, "aiodist"] * 1e6, limit, f"{n} ranks")
        if fits and ("all_reduce", 8, "sync") in t:
            checks["sync"].at_most(t["all_reduce", 8, "sync"] * 1e6, 7.0, f"{n} ranks")
        for (name, size, lib), value in sorted(t.items()):
            where = f"{name} {fmt_size(size) if size else ''} {n} ranks".replace("  ", " ")
            if (
                name == "all_reduce"
                and (1 << 20) <= size <= (64 << 20)
                and ("all_reduce", size, "mpi") in t
            ):
                if lib == "aiodist":
                    checks["mpi"].at_least(t[name, size, "mpi"] / value, 0.5, where)
                if lib == "shared":
                    checks["shared"].at_least(t[name, size, "mpi"] / value, 1.2, where)
            gloo = t.get((name, size, "gloo"))
            if gloo and lib == "aiodist" and size >= (64 << 10):
                checks["gloo"].at_least(gloo / value, 2.0, where)
            if gloo and lib == "no-shm":
                checks["off"].at_least(gloo / value, 1.2, where)
        for (name, size, lib), (wall, cpu) in sorted(w["stall"].items()):
            stall = (wall if fits else cpu) * 1e3
            where = f"{LABELS[lib]}, {name} {fmt_size(size) if size else ''} {n} ranks"
            if size <= (1 << 20):
                checks["stall1"].at_most(stall, 1.0, where, "ms")
            checks["stall5"].at_most(stall, 5.0, where, "ms")
    if not any("mpi" in {k[2] for k in w["times"]} for w in worlds.values()):
        checks["mpi"].notes.append("no MPI in this run")
        checks["shared"].notes.append("no MPI in this run")
    if not any("gloo" in {k[2] for k in w["times"]} for w in worlds.values()):
        checks["gloo"].notes.append("no gloo in this run")
        checks["off"].notes.append("no gloo in this run")
    checks["stall1"].notes.append(
        "wall time with ranks <= CPUs, the loop thread's CPU time with more"
    )
    return [c.line() for c in checks.values()]


def busbw_points(worlds: dict[int, dict[str, Any]]) -> dict[int, dict[str, list[Any]]]:
    """all_reduce busbw (GB/s) against size (bytes), per world size and library, 1 KiB up."""
    points: dict[int, dict[str, list[Any]]] = {}
    for n, w in sorted(worlds.items()):
        for lib in LIBS:
            pts = sorted(
                (w["counts"]["all_reduce", size] * 4, t)
                for (name, size, lb), t in w["times"].items()
                if name == "all_reduce" and lb == lib and size >= 1024
            )
            if pts:
                factor = bus_factor("all_reduce", n)
                points.setdefault(n, {})[lib] = [(b, b / t * factor / 1e9) for b, t in pts]
    return points


def read_busbw(path: str) -> dict[int, dict[str, list[Any]]]:
    """The all_reduce busbw of a results file this script wrote, as ``plot`` takes it."""
    points: dict[int, dict[str, list[Any]]] = {}
    n, header = 0, []
    for line in Path(path).read_text().splitlines():
        if line.startswith("### "):
            title = line[4:].split(", ")
            n = int(title[1].split()[0]) if title[0] == "all_reduce" else 0
            header = []
        elif n and line.startswith("| size |"):
            header = [c.strip() for c in line.strip("| ").split("|")]
        elif n and header and line.startswith("| ") and "---" not in line:
            cells = [c.strip() for c in line.strip("| ").split("|")]
            size = int(cells[header.index("count")]) * np.dtype(DTYPE).itemsize
            for lib in LIBS:
                # From the time (four digits), not the busbw column (three decimals).
                column = f"{'MPI' if lib == 'mpi' else lib} time"
                if size >= 1024 and column in header and cells[header.index(column)]:
                    value, unit = cells[header.index(column)].split()
                    t = float(value) * {"µs": 1e-6, "ms": 1e-3, "s": 1.0}[unit]
                    busbw = size / t * bus_factor("all_reduce", n) / 1e9
                    points.setdefault(n, {}).setdefault(lib, []).append((size, busbw))
    if not points:
        raise SystemExit(f"{path}: no all_reduce table of bench/compare.py in it")
    return points


def plot(points: dict[int, dict[str, list[Any]]], path: str) -> None:
    """One panel per world size, stacked: legible at the page's width (about 800 pixels)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)")
        return
    if not points:
        return
    ns = sorted(points)
    # 8 inches at 100 dpi: shown 800 pixels wide, the 12-point labels are 16 pixels high.
    fig, axes = plt.subplots(len(ns), 1, figsize=(8, 4.8 * len(ns)), squeeze=False)
    styles = {
        "aiodist": ("C0", "o", "-"),
        "shared": ("C2", "^", "-"),
        "no-shm": ("C0", "s", "--"),
        "gloo": ("C3", "v", "-"),
        "mpi": ("C1", "D", "-"),
    }
    ticks = [s for s in SIZES if s >= 1024]
    for ax, n in zip(axes[:, 0], ns, strict=True):
        for lib in LIBS:
            pts = points[n].get(lib)
            if not pts:
                continue
            color, marker, line = styles[lib]
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                color=color,
                marker=marker,
                markersize=7,
                linewidth=2,
                linestyle=line,
                label=LABELS[lib],
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ticks, [fmt_size(s).replace(" ", "") for s in ticks])
        ax.tick_params(labelsize=12)
        ax.set_xlabel("size of the array", fontsize=12)
        ax.set_ylabel("bus bandwidth (GB/s)", fontsize=12)
        ax.set_title(f"all_reduce float32, {n} ranks on one host", fontsize=14)
        ax.grid(True, which="both", alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=12, loc="best")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4", help="world sizes, comma-separated")
    parser.add_argument("--ops", default=",".join(OPS), help="operations, comma-separated")
    parser.add_argument(
        "--sizes",
        default=",".join(str(s) for s in SIZES),
        help="sizes in bytes, comma-separated; K, M suffixes allowed (1K = 1024)",
    )
    parser.add_argument("--reps", type=int, default=5, help="timed batches per library and row")
    parser.add_argument("--batch-ms", type=float, default=20.0, help="length of a timed batch")
    parser.add_argument("--no-mpi", action="store_true", help="leave MPI out")
    parser.add_argument(
        "--write",
        action="store_true",
        help="write bench/results/compare.md and docs/images/compare_all_reduce.png "
        "(else a temp folder)",
    )
    parser.add_argument("--out", help="the results file (overrides --write's)")
    parser.add_argument("--plot", help="PNG of all_reduce busbw ('' for none; overrides --write's)")
    parser.add_argument("--world-timeout", type=float, default=1800, help="seconds per world")
    parser.add_argument(
        "--replot", metavar="RESULTS", help="only draw the plot of this results file again"
    )
    parser.add_argument("--verbose", action="store_true", help="progress on stderr")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--tcp-sink", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        try:
            worker(args.worker)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        return
    if args.tcp_sink:
        _tcp_sink(args.tcp_sink)
        return
    args.ops = [o for o in args.ops.split(",") if o]
    unknown = set(args.ops) - set(OPS)
    if unknown:
        parser.error(f"unknown operations: {sorted(unknown)}; known: {','.join(OPS)}")
    try:
        args.sizes = [parse_size(s) for s in args.sizes.split(",") if s]
        ranks = [int(r) for r in args.ranks.split(",") if r]
    except ValueError as exc:
        parser.error(str(exc))
    if any(r < 2 for r in ranks):
        parser.error("--ranks: every world needs at least 2 ranks")
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    # Committed results change only on purpose: without --write they go to a fresh folder.
    if args.out is None or args.plot is None:
        folder = ROOT if args.write else Path(tempfile.mkdtemp(prefix="aiodist-bench-"))
        if args.out is None:
            args.out = str(
                folder / "bench/results/compare.md" if args.write else folder / "compare.md"
            )
        if args.plot is None:
            args.plot = str(
                folder / "docs/images/compare_all_reduce.png"
                if args.write
                else folder / "compare_all_reduce.png"
            )
    if args.replot:
        if args.plot:
            plot(read_busbw(args.replot), args.plot)
        return
    try:
        import torch

        use_gloo, torch_note = True, f"torch {torch.__version__}"
    except ImportError:
        use_gloo, torch_note = False, "no torch"
        print("gloo skipped: torch is not installed (pip install torch==2.13.0)", flush=True)

    started = time.monotonic()
    cpus = len(os.sched_getaffinity(0))
    use_mpi, mpi_note = (False, "left out by --no-mpi") if args.no_mpi else mpi_available()
    if not use_mpi:
        print(f"MPI skipped: {mpi_note}", flush=True)
    commit = checkout_commit()
    load_before = os.getloadavg()[0]
    limits = memory_limits()
    limits["loopback TCP, one direction"] = tcp_limit()
    command = shlex.join(["python", "bench/compare.py", *sys.argv[1:]])
    head = [
        "# aiodist, torch gloo and MPI side by side (`bench/compare.py`)",
        "",
        f"Command: `unshare -n bash -c 'ip link set lo up && .venv/bin/{command}'`, "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}, {cpus} CPUs, at commit `{commit}`; "
        f"{torch_note}, numpy {np.__version__}, "
        f"MPI: {mpi_note if use_mpi else 'none (' + mpi_note + ')'}. "
        "Times are medians over the repetitions of the slowest rank's batch average; "
        "busbw in GB/s; `a / b` is b's time over a's (above 1: a is faster); stall in ms, "
        "wall / CPU of the loop's thread. `bench/compare.py`'s docstring says how each "
        "column is measured.",
        "",
        "## Machine limits",
        "",
        "| what | GB/s |",
        "| --- | ---: |",
        *(f"| {k} | {v / 1e9:.2f} |" for k, v in limits.items()),
        "",
    ]
    print("\n".join(head), flush=True)
    worlds: dict[int, dict[str, Any]] = {}
    body: list[str] = []
    for n in ranks:
        w = worlds[n] = run_world(n, args, use_mpi, use_gloo)
        block = [f"## {n} ranks", ""]
        block += [f"- {k}: {v}" for k, v in w["info"].items() if v] + [""]
        for name in args.ops:
            block += op_table(name, n, w, LIBS)
            if name == "all_reduce":
                block += sync_table(n, w)
        print("\n".join(block), flush=True)
        body += block
    summary = [
        "## Targets",
        "",
        *targets(worlds, cpus),
        "",
        f"Run time: {(time.monotonic() - started) / 60:.1f} min; load average (1 min) "
        f"{load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
        f"({cpus} CPUs: a load above that means other processes took turns with the ranks).",
        "",
    ]
    print("\n".join(summary), flush=True)
    # The results first, so that a failing plot cannot lose them; the report links the
    # plot only where one can be made.
    picture = []
    if args.plot and importlib.util.find_spec("matplotlib") is not None:
        rel = os.path.relpath(args.plot, os.path.dirname(os.path.abspath(args.out)))
        picture = [
            "## all_reduce bus bandwidth",
            "",
            f"![all_reduce busbw against size]({rel})",
            "",
        ]
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(head + summary + picture + body).rstrip() + "\n")
        print(f"wrote {args.out}")
    if args.plot:
        plot(busbw_points(worlds), args.plot)


if __name__ == "__main__":
    main()
