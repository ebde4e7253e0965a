"""barrier by dissemination, and torch's monitored barrier."""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from .._arrays._intake import byte_view
from ..errors import DistTimeoutError
from ..transport.base import OpComm, fails_alone
from ._common import EMPTY, Flight

__all__ = ["barrier", "monitored_barrier"]

logger = logging.getLogger(__name__)


async def barrier(comm: OpComm) -> None:
    """Return once every rank of ``comm`` has entered the barrier.

    Dissemination: in round ``k`` rank ``r`` signals ``r + 2**k`` and waits for
    ``r - 2**k``; after ``ceil(log2 n)`` rounds every rank has heard, directly or through
    others, from every rank. Messages are empty.

    Args:
        comm: This operation's view of the group.

    Raises:
        DistNetworkError: a peer was lost.
    """
    n, rank = comm.size, comm.rank
    flight = Flight()
    try:
        dist, step = 1, 0
        while dist < n:
            recv = flight.add(comm.recv_into((rank - dist) % n, step, memoryview(bytearray())))
            flight.add(comm.send((rank + dist) % n, step, EMPTY))
            await recv
            dist <<= 1
            step += 1
        await flight.drain()
    except BaseException:
        flight.abandon()
        raise


async def monitored_barrier(
    comm: OpComm, ranks: tuple[int, ...], seconds: float | None, wait_all_ranks: bool
) -> None:
    """A barrier through rank 0 that names the ranks that did not arrive within ``seconds``.

    Every other rank signals rank 0 and waits for its answer; rank 0 waits for each (for
    all of them with ``wait_all_ranks``, else up to the first missing) and answers every
    rank: go on, or the barrier failed. On failure rank 0 raises ``DistTimeoutError``
    naming the missing ranks (``ranks`` gives their global ranks), in torch's words
    (``Rank 1 failed to pass monitoredBarrier``), and so does every rank that arrived, or
    that arrives later (``Rank 2 successfully reached monitoredBarrier, but received errors
    while waiting for send/recv from rank 0``). Every rank learns the same outcome, so only
    this operation fails: the group goes on, as torch's does.
    """
    token = np.zeros(1, np.uint8)
    me, root = ranks[comm.rank], ranks[0]
    if comm.rank != 0:
        await comm.send(0, 0, byte_view(token))
        release = comm.recv_into(0, 1, byte_view(token))
        # Rank 0 decides within ``seconds`` of its own arrival: wait for its answer twice as
        # long (it may have come later than this rank), so that only a rank 0 that is gone
        # or stuck leaves this rank to time out on its own.
        within = None if seconds is None else 2 * seconds
        done, _ = await asyncio.wait([release], timeout=within)
        errors = (
            f"monitored_barrier: Rank {me} successfully reached monitoredBarrier, but received "
            f"errors while waiting for send/recv from rank {root}"  # torch's words
        )
        if not done:
            raise DistTimeoutError(f"{errors}: rank {root} did not answer within {within:g} s")
        release.result()
        if token[0]:
            raise fails_alone(
                DistTimeoutError(
                    f"{errors}: a rank did not reach it within {seconds:g} s (rank {root}'s "
                    "error names it)"
                )
            )
        return
    bufs = {r: np.zeros(1, np.uint8) for r in range(1, comm.size)}
    arrivals = {comm.recv_into(r, 0, byte_view(b)): r for r, b in bufs.items()}
    loop = asyncio.get_running_loop()
    deadline = None if seconds is None else loop.time() + seconds
    missing: list[int] = []
    for fut, r in arrivals.items():
        left = None if deadline is None else max(0.0, deadline - loop.time())
        done, _ = await asyncio.wait([fut], timeout=left)
        if done:
            fut.result()
        else:
            missing.append(ranks[r])
            if not wait_all_ranks:
                break
    # The answer, 1 if the barrier failed, goes to the missing ranks too: if one calls it
    # later, it fails at once instead of waiting for a rank 0 that has gone on.
    token[0] = 1 if missing else 0
    await asyncio.gather(*(comm.send(r, 1, byte_view(token)) for r in bufs))
    if missing:
        named = (
            f"Rank {missing[0]}" if len(missing) == 1 else f"Ranks {', '.join(map(str, missing))}"
        )
        raise fails_alone(
            DistTimeoutError(
                f"monitored_barrier: rank {root}: {named} failed to pass monitoredBarrier "
                f"within {seconds:g} s"
            )
        )
