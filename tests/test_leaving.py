"""Leaving a world in any order: ``destroy_process_group`` returns within a bounded time.

The ranks build their store in torch's explicit-store shape (``tests/leave_worker.py``: rank
0 hosts it, the store object goes out of scope once the process group has it) in processes
that live on after they destroy (a pool's workers). The rank hosting the store keeps it up
until the others have left; a rank that does not host it never waits for a store that stopped
answering longer than ``LEAVE_WAIT``.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import time
from pathlib import Path

import leave_worker
import pytest

from aiodist.group._world import LEAVE_WAIT
from aiodist.testing import free_port

pytestmark = pytest.mark.multiprocess

#: How long after the last rank called it every destroy_process_group has returned, at the
#: most (seconds): leaving takes well under a second; this allows for a loaded machine.
RETURNED_WITHIN = 10.0


def test_every_order_of_destroys_returns_in_a_pool_of_live_workers(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        for n, each in enumerate(itertools.permutations(range(3))):
            run_dir = tmp_path / str(n)
            run_dir.mkdir()
            port = free_port()
            jobs = [(rank, port, each, str(run_dir)) for rank in range(3)]
            results = pool.map_async(leave_worker.destroy_in_order, jobs, chunksize=1)
            done = results.get(timeout=90)
            last_call = max(called for _, called, _ in done)
            for rank, called, returned in done:
                assert returned - last_call < RETURNED_WITHIN, (each, done)
                if rank != 0:  # (rank 0 waits for the others to leave)
                    assert returned - called < RETURNED_WITHIN, (each, done)


def test_destroy_does_not_wait_for_a_store_host_that_stopped_answering(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    ready, report = tmp_path / "ready", tmp_path / "report"
    ready.mkdir()
    report.mkdir()
    port = free_port()
    procs = [
        ctx.Process(target=leave_worker.stop_after_work, args=(r, port, str(ready), str(report)))
        for r in range(3)
    ]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 60
        while not all((ready / str(r)).exists() for r in range(3)):
            assert time.monotonic() < deadline, "the ranks did not form their world"
            time.sleep(0.01)
        assert procs[0].pid is not None
        os.kill(procs[0].pid, signal.SIGSTOP)  # its store's loop no longer answers
        (ready / "stopped").touch()
        for p in procs[1:]:
            p.join(timeout=LEAVE_WAIT + 30)
            assert p.exitcode == 0
        took = [float((report / str(r)).read_text()) for r in (1, 2)]
        # The store's goodbye is given up after LEAVE_WAIT; closing the connections to the
        # stopped rank takes moments.
        assert all(LEAVE_WAIT - 0.5 < t < LEAVE_WAIT + 5 for t in took), took
    finally:
        if procs[0].pid is not None:
            os.kill(procs[0].pid, signal.SIGCONT)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    assert procs[0].exitcode == 0
