"""CUDA devices as the backend drives them (cupy): streams, threads, events, gates, intake.

Per device, made on first use and shared by every group of the process:

* two non-blocking streams: ``d2h`` (device -> host copies) and ``h2d`` (host -> device
  copies, device copies and reductions); each group's NCCL communicator has its own;
* two worker threads: the *launcher*, which makes every cupy call that may stall (kernel
  launches, whose first use compiles; allocations, which may synchronize the device;
  pinned host allocations; IPC handles), and the *NCCL issuer*, which makes every NCCL call
  (init, enqueue, destroy: any of them can block until the peers arrive). Neither runs on
  an event loop, and each serves its calls in the order they were submitted;
* *gates* (:class:`OpEnd`): a stream made to wait for an operation whose device work is not
  enqueued yet (``Work.wait_stream`` right after the call) waits on a word of pinned host
  memory (``cuStreamWaitValue32``) that the operation's stream sets once its work is done
  (``cuStreamWriteValue32``), or the host sets if the operation fails first. No host
  thread ever blocks for it.

Completions are :class:`EventDone` objects (``cudaEventQuery``: 0 done, 600 pending, any
other status a CUDA error), watched by :mod:`aiodist.backends._progress`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import logging
import os
import queue
import socket
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import cupy
import numpy as np
from cupy.cuda import runtime

from .._arrays._intake import check_dtype
from .._arrays._reduce import ReduceOp
from ..errors import DistBackendError, DistError, DistUsageError
from ._cuda_tables import reduce_many
from ._progress import progress_thread

__all__ = [
    "CudaMover",
    "Device",
    "EventDone",
    "OpEnd",
    "as_device_array",
    "backend_error",
    "device",
    "flat_bytes",
    "host_identity",
    "load_nccl",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_NOT_READY = 600  # cudaErrorNotReady
_GATE_SLOTS = 1024
_WAIT_VALUE_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ
_DL_CUDA = 2
_DL_HOST = frozenset({1, 3, 13})  # CPU, CUDA pinned host, CUDA managed


def backend_error(exc: BaseException, what: str) -> DistError:
    """``exc`` (a cupy, CUDA or NCCL error) as a :class:`DistBackendError` naming ``what``."""
    if isinstance(exc, DistError):
        return exc
    error = DistBackendError(f"{what}: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


class EventDone:
    """A completion: a recorded CUDA event (see :mod:`aiodist.backends._progress`)."""

    __slots__ = ("event", "what")

    def __init__(self, event: Any, what: str) -> None:
        self.event = event
        self.what = what

    def query(self) -> bool:
        """Whether the event's work is done.

        Raises:
            DistBackendError: the device reported an error (a sticky one stays).
        """
        status = runtime.eventQuery(self.event.ptr)
        if status == 0:
            return True
        if status == _NOT_READY:
            return False
        raise backend_error(runtime.CUDARuntimeError(status), self.what)


class Worker:
    """A daemon thread that runs submitted calls in order, with its device current."""

    def __init__(self, name: str, index: int) -> None:
        self.name = name
        self._index = index
        self._queue: queue.SimpleQueue[
            tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None
        ] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<Worker {self.name}>"

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Queue ``fn``; its result or exception comes back through the future."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._queue.put((fn, future))
        return future

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the thread and return its result, without blocking the loop."""
        return await asyncio.wrap_future(self.submit(fn))

    def _run(self) -> None:
        cupy.cuda.Device(self._index).use()
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)
            del item, fn, future  # hold nothing of a finished call while idle


