"""The shared-memory transport: message matching, every collective over it, peers that go."""

from __future__ import annotations

import asyncio
import functools
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
from collective_helpers import numpy_reduce, run_on, sample
from shm_helpers import leftovers, new_job, shm_world

import aiodist
from aiodist import collectives
from aiodist._arrays._fingerprint import fingerprint
from aiodist._arrays._reduce import ReduceOp
from aiodist.store import FileStore, HashStore
from aiodist.testing import start_world_processes
from aiodist.transport._mailbox import Mailbox
from aiodist.transport._shm_segment import SharedMemoryError, host_key, unavailable_reason
from aiodist.transport.base import OpComm, PeerDirectory, Transport
from aiodist.transport.routed import RoutedTransport
from aiodist.transport.shm import ShmTransport, find_local_ranks, plan_shared_memory
from aiodist.transport.tcp import TCPTransport

pytestmark = pytest.mark.both_loops  # the standard loop (asyncio.run, uvicorn) too

T = (0, 1, 0)


def mv(a: np.ndarray) -> memoryview:
    return memoryview(a).cast("B")


@pytest.fixture
def job() -> Any:
    key = new_job()
    yield key
    assert leftovers(key) == []


async def close_all(world: list[ShmTransport]) -> None:
    for t in world:
        await t.aclose()


async def test_send_before_and_after_the_receive_is_posted(job: str) -> None:
    t0, t1 = await shm_world(2, job)
    # Every name was unlinked once both ranks had mapped everything.
    assert leftovers(job) == []
    a = np.arange(10, dtype=np.float32)
    # Message first: staged, copied out when the receive is posted.
    await t0.send(1, T, mv(a))
    out = np.zeros(10, dtype=np.float32)
    assert await t1.recv_into(0, T, mv(out)) == 0
    np.testing.assert_array_equal(out, a)
    # Receive first: the bytes land straight in the receive's buffer.
    out2 = np.zeros(10, dtype=np.float32)
    fut = t0.recv_into(1, (0, 2, 0), mv(out2))
    assert not fut.done()
    await t1.send(0, (0, 2, 0), mv(a * 2))
    assert await fut == 1
    np.testing.assert_array_equal(out2, a * 2)
    # To itself: straight into the mailbox.
    await t0.send(0, T, mv(a))
    out3 = np.zeros(10, dtype=np.float32)
    assert await t0.recv_into(0, T, mv(out3)) == 0
    np.testing.assert_array_equal(out3, a)
    await close_all([t0, t1])


async def test_order_per_peer_and_tag_any_source_and_empty_messages(job: str) -> None:
    t0, t1, t2 = await shm_world(3, job)
    for i in range(5):
        await t1.send(0, (0, 0, i % 2), mv(np.full(4, i, dtype=np.int64)))
    outs = [np.zeros(4, dtype=np.int64) for _ in range(5)]
    futs = [t0.recv_into(1, (0, 0, 1), mv(o)) for o in outs[:2]]
    futs += [t0.recv_into(1, (0, 0, 0), mv(o)) for o in outs[2:]]
    await asyncio.gather(*futs)
    assert [int(o[0]) for o in outs] == [1, 3, 0, 2, 4]
    # Any source: the message staged first (arrival order), then whoever sends next.
    await t2.send(0, T, memoryview(b"two"))
    await asyncio.sleep(0.01)  # rank 0's doorbell rings; the message is staged
    await t1.send(0, T, memoryview(b"one"))
    await asyncio.sleep(0.01)
    box = bytearray(3)
    assert await t0.recv_into(None, T, memoryview(box)) == 2
    assert box == b"two"
    assert await t0.recv_into(None, T, memoryview(box)) == 1
    fut = t0.recv_into(None, T, memoryview(box))
    await t2.send(0, T, memoryview(b"xyz"))
    assert await fut == 2
    assert box == b"xyz"
    await t1.send(2, T, memoryview(b""))
    assert await t2.recv_into(1, T, memoryview(bytearray())) == 1
    await close_all([t0, t1, t2])


