"""Data-parallel SGD that survives ``kill -9`` of a worker: the others shrink and go on.

    python examples/elastic_sgd.py                 # 4 workers, rank 2 killed at step 20
    python examples/elastic_sgd.py --workers 3 --kill-rank 0 --kill-step 5

This process hosts the store (a ``TCPStore`` server) and starts the workers, so that any
worker may die, rank 0 included. Each worker joins the process group through that store with
the blocking API (``import aiodist.sync as dist``). Every step, it computes the gradient of
the squared error on its shard of the data and the workers sum the gradients (all_reduce).

At ``--kill-step`` one worker kills itself with ``SIGKILL``, as the OOM killer or a lost host
would. The all_reduce of the others fails within milliseconds; they ask which ranks are gone
(``lost_ranks``), go on without them (``shrink_group``: renumbered, over new connections, none
of them restarting), re-shard the data among themselves and redo the step. The gradient is a
sum over the whole data set however it is sharded, so the survivors end with the weights
that one process computes with numpy: this process checks.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sys
import time
from multiprocessing.queues import Queue

import numpy as np

import aiodist.sync as dist

STEPS = 40
LR = 0.05
SAMPLES = 1200
FEATURES = 8


def make_data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The data set (every worker makes the same one) and the initial weights."""
    rng = np.random.default_rng(1234)
    true_w = rng.normal(size=FEATURES)
    x = rng.normal(size=(SAMPLES, FEATURES))
    y = x @ true_w + 0.01 * rng.normal(size=SAMPLES)
    return x, y, np.zeros(FEATURES)


def gradient_sum(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The squared error's gradient summed over the rows of ``x`` (not averaged: the sum of
    the shards' sums is the whole data set's, however it is split)."""
    return 2.0 * x.T @ (x @ w - y)


def reference() -> np.ndarray:
    """Full-batch gradient descent in one process: what the survivors must end with."""
    x, y, w = make_data()
    for _ in range(STEPS):
        w = w - LR * gradient_sum(w, x, y) / SAMPLES
    return w


def worker(
    rank: int, workers: int, port: int, kill_rank: int, kill_step: int, results: Queue
) -> None:
    """One worker: train, and on a lost rank shrink the group and redo the step."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=workers)
    x, y, w = make_data()
    step = 0
    while step < STEPS:
        if rank == kill_rank and step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        # This worker's shard: every size-th row, from its rank in the current group.
        mine = slice(dist.get_rank(), SAMPLES, dist.get_world_size())
        grad = gradient_sum(w, x[mine], y[mine])
        try:
            dist.all_reduce(grad)
        except dist.DistError as exc:
            started = time.perf_counter()
            lost = dist.lost_ranks()
            dist.shrink_group(lost)
            took = time.perf_counter() - started
            # One write, so that the workers' lines do not interleave.
            sys.stdout.write(
                f"worker {rank}: step {step} failed ({type(exc).__name__}); ranks {lost} "
                f"lost; now rank {dist.get_rank()} of {dist.get_world_size()} "
                f"after {took * 1e3:.1f} ms\n"
            )
            sys.stdout.flush()
            continue  # redo the step with the survivors
        w -= LR * grad / SAMPLES
        step += 1
    results.put((rank, w))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--kill-rank", type=int, default=2)
    parser.add_argument("--kill-step", type=int, default=20)
    args = parser.parse_args()
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    config = (args.workers, server.port, args.kill_rank, args.kill_step, results)
    procs = [ctx.Process(target=worker, args=(r, *config)) for r in range(args.workers)]
    for p in procs:
        p.start()
    finished = dict(results.get(timeout=60) for _ in range(args.workers - 1))
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    expected = [-signal.SIGKILL if r == args.kill_rank else 0 for r in range(args.workers)]
    w = reference()
    agree = all(np.allclose(got, w, rtol=1e-12, atol=0) for got in finished.values())
    print(f"exit codes {codes}; survivors {sorted(finished)} match the reference: {agree}")
    return 0 if codes == expected and agree else 1


if __name__ == "__main__":
    sys.exit(main())
