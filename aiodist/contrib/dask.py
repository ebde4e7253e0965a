# distributed ships type information, but most of its API (Client.gather, Future.exception,
# Variable, ...) is not annotated: calls to it are unchecked here.
# mypy: disallow-untyped-calls=False
"""Process groups on the workers of a Dask cluster (``pip install distributed``).

:func:`run` runs a function once on each worker of a ``distributed.Client``'s cluster
(or of the ``workers`` it is given), all at the same time, as the ranks of one process
group, and returns what each rank returned, in rank order::

    import numpy as np
    from distributed import Client, LocalCluster

    import aiodist
    from aiodist.contrib.dask import run


    async def step(scale):
        x = np.full(4, (aiodist.get_rank() + 1) * scale)
        await aiodist.all_reduce(x)  # the group is the default group here
        return x


    if __name__ == "__main__":
        with LocalCluster(n_workers=2, threads_per_worker=1) as cluster, Client(cluster) as client:
            print(run(client, step, 1.0))  # [array([3., 3., 3., 3.]), array([3., 3., 3., 3.])]

Rank ``i`` is the ``i``-th worker of ``workers``, or of the cluster's worker addresses
sorted; the world size is their number. Each rank is one task pinned to its worker: the
arrays the ranks exchange move through aiodist's collectives (shared memory between the
workers of one host, TCP between hosts), and Dask carries only ``fn``, its arguments and
what each rank returns. ``fn`` may be

* a coroutine function (``async def``): each rank runs it on a fresh event loop in its
  task's thread, with the rank's group as the default group of the asynchronous API
  (``await aiodist.all_reduce(x)``); the group belongs to that task alone, so a worker with
  several threads may run ranks of several jobs at once;
* a plain function that uses the blocking API (``import aiodist.sync as dist``;
  ``dist.all_reduce(x)``): the group is then its worker process's default group, so such a
  process runs one rank of such a job at a time.

How the group forms: rank 0's task hosts the group's store on its worker's host, at a port
the kernel picks while binding (no race with other jobs), and publishes its address in a
``distributed.Variable`` of a name unique to the job, from which the other ranks read
it; the client deletes the variable when the job ends. Each job gets a fresh random token,
so its store and the connections between its ranks refuse anyone outside the job; each
rank's transport listens on its worker's host (``AIODIST_HOST``, unless set), so the
workers may be spread over several machines. Every task leaves its group when ``fn``
returns or raises; rank 0 keeps the store up until every rank has left.

When ``fn`` raises on one rank, that rank aborts the group: the other ranks' operations
fail at once (with :class:`~aiodist.DistNetworkError` naming it) instead of waiting for it,
and :func:`run` raises the first rank's own exception, with a note naming the rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

try:
    import distributed
    from distributed.comm.addressing import get_address_host
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError("aiodist.contrib.dask needs Dask: pip install distributed") from exc

from .. import _api, group
from ..errors import DistError, DistNetworkError, DistTimeoutError, DistUsageError
from ..store import TCPStore
from ..sync._loop_thread import run as _run_on_loop_thread

__all__ = ["run", "run_async"]

logger = logging.getLogger(__name__)

#: Keys of this module in the group's store, apart from the group's own.
_LEFT = "aiodist-dask/left/"
#: Seconds rank 0 of an aborted group keeps the store up for the other ranks to leave.
_ABORTED_LEAVE_WAIT = 2.0
#: The attribute by which a rank's task marks its exception: ``True`` when the rank failed
#: on its own, ``False`` when it failed because another rank aborted the group first.
_ORIGIN = "_aiodist_dask_origin"


@dataclass(frozen=True)
class _Job:
    """What every rank's task of one :func:`run` needs to know."""

    name: str  # unique: the tasks' key and the store address variable's name
    workers: tuple[str, ...]  # rank order
    token: str
    backend: str | None
    timeout: float
    is_async: bool


