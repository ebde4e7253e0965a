"""Python calls per small operation, per layer: where an 8-byte all_reduce's time goes.

Run (one process per rank on this host, shared memory between them):

    .venv/bin/python bench/per_call.py [--ranks 2] [--calls 20000] [--write]

For each kind of call (``async``: ``await aiodist.all_reduce(x)``; ``sync``:
``aiodist.sync.all_reduce(x)``; ``barrier``: ``await aiodist.barrier()``) every rank times
``--calls`` calls back to back (after a barrier; the slowest rank's average), then runs as
many again under cProfile (rank 0; for ``sync`` the loop thread too) and counts the Python
function calls per operation, by layer. Call counts are deterministic where the time is not
(the machine is shared): a layer's count is what it costs per call whatever the load. The
profile's clock is each thread's CPU time, so a rank is not charged for the time it waited
for a CPU or slept; a layer's share of it times rank 0's CPU time per call, measured without
the profiler, estimates the layer's cost (cProfile inflates every call about alike).
Calls of C functions (numpy, struct, ``perf_counter``) count in the layer of the Python
function that made them. The polling of a wait (its rounds depend on when the peer arrives)
is shown apart from the rest.
"""

from __future__ import annotations

import argparse
import contextvars
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

#: Layer of a function: by (file suffix, function name), then by file suffix.
LAYERS_BY_FUNCTION = {
    ("collectives/shm_workspace.py", "arrive"): "waiting",
    ("collectives/shm_workspace.py", "all_arrived"): "waiting",
    ("collectives/shm_workspace.py", "sync"): "waiting",
    ("collectives/shm_workspace.py", "_wait"): "waiting",
    ("collectives/shm_workspace.py", "_reached"): "waiting (polls)",
    ("collectives/shm_workspace.py", "_on_bell"): "waiting",
    ("_util/_wait.py", "spin_until"): "waiting",
    ("group/__init__.py", "resolve_group"): "intake",
    ("group/__init__.py", "check_usable"): "intake",
}
LAYERS_BY_FILE = {
    "_api/_collectives.py": "intake",
    "_api/__init__.py": "intake",
    "backends/__init__.py": "intake",
    "backends/cpu.py": "plan",
    "group/_operations.py": "intake",
    "_arrays/_intake.py": "intake",
    "_arrays/_fingerprint.py": "fingerprint",
    "group/_default.py": "intake",
    "group/__init__.py": "sequencing",
    "group/_work.py": "sequencing",
    "group/_recorder.py": "sequencing",
    "transport/_mailbox.py": "sequencing",
    "transport/base.py": "sequencing",
    "collectives/shm.py": "algorithm",
    "collectives/shm_workspace.py": "workspace turn",
    "_util/_wait.py": "waiting",
    "transport/_shm_signal.py": "waiting",
    "sync/__init__.py": "sync hand-over",
    "sync/_loop_thread.py": "sync hand-over",
    "_util/_asyncio_internals.py": "sync hand-over",
    "concurrent/futures/_base.py": "sync hand-over",
    "threading.py": "sync hand-over",
    "asyncio/events.py": "event loop",
    "asyncio/base_events.py": "event loop",
    "asyncio/selector_events.py": "event loop",
    "selectors.py": "event loop",
    "asyncio/futures.py": "event loop",
    "asyncio/tasks.py": "event loop",
    "bench/per_call.py": "caller",
}
ORDER = (
    "intake",
    "fingerprint",
    "sequencing",
    "plan",
    "algorithm",
    "workspace turn",
    "waiting",
    "waiting (polls)",
    "sync hand-over",
    "event loop",
    "other",
)


def layer_of(key: tuple[str, int, str], stats: dict[Any, Any], depth: int = 0) -> str:
    """The layer of one profiled function; a C function takes its main caller's."""
    file, _, name = key
    if file == "~" or file.startswith("<"):
        callers = stats[key][4]
        if not callers or depth > 3:
            return "other"
        caller = max(callers, key=lambda c: callers[c][1])
        # (A C function's count is in its caller's layer, but polls stay polls.)
        found = layer_of(caller, stats, depth + 1)
        return "waiting (polls)" if found == "waiting" and "perf_counter" in name else found
    file = file.replace(os.sep, "/")
    for (suffix, fn), layer in LAYERS_BY_FUNCTION.items():
        if fn == name and file.endswith(suffix):
            return layer
    for suffix, layer in LAYERS_BY_FILE.items():
        if file.endswith(suffix):
            return layer
    return "other"


def per_layer(stats: pstats.Stats, calls: int) -> dict[str, tuple[float, float]]:
    """Layer -> (Python and C function calls per operation, share of the profiled time)."""
    raw = stats.stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in raw.values()) or 1.0
    out: dict[str, list[float]] = {}
    for key, (_, nc, tt, _, _) in raw.items():
        if key[2] in ("enable", "disable") or key[0].endswith("per_call.py"):
            continue  # the profiler's own calls and the timing loop
        cell = out.setdefault(layer_of(key, raw), [0.0, 0.0])
        cell[0] += nc / calls
        cell[1] += tt / total
    return {k: (v[0], v[1]) for k, v in out.items()}


# -- one rank -----------------------------------------------------------------------------------


