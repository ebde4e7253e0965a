"""Rendezvous: turning an ``init_method`` URL into a store, this process's rank and the world size.

Schemes, with torch's rules:

* ``env://[?rank=R&world_size=W]``: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``
  from the environment (query parameters override the first two). Without them, the
  variables of the launcher that started the process: Open MPI's ``mpirun``, MPICH's and
  Intel MPI's hydra, SLURM's ``srun``, Kubeflow's ``PET_*`` and Kubernetes Indexed Jobs;
  under SLURM and single-node MPI the master is derived too (the first host of the node
  list, a port from the job id). ``aiodist._util._cluster`` holds the rules; a derived master is
  exported as ``MASTER_ADDR``/``MASTER_PORT`` for the rest of the process to see.
* ``tcp://host:port?rank=R&world_size=W``.
* ``file:///abs/path?rank=R&world_size=W``: a :class:`~aiodist.FileStore` on that path.
* ``etcd://host:port[,host:port...]/prefix?rank=R&world_size=W``: an
  :class:`~aiodist.EtcdStore` under ``prefix`` in the etcd cluster of those members (tried
  in that order). No rank hosts the store.

``env://`` with ``AIODIST_STORE_URL`` set (``aiodist-run --rdzv-backend=etcd`` sets it) takes
the rank and world size from the environment and the store from that URL instead of
``MASTER_ADDR``/``MASTER_PORT``.

``env://`` and ``tcp://`` give a :class:`~aiodist.TCPStore`: rank 0 hosts it and the others
connect, except under an agent that hosts the store itself (``TORCHELASTIC_USE_AGENT_STORE=True``)
at the URL's address (``MASTER_ADDR:MASTER_PORT``), where every rank connects. Other schemes come from :func:`register_rendezvous_handler` or
from packages that declare an entry point in the ``aiodist.rendezvous`` group (name: the
scheme; value: the handler).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable
from importlib.metadata import entry_points
from typing import Protocol
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from ._util._auth import resolve_token
from ._util._cluster import LOCAL_RANK_VARS, read_cluster_env, read_rank_and_world_size
from ._util._timeouts import Timeout, to_seconds
from .errors import DistUsageError
from .store import EtcdStore, FileStore, Store
from .store._etcd_client import parse_endpoints
from .store.etcd import DEFAULT_PREFIX

__all__ = [
    "ENTRY_POINT_GROUP",
    "STORE_URL_ENV",
    "RendezvousHandler",
    "get_node_local_rank",
    "register_rendezvous_handler",
    "rendezvous",
    "resolve",
]

logger = logging.getLogger(__name__)

#: The entry-point group third-party packages use to provide rendezvous schemes.
ENTRY_POINT_GROUP = "aiodist.rendezvous"
#: The variable that gives ``env://`` its store's URL (rank and world size left out).
STORE_URL_ENV = "AIODIST_STORE_URL"


class RendezvousHandler(Protocol):
    """A rendezvous scheme: ``await handler(url, timeout=...) -> (store, rank, world_size)``.

    ``url`` already carries the ``rank`` and ``world_size`` that :func:`rendezvous` was given,
    as query parameters. ``timeout`` is the store timeout in seconds (``None``: the store's
    default). ``auth_token`` is passed only when the caller gave one: the shared secret the
    store must require (handlers that make no network store may ignore it).
    """

    def __call__(
        self, url: str, *, timeout: float | None, auth_token: bytes | None = None
    ) -> Awaitable[tuple[Store, int, int]]:
        """Create or join the store the URL names."""
        ...


_handlers: dict[str, RendezvousHandler] = {}


def register_rendezvous_handler(scheme: str, handler: RendezvousHandler) -> None:
    """Make ``scheme://`` URLs rendezvous through ``handler``.

    Args:
        scheme: the URL scheme, without ``://`` (case-insensitive).
        handler: an async callable ``handler(url, *, timeout) -> (store, rank, world_size)``.

    Raises:
        DistUsageError: the scheme is empty, malformed or already registered, or ``handler``
            is not callable.
    """
    if not isinstance(scheme, str) or not scheme or "://" in scheme or ":" in scheme:
        raise DistUsageError(f"rendezvous scheme must be a name like 'env', got {scheme!r}")
    if not callable(handler):
        raise DistUsageError(f"rendezvous handler for {scheme}:// must be callable")
    scheme = scheme.lower()
    if scheme in _handlers:
        raise DistUsageError(f"a rendezvous handler for {scheme}:// is already registered")
    _handlers[scheme] = handler


def _find_handler(scheme: str) -> RendezvousHandler:
    handler = _handlers.get(scheme)
    if handler is not None:
        return handler
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name.lower() == scheme:
            logger.debug("loading rendezvous handler for %s:// from %s", scheme, ep.value)
            loaded: RendezvousHandler = ep.load()
            register_rendezvous_handler(scheme, loaded)
            return loaded
    known = sorted({*_handlers, *(ep.name.lower() for ep in entry_points(group=ENTRY_POINT_GROUP))})
    raise DistUsageError(  # torch's words first
        f"No rendezvous handler for {scheme}:// (known schemes: "
        f"{', '.join(s + '://' for s in known)})"
    )


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DistUsageError(f"{name} must be an int, got {type(value).__name__}")
    return value


async def rendezvous(
    url: str,
    rank: int = -1,
    world_size: int = -1,
    timeout: Timeout = None,
    *,
    auth_token: str | bytes | None = None,
) -> tuple[Store, int, int]:
    """Rendezvous through ``url``: return a store shared by the job, this rank and the world size.

    ``rank`` and ``world_size`` (``-1``: not given) are added to the URL's query, as torch does;
    giving one both ways with different values is an error.

    Args:
        url: ``env://``, ``tcp://host:port?...``, ``file:///path?...`` or a registered scheme.
        rank: this process's rank, or ``-1`` to take it from the URL or environment.
        world_size: the number of processes, or ``-1`` to take it from the URL or environment.
        timeout: the store timeout (seconds or ``timedelta``; ``None``: the store's default).
        auth_token: shared secret for the TCPStore (``None``: ``$AIODIST_AUTH_TOKEN``, if set).

    Returns:
        ``(store, rank, world_size)``.

    Raises:
        DistUsageError: the URL is malformed, misses a parameter or environment variable
            (the message names it), conflicts with the arguments, or has an unknown scheme.
        DistNetworkError: the store could not be reached.
        DistTimeoutError: the other ranks did not arrive in time.
    """
    handler, merged = resolve(url, rank, world_size)
    seconds = to_seconds(timeout)
    if auth_token is not None:
        return await handler(merged, timeout=seconds, auth_token=resolve_token(auth_token))
    return await handler(merged, timeout=seconds)


def resolve(url: str, rank: int = -1, world_size: int = -1) -> tuple[RendezvousHandler, str]:
    """Check ``url`` and the arguments of :func:`rendezvous` at once, before any I/O.

    Returns:
        The scheme's handler and the URL with ``rank`` and ``world_size`` in its query.

    Raises:
        DistUsageError: as :func:`rendezvous`: a malformed URL, an unknown scheme ("No
            rendezvous handler for ...", as torch says), or a conflict with the arguments.
    """
    if not isinstance(url, str):
        raise DistUsageError(f"rendezvous url must be a str, got {type(url).__name__}")
    rank = _check_int("rank", rank)
    world_size = _check_int("world_size", world_size)
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an unbalanced "[" in the host
        raise DistUsageError(f"rendezvous url {url!r} is malformed: {exc}") from None
    if not parts.scheme:
        raise DistUsageError(f"rendezvous url {url!r} has no scheme, e.g. env:// or tcp://")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    for name, value in (("rank", rank), ("world_size", world_size)):
        if value == -1:
            continue
        if name in query and query[name] != str(value):
            raise DistUsageError(
                f"{name} given twice: {name}={query[name]} in the url {url!r} "
                f"and {name}={value} as an argument"
            )
        query[name] = str(value)
    # The query replaced in the text: urlunsplit would turn file:////tmp/x (the form torch's
    # own tests build) into file://tmp/x, a path read as a host.
    base = url.split("#", 1)[0].split("?", 1)[0]
    merged = f"{base}?{urlencode(query)}" if query else base
    return _find_handler(parts.scheme.lower()), merged


# -- the built-in schemes ------------------------------------------------------------------
def _error(scheme: str, message: str) -> DistUsageError:
    return DistUsageError(f"Error initializing aiodist using {scheme}:// rendezvous: {message}")


def _parse_int(scheme: str, what: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise _error(scheme, f"{what} must be an integer, got {text!r}") from None


def _check_rank(scheme: str, rank: int, world_size: int) -> None:
    if world_size < 1:
        raise _error(scheme, f"world size must be positive, got {world_size}")
    if not 0 <= rank < world_size:
        raise _error(scheme, f"rank {rank} is out of range for world size {world_size}")


def _query_int(scheme: str, query: dict[str, str], name: str, label: str) -> int | None:
    return _parse_int(scheme, label, query[name]) if name in query else None


def _rank_and_size(scheme: str, query: dict[str, str]) -> tuple[int, int]:
    """The query's rank and world size, both required (``tcp://``, ``file://``)."""
    rank = _query_int(scheme, query, "rank", "rank")
    world_size = _query_int(scheme, query, "world_size", "world size")
    if rank is None:
        raise _error(scheme, "rank parameter missing")
    if world_size is None:
        raise _error(scheme, "world size parameter missing")
    _check_rank(scheme, rank, world_size)
    return rank, world_size


async def _tcp_store(
    scheme: str,
    host: str,
    port: int,
    rank: int,
    world_size: int,
    timeout: float | None,
    auth_token: bytes | None,
) -> Store:
    if not 0 <= port < 2**16:
        raise _error(scheme, f"port must be from 0 to 65535, got {port}")
    from .store.tcp import TCPStore

    # A launcher's agent may host the store for the whole job; then rank 0 is a client too,
    # of that store only: a URL naming another address still has rank 0 host it (torch 2.15).
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and (
        host == os.environ.get("MASTER_ADDR") and str(port) == os.environ.get("MASTER_PORT")
    )
    is_master = rank == 0 and not agent_store
    logger.debug(
        "%s:// rendezvous: rank %d/%d %s the store at %s:%d",
        scheme, rank, world_size, "hosts" if is_master else "joins", host, port,
    )  # fmt: skip
    # The host does not wait here for the others to join the store: init_process_group
    # waits for every rank anyway, checking that they agree on the world size and saying
    # whom it waits for (a host waiting for more ranks than the others were given would
    # wait here in silence).
    store: Store = await TCPStore.create(
        host,
        port,
        world_size=world_size,
        is_master=is_master,
        timeout=timeout,
        wait_for_workers=False,
        auth_token=auth_token,
    )
    return store


async def _env_handler(
    url: str, *, timeout: float | None, auth_token: bytes | None = None
) -> tuple[Store, int, int]:
    query = dict(parse_qsl(urlsplit(url).query, keep_blank_values=True))
    rank = _query_int("env", query, "rank", "rank")
    world_size = _query_int("env", query, "world_size", "world size")
    store_url = os.environ.get(STORE_URL_ENV)
    if store_url:
        return await _env_store_url(store_url, rank, world_size, timeout, auth_token)
    try:
        job = read_cluster_env(rank=rank, world_size=world_size)
    except DistUsageError as exc:
        raise _error("env", str(exc)) from None
    for var, value in (("MASTER_ADDR", job.master_addr), ("MASTER_PORT", job.master_port)):
        if value.var != var:
            # Derived (or PET_*): export it, so that the transport's choice of interface,
            # the user's code and any torch code in this process see the same master.
            logger.info("env:// rendezvous: %s=%s from %s", var, value.value, value.source)
            os.environ[var] = str(value.value)
    host, port = job.master_addr.value, job.master_port.value
    store = await _tcp_store(
        "env", host, port, job.rank.value, job.world_size.value, timeout, auth_token
    )
    return store, job.rank.value, job.world_size.value


async def _env_store_url(
    store_url: str,
    rank: int | None,
    world_size: int | None,
    timeout: float | None,
    auth_token: bytes | None,
) -> tuple[Store, int, int]:
    """``env://`` with ``$AIODIST_STORE_URL``: the store that URL names, the rank and world
    size of the environment."""
    try:
        r, w = read_rank_and_world_size(rank=rank, world_size=world_size)
    except DistUsageError as exc:
        raise _error("env", str(exc)) from None
    parts = urlsplit(store_url)
    if not parts.scheme or parts.scheme.lower() == "env" or parts.query:
        raise _error(
            "env",
            f"{STORE_URL_ENV}={store_url!r} must name a store, like etcd://host:port/prefix, "
            "with no query",
        )
    logger.debug("env:// rendezvous: the store of %s=%s", STORE_URL_ENV, store_url)
    merged = urlunsplit(parts._replace(query=urlencode({"rank": r.value, "world_size": w.value})))
    handler = _find_handler(parts.scheme.lower())
    if auth_token is not None:
        return await handler(merged, timeout=timeout, auth_token=auth_token)
    return await handler(merged, timeout=timeout)


async def _tcp_handler(
    url: str, *, timeout: float | None, auth_token: bytes | None = None
) -> tuple[Store, int, int]:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError as exc:
        raise _error("tcp", f"bad port in {url!r}: {exc}") from None
    if not parts.hostname:
        raise _error("tcp", "host name missing")
    if port is None:
        raise _error("tcp", "port number missing")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    rank, world_size = _rank_and_size("tcp", query)
    store = await _tcp_store("tcp", parts.hostname, port, rank, world_size, timeout, auth_token)
    return store, rank, world_size


async def _file_handler(
    url: str, *, timeout: float | None, auth_token: bytes | None = None
) -> tuple[Store, int, int]:
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise _error(
            "file", f"expected file:///absolute/path, got host {parts.netloc!r} in {url!r}"
        )
    path = unquote(parts.path)
    if not path:
        raise _error("file", "path missing")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    rank, world_size = _rank_and_size("file", query)
    return FileStore(path, world_size, timeout=timeout), rank, world_size


async def _etcd_handler(
    url: str, *, timeout: float | None, auth_token: bytes | None = None
) -> tuple[Store, int, int]:
    parts = urlsplit(url)
    if not parts.netloc:
        raise _error("etcd", f"expected etcd://host:port[,host:port...]/prefix, got {url!r}")
    try:
        endpoints = parse_endpoints(parts.netloc, "endpoints")
    except DistUsageError as exc:
        raise _error("etcd", str(exc)) from None
    prefix = unquote(parts.path)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    rank, world_size = _rank_and_size("etcd", query)
    if auth_token is not None:
        logger.info("etcd:// rendezvous: the auth token is not used (etcd has its own auth)")
    store = await EtcdStore.create(
        endpoints, prefix if prefix not in ("", "/") else DEFAULT_PREFIX, timeout
    )
    return store, rank, world_size


register_rendezvous_handler("env", _env_handler)
register_rendezvous_handler("tcp", _tcp_handler)
register_rendezvous_handler("file", _file_handler)
register_rendezvous_handler("etcd", _etcd_handler)


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """Return this process's rank on its node, from the launcher's environment.

    Looks at ``LOCAL_RANK`` (torchrun, ``aiodist-run``), ``OMPI_COMM_WORLD_LOCAL_RANK``
    (Open MPI), ``MPI_LOCALRANKID`` (MPICH, Intel MPI) and ``SLURM_LOCALID`` (SLURM), in that
    order.

    Args:
        fallback_rank: returned when none of them is set.

    Raises:
        DistUsageError: none is set and there is no fallback, or the value is not an integer.
    """
    for name in LOCAL_RANK_VARS:
        value = os.environ.get(name)
        if value:
            try:
                return int(value)
            except ValueError:
                raise DistUsageError(f"{name} must be an integer, got {value!r}") from None
    if fallback_rank is not None:
        return fallback_rank
    raise DistUsageError(
        f"the local rank is unknown: none of {', '.join(LOCAL_RANK_VARS)} is set "
        "and no fallback_rank was given"
    )
