"""A world as it forms: the ranks agree on it or fail at once, and a long wait speaks.

``init_process_group`` checks that every rank was given the same world size and backend:
ranks that disagree raise a ``DistUsageError`` naming both values within moments, on every
rank, instead of waiting in silence for the timeout (30 minutes by default). While ranks are
missing, a warning names them at the first minute (here: ``AIODIST_WAIT_WARNING``
shortens it), and the live view shows who has arrived.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import aiodist
from aiodist import debug
from aiodist._assembly._forming import forming_worlds
from aiodist._assembly._join import job_store
from aiodist.backends import cpu
from aiodist.group import isolate_context
from aiodist.testing import free_port, run_world

_RANK = """
import json, sys, time
import aiodist.sync as dist
start = time.monotonic()
try:
    dist.init_process_group("gloo", timeout=60)
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__, "text": str(exc),
                      "took": time.monotonic() - start}))
else:
    print(json.dumps({"error": None, "took": time.monotonic() - start}))
    dist.destroy_process_group()
"""


def _env_ranks(sizes: list[int], extra: dict[str, str] | None = None) -> list[dict[str, object]]:
    """Run ranks 0.. with env:// and these WORLD_SIZEs; return what each printed."""
    port = str(free_port())
    procs = []
    for rank, size in enumerate(sizes):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            **(extra or {}),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _RANK],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=90)
            assert p.returncode == 0, err
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return outs


@pytest.mark.multiprocess
@pytest.mark.parametrize("sizes", [[2, 3], [3, 2]], ids=["host-smaller", "host-larger"])
def test_ranks_given_different_world_sizes_fail_at_once_naming_both(sizes: list[int]) -> None:
    outs = _env_ranks(sizes)
    for out in outs:
        assert out["error"] == "DistUsageError", out
        text = str(out["text"])
        assert "the ranks disagree on the world size" in text, text
        assert f"world_size={sizes[0]}" in text and f"world_size={sizes[1]}" in text, text
        assert "rank 0 (pid" in text and "rank 1 (pid" in text, text
        # At once: well before the 60 s timeout (the ranks poll every half second).
        assert float(out["took"]) < 15, out


_COPY = aiodist.Backend("cpu_copy", "cpu", dict(cpu.BACKEND.ops), setup=cpu.BACKEND.setup)
aiodist.register_backend("cpu_copy", _COPY)


async def test_ranks_given_different_backends_fail_at_once_naming_both() -> None:
    store = aiodist.HashStore()

    async def rank(r: int, backend: str) -> BaseException | None:
        isolate_context()
        try:
            await aiodist.init_process_group(backend, store=store, rank=r, world_size=2, timeout=60)
        except aiodist.DistError as exc:
            return exc
        await aiodist.destroy_process_group()
        return None

    start = time.monotonic()
    errors = await asyncio.gather(rank(0, "cpu"), rank(1, "cpu_copy"))
    assert time.monotonic() - start < 10
    for exc in errors:
        assert isinstance(exc, aiodist.DistUsageError), exc
        assert "disagree on the backend" in str(exc), exc
        assert "backend='cpu'" in str(exc) and "backend='cpu_copy'" in str(exc), exc


async def test_the_records_of_a_disagreement_are_emptied() -> None:
    store = aiodist.HashStore()

    async def rank(r: int, size: int) -> BaseException | None:
        isolate_context()
        try:
            await aiodist.init_process_group(store=store, rank=r, world_size=size, timeout=30)
        except aiodist.DistError as exc:
            return exc
        return None

    errors = await asyncio.gather(rank(0, 2), rank(1, 3))
    assert all(isinstance(e, aiodist.DistUsageError) for e in errors), errors
    # Nobody forms a world any more (what the live view reads).
    assert await forming_worlds(job_store(store, "")) == []


