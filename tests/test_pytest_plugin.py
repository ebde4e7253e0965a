"""aiodist's pytest plugin, run on inner test suites with pytester.

Each test writes a small suite into a temporary directory, runs pytest on it in this process
(the plugin is loaded from its entry point, as in any project that installs aiodist) and
checks the outcomes and the report.
"""

from __future__ import annotations

import os
import re

import pytest

pytest_plugins = ["pytester"]

MODES = ["strict", "auto"]


def _ini(pytester: pytest.Pytester, mode: str, *extra: str) -> None:
    lines = [
        "[pytest]",
        f"asyncio_mode = {mode}",
        "asyncio_default_fixture_loop_scope = function",
        "filterwarnings = error",
        *extra,
    ]
    pytester.makeini("\n".join(lines) + "\n")


# -- the aiodist_world marker, ranks as tasks ---------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_world_marker_runs_the_body_once_per_rank(pytester: pytest.Pytester, mode: str) -> None:
    _ini(pytester, mode)
    pytester.makepyfile(
        """
        import numpy as np
        import pytest
        import aiodist

        seen = []

        @pytest.mark.aiodist_world(3)
        async def test_all_reduce(rank, world_size):
            assert world_size == 3 and aiodist.get_world_size() == 3
            assert aiodist.get_rank() == rank
            x = np.full(4, rank + 1, np.float32)
            await aiodist.all_reduce(x)
            np.testing.assert_array_equal(x, np.full(4, 6, np.float32))
            seen.append(rank)

        @pytest.mark.aiodist_world(2, transport="local")
        async def test_without_rank_arguments():
            x = np.array([aiodist.get_rank() * 10.0])
            await aiodist.broadcast(x, src=1)
            assert x[0] == 10.0
            seen.append(("local", aiodist.get_rank()))

        def test_every_rank_ran():
            assert sorted(seen[:3]) == [0, 1, 2]
            assert sorted(seen[3:]) == [("local", 0), ("local", 1)]
        """
    )
    result = pytester.runpytest("-v")
    result.assert_outcomes(passed=3)
    # The rank arguments are filled in per rank and leave the test ids unchanged.
    result.stdout.fnmatch_lines(
        ["*::test_all_reduce PASSED*", "*::test_without_rank_arguments PASSED*"]
    )


@pytest.mark.parametrize("mode", MODES)
def test_world_marker_over_shared_memory(pytester: pytest.Pytester, mode: str) -> None:
    _ini(pytester, mode)
    pytester.makepyfile(
        """
        import numpy as np
        import pytest
        import aiodist
        from aiodist.group import peek_world

        def inputs(rank):
            rng = np.random.default_rng(rank)
            return rng.integers(-1000, 1000, 5000), rng.standard_normal(5000)

        @pytest.mark.aiodist_world(3, transport="shm")
        async def test_all_reduce(rank, world_size):
            # The default group runs its collectives in a shared-memory workspace.
            assert sorted(peek_world().groups[0].paths) == ["cpu"]
            ints, floats = inputs(rank)
            await aiodist.all_reduce(ints)
            await aiodist.all_reduce(floats, op=aiodist.ReduceOp.MAX)
            every = [inputs(r) for r in range(world_size)]
            np.testing.assert_array_equal(ints, np.sum([i for i, _ in every], axis=0))
            np.testing.assert_array_equal(floats, np.max([f for _, f in every], axis=0))
            assert ints.dtype == np.int64 and floats.dtype == np.float64
        """
    )
    result = pytester.runpytest("-v")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*::test_all_reduce PASSED*"])