async def test_size_mismatch_names_sizes_tag_and_peer_and_the_stream_stays_in_sync(
    job: str,
) -> None:
    t0, t1 = await shm_world(2, job)
    fut = t1.recv_into(0, (3, 4, 5), memoryview(bytearray(8)))
    await t0.send(1, (3, 4, 5), memoryview(bytearray(12)))
    with pytest.raises(
        aiodist.DistUsageError,
        match=r"size mismatch on tag \(3, 4, 5\) from rank 0: the receive expects 8 bytes, "
        r"the message has 12 bytes",
    ):
        await fut
    await t0.send(1, T, memoryview(b"ok"))
    out = bytearray(2)
    await t1.recv_into(0, T, memoryview(out))
    assert out == b"ok"
    await close_all([t0, t1])


async def test_messages_larger_than_the_ring_stream_and_the_loop_keeps_ticking(job: str) -> None:
    # 64 KiB rings, 6 MiB messages both ways at once: ~100 ring-fulls each, copied in and
    # out concurrently, with other work running on the loop between pieces.
    t0, t1 = await shm_world(2, job, ring_bytes=64 << 10)
    rng = np.random.default_rng(0)
    a, b = rng.random(6 << 17), rng.random(6 << 17)
    ra, rb = np.zeros_like(a), np.zeros_like(b)
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    futs = [
        t1.recv_into(0, T, mv(ra)),
        t0.recv_into(1, T, mv(rb)),
        t0.send(1, T, mv(a)),
        t1.send(0, T, mv(b)),
    ]
    await asyncio.gather(*futs)
    stop.set()
    await tick
    np.testing.assert_array_equal(ra, a)
    np.testing.assert_array_equal(rb, b)
    print(f"largest loop stall while streaming 2 x 6 MiB: {max(gaps) * 1e3:.2f} ms")
    await close_all([t0, t1])


async def test_a_fingerprint_mismatch_reaches_the_handler_and_no_byte_lands(job: str) -> None:
    t0, t1 = await shm_world(2, job)
    seen: list[tuple[int, int, str]] = []

    class Listener:
        def on_mismatch(self, group: int, seq: int, exc: Exception) -> None:
            seen.append((group, seq, str(exc)))

        def on_reject(self, peer: int, group: int, seq: int, reason: str) -> None:
            raise AssertionError("no rejection here")

    t1.mailbox.listener = Listener()
    fp_sum = fingerprint("all_reduce", dtype=np.float32, shape=(4,), reduce_op=ReduceOp.SUM)
    fp_max = fingerprint("all_reduce", dtype=np.float32, shape=(4,), reduce_op=ReduceOp.MAX)
    t0.mailbox.begin(0, 7, fp_sum)
    t1.mailbox.begin(0, 7, fp_max)
    out = np.zeros(4, np.float32)
    fut = t1.recv_into(0, (0, 7, 0), mv(out))
    await t0.send(1, (0, 7, 0), mv(np.ones(4, np.float32)))
    await asyncio.sleep(0.05)
    assert seen and seen[0][:2] == (0, 7)
    assert "collective mismatch" in seen[0][2] and "op=SUM" in seen[0][2]
    assert not fut.done() and (out == 0).all()
    fut.cancel()
    await close_all([t0, t1])


