"""The operation layer's plumbing: backends as tables, failure spreading, sockets, batches."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import numpy as np
import pytest

import aiodist
from aiodist import backends
from aiodist.backends import cpu
from aiodist.group import ProcessGroup, start_world
from aiodist.testing import run_world
from aiodist.transport.local import LocalTransport

pytestmark = pytest.mark.both_loops

# A backend made of the CPU backend's validate functions, counting the calls it plans.
_counted: list[str] = []


def _counting(name: str) -> Any:
    def validate(group: ProcessGroup, *args: Any) -> aiodist.Plan:
        _counted.append(name)
        return cpu.BACKEND.ops[name](group, *args)

    return validate


_COUNTING = aiodist.Backend("counting", "cpu", {name: _counting(name) for name in cpu.BACKEND.ops})
aiodist.register_backend("counting", _COUNTING)


async def test_a_registered_backend_serves_its_device() -> None:
    async def fn(rank: int, size: int) -> tuple[str, float]:
        x = np.array([float(rank + 1)])
        await aiodist.all_reduce(x)
        await aiodist.barrier()
        return aiodist.get_backend(), float(x[0])

    _counted.clear()
    assert await run_world(fn, 3, backend="counting") == [("counting", 6.0)] * 3
    assert _counted.count("all_reduce") == 3 and _counted.count("barrier") == 3
    with pytest.raises(aiodist.DistUsageError, match="'counting' is registered already"):
        aiodist.register_backend("counting", _COUNTING)
    with pytest.raises(aiodist.DistUsageError, match="unknown backend 'cpu:nope'"):
        backends.parse_backend("cpu:nope")


async def test_arrays_of_a_device_without_a_backend_are_refused() -> None:
    class CudaArray:
        """Something that says it lives on a CUDA device (DLPack device type 2)."""

        def __dlpack__(self, stream: object = None) -> object:
            raise AssertionError("never read: the call is refused first")

        def __dlpack_device__(self) -> tuple[int, int]:
            return (2, 0)

    async def fn(rank: int, size: int) -> None:
        with pytest.raises(
            aiodist.DistUsageError,
            match=r"all_reduce: tensor \(CudaArray\) lives on GPU device 0 .* use the CUDA backend",
        ):
            aiodist.all_reduce(CudaArray())
        with pytest.raises(aiodist.DistUsageError, match=r"tensor_list\[1\] .* lives on GPU"):
            aiodist.all_gather([np.zeros(1), CudaArray()], np.zeros(1))
        x = np.ones(1)
        await aiodist.all_reduce(x)  # both calls were rejected on both ranks alike
        assert x[0] == 2.0

    await run_world(fn, 2)


def test_device_of_tells_devices_apart() -> None:
    class CudaArray:
        @property
        def __cuda_array_interface__(self) -> dict[str, Any]:
            return {"shape": (1,)}

    assert backends.device_of("x", (np.zeros(1), aiodist.ReduceOp.SUM, 3)) == "cpu"
    assert backends.device_of("x", ([CudaArray(), CudaArray()],)) == "cuda"
    assert backends.device_of("x", (None, 1.5)) is None
    with pytest.raises(aiodist.DistUsageError, match="x: the arrays live on different devices"):
        backends.device_of("x", ([np.zeros(1)], CudaArray()))


async def test_batch_is_checked_whole_before_anything_starts() -> None:
    async def fn(rank: int, size: int) -> list[str]:
        if rank == 0:
            ops = [
                aiodist.P2POp(aiodist.isend, np.ones(2), 1, tag=0),
                aiodist.P2POp(aiodist.isend, [1.0, 2.0], 1, tag=1),
            ]
            with pytest.raises(
                aiodist.DistUsageError,
                match=r"batch_isend_irecv: entry 1: send: tensor must be a numpy array",
            ):
                aiodist.batch_isend_irecv(ops)
            return []
        works = aiodist.batch_isend_irecv(
            [aiodist.P2POp(aiodist.irecv, np.zeros(2), 0, tag=t) for t in (0, 1)]
        )
        errors = []
        for w in works:
            with pytest.raises(aiodist.DistUsageError) as info:
                await w
            errors.append(str(info.value))
        return errors

    _, errors = await run_world(fn, 2)
    assert "rank 0 rejected its send: send: the batch was rejected" in errors[0]
    assert "tensor must be a numpy array" in errors[1]


async def test_tcp_nodelay_on_accepted_and_connected_sockets() -> None:
    async def fn(rank: int, size: int) -> list[tuple[bool, int]]:
        for _ in range(3):
            await aiodist.all_gather([np.zeros(256) for _ in range(size)], np.ones(256))
        transport = aiodist.group.current_world().transport
        return [
            (
                conn.accepted,
                conn.transport.get_extra_info("socket").getsockopt(
                    socket.IPPROTO_TCP, socket.TCP_NODELAY
                ),
            )
            for conn in transport._conns
        ]

    flags = [f for per_rank in await run_world(fn, 3) for f in per_rank]
    assert {accepted for accepted, _ in flags} == {True, False}
    assert all(nodelay for _, nodelay in flags), flags


async def test_simultaneous_connects_never_fail() -> None:
    # Both ranks of every pair connect at once; a connect task that starts after the peer's
    # own connection was accepted used to fail an assertion.
    async def fn(rank: int, size: int) -> None:
        outs = [np.zeros(1) for _ in range(size)]
        await aiodist.all_gather(outs, np.array([float(rank)]))
        assert [o[0] for o in outs] == list(range(size))

    for _ in range(10):
        await run_world(fn, 3)


class _FlakyStore(aiodist.HashStore):
    """A store whose first wait on the abort key fails, as a store refusing one request."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = 0

    async def get(self, key: str) -> bytes:
        if key.endswith("abort") and not self.failed:
            self.failed += 1
            raise aiodist.DistStoreError("the store refused this request once")
        return await super().get(key)


