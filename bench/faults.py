"""Time-to-error under injected faults: aiodist against torch's gloo, same scenarios.

Every rank is its own process (``tests/fault_worker.py``); the store runs in a process of
its own too. Scenarios:

- ``sigkill N``: N ranks loop over all_reduce; rank 1 is SIGKILLed.
- ``cut``: 3 ranks loop over all_reduce; every TCP connection between rank 0 and rank 1 is
  reset (``ss -K``, the kernel's socket destroy: both ends see a reset). Same fault for
  both libraries; the test suite does the same with a proxy it controls. aiodist's ranks
  run with ``AIODIST_SHM=0`` here (on one host they would otherwise share memory, and have
  no connection to cut); in the other scenarios they use shared memory, as by default.
- ``store killed``: 2 ranks wait on a store key; the store's process is SIGKILLed.
- ``straggler``: of 3 ranks, rank 2 never calls all_reduce (group timeout 5 s).

For each surviving rank: the error it raised and the seconds from the fault to the error
(or "no error" if it reported none within the group timeout + 5 s). Needs root in a private
network namespace for ``ss -K``:
``unshare -n bash -c 'ip link set lo up && .venv/bin/python bench/faults.py'`` (``unshare -n``
needs root; ``unshare -rn`` makes you root in a namespace of your own, which is enough).

The tables are printed and written to a temporary folder, or with ``--write`` to
``bench/results/faults.md`` (``--out``: another path). Without torch
(``pip install torch==2.13.0``) only aiodist's column is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "fault_worker.py"
HOST = "127.0.0.1"


class Proc:
    """A worker process and the JSON events it printed."""

    def __init__(self, rank: int, proc: asyncio.subprocess.Process) -> None:
        self.rank, self.proc = rank, proc
        self.events: list[dict[str, Any]] = []
        self.reader = asyncio.get_running_loop().create_task(self._read())

    def __repr__(self) -> str:
        return f"<Proc rank={self.rank} pid={self.proc.pid}>"

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            with contextlib.suppress(json.JSONDecodeError):
                self.events.append(json.loads(line))

    async def event(self, name: str, timeout: float) -> dict[str, Any] | None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for e in self.events:
                if e["event"] == name:
                    return e
            if self.reader.done():
                return None
            await asyncio.sleep(0.01)
        return None

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()
        await self.reader


async def spawn(
    lib: str, mode: str, rank: int, world: int, port: int, timeout: float, tcp_only: bool = False
) -> Proc:
    # Ranks on one host talk through shared memory unless told otherwise: a scenario that
    # cuts TCP connections needs them on TCP.
    env = {**os.environ, "AIODIST_SHM": "0"} if tcp_only else None
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(WORKER),
        lib,
        mode,
        str(rank),
        str(world),
        HOST,
        str(port),
        str(timeout),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env=env,
    )
    return Proc(rank, proc)


def cut_connections(pid_a: int, pid_b: int) -> int:
    """Reset every established TCP connection between processes ``pid_a`` and ``pid_b``."""
    out = subprocess.run(
        ["ss", "-tnpH", "state", "established"], capture_output=True, text=True, check=True
    ).stdout
    owner: dict[int, int] = {}
    conns: list[tuple[int, int, int]] = []
    for line in out.splitlines():
        m = re.search(r":(\d+)\s+\S+:(\d+)\s+users:\(\(\"[^\"]*\",pid=(\d+)", line)
        if m:
            local, peer, pid = map(int, m.groups())
            owner[local] = pid
            conns.append((local, peer, pid))
    killed = 0
    for local, peer, pid in conns:
        if pid == pid_a and owner.get(peer) == pid_b:
            subprocess.run(
                ["ss", "-K", "-tn", "sport", "=", f":{local}", "dport", "=", f":{peer}"],
                capture_output=True,
                check=True,
            )
            killed += 1
    return killed


async def scenario(lib: str, name: str, world: int, timeout: float) -> dict[str, Any]:
    """Run one scenario for ``lib``; return what each surviving rank got and when."""
    store_lib = "torch" if lib == "torch" else "aiodist"
    store = await spawn(store_lib, "store", 0, world, 0, timeout)
    ranks: list[Proc] = []
    note = ""
    try:
        started = await store.event("store", 60)
        assert started is not None, "the store did not start"
        port = started["port"]
        mode = {"sigkill": "loop", "cut": "loop", "store": "storewait", "straggler": "straggler"}
        tcp_only = name == "cut"
        ranks = [
            await spawn(lib, mode[name], r, world, port, timeout, tcp_only) for r in range(world)
        ]
        ready = "looping" if mode[name] == "loop" else "ready"
        for r in ranks:
            if await r.event(ready, 120) is None:
                raise RuntimeError(f"{lib} {name}: rank {r.rank} never got ready: {r.events}")
        await asyncio.sleep(0.3)
        fault = time.time()
        survivors = ranks
        if name == "sigkill":
            ranks[1].proc.send_signal(signal.SIGKILL)
            survivors = [r for r in ranks if r.rank != 1]
        elif name == "cut":
            note = f"{cut_connections(ranks[0].proc.pid, ranks[1].proc.pid)} connection(s) reset"
        elif name == "store":
            store.proc.send_signal(signal.SIGKILL)
        elif name == "straggler":
            survivors = ranks[:-1]
        got = {}
        for r in survivors:
            e = await r.event("error", max(0.0, fault + timeout + 5 - time.time()))
            if e is None:
                got[r.rank] = None
            else:
                msg = " ".join(e["msg"].split())
                got[r.rank] = (e["type"], round(e["t"] - fault, 3), msg[:160])
        return {"lib": lib, "scenario": name, "world": world, "ranks": got, "note": note}
    finally:
        for r in ranks:
            await r.stop()
        await store.stop()


def cell(result: dict[str, Any], timeout: float) -> str:
    parts = []
    for rank, got in sorted(result["ranks"].items()):
        if got is None:
            parts.append(f"r{rank}: no error in {timeout + 5:g} s (hung)")
        else:
            kind, seconds, _ = got
            hung = " (group timeout)" if seconds >= timeout - 0.5 else ""
            parts.append(f"r{rank}: {kind} {seconds:.2f} s{hung}")
    return "<br>".join(parts)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=10.0, help="group timeout, seconds")
    parser.add_argument("--straggler-timeout", type=float, default=5.0)
    parser.add_argument("--libs", default="aiodist,torch")
    parser.add_argument("--only", default="", help="comma-separated scenario names to run")
    parser.add_argument(
        "--write", action="store_true", help="write bench/results/faults.md (else a temp folder)"
    )
    parser.add_argument("--out", help="the results file (overrides --write's)")
    args = parser.parse_args()
    # Committed results change only on purpose: without --write they go to a fresh folder.
    if args.out is None:
        args.out = str(
            ROOT / "bench" / "results" / "faults.md"
            if args.write
            else Path(tempfile.mkdtemp(prefix="aiodist-bench-"), "faults.md")
        )
    plan = [
        ("sigkill", 2, "SIGKILL rank 1 mid all_reduce, 2 ranks"),
        ("sigkill", 3, "SIGKILL rank 1 mid all_reduce, 3 ranks"),
        ("sigkill", 4, "SIGKILL rank 1 mid all_reduce, 4 ranks"),
        ("cut", 3, "connections rank 0 <-> 1 reset mid all_reduce, 3 ranks"),
        ("store", 2, "store process SIGKILLed while ranks wait on a key, 2 ranks"),
        ("straggler", 3, "rank 2 never calls all_reduce, 3 ranks"),
    ]
    if args.only:
        plan = [p for p in plan if p[0] in args.only.split(",")]
    libs = args.libs.split(",")
    if "torch" in libs:
        try:
            import torch  # noqa: F401
        except ImportError:
            print("torch is not installed (pip install torch==2.13.0): the gloo column is left out")
            libs.remove("torch")
    rows = []
    details = []
    for name, world, title in plan:
        timeout = args.straggler_timeout if name == "straggler" else args.timeout
        cells = []
        for lib in libs:
            result = await scenario(lib, name, world, timeout)
            cells.append(cell(result, timeout))
            for rank, got in sorted(result["ranks"].items()):
                what = "no error" if got is None else f"{got[0]} after {got[1]} s: {got[2]}"
                details.append(f"- {title}, {lib}, rank {rank}: {what}")
            if result["note"]:
                details.append(f"- {title}, {lib}: {result['note']}")
            print(f"{title} / {lib}: {cells[-1]}", file=sys.stderr, flush=True)
        rows.append(f"| {title} | " + " | ".join(cells) + " |")
    names = {"aiodist": "aiodist", "torch": "torch gloo"}
    table = "\n".join(
        [
            "| scenario | " + " | ".join(names[lib] for lib in libs) + " |",
            "| --- | " + " | ".join("---" for _ in libs) + " |",
            *rows,
        ]
    )
    text = (
        "# Time-to-error under injected faults\n\n"
        f"`python bench/faults.py` (one process per rank on loopback; group timeout "
        f"{args.timeout:g} s, straggler scenario {args.straggler_timeout:g} s; aiodist's "
        "ranks share memory, as by default on one host, except where connections are cut, "
        "which runs them with AIODIST_SHM=0). Each cell: what each surviving rank raised "
        "and the seconds from the fault to the error.\n\n"
        f"{table}\n\n## Messages\n\n" + "\n".join(details) + "\n"
    )
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)  # noqa: ASYNC240 - once, at the end
    print(f"wrote {out}")


if __name__ == "__main__":
    asyncio.run(main())
