"""One-shot check of aiodist's CUDA backend on a GPU machine (one GPU is enough).

    NCCL_DEBUG=WARN timeout 480 python bench/gpu_check.py --write    # on the GPU machine
    python bench/gpu_check.py --dry-run --out /tmp/gpu.md             # anywhere, no cupy

Phases, each printed as it finishes (a run that is cut off still shows what it did), and the
results file rewritten after each: ``gpu.md`` in a temporary folder, or with ``--write``
``bench/results/gpu.md`` (``--out``: another path):

1. environment: CUDA driver and runtime, cupy, NCCL (runtime and build), the device;
2. device ceilings: device-to-device copy bandwidth, pinned host copies both ways;
3. correctness: every collective (several dtypes and reductions, multi-chunk and
   multi-round sizes, ``wait_stream`` before completion, a torch tensor through DLPack when
   torch has CUDA) against numpy, on every data path this machine allows: ``nccl`` with one
   rank (NCCL refuses two ranks on one GPU), ``ipc`` and ``staged`` with 1 to 4 processes;
4. all_reduce time from 4 KiB to 1 GiB per path (2 processes for ipc and staged), with the
   longest stall of each rank's event loop while it ran, and torch.distributed NCCL at
   world size 1 when torch is installed.

``--dry-run`` runs the same structure without cupy: numpy arrays on the CPU backend, small
sizes, torch's gloo instead of NCCL. It exists so that the script itself is tested.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import importlib.util
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# Run from a checkout without installing it (the GPU machine may have no network for pip).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiodist
from aiodist.testing import WorldProcessError, run_world_processes

RESULTS = Path(__file__).resolve().parent / "results" / "gpu.md"
SIZES = [4 << 10 << 2 * i for i in range(9)]  # 4 KiB ... 256 MiB
SIZES.append(1 << 30)
DRY_SIZES = [4 << 10, 64 << 10, 1 << 20]


def log(text: str = "") -> None:
    print(text, flush=True)


# -- what runs in each rank ---------------------------------------------------------------------
def _modules(dry: bool) -> tuple[Any, Callable[[Any], np.ndarray]]:
    if dry:
        return np, np.asarray
    import cupy

    return cupy, cupy.asnumpy


class _Stalls:
    """The longest gap a 1 ms ticker task saw on this rank's loop."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(0.001)
            now = loop.time()
            self.longest = max(self.longest, now - last - 0.001)
            last = now

    def __enter__(self) -> _Stalls:
        self._task = asyncio.get_running_loop().create_task(self._tick())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


def _inputs(rank: int, count: int, dtype: Any) -> np.ndarray:
    rng = np.random.default_rng(1000 + rank)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, count).astype(bool)
    if dt.kind in "iu":
        return rng.integers(0, 20, count).astype(dt)
    return rng.normal(size=count).astype(np.float32).astype(dt)


def _close(got: np.ndarray, want: np.ndarray, dtype: Any) -> None:
    dt = np.dtype(dtype)
    if dt.kind in "biu":
        np.testing.assert_array_equal(got, want)
    else:
        tol = 3e-2 if dt.itemsize <= 2 else 1e-4
        np.testing.assert_allclose(
            got.astype(np.float64), np.asarray(want).astype(np.float64), rtol=tol, atol=tol
        )


