"""torch's own distributed tests on aiodist: ``DistributedTest._DistTestBase`` of torch 2.13.

The test base ships in the torch wheel (``torch/testing/_internal/distributed/
distributed_test.py``); torch runs it through ``TestDistBackend``: one process per rank,
``init_process_group("gloo", "file://...")``, and a rank's exit code says whether its part
passed. Here that machinery runs unchanged, with two differences: the ranks are forked
rather than spawned (the parent has imported torch and aiodist once), and on aiodist each
rank first binds the module's ``dist`` (and the few ``torch.distributed`` names the module
and its helpers imported one by one) to ``aiodist.sync``, as a user porting a script would
change its import line. Every collective, group, object and barrier call of the tests then
runs aiodist's code on torch tensors, which aiodist takes through DLPack; gloo runs the same
tests as the reference, at 3 and 4 ranks each.

aiodist also stands where torch asks each backend what it supports: torch's tests check the
profiler's events of the backends in their allowlists (``PROFILING_SUPPORTED_BACKENDS``...),
and aiodist, which never imports torch, records none, so it is left out of those lists as a
backend without profiler support; the profiled tests still run their operations and check
the results.

The tests left out, and why, are :data:`LEFT_OUT`; ``docs/migrating.md`` shows the same
table (checked here). The whole run takes minutes: it is the ``torch_suite`` job, which
``.ci/run`` runs after the suite; a few tests stay in the suite (``TestAiodistSmoke``).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import importlib.util
import multiprocessing
import os
import re
import sys
import unittest
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = [pytest.mark.torch, pytest.mark.multiprocess]
pytest.importorskip("torch.distributed")

import aiodist.sync  # noqa: E402 (imported once here, so that each forked rank has it)

TORCH_MODULE = "torch.testing._internal.distributed.distributed_test"
WORLD_SIZES = (3, 4)
MIGRATING = Path(__file__).parent.parent / "docs" / "migrating.md"

#: The tests of ``DistributedTest`` left out (``fnmatch`` patterns), with the reason.
LEFT_OUT: list[tuple[tuple[str, ...], str]] = [
    (
        ("test_*cuda*", "test_*nccl*"),
        "CUDA tensors and NCCL: aiodist's CUDA backend takes cupy arrays, not torch's CUDA "
        "tensors, and these runs have no GPU",
    ),
    (
        ("test_*ddp*", "test_*DDP*", "test_*DistributedDataParallel*", "test_*SyncBatchNorm*"),
        "`DistributedDataParallel` and `SyncBatchNorm` run on torch's own C++ process group, "
        "which aiodist does not provide",
    ),
    (
        (
            "test_accumulate_gradients_no_sync*",
            "test_compute_bucket_assignment_by_size_*",
            "test_different_graph_across_ranks",
            "test_get_data_parallel_params",
            "test_grads_same_across_ranks_with_no_sync",
            "test_invalid_static_graph",
            "test_output_unused_in_loss_*",
            "test_skip_all_reduce_unused_parameters",
            "test_static_graph_*",
            "test_sync_bn_logged",
            "test_undefined_grad_parity_unused_parameters",
            "test_verify_model_across_rank_*",
        ),
        "built on `DistributedDataParallel`",
    ),
    (
        (
            "test_*model_averager*",
            "test_average_parameters",
            "test_post_localSGD_*",
            "test_DistributedSampler_padding",
        ),
        "torch's library code (the model averagers, `PostLocalSGDOptimizer`, "
        "`DistributedSampler`) calls `torch.distributed` itself, not the test's `dist`",
    ),
    (
        ("test_get_future",),
        "calls `ProcessGroup.allreduce`, a method of torch's C++ process group, and chains "
        "`torch.futures.Future.then`: aiodist's `ProcessGroup` has no per-operation methods "
        "(`dist.all_reduce(t, group=pg, async_op=True)` does it) and `Work.get_future()` is a "
        "`concurrent.futures.Future`",
    ),
    (
        ("test_monitored_barrier_gloo_rank_0_timeout",),
        "calls `ProcessGroup.monitored_barrier`, a method aiodist's `ProcessGroup` does not "
        "have; `dist.monitored_barrier(group=pg)` does the same, with torch's messages "
        "(`test_monitored_barrier_gloo` runs)",
    ),
    (
        ("test_new_subgroups_with_group_param",),
        "calls `ProcessGroup.size()` (an attribute in aiodist) and torch's private "
        "`dist._rank_not_in_group`; `new_subgroups` with each rank's own parent group works "
        "(tests/test_torch_behaviours.py)",
    ),
    (
        ("test_all_reduce_complex_unsupported_ops",),
        "expects `PRODUCT` on complex tensors to be refused; aiodist computes it (MAX, MIN "
        'and the bitwise ops are refused with torch\'s "all_reduce does not support", '
        "tests/test_torch_behaviours.py)",
    ),
    (
        ("test_sparse_all_reduce_sum",),
        "sparse COO tensors: aiodist moves dense arrays through DLPack, which has no sparse "
        "layout; all_reduce the dense tensor, or all_gather the indices and values",
    ),
]

#: The tests that stay in the suite: one of each kind that torch's test base checks.
SMOKE = (
    "test_all_reduce_sum",
    "test_all_reduce_coalesced_sum",
    "test_send_recv_any_source",
    "test_all_gather_object_default_pg",
    "test_scatter_object_list",
    "test_monitored_barrier_gloo",
    "test_get_backend",
)


def left_out(name: str) -> str | None:
    """The reason ``name`` is left out, or ``None``."""
    for patterns, reason in LEFT_OUT:
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            return reason
    return None


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@functools.cache
def _load(world_size: int) -> ModuleType:
    """torch's test module as a run of ``world_size`` ranks imports it: some of its
    decorators read ``WORLD_SIZE`` (and ``BACKEND``) at import, so each size gets its own
    copy of the module."""
    spec = importlib.util.find_spec(TORCH_MODULE)
    assert spec is not None and spec.origin is not None
    name = f"{TORCH_MODULE}__{world_size}_ranks"
    copy = importlib.util.spec_from_file_location(name, spec.origin)
    assert copy is not None and copy.loader is not None
    module = importlib.util.module_from_spec(copy)
    sys.modules[name] = module  # (its classes pickle by their module's name)
    with _environ(BACKEND="gloo", WORLD_SIZE=str(world_size)), warnings.catch_warnings():
        # (torch's modules deprecate each other as they import: torch.jit.script...)
        warnings.simplefilter("ignore")
        copy.loader.exec_module(module)
    return module


def _use_aiodist(module: ModuleType) -> None:
    """In a rank's process: the names through which ``module`` and torch's test helpers
    reach ``torch.distributed`` now reach ``aiodist.sync``."""
    from torch.testing._internal import common_distributed

    dist = aiodist.sync
    module.dist = dist  # type: ignore[attr-defined]
    module.get_world_size = dist.get_world_size  # type: ignore[attr-defined]
    # torch's private accessor of the default group, imported by name.
    module._get_default_group = lambda: dist.group.WORLD  # type: ignore[attr-defined]
    common_distributed.c10d = dist  # its decorators' barrier and debug level
    for allowlist in (
        "PROFILING_SUPPORTED_BACKENDS",
        "CUDA_PROFILING_SUPPORTED_BACKENDS",
        "SEND_RECV_PROFILING_SUPPORTED_BACKENDS",
    ):
        setattr(module, allowlist, [b for b in getattr(module, allowlist) if b != "gloo"])


class _LeftOut:
    """A test taken out of a suite: not callable, so not collected. It keeps the function as
    ``__wrapped__``, which torch's ``TestDistBackend.setUp`` reads of one of them."""

    def __init__(self, test: Any) -> None:
        self.__wrapped__ = getattr(test, "__wrapped__", test)


