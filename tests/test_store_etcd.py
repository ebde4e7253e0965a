"""EtcdStore against a real etcd: the conformance kit, fail-over between members, leases."""

from __future__ import annotations

import asyncio
import itertools
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from etcd_helpers import Member, etcd, etcd3, needs_etcd
from netns_helpers import Hosts

import aiodist
from aiodist.errors import DistNetworkError, DistUsageError
from aiodist.testing import check_store

pytestmark = needs_etcd

__all__ = ["etcd", "etcd3"]  # (the fixtures imported above, used by name)

_jobs = itertools.count()


@pytest.mark.both_loops
@pytest.mark.parametrize("prefixed", [False, True], ids=["etcd", "prefix-etcd"])
async def test_etcd_store_conformance(etcd: str, prefixed: bool) -> None:
    opened: list[aiodist.Store] = []

    async def make() -> aiodist.Store:
        store = await aiodist.EtcdStore.create(etcd, f"/conformance/{next(_jobs)}", timeout=10)
        if not prefixed:
            return store
        opened.append(store)
        return aiodist.PrefixStore("a", aiodist.PrefixStore("b", store))

    try:
        await check_store(make)
    finally:
        for store in opened:
            await store.aclose()


def test_etcd_sync_store_conformance(etcd: str) -> None:
    import aiodist.sync as dist
    from aiodist.testing import check_sync_store

    check_sync_store(lambda: dist.EtcdStore(etcd, f"/sync/{next(_jobs)}", timeout=10))


# -- the URL --------------------------------------------------------------------------------
async def test_etcd_url_gives_a_store_under_its_prefix(etcd: str) -> None:
    from aiodist.rendezvous import rendezvous

    store, rank, size = await rendezvous(f"etcd://{etcd}/jobs/url?rank=1&world_size=2")
    other, _, _ = await rendezvous(f"etcd://{etcd}/jobs/url", rank=0, world_size=2)
    elsewhere, _, _ = await rendezvous(f"etcd://{etcd}/jobs/other?rank=0&world_size=1")
    try:
        assert (type(store), rank, size) == (aiodist.EtcdStore, 1, 2)
        assert store.prefix == "/jobs/url/"
        await store.set("k", b"v")
        assert await other.get("k") == b"v"
        assert await elsewhere.check(["k"]) is False
    finally:
        for s in (store, other, elsewhere):
            await s.aclose()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("etcd:///p?rank=0&world_size=1", "expected etcd://host:port"),
        ("etcd://h:x/p?rank=0&world_size=1", "'h:x' has an invalid port"),
        ("etcd://h:1,/p?rank=0&world_size=1", "an empty entry"),
        ("etcd://h:1/p?world_size=1", "rank parameter missing"),
        ("etcd://h:1/p?rank=2&world_size=2", "rank 2 is out of range"),
    ],
)
async def test_etcd_url_errors(url: str, message: str) -> None:
    from aiodist.rendezvous import rendezvous

    with pytest.raises(DistUsageError, match="Error initializing aiodist using etcd://") as info:
        await rendezvous(url)
    assert message in str(info.value)


async def test_unreachable_etcd_is_a_network_error() -> None:
    from etcd_helpers import free_ports

    port = free_ports(1)[0]
    start = time.monotonic()
    with pytest.raises(DistNetworkError, match=rf"127.0.0.1:{port}.*could not be reached"):
        await aiodist.EtcdStore.create(f"127.0.0.1:{port}", "/x")
    assert time.monotonic() - start < 30


# -- fail-over ------------------------------------------------------------------------------
async def test_operations_go_on_when_an_etcd_member_dies(etcd3: list[Member]) -> None:
    endpoints = [m.endpoint for m in etcd3]
    store = await aiodist.EtcdStore.create(endpoints, "/failover", timeout=30)
    other = await aiodist.EtcdStore.create(list(reversed(endpoints)), "/failover", timeout=30)
    try:
        await store.set("before", b"1")
        assert await store.add("n", 1) == 1
        await store.queue_push("q", b"a")
        # A wait parked on the first member, which then dies: it resumes on another.
        getter = asyncio.ensure_future(store.get("late"))
        popper = asyncio.ensure_future(store.queue_pop("empty"))
        await asyncio.sleep(0.3)
        assert not getter.done()
        etcd3[0].kill()
        await other.set("late", b"here")
        await other.queue_push("empty", b"item")
        assert await asyncio.wait_for(getter, 20) == b"here"
        assert await asyncio.wait_for(popper, 20) == b"item"
        assert await store.get("before") == b"1"
        assert await store.add("n", 1) == 2
        assert await other.add("n", 1) == 3
        assert await store.queue_pop("q") == b"a"
        assert await store.compare_set("cs", b"", b"x") == b"x"
        # A new client whose first endpoint is the dead member starts on the next one.
        late = await aiodist.EtcdStore.create(endpoints, "/failover", timeout=30)
        try:
            assert await late.get("n") == b"3"
        finally:
            await late.aclose()
    finally:
        await store.aclose()
        await other.aclose()


