"""The CUDA backend through the public API.

Three tiers: what holds everywhere (``import aiodist`` leaves cupy alone); what needs cupy
installed but no device (the table, routing, rejections of host arrays); and, marked
``gpu``, every collective on every data path against numpy, which skips without a device.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import aiodist

HAVE_CUPY = importlib.util.find_spec("cupy") is not None


def _device_reason() -> str | None:
    if not HAVE_CUPY:
        return "cupy is not installed (aiodist's cuda13 extra)"
    import cupy

    if not cupy.cuda.is_available():
        return "cupy found no CUDA device"
    return None


NO_DEVICE = _device_reason()
needs_cupy = pytest.mark.skipif(not HAVE_CUPY, reason="cupy is not installed")


def test_import_aiodist_leaves_cupy_alone() -> None:
    code = (
        "import sys, numpy, aiodist, aiodist.sync;"
        "from aiodist.backends import _cuda_path, _cuda_staged, _cuda_tables, _cuda_ipc;"
        "import aiodist.backends._progress;"
        "assert 'cupy' not in sys.modules, 'cupy was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- cupy installed, no device needed ---------------------------------------------------------
@needs_cupy
def test_table_has_every_operation_of_the_cpu_backend() -> None:
    from aiodist.backends import cpu, cuda

    assert set(cuda.BACKEND.ops) == set(cpu.BACKEND.ops)
    assert repr(cuda.BACKEND) == f"<Backend cuda device=cuda ops={len(cpu.BACKEND.ops)}>"
    # Barriers and object collectives run on the CPU.
    assert cuda.BACKEND.ops["barrier"] is cpu.BACKEND.ops["barrier"]
    assert cuda.BACKEND.ops["all_gather_object"] is cpu.BACKEND.ops["all_gather_object"]


@needs_cupy
async def test_cuda_group_runs_host_side_operations_and_rejects_host_arrays() -> None:
    from aiodist.backends import cuda

    async def fn(rank: int, n: int) -> list[Any]:
        pg = aiodist.group.current_world().default_group
        await aiodist.barrier()
        objects: list[Any] = [None] * n
        await aiodist.all_gather_object(objects, {"rank": rank})
        with pytest.raises(
            aiodist.DistUsageError,
            match=r"all_reduce: tensor \(ndarray\) lives in host memory, but the CUDA backend "
            r"takes CUDA arrays; a group made with backend=None or 'cpu:gloo,cuda:nccl' sends",
        ):
            aiodist.all_reduce(np.ones(3, np.float32))
        # The rejection leaves the group usable.
        await aiodist.barrier()
        assert cuda.data_path(pg) is None and cuda.group_state(pg) is None
        return objects

    results = await aiodist.testing.run_world(fn, 2, backend="cuda")
    assert results == [[{"rank": 0}, {"rank": 1}]] * 2


@needs_cupy
async def test_mixed_backend_routes_host_arrays_to_the_cpu() -> None:
    async def fn(rank: int, n: int) -> list[float]:
        x = np.full(4, rank + 1.0)
        await aiodist.all_reduce(x)
        return x.tolist()

    results = await aiodist.testing.run_world(fn, 2, backend="cpu:gloo,cuda:nccl")
    assert results == [[3.0] * 4] * 2


# -- on a GPU -----------------------------------------------------------------------------------
def _reference_inputs(rank: int, count: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng(rank)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(0, 20, count).astype(dtype)
    return rng.normal(size=count).astype(dtype)


async def _every_collective(rank: int, n: int) -> str:
    """Every collective on cupy arrays, against numpy; returns the group's path."""
    import cupy

    from aiodist.backends import cuda

    count = 4099
    dtype = "float32"
    inputs = [_reference_inputs(r, count, dtype) for r in range(n)]
    x = cupy.asarray(inputs[rank])
    work = aiodist.all_reduce(x)
    work.wait_stream()  # the current stream waits for it, before or after it is issued
    await work
    np.testing.assert_allclose(cupy.asnumpy(x), sum(inputs), rtol=1e-4)
    for op in (aiodist.ReduceOp.MAX, aiodist.ReduceOp.AVG):
        y = cupy.asarray(inputs[rank])
        await aiodist.all_reduce(y, op=op)
        ref = np.maximum.reduce(inputs) if op is aiodist.ReduceOp.MAX else sum(inputs) / n
        np.testing.assert_allclose(cupy.asnumpy(y), ref, rtol=1e-4)
    ints = cupy.arange(10, dtype=cupy.int16) + rank  # not an NCCL type: staged on nccl
    await aiodist.all_reduce(ints, op=aiodist.ReduceOp.BXOR)
    expected = np.arange(10, dtype=np.int16)
    for r in range(1, n):
        expected ^= np.arange(10, dtype=np.int16) + r
    np.testing.assert_array_equal(cupy.asnumpy(ints), expected)
    root = n - 1
    z = cupy.asarray(inputs[rank])
    await aiodist.reduce(z, dst=root)
    np.testing.assert_allclose(
        cupy.asnumpy(z), sum(inputs) if rank == root else inputs[rank], rtol=1e-4
    )
    b = cupy.asarray(inputs[rank])
    await aiodist.broadcast(b, src=root)
    np.testing.assert_array_equal(cupy.asnumpy(b), inputs[root])
    outs = [cupy.zeros(count, dtype) for _ in range(n)]
    await aiodist.all_gather(outs, cupy.asarray(inputs[rank]))
    for r in range(n):
        np.testing.assert_array_equal(cupy.asnumpy(outs[r]), inputs[r])
    big = cupy.zeros(n * count, dtype)
    await aiodist.all_gather_into_tensor(big, cupy.asarray(inputs[rank]))
    np.testing.assert_array_equal(cupy.asnumpy(big), np.concatenate(inputs))
    rs = cupy.zeros(count, dtype)
    await aiodist.reduce_scatter(rs, [cupy.asarray(inputs[rank]) * (j + 1) for j in range(n)])
    np.testing.assert_allclose(cupy.asnumpy(rs), sum(inputs) * (rank + 1), rtol=1e-4)
    g = [cupy.zeros(count, dtype) for _ in range(n)] if rank == root else None
    await aiodist.gather(cupy.asarray(inputs[rank]), g, dst=root)
    if g is not None:
        for r in range(n):
            np.testing.assert_array_equal(cupy.asnumpy(g[r]), inputs[r])
    s = cupy.zeros(count, dtype)
    pieces = [cupy.full(count, r, dtype) for r in range(n)] if rank == root else None
    await aiodist.scatter(s, pieces, src=root)
    np.testing.assert_array_equal(cupy.asnumpy(s), np.full(count, rank, dtype))
    a2a_out = [cupy.zeros(3, cupy.int64) for _ in range(n)]
    await aiodist.all_to_all(a2a_out, [cupy.full(3, rank * 10 + j, cupy.int64) for j in range(n)])
    for j in range(n):
        np.testing.assert_array_equal(cupy.asnumpy(a2a_out[j]), np.full(3, j * 10 + rank))
    if n > 1:
        peer = (rank + 1) % n
        sent = cupy.full(7, rank, cupy.float64)
        got = cupy.zeros(7, cupy.float64)
        recv = aiodist.irecv(got, src=(rank - 1) % n)
        await aiodist.isend(sent, dst=peer)
        await recv
        np.testing.assert_array_equal(cupy.asnumpy(got), np.full(7, (rank - 1) % n))
    state = cuda.group_state(aiodist.group.current_world().default_group)
    assert state is not None and f"path={state.path}" in repr(state)
    return str(state.path)


