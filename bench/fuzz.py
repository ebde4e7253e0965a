"""Random programs checked against numpy, many of them: wrong values, hangs, errors, leaks.

Run (in a private network namespace, like the other benches):

    unshare -n bash -c 'ip link set lo up && .venv/bin/python bench/fuzz.py --programs 10000 --write'

Program ``i`` is the program of seed ``--seed + i`` (``tests/program_fuzz.py``: 20-40
collectives, point-to-point calls and subgroup calls, with one-rank usage errors, cancelled
awaits and expiring waits, each result compared with a numpy model). The programs are split
into equal blocks over the configurations: every world size of ``--ranks``, transport of
``--transport`` (``shm``, ``tcp``), API of ``--api`` (``async``: the ranks as tasks of one
loop, ``aiodist.testing.run_world``; ``sync``: the blocking API, one process per rank) and
loop of ``--loop`` (``asyncio``, ``uvloop``). ``--staging BYTES`` sets every rank's staging
bound (``$AIODIST_STAGING_BYTES``): with a small one most messages are announced and their
payloads wait for their receives (over shared memory, copied from the sender's memory unless
``AIODIST_SHM_PULL=0``), and the programs draw larger arrays too. A program that fails prints
the command that replays it: ``--seed`` its seed, one value of each of the four options,
``--staging`` if given, ``--programs 1``.

The programs run in worker processes that stay up from one program to the next, so that
what a program leaves behind adds up: for the async API one process that runs every rank;
for the blocking API one process per rank, each joining a new default group for each
program through a TCPStore that this process hosts, as a job that destroys its default group
and makes another does (one ``group_name`` per worker set: each program is the job's next
generation). A program is counted

- **wrong value**: a result differs from the model;
- **hang**: an operation timed out (``OP_TIMEOUT``, 5 s), or its workers did not answer
  within ``--guard`` seconds (they are killed and started again);
- **error**: an error that should not happen: a call raised where the model says it
  succeeds, raised something else than the model says, or did not raise (a rejection that
  never reached a rank that needed it), a worker crashed, or an event loop's exception
  handler fired.

A worker set whose program found a problem is started again before the next program. After
each program the bench reads each worker's resident memory, the keys left in the store (by
the blocking API's worlds, which are destroyed), and the files left in ``/dev/shm`` by the
workers. The first program of a worker set makes its job's own keys, which its later
programs reuse (a generation counter and a forming record per rank, the job's current
world): counted apart from the keys each later program leaves. The growth of resident
memory is counted from the end of the ``--warmup``-th program of a worker set to its last.

The results go to ``fuzz.md`` in a fresh temporary folder, or with ``--write`` to
``bench/results/fuzz.md`` (``--out``: another path), with every failing program's report.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import multiprocessing
import multiprocessing.connection
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests"))

import program_fuzz  # noqa: E402  (tests/, through the path above)
from compare import checkout_commit  # noqa: E402  (bench/compare.py, through the path above)
from program_fuzz import (  # noqa: E402
    HANG,
    UNEXPECTED_ERROR,
    WRONG_VALUE,
    Config,
    RankReport,
    Report,
)

SHM_DIR = Path("/dev/shm")


# -- workers -------------------------------------------------------------------------------
def _async_worker(conn: multiprocessing.connection.Connection, loop: str) -> None:
    """Run programs with the async API on one loop that lives as long as the process."""
    from aiodist._util._loop import loop_factory

    caught: list[dict[str, Any]] = []
    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        runner.get_loop().set_exception_handler(lambda _loop, context: caught.append(context))
        while (config := conn.recv()) is not None:
            reports, error, kind = [], "", ""
            try:
                reports = runner.run(program_fuzz.run_world_program(config))
            except Exception as exc:
                error, kind = program_fuzz.runner_failure(exc)
            if caught:
                error = "; ".join(filter(None, [error, program_fuzz.handler_fired(caught)]))
                kind = kind or UNEXPECTED_ERROR
                caught.clear()
            conn.send((reports, error, kind))


def _sync_worker(
    conn: multiprocessing.connection.Connection,
    rank: int,
    port: int,
    name: str,
    environment: dict[str, str],
) -> None:
    """Run rank ``rank`` of programs with the blocking API, a new default group of the job
    ``name`` (``group_name``) for each, under ``environment`` (its loop, staging bound)."""
    os.environ.update(environment)
    import aiodist.sync as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    while (config := conn.recv()) is not None:
        program = config.program()
        try:
            dist.init_process_group(
                "cpu",
                store=store,
                rank=rank,
                world_size=config.ranks,
                timeout=program_fuzz.RUN_LIMIT,
                group_name=name,
                shared_memory=config.transport == "shm",
            )
            try:
                report, error, kind = program_fuzz.run_sync_rank(program, rank), "", ""
            finally:
                dist.destroy_process_group()
        except Exception as exc:
            report, kind = RankReport(rank), program_fuzz.runner_failure(exc)[1]
            error = f"rank {rank}: {traceback.format_exc(limit=8)}"
        conn.send(([report], error, kind))


def _rss_mib(pid: int) -> float:
    """Resident memory of process ``pid`` in MiB (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _shm_files(pids: set[int]) -> list[str]:
    """The files of ``/dev/shm`` that processes ``pids`` made
    (``aiodist-<job>-<kind><rank>-<pid>-<start>-<nonce>``)."""
    found = []
    for path in SHM_DIR.glob("aiodist-*"):
        parts = path.name.rsplit("-", 3)
        if len(parts) == 4 and parts[1].isdigit() and int(parts[1]) in pids:
            found.append(path.name)
    return found


@dataclass
class WorkerSet:
    """Worker processes that run programs of one API, loop and staging bound (and,
    blocking, world size)."""

    key: tuple[Any, ...]
    procs: list[multiprocessing.process.BaseProcess] = field(default_factory=list)
    conns: list[multiprocessing.connection.Connection] = field(default_factory=list)
    programs: int = 0
    rss: list[float] = field(default_factory=list)  # total resident MiB after each program

    @classmethod
    def start(cls, config: Config, port: int) -> WorkerSet:
        ctx = multiprocessing.get_context("spawn")
        workers = cls(_key(config))
        if config.api == "async":
            targets = [(_async_worker, (config.loop,))]
        else:
            # (A job of its own: workers started again after a problem begin afresh.)
            job = f"fuzz-{config.seed}"
            env = {"AIODIST_LOOP": config.loop, **config.environment()}
            targets = [(_sync_worker, (r, port, job, env)) for r in range(config.ranks)]
        for target, args in targets:
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=target, args=(theirs, *args), daemon=True)
            proc.start()
            theirs.close()
            workers.procs.append(proc)
            workers.conns.append(ours)
        return workers

    @property
    def pids(self) -> set[int]:
        return {p.pid for p in self.procs if p.pid is not None}

    def run(self, config: Config, guard: float) -> tuple[list[RankReport], str, str]:
        """Run ``config``'s program: the ranks' reports, an error, and its kind."""
        for conn in self.conns:
            conn.send(config)
        deadline = time.monotonic() + guard
        answers: dict[int, Any] = {}
        waiting = dict(enumerate(self.conns))
        while waiting:
            ready = multiprocessing.connection.wait(
                list(waiting.values()), timeout=max(0.0, deadline - time.monotonic())
            )
            if not ready:
                silent = sorted(waiting)
                return [], f"workers {silent} did not answer within {guard:g} s", HANG
            for i, conn in list(waiting.items()):
                if conn in ready:
                    try:
                        answers[i] = conn.recv()
                    except (EOFError, OSError):
                        code = self.procs[i].exitcode
                        return [], f"worker {i} died (exit code {code})", UNEXPECTED_ERROR
                    del waiting[i]
        self.programs += 1
        self.rss.append(sum(_rss_mib(pid) for pid in self.pids))
        reports = [r for i in sorted(answers) for r in answers[i][0]]
        errors = "; ".join(answers[i][1] for i in sorted(answers) if answers[i][1])
        kinds = {answers[i][2] for i in answers} - {""}
        return reports, errors, HANG if HANG in kinds else UNEXPECTED_ERROR if kinds else ""

    def close(self) -> None:
        """Ask the workers to end; kill those that do not."""
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()


