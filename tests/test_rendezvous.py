"""Rendezvous URL rules, errors and the scheme registry; real stores behind each scheme."""

from __future__ import annotations

import asyncio
import multiprocessing
import sys
import textwrap
from pathlib import Path

import pytest

import aiodist
from aiodist import rendezvous as rdzv
from aiodist._util._cluster import VARIABLES, read_rank_and_world_size
from aiodist.rendezvous import get_node_local_rank, register_rendezvous_handler, rendezvous
from aiodist.testing import free_port

pytestmark = pytest.mark.both_loops  # the standard loop (asyncio.run, uvicorn) too


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*VARIABLES, "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def recorder() -> list[tuple[str, float | None]]:
    """A registered ``rec://`` scheme that records the URL it was given."""
    calls: list[tuple[str, float | None]] = []

    async def handler(url: str, *, timeout: float | None) -> tuple[aiodist.Store, int, int]:
        calls.append((url, timeout))
        return aiodist.HashStore(), 0, 1

    register_rendezvous_handler("rec", handler)
    yield calls
    del rdzv._handlers["rec"]


async def test_function_arguments_are_merged_into_the_query(
    recorder: list[tuple[str, float | None]],
) -> None:
    await rendezvous("rec://h:1?x=y", rank=2, world_size=4, timeout=7)
    assert recorder == [("rec://h:1?x=y&rank=2&world_size=4", 7.0)]
    await rendezvous("rec://h:1?rank=2", rank=2)  # the same value twice is no conflict
    assert recorder[-1][0] == "rec://h:1?rank=2"
    with pytest.raises(
        aiodist.DistUsageError,
        match=r"rank given twice: rank=1 in the url 'rec://h:1\?rank=1' and rank=3 as an argument",
    ):
        await rendezvous("rec://h:1?rank=1", rank=3)
    with pytest.raises(aiodist.DistUsageError, match="world_size given twice"):
        await rendezvous("rec://?world_size=2", world_size=3)


async def test_scheme_registry_errors(recorder: list[tuple[str, float | None]]) -> None:
    with pytest.raises(
        aiodist.DistUsageError,
        match=r"No rendezvous handler for nope:// \(known schemes: env://, etcd://, file://, rec://, tcp://\)",
    ):
        await rendezvous("nope://x")
    with pytest.raises(aiodist.DistUsageError, match=r"handler for rec:// is already registered"):
        register_rendezvous_handler("rec", rdzv._handlers["rec"])
    with pytest.raises(aiodist.DistUsageError, match="must be a name like 'env', got 'x://'"):
        register_rendezvous_handler("x://", rdzv._handlers["rec"])
    with pytest.raises(aiodist.DistUsageError, match="has no scheme"):
        await rendezvous("/just/a/path")
    with pytest.raises(aiodist.DistUsageError, match="url must be a str, got bytes"):
        await rendezvous(b"env://")  # type: ignore[arg-type]
    with pytest.raises(aiodist.DistUsageError, match="rank must be an int, got str"):
        await rendezvous("rec://", rank="0")  # type: ignore[arg-type]
    with pytest.raises(aiodist.DistUsageError, match="timeout must not be negative"):
        await rendezvous("rec://", timeout=-1)