@pytest.mark.parametrize(
    ("path", "size"),
    [("staged", 1), ("staged", 2), ("staged", 3), ("ipc", 2), ("ipc", 4), ("nccl", 1)],
)
@pytest.mark.gpu
@pytest.mark.skipif(NO_DEVICE is not None, reason=NO_DEVICE or "")
async def test_every_collective_on_one_gpu(
    path: str, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIODIST_CUDA_PATH", path)
    paths = await aiodist.testing.run_world(_every_collective, size, backend="cuda", timeout=120)
    assert paths == [path] * size


@pytest.mark.gpu
@pytest.mark.skipif(NO_DEVICE is not None, reason=NO_DEVICE or "")
async def test_bad_device_input_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import cupy

    async def fn(rank: int, n: int) -> None:
        with pytest.raises(aiodist.DistUsageError, match="tensor is not C-contiguous"):
            aiodist.all_reduce(cupy.zeros((4, 4), cupy.float32)[:, 1])
        with pytest.raises(aiodist.DistUsageError, match="live on different devices"):
            aiodist.all_gather([np.zeros(2)] * n, cupy.zeros(2))
        x = cupy.ones(5, cupy.float32)
        await aiodist.all_reduce(x)
        np.testing.assert_array_equal(cupy.asnumpy(x), np.full(5, n, np.float32))

    monkeypatch.setenv("AIODIST_CUDA_PATH", "staged")
    await aiodist.testing.run_world(fn, 2, backend="cpu:gloo,cuda:nccl")
