"""The blocking facade's loop thread and stores (aiodist.sync)."""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import subprocess
import sys
import textwrap
import threading
from datetime import timedelta
from pathlib import Path

import pytest

import aiodist
import aiodist.sync as dist
from aiodist.sync._loop_thread import HandOverLoop, loop_thread as _loop_thread, run as _run
from aiodist.testing import check_sync_store, free_port

_counter = itertools.count()


def test_sync_hash_store_conformance() -> None:
    check_sync_store(dist.HashStore)


def test_sync_file_store_conformance(tmp_path: Path) -> None:
    check_sync_store(lambda: dist.FileStore(tmp_path / f"f{next(_counter)}"))


def test_sync_tcp_store_conformance() -> None:
    check_sync_store(lambda: dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=10))


def test_sync_prefix_store_conformance() -> None:
    base = dist.HashStore()
    check_sync_store(lambda: dist.PrefixStore(f"p{next(_counter)}", base))
    base.close()


def test_torch_style_tcp_store_usage() -> None:
    # The torch.distributed documentation's TCPStore listing, with this import; the master
    # waits in its constructor until the client has joined, so it is built in a thread.
    port = free_port()
    made: list[dist.TCPStore] = []
    maker = threading.Thread(
        target=lambda: made.append(dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30)))
    )
    maker.start()
    client = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=30))
    maker.join(30)
    (server,) = made
    server.set("first_key", "first_value")
    assert client.get("first_key") == b"first_value"
    assert server.add("counter", 5) == 5 and client.add("counter", 1) == 6
    client.wait(["first_key"], timedelta(seconds=1))
    with pytest.raises(aiodist.DistTimeoutError, match=r"'/?missing'"):
        client.wait(["missing"], timedelta(milliseconds=100))
    assert server.timeout == timedelta(seconds=30)
    assert (server.host, client.port) == ("127.0.0.1", server.port)
    assert repr(client).startswith("<TCPStore (blocking) <TCPStore 127.0.0.1:")
    client.close()
    server.close()
    server.close()  # harmless


def test_multi_tenant_masters_share_one_server() -> None:
    first = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True)
    second = dist.TCPStore("127.0.0.1", first.port, is_master=True, multi_tenant=True)
    second.set("k", b"v")
    assert first.get("k") == b"v"
    second.close()
    first.close()
    with pytest.raises(aiodist.DistUsageError, match="master_listen_fd"):
        dist.TCPStore("127.0.0.1", 0, is_master=True, master_listen_fd=3)


def test_prefix_store_over_a_blocking_store() -> None:
    base = dist.HashStore()
    nested = dist.PrefixStore("a", dist.PrefixStore("b", base))
    nested.set("k", b"1")
    assert base.get("b/a/k") == b"1"
    assert nested.list_keys() == ["k"]
    assert isinstance(nested.underlying_store, dist.PrefixStore)
    with pytest.raises(aiodist.DistUsageError, match=r"needs an aiodist\.sync store, got None"):
        dist.PrefixStore("p", None)  # type: ignore[arg-type]
    with pytest.raises(aiodist.DistUsageError, match="got HashStore"):
        dist.PrefixStore("p", aiodist.HashStore())  # type: ignore[arg-type]


def test_eight_threads_hammer_one_store() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=30)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(200):
                store.add("counter", 1)
                store.set(f"t{i}/{j}", str(j))
                assert store.get(f"t{i}/{j}") == str(j).encode()
        except BaseException as exc:
            errors.append(exc)

    # One thread also blocks in a wait the whole time: the others must keep going.
    waiter = threading.Thread(target=store.wait, args=(["done"],))
    waiter.start()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    store.set("done", b"")
    waiter.join(10)
    assert not errors and not waiter.is_alive()
    assert store.get("counter") == b"1600"
    assert store.num_keys() >= 1602
    store.close()


def test_one_loop_thread_that_callers_may_stand_in_for_and_no_policy_change() -> None:
    policy = type(asyncio.get_event_loop_policy())
    dist.HashStore().set("k", b"v")

    async def loop_type() -> type:
        return type(asyncio.get_running_loop())

    # By default the standard loop with a turn to hand over (uvloop has no hook for it).
    kind = _run(loop_type())
    assert kind is HandOverLoop and issubclass(kind, asyncio.SelectorEventLoop)
    assert type(asyncio.get_event_loop_policy()) is policy
    names = [t.name for t in threading.enumerate()]
    assert names.count("aiodist-loop") == 1


