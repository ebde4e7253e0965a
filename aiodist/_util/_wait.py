"""When a waiting rank polls and when it sleeps: the one wait policy of every layer.

A rank that waits for a peer can poll for a moment before it sleeps: when the answer comes
within microseconds (a peer on the same host answering a small message), polling saves the
cost of going to sleep and being woken again, tens of microseconds on a virtual machine. It
costs a CPU meanwhile, which is free only when this host's ranks fit on its CPUs. Every
layer that waits asks here:

* the blocking facade, waiting for the loop thread to finish an operation
  (:mod:`aiodist.sync._loop_thread`);
* a TCP receive, reading its sockets before the loop sleeps (:mod:`aiodist.transport.tcp`);
* the shared-memory rings of the transport and the barriers of a node workspace
  (:mod:`aiodist.transport.shm`, :mod:`aiodist.collectives.shm_workspace`);
* a large collective, keeping its event loop from sleeping while its data flows
  (:mod:`aiodist.collectives._common`).

The policy:

* **whether to poll**: only when this host's ranks fit on the CPUs this process may use
  (:func:`ranks_fit`); with more ranks than CPUs every poll takes a CPU from a rank that
  works. A shared-memory barrier on such a host still polls, for
  :data:`OVERSUBSCRIBED_SPIN_SECONDS`, giving the CPU away at every round: there a wait
  that ends while polling costs no trip through the scheduler;
* **how long**: :data:`SPIN_SECONDS`; pure polling for the first :data:`HOT_SPIN_SECONDS`,
  then giving the CPU away (``sched_yield``) at every round, so that a peer that needs the
  CPU gets it (:func:`spin_until`);
* **backing off**: after :data:`POLL_MISSES` polls in a row that ran out of time (the peer is
  slow, or the CPUs are busy) the next :data:`POLL_SKIP` waits sleep at once, then polling
  gets another chance (:class:`Backoff`). A skip that grew with each miss never recovers
  once both ranks of an exchange skip: each then waits for the other's wake-up, longer than
  a poll lasts, so every later poll misses too;
* **keeping a loop awake**: a rank that moves :data:`AWAKE_BYTES` or more in one operation
  keeps its event loop polling its sockets instead of sleeping, while its ranks fit the CPUs
  and the machine has no more runnable threads than CPUs (:func:`may_stay_awake`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

__all__ = [
    "AWAKE_BYTES",
    "HOT_SPIN_SECONDS",
    "OVERSUBSCRIBED_SPIN_SECONDS",
    "POLL_MISSES",
    "POLL_SKIP",
    "SPIN_SECONDS",
    "Backoff",
    "local_ranks",
    "may_stay_awake",
    "ranks_fit",
    "runnable_threads",
    "spin_until",
    "usable_cpus",
]

#: Seconds a wait polls before it sleeps, when it polls at all.
SPIN_SECONDS = 50e-6
#: Seconds of pure polling before each round also gives the CPU away.
HOT_SPIN_SECONDS = 5e-6
#: Seconds a shared-memory barrier polls, giving the CPU away at every round, when the host
#: has more ranks than CPUs (4 ranks on 2 CPUs: all_reduce 8 B 140-210 µs without, 76 µs
#: with, ``bench/latency.py``). An idle rank still sleeps.
OVERSUBSCRIBED_SPIN_SECONDS = 200e-6
#: Polls in a row that ran out of time before the next :data:`POLL_SKIP` waits sleep at once.
POLL_MISSES = 3
POLL_SKIP = 8
#: Bytes one rank sends or receives in one operation from which it keeps its loop awake.
AWAKE_BYTES: int | None = 1 << 20

_usable_cpus: int | None = None
#: How long a reading of the machine's runnable threads is trusted, in seconds.
_RUNNABLE_TTL = 0.002
_runnable: tuple[float, int] = (-1.0, 0)


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    global _usable_cpus
    if _usable_cpus is None:
        affinity = getattr(os, "sched_getaffinity", None)
        _usable_cpus = len(affinity(0)) if affinity is not None else os.cpu_count() or 1
    return _usable_cpus


def local_ranks(known: int) -> int:
    """How many ranks run on this host: ``$LOCAL_WORLD_SIZE`` (every group's ranks on the
    host, as launchers count them) when set, else ``known``; 0 for a value that is not a
    number (then nothing fits)."""
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE") or known)
    except ValueError:
        return 0


def ranks_fit(ranks: int) -> bool:
    """Whether ``ranks`` ranks of this host fit on the CPUs this process may use."""
    return 0 < ranks <= usable_cpus()


def runnable_threads() -> int:
    """Threads running or waiting for a CPU on this machine now (``/proc/loadavg``), read
    at most every 2 ms; 0 where the kernel does not say."""
    global _runnable
    now = time.monotonic()
    if now - _runnable[0] > _RUNNABLE_TTL:
        try:
            with open("/proc/loadavg", "rb") as f:
                count = int(f.read().split()[3].split(b"/")[0])
        except (OSError, ValueError, IndexError):
            count = 0
        _runnable = (now, count)
    return _runnable[1]


def may_stay_awake(ranks: int, nbytes: int) -> bool:
    """Whether a rank that moves ``nbytes`` in one operation of a group of ``ranks`` keeps
    its event loop polling instead of sleeping until the operation is done.

    A loop asleep in ``epoll_wait`` has to be woken by the peer's kernel for every burst of
    data that lands (a receiver) or every window of buffer space that frees (a sender): an
    inter-processor interrupt, paid on loopback by the CPU that moves the bytes, the
    bottleneck of a large transfer. Only while the machine has no more runnable threads than
    usable CPUs: beside other busy processes a polling loop takes turns from the ranks that
    move the data (two CPU hogs beside two ranks: a 4 MiB broadcast 1.6 -> 5.2 ms with
    polling regardless, unchanged with this check). Measured on 2 ranks over loopback, quiet
    machine: a 4 MiB broadcast 1006 -> 663 µs, 16 MiB 4.6 -> 2.9 ms, 64 MiB 15.9 -> 12.5 ms.
    """
    return (
        AWAKE_BYTES is not None
        and nbytes >= AWAKE_BYTES
        and ranks_fit(max(local_ranks(ranks), ranks))
        and runnable_threads() <= usable_cpus()
    )


def spin_until(done: Callable[[], bool], seconds: float) -> bool:
    """Call ``done()`` until it is true or ``seconds`` have passed; return its last answer.

    Pure polling for :data:`HOT_SPIN_SECONDS`, then each round gives the CPU (and the GIL)
    away first, so that a peer or the loop thread that needs it runs meanwhile.
    """
    if done():
        return True
    now = time.perf_counter
    start = now()
    hot, end = start + HOT_SPIN_SECONDS, start + seconds
    while True:
        t = now()
        if t >= end:
            return done()
        if t >= hot:
            os.sched_yield()
        if done():
            return True


class Backoff:
    """The backing off of one kind of wait: after :data:`POLL_MISSES` polls in a row that
    ran out of time, the next :data:`POLL_SKIP` waits do not poll."""

    __slots__ = ("_misses", "_skip")

    def __init__(self) -> None:
        self._misses = 0
        self._skip = 0

    def __repr__(self) -> str:
        return f"<Backoff misses={self._misses} skip={self._skip}>"

    def skips(self) -> bool:
        """Whether this wait sleeps without polling (and counts it)."""
        if self._skip:
            self._skip -= 1
            return True
        return False

    def polled(self, answered: bool) -> None:
        """Record how a poll ended: answered in time, or not."""
        if answered:
            self._misses = 0
            return
        self._misses += 1
        if self._misses >= POLL_MISSES:
            self._misses = 0
            self._skip = POLL_SKIP
