"""The CUDA backend: cupy arrays (and CUDA DLPack tensors) over CUDA streams.

Its intake (:func:`~aiodist.backends._cuda_device.as_device_array`) takes device arrays;
the operations' argument rules are in :mod:`aiodist.group._operations`. For each algorithm's
checked call, its path records a *ready* event on the caller's current stream (the
operation starts after the work queued there, as in torch) and returns a
:class:`~aiodist.group.Plan` that runs it on the group's data path:

* ``nccl``: one NCCL communicator per group, its unique id passed through the world's
  store; calls issued on the device's NCCL thread, in sequence order;
* ``ipc``: ranks of one host map each other's exchange buffers (:mod:`._cuda_ipc`);
* ``staged``: through pinned host memory and the CPU transport (:mod:`._cuda_staged`).

The path is agreed at the group's first CUDA operation (:mod:`._cuda_path`;
``AIODIST_CUDA_PATH`` forces one) and shows in :func:`data_path` and in the repr of
:func:`group_state`. What NCCL cannot do (bitwise reductions, int16, integer means, point
to point) takes the staged path whatever the group's path is; what the IPC path does not
cover (all_to_all, point to point) too.

The operation's task ends when its device work is done, as the progress thread observes
(:mod:`aiodist.backends._progress`); ``work.wait_stream(stream)`` makes a stream wait for it with no
host block, before or after the work is issued (:class:`~._cuda_device.OpEnd`). The arrays
stay referenced until then (and, for an operation cancelled part-way, until its last device
step is done). A CUDA or NCCL error (an asynchronous NCCL error included, checked every
100 ms while work is pending) fails the operation with ``DistBackendError`` and aborts the
world; every rank's communicators are then aborted (the abort reaches the other ranks
through the store).

Barriers and object collectives run on the CPU (their objects travel over the CPU
transport): the backend takes the CPU backend's paths for them.

bfloat16: cupy has no bfloat16 arithmetic, so the device reduces its uint16 bit patterns
through float32 and rounds once to the nearest even bfloat16 (NCCL reduces it natively).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import cupy
from cupy.cuda import runtime

from .._arrays._reduce import ReduceOp
from ..errors import DistBackendError, DistTimeoutError, DistUsageError
from ..group import Plan, ProcessGroup
from ..group._operations import HOST_ALGORITHMS, Call
from ..transport.base import OpComm
from . import Backend, cpu
from ._cuda_device import (
    CudaMover,
    Device,
    EventDone,
    OpEnd,
    as_device_array,
    backend_error,
    device,
    flat_bytes,
    host_identity,
    load_nccl,
    process_id,
)
from ._cuda_ipc import (
    ipc_all_gather,
    ipc_all_reduce,
    ipc_broadcast,
    ipc_gather,
    ipc_reduce,
    ipc_reduce_scatter,
    ipc_scatter,
)
from ._cuda_path import RankInfo, agree_ipc, agree_path, forced_path, shared_gpu_ok
from ._cuda_staged import (
    staged_all_gather,
    staged_all_reduce,
    staged_all_to_all,
    staged_broadcast,
    staged_gather,
    staged_recv,
    staged_reduce,
    staged_reduce_scatter,
    staged_scatter,
    staged_send,
)
from ._cuda_tables import NcclCall, nccl_plan, reduce_many
from ._progress import progress_thread

__all__ = ["BACKEND", "IPC_SLAB_BYTES", "data_path", "group_state", "take"]

logger = logging.getLogger(__name__)

#: Bytes of each rank's IPC exchange buffer (``AIODIST_CUDA_IPC_BYTES`` overrides it).
IPC_SLAB_BYTES = 64 << 20
_NCCL_UINT8 = 1
_NAME = "cuda"  # the backend's name, which keys its state in a group's paths

NcclLaunch = Callable[[Any, int], None]
IpcRun = Callable[[OpComm, CudaMover, Sequence[Any]], Awaitable[Any]]
StagedRun = Callable[[OpComm, CudaMover], Awaitable[Any]]


# -- per-group state -------------------------------------------------------------------------------
class GroupState:
    """One group's CUDA side on this rank: its device, data path and path resources (the
    group's :class:`~aiodist.group.DataPath` for the CUDA backend, made at its first CUDA
    operation)."""

    def __init__(self, group: ProcessGroup, dev: Device) -> None:
        self.group = group
        self.device = dev
        self.path: str | None = None
        #: IPC: one operation at a time, in sequence order (they share the slabs).
        self.lock = asyncio.Lock()
        self.comm: Any = None
        #: The stream of this group's NCCL kernels: one per communicator, so that two
        #: groups' operations never wait for each other in a shared stream.
        self.stream: Any = None
        self.slabs: list[Any] = []
        self._slab_memory: Any = None
        self._imported: list[int] = []
        self._setup: asyncio.Task[str] | None = None
        self._ended: asyncio.Future[BaseException | None] | None = None
        self._remove_check: Callable[[], None] | None = None
        self._watcher: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return (
            f"<CUDA group {self.group.group_id} rank={self.group.rank}/{self.group.size} "
            f"cuda:{self.device.index} path={self.path or 'undecided'}>"
        )

    async def ready(self) -> str:
        """The group's path, agreed with the other ranks on first use.

        Operations that wait here resume in the order they came (sequence order).

        Raises:
            DistUsageError: the ranks could not agree (a forced path that cannot work).
            DistBackendError: setting the path up failed.
        """
        if self._setup is None:
            self._setup = asyncio.get_running_loop().create_task(self._agree())
        # A cancelled operation must not cancel the setup every operation shares.
        return await asyncio.shield(self._setup)

    async def _agree(self) -> str:
        group, world = self.group, self.group.world
        loop = asyncio.get_running_loop()
        self._ended = loop.create_future()
        self._watcher = loop.create_task(self._watch())
        prefix = f"cuda/{group.group_id}"
        try:
            forced = forced_path()
        except DistUsageError:
            forced = os.environ.get("AIODIST_CUDA_PATH", "").strip().lower()
        # Loading NCCL opens a shared library: not on the loop.
        nccl, version = await self.device.launcher.run(_nccl_and_version)
        info = RankInfo(
            host=host_identity(),
            gpu=self.device.pci_bus_id,
            nccl=version,
            shared_gpu_ok=shared_gpu_ok(version),
            forced=forced,
        )
        path, _ = await agree_path(
            world.store, prefix, group.rank, group.size, info, timeout=group.timeout
        )
        if path == "ipc":
            problem = await agree_ipc(
                world.store,
                prefix,
                group.rank,
                group.size,
                await self._open_ipc(prefix),
                timeout=group.timeout,
            )
            if problem is not None:
                await self._close_ipc()
                if forced == "ipc":
                    raise DistBackendError(f"AIODIST_CUDA_PATH=ipc: CUDA IPC failed on {problem}")
                logger.warning("%r: CUDA IPC failed on %s; staging instead", self, problem)
                path = "staged"
        if path == "nccl":
            await self._init_nccl(nccl, prefix)
        self.path = path
        logger.info("%r", self)
        return path

    # -- NCCL ----------------------------------------------------------------------------
    async def _init_nccl(self, nccl: Any, prefix: str) -> None:
        group, store = self.group, self.group.world.store
        key = f"{prefix}/nccl-uid"
        if group.rank == 0:
            uid = await self.device.issuer.run(nccl.get_unique_id)
            await store.set(key, bytes(b & 0xFF for b in uid))
        await store.wait([key], group.timeout)
        raw = await store.get(key)
        # cupy 14 takes the id as bytes; earlier releases as a tuple of signed chars.
        uid_arg: Any = (
            raw
            if int(cupy.__version__.split(".")[0]) >= 14
            else tuple(b - 256 if b > 127 else b for b in raw)
        )
        size, rank = group.size, group.rank
        with cupy.cuda.Device(self.device.index):
            self.stream = cupy.cuda.Stream(non_blocking=True)
        init = self.device.issuer.run(lambda: nccl.NcclCommunicator(size, uid_arg, rank))
        try:
            self.comm = await asyncio.wait_for(init, group.timeout)
        except TimeoutError:
            raise DistTimeoutError(
                f"{self!r}: NCCL did not set up the communicator within {group.timeout:g} s "
                "(a rank did not join)"
            ) from None
        except Exception as exc:
            raise backend_error(exc, f"{self!r}: NCCL communicator setup") from exc
        loop = asyncio.get_running_loop()
        comm = self.comm

        def on_error(exc: BaseException) -> None:
            error = backend_error(exc, f"NCCL reported an asynchronous error on {self!r}")
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self.group.world.abort, error)

        self._remove_check = progress_thread().add_check(comm.check_async_error, on_error)

    # -- IPC -----------------------------------------------------------------------------
    async def _open_ipc(self, prefix: str) -> str | None:
        """Export this rank's slab and map the others'; return what failed, if anything."""
        group, store = self.group, self.group.world.store
        # At least 64 KiB: every rank's region of a slab stays 256-aligned and non-empty.
        size = max(int(os.environ.get("AIODIST_CUDA_IPC_BYTES", IPC_SLAB_BYTES)), 1 << 16)
        index = self.device.index

        def export() -> tuple[Any, bytes]:
            memory = cupy.cuda.Memory(size)
            return memory, bytes(runtime.ipcGetMemHandle(memory.ptr))

        try:
            self._slab_memory, handle = await self.device.launcher.run(export)
            problem = None
        except Exception as exc:
            handle, problem = b"", f"cudaIpcGetMemHandle: {exc}"
        ptr = int(self._slab_memory.ptr) if problem is None else 0
        record = json.dumps({"pid": process_id(), "handle": handle.hex(), "size": size, "ptr": ptr})
        await store.set(f"{prefix}/ipc-slab/{group.rank}", record)
        keys = [f"{prefix}/ipc-slab/{r}" for r in range(group.size)]
        await store.wait(keys, group.timeout)
        records = [json.loads(raw) for raw in await store.multi_get(keys)]
        if problem is not None:
            return problem
        if any(not r["handle"] or r["size"] != size for r in records):
            return "the ranks' exchange buffers differ (AIODIST_CUDA_IPC_BYTES must match)"

        def open_all() -> list[Any]:
            views = []
            for r, rec in enumerate(records):
                if r == group.rank or rec["pid"] == process_id():
                    ptr = int(rec["ptr"])  # one process: the pointer is valid as it is
                else:
                    ptr = runtime.ipcOpenMemHandle(bytes.fromhex(rec["handle"]))
                    self._imported.append(ptr)
                memory = cupy.cuda.UnownedMemory(ptr, size, self, index)
                views.append(cupy.ndarray((size,), cupy.uint8, cupy.cuda.MemoryPointer(memory, 0)))
            return views

        try:
            self.slabs = await self.device.launcher.run(open_all)
        except Exception as exc:
            return f"cudaIpcOpenMemHandle: {exc}"
        return None

    async def _close_ipc(self) -> None:
        imported, self._imported = self._imported, []
        memory, self._slab_memory = self._slab_memory, None
        self.slabs = []

        def close() -> None:
            for ptr in imported:
                with contextlib.suppress(Exception):
                    runtime.ipcCloseMemHandle(ptr)

        await self.device.launcher.run(close)
        del memory  # freed after the peers' mappings of this process are closed

    # -- completion and failure ------------------------------------------------------------
    async def wait_device(self, done: EventDone) -> None:
        """Wait until ``done`` completes, or fail at once if the world is aborted meanwhile.

        Raises:
            DistBackendError: the device reported an error, or the world was aborted.
        """
        future = progress_thread().watch(done, what=done.what)
        ended = self._ended
        if ended is None:
            await future
            return
        waiters: list[asyncio.Future[Any]] = [future, ended]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if future.done():
            future.result()
            return
        future.cancel()
        cause = ended.result()
        raise DistBackendError(f"{done.what}: the process group was aborted: {cause}")

    async def _watch(self) -> None:
        cause = await self.group.world.domain.wait_ended()
        if cause is not None:
            self.abort(cause)
        else:
            await self.aclose()

    # -- the group's data path (``group.paths["cuda"]``) -------------------------------------
    def abort(self, cause: BaseException) -> None:
        """Fail what waits for the device and abort the communicator (every rank does, as
        its world aborts)."""
        self._end(cause)
        comm, self.comm = self.comm, None
        if comm is not None:
            # ncclCommAbort can hang: a throwaway thread, never the loop or the issue thread.
            threading.Thread(
                target=_abort_comm, args=(comm,), name="aiodist-nccl-abort", daemon=True
            ).start()

    async def aclose(self) -> None:
        """Destroy the communicator and unmap the IPC buffers (the group is destroyed, or its
        world closed)."""
        self._end(None)
        comm, self.comm = self.comm, None
        if comm is not None:
            # Destroy on the issue thread: it flushes issued work and may block.
            self.device.issuer.submit(comm.destroy)
        if self.slabs:
            await self._close_ipc()

    def _end(self, cause: BaseException | None) -> None:
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(cause)
        remove, self._remove_check = self._remove_check, None
        if remove is not None:
            remove()


def _nccl_and_version() -> tuple[Any, int | None]:
    nccl = load_nccl()
    return nccl, None if nccl is None else int(nccl.get_version())


def _abort_comm(comm: Any) -> None:
    try:
        comm.abort()
    except Exception as exc:
        logger.warning("ncclCommAbort failed: %s", exc)


def group_state(group: ProcessGroup) -> GroupState | None:
    """The group's CUDA state on this rank (``None`` before its first CUDA operation)."""
    state = group.paths.get(_NAME)
    return state if isinstance(state, GroupState) else None


