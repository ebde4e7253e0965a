"""What the web integrations answer: the health check, the metrics, and aiodist errors as
HTTP responses."""

from __future__ import annotations

import logging
from typing import Any

from ..errors import DistError, DistTimeoutError, DistUsageError
from ..serving import Controller, RemoteError, Unavailable

__all__ = ["enable_metrics", "error_response", "health_response", "metrics_page"]

logger = logging.getLogger(__name__)


def enable_metrics() -> bool:
    """Enable :mod:`aiodist.metrics` in the process's registry for a web application's
    ``/metrics``; ``False`` (and a log line saying why) when ``prometheus_client`` is not
    installed."""
    from .. import metrics

    try:
        metrics.enable()
    except ImportError as exc:
        logger.info("no metrics endpoint: %s", exc)
        return False
    return True


def metrics_page() -> tuple[bytes, str]:
    """The process's metrics in Prometheus' text format, and its content type."""
    import prometheus_client

    return prometheus_client.generate_latest(), prometheus_client.CONTENT_TYPE_LATEST


def health_response(controller: Controller) -> tuple[int, dict[str, Any]]:
    """``(200, state)`` when the controller can take calls, else ``(503, state)``.

    The state names the cause when the group failed (``reason``), so a load balancer's
    health log says why a server left the pool.
    """
    state = controller.health()
    return (200 if state["ready"] else 503), state


def error_response(exc: DistError) -> tuple[int, dict[str, Any]]:
    """The HTTP status and JSON body for an aiodist error that a request handler raised.

    * :class:`~aiodist.serving.Unavailable` (starting, rebuilding, closing): 503, with the
      controller's state and reason;
    * :class:`~aiodist.serving.RemoteError` (a handler raised on a worker): 500, with the
      failures by rank;
    * :class:`~aiodist.errors.DistTimeoutError` (the call's deadline passed): 504;
    * :class:`~aiodist.errors.DistUsageError` (the server passed something invalid): 500;
    * any other :class:`~aiodist.errors.DistError` (a worker lost, the group aborted): 503.
    """
    body: dict[str, Any] = {"error": str(exc), "type": type(exc).__name__}
    if isinstance(exc, Unavailable):
        body.update(state=exc.state, reason=exc.reason)
        return 503, body
    if isinstance(exc, RemoteError):
        body["failures"] = {str(rank): text for rank, text in exc.failures.items()}
        return 500, body
    if isinstance(exc, DistTimeoutError):
        return 504, body
    if isinstance(exc, DistUsageError):
        return 500, body
    return 503, body