# -- the client's side ---------------------------------------------------------------------
def run(
    client: Any,
    fn: Callable[..., Any],
    /,
    *args: Any,
    workers: Sequence[str] | None = None,
    backend: str | None = None,
    timeout: float = 300.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on Dask workers as the ranks of one process group.

    One task is pinned to each worker, and all of them run at the same time. Rank ``i`` runs
    on the ``i``-th worker of ``workers``, or of the cluster's worker addresses sorted; the
    world size is the number of those workers. The group is the default group inside
    ``fn`` and is destroyed when ``fn`` returns or raises.

    Args:
        client: a synchronous ``distributed.Client`` of the cluster (with an asynchronous
            one, await :func:`run_async`).
        fn: an ``async def`` function, which uses the asynchronous API (``await
            aiodist.all_reduce(x)``), or a plain one, which uses ``aiodist.sync``. Dask
            pickles it (with cloudpickle), with its arguments, for every rank.
        *args: positional arguments of ``fn``, the same for every rank (``fn`` picks its
            share with ``aiodist.get_rank()``).
        workers: the addresses of the workers to run on, in rank order (``None``: every
            worker of the cluster).
        backend: as for :func:`aiodist.init_process_group`.
        timeout: seconds for the ranks to meet (every task started and the group formed);
            also the group's timeout (the limit of each of its operations), and how long
            ``run`` waits for the other ranks to end once one rank failed.
        **kwargs: keyword arguments of ``fn`` (other than ``workers``, ``backend`` and
            ``timeout``).

    Returns:
        What ``fn`` returned on each rank, in rank order.

    Raises:
        DistUsageError: a bad argument: ``fn`` not callable, no worker (in the cluster or
            in ``workers``), an entry of ``workers`` that is not a worker of the cluster
            or is given twice, a timeout that is not a positive number, or an asynchronous
            ``client``; nothing was submitted then.
        BaseException: ``fn``'s exception on the rank that failed first (ranks that only
            failed because of it are named in a note), or the aiodist error that stopped
            the group from forming (a :class:`~aiodist.DistTimeoutError` when a worker did
            not start its task in time).
    """
    _check_client(client, asynchronous=False)
    _check_arguments(fn, backend, timeout)
    identity = client.sync(_scheduler(client).identity)
    job = _make_job(fn, identity, workers, backend, timeout)
    futures = _submit(client, job, fn, args, kwargs)
    try:
        try:
            return list(client.gather(futures))
        except BaseException:
            if not any(f.status == "error" for f in futures):
                raise  # (not a rank's failure: Ctrl-C, a lost scheduler)
        failures: list[tuple[int, BaseException, Any]] = []
        deadline = time.monotonic() + job.timeout
        for rank, future in enumerate(futures):
            try:
                exc = future.exception(timeout=max(0.0, deadline - time.monotonic()))
                if exc is not None:
                    failures.append((rank, exc, future.traceback()))
            except (Exception, asyncio.CancelledError) as error:  # still running, cancelled
                logger.info("aiodist.contrib.dask: rank %d did not end: %r", rank, error)
        rank, exc, tb = _root_cause(failures)
        raise exc.with_traceback(tb)
    finally:
        pending = [f for f in futures if not f.done()]
        if pending:
            client.cancel(pending)
        distributed.Variable(job.name, client=client).delete()


async def run_async(
    client: Any,
    fn: Callable[..., Any],
    /,
    *args: Any,
    workers: Sequence[str] | None = None,
    backend: str | None = None,
    timeout: float = 300.0,
    **kwargs: Any,
) -> list[Any]:
    """Like :func:`run`, through an asynchronous client (``Client(..., asynchronous=True)``).

    Args:
        client: an asynchronous ``distributed.Client`` of the cluster.
        fn: as for :func:`run`.
        *args: as for :func:`run`.
        workers: as for :func:`run`.
        backend: as for :func:`run`.
        timeout: as for :func:`run`.
        **kwargs: as for :func:`run`.

    Returns:
        What ``fn`` returned on each rank, in rank order.

    Raises:
        DistUsageError: as for :func:`run` (and a synchronous ``client``).
        BaseException: as for :func:`run`. If the awaiting task is cancelled, the ranks'
            tasks are cancelled too.
    """
    _check_client(client, asynchronous=True)
    _check_arguments(fn, backend, timeout)
    identity = await _scheduler(client).identity()
    job = _make_job(fn, identity, workers, backend, timeout)
    futures = _submit(client, job, fn, args, kwargs)
    try:
        try:
            return list(await client.gather(futures))
        except BaseException:
            if not any(f.status == "error" for f in futures):
                raise
        failures: list[tuple[int, BaseException, Any]] = []
        deadline = time.monotonic() + job.timeout
        for rank, future in enumerate(futures):
            try:
                exc = await future.exception(timeout=max(0.0, deadline - time.monotonic()))
                if exc is not None:
                    failures.append((rank, exc, await future.traceback()))
            except (Exception, asyncio.CancelledError) as error:
                if isinstance(error, asyncio.CancelledError) and _cancelling():
                    raise
                logger.info("aiodist.contrib.dask: rank %d did not end: %r", rank, error)
        rank, exc, tb = _root_cause(failures)
        raise exc.with_traceback(tb)
    finally:
        pending = [f for f in futures if not f.done()]
        if pending:
            await client.cancel(pending)
        distributed.Variable(job.name, client=client).delete()


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _check_client(client: object, *, asynchronous: bool) -> None:
    if not isinstance(client, distributed.Client):
        raise DistUsageError(f"client must be a distributed.Client, got {type(client).__name__}")
    if bool(client.asynchronous) != asynchronous:
        raise DistUsageError(
            "client is asynchronous: use `await run_async(client, fn, ...)`"
            if client.asynchronous
            else "client is synchronous: use `run(client, fn, ...)`"
        )


def _scheduler(client: distributed.Client) -> Any:
    if client.scheduler is None:
        raise DistUsageError("client is not connected to a scheduler")
    return client.scheduler


def _check_arguments(fn: object, backend: object, timeout: object) -> None:
    if not callable(fn):
        raise DistUsageError(f"fn must be callable, got {type(fn).__name__} {fn!r:.80}")
    if backend is not None and not isinstance(backend, str):
        raise DistUsageError(f"backend must be a string or None, got {type(backend).__name__}")
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise DistUsageError(f"timeout must be a positive number of seconds, got {timeout!r}")


def _make_job(
    fn: Callable[..., Any],
    identity: dict[str, Any],
    workers: Sequence[str] | None,
    backend: str | None,
    timeout: float,
) -> _Job:
    """The job's plan: its ranks' workers, checked against the scheduler's ``identity``."""
    cluster = sorted(identity.get("workers", {}))
    if workers is None:
        if not cluster:
            raise DistUsageError("the Dask cluster has no workers to run the ranks on")
        chosen = tuple(cluster)
    else:
        if isinstance(workers, str) or not isinstance(workers, Sequence):
            raise DistUsageError(
                f"workers must be a list of worker addresses, got {type(workers).__name__}"
            )
        if not workers:
            raise DistUsageError("workers is empty: give at least one worker address")
        known = set(cluster)
        seen: set[str] = set()
        for address in workers:
            if not isinstance(address, str) or address not in known:
                raise DistUsageError(
                    f"workers: {address!r} is not a worker of the Dask cluster; its workers "
                    f"are {', '.join(cluster) or 'none'}"
                )
            if address in seen:
                raise DistUsageError(f"workers: {address!r} is given twice")
            seen.add(address)
        chosen = tuple(workers)
    name = getattr(fn, "__name__", type(fn).__name__)
    return _Job(
        name=f"aiodist-{name}-{secrets.token_hex(8)}",
        workers=chosen,
        token=secrets.token_hex(32),
        backend=backend,
        timeout=float(timeout),
        is_async=_is_async(fn),
    )


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004  (an object with an async __call__)
    )