def _key(config: Config) -> tuple[Any, ...]:
    staging = () if config.staging is None else (f"staging {config.staging}",)
    if config.api == "async":
        return ("async", config.loop, *staging)
    return ("sync", config.ranks, config.loop, *staging)


# -- the run ---------------------------------------------------------------------------------
@dataclass
class Lifetime:
    """What one worker set did before it was closed: for the leak table."""

    name: str
    programs: int
    rss: list[float]


@dataclass
class Totals:
    """Everything a run found."""

    reports: list[Report] = field(default_factory=list)
    lifetimes: list[Lifetime] = field(default_factory=list)
    keys_left: list[int] = field(default_factory=list)  # per passing blocking-API program
    job_keys: int = 0  # the most keys the first program of a blocking-API worker set made
    shm_left: int = 0  # the most files found after a passing program
    shm_names: list[str] = field(default_factory=list)

    def retire(self, workers: WorkerSet, kill: bool = False) -> None:
        """Close ``workers`` (kill them: they may be stuck), keeping what they did."""
        self.lifetimes.append(
            Lifetime(" ".join(map(str, workers.key)), workers.programs, workers.rss)
        )
        if kill:
            for proc in workers.procs:
                proc.kill()
        workers.close()


def configurations(args: argparse.Namespace) -> list[tuple[int, str, str, str]]:
    """Every (world size, transport, API, loop) the options ask for."""
    return list(itertools.product(args.ranks, args.transport, args.api, args.loop))


