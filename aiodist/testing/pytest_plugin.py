"""aiodist's pytest plugin. Inert unless its marker, fixture or option is used.

pytest loads it for every project that installs aiodist (the ``pytest11`` entry point
``aiodist``; ``-p no:aiodist`` turns it off). It adds:

* the marker ``@pytest.mark.aiodist_world(n)``: the test body runs on ``n`` ranks, each with
  a default process group of its own. The test may take ``rank`` and ``world_size``
  arguments::

      @pytest.mark.aiodist_world(4)
      async def test_sum(rank, world_size):
          x = np.full(3, rank, np.float32)
          await aiodist.all_reduce(x)
          assert (x == sum(range(world_size))).all()

  By default the ranks are tasks of the test's event loop (through
  :func:`aiodist.testing.run_world`), which needs pytest-asyncio; the marker makes the
  test an asyncio test in strict mode too. With ``processes=True`` each rank is a process
  of its own (:func:`aiodist.testing.run_world_processes`), and the body may also be a
  plain ``def`` that uses the blocking API (``aiodist.sync``). A failing rank fails the
  test with its own traceback; the report names the rank.

  Keyword arguments: ``processes`` (default ``False``), ``backend`` (``"cpu"``),
  ``timeout`` (seconds for the whole world; default: that of ``run_world`` or
  ``run_world_processes``) and, for tasks only, ``transport`` (``"tcp"``, ``"shm"`` or
  ``"local"``, as :func:`aiodist.testing.run_world` takes it).
  Other fixtures are set up once and shared by all ranks (with ``processes=True`` their
  values are pickled to the children, and the test module must be importable by name, as
  pytest's default ``prepend`` import mode makes it).

* the fixture ``tcp_store``: an :class:`aiodist.TCPStore` that hosts its server on
  ``127.0.0.1`` (a free port, the store's ``port``), on the test's event loop,
  closed after the test. Other clients, torch's included, connect to that port.

* the option ``--aiodist-loop=KINDS`` (ini ``aiodist_loop``): the event loop(s) that
  pytest-asyncio runs async tests on, ``uvloop``, ``asyncio`` or ``auto`` (uvloop when
  installed), or several separated by commas (``uvloop,asyncio`` runs each async test
  once per loop, with ids ``[uvloop]`` and ``[asyncio]``). It works through
  pytest-asyncio's ``pytest_asyncio_loop_factories`` hook (pytest-asyncio 1.4 or later),
  in strict and auto mode, and takes precedence over that hook in ``conftest.py`` files.
  With the option given, the processes of ``aiodist_world(..., processes=True)`` tests
  run on the loop kind of their test.

A project that writes its own ``pytest_asyncio_loop_factories`` hook can return
:func:`loop_factories` from it.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import AsyncIterator, Callable, Generator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import pytest

if TYPE_CHECKING:
    from ..store import TCPStore

__all__ = ["loop_factories"]

_MARKER = "aiodist_world"
_MARKER_HELP = (
    "aiodist_world(world_size, *, processes=False, backend='cpu', timeout=None, "
    "transport='tcp'): run the test body on world_size ranks, as tasks of the test's event "
    "loop (transport 'tcp', 'shm' or 'local') or as processes (aiodist's plugin)"
)
#: The test arguments the marker fills in per rank.
_RANK_ARGS = ("rank", "world_size")
#: Where pytest_configure keeps the loop kinds that --aiodist-loop / aiodist_loop chose.
_LOOP_KINDS = pytest.StashKey[tuple[str, ...]]()


def loop_factories(*kinds: str) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Event loop factories by name, in the form ``pytest_asyncio_loop_factories`` returns.

    Args:
        *kinds: ``"uvloop"``, ``"asyncio"`` or ``"auto"`` (uvloop when installed, else the
            standard loop); none means ``("uvloop", "asyncio")``.

    Returns:
        A dict from each kind to a callable that creates a new loop of that kind.

    Raises:
        DistUsageError: a kind is unknown, or ``"uvloop"`` is asked for and not installed.
    """
    from .._util._loop import loop_factory

    return {kind: loop_factory(kind) for kind in kinds or ("uvloop", "asyncio")}


