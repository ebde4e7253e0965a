"""Prometheus metrics: every operation counted once, with its outcome, bytes and duration."""

from __future__ import annotations

import asyncio
import contextvars
import gc
from collections.abc import Iterator

import numpy as np
import prometheus_client
import pytest

import aiodist
import aiodist.metrics
from aiodist import serving
from aiodist.group import _recorder
from aiodist.serving import STATES, Controller, Unavailable
from aiodist.testing import run_world


@pytest.fixture
def registry() -> Iterator[prometheus_client.CollectorRegistry]:
    """Metrics enabled in a registry of the test's own, and disabled again after it."""
    # (A web application's setup in this process may have enabled them in the default one.)
    before = _recorder.observer, aiodist.metrics._registry
    _recorder.observer = aiodist.metrics._registry = None
    registry = prometheus_client.CollectorRegistry()
    aiodist.metrics.enable(registry)
    yield registry
    _recorder.observer, aiodist.metrics._registry = before


async def test_operations_are_counted_with_outcome_bytes_and_duration(
    registry: prometheus_client.CollectorRegistry,
) -> None:
    async def fn(rank: int, size: int) -> None:
        x = np.ones(4)  # 32 bytes
        for _ in range(3):
            await aiodist.all_reduce(x)
        await aiodist.broadcast(np.zeros(2, dtype=np.int32), src=0)  # 8 bytes
        # Called differently on the two ranks: both fail.
        with pytest.raises(aiodist.DistUsageError):
            await aiodist.all_reduce(np.ones(rank + 1))

    await run_world(fn, 2)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    # Both ranks run in this process: each operation is counted once per rank.
    assert value("aiodist_operations_total", op="all_reduce", state="completed") == 6
    assert value("aiodist_operations_total", op="broadcast", state="completed") == 2
    assert value("aiodist_operations_total", op="all_reduce", state="failed") == 2
    assert value("aiodist_operation_array_bytes_total", op="broadcast") == 16
    # The completed all_reduces' 6 x 32 bytes, and the failed ones' 8 + 16.
    assert value("aiodist_operation_array_bytes_total", op="all_reduce") == 6 * 32 + 8 + 16
    assert value("aiodist_operation_seconds_count", op="all_reduce") == 8
    assert value("aiodist_operation_seconds_bucket", op="broadcast", le="+Inf") == 2
    assert value("aiodist_operation_seconds_sum", op="broadcast") > 0


def test_enabling_twice(registry: prometheus_client.CollectorRegistry) -> None:
    aiodist.metrics.enable(registry)  # the same registry: nothing happens
    with pytest.raises(aiodist.DistUsageError, match="enabled already, in another registry"):
        aiodist.metrics.enable(prometheus_client.CollectorRegistry())


async def _double(x: np.ndarray) -> np.ndarray:
    return 2 * x


async def _fail(x: np.ndarray) -> np.ndarray:
    raise ValueError("a handler that fails")


def _isolated() -> contextvars.Context:
    context = contextvars.copy_context()
    context.run(aiodist.group.isolate_context)
    return context


async def test_a_serving_controllers_state_rebuilds_and_calls(
    registry: prometheus_client.CollectorRegistry,
) -> None:
    # (Counted from here: a controller of an earlier test may still be alive.)
    gc.collect()

    def raw(name: str, labels: dict[str, str]) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    series = [("aiodist_serving_state", {"state": s}) for s in STATES] + [
        ("aiodist_serving_rebuilds_total", {}),
        ("aiodist_serving_calls_in_flight", {}),
        *(
            ("aiodist_serving_calls_total", {"outcome": o})
            for o in ("completed", "failed", "refused")
        ),
    ]
    base = {(name, tuple(labels.items())): raw(name, labels) for name, labels in series}

    def value(name: str, **labels: str) -> float:
        return raw(name, labels) - base[name, tuple(labels.items())]

    def state() -> list[str]:
        return [s for s in STATES if value("aiodist_serving_state", state=s) == 1]

    store = aiodist.HashStore()
    controller = Controller(store=store, rank=0, world_size=2, timeout=30)
    assert state() == ["new"]
    with pytest.raises(Unavailable):
        await controller.call("double", np.ones(2))
    starting = asyncio.create_task(_start(controller), context=_isolated())
    await starting
    assert state() == ["starting"]
    handlers = {"double": _double, "fail": _fail}
    worker = asyncio.create_task(
        serving.run_worker(handlers, store=store, rank=1, world_size=2, timeout=30),
        context=_isolated(),
    )
    first = await controller.wait_ready(10)
    assert state() == ["ready"]
    assert (await controller.call("double", np.ones(2), timeout=10))[0].tolist() == [2.0, 2.0]
    with pytest.raises(serving.RemoteError):
        await controller.call("fail", np.ones(2), timeout=10)
    first.group.abort("a worker was lost")
    await asyncio.sleep(0)
    assert state() == ["rebuilding"]
    second = await controller.wait_ready(10)
    assert second is not first and state() == ["ready"]
    await controller.call("double", np.ones(2), timeout=10)
    assert value("aiodist_serving_rebuilds_total") == 1
    assert value("aiodist_serving_calls_total", outcome="completed") == 2
    assert value("aiodist_serving_calls_total", outcome="failed") == 1
    assert value("aiodist_serving_calls_total", outcome="refused") == 1
    assert value("aiodist_serving_calls_in_flight") == 0
    await controller.aclose()
    assert state() == ["closed"]
    await asyncio.wait_for(worker, 10)


async def _start(controller: Controller) -> None:
    controller.start()
