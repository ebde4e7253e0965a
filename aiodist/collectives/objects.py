"""Object collectives: pickled Python objects between the ranks, sizes first.

Each algorithm takes two ``OpComm`` (one per sequence number: the sizes, then the bytes) and
the arguments :mod:`aiodist.group._operations` checked; it runs on the CPU, whatever devices the
group's arrays live on. A peer's announced sizes are checked before anything is allocated
(:data:`MAX_OBJECT_SIZE`), and received bytes are unpickled, which trusts the peers (as
torch does), or with ``weights_only`` as data only: builtin values, containers and numpy
arrays, never a class or function that could run code, and never more memory than the
pickle's own size (and :data:`UNPICKLE_SLACK`): what a data pickle builds is made of bytes
it carries, so ``bytearray(2**40)``, or the same bytes copied again and again through the
pickle's memo, is not data.
"""

from __future__ import annotations

import asyncio
import io
import math
import pickle
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, cast

import numpy as np
import numpy.typing as npt

try:  # numpy 2 (numpy.core.multiarray names the same functions)
    from numpy._core.multiarray import _reconstruct, scalar as _scalar
except ImportError:  # numpy 1
    from numpy.core.multiarray import (  # type: ignore[no-redef]
        _reconstruct,
        scalar as _scalar,
    )

from .._arrays._intake import byte_view
from ..errors import DistError, DistProtocolError
from ..transport.base import OpComm
from ._common import ResultError
from .gather import all_gather, gather, scatter
from .tree import broadcast

__all__ = [
    "MAX_OBJECT_SIZE",
    "UNPICKLE_SLACK",
    "all_gather_objects",
    "broadcast_objects",
    "gather_objects",
    "recv_objects",
    "scatter_objects",
    "send_objects",
]

Array = npt.NDArray[Any]


#: The largest pickled object an object collective takes from a peer. Sizes are announced by
#: the peers before the bytes follow, so they are checked before anything is allocated.
MAX_OBJECT_SIZE = 1 << 40


def _checked_sizes(sizes: Array, op: str, root: int | None = None) -> list[int]:
    """The announced sizes as ints, each in ``[0, MAX_OBJECT_SIZE]``.

    Raises:
        DistProtocolError: a peer announced a negative or oversized object.
    """
    out = sizes.tolist()
    for i, n in enumerate(out):
        if not 0 <= n <= MAX_OBJECT_SIZE:
            who = f"rank {root}" if root is not None else f"group rank {i}"
            raise DistProtocolError(
                f"{op}: {who} announced a pickled object of {n} bytes (the limit is "
                f"{MAX_OBJECT_SIZE}): a corrupted stream or a peer that is not aiodist"
            )
    return [int(n) for n in out]


def _bytes(shape: int | tuple[int, int], op: str) -> Array:
    """Zeroed receive memory for pickled objects; a clear error when it cannot be had.

    Raises:
        DistError: the memory cannot be allocated.
    """
    try:
        return np.zeros(shape, np.uint8)
    except (MemoryError, ValueError) as exc:
        raise DistError(
            f"{op}: cannot allocate {shape} bytes for the peers' objects: {exc}"
        ) from exc


#: What ``weights_only=True`` lets a pickle name: builtin values and containers, and numpy
#: arrays, scalars and dtypes (in numpy 2's module and numpy 1's); nothing that runs code.
_DATA_GLOBALS = frozenset(
    {
        *(
            ("builtins", name)
            for name in ("bytearray", "complex", "frozenset", "range", "set", "slice")
        ),
        ("collections", "OrderedDict"),
        ("numpy", "dtype"),
        ("numpy", "ndarray"),
        *(
            (module, name)
            for module in ("numpy._core.multiarray", "numpy.core.multiarray")
            for name in ("_reconstruct", "scalar")
        ),
    }
)


#: Bytes a ``weights_only`` unpickle may allocate beyond the size of the pickle.
UNPICKLE_SLACK = 1 << 16


def _nbytes(shape: object, dtype: object) -> int:
    """The bytes of an array of ``shape`` and ``dtype`` as a pickle gave them."""
    dims = shape if isinstance(shape, tuple) else (shape,)
    if not all(isinstance(d, int) and d >= 0 for d in dims):
        raise pickle.UnpicklingError(f"weights_only=True: an array of shape {shape!r}")
    return math.prod(dims) * np.dtype(dtype).itemsize  # type: ignore[call-overload,no-any-return]