def data_path(group: ProcessGroup) -> str | None:
    """The group's CUDA data path (``"nccl"``, ``"ipc"``, ``"staged"``), once agreed."""
    state = group_state(group)
    return None if state is None else state.path


# -- one call -------------------------------------------------------------------------------
class _Call:
    """A checked CUDA call: its arrays, events, and how each path runs it."""

    def __init__(self, pg: ProcessGroup, name: str, arrays: Sequence[Any]) -> None:
        devices = sorted({int(a.device.id) for a in arrays})
        if len(devices) > 1:
            raise DistUsageError(
                f"the arrays live on different CUDA devices ({', '.join(f'cuda:{d}' for d in devices)}); "
                "every array of one call must be on the same device"
            )
        index = devices[0] if devices else cupy.cuda.Device().id
        state = group_state(pg)
        if state is None:
            state = GroupState(pg, device(index))
            pg.paths[_NAME] = state
        elif state.device.index != index:
            raise DistUsageError(
                f"the arrays live on cuda:{index}, but this rank's operations on the group run "
                f"on cuda:{state.device.index}; a group uses one device per rank"
            )
        self.name = name
        self.state = state
        self.stash = list(arrays)
        self.what = f"{name} on {pg!r}"
        self.ready = state.device.ready_event()
        self.end = OpEnd(state.device, self.what)
        self.nccl: NcclLaunch | None = None
        self.ipc: IpcRun | None = None
        self.staged: StagedRun | None = None

    def plan(self, checked: Call) -> Plan:
        return Plan(_run, (self,), checked.fingerprint, checked.output, self.end.device_sync)


