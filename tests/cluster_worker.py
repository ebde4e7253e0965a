"""One rank of a job started by a cluster's launcher (srun, mpirun, aiodist-run in a "pod").

It joins through ``env://`` with nothing but what the launcher set, all_reduces an array
that depends on its rank, checks the result against numpy, and prints one JSON line: the
rank, world size, local rank and master it used, with their sources, and the reduced sum.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import aiodist.sync as dist
from aiodist._util._cluster import VARIABLES, read_cluster_env

N = 1000


def contribution(rank: int) -> np.ndarray:
    return np.arange(N, dtype=np.float64) * (rank + 1) + rank


def main() -> None:
    launched_with = dict(os.environ)  # env:// exports a derived master; report what it found
    dist.init_process_group(backend="gloo", init_method="env://", timeout=60)
    job = read_cluster_env(launched_with)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x = contribution(rank)
    dist.all_reduce(x)
    expected = np.sum([contribution(r) for r in range(world_size)], axis=0)
    np.testing.assert_array_equal(x, expected)
    report = {
        "rank": rank,
        "world_size": world_size,
        "rank_source": job.rank.source,
        "world_size_source": job.world_size.source,
        "local_rank": None if job.local_rank is None else job.local_rank.value,
        "master_addr": job.master_addr.value,
        "master_addr_source": job.master_addr.source,
        "master_port": job.master_port.value,
        "master_port_source": job.master_port.source,
        "exported_master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        "sum": float(x.sum()),
        "env": {name: launched_with[name] for name in VARIABLES if name in launched_with},
    }
    dist.destroy_process_group()
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