# -- registration -------------------------------------------------------------------------------
def pytest_addoption(parser: pytest.Parser) -> None:
    """Add ``--aiodist-loop`` and the ``aiodist_loop`` ini option (both unset by default)."""
    help_text = (
        "event loop(s) pytest-asyncio runs async tests on: uvloop, asyncio or auto, or "
        "several separated by commas (each test then runs once per loop)"
    )
    group = parser.getgroup("aiodist")
    group.addoption(
        "--aiodist-loop", dest="aiodist_loop", default=None, metavar="KINDS", help=help_text
    )
    parser.addini("aiodist_loop", help=help_text, default="")


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker, the fixtures, and the loop factories when an option asks for them.

    Raises:
        pytest.UsageError: ``--aiodist-loop``/``aiodist_loop`` names an unknown or missing
            loop, or is used without pytest-asyncio 1.4 or later.
    """
    config.addinivalue_line("markers", _MARKER_HELP)
    asyncio_plugin = config.pluginmanager.hasplugin("asyncio")
    config.pluginmanager.register(
        _asyncio_fixtures() if asyncio_plugin else _NoAsyncioFixtures(), "aiodist-fixtures"
    )
    kinds = _loop_kinds(config)
    if not kinds:
        return
    hook = getattr(config.hook, "pytest_asyncio_loop_factories", None)
    if not asyncio_plugin or hook is None or not hook.has_spec():
        raise pytest.UsageError(
            "--aiodist-loop / aiodist_loop needs pytest-asyncio 1.4 or later (its "
            "pytest_asyncio_loop_factories hook): pip install 'pytest-asyncio>=1.4'"
        )
    from ..errors import DistUsageError

    try:
        factories = loop_factories(*kinds)
    except DistUsageError as exc:
        raise pytest.UsageError(f"--aiodist-loop / aiodist_loop: {exc}") from None
    config.stash[_LOOP_KINDS] = kinds
    config.pluginmanager.register(_LoopFactories(factories), "aiodist-loop-factories")


def _loop_kinds(config: pytest.Config) -> tuple[str, ...]:
    value = config.getoption("aiodist_loop") or config.getini("aiodist_loop")
    kinds = [k.strip() for k in str(value or "").split(",") if k.strip()]
    return tuple(dict.fromkeys(kinds))  # in order, without repeats


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Name the chosen loops in the header, only when the option chose any."""
    kinds = config.stash.get(_LOOP_KINDS, ())
    return [f"aiodist: loop={','.join(kinds)}"] if kinds else []


class _LoopFactories:
    """Registered only when --aiodist-loop or aiodist_loop is set."""

    def __init__(self, factories: Mapping[str, Callable[[], asyncio.AbstractEventLoop]]) -> None:
        self.factories = dict(factories)

    # The hook is firstresult: tryfirst makes the explicit option win over conftest hooks.
    @pytest.hookimpl(tryfirst=True)
    def pytest_asyncio_loop_factories(
        self, config: pytest.Config, item: pytest.Item
    ) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
        return self.factories


def _asyncio_fixtures() -> object:
    """The async fixtures, for when pytest-asyncio is active (they work in strict mode too)."""
    import pytest_asyncio

    class AsyncioFixtures:
        @pytest_asyncio.fixture
        async def tcp_store(self) -> AsyncIterator[TCPStore]:
            """An aiodist TCPStore hosting its server on 127.0.0.1 (a free port), closed
            after the test. Its store timeout is 30 s, so a wait on a missing key fails well
            within a test's time limit."""
            from ..store import TCPStore

            store = await TCPStore.create("127.0.0.1", 0, is_master=True, timeout=30.0)
            try:
                yield store
            finally:
                await store.aclose()

    return AsyncioFixtures()


