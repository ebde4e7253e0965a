"""``aiodist-run``: a torchrun-compatible launcher that hosts the store and supervises workers.

Usage is torchrun's: ``aiodist-run --nproc-per-node=4 train.py --lr 0.1``. The launcher of node 0
hosts an aiodist TCPStore server (which also speaks torch's TCPStore protocol) at
``MASTER_ADDR:MASTER_PORT``; every worker gets torchrun's environment
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ..., ``TORCHELASTIC_USE_AGENT_STORE=True``), so
``init_process_group("env://")`` works in aiodist workers and in unmodified torch workers.

Supervision runs on the launcher's own event loop: worker output is prefixed with the rank,
and the first failing worker stops the whole world at once. ``--max-restarts`` restarts, with
``--restart-policy=all`` (torchrun's behaviour), every node's group with the store emptied of
the failed attempt's keys; with ``--restart-policy=failed`` only the failed worker, while the
others and the store keep running (the survivors rebuild their process group in-process).
A signal the launcher handles is forwarded once to every worker's process group; workers
still running ``--shutdown-grace`` seconds later are killed, and the launcher says how each
one ended.

Several nodes (``--nnodes=N --node-rank=K --master-addr=HOST``) agree on ranks through the
store and watch each other with heartbeats there; see ``docs/architecture.md`` ("Launcher").

Every job has a secret: ``$AIODIST_AUTH_TOKEN``, or one the launcher of a single node makes
up; the store requires it and the workers get it in their environment, so their stores and
connections prove it. torch workers cannot: the store lets torch clients in from the job's
hosts only, as the job's user. A job on several nodes needs the same secret on each, from
the environment; without one it runs open, with a warning.

The package is ``aiodist-run``: this module (the node's agent), ``_cli`` (the command
line), ``_coordinator`` (the nodes' agreement), ``_workers`` (worker processes and their
output), ``_preload`` (workers forked from a preloaded starter) and ``__main__``. It may
import :mod:`aiodist.debug` and everything below it; never the async API or the other
facades.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.parser
import functools
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import string
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from .._util._auth import derive_key, resolve_token
from .._util._loop import loop_factory
from ..debug import format_status, gather_status
from ..debug._status import authorized
from ..errors import DistError, DistUsageError
from ..store import Store, TCPStore

# The command line and the agreement between nodes have modules of their own; their public
# names are re-exported here, where users (and the console script) have always found them.
from ._cli import LaunchConfig, get_args_parser, parse_args
from ._coordinator import (
    LAUNCHER_PREFIX as LAUNCHER_PREFIX,
    Coordinator,
    NodeLostError,
    Round,
    open_store,
    route_to,
)
from ._preload import Starter
from ._workers import WorkerFailure, WorkerGroup, WorkerSpec, default_prefix, describe_exit

logger = logging.getLogger(__name__)

__all__ = ["LaunchConfig", "NodeLostError", "get_args_parser", "main", "parse_args"]


# -- supervision ----------------------------------------------------------------------------
@dataclass
class _Outcome:
    """How one attempt ended on this node."""

    failure: WorkerFailure | None = None
    signum: int | None = None
    #: The other nodes went on without this one (MIN:MAX nodes, ``--restart-policy=failed``).
    left_behind: bool = False


class _Launcher:
    """One ``aiodist-run`` process: hosts or joins the store, then runs the attempts."""

    def __init__(self, cfg: LaunchConfig, stdout: BinaryIO, stderr: BinaryIO) -> None:
        self._cfg = cfg
        self._stdout = stdout
        self._stderr = stderr
        self._group: WorkerGroup | None = None
        self._store: Store | None = None
        #: Where the workers are forked from, with ``--preload``.
        self._starter: Starter | None = None
        self._signal: int | None = None
        self._interrupted = asyncio.Event()
        self._main: asyncio.Task[int] | None = None
        self._port = cfg.master_port
        self._local_addr: str | None = None
        #: This node's place in the attempt that runs (with MIN:MAX nodes, each has its own).
        self._round = Round(0, cfg.node_rank, cfg.nnodes, 0, cfg.nproc_per_node * cfg.nnodes)
        #: Whether the launchers of several nodes coordinate through the store.
        self._several = cfg.nnodes > 1 or cfg.elastic
        #: Whether an attempt outlives a change of nodes: with MIN:MAX nodes and
        #: ``--restart-policy=failed`` the workers go on without a lost node's (they shrink
        #: their world) and admit a new node's, so the launchers do too.
        self._goes_on = cfg.elastic and cfg.restart_policy == "failed"
        #: The store's node, when the attempt goes on: arrivals for the next attempt taken in.
        self._taken = 0
        #: Whether this node's workers of the attempt that ran last all finished.
        self._finished = False
        #: Whether this node hosts the store (node 0 of a fixed count): it starts attempts,
        #: and keeps the store up until the others are done with it.
        self._hosting = False
        #: With ``--restart-policy=failed``: how many times each local rank was restarted.
        self._restarts = [0] * cfg.nproc_per_node
        self._log_base: Path = cfg.log_dir or Path(tempfile.mkdtemp(prefix="aiodist-run-"))
        self._keep_logs = cfg.log_dir is not None or any(cfg.redirects + cfg.tees)
        #: The job's secret: its store requires it, its workers get it.
        self._token = _job_secret(cfg)

    def __repr__(self) -> str:
        cfg = self._cfg
        return (
            f"<Launcher node={self._round.node_rank}/{self._round.nnodes} "
            f"nproc={cfg.nproc_per_node} "
            f"store={cfg.master_addr}:{self._port} signal={self._signal}>"
        )

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self._signal is not None and self._group is not None:
            # A second signal: stop waiting politely.
            self._group.kill(
                f"was still running when the launcher received a second signal ({name})"
            )
            return
        logger.info(
            "received %s: stopping the workers (%g s grace period)",
            name,
            self._cfg.shutdown_timeout,
        )
        self._signal = signum
        self._interrupted.set()
        if self._group is not None:
            # Forwarded now, once; the supervision loop sees the flag, tells the other nodes,
            # waits out the grace period and reports how each worker ended.
            self._group.begin_stop(signum)
        elif self._main is not None:
            # No workers are running (joining, waiting for other nodes): just stop.
            self._main.cancel()

    async def run(self) -> int:
        """Run the job; return the launcher's exit status."""
        cfg = self._cfg
        loop = asyncio.get_running_loop()
        for sig in cfg.signals:
            loop.add_signal_handler(sig, self._on_signal, sig)
        self._main = asyncio.current_task()
        try:
            return await self._run()
        except asyncio.CancelledError:
            if self._signal is None or self._main is None:
                raise
            self._main.uncancel()
            return 128 + self._signal
        finally:
            for sig in cfg.signals:
                loop.remove_signal_handler(sig)
            if not self._keep_logs:
                shutil.rmtree(self._log_base, ignore_errors=True)

    async def _run(self) -> int:
        cfg = self._cfg
        store = await open_store(cfg, self._token)
        self._store = store
        coord = Coordinator(store, cfg)
        status = None
        try:
            if isinstance(store, TCPStore):
                self._port = store.port
                self._hosting = store.server is not None
            else:
                # The store is in etcd: the leader does what the hosting node does.
                self._hosting = await coord.lead()
            if self._several:
                self._local_addr = route_to(cfg.master_addr, self._port)
            if cfg.status_port is not None:
                status = await self._serve_status(store)
            if cfg.preload:
                self._starter = await Starter.open(cfg.preload, self._environment())
            if self._hosting and isinstance(store, TCPStore):
                where = f"{cfg.master_addr}:{self._port}"
                logger.info(
                    "the job's store is at %s (python -m aiodist.debug status --store %s)",
                    where,
                    where,
                )
            if self._several:
                logger.info(
                    "%s: %s %s",
                    f"node {cfg.node_rank} of {cfg.nnodes}"
                    if not cfg.elastic
                    else f"{cfg.nnodes} to {cfg.max_nnodes} nodes",
                    ("leading through" if cfg.etcd_endpoints else "hosting")
                    if self._hosting
                    else "joining",
                    cfg.store_name if cfg.etcd_endpoints else f"{cfg.master_addr}:{self._port}",
                )
            if not cfg.elastic:
                self._round = await coord.join()
            return await self._attempts(coord)
        except NodeLostError as exc:
            what = "had finished" if self._finished else "were stopped"
            logger.error("%s; the workers of node %d %s", exc, self._round.node_rank, what)
            if exc.node is not None:
                self._write_summary(self._node_failure(exc.node, 1, str(exc)), 0)
            return 1
        finally:
            if self._group is not None:
                await self._group.stop(cfg.shutdown_timeout)
            if self._starter is not None:
                await self._starter.close()
            if status is not None:
                status.close()
            if cfg.etcd_endpoints and self._hosting:
                await coord.clear()
            # Node 0 also stops its server here: every other node has seen the end by now.
            await store.aclose()

    async def _serve_status(self, store: Store) -> asyncio.Server:
        """Serve the live view of the job's ranks: ``GET /`` as text, ``GET /json`` raw;
        with the job's secret, only to requests that carry the key derived from it."""
        cfg = self._cfg
        key = None if self._token is None else derive_key(self._token, "status")

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                async with asyncio.timeout(10):
                    request = await reader.readuntil(b"\r\n\r\n")
                line, _, head = request.partition(b"\r\n")
                target = line.split()[1].decode("latin-1")
                path = target.partition("?")[0]
                headers = email.parser.BytesHeaderParser().parsebytes(head)
                if not authorized(key, target, headers.get("Authorization")):
                    body, code = "the job's key is needed (?key=...)\n", "401 Unauthorized"
                else:
                    try:
                        entries = await gather_status(store, auth_token=self._token)
                        body = json.dumps(entries) if path == "/json" else format_status(entries)
                        code = "200 OK"
                    except DistError as exc:
                        body, code = f"{exc}\n", "503 Service Unavailable"
                kind = "application/json" if path == "/json" else "text/plain"
                data = body.encode()
                writer.write(
                    f"HTTP/1.0 {code}\r\nContent-Type: {kind}; charset=utf-8\r\n"
                    f"Content-Length: {len(data)}\r\n\r\n".encode()
                    + data
                )
                await writer.drain()
            except (OSError, IndexError, TimeoutError, asyncio.IncompleteReadError):
                pass  # a client that left, or sent no request
            except asyncio.LimitOverrunError:
                pass  # a request head of more than 64 KiB: not one of ours
            finally:
                writer.close()

        assert cfg.status_port is not None
        server = await asyncio.start_server(answer, cfg.status_host, cfg.status_port)
        host, port = server.sockets[0].getsockname()[:2]
        where = f"http://{host}:{port}/" + ("" if key is None else f"?key={key}")
        logger.warning("live view of the ranks at %s (JSON at /json)", where)
        return server

    async def _attempts(self, coord: Coordinator) -> int:
        cfg = self._cfg
        attempt, failures = 0, 0
        while True:
            if cfg.elastic:
                round_ = await coord.join_round(attempt, self._hosting)
                if round_ is None:
                    logger.info("the job ended before this node was needed")
                    return 0
                self._round, attempt = round_, round_.attempt
                logger.info(
                    "attempt %d: %snode %d of %d, ranks %d-%d of %d",
                    attempt,
                    "taken in as it runs, as " if round_.joined else "",
                    round_.node_rank,
                    round_.nnodes,
                    round_.rank_base,
                    round_.rank_base + cfg.nproc_per_node - 1,
                    round_.world_size,
                )
            else:
                await self._wait_release(coord, attempt)
            if self._signal is not None:
                return 128 + self._signal
            outcome = await self._run_attempt(coord, attempt)
            if outcome.left_behind:
                logger.warning(
                    "attempt %d went on without this node (its heartbeats were not seen for "
                    "%g s): joining the job again, as a node that comes",
                    attempt,
                    cfg.lost_after,
                )
                attempt += 1
                continue
            if outcome.failure is None and outcome.signum is None:
                await self._finish(coord, attempt)
                return 0
            failure = outcome.failure
            # Nodes waiting to join: the nodes come together again, which is no failure.
            rejoin = failure is not None and failure.rank < 0 and failure.exitcode == 0
            # A launcher stopped by a signal is gone for good: restarting cannot bring it back.
            # With --restart-policy=failed the attempt already used its restarts; a lost node
            # (MIN:MAX nodes) is left behind whatever the policy.
            lost = failure is not None and failure.rank < 0 and failure.exitcode > 0
            restart = rejoin or (
                failure is not None
                and failures < cfg.max_restarts
                and ((cfg.restart_policy == "all" and failure.rank >= 0) or lost)
            )
            # Node 0 starts the next attempt once every node (this one too) counted in here.
            with contextlib.suppress(NodeLostError):
                await coord.increment(attempt, "stopped")
                if not restart and self._hosting and self._several:
                    await self._linger(coord, attempt)
            if outcome.signum is not None:
                if cfg.elastic and self._hosting:
                    await coord.end(128 + outcome.signum)
                return 128 + outcome.signum
            assert failure is not None
            if not restart:
                if cfg.elastic and self._hosting:
                    await coord.end(1)
                self._write_summary(failure, failures)
                return 1
            if rejoin:
                logger.info("attempt %d: nodes are waiting to join: the nodes meet again", attempt)
            else:
                failures += 1
                logger.warning(
                    "attempt %d failed: %s; restarting the workers (%d of %d restarts left)",
                    attempt,
                    self._what_failed(failure),
                    cfg.max_restarts - failures,
                    cfg.max_restarts,
                )
            attempt += 1

    @staticmethod
    def _what_failed(failure: WorkerFailure) -> str:
        if failure.rank >= 0:
            return (
                f"rank {failure.rank} (node {failure.node_rank}) exited with "
                f"{describe_exit(failure.exitcode)}"
            )
        if failure.exitcode == 0:
            return "nodes are waiting to join"
        if failure.exitcode > 0:
            return f"node {failure.node_rank} was lost"
        return f"the launcher of node {failure.node_rank} was stopped by {describe_exit(failure.exitcode)}"

    async def _linger(self, coord: Coordinator, attempt: int) -> None:
        """Node 0 keeps the store up until every node has read the failure (or is lost)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._cfg.lost_after):
                while await coord.count(attempt, "stopped") < len(coord.live):
                    await asyncio.sleep(self._cfg.monitor_interval)

    async def _wait_release(self, coord: Coordinator, attempt: int) -> None:
        """Node 0 starts ``attempt`` once every node stopped the previous one; others wait."""
        cfg = self._cfg
        if self._hosting:
            while attempt > 0 and await coord.count(attempt - 1, "stopped") < cfg.nnodes:
                await self._tick(coord, attempt)
            await coord.release(attempt)
            return
        while not await coord.released(attempt):
            await self._tick(coord, attempt)

    async def _tick(self, coord: Coordinator, attempt: int) -> None:
        if self._several:
            await self._heartbeats(coord, attempt)
        await asyncio.sleep(self._cfg.monitor_interval)

    async def _heartbeats(self, coord: Coordinator, attempt: int) -> None:
        """Send this node's heartbeat and check the others'. When the attempt goes on
        without a lost node, leave it behind (while at least ``MIN`` nodes remain) and take
        up what the other nodes saw come and go.

        Raises:
            NodeLostError: a node's heartbeats stopped (and the attempt cannot go on without
                it), or the store stopped answering.
        """
        cfg = self._cfg
        try:
            await coord.beat()
        except NodeLostError as exc:
            if not self._goes_on or exc.node is None or len(coord.live) <= cfg.nnodes:
                raise
            await coord.leave_behind(attempt, exc.node, str(exc))
        if not self._goes_on:
            return
        for node in await coord.follow(attempt):
            if node != self._round.node_rank:
                left = len(coord.live)
                logger.warning(
                    "node %d was lost: the attempt goes on without it, on %d node%s "
                    "(--nnodes=%d:%s); the workers go on without its workers "
                    "(--restart-policy=failed)",
                    node,
                    left,
                    "" if left == 1 else "s",
                    cfg.nnodes,
                    cfg.max_nnodes,
                )
        if self._hosting and not self._finished and self._round.node_rank not in coord.left:
            await self._take_in(coord, attempt)

    async def _take_in(self, coord: Coordinator, attempt: int) -> None:
        """The store's node, when the attempt goes on: take the nodes that came into it, up
        to ``MAX`` (the others wait as spares)."""
        cfg = self._cfg
        assert cfg.max_nnodes is not None
        arrived = await coord.count(attempt + 1, "arrived")
        while self._taken < arrived and len(coord.live) < cfg.max_nnodes:
            node = await coord.take_in(attempt, self._taken)
            self._taken += 1
            await coord.follow(attempt)
            logger.info(
                "a node came: taken into attempt %d as node %d; its workers join at the "
                "workers' next admission point",
                attempt,
                node,
            )

    def _spec(self, local: int, restarts: int) -> WorkerSpec:
        """The worker of local rank ``local`` after ``restarts`` restarts (of it or the group)."""
        cfg = self._cfg
        attempt_dir = self._log_base / cfg.run_id / f"attempt_{restarts}"
        place = self._round
        rank = place.rank_base + local
        env = self._environment()
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(local),
            WORLD_SIZE=str(place.world_size),
            LOCAL_WORLD_SIZE=str(cfg.nproc_per_node),
            GROUP_RANK=str(place.node_rank),
            GROUP_WORLD_SIZE=str(place.nnodes),
            ROLE_NAME=cfg.role,
            ROLE_RANK=str(rank),
            ROLE_WORLD_SIZE=str(place.world_size),
            TORCHELASTIC_RESTART_COUNT=str(restarts),
            TORCHELASTIC_MAX_RESTARTS=str(cfg.max_restarts),
            TORCHELASTIC_RUN_ID=cfg.run_id,
            TORCHELASTIC_ERROR_FILE=str(attempt_dir / str(rank) / "error.json"),
            AIODIST_RESTART_COUNT=str(restarts),
            AIODIST_RESTART_POLICY=cfg.restart_policy,
            AIODIST_RUN_ID=cfg.run_id,
            PYTHON_EXEC=sys.executable,
        )
        if cfg.etcd_url is not None:
            # The workers' store is the launchers' store in etcd (torch's TCPStore clients
            # cannot use it: no MASTER_ADDR for them).
            env["AIODIST_STORE_URL"] = cfg.etcd_url
        else:
            env.pop("AIODIST_STORE_URL", None)
            env.update(
                MASTER_ADDR=cfg.master_addr,
                MASTER_PORT=str(self._port),
                TORCHELASTIC_USE_AGENT_STORE="True",
            )
        if cfg.status_port is not None:
            env["AIODIST_STATUS"] = "1"
            if self._several:
                # Node 0's launcher asks every rank: their endpoints listen where it reaches.
                env.setdefault("AIODIST_STATUS_HOST", cfg.local_addr or self._local_addr or "")
        if cfg.virtual_local_rank:
            env.update(LOCAL_RANK="0", CUDA_VISIBLE_DEVICES=_own_device(local))
        if cfg.local_addr is not None:
            env["AIODIST_HOST"] = cfg.local_addr
        elif self._local_addr is not None:
            env.setdefault("AIODIST_HOST", self._local_addr)
        return WorkerSpec(
            rank=rank,
            local_rank=local,
            cmd=cfg.cmd,
            env=env,
            redirect=cfg.redirects[local],
            tee=cfg.tees[local],
            console=cfg.local_ranks_filter is None or local in cfg.local_ranks_filter,
            log_dir=attempt_dir / str(rank),
            error_file=attempt_dir / str(rank) / "error.json",
            prefix=functools.partial(self._line_prefix, local=local),
        )

    def _environment(self) -> dict[str, str]:
        """What every worker's environment starts from (and the ``--preload`` starter's)."""
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        if self._token is not None:  # (one from the environment is there already)
            env.setdefault("AIODIST_AUTH_TOKEN", self._token.decode())
        return env

    def _line_prefix(self, rank: int, local: int) -> str:
        """What starts the console lines of the worker of ``local`` while it has ``rank``:
        ``--log-line-prefix-template``, or the default prefix."""
        template = self._cfg.line_prefix
        if template is None:
            return default_prefix(rank)
        fields = {
            "rank": rank,
            "local_rank": local,
            "role_name": self._cfg.role,
            "hostname": socket.gethostname(),
        }
        return string.Template(template).safe_substitute(fields) + " "

    def _can_restart_alone(self, failure: WorkerFailure) -> bool:
        cfg = self._cfg
        return (
            cfg.restart_policy == "failed"
            and self._signal is None
            and self._restarts[failure.local_rank] < cfg.max_restarts
        )

    async def _restart_alone(self, group: WorkerGroup, failure: WorkerFailure) -> None:
        """Replace the failed worker; the others, and the store, keep running."""
        count = self._restarts[failure.local_rank] + 1
        self._restarts[failure.local_rank] = count
        logger.warning(
            "rank %d (pid %d) exited with %s; restarting it alone (its restart %d of %d), "
            "the other workers keep running",
            failure.rank,
            failure.pid,
            describe_exit(failure.exitcode),
            count,
            self._cfg.max_restarts,
        )
        await group.replace(self._spec(failure.local_rank, count))

    async def _run_attempt(self, coord: Coordinator, attempt: int) -> _Outcome:
        cfg = self._cfg
        group = WorkerGroup(self._round.node_rank, self._stdout, self._stderr, self._starter)
        self._group = group
        self._finished, self._taken = False, 0
        # A node taken into a running attempt starts its workers as replacements are:
        # TORCHELASTIC_RESTART_COUNT above 0, so that they join the running world.
        first = attempt + 1 if self._round.joined else attempt
        try:
            await group.start([self._spec(local, first) for local in range(cfg.nproc_per_node)])
            if self._keep_logs and attempt == 0 and any(cfg.redirects + cfg.tees):
                logger.info("worker logs: %s", self._log_base / cfg.run_id)
            while True:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(cfg.monitor_interval):
                        await _first(group.changed.wait(), self._interrupted.wait())
                group.changed.clear()
                if self._signal is not None:
                    # Tell the other nodes first: their workers would otherwise see this
                    # node's workers leave and fail, and report that as the root cause.
                    if self._several:
                        with contextlib.suppress(NodeLostError):
                            await coord.publish_failure(attempt, self._signal_failure())
                    await group.stop(cfg.shutdown_timeout, self._signal)
                    for level, message in group.shutdown_report():
                        logger.log(level, "%s", message)
                    return _Outcome(signum=self._signal)
                failure = group.first_failure()
                while failure is not None and self._can_restart_alone(failure):
                    await self._restart_alone(group, failure)
                    failure = group.first_failure()
                if failure is not None:
                    failure.restarts = self._restarts[failure.local_rank]
                    await group.stop(cfg.shutdown_timeout)
                    if self._several:
                        try:
                            failure = await coord.publish_failure(attempt, failure)
                        except NodeLostError:
                            self._write_summary(failure, attempt)
                            raise
                    return _Outcome(failure=failure)
                if self._several:
                    remote = await self._news(coord, attempt)
                    if self._round.node_rank in coord.left:
                        logger.warning(
                            "the other nodes went on without this one: stopping its workers"
                        )
                        await group.stop(cfg.shutdown_timeout)
                        return _Outcome(left_behind=True)
                    if remote is not None:
                        logger.info(
                            "%s: stopping the workers of this node", self._what_failed(remote)
                        )
                        await group.stop(cfg.shutdown_timeout)
                        return _Outcome(failure=remote)
                # A worker that failed during the store requests above is handled at the top
                # of the loop, not taken for the end of a successful run.
                if not group.running() and group.first_failure() is None:
                    break
        except BaseException:
            await group.stop(cfg.shutdown_timeout)
            raise
        finally:
            self._group = None
        # This node is done; the job is done once every node is (every node that is left,
        # when the attempt goes on without lost nodes).
        self._finished = True
        if self._several:
            await coord.mark(attempt, "done")
            while not await coord.marked(attempt, "done", coord.live):
                remote = await coord.failure(attempt)
                if remote is not None:
                    return _Outcome(failure=remote)
                if self._interrupted.is_set():
                    return _Outcome(signum=self._signal)
                await self._tick(coord, attempt)
        return _Outcome()

    async def _news(self, coord: Coordinator, attempt: int) -> WorkerFailure | None:
        """What ends ``attempt`` on the other nodes, if anything: a failure there, a lost
        node, or (MIN:MAX nodes) nodes waiting to join. The first one recorded is every
        node's."""
        cfg = self._cfg
        try:
            await self._heartbeats(coord, attempt)
        except NodeLostError as exc:
            if not cfg.elastic or exc.node is None:
                raise  # (a fixed set of nodes cannot go on without one, nor anyone without the store)
            return await coord.publish_failure(attempt, self._node_failure(exc.node, 1, str(exc)))
        if (
            cfg.elastic
            and not self._goes_on
            and cfg.max_nnodes is not None
            and self._round.nnodes < cfg.max_nnodes
            and await coord.waiting(attempt)
        ):
            news = "nodes are waiting to join"
            return await coord.publish_failure(attempt, self._node_failure(-1, 0, news))
        return await coord.failure(attempt)

    def _node_failure(self, node: int, exitcode: int, text: str) -> WorkerFailure:
        # How a node's launcher ends an attempt that no worker failed: rank -1, and exit code
        # 0 when nodes wait to join, 1 when a node was lost, -N when stopped by signal N.
        return WorkerFailure(
            rank=-1,
            local_rank=-1,
            node_rank=self._round.node_rank if node < 0 else node,
            pid=os.getpid(),
            exitcode=exitcode,
            timestamp=time.time(),
            stderr_tail=[text],
        )

    async def _finish(self, coord: Coordinator, attempt: int) -> None:
        """Node 0 keeps the store up until every other node has seen the job finish."""
        if not self._several:
            return
        if not self._hosting:
            await coord.mark(attempt, "ack")
            return
        if self._cfg.elastic:
            await coord.end(0)  # (nodes still waiting to join learn it and stop)
        with contextlib.suppress(NodeLostError):
            me = self._round.node_rank
            while not await coord.marked(attempt, "ack", [n for n in coord.live if n != me]):
                await self._tick(coord, attempt)

    def _signal_failure(self) -> WorkerFailure:
        assert self._signal is not None
        name = signal.Signals(self._signal).name
        text = f"the launcher of node {self._round.node_rank} received {name}"
        return self._node_failure(-1, -self._signal, text)

    def _write_summary(self, failure: WorkerFailure, attempt: int) -> None:
        self._stderr.write(self._summary(failure, attempt).encode())
        self._stderr.flush()

    def _summary(self, f: WorkerFailure, attempt: int) -> str:
        cfg = self._cfg
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(f.timestamp))
        if f.rank < 0:
            head = self._what_failed(f)
        else:
            head = (
                f"rank {f.rank} (local rank {f.local_rank} on node {f.node_rank}, pid {f.pid}) "
                f"failed first, with {describe_exit(f.exitcode)} at {when}"
            )
        if cfg.restart_policy == "failed" and f.rank >= 0:
            times = "once" if f.restarts == 1 else f"{f.restarts} times"
            restarts = (
                f"rank {f.rank} had been restarted {times} (--max-restarts={cfg.max_restarts}, "
                "--restart-policy=failed)"
            )
        else:
            restarts = (
                f"attempt {attempt + 1} of {cfg.max_restarts + 1} "
                f"(--max-restarts={cfg.max_restarts})"
            )
        lines = [
            "",
            "=" * 72,
            "aiodist-run: the job failed",
            f"  root cause: {head}",
            f"  {restarts}; the other workers were stopped",
        ]
        if f.rank < 0 and f.exitcode > 0 and not cfg.elastic:
            lines[-1] = f"  the workers of node {self._round.node_rank} " + (
                "had finished" if self._finished else "were stopped"
            )
            lines.append(
                f"  a job of --nnodes={cfg.nnodes} runs on exactly that many nodes and ends when "
                "one is lost; with --nnodes=MIN:MAX and --restart-policy=failed the other "
                "nodes go on, their workers shrinking past the lost node's"
            )
        if f.finished:
            which = ", ".join(map(str, sorted(f.finished)))
            lines.append(
                f"  {'rank' if len(f.finished) == 1 else 'ranks'} {which} of node "
                f"{f.node_rank} had finished before (exit code 0): not a failure, even where "
                "the error names them"
            )
        if f.error:
            lines.append(f"  error: {f.error}")
        if f.error_traceback:
            lines.append("  traceback (from the worker's error file):")
            lines += ["    " + s for s in f.error_traceback.rstrip().splitlines()[-30:]]
        elif f.stderr_tail:
            lines.append(
                f"  last lines of rank {f.rank}'s stderr:" if f.rank >= 0 else "  details:"
            )
            lines += ["    " + s for s in f.stderr_tail]
        lines += ["=" * 72, ""]
        return "\n".join(lines)


