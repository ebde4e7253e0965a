"""A host of an elastic job lost at a random step: do the other host's workers finish well?

Run (as root: it creates network namespaces; it leaves the machine as it found it):

    .venv/bin/python bench/lost_host.py --write

Two network namespaces are the hosts, joined by a veth pair: 10.98.0.1 (it hosts the store)
and 10.98.0.2. Each runs ``aiodist-run --nnodes=1:2 --nproc-per-node=2
--master-addr=10.98.0.1 --restart-policy=failed --max-restarts=1`` with
``examples/elastic_sgd.py --steps=40 --step-seconds=0.1 --log-steps`` (no worker kills itself),
beside ``--hogs`` processes that spin (default 2: ``python3 -c 'while True: pass'``), with
the library's default timeouts (peer timeout 8 s, a node lost after 15 s of silence). Once
host 0's rank 0 has done a step drawn at random (3 to 36, ``--seed``), host 1 is lost, in
one of two ways (``--modes``), each ``--runs`` times in turn:

    killed   its link goes down (no FIN, no RST), then every process in it is killed
    silent   only its link goes down: its processes run on, cut off

A run passes when host 0's launcher exits 0 and both of its workers end with the weights one
process computes with numpy (the example checks them). A run not ended ``--guard`` seconds
(default 120) after the loss is killed and counted as hung. For each run the results give
the time from the loss to the survivors' shrink (the line ``ranks [2, 3] lost; now rank 0 of
2``), to host 0's launcher leaving node 1 behind, and to its exit.

The results go to ``lost_host.md`` in a fresh temporary folder, or with ``--write`` to
``bench/results/lost_host.md`` (``--out``: another path); the output of host 0's launcher in
every run, each line with its time from the loss, to that temporary folder.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import checkout_commit  # bench/compare.py, found through the path above

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "elastic_sgd.py"
MODES = ("killed", "silent")
STEPS = 40
ADDRESSES = ("10.98.0.1", "10.98.0.2")
NAMESPACES = (f"aiodlh{os.getpid()}a", f"aiodlh{os.getpid()}b")
VETHS = (f"vlh{os.getpid()}a", f"vlh{os.getpid()}b")
PORT = 29455


@dataclass
class Run:
    mode: str
    index: int
    step: int
    outcome: str = "passed"
    #: Seconds from the loss to: the survivors' shrink, the launcher leaving node 1 behind,
    #: the launcher's exit (``None``: not seen).
    shrunk: float | None = None
    left_behind: float | None = None
    ended: float | None = None
    tail: list[str] = field(default_factory=list)


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def make_hosts() -> None:
    for ns in NAMESPACES:
        ip("netns", "add", ns)
    ip("link", "add", VETHS[0], "type", "veth", "peer", "name", VETHS[1])
    for ns, veth, addr in zip(NAMESPACES, VETHS, ADDRESSES, strict=True):
        ip("link", "set", veth, "netns", ns)
        ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
        ip("-n", ns, "link", "set", veth, "up")
        ip("-n", ns, "link", "set", "lo", "up")


def kill_all(ns: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    if pids.stdout.split():
        subprocess.run(["kill", "-9", *pids.stdout.split()], capture_output=True)


def remove_hosts() -> None:
    for ns, veth in zip(NAMESPACES, VETHS, strict=True):
        kill_all(ns)
        subprocess.run(["ip", "-n", ns, "link", "del", veth], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class Node:
    """One host's launcher; its output lines, with the time each came."""

    def __init__(self, host: int, run_id: str) -> None:
        command = [
            *("ip", "netns", "exec", NAMESPACES[host], sys.executable, "-m", "aiodist.run"),
            "--nnodes=1:2",
            "--nproc-per-node=2",
            f"--master-addr={ADDRESSES[0]}",
            f"--master-port={PORT}",
            f"--rdzv-id={run_id}",
            "--restart-policy=failed",
            "--max-restarts=1",
            "--shutdown-timeout=2",
            str(EXAMPLE),
            f"--steps={STEPS}",
            "--step-seconds=0.1",
            "--kill-step=-1",
            "--log-steps",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AIODIST_", "MASTER_"))}
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        self.lines: list[tuple[float, str]] = []
        self._readers = [
            threading.Thread(target=self._read, args=(stream,), daemon=True)
            for stream in (self.proc.stdout, self.proc.stderr)
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, text: str) -> float | None:
        """When the first line holding ``text`` came (``None``: none did)."""
        return next((t for t, line in list(self.lines) if text in line), None)

    def wait_for(self, text: str, deadline: float) -> bool:
        while self.first(text) is None:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                return self.first(text) is not None
            time.sleep(0.01)
        return True

    def end(self, timeout: float) -> bool:
        """Whether it ended within ``timeout`` seconds (else it is killed)."""
        try:
            self.proc.wait(timeout)
            ended = True
        except subprocess.TimeoutExpired:
            ended = False
            self.proc.kill()
            self.proc.wait()
        for reader in self._readers:
            reader.join(5)
        return ended


def one_run(mode: str, index: int, rng: random.Random, guard: float, logs: Path) -> Run:
    run = Run(mode, index, rng.randrange(3, STEPS - 3))
    lost = time.monotonic()
    nodes = [Node(host, f"lost-{mode}-{index}") for host in (0, 1)]
    try:
        if not nodes[0].wait_for(f"worker 0: step {run.step} done", time.monotonic() + guard):
            run.outcome = "did not start"
        else:
            lost = time.monotonic()
            ip("-n", NAMESPACES[1], "link", "set", VETHS[1], "down")
            if mode == "killed":
                kill_all(NAMESPACES[1])
            if not nodes[0].end(guard):
                run.outcome = "hung"
            else:
                run.ended = time.monotonic() - lost
            for name, text in (("shrunk", "now rank 0 of 2"), ("left_behind", "node 1 was lost")):
                when = nodes[0].first(text)
                setattr(run, name, None if when is None else when - lost)
            done = [line for _, line in nodes[0].lines if "weights match the reference" in line]
            if run.outcome == "passed" and nodes[0].proc.returncode != 0:
                run.outcome = f"failed (exit {nodes[0].proc.returncode})"
            elif run.outcome == "passed" and (
                len(done) != 2 or not all(line.endswith("True") for line in done)
            ):
                run.outcome = "failed (weights)"
    finally:
        for node in nodes:
            if node.proc.poll() is None:
                node.proc.kill()
            node.end(10)
        for ns in NAMESPACES:
            kill_all(ns)
        ip("-n", NAMESPACES[1], "link", "set", VETHS[1], "up")
    if run.outcome != "passed":
        run.tail = [line for _, line in nodes[0].lines][-30:]
    with (logs / f"{mode}-{index}.log").open("w") as log:
        log.writelines(f"{t - lost:8.3f} {line}\n" for t, line in nodes[0].lines)
    return run


def _median(values: list[float | None]) -> str:
    seen = [v for v in values if v is not None]
    return f"{statistics.median(seen):.1f}" if seen else "-"


def _max(values: list[float | None]) -> str:
    seen = [v for v in values if v is not None]
    return f"{max(seen):.1f}" if seen else "-"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def report(runs: list[Run], args: argparse.Namespace, minutes: float) -> str:
    lines = [
        "# A host of an elastic job lost at a random step (`bench/lost_host.py`)",
        "",
        f"Command: `.venv/bin/python bench/lost_host.py --runs {args.runs} --seed {args.seed} "
        f"--hogs {args.hogs} --write`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{os.cpu_count()} CPUs, Linux {os.uname().release}, aiodist commit "
        f"`{checkout_commit()}`, Python {sys.version.split()[0]}; run time {minutes:.1f} min.",
        "",
        "Each run: two network namespaces as hosts, each running `aiodist-run --nnodes=1:2 "
        "--nproc-per-node=2 --master-addr=10.98.0.1 --restart-policy=failed --max-restarts=1 "
        f"examples/elastic_sgd.py --steps={STEPS} --step-seconds=0.1 --kill-step=-1 "
        f"--log-steps`, beside {args.hogs} processes that spin, with the default timeouts "
        "(peer timeout 8 s, a node lost after 15 s); once host 0's rank 0 has done a step drawn "
        "at random, host 1 is lost: its link down, then every process in it killed (`killed`), "
        "or its link down only (`silent`). A run passes when host 0's launcher exits 0 and "
        "both of its workers' weights equal the numpy reference. Times are seconds from the "
        "loss.",
        "",
        "## Summary",
        "",
        "| mode | runs | passed | failed | hung | to the shrink, median (s) | max (s) | "
        "to node 1 left behind, median (s) | to the launcher's exit, median (s) | max (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode in args.modes:
        mine = [r for r in runs if r.mode == mode]
        if not mine:
            continue
        passed = sum(r.outcome == "passed" for r in mine)
        hung = sum(r.outcome == "hung" for r in mine)
        lines.append(
            f"| {mode} | {len(mine)} | {passed} | {len(mine) - passed - hung} | {hung} | "
            f"{_median([r.shrunk for r in mine])} | {_max([r.shrunk for r in mine])} | "
            f"{_median([r.left_behind for r in mine])} | {_median([r.ended for r in mine])} | "
            f"{_max([r.ended for r in mine])} |"
        )
    lines += [
        "",
        "## Every run",
        "",
        "| mode | run | step | outcome | to the shrink (s) | to node 1 left behind (s) | "
        "to the exit (s) |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in runs:
        lines.append(
            f"| {r.mode} | {r.index} | {r.step} | {r.outcome} | {_seconds(r.shrunk)} | "
            f"{_seconds(r.left_behind)} | {_seconds(r.ended)} |"
        )
    failures = [r for r in runs if r.outcome != "passed"]
    if failures:
        lines += ["", "## Host 0's output in the runs that did not pass", ""]
        for r in failures:
            lines += [f"### {r.mode} {r.index}: {r.outcome}", "", "```", *r.tail, "```", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=20, help="runs of each mode")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--hogs", type=int, default=2, help="processes that spin beside the job")
    p.add_argument("--guard", type=float, default=120.0, help="seconds before a run is hung")
    p.add_argument("--write", action="store_true", help="write bench/results/lost_host.md")
    p.add_argument("--out", default="", help="the results file (default: see --write)")
    args = p.parse_args()
    args.modes = args.modes.split(",")
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown:
        p.error(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    rng = random.Random(args.seed)
    logs = Path(tempfile.mkdtemp(prefix="aiodist-lost-host-"))
    t0 = time.monotonic()
    runs = []
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    make_hosts()
    try:
        for index in range(1, args.runs + 1):
            for mode in args.modes:
                run = one_run(mode, index, rng, args.guard, logs)
                print(
                    f"{mode} {index}: {run.outcome} (step {run.step}; shrunk "
                    f"{_seconds(run.shrunk)}, left behind {_seconds(run.left_behind)}, "
                    f"ended {_seconds(run.ended)} s after the loss)",
                    flush=True,
                )
                runs.append(run)
    finally:
        remove_hosts()
        for hog in hogs:
            hog.kill()
            hog.wait()
    text = report(runs, args, (time.monotonic() - t0) / 60)
    if args.out:
        out = Path(args.out)
    elif args.write:
        out = ROOT / "bench" / "results" / "lost_host.md"
    else:
        out = logs / "lost_host.md"
    out.write_text(text)
    print(f"wrote {out} (every run's output: {logs})")


if __name__ == "__main__":
    main()
