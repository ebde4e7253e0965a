"""Data-parallel training of a numpy MLP whose gradient all_reduce overlaps the backward pass.

    aiodist-run --standalone --nproc-per-node=2 examples/async_mlp.py

(``--steps``, ``--hidden``, ``--samples`` and friends change the sizes; ``--out FILE`` makes
rank 0 save the trained weights.)

The model is a three-layer perceptron (``features -> hidden -> hidden -> outputs``, ReLU)
fitted by full-batch gradient descent to synthetic regression data; each rank holds its own
shard of the samples. Each layer's weight and bias gradients live in one flat buffer, a
gradient bucket, so a layer is reduced with one ``aiodist.all_reduce``.

The backward pass runs from the last layer to the first. With overlap, a layer's bucket is
handed to ``aiodist.all_reduce(bucket, op=AVG)`` the moment its gradients exist, and the
returned ``Work`` moves the bytes on the event loop while the next (earlier) layer's
gradients are computed in a worker thread (numpy releases the GIL in its matrix products).
All the works are awaited once the backward pass is done, then every rank applies the same
averaged gradients. Without overlap, the same buckets are reduced only after the whole
backward pass. The script trains both ways from the same start and prints the loss and the
time per step of each. Overlap pays where the transfers and the arithmetic do not compete
for the same cores (more cores than busy threads, or a real network between the hosts); on
a machine whose cores are all busy computing, both take about as long.

Every rank then checks that both runs reached the weights that a single process computes
with numpy on the whole data set (the mean gradient over all samples is the average of the
shards' mean gradients, since the shards are equal). ``examples/async_overlap.py`` shows the
same Work-handle pattern on fixed buckets with a health check ticking on the loop; this one
trains a real model.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

import aiodist


@dataclass(frozen=True)
class Config:
    """Sizes and training settings; every rank and the reference use the same."""

    features: int = 512
    hidden: int = 768
    outputs: int = 8
    samples: int = 512  # per rank
    steps: int = 12
    lr: float = 0.05

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """The (inputs, outputs) of each layer."""
        sizes = [self.features, self.hidden, self.hidden, self.outputs]
        return list(itertools.pairwise(sizes))


class MLP:
    """The parameters and gradients, one flat bucket per layer with W and b as views."""

    def __init__(self, cfg: Config) -> None:
        rng = np.random.default_rng(0)
        self.params: list[np.ndarray] = []
        self.grads: list[np.ndarray] = []
        self.weights: list[np.ndarray] = []
        self.biases: list[np.ndarray] = []
        self.grad_w: list[np.ndarray] = []
        self.grad_b: list[np.ndarray] = []
        for n_in, n_out in cfg.shapes:
            bucket = np.empty(n_in * n_out + n_out)
            w, b = bucket[: n_in * n_out].reshape(n_in, n_out), bucket[n_in * n_out :]
            w[...] = rng.normal(scale=np.sqrt(2.0 / n_in), size=(n_in, n_out))
            b[...] = 0.0
            grad = np.zeros_like(bucket)
            self.params.append(bucket)
            self.weights.append(w)
            self.biases.append(b)
            self.grads.append(grad)
            self.grad_w.append(grad[: n_in * n_out].reshape(n_in, n_out))
            self.grad_b.append(grad[n_in * n_out :])

    def forward(self, x: np.ndarray, y: np.ndarray) -> tuple[float, list[np.ndarray], np.ndarray]:
        """Return the mean squared error, each layer's input, and d(loss)/d(output)."""
        inputs, a = [], x
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            inputs.append(a)
            a = a @ w + b
            if i < len(self.weights) - 1:
                a = np.maximum(a, 0.0)
        err = a - y
        return float(np.mean(err * err)), inputs, 2.0 * err / err.size

    def backward_layer(self, i: int, inputs: list[np.ndarray], d_out: np.ndarray) -> np.ndarray:
        """Fill layer ``i``'s gradient bucket; return the gradient for layer ``i - 1``'s output."""
        np.matmul(inputs[i].T, d_out, out=self.grad_w[i])
        np.sum(d_out, axis=0, out=self.grad_b[i])
        if i == 0:
            return d_out
        # Through the ReLU that produced this layer's input.
        return (d_out @ self.weights[i].T) * (inputs[i] > 0.0)

    def step(self, lr: float) -> None:
        """Gradient descent on every bucket."""
        for p, g in zip(self.params, self.grads, strict=True):
            p -= lr * g


