"""The store conformance kit, run against every store."""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

import aiodist
from aiodist.testing import check_store

Factory = Callable[[], Awaitable[aiodist.Store]]
_counter = itertools.count()


def _factories(tmp_path: Path) -> dict[str, Factory]:
    def fresh_file() -> str:
        return str(tmp_path / f"store{next(_counter)}")

    async def hash_store() -> aiodist.Store:
        return aiodist.HashStore()

    async def file_store() -> aiodist.Store:
        return aiodist.FileStore(fresh_file())

    async def prefix_over_hash() -> aiodist.Store:
        return aiodist.PrefixStore("pg", aiodist.HashStore())

    async def prefix_over_file() -> aiodist.Store:
        return aiodist.PrefixStore("a", aiodist.PrefixStore("b", aiodist.FileStore(fresh_file())))

    return {
        "hash": hash_store,
        "file": file_store,
        "prefix-hash": prefix_over_hash,
        "prefix-file": prefix_over_file,
    }


@pytest.mark.both_loops
@pytest.mark.parametrize("kind", ["hash", "file", "prefix-hash", "prefix-file"])
async def test_store_conformance(kind: str, tmp_path: Path) -> None:
    await check_store(_factories(tmp_path)[kind])
