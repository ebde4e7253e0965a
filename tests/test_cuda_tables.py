"""The CUDA backend's dtype/op tables, device reduction and path choice, on the CPU."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from collective_helpers import numpy_reduce

import aiodist
from aiodist._arrays._reduce import ReduceOp, check_reduce_op
from aiodist.backends._cuda_path import (
    PATH_ENV,
    RankInfo,
    agree_ipc,
    agree_path,
    choose_path,
    forced_path,
    shared_gpu_ok,
)
from aiodist.backends._cuda_tables import (
    NcclCall,
    bfloat16_round,
    bfloat16_widen,
    nccl_plan,
    reduce_many,
    wire_dtype,
)
from aiodist.errors import DistUsageError

BF16 = np.dtype(ml_dtypes.bfloat16)
ALL_DTYPES = [
    np.dtype(t)
    for t in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
] + [BF16]
OPS = [op for op in ReduceOp if op is not ReduceOp.PREMUL_SUM]


def valid(dtype: np.dtype[Any], op: ReduceOp) -> bool:
    try:
        check_reduce_op(op, dtype)
    except DistUsageError:
        return False
    return True


# -- NCCL mapping --------------------------------------------------------------------------
def test_nccl_plan_native_types() -> None:
    assert nccl_plan(np.dtype("float32"), ReduceOp.SUM) == NcclCall(7, 0)
    assert nccl_plan(np.dtype("float16"), ReduceOp.AVG) == NcclCall(6, 4)
    assert nccl_plan(BF16, ReduceOp.MAX) == NcclCall(9, 2)
    assert nccl_plan(np.dtype("int64"), ReduceOp.MIN) == NcclCall(4, 3)
    assert nccl_plan(np.dtype("uint8"), ReduceOp.PRODUCT) == NcclCall(1, 1)
    assert nccl_plan(np.dtype("float64"), ReduceOp.PREMUL_SUM) == NcclCall(8, 0)


def test_nccl_plan_translations_and_refusals() -> None:
    boolean = np.dtype(bool)
    assert nccl_plan(boolean, ReduceOp.SUM) == NcclCall(1, 2)  # or: uint8 MAX
    assert nccl_plan(boolean, ReduceOp.BAND) == NcclCall(1, 3)  # and: uint8 MIN
    assert nccl_plan(boolean, ReduceOp.BXOR) == "NCCL has no ReduceOp.BXOR for bool"
    assert nccl_plan(np.dtype("complex64"), ReduceOp.SUM) == NcclCall(7, 0, 2)
    assert nccl_plan(np.dtype("complex128"), ReduceOp.AVG) == NcclCall(8, 4, 2)
    assert nccl_plan(np.dtype("complex64"), ReduceOp.PRODUCT) == (
        "NCCL has no ReduceOp.PRODUCT for complex numbers"
    )
    assert nccl_plan(np.dtype("int16"), ReduceOp.SUM) == "NCCL has no datatype for int16"
    assert nccl_plan(np.dtype("int32"), ReduceOp.BXOR) == "NCCL has no ReduceOp.BXOR"
    assert "floors the mean" in str(nccl_plan(np.dtype("int32"), ReduceOp.AVG))


def test_every_valid_pair_has_an_answer() -> None:
    # Each (dtype, op) the CPU backend accepts is either an NCCL call or a reason (staged).
    for dtype, op in itertools.product(ALL_DTYPES, OPS):
        if valid(dtype, op):
            answer = nccl_plan(dtype, op)
            assert isinstance(answer, NcclCall | str), (dtype, op)
    assert wire_dtype(BF16) == np.dtype(np.uint16)
    assert wire_dtype(np.dtype("float32")) == np.dtype("float32")


# -- the device reduction, run with numpy ----------------------------------------------------
def contributions(dtype: np.dtype[Any], n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        if dtype.kind == "b":
            a = rng.integers(0, 2, size).astype(bool)
        elif dtype.kind in "iu":
            a = rng.integers(1, 5, size).astype(dtype)
        elif dtype.kind == "c":
            a = (rng.normal(size=size) + 1j * rng.normal(size=size)).astype(dtype)
        else:
            a = rng.normal(size=size).astype(np.float32).astype(dtype)
        out.append(a)
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_reduce_many_matches_the_cpu_kernels(n: int) -> None:
    for dtype, op in itertools.product(ALL_DTYPES, OPS):
        if not valid(dtype, op):
            continue
        arrays = contributions(dtype, n, 37, seed=n)
        expected = numpy_reduce(op, arrays)
        raw = [a.view(np.uint8).copy() for a in arrays]
        out = np.empty_like(raw[0])
        reduce_many(np, op, dtype, out, raw)
        got = out.view(dtype)
        if dtype == BF16:
            # float32 accumulation rounded once vs. rounding after every step.
            np.testing.assert_allclose(
                got.astype(np.float32), expected.astype(np.float32), rtol=2e-2, atol=2e-2
            )
        elif dtype.kind in "fc":
            np.testing.assert_allclose(got, expected, rtol=2e-3 if dtype.itemsize <= 2 else 1e-6)
        else:
            np.testing.assert_array_equal(got, expected, err_msg=f"{dtype} {op!r}")
        # In place into the first contribution, as the staged path does.
        reduce_many(np, op, dtype, raw[0], raw)
        np.testing.assert_array_equal(raw[0], out)


def test_reduce_many_premul_and_integer_avg() -> None:
    arrays = [np.arange(6, dtype=np.float64) + r for r in range(3)]
    out = np.empty(48, np.uint8)
    reduce_many(
        np,
        ReduceOp.PREMUL_SUM,
        np.dtype(np.float64),
        out,
        [a.view(np.uint8) for a in arrays],
        factor=0.5,
    )
    np.testing.assert_allclose(out.view(np.float64), 0.5 * sum(arrays))
    ints = [np.array([-7, 7, 1], np.int32), np.array([0, 0, 0], np.int32)]
    got = np.empty(12, np.uint8)
    reduce_many(np, ReduceOp.AVG, np.dtype(np.int32), got, [a.view(np.uint8) for a in ints])
    np.testing.assert_array_equal(got.view(np.int32), [-4, 3, 0])  # floor, as numpy's //


def test_bfloat16_round_trip_and_rounding_match_ml_dtypes() -> None:
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [
            rng.normal(scale=1e3, size=20000).astype(np.float32),
            rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32),
            np.array(
                [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 3.4e38, -3.4e38, 1e-45, 1.00390625],
                np.float32,
            ),
        ]
    )
    # Exact ties (halfway between two bfloat16 values) round to even.
    ties = (np.arange(0, 4096, dtype=np.uint32) << 16 | 0x8000).view(np.float32)
    values = np.concatenate([values, ties])
    out = np.empty(values.size, np.uint16)
    bfloat16_round(np, values, out)
    with np.errstate(invalid="ignore"):  # ml_dtypes warns on casting NaN
        expected = values.astype(BF16)
    finite = ~np.isnan(values)
    np.testing.assert_array_equal(out[finite], expected.view(np.uint16)[finite])
    assert np.isnan(out[~finite].view(BF16).astype(np.float32)).all()
    widened = bfloat16_widen(np, expected.view(np.uint16))
    np.testing.assert_array_equal(widened[finite], expected.astype(np.float32)[finite])


# -- path choice -----------------------------------------------------------------------------
def info(
    host: str = "h", gpu: str = "0000:01:00.0", nccl: int | None = 22809, **kw: Any
) -> RankInfo:
    return RankInfo(host=host, gpu=gpu, nccl=nccl, **kw)


def test_choose_path_ladder() -> None:
    gpus = [f"0000:0{i}:00.0" for i in range(4)]
    assert choose_path([info(gpu=g) for g in gpus]) == "nccl"
    assert choose_path([info(host=f"h{i}", gpu="0000:01:00.0") for i in range(2)]) == "nccl"
    # Several ranks on one GPU: NCCL refuses, IPC serves one host.
    assert choose_path([info(), info()]) == "ipc"
    assert choose_path([info(shared_gpu_ok=True), info(shared_gpu_ok=True)]) == "nccl"
    assert choose_path([info(gpu=gpus[0], nccl=None), info(gpu=gpus[1])]) == "ipc"
    # Across hosts without NCCL only staging works.
    assert choose_path([info(host="a", nccl=None), info(host="b")]) == "staged"
    assert choose_path([info(host="a"), info(host="b"), info(host="a")]) == "staged"
    assert choose_path([info()]) == "nccl"


def test_choose_path_forced() -> None:
    assert choose_path([info(forced="staged"), info(gpu="x")]) == "staged"
    assert choose_path([info(forced="ipc"), info(gpu="x", forced="ipc")]) == "ipc"
    with pytest.raises(
        DistUsageError, match=r"AIODIST_CUDA_PATH differs between ranks: \{0: 'ipc', 1: 'staged'\}"
    ):
        choose_path([info(forced="ipc"), info(forced="staged")])
    with pytest.raises(
        DistUsageError,
        match=r"AIODIST_CUDA_PATH=nccl cannot work here: ranks 0 and 1 share GPU 0000:01:00.0",
    ):
        choose_path([info(forced="nccl"), info()])
    with pytest.raises(DistUsageError, match=r"NCCL did not load on ranks \[1\]"):
        choose_path([info(forced="nccl"), info(gpu="x", nccl=None)])
    with pytest.raises(DistUsageError, match="ipc cannot work here: the ranks run on 2 hosts"):
        choose_path([info(host="a", forced="ipc"), info(host="b")])


def test_forced_path_and_shared_gpu_env() -> None:
    assert forced_path({}) is None
    assert forced_path({PATH_ENV: " IPC "}) == "ipc"
    with pytest.raises(DistUsageError, match="AIODIST_CUDA_PATH='tcp' is not a data path"):
        forced_path({PATH_ENV: "tcp"})
    assert shared_gpu_ok(23004, {"NCCL_MULTI_RANK_GPU_ENABLE": "1"})
    assert not shared_gpu_ok(22809, {"NCCL_MULTI_RANK_GPU_ENABLE": "1"})
    assert not shared_gpu_ok(23004, {})
    assert not shared_gpu_ok(None, {"NCCL_MULTI_RANK_GPU_ENABLE": "1"})
    record = info(forced="ipc", shared_gpu_ok=True)
    assert RankInfo.from_json(record.to_json()) == record
    with pytest.raises(aiodist.DistBackendError, match="unreadable CUDA record"):
        RankInfo.from_json(b"{}")


async def test_agreement_through_the_store() -> None:
    store = aiodist.HashStore()
    records = [info(), info(), info(host="elsewhere")]
    results = await asyncio.gather(
        *(agree_path(store, "cuda/0", r, 3, records[r], timeout=5) for r in range(3))
    )
    assert [path for path, _ in results] == ["staged"] * 3
    assert all(infos == records for _, infos in results)
    # A forced path that cannot work: every rank raises the same error.
    bad = [info(forced="nccl"), info()]
    outcomes = await asyncio.gather(
        *(agree_path(store, "cuda/1", r, 2, bad[r], timeout=5) for r in range(2)),
        return_exceptions=True,
    )
    assert all(isinstance(e, DistUsageError) for e in outcomes)
    assert len({str(e) for e in outcomes}) == 1
    assert "share GPU" in str(outcomes[0])
    # The IPC probe: one rank's failure reaches all.
    problems = await asyncio.gather(
        agree_ipc(store, "cuda/2", 0, 2, None, timeout=5),
        agree_ipc(store, "cuda/2", 1, 2, "cudaIpcOpenMemHandle: invalid handle", timeout=5),
    )
    assert problems == ["rank 1: cudaIpcOpenMemHandle: invalid handle"] * 2
    assert await agree_ipc(store, "cuda/3", 0, 1, None, timeout=5) is None


async def test_agreement_times_out_naming_the_key() -> None:
    store = aiodist.HashStore()
    with pytest.raises(aiodist.DistTimeoutError, match="cuda/0/info/1"):
        await agree_path(store, "cuda/0", 0, 2, info(), timeout=0.1)


def test_an_unknown_forced_path_is_named() -> None:
    with pytest.raises(DistUsageError, match="AIODIST_CUDA_PATH='tcp' is not a data path"):
        choose_path([info(forced="tcp"), info()])
