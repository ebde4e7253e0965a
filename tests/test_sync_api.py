"""The blocking process-group API (aiodist.sync) and the torch-style examples."""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

import aiodist
import aiodist.sync as dist
from aiodist.sync._loop_thread import run
from aiodist.testing import free_port

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def clean_world() -> None:
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_init_rules_single_rank(clean_world: None, tmp_path: Path) -> None:
    store = dist.HashStore()
    with pytest.raises(aiodist.DistUsageError, match="either store or init_method"):
        dist.init_process_group("gloo", init_method="env://", store=store, rank=0, world_size=1)
    with pytest.raises(aiodist.DistUsageError, match="world_size must be a positive int"):
        dist.init_process_group("gloo", store=store, rank=0)
    with pytest.raises(aiodist.DistUsageError, match=r"rank must be in \[0, 1\)"):
        dist.init_process_group("gloo", store=store, world_size=1)
    with pytest.raises(aiodist.DistUsageError, match="unknown backend 'mpi'"):
        dist.init_process_group("mpi", store=store, rank=0, world_size=1)
    with pytest.raises(aiodist.DistUsageError, match=r"blocking aiodist\.sync store"):
        dist.init_process_group(store=aiodist.HashStore(), rank=0, world_size=1)  # type: ignore[arg-type]
    # The blocking facade names the blocking call, for operations and introspection alike.
    blocking = r"needs the default process group: call `dist\.init_process_group\(\.\.\.\)` \(with `import aiodist\.sync as dist`\) first$"
    with pytest.raises(aiodist.DistUsageError, match=f"^all_reduce {blocking}"):
        dist.all_reduce(np.ones(1))
    with pytest.raises(aiodist.DistUsageError, match=f"^get_rank {blocking}"):
        dist.get_rank()
    with pytest.raises(aiodist.DistUsageError, match=f"^new_group {blocking}"):
        dist.new_group([0])
    assert not dist.is_initialized()

    # With cupy installed, the forms that name both devices (or none) get the CUDA backend too.
    both = "cpu:cpu,cuda:cuda" if dist.is_nccl_available() else "cpu"
    for backend, name in [
        ("cpu", "cpu"),
        ("gloo", "gloo"),  # the name given, as torch answers
        ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"),
        (dist.Backend("GLOO"), "gloo"),
        (None, both),
    ]:
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=30)
        assert dist.is_initialized() and dist.get_backend() == name
        assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
        with pytest.raises(
            aiodist.DistUsageError, match="initialize the default process group twice"
        ):
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        x = np.arange(3.0)
        assert dist.all_reduce(x) is None
        np.testing.assert_array_equal(x, np.arange(3.0))
        dist.destroy_process_group()
        assert not dist.is_initialized()
    store.close()

    # init_method URLs, and env:// when neither init_method nor store is given.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/f", rank=0, world_size=1)
    assert dist.get_world_size() == 1
    dist.destroy_process_group()
    port = free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=30))
        assert dist.get_rank() == 0
        dist.destroy_process_group()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    with pytest.raises(aiodist.DistUsageError, match="unknown backend"):
        dist.Backend("ucc")
    assert dist.Backend.GLOO == "gloo" and dist.is_available()


def test_async_op_work_single_rank(clean_world: None) -> None:
    store = dist.HashStore()
    dist.init_process_group("cpu", store=store, rank=0, world_size=1)
    x = np.ones(4, dtype=np.float32)
    work = dist.all_reduce(x, async_op=True)
    assert work is not None
    assert work.wait() is True
    assert work.wait(timeout=timedelta(seconds=1)) is True
    assert work.is_completed() and work.is_success() and work.exception() is None
    assert work.result() is x
    future = work.get_future()
    assert isinstance(future, Future) and future.result(timeout=5) is x
    assert repr(work).startswith("<Work (blocking) <Work all_reduce")
    barrier = dist.barrier(async_op=True)
    assert barrier is not None and barrier.wait()
    dist.barrier(timeout=5)
    # A blocking call on the loop thread is refused instead of deadlocking.
    with pytest.raises(aiodist.DistUsageError, match="event-loop thread"):
        future.add_done_callback(lambda _: None)  # runs here, not on the loop: fine
        run(_call_blocking_inside())
    dist.destroy_process_group()
    store.close()