async def _run(comm: OpComm, call: _Call) -> Any:
    state, dev = call.state, call.state.device
    mover = CudaMover(dev, call.ready, call.what)
    finished: EventDone | None = None
    result: Any = None
    try:
        path = await state.ready()
        if path == "nccl" and call.nccl is not None:
            # Submitted with no await since the path was known: the issue thread receives
            # the group's NCCL calls in sequence order, on every rank.
            finished = await dev.issuer.run(lambda: _issue_nccl(state, call))
        elif path == "ipc" and call.ipc is not None:
            async with state.lock:
                await call.ipc(comm, mover, state.slabs)
            finished = await mover.finish(call.end)
        else:
            assert call.staged is not None
            result = await call.staged(comm, mover)
            finished = await mover.finish(call.end)
        await state.wait_device(finished)
        call.end.finished()
        return result
    except asyncio.CancelledError:
        # Device steps may still read or write the arrays and staging memory.
        last = finished if finished is not None else mover.last()
        if last is not None:
            progress_thread().keep(last, (call.stash, mover))
        raise
    except Exception as exc:
        error = backend_error(exc, call.what)
        if error is exc:
            raise
        raise error from exc
    finally:
        call.end.fail()  # (a no-op once the end was recorded)


def _issue_nccl(state: GroupState, call: _Call) -> EventDone:
    stream = state.stream
    runtime.streamWaitEvent(stream.ptr, call.ready.ptr)
    assert call.nccl is not None
    if state.comm is None:
        raise DistBackendError(f"{call.what}: the NCCL communicator is gone (aborted)")
    with stream:
        call.nccl(state.comm, stream.ptr)
    return call.end.record(stream)