class _Driver:
    """The two CUDA driver calls cupy does not bind: stream memory operations."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self.wait_value = self._symbol(lib, "cuStreamWaitValue32")
        self.write_value = self._symbol(lib, "cuStreamWriteValue32")

    @staticmethod
    def _symbol(lib: ctypes.CDLL, name: str) -> Any:
        fn = getattr(lib, f"{name}_v2", None) or getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
        return fn

    @staticmethod
    def check(status: int, what: str) -> None:
        if status != 0:
            raise DistBackendError(f"{what} failed with CUDA driver error {status}")


class _Gates:
    """Words of pinned host memory that streams wait on (by UVA, one address for both)."""

    def __init__(self, index: int) -> None:
        with cupy.cuda.Device(index):
            self._ptr = runtime.hostAlloc(
                4 * _GATE_SLOTS, runtime.hostAllocMapped | runtime.hostAllocPortable
            )
        self.words = np.ctypeslib.as_array((ctypes.c_uint32 * _GATE_SLOTS).from_address(self._ptr))
        self.words[:] = 0
        self._tickets = [0] * _GATE_SLOTS
        self._free = list(range(_GATE_SLOTS))
        self._lock = threading.Lock()

    def take(self) -> tuple[int, int]:
        """A free slot and the ticket (a value above every earlier one of the slot) to wait for.

        Raises:
            DistBackendError: every slot is taken.
        """
        with self._lock:
            if not self._free:
                raise DistBackendError(
                    f"more than {_GATE_SLOTS} operations are waited on by streams before "
                    "their device work was issued"
                )
            slot = self._free.pop()
            self._tickets[slot] += 1
            return slot, self._tickets[slot]

    def address(self, slot: int) -> int:
        """The slot's address (host and device alike)."""
        return int(self._ptr) + 4 * slot

    def release(self, slot: int) -> None:
        """Return a slot whose ticket was written (streams waiting on it have passed)."""
        with self._lock:
            self._free.append(slot)


class Device:
    """One CUDA device's streams, worker threads and gates (one per device per process)."""

    def __init__(self, index: int) -> None:
        self.index = index
        with cupy.cuda.Device(index):
            self.d2h = cupy.cuda.Stream(non_blocking=True)
            self.h2d = cupy.cuda.Stream(non_blocking=True)
            self.pci_bus_id = str(runtime.deviceGetPCIBusId(index))
        self.launcher = Worker(f"aiodist-cuda{index}-launch", index)
        self.issuer = Worker(f"aiodist-cuda{index}-nccl", index)
        self._gates: _Gates | None = None
        self._driver: _Driver | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<CUDA device {self.index} ({self.pci_bus_id})>"

    def gates(self) -> tuple[_Gates, _Driver]:
        """The gate words and the driver calls, made on first use."""
        with self._lock:
            if self._gates is None or self._driver is None:
                self._driver = _Driver()
                self._gates = _Gates(self.index)
            return self._gates, self._driver

    def ready_event(self) -> Any:
        """Record an event on the caller's current stream: the operation starts after it."""
        with cupy.cuda.Device(self.index):
            event = cupy.cuda.Event(disable_timing=True)
            event.record(cupy.cuda.get_current_stream())
        return event

    def stream_pointer(self, stream: Any) -> int:
        """The ``cudaStream_t`` of ``stream``: ``None`` (cupy's current stream on this device),
        a cupy stream, an int, or any object with ``__cuda_stream__`` or ``cuda_stream``
        (torch's streams).

        Raises:
            DistUsageError: ``stream`` is none of those.
        """
        if stream is None:
            with cupy.cuda.Device(self.index):
                return int(cupy.cuda.get_current_stream().ptr)
        if isinstance(stream, int) and not isinstance(stream, bool):
            return stream
        if isinstance(getattr(stream, "ptr", None), int):
            return int(stream.ptr)
        protocol = getattr(stream, "__cuda_stream__", None)
        if protocol is not None:
            return int(protocol()[1])
        handle = getattr(stream, "cuda_stream", None)
        if isinstance(handle, int):
            return handle
        raise DistUsageError(
            f"wait_stream: {type(stream).__name__} is not a CUDA stream (pass a cupy stream, "
            "a torch.cuda.Stream, an object with __cuda_stream__, or None)"
        )


_devices: dict[int, Device] = {}
_devices_lock = threading.Lock()


def device(index: int) -> Device:
    """The process's :class:`Device` for CUDA device ``index``."""
    with _devices_lock:
        found = _devices.get(index)
        if found is None:
            found = _devices[index] = Device(index)
        return found


