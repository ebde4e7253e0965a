"""torch's TCPStore clients sharing a queue of work items, on aiodist's server and on torch's.

torch's client pops in two requests: a WAIT on the queue's key, then a POP. With several
clients blocked in ``queue_pop``, the server's choice of whom a push wakes, and when, must
leave no woken client without an item. The job (``tests/torch_queue_client.py``) runs torch's
elastic helpers first, then each client takes one item while the host pushes them one at a
time, round after round, beside two processes that keep the CPUs busy; the same rounds run
against torch's own server as the reference.

aiodist's server promises the item to the woken client until it pops (``store/_state.py``);
the tests with raw torch-wire connections state what that guarantees where torch's server
does not: a client whose wait arrives between another's wake and its pop waits for the next
item instead of taking that one.
"""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.torch, pytest.mark.multiprocess]
torch_distributed = pytest.importorskip("torch.distributed")
elastic = pytest.importorskip("torch.distributed.elastic.utils.store")

import aiodist.sync as dist  # noqa: E402
from aiodist.store import _wire  # noqa: E402

HOST = "127.0.0.1"
CLIENT = Path(__file__).parent / "torch_queue_client.py"
CLIENTS = 3


@pytest.fixture
def busy_cpus() -> Iterator[None]:
    """Two processes spinning on the CPUs for the test's duration."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def _servers() -> dict[str, Callable[[], Any]]:
    timeout = timedelta(seconds=60)
    return {
        "aiodist": lambda: dist.TCPStore(HOST, 0, None, True, timeout=timeout),
        "torch": lambda: torch_distributed.TCPStore(
            HOST, 0, None, True, timeout=timeout, wait_for_workers=False
        ),
    }


def _blocked_in_poll(pid: int) -> bool:
    """Whether the process sleeps in ``poll``: a torch client waiting for a reply."""
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return "poll" in f.read()
    except OSError:
        return False


def _until(done: Callable[[], bool], procs: list[subprocess.Popen[str]], what: str) -> None:
    deadline = time.monotonic() + 30
    while not done():
        failed = [p.returncode for p in procs if p.poll() is not None]
        assert not failed, f"clients exited with {failed} while the host waited for {what}"
        assert time.monotonic() < deadline, f"the host waited 30 s for {what}"
        time.sleep(0.002)


def _host_rounds(store: Any, rounds: int) -> list[dict[str, Any]]:
    """Run the host's side of ``rounds`` rounds with torch clients; their JSON lines."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(CLIENT), HOST, str(store.port), str(r), str(CLIENTS), str(rounds)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(CLIENTS)
    ]
    try:
        for n in range(rounds):
            r = f"r{n}/"
            elastic.synchronize(store, b"host", CLIENTS, CLIENTS + 1, r + "sync/", timeout=30)
            elastic.barrier(store, CLIENTS + 1, r + "bar/", barrier_timeout=30)
            store.set(r + "go", "1")
            store.wait([f"{r}in-pop/{c}" for c in range(CLIENTS)], timedelta(seconds=30))
            # Every client is inside its blocking pop: torch's server would give a wait
            # that arrives after a push the item promised to the client it woke.
            _until(lambda: all(_blocked_in_poll(p.pid) for p in procs), procs, "the pops")
            time.sleep(0.05)
            for i in range(CLIENTS):
                store.queue_push(r + "work", f"item{i}")
                _until(
                    lambda r=r, i=i: (
                        store.check([r + "popped"]) and int(store.get(r + "popped")) > i
                    ),
                    procs,
                    f"round {n}'s item {i} to be taken",
                )
            store.set(r + "all-popped", "1")
            elastic.barrier(store, CLIENTS + 1, r + "bar2/", barrier_timeout=30)
    except BaseException as exc:
        for p in procs:
            p.kill()
        said = "\n".join(p.communicate()[1][-2000:] for p in procs)
        raise AssertionError(f"the host failed: {exc!r}; the clients said:\n{said}") from exc
    outputs = [p.communicate(timeout=60) for p in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
    return [json.loads(line) for out, _ in outputs for line in out.splitlines()]


def _check_rounds(lines: list[dict[str, Any]], rounds: int) -> None:
    assert len(lines) == CLIENTS * rounds
    for n in range(rounds):
        mine = sorted((x for x in lines if x["round"] == n), key=lambda x: x["rank"])
        # One item each: none got QueueEmptyError, none got two.
        assert sorted(x["item"] for x in mine) == [f"item{i}" for i in range(CLIENTS)]
        for x in mine:
            assert x["gathered"] == ["d0", "d1", "d2", "host"]
            assert x["go"] == "1" and x["ready"] is True
        assert len({x["leader"] for x in mine}) == 1  # one election winner, seen by all
        assert sorted(x["ticket"] for x in mine) == [1, 2, 3]


def _run(server: str, rounds: int) -> None:
    store = _servers()[server]()
    try:
        _check_rounds(_host_rounds(store, rounds), rounds)
    finally:
        if server == "aiodist":
            store.close()
        del store


@pytest.mark.parametrize("server", ["aiodist", "torch"])
def test_torch_clients_share_a_queue(server: str, busy_cpus: None) -> None:
    _run(server, 3)


@pytest.mark.torch_suite
@pytest.mark.timeout(600)
@pytest.mark.parametrize("server", ["aiodist", "torch"])
def test_torch_clients_share_a_queue_50_rounds(server: str, busy_cpus: None) -> None:
    _run(server, 50)


# -- aiodist's server: the item a wait was answered for ---------------------------------
_VALIDATE = bytes([_wire.TorchOp.VALIDATE]) + struct.pack("<I", _wire.TORCH_VALIDATE_MAGIC)
_KEY = b"/work"  # torch's clients put "/" before every key


def _torch_conn(port: int) -> socket.socket:
    sock = socket.create_connection((HOST, port), timeout=5)
    sock.sendall(_VALIDATE)
    return sock


def _answered(sock: socket.socket, within: float) -> bool:
    """Whether a STOP_WAITING arrives within ``within`` seconds."""
    sock.settimeout(within)
    try:
        reply = sock.recv(1)
    except TimeoutError:
        return False
    finally:
        sock.settimeout(5)
    assert reply == bytes([_wire.TORCH_STOP_WAITING])
    return True


def _pop(sock: socket.socket) -> bytes | None:
    sock.sendall(_wire.torch_request(_wire.TorchOp.QUEUE_POP, _KEY))
    (count,) = struct.unpack("<q", _recv(sock, 8))
    if count <= 0:
        return None
    (size,) = struct.unpack("<Q", _recv(sock, 8))
    return _recv(sock, size)


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "the server closed the connection"
        data += chunk
    return data


@pytest.fixture
def aiodist_store() -> Iterator[Any]:
    store = dist.TCPStore(HOST, 0, None, True, timeout=timedelta(seconds=30))
    try:
        yield store
    finally:
        store.close()


def test_a_wait_after_a_wake_waits_for_the_next_item(aiodist_store: Any) -> None:
    first, late = _torch_conn(aiodist_store.port), _torch_conn(aiodist_store.port)
    with first, late:
        first.sendall(_wire.torch_request(_wire.TorchOp.WAIT, [_KEY]))
        aiodist_store.queue_push("work", "item0")
        assert _answered(first, 5)
        # A wait that arrives before the woken client's pop: torch's server answers it at
        # once, and one of the two pops then finds the queue empty.
        late.sendall(_wire.torch_request(_wire.TorchOp.WAIT, [_KEY]))
        assert not _answered(late, 0.3)
        assert aiodist_store.queue_len("work") == 1
        assert not aiodist_store.check(["work"])  # the item is taken, if not yet popped
        assert _pop(first) == b"item0"
        aiodist_store.queue_push("work", "item1")
        assert _answered(late, 5)
        assert _pop(late) == b"item1"
        assert aiodist_store.queue_len("work") == 0


def test_a_promised_item_goes_to_the_next_waiter_when_its_client_moves_on(
    aiodist_store: Any,
) -> None:
    first, second, third = (_torch_conn(aiodist_store.port) for _ in range(3))
    with first, second, third:
        aiodist_store.queue_push("work", "item0")
        first.sendall(_wire.torch_request(_wire.TorchOp.WAIT, [_KEY]))
        assert _answered(first, 5)  # answered at once: the item is promised to it
        second.sendall(_wire.torch_request(_wire.TorchOp.WAIT, [_KEY]))
        third.sendall(_wire.torch_request(_wire.TorchOp.WAIT, [_KEY]))
        assert not _answered(second, 0.2)
        # A plain wait (``store.wait(["work"])``), then another request: the item is free.
        first.sendall(_wire.torch_request(_wire.TorchOp.CHECK, [_KEY]))
        assert _recv(first, 1) == bytes([_wire.TORCH_NOT_READY])  # promised to the next
        assert _answered(second, 5)
        # The client that was promised it goes away before its pop: the next one gets it.
        second.close()
        assert _answered(third, 5)
        assert _pop(third) == b"item0"


def test_a_non_blocking_pop_leaves_an_item_for_the_promised_client(aiodist_store: Any) -> None:
    waiter = _torch_conn(aiodist_store.port)
    with waiter:
        waiter.sendall(_wire.torch_request(_wire.TorchOp.WAIT, [_KEY]))
        aiodist_store.queue_push("work", "item0")
        assert _answered(waiter, 5)
        with pytest.raises(dist.QueueEmptyError):
            aiodist_store.queue_pop("work", False)
        # Pops keep the queue's order: the promise is one item, not a particular one.
        aiodist_store.queue_push("work", "item1")
        assert aiodist_store.queue_pop("work", False) == b"item0"
        assert _pop(waiter) == b"item1"
