"""Workers of an elastic job killed from outside at random moments: does every job end well?

Run (in a private network namespace, like the other benches):

    unshare -n bash -c 'ip link set lo up && .venv/bin/python bench/elastic_chaos.py --write'

Each run starts ``examples/elastic_sgd.py`` as a job of 4 workers under ``aiodist-run
--standalone --nproc-per-node=4 --restart-policy=failed --max-restarts=4
--preload=numpy,aiodist.sync`` (``--preload``: another list, or ``''`` for workers started
as new processes; steps of ``--step-seconds``, 0.02 s; ``--wait-for-replacements``: at an
admission point the members wait until the world is whole again; no worker kills itself)
and ``SIGKILL``s workers from outside, as the OOM killer or a lost host would, at moments
drawn at random (``--seed``).
The scenarios (``--scenarios``, comma-separated), each ``--runs`` times, in turn:

    one          one member, 0-0.5 s after the workers started (in their start-up: joining
                 the group; or training)
    two-apart    two members, the second 0-50 ms after the first: the second dies while the
                 survivors look up who was lost, vote, or form the shrunk world
    two-at-once  two members at once
    replacement  one member; then its replacement 0-400 ms after the replacement started
                 (waiting in the lobby, connecting to the members, setting up the grown
                 world, or receiving the state)
    admission    one member; then another member 0-400 ms after the replacement started:
                 while the members admit it, or around that

A run passes when the launcher exits 0 and every worker that ended reported weights equal to
the single-process numpy reference (the example checks them: the gradient is a sum over the
whole data set however it is sharded, so every membership change must keep it exact). A run
that has not ended after ``--guard`` seconds (default 60) is killed and counted as hung.
Every failed or hung run keeps the tail of its output in the results.

The results go to ``elastic_chaos.md`` in a fresh temporary folder, or with ``--write`` to
``bench/results/elastic_chaos.md`` (``--out``: another path).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import checkout_commit  # bench/compare.py, found through the path above

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "elastic_sgd.py"
SCENARIOS = ("one", "two-apart", "two-at-once", "replacement", "admission")
NPROC = 4


@dataclass
class Run:
    scenario: str
    index: int
    outcome: str = "passed"
    seconds: float = 0.0
    kills: list[str] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)


def workers(launcher: int) -> set[int]:
    """The process ids of the launcher's workers now: its children, or with ``--preload`` its
    starter's (a fork shows the starter's command line and environment in ``/proc``, so
    workers are told apart by process id, not by ``RANK``)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    starters = set()
    for pid, ppid in parents.items():
        if ppid == launcher:
            with contextlib.suppress(OSError):
                if b"aiodist.launcher._preload" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    starters.add(pid)
    return {pid for pid, ppid in parents.items() if ppid in {launcher, *starters}} - starters


def kill(run: Run, pid: int, started: float, what: str) -> None:
    with_time = f"{what} (pid {pid}) at {time.monotonic() - started:.3f} s"
    try:
        os.kill(pid, signal.SIGKILL)
        run.kills.append(with_time)
    except ProcessLookupError:
        run.kills.append(f"{with_time}: already gone")


def wait_for_replacement(
    launcher: int, members: set[int], proc: subprocess.Popen[bytes], deadline: float
) -> int | None:
    """Wait until a worker that is not one of ``members`` runs and return its process id;
    ``None`` if the job ends or the deadline passes first."""
    while time.monotonic() < deadline and proc.poll() is None:
        fresh = workers(launcher) - members
        if fresh:
            return min(fresh)
        time.sleep(0.005)
    return None


def inject(run: Run, proc: subprocess.Popen[bytes], rng: random.Random, guard: float) -> None:
    """Kill workers of the job ``proc`` as ``run.scenario`` says."""
    started = time.monotonic()
    members: set[int] = set()
    while len(members) < NPROC and time.monotonic() < started + guard and proc.poll() is None:
        time.sleep(0.005)
        members = workers(proc.pid)  # nothing was killed yet: the workers first started
    if len(members) < NPROC:
        run.kills.append(f"only {len(members)} workers found")
        return
    time.sleep(rng.uniform(0.0, 0.5))
    first, second = rng.sample(sorted(members), 2)
    kill(run, first, started, "member")
    if run.scenario == "two-apart":
        time.sleep(rng.uniform(0.0, 0.05))
        kill(run, second, started, "member")
    elif run.scenario == "two-at-once":
        kill(run, second, started, "member")
    elif run.scenario in ("replacement", "admission"):
        fresh = wait_for_replacement(proc.pid, members, proc, started + guard)
        if fresh is None:
            run.kills.append("no replacement started")
            return
        time.sleep(rng.uniform(0.0, 0.4))
        kill(run, fresh if run.scenario == "replacement" else second, started, run.scenario)


