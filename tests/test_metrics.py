"""Prometheus metrics: every operation counted once, with its outcome, bytes and duration."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import prometheus_client
import pytest

import aiodist
import aiodist.metrics
from aiodist import _recorder
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
