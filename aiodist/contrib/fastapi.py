"""A serving job's controller in a FastAPI application (``pip install fastapi uvicorn``).

:func:`setup` gives a :class:`fastapi.FastAPI` application a
:class:`~aiodist.serving.Controller` on rank 0; the other ranks run
:func:`aiodist.serving.run_worker`::

    from fastapi import FastAPI, Request

    from aiodist.contrib.fastapi import setup

    app = FastAPI()
    controller = setup(app)  # also app.state.aiodist

    @app.post("/predict")
    async def predict(request: Request) -> dict[str, list[list[float]]]:
        x = parse(await request.body())  # bad input: raise HTTPException(400) here
        replies = await controller.call("forward", x, timeout=5.0)
        return {"y": np.concatenate(replies, axis=1).tolist()}

    uvicorn.run(app)

What :func:`setup` adds:

* the lifespan (wrapped around the application's own): on start-up the controller joins
  the process group in a background task, so the server answers at once (until every rank
  has joined, a call raises :class:`~aiodist.serving.Unavailable`); on shutdown, after the
  server has let the requests in flight finish, the controller finishes its calls, stops
  the workers and destroys the group;
* ``GET /health``: 200 with the controller's state while it can take calls, 503 with the
  state and the reason (the failure being recovered from, with the rank it names) when not;
* ``GET /metrics``: the process's :mod:`aiodist.metrics` for Prometheus, when
  ``prometheus_client`` is installed (``pip install prometheus_client``);
* an exception handler that answers aiodist errors raised by a route as JSON:
  ``Unavailable`` 503, a handler's failure on a worker (:class:`~aiodist.serving.RemoteError`)
  500, a call's deadline (:class:`~aiodist.errors.DistTimeoutError`) 504, a lost worker or
  an aborted group 503.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

try:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError("aiodist.contrib.fastapi needs FastAPI: pip install fastapi uvicorn") from exc

from ..errors import DistError, DistUsageError
from ..serving import Controller
from ._http import enable_metrics, error_response, health_response, metrics_page

__all__ = ["setup"]


def setup(
    app: FastAPI,
    *,
    health_path: str = "/health",
    metrics_path: str | None = "/metrics",
    rebuild: bool = True,
    drain_timeout: float = 30.0,
    **init: Any,
) -> Controller:
    """Run a serving controller in ``app``: lifespan, health check, errors.

    Args:
        app: the application (not started yet).
        health_path: the path of the health check.
        metrics_path: where the process's :mod:`aiodist.metrics` are served, if
            ``prometheus_client`` is installed (``None``: nowhere).
        rebuild: join a new group after a failure (see :class:`~aiodist.serving.Controller`).
        drain_timeout: seconds the shutdown waits for the calls in flight.
        **init: arguments of :func:`aiodist.init_process_group` (default ``env://``).

    Returns:
        The controller (also ``app.state.aiodist``).

    Raises:
        DistUsageError: ``app`` already has a controller, or a bad ``drain_timeout``.
    """
    if getattr(app.state, "aiodist", None) is not None:
        raise DistUsageError(f"setup: {app!r} already has an aiodist controller")
    controller = Controller(rebuild=rebuild, drain_timeout=drain_timeout, **init)
    app.state.aiodist = controller
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[Any]:
        controller.start()
        try:
            async with inner(app) as state:
                yield state
        finally:
            await controller.aclose()

    async def health() -> JSONResponse:
        status, body = health_response(controller)
        return JSONResponse(body, status_code=status)

    async def errors(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, DistError)  # the handler is registered for DistError only
        status, body = error_response(exc)
        return JSONResponse(body, status_code=status)

    app.router.lifespan_context = lifespan
    app.add_api_route(health_path, health, methods=["GET"], include_in_schema=False)
    if metrics_path is not None and enable_metrics():

        async def metrics() -> Response:
            body, kind = metrics_page()
            return Response(body, headers={"Content-Type": kind})

        app.add_api_route(metrics_path, metrics, methods=["GET"], include_in_schema=False)
    app.add_exception_handler(DistError, errors)
    return controller
