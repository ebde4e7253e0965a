"""Process groups among Ray actors (``pip install ray``).

An actor class that inherits :class:`AiodistActor` can join a group; :func:`create_group`
starts ``world_size`` such actors and joins them, and :func:`destroy_group` takes the group
down again::

    import numpy as np
    import ray

    import aiodist
    from aiodist.contrib.ray import AiodistActor, create_group, destroy_group

    class Shard(AiodistActor):
        async def step(self, grad):
            grad = grad.copy()  # Ray passes arrays read-only; collectives write in place
            await aiodist.all_reduce(grad)  # every method runs on the actor's event loop
            return grad

    shards = create_group(Shard, 4)
    grads = ray.get([s.step.remote(np.ones(8)) for s in shards])
    destroy_group(shards)

The mixin's methods are coroutines, which makes every actor of such a class an async actor:
Ray runs all its methods on one event loop in the actor's process, and a method can overlap
communication with computation (``work = aiodist.all_reduce(x); ...; await work``). aiodist
keeps the default group in a context variable, and Ray runs each call in a context of its
own; so the mixin makes the actor's group the default group inside each of the class's
``async def`` methods (it wraps them when the class is defined).

How the group forms: rank 0's actor hosts the group's store on its node's address and a
port the kernel picks while binding (no race with other jobs), then every actor joins it.
Each group gets a fresh random token, so its store and the connections between its ranks
refuse anyone outside the group; each actor's transport listens on its node's address
(``AIODIST_HOST``, unless set), so the actors may be spread over a Ray cluster.
"""

from __future__ import annotations

import functools
import inspect
import os
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

try:
    import ray
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError("aiodist.contrib.ray needs Ray: pip install ray") from exc

from .. import _api, group
from .._util._timeouts import Timeout, to_seconds
from ..errors import DistUsageError
from ..store import TCPStore

__all__ = ["AiodistActor", "create_group", "destroy_group"]

#: Keys of this module in the group's store, apart from the group's own.
_LEFT = "aiodist-ray/left/"


def _node_address() -> str:
    """This node's address in the Ray cluster."""
    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]


def _split_master(master: str) -> tuple[str, int]:
    host, sep, port = master.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise DistUsageError(f"master must be 'host:port', got {master!r}")
    return host.strip("[]"), int(port)


