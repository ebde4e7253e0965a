"""What torch's own tests expect of ``torch.distributed``, stated on ``aiodist.sync``.

torch's ``test/distributed/test_store.py`` and ``DistributedTest`` check these behaviours;
scripts rely on them too (they catch torch's error classes, match its words, compare
``get_backend()`` with what they passed). Each test below states torch's behaviour and
checks that ``aiodist.sync`` has it; aiodist's own explanation follows torch's words in its
messages.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aiodist.sync as dist
from aiodist.testing import run_world_processes

pytestmark = pytest.mark.multiprocess

HOST = "127.0.0.1"


@pytest.fixture
def tcp_store() -> Any:
    store = dist.TCPStore(HOST, 0, 1, True, timeout=timedelta(seconds=30))
    yield store
    store.close()


@pytest.fixture
def file_path(tmp_path: Path) -> str:
    path = tmp_path / "store"
    path.touch()
    return str(path)


# -- stores -------------------------------------------------------------------------------
def test_stores_have_the_extended_api(tcp_store: Any, file_path: str) -> None:
    """torch: ``has_extended_api()`` is true for its C++ stores and a PrefixStore over them."""
    with dist.HashStore() as hash_store, dist.FileStore(file_path, 1) as file_store:
        for store in (tcp_store, hash_store, file_store, dist.PrefixStore("p", tcp_store)):
            assert store.has_extended_api() is True
            store.set("foo", "po")
            store.append("foo", "tato")
            store.multi_set(["a", "b"], ["1", "2"])
            assert store.multi_get(["foo", "a", "b"]) == [b"potato", b"1", b"2"]


def test_tcp_store_reports_its_libuv_backend() -> None:
    """torch: ``TCPStore.libuvBackend`` says whether it runs on libuv (the default)."""
    with dist.TCPStore(HOST, 0, 1, True) as store:
        assert store.libuvBackend is True
    with dist.TCPStore(HOST, 0, 1, True, use_libuv=False) as store:
        assert store.libuvBackend is False


def test_a_master_whose_workers_do_not_join_raises_a_store_error() -> None:
    """torch: ``DistStoreError`` "Timed out after N seconds waiting for clients. k/n clients
    joined."; without ``wait_for_workers`` nothing is raised."""
    with pytest.raises(
        dist.DistStoreError,
        match=r"^Timed out after \d+ seconds waiting for clients\. 1/2 clients joined\. \(the ",
    ) as info:
        dist.TCPStore(HOST, 0, 2, True, timeout=timedelta(seconds=1))
    assert isinstance(info.value, TimeoutError)
    dist.TCPStore(HOST, 0, 2, True, timeout=timedelta(seconds=1), wait_for_workers=False).close()


def test_store_waits_that_time_out_say_timeout(tcp_store: Any, file_path: str) -> None:
    """torch: a wait past its deadline raises ``DistStoreError`` whose message matches
    ``[t -i]imeout``; a blocking ``queue_pop`` past the store timeout says "timeout"."""
    with dist.HashStore() as hash_store, dist.FileStore(file_path, 1) as file_store:
        prefixed = dist.PrefixStore("p", tcp_store)
        for store in (tcp_store, hash_store, file_store, prefixed):
            with pytest.raises(dist.DistStoreError, match=r"[t -i]imeout") as info:
                store.wait(["bad_key"], timedelta(seconds=0.25))
            assert "store wait timeout: timed out after" in str(info.value)
            assert "still missing: ['" in str(info.value)
            store.set_timeout(timedelta(seconds=0.05))
            with pytest.raises(dist.DistStoreError, match="timeout"):
                store.queue_pop("nonexistent")


def test_a_port_in_use_is_named_in_torchs_words(tcp_store: Any) -> None:
    """torch: ``DistNetworkError`` "The server socket has failed to listen on any local
    network address ... <port>"."""
    port = tcp_store.port
    with pytest.raises(
        dist.DistNetworkError,
        match=rf"^The server socket has failed to listen on any local network address: .*{port}",
    ):
        dist.TCPStore(HOST, port, 1, True)


def test_world_size_0_is_refused_in_torchs_words() -> None:
    """torch: ``ValueError`` "TCPStore world size cannot be 0"."""
    with pytest.raises(ValueError, match=r"^TCPStore world size cannot be 0"):
        dist.TCPStore(HOST, 0, world_size=0, is_master=False)