async def _check_collectives(world: list[ShmTransport], size: int, seq: int) -> None:
    n = len(world)
    rng = np.random.default_rng(size)
    steps = iter(range(seq, seq + 100))

    async def run(fn: Any) -> list[Any]:
        return await run_on(world, fn, seq=next(steps))

    xs = [rng.integers(-9, 9, size).astype(np.float64) for _ in range(n)]
    ys = [x.copy() for x in xs]
    await run(lambda c: collectives.all_reduce(c, ys[c.rank], ReduceOp.SUM))
    for y in ys:
        np.testing.assert_array_equal(y, numpy_reduce(ReduceOp.SUM, xs))
    zs = [x.copy() for x in xs]
    await run(lambda c: collectives.reduce(c, zs[c.rank], n - 1, ReduceOp.MAX))
    np.testing.assert_array_equal(zs[n - 1], numpy_reduce(ReduceOp.MAX, xs))
    bs = [x.copy() for x in xs]
    await run(lambda c: collectives.broadcast(c, bs[c.rank], 0))
    for b in bs:
        np.testing.assert_array_equal(b, xs[0])
    outs = [[np.zeros(size) for _ in range(n)] for _ in range(n)]
    await run(lambda c: collectives.all_gather(c, outs[c.rank], xs[c.rank]))
    for o in outs:
        np.testing.assert_array_equal(np.stack(o), np.stack(xs))
    got = [np.zeros(size) for _ in range(n)]
    await run(lambda c: collectives.gather(c, got if c.rank == 0 else None, xs[c.rank], 0))
    np.testing.assert_array_equal(np.stack(got), np.stack(xs))
    into = [np.zeros(size) for _ in range(n)]
    await run(lambda c: collectives.scatter(c, into[c.rank], xs if c.rank == 0 else None, 0))
    np.testing.assert_array_equal(np.stack(into), np.stack(xs))
    ins = [[rng.integers(-9, 9, size).astype(np.float64) for _ in range(n)] for _ in range(n)]
    res = [np.zeros(size) for _ in range(n)]
    await run(lambda c: collectives.reduce_scatter(c, res[c.rank], ins[c.rank], ReduceOp.SUM))
    for j in range(n):
        np.testing.assert_array_equal(res[j], sum(ins[r][j] for r in range(n)))
    a2a = [[np.zeros(size) for _ in range(n)] for _ in range(n)]
    await run(lambda c: collectives.all_to_all(c, a2a[c.rank], ins[c.rank]))
    for r in range(n):
        for j in range(n):
            np.testing.assert_array_equal(a2a[r][j], ins[j][r])
    await run(lambda c: collectives.barrier(c))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
async def test_every_collective_over_shared_memory_matches_numpy(n: int, job: str) -> None:
    world = await shm_world(n, job)
    # 70_000 x 8 bytes: the chunked, pipelined algorithms with ready signals.
    for i, size in enumerate((0, 3, 70_000)):
        await _check_collectives(world, size, 100 * i)
    await close_all(world)


async def test_closing_in_order_versus_aborting(job: str) -> None:
    t0, t1, t2 = await shm_world(3, job)
    # Sent before closing: still delivered after the sender is gone.
    await t0.send(1, T, memoryview(b"last"))
    any_source = t1.recv_into(None, (0, 9, 0), memoryview(bytearray(1)))
    from_0 = t1.recv_into(0, (0, 8, 0), memoryview(bytearray(1)))
    await t0.aclose()
    with pytest.raises(aiodist.DistNetworkError, match="lost connection to rank 0: it closed"):
        await from_0
    box = bytearray(4)
    assert await t1.recv_into(0, T, memoryview(box)) == 0
    assert box == b"last"
    with pytest.raises(aiodist.DistNetworkError, match="rank 0"):
        await t1.send(0, T, memoryview(b"x"))
    # An orderly close leaves any-source receives waiting for the others.
    await asyncio.sleep(0.01)
    assert not any_source.done()
    t2.abort(aiodist.DistNetworkError("boom"))
    with pytest.raises(
        aiodist.DistNetworkError,
        match="lost connection to rank 2: it aborted: DistNetworkError: boom",
    ):
        await any_source
    with pytest.raises(aiodist.DistNetworkError, match="boom"):
        await t2.recv_into(1, T, memoryview(bytearray(1)))
    await close_all([t1, t2])
    # Closing twice is harmless; later calls fail at once.
    await t1.aclose()
    with pytest.raises(aiodist.DistNetworkError, match="closed"):
        await t1.recv_into(2, T, memoryview(bytearray(1)))