@pytest.mark.netns
@pytest.mark.multiprocess
def test_a_job_that_loses_a_host_of_its_store_goes_on(hosts: Hosts, tmp_path: Path) -> None:
    # Two hosts: host 0 runs two etcd members and workers 0 and 1, host 1 the third member
    # and worker 2; every client of the store talks to host 1's member first. At step 10 host
    # 1's worker and member are killed: the survivors' store moves to host 0's members, they
    # go on without worker 2 (recover), and a replacement started on host 0 is admitted.

    from cluster_helpers import clean_env
    from etcd_helpers import etcd_cluster

    example = Path(__file__).resolve().parent.parent / "examples" / "elastic_sgd.py"
    placement = [0, 0, 1]  # the hosts of the members, and of the workers
    with etcd_cluster(
        tmp_path,
        3,
        hosts=[hosts.addresses[h] for h in placement],
        prefixes=[hosts.prefix(h) for h in placement],
    ) as members:
        endpoints = ",".join(m.endpoint for m in (members[2], members[0], members[1]))

        def start(rank: int, host: int, restarts: int) -> subprocess.Popen[str]:
            env = clean_env(
                RANK=str(rank),
                WORLD_SIZE="3",
                TORCHELASTIC_RESTART_COUNT=str(restarts),
                AIODIST_STORE_URL=f"etcd://{endpoints}/job",
                AIODIST_PEER_TIMEOUT="2",  # (the etcd lease's time to live)
            )
            command = [str(example), "--kill-rank=2", "--kill-step=10", "--wait-for-replacements"]
            return subprocess.Popen(
                [*hosts.prefix(host), sys.executable, *command],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )

        workers = [start(rank, placement[rank], 0) for rank in range(3)]
        try:
            # Worker 2 kills itself at step 10; its host's member goes at once with it.
            workers[2].wait(timeout=60)
            members[2].kill()
            assert workers[2].returncode == -signal.SIGKILL, workers[2].communicate()
            workers.append(start(2, 0, 1))  # its replacement, on the host that is left
            outs = [w.communicate(timeout=90) for w in (workers[0], workers[1], workers[3])]
        finally:
            for w in workers:
                w.kill()
                w.communicate()
    for proc, (out, err) in zip((workers[0], workers[1], workers[3]), outs, strict=True):
        assert proc.returncode == 0, out + err
    (out0, _), (out1, _), (out2, _) = outs
    for rank, out in ((0, out0), (1, out1)):
        assert re.search(
            rf"^worker {rank}: step 10 failed \(DistNetworkError\); ranks \[2\] lost; now "
            rf"rank {rank} of 2 after [\d.]+ ms$",
            out,
            re.M,
        ), out
        assert out.endswith(
            f"worker {rank}: done as rank {rank}; weights match the reference: True\n"
        ), out
    assert re.search(
        r"^replacement of worker 2: admitted as rank 2 of 3 at step 15, ", out2, re.M
    ), out2
    assert out2.endswith(
        "replacement of worker 2: done as rank 2; weights match the reference: True\n"
    ), out2


