"""Reduction operations and the in-place kernels that apply them.

:class:`ReduceOp` carries torch's numeric values, so code that stores or sends them as plain
integers agrees with ``torch.distributed``. Every kernel works in place through a numpy
ufunc with ``out=``: no temporary arrays and no per-element Python.

Semantics worth knowing:

* ``AVG`` is ``SUM`` followed by a division by the number of contributors, applied once at
  the end (:func:`finish_into`). On integer dtypes the division is floor division (numpy's
  ``//``) of the sum, which wraps on overflow like every integer ``SUM``. ``AVG`` on ``bool``
  is rejected: there is no boolean mean.
* On ``bool``, ``SUM`` and ``MAX`` are logical or, ``PRODUCT`` and ``MIN`` logical and
  (numpy's ufuncs on booleans), which is what the sum or product of 0/1 values means
  read as truth values.
* ``MIN`` and ``MAX`` propagate NaN (``np.minimum``/``np.maximum``), so a NaN on any rank
  shows in the result, on every rank alike.
* Bitwise ops (``BAND``, ``BOR``, ``BXOR``) take integer and ``bool`` dtypes only; ``MIN``
  and ``MAX`` are not defined on complex numbers.
"""

from __future__ import annotations

import enum
import logging
import warnings
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import DistUsageError

__all__ = [
    "UFUNCS",
    "PremulSum",
    "ReduceOp",
    "check_reduce_op",
    "finish_into",
    "make_premul_sum",
    "reduce_into",
    "reduce_op",
]

logger = logging.getLogger(__name__)


class ReduceOp(enum.IntEnum):
    """A reduction for ``all_reduce``, ``reduce`` and ``reduce_scatter``.

    The values are torch's (``torch.distributed.ReduceOp``), so ``int(op)`` means the same
    in both libraries.
    """

    SUM = 0
    AVG = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4
    BAND = 5
    BOR = 6
    BXOR = 7
    #: A sum of each rank's input multiplied by a factor first; pass
    #: :func:`make_premul_sum` ``(factor)`` as the op.
    PREMUL_SUM = 8

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"


class _DeprecatedReduceOp:
    """torch's deprecated ``reduce_op``: ``reduce_op.SUM`` is :attr:`ReduceOp.SUM`, with a
    ``FutureWarning`` (as torch gives) that says to use :class:`ReduceOp`."""

    __slots__ = ()

    def __getattr__(self, name: str) -> ReduceOp:
        try:
            op = ReduceOp[name]
        except KeyError:
            raise AttributeError(f"reduce_op has no attribute {name!r}") from None
        warnings.warn(
            "`reduce_op` is deprecated, please use `ReduceOp` instead",
            FutureWarning,
            stacklevel=2,
        )
        return op

    def __repr__(self) -> str:
        return "<reduce_op (deprecated: use ReduceOp)>"


#: torch's deprecated alias of :class:`ReduceOp` (``reduce_op.SUM`` warns and works).
reduce_op = _DeprecatedReduceOp()


class PremulSum:
    """``ReduceOp.PREMUL_SUM`` with its factor: every input is multiplied by it, then summed.

    Make one with :func:`make_premul_sum`. Floating and complex dtypes only.
    """

    __slots__ = ("factor",)

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __repr__(self) -> str:
        return f"make_premul_sum({self.factor!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PremulSum) and other.factor == self.factor

    def __hash__(self) -> int:
        return hash(("premul_sum", self.factor))


def make_premul_sum(factor: float) -> PremulSum:
    """Return the reduction "multiply each rank's input by ``factor``, then sum".

    torch spells it ``torch.distributed._make_nccl_premul_sum(factor)``.

    Raises:
        DistUsageError: ``factor`` is not a real number.
    """
    if isinstance(factor, bool) or not isinstance(factor, int | float):
        raise DistUsageError(f"make_premul_sum: factor must be a real number, got {factor!r}")
    return PremulSum(float(factor))


