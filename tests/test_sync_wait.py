"""The blocking facade's wait: a short poll of the result before sleeping on it."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import numpy as np
import pytest

import aiodist.sync as dist
from aiodist._util import _wait
from aiodist.errors import DistError, DistUsageError
from aiodist.sync import _loop_thread


def _resolve_later(delay: float, fn: object) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        fn()  # type: ignore[operator]

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("delay", [0.0, 0.02])
@pytest.mark.parametrize("spin", [True, False])
def test_wait_returns_a_result_set_during_or_after_the_poll(
    monkeypatch: pytest.MonkeyPatch, delay: float, spin: bool
) -> None:
    # Within the poll (delay 0) the result is found by polling; after it (20 ms), by sleeping.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1" if spin else "100000")
    assert _loop_thread.may_spin() is spin
    future: concurrent.futures.Future[int] = concurrent.futures.Future()
    thread = _resolve_later(delay, lambda: future.set_result(7))
    assert _loop_thread.wait(future) == 7
    thread.join()


def test_wait_raises_the_failure_and_honours_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    failed: concurrent.futures.Future[int] = concurrent.futures.Future()
    thread = _resolve_later(0.0, lambda: failed.set_exception(DistError("rank 1 went away")))
    with pytest.raises(DistError, match="rank 1 went away"):
        _loop_thread.wait(failed)
    thread.join()
    pending: concurrent.futures.Future[int] = concurrent.futures.Future()
    start = time.perf_counter()
    with pytest.raises(concurrent.futures.TimeoutError):
        _loop_thread.wait(pending, 0.05)
    assert time.perf_counter() - start >= 0.05


def test_may_spin_counts_the_ranks_of_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_wait, "_usable_cpus", 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert _loop_thread.may_spin()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert not _loop_thread.may_spin()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "many")
    assert not _loop_thread.may_spin()
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert _loop_thread.may_spin()  # no world, no variable: this process is the only rank


@pytest.mark.parametrize("local_world_size", ["1", "100000"])
def test_blocking_calls_with_and_without_polling(
    monkeypatch: pytest.MonkeyPatch, local_world_size: str
) -> None:
    """A single-rank group and a HashStore through every blocking wait, polling or not."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    store = dist.HashStore()
    try:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            x = np.arange(6, dtype=np.float32)
            dist.all_reduce(x)
            np.testing.assert_array_equal(x, np.arange(6, dtype=np.float32))
            work = dist.broadcast(x, 0, async_op=True)
            assert work is not None and work.wait() is True
            out = [np.zeros(6, np.float32)]
            dist.all_gather(out, x)
            np.testing.assert_array_equal(out[0], x)
            # A usage error found when the operation starts reaches the caller, who waits
            # for the operation's end only (one hop to the loop thread).
            with pytest.raises(
                DistUsageError, match=r"src 5 is not in the process group \(global ranks \[0\]\)"
            ):
                dist.broadcast(x, 5)
            store.set("k", b"v")
            assert store.get("k") == b"v"
            assert store.add("n", 5) == 5
        finally:
            dist.destroy_process_group()
    finally:
        store.close()