class OpEnd:
    """The end of one operation's device work, which streams can be made to wait for.

    Before the work is issued a waiting stream waits on a gate word; once it is issued, on
    the end event. Both are set by the device once the work is done, so the waits hold
    exactly until then.
    """

    def __init__(self, dev: Device, what: str) -> None:
        self._device = dev
        self.what = what
        self._lock = threading.Lock()
        self._event: Any = None
        self._gate: tuple[int, int] | None = None
        self._failed = False

    def __repr__(self) -> str:
        state = "recorded" if self._event is not None else "failed" if self._failed else "pending"
        return f"<OpEnd {self.what} {state}>"

    def record(self, stream: Any) -> EventDone:
        """Mark the end of the work queued on ``stream`` (call after queuing all of it)."""
        with cupy.cuda.Device(self._device.index):
            event = cupy.cuda.Event(disable_timing=True)
            event.record(stream)
            with self._lock:
                self._event = event
                if self._gate is not None:
                    gates, driver = self._device.gates()
                    slot, ticket = self._gate
                    driver.check(
                        driver.write_value(stream.ptr, gates.address(slot), ticket, 0),
                        "cuStreamWriteValue32",
                    )
        return EventDone(event, self.what)

    def finished(self) -> None:
        """The recorded work is done: the gate (if any) was written and can be reused."""
        with self._lock:
            gate, self._gate = self._gate, None
        if gate is not None:
            self._device.gates()[0].release(gate[0])

    def fail(self) -> None:
        """The operation ends without (more) device work: release the streams waiting for it."""
        with self._lock:
            if self._event is not None or self._failed:
                return
            self._failed = True
            gate, self._gate = self._gate, None
        if gate is not None:
            gates = self._device.gates()[0]
            gates.words[gate[0]] = gate[1]
            gates.release(gate[0])

    def device_sync(self, stream: Any = None) -> None:
        """Make ``stream`` wait for the operation's device work, without blocking the host.

        Raises:
            DistUsageError: ``stream`` is not a CUDA stream.
            DistBackendError: the driver refused the wait.
        """
        ptr = self._device.stream_pointer(stream)
        with cupy.cuda.Device(self._device.index), self._lock:
            if self._event is not None:
                runtime.streamWaitEvent(ptr, self._event.ptr)
                return
            if self._failed:
                return  # nothing was or will be issued; the Work carries the error
            gates, driver = self._device.gates()
            if self._gate is None:
                self._gate = gates.take()
            slot, ticket = self._gate
            driver.check(
                driver.wait_value(ptr, gates.address(slot), ticket, _WAIT_VALUE_GEQ),
                "cuStreamWaitValue32",
            )


class CudaMover:
    """The staged and IPC paths' device steps for one operation (see ``Mover``).

    Each step is launched on the device's launcher thread and awaited through the progress
    thread; both copy streams first wait for the operation's ready event.
    """

    def __init__(self, dev: Device, ready: Any, what: str) -> None:
        self._device = dev
        self._ready = ready
        self._started = False
        self._what = what
        self._last: Any = None

    def _start(self) -> None:
        if not self._started:
            runtime.streamWaitEvent(self._device.d2h.ptr, self._ready.ptr)
            runtime.streamWaitEvent(self._device.h2d.ptr, self._ready.ptr)
            self._started = True

    async def _step(self, stream: Any, launch: Callable[[], None]) -> None:
        def work() -> Any:
            self._start()
            with stream:
                launch()
            event = cupy.cuda.Event(disable_timing=True)
            event.record(stream)
            return event

        event = await self._device.launcher.run(work)
        self._last = event
        await progress_thread().wait(EventDone(event, self._what), what=self._what)

    async def host(self, nbytes: int) -> Any:
        """Pinned host memory (a numpy array)."""
        import cupyx

        return await self._device.launcher.run(lambda: cupyx.empty_pinned((nbytes,), np.uint8))

    async def scratch(self, nbytes: int) -> Any:
        """Device memory from cupy's pool, tied to the ``h2d`` stream."""

        def allocate() -> Any:
            with self._device.h2d:
                return cupy.empty(nbytes, cupy.uint8)

        return await self._device.launcher.run(allocate)

    async def to_host(self, pairs: Sequence[tuple[Any, Any]]) -> None:
        """Device -> pinned host copies on ``d2h``."""
        stream = self._device.d2h

        def launch() -> None:
            for dst, src in pairs:
                if src.nbytes:
                    runtime.memcpyAsync(
                        dst.ctypes.data,
                        src.data.ptr,
                        src.nbytes,
                        runtime.memcpyDeviceToHost,
                        stream.ptr,
                    )

        await self._step(stream, launch)

    async def to_device(self, pairs: Sequence[tuple[Any, Any]]) -> None:
        """Pinned host -> device copies on ``h2d``."""
        stream = self._device.h2d

        def launch() -> None:
            for dst, src in pairs:
                if src.nbytes:
                    runtime.memcpyAsync(
                        dst.data.ptr,
                        src.ctypes.data,
                        src.nbytes,
                        runtime.memcpyHostToDevice,
                        stream.ptr,
                    )

        await self._step(stream, launch)

    async def copy(self, pairs: Sequence[tuple[Any, Any]]) -> None:
        """Device -> device copies on ``h2d`` (peers' slabs included)."""
        stream = self._device.h2d

        def launch() -> None:
            for dst, src in pairs:
                if src.nbytes:
                    runtime.memcpyAsync(
                        dst.data.ptr, src.data.ptr, src.nbytes, runtime.memcpyDefault, stream.ptr
                    )

        await self._step(stream, launch)

    async def reduce(
        self, op: ReduceOp, dtype: np.dtype[Any], out: Any, ins: list[Any], factor: float | None
    ) -> None:
        """Reduce on the device, on ``h2d``."""
        await self._step(
            self._device.h2d, lambda: reduce_many(cupy, op, dtype, out, ins, factor=factor)
        )

    async def finish(self, end: OpEnd) -> EventDone:
        """Record the operation's end after everything it queued."""

        def record() -> EventDone:
            self._start()
            return end.record(self._device.h2d)

        return await self._device.launcher.run(record)

    def last(self) -> EventDone | None:
        """The last step's event (memory of a cancelled operation is kept until it is done)."""
        return None if self._last is None else EventDone(self._last, self._what)


