"""The progress thread, driven by host-side completions (flags other threads set)."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref

import pytest

from aiodist.backends._progress import ProgressThread, progress_thread
from aiodist.errors import DistBackendError, DistTimeoutError, DistUsageError

pytestmark = pytest.mark.both_loops  # the standard loop (asyncio.run, uvicorn) too


class Flag:
    """A completion that another thread finishes (or fails) by setting it."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        if self.error is not None:
            raise self.error
        return self._done.is_set()

    def set(self) -> None:
        self._done.set()

    def fail(self, exc: BaseException) -> None:
        self.error = exc


def finish_later(flag: Flag, delay: float) -> threading.Timer:
    timer = threading.Timer(delay, flag.set)
    timer.start()
    return timer


@pytest.fixture
def progress() -> ProgressThread:
    thread = ProgressThread("test-progress", min_nap=1e-5, max_nap=1e-3)
    yield thread
    thread.close()


async def test_done_completion_costs_no_thread(progress: ProgressThread) -> None:
    flag = Flag()
    flag.set()
    future = progress.watch(flag)
    assert future.done() and future.result() is None
    assert "idle" in repr(progress)  # the thread was never started
    assert progress.pending == 0


async def test_completion_from_another_thread_wakes_the_loop(progress: ProgressThread) -> None:
    flags = [Flag() for _ in range(20)]
    timers = [finish_later(f, 0.01 + 0.002 * i) for i, f in enumerate(flags)]
    loop = asyncio.get_running_loop()
    gaps: list[float] = []

    async def ticker() -> None:
        last = loop.time()
        while True:
            await asyncio.sleep(0.001)
            now = loop.time()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    start = loop.time()
    await asyncio.gather(*(progress.wait(f) for f in flags))
    elapsed = loop.time() - start
    tick.cancel()
    for t in timers:
        t.join()
    assert all(f.queries >= 1 for f in flags)
    assert 0.04 <= elapsed < 5
    assert progress.pending == 0
    # The loop kept running while the thread polled (it is never blocked by the wait).
    assert len(gaps) > 5
    assert "running" in repr(progress)


async def test_failure_and_timeout(progress: ProgressThread) -> None:
    flag = Flag()
    future = progress.watch(flag, what="all_reduce (seq 3)")
    flag.fail(RuntimeError("cudaErrorIllegalAddress"))
    with pytest.raises(DistBackendError, match=r"all_reduce \(seq 3\) failed: RuntimeError: cuda"):
        await future
    assert isinstance(future.exception().__cause__, RuntimeError)

    ours = Flag()
    waiter = progress.watch(ours)
    ours.fail(DistUsageError("kept as it is"))
    with pytest.raises(DistUsageError, match="kept as it is"):
        await waiter

    never = Flag()
    start = time.monotonic()
    with pytest.raises(DistTimeoutError, match="broadcast on rank 1 did not finish in time"):
        await progress.wait(never, timeout=0.05, what="broadcast on rank 1")
    assert 0.04 <= time.monotonic() - start < 2
    assert progress.pending == 0


async def test_cancelled_waiter_stops_the_watch(progress: ProgressThread) -> None:
    flag = Flag()
    task = asyncio.create_task(progress.wait(flag))
    await asyncio.sleep(0.01)
    assert progress.pending == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert progress.pending == 0


async def test_waiters_on_two_loops(progress: ProgressThread) -> None:
    other_result: list[bool] = []
    flag_here, flag_there = Flag(), Flag()

    def other_loop() -> None:
        async def main() -> None:
            await progress.wait(flag_there)
            other_result.append(flag_there._done.is_set())  # woken once it was done

        asyncio.run(main())

    thread = threading.Thread(target=other_loop)
    thread.start()
    finish_later(flag_there, 0.02)
    finish_later(flag_here, 0.03)
    await progress.wait(flag_here)
    assert flag_here._done.is_set()
    thread.join(5)
    assert other_result == [True]


async def test_keep_holds_memory_until_done(progress: ProgressThread) -> None:
    class Buffer:
        pass

    flag = Flag()
    buffer = Buffer()
    ref = weakref.ref(buffer)
    progress.keep(flag, buffer)
    del buffer
    gc.collect()
    assert ref() is not None
    flag.set()
    for _ in range(200):
        await asyncio.sleep(0.005)
        gc.collect()
        if ref() is None:
            break
    assert ref() is None
    assert progress.pending == 0


async def test_checks_run_while_pending_and_report_errors(progress: ProgressThread) -> None:
    calls: list[float] = []
    errors: list[BaseException] = []
    broken = threading.Event()

    def check() -> None:
        calls.append(time.monotonic())
        if broken.is_set():
            raise RuntimeError("ncclRemoteError")

    loop = asyncio.get_running_loop()
    reported = loop.create_future()

    def on_error(exc: BaseException) -> None:
        errors.append(exc)
        loop.call_soon_threadsafe(reported.set_result, exc)

    progress.add_check(check, on_error, interval=0.01)
    flag = Flag()
    waiter = progress.watch(flag)
    await asyncio.sleep(0.08)
    assert len(calls) >= 3
    broken.set()
    exc = await asyncio.wait_for(reported, 5)
    assert str(exc) == "ncclRemoteError"
    count = len(calls)
    await asyncio.sleep(0.05)
    assert len(calls) == count  # a failed check is dropped
    flag.set()
    await waiter


async def test_idle_thread_sleeps(progress: ProgressThread) -> None:
    flag = Flag()
    finish_later(flag, 0.01)
    await progress.wait(flag)
    await asyncio.sleep(0.01)
    passes = progress.passes
    await asyncio.sleep(0.05)
    assert progress.passes == passes


async def test_close_fails_pending_waiters() -> None:
    thread = ProgressThread("closing")
    waiter = thread.watch(Flag(), what="reduce (seq 0)")
    await asyncio.sleep(0.01)
    thread.close()
    with pytest.raises(DistBackendError, match="closing was closed while device work was pending"):
        await waiter
    with pytest.raises(DistBackendError, match="is closed: cannot watch"):
        thread.watch(Flag())


def test_bad_naps_and_the_shared_thread() -> None:
    with pytest.raises(ValueError, match="min_nap <= max_nap"):
        ProgressThread(min_nap=1.0, max_nap=0.5)
    assert progress_thread() is progress_thread()
