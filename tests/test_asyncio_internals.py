"""The asyncio internals of ``aiodist._util._asyncio_internals`` still mean what aiodist assumes.

Run on every Python version aiodist supports (the README's test command runs this module on
each): a new asyncio that renames or changes one of them fails here, by name, instead of
somewhere in the blocking facade. Also the hand-over loop's one race: a thread standing in
for the loop's while that thread was handed events, closing a descriptor and opening another
with the same number.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from aiodist._util._asyncio_internals import (
    loop_on_this_thread,
    pending_work,
    release_yielded,
    set_loop_on_this_thread,
    wake,
)
from aiodist.sync._loop_thread import HandOverLoop, TurnSelector


def test_the_loop_on_this_thread_is_the_running_loop() -> None:
    assert loop_on_this_thread() is None
    loop = asyncio.new_event_loop()
    try:
        set_loop_on_this_thread(loop)
        try:
            assert asyncio.get_running_loop() is loop
            assert loop_on_this_thread() is loop
        finally:
            set_loop_on_this_thread(None)
        assert loop_on_this_thread() is None

        async def inside() -> asyncio.AbstractEventLoop | None:
            return loop_on_this_thread()

        assert loop.run_until_complete(inside()) is loop
    finally:
        loop.close()


def test_pending_work_counts_ready_callbacks_and_timers() -> None:
    loop = asyncio.new_event_loop()
    try:
        assert pending_work(loop) == (0, 0)
        loop.call_soon(lambda: None)
        assert pending_work(loop) == (1, 0)
        loop.call_later(60, lambda: None)
        assert pending_work(loop) == (1, 1)
        loop.run_until_complete(asyncio.sleep(0))  # runs the ready callback
        assert pending_work(loop) == (0, 1)
    finally:
        loop.close()


class _CountingSelector(TurnSelector):
    """Counts the waits for events that returned."""

    def __init__(self) -> None:
        super().__init__()
        self.returned = 0

    def wait_for_events(self, timeout: float | None) -> list[tuple[Any, int]]:
        events = super().wait_for_events(timeout)
        self.returned += 1
        return events


@pytest.fixture
def counted_loop() -> Iterator[tuple[HandOverLoop, _CountingSelector]]:
    selector = _CountingSelector()
    loop = HandOverLoop(selector)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop, selector
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def _until(condition: Any, seconds: float = 5.0) -> bool:
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.001)
    return True


def test_wake_ends_a_wait_for_events(counted_loop: tuple[HandOverLoop, _CountingSelector]) -> None:
    loop, selector = counted_loop
    # The loop's thread waits with no timeout (it has no timers): only a wake-up ends it.
    assert _until(lambda: selector.waiting)
    time.sleep(0.05)
    before = selector.returned
    assert selector.waiting and selector.returned == before
    wake(loop)
    assert _until(lambda: selector.returned > before, 2)
    # A callback left by a thread that stood in runs because the stand-in wakes the loop.
    ran = threading.Event()
    assert _until(lambda: loop.stand_in(lambda: loop.call_soon(ran.set)))
    assert ran.wait(2)


def test_release_yielded_lets_the_driver_await_the_future() -> None:
    async def main() -> None:
        fut = asyncio.get_running_loop().create_future()

        async def operation() -> int:
            return await fut + 1

        coro = operation()
        yielded = coro.send(None)  # as ProcessGroup._start runs an operation inline
        assert yielded is fut and fut._asyncio_future_blocking is True
        release_yielded(yielded)
        assert fut._asyncio_future_blocking is False

        async def driver() -> None:
            await yielded  # a Task refuses a future still marked as yielded to another
            with pytest.raises(StopIteration) as info:
                coro.send(None)
            assert info.value.value == 42

        task = asyncio.ensure_future(driver())
        await asyncio.sleep(0)
        fut.set_result(41)
        await task

    asyncio.run(main())


class _PausingSelector(TurnSelector):
    """Holds the loop's thread between finding events and taking the turn back, once."""

    def __init__(self) -> None:
        super().__init__()
        self.pause_next = False
        self.paused = threading.Event()
        self.resume = threading.Event()

    def wait_for_events(self, timeout: float | None) -> list[tuple[Any, int]]:
        events = super().wait_for_events(timeout)
        if self.pause_next and events:
            self.pause_next = False
            self.paused.set()
            self.resume.wait(5)
        return events


@pytest.mark.parametrize("round", range(5))
def test_a_descriptor_reused_by_a_stand_in_during_select_keeps_its_reader(round: int) -> None:
    # The loop's thread finds the old socket readable; before it takes the turn back, a
    # thread standing in removes that socket's reader, closes it, and opens a socket that
    # gets the same descriptor number, with a reader of its own. The loop must not take the
    # old event for the new socket (asyncio removes the reader of a descriptor whose handle
    # was cancelled: that would be the new socket's, and it would never read again).
    selector = _PausingSelector()
    loop = HandOverLoop(selector)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    old, old_peer = socket.socketpair()
    new: list[socket.socket] = []
    received: list[bytes] = []
    try:
        registered = threading.Event()

        def register_old() -> None:
            loop.add_reader(old.fileno(), lambda: None)
            registered.set()

        loop.call_soon_threadsafe(register_old)
        assert registered.wait(5)
        selector.pause_next = True
        old_peer.send(b"stale")
        assert selector.paused.wait(5)
        fd = old.fileno()

        def swap() -> None:
            loop.remove_reader(fd)
            old.close()
            a, b = socket.socketpair()
            new.extend((a, b))
            loop.add_reader(a.fileno(), lambda: received.append(a.recv(100)))

        assert loop.stand_in(swap)
        assert new[0].fileno() == fd  # the descriptor was reused, as the race needs
        selector.resume.set()
        new[1].send(b"fresh")
        assert _until(lambda: received == [b"fresh"], 2), received
    finally:
        selector.resume.set()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
        for s in (old, old_peer, *new):
            s.close()
