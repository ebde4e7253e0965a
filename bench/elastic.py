"""A worker killed mid-run: elastic recovery against full restarts, in one run.

Run (in a private network namespace: torch's store reverse-resolves its clients, and nothing
leaves the machine; ``unshare -n`` needs root, ``unshare -rn`` works without):

    unshare -n bash -c 'ip link set lo up && .venv/bin/python bench/elastic.py --write'

A job of 4 workers on this host trains data-parallel: every step each worker computes the
gradient of its shard of the data, the workers sum it (all_reduce, the size of the model) and
apply it to the model, ``--state-mib`` MiB of float32 (default 256). The aiodist workers keep
the gradient in an array of ``aiodist.empty`` (shared memory: their all_reduce reads it in
place, in the worlds that replace theirs too), as a job on one host would; torch's in a
tensor. At ``--kill-step`` the
worker of rank ``--kill-rank`` prints the time and kills itself with ``SIGKILL``, as the OOM
killer or a lost host would. Three setups (``--setups``, comma-separated), their repetitions
interleaved (one of each in turn), so that a change in the machine's load hits all alike:

    elastic      aiodist-run --restart-policy=failed --max-restarts=1 --preload=numpy,aiodist.sync
                 (the workers, the replacement too, are forks of one process that imported
                 numpy and aiodist: a replacement does not take the CPU of those imports from
                 the survivors as they recover): the survivors
                 ``recover`` (``shrink_group(lost_ranks())``) in the same processes, re-shard
                 and redo the step at 3; the launcher restarts the dead worker alone, which
                 calls ``join_process_group(state=...)`` and is admitted at the next admission
                 point (``admit(state=[step, model])`` every ``--admit-every`` steps), receiving
                 the step and the model from the members
    aiodist-all  aiodist-run --restart-policy=all --max-restarts=1 --preload=numpy,aiodist.sync:
                 every worker is stopped and
                 restarted; the restarted workers load the last checkpoint (rank 0 writes the
                 step and the model every ``--checkpoint-every`` steps, to /dev/shm where there
                 is one: a checkpoint in memory, the fastest a restart can load) and go on
    elastic-etcd the elastic setup with the job's store in an etcd cluster of three members on
                 this host (``--rdzv-backend=etcd``, every client talking to the first
                 member first, which each repetition starts afresh), as a job spread over hosts
                 runs it so that no host is its store's only home: at the kill step the worker
                 kills that first member too, then itself, as the loss of a host running both
                 would; the survivors' store moves to the other members, they learn of the
                 loss once the dead worker's etcd lease lapses (``--etcd-lease-ttl`` seconds,
                 ``AIODIST_PEER_TIMEOUT``), and the replacement is admitted as in the elastic
                 setup
    torch-all    the same job with torch gloo workers (``torch.distributed.all_reduce`` on
                 torch tensors) under ``torchrun --standalone --max-restarts=1``, restarted as a
                 whole, from the same checkpoints; torchrun runs with
                 ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (without it, torchrun 2.13 hands the
                 restarted workers a store that still holds the first attempt's keys, and
                 their gloo group hangs as it forms: pytorch/pytorch#135712)

Each worker prints timestamped lines (``time.time()``) that the bench reads from the
launcher's output: its start (its first line), each completed step, the kill, recoveries,
admissions, and at the end a digest of its model. Per repetition:

* kill -> next step: from the kill to the first step completed after it (a step that was
  not completed before the kill, or any step of a restarted process) on every survivor, the
  last of them (the survivors: the ranks other than the killed one, restarted or not);
* replacement ready: elastic, from the replacement's first line until
  ``join_process_group`` returned (admitted, holding the state); full restarts, from the
  first line of the first restarted worker until every restarted worker completed its first
  step;
* redone steps: steps completed before the kill that were computed again after it (the kill
  step minus the step the survivors resumed from: 0 for elastic, the steps since the last
  checkpoint for a full restart);
* lost steps: (time from the kill until every survivor completed the step the killed worker
  was about to do) / (the undisturbed step time) - 1: the steps an undisturbed job would have
  completed in that time beyond the one in progress; it counts the redone steps and the time
  the job stood still. The undisturbed step time is the median interval between the
  survivors' completed steps before the kill;
* weights equal: every worker (the replacement or the restarted ones included) ends with a
  model whose digest equals a single-process numpy replay of ``--steps`` steps. Each sample's
  gradient is an integer multiple of ``rint(64 w)``, so the sum over any sharding is exact in
  float32 and the weights match bit for bit.

Every repetition is a row of the results, a failed or timed-out one too (with its launcher's
exit status and the tail of its stderr); the summary gives median, min and max over the
completed ones, and the ratio of each full restart's median to the elastic one's.

Options: ``--reps`` (default 20), ``--state-mib`` (256), ``--steps`` (30), ``--kill-step``
(12), ``--setups``, ``--timeout`` (seconds per repetition). A short run: ``--reps 2
--state-mib 16``. The results go to ``elastic.md`` (and ``elastic.png``) in a fresh temporary
folder, or with ``--write`` to ``bench/results/elastic.md`` and ``docs/images/elastic.png``
(``--out``, ``--plot``: other paths; ``--plot ''``: none). The results file is written first;
the plot needs matplotlib. Without torch (``pip install torch==2.13.0``) the torch setup is
left out, saying so. The worker is this file itself, run with ``--worker aiodist`` or
``--worker torch`` by the launchers.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import itertools
import json
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import (
    checkout_commit,
    terminated_as_exit,
)  # bench/compare.py, found through the path above

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(Path(__file__).resolve())
NPROC = 4
SETUPS = ("elastic", "elastic-etcd", "aiodist-all", "torch-all")
#: The setups whose survivors go on in their processes (the others restart every worker).
ELASTIC = ("elastic", "elastic-etcd")
LABELS = {
    "elastic": "aiodist elastic",
    "elastic-etcd": "aiodist elastic, store in etcd",
    "aiodist-all": "aiodist full restart",
    "torch-all": "torch gloo full restart",
}
DESCRIPTIONS = {
    "elastic": "`aiodist-run --standalone --nproc-per-node=4 --restart-policy=failed "
    "--max-restarts=1 --preload=numpy,aiodist.sync`: the survivors recover in the same "
    "processes and go on at 3; the replacement (a fork of the launcher's starter, which "
    "imported numpy and aiodist once) joins at the next admission point and receives the step "
    "and the model",
    "elastic-etcd": "`aiodist-run --rdzv-backend=etcd --rdzv-endpoint=E1,E2,E3 --nnodes=1 "
    "--nproc-per-node=4 --restart-policy=failed --max-restarts=1 --preload=numpy,aiodist.sync`, "
    "the job's store in a fresh etcd cluster of three members on this host: at the kill step "
    "the worker kills member E1 (the one every client talks to first) with SIGKILL, then "
    "itself, as the loss of a host running both would; the survivors' store moves to E2, "
    "they learn of the loss once the dead worker's etcd lease lapses (AIODIST_PEER_TIMEOUT, "
    "the lease's time to live, given below), recover and go on at 3; the replacement joins "
    "as in the elastic setup",
    "aiodist-all": "`aiodist-run --standalone --nproc-per-node=4 --restart-policy=all "
    "--max-restarts=1 --preload=numpy,aiodist.sync`: every worker restarted; they load the "
    "last checkpoint",
    "torch-all": "`torchrun --standalone --nproc-per-node=4 --max-restarts=1`, torch gloo "
    "workers: every worker restarted; they load the last checkpoint. torchrun runs with "
    "`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, a store of the workers' own per attempt: with "
    "torchrun's default (its rendezvous store shared with the workers, the first attempt's "
    "keys left in it) the restarted gloo workers hang in `init_process_group` "
    "(pytorch/pytorch#135712)",
}
#: What a worker's line starts with (after the launcher's prefix), then a JSON object.
MARK = "@@elastic-bench "
#: The gradient of a sample of weight c is c * rint(SCALE * w); the update w -= LR * sum.
SCALE = 64
LR = 2.0**-18
#: Samples of the data set; sample i weighs i + 1. The sum of the weights times 64 stays far
#: below 2**24, so the sum of the shards' gradients is exact in float32 in any order.
SAMPLES = 12
WEIGHT_TOTAL = SAMPLES * (SAMPLES + 1) // 2
CHUNK = 1 << 20


# -- the model, shared by the workers and the replay ------------------------------------------


def initial_chunk(start: int, stop: int) -> np.ndarray:
    """Elements ``start:stop`` of the initial model: a hash of the index, in [-1, 1)."""
    i = np.arange(start, stop, dtype=np.uint64)
    h = (i * np.uint64(2654435761) + np.uint64(12345)) & np.uint64(0xFFFFFFFF)
    return h.astype(np.float32) * np.float32(2.0**-31) - np.float32(1.0)


def initial_model(n: int) -> np.ndarray:
    w = np.empty(n, np.float32)
    for s in range(0, n, CHUNK):
        w[s : s + CHUNK] = initial_chunk(s, min(n, s + CHUNK))
    return w


def shard_weight(rank: int, size: int) -> int:
    """The summed weight of this rank's shard: every size-th sample from its rank."""
    return sum(i + 1 for i in range(rank, SAMPLES, size))


