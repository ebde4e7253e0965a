"""Collectives across hosts on shaped links: aiodist, torch gloo and Open MPI, in one run.

Run (as root: it creates network namespaces; it leaves the machine as it found it):

    .venv/bin/python bench/multihost.py --write

The "hosts" are Linux network namespaces, each with one veth to a Linux bridge that lives in
a namespace of its own (nothing is added to the machine's own namespace). Each host's link
is shaped in both directions (the host's end and the bridge's end) with ``tc qdisc replace
dev X root tbf rate R burst B latency 5ms``, B = R x 1 ms (125000 bytes at 1gbit, 1250000 at
10gbit); MTU 9000 on every veth and the bridge. Ranks of one host share memory, as they
would on one machine. The defaults: ``--rates 1gbit,10gbit``, ``--configs 2x2,4x1`` (2 hosts
x 2 ranks, 4 hosts x 1 rank), ``--ops all_reduce,broadcast,all_gather,reduce_scatter``,
``--sizes 64K,256K,1M,4M,16M,64M`` (float32), ``--iters 10 --warmup 2``; a short run:
``--rates 1gbit --configs 2x2 --sizes 64K,1M --iters 3 --warmup 1``.

The implementations, each a launch of its own per rate and configuration (one process per
rank, started in its host's namespace with ``ip netns exec``):

* ``two-level``: aiodist's async API on its default settings (for hosts with several ranks
  each, the library picks its hierarchical algorithms);
* ``flat``: the same with ``AIODIST_TWO_LEVEL=0`` in the workers' environment;
* ``gloo``: ``torch.distributed`` with gloo (needs torch: ``pip install torch==2.13.0``);
* ``MPI``: mpi4py over Open MPI, started by ``mpirun`` (in the bridge's namespace, with a
  launch agent that enters a host's namespace, under a host name of its own), TCP between
  hosts and shared memory (vader) within one, with coll/han where Open MPI has it (its
  simple allreduce: the segmented one crashes in 4.1.4) and ``mpi_yield_when_idle`` where
  there are more ranks than CPUs.
  Without ``mpirun`` or mpi4py (``apt-get install -y openmpi-bin libopenmpi-dev``, ``pip
  install mpi4py``) or torch, their columns are left out and the reason is printed.

A cell is the median over the iterations of the slowest rank's time for one call, each call
after a barrier; busbw as nccl-tests define it (all_reduce 2(n-1)/n x S / t; all_gather and
reduce_scatter (n-1)/n x S / t, S the gathered output or the reduced input; broadcast S / t;
n ranks). ``a / b`` is b's time over a's (above 1: a is faster). Inter-host bytes are read
from each host's veth counters around the timed iterations (with their barriers): the
mean over the hosts of the bytes a host sends per operation, against the least any
algorithm must send (the formulas are in the results file).

The results go to a temporary folder, or with ``--write`` to ``bench/results/multihost.md``
and ``docs/images/multihost.png`` (``--out``, ``--plot``: other paths; ``--plot ''``:
none). The results file is written first; the plot needs matplotlib (``pip install -e
'.[bench]'``), and ``--replot RESULTS`` draws it again from a results file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import (  # bench/compare.py, found through the path above
    aiodist_op,
    bus_factor,
    checkout_commit,
    count_for,
    describe_transport,
    fmt_size,
    make_buffers,
    mpi_available,
    mpi_op,
    parse_size,
    terminated_as_exit,
    torch_op,
)

ROOT = Path(__file__).resolve().parent.parent
OPS = ["all_reduce", "broadcast", "all_gather", "reduce_scatter"]
SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
IMPLS = ["two-level", "flat", "gloo", "mpi"]
SHORT = {"two-level": "two-level", "flat": "flat", "gloo": "gloo", "mpi": "MPI"}
LABELS = {
    "two-level": "aiodist two-level",
    "flat": "aiodist flat",
    "gloo": "torch gloo",
    "mpi": "Open MPI",
}
SUBNET = "10.77.0"  # host i is .{i + 1}, the bridge .254
MTU = 9000
LATENCY = "5ms"
#: The least a host must send per operation, on average over the H hosts: F x (H-1)/H x S
#: (S as in busbw): F, and why.
OPTIMUM = {
    "all_reduce": (
        2,
        "each host's data must leave it for the (H-1)/H of the array that the "
        "others reduce, and the sums of that part must come back to it (the bandwidth-optimal "
        "bound, as a ring or reduce-scatter + all-gather between hosts reaches)",
    ),
    "broadcast": (1, "every host but the root's must receive S once: (H-1) x S over H hosts"),
    "all_gather": (1, "every host must receive the (H-1)/H of the output its ranks lack"),
    "reduce_scatter": (
        1,
        "every host must receive, for its ranks' 1/H of the input, the "
        "other hosts' sums: (H-1)/H x S in all",
    ),
}


def optimum(name: str, nbytes: int, h: int) -> float:
    return OPTIMUM[name][0] * (h - 1) / h * nbytes


def parse_config(text: str) -> tuple[int, int]:
    hosts, _, per_host = text.partition("x")
    return int(hosts), int(per_host)


def config_words(config: str) -> str:
    h, r = parse_config(config)
    return f"{h} hosts x {r} rank{'s' if r > 1 else ''}"


def rate_bytes(rate: str) -> float:
    """Bytes per second of a tc rate such as ``1gbit``."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not m:
        raise ValueError(f"rate {rate!r}: expected e.g. 1gbit, 10gbit, 500mbit")
    return float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2]] / 8


