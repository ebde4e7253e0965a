"""examples/torch_interop.py and examples/async_mlp.py run under the launcher on small sizes;
their results are checked against numpy computed here."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.multiprocess

EXAMPLES = Path(__file__).parent.parent / "examples"


def launch(nproc: int, script: str, *args: str) -> dict[int, list[str]]:
    """Run ``script`` under aiodist-run; return each rank's output lines."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, "-m", "aiodist.run", "--standalone", f"--nproc-per-node={nproc}",
         str(EXAMPLES / script), *args],
        capture_output=True, text=True, timeout=120, check=False, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines: dict[int, list[str]] = {}
    for m in re.finditer(r"^\[rank(\d+)\]: (.*)$", proc.stdout, re.M):
        lines.setdefault(int(m[1]), []).append(m[2])
    return lines


# -- torch_interop.py ---------------------------------------------------------------------------
@pytest.mark.torch
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_torch_and_aiodist_workers_share_an_aiodist_store() -> None:
    lines = launch(4, "torch_interop.py")
    results = {}
    for rank, out in lines.items():
        found = [json.loads(line[len("RESULT ") :]) for line in out if line.startswith("RESULT ")]
        assert len(found) == 1, out
        results[rank] = found[0]
    assert sorted(results) == [0, 1, 2, 3]
    base = np.arange(8, dtype=np.float32)
    torch_sum = base * 1 + base * 2  # ranks 0 and 1, reduced by gloo
    aiodist_sum = base * 3 + base * 4  # ranks 2 and 3, reduced by aiodist on torch tensors
    worlds = {"torch": (torch_sum, aiodist_sum), "aiodist": (aiodist_sum, torch_sum)}
    for rank, r in results.items():
        assert r["rank"] == rank and r["world"] == ("torch" if rank < 2 else "aiodist")
        own, other = worlds[r["world"]]
        np.testing.assert_array_equal(np.array(r["own"], np.float32), own)
        np.testing.assert_array_equal(np.array(r["other"], np.float32), other)


# -- async_mlp.py -------------------------------------------------------------------------------
def _mlp_reference(
    features: int, hidden: int, outputs: int, samples: int, steps: int, lr: float, ranks: int
) -> tuple[list[np.ndarray], float]:
    """Full-batch gradient descent on the example's data, written out with plain numpy."""
    rng = np.random.default_rng(1234)
    n = samples * ranks
    x = rng.normal(size=(n, features))
    a = rng.normal(size=(features, 16)) / np.sqrt(features)
    b = rng.normal(size=(16, outputs)) / 4.0
    y = np.tanh(x @ a) @ b + 0.01 * rng.normal(size=(n, outputs))
    init = np.random.default_rng(0)
    sizes = [features, hidden, hidden, outputs]
    ws = [init.normal(scale=np.sqrt(2.0 / i), size=(i, o)) for i, o in itertools.pairwise(sizes)]
    bs = [np.zeros(o) for o in sizes[1:]]
    loss = 0.0
    for _ in range(steps):
        z1 = x @ ws[0] + bs[0]
        h1 = np.maximum(z1, 0)
        z2 = h1 @ ws[1] + bs[1]
        h2 = np.maximum(z2, 0)
        err = h2 @ ws[2] + bs[2] - y
        loss = float(np.mean(err**2))
        d3 = 2 * err / err.size
        d2 = (d3 @ ws[2].T) * (z2 > 0)
        d1 = (d2 @ ws[1].T) * (z1 > 0)
        grads = [(x.T @ d1, d1.sum(0)), (h1.T @ d2, d2.sum(0)), (h2.T @ d3, d3.sum(0))]
        for i, (gw, gb) in enumerate(grads):
            ws[i] -= lr * gw
            bs[i] -= lr * gb
    return [np.concatenate([w.ravel(), b]) for w, b in zip(ws, bs, strict=True)], loss


def test_async_mlp_matches_single_process_numpy(tmp_path: Path) -> None:
    sizes = {"features": 6, "hidden": 24, "outputs": 3, "samples": 20, "steps": 7}
    args = [f"--{k}={v}" for k, v in sizes.items()]
    out = tmp_path / "weights.npz"
    lines = launch(3, "async_mlp.py", *args, "--lr=0.05", f"--out={out}")
    expected, final_loss = _mlp_reference(**sizes, lr=0.05, ranks=3)

    saved = np.load(out)
    assert len(saved.files) == 3
    for i, ref in enumerate(expected):
        np.testing.assert_allclose(saved[f"arr_{i}"], ref, rtol=1e-9, atol=1e-12)
    printed = [m for line in lines[0] if (m := re.fullmatch(r"step\s+6\s+loss (\S+)", line))]
    assert len(printed) == 1
    assert float(printed[0][1]) == pytest.approx(final_loss, rel=1e-5)
    for rank in range(3):
        summary = lines[rank][-1]
        assert summary.startswith(f"rank {rank}/3: buckets [")
        assert "both runs match the single-process numpy weights" in summary


# -- elastic_sgd.py -----------------------------------------------------------------------------
@pytest.mark.parametrize(("kill_rank", "shm"), [(2, "1"), (0, "0")])  # rank 0 too, over TCP
def test_elastic_sgd_survives_a_killed_worker_and_takes_its_replacement_back(
    kill_rank: int, shm: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env["AIODIST_SHM"] = shm
    proc = subprocess.run(
        [sys.executable, "-m", "aiodist.run", "--standalone", "--nproc-per-node=4",
         "--restart-policy=failed", "--max-restarts=1", str(EXAMPLES / "elastic_sgd.py"),
         f"--kill-rank={kill_rank}", "--kill-step=10", "--wait-for-replacements"],
        capture_output=True, text=True, timeout=120, check=False, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    out = proc.stdout
    survivors = [r for r in range(4) if r != kill_rank]
    # (Each line carries the rank its worker has when it prints it: the launcher follows.)
    for new_rank, rank in enumerate(survivors):
        assert re.search(
            rf"^\[rank{new_rank}\]: worker {rank}: step 10 failed \(DistNetworkError\); ranks "
            rf"\[{kill_rank}\] lost; now rank {new_rank} of 3 after [\d.]+ ms$",
            out,
            re.M,
        ), out
        assert (
            f"[rank{new_rank}]: worker {rank}: done as rank {new_rank}; weights match the "
            "reference: True" in out
        ), out
    admitted = re.search(
        rf"^\[rank3\]: replacement of worker {kill_rank}: admitted as rank 3 of 4 at "
        r"step (\d+), ",
        out,
        re.M,
    )
    assert admitted and admitted[1] == "15", out  # the first admission point after the loss
    assert (
        f"[rank3]: replacement of worker {kill_rank}: done as rank 3; weights match the "
        "reference: True" in out
    )
    # A line a step from the rank 0 of the moment: the recovery reads from the output.
    steps = re.findall(
        r"^\[rank0\]: worker \d: step (\d+) of 60 by (\d) ranks: loss [\d.]+$", out, re.M
    )
    assert [int(s) for s, _ in steps] == list(range(1, 61)), out
    assert [int(n) for _, n in steps] == [4] * 10 + [3] * 5 + [4] * 45, out
