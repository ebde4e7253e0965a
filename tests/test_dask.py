"""aiodist.contrib.dask: process groups on the workers of a real Dask ``LocalCluster``.

The cluster's workers are processes of their own (``processes=True``); the functions they run
are this module's, which the workers import by name (the test's ``sys.path`` reaches them).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

distributed = pytest.importorskip("distributed")

import aiodist  # noqa: E402
import aiodist.sync as dist  # noqa: E402
from aiodist.contrib.dask import run, run_async  # noqa: E402

pytestmark = [
    pytest.mark.dask,
    pytest.mark.multiprocess,
    # A worker process that Dask's LocalCluster stops at the end of the module may still be
    # reporting to the scheduler; the scheduler then warns about the closed stream. That is
    # Dask's own shutdown, not this module's work.
    pytest.mark.filterwarnings("ignore:.*(stream|comm).*closed:RuntimeWarning"),
]

N = 1000
WORLD = 3


def contribution(rank: int) -> np.ndarray:
    return np.arange(N, dtype=np.float64) * (rank + 1)


def expected_results(world: int) -> dict[str, Any]:
    return {
        "sum": np.sum([contribution(r) for r in range(world)], axis=0),
        "gathered": [np.full(4, r, dtype=np.int64) for r in range(world)],
        "broadcast": np.arange(8, dtype=np.float32) + 100 * (world - 1),
    }


async def collectives_async(scale: float) -> dict[str, Any]:
    """A rank's work through the asynchronous API."""
    rank, world = aiodist.get_rank(), aiodist.get_world_size()
    x = contribution(rank) * scale
    work = aiodist.all_reduce(x)  # started; awaited below
    gathered = [np.empty(4, dtype=np.int64) for _ in range(world)]
    await work
    await aiodist.all_gather(gathered, np.full(4, rank, dtype=np.int64))
    b = np.arange(8, dtype=np.float32) + 100 * rank
    await aiodist.broadcast(b, src=world - 1)
    return _report(rank, world, x, gathered, b)


