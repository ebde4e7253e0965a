import asyncio

import pytest

import aiodist


@pytest.mark.both_loops
async def test_get_waits_for_a_later_set() -> None:
    store = aiodist.HashStore(timeout=5)
    getter = asyncio.ensure_future(store.get("k"))
    await asyncio.sleep(0)
    assert not getter.done()
    await store.set("k", "v")
    assert await getter == b"v"


async def test_wait_timeout_names_missing_keys() -> None:
    store = aiodist.HashStore()
    await store.set("a", b"1")
    with pytest.raises(
        aiodist.DistTimeoutError, match=r"keys \['a', 'b'\]; still missing: \['b'\]"
    ):
        await store.wait(["a", "b"], timeout=0.05)
    assert await store.add("a", 2) == 3
