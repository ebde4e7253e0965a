"""What the CUDA backend can do with each dtype and reduction, and the device reduction.

Pure Python and numpy: no cupy import, so the CPU test suite checks every entry.

* :func:`nccl_plan` maps a (dtype, :class:`~aiodist.ReduceOp`) pair to NCCL's datatype and
  reduction codes (the values of ``ncclDataType_t``/``ncclRedOp_t`` in ``nccl.h``, stable
  across NCCL releases), or says why NCCL cannot take it. NCCL has no int16/uint16, bool,
  complex types nor bitwise reductions: bool reduces as uint8 with MAX (or) and MIN (and),
  complex SUM and AVG as float pairs; the rest runs on the staged path.
* :func:`reduce_many` combines the contributions of every rank on the device, in rank
  order, with the ufuncs of the array module it is given (``cupy`` on a GPU, ``numpy``
  here), so one implementation serves both and is tested on the CPU. bfloat16 travels as
  its uint16 bit pattern (cupy has no bfloat16 arithmetic): the contributions are widened to
  float32, reduced there, and rounded once to the nearest even bfloat16 (NaN stays NaN).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._arrays._reduce import ReduceOp

__all__ = [
    "NCCL_DTYPES",
    "NCCL_OPS",
    "NcclCall",
    "bfloat16_round",
    "bfloat16_widen",
    "is_bfloat16",
    "nccl_plan",
    "reduce_many",
    "wire_dtype",
]

logger = logging.getLogger(__name__)

# ncclDataType_t (nccl.h): ncclInt8=0 ... ncclBfloat16=9.
NCCL_DTYPES: dict[str, int] = {
    "int8": 0,
    "uint8": 1,
    "int32": 2,
    "uint32": 3,
    "int64": 4,
    "uint64": 5,
    "float16": 6,
    "float32": 7,
    "float64": 8,
    "bfloat16": 9,
}
# ncclRedOp_t (nccl.h).
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
NCCL_OPS: dict[ReduceOp, int] = {
    ReduceOp.SUM: NCCL_SUM,
    ReduceOp.PRODUCT: NCCL_PROD,
    ReduceOp.MAX: NCCL_MAX,
    ReduceOp.MIN: NCCL_MIN,
    ReduceOp.AVG: NCCL_AVG,
    # The inputs are scaled on the device first, then summed.
    ReduceOp.PREMUL_SUM: NCCL_SUM,
}
_NCCL_UINT8 = NCCL_DTYPES["uint8"]
_FLOATS = frozenset({"float16", "float32", "float64", "bfloat16"})
# bool as uint8: or is MAX, and is MIN.
_BOOL_OPS = {
    ReduceOp.SUM: NCCL_MAX,
    ReduceOp.MAX: NCCL_MAX,
    ReduceOp.BOR: NCCL_MAX,
    ReduceOp.PRODUCT: NCCL_MIN,
    ReduceOp.MIN: NCCL_MIN,
    ReduceOp.BAND: NCCL_MIN,
}


@dataclass(frozen=True, slots=True)
class NcclCall:
    """How NCCL reduces an array: its datatype, reduction, and elements per array element."""

    datatype: int
    op: int
    scale: int = 1


def is_bfloat16(dtype: np.dtype[Any]) -> bool:
    """Whether ``dtype`` is bfloat16 (ml_dtypes' dtype, recognised by name)."""
    return dtype.name == "bfloat16" and dtype.itemsize == 2


def wire_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype the device computes with: bfloat16 becomes its uint16 bit pattern."""
    return np.dtype(np.uint16) if is_bfloat16(dtype) else dtype


def nccl_plan(dtype: np.dtype[Any], op: ReduceOp) -> NcclCall | str:
    """How NCCL reduces ``dtype`` with ``op``, or the reason it cannot (a string).

    ``op`` has passed :func:`aiodist._arrays._reduce.check_reduce_op` for ``dtype``.
    """
    name = dtype.name
    if name == "bool":
        if op in _BOOL_OPS:
            return NcclCall(_NCCL_UINT8, _BOOL_OPS[op])
        return f"NCCL has no ReduceOp.{op.name} for bool"
    if dtype.kind == "c":
        if op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PREMUL_SUM):
            part = NCCL_DTYPES[np.dtype(f"f{dtype.itemsize // 2}").name]
            return NcclCall(part, NCCL_OPS[op], 2)
        return f"NCCL has no ReduceOp.{op.name} for complex numbers"
    if name not in NCCL_DTYPES:
        return f"NCCL has no datatype for {name}"
    if op not in NCCL_OPS:
        return f"NCCL has no ReduceOp.{op.name}"
    if op is ReduceOp.AVG and name not in _FLOATS:
        # ncclAvg truncates integer means; aiodist floors them, as numpy and the CPU do.
        return f"ReduceOp.AVG on {name} floors the mean, which NCCL does not"
    return NcclCall(NCCL_DTYPES[name], NCCL_OPS[op])


# -- the device reduction --------------------------------------------------------------------

_UFUNC_NAMES = {
    ReduceOp.SUM: "add",
    ReduceOp.AVG: "add",
    ReduceOp.PREMUL_SUM: "add",
    ReduceOp.PRODUCT: "multiply",
    ReduceOp.MIN: "minimum",
    ReduceOp.MAX: "maximum",
    ReduceOp.BAND: "bitwise_and",
    ReduceOp.BOR: "bitwise_or",
    ReduceOp.BXOR: "bitwise_xor",
}


def bfloat16_widen(xp: Any, bits: Any) -> Any:
    """float32 values of an array of bfloat16 bit patterns (uint16), exactly."""
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


def bfloat16_round(xp: Any, values: Any, out: Any) -> None:
    """Round float32 ``values`` to bfloat16 (nearest, ties to even) into uint16 ``out``.

    NaN stays a (quiet) NaN of the same sign; infinities and overflow to infinity follow
    IEEE rounding.
    """
    bits = values.view(xp.uint32)
    rounded = (bits + xp.uint32(0x7FFF) + ((bits >> 16) & xp.uint32(1))) >> 16
    quiet_nan = (bits >> 16) | xp.uint32(0x0040)
    xp.copyto(out, xp.where(values != values, quiet_nan, rounded).astype(xp.uint16))


def reduce_many(
    xp: Any,
    op: ReduceOp,
    dtype: np.dtype[Any],
    out: Any,
    ins: list[Any],
    *,
    factor: float | None = None,
) -> None:
    """Reduce the contributions ``ins`` (one per rank, in rank order) into ``out``.

    Every array is a flat ``uint8`` view of the same number of bytes in ``xp``'s memory
    (``numpy`` or ``cupy``); ``out`` may be ``ins[0]`` (not another). ``AVG`` divides the sum by
    ``len(ins)`` (floor division for integers); ``PREMUL_SUM`` multiplies each contribution
    by ``factor`` first.
    """
    if is_bfloat16(dtype):
        acc = bfloat16_widen(xp, ins[0].view(xp.uint16))
        acc = acc.copy() if factor is None else acc * xp.float32(factor)
        for other in ins[1:]:
            value = bfloat16_widen(xp, other.view(xp.uint16))
            if factor is not None:
                value = value * xp.float32(factor)
            getattr(xp, _UFUNC_NAMES[op])(acc, value, out=acc)
        if op is ReduceOp.AVG:
            xp.divide(acc, xp.float32(len(ins)), out=acc)
        bfloat16_round(xp, acc, out.view(xp.uint16))
        return
    typed_out = out.view(dtype)
    first = ins[0].view(dtype)
    ufunc = getattr(xp, _UFUNC_NAMES[op])
    if factor is not None:
        scale = dtype.type(factor)
        xp.multiply(first, scale, out=typed_out)
        for other in ins[1:]:
            xp.add(typed_out, other.view(dtype) * scale, out=typed_out)
        return
    if out is not ins[0]:
        xp.copyto(typed_out, first)
    for other in ins[1:]:
        ufunc(typed_out, other.view(dtype), out=typed_out)
    n = len(ins)
    if op is not ReduceOp.AVG or n == 1:
        return
    if dtype.kind not in "iu":
        xp.divide(typed_out, dtype.type(n), out=typed_out)
    elif n <= np.iinfo(dtype).max:
        xp.floor_divide(typed_out, dtype.type(n), out=typed_out)
    else:  # more ranks than the dtype can count: divide through int64, as the CPU does
        xp.floor_divide(typed_out, np.int64(n), out=typed_out, casting="unsafe")
