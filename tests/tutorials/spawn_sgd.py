"""Data-parallel SGD started with ``mp.spawn``, as torch's DDP tutorials start it, ported by
the import lines: ``python spawn_sgd.py WORLD PORT [START_METHOD]``. Never calls
``destroy_process_group()``.
"""

import os
import sys

import numpy as np

import aiodist.multiprocessing as mp
import aiodist.sync as dist

STEPS, FEATURES, SAMPLES = 20, 8, 64


def data(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((SAMPLES, FEATURES))
    return x, x @ np.arange(1.0, FEATURES + 1)


def train(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    w = np.random.default_rng(rank).standard_normal(FEATURES)
    dist.broadcast(w, src=0)  # every replica starts from rank 0's weights
    x, y = data(rank)
    for _ in range(STEPS):
        grad = 2 * x.T @ (x @ w - y) / SAMPLES
        dist.all_reduce(grad)
        w -= 0.05 * grad / world_size
    # The same steps on all the data in one process give the same weights.
    ref = np.random.default_rng(0).standard_normal(FEATURES)
    shards = [data(r) for r in range(world_size)]
    for _ in range(STEPS):
        grads = [2 * sx.T @ (sx @ ref - sy) / SAMPLES for sx, sy in shards]
        ref -= 0.05 * np.sum(grads, axis=0) / world_size
    np.testing.assert_allclose(w, ref, rtol=1e-9)
    print(f"rank {rank}: weights match the single-process reference")


if __name__ == "__main__":
    world_size, port = int(sys.argv[1]), int(sys.argv[2])
    start = sys.argv[3] if len(sys.argv) > 3 else "spawn"
    mp.spawn(train, args=(world_size, port), nprocs=world_size, join=True, start_method=start)