async def test_bad_arguments_are_usage_errors(job: str) -> None:
    store = HashStore()
    with pytest.raises(aiodist.DistUsageError, match="must include this rank"):
        await ShmTransport.create(store, 0, 4, [1, 2], job_key=job)
    with pytest.raises(aiodist.DistUsageError, match="ring_bytes must be a power of two"):
        await ShmTransport.create(store, 0, 2, ring_bytes=5000, job_key=job)
    with pytest.raises(aiodist.DistUsageError, match=r"local_ranks must be ranks in \[0, 2\)"):
        await ShmTransport.create(store, 0, 2, [0, 7], job_key=job)
    with pytest.raises(aiodist.DistUsageError, match="the mailbox belongs to rank 1"):
        await ShmTransport.create(store, 0, 2, mailbox=Mailbox(1, 2), job_key=job)
    t0, t1, t2 = await asyncio.gather(
        *(ShmTransport.create(store, r, 4, [0, 1, 2], job_key=job, timeout=10) for r in range(3))
    )
    with pytest.raises(
        aiodist.DistUsageError, match=r"rank 3 is not served .*local ranks \[0, 1, 2\]"
    ):
        t0.send(3, T, memoryview(b"x"))
    with pytest.raises(aiodist.DistUsageError, match=r"peer must be a rank in \[0, 4\)"):
        t0.recv_into(4, T, memoryview(bytearray(1)))
    with pytest.raises(aiodist.DistUsageError, match="a tag must be three integers"):
        t0.send(1, (0, -1, 0), memoryview(b"x"))
    with pytest.raises(aiodist.DistUsageError, match="read-only"):
        t0.recv_into(1, T, memoryview(b"x"))
    await close_all([t0, t1, t2])


async def test_a_peer_on_another_host_is_refused_by_name(job: str) -> None:
    store = HashStore()
    # Rank 1's record as a rank on another machine would publish it.
    await store.set(
        "shm/t/1",
        '{"v": 1, "host": "another-host", "pid": 1, "start": 1, "seg": "", "size": 0, '
        '"bell": "", "ring": 65536, "ranks": [0, 1]}',
    )
    with pytest.raises(
        aiodist.DistUsageError,
        match="rank 1 cannot share memory with rank 0: it is on another host",
    ):
        await ShmTransport.create(store, 0, 2, ring_bytes=65536, job_key=job, timeout=5)


async def test_a_rank_that_never_comes_is_named_at_the_deadline(job: str) -> None:
    with pytest.raises(aiodist.DistTimeoutError, match=r"ranks \[1\] did not arrive"):
        await ShmTransport.create(HashStore(), 0, 2, job_key=job, timeout=0.3)


async def test_disabled_or_unsupported_shared_memory_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AIODIST_SHM", "0")
    assert unavailable_reason() == "shared memory is disabled by AIODIST_SHM=0"
    with pytest.raises(SharedMemoryError, match="disabled by AIODIST_SHM=0"):
        await ShmTransport.create(HashStore(), 0, 2)
    monkeypatch.delenv("AIODIST_SHM")
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    reason = unavailable_reason()
    assert reason is not None and "total store order" in reason and "aarch64" in reason


async def test_find_local_ranks() -> None:
    store = HashStore()
    other = "another-boot/another-host/net:1/pid:1/shm:1:1"
    got = await asyncio.gather(
        *(find_local_ranks(store, r, 3, timeout=5) for r in (0, 1)),
        plan_shared_memory(store, 2, 3, timeout=5, host=other),
    )
    assert got == [[0, 1], [0, 1], ([2], None)]


async def test_one_rank_without_shared_memory_turns_it_off_for_its_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = HashStore()
    reasons = iter([None, "shared memory is disabled by AIODIST_SHM=0", None])
    monkeypatch.setattr("aiodist.transport.shm.unavailable_reason", lambda: next(reasons))
    got = await asyncio.gather(*(plan_shared_memory(store, r, 3, timeout=5) for r in range(3)))
    why = "rank 1: shared memory is disabled by AIODIST_SHM=0"
    assert got == [([0, 1, 2], why)] * 3


