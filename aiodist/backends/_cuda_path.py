"""Which data path a group's CUDA operations take, agreed by every rank through the store.

Three paths, best first:

* ``nccl``: NCCL loads on every rank and no two ranks share a GPU (NCCL refuses that before
  2.30, and from 2.30 allows it only with ``NCCL_MULTI_RANK_GPU_ENABLE=1``);
* ``ipc``: every rank runs on one host (CUDA IPC then maps each rank's exchange buffer
  into the others, several ranks on one GPU included); a probe must pass on every rank;
* ``staged``: always works: device memory is staged through host memory and moved by the
  CPU transport.

``AIODIST_CUDA_PATH=nccl|ipc|staged`` forces one; every rank that sets it must set the
same value, and a forced path that cannot work is an error rather than a silent fallback.

Agreement: each rank publishes what it sees (:class:`RankInfo`) under the group's prefix in
the world's store; group rank 0 reads them all, decides with :func:`choose_path` and
publishes the decision (or the error, which every rank then raises). Pure functions and a
store: no cupy here, so the CPU suite tests all of it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from .._util._timeouts import Timeout
from ..errors import DistBackendError, DistUsageError
from ..store import Store

__all__ = [
    "PATHS",
    "PATH_ENV",
    "RankInfo",
    "agree_ipc",
    "agree_path",
    "choose_path",
    "forced_path",
]

logger = logging.getLogger(__name__)

#: The data paths, best first.
PATHS = ("nccl", "ipc", "staged")
#: The environment variable that forces a path.
PATH_ENV = "AIODIST_CUDA_PATH"
#: The first NCCL release (2.30.0 as ``ncclGetVersion`` reports it) that lets several ranks
#: share a GPU, behind ``NCCL_MULTI_RANK_GPU_ENABLE=1``.
NCCL_SHARED_GPU_VERSION = 23000


@dataclass(frozen=True, slots=True)
class RankInfo:
    """What one rank tells the others before they choose a path.

    Attributes:
        host: the host's identity (host name and boot id).
        gpu: the GPU's identity (its PCI bus id).
        nccl: NCCL's runtime version (``ncclGetVersion``), or ``None`` if it did not load.
        shared_gpu_ok: NCCL may run several ranks on one GPU here (2.30+ and
            ``NCCL_MULTI_RANK_GPU_ENABLE=1``).
        forced: the path this rank's environment forces, or ``None``.
    """

    host: str
    gpu: str
    nccl: int | None
    shared_gpu_ok: bool = False
    forced: str | None = None

    def to_json(self) -> str:
        """This record as JSON (what goes into the store)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> RankInfo:
        """Read a record written by :meth:`to_json`.

        Raises:
            DistBackendError: the text is not such a record.
        """
        try:
            data = json.loads(text)
            return cls(
                host=str(data["host"]),
                gpu=str(data["gpu"]),
                nccl=None if data["nccl"] is None else int(data["nccl"]),
                shared_gpu_ok=bool(data["shared_gpu_ok"]),
                forced=None if data["forced"] is None else str(data["forced"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise DistBackendError(f"a rank published an unreadable CUDA record: {exc}") from exc


def forced_path(environ: Mapping[str, str] = os.environ) -> str | None:
    """The path ``AIODIST_CUDA_PATH`` forces, or ``None`` when it is unset or empty.

    Raises:
        DistUsageError: the variable names no path.
    """
    value = environ.get(PATH_ENV, "").strip().lower()
    if not value:
        return None
    if value not in PATHS:
        raise DistUsageError(
            f"{PATH_ENV}={environ[PATH_ENV]!r} is not a data path: use one of {', '.join(PATHS)}"
        )
    return value


def shared_gpu_ok(nccl_version: int | None, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether NCCL may run several ranks on one GPU here."""
    return (
        nccl_version is not None
        and nccl_version >= NCCL_SHARED_GPU_VERSION
        and environ.get("NCCL_MULTI_RANK_GPU_ENABLE", "") == "1"
    )


def _nccl_problem(infos: Sequence[RankInfo]) -> str | None:
    """Why NCCL cannot serve these ranks, or ``None`` if it can."""
    missing = [r for r, info in enumerate(infos) if info.nccl is None]
    if missing:
        return f"NCCL did not load on ranks {missing}"
    seen: dict[tuple[str, str], int] = {}
    for r, info in enumerate(infos):
        first = seen.setdefault((info.host, info.gpu), r)
        if first != r and not (info.shared_gpu_ok and infos[first].shared_gpu_ok):
            return (
                f"ranks {first} and {r} share GPU {info.gpu}, which NCCL refuses (NCCL 2.30+ "
                "allows it with NCCL_MULTI_RANK_GPU_ENABLE=1)"
            )
    return None


def _ipc_problem(infos: Sequence[RankInfo]) -> str | None:
    hosts = {info.host for info in infos}
    if len(hosts) > 1:
        return f"the ranks run on {len(hosts)} hosts; CUDA IPC needs them on one"
    return None


def choose_path(infos: Sequence[RankInfo]) -> str:
    """The best path every rank can take; the forced one if the ranks force one.

    Args:
        infos: one record per group rank, in group-rank order.

    Raises:
        DistUsageError: ranks force different paths, or force one that cannot work here
            (the message says why).
    """
    forced = {info.forced for info in infos if info.forced is not None}
    if len(forced) > 1:
        by_rank = {r: info.forced for r, info in enumerate(infos) if info.forced}
        raise DistUsageError(f"{PATH_ENV} differs between ranks: {by_rank}; set it alike")
    problems = {"nccl": _nccl_problem(infos), "ipc": _ipc_problem(infos), "staged": None}
    if forced:
        path = forced.pop()
        if path not in PATHS:
            raise DistUsageError(
                f"{PATH_ENV}={path!r} is not a data path: use one of {', '.join(PATHS)}"
            )
        problem = problems[path]
        if problem is not None:
            raise DistUsageError(f"{PATH_ENV}={path} cannot work here: {problem}")
        return path
    return next(path for path in PATHS if problems[path] is None)


async def agree_path(
    store: Store,
    prefix: str,
    rank: int,
    size: int,
    info: RankInfo,
    timeout: Timeout = None,
) -> tuple[str, list[RankInfo]]:
    """Publish ``info``, and return the path group rank 0 chose with every rank's record.

    Args:
        store: the world's store.
        prefix: the group's key prefix (``cuda/<group id>``).
        rank: this rank's group rank.
        size: the group's size.
        info: this rank's record.
        timeout: how long to wait for the other ranks.

    Raises:
        DistUsageError: the choice failed (every rank raises the same message).
        DistTimeoutError: a rank did not publish in time.
    """
    await store.set(f"{prefix}/info/{rank}", info.to_json())
    keys = [f"{prefix}/info/{r}" for r in range(size)]
    await store.wait(keys, timeout)
    infos = [RankInfo.from_json(raw) for raw in await store.multi_get(keys)]
    if rank == 0:
        try:
            decision = choose_path(infos)
        except DistUsageError as exc:
            decision = f"error:{exc}"
        await store.set(f"{prefix}/path", decision)
    await store.wait([f"{prefix}/path"], timeout)
    decision = (await store.get(f"{prefix}/path")).decode()
    if decision.startswith("error:"):
        raise DistUsageError(decision.removeprefix("error:"))
    logger.info("CUDA group %s: %s path (%d ranks)", prefix, decision, size)
    return decision, infos


async def agree_ipc(
    store: Store, prefix: str, rank: int, size: int, problem: str | None, timeout: Timeout = None
) -> str | None:
    """Tell the others whether CUDA IPC worked here; return the first rank's problem, if any.

    Every rank gets the same answer, so all of them keep IPC or all fall back.
    """
    await store.set(f"{prefix}/ipc/{rank}", "ok" if problem is None else f"failed:{problem}")
    keys = [f"{prefix}/ipc/{r}" for r in range(size)]
    await store.wait(keys, timeout)
    for r, raw in enumerate(await store.multi_get(keys)):
        text = raw.decode()
        if text != "ok":
            return f"rank {r}: {text.removeprefix('failed:')}"
    return None
