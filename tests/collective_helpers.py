"""Running collective algorithms on N ranks in one loop, and numpy references for them."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from aiodist._arrays._reduce import ReduceOp
from aiodist.store import HashStore
from aiodist.transport.base import OpComm, PeerDirectory, Transport
from aiodist.transport.local import LocalTransport
from aiodist.transport.tcp import TCPTransport

RankFn = Callable[[OpComm], Awaitable[Any]]


async def run_local(n: int, fn: RankFn, *, seq: int = 0, group_id: int = 0) -> list[Any]:
    """Run ``fn(comm)`` for every rank of a fresh in-process world; return their results."""
    world = LocalTransport.create_world(n)
    try:
        return await run_on(world, fn, seq=seq, group_id=group_id)
    finally:
        for t in world:
            await t.aclose()


async def run_tcp(n: int, fn: RankFn, *, seq: int = 0, group_id: int = 0) -> list[Any]:
    """Like :func:`run_local`, over real loopback TCP connections (ranks as tasks)."""
    store = HashStore()
    world: list[TCPTransport] = list(
        await asyncio.gather(
            *(TCPTransport.create(PeerDirectory(store), r, n, timeout=10) for r in range(n))
        )
    )
    try:
        return await run_on(world, fn, seq=seq, group_id=group_id)
    finally:
        for t in world:
            await t.aclose()


async def make_world(kind: str, n: int) -> list[Transport]:
    """``n`` connected transports of ``kind`` (``"local"`` or ``"tcp"``); close them after."""
    if kind == "local":
        return list(LocalTransport.create_world(n))
    store = HashStore()
    return list(
        await asyncio.gather(
            *(TCPTransport.create(PeerDirectory(store), r, n, timeout=10) for r in range(n))
        )
    )


#: The ways to run a world, by name (for test parametrization).
RUNNERS = {"local": run_local, "tcp": run_tcp}


async def run_on(
    world: Sequence[Transport], fn: RankFn, *, seq: int = 0, group_id: int = 0
) -> list[Any]:
    """Run ``fn(comm)`` on every transport of ``world`` concurrently, ranks 0..n-1."""
    ranks = list(range(len(world)))
    comms = [OpComm(t, ranks, r, group_id, seq) for r, t in enumerate(world)]
    return list(await asyncio.gather(*(fn(c) for c in comms)))


def numpy_reduce(op: ReduceOp, arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The reference reduction: left fold with the op's ufunc, AVG as floor or true mean."""
    ufunc = {
        ReduceOp.SUM: np.add,
        ReduceOp.AVG: np.add,
        ReduceOp.PRODUCT: np.multiply,
        ReduceOp.MIN: np.minimum,
        ReduceOp.MAX: np.maximum,
        ReduceOp.BAND: np.bitwise_and,
        ReduceOp.BOR: np.bitwise_or,
        ReduceOp.BXOR: np.bitwise_xor,
    }[op]
    acc = arrays[0].copy()
    for a in arrays[1:]:
        ufunc(acc, a, out=acc)
    if op is ReduceOp.AVG and len(arrays) > 1:
        if acc.dtype.kind in "iu":
            np.floor_divide(acc, acc.dtype.type(len(arrays)), out=acc)
        else:
            np.divide(acc, acc.dtype.type(len(arrays)), out=acc)
    return acc


def sample(
    dtype: np.dtype[Any], shape: tuple[int, ...], seed: int, op: ReduceOp = ReduceOp.SUM
) -> np.ndarray:
    """Small integer-valued data, so every reduction order gives the exact same result
    (products stay within 2**8, exact even in bfloat16)."""
    return np.asarray(_sample(dtype, shape, seed, op))


def _sample(dtype: np.dtype[Any], shape: tuple[int, ...], seed: int, op: ReduceOp) -> Any:
    rng = np.random.default_rng(seed)
    kind = "f" if dtype.name == "bfloat16" else dtype.kind
    low, high = (-1, 3) if op is ReduceOp.PRODUCT else (-3, 4)
    if kind == "b":
        return rng.integers(0, 2, shape).astype(dtype)
    if kind == "u":
        return rng.integers(0, high, shape).astype(dtype)
    if kind == "c":
        if op is ReduceOp.PRODUCT:
            return (rng.integers(0, 2, shape) + 1j * rng.integers(0, 2, shape)).astype(dtype)
        return (rng.integers(low, high, shape) + 1j * rng.integers(low, high, shape)).astype(dtype)
    return rng.integers(low, high, shape).astype(dtype)


class Wrapped(Transport):
    """``inner`` with every call passed through: subclasses change the calls a test watches."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner.rank, inner.world_size, inner.mailbox)
        self.inner = inner

    def send(
        self, peer: int, tag: Any, data: memoryview, *, cleared: bool = False
    ) -> asyncio.Future[None]:
        return self.inner.send(peer, tag, data, cleared=cleared)

    def recv_into(self, peer: int | None, tag: Any, out: memoryview) -> asyncio.Future[int]:
        return self.inner.recv_into(peer, tag, out)

    def send_reject(self, peer: int, group: int, seq: int, reason: str) -> None:
        self.inner.send_reject(peer, group, seq, reason)

    def abort(self, exc: BaseException) -> None:
        self.inner.abort(exc)

    async def aclose(self) -> None:
        await self.inner.aclose()