class _NoAsyncioFixtures:
    """Stand-ins that explain what is missing when pytest-asyncio is not active."""

    @pytest.fixture
    def tcp_store(self) -> None:
        """Needs pytest-asyncio: the store serves from the test's event loop."""
        pytest.fail(
            "the tcp_store fixture needs pytest-asyncio (pip install pytest-asyncio)",
            pytrace=False,
        )


# -- the aiodist_world marker ---------------------------------------------------------------------
@dataclass(frozen=True)
class _WorldSpec:
    world_size: int
    processes: bool
    backend: str | None
    timeout: float | None
    transport: Literal["tcp", "shm", "local"]


def _world_spec(
    world_size: int,
    *,
    processes: bool = False,
    backend: str | None = "cpu",
    timeout: float | None = None,
    transport: Literal["tcp", "shm", "local"] = "tcp",
) -> _WorldSpec:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not isinstance(processes, bool):
        raise ValueError(f"processes must be True or False, got {processes!r}")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0
    ):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if transport not in ("tcp", "shm", "local"):
        raise ValueError(f"transport must be 'tcp', 'shm' or 'local', got {transport!r}")
    if processes and transport != "tcp":
        raise ValueError("transport applies to ranks run as tasks, not with processes=True")
    return _WorldSpec(world_size, processes, backend, timeout, transport)


def _spec_of(node: pytest.Function) -> _WorldSpec | str | None:
    """The test's world, or why its marker cannot work, or ``None`` when it has none."""
    mark = node.get_closest_marker(_MARKER)
    if mark is None:
        return None
    where = f"{node.nodeid}: @pytest.mark.{_MARKER}"
    try:
        spec = _world_spec(*mark.args, **mark.kwargs)
    except (TypeError, ValueError) as exc:
        return f"{where}: {exc}"
    fn = node.function
    is_async = inspect.iscoroutinefunction(fn)
    if not is_async and not spec.processes:
        return (
            f"{where} runs the ranks as tasks of one event loop, so the test must be "
            "'async def'; use processes=True for a blocking test body (aiodist.sync)"
        )
    if is_async and not spec.processes and not node.config.pluginmanager.hasplugin("asyncio"):
        return (
            f"{where} runs the ranks on the test's event loop, which needs pytest-asyncio "
            "(pip install pytest-asyncio), or use processes=True"
        )
    params = inspect.signature(fn).parameters
    for name in _RANK_ARGS:
        if name in node.fixturenames and name not in params:
            return (
                f"{where}: a fixture requests {name!r}, but only the test function gets one "
                "value per rank (fixtures are set up once and shared by every rank)"
            )
    return spec


def _own_marks(obj: object) -> list[pytest.Mark]:
    marks = getattr(obj, "pytestmark", [])
    return [
        m for m in (marks if isinstance(marks, list) else [marks]) if isinstance(m, pytest.Mark)
    ]


