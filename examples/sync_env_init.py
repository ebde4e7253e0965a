"""torch.distributed's tutorial listing (env:// initialization), with ``import aiodist.sync``.

The parent sets MASTER_ADDR and MASTER_PORT and starts four processes; each calls
``init_process_group("gloo", rank=rank, world_size=size)``, which reads the rest from the
environment, and all-reduces an array.

    python examples/sync_env_init.py [world_size]
"""

import multiprocessing as mp
import os
import socket
import sys

import numpy as np

import aiodist.sync as dist


def run(rank: int, size: int) -> None:
    """All-reduce ``rank + 1`` over every process."""
    tensor = np.full(8, rank + 1, dtype=np.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    np.testing.assert_array_equal(tensor, np.full(8, size * (size + 1) // 2))
    # One write per line: the ranks share the terminal.
    sys.stdout.write(f"rank {rank}/{size}: all_reduce -> {tensor[0]}\n")
    sys.stdout.flush()


def init_process(rank: int, size: int, backend: str = "gloo") -> None:
    """Initialize the distributed environment, run, and tear down."""
    dist.init_process_group(backend, rank=rank, world_size=size)
    run(rank, size)
    dist.destroy_process_group()


def main() -> int:
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if not os.environ.get("MASTER_PORT"):
        with socket.socket() as s:
            s.bind((os.environ["MASTER_ADDR"], 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    processes = []
    for rank in range(size):
        p = ctx.Process(target=init_process, args=(rank, size))
        p.start()
        processes.append(p)
    for p in processes:
        p.join()
    return 0 if all(p.exitcode == 0 for p in processes) else 1


if __name__ == "__main__":
    sys.exit(main())
