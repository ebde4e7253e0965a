"""The bytes of a serving call and of its reply (see :mod:`aiodist.serving`).

A header is JSON in one fixed-size message (:data:`FIRST` bytes): a prefix with the length
of the JSON and of the arrays' bytes carried with it, the JSON, then the arrays when they
fit. JSON that does not fit goes on in a second message; arrays that do not fit follow as
messages of their own. Nothing here sends or receives: the channel
(``_serving_channel.py``) moves these messages. A header's length, and the number, dtypes
(numeric ones only, as collectives take) and total size of the arrays it announces, are
checked against limits before anything is allocated for them.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .._arrays._intake import as_array, check_dtype
from ..errors import DistProtocolError, DistUsageError

__all__ = [
    "FIRST",
    "MAX_ARRAYS",
    "MAX_ARRAY_BYTES",
    "ROOM",
    "array_spec",
    "check_name",
    "decode",
    "encode",
    "new_arrays",
    "outgoing",
    "overflow",
    "unpack",
]

#: The size of a header's first message: a small request or reply fits in it whole.
FIRST = 4096
_PREFIX = struct.Struct("<II")
#: What the first message holds after its prefix: the JSON, then the arrays that fit.
ROOM = FIRST - _PREFIX.size
_MAX_HEADER = 1 << 20
MAX_ARRAYS = 256
#: The most bytes the arrays of one header (a call, or a reply) may add up to.
MAX_ARRAY_BYTES = 1 << 34
_MAX_NAME = 256
_MAX_NDIM = 32


def encode(
    message: Mapping[str, Any], arrays: Sequence[npt.NDArray[Any]] = ()
) -> tuple[list[npt.NDArray[Any]], bool]:
    """The messages that carry ``message`` and ``arrays``, and whether the arrays are inside.

    The arrays travel inside the first message when they fit; otherwise they are among the
    messages returned, after the header's.
    """
    data = json.dumps(message, separators=(",", ":")).encode()
    size = sum(a.nbytes for a in arrays)
    inline = bool(arrays) and len(data) + size <= ROOM
    first = np.zeros(FIRST, np.uint8)
    head = _PREFIX.pack(len(data), size if inline else 0) + data[:ROOM]
    first[: len(head)] = np.frombuffer(head, np.uint8)
    if inline:
        at = len(head)
        for a in arrays:
            first[at : at + a.nbytes] = a.reshape(-1).view(np.uint8)
            at += a.nbytes
        return [first], True
    parts: list[npt.NDArray[Any]] = [first]
    if len(data) > ROOM:
        parts.append(np.frombuffer(data[ROOM:], np.uint8))
    return [*parts, *arrays], False


def overflow(first: npt.NDArray[np.uint8]) -> int:
    """How many bytes of the header's JSON follow ``first`` in a second message."""
    length, carried = _PREFIX.unpack(first[: _PREFIX.size].tobytes())
    if length > _MAX_HEADER or (carried and _PREFIX.size + length + carried > FIRST):
        raise DistProtocolError(
            f"serving header of {length} bytes carrying {carried} bytes of arrays"
        )
    return max(0, int(length) - ROOM)


def decode(
    first: npt.NDArray[np.uint8], rest: npt.NDArray[np.uint8] | None
) -> tuple[dict[str, Any], npt.NDArray[np.uint8] | None]:
    """The header's message, and the bytes of the arrays it carries (``None`` if none)."""
    length, carried = _PREFIX.unpack(first[: _PREFIX.size].tobytes())
    data = first[_PREFIX.size : _PREFIX.size + min(int(length), ROOM)].tobytes()
    if rest is not None:
        data += rest.tobytes()
    try:
        message = json.loads(data)
    except ValueError as exc:
        raise DistProtocolError(f"serving header is not JSON: {exc}") from exc
    if not isinstance(message, dict):
        raise DistProtocolError(f"serving header is not an object: {message!r}")
    if not carried:
        return message, None
    start = _PREFIX.size + int(length)
    return message, first[start : start + int(carried)]


def unpack(carried: npt.NDArray[np.uint8], specs: object) -> list[npt.NDArray[Any]]:
    """New arrays for ``specs``, filled from the bytes a header carried.

    Raises:
        DistProtocolError: the specs are bad (see :func:`new_arrays`), or the bytes carried
            are not theirs.
    """
    arrays = new_arrays(specs)
    if sum(a.nbytes for a in arrays) != len(carried):
        raise DistProtocolError(f"serving header carries {len(carried)} bytes for {specs!r}")
    at = 0
    for a in arrays:
        a.reshape(-1).view(np.uint8)[:] = carried[at : at + a.nbytes]
        at += a.nbytes
    return arrays