def tbf(rate: str) -> str:
    """The qdisc of a link: the rate, a burst of 1 ms at that rate, 5 ms of queue."""
    return f"tbf rate {rate} burst {round(rate_bytes(rate) / 1000)} latency {LATENCY}"


# -- the hosts ---------------------------------------------------------------------------------


def sh(command: str) -> None:
    """Run a command (words without spaces); raise with its message if it fails."""
    done = subprocess.run(command.split(), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{command}: {done.stderr.strip()}")


def kill_processes(names: list[str]) -> None:
    """Kill every process in these network namespaces."""
    for ns in names:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def remove_namespaces(names: list[str]) -> None:
    """Kill the processes in the namespaces, then remove them (and so their veths)."""
    kill_processes(names)
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def remove_leftovers() -> None:
    """Remove the namespaces of an earlier run that was killed before it could clean up."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listed.splitlines():
        m = re.fullmatch(r"aiomh(\d+)(?:br|h\d+)", line.split(" ")[0])
        if m:
            try:
                os.kill(int(m[1]), 0)
            except ProcessLookupError:
                print(f"removing {m[0]}, left by a run that was killed", flush=True)
                remove_namespaces([m[0]])


class Hosts:
    """Namespaces ``ns[i]`` with link ``links[i]`` (address ``addrs[i]``) to a bridge in
    namespace ``bridge_ns``, whose end of the link is ``ports[i]``. Names carry the pid."""

    def __init__(self, count: int) -> None:
        tag = os.getpid()
        self.bridge_ns = f"aiomh{tag}br"
        self.bridge = f"mbr{tag}"
        self.ns = [f"aiomh{tag}h{i}" for i in range(count)]
        self.links = [f"mh{i}p{tag}" for i in range(count)]
        self.ports = [f"mb{i}p{tag}" for i in range(count)]
        self.addrs = [f"{SUBNET}.{i + 1}" for i in range(count)]

    def create(self) -> None:
        b, bridge = self.bridge_ns, self.bridge
        for ns in [b, *self.ns]:
            sh(f"ip netns add {ns}")
            sh(f"ip -n {ns} link set lo up")
        sh(f"ip -n {b} link add {bridge} mtu {MTU} type bridge")
        sh(f"ip -n {b} addr add {SUBNET}.254/24 dev {bridge}")
        sh(f"ip -n {b} link set {bridge} up")
        for ns, link, port, addr in zip(self.ns, self.links, self.ports, self.addrs, strict=True):
            # Created in the namespaces: the machine's own never sees them.
            veth = f"type veth peer name {port} netns {b} mtu {MTU}"
            sh(f"ip link add {link} netns {ns} mtu {MTU} {veth}")
            sh(f"ip -n {b} link set {port} master {bridge} up")
            sh(f"ip -n {ns} addr add {addr}/24 dev {link}")
            sh(f"ip -n {ns} link set {link} up")

    def shape(self, rate: str) -> None:
        """Each link, both ways: the host's end (what it sends), the bridge's (receives)."""
        for ns, link, port in zip(self.ns, self.links, self.ports, strict=True):
            sh(f"tc -n {ns} qdisc replace dev {link} root {tbf(rate)}")
            sh(f"tc -n {self.bridge_ns} qdisc replace dev {port} root {tbf(rate)}")

    def names(self) -> list[str]:
        return [*self.ns, self.bridge_ns]


# -- one rank ---------------------------------------------------------------------------------


def sent_bytes(link: str) -> int:
    """Bytes this host has sent on its link so far."""
    return int(Path("/sys/class/net", link, "statistics", "tx_bytes").read_text())


def blocking(call: Callable[[], Any]) -> Callable[[], Any]:
    """A blocking call (gloo's, MPI's) as a coroutine function, to time all alike."""

    async def run() -> None:
        call()

    return run


async def rank_main(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    n, per_host, impl = cfg["n"], cfg["per_host"], cfg["impl"]
    link = cfg["links"][rank // per_host]
    info: dict[str, str] = {}
    init = f"tcp://{cfg['addr']}:{cfg['port']}"
    if impl in ("two-level", "flat"):
        import aiodist

        pg = await aiodist.init_process_group("cpu", init_method=init, world_size=n, rank=rank)
        # (compare.py's words are for one host: TCP is over loopback there)
        info["transport"] = describe_transport(pg).replace(
            "TCP over loopback", "TCP between the hosts"
        )

        def barrier() -> Any:
            return aiodist.barrier(group=pg)

        def op_for(name: str, b: dict[str, Any]) -> Callable[[], Any]:
            return aiodist_op(name, b, pg, rank, n)

    elif impl == "gloo":
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        warnings.filterwarnings("ignore", category=FutureWarning)
        dist.init_process_group(
            "gloo", init_method=init, world_size=n, rank=rank, timeout=timedelta(seconds=600)
        )
        barrier = blocking(dist.barrier)

        def op_for(name: str, b: dict[str, Any]) -> Callable[[], Any]:
            return blocking(torch_op(name, b, rank, n))

    else:
        import mpi4py

        mpi4py.rc.thread_level = "funneled"  # only this thread calls MPI
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        if comm.Get_rank() != rank or comm.Get_size() != n:
            raise RuntimeError(f"mpirun placed rank {comm.Get_rank()} of {comm.Get_size()}")
        barrier = blocking(comm.Barrier)

        def op_for(name: str, b: dict[str, Any]) -> Callable[[], Any]:
            return blocking(mpi_op(name, b, comm, rank, n))

    out: dict[str, Any] = {"times": {}, "bytes": {}, "info": info}
    for name in cfg["ops"]:
        for size in cfg["sizes"]:
            op = op_for(name, make_buffers(name, count_for(name, size, n), n, rank, impl == "mpi"))
            for _ in range(cfg["warmup"]):
                await op()
            await barrier()
            before = sent_bytes(link)
            times = []
            for _ in range(cfg["iters"]):
                await barrier()
                start = time.perf_counter()
                await op()
                times.append(time.perf_counter() - start)
            await barrier()  # every rank's traffic of the timed calls is through
            key = f"{name} {size}"
            out["times"][key] = times
            if rank % per_host == 0:  # one rank per host reads its link
                out["bytes"][key] = sent_bytes(link) - before
            if rank == 0 and cfg["verbose"]:
                print(f"    {name} {fmt_size(size)}", file=sys.stderr, flush=True)
    if impl in ("two-level", "flat"):
        await aiodist.destroy_process_group()
    elif impl == "gloo":
        dist.destroy_process_group()
    return out


def worker(cfg_path: str) -> None:
    from aiodist._util._loop import loop_factory

    cfg = json.loads(Path(cfg_path).read_text())
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "-1")))
    host = rank // cfg["per_host"]
    if not os.path.exists(f"/sys/class/net/{cfg['links'][host]}"):
        raise RuntimeError(f"rank {rank} is not on host {host}: its link is not here")
    with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
        result = runner.run(rank_main(rank, cfg))
    Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps(result))


# -- launches ----------------------------------------------------------------------------------

AGENT = r"""#!/bin/sh
# mpirun's remote shell (plm_rsh_agent), called as ssh is: AGENT [OPTIONS] HOST COMMAND...
# A host is a network namespace; its processes get a host name of their own (Open MPI names
# its session and shared-memory files after the host name).
while [ "${1#-}" != "$1" ]; do shift; done
case "$1" in
@CASES@  *) echo "$0: unknown host $1" >&2; exit 1 ;;
esac
shift
exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$ns" "$*"
"""


def mpirun(hosts: Hosts, h: int, per_host: int, tmp: str, han: bool) -> tuple[list[str], str]:
    """mpirun, to be run in the bridge's namespace, for ``per_host`` ranks on ``h`` hosts;
    and its settings, for the report."""
    hostfile, agent = Path(tmp, "hostfile"), Path(tmp, "agent.sh")
    hostfile.write_text("".join(f"{a} slots={per_host}\n" for a in hosts.addrs[:h]))
    cases = "".join(f"  {a}) ns={ns} ;;\n" for a, ns in zip(hosts.addrs, hosts.ns, strict=True))
    agent.write_text(AGENT.replace("@CASES@", cases))
    agent.chmod(0o755)
    subnet = f"{SUBNET}.0/24"
    mca = {
        "plm_rsh_agent": str(agent),
        "plm_rsh_no_tree_spawn": "1",
        "oob_tcp_if_include": subnet,
        "btl": "self,vader,tcp",
        "btl_tcp_if_include": subnet,
    }
    if h * per_host > len(os.sched_getaffinity(0)):
        mca["mpi_yield_when_idle"] = "1"  # more ranks than CPUs: MPI must not spin on them
    if han:
        mca["coll_han_priority"] = "100"  # 0 by default in Open MPI 4.1: off
        # Its segmented allreduce crashes in 4.1.4 (vader: "Read -1, expected 65536, errno =
        # 14", as in open-mpi/ompi#7735); the simple one is two-level too, unsegmented.
        mca["coll_han_use_simple_allreduce"] = "1"
    command = ["mpirun", "--allow-run-as-root", "-np", str(h * per_host), "--hostfile"]
    command += [str(hostfile), "--map-by", "slot", "--bind-to", "none"]
    for key, value in mca.items():
        command += ["--mca", key, value]
    shown = shlex.join(command[6:]).replace(str(agent), "AGENT").replace(str(hostfile), "HOSTS")
    return command, shown


_PORTS = iter(range(29700, 30700))


def launch(
    hosts: Hosts, impl: str, config: str, args: argparse.Namespace, han: bool
) -> dict[str, Any]:
    """One world of ``impl`` on the hosts of ``config``: its merged timings and bytes."""
    h, per_host = parse_config(config)
    n = h * per_host
    with tempfile.TemporaryDirectory(prefix="aiodist-multihost-") as tmp:
        cfg = {
            "impl": impl,
            "n": n,
            "per_host": per_host,
            "links": hosts.links[:h],
            "addr": hosts.addrs[0],
            "port": next(_PORTS),
            "ops": args.ops,
            "sizes": args.sizes,
            "iters": args.iters,
            "warmup": args.warmup,
            "verbose": args.verbose,
            "out": tmp,
        }
        cfg_path = Path(tmp, "config.json")
        cfg_path.write_text(json.dumps(cfg))
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "AIODIST_TWO_LEVEL")
        }
        env["OMP_NUM_THREADS"] = "1"
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # no reverse-DNS warnings in namespaces
        if impl == "flat":
            env["AIODIST_TWO_LEVEL"] = "0"
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(cfg_path)]
        if impl == "mpi":
            mpi, settings = mpirun(hosts, h, per_host, tmp, han)
            on = ["ip", "netns", "exec", hosts.bridge_ns, *mpi]
            procs = [subprocess.Popen(on + command, env=env, start_new_session=True)]
        else:
            procs = [
                subprocess.Popen(
                    ["ip", "netns", "exec", hosts.ns[r // per_host], *command],
                    env=dict(env, RANK=str(r), GLOO_SOCKET_IFNAME=hosts.links[r // per_host]),
                    start_new_session=True,
                )
                for r in range(n)
            ]
        try:
            deadline = time.monotonic() + args.timeout
            while any(p.poll() is None for p in procs):
                if any(p.returncode not in (None, 0) for p in procs):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no result within {args.timeout:g} s (--timeout)")
                time.sleep(0.2)
            if any(p.returncode != 0 for p in procs):
                raise RuntimeError("a rank failed (its output is above)")
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            kill_processes(hosts.names())  # what mpirun's agents left, if anything
        per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(n)]
    merged: dict[str, Any] = {"time": {}, "sent": {}, "info": per_rank[0]["info"]}
    if impl == "mpi":
        merged["info"]["settings"] = settings
    for key, first in per_rank[0]["times"].items():
        name, size = key.split()
        slowest = [max(pr["times"][key][i] for pr in per_rank) for i in range(len(first))]
        merged["time"][name, int(size)] = statistics.median(slowest)
        sent = [pr["bytes"][key] for pr in per_rank if key in pr["bytes"]]
        merged["sent"][name, int(size)] = statistics.mean(sent) / len(first)
    return merged


# -- report ------------------------------------------------------------------------------------

MIB = 1 << 20


def op_table(name: str, rate: str, config: str, run: dict[str, Any]) -> list[str]:
    """busbw per implementation, aiodist two-level's ratios, inter-host bytes vs optimum."""
    h, per_host = parse_config(config)
    n = h * per_host
    shown = [i for i in IMPLS if any(k[0] == name for k in run.get(i, {}).get("time", {}))]
    ratios = [b for b in ("gloo", "mpi") if "two-level" in shown and b in shown]
    head = ["size", *(f"{SHORT[i]} busbw" for i in shown)]
    head += [f"two-level / {SHORT[b]}" for b in ratios]
    head += ["optimum MiB/op/host", *(f"{SHORT[i]} MiB/op/host" for i in shown)]
    lines = [
        f"### {name}, {rate}, {config_words(config)}",
        "",
        "| " + " | ".join(head) + " |",
        "| " + " | ".join("---:" for _ in head) + " |",
    ]
    for size in sorted({k[1] for i in shown for k in run[i]["time"] if k[0] == name}):
        nbytes = count_for(name, size, n) * 4
        t = {i: run[i]["time"].get((name, size)) for i in shown}
        cells = [fmt_size(nbytes)]
        cells += [f"{nbytes / t[i] * bus_factor(name, n) / 1e9:.4g}" if t[i] else "" for i in shown]
        cells += [
            f"{t[b] / t['two-level']:.2f}x" if t[b] and t["two-level"] else "" for b in ratios
        ]
        best = optimum(name, nbytes, h)
        cells.append(f"{best / MIB:.3g}")
        for i in shown:
            sent = run[i]["sent"].get((name, size))
            cells.append(f"{sent / MIB:.3g} ({sent / best:.2f}x)" if sent is not None else "")
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def read_points(path: str) -> dict[tuple[str, str], dict[str, dict[str, list[Any]]]]:
    """The busbw of a results file this script wrote, as ``plot`` takes it."""
    points: dict[tuple[str, str], dict[str, dict[str, list[Any]]]] = {}
    run: tuple[str, str] | None = None
    name = ""
    header: list[str] = []
    for line in Path(path).read_text().splitlines():
        if line.startswith("### "):
            name, rate, words = line[4:].split(", ")
            run, header = (rate, words), []
        elif run and line.startswith("| size |"):
            header = [c.strip() for c in line.strip("| ").split("|")]
        elif run and header and line.startswith("| ") and "---" not in line:
            cells = [c.strip() for c in line.strip("| ").split("|")]
            for impl in IMPLS:
                column = f"{SHORT[impl]} busbw"
                if column in header and cells[header.index(column)]:
                    point = (parse_size(cells[0]), float(cells[header.index(column)]))
                    points.setdefault(run, {}).setdefault(name, {}).setdefault(impl, [])
                    points[run][name][impl].append(point)
    if not points:
        raise SystemExit(f"{path}: no table of bench/multihost.py in it")
    return points