def test_host_key_is_boot_id_host_name_and_namespaces() -> None:
    key = host_key()
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert key.startswith(f.read().strip() + "/")
    assert f"net:{os.stat('/proc/self/ns/net').st_ino}" in key
    assert f"pid:{os.stat('/proc/self/ns/pid').st_ino}" in key


@pytest.mark.netns
def test_another_network_namespace_is_another_host() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root for unshare")
    code = "from aiodist.transport._shm_segment import host_key; print(host_key())"
    out = subprocess.run(
        ["unshare", "-n", sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out and out != host_key()
    assert out.split("/")[:2] == host_key().split("/")[:2]  # same boot, same host name


async def test_one_mailbox_shared_with_a_tcp_transport_routes_per_peer(job: str) -> None:
    # Ranks 0 and 1 share memory; rank 2 is reached over TCP by both. Both transports of
    # a rank deliver into one mailbox, so any-source receives and fingerprints span both.
    store = HashStore()
    n = 3

    async def make(rank: int) -> Transport:
        mailbox = Mailbox(rank, n)
        tcp = await TCPTransport.create(
            PeerDirectory(store), rank, n, timeout=10, spin=0, mailbox=mailbox
        )
        if rank == 2:
            return tcp
        shm = await ShmTransport.create(store, rank, n, [0, 1], mailbox=mailbox, job_key=job)
        return RoutedTransport(tcp, shm)

    world = list(await asyncio.gather(*(make(r) for r in range(n))))
    xs = [np.full(50_000, r + 1.0) for r in range(n)]
    await run_on(world, lambda c: collectives.all_reduce(c, xs[c.rank], ReduceOp.SUM))
    for x in xs:
        assert (x == 6.0).all()
    # Any source on rank 0: one message over shared memory, one over TCP.
    await world[1].send(0, T, memoryview(b"s"))
    await world[2].send(0, T, memoryview(b"t"))
    got = set()
    for _ in range(2):
        box = bytearray(1)
        sender = await world[0].recv_into(None, T, memoryview(box))
        got.add((sender, bytes(box)))
    assert got == {(1, b"s"), (2, b"t")}
    for t in world:
        await t.aclose()


# -- real processes -----------------------------------------------------------------------


async def _battery(path: str, job: str, spin: float | None, rank: int, n: int) -> float:
    """Messages and collectives between processes; returns the largest value checked."""
    # 64 KiB rings: the 3 MiB messages below wait for room ~50 times (want flag, doorbell).
    t = await ShmTransport.create(
        FileStore(path), rank, n, timeout=30, job_key=job, spin=spin, ring_bytes=64 << 10
    )
    world = list(range(n))
    try:
        # A ring of messages of growing size, past the ring's capacity.
        for size in (1, 1000, 3 << 20):
            data = np.full(size, rank, np.uint8)
            box = np.zeros(size, np.uint8)
            recv = t.recv_into((rank - 1) % n, (1, size, 0), mv(box))
            await t.send((rank + 1) % n, (1, size, 0), mv(data))
            await recv
            assert (box == (rank - 1) % n).all()
        for seq, size in enumerate((1, 4096, 300_000)):
            for op in (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.AVG):
                xs = [sample(np.dtype(np.float64), (size,), r, op) for r in world]
                x = xs[rank].copy()
                comm = OpComm(t, world, rank, 1, seq * 10 + int(op))
                await collectives.all_reduce(comm, x, op)
                np.testing.assert_array_equal(x, numpy_reduce(op, xs))
        outs = [np.zeros(1000) for _ in world]
        await collectives.all_gather(OpComm(t, world, rank, 2, 0), outs, np.full(1000, rank * 1.0))
        assert [o[0] for o in outs] == [float(r) for r in world]
        return float(np.max(outs))
    finally:
        await t.aclose()


@pytest.mark.multiprocess
@pytest.mark.parametrize(("n", "spin"), [(2, None), (4, None), (3, 0.0)])
def test_processes_exchange_messages_and_run_collectives(
    n: int, spin: float | None, job: str, tmp_path: Any
) -> None:
    # n=4 on this machine's CPUs and spin=0 are the oversubscribed, doorbell-only paths.
    battery = functools.partial(_battery, str(tmp_path / "store"), job, spin)
    with start_world_processes(battery, n, timeout=90, init_group=False) as world:
        results = world.results()
    assert results == [float(n - 1)] * n


async def _wait_for_lost_peer(path: str, job: str, rank: int, n: int) -> Any:
    store = FileStore(path)
    t = await ShmTransport.create(store, rank, n, timeout=30, job_key=job)
    if rank == 0:
        await t.send(1, T, memoryview(b"before"))
        await store.set("sent", "1")
        await asyncio.sleep(60)  # killed here
        return None
    box = bytearray(6)
    await t.recv_into(0, T, memoryview(box))
    pending = t.recv_into(0, (0, 2, 0), memoryview(bytearray(1)))
    any_source = t.recv_into(None, (0, 3, 0), memoryview(bytearray(1)))
    await store.set("waiting", "1")
    try:
        await pending
    except aiodist.DistNetworkError as exc:
        failed_at = time.time()
        msg = str(exc)
    else:
        raise AssertionError("the receive from the killed rank completed")
    with pytest.raises(aiodist.DistNetworkError):
        await any_source
    await t.aclose()
    return bytes(box), msg, failed_at


@pytest.mark.multiprocess
async def test_a_killed_peer_fails_its_receives_at_once(job: str, tmp_path: Any) -> None:
    path = str(tmp_path / "store")
    rank_main = functools.partial(_wait_for_lost_peer, path, job)
    with start_world_processes(rank_main, 2, timeout=60, init_group=False) as world:
        await FileStore(path).wait(["waiting"], timeout=30)
        killed_at = time.time()
        world.procs[0].kill()
        [(box, msg, failed_at)] = await asyncio.to_thread(world.results, timeout=30, ranks=[1])
    assert box == b"before"  # sent before the death: still delivered
    assert msg.startswith("lost connection to rank 0: its process (pid ")
    assert msg.endswith(") exited")
    assert failed_at - killed_at < 2.0


async def test_a_sender_waiting_for_room_is_woken_whenever_the_receiver_frees_it(
    job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiodist.transport import _shm_link as shm_module

    t0, t1 = await shm_world(2, job, ring_bytes=1 << 16, spin=0)
    try:
        link = t0._by_peer[1]  # rank 0 -> rank 1
        rx = t1._by_peer[0]
        payload = np.arange(1 << 16, dtype=np.uint8)
        out = np.zeros_like(payload)
        # Fill the ring: the sender waits for room, and says so.
        sent = t0.send(1, (0, 0, 0), memoryview(payload))
        assert link.queue and link.want
        # A pass with no budget left learns nothing and must not clear the flag.
        assert link.tx(0) == 0 and link.want
        # The receiver frees room exactly between the sender's last look at the ring and
        # its store of the flag (here: inside the barrier that follows the store). The
        # sender must see that room itself, since the receiver saw no flag to ring for.
        link.want = False
        link.tx_words[link.tx_want_w] = 0
        fences = 0
        real_fence = shm_module.fence

        def receiver_frees_room_in_the_barrier() -> None:
            nonlocal fences
            fences += 1
            if fences == 1:
                rx.rx(1 << 15)
            real_fence()

        monkeypatch.setattr(shm_module, "fence", receiver_frees_room_in_the_barrier)
        head = link.head
        link.tx(1 << 20)
        assert link.head > head, "the sender slept on a ring with room"
        monkeypatch.setattr(shm_module, "fence", real_fence)
        got = t1.recv_into(0, (0, 0, 0), memoryview(out))
        await asyncio.wait_for(asyncio.gather(sent, got), 5)
        np.testing.assert_array_equal(out, payload)
    finally:
        await asyncio.gather(t0.aclose(), t1.aclose())