async def test_entry_point_provides_a_scheme(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "plugin_rdzv.py").write_text(
        textwrap.dedent(
            """
            import aiodist

            async def handler(url, *, timeout):
                return aiodist.HashStore(timeout), 1, 3
            """
        )
    )
    info = tmp_path / "plugin_rdzv-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plugin-rdzv\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[aiodist.rendezvous]\nplug = plugin_rdzv:handler\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        store, rank, world_size = await rendezvous("plug://anything", timeout=3)
        assert (rank, world_size) == (1, 3)
        assert isinstance(store, aiodist.HashStore) and store.timeout == 3.0
        assert "plug" in rdzv._handlers
    finally:
        rdzv._handlers.pop("plug", None)
        sys.modules.pop("plugin_rdzv", None)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("tcp://127.0.0.1?rank=0&world_size=1", "tcp:// rendezvous: port number missing"),
        ("tcp://127.0.0.1:29500?world_size=1", "tcp:// rendezvous: rank parameter missing"),
        ("tcp://127.0.0.1:29500?rank=0", "tcp:// rendezvous: world size parameter missing"),
        ("tcp://:29500?rank=0&world_size=1", "tcp:// rendezvous: host name missing"),
        ("tcp://h:99999?rank=0&world_size=1", "tcp:// rendezvous: bad port"),
        ("tcp://h:1?rank=x&world_size=1", "tcp:// rendezvous: rank must be an integer, got 'x'"),
        ("tcp://h:1?rank=2&world_size=2", "rank 2 is out of range for world size 2"),
        ("tcp://h:1?rank=0&world_size=0", "world size must be positive, got 0"),
        ("file://?rank=0&world_size=1", "file:// rendezvous: path missing"),
        ("file:///tmp/x?world_size=1", "file:// rendezvous: rank parameter missing"),
        ("file:///tmp/x?rank=0", "file:// rendezvous: world size parameter missing"),
        ("file://tmp/x?rank=0&world_size=1", "expected file:///absolute/path, got host 'tmp'"),
        ("env://", r"environment variable RANK expected, but not set \(nor OMPI_COMM_WORLD_RANK, "
                   r"PMI_RANK, SLURM_PROCID, PET_NODE_RANK or JOB_COMPLETION_INDEX\)"),
        ("env://?rank=0", "environment variable WORLD_SIZE expected, but not set "
                          r"\(nor OMPI_COMM_WORLD_SIZE, PMI_SIZE, SLURM_NTASKS or PET_NNODES\)"),
        ("env://?rank=0&world_size=1",
         "env:// rendezvous: environment variable MASTER_ADDR expected, but not set$"),
    ],
)  # fmt: skip
async def test_missing_and_bad_parameters_are_named(url: str, message: str) -> None:
    with pytest.raises(aiodist.DistUsageError, match=message) as info:
        await rendezvous(url)
    assert str(info.value).startswith("Error initializing aiodist using ")


async def test_env_errors_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(
        aiodist.DistUsageError,
        match=r"^Error initializing aiodist using env:// rendezvous: "
        r"environment variable MASTER_PORT expected, but not set$",
    ):
        await rendezvous("env://")
    monkeypatch.setenv("MASTER_PORT", "")  # empty counts as unset, as in torch
    with pytest.raises(aiodist.DistUsageError, match="MASTER_PORT expected, but not set"):
        await rendezvous("env://")
    monkeypatch.setenv("MASTER_PORT", "http")
    with pytest.raises(aiodist.DistUsageError, match="MASTER_PORT must be an integer, got 'http'"):
        await rendezvous("env://")
    monkeypatch.setenv("MASTER_PORT", "70000")
    with pytest.raises(aiodist.DistUsageError, match="port must be from 0 to 65535, got 70000"):
        await rendezvous("env://")
    monkeypatch.setenv("RANK", "5")
    with pytest.raises(aiodist.DistUsageError, match="rank 5 is out of range for world size 2"):
        await rendezvous("env://")


def test_rank_and_size_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    def resolve(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
        r, w = read_rank_and_world_size(rank=rank, world_size=world_size)
        return r.value, w.value

    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_STEP_ID", "0")  # a task that srun started
    assert resolve() == (3, 8)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert resolve() == (1, 4)  # Open MPI before SLURM
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "6")
    assert resolve() == (2, 6)  # torchrun's names first
    assert resolve(5, 7) == (5, 7)  # the query's values override them all


def test_node_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(aiodist.DistUsageError, match="the local rank is unknown: none of"):
        get_node_local_rank()
    assert get_node_local_rank(fallback_rank=4) == 4
    monkeypatch.setenv("SLURM_LOCALID", "2")
    assert get_node_local_rank() == 2
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    assert get_node_local_rank() == 1
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert get_node_local_rank(fallback_rank=9) == 0
    monkeypatch.setenv("LOCAL_RANK", "zero")
    with pytest.raises(aiodist.DistUsageError, match="LOCAL_RANK must be an integer, got 'zero'"):
        get_node_local_rank()


