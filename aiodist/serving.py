"""Serving: one rank (the controller) hands calls to the others (the workers).

The pattern is a model server: rank 0 runs a web server and takes requests; ranks 1 to N-1
hold the model's shards and run collectives among themselves. A :class:`Channel` is what
passes between them::

    # rank 0, in a request handler (any number of them at once)
    replies = await channel.call("forward", x, timeout=5.0)  # one reply per worker

    # ranks 1.., once
    await channel.serve({"forward": forward})  # returns when the controller closes

A call broadcasts a header (the handler's name, the arrays' shapes and dtypes) with the
arrays from the controller (inside the header's message when they fit in it, after it
otherwise); every worker runs its handler, ``async def handler(*arrays)``, on them; each
worker's reply (an array, a tuple of arrays, or ``None``) comes back to the controller
point to point, the same way. ``call`` returns the replies as a list in worker order
(``replies[i]`` is from rank ``i + 1``), each as its handler returned it.

Inside a handler, :func:`worker_group` is the group of the workers (every rank but the
controller), for the collectives of a sharded model::

    async def forward(x):
        group = aiodist.serving.worker_group()
        h = np.maximum(x @ w1_shard, 0)
        hidden = np.empty((group.size, *h.shape), h.dtype)
        await aiodist.all_gather_into_tensor(hidden, h, group=group)
        return np.concatenate(hidden, axis=1) @ w2_shard

Calls from many tasks are safe: each call holds the group's
:meth:`~aiodist.ProcessGroup.ordered` lock from its header to its last reply, so the workers run calls one after another, in the
order the controller's tasks asked. A handler that raises fails its call only: the
controller raises :class:`RemoteError` naming the rank and the exception, and the next call
works. (The failing worker rejects the worker-group collective its peers may be waiting for,
so they fail at once instead of waiting out a timeout; the next header realigns the workers'
sequence numbers.) A call's ``timeout`` is its deadline: a worker that does not reply in time
fails the call with :class:`~aiodist.errors.DistTimeoutError` naming it and aborts the world,
as any operation deadline does.

:class:`Controller` (rank 0) and :func:`run_worker` (the other ranks) add the life cycle a
server needs: the group starts in the background (calls meanwhile raise :class:`Unavailable`
with the reason), is rebuilt in-process after a failure (a lost worker that its launcher
restarts joins the new group), and is closed in order on shutdown, after the calls in
flight. ``aiodist.contrib.aiohttp`` and ``aiodist.contrib.fastapi`` put a Controller into a
web application.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import math
import signal
import struct
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from . import _api, _assembly, _subgroups, group as _group
from ._arrays import as_array
from ._timeouts import Timeout, to_seconds
from .errors import DistError, DistProtocolError, DistTimeoutError, DistUsageError
from .group import NonGroupMember, Plan, ProcessGroup, World

__all__ = [
    "CONTROLLER_RANK",
    "Channel",
    "Controller",
    "Handler",
    "RemoteError",
    "Reply",
    "Unavailable",
    "run_worker",
    "worker_group",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: The rank that makes calls; every other rank is a worker.
CONTROLLER_RANK = 0

#: What a handler returns, and what :meth:`Channel.call` hands back for each worker.
Reply = npt.NDArray[Any] | tuple[npt.NDArray[Any], ...] | None
#: A worker's handler: ``async def handler(*arrays) -> Reply``.
Handler = Callable[..., Awaitable[Any]]

# A header travels as one fixed-size message: the length of its JSON and of the arrays'
# bytes carried with it, the JSON, then the arrays when they fit (a small request or reply
# is then one message). JSON that does not fit goes on in a second message, and arrays that
# do not fit follow as messages of their own.
_FIRST = 4096
_PREFIX = struct.Struct("<II")
_ROOM = _FIRST - _PREFIX.size
_MAX_HEADER = 1 << 20
_MAX_ARRAYS = 256
_MAX_NAME = 256
_MAX_NDIM = 32
#: Seconds between checks of the world's health while the ranks join a channel.
_JOIN_POLL = 1.0
#: Seconds between attempts to join the group again when the store cannot be reached.
_RETRY = 0.5


class RemoteError(DistError):
    """A handler raised on one or more workers; only this call failed.

    Attributes:
        name: the handler's name.
        failures: ``{rank: "ExceptionType: message"}`` for each worker whose handler failed
            (a worker whose collective was rejected because a peer's handler failed is
            listed too, with that rejection).
    """

    def __init__(self, name: str, failures: Mapping[int, str]) -> None:
        self.name = name
        self.failures = dict(failures)
        parts = "; ".join(f"on rank {r}: {text}" for r, text in sorted(self.failures.items()))
        super().__init__(f"call {name!r} failed {parts}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.name, self.failures))


class Unavailable(DistError):
    """The controller cannot take calls now: starting, rebuilding, failed or shutting down.

    Attributes:
        state: the controller's state (``"starting"``, ``"rebuilding"``, ``"failed"``,
            ``"closing"``, ``"closed"``).
        reason: why, in words (the failure that is being recovered from, for instance).
    """

    def __init__(self, state: str, reason: str) -> None:
        self.state = state
        self.reason = reason
        super().__init__(f"not ready ({state}): {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.state, self.reason))


# -- the wire format ---------------------------------------------------------------------------
def _encode(
    message: Mapping[str, Any], arrays: Sequence[npt.NDArray[Any]] = ()
) -> tuple[list[npt.NDArray[Any]], bool]:
    """The messages that carry ``message`` and ``arrays``, and whether the arrays are inside.

    The arrays travel inside the first message when they fit; otherwise they are among the
    messages returned, after the header's.
    """
    data = json.dumps(message, separators=(",", ":")).encode()
    size = sum(a.nbytes for a in arrays)
    inline = bool(arrays) and len(data) + size <= _ROOM
    first = np.zeros(_FIRST, np.uint8)
    head = _PREFIX.pack(len(data), size if inline else 0) + data[:_ROOM]
    first[: len(head)] = np.frombuffer(head, np.uint8)
    if inline:
        at = len(head)
        for a in arrays:
            first[at : at + a.nbytes] = a.reshape(-1).view(np.uint8)
            at += a.nbytes
        return [first], True
    parts: list[npt.NDArray[Any]] = [first]
    if len(data) > _ROOM:
        parts.append(np.frombuffer(data[_ROOM:], np.uint8))
    return [*parts, *arrays], False


def _overflow(first: npt.NDArray[np.uint8]) -> int:
    """How many bytes of the header's JSON follow ``first`` in a second message."""
    length, carried = _PREFIX.unpack(first[: _PREFIX.size].tobytes())
    if length > _MAX_HEADER or (carried and _PREFIX.size + length + carried > _FIRST):
        raise DistProtocolError(
            f"serving header of {length} bytes carrying {carried} bytes of arrays"
        )
    return max(0, int(length) - _ROOM)