def _cost(func: object, args: object) -> int:
    """What calling ``func(*args)``, a global a data pickle may name, allocates (roughly:
    bytes, or elements of a set)."""
    if not isinstance(args, tuple):
        raise pickle.UnpicklingError("weights_only=True: a call without an argument tuple")
    if func is np.ndarray:
        # numpy's pickles name it only as _reconstruct's argument, never call it.
        raise pickle.UnpicklingError("weights_only=True does not call numpy.ndarray")
    if not args:
        return 0
    first = args[0]
    if func is bytearray:
        return first if isinstance(first, int) else len(first)
    if func in (set, frozenset, OrderedDict):
        return len(first)
    if func is _reconstruct:
        if first is not np.ndarray or len(args) != 3:
            raise pickle.UnpicklingError("weights_only=True: _reconstruct of a non-array")
        return _nbytes(args[1], args[2])
    if func is _scalar:
        return int(np.dtype(first).itemsize)
    return 0


#: The Python unpickler's opcode table (typeshed types its functions loosely).
_PY_DISPATCH = cast("dict[int, Callable[[Any], None]]", pickle._Unpickler.dispatch)


class _DataUnpickler(pickle._Unpickler):
    """Unpickles data only (see ``_DATA_GLOBALS``), within a memory budget.

    The Python implementation of the unpickler, not the C one: it is the one whose calls
    (REDUCE) and state settings (BUILD) can be looked at before they allocate.
    """

    stack: list[Any]

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._size = len(data)
        self._left = len(data) + UNPICKLE_SLACK

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _DATA_GLOBALS:
            raise pickle.UnpicklingError(
                f"weights_only=True does not unpickle {module}.{name}: only builtin values, "
                "containers and numpy arrays"
            )
        return super().find_class(module, name)

    def _spend(self, nbytes: int, what: str) -> None:
        self._left -= nbytes
        if self._left < 0:
            raise pickle.UnpicklingError(
                f"weights_only=True: the pickle asks for more memory ({what} of {nbytes}) "
                f"than its {self._size} bytes can be data for"
            )

    def load_reduce(self) -> None:
        func, args = self.stack[-2], self.stack[-1]
        self._spend(_cost(func, args), getattr(func, "__name__", "a call"))
        _PY_DISPATCH[pickle.REDUCE[0]](self)

    def load_build(self) -> None:
        inst, state = self.stack[-2], self.stack[-1]
        if isinstance(inst, np.ndarray):
            # (version, shape, dtype, is_fortran, data): the array gets shape x dtype bytes.
            if not isinstance(state, tuple) or len(state) != 5:
                raise pickle.UnpicklingError("weights_only=True: an array's state is malformed")
            data = state[4]
            cost = len(data) if isinstance(data, list) else _nbytes(state[1], state[2])
            self._spend(cost, "an array")
        _PY_DISPATCH[pickle.BUILD[0]](self)

    def load_newobj(self) -> None:
        # A data pickle builds its values by calls (REDUCE); ``cls.__new__`` is for classes.
        raise pickle.UnpicklingError("weights_only=True does not create objects of classes")

    dispatch = cast(
        "dict[int, Callable[[pickle.Unpickler], None]]",
        {
            **_PY_DISPATCH,
            pickle.REDUCE[0]: load_reduce,
            pickle.BUILD[0]: load_build,
            pickle.NEWOBJ[0]: load_newobj,
            pickle.NEWOBJ_EX[0]: load_newobj,
        },
    )


def _loads(buf: Array, name: str, weights_only: bool) -> Any:
    """Unpickle ``buf`` (what ``name`` received): as data only with ``weights_only`` (see
    ``_DATA_GLOBALS``), else trusting its sender.

    Raises:
        ResultError: the bytes do not unpickle (or, with ``weights_only``, name a global
            that is not data): called once this rank's part of the transfer is done, so
            only its call fails.
    """
    try:
        if weights_only:
            return _DataUnpickler(buf.tobytes()).load()
        return pickle.loads(buf.tobytes())
    except Exception as exc:
        raise ResultError(f"{name}: received bytes did not unpickle: {exc}") from exc


def _padded(rows: Sequence[Array], width: int) -> Array:
    out = np.zeros((len(rows), width), np.uint8)
    for i, r in enumerate(rows):
        out[i, : r.size] = r
    return out


async def broadcast_objects(
    c_sizes: OpComm,
    c_data: OpComm,
    objs: list[Any],
    payloads: list[Array],
    root: int,
    weights_only: bool,
) -> list[Any]:
    """Unpickle the root's ``payloads`` into every rank's ``objs``; return ``objs``."""
    mine = c_sizes.rank == root
    sizes = np.array([p.size for p in payloads] if mine else [0] * len(objs), np.int64)
    await broadcast(c_sizes, sizes, root)
    if mine:
        data = np.concatenate(payloads)
    else:
        total = sum(_checked_sizes(sizes, "broadcast_object_list", root))
        data = _bytes(total, "broadcast_object_list")
    await broadcast(c_data, data, root)
    if not mine:
        offsets = np.cumsum([0, *sizes.tolist()])
        for i in range(len(objs)):
            objs[i] = _loads(data[offsets[i] : offsets[i + 1]], f"object_list[{i}]", weights_only)
    return objs


