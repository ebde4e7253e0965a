"""ReduceOp, the reduction kernels and array intake, against numpy references."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from aiodist._arrays._intake import SUPPORTED_DTYPES, as_array, byte_view, check_dtype
from aiodist._arrays._reduce import ReduceOp, check_reduce_op, finish_into, reduce_into
from aiodist.errors import DistUsageError

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes")

DTYPES = [*sorted(d.name for d in SUPPORTED_DTYPES), "bfloat16"]


def _dtype(name: str) -> np.dtype[Any]:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _kind(dt: np.dtype[Any]) -> str:
    return "f" if dt.name == "bfloat16" else dt.kind


def _allowed(op: ReduceOp, dt: np.dtype[Any]) -> bool:
    kind = _kind(dt)
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        return kind in "biu"
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        return kind != "c"
    if op is ReduceOp.AVG:
        return kind != "b"
    return True


def _sample(dt: np.dtype[Any], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    kind = _kind(dt)
    if kind == "b":
        return rng.integers(0, 2, 16).astype(dt)
    if kind in "iu":
        return rng.integers(0 if kind == "u" else -50, 50, 16).astype(dt)
    if kind == "c":
        return (rng.integers(-8, 8, 16) + 1j * rng.integers(-8, 8, 16)).astype(dt)
    return rng.integers(-8, 8, 16).astype(dt)


def test_reduce_op_values_match_torch() -> None:
    assert [(m.name, int(m)) for m in ReduceOp] == [
        ("SUM", 0),
        ("AVG", 1),
        ("PRODUCT", 2),
        ("MIN", 3),
        ("MAX", 4),
        ("BAND", 5),
        ("BOR", 6),
        ("BXOR", 7),
        ("PREMUL_SUM", 8),
    ]
    assert repr(ReduceOp.SUM) == "ReduceOp.SUM"


# PREMUL_SUM is used with its factor (make_premul_sum); tested with the collectives.
PLAIN_OPS = [op for op in ReduceOp if op is not ReduceOp.PREMUL_SUM]


@pytest.mark.parametrize("op", PLAIN_OPS)
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_reduce_into_every_dtype_and_op(op: ReduceOp, dtype_name: str) -> None:
    dt = _dtype(dtype_name)
    if not _allowed(op, dt):
        with pytest.raises(
            DistUsageError, match=rf"^ReduceOp\.{op.name} is not supported for dtype {dt}$"
        ):
            check_reduce_op(op, dt)
        return
    assert check_reduce_op(int(op), dt) is op
    a, b, c = _sample(dt, 1), _sample(dt, 2), _sample(dt, 3)
    ref_ufunc = {
        ReduceOp.SUM: np.add,
        ReduceOp.AVG: np.add,
        ReduceOp.PRODUCT: np.multiply,
        ReduceOp.MIN: np.minimum,
        ReduceOp.MAX: np.maximum,
        ReduceOp.BAND: np.bitwise_and,
        ReduceOp.BOR: np.bitwise_or,
        ReduceOp.BXOR: np.bitwise_xor,
    }[op]
    expected = ref_ufunc(ref_ufunc(a, b), c)
    if op is ReduceOp.AVG:
        expected = expected // 3 if _kind(dt) in "iu" else expected / dt.type(3)
    expected = expected.astype(dt)
    dst = a.copy()
    reduce_into(op, dst, b)
    reduce_into(op, dst, c)
    finish_into(op, dst, 3)
    assert dst.dtype == dt
    np.testing.assert_array_equal(dst.astype(np.complex128), expected.astype(np.complex128))
    # The sources are untouched.
    np.testing.assert_array_equal(b, _sample(dt, 2))


def test_avg_on_integers_is_floor_division() -> None:
    dst = np.array([-7, 7, 5], dtype=np.int32)
    finish_into(ReduceOp.AVG, dst, 2)
    assert dst.tolist() == [-4, 3, 2]
    small = np.array([100, 255], dtype=np.uint8)
    finish_into(ReduceOp.AVG, small, 300)
    assert small.tolist() == [0, 0]


def test_finish_into_leaves_other_ops_alone() -> None:
    dst = np.array([4.0, 6.0])
    finish_into(ReduceOp.SUM, dst, 2)
    assert dst.tolist() == [4.0, 6.0]


def test_min_max_propagate_nan() -> None:
    dst = np.array([1.0, np.nan])
    reduce_into(ReduceOp.MIN, dst, np.array([np.nan, 0.0]))
    assert np.isnan(dst).all()


@pytest.mark.parametrize("bad", ["SUM", 9, -1, 1.0, True, None])
def test_check_reduce_op_rejects_non_ops(bad: object) -> None:
    with pytest.raises(DistUsageError, match=r"^op must be an aiodist.ReduceOp, got "):
        check_reduce_op(bad, np.dtype(np.float32))


def test_check_reduce_op_rejects_non_numeric_dtype() -> None:
    with pytest.raises(DistUsageError, match=r"^cannot reduce arrays of dtype <U3$"):
        check_reduce_op(ReduceOp.SUM, np.dtype("<U3"))


def test_as_array_numpy_is_identity() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert as_array(a, writable=True, name="tensor") is a


def test_as_array_noncontiguous_input_is_copied() -> None:
    a = np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2]
    got = as_array(a, writable=False, name="tensor")
    assert got.flags.c_contiguous
    np.testing.assert_array_equal(got, a)


def test_as_array_noncontiguous_output_is_refused() -> None:
    a = np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2]
    with pytest.raises(
        DistUsageError,
        match=r"^output_tensor_list\[1\] is not C-contiguous, but the collective writes its result",
    ):
        as_array(a, writable=True, name="output_tensor_list[1]")


def test_as_array_readonly_output_is_refused() -> None:
    a = np.zeros(3)
    a.flags.writeable = False
    assert as_array(a, writable=False, name="tensor") is a
    with pytest.raises(
        DistUsageError, match=r"^tensor is read-only, but the collective writes its result into it$"
    ):
        as_array(a, writable=True, name="tensor")


def test_as_array_rejects_other_objects() -> None:
    with pytest.raises(
        DistUsageError,
        match=r"^tensor must be a numpy array or a CPU tensor supporting DLPack, got list$",
    ):
        as_array([1, 2], writable=False, name="tensor")


@pytest.mark.parametrize("dtype", ["<U2", "O", "M8[s]", [("a", "<i4")]])
def test_as_array_rejects_unsupported_dtypes(dtype: Any) -> None:
    a = np.zeros(2, dtype=dtype)
    with pytest.raises(DistUsageError, match=r"^tensor has unsupported dtype "):
        as_array(a, writable=False, name="tensor")


def test_as_array_rejects_swapped_byte_order() -> None:
    a = np.zeros(2, dtype=">f4")
    with pytest.raises(
        DistUsageError,
        match=r"^tensor has dtype >f4 in non-native byte order; convert it with "
        r"\.astype\('float32'\) first$",
    ):
        as_array(a, writable=False, name="tensor")


def test_bfloat16_is_supported() -> None:
    check_dtype(np.dtype(ml_dtypes.bfloat16), "tensor")
    a = np.ones(3, dtype=ml_dtypes.bfloat16)
    assert as_array(a, writable=True, name="tensor") is a
    assert byte_view(a).nbytes == 6


class _FakeDevice:
    """A DLPack producer living on a GPU: __dlpack__ must never be called."""

    def __init__(self, device_type: int) -> None:
        self.device_type = device_type

    def __dlpack_device__(self) -> tuple[int, int]:
        return (self.device_type, 1)

    def __dlpack__(self, **kwargs: Any) -> object:
        raise AssertionError("a GPU array must not be exported")


def test_dlpack_on_cuda_is_refused() -> None:
    with pytest.raises(
        DistUsageError,
        match=r"^tensor \(_FakeDevice\) lives on GPU device 1 \(DLPack device type 2\); "
        r"the CPU backend takes host memory only: copy it to the CPU first, or use the CUDA "
        r"backend \(backend='cuda'; install aiodist's cuda13 \(or cuda12\) extra: "
        r"pip install -e '/path/to/aiodist\[cuda13\]'\)$",
    ):
        as_array(_FakeDevice(2), writable=True, name="tensor")


def test_dlpack_on_unknown_device_is_refused() -> None:
    with pytest.raises(
        DistUsageError,
        match=r"^tensor \(_FakeDevice\) lives on DLPack device type 9, which is not host memory$",
    ):
        as_array(_FakeDevice(9), writable=True, name="tensor")


@pytest.mark.parametrize("shape", [(), (0,), (0, 3), (5,), (2, 3, 4)])
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_byte_view_is_zero_copy(shape: tuple[int, ...], dtype_name: str) -> None:
    dt = _dtype(dtype_name)
    a = np.zeros(shape, dtype=dt)
    view = byte_view(a)
    assert view.format == "B"
    assert view.ndim == 1
    assert view.nbytes == a.nbytes
    if a.size:
        view[-1] = 1
        assert a.reshape(-1).view(np.uint8)[-1] == 1


def test_byte_view_of_readonly_array_is_readonly() -> None:
    a = np.zeros(4)
    a.flags.writeable = False
    assert byte_view(a).readonly


@pytest.mark.torch
class TestTorchTensors:
    """torch CPU tensors come in zero-copy through DLPack, without aiodist importing torch."""

    @pytest.fixture(autouse=True)
    def _torch(self) -> None:
        pytest.importorskip("torch", reason="needs torch")

    def test_cpu_tensor_shares_memory(self) -> None:
        import torch

        t = torch.arange(6, dtype=torch.float32)
        a = as_array(t, writable=True, name="tensor")
        a += 1
        assert t.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]

    @pytest.mark.parametrize(
        "dtype_name", ["bool", "int8", "uint8", "int64", "float16", "float64", "complex64"]
    )
    def test_dtypes(self, dtype_name: str) -> None:
        import torch

        t = torch.zeros(3, dtype=getattr(torch, dtype_name))
        assert as_array(t, writable=True, name="tensor").dtype == np.dtype(dtype_name)

    def test_noncontiguous_output_is_refused(self) -> None:
        import torch

        t = torch.zeros(4, 4)[:, 1]
        with pytest.raises(DistUsageError, match=r"^tensor is not C-contiguous"):
            as_array(t, writable=True, name="tensor")

    def test_tensor_requiring_grad_is_refused(self) -> None:
        import torch

        t = torch.zeros(2, requires_grad=True)
        with pytest.raises(
            DistUsageError,
            match=r"^tensor \(Tensor\) cannot be viewed as a numpy array through DLPack: ",
        ):
            as_array(t, writable=False, name="tensor")
