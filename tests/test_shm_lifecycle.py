"""Nothing of a job stays in /dev/shm, whichever way its processes end, and a full
/dev/shm is a clear error."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from shm_helpers import leftovers, new_job, shm_world

import aiodist
from aiodist._arrays._reduce import ReduceOp
from aiodist.collectives import _shared_array, shm
from aiodist.collectives.shm import NodeWorkspace
from aiodist.collectives.shm_workspace import workspace_bytes
from aiodist.store import FileStore, HashStore
from aiodist.testing import start_world_processes
from aiodist.transport.shm import ShmTransport

pytestmark = [pytest.mark.multiprocess, pytest.mark.both_loops]


async def _use_everything(path: str, job: str, close: bool, rank: int, n: int) -> list[str]:
    store = FileStore(path)
    t = await ShmTransport.create(store, rank, n, timeout=30, job_key=job)
    ws = await NodeWorkspace.create(store, rank, n, timeout=30, job_key=job)
    x = _shared_array.empty(1 << 17, np.float32, ws)
    x[:] = rank
    await shm.all_reduce(ws, x, ReduceOp.SUM)
    assert (x == sum(range(n))).all()
    seen = leftovers(job)  # every rank is past setup: every name is gone already
    await t.send((rank + 1) % n, (0, 0, 0), memoryview(b"hi"))
    box = bytearray(2)
    await t.recv_into((rank - 1) % n, (0, 0, 0), memoryview(box))
    await shm.barrier(ws)  # nobody exits while a peer still reads its ring
    if close:
        await ws.aclose()
        await t.aclose()
    return seen


@pytest.mark.parametrize("close", [True, False], ids=["aclose", "exit"])
def test_nothing_remains_after_aclose_or_a_plain_exit(close: bool, tmp_path: Any) -> None:
    job = new_job()
    rank_main = functools.partial(_use_everything, str(tmp_path / "store"), job, close)
    with start_world_processes(rank_main, 3, timeout=90, init_group=False) as world:
        seen = world.results()
    assert seen == [[], [], []]
    assert leftovers(job) == []


async def _set_up_and_wait(path: str, job: str, size: int, rank: int, started: int) -> str:
    """Rank ``rank`` of a transport of ``size`` ranks, of which only ``started`` come."""
    try:
        await ShmTransport.create(FileStore(path), rank, size, timeout=2, job_key=job)
    except aiodist.DistTimeoutError as exc:
        return str(exc)
    return "set up"


async def test_a_rank_killed_during_setup_leaves_nothing_behind(tmp_path: Any) -> None:
    job = new_job()
    path = str(tmp_path / "store")
    # Ranks 0 and 1 of three set up; rank 2 never comes. Rank 0 is killed while its
    # segment and doorbell still have names (they are unlinked once all have mapped them).
    rank_main = functools.partial(_set_up_and_wait, path, job, 3)
    with start_world_processes(rank_main, 2, timeout=60, init_group=False) as world:
        store = FileStore(path)
        await store.wait(["shm/t/0", "shm/t/1"], timeout=30)
        assert len(leftovers(job)) == 4  # two segments and two doorbells
        world.procs[0].kill()
        # Rank 1 gives up at its deadline and removes its own names and rank 0's.
        [msg] = await asyncio.to_thread(world.results, timeout=30, ranks=[1])
    assert msg.endswith(f"ranks [2] did not arrive within {msg.split('within ')[1]}")
    assert leftovers(job) == []


async def _kill_rank_0_once_published(rank_main: Any, path: str, key: str) -> int:
    """Start ``rank_main`` as rank 0 alone and kill it once it published ``key`` in the store
    at ``path`` (its names still exist); return its pid."""
    with start_world_processes(rank_main, 1, timeout=60, init_group=False) as world:
        await FileStore(path).wait([key], timeout=30)
        world.procs[0].kill()
        world.procs[0].join(10)
        return world.procs[0].pid


async def test_a_restart_removes_what_its_killed_predecessor_left(tmp_path: Any) -> None:
    job = new_job()
    path = str(tmp_path / "store")
    # Rank 0 of two sets up alone, and is killed while its names still exist.
    rank_main = functools.partial(_set_up_and_wait, path, job, 2)
    await _kill_rank_0_once_published(rank_main, path, "shm/t/0")
    left = leftovers(job)
    assert len(left) == 2  # nobody survived to clean up
    # The job starts again under the same key: its setup removes them first.
    transports = await shm_world(2, job)
    assert leftovers(job) == []
    for t in transports:
        await t.aclose()


#: What a rank sets up in shared memory, and the key its record is published under.
_SETUPS = {
    "workspace": (NodeWorkspace.create, "shm/ws/0"),
    "transport": (ShmTransport.create, "shm/t/0"),
}


async def _set_up(what: str, path: str, job: str, rank: int, started: int) -> str:
    """Rank ``rank`` of a ``what`` of two ranks, of which only ``started`` are processes."""
    await _SETUPS[what][0](FileStore(path), rank, 2, timeout=30, job_key=job)
    return "set up"


@pytest.mark.parametrize("what", list(_SETUPS))
async def test_a_peer_that_died_and_was_swept_away_is_named(what: str, tmp_path: Any) -> None:
    # Rank 0 creates its segment, publishes its record, and is killed before rank 1 maps the
    # segment; rank 1's set-up sweeps the dead process's files away first, as leftovers.
    # Rank 1 is told that rank 0 exited (a DistNetworkError, which recover() handles), not
    # that a file is missing.
    job = new_job()
    path = str(tmp_path / "store")
    create, key = _SETUPS[what]
    pid = await _kill_rank_0_once_published(functools.partial(_set_up, what, path, job), path, key)
    assert leftovers(job) != []
    with pytest.raises(aiodist.DistNetworkError, match=rf": rank 0 \(pid {pid}\) exited$"):
        await create(FileStore(path), 1, 2, timeout=30, job_key=job)
    assert leftovers(job) == []


async def test_a_failed_setup_unlinks_what_it_created() -> None:
    job = new_job()
    with pytest.raises(aiodist.DistTimeoutError):
        await ShmTransport.create(HashStore(), 0, 2, timeout=0.2, job_key=job)
    with pytest.raises(aiodist.DistTimeoutError):
        await NodeWorkspace.create(HashStore(), 0, 2, timeout=0.2, job_key=job)
    assert leftovers(job) == []


_FULL_SHM = textwrap.dedent(
    """
    import asyncio, json, os
    import numpy as np
    from aiodist.collectives import _shared_array
    from aiodist.collectives.shm import NodeWorkspace
    from aiodist.store import HashStore
    from aiodist.transport._shm_segment import SharedMemoryError
    from aiodist.transport.shm import ShmTransport

    async def main():
        # Rank 0 of two alone: each rank creates its own segment (the workspace's is rank
        # 0's) before it waits for anybody, so the error comes at once.
        errors = {}
        try:
            await ShmTransport.create(HashStore(), 0, 2, ring_bytes=4 << 20, timeout=5)
        except SharedMemoryError as exc:
            errors["transport"] = str(exc)
        try:
            await NodeWorkspace.create(HashStore(), 0, 2, timeout=5)
        except SharedMemoryError as exc:
            errors["workspace"] = str(exc)
        alone = await NodeWorkspace.create(HashStore(), 0, 1)
        try:
            _shared_array.empty(1 << 20, np.float32, alone)
        except SharedMemoryError as exc:
            errors["array"] = str(exc)
        errors["left"] = os.listdir("/dev/shm")
        print(json.dumps(errors))

    asyncio.run(main())
    """
)


def test_a_full_dev_shm_is_a_clear_error_not_a_sigbus() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a small /dev/shm privately")
    # A private mount namespace with a 1 MiB /dev/shm: nothing of it is seen outside.
    script = (
        "mount -t tmpfs -o size=1m tmpfs /dev/shm && "
        f'exec {sys.executable} -c "$AIODIST_TEST_SCRIPT"'
    )
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script],
        env={**os.environ, "AIODIST_TEST_SCRIPT": _FULL_SHM},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    errors = json.loads(proc.stdout)
    transport = errors["transport"]
    assert transport.startswith(
        "rank 0: cannot reserve 4198656 bytes of shared memory in /dev/shm for "
    )
    assert "it is full" in transport and "bytes are free" in transport
    assert "fall back to TCP (AIODIST_SHM=0)" in transport
    assert errors["workspace"].startswith(
        f"cannot reserve {workspace_bytes(2)} bytes of shared memory"
    )
    assert errors["array"].startswith(
        "cannot reserve 4194304 bytes of shared memory in /dev/shm for a shared array of "
        "4194304 bytes: it is full"
    )
    assert errors["left"] == []


#: A world of argv[1] ranks on this host: each reports its transport, its all_reduce and the
#: warnings that say it talks over TCP. With argv[2] == "limit", rank 1's files may not grow
#: past 1 MiB, so its 4 MiB of rings cannot be reserved after the host's room check passed.
_WORLD_ON_THIS_HOST = textwrap.dedent(
    """
    import asyncio, json, logging, resource, signal, sys
    import numpy as np
    import aiodist
    from aiodist.testing import start_world_processes

    async def rank_main(rank, size):
        said = []
        handler = logging.Handler()
        handler.emit = lambda record: said.append(record.getMessage())
        logging.getLogger("aiodist").addHandler(handler)
        if rank == 1 and sys.argv[2:] == ["limit"]:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        pg = await aiodist.init_process_group(timeout=60)
        x = np.full(4, float(rank))
        await aiodist.all_reduce(x)
        kind = type(pg.world.transport).__name__
        await aiodist.destroy_process_group()
        return kind, x.tolist(), [s for s in said if "talk over TCP" in s]

    if __name__ == "__main__":
        size = int(sys.argv[1])
        print(json.dumps(start_world_processes(rank_main, size, init_group=False).results()))
    """
)


#: Bytes of ring buffers the shared-memory transport of 4 ranks reserves on their host.
_RINGS_OF_4 = 50348032


@pytest.mark.multiprocess
@pytest.mark.parametrize(("size", "fits"), [(2, True), (4, False)])
def test_a_dev_shm_too_small_for_the_host_falls_back_to_tcp(
    size: int, fits: bool, tmp_path: Path
) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a small /dev/shm privately")
    worker = tmp_path / "world.py"  # (a file: spawned ranks import their function)
    worker.write_text(_WORLD_ON_THIS_HOST)
    # 16 MiB: two ranks' rings and workspace fit (12 MiB); four ranks' (56 MiB) do not.
    script = f"mount -t tmpfs -o size=16m tmpfs /dev/shm && exec {sys.executable} {worker} {size}"
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    expected = [float(sum(range(size)))] * 4
    for rank, (kind, x, said) in enumerate(json.loads(proc.stdout.splitlines()[-1])):
        assert x == expected
        if fits:
            assert (kind, said) == ("RoutedTransport", []), (rank, kind, said)
            continue
        assert kind == "TCPTransport", (rank, kind)
        assert len(said) == 1 and re.fullmatch(
            rf"rank {rank}: ranks \[0, 1, 2, 3\] talk over TCP: /dev/shm has \d+ bytes free, "
            rf"but the 4 ranks of this host would reserve {_RINGS_OF_4 + workspace_bytes(4)} "
            r"there; enlarge it \(docker: "
            r"--shm-size\) for shared memory",
            said[0],
        ), said


@pytest.mark.multiprocess
def test_a_rank_that_cannot_reserve_its_rings_takes_its_host_to_tcp(tmp_path: Path) -> None:
    worker = tmp_path / "world.py"  # (a file: spawned ranks import their function)
    worker.write_text(_WORLD_ON_THIS_HOST)
    proc = subprocess.run(
        [sys.executable, str(worker), "3", "limit"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    for rank, (kind, x, said) in enumerate(json.loads(proc.stdout.splitlines()[-1])):
        assert x == [3.0] * 4
        assert kind == "TCPTransport", (rank, kind)
        assert len(said) == 1 and re.fullmatch(
            rf"rank {rank}: ranks \[0, 1, 2\] talk over TCP: rank 1: cannot reserve 8393216 "
            r"bytes of shared memory in /dev/shm for the rings of rank 1 \(2 x 4194304 "
            r"bytes\): \[Errno 27\] File too large \(\d+ bytes are free\); .*",
            said[0],
        ), said


#: Two ranks that make subgroups until /dev/shm (24 MiB: the default group's rings and
#: workspace, and two subgroups' workspaces) has no room for the next workspace: each
#: reports, per subgroup, whether it has a workspace, its all_reduce, and what it said.
_SUBGROUPS_UNTIL_FULL = textwrap.dedent(
    """
    import asyncio, json, logging, sys, time
    import numpy as np
    import aiodist
    from aiodist.testing import start_world_processes

    async def rank_main(rank, size):
        said = []
        handler = logging.Handler()
        handler.emit = lambda record: said.append(record.getMessage())
        logging.getLogger("aiodist").addHandler(handler)
        await aiodist.init_process_group(timeout=30)
        start = time.monotonic()
        groups = []
        for _ in range(4):
            pg = await aiodist.new_group([0, 1])
            x = np.full(4, float(rank + 1))
            await aiodist.all_reduce(x, group=pg)
            groups.append(("cpu" in pg.paths, x.tolist()))
        took = time.monotonic() - start
        await aiodist.destroy_process_group()
        return groups, took, [s for s in said if "no shared-memory workspace" in s]

    if __name__ == "__main__":
        print(json.dumps(start_world_processes(rank_main, 2, init_group=False).results()))
    """
)


@pytest.mark.multiprocess
def test_subgroups_past_the_room_in_dev_shm_agree_to_run_over_the_transport(
    tmp_path: Path,
) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a small /dev/shm privately")
    worker = tmp_path / "subgroups.py"  # (a file: spawned ranks import their function)
    worker.write_text(_SUBGROUPS_UNTIL_FULL)
    script = f"mount -t tmpfs -o size=24m tmpfs /dev/shm && exec {sys.executable} {worker}"
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    for rank, (groups, took, said) in enumerate(json.loads(proc.stdout.splitlines()[-1])):
        # The first two fit; the others run over the transport, on both ranks alike.
        assert groups == [[True, [3.0] * 4]] * 2 + [[False, [3.0] * 4]] * 2, (rank, groups)
        assert took < 15, (rank, took)  # (no rank waits for the group's timeout of 30 s)
        assert len(said) == 2, (rank, said)
        for text in said:
            assert re.fullmatch(
                rf"<ProcessGroup rank={rank}/2 .*>: no shared-memory workspace, its "
                r"collectives run over the transport: group rank 0: cannot reserve \d+ bytes "
                r"of shared memory in /dev/shm .*",
                text,
            ), text