@pytest.mark.parametrize("mode", MODES)
def test_rank_that_returned_early_is_named(pytester: pytest.Pytester, mode: str) -> None:
    _ini(pytester, mode)
    pytester.makepyfile(
        test_early="""
        import numpy as np
        import pytest
        import aiodist

        @pytest.mark.aiodist_world(2, transport="local")
        async def test_rank_one_returns(rank):
            if rank == 1:
                return
            await aiodist.all_reduce(np.ones(3))
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            # The operation's own error first, then the one that names the rank.
            "E*aiodist.errors.DistNetworkError: lost connection to rank 1: it left the process "
            "group (destroy_process_group)",
            "The above exception was the direct cause of the following exception:",
            "rank = 0",
            ">*await aiodist.all_reduce(np.ones(3))",
            "E*aiodist.errors.DistNetworkError: rank 1 already returned (its function ended) "
            "while rank 0 waited for it in all_reduce",
            "E*run_world: raised on rank 0 of 2",
            "test_early.py:9: DistNetworkError",
        ]
    )


@pytest.mark.parametrize("mode", MODES)
def test_failing_rank_is_named_with_its_traceback(pytester: pytest.Pytester, mode: str) -> None:
    # In-process transport: over TCP, a rank that fails while its peers are still connecting
    # to it can hit CPython's Server.close() race (gh-109564) on the standard loop, whose
    # leaked transport would add a ResourceWarning to this report.
    _ini(pytester, mode)
    pytester.makepyfile(
        """
        import pytest
        import aiodist

        @pytest.mark.aiodist_world(3, transport="local")
        async def test_one_rank_fails(rank, world_size):
            if rank == 2:
                assert rank * 10 == 7, "rank two's own failure"
            await aiodist.barrier()
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "rank = 2, world_size = 3",
            '>*assert rank * 10 == 7, "rank two\'s own failure"',
            "E*AssertionError: rank two's own failure",
            "E*run_world: raised on rank 2 of 3",
            "test_failing_rank_is_named_with_its_traceback.py:7: AssertionError",
        ]
    )
    # The report starts at the test's own frame, not in the plugin or run_world.
    assert "run_tasks" not in result.stdout.str()
    assert "testing/_world.py" not in result.stdout.str()


def test_marker_errors_fail_only_that_test(pytester: pytest.Pytester) -> None:
    _ini(pytester, "auto")
    pytester.makepyfile(
        """
        import pytest

        @pytest.fixture
        def shard(rank):
            return rank

        @pytest.mark.aiodist_world(2)
        def test_blocking_body_as_tasks(rank):
            pass

        @pytest.mark.aiodist_world(0)
        async def test_no_ranks():
            pass

        @pytest.mark.aiodist_world(2, processes=True, transport="local")
        async def test_local_transport_in_processes():
            pass

        @pytest.mark.aiodist_world(2, transport="udp")
        async def test_unknown_transport():
            pass

        @pytest.mark.aiodist_world(2, colour="blue")
        async def test_unknown_argument():
            pass

        @pytest.mark.aiodist_world(2)
        async def test_fixture_wants_rank(shard):
            pass

        @pytest.mark.aiodist_world(1)
        async def test_fine(rank, world_size):
            assert (rank, world_size) == (0, 1)
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(errors=6, passed=1)
    result.stdout.fnmatch_lines_random(
        [
            "*test_blocking_body_as_tasks: @pytest.mark.aiodist_world runs the ranks as tasks of "
            "one event loop, so the test must be 'async def'; use processes=True for a blocking "
            "test body (aiodist.sync)",
            "*test_no_ranks: @pytest.mark.aiodist_world: world_size must be a positive integer, got 0",
            "*test_local_transport_in_processes: @pytest.mark.aiodist_world: transport applies to "
            "ranks run as tasks, not with processes=True",
            "*test_unknown_transport: @pytest.mark.aiodist_world: transport must be 'tcp', 'shm' "
            "or 'local', got 'udp'",
            "*test_unknown_argument: @pytest.mark.aiodist_world: *unexpected keyword argument 'colour'",
            "*test_fixture_wants_rank: @pytest.mark.aiodist_world: a fixture requests 'rank', but "
            "only the test function gets one value per rank*",
        ]
    )


# -- the aiodist_world marker, ranks as processes -----------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", MODES)
def test_world_marker_in_processes(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    _ini(pytester, mode)
    pytester.makepyfile(
        """
        import os
        import numpy as np
        import pytest
        import aiodist
        import aiodist.sync as dist

        @pytest.mark.aiodist_world(2, processes=True)
        def test_blocking_body(rank, world_size, tmp_path):
            assert os.getpid() != int(os.environ["TEST_PARENT_PID"])
            assert dist.get_rank() == rank and dist.get_world_size() == world_size == 2
            x = np.arange(4, dtype=np.float64) * (rank + 1)
            dist.all_reduce(x)
            np.testing.assert_array_equal(x, np.arange(4) * 3.0)
            (tmp_path / f"rank{rank}").write_text(str(os.getpid()))

        @pytest.mark.aiodist_world(2, processes=True)
        async def test_async_body(rank):
            assert os.getpid() != int(os.environ["TEST_PARENT_PID"])
            x = np.array([rank + 1.0])
            await aiodist.all_reduce(x, op=aiodist.ReduceOp.MAX)
            assert x[0] == 2.0
        """
    )
    monkeypatch.setenv("TEST_PARENT_PID", str(os.getpid()))
    result = pytester.runpytest("--basetemp", str(pytester.path / "tmp"))
    result.assert_outcomes(passed=2)
    # Each rank wrote from a process of its own.
    written = sorted(pytester.path.glob("tmp/test_blocking_body0/rank*"))
    assert [p.name for p in written] == ["rank0", "rank1"]
    assert len({p.read_text() for p in written}) == 2


@pytest.mark.multiprocess
def test_failing_process_rank_is_named_with_its_traceback(pytester: pytest.Pytester) -> None:
    _ini(pytester, "auto")
    pytester.makepyfile(
        test_proc_failure="""
        import pytest
        import aiodist.sync as dist

        @pytest.mark.aiodist_world(2, processes=True)
        def test_rank_one_fails(rank):
            if rank == 1:
                raise RuntimeError(f"rank {rank} gave up")
            dist.barrier()
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "rank 1 failed:",
            "Traceback (most recent call last):",
            '  File "*test_proc_failure.py", line 7, in test_rank_one_fails',
            '    raise RuntimeError(f"rank {rank} gave up")',
            "RuntimeError: rank 1 gave up",
        ]
    )
    # The child's traceback starts at the test's frame: the plumbing is left out.
    assert "testing/_world.py" not in result.stdout.str()


