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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave the ``torch_suite`` job out of runs whose ``-m`` does not name it."""
    if "torch_suite" in (config.getoption("markexpr") or ""):
        return
    kept = [item for item in items if item.get_closest_marker("torch_suite") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(
            items=[item for item in items if item.get_closest_marker("torch_suite")]
        )
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
