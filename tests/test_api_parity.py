"""The torch.distributed names a script or a modern training loop calls, async and blocking."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import json
import logging
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aiodist
import aiodist.sync as dist
from aiodist.launcher._cli import _cuda_devices
from aiodist.testing import run_world, run_world_processes

pytestmark = pytest.mark.both_loops


async def test_device_mesh_groups_along_each_dimension() -> None:
    async def fn(rank: int, size: int) -> tuple[object, ...]:
        mesh = await aiodist.init_device_mesh("cpu", (2, 3), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh["dp"], mesh["tp"]
        x = np.array([float(rank)])
        await aiodist.all_reduce(x, group=tp.get_group())
        y = np.array([float(rank)])
        await aiodist.all_reduce(y, group=mesh.get_group("dp"))
        both = mesh["tp", "dp"]
        return (
            mesh.shape,
            mesh.get_coordinate(),
            dp.mesh.tolist(),
            tp.mesh.tolist(),
            mesh.get_local_rank("tp"),
            tp.size(),
            x[0],
            y[0],
            both.mesh.tolist(),
            aiodist.get_pg_count(),
        )

    results = await run_world(fn, 6, timeout=60)
    for rank, (shape, coord, dp, tp, local_tp, tp_size, x, y, both, count) in enumerate(results):
        row, col = divmod(rank, 3)
        assert shape == (2, 3) and coord == (row, col)  # a tuple, as torch's
        assert dp == [col, col + 3] and tp == [3 * row, 3 * row + 1, 3 * row + 2]
        assert local_tp == col and tp_size == 3
        assert x == sum(tp) and y == sum(dp)
        assert both == [[0, 3], [1, 4], [2, 5]]
        assert count == 1 + 3 + 2  # the default group, 3 dp lines, 2 tp rows


async def test_device_mesh_bad_arguments() -> None:
    async def fn(rank: int, size: int) -> None:
        with pytest.raises(aiodist.DistUsageError, match=r"holds 6 ranks but the world has 4"):
            await aiodist.init_device_mesh("cpu", (2, 3))
        with pytest.raises(aiodist.DistUsageError, match="must name each of the 2 dimensions"):
            await aiodist.init_device_mesh("cpu", (2, 2), mesh_dim_names=("a",))
        with pytest.raises(aiodist.DistUsageError, match="no backend serves device 'tpu'"):
            await aiodist.init_device_mesh("tpu", (4,))
        mesh = await aiodist.init_device_mesh("cpu", (4,))
        with pytest.raises(aiodist.DistUsageError, match="no mesh dimension named 'dp'"):
            mesh.get_group("dp")
        assert mesh.get_group() is mesh.get_all_groups()[0]

    await run_world(fn, 4, timeout=60)


async def test_split_group_and_enumeration() -> None:
    async def fn(rank: int, size: int) -> tuple[object, ...]:
        mine = await aiodist.split_group(split_ranks=[[0, 2], [1]])
        sub, subs = await aiodist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
        x = np.array([rank])
        if mine is not None:
            await aiodist.all_reduce(x, group=mine)
        return (None if mine is None else mine.ranks, sub.ranks if sub else None, len(subs), x[0])

    results = await run_world(fn, 4, timeout=60)
    assert results[0] == ((0, 2), (0, 1), 2, 2)
    assert results[1] == ((1,), (0, 1), 2, 1)
    assert results[2] == ((0, 2), (2, 3), 2, 2)
    assert results[3] == (None, (2, 3), 2, 3)


async def test_coalesced_collectives_and_premul_sum() -> None:
    async def fn(rank: int, size: int) -> None:
        a, b = np.full(3, rank + 1.0), np.full((2, 2), 2.0 * rank)
        await aiodist.all_reduce_coalesced([a, b])
        np.testing.assert_array_equal(a, np.full(3, 3.0))
        np.testing.assert_array_equal(b, np.full((2, 2), 2.0))
        outs = [[np.zeros(2), np.zeros(1, np.int32)] for _ in range(size)]
        await aiodist.all_gather_coalesced(
            outs, [np.full(2, float(rank)), np.array([rank], np.int32)]
        )
        assert [o[0].tolist() for o in outs] == [[0.0, 0.0], [1.0, 1.0]]
        assert [o[1].tolist() for o in outs] == [[0], [1]]
        x = np.full(4, rank + 1.0, np.float32)
        await aiodist.all_reduce(x, op=aiodist.make_premul_sum(0.5))
        np.testing.assert_array_equal(x, np.full(4, 1.5, np.float32))
        with pytest.raises(aiodist.DistUsageError, match="PREMUL_SUM needs its factor"):
            aiodist.all_reduce(np.ones(2), op=aiodist.ReduceOp.PREMUL_SUM)
        with pytest.raises(
            aiodist.DistUsageError, match="PREMUL_SUM is not supported for dtype int64"
        ):
            aiodist.all_reduce(np.ones(2, np.int64), op=aiodist.make_premul_sum(2))

    await run_world(fn, 2, timeout=30)


async def test_object_point_to_point() -> None:
    async def fn(rank: int, size: int) -> object:
        if rank == 0:
            await aiodist.send_object_list([{"a": 1}, "two", 3.0], dst=1)
            return None
        got = [None, None, None]
        sender = await aiodist.recv_object_list(got)
        return sender, got

    _, (sender, got) = await run_world(fn, 2, timeout=30)
    assert sender == 0 and got == [{"a": 1}, "two", 3.0]


def test_small_functions() -> None:
    assert aiodist.supports_complex(aiodist.ReduceOp.SUM)
    assert not aiodist.supports_complex(aiodist.ReduceOp.MAX)
    assert not dist.supports_complex(reduceOp=dist.ReduceOp.BXOR)  # torch's keyword
    with pytest.raises(aiodist.DistUsageError, match="takes one reduction"):
        aiodist.supports_complex()
    assert aiodist.get_default_backend_for_device("cuda:1") == "cuda"
    previous = logging.getLogger("aiodist").level
    try:
        aiodist.set_debug_level("DETAIL")
        assert aiodist.get_debug_level() is aiodist.DebugLevel.DETAIL
        aiodist.set_debug_level(aiodist.DebugLevel.OFF)
        assert aiodist.get_debug_level() is aiodist.DebugLevel.OFF
        with pytest.raises(aiodist.DistUsageError, match="OFF, INFO or DETAIL"):
            aiodist.set_debug_level("LOUD")
    finally:
        logging.getLogger("aiodist").setLevel(previous)
    assert dist.is_gloo_available() and not dist.is_mpi_available()
    assert dist.DistNetworkError is aiodist.DistNetworkError
    assert issubclass(dist.QueueEmptyError, dist.DistStoreError)


def _blocking_parity(rank: int, size: int) -> list[object]:
    assert dist.group.WORLD is not None and dist.group.WORLD.size == size
    mesh = dist.init_device_mesh("cpu", (size,), mesh_dim_names=("dp",))
    x = np.array([float(rank)])
    dist.all_reduce(x, group=mesh["dp"].get_group())
    if rank == 0:
        dist.send_object_list(["hello", rank], dst=1)
    elif rank == 1:
        got = [None, None]
        assert dist.recv_object_list(got, src=0) == 0
        assert got == ["hello", 0]
    work = dist.all_reduce(np.ones(2), async_op=True)
    assert work.wait() and work.is_completed()
    assert work.timeout == timedelta(seconds=60)  # the group's (run_world_processes')
    dist.set_timeout(timedelta(seconds=7))
    work = dist.barrier(async_op=True)
    assert work.wait() and work.timeout == timedelta(seconds=7)
    return [x[0], dist.get_pg_count()]


@pytest.mark.multiprocess
def test_blocking_parity_in_processes() -> None:
    results = run_world_processes(_blocking_parity, 3, timeout=60)
    assert results == [[3.0, 2]] * 3


# -- torch 2.15's public API and torchrun's flags, name by name ------------------------------
#: torch.distributed's public names in torch 2.15.0 and torchrun's options, recorded from the
#: sources of the torch 2.15.0 wheel (its header says how); docs/migrating.md maps each name.
TORCH_API = Path(__file__).with_name("torch_api_2_15.txt")
TORCH_VERSION = (2, 15)

_OPTIONS = (
    "the options struct of ProcessGroup's per-operation methods, which aiodist's ProcessGroup "
    "does not have: aiodist's functions take these options as arguments"
)
_BACKEND_CLASS = (
    "a torch backend's C++ class, in torch only in builds with that backend; aiodist picks its "
    "own backends with init_process_group(backend=...)"
)
#: The names of torch 2.15's list that aiodist.sync deliberately does not provide, and why.
#: A name here that aiodist.sync gains fails the test: move it to the provided ones.
NOT_PROVIDED: dict[str, str] = {
    # functions
    "get_backend_impl": (
        "returns torch's C++ Backend object, for backend-specific experiments; aiodist's "
        "backends are not part of its API"
    ),
    # classes and types
    **dict.fromkeys(
        (
            "AllreduceCoalescedOptions",
            "AllreduceOptions",
            "AllToAllOptions",
            "BarrierOptions",
            "BroadcastOptions",
            "GatherOptions",
            "ReduceOptions",
            "ReduceScatterOptions",
            "ScatterOptions",
        ),
        _OPTIONS,
    ),
    "BackendConfig": "torch's device-to-backend map; get_backend_config() gives the same text",
    "BuiltinCommHookType": "DistributedDataParallel's communication hooks (out of scope)",
    "GradBucket": "DistributedDataParallel's gradient buckets (out of scope)",
    "Reducer": "DistributedDataParallel's gradient reducer (out of scope)",
    "Logger": "DistributedDataParallel's usage logger; aiodist logs to logging.getLogger('aiodist')",
    "GroupName": "a type alias (str) for annotations",
    "RankType": "a type alias (int | torch.SymInt) for annotations",
    **dict.fromkeys(
        (
            "ProcessGroupGloo",
            "ProcessGroupMPI",
            "ProcessGroupNCCL",
            "ProcessGroupNCCL2",
            "ProcessGroupNCCLLazy",
            "ProcessGroupUCC",
            "ProcessGroupXCCL",
        ),
        _BACKEND_CLASS,
    ),
    # submodules
    "algorithms": "DistributedDataParallel's communication hooks and join (out of scope)",
    "autograd": "distributed autograd, part of torch's RPC framework (out of scope)",
    "rpc": "torch's RPC framework (out of scope)",
    "remote_device": "RPC's remote devices (out of scope)",
    "c10d_logger": "torch's internal logging helpers",
    "logging_handlers": "torch's internal logging helpers",
    "config": "torch's internal settings",
    "constants": "torch's internal constants; default_pg_timeout is in aiodist.sync",
    "utils": "torch's internal helpers",
    "distributed_c10d": "the module behind torch.distributed's names; aiodist.sync has them",
    "device_mesh": "a module; its DeviceMesh and init_device_mesh are in aiodist.sync",
}

#: torch parameters that aiodist.sync's group makers accept and ignore, outside their
#: signature (aiodist.sync drops them before calling the async function).
IGNORED_OUTSIDE_SIGNATURE: dict[str, tuple[str, ...]] = {
    "new_group": ("pg_options", "use_local_synchronization", "group_desc"),
    "new_subgroups": ("pg_options", "group_desc"),
    "new_subgroups_by_enumeration": ("pg_options", "group_desc"),
    "split_group": ("pg_options",),
    "shrink_group": ("pg_options",),
}
#: torch 2.15 parameters of functions aiodist.sync provides that it does not take (passing
#: them raises TypeError), and why. A parameter here that aiodist.sync gains fails the test.
PARAMETERS_NOT_TAKEN: dict[str, dict[str, str]] = {
    "new_group": {
        "device_id": "groups are not bound to a device",
        "sort_ranks": "group ranks always follow the sorted global ranks",
    },
    "split_group": {"backend": "a split group always keeps its parent's backend"},
    "init_device_mesh": {"backend_override": "every dimension uses the default group's backend"},
}

#: torchrun 2.15 options aiodist-run does not take, with what to do instead (the list of
#: docs/launcher.md). An option here that aiodist-run gains fails the test.
FLAGS_NOT_SUPPORTED: dict[str, str] = {
    "--numa-binding": "bind in the worker (os.sched_setaffinity) or wrap it with numactl",
    "--duplicate-stdout-filters": "--tee with --log-dir, then grep the log files",
    "--duplicate-stderr-filters": "--tee with --log-dir, then grep the log files",
    "--logs-specs": "--log-dir, --redirects and --tee (no LogsSpecs plug-ins)",
    "--event-log-handler": "drop it: aiodist-run records no torchelastic events",
    "--print-completion": "none: aiodist-run prints no shell completion script",
}
#: Values of options aiodist-run takes that it rejects, with the message it gives.
VALUES_NOT_SUPPORTED: dict[tuple[str, str], str] = {
    # taken, but it needs a GPU to count
    **({("--nproc-per-node", "gpu"): "no GPU to count"} if not _cuda_devices()[0] else {}),
    ("--nproc-per-node", "xpu"): "is not valid",  # no XPU backend
}
#: A value for each --rdzv-conf key, as torchrun's docs give them.
_CONF_VALUE = {"is_host": "1", "store_type": "tcp"}


@dataclass(frozen=True)
class TorchApi:
    """What ``torch_api_2_15.txt`` records."""

    kinds: dict[str, str]
    params: dict[str, tuple[str, ...]]
    flags: dict[str, tuple[str, ...]]
    values: dict[str, tuple[str, ...]]
    rdzv_conf: tuple[str, ...]


def read_torch_api(path: Path = TORCH_API) -> TorchApi:
    kinds: dict[str, str] = {}
    params: dict[str, tuple[str, ...]] = {}
    flags: dict[str, tuple[str, ...]] = {}
    values: dict[str, tuple[str, ...]] = {}
    rdzv_conf: tuple[str, ...] = ()
    for line in path.read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        kind, name, rest = words[0], words[1], tuple(words[2:])
        if kind == "flag":
            flags[name] = (name, *rest)
        elif kind in ("choice", "example"):
            values[name] = rest
        elif kind == "rdzv-conf":
            rdzv_conf = (name, *rest)
        else:
            assert kind in ("function", "class", "type", "value", "module", "build-class"), line
            assert name not in kinds, f"{name} recorded twice"
            kinds[name] = kind
            if kind == "function":
                params[name] = rest
    return TorchApi(kinds, params, flags, values, rdzv_conf)


def test_torch_api_record_is_complete() -> None:
    api = read_torch_api()
    assert len(api.kinds) == 122 and len(api.flags) == 32, (len(api.kinds), len(api.flags))
    assert api.params["init_process_group"][-1] == "enable_reconfigure"
    assert {"gather_single", "set_timeout", "get_backend_impl"} <= set(api.params)


def test_sync_provides_every_torch_2_15_name() -> None:
    api = read_torch_api()
    provided = set(dist.__all__)
    absent = [n for n in api.kinds if n not in provided and n not in NOT_PROVIDED]
    assert not absent, (
        f"torch 2.15 names aiodist.sync neither provides nor lists in NOT_PROVIDED: {absent}"
    )
    stale = sorted(set(NOT_PROVIDED) & provided)
    assert not stale, f"aiodist.sync provides these now, remove them from NOT_PROVIDED: {stale}"
    unknown = sorted(set(NOT_PROVIDED) - set(api.kinds))
    assert not unknown, f"NOT_PROVIDED names that torch 2.15 does not have: {unknown}"


def _accepts(fn: Any) -> tuple[set[str], bool]:
    """The parameter names of ``fn``, and whether it takes any keyword (``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    return {p.name for p in params}, any(p.kind is p.VAR_KEYWORD for p in params)


def test_sync_takes_torch_2_15_parameters() -> None:
    api = read_torch_api()
    absent, stale = [], []
    for name, torch_params in api.params.items():
        if name not in dist.__all__:
            continue
        taken, any_keyword = _accepts(getattr(dist, name))
        ignored = IGNORED_OUTSIDE_SIGNATURE.get(name, ())
        not_taken = PARAMETERS_NOT_TAKEN.get(name, {})
        for param in torch_params:
            if param in taken or any_keyword:
                if param in ignored or param in not_taken:
                    stale.append(f"{name}({param})")
            elif param not in ignored and param not in not_taken:
                absent.append(f"{name}({param})")
        unknown = (set(ignored) | set(not_taken)) - set(torch_params)
        stale += [f"{name}({p}) is not torch's" for p in sorted(unknown)]
    listed = set(IGNORED_OUTSIDE_SIGNATURE) | set(PARAMETERS_NOT_TAKEN)
    stale += [f"{n}: not a function aiodist.sync has" for n in listed - set(api.params)]
    assert not absent, f"torch 2.15 parameters aiodist.sync neither takes nor lists: {absent}"
    assert not stale, f"lists of parameters that are no longer true: {stale}"


def test_ignored_parameters_are_accepted() -> None:
    """The group makers take torch's extra arguments: without a default group, passing them
    fails for that reason, not with a TypeError."""
    if dist.is_initialized():
        pytest.skip("a default process group is open in this process")
    probes = {
        "new_group": {},
        "new_subgroups": {},
        "new_subgroups_by_enumeration": {"ranks_per_subgroup_list": [[0]]},
        "split_group": {"split_ranks": [[0]]},
        "shrink_group": {"ranks_to_exclude": [1]},
    }
    assert probes.keys() == IGNORED_OUTSIDE_SIGNATURE.keys()
    for name, extra in IGNORED_OUTSIDE_SIGNATURE.items():
        kwargs = probes[name] | dict.fromkeys(extra)
        with pytest.raises(aiodist.DistUsageError, match="needs the default process group"):
            getattr(dist, name)(**kwargs)


def _aiodist_run_options() -> set[str]:
    from aiodist.launcher import get_args_parser

    return {s for action in get_args_parser()._actions for s in action.option_strings}


def test_aiodist_run_takes_every_torchrun_2_15_flag() -> None:
    api = read_torch_api()
    options = _aiodist_run_options()
    absent, stale = [], []
    for flag, spellings in api.flags.items():
        if flag in FLAGS_NOT_SUPPORTED:
            stale += [s for s in spellings if s in options]
        else:
            absent += [s for s in spellings if s not in options]
    assert not absent, f"torchrun 2.15 options aiodist-run neither takes nor lists: {absent}"
    assert not stale, f"aiodist-run takes these now, remove them from FLAGS_NOT_SUPPORTED: {stale}"
    unknown = sorted(set(FLAGS_NOT_SUPPORTED) - set(api.flags))
    assert not unknown, f"FLAGS_NOT_SUPPORTED options that torchrun 2.15 does not have: {unknown}"


def _parse(flag: str, value: str) -> str | None:
    """Parse ``aiodist-run FLAG=VALUE train.py``: ``None`` if it is taken, else the error."""
    from aiodist.launcher import parse_args

    argv = [f"{flag}={value}", "train.py"]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parse_args(argv)
    except aiodist.DistUsageError as exc:
        return str(exc)
    except SystemExit:
        return stderr.getvalue()
    return None


def test_aiodist_run_takes_torchrun_2_15_values() -> None:
    api = read_torch_api()
    cases = [(flag, value, value) for flag, values in api.values.items() for value in values]
    cases += [("--rdzv-conf", key, f"{key}={_CONF_VALUE.get(key, '30')}") for key in api.rdzv_conf]
    absent, stale, seen = [], [], set()
    for flag, key, value in cases:
        if flag in FLAGS_NOT_SUPPORTED:
            continue
        seen.add((flag, key))
        error = _parse(flag, value)
        expected = VALUES_NOT_SUPPORTED.get((flag, key))
        if expected is None and error is not None:
            absent.append(f"{flag}={value}: {error.strip()}")
        elif expected is not None and (error is None or expected not in error):
            stale.append(f"{flag}={value}: {error}")
    assert not absent, f"torchrun 2.15 values aiodist-run neither takes nor lists: {absent}"
    assert not stale, f"VALUES_NOT_SUPPORTED entries that are no longer true: {stale}"
    assert set(VALUES_NOT_SUPPORTED) <= seen, set(VALUES_NOT_SUPPORTED) - seen


# -- the installed torch (2.13 here), where there is one ---------------------------------------
_INSTALLED_TORCH = """
import inspect, json, types, warnings
warnings.simplefilter("ignore")
import torch, torch.distributed as d, torch.distributed.distributed_c10d as c10d

names, params = set(c10d.__all__), {}
for name in dir(d):
    obj = getattr(d, name)
    if name.startswith("_"):
        continue
    if isinstance(obj, types.ModuleType):
        if obj.__name__.startswith("torch.distributed."):
            names.add(name)
    elif (getattr(obj, "__module__", None) or "").startswith("torch"):
        names.add(name)
for name in names:
    obj = getattr(d, name) if hasattr(d, name) else getattr(c10d, name)
    if inspect.isfunction(obj):
        params[name] = [p for p in inspect.signature(obj).parameters if not p.startswith("_")]
# (after the names: importing torch.distributed.run adds submodules to torch.distributed)
from torch.distributed.run import get_args_parser

flags = [s for a in get_args_parser()._actions for s in a.option_strings]
print(json.dumps({"version": torch.__version__, "names": sorted(names), "params": params,
                  "flags": [f for f in flags if f not in ("-h", "--help")]}))
"""


def installed_torch() -> dict[str, Any]:
    """The installed torch's public names, parameters and torchrun flags (in a subprocess:
    importing torch here would load it into every later test of the session)."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    proc = subprocess.run(
        [sys.executable, "-c", _INSTALLED_TORCH],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    found: dict[str, Any] = json.loads(proc.stdout)
    version = tuple(int(part) for part in found["version"].split("+")[0].split(".")[:2])
    if version > TORCH_VERSION:
        pytest.skip(f"torch {found['version']} is newer than the recorded 2.15: record it anew")
    return found


@pytest.mark.torch
def test_recorded_api_covers_the_installed_torch() -> None:
    """What the installed (older) torch has, torch 2.15's record has too: the record is
    checked against a real torch, and aiodist.sync against that torch through the record."""
    found, api = installed_torch(), read_torch_api()
    unrecorded = sorted(set(found["names"]) - set(api.kinds))
    assert not unrecorded, (
        f"names of torch {found['version']} not in {TORCH_API.name}: {unrecorded}"
    )
    changed = [
        f"{name}: {params}"
        for name, params in found["params"].items()
        if not set(params) <= set(api.params.get(name, ()))
    ]
    assert not changed, f"parameters of torch {found['version']} not recorded: {changed}"
    spellings = {s for flag in api.flags.values() for s in flag}
    assert set(found["flags"]) <= spellings, set(found["flags"]) - spellings
    absent = [n for n in found["names"] if n not in dist.__all__ and n not in NOT_PROVIDED]
    assert not absent, f"torch {found['version']} names aiodist.sync lacks: {absent}"