@pytest.mark.multiprocess
def test_process_rank_that_returned_early_is_named(pytester: pytest.Pytester) -> None:
    _ini(pytester, "auto")
    pytester.makepyfile(
        test_proc_early="""
        import numpy as np
        import pytest
        import aiodist.sync as dist

        @pytest.mark.aiodist_world(2, processes=True)
        def test_rank_one_returns(rank):
            if rank == 1:
                return
            dist.all_reduce(np.ones(3))
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "rank 0 failed: rank 1 already returned (its function ended) while rank 0 waited "
            "for it in all_reduce",
            "Traceback (most recent call last):",
            '  File "*test_proc_early.py", line 9, in test_rank_one_returns',
            "    dist.all_reduce(np.ones(3))",
        ]
    )


# -- the tcp_store fixture ----------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_tcp_store_fixture_serves_and_is_closed_after_the_test(
    pytester: pytest.Pytester, mode: str
) -> None:
    _ini(pytester, mode)
    pytester.makepyfile(
        """
        import socket
        import pytest
        import aiodist

        ports = []

        @pytest.mark.asyncio
        async def test_store(tcp_store):
            assert isinstance(tcp_store, aiodist.TCPStore)
            assert tcp_store.host == "127.0.0.1" and tcp_store.port > 0
            other = await aiodist.TCPStore.create("127.0.0.1", tcp_store.port, timeout=5)
            try:
                await other.set("k", b"from another client")
                assert await tcp_store.get("k") == b"from another client"
                assert await tcp_store.add("n", 5) == 5
            finally:
                await other.aclose()
            ports.append(tcp_store.port)

        def test_server_is_gone():
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", ports[0]), timeout=5)

        @pytest.mark.aiodist_world(2)
        async def test_store_shared_by_ranks(rank, tcp_store):
            await tcp_store.set(f"rank{rank}", str(rank).encode())
            assert await tcp_store.get(f"rank{1 - rank}") == str(1 - rank).encode()
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=3)