async def test_init_says_which_ranks_have_not_arrived_and_the_live_view_shows_them(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AIODIST_WAIT_WARNING", "0.5")
    store = aiodist.HashStore()

    async def rank(r: int) -> float:
        isolate_context()
        await aiodist.init_process_group(store=store, rank=r, world_size=3, timeout=30)
        x = np.array([float(r + 1)])
        await aiodist.all_reduce(x)
        await aiodist.destroy_process_group()
        return float(x[0])

    early = [asyncio.ensure_future(rank(r)) for r in (0, 1)]
    with caplog.at_level("WARNING", logger="aiodist"):
        await asyncio.sleep(1.5)
    said = [r.getMessage() for r in caplog.records if "have not arrived" in r.getMessage()]
    assert any(
        m.startswith(
            "rank 0: init_process_group waits for the 3 ranks of its world: still waiting after"
        )
        and "ranks [2] have not arrived (ranks [0, 1] have)" in m
        for m in said
    ), said
    entries = await debug.gather_status(store)
    assert [sorted(e) for e in entries] == [["forming", "rank"]] * 2 + [["error", "rank"]]
    assert entries[0]["forming"]["world_size"] == 3 and entries[0]["forming"]["pid"] == os.getpid()
    text = debug.format_status(entries)
    assert (
        text.splitlines()[0] == "a world of 3 ranks is forming: ranks 0, 1 arrived, rank 2 not yet"
    )
    assert "rank 2: has not arrived" in text, text
    assert await asyncio.gather(*early, rank(2)) == [6.0] * 3
    # Formed: the live view shows the world's ranks (here without status endpoints).
    assert all("forming" not in e for e in await debug.gather_status(store))


async def test_a_rank_under_another_group_name_is_named(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AIODIST_WAIT_WARNING", "0.5")
    store = aiodist.HashStore()

    async def rank(r: int, name: str) -> None:
        isolate_context()
        await aiodist.init_process_group(
            store=store, rank=r, world_size=2, group_name=name, timeout=30
        )

    ranks = [asyncio.ensure_future(rank(0, "job")), asyncio.ensure_future(rank(1, "jbo"))]
    with caplog.at_level("WARNING", logger="aiodist"):
        await asyncio.sleep(1.5)
    for task in ranks:
        task.cancel()
    await asyncio.gather(*ranks, return_exceptions=True)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rank 0:")]
    assert any(
        "rank 1 forms a world of 2 under group_name 'jbo' (every rank must pass the same "
        "group_name)" in m
        for m in said
    ), said


async def test_a_collective_says_which_peer_it_waits_for(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AIODIST_WAIT_WARNING", "0.4")

    async def fn(rank: int, size: int) -> float:
        x = np.array([float(rank + 1)])
        if rank == 2:
            await asyncio.sleep(2.0)  # (user code that takes its time)
        await aiodist.all_reduce(x)
        return float(x[0])

    with caplog.at_level("WARNING", logger="aiodist"):
        assert await run_world(fn, 3) == [6.0] * 3
    said = [r.getMessage() for r in caplog.records if "still waits after" in r.getMessage()]
    for r in (0, 1):
        assert any(
            m.startswith(f"rank {r}: all_reduce (seq 0) on <ProcessGroup rank={r}/3")
            and "group ranks [2] have not called it (or only just)" in m
            for m in said
        ), said
    assert not any(m.startswith("rank 2:") for m in said), said


async def test_a_store_that_cannot_be_reached_is_named_while_connecting(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AIODIST_WAIT_WARNING", "0.5")
    port = free_port()  # nobody listens there
    with caplog.at_level("WARNING", logger="aiodist"), pytest.raises(aiodist.DistNetworkError):
        await aiodist.TCPStore.create("127.0.0.1", port, timeout=1.5)
    said = [r.getMessage() for r in caplog.records]
    assert any(
        m.startswith(f"TCPStore: connecting to the store at 127.0.0.1:{port} (is its host up")
        and "still waiting after" in m
        for m in said
    ), said
