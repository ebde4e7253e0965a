"""torch.distributed's explicit-store listing, on numpy arrays with ``import aiodist.sync``.

Each of four processes creates a ``TCPStore`` (rank 0 hosts it), hands it to
``init_process_group(backend="gloo", store=...)`` and all-reduces an array.

    python examples/sync_tcpstore.py [world_size]

MASTER_ADDR and MASTER_PORT are read from the environment (default 127.0.0.1 and a free
port).
"""

import multiprocessing as mp
import os
import socket
import sys

import numpy as np

import aiodist.sync as dist


def run(rank: int, world_size: int, master_addr: str, master_port: int) -> None:
    store = dist.TCPStore(
        host_name=master_addr,
        port=master_port,
        world_size=world_size,
        is_master=rank == 0,
    )
    dist.init_process_group(backend="gloo", store=store, rank=rank, world_size=world_size)
    tensor = np.arange(4, dtype=np.float32) * (rank + 1)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    expected = np.arange(4, dtype=np.float32) * sum(range(1, world_size + 1))
    np.testing.assert_array_equal(tensor, expected)
    # One write per line: the ranks share the terminal.
    sys.stdout.write(f"rank {rank}/{world_size}: all_reduce -> {tensor.tolist()}\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    store.close()


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def main() -> int:
    world_size = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    master_port = int(os.environ.get("MASTER_PORT") or free_port(master_addr))
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=run, args=(rank, world_size, master_addr, master_port))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [rank for rank, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        print(f"ranks {failed} failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