# -- data paths: each algorithm's checked call, as NCCL, IPC and staged steps -----------------
def take(x: object, *, writable: bool, name: str) -> Any:
    """The CUDA backend's intake (:class:`aiodist.group._operations.Intake`): device arrays (always
    writable)."""
    return as_device_array(x, name)


def _scaled(x: Any, factor: float | None, *, in_place: bool) -> Any:
    """``x`` times ``factor`` on the current stream (in place, or into new memory)."""
    if factor is None:
        return x
    out = x if in_place else cupy.empty_like(x)
    reduce_many(cupy, ReduceOp.PREMUL_SUM, x.dtype, flat_bytes(out), [flat_bytes(x)], factor=factor)
    return out


def _d2d(dst: Any, src: Any, stream: int) -> None:
    if src.nbytes:
        runtime.memcpyAsync(
            dst.data.ptr, src.data.ptr, src.nbytes, runtime.memcpyDeviceToDevice, stream
        )


def _concat(parts: Sequence[Any], stream: int) -> Any:
    flat = cupy.empty(sum(p.nbytes for p in parts), cupy.uint8)
    offset = 0
    for p in parts:
        _d2d(flat[offset : offset + p.nbytes], flat_bytes(p), stream)
        offset += p.nbytes
    return flat


def _all_reduce(pg: ProcessGroup, checked: Call) -> Plan:
    x, rop, factor = checked.args
    dt, b = x.dtype, flat_bytes(x)
    call = _Call(pg, "all_reduce", [x])
    nc = nccl_plan(dt, rop)
    if isinstance(nc, NcclCall):
        count = x.size * nc.scale

        def launch(comm: Any, stream: int) -> None:
            if count:
                _scaled(x, factor, in_place=True)
                comm.allReduce(x.data.ptr, x.data.ptr, count, nc.datatype, nc.op, stream)

        call.nccl = launch
    call.ipc = lambda c, m, s: ipc_all_reduce(c, m, s, b, dt, rop, factor)
    call.staged = lambda c, m: staged_all_reduce(c, m, b, dt, rop, factor)
    return call.plan(checked)