def test_a_master_takes_over_a_listening_socket() -> None:
    """torch: ``master_listen_fd`` is a socket the caller bound; the master listens on it,
    and refuses one bound to another port than ``port`` (``DistStoreError``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((HOST, 0))
    port = sock.getsockname()[1]
    with dist.TCPStore(HOST, port, 1, is_master=True, master_listen_fd=sock.detach()) as store:
        store.set("key", "value")
        assert store.get("key") == b"value"
        with dist.TCPStore(HOST, port, 1, is_master=False) as client:
            assert client.get("key") == b"value"
    other = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    other.bind((HOST, 0))
    fd = other.detach()
    with pytest.raises(
        dist.DistStoreError, match=rf"listen fd {fd} is bound to port \d+, expected"
    ):
        dist.TCPStore(HOST, port, 1, is_master=True, master_listen_fd=fd)


def _set_get_check(store: Any) -> int:
    # torch's StoreTestBase: five keys set and added to.
    for key, amount in [("key", 1), ("key", 2), ("key", 3)]:
        store.add(key, amount)
    store.set("key0", "value0")
    store.set("key1", "value1")
    store.set("key2", "value2")
    for amount in range(1, 7):
        store.add("key3", amount)
    assert (store.get("key"), store.get("key3")) == (b"6", b"21")
    count: int = store.num_keys()
    return count


def test_num_keys_counts_as_torch(file_path: str) -> None:
    """torch: a TCPStore counts its ``init/`` key, a FileStore its reference counter, a
    PrefixStore every key of the store under it; a HashStore the keys set."""
    with dist.TCPStore(HOST, 0, 1, True) as tcp:
        assert tcp.num_keys() == 1
        assert _set_get_check(tcp) == 6
        tcp.delete_key("key")
        assert tcp.num_keys() == 5
    with dist.TCPStore(HOST, 0, 1, True) as tcp:
        assert _set_get_check(dist.PrefixStore("test_prefix", tcp)) == 6
    with dist.FileStore(file_path, 1) as file_store:
        assert _set_get_check(file_store) == 6
        assert len(file_store.list_keys()) == 5  # the keys set, as aiodist lists them
    with dist.HashStore() as hash_store:
        assert _set_get_check(hash_store) == 5


def test_the_last_file_store_instance_removes_the_file() -> None:
    """torch: each FileStore counts itself in when made, out when destroyed; the last one
    of a known world removes the file."""
    with tempfile.NamedTemporaryFile(delete=False) as f:
        path = f.name
    store = dist.FileStore(path, 1)
    store2 = dist.FileStore(path, 1)
    del store
    assert os.path.exists(path)
    del store2
    assert not os.path.exists(path)


class MyPythonStore(dist.Store):
    """torch's test store: a dict, with torch's checks of what it is called with."""

    def __init__(self) -> None:
        super().__init__()
        self.store: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def set(self, key: str, value: bytes) -> None:  # type: ignore[override]
        assert isinstance(key, str) and type(value) is bytes
        with self.lock:
            self.store[key] = value

    def get(self, key: str) -> bytes:  # type: ignore[override]
        return self.store.get(key, b"")

    def add(self, key: str, value: int) -> int:  # type: ignore[override]
        with self.lock:
            new = int(self.store.get(key, b"0")) + value
            self.store[key] = str(new).encode()
            return new

    def compare_set(self, key: str, expected: bytes, new: bytes) -> bytes:  # type: ignore[override]
        assert type(expected) is bytes and type(new) is bytes
        with self.lock:
            value = self.store.get(key)
            if value is None and expected:
                return expected
            if value is None or value == expected:
                self.store[key] = value = new
            return value


def test_a_store_written_in_python_is_a_store() -> None:
    """torch: a subclass of ``dist.Store`` defining set/get/add/compare_set is a store:
    a PrefixStore over it works, with append, multi_get and multi_set built on those;
    ``has_extended_api()`` is false unless it says otherwise; a method it lacks raises
    "Not implemented."."""
    store = MyPythonStore()
    assert store.has_extended_api() is False
    prefixed = dist.PrefixStore("p", store)
    assert prefixed.has_extended_api() is False
    prefixed.set("key", "value")
    assert store.store == {"p/key": b"value"}
    assert prefixed.get("key") == b"value"
    assert prefixed.add("n", 2) == 2 and prefixed.add("n", 3) == 5
    assert prefixed.compare_set("key", "value", "other") == b"other"
    prefixed.append("foo", b"po")
    prefixed.append("foo", b"tato")
    assert prefixed.get("foo") == b"potato"
    prefixed.multi_set(["a", "b"], [b"c", b"d"])
    assert prefixed.multi_get(["a", "b", "foo"]) == [b"c", b"d", b"potato"]
    with pytest.raises(dist.DistStoreError, match=r"^Not implemented\.: MyPythonStore\.wait"):
        prefixed.wait(["key"])

    class Bare(dist.Store):
        pass

    bare = Bare()
    assert bare.has_extended_api() is False
    for call in (
        lambda: bare.append("foo", "bar"),
        lambda: bare.multi_get(["foo", "bar"]),
        lambda: bare.multi_set(["foo", "bar"], [b"v", b"v"]),
    ):
        with pytest.raises(RuntimeError, match=r"^Not implemented\."):
            call()

    class Extended(dist.Store):
        def has_extended_api(self) -> bool:
            return True

    assert dist.PrefixStore("p", Extended()).has_extended_api() is True


class WaitingStore(MyPythonStore):
    """A Python store that can wait: what a process group needs of its store."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = threading.Condition(self.lock)

    def set(self, key: str, value: bytes) -> None:  # type: ignore[override]
        super().set(key, value)
        with self.changed:
            self.changed.notify_all()

    def add(self, key: str, value: int) -> int:  # type: ignore[override]
        total = super().add(key, value)
        with self.changed:
            self.changed.notify_all()
        return total

    def get(self, key: str) -> bytes:  # type: ignore[override]
        self.wait([key])
        return self.store[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.store for k in keys)

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        with self.changed:
            if not self.changed.wait_for(lambda: self.check(keys), timeout=30):
                raise dist.DistStoreError(f"timeout waiting for {keys}")

    def delete_key(self, key: str) -> bool:
        with self.lock:
            return self.store.pop(key, None) is not None