async def test_file_rendezvous_in_one_process(tmp_path: Path) -> None:
    path = tmp_path / "rdzv file"
    url = f"file://{path}".replace(" ", "%20")
    results = await asyncio.gather(
        *(rendezvous(url, rank=r, world_size=3, timeout=5) for r in range(3))
    )
    assert [(rank, size) for _, rank, size in results] == [(0, 3), (1, 3), (2, 3)]
    stores = [store for store, _, _ in results]
    assert all(isinstance(s, aiodist.FileStore) and s.timeout == 5.0 for s in stores)
    await stores[0].set("hello", b"world")
    assert await stores[2].get("hello") == b"world"
    for store in stores:
        await store.aclose()
    assert not path.exists()  # the last of the three removed the file


def _file_rank(url: str, rank: int, world_size: int) -> None:
    async def main() -> None:
        store, r, n = await rendezvous(url, rank=rank, world_size=world_size, timeout=30)
        async with store:
            await store.set(f"rank{r}", str(r))
            await store.add("arrived", 1)
            await store.wait([f"rank{i}" for i in range(n)])
            values = await store.multi_get([f"rank{i}" for i in range(n)])
            assert values == [str(i).encode() for i in range(n)]
            # Keep the file until everyone has read: the last to close removes it.
            await store.add("done", 1)
            while int(await store.get("done")) < n:
                await asyncio.sleep(0.01)

    asyncio.run(main())


@pytest.mark.multiprocess
async def test_file_rendezvous_across_processes(tmp_path: Path) -> None:
    path = tmp_path / "rdzv"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_file_rank, args=(f"file://{path}", r, 4)) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        await asyncio.to_thread(p.join, 60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    assert not path.exists()


async def _four_ranks(urls: list[str], **kwargs: object) -> None:
    results = await asyncio.gather(
        *(rendezvous(url, timeout=10, **kwargs) for url in urls)  # type: ignore[arg-type]
    )
    stores = [store for store, _, _ in results]
    try:
        assert [(rank, size) for _, rank, size in results] == [(r, 4) for r in range(4)]
        await asyncio.gather(*(s.set(f"r{i}", str(i)) for i, s in enumerate(stores)))
        for store in stores:
            assert await store.multi_get(["r0", "r1", "r2", "r3"]) == [b"0", b"1", b"2", b"3"]
        assert await stores[3].add("n", 1) == 1
        assert await stores[0].add("n", 1) == 2
    finally:
        for store in reversed(stores):
            await store.aclose()


async def test_tcp_rendezvous_of_four_ranks() -> None:
    port = free_port()
    await _four_ranks([f"tcp://127.0.0.1:{port}?rank={r}&world_size=4" for r in range(4)])


async def test_env_rendezvous_of_four_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("WORLD_SIZE", "4")
    await _four_ranks([f"env://?rank={r}" for r in range(4)])


async def test_env_rendezvous_with_an_agent_store(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiodist.store.tcp import TCPStore

    # The launcher's agent hosts the store; every rank, rank 0 included, is a client.
    agent = await TCPStore.create("127.0.0.1", 0, is_master=True, timeout=10)
    try:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(agent.port))
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
        monkeypatch.setenv("SLURM_NTASKS", "4")
        monkeypatch.setenv("SLURM_STEP_ID", "0")
        await _four_ranks([f"env://?rank={r}" for r in range(4)])
        assert await agent.get("r2") == b"2"
    finally:
        await agent.aclose()


async def test_a_tcp_url_elsewhere_than_the_agent_store_is_hosted_by_rank_0(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Under an agent (its store at MASTER_ADDR:MASTER_PORT), a tcp:// URL naming another
    # address is a store of the script's own: rank 0 hosts it, as torch 2.15 does.
    agent = await aiodist.TCPStore.create("127.0.0.1", 0, is_master=True, timeout=10)
    try:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(agent.port))
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
        port = free_port()
        await _four_ranks([f"tcp://127.0.0.1:{port}?rank={r}&world_size=4" for r in range(4)])
        assert not await agent.check(["r2"])  # the agent's store was not used
    finally:
        await agent.aclose()


async def test_tcp_rendezvous_without_a_server_fails_within_its_timeout() -> None:
    import time

    port = free_port()  # nothing listens there
    start = time.monotonic()
    with pytest.raises(aiodist.DistNetworkError, match=f"127.0.0.1:{port}"):
        await rendezvous(f"tcp://127.0.0.1:{port}?rank=1&world_size=2", timeout=0.5)
    assert time.monotonic() - start < 5