async def all_gather_objects(
    c_sizes: OpComm, c_data: OpComm, objs: list[Any], mine: Array, weights_only: bool
) -> list[Any]:
    """Gather every rank's pickled object (``mine``) into ``objs``; return ``objs``."""
    n = c_sizes.size
    sizes = np.zeros(n, np.int64)
    await all_gather(c_sizes, list(sizes.reshape(n, 1)), np.array([mine.size], np.int64))
    width = max(_checked_sizes(sizes, "all_gather_object"))
    rows = _bytes((n, width), "all_gather_object")
    await all_gather(c_data, list(rows), _padded([mine], width)[0])
    for i in range(n):
        objs[i] = _loads(rows[i, : sizes[i]], f"object from group rank {i}", weights_only)
    return objs


async def gather_objects(
    c_sizes: OpComm,
    c_data: OpComm,
    objs: list[Any] | None,
    mine: Array,
    root: int,
    weights_only: bool,
) -> list[Any] | None:
    """Gather every rank's pickled object into the root's ``objs``; return ``objs``."""
    # Every rank learns the largest size, so all contributions pad to one width.
    n = c_sizes.size
    sizes = np.zeros(n, np.int64)
    await all_gather(c_sizes, list(sizes.reshape(n, 1)), np.array([mine.size], np.int64))
    width = max(_checked_sizes(sizes, "gather_object"))
    rows = _bytes((n, width), "gather_object") if objs is not None else None
    await gather(c_data, None if rows is None else list(rows), _padded([mine], width)[0], root)
    if objs is not None and rows is not None:
        for i in range(n):
            objs[i] = _loads(rows[i, : sizes[i]], f"object from group rank {i}", weights_only)
    return objs


async def scatter_objects(
    c_sizes: OpComm,
    c_data: OpComm,
    outs: list[Any],
    payloads: list[Array],
    root: int,
    weights_only: bool,
) -> list[Any]:
    """Unpickle the root's ``payloads[i]`` into rank ``i``'s ``outs[0]``; return ``outs``."""
    mine = c_sizes.rank == root
    sizes = np.array([p.size for p in payloads] if mine else [0] * c_sizes.size, np.int64)
    await broadcast(c_sizes, sizes, root)
    width = max(_checked_sizes(sizes, "scatter_object_list", root))
    row = _bytes(width, "scatter_object_list")
    rows = list(_padded(payloads, width)) if mine else None
    await scatter(c_data, row, rows, root)
    outs[0] = _loads(row[: sizes[c_sizes.rank]], "scattered object", weights_only)
    return outs


def send_objects(comm: OpComm, peer: int, sizes: Array, data: Array) -> Coroutine[Any, Any, None]:
    """Send pickled objects to ``peer``: their sizes, then their bytes.

    Both messages take their place among the peer's now, as the operation is issued (a
    rejected send issued next must not overtake them); the coroutine waits for them.
    """
    # The sizes travel as step 0, like a tensor sent with the same tag (as in torch).
    sizes_sent = comm.send(peer, 0, byte_view(sizes))
    return _sent(asyncio.gather(sizes_sent, comm.send(peer, 1, byte_view(data))))


async def _sent(sends: asyncio.Future[Any]) -> None:
    await sends


async def recv_objects(
    comm: OpComm,
    peer: int | None,
    objs: list[Any],
    ranks: tuple[int, ...],
    group_ranks: bool,
    weights_only: bool,
) -> int:
    """Receive objects sent by :func:`send_objects` into ``objs``; return the sender.

    The sender is a group rank if ``group_ranks``, else a global rank (``ranks`` maps them).
    """
    sizes = np.zeros(len(objs), np.int64)
    sender = await comm.recv_into(peer, 0, byte_view(sizes))
    source = ranks.index(sender)
    data = _bytes(sum(_checked_sizes(sizes, "recv_object_list", source)), "recv_object_list")
    await comm.recv_into(source, 1, byte_view(data))
    offsets = np.cumsum([0, *sizes.tolist()])
    for i in range(len(objs)):
        objs[i] = _loads(data[offsets[i] : offsets[i + 1]], f"object_list[{i}]", weights_only)
    return source if group_ranks else sender