def _all_reduce_coalesced(pg: ProcessGroup, checked: Call) -> Plan:
    xs, rop, factor = checked.args
    dt = xs[0].dtype
    total = sum(x.size for x in xs)
    call = _Call(pg, "all_reduce_coalesced", xs)
    nc = nccl_plan(dt, rop)
    if isinstance(nc, NcclCall):

        def launch(comm: Any, stream: int) -> None:
            flat = _concat(xs, stream)
            if total:
                if factor is not None:
                    reduce_many(cupy, ReduceOp.PREMUL_SUM, dt, flat, [flat], factor=factor)
                comm.allReduce(
                    flat.data.ptr, flat.data.ptr, total * nc.scale, nc.datatype, nc.op, stream
                )
            offset = 0
            for x in xs:
                _d2d(flat_bytes(x), flat[offset : offset + x.nbytes], stream)
                offset += x.nbytes

        call.nccl = launch

    async def flat_then(c: OpComm, m: CudaMover, run: Callable[[Any], Awaitable[None]]) -> None:
        flat = await m.scratch(sum(x.nbytes for x in xs))
        pieces, offset = [], 0
        for x in xs:
            pieces.append((flat[offset : offset + x.nbytes], flat_bytes(x)))
            offset += x.nbytes
        await m.copy(pieces)
        await run(flat)
        await m.copy([(src, dst) for dst, src in pieces])

    call.ipc = lambda c, m, s: flat_then(
        c, m, lambda f: ipc_all_reduce(c, m, s, f, dt, rop, factor)
    )
    call.staged = lambda c, m: flat_then(
        c, m, lambda f: staged_all_reduce(c, m, f, dt, rop, factor)
    )
    return call.plan(checked)


