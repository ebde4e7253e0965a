"""The channel of a serving job: calls from the controller to handlers on the workers.

:class:`Channel` sends a call's header and arrays (in the format of ``_serving_wire.py``),
runs the handlers on the workers, and brings their replies back. The roles built on it
(the controller's and the workers' life cycle, :func:`~aiodist.serving.worker_group`) are in
:mod:`aiodist.serving`, which re-exports the public names defined here.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from .. import _api, backends, group as _group
from .._arrays._intake import as_array
from .._assembly import _join as _assembly, _subgroups
from .._util._timeouts import Timeout, to_seconds
from ..errors import DistError, DistProtocolError, DistTimeoutError, DistUsageError
from ..group import NonGroupMember, Plan, ProcessGroup
from ._wire import (
    FIRST,
    MAX_ARRAYS,
    array_spec,
    check_name,
    decode,
    encode,
    new_arrays,
    outgoing,
    overflow,
    unpack,
)

__all__ = [
    "CONTROLLER_RANK",
    "Channel",
    "Handler",
    "RemoteError",
    "Reply",
    "check_handlers",
    "current_channel",
]

# The public module's logger: the log lines of a handler's failure name aiodist.serving,
# which is what users configure.
logger = logging.getLogger("aiodist.serving")

T = TypeVar("T")

# Public names: aiodist.serving documents them where users import them.
CONTROLLER_RANK = 0
Reply = npt.NDArray[Any] | tuple[npt.NDArray[Any], ...] | None
Handler = Callable[..., Awaitable[Any]]

#: Seconds between checks of the world's health while the ranks join a channel.
_JOIN_POLL = 1.0


class RemoteError(DistError):
    """A handler raised on one or more workers; only this call failed.

    Attributes:
        name: the handler's name.
        failures: ``{rank: "ExceptionType: message"}`` for each worker whose handler failed
            (a worker whose collective was rejected because a peer's handler failed is
            listed too, with that rejection).
    """

    # Raised to users as aiodist.serving.RemoteError: tracebacks and pickles keep naming
    # the public module it was always in.
    __module__ = "aiodist.serving"

    def __init__(self, name: str, failures: Mapping[int, str]) -> None:
        self.name = name
        self.failures = dict(failures)
        parts = "; ".join(f"on rank {r}: {text}" for r, text in sorted(self.failures.items()))
        super().__init__(f"call {name!r} failed {parts}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.name, self.failures))


def check_handlers(handlers: object) -> dict[str, Handler]:
    """``handlers`` as a table of names to callables, checked before any rank serves."""
    if not isinstance(handlers, Mapping) or not handlers:
        raise DistUsageError(
            f"serve: handlers must be a non-empty mapping of names to async functions, "
            f"got {type(handlers).__name__}"
        )
    table: dict[str, Handler] = {}
    for name, fn in handlers.items():
        check_name(name, "serve")
        if not callable(fn):
            raise DistUsageError(f"serve: handler {name!r} is not callable: {fn!r}")
        table[name] = fn
    return table


_serving: contextvars.ContextVar[Channel | None] = contextvars.ContextVar(
    "aiodist_serving", default=None
)


def current_channel() -> Channel | None:
    """The channel whose handler runs in this context (``None`` outside a handler)."""
    return _serving.get()


def _refuse(pg: ProcessGroup, name: str, args: tuple[Any, ...]) -> Plan:
    """A planner that rejects the operation it plans, with the reason in ``args``."""
    raise DistUsageError(str(args[0]))


async def _watching(pg: ProcessGroup, step: Awaitable[T]) -> T:
    """Await ``step`` of making a channel while watching ``pg``'s world.

    Raises:
        DistError: the world was aborted meanwhile, or it can never be complete (a rank
            that should be in it joined a later generation); the world is then aborted, so
            that its other ranks move on too.
    """
    task = asyncio.ensure_future(step)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_JOIN_POLL)
            if done:
                return task.result()
            pg.check_usable("Channel.create")
            # A rank that joined this world and left before the others came (or restarted
            # before the survivors had moved on) is in the next generation now: nobody
            # else can complete this one, so it is given up for the next.
            who = await _assembly.left_by(pg.world.store)
            if who is not None:
                pg.abort(
                    f"this generation of the process group can never be complete: {who} left it"
                )
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _join(pg: ProcessGroup) -> None:
    """Wait, without a deadline, until every rank of ``pg``'s world has reached this point.

    A restarted worker may take a while to come back; waiting through the store (instead of
    a collective with a deadline) keeps every rank joining each generation exactly once.
    """
    store = pg.world.store
    keys = [f"serving/joined/{r}" for r in range(pg.size)]
    await store.set(keys[pg.rank], b"1")
    while True:
        try:
            await store.wait(keys, _JOIN_POLL * 60)
        except DistTimeoutError:
            continue
        return


@dataclass
class _Reply:
    ok: bool
    seq: int
    value: Reply = None
    error: str = ""


class Channel:
    """Calls from the controller (rank 0) to handlers on the workers (every other rank).

    Make one on every rank with :meth:`create`; then rank 0 makes calls and closes the
    channel, and the other ranks serve until it does.

    Attributes:
        group: the world's default group, over which headers and arrays travel.
        workers: the group of the workers (:data:`aiodist.NON_GROUP_MEMBER` on the
            controller); handlers run their collectives on it (see :func:`worker_group`).
        worker_ranks: the global ranks of the workers, in the order of a call's replies.
        calls: how many calls the controller made on this channel.
    """

    def __init__(self, group: ProcessGroup, workers: ProcessGroup | NonGroupMember) -> None:
        self.group = group
        self.workers = workers
        self.worker_ranks = tuple(r for r in range(group.size) if r != CONTROLLER_RANK)
        self.calls = 0
        # The controller: the workers' agreed next sequence number on their group, sent in
        # every header so that workers whose handlers issued different numbers of
        # collectives (one failed part-way) line up again before the next call.
        self._seq = 0
        self._closed = False

    def __repr__(self) -> str:
        role = "controller" if self.is_controller else "worker"
        state = "closed" if self._closed else "open"
        return (
            f"<Channel rank={self.group.rank}/{self.group.size} {role} {state} calls={self.calls}>"
        )

    @property
    def is_controller(self) -> bool:
        """Whether this rank is the controller (rank 0)."""
        return self.group.rank == CONTROLLER_RANK

    @property
    def closed(self) -> bool:
        """Whether the channel was closed (by :meth:`aclose` on the controller)."""
        return self._closed

    @classmethod
    async def create(cls, group: ProcessGroup | None = None) -> Channel:
        """Make the channel of ``group``'s world; every rank calls this.

        It waits, without a deadline, until every rank has called it (a restarted worker
        may take a while), then makes the workers' group.

        Args:
            group: the default group of an initialized world (``None``: the default group
                seen here).

        Raises:
            DistUsageError: not initialized, ``group`` is not a world's default group, or
                the world has a single rank (a channel needs a worker).
            DistError: the world was aborted while the ranks joined.
        """
        pg = _group.resolve_group(group, "Channel.create")
        world = pg.world
        if pg is not world.default_group:
            raise DistUsageError(
                "Channel.create: group must be the default group of its world (the channel "
                "makes the workers' group from every rank)"
            )
        if world.size < 2:
            raise DistUsageError("Channel.create: a channel needs a world of two or more ranks")
        await _watching(pg, _join(pg))
        # A rank that joined and died before voting must not hold the others for the
        # group's timeout: the vote is watched like the join.
        workers = await _watching(
            pg,
            _subgroups.new_group(
                world,
                [r for r in range(world.size) if r != CONTROLLER_RANK],
                backend=world.backend,
                backends=dict(world.backends),
                timeout=world.timeout,
            ),
        )
        return cls(pg, workers)

    # -- the controller's side -------------------------------------------------------------

    async def call(self, name: str, *arrays: Any, timeout: Timeout = None) -> list[Reply]:
        """Run handler ``name`` on every worker with ``arrays``; return their replies.

        Args:
            name: the handler's name on the workers.
            *arrays: numpy arrays (or CPU tensors with DLPack), handed to the handler as its
                positional arguments; their shapes and dtypes travel with them.
            timeout: the call's deadline in seconds (or ``timedelta``), counted from now and
                covering the wait for earlier calls; ``None``: the group's timeout. A worker
                that has not replied by then fails the call and aborts the world.

        Returns:
            One reply per worker, in rank order (``replies[i]`` from rank ``i + 1``): what
            its handler returned (an array, a tuple of arrays, or ``None``), as new numpy
            arrays.

        Raises:
            DistUsageError: called on a worker, the channel is closed, a bad name, an
                argument that is not an array of a supported dtype, or a bad timeout.
                Nothing was sent.
            RemoteError: a handler raised (or had no such name) on one or more workers;
                the group stays usable.
            DistTimeoutError: the deadline passed: waiting for earlier calls (nothing was
                sent, the group stays usable), or for the workers it names (the world is
                aborted).
            DistError: the world failed (a worker was lost, ...), or had failed before.
        """
        if not self.is_controller:
            raise DistUsageError(
                f"call: only the controller (rank {CONTROLLER_RANK}) makes calls; rank "
                f"{self.group.rank} is a worker (it runs serve)"
            )
        if self._closed:
            raise DistUsageError("call: the channel is closed")
        check_name(name, "call")
        try:
            seconds = to_seconds(timeout, None)
        except DistUsageError as exc:
            raise DistUsageError(f"call {name!r}: {exc}") from None
        if len(arrays) > MAX_ARRAYS:
            raise DistUsageError(f"call {name!r}: {len(arrays)} arrays (at most {MAX_ARRAYS})")
        payload = [
            as_array(a, writable=False, name=f"call {name!r}: argument {i}")
            for i, a in enumerate(arrays)
        ]
        header = {
            "op": "call",
            "name": name,
            "arrays": [array_spec(a, f"call {name!r}") for a in payload],
        }
        self.group.check_usable("call")
        loop = asyncio.get_running_loop()
        deadline = None if seconds is None else loop.time() + seconds
        lock = self.group.ordered()
        try:
            async with asyncio.timeout_at(deadline):
                await lock.acquire()
        except TimeoutError:
            raise DistTimeoutError(
                f"call {name!r}: the earlier calls did not finish within the call's timeout "
                f"of {seconds:g} s; nothing was sent"
            ) from None
        # The call runs in a task of its own that holds the lock until the last reply is in:
        # a caller that stops waiting (cancelled, a client gone) must not let the next call
        # start while the workers still answer this one.
        task = loop.create_task(self._exchange(name, header, payload, deadline, seconds))
        task.add_done_callback(lambda t: None if t.cancelled() else t.exception())
        task.add_done_callback(lambda _: lock.release())
        return await asyncio.shield(task)

    def _left(self, deadline: float | None) -> float | None:
        if deadline is None:
            return None
        return max(0.0, deadline - asyncio.get_running_loop().time())

    async def _exchange(
        self,
        name: str,
        header: dict[str, Any],
        payload: list[npt.NDArray[Any]],
        deadline: float | None,
        seconds: float | None,
    ) -> list[Reply]:
        pg, tag = self.group, self.calls
        self.calls += 1
        self.group.check_usable("call")
        header = {**header, "id": tag, "seq": self._seq}
        parts, _ = encode(header, payload)
        sent = [
            _api.broadcast(part, src=CONTROLLER_RANK, group=pg, timeout=self._left(deadline))
            for part in parts
        ]
        firsts = [np.empty(FIRST, np.uint8) for _ in self.worker_ranks]
        works = [
            _api.recv(buf, src=r, group=pg, tag=tag, timeout=self._left(deadline))
            for r, buf in zip(self.worker_ranks, firsts, strict=True)
        ]
        results = await asyncio.gather(
            asyncio.gather(*sent),
            *(
                self._reply(r, buf, work, tag, deadline)
                for r, buf, work in zip(self.worker_ranks, firsts, works, strict=True)
            ),
            return_exceptions=True,
        )
        replies = results[1:]
        lost = [
            r for r, x in zip(self.worker_ranks, replies, strict=True) if not isinstance(x, _Reply)
        ]
        if lost or isinstance(results[0], BaseException):
            raise self._lost(
                name, seconds, lost, [x for x in results if isinstance(x, BaseException)]
            )
        got = [x for x in replies if isinstance(x, _Reply)]
        self._seq = max(self._seq, *(x.seq for x in got))
        failures = {r: x.error for r, x in zip(self.worker_ranks, got, strict=True) if not x.ok}
        if failures:
            raise RemoteError(name, failures)
        return [x.value for x in got]

    async def _reply(
        self,
        rank: int,
        first: npt.NDArray[np.uint8],
        work: Awaitable[Any],
        tag: int,
        deadline: float | None,
    ) -> _Reply:
        pg = self.group
        await work
        rest = None
        extra = overflow(first)
        if extra:
            rest = np.empty(extra, np.uint8)
            await _api.recv(rest, src=rank, group=pg, tag=tag, timeout=self._left(deadline))
        message, carried = decode(first, rest)
        try:
            ok, seq = bool(message["ok"]), int(message["seq"])
            if not ok:
                return _Reply(False, seq, error=str(message["error"]))
            kind, specs = message["kind"], message["arrays"]
        except (KeyError, TypeError, ValueError) as exc:
            raise DistProtocolError(f"bad serving reply from rank {rank}: {message!r}") from exc
        if carried is not None:
            arrays = unpack(carried, specs)
        else:
            arrays = new_arrays(specs)
            if arrays:
                await asyncio.gather(
                    *(
                        _api.recv(a, src=rank, group=pg, tag=tag, timeout=self._left(deadline))
                        for a in arrays
                    )
                )
        if kind == "none":
            return _Reply(True, seq)
        if kind == "array" and len(arrays) == 1:
            return _Reply(True, seq, arrays[0])
        if kind == "tuple":
            return _Reply(True, seq, tuple(arrays))
        raise DistProtocolError(f"bad serving reply from rank {rank}: {message!r}")

    def _lost(
        self, name: str, seconds: float | None, lost: list[int], errors: list[BaseException]
    ) -> BaseException:
        """The error of a call whose exchange failed: the deadline, or the world's failure."""
        timeouts = [e for e in errors if isinstance(e, DistTimeoutError)]
        cause = timeouts[0] if timeouts else self.group.world.broken or errors[0]
        if not isinstance(cause, DistError):
            return cause  # not a failure of the group: a bug, raised as it is
        who = f"no reply from ranks {lost}" if lost else "the arrays were not delivered"
        if timeouts and seconds is not None:
            error: DistError = DistTimeoutError(
                f"call {name!r} did not complete within the call's timeout of {seconds:g} s: "
                f"{who}; the process group is aborted"
            )
        else:
            error = type(cause)(f"call {name!r} failed: {who}: {type(cause).__name__}: {cause}")
        error.__cause__ = cause
        return error

    async def aclose(self, timeout: Timeout = None) -> None:
        """Stop the workers: every worker's :meth:`serve` returns (controller only).

        Calls already waiting their turn run first; calls made after ``aclose`` raise.
        Closing an aborted or closed channel does nothing.

        Args:
            timeout: seconds to wait for the calls in flight and for the workers to take
                the message; ``None``: the group's timeout.

        Raises:
            DistUsageError: called on a worker.
            DistTimeoutError: the calls in flight did not finish in time.
            DistError: the world failed while the message went out.
        """
        if not self.is_controller:
            raise DistUsageError(
                f"close: only the controller (rank {CONTROLLER_RANK}) closes the channel; "
                f"rank {self.group.rank} is a worker"
            )
        if self._closed:
            return
        self._closed = True
        seconds = to_seconds(timeout, None)
        lock = self.group.ordered()
        try:
            async with asyncio.timeout(seconds):
                await lock.acquire()
        except TimeoutError:
            raise DistTimeoutError(
                f"close: the calls in flight did not finish within {seconds:g} s"
            ) from None
        try:
            if self.group.is_aborted() or self.group.is_destroyed:
                return
            header = {"op": "close", "seq": self._seq}
            await asyncio.gather(
                *(
                    _api.broadcast(part, src=CONTROLLER_RANK, group=self.group, timeout=seconds)
                    for part in encode(header)[0]
                )
            )
        finally:
            lock.release()

    # -- the workers' side -----------------------------------------------------------------

    async def serve(self, handlers: Mapping[str, Handler]) -> None:
        """Run the controller's calls with ``handlers`` until it closes the channel.

        Each call runs ``await handlers[name](*arrays)`` and sends what it returns (an
        array, a tuple of arrays, or ``None``; numpy scalars count as arrays) back to the
        controller. An exception in a handler, or a name with no handler, fails that call
        on the controller with :class:`RemoteError`; serving goes on.

        Args:
            handlers: handler names to ``async def handler(*arrays)`` functions.

        Raises:
            DistUsageError: called on the controller, or ``handlers`` is not a non-empty
                mapping of names to callables.
            DistError: the world failed (a rank was lost, a deadline passed, ...): rebuild
                it (:func:`run_worker` does).
            DistProtocolError: the controller sent something this version cannot read.
        """
        if self.is_controller:
            raise DistUsageError(
                f"serve: rank {CONTROLLER_RANK} is the controller; it makes calls and the "
                "workers serve them"
            )
        table = check_handlers(handlers)
        pg = self.group
        while True:
            message, carried = await self._next_header()
            try:
                op, seq = message["op"], int(message["seq"])
                if op == "call":
                    tag, name = int(message["id"]), str(message["name"])
                    specs: Sequence[Any] = message["arrays"]
                    if not isinstance(specs, list):
                        raise TypeError("arrays")
            except (KeyError, TypeError, ValueError) as exc:
                raise DistProtocolError(f"bad serving header: {message!r}") from exc
            self._realign(seq)
            if op == "close":
                self._closed = True
                return
            if op != "call":
                raise DistProtocolError(f"bad serving header: {message!r}")
            if carried is not None:
                arrays = unpack(carried, specs)
            else:
                arrays = new_arrays(specs)
                if arrays:
                    await asyncio.gather(
                        *(_api.broadcast(a, src=CONTROLLER_RANK, group=pg) for a in arrays)
                    )
            reply, out = await self._run(table, name, arrays)
            parts, _ = encode(reply, out)
            await asyncio.gather(
                *(_api.send(part, dst=CONTROLLER_RANK, group=pg, tag=tag) for part in parts)
            )

    async def _next_header(self) -> tuple[dict[str, Any], npt.NDArray[np.uint8] | None]:
        pg = self.group
        first = np.empty(FIRST, np.uint8)
        # A worker waits for the next call as long as it takes: no deadline.
        await _api.broadcast(first, src=CONTROLLER_RANK, group=pg, timeout=math.inf)
        rest = None
        extra = overflow(first)
        if extra:
            rest = np.empty(extra, np.uint8)
            await _api.broadcast(rest, src=CONTROLLER_RANK, group=pg)
        return decode(first, rest)

    async def _run(
        self, table: Mapping[str, Handler], name: str, arrays: list[npt.NDArray[Any]]
    ) -> tuple[dict[str, Any], list[npt.NDArray[Any]]]:
        rank = self.group.rank
        handler = table.get(name)
        error = None
        if handler is None:
            error = f"LookupError: no handler named {name!r} (this worker serves {sorted(table)})"
        else:
            token = _serving.set(self)
            try:
                value = await handler(*arrays)
                kind, out = outgoing(value, name)
                specs = [array_spec(a, f"handler {name!r} returned") for a in out]
            except Exception as exc:
                # The world failed under the handler: serving cannot go on.
                self.group.check_usable("serve")
                logger.exception("rank %d: handler %r failed", rank, name)
                error = f"{type(exc).__name__}: {exc}"
            finally:
                _serving.reset(token)
        if error is not None:
            # The other workers may be waiting in a collective this rank will not issue:
            # rejecting the next operation of the workers' group fails it for them at once.
            self._refuse(f"handler {name!r} failed on rank {rank}: {error}")
            return {"ok": False, "error": error, "seq": self._worker_seq()}, []
        return {
            "ok": True,
            "kind": kind,
            "arrays": specs,
            "seq": self._worker_seq(),
        }, out

    def _worker_seq(self) -> int:
        return self.workers.next_seq if isinstance(self.workers, ProcessGroup) else 0

    def _refuse(self, reason: str) -> None:
        """Take the workers' group's next sequence number, rejecting it for every peer."""
        workers = self.workers
        if not isinstance(workers, ProcessGroup) or workers.size < 2:
            return
        with contextlib.suppress(DistUsageError):
            workers.issue("serve", _refuse, (reason,), rejecter=backends.reject)

    def _realign(self, seq: int) -> None:
        """Skip to sequence number ``seq`` of the workers' group (after a failed call)."""
        while self._worker_seq() < seq:
            self._refuse("skipped to realign the workers after a failed call")
