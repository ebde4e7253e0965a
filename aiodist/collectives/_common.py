"""Pieces shared by the collective algorithms: in-flight futures, chunking, scratch memory."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from .._util._wait import may_stay_awake
from ..errors import DistError
from ..transport.base import OpComm

logger = logging.getLogger(__name__)

#: Largest piece of a large message sent, received and reduced as one unit. Small enough
#: that reducing or copying one piece stalls the loop well under a millisecond, large
#: enough that per-message overhead is a few percent.
CHUNK_BYTES = 512 * 1024
#: Chunks whose receives are posted ahead of the one being processed.
WINDOW = 4
#: Bytes of local copying or reducing between two yields to the event loop.
YIELD_BYTES = 2 * 1024 * 1024

#: An empty message, for operations that only synchronize.
EMPTY = memoryview(b"")

#: Step number of the "receives posted" signal, above every data step of an operation.
READY_STEP = 1 << 48
#: From this many bytes per message on, a rank waits for its receiver's ready signal before
#: sending. A receiver that is still busy with the previous operation would otherwise have
#: the transport stage the data (allocate, copy in, copy out): milliseconds for megabytes,
#: against one empty message's round trip.
#:
#: Where the receiver's and the sender's sizes could disagree without any other message
#: failing (rooted and all-to-all operations), the receiver signals whatever its size and
#: the sender always takes the signal, waiting for it only when its own message is large:
#: a mismatch then reaches the length check of the receive instead of leaving both sides
#: waiting for each other.
READY_BYTES = 256 * 1024


class ResultError(DistError):
    """This rank's part of an operation is done, but its result cannot be made here (bytes
    it received do not unpickle): only this rank's call fails. Its peers need nothing more
    from it, so the group, and their calls, go on."""


class Flight:
    """The futures one operation posted; all of them settle before the operation returns.

    An operation must not complete while a send still refers to the caller's memory (the
    caller may overwrite it at once), and on failure none of the other futures may be left
    with an exception nobody retrieves.
    """

    __slots__ = ("futs",)

    def __init__(self) -> None:
        self.futs: list[asyncio.Future[Any]] = []

    def __repr__(self) -> str:
        pending = sum(1 for f in self.futs if not f.done())
        return f"<Flight {len(self.futs)} futures, {pending} pending>"

    def add(self, fut: asyncio.Future[Any]) -> asyncio.Future[Any]:
        """Track ``fut`` and return it."""
        self.futs.append(fut)
        return fut

    async def drain(self) -> None:
        """Wait for every tracked future; raise the first failure."""
        for fut in self.futs:
            if fut.done():
                fut.result()
            else:
                await fut
        self.futs.clear()

    def abandon(self) -> None:
        """After a failure: cancel what is pending and retrieve every exception."""
        abandon(self.futs)
        self.futs.clear()


def abandon(futs: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel the pending futures of a failed operation and retrieve the others' exceptions."""
    for fut in futs:
        if not fut.done():
            fut.cancel()
        elif not fut.cancelled():
            fut.exception()


def chunk_size(chunk_bytes: int | None) -> int:
    """The pipelining unit: ``chunk_bytes`` if given, else :data:`CHUNK_BYTES`.

    Every chunk costs a message, a receive and a callback (tens of microseconds), and two
    chunks in flight already overlap sending, receiving and reducing, so chunks are as
    large as the loop's latency budget allows rather than a fixed fraction of a message.
    """
    return CHUNK_BYTES if chunk_bytes is None else max(1, chunk_bytes)