def one_run(
    scenario: str, index: int, rng: random.Random, args: argparse.Namespace, out: Path
) -> Run:
    run = Run(scenario, index)
    log = out / f"{scenario}-{index}.log"
    command = [
        sys.executable,
        "-m",
        "aiodist.run",
        "--standalone",
        f"--nproc-per-node={NPROC}",
        "--restart-policy=failed",
        "--max-restarts=4",
        f"--preload={args.preload}",
        str(EXAMPLE),
        "--kill-step=1000000",  # no worker kills itself
        "--step-seconds=0.02",
        "--wait-for-replacements",
    ]
    started = time.monotonic()
    with log.open("wb") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            inject(run, proc, rng, args.guard)
            proc.wait(timeout=max(1.0, args.guard - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            run.outcome = "hung"
            for pid in workers(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait()
    run.seconds = time.monotonic() - started
    text = log.read_text(errors="replace")
    matches = [line for line in text.splitlines() if "weights match the reference" in line]
    if run.outcome != "hung":
        if proc.returncode != 0:
            run.outcome = f"failed (exit {proc.returncode})"
        elif not matches or any(not line.endswith("True") for line in matches):
            run.outcome = "failed (weights)"
    if run.outcome != "passed":
        run.tail = text.splitlines()[-25:]
    return run


def report(runs: list[Run], args: argparse.Namespace, minutes: float) -> str:
    lines = [
        "# Elastic job under random SIGKILLs from outside (`bench/elastic_chaos.py`)",
        "",
        f"Command: `unshare -n bash -c 'ip link set lo up && .venv/bin/python "
        f"bench/elastic_chaos.py --runs {args.runs} --seed {args.seed} --write'`, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, "
        f"aiodist commit `{checkout_commit()}`, Python {sys.version.split()[0]}; "
        f"run time {minutes:.1f} min.",
        "",
        f"Each run: `aiodist-run --standalone --nproc-per-node={NPROC} "
        f"--restart-policy=failed --max-restarts=4 --preload={args.preload} "
        "examples/elastic_sgd.py "
        "--kill-step=1000000 --step-seconds=0.02 --wait-for-replacements`, workers killed "
        "from outside as the scenario says (see the bench's docstring); a run passes when "
        "the launcher exits 0 and every worker's weights equal the numpy reference; a run "
        f"not ended after {args.guard:g} s is hung.",
        "",
        "## Summary",
        "",
        "| scenario | runs | passed | failed | hung | run time, median (s) | max (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for scenario in args.scenarios:
        mine = [r for r in runs if r.scenario == scenario]
        if not mine:
            continue
        times = [r.seconds for r in mine]
        passed = sum(r.outcome == "passed" for r in mine)
        hung = sum(r.outcome == "hung" for r in mine)
        lines.append(
            f"| {scenario} | {len(mine)} | {passed} | {len(mine) - passed - hung} | {hung} | "
            f"{statistics.median(times):.2f} | {max(times):.2f} |"
        )
    lines += ["", "## Every run", "", "| scenario | run | outcome | seconds | kills |"]
    lines.append("| --- | ---: | --- | ---: | --- |")
    for r in runs:
        lines.append(
            f"| {r.scenario} | {r.index} | {r.outcome} | {r.seconds:.2f} | {'; '.join(r.kills)} |"
        )
    failures = [r for r in runs if r.outcome != "passed"]
    if failures:
        lines += ["", "## The output of the runs that did not pass", ""]
        for r in failures:
            lines += [f"### {r.scenario} {r.index}: {r.outcome}", "", "```", *r.tail, "```", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=10, help="runs of each scenario")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--preload", default="numpy,aiodist.sync", help="aiodist-run --preload")
    p.add_argument("--guard", type=float, default=60.0, help="seconds before a run is hung")
    p.add_argument("--write", action="store_true", help="write bench/results/elastic_chaos.md")
    p.add_argument("--out", default="", help="the results file (default: see --write)")
    args = p.parse_args()
    args.scenarios = args.scenarios.split(",")
    unknown = sorted(set(args.scenarios) - set(SCENARIOS))
    if unknown:
        p.error(f"unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}")
    rng = random.Random(args.seed)
    logs = Path(tempfile.mkdtemp(prefix="aiodist-elastic-chaos-"))
    t0 = time.monotonic()
    runs = []
    for index in range(1, args.runs + 1):
        for scenario in args.scenarios:
            run = one_run(scenario, index, rng, args, logs)
            print(f"{scenario} {index}: {run.outcome} in {run.seconds:.2f} s; {run.kills}")
            runs.append(run)
    text = report(runs, args, (time.monotonic() - t0) / 60)
    if args.out:
        out = Path(args.out)
    elif args.write:
        out = ROOT / "bench" / "results" / "elastic_chaos.md"
    else:
        out = logs / "elastic_chaos.md"
    out.write_text(text)
    print(f"wrote {out} (every run's output: {logs})")


if __name__ == "__main__":
    main()