def collectives_sync(scale: float) -> dict[str, Any]:
    """The same work through the blocking API, as a torch.distributed script writes it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x = contribution(rank) * scale
    dist.all_reduce(x)
    gathered = [np.empty(4, dtype=np.int64) for _ in range(world)]
    dist.all_gather(gathered, np.full(4, rank, dtype=np.int64))
    b = np.arange(8, dtype=np.float32) + 100 * rank
    dist.broadcast(b, src=world - 1)
    return _report(rank, world, x, gathered, b)


def _report(
    rank: int, world: int, x: np.ndarray, gathered: list[np.ndarray], b: np.ndarray
) -> dict[str, Any]:
    return {
        "rank": rank,
        "world": world,
        "worker": distributed.get_worker().address,
        "pid": os.getpid(),
        "sum": x,
        "gathered": gathered,
        "broadcast": b,
    }


async def fail_on_rank_1() -> int:
    rank = aiodist.get_rank()
    if rank == 1:
        raise ValueError("rank 1 cannot go on: bad shard")
    await aiodist.all_reduce(np.ones(N))  # never completes: rank 1 is gone
    return rank


async def time_out_on_rank_0() -> None:
    if aiodist.get_rank() == 0:
        raise aiodist.DistTimeoutError("rank 0 waited too long")
    await aiodist.all_reduce(np.ones(N))


def check(results: list[dict[str, Any]], workers: list[str], scale: float = 1.0) -> None:
    expected = expected_results(len(workers))
    assert [r["rank"] for r in results] == list(range(len(workers)))
    assert [r["world"] for r in results] == [len(workers)] * len(workers)
    assert [r["worker"] for r in results] == workers  # rank i runs on workers[i]
    assert len({r["pid"] for r in results}) == len(workers)
    for r in results:
        np.testing.assert_array_equal(r["sum"], expected["sum"] * scale)
        for got, want in zip(r["gathered"], expected["gathered"], strict=True):
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(r["broadcast"], expected["broadcast"])


def leftover_variables(client: Any) -> dict[str, Any]:
    """The Dask variables the scheduler still holds, once the client's deletes reached it."""

    def variables(dask_scheduler: Any) -> dict[str, Any]:
        return dict(dask_scheduler.extensions["variables"].variables)

    deadline = time.monotonic() + 5
    while (left := client.run_on_scheduler(variables)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with distributed.LocalCluster(
        n_workers=WORLD,
        processes=True,
        threads_per_worker=1,
        host="127.0.0.1",
        # The scheduler serves HTTP (metrics) even without a dashboard: on a port of its own,
        # since 8787 may be taken (by another cluster of this module, for one).
        dashboard_address="127.0.0.1:0",
    ) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def client(cluster: Any) -> Iterator[Any]:
    with distributed.Client(cluster) as client:
        yield client


@pytest.fixture(scope="module")
def workers(client: Any) -> list[str]:
    client.wait_for_workers(WORLD)
    return sorted(client.scheduler_info(n_workers=-1)["workers"])


def test_an_async_function_runs_collectives_on_every_worker(
    client: Any, workers: list[str]
) -> None:
    results = run(client, collectives_async, 2.0)
    check(results, workers, scale=2.0)
    assert leftover_variables(client) == {}


def test_a_sync_function_runs_collectives_on_every_worker(client: Any, workers: list[str]) -> None:
    results = run(client, collectives_sync, scale=0.5, timeout=60)
    check(results, workers, scale=0.5)
    assert leftover_variables(client) == {}


def test_workers_chooses_the_ranks_and_their_order(client: Any, workers: list[str]) -> None:
    chosen = [workers[2], workers[0]]
    check(run(client, collectives_async, 1.0, workers=chosen), chosen)
    check(run(client, collectives_sync, 1.0, workers=chosen[::-1]), chosen[::-1])


def test_a_failing_rank_raises_its_own_exception_and_fails_its_peers_fast(
    client: Any, workers: list[str]
) -> None:
    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        run(client, fail_on_rank_1, timeout=60)
    assert time.monotonic() - start < 15  # the peers did not wait for the group's timeout
    assert type(info.value) is ValueError
    assert info.value.args == ("rank 1 cannot go on: bad shard",)
    notes = info.value.__notes__
    assert f"raised by rank 1 of 3 (Dask worker {workers[1]}) in aiodist.contrib.dask.run" in notes
    # The peers failed because rank 1 aborted the group: named in a note, not raised.
    others = next(n for n in notes if n.startswith("the other ranks that failed: "))
    assert re.search(r"rank 0: DistNetworkError", others), others
    assert re.search(r"rank 2: DistNetworkError", others), others
    assert leftover_variables(client) == {}
    # The cluster is still usable: the next job forms a new group on the same workers.
    check(run(client, collectives_sync, 1.0), workers)


def test_an_aiodist_error_keeps_its_type(client: Any) -> None:
    with pytest.raises(Exception) as info:
        run(client, time_out_on_rank_0, timeout=60)
    assert type(info.value) is aiodist.DistTimeoutError, repr(info.value)
    assert info.value.args == ("rank 0 waited too long",)


async def test_run_async_uses_an_asynchronous_client(cluster: Any, workers: list[str]) -> None:
    async with distributed.Client(cluster.scheduler_address, asynchronous=True) as client:
        check(await run_async(client, collectives_async, 1.0, workers=workers[:2]), workers[:2])
        with pytest.raises(ValueError) as info:
            await run_async(client, fail_on_rank_1)
        assert info.value.args == ("rank 1 cannot go on: bad shard",)
        with pytest.raises(
            aiodist.DistUsageError, match=r"^client is asynchronous: use `await run_async"
        ):
            run(client, collectives_async, 1.0)


def test_bad_arguments_are_refused_before_anything_is_submitted(
    client: Any, workers: list[str]
) -> None:
    def tasks(dask_scheduler: Any) -> int:
        return len(dask_scheduler.tasks)

    before = client.run_on_scheduler(tasks)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"fn": 42}, "fn must be callable, got int 42"),
        ({"workers": []}, "workers is empty: give at least one worker address"),
        (
            {"workers": [workers[0], "tcp://10.9.9.9:1234"]},
            f"workers: 'tcp://10.9.9.9:1234' is not a worker of the Dask cluster; its "
            f"workers are {', '.join(workers)}",
        ),
        ({"workers": [workers[1], workers[1]]}, f"workers: '{workers[1]}' is given twice"),
        ({"workers": workers[0]}, "workers must be a list of worker addresses, got str"),
        ({"timeout": 0}, "timeout must be a positive number of seconds, got 0"),
    ]
    for arguments, message in cases:
        fn = arguments.pop("fn", collectives_async)
        with pytest.raises(aiodist.DistUsageError) as info:
            run(client, fn, 1.0, **arguments)
        assert type(info.value) is aiodist.DistUsageError
        assert str(info.value) == message
    with pytest.raises(aiodist.DistUsageError, match=r"^client must be a distributed\.Client"):
        run("tcp://127.0.0.1:8786", collectives_async)
    assert client.run_on_scheduler(tasks) == before


def test_a_cluster_without_workers_is_refused() -> None:
    with (
        distributed.LocalCluster(
            n_workers=0, host="127.0.0.1", dashboard_address="127.0.0.1:0"
        ) as empty,
        distributed.Client(empty) as client,
    ):
        with pytest.raises(aiodist.DistUsageError) as info:
            run(client, collectives_async, 1.0)
        assert str(info.value) == "the Dask cluster has no workers to run the ranks on"
