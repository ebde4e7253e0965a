"""FileStore and PrefixStore beyond the conformance kit: file format, sharing, cleanup."""

from __future__ import annotations

import asyncio
import multiprocessing
import struct
from pathlib import Path

import pytest

import aiodist

pytestmark = pytest.mark.both_loops  # the standard loop (asyncio.run, uvicorn) too


def _records(path: Path) -> list[tuple[bytes, bytes]]:
    data = path.read_bytes()
    out, pos = [], 0
    while pos < len(data):
        (klen,) = struct.unpack_from("<I", data, pos)
        key = data[pos + 4 : pos + 4 + klen]
        (vlen,) = struct.unpack_from("<I", data, pos + 4 + klen)
        value = data[pos + 8 + klen : pos + 8 + klen + vlen]
        out.append((key, value))
        pos += 8 + klen + vlen
    return out


async def test_file_format_is_an_append_only_log(tmp_path: Path) -> None:
    path = tmp_path / "log"
    store = aiodist.FileStore(path)
    assert not path.exists()  # the constructor does no I/O
    await store.set("k", b"v1")
    await store.add("c", 3)
    assert await store.delete_key("k") is True
    await store.queue_push("q", b"x")
    assert await store.queue_pop("q") == b"x"
    assert _records(path) == [
        (b"refcount/", b"1"),
        (b"/k", b"v1"),
        (b"/c", b"3"),
        (b"-/k", b""),
        (b"+/q", b"x"),
        (b"^/q", b""),
    ]
    await store.aclose()
    assert path.exists()  # world size unknown: the file stays
    assert _records(path)[-2:] == [(b"cleanup/", b"1"), (b"refcount/", b"0")]


async def test_file_removed_after_world_size_instances_close(tmp_path: Path) -> None:
    path = tmp_path / "shared"
    a = aiodist.FileStore(path, world_size=2)
    b = aiodist.FileStore(str(path), world_size=2)
    await a.set("x", b"1")
    assert await b.get("x") == b"1"
    clone = await a.clone()
    await a.aclose()
    await clone.aclose()
    assert path.exists()  # b is still open
    await b.aclose()
    assert not path.exists()


async def test_file_store_reads_only_the_new_tail(tmp_path: Path) -> None:
    path = tmp_path / "tail"
    writer = aiodist.FileStore(path)
    reader = aiodist.FileStore(path)
    await writer.set("a", b"1")
    assert await reader.get("a") == b"1"
    offset = reader._log._offset
    assert offset == path.stat().st_size
    await writer.set("b", b"2")
    assert await reader.multi_get(["a", "b"]) == [b"1", b"2"]
    assert reader._log._offset == path.stat().st_size > offset
    assert repr(reader) == (f"<FileStore path={str(path)!r} world_size=-1 keys=2 timeout=300.0>")
    await writer.aclose()
    await reader.aclose()
    assert "closed" in repr(reader)


async def test_file_store_keeps_the_loop_responsive(tmp_path: Path) -> None:
    # Another process holds the file lock: a FileStore operation waits in a worker thread,
    # and the event loop keeps running other tasks meanwhile.
    import fcntl

    path = tmp_path / "locked"
    store = aiodist.FileStore(path)
    await store.set("k", b"v")
    with path.open("rb") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        setter = asyncio.ensure_future(store.set("k2", b"v2"))
        ticks = 0
        for _ in range(10):
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks == 10 and not setter.done()
        fcntl.flock(f, fcntl.LOCK_UN)
    await asyncio.wait_for(setter, 5)
    assert await store.get("k2") == b"v2"
    await store.aclose()


async def test_file_store_errors(tmp_path: Path) -> None:
    with pytest.raises(aiodist.DistUsageError, match="world_size must be -1 or positive, got 0"):
        aiodist.FileStore(tmp_path / "x", world_size=0)
    with pytest.raises(aiodist.DistUsageError, match="needs a file name"):
        aiodist.FileStore("")
    store = aiodist.FileStore(tmp_path / "no" / "such" / "dir")
    with pytest.raises(aiodist.DistStoreError, match=r"FileStore cannot open .*dir'"):
        await store.set("k", b"v")
    await store.aclose()
    closed = aiodist.FileStore(tmp_path / "closed")
    await closed.aclose()
    with pytest.raises(aiodist.DistStoreError, match="is closed"):
        await closed.set("k", b"v")


def _add_many(path: str, n: int, start: multiprocessing.synchronize.Event) -> None:
    async def main() -> None:
        async with aiodist.FileStore(path, world_size=-1, timeout=30) as store:
            start.wait()
            for _ in range(n):
                await store.add("counter", 1)

    asyncio.run(main())


@pytest.mark.multiprocess
async def test_16_processes_add_to_one_file_store_key(tmp_path: Path) -> None:
    path = str(tmp_path / "counter")
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    procs = [ctx.Process(target=_add_many, args=(path, 1000, start)) for _ in range(16)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        await asyncio.to_thread(p.join, 60)
        assert p.exitcode == 0
    async with aiodist.FileStore(path) as store:
        assert await store.get("counter") == b"16000"


async def test_prefix_store_nesting_and_listing() -> None:
    base = aiodist.HashStore()
    inner = aiodist.PrefixStore("b", base)
    outer = aiodist.PrefixStore("a", inner)
    await outer.set("k", b"1")
    await base.set("unrelated", b"x")
    assert await base.get("b/a/k") == b"1"
    assert await inner.get("a/k") == b"1"
    assert await outer.list_keys() == ["k"]
    assert await outer.num_keys() == 1
    assert sorted(await base.list_keys()) == ["b/a/k", "unrelated"]
    assert outer.underlying_store is inner
    assert outer.prefix == "a/"
    assert repr(outer) == (
        "<PrefixStore prefix='a/' store=<PrefixStore prefix='b/' "
        "store=<HashStore keys=2 timeout=300.0>>>"
    )
    outer.set_timeout(5)
    assert base.timeout == 5.0 and outer.timeout == 5.0
    await outer.aclose()
    assert await base.get("b/a/k") == b"1"  # closing a PrefixStore leaves its store open


async def test_prefix_store_rejects_bad_arguments() -> None:
    with pytest.raises(aiodist.DistUsageError, match="needs an underlying store, got None"):
        aiodist.PrefixStore("p", None)  # type: ignore[arg-type]
    with pytest.raises(aiodist.DistUsageError, match="needs an aiodist Store, got dict"):
        aiodist.PrefixStore("p", {})  # type: ignore[arg-type]
    store = aiodist.PrefixStore("p", aiodist.HashStore())
    with pytest.raises(aiodist.DistUsageError, match="a single str"):
        await store.check("abc")


@pytest.mark.torch
async def test_file_store_shares_a_file_with_torch(tmp_path: Path) -> None:
    dist = pytest.importorskip("torch.distributed", reason="needs torch")
    path = str(tmp_path / "torch-shared")
    ours = aiodist.FileStore(path)
    await ours.set("from-aiodist", b"1")
    await ours.add("count", 2)
    theirs = dist.FileStore(path, -1)
    assert theirs.get("from-aiodist") == b"1"
    assert theirs.add("count", 3) == 5
    theirs.set("from-torch", b"t")
    theirs.delete_key("from-aiodist")
    assert await ours.get("from-torch") == b"t"
    assert await ours.get("count") == b"5"
    assert await ours.check(["from-aiodist"]) is False
    assert sorted(await ours.list_keys()) == ["count", "from-torch"]
    del theirs
    await ours.aclose()