def _reduce(pg: ProcessGroup, checked: Call) -> Plan:
    x, root, rop, factor = checked.args
    dt, b = x.dtype, flat_bytes(x)
    call = _Call(pg, "reduce", [x])
    nc = nccl_plan(dt, rop)
    is_root = pg.rank == root
    if isinstance(nc, NcclCall):
        count = x.size * nc.scale

        def launch(comm: Any, stream: int) -> None:
            if count:
                # Only the root's array is the caller's to change.
                src = _scaled(x, factor, in_place=is_root)
                comm.reduce(src.data.ptr, x.data.ptr, count, nc.datatype, nc.op, root, stream)

        call.nccl = launch
    call.ipc = lambda c, m, s: ipc_reduce(c, m, s, b, dt, rop, root, factor)
    call.staged = lambda c, m: staged_reduce(c, m, b, dt, rop, root, factor)
    return call.plan(checked)


def _reduce_scatter(pg: ProcessGroup, checked: Call) -> Plan:
    out, ins, rop, factor = checked.args
    dt, b = out.dtype, flat_bytes(out)
    call = _Call(pg, "reduce_scatter", [out, *ins])
    nc = nccl_plan(dt, rop)
    parts = [flat_bytes(a) for a in ins]
    if isinstance(nc, NcclCall):
        count = out.size * nc.scale

        def launch(comm: Any, stream: int) -> None:
            if count:
                flat = _concat(ins, stream)
                if factor is not None:
                    reduce_many(cupy, ReduceOp.PREMUL_SUM, dt, flat, [flat], factor=factor)
                comm.reduceScatter(flat.data.ptr, out.data.ptr, count, nc.datatype, nc.op, stream)

        call.nccl = launch
    call.ipc = lambda c, m, s: ipc_reduce_scatter(c, m, s, b, parts, dt, rop, factor)
    call.staged = lambda c, m: staged_reduce_scatter(c, m, b, parts, dt, rop, factor)
    return call.plan(checked)


def _broadcast(pg: ProcessGroup, checked: Call) -> Plan:
    x, root = checked.args
    b = flat_bytes(x)
    call = _Call(pg, "broadcast", [x])

    def launch(comm: Any, stream: int) -> None:
        if b.nbytes:
            comm.broadcast(b.data.ptr, b.data.ptr, b.nbytes, _NCCL_UINT8, root, stream)

    call.nccl = launch
    call.ipc = lambda c, m, s: ipc_broadcast(c, m, s, b, root)
    call.staged = lambda c, m: staged_broadcast(c, m, b, root)
    return call.plan(checked)