# -- intake ------------------------------------------------------------------------------------
def as_device_array(x: object, name: str) -> Any:
    """Return ``x`` as a C-contiguous cupy array on its device, sharing its memory.

    Takes cupy arrays, DLPack producers on a CUDA device (torch CUDA tensors, through
    ``cupy.from_dlpack``, which also orders the producer's stream before cupy's current one
    and carries bfloat16 unambiguously), then objects with only
    ``__cuda_array_interface__`` (numba, ...).

    Raises:
        DistUsageError: anything else, an unsupported dtype, or an array that is not
            C-contiguous. The message names the argument.
    """
    if isinstance(x, cupy.ndarray):
        arr = x
    elif hasattr(x, "__dlpack__"):
        try:
            kind = int(x.__dlpack_device__()[0])  # type: ignore[attr-defined]
        except Exception as exc:
            raise DistUsageError(f"{name}: __dlpack_device__() failed: {exc}") from exc
        if kind in _DL_HOST:
            raise DistUsageError(
                f"{name} ({type(x).__name__}) lives in host memory, but the CUDA backend takes "
                "CUDA arrays; a group made with backend=None or 'cpu:gloo,cuda:nccl' sends "
                "host arrays to the CPU backend"
            )
        if kind != _DL_CUDA:
            raise DistUsageError(
                f"{name} ({type(x).__name__}) lives on DLPack device type {kind}, not on a "
                "CUDA device; the CUDA backend takes device memory"
            )
        try:
            arr = cupy.from_dlpack(x)
        except Exception as exc:
            raise DistUsageError(
                f"{name} ({type(x).__name__}) cannot be viewed by cupy through DLPack: {exc}"
            ) from exc
    elif hasattr(x, "__cuda_array_interface__"):  # numba and others without DLPack
        try:
            arr = cupy.asarray(x)
        except Exception as exc:
            raise DistUsageError(f"{name} ({type(x).__name__}): {exc}") from exc
    else:
        raise DistUsageError(
            f"{name} must be a CUDA array (cupy, __cuda_array_interface__ or a CUDA DLPack "
            f"tensor), got {type(x).__name__}"
        )
    check_dtype(arr.dtype, name)
    if not arr.flags.c_contiguous:
        raise DistUsageError(
            f"{name} is not C-contiguous; pass a contiguous array (cupy.ascontiguousarray(a), "
            "or tensor.contiguous() for a torch tensor) and copy the result back"
        )
    return arr


def flat_bytes(a: Any) -> Any:
    """A flat uint8 view of a contiguous cupy array (any dtype, 0-d and empty included)."""
    return a.reshape(-1).view(cupy.uint8)


def load_nccl() -> Any:
    """cupy's NCCL module if NCCL loads here, else ``None`` (cupy's warning is silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from cupy.cuda import nccl
        except ImportError:
            return None
    return nccl if getattr(nccl, "available", False) else None


def host_identity() -> str:
    """This host, as the IPC path sees it: host name and boot id."""
    boot = ""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return f"{socket.gethostname()}/{boot}"


def process_id() -> int:
    """This process's id (ranks of one process share device pointers without IPC)."""
    return os.getpid()