async def test_abort_watch_survives_a_store_error() -> None:
    store = _FlakyStore()
    transports = LocalTransport.create_world(2)
    worlds = []

    async def rank(r: int) -> None:
        aiodist.group.isolate_context()
        pg = start_world(transports[r], store, backend="cpu", backends={"cpu": "cpu"})
        worlds.append(pg.world)

    await asyncio.gather(rank(0), rank(1))
    try:
        await asyncio.sleep(0.2)  # the watch has failed once and retried
        assert store.failed == 1
        by_rank = {w.rank: w for w in worlds}
        by_rank[0].abort(aiodist.DistError("rank 0 gives up"))
        started = time.monotonic()
        while by_rank[1].broken is None and time.monotonic() - started < 5:
            await asyncio.sleep(0.01)
        assert "rank 0 gives up" in str(by_rank[1].broken)
    finally:
        for w in worlds:
            await w.aclose()


class _RecordingPath:
    """A backend's per-group state that records what the group does to it."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def abort(self, cause: BaseException) -> None:
        self.events.append(f"abort: {cause}")

    async def aclose(self) -> None:
        self.events.append("aclose")


async def _keep_a_path(group: ProcessGroup) -> None:
    group.paths["keeping"] = _RecordingPath()


aiodist.register_backend(
    "keeping", aiodist.Backend("keeping", "cpu", dict(cpu.BACKEND.ops), setup=_keep_a_path)
)


async def test_a_backends_per_group_state_is_closed_and_aborted_with_its_group() -> None:
    async def fn(rank: int, size: int) -> None:
        default = aiodist.group.resolve_group(None, "test")
        world_path = default.paths["keeping"]
        sub = await aiodist.new_group([0, 1])
        assert isinstance(sub, ProcessGroup)
        sub_path = sub.paths["keeping"]
        assert sub_path is not world_path
        x = np.ones(2)
        await aiodist.all_reduce(x, group=sub)
        assert x.tolist() == [2.0, 2.0]
        await sub.destroy()
        assert sub_path.events == ["aclose"] and sub.paths == {}
        assert world_path.events == []
        default.world.abort(aiodist.DistNetworkError("the test aborts"))
        assert len(world_path.events) == 1
        assert world_path.events[0].startswith(f"abort: rank {rank}: process group aborted")
        assert "the test aborts" in world_path.events[0]

    await run_world(fn, 2, backend="keeping")


async def test_a_world_hears_of_a_peer_lost_before_it_was_built() -> None:
    # The transport connected, then rank 1 aborted before rank 0 built its world on it
    # (as when a rank dies during init_process_group's set-up): the world is aborted,
    # naming it, instead of waiting for rank 1's part of the set-up.
    from aiodist.store import HashStore
    from aiodist.transport.base import PeerDirectory
    from aiodist.transport.tcp import TCPTransport

    store = HashStore()
    t0, t1 = await asyncio.gather(
        *(TCPTransport.create(PeerDirectory(store), r, 2, timeout=10) for r in range(2))
    )
    await t1.send(0, (0, 1, 0), memoryview(b"x"))  # connected
    await t0.recv_into(1, (0, 1, 0), memoryview(bytearray(1)))
    t1.abort(aiodist.DistNetworkError("rank 1 gives up"))
    with pytest.raises(aiodist.DistNetworkError, match="rank 1 gives up"):
        await t0.recv_into(1, (0, 1, 0), memoryview(bytearray(1)))
    aiodist.group.isolate_context()
    pg = start_world(t0, store, backend="cpu", backends={"cpu": "cpu"})
    try:
        assert pg.is_aborted()
        assert "rank 1 gives up" in str(pg.world.broken)
    finally:
        await pg.world.aclose()
        await t1.aclose()