def _dtype_code(dtype: np.dtype[Any]) -> str:
    return "bfloat16" if dtype.name == "bfloat16" else dtype.str


def array_spec(a: npt.NDArray[Any], what: str) -> list[Any]:
    """The ``[dtype, shape]`` of ``a`` for a header (at most 32 dimensions keep it bounded)."""
    if a.ndim > _MAX_NDIM:
        raise DistUsageError(f"{what}: an array of {a.ndim} dimensions (at most {_MAX_NDIM})")
    return [_dtype_code(a.dtype), list(a.shape)]


def new_arrays(specs: object) -> list[npt.NDArray[Any]]:
    """New arrays for the ``[dtype, shape]`` specs a header announced.

    Raises:
        DistProtocolError: ``specs`` is not a list of at most :data:`MAX_ARRAYS` specs, a
            spec is malformed or has a dtype collectives do not take (object, string,
            structured...), or they add up to more than :data:`MAX_ARRAY_BYTES`.
    """
    if not isinstance(specs, list) or len(specs) > MAX_ARRAYS:
        raise DistProtocolError(
            f"a serving header announces {specs!r:.200}: not a list of at most {MAX_ARRAYS} "
            "array specs"
        )
    parsed = [_parse_spec(s) for s in specs]
    total = sum(math.prod(dims) * dtype.itemsize for dtype, dims in parsed)
    if total > MAX_ARRAY_BYTES:
        raise DistProtocolError(
            f"a serving header announces arrays of {total} bytes in all, more than the "
            f"limit of {MAX_ARRAY_BYTES}"
        )
    return [np.empty(dims, dtype) for dtype, dims in parsed]


def _parse_spec(spec: object) -> tuple[np.dtype[Any], tuple[int, ...]]:
    """The dtype and shape of a ``[dtype, shape]`` spec read off the wire.

    Raises:
        DistProtocolError: a malformed spec, or a dtype collectives do not take.
    """
    try:
        if not isinstance(spec, list) or len(spec) != 2:
            raise ValueError("not [dtype, shape]")
        code, shape = spec
        if code == "bfloat16":
            import ml_dtypes

            dtype = np.dtype(ml_dtypes.bfloat16)
        elif isinstance(code, str):
            dtype = np.dtype(code)
        else:
            raise ValueError("the dtype is not a string")
        check_dtype(dtype, "the array")
        if not isinstance(shape, list) or len(shape) > _MAX_NDIM:
            raise ValueError(f"the shape is not a list of at most {_MAX_NDIM} sizes")
        dims = tuple(shape)
        if not all(type(d) is int and d >= 0 for d in dims):
            raise ValueError(f"shape {dims}")
        return dtype, dims
    except (TypeError, ValueError, ImportError, DistUsageError) as exc:
        raise DistProtocolError(
            f"bad array spec in a serving header: {spec!r:.200}: {exc}"
        ) from exc


def check_name(name: object, what: str) -> str:
    """``name``, if it can be a handler's name in a header (``what`` is the caller, for errors)."""
    if not isinstance(name, str) or not name or len(name) > _MAX_NAME:
        raise DistUsageError(
            f"{what}: a handler name must be a non-empty string of at most {_MAX_NAME} "
            f"characters, got {name!r}"
        )
    return name


def outgoing(value: object, name: str) -> tuple[str, list[npt.NDArray[Any]]]:
    """A handler's return value as ``(kind, arrays)``, checked for the wire."""
    where = f"handler {name!r} returned"
    if value is None:
        return "none", []
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if isinstance(value, tuple):
        if len(value) > MAX_ARRAYS:
            raise DistUsageError(f"{where} {len(value)} arrays (at most {MAX_ARRAYS})")
        items = [np.asarray(v) if isinstance(v, np.generic) else v for v in value]
        return "tuple", [
            as_array(v, writable=False, name=f"{where} a tuple whose item {i}")
            for i, v in enumerate(items)
        ]
    if isinstance(value, np.ndarray) or hasattr(value, "__dlpack__"):
        return "array", [as_array(value, writable=False, name=f"{where} an array that")]
    raise DistUsageError(
        f"{where} {type(value).__name__}; a handler returns an array, a tuple of arrays, or None"
    )
