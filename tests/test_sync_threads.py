"""The blocking facade from several threads of each rank, with 2 and 4 ranks in processes.

Operations of one group must be issued in the same order on every rank, as in torch; the
way to use several threads is a group per thread (made in the same order everywhere), or
point-to-point messages told apart by tag. Every result is checked against its arithmetic.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from aiodist.testing import run_world_processes

THREADS, STEPS = 3, 20


def _group_per_thread(rank: int, size: int) -> dict[int, list[float]]:
    import aiodist.sync as dist

    groups = [dist.new_group(list(range(size))) for _ in range(THREADS)]
    results: dict[int, list[float]] = {}
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            got = []
            right, left = (rank + 1) % size, (rank - 1) % size
            for i in range(STEPS):
                x = np.full(3, (rank + 1.0) * (t + 1) + i)
                dist.all_reduce(x, group=groups[t])
                # A ring exchange, tagged by thread and step, on the default group.
                out = np.zeros(1)
                send = dist.isend(np.array([100.0 * rank + t]), right, tag=t * STEPS + i)
                dist.recv(out, left, tag=t * STEPS + i)
                send.wait()
                got += [float(x[0]), float(out[0])]
            results[t] = got
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    if errors:
        raise errors[0]
    return results


@pytest.mark.multiprocess
@pytest.mark.parametrize("size", [2, 4])
def test_each_thread_runs_its_own_group(size: int) -> None:
    results = run_world_processes(_group_per_thread, size, timeout=90)
    for rank, per_thread in enumerate(results):
        left = (rank - 1) % size
        for t in range(THREADS):
            expected = []
            for i in range(STEPS):
                expected.append((t + 1) * size * (size + 1) / 2 + size * i)
                expected.append(100.0 * left + t)
            assert per_thread[t] == expected, (rank, t)
