"""The store conformance kit, run against every store."""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

import aiodist
from aiodist.store.tcp import TCPStore
from aiodist.testing import check_store

Factory = Callable[[], Awaitable[aiodist.Store]]
_counter = itertools.count()
KINDS = ["hash", "file", "tcp", "prefix-hash", "prefix-file", "prefix-tcp"]


def _factory(kind: str, tmp_path: Path, opened: list[aiodist.Store]) -> Factory:
    """A factory of fresh stores of ``kind``; it records the stores a PrefixStore borrows."""

    async def base(name: str) -> aiodist.Store:
        if name == "hash":
            return aiodist.HashStore()
        if name == "file":
            return aiodist.FileStore(tmp_path / f"store{next(_counter)}")
        return await TCPStore.create("127.0.0.1", 0, is_master=True, timeout=10)

    async def make() -> aiodist.Store:
        if not kind.startswith("prefix-"):
            return await base(kind)
        inner = await base(kind.removeprefix("prefix-"))
        opened.append(inner)
        return aiodist.PrefixStore("a", aiodist.PrefixStore("b", inner))

    return make


@pytest.mark.both_loops
@pytest.mark.parametrize("kind", KINDS)
async def test_store_conformance(kind: str, tmp_path: Path) -> None:
    opened: list[aiodist.Store] = []
    try:
        await check_store(_factory(kind, tmp_path, opened))
    finally:
        for store in opened:
            await store.aclose()


def _add_many_tcp(port: int, n: int) -> None:
    import asyncio

    async def main() -> None:
        async with await TCPStore.create("127.0.0.1", port, timeout=30) as store:
            await store.wait(["go"])
            for _ in range(n):
                await store.add("counter", 1)

    asyncio.run(main())


@pytest.mark.multiprocess
async def test_16_processes_add_to_one_tcp_store_key() -> None:
    import asyncio
    import multiprocessing

    async with await TCPStore.create("127.0.0.1", 0, is_master=True, timeout=30) as server:
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=_add_many_tcp, args=(server.port, 1000)) for _ in range(16)]
        for p in procs:
            p.start()
        await server.set("go", b"")
        for p in procs:
            await asyncio.to_thread(p.join, 60)
        assert [p.exitcode for p in procs] == [0] * 16
        assert await server.get("counter") == b"16000"