def split(total: int, parts: int) -> list[tuple[int, int]]:
    """Cut ``range(total)`` into ``parts`` contiguous pieces whose sizes differ by at most 1."""
    return [(total * i // parts, total * (i + 1) // parts) for i in range(parts)]


def num_chunks(nbytes: int, chunk_bytes: int) -> int:
    """How many chunks a message of ``nbytes`` is cut into (at least one)."""
    return max(1, -(-nbytes // chunk_bytes))


class ScratchPool:
    """Reusable receive buffers, so large operations do not page-fault fresh memory each time.

    Buffers are kept per power-of-two size class, a few per class, up to a total byte cap;
    anything beyond that is left to the garbage collector.
    """

    def __init__(self, per_class: int = 8, max_bytes: int = 128 * 1024 * 1024) -> None:
        self._free: dict[int, list[npt.NDArray[np.uint8]]] = {}
        self._per_class = per_class
        self._max_bytes = max_bytes
        self._cached = 0

    def __repr__(self) -> str:
        return f"<ScratchPool cached={self._cached} bytes in {len(self._free)} size classes>"

    def get(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """Return a ``uint8`` buffer of at least ``nbytes`` bytes (contents undefined)."""
        size = max(4096, 1 << max(0, nbytes - 1).bit_length())
        free = self._free.get(size)
        if free:
            try:
                buf = free.pop()
            except IndexError:  # emptied by another thread's loop
                pass
            else:
                self._cached -= size
                return buf
        return np.empty(size, dtype=np.uint8)

    def put(self, buf: npt.NDArray[np.uint8]) -> None:
        """Return a buffer from :meth:`get` for reuse."""
        size = buf.nbytes
        free = self._free.setdefault(size, [])
        if len(free) < self._per_class and self._cached + size <= self._max_bytes:
            free.append(buf)
            self._cached += size


#: The process-wide pool of receive buffers.
SCRATCH = ScratchPool()


def typed(buf: npt.NDArray[np.uint8], dtype: np.dtype[Any], count: int) -> npt.NDArray[Any]:
    """The first ``count`` elements of a scratch buffer, viewed as ``dtype``."""
    return buf[: count * dtype.itemsize].view(dtype)


async def copy_into(dst: npt.NDArray[Any], src: npt.NDArray[Any]) -> None:
    """Copy ``src`` into ``dst`` (same dtype and size), yielding to the loop between pieces.

    Nothing is copied when both are the same memory (an output list that holds the input).
    """
    if dst.size == 0 or _address(dst) == _address(src):
        return
    d = dst.reshape(-1)
    s = src.reshape(-1)
    if d.nbytes <= YIELD_BYTES:
        np.copyto(d, s)
        return
    step = YIELD_BYTES // d.itemsize
    for lo in range(0, d.size, step):
        np.copyto(d[lo : lo + step], s[lo : lo + step])
        await asyncio.sleep(0)


def _tick_until(done: asyncio.Future[Any], on_tick: Callable[[], None] | None = None) -> None:
    # A callback that schedules itself again keeps the loop polling (no sleep) until
    # ``done`` resolves, however it ends. ``on_tick`` lets a test count the rounds.
    loop = done.get_loop()

    def tick() -> None:
        if not done.done():
            if on_tick is not None:
                on_tick()
            loop.call_soon(tick)

    loop.call_soon(tick)


def _address(a: npt.NDArray[Any]) -> int:
    return int(a.__array_interface__["data"][0])


def binomial_tree(vrank: int, size: int) -> tuple[int | None, list[int]]:
    """Parent and children of ``vrank`` in a binomial tree rooted at 0 over ``size`` ranks.

    Children come largest subtree first (the order a broadcast should feed them).
    """
    if vrank == 0:
        parent = None
        low = 1 << (size - 1).bit_length()
    else:
        low = vrank & -vrank
        parent = vrank - low
    children = []
    mask = low >> 1
    while mask:
        if vrank + mask < size:
            children.append(vrank + mask)
        mask >>= 1
    return parent, children


class Dataflow:
    """Drives a pipelined algorithm from future callbacks instead of a fixed await order.

    Each received chunk is handled (reduced, forwarded) as soon as it lands, whatever the
    order of arrival, without a task per chunk. :meth:`on` registers a handler for a
    future; a handler calls :meth:`finish_one` when it completed one of the ``expected``
    units of work. :meth:`after_ready` counts its own unit: a rank may receive everything
    it needs before its neighbour's ready signal arrives, and must still send its part
    then. :meth:`wait` returns when all units are done and every send has drained, or
    raises the first failure (a failed future or a handler that raised). Handlers of a
    finished or failed operation do not run.
    """

    __slots__ = ("_awake", "_done", "flight", "remaining")

    def __init__(self, expected: int) -> None:
        self._done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.flight = Flight()
        self.remaining = expected
        self._awake = False

    def __repr__(self) -> str:
        return f"<Dataflow remaining={self.remaining} {self.flight!r}>"

    def on(self, fut: asyncio.Future[Any], handler: Callable[..., None], *args: Any) -> None:
        """Track ``fut``; once it succeeds, call ``handler(*args)``."""
        self.flight.add(fut)
        fut.add_done_callback(lambda f: self._run(f, handler, args))

    def _run(self, fut: asyncio.Future[Any], handler: Callable[..., None], args: Any) -> None:
        if self._done.done() or fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self._done.set_exception(exc)
            return
        try:
            handler(*args)
        except Exception as err:  # a handler's failure fails the operation
            self._done.set_exception(err)

    def after_ready(
        self, comm: OpComm, peer: int, handler: Callable[..., None], *args: Any
    ) -> None:
        """Call ``handler(*args)`` once ``peer`` signalled (:meth:`signal_ready`) that its
        receives are posted; this is one more unit of work."""
        # Only while work remains: a finished flow would never run the handler.
        assert not self._done.done(), "after_ready on a finished Dataflow"
        self.remaining += 1

        def ready() -> None:
            # The peer's receives are posted: what goes to it now skips the transport's
            # own handshake (it would add a round trip to this one).
            comm.cleared_by(peer)
            handler(*args)
            self.finish_one()

        self.on(comm.recv_into(peer, READY_STEP, memoryview(bytearray())), ready)

    def start_sends(
        self,
        comm: OpComm,
        nbytes: int,
        signal_to: int,
        wait_for: int,
        send_first: Callable[[], None],
    ) -> None:
        """Run ``send_first`` now for small messages; for large ones (``READY_BYTES``), tell
        ``signal_to`` our receives are posted and run it once ``wait_for`` says the same."""
        if nbytes >= READY_BYTES:
            self.signal_ready(comm, signal_to)
            self.after_ready(comm, wait_for, send_first)
        else:
            send_first()

    def signal_ready(self, comm: OpComm, peer: int) -> None:
        """Tell ``peer`` that our receives for its data are posted."""
        self.flight.add(comm.send(peer, READY_STEP, EMPTY))

    def send_when_ready(self, comm: OpComm, peer: int, step: int, data: memoryview) -> None:
        """Send ``data`` to ``peer``: at once if small, else once ``peer`` signalled ready.

        Takes ``peer``'s ready signal either way (one unit of work, see
        :meth:`after_ready`).
        """
        large = len(data) >= READY_BYTES
        if not large:
            self.flight.add(comm.send(peer, step, data))

        def ready() -> None:
            if large:
                self.flight.add(comm.send(peer, step, data))

        self.after_ready(comm, peer, ready)

    def copy(self, dst: npt.NDArray[Any], src: npt.NDArray[Any]) -> None:
        """Copy ``src`` into ``dst`` (same dtype and size) as part of this operation.

        Up to :data:`YIELD_BYTES` the copy happens now; a larger one runs as a task that
        yields between pieces (one more unit of work), so the transfers already started
        keep going while it copies. Call it after posting the operation's receives and
        signals, never before: every peer's sends to this rank would wait for the copy.
        Nothing is copied when both are the same memory (an output list that holds the
        input).
        """
        if dst.size == 0 or _address(dst) == _address(src):
            return
        if dst.nbytes <= YIELD_BYTES:
            np.copyto(dst.reshape(-1), src.reshape(-1))
            return
        self.remaining += 1
        self.on(asyncio.get_running_loop().create_task(copy_into(dst, src)), self.finish_one)

    def finish_one(self) -> None:
        """Record that one unit of work is complete."""
        self.remaining -= 1
        if self.remaining == 0 and not self._done.done():
            self._done.set_result(None)

    def stay_awake(self, comm: OpComm, nbytes: int) -> None:
        """Keep the loop from sleeping while :meth:`wait` waits, if this rank sends or
        receives ``nbytes``, as :func:`aiodist._util._wait.may_stay_awake` decides."""
        if may_stay_awake(comm.size, nbytes):
            self._awake = True

    async def run(
        self, start: Callable[[], None], scratch: Iterable[npt.NDArray[np.uint8]] = ()
    ) -> None:
        """Call ``start`` (it posts the receives and starts the sends), then :meth:`wait`,
        then give ``scratch`` back to :data:`SCRATCH`. What is in flight is abandoned if
        ``start`` fails; the scratch is not reused if the work fails (a cancelled receive
        may still fill it)."""
        try:
            start()
        except BaseException:
            self.flight.abandon()
            raise
        await self.wait()
        for buf in scratch:
            SCRATCH.put(buf)

    async def wait(self) -> None:
        """Wait for all the work and every tracked send; on failure clean up and raise."""
        try:
            if self.remaining == 0 and not self._done.done():
                self._done.set_result(None)
            if self._awake and not self._done.done():
                _tick_until(self._done)
            await self._done
            await self.flight.drain()
        except BaseException:
            if self._done.done() and not self._done.cancelled():
                self._done.exception()
            else:
                self._done.cancel()
            self.flight.abandon()
            raise