def local_gradient(w: np.ndarray, grad: np.ndarray, weight: int) -> None:
    np.multiply(w, np.float32(SCALE), out=grad)
    np.rint(grad, out=grad)
    grad *= np.float32(weight)


def apply(w: np.ndarray, grad: np.ndarray) -> None:
    grad *= np.float32(LR)
    w -= grad


def digest(w: np.ndarray) -> str:
    h = hashlib.blake2b(digest_size=8)
    for s in range(0, w.size, 16 * CHUNK):
        h.update(memoryview(w[s : s + 16 * CHUNK]))
    return h.hexdigest()


def reference_digest(n: int, steps: int) -> str:
    """The model's digest after ``steps`` full-batch steps in one process (chunk by chunk:
    every element evolves on its own)."""
    h = hashlib.blake2b(digest_size=8)
    for s in range(0, n, CHUNK):
        w = initial_chunk(s, min(n, s + CHUNK))
        grad = np.empty_like(w)
        for _ in range(steps):
            local_gradient(w, grad, WEIGHT_TOTAL)
            apply(w, grad)
        h.update(memoryview(w))
    return h.hexdigest()


# -- the worker ------------------------------------------------------------------------------


def emit(event: str, **fields: Any) -> None:
    """One timestamped line, in one write (lines of several processes do not interleave)."""
    record = {
        "t": time.time(),
        "ev": event,
        "rank0": int(os.environ.get("RANK", "-1")),
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "pid": os.getpid(),
        **fields,
    }
    sys.stdout.write(MARK + json.dumps(record) + "\n")
    sys.stdout.flush()