def _decode(
    first: npt.NDArray[np.uint8], rest: npt.NDArray[np.uint8] | None
) -> tuple[dict[str, Any], npt.NDArray[np.uint8] | None]:
    """The header's message, and the bytes of the arrays it carries (``None`` if none)."""
    length, carried = _PREFIX.unpack(first[: _PREFIX.size].tobytes())
    data = first[_PREFIX.size : _PREFIX.size + min(int(length), _ROOM)].tobytes()
    if rest is not None:
        data += rest.tobytes()
    try:
        message = json.loads(data)
    except ValueError as exc:
        raise DistProtocolError(f"serving header is not JSON: {exc}") from exc
    if not isinstance(message, dict):
        raise DistProtocolError(f"serving header is not an object: {message!r}")
    if not carried:
        return message, None
    start = _PREFIX.size + int(length)
    return message, first[start : start + int(carried)]


def _unpack(carried: npt.NDArray[np.uint8], specs: Sequence[Any]) -> list[npt.NDArray[Any]]:
    """New arrays for ``specs``, filled from the bytes a header carried."""
    arrays = [_empty(s) for s in specs]
    if sum(a.nbytes for a in arrays) != len(carried):
        raise DistProtocolError(f"serving header carries {len(carried)} bytes for {specs!r}")
    at = 0
    for a in arrays:
        a.reshape(-1).view(np.uint8)[:] = carried[at : at + a.nbytes]
        at += a.nbytes
    return arrays


