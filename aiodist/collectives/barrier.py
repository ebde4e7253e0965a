"""barrier by dissemination, and torch's monitored barrier."""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from .._arrays import byte_view
from ..errors import DistTimeoutError
from ..transport.base import OpComm
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

    Every other rank signals rank 0 and waits to be released; rank 0 waits for each (for
    all of them with ``wait_all_ranks``, else up to the first missing) and raises
    ``DistTimeoutError`` naming the missing ranks (``ranks`` gives their global ranks).
    """
    token = np.zeros(1, np.uint8)
    if comm.rank != 0:
        await comm.send(0, 0, byte_view(token))
        release = comm.recv_into(0, 1, byte_view(token))
        done, _ = await asyncio.wait([release], timeout=seconds)
        if not done:
            raise DistTimeoutError(
                f"monitored_barrier: rank {ranks[comm.rank]} was not released by rank "
                f"{ranks[0]} within {seconds:g} s"
            )
        release.result()
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
    if missing:
        raise DistTimeoutError(
            f"monitored_barrier: rank {ranks[0]}: "
            f"{'rank' if len(missing) == 1 else 'ranks'} {', '.join(map(str, missing))} "
            f"failed to pass the monitored barrier within {seconds:g} s"
        )
    await asyncio.gather(*(comm.send(r, 1, byte_view(token)) for r in bufs))
