"""Data-parallel SGD on a linear model, launched with ``aiodist-run``.

    aiodist-run --standalone --nproc-per-node=4 examples/data_parallel_sgd.py

Every rank reads ``RANK``/``WORLD_SIZE`` (set by the launcher), joins the process group through
``env://`` (node 0's launcher hosts the store) with the blocking, ``torch.distributed``-shaped
API (``import aiodist.sync as dist``), and then:

1. receives the initial weights from rank 0 (broadcast),
2. each step, computes the gradient of the mean squared error on its own shard of the data
   and averages the gradients of all ranks (all_reduce),
3. gathers every rank's final loss (all_gather) and checks that all ranks hold the same
   weights, equal to what one process computes on the whole data set with numpy.

The data is generated from a seed, so every rank can also compute the single-process
reference and compare.
"""

from __future__ import annotations

import os

import numpy as np

import aiodist.sync as dist

STEPS = 50
LR = 0.1
SAMPLES_PER_RANK = 256
FEATURES = 8


def make_data(world_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The whole data set (every rank makes the same one) and the true weights."""
    rng = np.random.default_rng(1234)
    true_w = rng.normal(size=FEATURES)
    x = rng.normal(size=(SAMPLES_PER_RANK * world_size, FEATURES))
    y = x @ true_w + 0.01 * rng.normal(size=len(x))
    return x, y, true_w


def gradient(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Gradient of the mean squared error of ``x @ w`` against ``y``."""
    return 2.0 * x.T @ (x @ w - y) / len(x)


def reference(x: np.ndarray, y: np.ndarray, w0: np.ndarray) -> np.ndarray:
    """Full-batch gradient descent in one process: what the ranks must reproduce."""
    w = w0.copy()
    for _ in range(STEPS):
        w -= LR * gradient(w, x, y)
    return w


def main() -> None:
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend="gloo", rank=rank, world_size=world_size)
    x, y, true_w = make_data(world_size)
    shard = slice(rank * SAMPLES_PER_RANK, (rank + 1) * SAMPLES_PER_RANK)
    x_local, y_local = x[shard], y[shard]

    # Rank 0 decides the initial weights; everyone else receives them.
    w = np.random.default_rng(rank).normal(size=FEATURES) if rank == 0 else np.empty(FEATURES)
    dist.broadcast(w, src=0)
    w0 = w.copy()

    for step in range(STEPS):
        grad = gradient(w, x_local, y_local)
        # Equal shard sizes: the mean of the shard gradients is the full-batch gradient.
        dist.all_reduce(grad, op=dist.ReduceOp.AVG)
        w -= LR * grad
        if rank == 0 and step % 10 == 0:
            loss = float(np.mean((x @ w - y) ** 2))
            print(f"step {step:3d}  loss {loss:.6f}", flush=True)

    local_loss = np.array([np.mean((x_local @ w - y_local) ** 2)])
    losses = [np.empty(1) for _ in range(world_size)]
    dist.all_gather(losses, local_loss)
    expected = reference(x, y, w0)
    assert np.allclose(w, expected, rtol=1e-10, atol=1e-12), (w, expected)
    print(
        f"rank {rank}/{world_size}: weights match the single-process numpy reference "
        f"(max error {np.max(np.abs(w - expected)):.1e}); distance to the true weights "
        f"{np.linalg.norm(w - true_w):.4f}; mean loss over ranks "
        f"{np.mean(np.concatenate(losses)):.6f}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