def make_data(cfg: Config, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The whole data set (every rank makes the same one): y = tanh(x A) B + noise."""
    rng = np.random.default_rng(1234)
    n = cfg.samples * world_size
    x = rng.normal(size=(n, cfg.features))
    a = rng.normal(size=(cfg.features, 16)) / np.sqrt(cfg.features)
    b = rng.normal(size=(16, cfg.outputs)) / 4.0
    return x, np.tanh(x @ a) @ b + 0.01 * rng.normal(size=(n, cfg.outputs))


def reference(cfg: Config, world_size: int) -> tuple[list[np.ndarray], list[float]]:
    """Full-batch training in one process on the whole data: what the ranks must reproduce."""
    x, y = make_data(cfg, world_size)
    model, losses = MLP(cfg), []
    for _ in range(cfg.steps):
        loss, inputs, d = model.forward(x, y)
        for i in reversed(range(len(model.params))):
            d = model.backward_layer(i, inputs, d)
        model.step(cfg.lr)
        losses.append(loss)
    return model.params, losses


async def train(
    cfg: Config, x: np.ndarray, y: np.ndarray, *, overlap: bool
) -> tuple[MLP, list[float], list[float]]:
    """Train on this rank's shard; return the model, the global losses and the step times."""
    model = MLP(cfg)
    for bucket in model.params:  # the same start everywhere, whatever each rank's seed did
        await aiodist.broadcast(bucket, src=0)
    avg = aiodist.ReduceOp.AVG
    losses, times = [], []
    for _ in range(cfg.steps):
        start = time.perf_counter()
        loss, inputs, d = model.forward(x, y)
        loss_buf = np.array([loss])
        works = [aiodist.all_reduce(loss_buf, op=avg)]
        for i in reversed(range(len(model.params))):
            d = await asyncio.to_thread(model.backward_layer, i, inputs, d)
            if overlap:  # this bucket travels while the earlier layers are computed
                works.append(aiodist.all_reduce(model.grads[i], op=avg))
        if not overlap:
            works += [aiodist.all_reduce(g, op=avg) for g in reversed(model.grads)]
        for work in works:
            await work
        model.step(cfg.lr)
        times.append(time.perf_counter() - start)
        losses.append(float(loss_buf[0]))
    return model, losses, times


def parse_args(argv: list[str]) -> tuple[Config, str | None]:
    """The configuration from the command line, and where rank 0 saves the weights."""
    defaults = Config()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name in ("features", "hidden", "outputs", "samples", "steps"):
        parser.add_argument(f"--{name}", type=int, default=getattr(defaults, name))
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--out", help="rank 0 saves the trained weights here (.npz)")
    args = parser.parse_args(argv)
    fields = ("features", "hidden", "outputs", "samples", "steps", "lr")
    return Config(**{f: getattr(args, f) for f in fields}), args.out


async def main() -> None:
    cfg, out = parse_args(sys.argv[1:])
    await aiodist.init_process_group()  # env://, as aiodist-run and torchrun set it up
    rank, size = aiodist.get_rank(), aiodist.get_world_size()
    x, y = make_data(cfg, size)
    shard = slice(rank * cfg.samples, (rank + 1) * cfg.samples)
    x, y = x[shard], y[shard]

    runs = {}
    for overlap in (True, False):
        runs[overlap] = await train(cfg, x, y, overlap=overlap)
    await aiodist.destroy_process_group()

    ref_params, ref_losses = reference(cfg, size)
    errors = []
    for model, losses, _ in runs.values():
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-9)
        for p, ref in zip(model.params, ref_params, strict=True):
            np.testing.assert_allclose(p, ref, rtol=1e-9, atol=1e-12)
            errors.append(float(np.max(np.abs(p - ref))))
    if out and rank == 0:
        np.savez(out, *runs[True][0].params)

    def ms_per_step(times: list[float]) -> float:
        return statistics.median(times[1:] or times) * 1000  # the first step warms up

    lines = []
    if rank == 0:
        losses = runs[True][1]
        lines += [f"step {s:3d}  loss {losses[s]:.6f}" for s in range(0, cfg.steps, 4)]
        lines.append(f"step {cfg.steps - 1:3d}  loss {losses[-1]:.6f}")
    buckets = ", ".join(f"{p.nbytes / 2**20:.2f}" for p in reversed(runs[True][0].params))
    lines.append(
        f"rank {rank}/{size}: buckets [{buckets}] MiB (last layer first); "
        f"{ms_per_step(runs[True][2]):.1f} ms/step with overlap, "
        f"{ms_per_step(runs[False][2]):.1f} ms/step without; both runs match the "
        f"single-process numpy weights (max error {max(errors):.1e})"
    )
    # One write: the ranks share the terminal.
    sys.stdout.write("".join(line + "\n" for line in lines))
    sys.stdout.flush()


if __name__ == "__main__":
    asyncio.run(main())