def _job_secret(cfg: LaunchConfig) -> bytes | None:
    """The job's secret: ``$AIODIST_AUTH_TOKEN``, else a new one for a job of one node. The
    nodes of a job that spans several must share theirs; without one, the job runs open
    (as torchrun's do), and this says so."""
    token = resolve_token(None)
    if token is not None:
        return token
    if cfg.nnodes == 1 and not cfg.elastic:
        return secrets.token_hex(32).encode()
    logger.warning(
        "this job spans several nodes and has no secret: anyone who can reach the store at "
        "%s:%d or a worker's port can read and change the job's keys, pose as a rank, and "
        "send what the object collectives unpickle. Set AIODIST_AUTH_TOKEN to the same "
        "secret on every node (python -c 'import secrets; print(secrets.token_hex(32))')",
        cfg.master_addr,
        cfg.master_port,
    )
    return None


def _own_device(local: int) -> str:
    """The GPU of local rank ``local`` for ``--virtual-local-rank``: its entry of the
    launcher's ``CUDA_VISIBLE_DEVICES``, or its index."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not visible:
        return str(local)
    if local >= len(visible):
        raise DistUsageError(
            f"--virtual-local-rank: local rank {local} has no GPU: CUDA_VISIBLE_DEVICES lists "
            f"{len(visible)}"
        )
    return visible[local].strip()


async def _first(*aws: Any) -> None:
    """Wait until the first of ``aws`` completes; cancel the rest."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``aiodist-run`` and ``python -m aiodist.run``.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        0 when every worker succeeded; 1 when a worker failed (after the allowed restarts) or
        a node was lost; 2 for a bad command line; 128 + N when stopped by signal N.
    """
    logging.basicConfig(level=logging.INFO, format="[aiodist-run] %(levelname)s: %(message)s")
    try:
        cfg = parse_args(argv)
    except DistUsageError as exc:
        sys.stderr.write(f"aiodist-run: error: {exc}\n")
        return 2
    launcher = _Launcher(cfg, sys.stdout.buffer, sys.stderr.buffer)
    try:
        with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
            return runner.run(launcher.run())
    except DistUsageError as exc:
        logger.error("%s", exc)
        return 2
    except DistError as exc:
        logger.error("%s", exc)
        return 1
    except OSError as exc:
        logger.error("%s", exc)
        return 1