def _dtype_code(dtype: np.dtype[Any]) -> str:
    return "bfloat16" if dtype.name == "bfloat16" else dtype.str


def _spec(a: npt.NDArray[Any], what: str) -> list[Any]:
    """The ``[dtype, shape]`` of ``a`` for a header (at most 32 dimensions keep it bounded)."""
    if a.ndim > _MAX_NDIM:
        raise DistUsageError(f"{what}: an array of {a.ndim} dimensions (at most {_MAX_NDIM})")
    return [_dtype_code(a.dtype), list(a.shape)]


def _empty(spec: object) -> npt.NDArray[Any]:
    """A new array for a ``[dtype, shape]`` spec read off the wire."""
    try:
        if not isinstance(spec, list) or len(spec) != 2:
            raise ValueError("not [dtype, shape]")
        code, shape = spec
        if code == "bfloat16":
            import ml_dtypes

            dtype = np.dtype(ml_dtypes.bfloat16)
        else:
            dtype = np.dtype(code)
        dims = tuple(int(d) for d in shape)
        if len(dims) > _MAX_NDIM or any(d < 0 for d in dims):
            raise ValueError(f"shape {dims}")
        return np.empty(dims, dtype)
    except (TypeError, ValueError, ImportError) as exc:
        raise DistProtocolError(f"bad array spec in a serving header: {spec!r}: {exc}") from exc


def _check_name(name: object, what: str) -> str:
    if not isinstance(name, str) or not name or len(name) > _MAX_NAME:
        raise DistUsageError(
            f"{what}: a handler name must be a non-empty string of at most {_MAX_NAME} "
            f"characters, got {name!r}"
        )
    return name


def _check_handlers(handlers: object) -> dict[str, Handler]:
    if not isinstance(handlers, Mapping) or not handlers:
        raise DistUsageError(
            f"serve: handlers must be a non-empty mapping of names to async functions, "
            f"got {type(handlers).__name__}"
        )
    table: dict[str, Handler] = {}
    for name, fn in handlers.items():
        _check_name(name, "serve")
        if not callable(fn):
            raise DistUsageError(f"serve: handler {name!r} is not callable: {fn!r}")
        table[name] = fn
    return table


def _outgoing(value: object, name: str) -> tuple[str, list[npt.NDArray[Any]]]:
    """A handler's return value as ``(kind, arrays)``, checked for the wire."""
    where = f"handler {name!r} returned"
    if value is None:
        return "none", []
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if isinstance(value, tuple):
        if len(value) > _MAX_ARRAYS:
            raise DistUsageError(f"{where} {len(value)} arrays (at most {_MAX_ARRAYS})")
        items = [np.asarray(v) if isinstance(v, np.generic) else v for v in value]
        return "tuple", [
            as_array(v, writable=False, name=f"{where} a tuple whose item {i}")
            for i, v in enumerate(items)
        ]
    if isinstance(value, np.ndarray) or hasattr(value, "__dlpack__"):
        return "array", [as_array(value, writable=False, name=f"{where} an array that")]
    raise DistUsageError(
        f"{where} {type(value).__name__}; a handler returns an array, a tuple of arrays, or None"
    )


# -- the channel -------------------------------------------------------------------------------
_serving: contextvars.ContextVar[Channel | None] = contextvars.ContextVar(
    "aiodist_serving", default=None
)