#: The numpy ufunc behind each op; AVG reduces as SUM and divides in finish_into.
UFUNCS: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
    ReduceOp.PREMUL_SUM: np.add,
}

_BITWISE = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})
_ORDERED = frozenset({ReduceOp.MIN, ReduceOp.MAX})


def _kind(dtype: np.dtype[Any]) -> str:
    """numpy's dtype kind, with bfloat16 (kind ``V`` in ml_dtypes) counted as a float."""
    if dtype.kind == "V" and dtype.name == "bfloat16":
        return "f"
    return dtype.kind


def check_reduce_op(op: object, dtype: np.dtype[Any]) -> ReduceOp:
    """Check that ``op`` is a reduction that ``dtype`` can take, and return it as a ReduceOp.

    Args:
        op: A :class:`ReduceOp`, or its integer value.
        dtype: The dtype of the arrays to reduce.

    Returns:
        ``op`` as a :class:`ReduceOp` member.

    Raises:
        DistUsageError: ``op`` is not a reduction, or ``dtype`` cannot take it (bitwise ops on
            floating or complex dtypes, ``MIN``/``MAX`` on complex, ``AVG`` on bool). The
            message names both.
    """
    if isinstance(op, PremulSum):
        if _kind(dtype) not in "fc":
            raise DistUsageError(f"ReduceOp.PREMUL_SUM is not supported for dtype {dtype}")
        return ReduceOp.PREMUL_SUM
    if isinstance(op, bool) or not isinstance(op, int):
        raise DistUsageError(f"op must be an aiodist.ReduceOp, got {op!r}")
    try:
        rop = ReduceOp(op)
    except ValueError:
        raise DistUsageError(f"op must be an aiodist.ReduceOp, got {op!r}") from None
    if rop is ReduceOp.PREMUL_SUM:
        raise DistUsageError(
            "ReduceOp.PREMUL_SUM needs its factor: pass aiodist.make_premul_sum(factor)"
        )
    kind = _kind(dtype)
    if kind not in "biufc":
        raise DistUsageError(f"cannot reduce arrays of dtype {dtype}")
    if (
        (rop in _BITWISE and kind in "fc")
        or (rop in _ORDERED and kind == "c")
        or (rop is ReduceOp.AVG and kind == "b")
    ):
        raise DistUsageError(f"ReduceOp.{rop.name} is not supported for dtype {dtype}")
    return rop


def reduce_into(op: ReduceOp, dst: npt.NDArray[Any], src: npt.NDArray[Any]) -> None:
    """Combine ``src`` into ``dst`` in place: ``dst = op(dst, src)`` element by element.

    ``op`` must have passed :func:`check_reduce_op` for the arrays' dtype; both arrays have
    the same dtype and shape. For ``AVG`` this adds; :func:`finish_into` divides at the end.

    Raises:
        TypeError: numpy cannot apply the op to the dtype (only if the check was skipped).
    """
    UFUNCS[op](dst, src, out=dst)


def finish_into(op: ReduceOp, dst: npt.NDArray[Any], contributors: int) -> None:
    """Apply the final step of ``op`` to a fully reduced ``dst``, in place.

    Only ``AVG`` has one: the sum of ``contributors`` arrays becomes their mean (floor
    division on integer dtypes). Every other op is left as reduced.

    Raises:
        TypeError: numpy cannot divide the dtype (only if the check was skipped).
    """
    if op is not ReduceOp.AVG or contributors == 1:
        return
    if _kind(dst.dtype) in "iu":
        # A group larger than the dtype's maximum divides through int64 (exact for every
        # value of an 8- or 16-bit dtype) and casts the quotient back.
        if contributors <= np.iinfo(dst.dtype).max:
            np.floor_divide(dst, dst.dtype.type(contributors), out=dst)
        else:
            np.floor_divide(dst, np.int64(contributors), out=dst, casting="unsafe")
    else:
        np.divide(dst, dst.dtype.type(contributors), out=dst)
