"""Injected faults: a rank killed mid all_reduce, a cut connection, a killed store, a straggler.

Each test injects a real fault (SIGKILL of a rank process, closing the sockets of a TCP proxy
the ranks talk through, SIGKILL of the store's process, a rank that never calls the op) and
checks that every surviving rank raises the right error naming the cause, that later calls
raise at once, and that destroy + init give a working group again. Time-to-error is only
bounded generously (no hang); ``bench/faults.py`` measures it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aiodist
from aiodist.errors import DistNetworkError, DistTimeoutError
from aiodist.store import HashStore, TCPStore

WORKER = Path(__file__).with_name("fault_worker.py")
HOST = "127.0.0.1"
#: Generous bound on time-to-error: proves "no hang", not speed (bench/faults.py measures).
NO_HANG = 10.0


class Rank:
    """One worker process of a scenario and the events it printed."""

    def __init__(self, rank: int, proc: asyncio.subprocess.Process) -> None:
        self.rank = rank
        self.proc = proc
        self.events: list[dict[str, Any]] = []
        self.stderr = b""
        self._reader = asyncio.get_running_loop().create_task(self._read())

    def __repr__(self) -> str:
        return f"<Rank {self.rank} pid={self.proc.pid} events={[e['event'] for e in self.events]}>"

    async def _read(self) -> None:
        assert self.proc.stdout is not None and self.proc.stderr is not None
        err = asyncio.get_running_loop().create_task(self.proc.stderr.read())
        async for line in self.proc.stdout:
            self.events.append(json.loads(line))
        self.stderr = await err

    async def event(self, name: str, timeout: float = 30.0) -> dict[str, Any]:
        """Wait for the first event called ``name``."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for e in self.events:
                if e["event"] == name:
                    return e
            if self._reader.done():
                break
            await asyncio.sleep(0.01)
        raise AssertionError(f"rank {self.rank}: no {name!r} event: {self.events} {self.stderr!r}")

    async def finish(self) -> None:
        """Kill the process if it still runs and collect its output."""
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()
        await self._reader