def test_a_store_written_in_python_serves_a_process_group() -> None:
    dist.init_process_group("gloo", store=WaitingStore(), rank=0, world_size=1)
    try:
        x = np.arange(3.0)
        dist.all_reduce(x)
        assert x.tolist() == [0.0, 1.0, 2.0]
    finally:
        dist.destroy_process_group()


# -- rendezvous ---------------------------------------------------------------------------
def test_file_rendezvous_takes_the_url_torch_builds(tmp_path: Path) -> None:
    """torch's own tests build ``file:///`` + an absolute path: ``file:////tmp/...``."""
    path = tmp_path / "rdzv"
    url = f"file:///{path!s}?world_size=2"
    store0, rank0, size0 = next(dist.rendezvous(url + "&rank=0"))
    store1, rank1, size1 = next(dist.rendezvous(url + "&rank=1"))
    with store0, store1:
        assert (rank0, size0, rank1, size1) == (0, 2, 1, 2)
        store0.set("key0", "value0")
        store1.set("key1", "value1")
        assert (store1.get("key0"), store0.get("key1")) == (b"value0", b"value1")


def test_rendezvous_checks_the_url_when_called() -> None:
    """torch: ``rendezvous()`` raises at once for an unknown scheme ("No rendezvous
    handler") and for node-specific arguments given twice; missing parameters at ``next()``."""
    with pytest.raises(RuntimeError, match=r"^No rendezvous handler for invalid://"):
        dist.rendezvous("invalid://")
    with pytest.raises(
        ValueError,
        match=r"^The url: file://foo\?rank=12&world_size=16 has node-specific arguments",
    ):
        dist.rendezvous("file://foo?rank=12&world_size=16", 12, 16)
    for url, missing in [
        ("file://?rank=0&world_size=1", "path missing"),
        ("file:///tmp/foo?world_size=1", "rank parameter missing"),
        ("file:///tmp/foo?rank=0", "size parameter missing"),
        ("tcp://127.0.0.1?rank=0&world_size=1", "port number missing"),
    ]:
        steps = dist.rendezvous(url)
        with pytest.raises(ValueError, match=missing):
            next(steps)


