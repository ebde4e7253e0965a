"""A torch ``TCPStore`` client of a job whose workers share a queue of work items:
``python torch_queue_client.py HOST PORT RANK CLIENTS ROUNDS``.

Each round, under keys of its own (``r<round>/``), the client runs what an elastic job's
workers do before they take work: torch's ``synchronize`` and ``barrier`` helpers (the host,
``tests/test_torch_store_queue.py``, takes part as rank ``CLIENTS``), a ``compare_set``
election, an ``add`` ticket, ``wait`` for the host's go, ``multi_get``, ``check`` and
``append``; then it takes one item with a blocking ``queue_pop`` while the host pushes the
items one at a time, and meets the others in a second barrier. It prints one JSON line per
round: what it popped, and what the steps before returned.

Between its pop and the second barrier it polls with ``check`` rather than waiting: torch's
server, which wakes one waiter per push, leaves the woken client registered on the queue, and
a later push would wake that client's next wait instead of a client blocked in its pop.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta

import torch.distributed as td
from torch.distributed.elastic.utils.store import barrier, synchronize

host, port, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
clients, rounds = int(sys.argv[4]), int(sys.argv[5])
store = td.TCPStore(host, port, None, False, timeout=timedelta(seconds=30))
for n in range(rounds):
    r = f"r{n}/"
    gathered = synchronize(store, f"d{rank}".encode(), rank, clients + 1, r + "sync/", 30)
    barrier(store, clients + 1, r + "bar/", barrier_timeout=30)
    leader = store.compare_set(r + "leader", "", str(rank)).decode()
    ticket = store.add(r + "tickets", 1)
    store.wait([r + "go"])
    go, _ = store.multi_get([r + "go", r + "leader"])
    ready = store.check([r + "tickets", r + "go"])
    store.append(r + "log", f"{rank};")
    store.set(f"{r}in-pop/{rank}", "1")
    item = store.queue_pop(r + "work", True).decode()
    store.add(r + "popped", 1)
    while not store.check([r + "all-popped"]):
        time.sleep(0.005)
    barrier(store, clients + 1, r + "bar2/", barrier_timeout=30)
    line = {
        "rank": rank,
        "round": n,
        "item": item,
        "gathered": [g.decode() for g in gathered],
        "leader": leader,
        "ticket": ticket,
        "go": go.decode(),
        "ready": ready,
    }
    print(json.dumps(line), flush=True)