def plot(points: dict[tuple[str, str], dict[str, dict[str, list[Any]]]], path: str) -> None:
    """One figure per rate and configuration, stacked, each a panel per operation (two
    panels a row: legible at a page's width, about 900 pixels)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)")
        return
    if not points:
        return
    # Plain numbers on the log axes: 0.1, 1, and the 2s and 5s between them.
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    two_five = FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else "")
    runs = list(points)
    ops = [op for op in OPS if any(op in points[r] for r in runs)]
    rows = (len(ops) + 1) // 2
    styles = {
        "two-level": ("C0", "o", "-"),
        "flat": ("C0", "s", "--"),
        "gloo": ("C3", "v", "-"),
        "mpi": ("C1", "D", "-"),
    }
    fig = plt.figure(figsize=(9, 3.4 * rows * len(runs) + 0.5), layout="constrained")
    for sub, run in zip(fig.subfigures(len(runs), 1, squeeze=False)[:, 0], runs, strict=True):
        sub.suptitle(f"{run[0]} links, {run[1]}", fontsize=14, fontweight="bold")
        axes = sub.subplots(rows, 2, squeeze=False).flatten()
        for ax in axes[len(ops) :]:
            ax.set_visible(False)
        for ax, op in zip(axes, ops, strict=False):
            sizes: set[int] = set()
            for impl in IMPLS:
                pts = sorted(points[run].get(op, {}).get(impl, []))
                if not pts:
                    continue
                sizes.update(p[0] for p in pts)
                color, marker, line = styles[impl]
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    color=color,
                    marker=marker,
                    markersize=6,
                    linewidth=2,
                    linestyle=line,
                    label=LABELS[impl],
                )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ticks = sorted(sizes)
            ax.set_xticks(ticks, [fmt_size(s).replace(" ", "") for s in ticks])
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(two_five)
            ax.tick_params(labelsize=11)
            ax.tick_params(which="minor", labelsize=9)
            ax.set_title(op, fontsize=12)
            ax.set_ylabel("busbw (GB/s)", fontsize=11)
            ax.grid(True, which="both", alpha=0.3)
    handles, labels = fig.axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside upper center", ncol=len(labels), fontsize=11)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="1gbit,10gbit", help="link rates (tc), comma-separated")
    parser.add_argument(
        "--configs", default="2x2,4x1", help="HOSTSxRANKS_PER_HOST, comma-separated"
    )
    parser.add_argument("--ops", default=",".join(OPS), help="operations, comma-separated")
    parser.add_argument(
        "--sizes",
        default=",".join(str(s) for s in SIZES),
        help="sizes in bytes, comma-separated; K, M suffixes allowed (1K = 1024)",
    )
    parser.add_argument("--impls", default=",".join(IMPLS), help="implementations to run")
    parser.add_argument("--iters", type=int, default=10, help="timed calls per row")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls before them")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    parser.add_argument(
        "--write",
        action="store_true",
        help="write bench/results/multihost.md and docs/images/multihost.png (else a temp folder)",
    )
    parser.add_argument("--out", help="the results file (overrides --write's)")
    parser.add_argument("--plot", help="the PNG ('' for none; overrides --write's)")
    parser.add_argument(
        "--replot", metavar="RESULTS", help="only draw the plot of this results file again"
    )
    parser.add_argument("--verbose", action="store_true", help="progress per row on stderr")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        try:
            worker(args.worker)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        return
    if os.geteuid() != 0 and not args.replot:
        raise SystemExit(
            "bench/multihost.py must run as root: it creates network namespaces, veths, a "
            "bridge and tc qdiscs (and removes them when it ends)"
        )
    # Committed results change only on purpose: without --write they go to a fresh folder.
    if args.out is None or args.plot is None:
        folder = (
            ROOT / "bench/results"
            if args.write
            else Path(tempfile.mkdtemp(prefix="aiodist-bench-"))
        )
        if args.out is None:
            args.out = str(folder / "multihost.md")
        if args.plot is None:
            # (With --write, where the documentation's pictures are: the results page
            # includes the results file, picture and all.)
            args.plot = str(ROOT / "docs/images" if args.write else folder) + "/multihost.png"
    if args.replot:
        if args.plot:
            plot(read_points(args.replot), args.plot)
        return
    try:
        rates = [r for r in args.rates.split(",") if r]
        for r in rates:
            rate_bytes(r)
        configs = [c for c in args.configs.split(",") if c]
        if any(h < 2 or per < 1 for h, per in map(parse_config, configs)):
            raise ValueError("--configs: at least 2 hosts and 1 rank per host")
        args.sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    except ValueError as exc:
        parser.error(str(exc))
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be at least 1, --warmup at least 0")
    args.ops = [o for o in args.ops.split(",") if o]
    impls = [i for i in args.impls.split(",") if i]
    if set(args.ops) - set(OPS) or set(impls) - set(IMPLS):
        parser.error(f"known operations: {','.join(OPS)}; implementations: {','.join(IMPLS)}")
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            raise SystemExit(f"bench/multihost.py needs `{tool}` (iproute2, util-linux)")

    skipped: dict[str, str] = {}
    libs = [f"numpy {importlib.metadata.version('numpy')}"]
    if importlib.util.find_spec("torch") is None:
        skipped["gloo"] = "torch is not installed (pip install torch==2.13.0)"
    else:
        libs.append(f"torch {importlib.metadata.version('torch')}")
    han = False
    if "mpi" in impls:
        ok, mpi_note = mpi_available()
        if ok:
            info = subprocess.run(["ompi_info"], capture_output=True, text=True).stdout
            han = re.search(r"MCA coll: han\b", info) is not None
            has = "with coll/han" if han else "without coll/han (this Open MPI has none)"
            libs.append(f"{mpi_note} {has}")
        else:
            skipped["mpi"] = mpi_note
    for impl, why in skipped.items():
        if impl in impls:
            print(f"{LABELS[impl]} skipped: {why}", flush=True)
    impls = [i for i in impls if i not in skipped]

    started = time.monotonic()
    cpus = len(os.sched_getaffinity(0))
    load_before = os.getloadavg()[0]
    results: dict[tuple[str, str], dict[str, Any]] = {}
    failures: list[str] = []
    remove_leftovers()
    hosts = Hosts(max(parse_config(c)[0] for c in configs))
    with terminated_as_exit():
        try:
            hosts.create()
            for rate in rates:
                hosts.shape(rate)
                for config in configs:
                    for impl in impls:
                        where = f"{LABELS[impl]}, {rate}, {config_words(config)}"
                        print(f"{where} ...", flush=True)
                        t0 = time.monotonic()
                        try:
                            run = launch(hosts, impl, config, args, han)
                        except (RuntimeError, OSError, ValueError, KeyError) as exc:
                            failures.append(f"{where}: {exc}")
                            print(f"{where}: failed: {exc}", flush=True)
                            continue
                        results.setdefault((rate, config), {})[impl] = run
                        print(f"{where}: {time.monotonic() - t0:.0f} s", flush=True)
        finally:
            remove_namespaces(hosts.names())
    left = [ns for ns in hosts.names() if Path("/run/netns", ns).exists()]
    if left:
        print(f"warning: could not remove the namespaces {left}", flush=True)

    command = shlex.join(["python", "bench/multihost.py", *sys.argv[1:]])
    shaping = "; ".join(f"`tc qdisc replace dev X root {tbf(r)}`" for r in rates)
    head = [
        "# aiodist across hosts: two-level, flat, torch gloo and Open MPI (`bench/multihost.py`)",
        "",
        f"Command: `.venv/bin/{command}`, {time.strftime('%Y-%m-%d %H:%M %Z')}, {cpus} CPUs, "
        f"Linux {os.uname().release}, at commit `{checkout_commit()}`; {', '.join(libs)}. Load average "
        f"(1 min) {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
        f"(above {cpus}: other processes took turns with the ranks); run time "
        f"{(time.monotonic() - started) / 60:.1f} min.",
        "",
        "Hosts are network namespaces on this machine, each with a veth to one Linux bridge "
        f"(MTU {MTU} on all); each host's link is shaped in both directions, on the host's end "
        f"and the bridge's: {shaping} (burst: 1 ms at the rate). Ranks of one host share "
        "memory; each implementation is a launch of its own per rate and configuration.",
        "",
        f"A busbw cell (GB/s) is from the median over {args.iters} calls (after "
        f"{args.warmup} untimed) of the slowest rank's time, each call after a barrier: "
        "nccl-tests' busbw, n ranks: all_reduce 2(n-1)/n x S / t, all_gather and "
        "reduce_scatter (n-1)/n x S / t, broadcast S / t; S (`size`) is the array of "
        "all_reduce and broadcast, the gathered output of all_gather, the input of "
        "reduce_scatter. `two-level / b` is b's time over aiodist two-level's (above 1: "
        "aiodist is faster). `flat` is aiodist with `AIODIST_TWO_LEVEL=0`.",
        "",
        "MiB/op/host: the bytes a host sends on its link per operation, averaged over the H "
        "hosts (the veths' counters around the timed calls, their barriers included), and "
        "in brackets over the optimum, the least any algorithm must send:",
        "",
        *(
            f"- {op}: {'2' if OPTIMUM[op][0] == 2 else ''}(H-1)/H x S: {OPTIMUM[op][1]};"
            for op in args.ops
        ),
        "",
        "The counters count Ethernet, IP and TCP headers and the ACKs too: about 1% at MTU "
        f"{MTU} (the kernel counts a segmentation-offloaded packet of up to 64 KiB as one).",
        "",
        *(f"{LABELS[i]}: left out: {why}." for i, why in skipped.items() if i in args.impls),
        *(f"Failed: {f}." for f in failures),
        "",
    ]
    body: list[str] = []
    for (rate, config), run in results.items():
        body += [f"## {rate}, {config_words(config)}", ""]
        for impl in ("two-level", "flat"):
            if impl in run:
                body.append(f"- {LABELS[impl]}: {run[impl]['info']['transport']}")
        if "mpi" in run:
            body.append(f"- Open MPI: `mpirun {run['mpi']['info']['settings']}`")
        body.append("")
        for name in args.ops:
            body += op_table(name, rate, config, run)
    print("\n".join(head + body), flush=True)
    # The results first, so that a failing plot cannot lose them.
    picture = []
    if args.plot and importlib.util.find_spec("matplotlib") is not None:
        rel = os.path.relpath(args.plot, os.path.dirname(os.path.abspath(args.out)))
        picture = ["## Bus bandwidth", "", f"![busbw against size]({rel})", ""]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    Path(args.out).write_text("\n".join(head + picture + body).rstrip() + "\n")
    print(f"wrote {args.out}")
    if args.plot:
        points: dict[tuple[str, str], dict[str, dict[str, list[Any]]]] = {}
        for (rate, config), run in results.items():
            n = math.prod(parse_config(config))
            for impl, merged in run.items():
                for (name, size), t in sorted(merged["time"].items()):
                    nbytes = count_for(name, size, n) * 4
                    bw = nbytes / t * bus_factor(name, n) / 1e9
                    key = (rate, config_words(config))
                    points.setdefault(key, {}).setdefault(name, {}).setdefault(impl, [])
                    points[key][name][impl].append((nbytes, bw))
        plot(points, args.plot)
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