def test_blocking_call_on_the_loop_thread_is_refused() -> None:
    store = dist.HashStore()

    async def misuse() -> None:
        store.get("k")  # a blocking call from a coroutine on the loop thread

    with pytest.raises(aiodist.DistUsageError, match="on aiodist's event-loop thread"):
        _run(misuse())
    store.set("k", b"still usable")
    assert store.get("k") == b"still usable"


def test_run_timeout_cancels_the_coroutine() -> None:
    cancelled = threading.Event()

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            cancelled.set()

    with pytest.raises(aiodist.DistTimeoutError, match=r"did not finish within 0\.1 s"):
        _run(forever(), timeout=0.1)
    assert cancelled.wait(5)
    # A DistTimeoutError from the operation itself passes through unchanged.
    store = dist.HashStore()
    store.set_timeout(0.05)
    with pytest.raises(aiodist.DistTimeoutError, match="still missing: \\['nope'\\]"):
        store.get("nope")


def _python(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.multiprocess
def test_ctrl_c_cancels_a_blocking_call() -> None:
    result = _python(
        """
        import os, signal, threading, time
        import aiodist.sync as dist
        from aiodist.sync._loop_thread import run as _run

        store = dist.HashStore()
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        start = time.monotonic()
        try:
            store.get("never")
        except KeyboardInterrupt:
            print("interrupted after", round(time.monotonic() - start, 1))
        async def waiters():
            return store.async_store._state.waiter_count
        time.sleep(0.1)
        print("waiters left", _run(waiters()))
        store.set("k", b"v")
        print("usable", store.get("k"))
        """
    )
    assert result.returncode == 0, result.stderr
    assert "interrupted after 0.3" in result.stdout
    assert "waiters left 0" in result.stdout
    assert "usable b'v'" in result.stdout


@pytest.mark.multiprocess
def test_interpreter_exit_closes_stores_and_stops_the_thread(tmp_path: Path) -> None:
    path = tmp_path / "exit-file"
    result = _python(
        f"""
        import aiodist.sync as dist
        server = dist.TCPStore("127.0.0.1", 0, is_master=True)
        store = dist.FileStore({str(path)!r}, world_size=1)
        store.set("k", b"v")
        print(server.port)
        """
    )
    assert result.returncode == 0, result.stderr
    assert not path.exists()  # closed at exit: the only instance removed its file
    port = int(result.stdout)
    with socket.socket() as s:  # the server is gone
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_fork_child_gets_its_own_loop_thread() -> None:
    import multiprocessing

    dist.HashStore().set("k", b"v")  # the parent's loop thread is running
    ctx = multiprocessing.get_context("fork")
    queue = ctx.SimpleQueue()

    def child() -> None:
        store = dist.HashStore()
        store.set("x", b"child")
        queue.put(store.get("x"))

    with pytest.warns(DeprecationWarning) if sys.version_info >= (3, 12) else _nullcontext():
        proc = ctx.Process(target=child)
        proc.start()
    proc.join(30)
    assert proc.exitcode == 0 and queue.get() == b"child"


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


def test_stop_and_restart_loop_thread() -> None:
    store = dist.HashStore()
    store.set("k", b"v")
    first = _loop_thread._thread
    assert first is not None and first.is_alive()
    _loop_thread.stop()
    assert _loop_thread.ident is None
    first.join(5)
    assert not first.is_alive()
    fresh = dist.HashStore()  # a new loop thread starts on demand
    fresh.set("a", b"1")
    assert fresh.get("a") == b"1"
    assert _loop_thread._thread is not None and _loop_thread._thread is not first


@pytest.mark.multiprocess
def test_loop_kind_from_the_environment() -> None:
    code = """
import asyncio
import aiodist.sync as dist
from aiodist.sync._loop_thread import run as _run
async def kind():
    loop = type(asyncio.get_running_loop())
    return f"{loop.__module__}.{loop.__name__}"
dist.HashStore().set("k", b"v")
print(_run(kind()))
"""
    for kind, module in (
        ("asyncio", "aiodist.sync._loop_thread.HandOverLoop"),
        ("uvloop", "uvloop"),
    ):
        result = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "AIODIST_LOOP": kind},
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip().startswith(module)
