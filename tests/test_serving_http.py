"""The serving examples under aiodist-run, on uvloop and on the standard loop, with a real
HTTP client: answers against numpy, bad bodies, the health check, and a drained shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving_helpers import (
    EXAMPLES,
    Client,
    Launched,
    error_text,
    load_example,
    ready,
    reference,
    wait_until,
)

import aiodist
from aiodist.testing import free_port

pytestmark = pytest.mark.multiprocess


BAD_BODIES = [
    (b"not json", 'expected {"x": [[16 numbers], ...]}: Expecting value'),
    (b'{"y": [[1]]}', "expected {\"x\": [[16 numbers], ...]}: 'x'"),
    (b"[1, 2]", "list indices must be integers"),
    (b'{"x": [[1, 2], [3]]}', "inhomogeneous"),
    (json.dumps({"x": [["a"] * 16]}).encode(), "could not convert string to float"),
    (json.dumps({"x": [[None] * 16]}).encode(), "not finite"),
    (json.dumps({"x": [[1.0] * 15]}).encode(), "x must have shape (1..256, 16), got (1, 15)"),
    (b'{"x": []}', "x must have shape (1..256, 16), got (0,)"),
    (json.dumps({"x": [[0.0] * 16] * 257}).encode(), "got (257, 16)"),
    (b'{"x": [[NaN, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]]}', "not finite"),
]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
@pytest.mark.parametrize(
    ("example", "client_kind"),
    [("serving_aiohttp.py", "aiohttp"), ("serving_fastapi.py", "httpx")],
)
async def test_an_example_answers_like_numpy_and_drains_on_shutdown(
    example: str, client_kind: str, loop: str, tmp_path: Path
) -> None:
    weights = load_example(example).weights()
    port = free_port()
    launched = Launched(
        EXAMPLES / example, 3, tmp_path / "job.log", PORT=str(port), AIODIST_LOOP=loop
    )
    async with launched as job, Client(client_kind, port) as client:
        health = await ready(client)
        assert health == {
            "ready": True,
            "state": "ready",
            "reason": "",
            "generation": 1,
            "world_size": 3,
            "calls": 0,
            "failed": 0,
            "in_flight": 0,
            "refused": 0,
        }, job.output()

        # Requests of every batch size, eight at a time, each checked against numpy.
        rng = np.random.default_rng(7)
        batches = [rng.standard_normal((n, 16)).astype(np.float32) for n in range(1, 33)]
        limit = asyncio.Semaphore(8)

        async def ask(x: np.ndarray) -> tuple[int, Any]:
            async with limit:
                return await client.predict(x)

        answers = await asyncio.gather(*(ask(x) for x in batches))
        for x, (status, body) in zip(batches, answers, strict=True):
            assert status == 200, body
            y = np.array(body["y"], np.float32)
            np.testing.assert_allclose(y, reference(x, weights), rtol=1e-5, atol=1e-5)

        # Bad bodies get 400 with the reason, and never reach the group.
        for body, message in BAD_BODIES:
            status, answer = await client.request("POST", "/predict", body)
            assert status == 400, (body, answer)
            assert message in error_text(answer), (body, answer)
        status, health = await client.health()
        assert status == 200 and health["calls"] == len(batches) and health["failed"] == 0

        # The controller's operations, for Prometheus: each call broadcast its request.
        status, kind, text = await client.text("/metrics")
        assert status == 200 and kind.startswith("text/plain"), (status, kind)
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        completed = (("op", "broadcast"), ("state", "completed"))
        assert samples[("aiodist_operations_total", completed)] >= len(batches), text
        assert (
            "aiodist_operations_total",
            (("op", "broadcast"), ("state", "failed")),
        ) not in samples
        assert samples[("aiodist_operation_seconds_count", (("op", "broadcast"),))] >= len(batches)

        # Shutdown while requests keep coming: every request the server took is answered
        # in full; the others are refused at the connection.
        done: list[tuple[int, Any, np.ndarray]] = []

        async def keep_asking(seed: int) -> None:
            local = np.random.default_rng(seed)
            while True:
                x = local.standard_normal((4, 16)).astype(np.float32)
                try:
                    status, body = await client.predict(x)
                except ConnectionError:
                    return
                done.append((status, body, x))

        async def enough() -> bool:
            return len(done) >= 40

        askers = [asyncio.ensure_future(keep_asking(s)) for s in range(8)]
        await wait_until(enough, 30, "40 answers")
        stopped = time.monotonic()
        await job.stop()
        await asyncio.wait_for(asyncio.gather(*askers), 30)
        assert time.monotonic() - stopped < 15
        assert len(done) >= 40
        for status, body, x in done:
            assert status == 200, body
            np.testing.assert_allclose(
                np.array(body["y"], np.float32), reference(x, weights), rtol=1e-5, atol=1e-5
            )
    out = job.output()
    assert "serving controller: closed: shut down" in out, out
    assert out.count("serving until the controller closes the channel") == 2, out
    assert "Traceback" not in out, out


# -- the integrations' set-up, in-process ------------------------------------------------------------
def test_an_application_takes_one_controller() -> None:
    from aiohttp import web
    from fastapi import FastAPI

    from aiodist.contrib import aiohttp as with_aiohttp, fastapi as with_fastapi

    app = web.Application()
    controller = with_aiohttp.setup(app)
    assert app[with_aiohttp.CONTROLLER] is controller and controller.state == "new"
    with pytest.raises(aiodist.DistUsageError, match=r"already has an aiodist controller"):
        with_aiohttp.setup(app)
    api = FastAPI()
    controller = with_fastapi.setup(api)
    assert api.state.aiodist is controller
    with pytest.raises(aiodist.DistUsageError, match=r"already has an aiodist controller"):
        with_fastapi.setup(api)


async def test_fastapi_setup_keeps_the_applications_own_lifespan() -> None:
    from fastapi import FastAPI

    from aiodist.contrib.fastapi import setup

    events = []

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, int]]:
        events.append("enter")
        yield {"answer": 42}
        events.append("exit")

    api = FastAPI(lifespan=lifespan)
    # Rank 0 of two, with no rank 1: the controller stays "starting" until shut down.
    controller = setup(api, store=aiodist.HashStore(), rank=0, world_size=2, timeout=10)

    async def run() -> None:
        async with api.router.lifespan_context(api) as state:
            assert state == {"answer": 42}
            await asyncio.sleep(0.2)
            assert controller.state == "starting", controller.reason
        assert controller.state == "closed"

    context = contextvars.copy_context()
    context.run(aiodist.group.isolate_context)  # its group stays out of the process default
    await asyncio.create_task(run(), context=context)
    assert events == ["enter", "exit"]