async def spawn(
    lib: str, mode: str, rank: int, world: int, port: int, timeout: float = 30.0
) -> Rank:
    """Start one worker of ``tests/fault_worker.py``."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(WORKER),
        lib,
        mode,
        str(rank),
        str(world),
        HOST,
        str(port),
        str(timeout),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    return Rank(rank, proc)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3, 4])
async def test_sigkill_mid_all_reduce(world: int) -> None:
    """Every survivor of a SIGKILLed rank raises DistNetworkError naming it, then fails fast."""
    store = await TCPStore.create(HOST, 0, is_master=True, wait_for_workers=False)
    ranks = [await spawn("aiodist", "loop", r, world, store.port) for r in range(world)]
    victim = 1
    try:
        for r in ranks:
            await r.event("looping")
        killed = time.time()
        ranks[victim].proc.send_signal(signal.SIGKILL)
        for r in ranks:
            if r.rank == victim:
                continue
            err = await r.event("error", NO_HANG + 5)
            assert err["type"] == "DistNetworkError", err
            # Over TCP a survivor sees the connection drop; over shared memory it hears of
            # the death from the store, whose connection to the victim dropped.
            named = rf"lost connection to rank {victim}\b|\brank {victim} is gone"
            assert re.search(named, err["msg"]), err
            assert err["t"] - killed < NO_HANG, err
            await r.event("exit")
    finally:
        for r in ranks:
            await r.finish()
        await store.aclose()


@pytest.mark.multiprocess
async def test_store_killed() -> None:
    """Ranks waiting on the store get DistNetworkError when its process dies; the group too."""
    server = await spawn("aiodist", "store", 0, 2, 0)
    try:
        port = (await server.event("store"))["port"]
        ranks = [await spawn("aiodist", "storewait", r, 2, port) for r in range(2)]
        for r in ranks:
            await r.event("ready")
        await asyncio.sleep(0.2)  # let both park their wait on the server
        killed = time.time()
        server.proc.send_signal(signal.SIGKILL)
        for r in ranks:
            err = await r.event("error", NO_HANG + 5)
            assert err["type"] == "DistNetworkError", err
            assert err["t"] - killed < NO_HANG, err
            later = await r.event("later")
            assert later["type"] == "DistNetworkError", later
            assert "lost the store" in later["msg"], later
        for r in ranks:
            await r.finish()
    finally:
        await server.finish()


@pytest.mark.multiprocess
@pytest.mark.parametrize("lib", ["aiodist", "aiodist-sync"])
async def test_straggler_then_recover_processes(lib: str) -> None:
    """A straggler makes the others time out naming it; destroy + init work again."""
    world, timeout = 3, 2.0
    store = await TCPStore.create(HOST, 0, is_master=True, wait_for_workers=False)
    ranks = [await spawn(lib, "recover", r, world, store.port, timeout) for r in range(world)]
    try:
        for r in ranks[:-1]:
            err = await r.event("error", timeout + NO_HANG)
            assert err["type"] in ("DistTimeoutError", "DistNetworkError"), err
            assert "all_reduce (seq 0)" in err["msg"], err
            assert f"ranks that did not arrive: [{world - 1}]" in err["msg"], err
        straggler = await ranks[-1].event("error", timeout + NO_HANG)
        assert straggler["type"] == "DistNetworkError", straggler
        assert "DistTimeoutError" in straggler["msg"], straggler
        for r in ranks:
            done = await r.event("recovered", 30)
            assert done["value"] == world * (world + 1) / 2
    finally:
        for r in ranks:
            await r.finish()
        await store.aclose()


async def _relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.transport.abort()


class Proxy:
    """A TCP relay the test controls: ``cut()`` resets every connection through it."""

    def __init__(self) -> None:
        self.target: tuple[str, int] | None = None
        self.writers: list[asyncio.StreamWriter] = []
        self.relays: set[asyncio.Task[None]] = set()
        self.server: asyncio.Server | None = None

    def __repr__(self) -> str:
        return f"<Proxy to {self.target} connections={len(self.writers) // 2}>"

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._accept, HOST, 0)
        port: int = self.server.sockets[0].getsockname()[1]
        return port

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self.target is not None
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self.writers += [writer, up_writer]
        for a, b in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.get_running_loop().create_task(_relay(a, b))
            self.relays.add(task)
            task.add_done_callback(self.relays.discard)

    def cut(self) -> None:
        for w in self.writers:
            w.transport.abort()

    async def close(self) -> None:
        self.cut()
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()
        await asyncio.gather(*self.relays, return_exceptions=True)


class ProxiedStore(HashStore):
    """A store that publishes the proxy's address in place of ``rank``'s transport address."""

    def __init__(self, proxy: Proxy, proxy_port: int, rank: int) -> None:
        super().__init__()
        self.proxy, self.proxy_port, self.rank = proxy, proxy_port, rank

    async def set(self, key: str, value: str | bytes) -> None:
        if key.endswith(f"transport/tcp/{self.rank}"):
            real = value.decode() if isinstance(value, bytes) else value
            host, _, port = real.rpartition(":")
            self.proxy.target = (host, int(port))
            value = f"{HOST}:{self.proxy_port}"
        await super().set(key, value)


async def test_connection_cut_through_proxy() -> None:
    """Cutting rank 0 <-> rank 1 mid all_reduce fails all three ranks, naming a lost rank."""
    proxy = Proxy()
    store = ProxiedStore(proxy, await proxy.start(), rank=1)
    looping = [asyncio.Event() for _ in range(3)]

    async def rank_main(rank: int) -> BaseException | None:
        aiodist.group.isolate_context()  # ranks as tasks of one process
        # Over TCP: the proxy cuts a TCP connection (shared memory would bypass it).
        await aiodist.init_process_group(
            "cpu", store=store, rank=rank, world_size=3, timeout=30, shared_memory=False
        )
        x = np.ones(1024, np.float32)
        try:
            n = 0
            while True:
                await aiodist.all_reduce(x)
                n += 1
                if n == 3:
                    looping[rank].set()
        except DistNetworkError as exc:
            with pytest.raises(DistNetworkError, match="unusable after an earlier failure"):
                aiodist.all_reduce(x)
            return exc
        finally:
            await aiodist.destroy_process_group()

    tasks = [asyncio.create_task(rank_main(r)) for r in range(3)]
    try:
        for e in looping:
            await asyncio.wait_for(e.wait(), 30)
        assert proxy.writers, "rank 0 should reach rank 1 through the proxy"
        cut = time.monotonic()
        proxy.cut()
        errors = await asyncio.wait_for(asyncio.gather(*tasks), NO_HANG)
        assert time.monotonic() - cut < NO_HANG
    finally:
        await proxy.close()
    assert re.search(r"lost connection to rank 1", str(errors[0])), errors[0]
    assert re.search(r"lost connection to rank 0", str(errors[1])), errors[1]
    assert re.search(r"lost connection to rank [01]", str(errors[2])), errors[2]


@pytest.mark.both_loops
async def test_straggler_in_process_and_recover() -> None:
    """Ranks as tasks: the others time out naming the straggler, op and seq; then recover."""
    store = HashStore()
    timeout = 1.0

    async def rank_main(rank: int) -> tuple[BaseException, float]:
        aiodist.group.isolate_context()  # ranks as tasks of one process
        await aiodist.init_process_group(
            "cpu", store=store, rank=rank, world_size=3, timeout=timeout
        )
        x = np.ones(16, np.float32)
        await aiodist.all_reduce(x)  # seq 0 completes
        start = time.monotonic()
        try:
            if rank == 2:
                await asyncio.sleep(timeout + 2.5)
            await aiodist.all_reduce(x)
            raise AssertionError("the straggler's all_reduce should fail")
        except (DistTimeoutError, DistNetworkError) as exc:
            err = exc
        waited = time.monotonic() - start
        await aiodist.destroy_process_group()
        await aiodist.init_process_group("cpu", store=store, rank=rank, world_size=3)
        y = np.full(4, rank + 1.0, np.float32)
        await aiodist.all_reduce(y)
        np.testing.assert_array_equal(y, np.full(4, 6.0, np.float32))
        await aiodist.destroy_process_group()
        return err, waited

    results = await asyncio.wait_for(asyncio.gather(*(rank_main(r) for r in range(3))), 30)
    for rank in (0, 1):
        err, waited = results[rank]
        assert isinstance(err, DistTimeoutError), err
        assert re.search(r"all_reduce \(seq 1\) .* group timeout of 1 s", str(err)), err
        assert "ranks that did not arrive: [2]" in str(err), err
        assert waited < timeout + NO_HANG
    err, _ = results[2]
    assert isinstance(err, DistNetworkError), err
    # The straggler names the first cause, through the store or its peer's abort message.
    assert re.search(r"rank [01]\b.*DistTimeoutError: all_reduce \(seq 1\)", str(err)), err


async def test_wait_timeout_names_awaited_ranks() -> None:
    """Work.wait(timeout) names the op, its seq and the ranks whose messages were awaited."""
    store = HashStore()

    async def rank_main(rank: int) -> BaseException | None:
        aiodist.group.isolate_context()  # ranks as tasks of one process
        await aiodist.init_process_group("cpu", store=store, rank=rank, world_size=2)
        try:
            if rank == 1:
                await asyncio.sleep(1.0)
                return None
            with pytest.raises(DistTimeoutError) as info:
                await aiodist.all_reduce(np.ones(4, np.float32)).wait(0.3)
            return info.value
        finally:
            await aiodist.destroy_process_group()

    err, _ = await asyncio.wait_for(asyncio.gather(rank_main(0), rank_main(1)), 20)
    assert re.search(
        r"all_reduce \(seq 0\) .* wait timeout of 0\.3 s; still waiting for messages from "
        r"ranks \[1\]",
        str(err),
    ), err


@pytest.mark.multiprocess
async def test_a_rank_that_aborts_in_the_middle_of_a_message_is_named_with_its_reason() -> None:
    """Rank 0 aborts while part of a large message to rank 1 is on the wire. Its reason
    cannot follow part of a frame, so the connection just ends; and the store, stopped
    meanwhile (SIGSTOP), cannot tell rank 1 of the abort first. Rank 1 still reports that
    rank 0 aborted, and why, once the store answers, rather than taking it for a death."""
    server = await spawn("aiodist", "store", 0, 2, 0)
    sent = asyncio.Event()
    big = np.arange(16 << 20, dtype=np.float32)  # 64 MiB: many writes

    async def rank_main(rank: int) -> str:
        aiodist.group.isolate_context()  # ranks as tasks of one process
        store = await TCPStore.create(HOST, port, timeout=30)
        await aiodist.init_process_group(
            "cpu", store=store, rank=rank, world_size=2, timeout=30, shared_memory=False
        )
        try:
            if rank == 0:
                await aiodist.send(np.ones(1, np.float32), 1)  # connected
                work = aiodist.isend(big, 1)
                await asyncio.sleep(0.002)  # part of the frame written
                server.proc.send_signal(signal.SIGSTOP)
                sent.set()
                aiodist.group.current_world().default_group.abort("rank 0 gives up")
                with pytest.raises(DistNetworkError):
                    await work.wait()
                return ""
            await aiodist.recv(np.empty(1, np.float32), 0)
            with pytest.raises(DistNetworkError) as info:
                await aiodist.recv(np.empty_like(big), 0)
            return str(info.value)
        finally:
            await aiodist.destroy_process_group()
            await store.aclose()

    async def resume_store() -> None:
        await sent.wait()
        await asyncio.sleep(0.1)  # rank 1 has seen the connection end
        server.proc.send_signal(signal.SIGCONT)

    try:
        port = (await server.event("store"))["port"]
        resuming = asyncio.create_task(resume_store())
        _, message = await asyncio.wait_for(asyncio.gather(rank_main(0), rank_main(1)), NO_HANG)
        await resuming
    finally:
        server.proc.send_signal(signal.SIGCONT)
        await server.finish()
    assert message == (
        "lost connection to rank 0: it aborted: rank 0: DistError: rank 0 gives up"
    ), message
