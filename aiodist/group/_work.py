"""One operation on a process group: its kind, its plan, its record of life and its handle.

:class:`Operation` is what :mod:`aiodist.group` keeps of a call from the reservation of its
sequence number to its end; :class:`Plan` is what a backend returns for it (the algorithm
and its arguments); :class:`Work` is the handle the caller awaits.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable, Coroutine, Generator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, Protocol, TypeVar

from .._arrays._fingerprint import NO_FINGERPRINT
from .._util._timeouts import Timeout, to_seconds
from ..errors import DistUsageError
from ..transport.base import OpComm, fails_alone, rejection_text
from ._recorder import OpRecord

__all__ = [
    "Issuer",
    "ANY_TAG",
    "Inline",
    "MAX_TAG",
    "P2P_GROUP_BIT",
    "OpKind",
    "Operation",
    "Plan",
    "Work",
    "handed_over",
    "raising",
    "rejected_on_transport",
]

T = TypeVar("T")

#: Point-to-point messages of group ``g`` travel under group id ``g | P2P_GROUP_BIT`` with
#: the user's tag as sequence number, so they never meet a collective's messages.
P2P_GROUP_BIT = 1 << 31
#: The largest user tag of a point-to-point message.
MAX_TAG = 2**63 - 1
#: The tag of a point-to-point rejection whose sender could not name a valid tag.
ANY_TAG = (1 << 64) - 1


class OpKind(enum.Enum):
    """What an operation is: a collective of the whole group, or point to point."""

    COLLECTIVE = "collective"
    P2P = "p2p"


@dataclass(slots=True)
class Plan:
    """A checked operation, ready to run: ``await algorithm(*comms, *args)``.

    ``algorithm(*comms, *args)`` is called when the operation starts, which is when it is
    issued, in issue order on every rank: a data path that keeps an order of the group's
    operations (a workspace's turns) takes the operation's place in it in that call, and
    returns the awaitable that moves the data.

    Attributes:
        algorithm: makes the awaitable that moves the data (one ``OpComm`` per sequence
            number of the operation, then ``args``): a coroutine function, or a function
            that takes the operation's place on its path and returns one.
        args: its checked arguments.
        fingerprint: the call's fingerprint, which every message of it carries.
        output: the Work's result when the algorithm returns ``None`` (the output array).
        device_sync: for an operation on a device (CUDA), makes a device stream wait for the
            operation's end without blocking the host (:meth:`Work.wait_stream`).
        waiting_for: for an operation that waits on its path rather than for messages, the
            group ranks it waits for now (named when it times out).
    """

    algorithm: Callable[..., Awaitable[Any]]
    args: tuple[Any, ...] = ()
    fingerprint: bytes = NO_FINGERPRINT
    output: Any = None
    device_sync: Callable[[Any], None] | None = None
    waiting_for: Callable[[], list[int]] | None = None


class Work(Generic[T]):
    """The handle of one operation, returned as soon as the operation is issued.

    Await it (``await work``) or call ``await work.wait(timeout)`` to get the operation's
    result; both can be done any number of times. The operation runs as a task on the event
    loop whether or not anyone awaits it, and a caller that stops waiting (cancelled, or
    ``asyncio.timeout`` around the await) leaves it running.

    The result is the output the operation wrote (the array or list passed in, or the object
    list), the sender's rank for a receive, and ``None`` for a barrier or a send.
    """

    __slots__ = ("_future", "_name", "_op")

    def __init__(self, op: Operation | None, name: str = "") -> None:
        self._op = op
        if op is None:
            self._name = name
            self._future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        else:
            self._name = op.name
            self._future = op.ended

    @staticmethod
    def not_issued(name: str, result: Any = None) -> Work[Any]:
        """The work of call ``name`` on a group this rank is not in: done with ``result``,
        nothing ran."""
        work: Work[Any] = Work(None, name)
        work._future.set_result(result)
        return work

    @property
    def op(self) -> str:
        """The operation's name, e.g. ``"all_reduce"``."""
        return self._name

    @property
    def timeout(self) -> timedelta | None:
        """The operation's deadline from its start (the group's timeout unless the call gave
        its own); ``None``: none (or a call that was not issued)."""
        seconds = None if self._op is None else self._op.timeout
        return None if seconds is None else timedelta(seconds=seconds)

    @property
    def seq(self) -> int:
        """The group sequence number (the tag, for a point-to-point operation); ``-1`` for
        a call that was not issued (see :meth:`not_issued`)."""
        return -1 if self._op is None else self._op.seq

    def __repr__(self) -> str:
        if self._op is None:
            return f"<Work {self._name} not issued: this rank is not in the group>"
        fut = self._future
        if not fut.done():
            state = "pending"
        elif fut.exception() is not None:
            state = f"failed ({type(fut.exception()).__name__})"
        else:
            state = "completed"
        op = self._op
        key = op.label.replace(" ", "=")
        return f"<Work {op.name} {key} group={op.group.group_id} {state}>"

    def __await__(self) -> Generator[Any, None, T]:
        fut = self._future
        if fut.done():  # (most small operations: no coroutine for the wait)
            return fut.result()
        return (yield from self.wait().__await__())

    async def wait(self, timeout: Timeout = None) -> T:
        """Wait for the operation to finish and return its result.

        Args:
            timeout: seconds (or ``timedelta``) to wait; ``None`` or ``0`` (torch's "no
                timeout") waits until the group's own timeout ends the operation.

        Returns:
            The operation's result (see the class docstring).

        Raises:
            DistTimeoutError: ``timeout`` passed first. As in torch's gloo backend, this
                fails the operation and aborts the process group, because the peers are
                left part-way through it.
            DistError: the operation failed (the same exception on every call).
        """
        fut = self._future
        if fut.done():
            return fut.result()
        seconds = to_seconds(timeout, None)
        if not seconds:
            await _join(fut)
        else:
            # asyncio.wait never cancels what it waits on, so cancelling the caller leaves
            # the operation running.
            await asyncio.wait([fut], timeout=seconds)
            if not fut.done():
                op = self._op
                assert op is not None  # (a work without one is born done)
                op.group.wait_expired(op, seconds)
        return fut.result()

    def is_completed(self) -> bool:
        """Return whether the operation has finished, successfully or not."""
        return self._future.done()

    def is_success(self) -> bool:
        """Return whether the operation has finished without an error."""
        return self._future.done() and self._future.exception() is None

    def exception(self) -> BaseException | None:
        """Return the operation's exception, or ``None`` if it succeeded or is still running."""
        return self._future.exception() if self._future.done() else None

    def result(self) -> T:
        """Return the result of a finished operation without waiting.

        Raises:
            DistUsageError: the operation has not finished yet.
            DistError: the operation failed.
        """
        if not self._future.done():
            raise DistUsageError(f"{self!r} has not completed yet; await it first")
        return self._future.result()

    def add_done_callback(self, fn: Callable[[Work[T]], object]) -> None:
        """Call ``fn(work)`` on the loop once the operation has finished."""
        self._future.add_done_callback(lambda _: fn(self))

    def wait_stream(self, stream: Any = None) -> None:
        """Make a device stream wait for this operation, without blocking the host.

        For an operation on CUDA arrays: work queued on ``stream`` (default: the current
        stream) after this call starts once the operation's device work is done.

        Raises:
            DistUsageError: the operation runs on the host (await it instead).
        """
        sync = None if self._op is None else self._op.device_sync
        if sync is None:
            raise DistUsageError(
                f"wait_stream: {self!r} runs on the host, not on a device stream; await it"
            )
        sync(stream)


async def _join(future: asyncio.Future[Any]) -> None:
    """Wait for ``future`` without cancelling it if the waiting task is cancelled."""
    waiter = future.get_loop().create_future()

    def wake(_: asyncio.Future[Any]) -> None:
        if not waiter.done():
            waiter.set_result(None)

    future.add_done_callback(wake)
    try:
        await waiter
    finally:
        future.remove_done_callback(wake)


class Issuer(Protocol):
    """What an operation asks of the group that issued it
    (:class:`aiodist.group.ProcessGroup`)."""

    @property
    def rank(self) -> int:
        """This rank's rank in the group."""

    @property
    def group_id(self) -> int:
        """The group's number, the same on every member."""

    @property
    def timeout(self) -> float | None:
        """Seconds an operation may run unless it has a deadline of its own."""

    def wait_expired(self, op: Operation, seconds: float) -> None:
        """Fail ``op``: a caller's ``work.wait(seconds)`` gave up on it."""

    async def waits_for(self, op: Operation, within: float) -> str:
        """Say for whom ``op``, which has run long, waits."""


class Operation:
    """One call on a process group, from the reservation of its number to its end.

    It owns what the call is (name, kind, sequence number or tag, how many sequence
    numbers), its fingerprint and flight-recorder entry once planned, its deadline and
    task once started, the future its :class:`Work` reads, and its failure scope: the
    peers told if it is rejected (every other member for a collective; the receiver for a
    send; nobody for a receive).

    The work refers to its operation and not the other way round, nor does an ended
    operation keep its task: an operation leaves no reference cycle for the garbage
    collector, whose passes would otherwise stall a rank (and its peers) every few hundred
    small operations.
    """

    __slots__ = (
        "device_sync",
        "ended",
        "group",
        "kind",
        "name",
        "nseq",
        "own_timeout",
        "peer",
        "record",
        "rejected",
        "sends",
        "seq",
        "task",
        "timeout",
        "waiting_for",
    )

    def __init__(
        self,
        group: Issuer,
        name: str,
        kind: OpKind,
        seq: int,
        *,
        nseq: int = 1,
        peer: int | None = None,
        sends: bool = False,
    ) -> None:
        self.group = group
        self.name = name
        self.kind = kind
        self.seq = seq
        self.nseq = nseq
        #: Point to point: the peer's group rank (``None``: any source).
        self.peer = peer
        #: Point to point: whether this is a send (whose receiver waits for it).
        self.sends = sends
        #: Seconds it may run (the group's timeout unless the call gave its own).
        self.timeout = group.timeout
        self.own_timeout = False
        self.record: OpRecord | None = None
        self.task: asyncio.Task[None] | None = None
        self.device_sync: Callable[[Any], None] | None = None
        self.waiting_for: Callable[[], list[int]] | None = None
        #: Rejected (here, or by a peer before this rank issued it): its plan only takes
        #: its place on the path.
        self.rejected = False
        #: Resolves when the operation has ended, whatever its outcome (its work's result).
        self.ended: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def set_timeout(self, timeout: Timeout) -> None:
        """Give the operation a deadline of its own instead of the group's.

        Raises:
            DistUsageError: not a number of seconds or a ``timedelta``.
        """
        if timeout is not None:
            self.timeout = to_seconds(timeout)
            self.own_timeout = True

    def __repr__(self) -> str:
        return f"<Operation {self.name} {self.label} group={self.group.group_id}>"

    @property
    def label(self) -> str:
        """``"seq N"``, or ``"tag N"`` for a point-to-point operation."""
        return f"{'tag' if self.kind is OpKind.P2P else 'seq'} {self.seq}"

    @property
    def wire_group(self) -> int:
        """The group id its messages travel under."""
        gid = self.group.group_id
        return gid | P2P_GROUP_BIT if self.kind is OpKind.P2P else gid

    def settle(self, exc: BaseException | None, result: Any = None) -> None:
        """Resolve the work with ``result``, or fail it with ``exc``; the first outcome stays."""
        fut = self.ended
        if fut.done():
            return
        if exc is None:
            fut.set_result(result)
        else:
            # Work nobody awaits must not report "exception never retrieved": the failure
            # is kept in the work (and in the world's state), so it is marked retrieved.
            fut.set_exception(exc)
            fut.exception()
        if self.record is not None:
            self.record.finish(exc)


#: A backend's way of running a call of one operation at once, without a plan or a task
#: (:attr:`aiodist.group.ProcessGroup.inline_ops`): ``inline(args)`` (the call's arguments)
#: returns ``None`` when it cannot (it did nothing: the call is planned as any other), else
#: ``(output, fingerprint, rest)``: the work's result, the call's fingerprint, and ``None``
#: when the operation ended, else the :class:`Plan` that ends it (made with
#: :func:`handed_over`: the operation holds its place on its path already). What it raises,
#: the operation raised in its place, as its algorithm would have.
Inline = Callable[[tuple[Any, ...]], tuple[Any, bytes, Plan | None] | None]


def handed_over(*args: Any) -> Awaitable[Any]:
    """The algorithm of a :class:`Plan` whose operation has started already
    (``Plan(handed_over, (started,))``): returns ``started``, the awaitable that ends it."""
    started: Awaitable[Any] = args[-1]  # (after the operation's OpComms)
    return started


def rejected_on_transport(
    group: Issuer, algorithm: str | None, error: BaseException, tell: bool
) -> Plan:
    """The rejection plan of a path that keeps no order of its own (see
    :func:`aiodist.backends.reject`): the operation's place is its sequence numbers, which the
    peers' messages of it carry; it tells them why when ``tell``, then fails with ``error``,
    marked as failing this operation only."""
    return Plan(_rejected, (fails_alone(error), tell))


def _rejected(*args: Any) -> Coroutine[Any, Any, None]:
    # (*comms, error, tell): one OpComm per sequence number of the operation. Called as the
    # operation starts: the peers are told then, even if this rank leaves at once.
    *comms, error, tell = args
    if tell:
        for comm in comms:
            assert isinstance(comm, OpComm)
            comm.reject(rejection_text(error))
    return raising(error)


async def raising(error: BaseException) -> None:
    """A coroutine that raises ``error``: the awaitable of an operation that failed."""
    raise error
