"""A test server: the model of examples/serving_aiohttp.py plus handlers that fail on purpose.

Run like the example (``aiodist-run --standalone --nproc-per-node=3 tests/serving_app.py``).
``POST /fail`` runs a handler that raises on rank 1 while rank 2 waits for it in an
all_gather; ``POST /stall`` one in which rank 2 sleeps ``{"seconds": s}`` under a call
deadline of ``{"timeout": t}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from pathlib import Path

import numpy as np
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import serving_aiohttp as example

import aiodist
from aiodist import serving
from aiodist.contrib.aiohttp import CONTROLLER


async def fail(x: np.ndarray) -> np.ndarray:
    group = serving.worker_group()
    if group.rank == 0:
        raise ValueError(f"shard 0 refuses a batch of {len(x)}")
    out = np.empty((group.size, *x.shape), x.dtype)
    await aiodist.all_gather_into_tensor(out, x, group=group)
    return out


async def stall(seconds: np.ndarray) -> np.ndarray:
    group = serving.worker_group()
    if group.rank == group.size - 1:
        await asyncio.sleep(float(seconds[0]))
    return seconds


HANDLERS = {"forward": example.forward, "fail": fail, "stall": stall}


def make_app() -> web.Application:
    app = example.make_app()
    controller = app[CONTROLLER]

    async def fail_route(request: web.Request) -> web.Response:
        await controller.call("fail", example.parse(await request.read()), timeout=5)
        return web.json_response({"unexpected": "no failure"})

    async def stall_route(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        seconds = np.array([body["seconds"]], np.float64)
        await controller.call("stall", seconds, timeout=body["timeout"])
        return web.json_response({"stalled": body["seconds"]})

    app.router.add_post("/fail", fail_route)
    app.router.add_post("/stall", stall_route)
    return app


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if os.environ.get("RANK", "0") == "0":
        port = int(os.environ["PORT"])
        web.run_app(
            make_app(), host="127.0.0.1", port=port, loop=example.new_loop(), access_log=None
        )
    else:
        with asyncio.Runner(loop_factory=example.new_loop) as runner:
            runner.run(serving.run_worker(HANDLERS))