async def _call_blocking_inside() -> None:
    dist.all_reduce(np.ones(1))


def _rank_main(rank: int, world_size: int, port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timedelta(seconds=30))
    for attempt in range(2):  # destroy, then init again in the same process
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                group_name=f"attempt{attempt}")  # fmt: skip
        assert (dist.get_rank(), dist.get_world_size()) == (rank, world_size)

        x = np.full(5, rank + 1.0)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        np.testing.assert_array_equal(x, np.full(5, float(world_size)))

        works = [dist.all_reduce(np.full(3, r * rank), async_op=True) for r in range(3)]
        assert [w.wait() for w in works if w is not None] == [True] * 3
        assert [w.result().tolist() for w in works if w is not None] == [
            [r * sum(range(world_size))] * 3 for r in range(3)
        ]

        y = np.arange(4) if rank == 1 else np.zeros(4, dtype=np.int64)
        dist.broadcast(y, src=1)
        np.testing.assert_array_equal(y, np.arange(4))

        out = [np.zeros(2, dtype=np.int32) for _ in range(world_size)]
        dist.all_gather(out, np.full(2, rank, dtype=np.int32))
        assert [o.tolist() for o in out] == [[r, r] for r in range(world_size)]

        # A ring of blocking send/recv (even ranks send first) and of batched p2p ops.
        right, left = (rank + 1) % world_size, (rank - 1) % world_size
        got = np.zeros(1)
        if rank % 2 == 0:
            dist.send(np.array([float(rank)]), dst=right)
            assert dist.recv(got, src=left) == left
        else:
            assert dist.recv(got) == left
            dist.send(np.array([float(rank)]), dst=right)
        assert got[0] == left
        recv_buf = np.zeros(1)
        ops = [
            dist.P2POp(dist.isend, np.array([rank * 10.0]), right),
            dist.P2POp(dist.irecv, recv_buf, left),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        assert recv_buf[0] == left * 10.0

        objs: list[object] = [None] * world_size
        dist.all_gather_object(objs, {"rank": rank})
        assert objs == [{"rank": r} for r in range(world_size)]
        bl: list[object] = ["from 0", 7] if rank == 0 else [None, None]
        dist.broadcast_object_list(bl, src=0)
        assert bl == ["from 0", 7]

        evens = dist.new_group([r for r in range(world_size) if r % 2 == 0])
        if rank % 2 == 0:
            z = np.ones(2)
            dist.all_reduce(z, group=evens)
            assert z.tolist() == [(world_size + 1) // 2] * 2
            assert dist.get_rank(evens) == rank // 2
        else:
            assert evens is dist.NON_GROUP_MEMBER and dist.get_rank(evens) == -1
        dist.barrier()
        dist.destroy_process_group()
        assert not dist.is_initialized()
    store.close()


@pytest.mark.multiprocess
def test_blocking_api_across_four_processes() -> None:
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, 4, port)) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("listing", ["sync_tcpstore.py", "sync_env_init.py"])
def test_torch_documentation_listings(listing: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / listing)],
        capture_output=True, text=True, timeout=90, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = sorted(result.stdout.splitlines())
    expected = (
        [f"rank {r}/4: all_reduce -> [0.0, 10.0, 20.0, 30.0]" for r in range(4)]
        if listing == "sync_tcpstore.py"
        else [f"rank {r}/4: all_reduce -> 10" for r in range(4)]
    )
    assert lines == expected


