"""Two-level collectives, for groups spread over hosts with several ranks on some of them.

The ranks of a host work together first (over shared memory, where they have it), and only
what the other hosts need crosses the network, once. A host's ranks share that traffic
in *columns*: column ``j`` of a host is carried by its local rank ``j mod k`` (``k`` ranks on
the host), and the ranks that carry column ``j``, one per host, run a flat algorithm of
:mod:`aiodist.collectives` among themselves. With ``k`` ranks on every host, every rank
carries one column and every socket towards the network works; a host with fewer ranks
carries several columns per rank. ``all_reduce`` of ``S`` bytes thus sends
``2(H-1)/H x S`` per host across the network (``H`` hosts), where a flat ring through every
rank sends about ``2 x S`` (``2(N-1)/N x S``, ``N`` ranks) from a host whose ranks are
consecutive, and more from one whose ranks are not.

Each phase of an algorithm runs on its own :meth:`~aiodist.transport.base.OpComm.part` of
the operation (1 and 2 within the host, from 3 on across hosts), so phases and columns run
side by side without their messages meeting. Every rank ends with bitwise the same
result: each element is reduced once, on one rank, and copied from there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .._arrays._intake import byte_view
from .._arrays._reduce import ReduceOp, finish_into, reduce_into
from ..transport.base import PHASES, OpComm
from ._common import (
    EMPTY,
    READY_BYTES,
    YIELD_BYTES,
    Dataflow,
    Flight,
    copy_into,
    num_chunks,
    split,
)
from .all_reduce import RING_THRESHOLD_BYTES, all_reduce as flat_all_reduce
from .barrier import barrier as flat_barrier
from .gather import all_gather as flat_all_gather
from .tree import broadcast as flat_broadcast, reduce as flat_reduce

__all__ = [
    "HostPlan",
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "reduce",
    "reduce_scatter",
]

Array = npt.NDArray[Any]

# The phases of an operation (see OpComm.part): within the host, then across hosts, where
# column j takes phase _ACROSS + j. (all_reduce numbers each segment's phases apart.)
_GATHER, _SPREAD, _ACROSS = 1, 2, 3

#: all_reduce moves larger messages in segments of about this many bytes.
SEGMENT_BYTES = 4 << 20
_SEGMENTS_IN_FLIGHT = 2


class HostPlan:
    """A group's ranks by host, as one of its ranks sees them.

    Args:
        hosts: the group's ranks by host, each host's in order.
        rank: this rank (of the group).

    Attributes:
        hosts: as given.
        mine: the ranks of this rank's host.
        local: this rank's place on its host.
        width: the number of columns (the most ranks any host has).
    """

    __slots__ = ("_host_of", "hosts", "local", "mine", "width")

    def __init__(self, hosts: Sequence[tuple[int, ...]], rank: int) -> None:
        self.hosts = tuple(hosts)
        self._host_of = {r: h for h in self.hosts for r in h}
        self.mine = self._host_of[rank]
        self.local = self.mine.index(rank)
        self.width = max(len(h) for h in self.hosts)

    def __repr__(self) -> str:
        return f"<HostPlan {[list(h) for h in self.hosts]}, this rank {self.mine[self.local]}>"

    @classmethod
    def of_group(
        cls, world_hosts: Sequence[Sequence[int]] | None, ranks: Sequence[int], rank: int
    ) -> HostPlan | None:
        """The plan of the group of global ``ranks`` (``rank`` is this one's group rank)
        in a world whose ranks are on ``world_hosts``, or ``None`` when two levels gain
        nothing: the hosts are unknown, the group is on one host, or each of its hosts has
        one of its ranks."""
        if world_hosts is None:
            return None
        place = {g: i for i, g in enumerate(ranks)}
        hosts = [tuple(sorted(place[g] for g in h if g in place)) for h in world_hosts]
        hosts = sorted(h for h in hosts if h)
        if len(hosts) < 2 or all(len(h) == 1 for h in hosts):
            return None
        return cls(hosts, rank)

    def column(self, j: int) -> tuple[int, ...]:
        """The ranks that carry column ``j`` across hosts, one per host."""
        return tuple(h[j % len(h)] for h in self.hosts)

    def carrier(self, r: int) -> int:
        """The rank of this host that carries rank ``r``'s column (``r``'s place on its
        host)."""
        return self.mine[self._host_of[r].index(r) % len(self.mine)]

    def representative(self, root: int) -> tuple[tuple[int, ...], int]:
        """The ranks that stand for their hosts in an operation rooted at ``root`` (the root
        for its host, the first rank for the others), and the one of this host."""
        reps = tuple(root if root in h else h[0] for h in self.hosts)
        return reps, root if root in self.mine else self.mine[0]


async def all_reduce(comm: OpComm, plan: HostPlan, x: Array, op: ReduceOp) -> None:
    """:func:`aiodist.collectives.all_reduce` in two levels: the host's ranks reduce each
    column onto its carrier, the carriers of a column all-reduce it across hosts, and each
    carrier copies its columns to the rest of its host.

    Below :data:`~aiodist.collectives.RING_THRESHOLD_BYTES` the message is one column
    (the host's first rank carries it, fewest messages); from there on it is cut into
    ``plan.width`` columns, so that every rank carries its share across the network. From
    :data:`SEGMENT_BYTES` on, it moves in segments, two at a time, so that one crosses the
    network while the host works on the next.
    """
    flat = x.reshape(-1)
    phases = 2 + plan.width  # of one segment: within the host twice, and each column
    count = min(num_chunks(x.nbytes, SEGMENT_BYTES), (PHASES - 1) // phases)
    segments = split(flat.size, count)
    await _run(
        [
            _all_reduce_segment(comm, plan, flat[lo:hi], op, 1 + s * phases)
            for s, (lo, hi) in enumerate(segments)
        ],
        window=_SEGMENTS_IN_FLIGHT,
    )


async def _all_reduce_segment(
    comm: OpComm, plan: HostPlan, flat: Array, op: ReduceOp, first_phase: int
) -> None:
    raw = ReduceOp.SUM if op is ReduceOp.AVG else op
    pieces = split(flat.size, plan.width if flat.nbytes >= RING_THRESHOLD_BYTES else 1)
    k = len(plan.mine)
    gather, spread, across = first_phase, first_phase + 1, first_phase + 2
    if k > 1:
        blocks = [(flat[lo:hi], flat[lo:hi], j % k) for j, (lo, hi) in enumerate(pieces)]
        await _reduce_onto_carriers(comm.part(plan.mine, gather), blocks, raw)

    async def column(j: int) -> None:
        lo, hi = pieces[j]
        part = flat[lo:hi]
        await flat_all_reduce(comm.part(plan.column(j), across + j), part, raw)
        finish_into(op, part, comm.size)

    await _run([column(j) for j in range(len(pieces)) if j % k == plan.local])
    if k > 1:
        await _spread_from_carriers(comm.part(plan.mine, spread), flat, pieces)


async def _reduce_onto_carriers(
    host: OpComm, blocks: Sequence[tuple[Array, Array | None, int]], op: ReduceOp
) -> None:
    """Sum blocks within the host: ``blocks[i]`` is this rank's block ``i``, where its
    carrier (the host rank ``blocks[i][2]``) sums it, and the carrier's own running sum
    (``None`` elsewhere). Every rank sends each block it does not carry to its carrier; a
    carrier reduces the others' into its sum in the order of their places."""
    me = host.rank
    sends: list[tuple[int, int, memoryview]] = []
    recvs: list[tuple[int, int, memoryview]] = []
    received: list[tuple[Array, Array]] = []
    for i, (block, acc, carrier) in enumerate(blocks):
        if carrier != me:
            sends.append((carrier, i, byte_view(block)))
            continue
        assert acc is not None
        for peer in range(host.size):
            if peer != me:
                buf = np.empty_like(block)
                recvs.append((peer, i, byte_view(buf)))
                received.append((acc, buf))
    await _exchange(host, sends, recvs)
    for dst, src in received:
        await _reduce_into(op, dst, src)


async def _spread_from_carriers(host: OpComm, flat: Array, pieces: list[tuple[int, int]]) -> None:
    k, me = host.size, host.rank
    sends: list[tuple[int, int, memoryview]] = []
    recvs: list[tuple[int, int, memoryview]] = []
    for j, (lo, hi) in enumerate(pieces):
        view = byte_view(flat[lo:hi])
        if j % k == me:
            sends += [(peer, j, view) for peer in range(k) if peer != me]
        else:
            recvs.append((j % k, j, view))
    await _exchange(host, sends, recvs)


async def _exchange(
    comm: OpComm,
    sends: Sequence[tuple[int, int, memoryview]],
    recvs: Sequence[tuple[int, int, memoryview]],
) -> None:
    """Send and receive ``(peer, step, bytes)`` messages, none of them staged: every receive
    is posted first and each peer that sends here is told so (one ready signal); what goes
    to a peer leaves once that peer said the same, at once when it is small (as the flat
    algorithms do, see ``collectives._common.READY_BYTES``)."""
    flow = Dataflow(len(recvs))
    outgoing: dict[int, list[tuple[int, memoryview]]] = {}
    for peer, step, data in sends:
        outgoing.setdefault(peer, []).append((step, data))
    try:
        for peer, step, out in recvs:
            flow.on(comm.recv_into(peer, step, out), flow.finish_one)
        for peer in {peer for peer, _, _ in recvs}:
            flow.signal_ready(comm, peer)

        def send(peer: int, messages: list[tuple[int, memoryview]]) -> None:
            for step, data in messages:
                flow.flight.add(comm.send(peer, step, data))

        for peer, messages in outgoing.items():
            if sum(len(data) for _, data in messages) >= READY_BYTES:
                flow.after_ready(comm, peer, send, peer, messages)
            else:
                send(peer, messages)
                flow.after_ready(comm, peer, lambda: None)
        flow.stay_awake(comm, sum(len(d) for _, _, d in sends) + sum(len(o) for _, _, o in recvs))
    except BaseException:
        flow.flight.abandon()
        raise
    await flow.wait()


async def broadcast(comm: OpComm, plan: HostPlan, x: Array, root: int) -> None:
    """:func:`aiodist.collectives.broadcast` in two levels: across hosts among one rank
    per host (the root for its own), then within each host from that rank."""
    reps, rep = plan.representative(root)
    if comm.rank == rep:
        await flat_broadcast(comm.part(reps, _ACROSS), x, reps.index(root))
    if len(plan.mine) > 1:
        await flat_broadcast(comm.part(plan.mine, _SPREAD), x, plan.mine.index(rep))


async def reduce(comm: OpComm, plan: HostPlan, x: Array, root: int, op: ReduceOp) -> None:
    """:func:`aiodist.collectives.reduce` in two levels: each host reduces onto one of its
    ranks (the root on its own host), and those reduce across hosts onto the root. Only
    the root's ``x`` changes."""
    raw = ReduceOp.SUM if op is ReduceOp.AVG else op
    reps, rep = plan.representative(root)
    # A host's representative other than the root holds its host's sum in scratch.
    acc = x.copy() if comm.rank == rep and rep != root else x
    if len(plan.mine) > 1:
        await flat_reduce(comm.part(plan.mine, _GATHER), acc, plan.mine.index(rep), raw)
    if comm.rank == rep:
        await flat_reduce(comm.part(reps, _ACROSS), acc, reps.index(root), raw)
    if comm.rank == root:
        finish_into(op, x, comm.size)


async def all_gather(comm: OpComm, plan: HostPlan, outs: Sequence[Array], x: Array) -> None:
    """:func:`aiodist.collectives.all_gather` in two levels: the carriers of each column
    gather their ``x`` across hosts, then each rank copies the blocks it gathered to the
    rest of its host."""
    k = len(plan.mine)

    async def across(j: int) -> None:
        column = plan.column(j)
        await flat_all_gather(comm.part(column, _ACROSS + j), [outs[r] for r in column], x)

    await _run([across(j) for j in range(plan.width) if j % k == plan.local])
    if k == 1:
        return
    sends: list[tuple[int, int, memoryview]] = []
    recvs: list[tuple[int, int, memoryview]] = []
    for r in range(comm.size):
        carrier = plan.carrier(r)
        view = byte_view(outs[r])
        if carrier == comm.rank:
            sends += [(peer, r, view) for peer in range(k) if peer != plan.local]
        else:
            recvs.append((plan.mine.index(carrier), r, view))
    await _exchange(comm.part(plan.mine, _SPREAD), sends, recvs)


async def reduce_scatter(
    comm: OpComm, plan: HostPlan, out: Array, ins: Sequence[Array], op: ReduceOp
) -> None:
    """:func:`aiodist.collectives.reduce_scatter` in two levels: each host sums every
    rank's block onto the rank of the host that carries that rank's column, and each
    carrier sends its host's sum straight to the block's rank, which reduces what the hosts
    sent it in host order."""
    raw = ReduceOp.SUM if op is ReduceOp.AVG else op
    me = comm.rank
    k = len(plan.mine)
    carried = [r for r in range(comm.size) if plan.carrier(r) == me]
    # This host's sum of each carried block: in ``out`` for this rank's own.
    sums = {r: out if r == me else np.empty_like(ins[r]) for r in carried}
    for r in carried:
        await copy_into(sums[r], ins[r])
    if k > 1:
        blocks = [(ins[r], sums.get(r), plan.mine.index(plan.carrier(r))) for r in range(comm.size)]
        await _reduce_onto_carriers(comm.part(plan.mine, _GATHER), blocks, raw)
    others = [h for h in plan.hosts if h is not plan.mine]
    bufs = [np.empty_like(out) for _ in others]
    sends = [(r, 0, byte_view(sums[r])) for r in carried if r != me]
    recvs = [
        (h[plan.local % len(h)], 0, byte_view(buf)) for h, buf in zip(others, bufs, strict=True)
    ]
    await _exchange(comm.part(range(comm.size), _ACROSS), sends, recvs)
    for buf in bufs:
        await _reduce_into(raw, out, buf)
    finish_into(op, out, comm.size)


async def barrier(comm: OpComm, plan: HostPlan) -> None:
    """:func:`aiodist.collectives.barrier` in two levels: each host's ranks check in with
    its first rank, the first ranks pass a barrier across hosts, and each lets its host go."""
    first = tuple(h[0] for h in plan.hosts)
    k = len(plan.mine)
    gather = comm.part(plan.mine, _GATHER) if k > 1 else None
    spread = comm.part(plan.mine, _SPREAD) if k > 1 else None
    if gather is not None and spread is not None and plan.local:
        await gather.send(0, 0, EMPTY)
        await spread.recv_into(0, 0, memoryview(bytearray()))
        return
    if gather is not None:
        await _all(gather.recv_into(peer, 0, memoryview(bytearray())) for peer in range(1, k))
    await flat_barrier(comm.part(first, _ACROSS))
    if spread is not None:
        await _all(spread.send(peer, 0, EMPTY) for peer in range(1, k))


async def _all(futs: Any) -> None:
    flight = Flight()
    try:
        for fut in futs:
            flight.add(fut)
        await flight.drain()
    except BaseException:
        flight.abandon()
        raise


async def _run(coros: list[Coroutine[Any, Any, None]], window: int | None = None) -> None:
    """Run ``coros`` side by side, at most ``window`` at once (default all); on the first
    failure cancel the others, wait for them to let go of their arrays, and raise it."""
    if len(coros) == 1:
        await coros[0]
        return
    running: set[asyncio.Future[None]] = set()
    started: list[asyncio.Future[None]] = []
    try:
        for coro in coros:
            if window is not None and len(running) >= window:
                done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()
            task = asyncio.ensure_future(coro)
            started.append(task)
            running.add(task)
        await asyncio.gather(*running)
    except BaseException:
        for coro in coros[len(started) :]:
            coro.close()
        for task in started:
            task.cancel()
        await asyncio.gather(*started, return_exceptions=True)
        raise


async def _reduce_into(op: ReduceOp, dst: Array, src: Array) -> None:
    # In pieces, yielding to the loop between them (a 32 MiB reduction is milliseconds).
    if dst.nbytes <= YIELD_BYTES:
        reduce_into(op, dst, src)
        return
    d, s = dst.reshape(-1), src.reshape(-1)
    step = YIELD_BYTES // d.itemsize
    for lo in range(0, d.size, step):
        reduce_into(op, d[lo : lo + step], s[lo : lo + step])
        await asyncio.sleep(0)
