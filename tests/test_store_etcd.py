"""EtcdStore against a real etcd: the conformance kit, fail-over between members, leases."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
from etcd_helpers import Member, etcd, etcd3, needs_etcd

import aiodist
from aiodist.errors import DistNetworkError, DistUsageError
from aiodist.testing import check_store

pytestmark = needs_etcd

__all__ = ["etcd", "etcd3"]  # (fixtures)

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
