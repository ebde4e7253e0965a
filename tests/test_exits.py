"""Ranks that end, with or without a goodbye, while the others still work.

A rank whose script ends leaves the group as it exits; what it sent before still reaches
the others; one that goes without a goodbye breaks the group for new operations only; one
that ends on an exception makes the others fail at once, naming it; a rank hosting the store
keeps it up until the others have left. Each scenario is ``tests/exit_worker.py`` run as real
processes, on both loops and over shared memory and TCP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import proc_helpers
import pytest
from netns_helpers import IPV4, Hosts

import aiodist
import aiodist.multiprocessing as amp
import aiodist.sync as dist
from aiodist.testing import free_port, run_world, start_world_processes

WORKER = Path(__file__).parent / "exit_worker.py"
TRANSPORTS = [
    pytest.param({"AIODIST_SHM": "1", "AIODIST_LOOP": "uvloop"}, id="shm-uvloop"),
    pytest.param({"AIODIST_SHM": "0", "AIODIST_LOOP": "asyncio"}, id="tcp-asyncio"),
]


class Ranks:
    """The processes of one scenario, once they have all ended: exit codes and events."""

    def __init__(
        self,
        scenario: str,
        world: int,
        env: dict[str, str],
        placed: tuple[Hosts, list[int]] | None = None,
    ) -> None:
        """Run ``scenario`` with ``world`` ranks; ``placed``: the namespaces, and the host of
        each rank (rank 0 hosts the store on host 0's address)."""
        port = free_port()
        master = [] if placed is None else [IPV4[0]]
        procs = [
            subprocess.Popen(
                [
                    *([] if placed is None else placed[0].prefix(placed[1][rank])),
                    sys.executable,
                    str(WORKER),
                    scenario,
                    str(rank),
                    str(world),
                    str(port),
                    *master,
                ],
                env={**os.environ, **env},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(world)
        ]
        self.codes: list[int] = []
        self.events: list[dict[str, dict[str, Any]]] = []
        self.ended: list[float] = []
        self.stderr: list[str] = []
        for proc in procs:
            out, err = proc.communicate(timeout=60)
            self.ended.append(time.time())
            self.codes.append(proc.returncode)
            self.stderr.append(err)
            self.events.append({e["event"]: e for e in map(json.loads, out.splitlines())})

    def __repr__(self) -> str:
        return f"<Ranks codes={self.codes} events={self.events} stderr={self.stderr}>"


@pytest.mark.multiprocess
@pytest.mark.parametrize("env", TRANSPORTS)
def test_what_a_rank_sent_before_it_vanished_is_received(env: dict[str, str]) -> None:
    r = Ranks("sent_then_gone", 2, env)
    assert r.codes == [0, 0], r
    assert r.events[0]["received"]["ok"], r
    # Gone without a goodbye: the group is broken for what comes next, naming rank 1.
    state = r.events[0]["state"]
    assert state["aborted"] and "rank 1" in state["cause"], r
    second = r.events[0]["second"]
    assert second["type"] == "DistNetworkError" and "rank 1" in second["msg"], r


@pytest.mark.multiprocess
@pytest.mark.parametrize("env", TRANSPORTS)
def test_a_rank_whose_script_ended_breaks_nothing(env: dict[str, str]) -> None:
    r = Ranks("sent_then_exit", 3, env)
    assert r.codes == [0, 0, 0], r
    assert r.events[0]["received"]["ok"], r
    assert not r.events[0]["state"]["aborted"], r
    second = r.events[0]["second"]
    assert second["type"] == "DistNetworkError", r
    assert second["msg"] == (
        "lost connection to rank 1: it exited without calling destroy_process_group() "
        "(its script had ended)"
    ), r
    # The others go on together.
    assert r.events[0]["pair"]["value"] == r.events[2]["pair"]["value"] == 4.0, r


@pytest.mark.multiprocess
@pytest.mark.parametrize("env", TRANSPORTS)
def test_a_rank_that_ends_on_an_exception_fails_the_others_at_once(env: dict[str, str]) -> None:
    r = Ranks("raise", 3, env)
    assert r.codes[1] == 1 and "ValueError: boom" in r.stderr[1], r
    for rank in (0, 2):
        err = r.events[rank]["error"]
        assert err["type"] in ("DistError", "DistNetworkError"), r
        assert "rank 1 exited on an exception: ValueError: boom" in err["msg"], r
        assert err["waited"] < 5.0, r  # (a no-hang guard: it is told, not timed out)


@pytest.mark.multiprocess
@pytest.mark.parametrize("env", TRANSPORTS)
def test_the_store_host_ending_first_keeps_the_store_up_for_the_others(
    env: dict[str, str],
) -> None:
    r = Ranks("host_first", 3, env)
    assert r.codes == [0, 0, 0], r
    assert r.events[1]["pair"]["value"] == r.events[2]["pair"]["value"] == 3.0, r
    # Rank 0 ended its script at once, and its process stayed until the others had left.
    assert r.events[0]["end"]["t"] < r.events[1]["pair"]["t"], r


@pytest.mark.netns
@pytest.mark.multiprocess
def test_ranks_that_end_on_two_hosts(hosts: Hosts) -> None:
    """Rank 0 on one host, ranks 1 and 2 sharing memory on the other, plain tcp://."""
    placed = (hosts, [0, 1, 1])
    r = Ranks("sent_then_exit", 3, {}, placed)
    assert r.codes == [0, 0, 0], r
    assert r.events[0]["received"]["ok"] and not r.events[0]["state"]["aborted"], r
    assert "it exited without calling destroy_process_group()" in r.events[0]["second"]["msg"]
    assert r.events[0]["pair"]["value"] == r.events[2]["pair"]["value"] == 4.0, r
    r = Ranks("host_first", 3, {}, placed)
    assert r.codes == [0, 0, 0], r
    assert r.events[1]["pair"]["value"] == r.events[2]["pair"]["value"] == 3.0, r


@pytest.mark.multiprocess
def test_an_operation_completes_although_the_last_rank_left_it_at_once() -> None:
    for _ in range(3):
        r = Ranks("barrier_gone", 2, {"AIODIST_SHM": "1"})
        assert r.codes == [0, 0] and r.events[0]["passed"]["ok"], r


# -- what torch users meet on the way ---------------------------------------------------------
async def test_scatter_object_list_ignores_the_input_list_on_other_ranks() -> None:
    async def fn(rank: int, size: int) -> object:
        out: list[object] = [None]
        # Anything on the non-source ranks, as torch documents: "elements are not used".
        ins = [f"to {r}" for r in range(size)] if rank == 0 else ["junk", 1, 2, 3, 4]
        await aiodist.scatter_object_list(out, ins, src=0)
        return out[0]

    assert await run_world(fn, 3) == ["to 0", "to 1", "to 2"]


async def test_a_store_wait_timeout_is_a_store_error_as_in_torch() -> None:
    store = aiodist.HashStore(timeout=0.05)
    with pytest.raises(aiodist.DistStoreError, match=r"waiting for keys \['absent'\]") as info:
        await store.get("absent")
    assert isinstance(info.value, aiodist.DistTimeoutError) and isinstance(info.value, TimeoutError)
    async with await aiodist.TCPStore.create("127.0.0.1", 0, is_master=True, timeout=5) as host:
        with pytest.raises(aiodist.DistStoreError, match=r"still missing: \['k'\]"):
            await host.wait(["k"], 0.05)


def test_reduce_op_is_reduce_op_with_a_deprecation_warning() -> None:
    with pytest.warns(FutureWarning, match="please use `ReduceOp` instead"):
        assert dist.reduce_op.SUM is dist.ReduceOp.SUM
    with pytest.warns(FutureWarning):
        assert aiodist.reduce_op.MAX is aiodist.ReduceOp.MAX
    with pytest.raises(AttributeError, match="reduce_op has no attribute 'MEAN'"):
        dist.reduce_op.MEAN  # noqa: B018


def _non_member(rank: int, size: int) -> tuple[object, ...]:
    group = dist.new_group([0, 1])
    x = np.ones(2)
    if rank < 2:
        dist.all_reduce(x, group=group)
        return (float(x[0]),)
    with pytest.warns(UserWarning, match="Running all_reduce on global rank 2 which does not"):
        nothing = dist.all_reduce(x, group=group)
    with pytest.warns(UserWarning, match="Running recv on global rank 2"):
        sender = dist.recv(x, src=0, group=group)
    with pytest.warns(UserWarning, match="Running broadcast_object_list"):
        dist.broadcast_object_list([None], src=0, group=group)
    return (nothing, sender, float(x[0]))


@pytest.mark.multiprocess
def test_a_call_on_a_group_without_this_rank_warns_and_returns() -> None:
    results = aiodist.testing.run_world_processes(_non_member, 3, timeout=60)
    assert results == [(2.0,), (2.0,), (None, -1, 1.0)]


# -- aiodist.multiprocessing.spawn ------------------------------------------------------------
def _write_rank(i: int, path: str) -> None:
    Path(path, f"rank{i}").write_text(str(i))


def _fail_one(i: int) -> None:
    if i == 1:
        raise ValueError(f"boom in {i}")
    time.sleep(30)  # stopped by the parent once rank 1 failed


def _exit_one(i: int) -> None:
    if i == 0:
        sys.exit(3)
    time.sleep(30)


@pytest.mark.multiprocess
def test_spawn_runs_fn_with_the_index_first(tmp_path: Path) -> None:
    assert amp.spawn(_write_rank, args=(str(tmp_path),), nprocs=3) is None
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["0", "1", "2"]
    context = amp.spawn(_write_rank, args=(str(tmp_path),), nprocs=2, join=False)
    assert isinstance(context, amp.ProcessContext) and len(context.pids()) == 2
    while not context.join():
        pass


@pytest.mark.multiprocess
def test_spawn_raises_the_first_failure_with_its_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(amp.ProcessRaisedException, match="boom in 1") as info:
        amp.spawn(_fail_one, nprocs=3)
    assert info.value.error_index == 1
    assert "-- Process 1 terminated with the following error:" in str(info.value)
    assert "Traceback" in str(info.value)
    assert time.monotonic() - start < 20  # the others were stopped, not waited for
    with pytest.raises(amp.ProcessExitedException, match="process 0 terminated with exit code 3"):
        amp.spawn(_exit_one, nprocs=2, start_method="fork")


# -- fork, spawn and forkserver children, the parent holding a group or not -------------------
@pytest.mark.multiprocess
@pytest.mark.parametrize("hold", [True, False], ids=["parent-holds-a-group", "parent-without"])
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_children_form_a_group_of_their_own(method: str, hold: bool) -> None:
    worker = Path(__file__).parent / "fork_worker.py"
    proc = subprocess.run(
        [sys.executable, str(worker), method, "1" if hold else "0"],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["codes"] == [0, 0], report
    for rank, child in enumerate(report["children"]):
        # A forked child starts uninitialized, with its own loop and progress threads.
        assert child == {"rank": rank, "inherited": False, "sum": 3.0, "watched": True}
    assert report["parent"] == (1.0 if hold else None)


def _three_ranks(
    script: str, *args: str, env: dict[str, str] | None = None
) -> list[subprocess.Popen[str]]:
    """Start ``python -c script <rank> *args`` for ranks 0-2 (output piped, as text), with
    ``env`` over this process's environment; a test that fails leaves none running."""
    return [
        proc_helpers.track(
            subprocess.Popen(
                [sys.executable, "-c", script, str(r), *args],
                env={**os.environ, **(env or {})},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        for r in range(3)
    ]


# -- one timeout, from init_process_group down ------------------------------------------------
_WORKSPACE_STRAGGLER = """
import asyncio, json, sys, time
import aiodist.sync as dist
import aiodist.collectives.shm as shm
rank, port = int(sys.argv[1]), sys.argv[2]
if rank == 1:
    async def never(*args, **kwargs):  # this rank stops before it takes part in the workspace
        await asyncio.Event().wait()
    shm.NodeWorkspace.create = never
start = time.monotonic()
try:
    dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=3, timeout=3)
except Exception as exc:
    print(json.dumps({"type": type(exc).__name__, "msg": str(exc), "t": time.monotonic() - start}))
"""


@pytest.mark.multiprocess
def test_the_groups_timeout_bounds_the_shared_memory_workspace() -> None:
    port = str(free_port())
    procs = _three_ranks(_WORKSPACE_STRAGGLER, port, env={"AIODIST_SHM": "1"})
    try:
        for rank in (0, 2):
            out, err = procs[rank].communicate(timeout=60)
            error = json.loads(out)
            assert error["type"] == "DistTimeoutError", (error, err)
            # The group's 3 s, not the workspace's former 300 s (a generous no-hang guard).
            assert 3 <= error["t"] < 30, error
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()


# -- the async API: a world left open when its event loop ends ----------------------------------
_ASYNC_HOST_FIRST = """
import asyncio, json, sys, time
import numpy as np
import aiodist

async def main(rank, port):
    await aiodist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    pair = await aiodist.new_group([1, 2])
    if rank == 0:
        return  # rank 0 hosts the store and ends first, without destroy_process_group()
    await asyncio.sleep(1.0)
    x = np.array([float(rank)])
    # Had rank 0's process ended with its loop, the store would be gone: "lost the store"
    # would have aborted this world by now.
    await aiodist.all_reduce(x, group=pair)
    await aiodist.barrier(group=pair)
    print(json.dumps({"value": float(x[0]), "t": time.time()}))

asyncio.run(main(int(sys.argv[1]), sys.argv[2]))
print(json.dumps({"ended": time.time()}))
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("env", TRANSPORTS)
def test_an_async_rank_whose_loop_ends_leaves_and_keeps_the_store(env: dict[str, str]) -> None:
    port = str(free_port())
    procs = _three_ranks(_ASYNC_HOST_FIRST, port, env=env)
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [e for _, e in outs]
    lines = [[json.loads(line) for line in out.splitlines()] for out, _ in outs]
    assert lines[1][0]["value"] == lines[2][0]["value"] == 3.0, lines
    # Rank 0's asyncio.run returned after the others had left: its loop kept the store.
    assert lines[0][0]["ended"] >= max(lines[1][0]["t"], lines[2][0]["t"]), lines


# -- an event loop that runs only while its owner waits for aiodist -----------------------------
_STOPPED_LOOPS = """
import asyncio, json, os, sys, time
import numpy as np
import aiodist

rank, port, marks = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if os.environ["AIODIST_LOOP"] == "uvloop":
    import uvloop
    loop = uvloop.new_event_loop()
else:
    loop = asyncio.new_event_loop()
seen = {}

def run(fn, *args, **kwargs):
    async def call():
        return await fn(*args, **kwargs)
    return loop.run_until_complete(call())

def everyone_done(step):
    # No loop runs while the ranks wait here, rank 0's (which serves the store) included:
    # every rank must be done with the step when the first returns from it.
    os.makedirs(os.path.join(marks, step), exist_ok=True)
    open(os.path.join(marks, step, str(rank)), "w").close()
    end = time.monotonic() + 15
    while len(os.listdir(os.path.join(marks, step))) < 3 and time.monotonic() < end:
        time.sleep(0.01)
    seen[step] = sorted(os.listdir(os.path.join(marks, step)))

run(aiodist.init_process_group, "gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
everyone_done("init")
run(aiodist.new_group, [0, 2])
everyone_done("new_group")
x = np.array([rank + 1.0])
run(aiodist.all_reduce, x)
run(aiodist.destroy_process_group)
print(json.dumps({"seen": seen, "sum": float(x[0])}))
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("env", TRANSPORTS)
def test_no_rank_returns_from_setup_while_another_needs_the_store(
    env: dict[str, str], tmp_path: Path
) -> None:
    """A script may run its loop only while it awaits aiodist (``run_until_complete`` per
    call): once rank 0 is back from a setup, its loop no longer serves the store, so the
    others must not need it any more."""
    port = str(free_port())
    procs = _three_ranks(_STOPPED_LOOPS, port, str(tmp_path), env=env)
    outs = [p.communicate(timeout=90) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [e for _, e in outs]
    everyone = ["0", "1", "2"]
    for out, _ in outs:
        assert json.loads(out) == {"seen": {"init": everyone, "new_group": everyone}, "sum": 6.0}


_VANISHES_BEFORE_VOTING = """
import json, os, sys, time
import aiodist.sync as dist

rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=3, timeout=60)
if rank == 2:
    os._exit(0)  # no goodbye: only its lease in the store says it went
start = time.monotonic()
try:
    dist.new_group([0, 1])
except Exception as exc:
    print(json.dumps({"type": type(exc).__name__, "msg": str(exc), "t": time.monotonic() - start}))
"""


@pytest.mark.multiprocess
def test_a_rank_that_vanishes_before_new_group_fails_it_within_seconds() -> None:
    """The others wait in the vote's store barrier, which ends when the world breaks: they
    do not wait for the 60 s timeout."""
    port = str(free_port())
    procs = _three_ranks(_VANISHES_BEFORE_VOTING, port)
    outs = [p.communicate(timeout=90) for p in procs]
    for out, err in outs[:2]:
        error = json.loads(out)
        assert error["type"] == "DistNetworkError", (error, err)
        assert error["msg"].startswith("new_group: the world broke before every rank got"), error
        assert "rank 2" in error["msg"], error
        assert error["t"] < 20, error  # (a generous no-hang guard: the lease takes moments)


# -- a rank that leaves while the others need it ------------------------------------------------
async def _rank_two_leaves_mid_operation(rank: int, size: int) -> str:
    await aiodist.init_process_group(timeout=30)
    if rank == 2:
        await aiodist.destroy_process_group()
        return "left"
    try:
        await aiodist.all_reduce(np.ones(4))
    except aiodist.DistError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        await aiodist.destroy_process_group()
    return "completed"


@pytest.mark.multiprocess
def test_a_rank_that_left_fails_the_operation_with_a_network_error_on_every_rank() -> None:
    # Over TCP the first rank to see the departure tells the other, which must not take the
    # word for a usage error of that rank's call: every rank names the one that left.
    results = start_world_processes(
        _rank_two_leaves_mid_operation, 3, init_group=False, env={"AIODIST_SHM": "0"}
    ).results()
    assert results[2] == "left"
    for text in results[:2]:
        assert text.startswith("DistNetworkError: "), results
        assert text.endswith(
            "lost connection to rank 2: it left the process group (destroy_process_group)"
        ), results