# -- the loop option ----------------------------------------------------------------------------
_LOOP_SUITE = """
    import asyncio
    import os
    import pytest

    def kind():
        loop = asyncio.get_running_loop()
        return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"

    @pytest.mark.asyncio
    async def test_loop():
        assert kind() == os.environ["EXPECTED_LOOP"], type(asyncio.get_running_loop())

    @pytest.mark.aiodist_world(2)
    async def test_world_loop(rank):
        assert kind() == os.environ["EXPECTED_LOOP"]

    @pytest.mark.aiodist_world(2, processes=True)
    async def test_process_loop(rank):
        assert kind() == os.environ["EXPECTED_LOOP"]
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_loop_option_selects_the_loop(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, mode: str, loop: str
) -> None:
    _ini(pytester, mode)
    pytester.makepyfile(_LOOP_SUITE)
    monkeypatch.setenv("EXPECTED_LOOP", loop)
    result = pytester.runpytest(f"--aiodist-loop={loop}")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines([f"aiodist: loop={loop}"])


def test_loop_ini_option_and_several_loops(pytester: pytest.Pytester) -> None:
    _ini(pytester, "strict", "aiodist_loop = uvloop, asyncio")
    pytester.makepyfile(
        """
        import asyncio
        import pytest

        @pytest.mark.asyncio
        async def test_loop(request):
            loop_module = type(asyncio.get_running_loop()).__module__
            expected = request.node.callspec.id
            assert loop_module.startswith("uvloop") == (expected == "uvloop"), loop_module

        @pytest.mark.asyncio(loop_factories=["asyncio"])
        async def test_standard_loop_only():
            assert not type(asyncio.get_running_loop()).__module__.startswith("uvloop")
        """
    )
    result = pytester.runpytest("-v")
    result.assert_outcomes(passed=3, skipped=0)
    result.stdout.fnmatch_lines_random(
        [
            "*::test_loop[[]uvloop[]] PASSED*",
            "*::test_loop[[]asyncio[]] PASSED*",
            # One selected loop: the id stays as it was.
            "*::test_standard_loop_only PASSED*",
        ]
    )


def test_loop_option_wins_over_a_conftest_hook(pytester: pytest.Pytester) -> None:
    _ini(pytester, "auto")
    pytester.makeconftest(
        """
        import asyncio

        def pytest_asyncio_loop_factories(config, item):
            return {"standard": asyncio.new_event_loop}
        """
    )
    pytester.makepyfile(
        """
        import asyncio

        async def test_loop():
            assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")
        """
    )
    pytester.runpytest("--aiodist-loop=uvloop").assert_outcomes(passed=1)
    # Without the option the conftest's hook decides, as if the plugin were not there.
    pytester.runpytest().assert_outcomes(failed=1)


def test_loop_option_errors(pytester: pytest.Pytester) -> None:
    _ini(pytester, "auto")
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest("--aiodist-loop=trio")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: --aiodist-loop / aiodist_loop: unknown loop kind 'trio': "
            "expected 'auto', 'uvloop' or 'asyncio'"
        ]
    )
    result = pytester.runpytest("-p", "no:asyncio", "--aiodist-loop=uvloop")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: --aiodist-loop / aiodist_loop needs pytest-asyncio 1.4 or later*"]
    )


# -- inert unless used --------------------------------------------------------------------------
_PLAIN_SUITE = """
    import asyncio
    import pytest

    @pytest.fixture
    def resource():
        return "resource"

    @pytest.mark.asyncio
    async def test_async(resource):
        print("LOOP", type(asyncio.get_running_loop()).__module__, resource)

    @pytest.mark.parametrize("x", [1, 2])
    async def test_param(x):
        assert x == 1

    def test_needs_rank(rank):
        pass

    def test_sync():
        pass
"""


@pytest.mark.parametrize("mode", MODES)
def test_plugin_is_inert_when_unused(pytester: pytest.Pytester, mode: str) -> None:
    _ini(pytester, mode)
    pytester.makepyfile(_PLAIN_SUITE)

    def run(*args: str) -> tuple[dict[str, int], list[str]]:
        result = pytester.runpytest("-v", "-s", *args)
        lines = [
            line
            for line in result.outlines
            if re.match(r"(test_\S+::\S+ |LOOP |E +fixture 'rank' not found)", line)
            or line.startswith(("FAILED", "ERROR"))
        ]
        return result.parseoutcomes(), lines

    with_plugin = run()
    without_plugin = run("-p", "no:aiodist")
    assert with_plugin == without_plugin
    assert any(" LOOP asyncio" in line for line in with_plugin[1])


def test_without_pytest_asyncio(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nfilterwarnings = error\n")
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.aiodist_world(2)
        async def test_tasks(rank):
            pass

        def test_store(tcp_store):
            pass
        """
    )
    result = pytester.runpytest("-p", "no:asyncio")
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines_random(
        [
            "*test_tasks: @pytest.mark.aiodist_world runs the ranks on the test's event loop, "
            "which needs pytest-asyncio (pip install pytest-asyncio), or use processes=True",
            "*the tcp_store fixture needs pytest-asyncio (pip install pytest-asyncio)",
        ]
    )


@pytest.mark.multiprocess
def test_processes_without_pytest_asyncio(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nfilterwarnings = error\n")
    pytester.makepyfile(
        """
        import numpy as np
        import pytest
        import aiodist

        @pytest.mark.aiodist_world(2, processes=True)
        async def test_async_body_in_processes(rank):
            x = np.array([float(rank)])
            await aiodist.all_reduce(x)
            assert x[0] == 1.0
        """
    )
    pytester.runpytest("-p", "no:asyncio").assert_outcomes(passed=1)
