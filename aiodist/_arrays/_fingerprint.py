"""Fingerprints of collective calls: what every message of an operation says about its call.

A fingerprint is a fixed 32-byte block packed once per operation: the operation, dtype,
reduce op, root and the shape (up to four dimensions exactly, a CRC of the whole shape
beyond that). Every frame of the operation carries it, and the receiving rank compares it
with the fingerprint of the operation it issued under the same ``(group, seq)`` before any
payload byte is written to the caller's memory. Since the block is self-describing, a
mismatch is reported with both sides' calls in full, without a second exchange.
:data:`NO_FINGERPRINT` (all zeros) marks messages that are not checked (point-to-point).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

from ..errors import DistUsageError

__all__ = ["NO_FINGERPRINT", "describe", "fingerprint", "mismatch_error"]

# op code, dtype code, reduce op, ndim, root, four dimensions, CRC of the full shape.
_FP = struct.Struct("<BBBBi4IQ")
FINGERPRINT_SIZE = _FP.size

#: The fingerprint of messages that are not checked.
NO_FINGERPRINT = bytes(FINGERPRINT_SIZE)

# Codes are indices + 1 in these tuples (0 means "none"); appending keeps old codes valid.
_OPS = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_single",  # (also all_gather_into_tensor, its other name)
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_single",  # (also reduce_scatter_tensor)
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "gather_single",  # (also gather_into_tensor, its other name)
)
_OP_CODE = {name: i + 1 for i, name in enumerate(_OPS)}
_DTYPES = (
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "bfloat16",
)
_DTYPE_CODE = {name: i + 1 for i, name in enumerate(_DTYPES)}
_REDUCE_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")
_ROOT_NAME = {
    "broadcast": "src",
    "reduce": "dst",
    "gather": "dst",
    "scatter": "src",
    "broadcast_object_list": "src",
    "gather_object": "dst",
    "scatter_object_list": "src",
}
_NO_SHAPE = 255
_NO_OP = 255
_MAX_DIM = 2**32 - 1


def fingerprint(
    op: str,
    *,
    dtype: object = None,
    shape: Sequence[int] | None = None,
    root: int = -1,
    reduce_op: int = _NO_OP,
) -> bytes:
    """Return the fingerprint of a call of collective ``op``.

    Args:
        op: the collective's name (an operation of :mod:`aiodist.group._operations`; an alias
            fingerprints as the operation it names).
        dtype: the numpy dtype the ranks must agree on, or ``None``.
        shape: the shape the ranks must agree on, or ``None``.
        root: the root group rank of a rooted collective, else -1.
        reduce_op: the ``ReduceOp`` value of a reduction.

    Raises:
        DistUsageError: ``op`` is not a known collective.
    """
    key = (op, dtype, None if shape is None else tuple(shape), root, reduce_op)
    fp = _cache.get(key)
    if fp is None:
        fp = _cache[key] = _pack(op, dtype, shape, root, reduce_op)
        if len(_cache) > _CACHE_SIZE:  # programs use a few call shapes; never grow unbounded
            _cache.clear()
    return fp


# Packing costs a few microseconds (dtype names, struct); a lookup a fraction of one.
_cache: dict[tuple[object, ...], bytes] = {}
_CACHE_SIZE = 4096


def _pack(op: str, dtype: object, shape: Sequence[int] | None, root: int, reduce_op: int) -> bytes:
    code = _OP_CODE.get(op)
    if code is None:
        raise DistUsageError(f"no fingerprint for unknown collective {op!r}")
    dcode = 0 if dtype is None else _DTYPE_CODE.get(str(dtype), 254)
    if shape is None:
        return _FP.pack(code, dcode, reduce_op, _NO_SHAPE, root, 0, 0, 0, 0, 0)
    ndim = len(shape)
    dims = [min(int(d), _MAX_DIM) for d in shape[:4]]
    dims += [0] * (4 - len(dims))
    crc = zlib.crc32(repr(tuple(shape)).encode()) if ndim > 4 else 0
    return _FP.pack(code, dcode, reduce_op, min(ndim, 254), root, *dims, crc)


def describe(fp: bytes) -> str:
    """Return the call a fingerprint stands for, e.g. ``all_reduce(shape=(4,), dtype=float32,
    op=SUM)``; ``"point-to-point"`` for :data:`NO_FINGERPRINT`."""
    if fp == NO_FINGERPRINT:
        return "point-to-point"
    code, dcode, rop, ndim, root, d0, d1, d2, d3, _ = _FP.unpack(fp)
    op = _OPS[code - 1] if 0 < code <= len(_OPS) else f"op{code}"
    parts = []
    if ndim != _NO_SHAPE:
        dims = [d0, d1, d2, d3][: min(ndim, 4)]
        text = ", ".join(map(str, dims))
        if ndim == 1:
            text += ","
        elif ndim > 4:
            text += f", ... ({ndim} dims)"
        parts.append(f"shape=({text})")
    if dcode:
        parts.append(f"dtype={_DTYPES[dcode - 1] if dcode <= len(_DTYPES) else 'other'}")
    if rop != _NO_OP:
        parts.append(f"op={_REDUCE_OPS[rop] if rop < len(_REDUCE_OPS) else rop}")
    if root >= 0:
        parts.append(f"{_ROOT_NAME.get(op, 'root')}={root}")
    return f"{op}({', '.join(parts)})"


def mismatch_error(
    rank: int, mine: bytes, peer: int, theirs: bytes, group: int, seq: int
) -> DistUsageError:
    """Return the error for a message of ``peer`` whose fingerprint differs from ours."""
    where = "" if group == 0 else f" of group {group}"
    return DistUsageError(
        f"collective mismatch: rank {rank} called {describe(mine)} as op #{seq}{where} but "
        f"rank {peer} called {describe(theirs)}; every rank of a group must issue the same "
        "collectives, with the same shapes, dtypes, roots and reduce ops, in the same order"
    )