def watchdog(deadline: float) -> None:
    """End this worker if its launcher is gone (torchrun's workers have sessions of their
    own and would outlive it) or the repetition's deadline passed."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent or time.time() > deadline:
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def checkpoint_due(a: argparse.Namespace, step: int, rank: int) -> bool:
    """Whether rank ``rank`` writes a checkpoint after ``step`` (the full-restart setups)."""
    return (
        bool(a.checkpoint_dir) and rank == 0 and step % a.checkpoint_every == 0 and step < a.steps
    )


def save_checkpoint(folder: Path, step: int, w: np.ndarray) -> None:
    """Write the model, then point ``latest`` at it (each by a rename: a kill in between
    leaves the previous checkpoint whole)."""
    tmp = folder / f"model.{step}.tmp"
    w.tofile(tmp)
    os.replace(tmp, folder / f"model.{step}")
    previous = folder / "latest"
    old = previous.read_text() if previous.exists() else None
    (folder / "latest.tmp").write_text(str(step))
    os.replace(folder / "latest.tmp", previous)
    if old is not None:
        with contextlib.suppress(OSError):
            os.unlink(folder / f"model.{old}")


def load_state(folder: str, n: int) -> tuple[int, np.ndarray]:
    """The last checkpoint (step, model), else the initial model at step 0."""
    latest = Path(folder) / "latest" if folder else None
    if latest is not None and latest.exists():
        step = int(latest.read_text())
        w = np.fromfile(Path(folder) / f"model.{step}", dtype=np.float32)
        if w.size != n:
            raise RuntimeError(f"checkpoint of step {step}: {w.size} elements, not {n}")
        emit("loaded", step=step, source="checkpoint")
        return step, w
    w = initial_model(n)
    emit("loaded", step=0, source="initial")
    return 0, w


def worker_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/elastic.py --worker")
    p.add_argument("--worker", choices=("aiodist", "torch"), required=True)
    p.add_argument("--state-mib", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--kill-step", type=int, required=True)
    p.add_argument("--kill-rank", type=int, required=True)
    p.add_argument("--admit-every", type=int, default=5)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--checkpoint-dir", default="")
    p.add_argument("--elastic", action="store_true")
    p.add_argument("--kill-also", type=int, default=0, help="a process killed at the kill step")
    p.add_argument("--deadline", type=float, required=True)
    return p.parse_args(argv)


def recover(dist: Any, exc: BaseException, step: int) -> None:
    """``dist.recover(exc)`` (aiodist.sync), and a line saying what it lost and took."""
    started = time.time()
    lost = dist.recover(exc)
    emit(
        "recover",
        step=step,
        lost=lost,
        seconds=time.time() - started,
        rank=dist.get_rank(),
        size=dist.get_world_size(),
    )


def aiodist_worker(a: argparse.Namespace) -> None:
    import aiodist.sync as dist

    n = a.state_mib << 18
    first = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    mine = int(os.environ["RANK"])
    step_box = np.zeros(1, np.int64)
    if a.elastic and not first:
        w = np.empty(n, np.float32)
        # A replacement: wait to be admitted; the members send the step and the model.
        dist.join_process_group("gloo", state=[step_box, w])
        step = int(step_box[0])
        emit("ready", step=step, rank=dist.get_rank(), size=dist.get_world_size())
    else:
        step, w = load_state(a.checkpoint_dir, n) if not first else (0, initial_model(n))
        dist.init_process_group("gloo")
        emit("joined", step=step, rank=dist.get_rank(), size=dist.get_world_size())
    # In shared memory (one host): the workers' all_reduce reads it in place, and so do the
    # worlds that replace this one as ranks are lost and admitted.
    grad = dist.empty(n, np.float32)
    while step < a.steps:
        if first and mine == a.kill_rank and step == a.kill_step:
            emit("kill", step=step)
            if a.kill_also:  # (the rest of its host: an etcd member)
                os.kill(a.kill_also, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        local_gradient(w, grad, shard_weight(dist.get_rank(), dist.get_world_size()))
        try:
            dist.all_reduce(grad)
        except dist.DistError as exc:
            if not a.elastic:
                emit("failed", step=step, error=type(exc).__name__)
                raise
            recover(dist, exc, step)  # shrink_group(lost_ranks()), or raise exc
            continue  # redo the step, re-sharded among the survivors
        apply(w, grad)
        step += 1
        emit("step", step=step, size=dist.get_world_size())
        if checkpoint_due(a, step, dist.get_rank()):
            save_checkpoint(Path(a.checkpoint_dir), step, w)
        if a.elastic and step % a.admit_every == 0 and step < a.steps:
            step_box[0] = step
            started = time.time()
            try:
                admitted = dist.admit(state=[step_box, w])
                # The last admission point waits for the replacement, so that every
                # repetition measures its admission however fast the steps go (every member
                # calls admit as often: they all see the same).
                last = step + a.admit_every >= a.steps
                full = int(os.environ["WORLD_SIZE"])
                while last and not admitted and dist.get_world_size() < full:
                    time.sleep(0.05)
                    admitted = dist.admit(state=[step_box, w])
            except dist.DistError as exc:
                # A member lost as the world grew: go on without it, as after a failed step
                # (the processes being admitted wait for the next admission point).
                recover(dist, exc, step)
                admitted = []
            if admitted:
                emit(
                    "admit",
                    step=step,
                    admitted=admitted,
                    seconds=time.time() - started,
                    size=dist.get_world_size(),
                )
    emit("done", step=step, digest=digest(w), rank=dist.get_rank(), size=dist.get_world_size())
    dist.destroy_process_group()


def torch_worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    n = a.state_mib << 18
    first = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    mine = int(os.environ["RANK"])
    step, w_np = load_state(a.checkpoint_dir, n) if not first else (0, initial_model(n))
    dist.init_process_group("gloo")
    emit("joined", step=step, rank=dist.get_rank(), size=dist.get_world_size())
    w = torch.from_numpy(w_np)
    grad = torch.empty_like(w)
    weight = shard_weight(dist.get_rank(), dist.get_world_size())
    while step < a.steps:
        if first and mine == a.kill_rank and step == a.kill_step:
            emit("kill", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        # The same operations as local_gradient and apply, on torch tensors.
        torch.mul(w, SCALE, out=grad)
        grad.round_()
        grad.mul_(weight)
        try:
            dist.all_reduce(grad)
        except RuntimeError as exc:
            emit("failed", step=step, error=type(exc).__name__)
            raise
        grad.mul_(LR)
        w.sub_(grad)
        step += 1
        emit("step", step=step, size=dist.get_world_size())
        if checkpoint_due(a, step, dist.get_rank()):
            save_checkpoint(Path(a.checkpoint_dir), step, w_np)
    emit("done", step=step, digest=digest(w_np), rank=dist.get_rank(), size=dist.get_world_size())
    dist.destroy_process_group()


def worker_main(argv: list[str]) -> None:
    emit("start")
    a = worker_args(argv)
    watchdog(a.deadline)
    if a.worker == "torch":
        torch_worker(a)
    else:
        aiodist_worker(a)


# -- the etcd cluster of the elastic-etcd setup -----------------------------------------------


class EtcdCluster:
    """Three etcd members on loopback, their data on disk (as a cluster keeps it), started
    and ready (a leader elected); :meth:`stop` ends them and removes their data."""

    def __init__(self) -> None:
        etcd = shutil.which("etcd")
        if etcd is None:
            raise RuntimeError("etcd is not installed (Debian: apt-get install etcd-server)")
        self.folder = Path(tempfile.mkdtemp(prefix="aiodist-bench-etcd-"))
        with contextlib.ExitStack() as stack:
            socks = [stack.enter_context(socket.socket()) for _ in range(6)]
            for sock in socks:
                sock.bind(("127.0.0.1", 0))
            ports = [sock.getsockname()[1] for sock in socks]
        names = [f"m{i}" for i in range(3)]
        peers = [f"http://127.0.0.1:{ports[2 * i + 1]}" for i in range(3)]
        #: The members' client addresses; every client talks to the first one first.
        self.endpoints = [f"127.0.0.1:{ports[2 * i]}" for i in range(3)]
        cluster = ",".join(f"{n}={u}" for n, u in zip(names, peers, strict=True))
        self.procs = []
        for i, name in enumerate(names):
            with open(self.folder / f"{name}.log", "wb") as log:
                self.procs.append(
                    subprocess.Popen(
                        [
                            etcd, "--name", name, "--data-dir", str(self.folder / name),
                            "--listen-client-urls", f"http://{self.endpoints[i]}",
                            "--advertise-client-urls", f"http://{self.endpoints[i]}",
                            "--listen-peer-urls", peers[i],
                            "--initial-advertise-peer-urls", peers[i],
                            "--initial-cluster", cluster, "--initial-cluster-state", "new",
                            "--initial-cluster-token", self.folder.name,
                        ],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )  # fmt: skip
        #: The members' process ids, in the order of :attr:`endpoints`.
        self.pids = [proc.pid for proc in self.procs]
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for endpoint in self.endpoints:
            request = urllib.request.Request(
                f"http://{endpoint}/v3/kv/range", data=json.dumps({"key": "AA=="}).encode()
            )
            while True:
                with (
                    contextlib.suppress(OSError),
                    urllib.request.urlopen(request, timeout=2) as answer,
                ):
                    if b"header" in answer.read():
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd at {endpoint} did not become ready in {timeout} s")
                time.sleep(0.05)

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


# -- one repetition ---------------------------------------------------------------------------


@dataclass
class Rep:
    setup: str
    index: int
    status: str = "ok"
    exit_code: int | None = None
    seconds: float = 0.0
    m: dict[str, Any] = field(default_factory=dict)
    stderr_tail: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class Failed(Exception):
    pass


def launcher_command(
    setup: str, a: argparse.Namespace, ckpt: str, deadline: float, etcd: EtcdCluster | None
) -> list[str]:
    worker = [
        SCRIPT,
        "--worker",
        "torch" if setup == "torch-all" else "aiodist",
        f"--state-mib={a.state_mib}",
        f"--steps={a.steps}",
        f"--kill-step={a.kill_step}",
        f"--kill-rank={a.kill_rank}",
        f"--admit-every={a.admit_every}",
        f"--checkpoint-every={a.checkpoint_every}",
        f"--deadline={deadline:.3f}",
    ]
    common = ["--standalone", f"--nproc-per-node={NPROC}", "--max-restarts=1"]
    aiodist_run = [sys.executable, "-m", "aiodist.run", *common, "--preload=numpy,aiodist.sync"]
    if setup == "elastic":
        return [*aiodist_run, "--restart-policy=failed", *worker, "--elastic"]
    if setup == "elastic-etcd":
        assert etcd is not None
        on_etcd = [
            sys.executable, "-m", "aiodist.run", "--rdzv-backend=etcd",
            f"--rdzv-endpoint={','.join(etcd.endpoints)}", "--rdzv-id=bench", "--nnodes=1",
            f"--nproc-per-node={NPROC}", "--max-restarts=1", "--preload=numpy,aiodist.sync",
        ]  # fmt: skip
        kill_also = f"--kill-also={etcd.pids[0]}"
        return [*on_etcd, "--restart-policy=failed", *worker, "--elastic", kill_also]
    worker.append(f"--checkpoint-dir={ckpt}")
    if setup == "aiodist-all":
        return [*aiodist_run, "--restart-policy=all", *worker]
    return [*torchrun(), *common, *worker]


def torchrun() -> list[str]:
    found = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


def parse(text: str) -> list[dict[str, Any]]:
    events = []
    for line in text.splitlines():
        at = line.find(MARK)
        if at >= 0:
            with contextlib.suppress(ValueError):
                events.append(json.loads(line[at + len(MARK) :]))
    return events


def ours(pid: int) -> bool:
    """Whether ``pid`` is still a worker of this bench (not a process that reused the id)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return SCRIPT.encode() in cmdline and b"--worker" in cmdline