# -- process groups and operations --------------------------------------------------------
def _operations(rank: int, size: int) -> dict[str, Any]:
    out: dict[str, Any] = {"backend": dist.get_backend()}
    # torch: all_reduce_coalesced takes complex tensors beside their real dtype.
    xs = [
        np.full(3, rank + 1, np.float32),
        np.full(2, rank + 1j, np.complex64),
        np.arange(4, dtype=np.float32) * rank,
    ]
    dist.all_reduce_coalesced(xs)
    out["coalesced"] = [x.tolist() for x in xs]
    with pytest.raises(ValueError, match="cannot reduce complex and real arrays together"):
        dist.all_reduce_coalesced(xs, dist.ReduceOp.PRODUCT)
    # torch: complex tensors refuse MAX, MIN and the bitwise reductions in these words.
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.BAND):
        with pytest.raises(ValueError, match=f"all_reduce does not support ReduceOp.{op.name}"):
            dist.all_reduce(np.ones(2, np.complex64), op)
        with pytest.raises(ValueError, match=f"all_reduce does not support ReduceOp.{op.name}"):
            dist.all_reduce_coalesced([np.ones(2, np.complex64)], op)
    # torch: the work of a receive from any rank names the sender (source_rank()).
    if rank == 0:
        senders = []
        for _ in range(size - 1):
            buf = np.zeros(1, np.int64)
            work = dist.irecv(buf)
            work.wait()
            assert buf[0] == work.source_rank() == work._source_rank()
            senders.append(work.source_rank())
        out["senders"] = sorted(senders)
    else:
        dist.send(np.array([rank]), 0)
    with pytest.raises(ValueError, match=r"source_rank\(\) is the sender of a receive"):
        dist.all_reduce(np.ones(1), async_op=True).source_rank()

    # torch: pickle's own exception comes through the object collectives.
    class Bar:
        pass

    try:
        pickle.dumps(Bar())
    except Exception as exc:
        expected = type(exc)
    with pytest.raises(expected) as info:
        dist.all_gather_object([None] * size, Bar())
    out["pickling"] = isinstance(info.value, ValueError) and "cannot be pickled" in str(info.value)
    with pytest.raises(
        ValueError, match=r"^scatter_object_list: Expected argument scatter_object_o"
    ):
        dist.scatter_object_list([], [1] * size)
    # torch: new_subgroups splits the group each rank passes, ranks passing groups of their own.
    mine, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    sub, subs = dist.new_subgroups(group_size=1, group=mine)
    out["subgroups"] = (
        list(sub.ranks),
        [None if g is dist.NON_GROUP_MEMBER else list(g.ranks) for g in subs],
    )
    x = np.array([float(rank)])
    dist.all_reduce(x, group=sub)
    out["sub_sum"] = float(x[0])
    # torch: monitored_barrier names the rank that failed to pass it, and the others, that
    # one too when it comes later, learn it; the group goes on.
    if rank == 1:
        time.sleep(2)
    with pytest.raises(RuntimeError) as failed:
        dist.monitored_barrier(timeout=timedelta(seconds=1))
    out["monitored"] = str(failed.value)
    x = np.ones(1)
    dist.all_reduce(x)
    out["after"] = float(x[0])
    return out


def test_operations_behave_as_torchs() -> None:
    got = run_world_processes(_operations, 4, "gloo", timeout=90)
    for rank, out in enumerate(got):
        assert out["backend"] == "gloo"  # torch: get_backend() returns the name given
        assert out["coalesced"] == [[10.0] * 3, [6 + 4j] * 2, [0.0, 6.0, 12.0, 18.0]]
        assert out["pickling"] is True
        parent = [rank % 2, rank % 2 + 2]
        assert out["subgroups"] == ([rank], [[r] if r == rank else None for r in parent])
        assert out["sub_sum"] == rank
        assert out["after"] == 4.0
        if rank:
            assert out["monitored"].startswith(
                f"monitored_barrier: Rank {rank} successfully reached monitoredBarrier, but "
                "received errors while waiting for send/recv from rank 0: "
            )
    assert got[0]["senders"] == [1, 2, 3]
    assert got[0]["monitored"] == (
        "monitored_barrier: rank 0: Rank 1 failed to pass monitoredBarrier within 1 s"
    )