def _all_gather(pg: ProcessGroup, checked: Call) -> Plan:
    outs, x, whole = checked.args
    b, rows = flat_bytes(x), [flat_bytes(o) for o in outs]
    # NCCL gathers straight into one output array; into a list through scratch memory.
    direct = None if whole is None else flat_bytes(whole)
    call = _Call(pg, "all_gather", [x, *outs])

    def launch(comm: Any, stream: int) -> None:
        if not b.nbytes:
            return
        target = direct if direct is not None else cupy.empty(b.nbytes * len(rows), cupy.uint8)
        comm.allGather(b.data.ptr, target.data.ptr, b.nbytes, _NCCL_UINT8, stream)
        if direct is None:
            for i, row in enumerate(rows):
                _d2d(row, target[i * b.nbytes : (i + 1) * b.nbytes], stream)

    call.nccl = launch
    call.ipc = lambda c, m, s: ipc_all_gather(c, m, s, rows, b)
    call.staged = lambda c, m: staged_all_gather(c, m, rows, b)
    return call.plan(checked)


def _all_gather_coalesced(pg: ProcessGroup, checked: Call) -> Plan:
    rows, xs = checked.args
    total = sum(x.nbytes for x in xs)
    call = _Call(pg, "all_gather_coalesced", [*xs, *(o for row in rows for o in row)])
    n = pg.size

    def unpack(gathered: Any) -> list[tuple[Any, Any]]:
        pairs = []
        for r, outs in enumerate(rows):
            offset = r * total
            for o in outs:
                pairs.append((flat_bytes(o), gathered[offset : offset + o.nbytes]))
                offset += o.nbytes
        return pairs

    def launch(comm: Any, stream: int) -> None:
        flat = _concat(xs, stream)
        gathered = cupy.empty(n * total, cupy.uint8)
        if total:
            comm.allGather(flat.data.ptr, gathered.data.ptr, total, _NCCL_UINT8, stream)
        for dst, src in unpack(gathered):
            _d2d(dst, src, stream)

    async def moved(c: OpComm, m: CudaMover, slabs: Sequence[Any] | None) -> None:
        flat = await m.scratch(total)
        gathered = await m.scratch(n * total)
        pieces, offset = [], 0
        for x in xs:
            pieces.append((flat[offset : offset + x.nbytes], flat_bytes(x)))
            offset += x.nbytes
        await m.copy(pieces)
        outs = [gathered[r * total : (r + 1) * total] for r in range(n)]
        if slabs is None:
            await staged_all_gather(c, m, outs, flat)
        else:
            await ipc_all_gather(c, m, slabs, outs, flat)
        await m.copy(unpack(gathered))

    call.nccl = launch
    call.ipc = lambda c, m, s: moved(c, m, s)
    call.staged = lambda c, m: moved(c, m, None)
    return call.plan(checked)


def _gather(pg: ProcessGroup, checked: Call) -> Plan:
    outs, x, root = checked.args
    b = flat_bytes(x)
    rows = None if outs is None else [flat_bytes(o) for o in outs]
    call = _Call(pg, "gather", [x, *(outs or [])])
    me = pg.rank

    def launch(comm: Any, stream: int) -> None:
        if not b.nbytes:
            return
        nccl = load_nccl()
        nccl.groupStart()
        try:
            if rows is None:
                comm.send(b.data.ptr, b.nbytes, _NCCL_UINT8, root, stream)
            else:
                for r, row in enumerate(rows):
                    if r == me:
                        _d2d(row, b, stream)
                    else:
                        comm.recv(row.data.ptr, b.nbytes, _NCCL_UINT8, r, stream)
        finally:
            nccl.groupEnd()

    call.nccl = launch
    call.ipc = lambda c, m, s: ipc_gather(c, m, s, rows, b, root)
    call.staged = lambda c, m: staged_gather(c, m, rows, b, root)
    return call.plan(checked)


