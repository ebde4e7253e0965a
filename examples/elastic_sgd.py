"""Data-parallel SGD that survives ``kill -9`` of a worker and takes its replacement back.

    aiodist-run --standalone --nproc-per-node=4 --restart-policy=failed --max-restarts=1 \\
        examples/elastic_sgd.py --kill-rank=2 --kill-step=10

With ``--preload=numpy,aiodist.sync`` every worker, the replacement too, is a fork of a
process that has imported those, so the replacement takes no CPU from the survivors for its
imports.

Each worker joins the process group with the blocking API (``import aiodist.sync as dist``)
through ``env://``; the launcher hosts the store, so any worker may die, rank 0 included.
Every step, a worker computes the gradient of the squared error on its shard of the data,
and the workers sum the gradients (all_reduce); rank 0 says which step ended, by how many
ranks, and the loss before it.

At ``--kill-step`` the worker of rank ``--kill-rank`` kills itself with ``SIGKILL``, as the
OOM killer or a lost host would. The all_reduce of the others fails within milliseconds;
they go on without the ranks that are gone (``recover``: ``lost_ranks`` then
``shrink_group``, renumbered, over new connections, none of them restarting), re-shard the
data among themselves and redo the step. Meanwhile the launcher (``--restart-policy=failed``) starts a
replacement for the dead worker alone; it waits to be admitted (``join_process_group``).
Every ``ADMIT_EVERY`` steps the workers admit whoever waits and send them the step and the
weights (``admit(state=...)``); with ``--wait-for-replacements`` they wait there until
the world is whole again. The gradient is a sum over the whole data set however it
is sharded, so every worker, the replacement too, ends with the weights one process
computes with numpy, and says so.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import numpy as np

import aiodist.sync as dist

STEPS = 60
ADMIT_EVERY = 5
LR = 0.05
SAMPLES = 1200
FEATURES = 8


def make_data() -> tuple[np.ndarray, np.ndarray]:
    """The data set; every worker makes the same one."""
    rng = np.random.default_rng(1234)
    true_w = rng.normal(size=FEATURES)
    x = rng.normal(size=(SAMPLES, FEATURES))
    return x, x @ true_w + 0.01 * rng.normal(size=SAMPLES)


def gradient_sum(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The squared error's gradient summed over the rows of ``x`` (not averaged: the sum of
    the shards' sums is the whole data set's, however it is split)."""
    return 2.0 * x.T @ (x @ w - y)


def reference(steps: int = STEPS) -> np.ndarray:
    """Full-batch gradient descent in one process: what every worker must end with."""
    x, y = make_data()
    w = np.zeros(FEATURES)
    for _ in range(steps):
        w = w - LR * gradient_sum(w, x, y) / SAMPLES
    return w


def say(text: str) -> None:
    """Print one line in one write, so that the workers' lines do not interleave."""
    sys.stdout.write(f"{text}\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kill-rank", type=int, default=2)
    parser.add_argument("--kill-step", type=int, default=10, help="-1: nobody kills itself")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument(
        "--log-steps", action="store_true", help="print a line at the end of every step"
    )
    parser.add_argument(
        "--step-seconds", type=float, default=0.05, help="time a step's computation takes"
    )
    parser.add_argument(
        "--wait-for-replacements",
        action="store_true",
        help="at the first admission point after a loss, wait until the world is whole again",
    )
    args = parser.parse_args()
    name = f"worker {os.environ['RANK']}"
    x, y = make_data()
    state = np.zeros(1 + FEATURES)  # the step, then the weights
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        name = f"replacement of worker {os.environ['RANK']}"
        started = time.perf_counter()
        dist.join_process_group("gloo", state=[state])  # the members send where they are
        say(
            f"{name}: admitted as rank {dist.get_rank()} of {dist.get_world_size()} at "
            f"step {int(state[0])}, {time.perf_counter() - started:.2f} s after it started"
        )
    else:
        dist.init_process_group("gloo")
    step, w = int(state[0]), state[1:].copy()
    full = int(os.environ["WORLD_SIZE"])
    while step < args.steps:
        if name == f"worker {args.kill_rank}" and step == args.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        # This worker's shard: every size-th row, from its rank in the current group.
        mine = slice(dist.get_rank(), SAMPLES, dist.get_world_size())
        error = x[mine] @ w - y[mine]
        # The gradient's sum and the squared error's, in one all_reduce.
        summed = np.append(2.0 * x[mine].T @ error, error @ error)
        time.sleep(args.step_seconds)  # the rest of a real step's work
        try:
            dist.all_reduce(summed)
        except dist.DistError as exc:
            started = time.perf_counter()
            lost = dist.recover(exc)  # shrink_group(lost_ranks()), or raise exc if none is lost
            say(
                f"{name}: step {step} failed ({type(exc).__name__}); ranks {lost} lost; now "
                f"rank {dist.get_rank()} of {dist.get_world_size()} after "
                f"{(time.perf_counter() - started) * 1e3:.1f} ms"
            )
            continue  # redo the step with the survivors
        grad, loss = summed[:-1], summed[-1] / SAMPLES
        w -= LR * grad / SAMPLES
        step += 1
        if dist.get_rank() == 0:  # (one line a step: the world's size shows its changes)
            say(
                f"{name}: step {step} of {args.steps} by {dist.get_world_size()} ranks: loss {loss:.6f}"
            )
        if args.log_steps:  # (every worker: a test follows each one)
            say(f"{name}: step {step} done as rank {dist.get_rank()} of {dist.get_world_size()}")
        if step % ADMIT_EVERY == 0 and step < args.steps:
            state[0], state[1:] = step, w  # sent to the admitted ranks, if any
            try:
                admitted = dist.admit(state=[state])
                while args.wait_for_replacements and not admitted and dist.get_world_size() < full:
                    time.sleep(0.05)
                    # (every member calls it as often: they all see the same)
                    admitted = dist.admit(state=[state])
            except dist.DistError as exc:
                # A member was lost as the world grew: go on without it (the processes
                # being admitted wait for the next admission point).
                lost = dist.recover(exc)
                say(f"{name}: admission at step {step} failed; ranks {lost} lost")
    match = bool(np.allclose(w, reference(args.steps), rtol=1e-12, atol=0))
    say(f"{name}: done as rank {dist.get_rank()}; weights match the reference: {match}")
    dist.destroy_process_group()
    sys.exit(0 if match else 1)


if __name__ == "__main__":
    main()