async def _loop_async(fn: Any, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        await fn()
    return (time.perf_counter() - start) / calls


def _loop_sync(fn: Any, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def worker(tmp: str) -> None:
    import aiodist
    from aiodist import sync
    from aiodist._util._loop import loop_factory
    from aiodist.group import isolate_context
    from aiodist.sync._loop_thread import loop_thread

    cfg = json.loads(Path(tmp, "config.json").read_text())
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n))
    loop = loop_factory(cfg["loop"])()
    ctx = contextvars.copy_context()
    ctx.run(isolate_context)

    def run(coro: Any) -> Any:
        return loop.run_until_complete(loop.create_task(coro, context=ctx))

    a_url, s_url = (f"tcp://127.0.0.1:{p}" for p in cfg["ports"])
    run(aiodist.init_process_group("cpu", init_method=a_url, rank=rank, world_size=n))
    sync.init_process_group("cpu", init_method=s_url, rank=rank, world_size=n)
    x = np.zeros(1, np.float64)
    kinds = {
        "async": (True, lambda: aiodist.all_reduce(x)),
        "sync": (False, lambda: sync.all_reduce(x)),
        "barrier": (True, aiodist.barrier),
        "sync barrier": (False, sync.barrier),
    }
    out: dict[str, Any] = {}
    for kind in cfg["kinds"]:
        is_async, fn = kinds[kind]
        times, cpu = [], []
        for _ in range(cfg["rounds"] + 1):  # (the first round warms up)
            sync.barrier()
            used = time.process_time()
            if is_async:
                times.append(run(_loop_async(fn, cfg["calls"])))
            else:
                times.append(_loop_sync(fn, cfg["calls"]))
            cpu.append((time.process_time() - used) / cfg["calls"])
        out[kind] = {"times": times[1:], "cpu": cpu[1:]}
        if not cfg["profile"]:
            continue
        # CPU time, not wall time: a rank that waits for a CPU (the machine is shared) or
        # sleeps on its doorbell is not charged; one that polls is (its polls are "waiting").
        prof, on_loop = cProfile.Profile(time.thread_time), cProfile.Profile(time.thread_time)
        sync.barrier()
        if rank == 0:
            if not is_async:
                loop_thread.loop().call_soon_threadsafe(on_loop.enable)
            prof.enable()
        if is_async:
            run(_loop_async(fn, cfg["calls"]))
        else:
            _loop_sync(fn, cfg["calls"])
        if rank == 0:
            prof.disable()
            if not is_async:
                loop_thread.loop().call_soon_threadsafe(on_loop.disable)
                time.sleep(0.1)
            stats = pstats.Stats(prof)
            if not is_async and on_loop.getstats():
                stats.add(on_loop)
            out[kind]["layers"] = per_layer(stats, cfg["calls"])
            if cfg["dump"]:
                stats.dump_stats(os.path.join(cfg["dump"], f"{kind.replace(' ', '_')}.prof"))
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(out))
    sync.barrier()
    sync.destroy_process_group()
    run(aiodist.destroy_process_group())
    loop.close()


# -- the run ------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kinds", default="async,sync,barrier")
    parser.add_argument("--loop", default="auto", choices=("auto", "asyncio"))
    parser.add_argument("--no-profile", action="store_true", help="only time")
    parser.add_argument("--dump", help="a folder for rank 0's cProfile files (snakeviz ...)")
    parser.add_argument("--write", action="store_true", help="write bench/results/per_call.md")
    parser.add_argument("--out", help="the results file (overrides --write's)")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    from aiodist.testing import free_port

    with tempfile.TemporaryDirectory(prefix="aiodist-per-call-") as tmp:
        cfg = {
            "calls": args.calls,
            "rounds": args.rounds,
            "kinds": args.kinds.split(","),
            "loop": args.loop,
            "profile": not args.no_profile,
            "dump": args.dump,
            "ports": [free_port(), free_port()],
        }
        Path(tmp, "config.json").write_text(json.dumps(cfg))
        env = dict(os.environ, WORLD_SIZE=str(args.ranks), OMP_NUM_THREADS="1")
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", tmp], env=dict(env, RANK=str(r))
            )
            for r in range(args.ranks)
        ]
        if any(p.wait(timeout=900) for p in procs):
            raise SystemExit("a rank failed (see above)")
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.ranks)]
    lines = [
        "# Python calls per small operation, per layer (`bench/per_call.py`)",
        "",
        f"Command: `{' '.join(['python', 'bench/per_call.py', *sys.argv[1:]])}`, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, "
        f"load average {' / '.join(f'{x:.1f}' for x in os.getloadavg())} at the end. "
        f"{args.ranks} ranks, {args.calls} calls back to back per round, {args.rounds} rounds.",
    ]
    for kind in cfg["kinds"]:
        rounds = [max(r[kind]["times"][i] for r in ranks) for i in range(args.rounds)]
        shown = ", ".join(f"{1e6 * t:.1f}" for t in rounds)
        cpu = min(ranks[0][kind]["cpu"])
        lines += [
            "",
            f"## {kind}",
            "",
            f"µs per call (slowest rank, each round): {shown}; CPU µs per call of rank 0 "
            f"(its best round, every thread): {1e6 * cpu:.1f}",
        ]
        layers = ranks[0][kind].get("layers")
        if layers:
            lines += [
                "",
                "| layer | calls per op | share of CPU time | CPU µs per op (est.) |",
                "| --- | ---: | ---: | ---: |",
            ]
            for layer in ORDER:
                if layer in layers:
                    c, share = layers[layer]
                    lines.append(
                        f"| {layer} | {c:.1f} | {100 * share:.0f} % | {1e6 * cpu * share:.1f} |"
                    )
            total = sum(c for layer, (c, _) in layers.items() if layer != "waiting (polls)")
            lines.append(f"| all but polls | {total:.1f} | | |")
    text = "\n".join(lines) + "\n"
    print(text)
    # Committed results change only on purpose: without --write they go to a fresh folder.
    if args.out:
        out = Path(args.out)
    elif args.write:
        out = Path(__file__).resolve().parent / "results" / "per_call.md"
    else:
        out = Path(tempfile.mkdtemp(prefix="aiodist-bench-")) / "per_call.md"
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
