"""A torch ``TCPStore`` client that runs every store operation, in the sequences torch's own
helpers use, and prints what each returned: ``python torch_store_client.py HOST PORT RANK
WORLD``. ``tests/test_torch_store_conformance.py`` runs it against torch's server and
aiodist's and compares the outputs.

Rank 0 of the clients is not special; the test process is the store's host, takes part in
the ``synchronize`` and ``barrier`` helpers as rank ``WORLD`` and pushes the shared queue's
items one at a time while every client waits in a blocking ``queue_pop``.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from typing import Any

import torch.distributed as td
from torch.distributed.elastic.utils.store import barrier, synchronize

host, port, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
results: list[Any] = []


def record(name: str, call: Any) -> None:
    """Run ``call()`` and record its result, or the type of what it raised."""
    try:
        value = call()
    except Exception as exc:
        results.append([name, "raised", type(exc).__name__])
        return
    if isinstance(value, bytes):
        value = value.decode()
    elif isinstance(value, list):
        value = [v.decode() if isinstance(v, bytes) else v for v in value]
    results.append([name, value])


store = td.TCPStore(host, port, None, False, timeout=timedelta(seconds=20))
store.set_timeout(timedelta(seconds=20))
me = f"c{rank}/"
# Every operation on keys of its own.
record("set", lambda: store.set(me + "k", "v"))
record("get", lambda: store.get(me + "k"))
record("check present", lambda: store.check([me + "k"]))
record("check missing", lambda: store.check([me + "missing"]))
record("add new", lambda: store.add(me + "n", 3))
record("add again", lambda: store.add(me + "n", -5))
record("get counter", lambda: store.get(me + "n"))
record("compare_set new", lambda: store.compare_set(me + "c", "", "a"))
record("compare_set wrong", lambda: store.compare_set(me + "c", "x", "b"))
record("compare_set right", lambda: store.compare_set(me + "c", "a", "b"))
record("compare_set missing", lambda: store.compare_set(me + "m", "x", "y"))
record("append new", lambda: store.append(me + "l", "1"))
record("append", lambda: store.append(me + "l", "2"))
record("get appended", lambda: store.get(me + "l"))
record("multi_set", lambda: store.multi_set([me + "a", me + "b"], ["A", "B"]))
record("multi_get", lambda: store.multi_get([me + "a", me + "b", me + "k"]))
record("delete present", lambda: store.delete_key(me + "a"))
record("delete missing", lambda: store.delete_key(me + "a"))
record("wait present", lambda: store.wait([me + "k", me + "b"]))
record("wait with timeout", lambda: store.wait([me + "k"], timedelta(seconds=5)))
# A timeout changed mid-session, then changed back: the connection stays in step.
store.set_timeout(timedelta(milliseconds=200))
record("get missing, short timeout", lambda: store.get(me + "never"))
record("wait missing, short timeout", lambda: store.wait([me + "never"]))
record("wait missing, own timeout", lambda: store.wait([me + "never"], timedelta(seconds=0.2)))
store.set_timeout(timedelta(seconds=20))
record("get after timeouts", lambda: store.get(me + "k"))
# Queues of its own: non-blocking and blocking pops.
record("queue_pop empty", lambda: store.queue_pop(me + "q", False))
record("queue_push", lambda: store.queue_push(me + "q", "x"))
record("queue_push 2", lambda: store.queue_push(me + "q", "y"))
record("queue_len", lambda: store.queue_len(me + "q"))
record("queue_pop", lambda: store.queue_pop(me + "q", False))
record("queue_pop blocking", lambda: store.queue_pop(me + "q", True))
record("queue_len empty", lambda: store.queue_len(me + "q"))
# torch's elastic helpers, with the host as rank ``world``.
record(
    "synchronize",
    lambda: synchronize(store, f"d{rank}".encode(), rank, world + 1, "sync/", timeout=20),
)
record("barrier", lambda: barrier(store, world + 1, "bar/", barrier_timeout=20))
record("compare_set election", lambda: store.compare_set("leader", "", f"{rank}") != b"")
record("add tickets", lambda: store.add("tickets", 1) <= world)
# The shared queue: the host pushes one item at a time while every client waits, each once
# the one before was taken. (A client that has its item polls instead of waiting again until
# every item is taken: torch's server, which wakes one waiter per push, leaves the woken
# client registered on the queue, and a later push would wake that client's next wait.)
store.set(f"in-pop/{rank}", "1")
item = store.queue_pop("work", True)
store.add("popped", 1)
while not store.check(["all-popped"]):
    time.sleep(0.01)
record("shared queue_pop", lambda: item.decode().startswith("item"))
record("final barrier", lambda: barrier(store, world + 1, "bar2/", barrier_timeout=20))
print(json.dumps({"rank": rank, "results": results, "item": item.decode()}))
