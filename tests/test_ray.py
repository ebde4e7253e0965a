"""aiodist.contrib.ray: groups of Ray actors on a local Ray cluster (``ray.init`` in this process).

Ray runs in the test's network namespace with only loopback: its node address falls back to
127.0.0.1 there, where the actors' stores and transports listen too.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import numpy as np
import pytest
import ray

import aiodist
from aiodist.contrib.ray import AiodistActor, create_group, destroy_group

pytestmark = [pytest.mark.ray, pytest.mark.multiprocess]

N = 4096


def contribution(rank: int, scale: float) -> np.ndarray:
    return (np.arange(N, dtype=np.float64) + rank) * scale


class Shard(AiodistActor):
    """A user's actor: state of its own, and methods that use aiodist's async API."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    async def reduce_own_part(self) -> np.ndarray:
        x = contribution(aiodist.get_rank(), self.scale)
        work = aiodist.all_reduce(x)  # started; the loop is free until it is awaited
        await asyncio.sleep(0)
        await work
        return x

    async def broadcast_from(self, root: int, x: np.ndarray) -> np.ndarray:
        x = x.copy()  # Ray hands array arguments over read-only, straight from its object store
        await aiodist.broadcast(x, src=root)
        return x

    async def gather_places(self) -> list[object]:
        place = (aiodist.get_rank(), aiodist.get_world_size(), os.getpid())
        out: list[object] = [None] * aiodist.get_world_size()
        await aiodist.all_gather_object(out, place)
        return out

    async def in_group(self) -> bool:
        return aiodist.is_initialized()


class NotAnAiodistActor:
    async def f(self) -> None:
        pass


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    # The actors' processes import this module (Shard) by name, as Ray does for a user's module.
    tests = os.path.dirname(__file__)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": tests}},
    )
    try:
        yield
    finally:
        ray.shutdown()


def test_a_group_of_actors_runs_collectives(local_ray: None) -> None:
    # num_cpus=0: three actors on a two-CPU cluster (they mostly wait on each other).
    shards = create_group(Shard, 3, actor_args=(0.5,), options={"num_cpus": 0}, timeout=60)
    try:
        expected = np.sum([contribution(r, 0.5) for r in range(3)], axis=0)
        for result in ray.get([s.reduce_own_part.remote() for s in shards], timeout=60):
            np.testing.assert_array_equal(result, expected)
        # Arguments travel as Ray passes them; rank 1's array reaches every rank.
        sent = [np.full(16, float(r), dtype=np.float32) for r in range(3)]
        got = ray.get([s.broadcast_from.remote(1, x) for s, x in zip(shards, sent, strict=True)])
        for x in got:
            np.testing.assert_array_equal(x, sent[1])
        # The group outlives the method that made it: every later call sees it.
        places = ray.get([s.gather_places.remote() for s in shards], timeout=60)
        assert all(p == places[0] for p in places)
        assert [p[:2] for p in places[0]] == [(0, 3), (1, 3), (2, 3)]  # type: ignore[index]
        assert len({p[2] for p in places[0]}) == 3  # type: ignore[index]  # three processes
        destroy_group(shards, timeout=60)
        assert ray.get([s.in_group.remote() for s in shards]) == [False] * 3
    finally:
        for shard in shards:
            ray.kill(shard)


def test_a_dead_actor_fails_its_peers_within_seconds(local_ray: None) -> None:
    shards = create_group(
        ray.remote(Shard), 3, actor_kwargs={"scale": 1.0}, options={"num_cpus": 0}, timeout=60
    )
    try:
        ray.get([s.reduce_own_part.remote() for s in shards], timeout=60)  # all connected
        ray.kill(shards[2])
        start = time.monotonic()
        calls = [s.reduce_own_part.remote() for s in shards[:2]]
        for call in calls:
            with pytest.raises(aiodist.DistNetworkError, match="rank 2"):
                ray.get(call, timeout=60)
        assert time.monotonic() - start < 10
    finally:
        for shard in shards:
            ray.kill(shard)


def test_create_group_checks_its_arguments(local_ray: None) -> None:
    with pytest.raises(aiodist.DistUsageError, match="world_size must be a positive int, got 0"):
        create_group(Shard, 0)
    with pytest.raises(aiodist.DistUsageError, match="must be a class that inherits AiodistActor"):
        create_group(NotAnAiodistActor, 2)
    with pytest.raises(aiodist.DistUsageError, match="must be a class that inherits AiodistActor"):
        create_group(ray.remote(NotAnAiodistActor), 2)
