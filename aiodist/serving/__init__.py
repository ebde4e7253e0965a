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

The package is serving: this module (``Controller``, ``run_worker``), ``_channel``
(the Channel of calls from a controller to its workers) and ``_wire`` (the format of calls
and replies). It may import the async API and everything below it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import weakref
from collections.abc import Mapping
from typing import Any

from .. import _api, group as _group
from .._util._timeouts import Timeout, to_seconds
from ..errors import DistError, DistTimeoutError, DistUsageError
from ..group import ProcessGroup, World
from . import _channel as _serving_channel
from ._channel import Channel, RemoteError, check_handlers, current_channel

__all__ = [
    "CONTROLLER_RANK",
    "STATES",
    "Channel",
    "Controller",
    "Handler",
    "RemoteError",
    "Reply",
    "Unavailable",
    "controllers",
    "run_worker",
    "worker_group",
]

logger = logging.getLogger(__name__)

# Defined with the channel, which uses them; bound again here for their documentation.
#: The rank that makes calls; every other rank is a worker.
CONTROLLER_RANK = _serving_channel.CONTROLLER_RANK

#: What a handler returns, and what :meth:`Channel.call` hands back for each worker.
Reply = _serving_channel.Reply
#: A worker's handler, ``async def handler(*arrays) -> Reply``.
Handler = _serving_channel.Handler

#: Seconds between attempts to join the group again when the store cannot be reached.
_RETRY = 0.5

#: Every state a :class:`Controller` is in at some point, in the order of its life.
STATES = ("new", "starting", "ready", "rebuilding", "failed", "closing", "closed")

# The controllers of this process, for aiodist.metrics.
_controllers: weakref.WeakSet[Controller] = weakref.WeakSet()


def controllers() -> list[Controller]:
    """The :class:`Controller` objects of this process (for :mod:`aiodist.metrics`)."""
    return list(_controllers)


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


def worker_group() -> ProcessGroup:
    """Return the group of the workers, inside a handler that :meth:`Channel.serve` runs.

    The group holds every rank but the controller, in rank order (group rank ``i`` is
    global rank ``i + 1``): a handler's collectives run on it, since the controller does not
    take part in them.

    Raises:
        DistUsageError: called outside a handler.
    """
    channel = current_channel()
    if channel is None or not isinstance(channel.workers, ProcessGroup):
        raise DistUsageError(
            "worker_group() is only available inside a handler run by Channel.serve"
        )
    return channel.workers


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
        self._refused = 0
        self._in_flight = 0
        self._channel: Channel | None = None
        self._world: World | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = asyncio.Event()
        self._changed = asyncio.Event()
        _controllers.add(self)

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
        ``in_flight`` the calls running now; ``refused`` the calls refused because the
        controller was not ready (:class:`Unavailable`).
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
            "refused": self._refused,
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
        try:
            channel = self.channel
        except Unavailable:
            self._refused += 1
            raise
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
    table = check_handlers(handlers)
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