def _scatter(pg: ProcessGroup, checked: Call) -> Plan:
    out, ins, root = checked.args
    b = flat_bytes(out)
    parts = None if ins is None else [flat_bytes(a) for a in ins]
    call = _Call(pg, "scatter", [out, *(ins or [])])
    me = pg.rank

    def launch(comm: Any, stream: int) -> None:
        if not b.nbytes:
            return
        nccl = load_nccl()
        nccl.groupStart()
        try:
            if parts is None:
                comm.recv(b.data.ptr, b.nbytes, _NCCL_UINT8, root, stream)
            else:
                for r, part in enumerate(parts):
                    if r == me:
                        _d2d(b, part, stream)
                    else:
                        comm.send(part.data.ptr, b.nbytes, _NCCL_UINT8, r, stream)
        finally:
            nccl.groupEnd()

    call.nccl = launch
    call.ipc = lambda c, m, s: ipc_scatter(c, m, s, b, parts, root)
    call.staged = lambda c, m: staged_scatter(c, m, b, parts, root)
    return call.plan(checked)


def _all_to_all(pg: ProcessGroup, checked: Call) -> Plan:
    outs = [flat_bytes(o) for o in checked.args[0]]
    ins = [flat_bytes(i) for i in checked.args[1]]
    call = _Call(pg, "all_to_all", [*outs, *ins])
    me = pg.rank

    def launch(comm: Any, stream: int) -> None:
        nccl = load_nccl()
        nccl.groupStart()
        try:
            for r, (o, i) in enumerate(zip(outs, ins, strict=True)):
                if r == me:
                    _d2d(o, i, stream)
                    continue
                if i.nbytes:
                    comm.send(i.data.ptr, i.nbytes, _NCCL_UINT8, r, stream)
                if o.nbytes:
                    comm.recv(o.data.ptr, o.nbytes, _NCCL_UINT8, r, stream)
        finally:
            nccl.groupEnd()

    call.nccl = launch
    # Blocks may differ in size between ranks: the IPC path leaves this to staging.
    call.staged = lambda c, m: staged_all_to_all(c, m, outs, ins)
    return call.plan(checked)


# Point to point: staged on every path.
def _send(pg: ProcessGroup, checked: Call) -> Plan:
    peer, x = checked.args
    b = flat_bytes(x)
    call = _Call(pg, "send", [x])
    call.staged = lambda c, m: staged_send(c, m, peer, b)
    return call.plan(checked)


def _recv(pg: ProcessGroup, checked: Call) -> Plan:
    peer, out, ranks = checked.args
    b = flat_bytes(out)
    call = _Call(pg, "recv", [out])

    async def run(c: OpComm, m: CudaMover) -> int:
        sender = await staged_recv(c, m, peer, b)
        return sender if ranks is None else ranks.index(sender)

    call.staged = run
    return call.plan(checked)


#: The CUDA backend. Barriers and object collectives run on the CPU (their bytes travel over
#: the CPU transport): it takes the CPU backend's paths for them.
BACKEND = Backend.from_paths(
    _NAME,
    "cuda",
    take,
    {
        "all_reduce": _all_reduce,
        "all_reduce_coalesced": _all_reduce_coalesced,
        "reduce": _reduce,
        "reduce_scatter": _reduce_scatter,
        "broadcast": _broadcast,
        "all_gather": _all_gather,
        "all_gather_coalesced": _all_gather_coalesced,
        "gather": _gather,
        "scatter": _scatter,
        "all_to_all": _all_to_all,
        "send": _send,
        "recv": _recv,
        **{name: cpu.PATHS[name] for name in HOST_ALGORITHMS},
    },
)
