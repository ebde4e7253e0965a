"""Wire compatibility with torch's TCPStore, proven with real torch in separate processes.

torch's store calls can hold the GIL while they block, so torch always runs in a subprocess
while the aiodist side runs on this test's event loop.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
import textwrap

import pytest

import aiodist

pytestmark = [
    pytest.mark.torch,
    pytest.mark.multiprocess,
    pytest.mark.skipif(
        importlib.util.find_spec("torch") is None,
        reason="torch is not installed (pip install torch==2.13.0 to run the interop tests)",
    ),
]


async def _run(script: str, *args: str, env: dict[str, str] | None = None) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        textwrap.dedent(script),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 90)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, f"torch process failed:\n{err.decode()[-3000:]}"
    return out.decode()


_TORCH_CLIENT = """
    import sys
    from datetime import timedelta
    import torch.distributed as dist

    port = int(sys.argv[1])
    s = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=False,
                      timeout=timedelta(seconds=20))
    assert s.get("from_aiodist") == b"hello"
    s.set("from_torch", "t")
    assert s.add("cnt", 5) == 5 and s.add("cnt", 2) == 7
    s.wait(["from_aiodist"])
    try:
        s.wait(["never"], timedelta(milliseconds=200))
        raise AssertionError("wait did not time out")
    except dist.DistStoreError as exc:
        assert "never" in str(exc), exc
    assert s.get("from_aiodist") == b"hello"  # connection usable after the cancelled wait
    assert s.compare_set("cs", "", "v") == b"v"
    assert s.compare_set("cs", "v", "w") == b"w"
    assert s.compare_set("cs", "x", "y") == b"w"
    assert s.compare_set("cs_missing", "x", "y") == b"x"
    assert s.check(["from_aiodist", "cs"]) and not s.check(["cs_missing"])
    assert s.delete_key("del_me") and not s.delete_key("del_me")
    s.multi_set(["m1", "m2"], ["1", "2"])
    assert s.multi_get(["from_aiodist", "m1", "m2"]) == [b"hello", b"1", b"2"]
    s.append("app", "a")
    s.append("app", "b")
    assert s.get("app") == b"ab"
    s.queue_push("q", "first")
    s.queue_push("q", "second")
    assert s.queue_len("q") == 2 and s.queue_pop("q") == b"first"
    keys = s.list_keys()
    assert "from_aiodist" in keys and "from_torch" in keys and "init/" not in keys, keys
    print("num_keys", s.num_keys())
    s.barrier("torch_barrier", 2)  # the aiodist side counts in too
    s.set("ready", "1")
    assert s.get("late") == b"from aiodist after ready"  # blocks until aiodist sets it
    print("OK")
"""


async def test_torch_client_against_aiodist_server() -> None:
    async with await aiodist.TCPStoreServer().start("127.0.0.1", 0) as server:
        store = await aiodist.TCPStore.create("127.0.0.1", server.port, timeout=60)
        await store.set("from_aiodist", b"hello")
        await store.set("del_me", b"x")
        torch_side = asyncio.ensure_future(_run(_TORCH_CLIENT, str(server.port)))
        await store.barrier("torch_barrier", 2)
        await store.wait(["ready"])
        expected_keys = ["from_aiodist", "from_torch", "cnt", "cs", "m1", "m2", "app"]
        expected_keys += ["torch_barrier", "ready"]
        assert sorted(await store.list_keys()) == sorted(expected_keys)
        await store.set("late", b"from aiodist after ready")
        out = await torch_side
        assert out.splitlines() == [f"num_keys {len(expected_keys) - 1}", "OK"]
        assert await store.get("from_torch") == b"t"
        assert await store.get("cnt") == b"7"
        assert await store.queue_pop("q") == b"second"
        assert await store.multi_get(["m1", "m2", "app"]) == [b"1", b"2", b"ab"]
        await store.aclose()
        await asyncio.sleep(0.05)
        assert server.state.waiter_count == 0


_TORCH_SERVER = """
    import sys
    from datetime import timedelta
    import torch.distributed as dist

    s = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True,
                      timeout=timedelta(seconds=60))
    s.set("from_torch", "served by torch")
    print(s.port, flush=True)
    s.wait(["done"])
    assert s.get("from_aiodist") == b"hi", s.get("from_aiodist")
    assert s.get("counter") == b"12"
    assert s.get("appended") == b"xy"
    print("OK", flush=True)
