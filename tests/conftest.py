"""Suite-wide fixtures: which event loops the async tests run on, and loop hygiene."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import proc_helpers
import pytest

from aiodist._util._loop import loop_factory

#: Fixtures shared by several test files (``hosts``: two network namespaces).
pytest_plugins = ["netns_helpers"]


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Run on uvloop (the default users get); tests marked ``both_loops`` also on asyncio."""
    factories = {"uvloop": loop_factory("auto")}
    if item.get_closest_marker("both_loops") is not None:
        factories["asyncio"] = asyncio.new_event_loop
    return factories


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "both_loops: run on uvloop and on the standard loop")
    config.addinivalue_line(
        "markers",
        "torch_suite: the long torch-compatibility job (torch's own DistributedTest, 50-round "
        "store runs); collected only when -m names it, as `.ci/run` does after the suite",
    )


#: The long jobs: left out of the test command (scripts/test.sh), run by `.ci/run` after it.
LONG_JOBS = ("torch_suite", "slow")

#: The modules whose tests are marked ``slow``: real launchers, clusters, hosts in network
#: namespaces and dead peers waited out for their timeouts, seconds each (the test command
#: stays within minutes; `.ci/run` runs them after it, `pytest -m slow` alone).
SLOW_MODULES = frozenset(
    {
        "test_dask.py",
        "test_examples_extra.py",
        "test_exits.py",
        "test_faults.py",
        "test_health.py",
        "test_launcher_elastic.py",
        "test_launcher_multinode.py",
        "test_launcher_preload.py",
        "test_launcher_restart.py",
        "test_launcher_torch.py",
        "test_liveness.py",
        "test_lost_host.py",
        "test_mpirun.py",
        "test_multihost.py",
        "test_ray.py",
        "test_serving_faults.py",
        "test_serving_http.py",
        "test_slurm.py",
        "test_store_etcd.py",
        "test_store_liveness.py",
        "test_torch_store_conformance.py",
        "test_torch_store_interop.py",
        "test_torch_store_queue.py",
        "test_tutorials.py",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of :data:`SLOW_MODULES` ``slow``; leave each long job
    (:data:`LONG_JOBS`) out of runs whose ``-m`` does not name it."""
    for item in items:
        if item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    markexpr = config.getoption("markexpr") or ""
    left_out = [j for j in LONG_JOBS if j not in markexpr]
    if not left_out:
        return
    kept, deselected = [], []
    for item in items:
        long_job = any(item.get_closest_marker(j) is not None for j in left_out)
        (deselected if long_job else kept).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


@pytest.fixture(autouse=True)
def _no_tracked_process_outlives_its_test() -> Iterator[None]:
    """Kill the launchers a failed test left running (see ``proc_helpers``)."""
    yield
    proc_helpers.reap()


@pytest.fixture(autouse=True)
def _fail_on_loop_exception_handler(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail an async test if anything reached its loop's exception handler."""
    if not hasattr(request.node, "obj") or not asyncio.iscoroutinefunction(request.node.obj):
        yield
        return
    caught: list[dict[str, Any]] = []
    loop = request.getfixturevalue("_function_scoped_runner").get_loop()
    loop.set_exception_handler(lambda _loop, context: caught.append(context))
    yield
    if caught:
        pytest.fail(f"the event loop's exception handler fired: {caught!r}")
