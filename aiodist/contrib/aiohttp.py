"""A serving job's controller in an aiohttp application (``pip install aiohttp``).

:func:`setup` gives an :class:`aiohttp.web.Application` a
:class:`~aiodist.serving.Controller` on rank 0; the other ranks run
:func:`aiodist.serving.run_worker`::

    from aiohttp import web

    from aiodist.contrib.aiohttp import setup

    app = web.Application()
    controller = setup(app)  # also app[aiodist.contrib.aiohttp.CONTROLLER]

    async def predict(request: web.Request) -> web.Response:
        x = parse(await request.read())  # bad input: answer 400 here, before any call
        replies = await controller.call("forward", x, timeout=5.0)
        return web.json_response({"y": np.concatenate(replies, axis=1).tolist()})

    app.router.add_post("/predict", predict)
    web.run_app(app)

What :func:`setup` adds:

* start-up: the controller joins the process group in a background task, so the server
  answers at once; until every rank has joined, a call raises
  :class:`~aiodist.serving.Unavailable`;
* ``GET /health``: 200 with the controller's state while it can take calls, 503 with the
  state and the reason (the failure being recovered from, with the rank it names) when not;
* ``GET /metrics``: the process's :mod:`aiodist.metrics` for Prometheus, when
  ``prometheus_client`` is installed (``pip install prometheus_client``);
* a middleware that answers aiodist errors raised by a request handler as JSON:
  ``Unavailable`` 503, a handler's failure on a worker (:class:`~aiodist.serving.RemoteError`)
  500, a call's deadline (:class:`~aiodist.errors.DistTimeoutError`) 504, a lost worker or
  an aborted group 503;
* shutdown (``on_cleanup``, after aiohttp has let the requests in flight finish): the
  controller finishes its calls, stops the workers and destroys the group.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

try:
    from aiohttp import web
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError("aiodist.contrib.aiohttp needs aiohttp: pip install aiohttp") from exc

from ..errors import DistError, DistUsageError
from ..serving import Controller
from ._http import enable_metrics, error_response, health_response, metrics_page

__all__ = ["CONTROLLER", "setup"]

#: The key of the application's controller, ``app[CONTROLLER]`` (``request.app[CONTROLLER]``).
CONTROLLER = web.AppKey("aiodist_controller", Controller)


def setup(
    app: web.Application,
    *,
    health_path: str = "/health",
    metrics_path: str | None = "/metrics",
    rebuild: bool = True,
    drain_timeout: float = 30.0,
    **init: Any,
) -> Controller:
    """Run a serving controller in ``app``: start, health check, errors, shutdown.

    Args:
        app: the application (not started yet).
        health_path: the path of the health check.
        metrics_path: where the process's :mod:`aiodist.metrics` are served, if
            ``prometheus_client`` is installed (``None``: nowhere).
        rebuild: join a new group after a failure (see :class:`~aiodist.serving.Controller`).
        drain_timeout: seconds the shutdown waits for the calls in flight.
        **init: arguments of :func:`aiodist.init_process_group` (default ``env://``).

    Returns:
        The controller (also ``app[CONTROLLER]``).

    Raises:
        DistUsageError: ``app`` already has a controller, or a bad ``drain_timeout``.
    """
    if CONTROLLER in app:
        raise DistUsageError(f"setup: {app!r} already has an aiodist controller")
    controller = Controller(rebuild=rebuild, drain_timeout=drain_timeout, **init)
    app[CONTROLLER] = controller

    async def start(app: web.Application) -> None:
        controller.start()

    async def close(app: web.Application) -> None:
        await controller.aclose()

    async def health(request: web.Request) -> web.Response:
        status, body = health_response(controller)
        return web.json_response(body, status=status)

    app.on_startup.append(start)
    app.on_cleanup.append(close)
    app.router.add_get(health_path, health)
    if metrics_path is not None and enable_metrics():

        async def metrics(request: web.Request) -> web.Response:
            body, kind = metrics_page()
            return web.Response(body=body, headers={"Content-Type": kind})

        app.router.add_get(metrics_path, metrics)
    app.middlewares.append(_errors)
    return controller


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except DistError as exc:
        status, body = error_response(exc)
        return web.json_response(body, status=status)