def worker_group() -> ProcessGroup:
    """Return the group of the workers, inside a handler that :meth:`Channel.serve` runs.

    The group holds every rank but the controller, in rank order (group rank ``i`` is
    global rank ``i + 1``): a handler's collectives run on it, since the controller does not
    take part in them.

    Raises:
        DistUsageError: called outside a handler.
    """
    channel = _serving.get()
    if channel is None or not isinstance(channel.workers, ProcessGroup):
        raise DistUsageError(
            "worker_group() is only available inside a handler run by Channel.serve"
        )
    return channel.workers


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
        _check_name(name, "call")
        try:
            seconds = to_seconds(timeout, None)
        except DistUsageError as exc:
            raise DistUsageError(f"call {name!r}: {exc}") from None
        if len(arrays) > _MAX_ARRAYS:
            raise DistUsageError(f"call {name!r}: {len(arrays)} arrays (at most {_MAX_ARRAYS})")
        payload = [
            as_array(a, writable=False, name=f"call {name!r}: argument {i}")
            for i, a in enumerate(arrays)
        ]
        header = {
            "op": "call",
            "name": name,
            "arrays": [_spec(a, f"call {name!r}") for a in payload],
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
        parts, _ = _encode(header, payload)
        sent = [
            _api.broadcast(part, src=CONTROLLER_RANK, group=pg, timeout=self._left(deadline))
            for part in parts
        ]
        firsts = [np.empty(_FIRST, np.uint8) for _ in self.worker_ranks]
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
        extra = _overflow(first)
        if extra:
            rest = np.empty(extra, np.uint8)
            await _api.recv(rest, src=rank, group=pg, tag=tag, timeout=self._left(deadline))
        message, carried = _decode(first, rest)
        try:
            ok, seq = bool(message["ok"]), int(message["seq"])
            if not ok:
                return _Reply(False, seq, error=str(message["error"]))
            kind, specs = message["kind"], message["arrays"]
        except (KeyError, TypeError, ValueError) as exc:
            raise DistProtocolError(f"bad serving reply from rank {rank}: {message!r}") from exc
        if carried is not None:
            arrays = _unpack(carried, specs)
        else:
            arrays = [_empty(s) for s in specs]
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
                    for part in _encode(header)[0]
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
        table = _check_handlers(handlers)
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
                arrays = _unpack(carried, specs)
            else:
                arrays = [_empty(s) for s in specs]
                if arrays:
                    await asyncio.gather(
                        *(_api.broadcast(a, src=CONTROLLER_RANK, group=pg) for a in arrays)
                    )
            reply, out = await self._run(table, name, arrays)
            parts, _ = _encode(reply, out)
            await asyncio.gather(
                *(_api.send(part, dst=CONTROLLER_RANK, group=pg, tag=tag) for part in parts)
            )

    async def _next_header(self) -> tuple[dict[str, Any], npt.NDArray[np.uint8] | None]:
        pg = self.group
        first = np.empty(_FIRST, np.uint8)
        # A worker waits for the next call as long as it takes: no deadline.
        await _api.broadcast(first, src=CONTROLLER_RANK, group=pg, timeout=math.inf)
        rest = None
        extra = _overflow(first)
        if extra:
            rest = np.empty(extra, np.uint8)
            await _api.broadcast(rest, src=CONTROLLER_RANK, group=pg)
        return _decode(first, rest)

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
                kind, out = _outgoing(value, name)
                specs = [_spec(a, f"handler {name!r} returned") for a in out]
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
            workers.issue("serve", _refuse, (reason,))

    def _realign(self, seq: int) -> None:
        """Skip to sequence number ``seq`` of the workers' group (after a failed call)."""
        while self._worker_seq() < seq:
            self._refuse("skipped to realign the workers after a failed call")


# -- the life cycle ----------------------------------------------------------------------------
async def _destroy(world: World) -> None:
    """``destroy_process_group()`` for ``world``, from whichever task holds it."""
    if _group.peek_world() is world:
        _group.set_current_world(None)
    await world.aclose()


class Controller:
    """Rank 0 of a serving job: the group, its channel to the workers, and their life cycle.

    :meth:`start` joins the process group in a background task, so a server takes requests
    at once: until every rank has joined, :meth:`call` raises :class:`Unavailable` with the
    reason. When the world fails (a worker lost, a call's deadline passed), the controller
    destroys the group and joins a new one, in the same process: workers that survived join
    it again (:func:`run_worker` does), and a worker that was restarted joins it for the
    first time. :meth:`aclose` lets the calls in flight finish, stops the workers and
    destroys the group. ``async with Controller(...) as controller:`` starts it and closes
    it at the end.

    Args:
        rebuild: join a new group after a failure (otherwise the controller stays
            ``"failed"``).
        drain_timeout: seconds :meth:`aclose` waits for the calls in flight.
        **init: arguments of :func:`aiodist.init_process_group` (``init_method``,
            ``timeout``, ``backend``, ``store``, ...); by default ``env://``, as under
            ``aiodist-run``.

    Raises:
        DistUsageError: ``drain_timeout`` is not a number of seconds.
    """

    def __init__(self, *, rebuild: bool = True, drain_timeout: float = 30.0, **init: Any) -> None:
        self._init = init
        self._rebuild = rebuild
        self._drain_timeout = to_seconds(drain_timeout)
        self._state = "new"
        self._reason = "not started"
        self._generation = 0
        self._calls = 0
        self._failed = 0
        self._in_flight = 0
        self._channel: Channel | None = None
        self._world: World | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = asyncio.Event()
        self._changed = asyncio.Event()

    def __repr__(self) -> str:
        return (
            f"<Controller {self._state} generation={self._generation} calls={self._calls} "
            f"in_flight={self._in_flight}>"
        )

    def _now(self) -> tuple[str, str]:
        """The state and reason, counting a failure the background task has not seen yet."""
        channel = self._channel
        if self._state == "ready" and channel is not None:
            cause = channel.group.world.broken
            if cause is not None:
                return self._failed_state(cause)
        return self._state, self._reason

    @property
    def state(self) -> str:
        """``"new"``, ``"starting"``, ``"ready"``, ``"rebuilding"``, ``"failed"``,
        ``"closing"`` or ``"closed"``."""
        return self._now()[0]

    @property
    def reason(self) -> str:
        """Why the controller is not ready (``""`` when it is)."""
        return self._now()[1]

    @property
    def channel(self) -> Channel:
        """The channel of the current group.

        Raises:
            Unavailable: the controller is not ready.
        """
        state, reason = self._now()
        channel = self._channel
        if state != "ready" or channel is None:
            raise Unavailable(state, reason)
        return channel

    def health(self) -> dict[str, Any]:
        """The controller's state for a health check (JSON-ready).

        ``ready`` says whether calls can be made; ``reason`` says why not (the failure
        being recovered from, which names the rank it came from); ``generation`` counts the
        groups built; ``world_size`` is the group's (while joining, the one asked for, if
        given); ``calls`` and ``failed`` count the calls made and those that raised;
        ``in_flight`` the calls running now.
        """
        state, reason = self._now()
        world = self._world
        return {
            "ready": state == "ready",
            "state": state,
            "reason": reason,
            "generation": self._generation,
            "world_size": self._init.get("world_size") if world is None else world.size,
            "calls": self._calls,
            "failed": self._failed,
            "in_flight": self._in_flight,
        }

    async def __aenter__(self) -> Controller:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def start(self) -> None:
        """Start joining the process group in a background task; return at once.

        Raises:
            DistUsageError: already started.
        """
        if self._task is not None:
            raise DistUsageError(f"{self!r} was already started")
        self._set("starting", "waiting for every rank to join the process group")
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def wait_ready(self, timeout: Timeout = None) -> Channel:
        """Wait until the controller is ready; return its channel.

        Raises:
            DistTimeoutError: not ready within ``timeout`` seconds.
            Unavailable: the controller failed (with ``rebuild=False``) or was closed.
        """
        seconds = to_seconds(timeout, None)
        try:
            async with asyncio.timeout(seconds):
                while (now := self._now())[0] != "ready":
                    if now[0] in ("failed", "closing", "closed", "new"):
                        raise Unavailable(*now)
                    await self._changed.wait()
        except TimeoutError:
            raise DistTimeoutError(
                f"the controller was not ready within {seconds:g} s: {self.state}: {self.reason}"
            ) from None
        return self.channel

    async def call(self, name: str, *arrays: Any, timeout: Timeout = None) -> list[Reply]:
        """:meth:`Channel.call` on the current group.

        Raises:
            Unavailable: the group is not ready (starting, rebuilding, failed, closing).
            DistUsageError, RemoteError, DistTimeoutError, DistError: as
                :meth:`Channel.call`.
        """
        channel = self.channel
        self._in_flight += 1
        self._calls += 1
        try:
            return await channel.call(name, *arrays, timeout=timeout)
        except Exception:
            self._failed += 1
            raise
        finally:
            self._in_flight -= 1

    def _set(self, state: str, reason: str) -> None:
        if state != self._state:
            log = logger.warning if state in ("rebuilding", "failed") else logger.info
            log("serving controller: %s%s", state, f": {reason}" if reason else "")
        self._state, self._reason = state, reason
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _run(self) -> None:
        while True:
            try:
                # A rank given up front is checked before joining, which waits for every rank.
                _check_controller_rank(self._init.get("rank"))
                pg = await _api.init_process_group(**self._init)
                self._world = pg.world
                _check_controller_rank(pg.rank)
                channel = await Channel.create(pg)
            except DistError as exc:
                aborted = self._world is not None and self._world.broken is not None
                await self._drop_world()
                # A usage error outside a failure is a wrong configuration: joining again
                # would fail the same way.
                if not self._rebuild or (isinstance(exc, DistUsageError) and not aborted):
                    self._set("failed", f"cannot start the process group: {exc}")
                    return
                self._set(self._state, f"joining the process group failed ({exc}); trying again")
                await asyncio.sleep(_RETRY)
                continue
            self._channel = channel
            self._generation += 1
            self._set("ready", "")
            cause = await pg.wait_aborted()
            if cause is None:
                cause = DistError("the process group was destroyed")
            self._set(*self._failed_state(cause))
            self._channel = None
            await self._drop_world()
            if not self._rebuild:
                return

    def _failed_state(self, cause: BaseException) -> tuple[str, str]:
        reason = f"the process group failed: {type(cause).__name__}: {cause}"
        if self._rebuild:
            return "rebuilding", f"{reason}; rebuilding it"
        return "failed", reason

    async def _drop_world(self) -> None:
        world, self._world = self._world, None
        if world is not None:
            try:
                await _destroy(world)
            except DistError as exc:
                logger.warning("serving controller: destroying the process group: %s", exc)

    async def aclose(self) -> None:
        """Let the calls in flight finish, stop the workers, and destroy the group.

        New calls raise :class:`Unavailable` from the moment it is called. If calls are
        still running after ``drain_timeout`` seconds, the group is aborted instead (the
        workers then rebuild or stop, as their launcher decides).
        """
        if self._state in ("closing", "closed"):
            await self._closed.wait()
            return
        channel = self._channel if self._state == "ready" else None
        self._set("closing", "shutting down")
        try:
            why = "the controller shut down before every rank had joined"
            if channel is not None:
                try:
                    await channel.aclose(self._drain_timeout)
                    why = ""
                except DistTimeoutError as exc:
                    why = f"the controller shut down: {exc}"
                except DistError as exc:
                    logger.warning("serving controller: closing the channel: %s", exc)
            if self._task is not None:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
            world = self._world
            if why and world is not None and world.broken is None:
                # Workers not told to stop would wait for calls forever: tell them why.
                world.default_group.abort(why)
            await self._drop_world()
        finally:
            self._channel = None
            self._set("closed", "shut down")
            self._closed.set()


def _check_worker_rank(rank: int | None) -> None:
    if rank == CONTROLLER_RANK:
        raise DistUsageError(
            f"rank {CONTROLLER_RANK} is the controller (it makes calls); "
            "run_worker runs on the other ranks"
        )


def _check_controller_rank(rank: int | None) -> None:
    if rank is not None and rank != CONTROLLER_RANK:
        raise DistUsageError(
            f"the controller must be rank {CONTROLLER_RANK}, but this process is rank {rank}; "
            "the other ranks run run_worker"
        )


async def run_worker(handlers: Mapping[str, Handler], *, rebuild: bool = True, **init: Any) -> None:
    """Be a worker of a serving job: join the group and serve calls until the controller closes.

    After a failure of the world (a rank lost, a call's deadline passed), the worker
    destroys the group and joins a new one, as the controller does, so that a restarted
    rank finds every other rank in the new group.

    Signals: on the first SIGTERM or SIGINT (the launcher forwards them to every rank), a
    worker keeps serving until the controller, shutting down too, has finished its calls
    and closed the channel; a second one, or one while no group is up, stops it at once.

    Args:
        handlers: handler names to ``async def handler(*arrays)`` functions (see
            :meth:`Channel.serve`).
        rebuild: join a new group after a failure (otherwise raise it).
        **init: arguments of :func:`aiodist.init_process_group`; by default ``env://``.

    Raises:
        DistUsageError: bad ``handlers``, or this process is the controller (rank 0).
        DistError: the world failed and ``rebuild`` is false, or the group could not be
            joined.
    """
    table = _check_handlers(handlers)
    _check_worker_rank(init.get("rank"))  # before joining, which waits for every rank
    loop = asyncio.get_running_loop()
    me = asyncio.current_task()
    # "joining" a group, "serving" calls, or "leaving" (serve returned: the process ends).
    phase = "joining"
    stopping = ""  # the signal that asked this worker to stop

    def on_signal(signum: int) -> None:
        nonlocal stopping
        name = signal.Signals(signum).name
        if phase == "leaving":
            return  # already on the way out
        if phase == "serving" and not stopping:
            stopping = name
            logger.warning(
                "worker: %s: serving until the controller closes the channel (again to stop now)",
                name,
            )
            return
        logger.warning("worker: %s: stopping", name)
        stopping = name
        if me is not None:
            me.cancel()

    installed = []
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(signum, on_signal, signum)
                installed.append(signum)
    try:
        while True:
            phase = "joining"
            try:
                pg = await _api.init_process_group(**init)
            except DistError as exc:
                # A rank left while the group formed: join the next generation.
                if not rebuild or isinstance(exc, DistUsageError):
                    raise
                logger.warning("worker: joining the process group failed (%s); trying again", exc)
                await asyncio.sleep(_RETRY)
                continue
            world = pg.world
            try:
                _check_worker_rank(pg.rank)
                channel = await Channel.create(pg)
                phase = "serving"
                await channel.serve(table)
                phase = "leaving"
                return
            except DistError as exc:
                if stopping:
                    phase = "leaving"
                    return
                if not (rebuild and pg.is_aborted()):
                    raise
                logger.warning(
                    "rank %d: the process group failed (%s); joining a new one", pg.rank, exc
                )
            finally:
                if phase != "leaving" and not pg.is_aborted():
                    # Leaving a group whose controller still counts on this worker is a
                    # failure: the others must hear of it now, not at their next call.
                    why = f"{stopping} stopped it" if stopping else "it stopped serving"
                    pg.abort(f"worker rank {pg.rank} left: {why}")
                await _destroy(world)
    except asyncio.CancelledError:
        if not stopping:
            raise
        if me is not None:
            me.uncancel()
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)