def _submit(
    client: distributed.Client,
    job: _Job,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> list[distributed.Future[Any]]:
    return [
        client.submit(
            _rank_task,
            job,
            rank,
            fn,
            args,
            kwargs,
            key=f"{job.name}-rank-{rank}",
            workers=[address],
            allow_other_workers=False,
            pure=False,
        )
        for rank, address in enumerate(job.workers)
    ]


def _root_cause(
    failures: list[tuple[int, BaseException, Any]],
) -> tuple[int, BaseException, Any]:
    """The failure to raise: a rank's own failure before one caused by another's abort
    (unmarked, when Dask could not carry the mark), a non-aiodist error before an aiodist
    one, then the lowest rank. The other failures are listed in a note on it."""

    def order(failure: tuple[int, BaseException, Any]) -> tuple[int, bool, int]:
        rank, exc, _ = failure
        origin = getattr(exc, _ORIGIN, None)
        return (
            0 if origin is True else 1 if origin is None else 2,
            isinstance(exc, DistError),
            rank,
        )

    if not failures:  # (every failed task was cancelled or is still running)
        raise DistError("aiodist.contrib.dask: a rank failed, but its error could not be read")
    failures = sorted(failures, key=order)
    first = failures[0]
    if len(failures) > 1:
        others = "; ".join(
            f"rank {rank}: {_summary(exc)}" for rank, exc, _ in sorted(failures[1:], key=_rank)
        )
        first[1].add_note(f"the other ranks that failed: {others}")
    return first


def _rank(failure: tuple[int, BaseException, Any]) -> int:
    return failure[0]


def _summary(exc: BaseException) -> str:
    """The exception's type and the first line of its message, at most 200 characters."""
    lines = str(exc).splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


# -- a rank's side ---------------------------------------------------------------------------
def _rank_task(
    job: _Job,
    rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """The task of ``rank``: form the group, run ``fn`` in it, leave it."""
    worker = distributed.get_worker()
    host = get_address_host(worker.address)
    # Listen where the other ranks can reach this one: its worker's host, not loopback.
    os.environ.setdefault("AIODIST_HOST", host)
    rank_ = _Rank(job, rank, host, distributed.get_client())
    if job.is_async:
        return asyncio.run(rank_.run_async(fn, args, kwargs))
    return rank_.run_sync(fn, args, kwargs)


class _Rank:
    """One rank of a job: joins the group, runs ``fn``, marks its failure, leaves."""

    def __init__(self, job: _Job, rank: int, host: str, client: distributed.Client) -> None:
        self.job, self.rank, self.host, self.client = job, rank, host, client
        self.store: TCPStore | None = None
        self.pg: group.ProcessGroup | None = None
        self.where = f"rank {rank} of {len(job.workers)} (Dask worker {job.workers[rank]})"

    async def run_async(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        # The group belongs to this task's context alone: several ranks of several jobs may
        # run in threads of one worker process.
        group.isolate_context()
        failure: BaseException | None = None
        try:
            await self.join()
            return await fn(*args, **kwargs)
        except BaseException as exc:
            failure = self.failed(exc)
            raise
        finally:
            await self.leave(failure)

    def run_sync(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        # aiodist.sync runs the group on its event-loop thread, as the process's default.
        failure: BaseException | None = None
        try:
            _run_on_loop_thread(self.join())
            result = fn(*args, **kwargs)
            if inspect.isawaitable(result):
                if inspect.iscoroutine(result):
                    result.close()
                raise DistUsageError(
                    f"fn {getattr(fn, '__name__', fn)!r} returned an awaitable: make it an "
                    "`async def` function to use the asynchronous API"
                )
            return result
        except BaseException as exc:
            failure = self.failed(exc)
            raise
        finally:
            _run_on_loop_thread(self.leave(failure))

    async def join(self) -> None:
        """Reach the store (rank 0: host it and publish where) and join the group."""
        job = self.job
        if self.rank == 0:
            try:
                self.store = await TCPStore.create(
                    self.host, 0, is_master=True, timeout=job.timeout, auth_token=job.token
                )
            except BaseException as exc:
                await asyncio.to_thread(self._publish, {"error": f"{type(exc).__name__}: {exc}"})
                raise
            host = f"[{self.host}]" if ":" in self.host else self.host
            await asyncio.to_thread(self._publish, {"master": f"{host}:{self.store.port}"})
        else:
            master = await asyncio.to_thread(self._read_master)
            host, _, port = master.rpartition(":")
            self.store = await TCPStore.create(
                host.strip("[]"), int(port), timeout=job.timeout, auth_token=job.token
            )
        self.pg = await _api.init_process_group(
            job.backend,
            store=self.store,
            rank=self.rank,
            world_size=len(job.workers),
            timeout=job.timeout,
            auth_token=job.token,
        )

    def _publish(self, value: dict[str, str]) -> None:
        distributed.Variable(self.job.name, client=self.client).set(value)

    def _read_master(self) -> str:
        variable = distributed.Variable(self.job.name, client=self.client)
        try:
            value = cast(dict[str, str], variable.get(timeout=self.job.timeout))
        except TimeoutError:
            raise _consequential(
                DistTimeoutError(
                    f"rank {self.rank}: rank 0 (Dask worker {self.job.workers[0]}) did not "
                    f"publish the group's store within {self.job.timeout:g} s (is that "
                    "worker busy with other tasks?)"
                )
            ) from None
        if "error" in value:
            raise _consequential(
                DistNetworkError(
                    f"rank {self.rank}: rank 0 (Dask worker {self.job.workers[0]}) could not "
                    f"host the group's store: {value['error']}"
                )
            )
        return value["master"]

    def failed(self, exc: BaseException) -> BaseException:
        """Mark ``exc``: whether this rank failed on its own or because the group was
        aborted by another rank first, and where."""
        if getattr(exc, _ORIGIN, None) is False:  # (marked where it was made)
            origin = False
        else:
            origin = self.pg is None or not self.pg.is_aborted()
        with contextlib.suppress(AttributeError, TypeError):  # (an exotic exception type)
            setattr(exc, _ORIGIN, origin)
        if origin:
            exc.add_note(f"raised by {self.where} in aiodist.contrib.dask.run")
        else:
            exc.add_note(f"raised by {self.where}, after another rank aborted the group")
        return exc

    async def leave(self, failure: BaseException | None) -> None:
        """Leave the group (aborting it first on ``failure``) and close the store; rank 0
        keeps the store up until every rank has left.

        Raises:
            DistError: leaving failed, in a group that was not aborted (after an abort, the
                store or a peer may be gone already: that is only logged).
        """
        pg, store = self.pg, self.store
        self.pg = self.store = None

        def aborted() -> bool:
            return failure is not None or (pg is not None and pg.is_aborted())

        try:
            if pg is not None:
                if failure is not None:
                    pg.abort(failure)  # (nothing when another rank's abort came first)
                await pg.destroy()
            if store is not None:
                await store.set(f"{_LEFT}{self.rank}", b"1")
                if self.rank == 0:
                    keys = [f"{_LEFT}{r}" for r in range(len(self.job.workers))]
                    # The others still need the store to leave their groups cleanly; those
                    # of an aborted group leave as soon as they hear of it, or fail anyway.
                    wait = _ABORTED_LEAVE_WAIT if aborted() else self.job.timeout
                    try:
                        await store.wait(keys, wait)
                    except DistTimeoutError as exc:
                        logger.info("%s: not every rank left the store: %s", self.where, exc)
        except DistError as exc:
            if not aborted():
                raise
            logger.info("%s: leaving the aborted group: %s", self.where, exc)
        finally:
            if store is not None:
                await store.aclose()


def _consequential(exc: BaseException) -> BaseException:
    setattr(exc, _ORIGIN, False)
    return exc