@pytest.hookimpl(wrapper=True)
def pytest_pycollect_makeitem(
    collector: pytest.Module | pytest.Class, name: str, obj: object
) -> Generator[None, Any, Any]:
    """Make an async ``aiodist_world`` test an asyncio test, in strict mode too."""
    if (
        inspect.iscoroutinefunction(obj)
        and collector.config.pluginmanager.hasplugin("asyncio")
        and collector.get_closest_marker("asyncio") is None
    ):
        names = {m.name for m in _own_marks(obj)}
        if "asyncio" not in names and (
            _MARKER in names or collector.get_closest_marker(_MARKER) is not None
        ):
            pytest.mark.asyncio(obj)  # what writing @pytest.mark.asyncio would have done
    return (yield)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Give the ``rank``/``world_size`` arguments of an ``aiodist_world`` test values.

    They are placeholders that keep the test's id unchanged: each rank calls the test
    function with its own rank.
    """
    spec = _spec_of(metafunc.definition)
    if not isinstance(spec, _WorldSpec):
        return  # no marker, or a bad one that pytest_runtest_setup reports
    params = inspect.signature(metafunc.function).parameters
    names = [n for n in _RANK_ARGS if n in params]
    if names:
        placeholders = {"rank": None, "world_size": spec.world_size}
        metafunc.parametrize(
            names, [tuple(placeholders[n] for n in names)], ids=[pytest.HIDDEN_PARAM]
        )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Fail (only) a test whose ``aiodist_world`` marker cannot work, before its fixtures.

    Raises:
        pytest.fail.Exception: the marker's arguments or the test do not fit; the message
            says what is wrong.
    """
    spec = _spec_of(item) if isinstance(item, pytest.Function) else None
    if isinstance(spec, str):
        pytest.fail(spec, pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """While an ``aiodist_world`` test runs, its function runs the body on every rank."""
    spec = _spec_of(item) if isinstance(item, pytest.Function) else None
    if not isinstance(spec, _WorldSpec):
        return (yield)
    assert isinstance(item, pytest.Function)
    fn = item.obj
    item.obj = _world_runner(item, fn, spec)
    try:
        return (yield)
    finally:
        item.obj = fn  # the report cuts its traceback at the test function's own frame


def _with_rank(kwargs: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    given = {"rank": rank, "world_size": world_size}
    return {k: given.get(k, v) for k, v in kwargs.items()}


def _call_rank(fn: Callable[..., Any], kwargs: dict[str, Any], rank: int, world_size: int) -> Any:
    return fn(**_with_rank(kwargs, rank, world_size))


async def _call_rank_async(
    fn: Callable[..., Any], kwargs: dict[str, Any], rank: int, world_size: int
) -> Any:
    return await fn(**_with_rank(kwargs, rank, world_size))


def _loop_kind(loop: asyncio.AbstractEventLoop) -> str:
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


def _world_runner(
    item: pytest.Function, fn: Callable[..., Any], spec: _WorldSpec
) -> Callable[..., Any]:
    """The function pytest calls in place of the test: it runs ``fn`` on every rank."""
    from ._world import WorldProcessError, run_world, run_world_processes

    limit = {} if spec.timeout is None else {"timeout": spec.timeout}
    is_async = inspect.iscoroutinefunction(fn)

    if not spec.processes:

        async def run_tasks(**kwargs: Any) -> None:
            __tracebackhide__ = True

            async def rank_body(rank: int, world_size: int) -> Any:
                __tracebackhide__ = True
                return await fn(**_with_rank(kwargs, rank, world_size))

            await run_world(
                rank_body, spec.world_size, spec.backend, transport=spec.transport, **limit
            )

        return run_tasks

    call = _call_rank_async if is_async else _call_rank
    kinds = item.config.stash.get(_LOOP_KINDS, ())

    def run_processes(kwargs: dict[str, Any], loop: str | None) -> None:
        __tracebackhide__ = True
        env = {} if loop is None else {"AIODIST_LOOP": loop}
        body = functools.partial(call, fn, kwargs)
        try:
            run_world_processes(body, spec.world_size, spec.backend, env=env, **limit)
        except WorldProcessError as exc:
            failure = str(exc)
        else:
            return
        # The message holds the failing rank's own traceback; the parent's frames would
        # only show run_world_processes.
        pytest.fail(failure, pytrace=False)

    if not _is_asyncio_item(item):

        def run_blocking(**kwargs: Any) -> None:
            __tracebackhide__ = True
            run_processes(kwargs, kinds[0] if len(kinds) == 1 else None)

        return run_blocking

    async def run_from_loop(**kwargs: Any) -> None:
        __tracebackhide__ = True
        # The test's loop stays free (a tcp_store fixture keeps serving) while the ranks run;
        # they use the loop kind the test runs on when --aiodist-loop chose one.
        loop = _loop_kind(asyncio.get_running_loop()) if kinds else None
        await asyncio.to_thread(run_processes, kwargs, loop)

    return run_from_loop


def _is_asyncio_item(item: pytest.Function) -> bool:
    if not item.config.pluginmanager.hasplugin("asyncio"):
        return False
    from pytest_asyncio import is_async_test

    return is_async_test(item)
