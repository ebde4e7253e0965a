"""Backends: per device kind, a table of operations, and the dispatch of each call to one.

A :class:`Backend` maps each operation name to its *validate function*,
``validate(group, *args) -> Plan``: it checks the arguments as only this rank can, and
returns the :class:`~aiodist.group.Plan` to run (the algorithm, its checked arguments and the
call's fingerprint). The built-in backends are made with :meth:`Backend.from_paths`: an
array intake, and a data path per algorithm; every operation of
:data:`aiodist.group._operations.OPERATIONS` whose algorithm has a path is then in the table, its
argument rules written once above the backends. A process group holds the name of the backend serving each device kind
(``{"cpu": "cpu"}`` for ``backend="gloo"``); :func:`plan` finds where a call's arrays live and
hands the call to that backend. A backend plugs in with :func:`register_backend` (or is built
in: ``"cpu"``, and ``"cuda"`` loaded on first use), without touching the public API.

May import: the group core, the collectives, the transports, the stores,
:mod:`aiodist._arrays`, :mod:`aiodist._util` and :mod:`aiodist.errors`.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._arrays._intake import CUDA_INSTALL_HINT
from ..collectives._shared_array import check as check_shape_and_dtype
from ..errors import DistUsageError
from ..group._operations import OPERATIONS, Call, Intake
from ..group._work import Plan, rejected_on_transport

if TYPE_CHECKING:
    from ..group import ProcessGroup

__all__ = [
    "Backend",
    "Reject",
    "available",
    "device_of",
    "is_backend_available",
    "load",
    "parse_backend",
    "plan",
    "register_backend",
    "reject",
    "rejected_on_transport",
    "setup",
]

logger = logging.getLogger(__name__)

#: ``validate(group, *args) -> Plan``.
Validate = Callable[..., "Plan"]
#: ``path(group, call) -> Plan``: runs one algorithm's checked calls on a backend's data path.
Path = Callable[["ProcessGroup", Call], "Plan"]
#: ``reject(group, algorithm, error, tell) -> Plan``: the plan of a rejected call of an
#: operation that runs ``algorithm`` (``None``: not an operation of the table); see
#: :func:`reject`.
Reject = Callable[["ProcessGroup", str | None, BaseException, bool], "Plan"]

# DLPack device types (dlpack.h, DLDeviceType): host memory, and CUDA device memory.
HostArray = np.ndarray[Any, np.dtype[Any]]

_DL_HOST = frozenset({1, 3, 13})  # CPU, CUDA pinned host, CUDA managed
_DL_CUDA = 2


class Backend:
    """A table of operations for one kind of device.

    Args:
        name: the backend's name (``"cpu"``).
        device: the device kind whose arrays it takes (``"cpu"``, ``"cuda"``).
        ops: operation name -> validate function.
        setup: awaited by every member of each new group, before its first operation
            (collective: e.g. to map a shared-memory workspace for it).
        empty: ``empty(group, shape, dtype, zeroed)``: an array that this backend's
            collectives of ``group`` read in place (:func:`aiodist.empty`); ``None``:
            ordinary arrays.
        reject: the plan of a rejected call (``Reject``: see ``aiodist.backends.reject``); by default
            the peers are told over the transport, for a backend whose paths keep no order
            of their own.
    """

    def __init__(
        self,
        name: str,
        device: str,
        ops: Mapping[str, Validate] | None = None,
        setup: Callable[[ProcessGroup], Awaitable[None]] | None = None,
        empty: Callable[[ProcessGroup, tuple[int, ...], np.dtype[Any], bool], HostArray]
        | None = None,
        reject: Reject | None = None,
    ) -> None:
        self.name = name
        self.device = device
        self.ops: dict[str, Validate] = dict(ops or {})
        #: Awaited once per group, collectively, before its first operation.
        self.setup = setup
        self.empty = empty
        self.reject: Reject = reject or rejected_on_transport

    def __repr__(self) -> str:
        return f"<Backend {self.name} device={self.device} ops={len(self.ops)}>"

    @classmethod
    def from_paths(
        cls,
        name: str,
        device: str,
        intake: Intake,
        paths: Mapping[str, Path],
        setup: Callable[[ProcessGroup], Awaitable[None]] | None = None,
        empty: Callable[[ProcessGroup, tuple[int, ...], np.dtype[Any], bool], HostArray]
        | None = None,
        reject: Reject | None = None,
    ) -> Backend:
        """A backend made of an array intake and a data path per algorithm.

        Its table holds every operation whose algorithm has a path in ``paths``: a call is
        checked by the operation (with ``intake``), then planned by the path.
        """
        backend = cls(name, device, setup=setup, empty=empty, reject=reject)
        for operation in OPERATIONS.values():
            path = paths.get(operation.algorithm)
            if path is not None:
                backend.ops[operation.name] = _validate(operation.check, intake, path)
        return backend

    def op(self, name: str) -> Callable[[Validate], Validate]:
        """Decorator: register the decorated function as the validate function of ``name``."""

        def register(fn: Validate) -> Validate:
            self.ops[name] = fn
            return fn

        return register


def _validate(check: Callable[..., Call], intake: Intake, path: Path) -> Validate:
    def validate(group: ProcessGroup, *args: Any) -> Plan:
        return path(group, check(intake, group, *args))

    return validate


# name -> module path that defines BACKEND, or the backend itself once loaded.
_BUILTIN = {"cpu": "aiodist.backends.cpu", "cuda": "aiodist.backends.cuda"}
_ALIASES = {"gloo": "cpu", "nccl": "cuda"}
_registry: dict[str, Backend | str] = dict(_BUILTIN)


def register_backend(name: str, backend: Backend) -> None:
    """Make ``backend`` available as ``init_process_group(backend=name)``.

    ``name`` may also appear in the per-device form: ``"cpu:<name>"``.

    Raises:
        DistUsageError: ``name`` is empty, contains ``:`` or ``,``, or is taken.
    """
    if not isinstance(name, str) or not name or ":" in name or "," in name:
        raise DistUsageError(f"a backend name must be a non-empty word, got {name!r}")
    key = name.lower()
    if key in _registry or key in _ALIASES:
        raise DistUsageError(f"backend {name!r} is registered already")
    _registry[key] = backend


def load(name: str) -> Backend:
    """Return the backend registered as ``name``, importing a built-in one on first use.

    Raises:
        DistUsageError: no such backend, or it cannot be used on this machine (the message
            says what to install).
    """
    entry = _registry.get(name)
    if entry is None:
        raise DistUsageError(f"unknown backend {name!r}")
    if isinstance(entry, Backend):
        return entry
    try:
        backend: Backend = importlib.import_module(entry).BACKEND
    except ImportError as exc:
        hint = f" ({CUDA_INSTALL_HINT})" if name == "cuda" else ""
        raise DistUsageError(f"the {name!r} backend cannot be loaded: {exc}{hint}") from exc
    _registry[name] = backend
    return backend


def is_backend_available(name: str) -> bool:
    """Return whether backend ``name`` (or alias) can run here, without importing it."""
    key = _ALIASES.get(name, name)
    entry = _registry.get(key)
    if entry is None:
        return False
    if key == "cuda" and not isinstance(entry, Backend):
        return importlib.util.find_spec("cupy") is not None
    return True


def parse_backend(spec: str | None) -> tuple[str, dict[str, str]]:
    """Return the canonical name of ``spec`` and the backend serving each device kind.

    ``None`` means every built-in backend available here (the CUDA one only with cupy
    installed); ``"cpu"``/``"gloo"``, ``"cuda"``/``"nccl"``, a registered name, or torch's
    per-device form ``"cpu:gloo,cuda:nccl"``.

    Raises:
        DistUsageError: an unknown backend, or a backend named for the wrong device.
    """
    if spec is None:
        devices = {"cpu": "cpu"}
        if is_backend_available("cuda"):
            devices["cuda"] = "cuda"
        return _name(devices), devices
    if not isinstance(spec, str):
        raise DistUsageError(f"backend must be a string or None, got {type(spec).__name__}")
    text = spec.strip().lower()
    devices = {}
    for part in (p.strip() for p in text.split(",")):
        device, _, impl = part.rpartition(":")
        name = _ALIASES.get(impl, impl)
        if name not in _registry:
            raise DistUsageError(
                f"unknown backend {spec!r}: expected 'cpu' (alias 'gloo'), 'cuda' (alias "
                "'nccl'), a registered backend, or a per-device form such as "
                "'cpu:gloo,cuda:nccl'"
            )
        kind = _device_of_backend(name)
        if device and device != kind:
            raise DistUsageError(f"backend {spec!r}: {impl!r} cannot serve {device!r} arrays")
        devices[kind] = name
    return _name(devices), devices


def available(spec: str | None) -> tuple[str, dict[str, str]]:
    """Like :func:`parse_backend`, keeping only the backends that can run here.

    A backend named alone must load (an error says what to install); in a per-device form
    such as ``"cpu:gloo,cuda:nccl"`` one that cannot is left out (calls with arrays of its
    device then say what is missing), as long as one remains.

    Raises:
        DistUsageError: an unknown backend, or none of those named can run here.
    """
    name, devices = parse_backend(spec)
    if len(devices) == 1:
        load(next(iter(devices.values())))
        return name, devices
    usable = {d: n for d, n in devices.items() if is_backend_available(n)}
    if not usable:
        load(next(iter(devices.values())))  # raises, naming what to install
    for backend in usable.values():
        load(backend)
    if len(usable) < len(devices):
        logger.info(
            "backend %r: %s cannot run here and is left out", spec, set(devices) - set(usable)
        )
    return _name(usable), usable


def _device_of_backend(name: str) -> str:
    if name in _BUILTIN:
        return name
    return load(name).device


def _name(devices: Mapping[str, str]) -> str:
    if len(devices) == 1:
        return next(iter(devices.values()))
    return ",".join(f"{d}:{n}" for d, n in devices.items())


def device_of(op: str, args: Sequence[Any]) -> str | None:
    """Return where the arrays among ``args`` live (``"cpu"`` or ``"cuda"``); ``None`` if none.

    numpy arrays are host memory; an object with ``__cuda_array_interface__`` (cupy, numba)
    is CUDA memory; an object with ``__dlpack__`` says where it lives through
    ``__dlpack_device__`` (torch tensors, JAX arrays). Lists of arrays are looked into.

    Raises:
        DistUsageError: arrays on different devices.
    """
    found: str | None = None
    for arg in args:
        kind = _kind(arg)
        if kind is None and isinstance(arg, list | tuple):
            for item in arg:
                item_kind = _kind(item)
                if item_kind is not None:
                    if kind is not None and item_kind != kind:
                        raise _mixed(op, kind, item_kind)
                    kind = item_kind
        if kind is not None:
            if found is not None and kind != found:
                raise _mixed(op, found, kind)
            found = kind
    return found


# Argument types that are never arrays (checked first: most arguments are these).
_SCALARS = frozenset({int, float, bool, str, bytes, type(None)})


def _kind(x: object) -> str | None:
    kind = type(x)
    if kind is np.ndarray:
        return "cpu"
    if kind in _SCALARS or isinstance(x, int):  # ints, and IntEnums such as ReduceOp
        return None
    if isinstance(x, np.ndarray):
        return "cpu"
    if hasattr(x, "__cuda_array_interface__"):
        return "cuda"
    device = getattr(x, "__dlpack_device__", None)
    if device is None:
        return None
    try:
        device_type = int(device()[0])
    except Exception:
        return "cpu"  # let the backend's intake report what is wrong with it
    if device_type in _DL_HOST:
        return "cpu"
    return "cuda" if device_type == _DL_CUDA else f"dlpack-device-{device_type}"


def _mixed(op: str, first: str, second: str) -> DistUsageError:
    return DistUsageError(
        f"{op}: the arrays live on different devices ({first} and {second}); every array "
        "of one call must be on the same device"
    )


async def setup(group: ProcessGroup) -> None:
    """Let each backend of a new group set it up; collective over the group's members.

    Returns on no member before every member is done: the setup talks through the store,
    whose server may run on a member's event loop, and that loop need not run once setup
    has returned there.

    Raises:
        DistError: a backend could not (a peer went away, the store cannot be reached).
    """
    what = f"setting up process group {group.group_id}"
    for name in group.backends.values():
        backend_setup = load(name).setup
        if backend_setup is not None:
            # (A member that dies before it publishes its part is waited for in the store:
            # its lost connections break the world, which ends the wait.)
            await group.world.domain.unless_broken(backend_setup(group), what)
    await group.world.domain.meet(f"set_up/{group.group_id}", group.size, group.timeout, what)


def empty(group: ProcessGroup, name: str, shape: object, dtype: Any, *, zeroed: bool) -> HostArray:
    """A host array for ``group``'s collectives (:func:`aiodist.empty` and ``zeros``, the
    call named ``name``): from the backend that serves the group's host arrays, when it
    allocates its own, else an ordinary numpy array.

    Raises:
        DistUsageError: a bad shape or dtype, named after ``name``.
    """
    try:
        dims, dt = check_shape_and_dtype(shape, dtype)
    except DistUsageError as exc:
        raise DistUsageError(f"{name}: {exc}") from None
    served = group.backends.get("cpu")
    allocate = load(served).empty if served is not None else None
    if allocate is not None:
        return allocate(group, dims, dt, zeroed)
    return np.zeros(dims, dt) if zeroed else np.empty(dims, dt)


def plan(group: ProcessGroup, op: str, args: tuple[Any, ...]) -> Plan:
    """Check a call of ``op`` with the backend that serves its arrays; return its plan.

    The device is that of the array arguments; calls without arrays (barrier, object
    collectives) go to the CPU backend when the group has one. A group served by one
    backend hands it every call.

    Raises:
        DistUsageError: the arrays' device has no backend in this group, the backend does
            not implement ``op``, or the backend's checks failed.
    """
    devices = group.backends
    if len(devices) == 1:
        # One backend serves the group: its own intake refuses arrays of another device,
        # naming the argument, so the device need not be worked out here.
        name: str | None = next(iter(devices.values()))
        device = next(iter(devices))
    else:
        device = device_of(op, args) or ("cpu" if "cpu" in devices else next(iter(devices)))
        name = devices.get(device)
    if name is None:
        raise DistUsageError(
            f"{op}: the arrays live on {device}, but the group's backend {group.backend!r} "
            f"serves {' and '.join(group.backends)} arrays"
            + (
                f"; the CUDA backend needs cupy: {CUDA_INSTALL_HINT}"
                if device == "cuda" and not is_backend_available("cuda")
                else ""
            )
        )
    backend = _registry.get(name)
    if not isinstance(backend, Backend):  # not loaded yet (or unknown: load says so)
        backend = load(name)
    validate = backend.ops.get(op)
    if validate is None:
        raise DistUsageError(f"{op}: the {name!r} backend does not implement it")
    return validate(group, *args)


def reject(group: ProcessGroup, op: str, error: BaseException, tell: bool) -> Plan:
    """The plan that takes the place of a call of ``op`` that ``group`` rejects.

    Its place on the group's data path is the one an accepted call of ``op`` would take,
    whatever the call's arguments were, so the ranks' sequences stay the same; it tells the
    peers why when ``tell`` (this rank rejected the call; otherwise a peer did, and the
    peers know), then fails with ``error``, marked as failing this operation only. The
    group's backend decides (a group served by several backends: its CPU one, whose paths
    then keep no order of their own).
    """
    served = group.backends
    name = next(iter(served.values())) if len(served) == 1 else served.get("cpu")
    if name is None:
        return rejected_on_transport(group, None, error, tell)
    backend = _registry.get(name)
    if not isinstance(backend, Backend):
        backend = load(name)
    spec = OPERATIONS.get(op)
    return backend.reject(group, None if spec is None else spec.algorithm, error, tell)
