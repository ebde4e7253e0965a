"""A tensor-parallel numpy MLP behind a FastAPI server: rank 0 serves HTTP, ranks 1.. hold shards.

    aiodist-run --standalone --nproc-per-node=3 examples/serving_fastapi.py

(add ``--restart-policy=failed`` to have a worker that dies restarted while rank 0 keeps
serving), and from another shell:

    curl -s localhost:8000/health
    curl -s localhost:8000/predict -d '{"x": [[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15]]}'

Rank 0 runs uvicorn; ``aiodist.contrib.fastapi.setup`` wraps the application's lifespan
with a serving controller that joins the process group in the background (requests
meanwhile get 503 with the reason), answers ``/health`` (200 while the group is up, 503 with
the cause once a worker is lost) and drains on shutdown. The other ranks run
``aiodist.serving.run_worker``. The model is a 2-layer MLP (16 -> 64 -> 8, ReLU) whose two
weight matrices are split by columns across the workers: a request's batch goes to every
worker in one call; each computes its columns of the hidden layer, the workers all_gather
them, and each computes its columns of the output, which rank 0 joins. The answer equals
``reference(x)``, the single-process numpy model. Bad request bodies get 400 before
anything reaches the group. A worker that dies fails the requests in flight at once; once
it is restarted, rank 0 rebuilds the group in-process and answers again.

``PORT`` (default 8000) sets the port, ``AIODIST_LOOP=asyncio`` the standard event loop
instead of uvloop. ``examples/serving_aiohttp.py`` is the same server with aiohttp.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os

import numpy as np
import numpy.typing as npt
import uvicorn
import uvloop
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

import aiodist
from aiodist import serving
from aiodist.contrib.fastapi import setup

D_IN, D_HIDDEN, D_OUT = 16, 64, 8
MAX_BATCH = 256
TIMEOUT = 5.0  # seconds a request may wait for the workers
Array = npt.NDArray[np.float32]


# -- the model: the same code a single process would run ------------------------------------------
@functools.cache
def weights() -> tuple[Array, Array]:
    """Both weight matrices, the same in every process."""
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((D_IN, D_HIDDEN)) / 4).astype(np.float32)
    w2 = (rng.standard_normal((D_HIDDEN, D_OUT)) / 8).astype(np.float32)
    return w1, w2


def reference(x: Array) -> Array:
    """The whole model in one process."""
    w1, w2 = weights()
    return np.maximum(x @ w1, 0) @ w2


def parse(body: bytes) -> Array:
    """The request's batch as a float32 array of shape (n, D_IN); ValueError says what is wrong."""
    try:
        x = np.asarray(json.loads(body)["x"], dtype=np.float32)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f'expected {{"x": [[{D_IN} numbers], ...]}}: {exc}') from None
    if x.ndim != 2 or x.shape[1] != D_IN or not 1 <= len(x) <= MAX_BATCH:
        raise ValueError(f"x must have shape (1..{MAX_BATCH}, {D_IN}), got {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("x holds numbers that are not finite")
    return x


async def forward(x: Array) -> Array:
    """A worker's part of the model: its columns of w1 and of w2."""
    group = serving.worker_group()
    w1, w2 = (np.split(w, group.size, axis=1)[group.rank] for w in weights())
    h = np.maximum(x @ w1, 0)
    hidden = np.empty((group.size, *h.shape), h.dtype)
    await aiodist.all_gather_into_tensor(hidden, h, group=group)
    return np.concatenate(hidden, axis=1) @ w2


# -- serving ------------------------------------------------------------------------------------------
def make_app() -> FastAPI:
    app = FastAPI()
    controller = setup(app)

    @app.post("/predict")
    async def predict(request: Request) -> JSONResponse:
        try:
            x = parse(await request.body())
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        columns = await controller.call("forward", x, timeout=TIMEOUT)
        return JSONResponse({"y": np.concatenate(columns, axis=1).tolist()})

    return app


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    loop = os.environ.get("AIODIST_LOOP", "auto")
    if os.environ.get("RANK", "0") == "0":
        port = int(os.environ.get("PORT", "8000"))
        uvicorn.run(make_app(), host="127.0.0.1", port=port, loop=loop, access_log=False)
    else:
        run = asyncio.run if loop == "asyncio" else uvloop.run
        run(serving.run_worker({"forward": forward}))
