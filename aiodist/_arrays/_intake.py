"""Array intake: numpy arrays and CPU DLPack producers, checked once at the API boundary.

Everything past this module works on C-contiguous numpy arrays of a supported dtype and
moves their bytes through :func:`byte_view`. torch tensors (and JAX arrays, and anything
else exporting ``__dlpack__``) are taken zero-copy with :func:`numpy.from_dlpack`, which
never imports the producer's library.
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import DistUsageError

#: What to install for the CUDA backend (aiodist is installed from its checkout).
CUDA_INSTALL_HINT = (
    "install aiodist's cuda13 (or cuda12) extra: pip install -e '/path/to/aiodist[cuda13]'"
)

__all__ = ["SUPPORTED_DTYPES", "as_array", "byte_view", "check_dtype"]

logger = logging.getLogger(__name__)

#: The dtypes collectives accept; ``bfloat16`` too when ml_dtypes made the array.
SUPPORTED_DTYPES: frozenset[np.dtype[Any]] = frozenset(
    np.dtype(t)
    for t in (
        np.bool_,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint16,
        np.uint32,
        np.uint64,
        np.float16,
        np.float32,
        np.float64,
        np.complex64,
        np.complex128,
    )
)

# DLPack device types (dlpack.h, DLDeviceType).
_DL_CPU = 1
_DL_CUDA = 2
_DL_CUDA_HOST = 3
_DL_ROCM = 10
_DL_CUDA_MANAGED = 13
_HOST_DEVICES = frozenset({_DL_CPU, _DL_CUDA_HOST, _DL_CUDA_MANAGED})


def check_dtype(dtype: np.dtype[Any], name: str) -> None:
    """Check that collectives can carry arrays of ``dtype``.

    Args:
        dtype: The dtype to check.
        name: The argument's name, for the error message.

    Raises:
        DistUsageError: the dtype is not numeric (object, string, datetime, structured) or is
            not in native byte order. The message names the argument and the dtype.
    """
    if dtype in SUPPORTED_DTYPES:
        return
    # ml_dtypes registers bfloat16 as a kind-"V" dtype; it is recognised by name so the
    # check works without importing ml_dtypes.
    if dtype.name == "bfloat16" and dtype.itemsize == 2:
        return
    if dtype.newbyteorder("=") in SUPPORTED_DTYPES:
        raise DistUsageError(
            f"{name} has dtype {dtype.str} in non-native byte order; "
            f"convert it with .astype({dtype.newbyteorder('=').name!r}) first"
        )
    raise DistUsageError(
        f"{name} has unsupported dtype {dtype}; collectives take bool, (u)int8-64, "
        "float16/32/64, bfloat16 and complex64/128"
    )


def _from_dlpack(x: Any, name: str) -> npt.NDArray[Any]:
    """A numpy view of a DLPack producer's host memory; device memory is refused."""
    try:
        device_type, device_id = x.__dlpack_device__()
    except Exception as exc:
        raise DistUsageError(
            f"{name} ({type(x).__name__}) has __dlpack__ but __dlpack_device__() failed: {exc}"
        ) from exc
    device_type = int(device_type)
    if device_type in (_DL_CUDA, _DL_ROCM):
        raise DistUsageError(
            f"{name} ({type(x).__name__}) lives on GPU device {device_id} "
            f"(DLPack device type {device_type}); the CPU backend takes host memory only: "
            "copy it to the CPU first, or use the CUDA backend (backend='cuda'; "
            f"{CUDA_INSTALL_HINT})"
        )
    if device_type not in _HOST_DEVICES:
        raise DistUsageError(
            f"{name} ({type(x).__name__}) lives on DLPack device type {device_type}, "
            "which is not host memory"
        )
    try:
        arr: npt.NDArray[Any] = np.from_dlpack(x)
    except (BufferError, TypeError, RuntimeError, ValueError) as exc:
        bf16 = _bfloat16_from_dlpack(x, name)
        if bf16 is not None:
            return bf16
        raise DistUsageError(
            f"{name} ({type(x).__name__}) cannot be viewed as a numpy array through DLPack: {exc}"
        ) from exc
    return arr


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DELETER),
]
_DL_BFLOAT = 4
_capsule_get = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get.restype = ctypes.c_void_p
_capsule_get.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_rename = ctypes.pythonapi.PyCapsule_SetName
_capsule_rename.restype = ctypes.c_int
_capsule_rename.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _bfloat16_from_dlpack(x: Any, name: str) -> npt.NDArray[Any] | None:
    """A bfloat16 view of a host DLPack tensor numpy cannot import itself, or ``None``.

    numpy has no bfloat16, so its ``from_dlpack`` refuses such tensors (torch's included);
    the capsule is read here and its memory viewed as ml_dtypes' bfloat16, in place. The
    producer's deleter runs once the last view of the memory is gone.
    """
    try:
        capsule = x.__dlpack__()
    except Exception:  # the producer refuses to export: numpy's error says why
        return None
    managed = ctypes.cast(_capsule_get(capsule, b"dltensor"), ctypes.POINTER(_DLManagedTensor))
    t = managed.contents.dl_tensor
    if (t.dtype.code, t.dtype.bits, t.dtype.lanes) != (_DL_BFLOAT, 16, 1):
        return None  # not ours to read: the capsule frees itself, unconsumed
    try:
        import ml_dtypes
    except ImportError:
        raise DistUsageError(
            f"{name} is a bfloat16 tensor: viewing it needs ml_dtypes (pip install ml_dtypes)"
        ) from None
    shape = tuple(t.shape[i] for i in range(t.ndim))
    compact = [1] * t.ndim
    for i in range(t.ndim - 2, -1, -1):
        compact[i] = compact[i + 1] * shape[i + 1]
    if t.strides and [t.strides[i] for i in range(t.ndim)] != compact and 0 not in shape:
        raise DistUsageError(
            f"{name} is a non-contiguous bfloat16 tensor; pass tensor.contiguous() (and copy "
            "the result back if the collective writes into it)"
        )
    # The capsule is consumed: its memory is now ours to release, with the producer's deleter.
    _capsule_rename(capsule, b"used_dltensor")
    count = int(np.prod(shape, dtype=np.int64))
    address = (t.data or 0) + t.byte_offset
    if count == 0 or not address:
        root = np.zeros(0, np.uint16)
    else:
        root = np.ctypeslib.as_array(
            ctypes.cast(address, ctypes.POINTER(ctypes.c_uint16)), (count,)
        )
    deleter = managed.contents.deleter
    if deleter:
        weakref.finalize(root, deleter, managed)
    view: npt.NDArray[Any] = root.view(ml_dtypes.bfloat16).reshape(shape)
    return view


