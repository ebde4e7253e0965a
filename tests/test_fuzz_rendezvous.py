"""Fuzzing the rendezvous URL parser: every URL gives a store or a documented error.

A malformed URL is a ``DistUsageError`` naming what is wrong; a well-formed one that points
nowhere is a ``DistNetworkError`` or ``DistTimeoutError`` within the (short) timeout. Never
another exception type.
"""

from __future__ import annotations

import string
from pathlib import Path

import pytest
from fuzz_helpers import fuzz
from hypothesis import given, strategies as st

import aiodist
from aiodist.rendezvous import rendezvous

ALLOWED = (aiodist.DistUsageError, aiodist.DistNetworkError, aiodist.DistTimeoutError)

text = st.text(alphabet=string.printable + "[]@%\u0663\u00e9\x00", max_size=12)
ints = st.one_of(
    st.integers(-2, 4).map(str),
    st.sampled_from(["", "x", "1.5", "99999999999999999999", " 1"]),
    text,
)
hosts = st.one_of(
    st.sampled_from(
        ["127.0.0.1", "localhost", "[::1]", "[", "]", "a:b", "", "host@x", "127.0.0.1:"]
    ),
    text,
)
ports = st.one_of(
    st.just(""), st.integers(-1, 70000).map(lambda p: f":{p}"), text.map(lambda t: ":" + t)
)
queries = st.lists(
    st.tuples(st.sampled_from(["rank", "world_size", "x", ""]), ints), max_size=3
).map(lambda kv: "&".join(f"{k}={v}" for k, v in kv))


@pytest.fixture(autouse=True)
def _no_rendezvous_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "AIODIST_AUTH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)


async def _try(url: str, rank: int, world_size: int) -> None:
    try:
        store, r, n = await rendezvous(url, rank, world_size, timeout=0.05)
    except ALLOWED as exc:
        assert str(exc), f"{type(exc).__name__} without a message for {url!r}"
        return
    await store.aclose()
    assert 0 <= r < n


@fuzz(300)
@given(
    scheme=st.one_of(st.sampled_from(["tcp", "env", "TCP", "", "nope", "tcp+x"]), text),
    host=hosts,
    port=ports,
    query=queries,
    rank=st.integers(-2, 2),
    world_size=st.integers(-2, 2),
)
async def test_network_urls(
    scheme: str, host: str, port: str, query: str, rank: int, world_size: int
) -> None:
    await _try(f"{scheme}://{host}{port}?{query}", rank, world_size)


@fuzz(100)
@given(data=st.text(max_size=40), rank=st.integers(-1, 1), world_size=st.integers(-1, 2))
async def test_arbitrary_strings(data: str, rank: int, world_size: int) -> None:
    await _try(data, rank, world_size)


@fuzz(100)
@given(name=text, netloc=st.sampled_from(["", "localhost", "elsewhere", "[", "a@b"]), query=queries)
async def test_file_urls(tmp_path: Path, name: str, netloc: str, query: str) -> None:
    # Paths stay inside the test's directory: the parser is fuzzed, not the file system.
    safe = "".join(c for c in name if c.isalnum()) or "f"
    await _try(f"file://{netloc}{tmp_path}/{safe}?{query}", -1, -1)


@pytest.mark.parametrize(
    "url", ["tcp://[:29500?rank=0&world_size=1", "file://[/tmp/x", "env://x]["]
)
async def test_unbalanced_bracket_is_a_usage_error(url: str) -> None:
    """Found by fuzzing: urlsplit's ValueError escaped instead of a DistUsageError."""
    with pytest.raises(aiodist.DistUsageError, match=r"rendezvous url .* is malformed: "):
        await rendezvous(url, timeout=0.05)