# -- leases ---------------------------------------------------------------------------------
@pytest.mark.multiprocess
async def test_a_lease_is_carried_out_when_its_holder_stops_renewing(etcd: str) -> None:
    import subprocess
    import sys

    holder = await asyncio.to_thread(
        subprocess.Popen,
        [
            sys.executable,
            "-c",
            "import asyncio, sys, aiodist\n"
            "async def main():\n"
            f"    s = await aiodist.EtcdStore.create({etcd!r}, '/leases', lease_ttl=2)\n"
            "    await s.lease('left/1', 'rank 1 is gone')\n"
            "    await s.lease('log', '1;', append=True)\n"
            "    await s.lease('withdrawn', 'never')\n"
            "    await s.lease('withdrawn', None)\n"
            "    print('ready', flush=True)\n"
            "    await asyncio.sleep(120)\n"
            "asyncio.run(main())\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    watcher = await aiodist.EtcdStore.create(etcd, "/leases", timeout=30, lease_ttl=2)
    try:
        assert holder.stdout is not None
        assert await asyncio.to_thread(holder.stdout.readline) == "ready\n"
        await watcher.lease("left/0", "rank 0 is gone")  # (a store with leases carries out others')
        await watcher.lease("log", "0;", append=True)
        await watcher.append("log", "start;")
        assert await watcher.check(["left/1"]) is False
        holder.kill()
        start = time.monotonic()
        assert await watcher.get("left/1") == b"rank 1 is gone"
        assert time.monotonic() - start < 10
        assert watcher.lease_lapse == 6.0  # (its lease's time to live, and 4 s)
        # (Each of its leases is carried out on its own: the log's may come moments later.)
        deadline = time.monotonic() + 5
        while await watcher.get("log") != b"start;1;" and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert await watcher.get("log") == b"start;1;"
        assert await watcher.check(["withdrawn", "left/0"]) is False
    finally:
        holder.kill()
        holder.communicate()
        await watcher.aclose()
    # Closing the store ends its leases too (as a TCPStore connection's end does).
    async with await aiodist.EtcdStore.create(etcd, "/leases", timeout=5) as reader:
        assert await reader.get("left/0") == b"rank 0 is gone"
        assert await reader.get("log") == b"start;1;0;"


@pytest.mark.multiprocess
def test_a_stopped_rank_is_gone_when_its_lease_lapses(etcd: str) -> None:
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from cluster_helpers import clean_env

    worker = str(Path(__file__).parent / "etcd_worker.py")
    url = f"etcd://{etcd}/lease-world"
    env = clean_env(AIODIST_PEER_TIMEOUT="2")
    ranks = [
        subprocess.Popen(
            [sys.executable, worker, "lease", url, str(r)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(2)
    ]
    try:
        for proc in ranks:
            assert proc.stdout is not None
            assert proc.stdout.readline() == "ready\n", proc.communicate(timeout=5)
        # Stopped, rank 1's process keeps its connections (its kernel answers for it), but
        # no longer renews its lease: only the lease can tell rank 0 that it is gone.
        os.kill(ranks[1].pid, signal.SIGSTOP)
        out, err = ranks[0].communicate(timeout=60)
        assert ranks[0].returncode == 0, err
        assert re.fullmatch(r"broken after (\S+) s: rank 1 is gone: .*\n", out), out
        assert float(out.split()[2]) < 10
    finally:
        for proc in ranks:
            proc.kill()
            proc.communicate()


# -- the launcher ---------------------------------------------------------------------------
@pytest.mark.multiprocess
def test_aiodist_run_with_the_store_in_etcd(etcd: str) -> None:
    import subprocess
    import sys
    from pathlib import Path

    from cluster_helpers import clean_env

    worker = str(Path(__file__).parent / "etcd_worker.py")
    run_id = f"launch{next(_jobs)}"
    common = [
        "--rdzv-backend=etcd",
        f"--rdzv-endpoint={etcd}",
        f"--rdzv-id={run_id}",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--monitor-interval=0.2",
    ]
    launchers = [
        subprocess.Popen(
            [sys.executable, "-m", "aiodist.run", *common, f"--node-rank={node}", worker, "job"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
        )
        for node in range(2)
    ]
    outs = []
    for proc in launchers:
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err
        outs.append(out)
    url = f"etcd://{etcd}/aiodist-run/{run_id}/"
    assert outs == [f"[rank{r}]: sum 3 store {url}\n" for r in range(2)]


@pytest.mark.multiprocess
async def test_the_leader_clears_the_jobs_keys(etcd: str) -> None:
    # (After test_aiodist_run_with_the_store_in_etcd's job, in a fresh cluster: a job that
    # ran leaves nothing behind, so its run id can be used again.)
    import subprocess
    import sys
    from pathlib import Path

    from cluster_helpers import clean_env

    worker = str(Path(__file__).parent / "etcd_worker.py")
    command = [
        sys.executable, "-m", "aiodist.run", "--rdzv-backend=etcd", f"--rdzv-endpoint={etcd}",
        "--rdzv-id=again", "--nproc-per-node=2", worker, "job",
    ]  # fmt: skip
    for _ in range(2):
        result = await asyncio.to_thread(
            subprocess.run, command, capture_output=True, text=True, timeout=90, env=clean_env()
        )
        assert result.returncode == 0, result.stderr
        assert sorted(result.stdout.splitlines())[0].startswith("[rank0]: sum 3 store etcd://")
    async with await aiodist.EtcdStore.create(etcd, "/aiodist-run/again/") as store:
        assert await store.list_keys() == []


async def test_a_write_whose_answer_was_lost_happens_once(etcd: str) -> None:
    # A proxy in front of etcd passes on the first write transaction of an add, lets etcd
    # apply it, then drops the connection before the answer: as if the member died just
    # after it took the request. The client sends it again to the next member (etcd itself).
    from etcd_helpers import free_ports

    host, port = etcd.rsplit(":", 1)
    dropped = asyncio.Event()

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: bool) -> None:
        try:
            while data := await reader.read(65536):
                if not up and dropped.is_set():
                    return  # the answer is lost
                if up and b"/v3/kv/txn" in data and b"request_put" in data and not dropped.is_set():
                    dropped.set()
                    writer.write(data)
                    await asyncio.sleep(0.3)  # (etcd applies it meanwhile)
                    return
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def relay(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        etcd_r, etcd_w = await asyncio.open_connection(host, int(port))
        up = asyncio.ensure_future(pipe(client_r, etcd_w, True))
        down = asyncio.ensure_future(pipe(etcd_r, client_w, False))
        await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
        for task in (up, down):
            task.cancel()
        await asyncio.gather(up, down, return_exceptions=True)
        client_w.close()
        etcd_w.close()

    proxy_port = free_ports(1)[0]
    proxy = await asyncio.start_server(relay, "127.0.0.1", proxy_port)
    store = await aiodist.EtcdStore.create([f"127.0.0.1:{proxy_port}", etcd], "/once")
    try:
        assert await store.add("n", 5) == 5
        assert dropped.is_set()
        assert await store.get("n") == b"5"
        assert await store.add("n", 1) == 6
    finally:
        await store.aclose()
        proxy.close()
        await proxy.wait_closed()