def end_processes(proc: subprocess.Popen[bytes], pids: set[int]) -> None:
    """The launcher's process group, then the workers it started that are still there."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    for pid in pids:
        if ours(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(ours(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


#: The launcher of the repetition in progress, ended on the way out of an interrupted run.
_current: list[tuple[subprocess.Popen[bytes], Path]] = []


def one_rep(setup: str, index: int, a: argparse.Namespace, ckpt_root: str, ref: str) -> Rep:
    rep = Rep(setup, index)
    folder = Path(tempfile.mkdtemp(prefix=f"{setup}-{index}-", dir=ckpt_root))
    ckpt = folder / "checkpoints"
    ckpt.mkdir()
    deadline = time.time() + a.timeout + 10
    etcd = EtcdCluster() if setup == "elastic-etcd" else None
    try:
        cmd = launcher_command(setup, a, str(ckpt), deadline, etcd)
        return run_rep(rep, folder, cmd, a, ref, etcd)
    finally:
        if etcd is not None:
            etcd.stop()
        shutil.rmtree(folder, ignore_errors=True)


def run_rep(
    rep: Rep,
    folder: Path,
    cmd: list[str],
    a: argparse.Namespace,
    ref: str,
    etcd: EtcdCluster | None,
) -> Rep:
    """Run one repetition's launcher ``cmd`` and read its measurements into ``rep``."""
    setup = rep.setup
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env.setdefault("OMP_NUM_THREADS", "1")
    if etcd is not None:
        env["AIODIST_PEER_TIMEOUT"] = f"{a.etcd_lease_ttl:g}"  # (the etcd leases' TTL)
    if setup == "torch-all":
        # torchrun shares its rendezvous store with the workers by default and keeps the
        # first attempt's keys in it: the restarted gloo workers then read the dead ones'
        # addresses and hang (pytorch/pytorch#135712). A store of their own per attempt:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    out_path, err_path = folder / "stdout", folder / "stderr"
    t0 = time.monotonic()
    timed_out = False
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        # A session of its own: the launcher's process group is ended with it.
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=err, env=env, cwd=ROOT, start_new_session=True
        )
        _current.append((proc, out_path))
        try:
            proc.wait(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            pids = {e["pid"] for e in parse(out_path.read_text(errors="replace"))}
            end_processes(proc, pids)
            _current.clear()
    rep.seconds = time.monotonic() - t0
    rep.exit_code = proc.returncode
    text = out_path.read_text(errors="replace")
    errors = err_path.read_text(errors="replace").splitlines()
    # (a launcher that wrote nothing to stderr: the tail of its other output instead)
    rep.stderr_tail = [ln for ln in errors if ln.strip()][-15:] or [
        ln for ln in text.splitlines() if MARK not in ln and ln.strip()
    ][-15:]
    events = parse(text)
    try:
        analyse(setup, events, a, ref, rep.m)
    except Failed as exc:
        rep.status = f"failed: {exc}"
    if timed_out:
        rep.status = f"timed out after {a.timeout:g} s" + (
            "" if rep.ok else f" ({rep.status.removeprefix('failed: ')})"
        )
    elif rep.exit_code != 0:
        rep.status = f"failed: launcher exit {rep.exit_code}" + (
            "" if rep.ok else f" ({rep.status.removeprefix('failed: ')})"
        )
    return rep


def analyse(
    setup: str, events: list[dict[str, Any]], a: argparse.Namespace, ref: str, m: dict[str, Any]
) -> None:
    """The measurements of one repetition from its workers' lines, into ``m`` as they are
    read; Failed if it went wrong (``m`` then holds what could be read)."""
    kills = [e for e in events if e["ev"] == "kill"]
    if not kills:
        raise Failed("no worker reached the kill step")
    kill = kills[0]
    t_kill, k, killed = kill["t"], kill["step"], kill["rank0"]
    m["kill_step"] = k
    survivors = [r for r in range(NPROC) if r != killed]
    steps = [e for e in events if e["ev"] == "step"]

    def before(e: dict[str, Any]) -> bool:
        return e["attempt"] == 0 and e["step"] <= k

    intervals = []
    for r in survivors:
        times = sorted(e["t"] for e in steps if e["rank0"] == r and before(e))
        intervals += [b - t for t, b in itertools.pairwise(times)]
    if not intervals:
        raise Failed("no two steps completed before the kill")
    m["step_s"] = step_s = statistics.median(intervals)
    firsts, caught = {}, {}
    for r in survivors:
        after = sorted(
            (e for e in steps if e["rank0"] == r and not before(e) and e["t"] > t_kill),
            key=lambda e: e["t"],
        )
        if not after:
            raise Failed(f"rank {r} completed no step after the kill")
        firsts[r] = after[0]
        beyond = [e for e in after if e["step"] > k]
        if beyond:
            caught[r] = beyond[0]["t"]
    m["next_step_s"] = max(e["t"] for e in firsts.values()) - t_kill
    m["resumed_from"] = min(e["step"] for e in firsts.values()) - 1
    m["redone"] = k - m["resumed_from"]
    if len(caught) == len(survivors):
        m["lost_steps"] = (max(caught.values()) - t_kill) / step_s - 1
    restarted = [e for e in events if e["ev"] == "start" and e["attempt"] > 0]
    if setup in ELASTIC:
        starts = [e for e in restarted if e["rank0"] == killed]
        ready = [e for e in events if e["ev"] == "ready"]
        if not starts:
            raise Failed("the launcher started no replacement")
        if not ready:
            raise Failed("the replacement was not admitted")
        m["ready_s"] = ready[0]["t"] - starts[0]["t"]
        m["whole_s"] = ready[0]["t"] - t_kill
        m["admitted_at"] = ready[0]["step"]
        admits = [e["seconds"] for e in events if e["ev"] == "admit"]
        m["admit_s"] = max(admits) if admits else None
        recovers = [e["seconds"] for e in events if e["ev"] == "recover"]
        m["recover_s"] = max(recovers) if recovers else None
        if {e["rank0"] for e in restarted} - {killed}:
            raise Failed("the launcher restarted survivors")
        kept = True
        for r in survivors:
            first_pid = {e["pid"] for e in events if e["rank0"] == r and e["attempt"] == 0}
            done_pid = {e["pid"] for e in events if e["rank0"] == r and e["ev"] == "done"}
            kept = kept and len(first_pid) == 1 and done_pid == first_pid
        m["pids_kept"] = kept
        if not kept:
            raise Failed("a survivor ended in another process than it started in")
    else:
        if len({e["rank0"] for e in restarted}) < NPROC:
            raise Failed(f"{len(restarted)} of {NPROC} workers restarted")
        first_steps = {}
        for e in sorted((e for e in steps if e["attempt"] > 0), key=lambda e: e["t"]):
            first_steps.setdefault(e["rank0"], e["t"])
        if len(first_steps) < NPROC:
            raise Failed("a restarted worker completed no step")
        m["ready_s"] = max(first_steps.values()) - min(e["t"] for e in restarted)
        m["whole_s"] = max(first_steps.values()) - t_kill
        loaded = [e for e in events if e["ev"] == "loaded" and e["attempt"] > 0]
        m["loaded_from"] = (
            "initial" if any(e["source"] == "initial" for e in loaded) else "checkpoint"
        )
        m["pids_kept"] = False
    done: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["ev"] == "done":
            done[e["rank0"]] = e
    m["workers_done"] = len(done)
    m["equal"] = len(done) == NPROC and all(e["digest"] == ref for e in done.values())
    if len(done) < NPROC:
        raise Failed(f"{len(done)} of {NPROC} workers finished")
    if not all(e["step"] == a.steps for e in done.values()):
        raise Failed("a worker finished at another step than --steps")
    if not m["equal"]:
        raise Failed("a worker's weights differ from the reference")


# -- results ---------------------------------------------------------------------------------


def private_network() -> bool:
    """Whether this process's network namespace has the loopback interface only
    (``/proc/self/net`` is the namespace's; ``/sys/class/net`` may be the host's)."""
    with contextlib.suppress(OSError):
        lines = Path("/proc/self/net/dev").read_text().splitlines()[2:]
        return [line.split(":")[0].strip() for line in lines] == ["lo"]
    return False


def cell(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def row(rep: Rep) -> str:
    m = rep.m
    status = rep.status if rep.ok else f"**{rep.status}**"
    said = [ln.strip() for ln in rep.stderr_tail if any(c.isalnum() for c in ln)]
    errors = [ln for ln in said if "rror" in ln or "failed" in ln]
    if not rep.ok and said:
        status += ": " + (errors or said)[-1][:160]
    status = status.replace("|", "/")
    point = (
        f"admitted at {m['admitted_at']}"
        if "admitted_at" in m
        else f"resumed from {m['resumed_from']} ({m['loaded_from']})"
        if "loaded_from" in m
        else "-"
    )
    cells = [
        LABELS[rep.setup],
        str(rep.index + 1),
        status,
        cell(rep.exit_code),
        f"{rep.seconds:.1f}",
        cell(m.get("step_s")),
        cell(m.get("kill_step")),
        cell(m.get("next_step_s")),
        cell(m.get("redone")),
        cell(m.get("lost_steps"), 2),
        cell(m.get("ready_s")),
        cell(m.get("whole_s")),
        point,
        cell(m.get("pids_kept")) if rep.setup in ELASTIC else "-",
        cell(m.get("equal")),
    ]
    return "| " + " | ".join(cells) + " |"


MEASURES = (
    ("next_step_s", "kill -> next step (s)"),
    ("ready_s", "replacement ready (s)"),
    ("whole_s", "kill -> all workers again (s)"),
    ("redone", "redone steps"),
    ("lost_steps", "lost steps"),
    ("step_s", "undisturbed step (s)"),
)
#: Measured in the elastic setup only.
ELASTIC_MEASURES = (
    ("recover_s", "survivors' recover(), the slowest (s)"),
    ("admit_s", "members' admit() that took the replacement in, the slowest (s)"),
)


def summary(reps: list[Rep], setups: list[str]) -> tuple[list[str], dict[tuple[str, str], float]]:
    lines = [
        "| setup | measure | completed | median | min | max |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    medians = {}
    for setup in setups:
        mine = [r for r in reps if r.setup == setup]
        ok = [r for r in mine if r.ok]
        for key, label in MEASURES + (ELASTIC_MEASURES if setup in ELASTIC else ()):
            values = [r.m[key] for r in ok if r.m.get(key) is not None]
            if values:
                medians[setup, key] = statistics.median(values)
                stats = [
                    f"{v:g}" if key == "redone" else cell(float(v), 2 if key == "lost_steps" else 3)
                    for v in (medians[setup, key], *minmax(values))
                ]
            else:
                stats = ["-", "-", "-"]
            lines.append(
                f"| {LABELS[setup]} | {label} | {len(ok)}/{len(mine)} | " + " | ".join(stats) + " |"
            )
    return lines, medians


def minmax(values: list[float]) -> tuple[float, float]:
    return min(values), max(values)


def ratios(medians: dict[tuple[str, str], float], setups: list[str]) -> list[str]:
    others = [s for s in setups if s not in ELASTIC]
    if "elastic" not in setups or not others:
        return []
    lines = [
        "| measure (median) | "
        + " | ".join(f"{LABELS[s]} / aiodist elastic" for s in others)
        + " |",
        "| --- | " + " | ".join("---:" for _ in others) + " |",
    ]
    for key, label in MEASURES[:3]:
        cells = []
        for s in others:
            base, other = medians.get(("elastic", key)), medians.get((s, key))
            cells.append(f"{other / base:.1f}x" if base and other is not None else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    verdicts = []
    for s in others:
        base, other = medians.get(("elastic", "next_step_s")), medians.get((s, "next_step_s"))
        if base and other is not None:
            met = "met" if other / base >= 10 else "not met"
            verdicts.append(f"{LABELS[s]}: {other / base:.1f}x ({met})")
    if verdicts:
        lines += [
            "",
            "Target, aiodist elastic at least 10x faster to the next step than a full "
            "restart: " + "; ".join(verdicts) + ".",
        ]
    return lines


def plot(reps: list[Rep], setups: list[str], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(8, 4.2))
    for ax, (key, label) in zip(axes, MEASURES[:2], strict=True):
        for i, setup in enumerate(setups):
            values = [r.m[key] for r in reps if r.setup == setup and r.ok and key in r.m]
            xs = [i + 0.08 * ((j % 5) - 2) for j in range(len(values))]
            ax.scatter(xs, values, s=18, color=f"C{i}", label=LABELS[setup])
            if values:
                ax.hlines(statistics.median(values), i - 0.3, i + 0.3, color=f"C{i}")
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _pos: f"{y:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda _y, _pos: ""))
        ax.set_xlim(-0.5, len(setups) - 0.5)
        names = [
            LABELS[s].replace(" full", "\nfull").replace(" elastic", "\nelastic") for s in setups
        ]
        ax.set_xticks(range(len(setups)), names)
        ax.set_title(label.replace(" (s)", ""))
        ax.set_ylabel("seconds")
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"{NPROC} workers, one killed with SIGKILL (lines: medians)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


def main() -> None:
    if "--worker" in sys.argv[1:]:
        worker_main(sys.argv[1:])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--reps", type=int, default=20, help="repetitions per setup")
    p.add_argument("--state-mib", type=int, default=256, help="the model's size, float32")
    p.add_argument("--steps", type=int, default=30, help="steps of the job")
    p.add_argument("--kill-step", type=int, default=12, help="the step a worker dies at")
    p.add_argument("--kill-rank", type=int, default=2, help="the worker that dies")
    p.add_argument("--admit-every", type=int, default=5, help="elastic: steps between admits")
    p.add_argument(
        "--checkpoint-every", type=int, default=5, help="full restarts: steps between checkpoints"
    )
    p.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated: {SETUPS}")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per repetition")
    p.add_argument(
        "--etcd-lease-ttl",
        type=float,
        default=2.0,
        help="elastic-etcd: the etcd leases' time to live, seconds (AIODIST_PEER_TIMEOUT)",
    )
    p.add_argument(
        "--write",
        action="store_true",
        help="write bench/results/elastic.md and docs/images/elastic.png (else a temp folder)",
    )
    p.add_argument("--out", help="the results file (overrides --write's)")
    p.add_argument("--plot", help="the plot's path ('' for none; overrides --write's)")
    a = p.parse_args()
    setups = [s for s in a.setups.split(",") if s]
    for s in setups:
        if s not in SETUPS:
            p.error(f"unknown setup {s!r}: expected some of {','.join(SETUPS)}")
    if not 0 <= a.kill_rank < NPROC:
        p.error(f"--kill-rank must be a rank of the {NPROC} workers")
    if a.kill_step < 2 or a.kill_step + a.admit_every >= a.steps:
        p.error("need 2 <= --kill-step and an admission point after it: --kill-step + "
                "--admit-every < --steps")  # fmt: skip
    if a.state_mib < 1 or a.reps < 1:
        p.error("--state-mib and --reps must be at least 1")
    folder = None if a.write else tempfile.mkdtemp(prefix="aiodist-bench-")
    if a.out is None:
        a.out = str(ROOT / "bench/results/elastic.md" if a.write else Path(folder, "elastic.md"))
    if a.plot is None:
        a.plot = str(ROOT / "docs/images/elastic.png" if a.write else Path(folder, "elastic.png"))
    notes = []
    if "elastic-etcd" in setups:
        if shutil.which("etcd") is None:
            print("etcd is not installed (apt-get install etcd-server): elastic-etcd is left out")
            notes.append("etcd is not installed: the elastic setup on etcd is left out.")
            setups.remove("elastic-etcd")
        else:
            version = subprocess.run(["etcd", "--version"], capture_output=True, text=True)
            notes.append(
                f"{version.stdout.splitlines()[0]}; etcd leases' time to live "
                f"{a.etcd_lease_ttl:g} s (AIODIST_PEER_TIMEOUT)."
            )
    if "torch-all" in setups:
        if importlib.util.find_spec("torch") is None:
            print("torch is not installed (pip install torch==2.13.0): torch-all is left out")
            notes.append("torch is not installed: the torch gloo setup is left out.")
            setups.remove("torch-all")
        else:
            notes.append(f"torch {importlib.metadata.version('torch')}.")
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    t_start = time.monotonic()
    load_before = os.getloadavg()
    n = a.state_mib << 18
    print(f"reference: replaying {a.steps} steps of {a.state_mib} MiB in one process ...")
    t0 = time.monotonic()
    ref = reference_digest(n, a.steps)
    print(f"reference digest {ref} ({time.monotonic() - t0:.1f} s)", flush=True)
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    ckpt_root = tempfile.mkdtemp(prefix="aiodist-elastic-", dir=shm)
    reps: list[Rep] = []
    header = (
        "| setup | rep | status | exit | run (s) | undisturbed step (s) | kill step "
        "| kill -> next step (s) | redone steps | lost steps | replacement ready (s) "
        "| kill -> all workers again (s) | admission / resumption | survivors' pids kept "
        "| weights equal |"
    )
    print(header, flush=True)
    try:
        with terminated_as_exit():
            for i in range(a.reps):
                for setup in setups:
                    rep = one_rep(setup, i, a, ckpt_root, ref)
                    reps.append(rep)
                    print(row(rep), flush=True)
    finally:
        for proc, out_path in _current:
            pids = {e["pid"] for e in parse(out_path.read_text(errors="replace"))}
            end_processes(proc, pids)
        shutil.rmtree(ckpt_root, ignore_errors=True)
    load_after = os.getloadavg()
    table, medians = summary(reps, setups)
    command = " ".join(["python", "bench/elastic.py", *map(shlex.quote, sys.argv[1:])])
    net = "a private network namespace" if private_network() else "the host's network namespace"
    lines = [
        "# A worker killed mid-run: elastic recovery against full restarts",
        "",
        f"Command: `unshare -n bash -c 'ip link set lo up && .venv/bin/{command}'` "
        f"(run in {net}), on {started}, {os.cpu_count()} CPUs, load average "
        f"{load_before[0]:.1f} / {load_before[1]:.1f} / {load_before[2]:.1f} (1 / 5 / 15 min) "
        f"at the start, {load_after[0]:.1f} / {load_after[1]:.1f} / {load_after[2]:.1f} at the "
        f"end; aiodist commit `{checkout_commit()}`, numpy {np.__version__}, Python "
        f"{sys.version.split()[0]}. "
        + "".join(f"{note} " for note in notes)
        + f"Run time {(time.monotonic() - t_start) / 60:.1f} min.",
        "",
        f"The job: {NPROC} workers on this host, data-parallel, {a.steps} steps; the model is "
        f"{a.state_mib} MiB of float32 and every step all_reduces a gradient of that size "
        "(the aiodist workers' in an array of `aiodist.empty`, in shared memory, which every "
        "world on the host reads in place, the worlds that replace theirs too; the torch "
        f"workers' in a tensor). At step {a.kill_step} the worker of rank {a.kill_rank} kills itself with SIGKILL. "
        f"Repetitions of each setup: {a.reps}, taken in turn. The setups:",
        "",
        *[f"- {LABELS[s]}: {DESCRIPTIONS[s]}." for s in setups],
        "",
        f"Elastic admission points: every {a.admit_every} steps. Full restarts: rank 0 writes "
        f"a checkpoint (step and model) every {a.checkpoint_every} steps to "
        f"{'/dev/shm (memory)' if shm else 'a temporary folder'}, and the restarted workers "
        "load the last one (the initial model if there is none).",
        "",
        "Measures (seconds from the workers' `time.time()` lines; a worker's first line is "
        "printed as its worker code starts, after Python and numpy started; for the aiodist "
        "setups, forks of the launcher's starter, that is just after the fork):",
        "",
        "- kill -> next step: from the kill to the first step completed after it on every "
        "survivor (the ranks other than the killed one, restarted or not), the last of them; a "
        "step counts when it was not completed before the kill, or a restarted process "
        "completed it;",
        "- replacement ready: elastic, from the replacement's first line until it was "
        "admitted and holds the state (`join_process_group` returned); full restarts, from the "
        "first line of the first restarted worker until every restarted worker completed its "
        "first step;",
        "- kill -> all workers again: from the kill to that same point;",
        "- redone steps: steps completed before the kill that were computed again after it "
        "(the kill step minus the step the survivors resumed from);",
        "- lost steps: (time from the kill until every survivor completed the step the killed "
        "worker was about to do) / (undisturbed step) - 1, the steps an undisturbed job would "
        "have completed in that time beyond the one in progress: it counts the redone steps "
        "and the time the job stood still;",
        "- undisturbed step: the median interval between the survivors' completed steps "
        "before the kill;",
        "- weights equal: every worker ends with a model whose digest equals a single-process "
        "numpy replay (the gradient is a sum over the whole data set, exact in float32 "
        "however it is sharded); survivors' pids kept: the elastic survivors ended in the "
        "processes they started in, and only the killed worker was restarted.",
        "",
        "A repetition completes when its launcher exits 0, every measure was read, the "
        "elastic survivors kept their processes, and every worker's weights equal the "
        "reference; the summary is over the completed ones.",
        "",
        "## Summary",
        "",
        *table,
        "",
        *ratios(medians, setups),
        "",
        "## Every repetition",
        "",
        header,
        "|" + " --- |" * 3 + " ---: |" * 9 + " --- |" * 3,
        *[row(r) for r in reps],
        "",
    ]
    failed = [r for r in reps if not r.ok]
    if failed:
        lines += ["## Failures", ""]
        for r in failed:
            lines += [
                f"{LABELS[r.setup]}, repetition {r.index + 1}: {r.status}, launcher exit "
                f"{r.exit_code}; the tail of its stderr:",
                "",
                "```text",
                *(r.stderr_tail or ["(empty)"]),
                "```",
                "",
            ]
    if a.plot and importlib.util.find_spec("matplotlib") is not None:
        rel = os.path.relpath(a.plot, os.path.dirname(os.path.abspath(a.out)))
        lines[lines.index("## Every repetition") : lines.index("## Every repetition")] = [
            f"![kill -> next step and replacement ready, per setup]({rel})",
            "",
        ]
    print("\n".join(["", *table, "", *ratios(medians, setups)]))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines).rstrip() + "\n")
    print(f"wrote {out}")
    if a.plot:
        plot(reps, setups, a.plot)


if __name__ == "__main__":
    main()