def _in_group(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Run ``method`` with its actor's group as the default group of the call's context."""

    @functools.wraps(method)
    async def run(self: AiodistActor, *args: Any, **kwargs: Any) -> Any:
        if self._aiodist_world is not None and group.peek_world() is None:
            group.set_current_world(self._aiodist_world)
        return await method(self, *args, **kwargs)

    return run


class AiodistActor:
    """A mixin for Ray actor classes whose instances join an aiodist process group.

    After :meth:`init_group`, the group is the default group inside every ``async def``
    method of the class and its subclasses: they call aiodist's async API directly
    (``await aiodist.all_reduce(x)``).
    """

    _aiodist_store: TCPStore | None = None
    _aiodist_place: tuple[int, int, float | None] | None = None  # rank, world size, timeout
    _aiodist_world: group.World | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, member in list(vars(cls).items()):
            if inspect.iscoroutinefunction(member) and not name.startswith("__"):
                setattr(cls, name, _in_group(member))

    async def host_store(self, *, timeout: Timeout = None, auth_token: str | None = None) -> str:
        """Host the group's store here, on this node's address and a free port.

        Call it on the actor that will be rank 0, then pass what it returns as ``master``
        to :meth:`init_group` of every actor.

        Args:
            timeout: the store's timeout (seconds or ``timedelta``; ``None``: 300 s).
            auth_token: the secret the store's clients must prove they hold.

        Returns:
            ``"host:port"`` of the store.

        Raises:
            DistUsageError: this actor hosts a store or is in a group already.
            DistNetworkError: the store could not listen.
        """
        if self._aiodist_store is not None:
            raise DistUsageError("this actor already has a store; destroy_group() first")
        host = _node_address()
        self._aiodist_store = await TCPStore.create(
            host, 0, is_master=True, timeout=timeout, auth_token=auth_token
        )
        return (
            f"[{host}]:{self._aiodist_store.port}"
            if ":" in host
            else f"{host}:{self._aiodist_store.port}"
        )

    async def init_group(
        self,
        rank: int,
        world_size: int,
        master: str,
        *,
        backend: str | None = None,
        timeout: Timeout = None,
        auth_token: str | None = None,
    ) -> None:
        """Join the group as ``rank`` of ``world_size``, through the store at ``master``.

        Rank 0 uses the store that :meth:`host_store` started here, or else starts one at
        ``master``; the other ranks connect to it.

        Args:
            rank: this actor's rank.
            world_size: the number of actors in the group.
            master: ``"host:port"`` of the group's store.
            backend: as for :func:`aiodist.init_process_group`.
            timeout: the group's timeout (seconds or ``timedelta``; ``None``: 30 minutes).
            auth_token: the group's shared secret (the same in every actor), or ``None``.

        Raises:
            DistUsageError: bad arguments, or this actor is in a group already.
            DistNetworkError: the store or a peer could not be reached.
            DistTimeoutError: the other actors did not join in time.
        """
        if self._aiodist_place is not None:
            raise DistUsageError("this actor is in a group already; destroy_group() first")
        host, port = _split_master(master)
        # Listen where the other actors can reach this one: its node's address, not loopback.
        os.environ.setdefault("AIODIST_HOST", _node_address())
        if self._aiodist_store is None:
            self._aiodist_store = await TCPStore.create(
                host, port, is_master=rank == 0, timeout=timeout, auth_token=auth_token
            )
        try:
            await _api.init_process_group(
                backend,
                store=self._aiodist_store,
                rank=rank,
                world_size=world_size,
                timeout=timeout,
                auth_token=auth_token,
            )
        except BaseException:
            store, self._aiodist_store = self._aiodist_store, None
            await store.aclose()
            raise
        self._aiodist_place = (rank, world_size, to_seconds(timeout))
        self._aiodist_world = group.peek_world()

    async def destroy_group(self) -> None:
        """Leave the group and close the store; rank 0 keeps it up until every rank has left.

        Does nothing in an actor that is in no group.

        Raises:
            DistTimeoutError: rank 0 waited for the others to leave longer than the group's
                timeout.
        """
        store, place, world = self._aiodist_store, self._aiodist_place, self._aiodist_world
        self._aiodist_store = self._aiodist_place = self._aiodist_world = None
        if world is not None:
            group.set_current_world(world)
            await _api.destroy_process_group()
        if store is None:
            return
        try:
            if place is not None:
                rank, world_size, timeout = place
                await store.set(f"{_LEFT}{rank}", b"1")
                if rank == 0:
                    # The others still need the store to leave their groups cleanly.
                    await store.wait([f"{_LEFT}{r}" for r in range(world_size)], timeout)
        finally:
            await store.aclose()


def create_group(
    actor_class: Any,
    world_size: int,
    *,
    actor_args: Sequence[Any] = (),
    actor_kwargs: Mapping[str, Any] | None = None,
    options: Mapping[str, Any] | None = None,
    backend: str | None = None,
    timeout: float = 300.0,
) -> list[Any]:
    """Start ``world_size`` actors of ``actor_class`` and join them into one group.

    Args:
        actor_class: a class that inherits :class:`AiodistActor`, decorated with
            ``@ray.remote`` or not.
        world_size: the number of actors; actor ``i`` is rank ``i``.
        actor_args: positional arguments of the actors' constructor.
        actor_kwargs: keyword arguments of the actors' constructor.
        options: Ray's actor options (``num_cpus``, ``num_gpus``, ``resources``, ...).
        backend: as for :func:`aiodist.init_process_group`.
        timeout: seconds for the actors to start and join; also the group's timeout.

    Returns:
        The actors' handles, in rank order.

    Raises:
        DistUsageError: ``world_size`` is not positive, or ``actor_class`` does not inherit
            :class:`AiodistActor`.
        ray.exceptions.GetTimeoutError: the actors were not all up and joined in time (for
            example, the cluster has too few resources for them); the actors are killed.
        DistError: joining failed in an actor (Ray raises it with the actor's traceback).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise DistUsageError(f"world_size must be a positive int, got {world_size!r}")
    decorated = isinstance(actor_class, ray.actor.ActorClass)  # by @ray.remote
    plain = actor_class.__ray_metadata__.modified_class if decorated else actor_class
    if not (isinstance(plain, type) and issubclass(plain, AiodistActor)):
        raise DistUsageError(f"{actor_class!r} must be a class that inherits AiodistActor")
    remote_class = actor_class if decorated else ray.remote(actor_class)
    if options:
        remote_class = remote_class.options(**options)
    actors: list[Any] = [
        remote_class.remote(*actor_args, **(actor_kwargs or {})) for _ in range(world_size)
    ]
    token = secrets.token_hex(32)
    try:
        master = ray.get(
            actors[0].host_store.remote(timeout=timeout, auth_token=token), timeout=timeout
        )
        joins = [
            actor.init_group.remote(
                rank, world_size, master, backend=backend, timeout=timeout, auth_token=token
            )
            for rank, actor in enumerate(actors)
        ]
        ray.get(joins, timeout=timeout)
    except BaseException:
        for actor in actors:
            ray.kill(actor)
        raise
    return actors


def destroy_group(actors: Sequence[Any], *, timeout: float = 300.0) -> None:
    """Take the group of these actors down; the actors stay alive.

    Args:
        actors: the handles :func:`create_group` returned.
        timeout: seconds to wait for every actor to leave.

    Raises:
        ray.exceptions.GetTimeoutError: not every actor left in time.
        DistError: leaving failed in an actor.
    """
    ray.get([actor.destroy_group.remote() for actor in actors], timeout=timeout)