def run(args: argparse.Namespace) -> Totals:
    """Run the programs, each configuration's in one block."""
    import aiodist.sync as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    combos = configurations(args)
    totals = Totals()
    workers: WorkerSet | None = None
    try:
        for i in range(args.programs):
            ranks, transport, api, loop = combos[i * len(combos) // args.programs]
            config = Config(args.seed + i, ranks, transport, api, loop, args.staging)
            if workers is not None and workers.key != _key(config):
                totals.retire(workers)
                workers = None
            if workers is None:
                workers = WorkerSet.start(config, store.port)
            keys = store.num_keys()
            started = time.monotonic()
            done, error, kind = workers.run(config, args.guard)
            program = config.program()
            report = Report(config, program, done, error, kind, time.monotonic() - started)
            totals.reports.append(report)
            _print(i, report)
            if report.problems:
                # The next program starts afresh: these workers may be broken, or stuck.
                totals.retire(workers, kill=kind == HANG or not done)
                workers = None
                continue
            if api == "sync" and workers.programs == 1:
                totals.job_keys = max(totals.job_keys, store.num_keys() - keys)
            elif api == "sync":
                totals.keys_left.append(store.num_keys() - keys)
            left = _shm_files(workers.pids)
            if len(left) > totals.shm_left:
                totals.shm_left, totals.shm_names = len(left), left[:10]
    finally:
        if workers is not None:
            totals.retire(workers)
        store.close()
    return totals


def _print(i: int, report: Report) -> None:
    problems = report.problems
    if not problems:
        if (i + 1) % 100 == 0:
            print(f"{i + 1} programs run", flush=True)
        return
    print(f"program {i}: {report.config}: {', '.join(sorted(report.kinds))}", flush=True)
    print(f"  {problems[0]}"[:400])
    print(f"  replay: {report.config.replay}", flush=True)


# -- the results -------------------------------------------------------------------------------
def verdict(report: Report) -> str:
    """The worst kind of problem of ``report``: wrong value, hang, error; or passed."""
    kinds = report.kinds
    for kind in (WRONG_VALUE, HANG):
        if kind in kinds:
            return kind
    return "error" if kinds else "passed"


def summary_row(name: str, reports: list[Report]) -> str:
    verdicts = Counter(verdict(r) for r in reports)
    seconds = statistics.median(r.seconds for r in reports)
    return (
        f"| {name} | {len(reports)} | {verdicts['passed']} | {verdicts[WRONG_VALUE]} | "
        f"{verdicts[HANG]} | {verdicts['error']} | {seconds:.2f} |"
    )


def leak_rows(totals: Totals, warmup: int) -> list[str]:
    rows = []
    for life in totals.lifetimes:
        if life.programs <= warmup:
            continue
        base, last = life.rss[warmup - 1], life.rss[-1]
        per_1000 = (last - base) / (life.programs - warmup) * 1000
        rows.append(
            f"| {life.name} | {life.programs} | {base:.1f} | {last:.1f} | {per_1000:+.1f} |"
        )
    return rows


def report_text(totals: Totals, args: argparse.Namespace, minutes: float) -> str:
    reports = totals.reports
    flags = (
        f"--programs {args.programs} --seed {args.seed} --ranks {','.join(map(str, args.ranks))} "
        f"--transport {','.join(args.transport)} --api {','.join(args.api)} "
        f"--loop {','.join(args.loop)}"
        + ("" if args.staging is None else f" --staging {args.staging}")
    )
    lines = [
        "# Random programs checked against numpy (`bench/fuzz.py`)",
        "",
        f"Command: `unshare -n bash -c 'ip link set lo up && .venv/bin/python bench/fuzz.py "
        f"{flags} --write'`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{os.cpu_count()} CPUs, aiodist commit `{checkout_commit()}`, Python "
        f"{sys.version.split()[0]}; run time {minutes:.1f} min.",
        "",
        "Each program: 20-40 collectives, point-to-point calls and subgroup calls of seed "
        "`--seed` + its index (`tests/program_fuzz.py`), with one-rank usage errors, cancelled "
        "awaits and expiring waits, every result compared with a numpy model; in worker "
        "processes that run one program after another (see the bench's docstring). A program "
        "counts as its worst problem: a wrong value, a hang (an operation timed out, or "
        f"no answer within {args.guard:g} s), or an error that should not happen.",
        "",
        "## Summary",
        "",
        "| configuration | programs | passed | wrong values | hangs | errors | seconds per program (median) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for ranks, transport, api, loop in configurations(args):
        mine = [
            r
            for r in reports
            if (r.config.ranks, r.config.transport, r.config.api, r.config.loop)
            == (ranks, transport, api, loop)
        ]
        if mine:
            lines.append(summary_row(f"{ranks} ranks, {transport}, {api}, {loop}", mine))
    if reports:
        lines.append(summary_row("**all**", reports))
    keys = totals.keys_left
    lines += [
        "",
        "## Leaks",
        "",
        "Keys left in the store by the world of a passing blocking-API program, once "
        "destroyed (every program but the first of its worker set): "
        + (
            f"{sum(keys)} in {len(keys)} programs (at most {max(keys)} by one)."
            if keys
            else "no such program."
        )
        + " Keys made by the first program of a worker set, which the later ones reuse (its "
        "job's generation counter and forming record of each rank, and its current world): "
        f"at most {totals.job_keys}."
        + " Files left in `/dev/shm` by the workers after a passing program: at most "
        + f"{totals.shm_left}"
        + (f" ({', '.join(totals.shm_names)})." if totals.shm_names else "."),
        "",
        f"Resident memory of each worker set that ran more than {args.warmup} programs (all "
        f"its processes together), from the end of its {args.warmup}th program to its last:",
        "",
        "| worker set | programs | MiB after warmup | MiB at the end | growth per 1000 programs (MiB) |",
        "| --- | ---: | ---: | ---: | ---: |",
        *leak_rows(totals, args.warmup),
    ]
    failing = [r for r in reports if r.problems]
    if failing:
        lines += [
            "",
            f"## Failing programs ({len(failing)}; the first {min(len(failing), 50)})",
            "",
        ]
        for r in failing[:50]:
            lines += [f"### {r.config}: {verdict(r)}", "", "```", r.describe(), "```", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--programs", type=int, default=120, help="how many programs")
    p.add_argument("--seed", type=int, default=1, help="the first program's seed")
    p.add_argument("--ranks", default="2,3,4", help="world sizes, comma-separated")
    p.add_argument("--transport", default="shm,tcp")
    p.add_argument("--api", default="async,sync")
    p.add_argument("--loop", default="asyncio,uvloop")
    p.add_argument(
        "--staging",
        type=int,
        default=None,
        metavar="BYTES",
        help="every rank's staging bound ($AIODIST_STAGING_BYTES; default: the environment's); "
        "a small one announces most messages, and the programs draw larger arrays too",
    )
    p.add_argument(
        "--guard",
        type=float,
        default=program_fuzz.RUN_LIMIT + 30,
        help="seconds before workers count as hung",
    )
    p.add_argument("--warmup", type=int, default=20, help="programs before memory is measured")
    p.add_argument("--write", action="store_true", help="write bench/results/fuzz.md")
    p.add_argument("--out", default="", help="the results file (default: see --write)")
    args = p.parse_args()
    args.ranks = [int(r) for r in args.ranks.split(",")]
    for name, known in (
        ("transport", program_fuzz.TRANSPORTS),
        ("api", program_fuzz.APIS),
        ("loop", program_fuzz.LOOPS),
    ):
        values = getattr(args, name).split(",")
        if set(values) - set(known):
            p.error(
                f"--{name}: unknown {sorted(set(values) - set(known))}; known: {', '.join(known)}"
            )
        setattr(args, name, values)
    if not set(args.ranks) <= {2, 3, 4} or args.programs < 1:
        p.error("--ranks takes 2, 3 and 4; --programs at least 1")
    if args.staging is not None and args.staging < 0:
        p.error("--staging takes a number of bytes, at least 0")
    t0 = time.monotonic()
    totals = run(args)
    text = report_text(totals, args, (time.monotonic() - t0) / 60)
    failing = [r for r in totals.reports if r.problems]
    for r in failing[:3]:
        print(r.describe())
    print(text.split("\n## Failing programs")[0])
    if args.out:
        out = Path(args.out)
    elif args.write:
        out = ROOT / "bench" / "results" / "fuzz.md"
    else:
        out = Path(tempfile.mkdtemp(prefix="aiodist-fuzz-")) / "fuzz.md"
    out.write_text(text)
    print(f"{len(totals.reports)} programs, {len(failing)} failed; wrote {out}")


if __name__ == "__main__":
    main()