def as_array(x: object, *, writable: bool, name: str) -> npt.NDArray[Any]:
    """Return ``x`` as a C-contiguous numpy array sharing its memory.

    numpy arrays are used as they are; objects with ``__dlpack__`` in host memory (torch CPU
    tensors, JAX CPU arrays) are viewed zero-copy through :func:`numpy.from_dlpack`.
    An input (``writable=False``) that is not C-contiguous is copied into a contiguous array,
    since nothing is written back to it; an output must be usable in place.

    Args:
        x: The array or tensor.
        writable: Whether the collective writes its result into ``x``.
        name: The argument's name (``"tensor"``, ``"output_tensor_list[2]"``), for errors.

    Returns:
        A C-contiguous numpy array viewing ``x``'s memory (or, for a non-contiguous input,
        a contiguous copy).

    Raises:
        DistUsageError: ``x`` is neither a numpy array nor a host DLPack producer, lives on a
            GPU, has an unsupported dtype, or is an output that is read-only or not
            C-contiguous. The message names the argument.
    """
    if isinstance(x, np.ndarray):
        arr: npt.NDArray[Any] = x
    elif hasattr(x, "__dlpack__"):
        arr = _from_dlpack(x, name)
    else:
        raise DistUsageError(
            f"{name} must be a numpy array or a CPU tensor supporting DLPack, "
            f"got {type(x).__name__}"
        )
    check_dtype(arr.dtype, name)
    if writable:
        if not arr.flags.writeable:
            raise DistUsageError(
                f"{name} is read-only, but the collective writes its result into it"
            )
        if not arr.flags.c_contiguous:
            raise DistUsageError(
                f"{name} is not C-contiguous, but the collective writes its result into it "
                "in place; pass a contiguous array (np.ascontiguousarray(a), or "
                "tensor.contiguous() for a torch tensor) and copy the result back"
            )
    elif not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return arr


def byte_view(a: npt.NDArray[Any]) -> memoryview:
    """A flat ``uint8`` memoryview of a C-contiguous array's bytes, without copying.

    Works for every supported dtype (bfloat16 included) and for 0-d and 0-size arrays.
    The view is read-only when the array is.
    """
    return a.reshape(-1).view(np.uint8).data
