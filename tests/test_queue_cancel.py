"""A cancelled ``queue_pop`` loses nothing: it returned its value, or the value is in the queue.

Every store is driven through every point of cancellation: a pop is cancelled after each
number of loop turns in turn (so also in the turn its reply was parsed, or its thread
finished), then after short real delays, with the value there from the start or pushed by
another client meanwhile. What the pop returned and what is left in the queue must be
exactly what was pushed: in the same order where the store can put a value back first, as
the same values on torch's wire (which cannot: a value goes back at the end). The blocking
facade is interrupted the way Ctrl-C interrupts it: an exception raised in the waiting
thread by a signal handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import FrameType

import pytest
from etcd_helpers import etcd, needs_etcd

import aiodist
import aiodist.sync as dist
from aiodist.errors import QueueEmptyError
from aiodist.sync import _loop_thread

__all__ = ["etcd"]  # (the fixture imported above, used by name)

#: Cancellation after this many loop turns, each in turn; then after real delays.
TURNS = 40
DELAYS = [0.0005 * i for i in range(24)]


async def _drain(store: aiodist.Store, key: str) -> list[bytes]:
    left = []
    while True:
        try:
            left.append(await store.queue_pop(key, block=False))
        except QueueEmptyError:
            return left


async def _cancel_after(task: asyncio.Future[bytes], point: int) -> None:
    if point < TURNS:
        for _ in range(point):
            await asyncio.sleep(0)
    else:
        await asyncio.sleep(DELAYS[point - TURNS])
    task.cancel()


async def _every_point(store: aiodist.Store, other: aiodist.Store, ordered: bool) -> int:
    """Cancel pops at every point, with values there before and pushed meanwhile; return
    how many pops returned their value (the rest were cancelled before they did)."""
    returned = 0
    for point in range(TURNS + len(DELAYS)):
        for pushed_meanwhile in (False, True):
            key = f"q{point}{'p' if pushed_meanwhile else ''}"
            values = [f"{key}-{i}".encode() for i in range(3)]
            if not pushed_meanwhile:
                for v in values:
                    await other.queue_push(key, v)
            popper = asyncio.ensure_future(store.queue_pop(key))
            if pushed_meanwhile:
                await asyncio.sleep(0)
                for v in values:
                    await other.queue_push(key, v)
            await _cancel_after(popper, point)
            outcome = (await asyncio.gather(popper, return_exceptions=True))[0]
            got = [] if isinstance(outcome, asyncio.CancelledError) else [outcome]
            returned += len(got)
            left = await _drain(other, key)
            if ordered:
                assert got + left == values, (point, pushed_meanwhile, got, left)
            else:
                assert sorted(got + left) == values, (point, pushed_meanwhile, got, left)
    return returned


@contextlib.asynccontextmanager
async def _tcp(wire: str) -> AsyncIterator[tuple[aiodist.Store, aiodist.Store]]:
    server = await aiodist.TCPStore.create("127.0.0.1", 0, is_master=True, timeout=10)
    store = await aiodist.TCPStore.create("127.0.0.1", server.port, timeout=10, wire=wire)  # type: ignore[arg-type]
    try:
        yield store, server
    finally:
        await store.aclose()
        await server.aclose()


@pytest.mark.parametrize("wire", ["aiodist", "torch"])
async def test_tcp_store_pops_lose_nothing_cancelled_at_every_point(wire: str) -> None:
    async with _tcp(wire) as (store, other):
        returned = await _every_point(store, other, ordered=wire == "aiodist")
    # Both outcomes were reached: cancelled before the value came, and after.
    assert 0 < returned < 2 * (TURNS + len(DELAYS)), returned


async def test_prefixed_tcp_store_pops_lose_nothing_cancelled_at_every_point() -> None:
    async with _tcp("aiodist") as (store, other):
        await _every_point(aiodist.PrefixStore("p", store), aiodist.PrefixStore("p", other), True)


async def test_hash_store_pops_lose_nothing_cancelled_at_every_point() -> None:
    store = aiodist.HashStore()
    await _every_point(store, store, ordered=True)


async def test_file_store_pops_lose_nothing_cancelled_at_every_point(tmp_path: Path) -> None:
    # The pop runs in a thread that cannot be stopped: cancelled, it is waited for.
    async with (
        aiodist.FileStore(tmp_path / "store") as store,
        aiodist.FileStore(tmp_path / "store") as other,
    ):
        returned = await _every_point(store, other, ordered=True)
    assert returned > 0, returned


@needs_etcd
async def test_etcd_store_pops_lose_nothing_cancelled_at_every_point(etcd: str) -> None:
    async with (
        await aiodist.EtcdStore.create(etcd, "/cancelled", timeout=10) as store,
        await aiodist.EtcdStore.create(etcd, "/cancelled", timeout=10) as other,
    ):
        returned = await _every_point(store, other, ordered=True)
        assert returned > 0, returned
        # What was given back is taken before what was pushed, in the queue's order.
        await other.queue_push("front", b"b")
        await other.queue_push_front("front", b"a")
        await other.queue_push_front("front", b"first")
        assert await _drain(store, "front") == [b"first", b"a", b"b"]


@pytest.mark.torch
def test_pops_from_a_torch_server_lose_nothing_cancelled_at_every_point() -> None:
    pytest.importorskip("torch")
    server = subprocess.Popen(
        [sys.executable, "-c", _TORCH_SERVER], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())

        async def main() -> int:
            store = await aiodist.TCPStore.create("127.0.0.1", port, timeout=10)
            other = await aiodist.TCPStore.create("127.0.0.1", port, timeout=10)
            try:
                assert store.wire == "torch"
                return await _every_point(store, other, ordered=False)
            finally:
                await other.aclose()
                await store.aclose()

        assert asyncio.run(main()) > 0
    finally:
        server.kill()
        server.communicate()


_TORCH_SERVER = textwrap.dedent(
    """
    import time
    from datetime import timedelta
    import torch.distributed as dist

    s = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True,
                      timeout=timedelta(seconds=60))
    print(s.port, flush=True)
    time.sleep(600)
    """
)


# -- the blocking facade, interrupted ----------------------------------------------------------
class _Interrupted(BaseException):
    """What the signal handler raises in the waiting thread (as Ctrl-C raises
    KeyboardInterrupt)."""


_WAIT = _loop_thread.wait.__code__


def _waiting(frame: FrameType | None) -> bool:
    """Whether ``frame`` is a blocking call of aiodist waiting for its result (where Ctrl-C
    lands: the thread spends its time there, and a lock's wait is interrupted for it)."""
    while frame is not None:
        if frame.f_code is _WAIT:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def _interrupt_after(seconds: float) -> Iterator[None]:
    """Raise :class:`_Interrupted` in this (the main) thread after ``seconds``, if it waits
    in a blocking call then: a signal's handler, as Ctrl-C's raises KeyboardInterrupt."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        if _waiting(frame):
            raise _Interrupted

    previous = signal.signal(signal.SIGUSR2, interrupt)
    timer = threading.Timer(
        seconds, signal.pthread_kill, (threading.main_thread().ident, signal.SIGUSR2)
    )
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()
        signal.signal(signal.SIGUSR2, previous)


def test_blocking_pops_lose_nothing_when_interrupted() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=10)
    client = dist.TCPStore("127.0.0.1", server.port, timeout=10)
    rng = random.Random(38)
    interrupted = 0
    try:
        for attempt in range(300):
            key = f"q{attempt}"
            values = [f"{key}-{i}".encode() for i in range(2)]
            got: list[bytes] = []
            pushed_meanwhile = attempt % 2 == 1
            pusher = threading.Timer(0.001, _push, (server, key, values))
            if pushed_meanwhile:
                pusher.start()
            else:
                for v in values:
                    server.queue_push(key, v)
            try:
                with _interrupt_after(rng.uniform(0.00005, 0.003)):
                    got.append(client.queue_pop(key))
            except _Interrupted:
                interrupted += 1
            if pushed_meanwhile:
                pusher.join()
            left = []
            while True:
                try:
                    left.append(server.queue_pop(key, block=False))
                except QueueEmptyError:
                    break
            assert got + left == values, (attempt, got, left)
    finally:
        client.close()
        server.close()
    assert 0 < interrupted < 300, interrupted


def _push(store: dist.Store, key: str, values: list[bytes]) -> None:
    for v in values:
        store.queue_push(key, v)


def test_an_interrupted_blocking_pop_gives_back_what_it_took_at_once() -> None:
    # The pop ended on the loop just as the interrupt came: the value goes back first.
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=10)
    try:
        server.queue_push("q", b"a")
        server.queue_push("q", b"b")
        start = time.monotonic()
        for _ in range(200):
            try:
                with _interrupt_after(0.00002):
                    value = server.queue_pop("q")
            except _Interrupted:
                continue
            server.queue_push_front("q", value)
        assert time.monotonic() - start < 30
        assert [server.queue_pop("q", block=False) for _ in range(2)] == [b"a", b"b"]
        assert server.queue_len("q") == 0
    finally:
        server.close()