def _suite(backend: str, world_size: int, keep: tuple[str, ...] | None = None) -> type[Any]:
    """The ``TestDistBackend`` of ``world_size`` ranks on ``backend`` (``"aiodist"`` or
    ``"gloo"``), with the tests of :data:`LEFT_OUT` (or all but ``keep``) taken out."""
    module = _load(world_size)

    class Suite(module.TestDistBackend, module.DistributedTest._DistTestBase):  # type: ignore[misc,name-defined]
        @classmethod
        def setUpClass(cls) -> None:
            cls._saved_environ = dict(os.environ)
            super().setUpClass()

        @classmethod
        def tearDownClass(cls) -> None:
            super().tearDownClass()
            os.environ.clear()
            os.environ.update(cls._saved_environ)

        def setUp(self) -> None:
            saved = dict(os.environ)
            self.addCleanup(lambda: (os.environ.clear(), os.environ.update(saved)))
            os.environ.update(BACKEND="gloo", WORLD_SIZE=str(world_size))
            super().setUp()
            self._start_processes(multiprocessing.get_context("fork").Process)

        @classmethod
        def _run(cls, rank: int, test_name: str, file_name: str, pipe: Any, **kwargs: Any) -> None:
            # The ranks run with Python's own warning filters, as under torch's runner (the
            # parent's pytest turns warnings into errors).
            warnings.resetwarnings()
            if backend == "aiodist":
                _use_aiodist(module)
            super()._run(rank, test_name, file_name, pipe, **kwargs)

    for name in unittest.TestLoader().getTestCaseNames(Suite):
        if (keep is None and left_out(name) is not None) or (keep is not None and name not in keep):
            setattr(Suite, name, _LeftOut(getattr(Suite, name)))
    Suite.__name__ = Suite.__qualname__ = f"Test{backend.capitalize()}{world_size}Ranks"
    Suite.__module__ = __name__
    return Suite


TestAiodistSmoke = _suite("aiodist", 3, SMOKE)
TestAiodistSmoke.__name__ = TestAiodistSmoke.__qualname__ = "TestAiodistSmoke"
TestAiodist3Ranks = pytest.mark.torch_suite(_suite("aiodist", 3))
TestAiodist4Ranks = pytest.mark.torch_suite(_suite("aiodist", 4))
TestGloo3Ranks = pytest.mark.torch_suite(_suite("gloo", 3))
TestGloo4Ranks = pytest.mark.torch_suite(_suite("gloo", 4))


def test_left_out_names_only_tests_of_torchs_base() -> None:
    """Every pattern of the table names a test of torch's base, and the smoke tests run."""
    names = [n for n in dir(_load(4).DistributedTest._DistTestBase) if n.startswith("test_")]
    for patterns, _ in LEFT_OUT:
        for pattern in patterns:
            assert fnmatch.filter(names, pattern), f"{pattern} matches no test of torch 2.13"
    assert not [n for n in SMOKE if left_out(n) or n not in names]


def test_migrating_page_shows_the_same_table() -> None:
    """``docs/migrating.md`` lists the tests left out with the same reasons."""
    text = MIGRATING.read_text()
    section = text.split("(torch-distributed-test)=", 1)[1]
    rows = re.findall(r"^\| (`test_.*?) \| (.*) \|$", section, re.M)
    assert [(tuple(re.findall(r"`([^`]+)`", names)), reason) for names, reason in rows] == [
        (patterns, reason) for patterns, reason in LEFT_OUT
    ]
