"""Prometheus metrics of the operations of this process (``pip install prometheus_client``).

After :func:`enable`, every operation that ends (collective or point to point, on any group
of any rank in this process) is counted in three metrics of ``prometheus_client``:

``aiodist_operations_total{op, state}``
    operations ended, ``state`` ``completed`` or ``failed``;
``aiodist_operation_array_bytes_total{op}``
    bytes of the arrays the operations were given (inputs and outputs);
``aiodist_operation_seconds{op}``
    a histogram of their durations, from start to end.

``aiodist.contrib.aiohttp`` and ``aiodist.contrib.fastapi`` enable them and serve them at
``/metrics`` when ``prometheus_client`` is installed. Elsewhere, serve them as
``prometheus_client`` does (``prometheus_client.start_http_server(8000)``)::

    import aiodist.metrics

    aiodist.metrics.enable()

Counting costs about a microsecond per operation, and nothing before :func:`enable`.
"""

from __future__ import annotations

import threading
from typing import Any

from . import _recorder
from ._recorder import OpRecord
from .errors import DistUsageError

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

        _registry = target
        _recorder.set_observer(observe)
