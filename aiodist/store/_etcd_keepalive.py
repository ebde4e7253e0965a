"""Keeping etcd leases alive from a thread of their own.

An etcd lease lives while its holder renews it; its keys vanish when it lapses. An
:class:`~aiodist.store.etcd.EtcdStore` ties its process's liveness to its lease, so the
renewals must not depend on the event loop the store serves: a rank whose loop is busy in a
long computation, or blocked in a call, is alive all the same. One daemon thread per process
(``aiodist-etcd-keepalive``) renews every lease of the process on a loop of its own, and tells
a lease's store, on the store's loop, when its lease could not be renewed in time. A forked
child starts without the thread and starts its own when it needs one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

from ..errors import DistError
from ._etcd_client import Endpoint, EtcdClient

__all__ = ["keep_alive"]

logger = logging.getLogger(__name__)


class _Keeper:
    """The process's keepalive thread and its loop (started on first use, again after a fork)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._loop: asyncio.AbstractEventLoop | None = None

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._pid != os.getpid():
                ready = threading.Event()
                loop = asyncio.new_event_loop()

                def main() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    loop.run_forever()

                threading.Thread(target=main, name="aiodist-etcd-keepalive", daemon=True).start()
                ready.wait()
                self._loop, self._pid = loop, os.getpid()
            return self._loop


_keeper = _Keeper()


async def _renew(
    endpoints: Sequence[Endpoint],
    lease_id: int,
    ttl: int,
    peer_timeout: float,
    on_lost: Callable[[str], None],
) -> None:
    client = EtcdClient(endpoints, connect_timeout=ttl / 3, peer_timeout=peer_timeout)
    # The lease lapses at ``expires`` unless renewed before: each answer moves it. Only etcd
    # can say that it lapsed, though: a renewal that cannot get through in time (the member
    # it went to died, the cluster is electing a leader) has not lost the lease, since a new
    # leader extends every lease by its time to live; the renewals go on until one is
    # answered, which says whether the lease still lives. (Deciding it lost at ``expires``
    # made a process whose member died with the leader give up a lease that still lived.)
    expires = time.monotonic() + ttl
    try:
        while True:
            await asyncio.sleep(ttl / 3)
            sent = time.monotonic()
            try:
                async with asyncio.timeout(ttl):
                    answer = await client.call("/v3/lease/keepalive", {"ID": str(lease_id)})
            except (DistError, TimeoutError) as exc:
                if "lease not found" in str(exc):
                    on_lost(f"its etcd lease {lease_id:x} had lapsed when it was renewed")
                    return
                log = logger.warning if time.monotonic() >= expires else logger.debug
                log("renewing etcd lease %x failed, trying again: %s", lease_id, exc or "timeout")
                continue
            left = int(answer.get("TTL", 0))
            if left <= 0:
                on_lost(f"its etcd lease {lease_id:x} had lapsed when it was renewed")
                return
            expires = sent + left
    finally:
        client.close()


def keep_alive(
    endpoints: Sequence[Endpoint],
    lease_id: int,
    ttl: int,
    peer_timeout: float,
    on_lost: Callable[[str], None],
) -> Callable[[], None]:
    """Renew the lease ``lease_id`` every ``ttl / 3`` seconds from the keepalive thread.

    ``on_lost(reason)`` is called, on the caller's event loop, if a renewal does not succeed
    before the lease lapses. Returns a function that stops renewing (callable from any
    thread; calling it twice is harmless).
    """
    caller = asyncio.get_running_loop()

    def lost(reason: str) -> None:
        with contextlib.suppress(RuntimeError):  # the store's loop has closed: nobody to tell
            caller.call_soon_threadsafe(on_lost, reason)

    loop = _keeper.loop()
    future = asyncio.run_coroutine_threadsafe(
        _renew(endpoints, lease_id, ttl, peer_timeout, lost), loop
    )

    def stop() -> None:
        if not loop.is_closed():
            loop.call_soon_threadsafe(future.cancel)

    return stop