async def check_rank(rank: int, n: int, dry: bool) -> dict[str, Any]:
    """Every collective against numpy on this rank; returns cases, failures, loop stall."""
    xp, host = _modules(dry)
    ok: list[str] = []
    failed: list[str] = []

    async def case(name: str, body: Callable[[], Any]) -> None:
        try:
            await body()
            ok.append(name)
        except Exception as exc:
            text = " ".join(str(exc).split())
            failed.append(f"{name}: {type(exc).__name__}: {text}"[:400])

    dtypes: list[Any] = ["float32", "float16", "int64"]
    if importlib.util.find_spec("ml_dtypes") is not None:
        import ml_dtypes

        dtypes.append(ml_dtypes.bfloat16)
    R = aiodist.ReduceOp
    root = n - 1
    counts = [1001] if dry else [1001, (5 << 20) // 4 + 3]  # the second crosses chunks/rounds

    with _Stalls() as stalls:
        for count in counts:
            for dtype in dtypes:
                ins = [_inputs(r, count, dtype) for r in range(n)]
                wide = [a.astype(np.float64) for a in ins]
                for op, want in [
                    (R.SUM, sum(wide)),
                    (R.MAX, np.maximum.reduce(wide)),
                    (R.AVG, sum(wide) / n),
                ]:
                    if op is R.AVG and np.dtype(dtype).kind in "iu":
                        want = sum(a.astype(np.int64) for a in ins) // n

                    async def all_reduce(
                        op: Any = op, want: Any = want, ins: Any = ins, dtype: Any = dtype
                    ) -> None:
                        x = xp.array(ins[rank])
                        await aiodist.all_reduce(x, op=op)
                        _close(host(x).astype(np.float64), want, dtype)

                    await case(f"all_reduce {np.dtype(dtype).name} {op.name} x{count}", all_reduce)

            ins32 = [_inputs(r, count, "float32") for r in range(n)]

            async def premul(ins: Any = ins32) -> None:
                x = xp.array(ins[rank])
                await aiodist.all_reduce(x, op=aiodist.make_premul_sum(0.5))
                _close(host(x), 0.5 * sum(ins), "float32")

            async def wait_stream(ins: Any = ins32) -> None:
                x = xp.array(ins[rank])
                work = aiodist.all_reduce(x)
                if not dry:
                    work.wait_stream()  # the current stream waits: y sees the result
                    y = x * 2
                    await work
                else:
                    await work
                    y = x * 2
                _close(host(y), 2 * sum(ins), "float32")

            async def reduce(ins: Any = ins32) -> None:
                x = xp.array(ins[rank])
                await aiodist.reduce(x, dst=root)
                _close(host(x), sum(ins) if rank == root else ins[rank], "float32")

            async def broadcast(ins: Any = ins32) -> None:
                x = xp.array(ins[rank])
                await aiodist.broadcast(x, src=root)
                _close(host(x), ins[root], "float32")

            async def all_gather(ins: Any = ins32, count: int = count) -> None:
                outs = [xp.zeros(count, "float32") for _ in range(n)]
                await aiodist.all_gather(outs, xp.array(ins[rank]))
                big = xp.zeros(n * count, "float32")
                await aiodist.all_gather_into_tensor(big, xp.array(ins[rank]))
                # (checks after every collective of a case: a failed check must not make
                # this rank skip a collective its peers issue)
                for r in range(n):
                    _close(host(outs[r]), ins[r], "float32")
                _close(host(big), np.concatenate(ins), "float32")

            async def reduce_scatter(ins: Any = ins32, count: int = count) -> None:
                out = xp.zeros(count, "float32")
                await aiodist.reduce_scatter(out, [xp.array(ins[rank] * (j + 1)) for j in range(n)])
                out2 = xp.zeros(count, "float32")
                await aiodist.reduce_scatter_tensor(out2, xp.array(np.concatenate([ins[rank]] * n)))
                _close(host(out), sum(ins) * (rank + 1), "float32")
                _close(host(out2), sum(ins), "float32")

            async def gather_scatter(ins: Any = ins32, count: int = count) -> None:
                got = [xp.zeros(count, "float32") for _ in range(n)] if rank == root else None
                await aiodist.gather(xp.array(ins[rank]), got, dst=root)
                out = xp.zeros(count, "float32")
                pieces = [xp.array(ins[r]) for r in range(n)] if rank == root else None
                await aiodist.scatter(out, pieces, src=root)
                if got is not None:
                    for r in range(n):
                        _close(host(got[r]), ins[r], "float32")
                _close(host(out), ins[rank], "float32")

            async def all_to_all() -> None:
                outs = [xp.zeros(rank + j + 1, "int64") for j in range(n)]
                send = [xp.full(rank + j + 1, rank * 100 + j, "int64") for j in range(n)]
                await aiodist.all_to_all(outs, send)
                for j in range(n):
                    _close(host(outs[j]), np.full(rank + j + 1, j * 100 + rank), "int64")

            async def coalesced(ins: Any = ins32) -> None:
                xs = [xp.array(ins[rank][:10]), xp.array(ins[rank][10:])]
                await aiodist.all_reduce_coalesced(xs)
                _close(host(xs[1]), sum(ins)[10:], "float32")

            async def point_to_point(count: int = count) -> None:
                if n == 1:
                    return
                got = xp.zeros(count, "float32")
                recv = aiodist.irecv(got, src=(rank - 1) % n)
                await aiodist.isend(xp.full(count, rank, "float32"), dst=(rank + 1) % n)
                await recv
                _close(host(got), np.full(count, (rank - 1) % n), "float32")

            for name, body in [
                ("all_reduce PREMUL_SUM", premul),
                ("wait_stream before completion", wait_stream),
                ("reduce", reduce),
                ("broadcast", broadcast),
                ("all_gather", all_gather),
                ("reduce_scatter", reduce_scatter),
                ("gather/scatter", gather_scatter),
                ("all_to_all", all_to_all),
                ("all_reduce_coalesced", coalesced),
                ("send/recv", point_to_point),
            ]:
                await case(f"{name} x{count}", body)

        if not dry and importlib.util.find_spec("torch") is not None:

            async def torch_tensor() -> None:
                import torch

                if not torch.cuda.is_available():
                    return
                t = torch.full((1000,), float(rank + 1), device="cuda")
                await aiodist.all_reduce(t)
                torch.cuda.synchronize()
                _close(t.cpu().numpy(), np.full(1000, n * (n + 1) / 2), "float32")

            await case("torch CUDA tensor through DLPack", torch_tensor)
        await aiodist.barrier()
    path = "cpu"
    if not dry:
        from aiodist.backends import cuda

        path = str(cuda.data_path(aiodist.group.current_world().default_group))
    return {"ok": ok, "failed": failed, "stall_ms": stalls.longest * 1e3, "path": path}


async def time_rank(
    rank: int, n: int, dry: bool, sizes: list[int], budget: float
) -> dict[str, Any]:
    """all_reduce times per size (median), and the loop's longest stall meanwhile."""
    xp, _ = _modules(dry)
    times: dict[int, float] = {}
    deadline = time.monotonic() + budget
    with _Stalls() as stalls:
        for size in sizes:
            x = xp.ones(size // 4, "float32")
            await aiodist.all_reduce(x)  # warm-up (and first-use setup)
            start = time.perf_counter()
            await aiodist.all_reduce(x)
            # Every rank must run the same number of operations: the slowest rank decides.
            estimates: list[Any] = [None] * n
            await aiodist.all_gather_object(estimates, time.perf_counter() - start)
            reps = int(min(20, max(2, 0.3 / max(max(estimates), 1e-6))))
            samples: list[float] = []
            for _ in range(reps):
                await aiodist.barrier()
                start = time.perf_counter()
                await aiodist.all_reduce(x)
                samples.append(time.perf_counter() - start)
            times[size] = float(np.median(samples))
            # Every rank takes the same decision: the slowest rank's view is shared.
            flag = [time.monotonic() > deadline]
            gathered: list[Any] = [None] * n
            await aiodist.all_gather_object(gathered, flag[0])
            if any(gathered):
                break
            del x
    return {"times": times, "stall_ms": stalls.longest * 1e3}


def torch_times(dry: bool, sizes: list[int]) -> dict[int, float]:
    """torch.distributed all_reduce at world size 1 (NCCL on a GPU, gloo in a dry run)."""
    import torch
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        backend = "gloo" if dry else "nccl"
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            device = "cpu" if dry else "cuda"
            times = {}
            for size in sizes:
                x = torch.ones(size // 4, device=device)
                dist.all_reduce(x)
                samples = []
                while len(samples) < 2 or (sum(samples) < 0.3 and len(samples) < 20):
                    if not dry:
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    dist.all_reduce(x)
                    if not dry:
                        torch.cuda.synchronize()
                    samples.append(time.perf_counter() - start)
                times[size] = float(np.median(samples))
            return times
        finally:
            dist.destroy_process_group()


# -- the parent ---------------------------------------------------------------------------------
class Report:
    """The markdown page, rewritten after every phase."""

    def __init__(self, out: Path, dry: bool) -> None:
        self.out = out
        self.dry = dry
        self.sections: list[str] = []

    def add(self, title: str, lines: list[str]) -> None:
        """Add (or replace) the section ``title`` and rewrite the file."""
        text = f"## {title}\n\n" + "\n".join(lines) + "\n"
        self.sections = [s for s in self.sections if not s.startswith(f"## {title}\n")]
        self.sections.append(text)
        self.write()

    def write(self) -> None:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        head = [
            "# aiodist CUDA backend: GPU check",
            "",
            f"Run {stamp} on {platform.node()} ({platform.machine()}, Python "
            f"{platform.python_version()})"
            + (" -- DRY RUN on the CPU, no GPU numbers" if self.dry else "")
            + ".",
            "",
            "Command: `NCCL_DEBUG=WARN timeout 480 python bench/gpu_check.py --write`",
            "",
        ]
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text("\n".join(head) + "\n" + "\n".join(self.sections))


def environment(dry: bool) -> tuple[list[str], list[str]]:
    """Versions and the device; the paths this machine allows. Exits if cupy/GPU is missing."""
    lines = [
        f"- aiodist {aiodist.__version__}, numpy {np.__version__}, Python {sys.version.split()[0]}"
    ]
    if dry:
        lines.append("- dry run: numpy arrays on the CPU backend stand for device arrays")
        return lines, ["cpu"]
    if importlib.util.find_spec("cupy") is None:
        sys.exit(
            "gpu_check: cupy is not installed (pip install 'aiodist[cuda13]'); nothing to check"
        )
    import cupy
    from cupy.cuda import runtime

    if not cupy.cuda.is_available():
        sys.exit("gpu_check: cupy found no CUDA device (driver missing or no GPU visible)")
    props = runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    lines += [
        f"- cupy {cupy.__version__}; CUDA runtime {runtime.runtimeGetVersion()}, driver "
        f"{runtime.driverGetVersion()}",
        f"- device 0: {name}, {props['totalGlobalMem'] / 2**30:.0f} GiB, "
        f"{runtime.getDeviceCount()} device(s), PCI {runtime.deviceGetPCIBusId(0)}",
    ]
    from aiodist.backends._cuda_device import load_nccl

    nccl = load_nccl()
    paths = ["nccl", "ipc", "staged"]
    if nccl is None:
        lines.append("- NCCL: did not load (the nccl path is skipped)")
        paths.remove("nccl")
    else:
        lines.append(f"- NCCL {nccl.get_version()} (cupy built against {nccl.get_build_version()})")
    lines.append(
        f"- ml_dtypes: {'yes' if importlib.util.find_spec('ml_dtypes') else 'no (bfloat16 cases skipped)'}"
    )
    lines.append(f"- torch: {'yes' if importlib.util.find_spec('torch') else 'no'}")
    return lines, paths


def ceilings(dry: bool) -> list[str]:
    """Copy bandwidth of the device (and pinned host copies) measured now."""
    if dry:
        a = np.ones(64 << 20, np.uint8)
        b = np.empty_like(a)
        start = time.perf_counter()
        for _ in range(5):
            np.copyto(b, a)
        rate = 5 * a.nbytes / (time.perf_counter() - start) / 1e9
        return [f"- host memcpy 64 MiB: {rate:.1f} GB/s (dry run)"]
    import cupy
    import cupyx

    def bandwidth(fn: Callable[[], None], nbytes: int, reps: int = 10) -> float:
        fn()
        cupy.cuda.Device().synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        cupy.cuda.Device().synchronize()
        return reps * nbytes / (time.perf_counter() - start) / 1e9

    a = cupy.ones(1 << 30, cupy.uint8)
    b = cupy.empty_like(a)
    d2d = bandwidth(lambda: b.data.copy_from_device_async(a.data, a.nbytes), a.nbytes)
    h = cupyx.empty_pinned((256 << 20,), np.uint8)
    d = cupy.empty(256 << 20, cupy.uint8)
    h2d = bandwidth(lambda: d.set(h), h.nbytes)
    d2h = bandwidth(lambda: d.get(out=h), h.nbytes)
    # Pre-compile the reduction kernels the ranks use (the kernel cache is shared).
    from aiodist._arrays._reduce import ReduceOp
    from aiodist.backends._cuda_tables import reduce_many

    for dt in ["float32", "float16", "int64", "int32", "int16", "uint16"]:
        x = cupy.ones(16, dt).view(cupy.uint8)
        for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG):
            reduce_many(cupy, op, np.dtype(dt), x, [x, x])
    return [
        f"- device-to-device copy 1 GiB: {d2d:.0f} GB/s (each byte read and written)",
        f"- pinned host -> device 256 MiB: {h2d:.1f} GB/s; device -> pinned host: {d2h:.1f} GB/s",
    ]


def rank_counts(path: str) -> list[int]:
    return [1] if path == "nccl" else [1, 2] if path == "cpu" else [1, 2, 3, 4]


def run_ranks(
    fn: Callable[..., Any], n: int, path: str, dry: bool, timeout: float, *, small_slabs: bool
) -> list[Any]:
    """Run ``fn`` on ``n`` processes on ``path``; small IPC slabs make checks go round."""
    env = {}
    if not dry:
        env["AIODIST_CUDA_PATH"] = path
        if small_slabs:
            env["AIODIST_CUDA_IPC_BYTES"] = str(1 << 20)
    return run_world_processes(fn, n, backend="cpu" if dry else "cuda", timeout=timeout, env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="numpy on the CPU, no cupy needed")
    parser.add_argument(
        "--write",
        action="store_true",
        help=f"write {RESULTS.relative_to(RESULTS.parents[2])} (else a temp folder)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="markdown file to write (overrides --write's)"
    )
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run")
    args = parser.parse_args(argv)
    dry = args.dry_run
    if dry and args.write:
        parser.error("--write records a real run: a dry run writes to a temp folder or --out")
    # Committed results change only on purpose: without --write they go to a fresh folder.
    if args.out is None:
        args.out = (
            RESULTS if args.write else Path(tempfile.mkdtemp(prefix="aiodist-bench-"), "gpu.md")
        )
    started = time.monotonic()
    report = Report(args.out, dry)

    def left() -> float:
        return args.budget - (time.monotonic() - started)

    log("== environment")
    lines, paths = environment(dry)
    for line in lines:
        log(line)
    report.add("Environment", lines)

    log("== device ceilings")
    lines = ceilings(dry)
    for line in lines:
        log(line)
    report.add("Device ceilings", lines)

    log("== correctness (every collective against numpy)")
    rows = [
        "| path | ranks | cases passed | failures | longest loop stall (ms) |",
        "| --- | --- | --- | --- | --- |",
    ]
    failures: list[str] = []
    for path in paths:
        for n in rank_counts(path):
            if left() < 60:
                log(f"   {path} x{n}: skipped, out of time")
                continue
            try:
                results = run_ranks(
                    functools.partial(check_rank, dry=dry),
                    n,
                    path,
                    dry,
                    min(120, left() - 30),
                    small_slabs=True,
                )
                passed = sum(len(r["ok"]) for r in results)
                failed = [f"rank {i}: {f}" for i, r in enumerate(results) for f in r["failed"]]
                stall = max(r["stall_ms"] for r in results)
                seen = {r["path"] for r in results}
                note = "" if seen == {path} or dry else f" (ran on {seen})"
            except WorldProcessError as exc:
                passed, failed, stall, note = 0, [str(exc).splitlines()[-1][:300]], float("nan"), ""
            failures += [f"{path} x{n}: {f}" for f in failed]
            rows.append(f"| {path}{note} | {n} | {passed} | {len(failed)} | {stall:.1f} |")
            log(f"   {path} x{n}: {passed} passed, {len(failed)} failed, loop stall {stall:.1f} ms")
            for f in failed[:10]:
                log(f"      {f}")
            report.add(
                "Correctness", rows + ([""] + [f"- {f}" for f in failures[:40]] if failures else [])
            )
    report.add("Correctness", rows + ([""] + [f"- {f}" for f in failures[:40]] if failures else []))

    log("== all_reduce time (median)")
    sizes = DRY_SIZES if dry else SIZES
    table: dict[str, dict[int, float]] = {}
    stalls: dict[str, float] = {}
    for path in paths:
        n = 1 if path == "nccl" else 2
        label = f"{path} x{n}"
        if left() < 40:
            log(f"   {label}: skipped, out of time")
            continue
        try:
            fn = functools.partial(
                time_rank, dry=dry, sizes=sizes, budget=max(10.0, left() / 3 - 20)
            )
            results = run_ranks(fn, n, path, dry, left() - 10, small_slabs=False)
            table[label] = results[0]["times"]
            stalls[label] = max(r["stall_ms"] for r in results)
        except WorldProcessError as exc:
            log(f"   {label}: failed: {str(exc).splitlines()[-1][:300]}")
            continue
        for size, t in table[label].items():
            log(f"   {label:12s} {size:>12d} B {t * 1e6:12.1f} us {size / t / 1e9:8.2f} GB/s")
    if importlib.util.find_spec("torch") is not None and left() > 30:
        try:
            table["torch nccl x1" if not dry else "torch gloo x1"] = torch_times(dry, sizes)
        except Exception as exc:
            log(f"   torch: failed: {type(exc).__name__}: {exc}")
    header = "| size | " + " | ".join(f"{k} us (GB/s)" for k in table) + " |"
    lines = [header, "|" + " --- |" * (len(table) + 1)]
    for size in sizes:
        cells = [
            f"{table[k][size] * 1e6:.1f} ({size / table[k][size] / 1e9:.2f})"
            if size in table[k]
            else "-"
            for k in table
        ]
        lines.append(f"| {size} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Longest loop stall while timing: "
        + ", ".join(f"{k} {v:.1f} ms" for k, v in stalls.items()),
    ]
    for line in lines:
        log(line)
    report.add("all_reduce time", lines)
    log(f"== done in {time.monotonic() - started:.0f} s; wrote {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.exit(2)