"""


@pytest.mark.parametrize("wire", ["torch", "auto"])
async def test_aiodist_client_against_torch_server(wire: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        textwrap.dedent(_TORCH_SERVER),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        port = int(await asyncio.wait_for(proc.stdout.readline(), 60))
        store = await aiodist.TCPStore.create("127.0.0.1", port, wire=wire, timeout=10)  # type: ignore[arg-type]
        assert store.wire == "torch"
        other = await store.clone()
        assert await store.get("from_torch") == b"served by torch"
        await store.set("from_aiodist", "hi")
        assert await store.add("counter", 10) == 10
        assert await store.add("counter", 2) == 12
        assert await store.compare_set("cs", "", "v") == b"v"
        assert await store.compare_set("cs", "nope", "w") == b"v"
        assert await store.compare_set("missing", "e", "d") == b"e"
        assert await store.check(["from_torch", "cs"]) and not await store.check(["missing"])
        await store.set("del", b"1")
        assert await store.delete_key("del") and not await store.delete_key("del")
        await store.multi_set(["m1", "m2"], [b"1", b"2"])
        assert await store.multi_get(["m1", "m2"]) == [b"1", b"2"]
        await store.append("appended", b"x")
        await store.append("appended", b"y")
        keys = await store.list_keys()
        assert {"from_torch", "from_aiodist", "counter", "cs", "m1", "m2", "appended"} <= set(
            keys
        ), keys
        assert await store.num_keys() == len(keys)
        await store.queue_push("q", b"1")
        await store.queue_push("q", b"2")
        assert await store.queue_len("q") == 2
        assert [await store.queue_pop("q"), await store.queue_pop("q")] == [b"1", b"2"]
        with pytest.raises(aiodist.QueueEmptyError):
            await store.queue_pop("q", block=False)
        with pytest.raises(aiodist.DistTimeoutError, match=r"still missing: \['absent'\]"):
            await store.wait(["absent"], timeout=0.2)
        # torch's BARRIER: both clients count in at the same counter.
        await asyncio.gather(store.barrier("bar", 2), other.barrier("bar", 2))
        assert await store.get("bar") == b"2"
        with pytest.raises(
            aiodist.DistTimeoutError,
            match=r"store barrier 'lonely' timed out after \d+ ms: 1 of 2 arrived",
        ):
            await store.barrier("lonely", 2, timeout=0.2)
        assert await store.add("counter", 0) == 12  # the main connection is still in step
        # A wait woken by another client, while this client keeps working.
        waiter = asyncio.ensure_future(store.get("woken"))
        await asyncio.sleep(0.05)
        assert await store.add("counter", 0) == 12
        await other.set("woken", b"yes")
        assert await asyncio.wait_for(waiter, 5) == b"yes"
        await store.set("done", b"1")
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err.decode()[-3000:]
        assert out.decode().strip() == "OK"
        await other.aclose()
        await store.aclose()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


_GLOO_RANK = """
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    assert t.item() == 3.0, t
    objs = [None, None]
    dist.all_gather_object(objs, {"rank": rank})
    assert objs == [{"rank": 0}, {"rank": 1}], objs
    dist.barrier()
    dist.destroy_process_group()
    print("OK", rank)
"""


async def test_two_torch_ranks_init_process_group_on_the_aiodist_store() -> None:
    async with await aiodist.TCPStoreServer().start("127.0.0.1", 0) as server:
        base = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(server.port),
            "WORLD_SIZE": "2",
            # Every rank is a client of a store hosted elsewhere, as under torchrun.
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "GLOO_SOCKET_IFNAME": "lo",
        }
        outs = await asyncio.gather(
            *(_run(_GLOO_RANK, env={**base, "RANK": str(rank)}) for rank in range(2))
        )
        assert [o.strip() for o in outs] == ["OK 0", "OK 1"]
        assert server.state.get(b"init/") == b"2"
        assert any(k.startswith(b"/default_pg/") for k in server.state.list_keys())


_SAME_PROCESS = """
    import logging, sys, threading, time
    from datetime import timedelta

    class Keep(logging.Handler):  # printed at the end: the server thread logs meanwhile
        records = []

        def emit(self, record):
            self.records.append(record.getMessage())

    logging.getLogger("aiodist").addHandler(Keep(logging.WARNING))
    import aiodist.sync as ad
    import torch.distributed as dist

    server = ad.TCPStore("127.0.0.1", 0, is_master=True, timeout=30)
    c = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
    c.set("k", "v")
    assert c.get("k") == b"v" and c.add("n", 2) == 2 and c.check(["k"]) and c.num_keys() == 2
    # Waits that outlast the receive timeout are unaffected: torch polls before it reads.
    threading.Timer(1.5, lambda: server.set("late", b"1")).start()
    c.wait(["late"], timedelta(seconds=10))
    threading.Timer(1.5, lambda: server.barrier("b", 2)).start()
    c.barrier("b", 2, timedelta(seconds=10))
    print("waits ok", flush=True)
    start = time.monotonic()
    try:
        c.queue_len("q") if sys.argv[1] == "queue_len" else c.list_keys()
    except dist.DistNetworkError as exc:
        print("raised", str(exc).splitlines()[0], round(time.monotonic() - start), flush=True)
    try:
        c.get("k")
    except dist.DistNetworkError as exc:
        print("then", str(exc).splitlines()[0], flush=True)
    other = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=9))
    print("still serving", other.get("k"), flush=True)
    for message in Keep.records:
        print("LOG", message)
"""


@pytest.mark.parametrize("call", ["queue_len", "list_keys"])
async def test_torch_client_in_the_server_process_fails_instead_of_hanging(call: str) -> None:
    """torch's queue_len() and list_keys() hold the GIL while they block for the reply, so a
    server in the same process can never send it: the process used to hang for good."""
    out = await _run(_SAME_PROCESS, call, env={"AIODIST_PEER_TIMEOUT": "1"})
    lines = [line for line in out.splitlines() if not line.startswith("LOG")]
    assert lines[:2] == ["waits ok", "raised Socket Timeout 1"]
    # The client is closed: its next call sees EOF, or a reset if it had sent it already.
    assert lines[2] in (
        "then Failed to recv, got 0 bytes. Connection was likely closed. Did the remote "
        "server shutdown or crash?",
        "then Connection reset by peer",
    )
    assert lines[3:] == ["still serving b'v'"]
    logged = [line for line in out.splitlines() if line.startswith("LOG")]
    assert "keep the GIL while they wait for the reply" in logged[0]
    assert f"refusing {call.upper()} from a torch client in this process" in logged[1]