@pytest.mark.multiprocess
def test_ctrl_c_during_a_blocking_collective() -> None:
    port = free_port()
    code = textwrap.dedent(
        f"""
        import os, signal, sys, threading, time
        import numpy as np
        import aiodist
        import aiodist.sync as dist
        rank = int(sys.argv[1])
        store = dist.TCPStore("127.0.0.1", {port}, 2, rank == 0)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        if rank == 1:
            store.wait(["rank0-interrupted"])   # joins the all_reduce only afterwards
            start = time.monotonic()
            try:
                dist.all_reduce(np.ones(4))
            except aiodist.DistError as exc:
                print("peer failed after %.3f s:" % (time.monotonic() - start), exc, flush=True)
        else:
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
            start = time.monotonic()
            try:
                dist.all_reduce(np.ones(4))
            except KeyboardInterrupt:
                print("interrupted after %.3f s" % (time.monotonic() - start), flush=True)
            store.set("rank0-interrupted", b"")
            store.wait(["rank1-done"])
        dist.destroy_process_group()
        if rank == 1:
            store.set("rank1-done", b"")
        threads = [t.name for t in threading.enumerate() if t.name == "aiodist-loop"]
        print("rank", rank, "done", threads, flush=True)
        store.close()
        """
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(r)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    # Ctrl-C (0.5 s in) ended a call that could never complete; the peer, which joined the
    # collective afterwards, was told at once. The bounds only guard against hangs.
    interrupted = float(outs[0][0].split("interrupted after ")[1].split(" s")[0])
    failed = float(outs[1][0].split("peer failed after ")[1].split(" s:")[0])
    assert 0.5 <= interrupted < 10 and failed < 10, outs
    assert "rank 0 done" in outs[0][0] and "rank 1 done" in outs[1][0]
    assert "all_reduce interrupted by KeyboardInterrupt" in outs[1][0]


def test_blocking_calls_from_several_threads(clean_world: None) -> None:
    store = dist.HashStore()
    dist.init_process_group("cpu", store=store, rank=0, world_size=1)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(50):
                x = np.ones(8)
                dist.all_reduce(x)
                assert dist.get_rank() == 0
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and time.monotonic() - start < 30
    dist.destroy_process_group()
    store.close()


@pytest.mark.multiprocess
def test_destroy_leaves_no_thread_or_socket(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import os, threading
        import numpy as np
        import aiodist.sync as dist

        def state():
            fds = sorted(os.listdir("/proc/self/fd"))
            return fds, [t.name for t in threading.enumerate() if t.name != "MainThread"]

        def cycle(attempt):
            url = "file://{tmp_path}/rdzv" + str(attempt)
            dist.init_process_group("gloo", init_method=url, rank=0, world_size=1)
            x = np.ones(3)
            dist.all_reduce(x)
            assert "aiodist-loop" in state()[1]
            dist.destroy_process_group()

        # libuv keeps one signal pipe per process from its first loop on: warm up first.
        cycle(0)
        before = state()
        assert before[1] == [], before
        for attempt in (1, 2):
            cycle(attempt)
            after = state()
            assert after == before, (before, after)
        print("clean")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "clean"


def test_torch_module_level_names(monkeypatch: pytest.MonkeyPatch) -> None:
    assert dist.is_available() and dist.is_gloo_available()
    assert dist.is_backend_available("cpu:gloo,cuda:nccl")
    assert not dist.is_backend_available("mpi")
    # The CUDA backend can run where cupy is installed.
    assert dist.is_nccl_available() is (importlib.util.find_spec("cupy") is not None)
    assert dist.group.WORLD is None and dist.GroupMember.NON_GROUP_MEMBER is dist.NON_GROUP_MEMBER
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert not dist.is_torchelastic_launched()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert dist.is_torchelastic_launched()
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert dist.get_node_local_rank() == 3
    assert dist.ReduceOp.SUM == 0 and dist.Backend("NCCL") == dist.Backend.NCCL


def test_init_takes_shared_memory_as_the_async_api_does(clean_world: None) -> None:
    from aiodist.transport.tcp import TCPTransport

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, shared_memory=False)
    world = dist.group.WORLD
    assert world is not None and isinstance(world.world.transport, TCPTransport)
    dist.destroy_process_group()
    with pytest.raises(aiodist.DistUsageError, match=r"shared_memory must be"):
        dist.init_process_group("gloo", store=store, rank=0, world_size=1, shared_memory="yes")  # type: ignore[arg-type]
