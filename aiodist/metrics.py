"""Prometheus metrics of the operations of this process (``pip install prometheus_client``).

After :func:`enable`, every operation that ends (collective or point to point, on any group
of any rank in this process) is counted in three metrics of ``prometheus_client``:

``aiodist_operations_total{op, state}``
    operations ended, ``state`` ``completed`` or ``failed``;
``aiodist_operation_array_bytes_total{op}``
    bytes of the arrays the operations were given (inputs and outputs);
``aiodist_operation_seconds{op}``
    a histogram of their durations, from start to end.

and, for each serving :class:`~aiodist.serving.Controller` of the process, in four more:

``aiodist_serving_state{state}``
    1 for the state the controller is in now (``starting``, ``ready``, ``rebuilding``,
    ``failed``, ...), 0 for the others;
``aiodist_serving_rebuilds_total``
    the process groups it built again after a failure;
``aiodist_serving_calls_total{outcome}``
    the calls made through it, ``outcome`` ``completed``, ``failed`` or ``refused`` (the
    controller was not ready);
``aiodist_serving_calls_in_flight``
    the calls running now.

``aiodist.contrib.aiohttp`` and ``aiodist.contrib.fastapi`` enable them and serve them at
``/metrics`` when ``prometheus_client`` is installed. Elsewhere, serve them as
``prometheus_client`` does (``prometheus_client.start_http_server(8000)``)::

    import aiodist.metrics

    aiodist.metrics.enable()

Counting costs about a microsecond per operation, and nothing before :func:`enable`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from .errors import DistUsageError
from .group import _recorder
from .group._recorder import OpRecord

__all__ = ["BUCKETS", "enable"]

#: The histogram's buckets in seconds, from 10 µs (a small operation in shared memory) to
#: 30 s.
BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)

_lock = threading.Lock()
_registry: Any = None


def enable(registry: Any = None) -> None:
    """Count every operation of this process from now on, in ``registry``.

    Args:
        registry: a ``prometheus_client.CollectorRegistry``; default the process's
            (``prometheus_client.REGISTRY``, what ``generate_latest()`` and
            ``start_http_server()`` serve). Enabling again with the same registry does
            nothing.

    Raises:
        ImportError: ``prometheus_client`` is not installed.
        DistUsageError: the metrics are enabled already, in another registry.
    """
    global _registry
    try:
        import prometheus_client
    except ImportError as exc:
        raise ImportError(
            "aiodist.metrics needs prometheus_client: pip install prometheus_client"
        ) from exc
    target = prometheus_client.REGISTRY if registry is None else registry
    with _lock:
        if _registry is not None:
            if _registry is target:
                return
            raise DistUsageError("aiodist.metrics is enabled already, in another registry")
        ops = prometheus_client.Counter(
            "aiodist_operations",
            "aiodist operations ended, by operation and outcome",
            ["op", "state"],
            registry=target,
        )
        nbytes = prometheus_client.Counter(
            "aiodist_operation_array_bytes",
            "Bytes of the arrays aiodist operations were given (inputs and outputs)",
            ["op"],
            registry=target,
        )
        seconds = prometheus_client.Histogram(
            "aiodist_operation_seconds",
            "Durations of aiodist operations, from start to end",
            ["op"],
            buckets=BUCKETS,
            registry=target,
        )
        # One child per label set, made once: a lookup by label costs more than the count.
        children: dict[tuple[str, str], tuple[Any, Any, Any]] = {}

        def observe(record: OpRecord) -> None:
            key = (record.op, record.state)
            child = children.get(key)
            if child is None:
                child = children[key] = (
                    ops.labels(record.op, record.state),
                    nbytes.labels(record.op),
                    seconds.labels(record.op),
                )
            count, size, duration = child
            count.inc()
            if record.nbytes:
                size.inc(record.nbytes)
            duration.observe(record.ended - (record.started or record.queued))

        target.register(_ServingCollector())
        _registry = target
        _recorder.set_observer(observe)


class _ServingCollector:
    """The serving controllers' metrics, read from them when scraped (see the module)."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from .serving import STATES, controllers

        healths = [c.health() for c in controllers()]
        state = GaugeMetricFamily(
            "aiodist_serving_state", "The serving controller's state (1: now)", labels=["state"]
        )
        for name in STATES:
            state.add_metric([name], sum(h["state"] == name for h in healths))
        rebuilds = CounterMetricFamily(
            "aiodist_serving_rebuilds", "Process groups the serving controller built again"
        )
        rebuilds.add_metric([], sum(max(0, h["generation"] - 1) for h in healths))
        calls = CounterMetricFamily(
            "aiodist_serving_calls", "Calls through the serving controller", labels=["outcome"]
        )
        failed = sum(h["failed"] for h in healths)
        calls.add_metric(["completed"], sum(h["calls"] - h["in_flight"] for h in healths) - failed)
        calls.add_metric(["failed"], failed)
        calls.add_metric(["refused"], sum(h["refused"] for h in healths))
        in_flight = GaugeMetricFamily(
            "aiodist_serving_calls_in_flight", "Calls through the serving controller running now"
        )
        in_flight.add_metric([], sum(h["in_flight"] for h in healths))
        yield from (state, rebuilds, calls, in_flight)
