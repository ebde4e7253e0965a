"""torch's TCPStore clients get from aiodist's server exactly what they get from torch's.

Three torch clients at once run every store operation (``tests/torch_store_client.py``), in
the sequences torch's elastic helpers use (``synchronize``, ``barrier``), with timeouts
changed mid-session, non-blocking and blocking queue pops, and a shared queue whose items
the host pushes one at a time while every client waits in a blocking pop (where aiodist's
server used to wake every waiter for one item: two of three clients got
``QueueEmptyError``). The same run against torch's own server is the reference, in the
same test.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.torch, pytest.mark.multiprocess]
torch_distributed = pytest.importorskip("torch.distributed")
elastic = pytest.importorskip("torch.distributed.elastic.utils.store")

import aiodist.sync as dist  # noqa: E402

HOST = "127.0.0.1"
CLIENT = Path(__file__).parent / "torch_store_client.py"
CLIENTS = 3


def run_with(store: Any) -> list[dict[str, Any]]:
    """Host ``store``'s side of the run while the torch clients run theirs; their outputs."""
    port = store.port
    procs = [
        subprocess.Popen(
            [sys.executable, str(CLIENT), HOST, str(port), str(r), str(CLIENTS)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(CLIENTS)
    ]
    try:
        gathered = elastic.synchronize(store, b"host", CLIENTS, CLIENTS + 1, "sync/", timeout=30)
        assert gathered == [b"d0", b"d1", b"d2", b"host"]
        elastic.barrier(store, CLIENTS + 1, "bar/", barrier_timeout=30)
        store.wait([f"in-pop/{r}" for r in range(CLIENTS)], timedelta(seconds=30))
        time.sleep(0.3)  # every client is inside its blocking pop now
        for i in range(CLIENTS):
            store.queue_push("work", f"item{i}")
            while not store.check(["popped"]) or int(store.get("popped")) <= i:
                failed = [p.returncode for p in procs if p.poll()]
                assert not failed, f"clients exited with {failed} while the queue was served"
                time.sleep(0.01)
        store.set("all-popped", "1")
        elastic.barrier(store, CLIENTS + 1, "bar2/", barrier_timeout=30)
    except Exception as exc:
        for p in procs:
            p.kill()
        errors = "\n".join(p.communicate()[1] for p in procs)
        raise AssertionError(f"the host failed: {exc!r}; the clients said:\n{errors}") from exc
    outputs = [p.communicate(timeout=60) for p in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
    return [json.loads(out) for out, _ in outputs]


def test_torch_clients_get_the_same_replies_from_both_servers() -> None:
    timeout = timedelta(seconds=60)
    reference = torch_distributed.TCPStore(
        HOST, 0, None, True, timeout=timeout, wait_for_workers=False
    )
    try:
        torch_runs = run_with(reference)
    finally:
        del reference
    ours = dist.TCPStore(HOST, 0, None, True, timeout=timeout, wait_for_workers=False)
    try:
        aiodist_runs = run_with(ours)
    finally:
        ours.close()
    for theirs, mine in zip(torch_runs, aiodist_runs, strict=True):
        assert mine["results"] == theirs["results"], (mine["rank"], mine, theirs)
    # One item each: none got QueueEmptyError, none got two.
    for runs in (torch_runs, aiodist_runs):
        assert sorted(r["item"] for r in runs) == [f"item{i}" for i in range(CLIENTS)]
