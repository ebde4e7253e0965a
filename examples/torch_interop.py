"""torch and aiodist workers in one job, sharing one store hosted by aiodist.

    aiodist-run --standalone --nproc-per-node=4 examples/torch_interop.py

``aiodist-run`` hosts the job's TCPStore (aiodist's server, which also speaks torch's
TCPStore wire protocol) and starts four workers. They form two separate worlds on that one
store, each under a key prefix of its own:

* ranks 0 and 1 are plain ``torch.distributed`` workers: a ``torch.distributed.TCPStore``
  client, a gloo process group, ``dist.all_reduce`` on a torch tensor;
* ranks 2 and 3 are aiodist workers (``import aiodist.sync as dist``, the blocking API):
  an ``aiodist.sync.TCPStore`` client, an aiodist process group, and
  ``dist.all_reduce(tensor)`` on **torch CPU tensors**, which aiodist takes through DLPack
  and reduces in place (same memory, ``data_ptr()`` unchanged, no copy back).

Then the worlds exchange their results through the shared store: the first rank of each
world publishes its reduced tensor, every rank reads the other world's, and each rank checks
both against numpy and prints one ``RESULT`` line (JSON) with what it computed.

Every rank's tensor is ``arange(ELEMS) * (global rank + 1)``, so the torch world's sum is
``3 * arange``, the aiodist world's ``7 * arange``, and together ``10 * arange``.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import numpy as np
import torch

ELEMS = 8
TORCH_RANKS = (0, 1)
TIMEOUT = timedelta(seconds=60)
RESULT_KEY = "interop/result/{}"


def contribution(global_rank: int) -> np.ndarray:
    """What global rank ``global_rank`` puts into its world's all_reduce."""
    return np.arange(ELEMS, dtype=np.float32) * (global_rank + 1)


def world_sum(ranks: range | tuple[int, ...]) -> np.ndarray:
    """The numpy reference of a world's all_reduce."""
    return np.sum([contribution(r) for r in ranks], axis=0, dtype=np.float32)


def torch_worker(rank: int, host: str, port: int) -> tuple[np.ndarray, np.ndarray]:
    """A plain torch.distributed gloo worker; returns (its world's sum, the other world's)."""
    import torch.distributed as tdist

    store = tdist.TCPStore(host, port, is_master=False, timeout=TIMEOUT)
    group_store = tdist.PrefixStore("interop/torch_world", store)
    tdist.init_process_group(
        "gloo", store=group_store, rank=rank, world_size=len(TORCH_RANKS), timeout=TIMEOUT
    )
    t = torch.from_numpy(contribution(rank))
    tdist.all_reduce(t)
    if rank == 0:
        store.set(RESULT_KEY.format("torch"), t.numpy().tobytes())
    store.wait([RESULT_KEY.format("aiodist")])
    other = np.frombuffer(store.get(RESULT_KEY.format("aiodist")), dtype=np.float32)
    tdist.destroy_process_group()
    return t.numpy(), other


def aiodist_worker(
    rank: int, world_size: int, host: str, port: int
) -> tuple[np.ndarray, np.ndarray]:
    """An aiodist worker that reduces torch tensors in place; returns (own sum, the other's)."""
    import aiodist.sync as dist

    store = dist.TCPStore(host, port, is_master=False, timeout=TIMEOUT)
    group_store = dist.PrefixStore("interop/aiodist_world", store)
    group_rank, group_size = rank - len(TORCH_RANKS), world_size - len(TORCH_RANKS)
    dist.init_process_group(
        "gloo", store=group_store, rank=group_rank, world_size=group_size, timeout=TIMEOUT
    )
    t = torch.from_numpy(contribution(rank))
    address = t.data_ptr()
    dist.all_reduce(t)  # a torch tensor: viewed through DLPack and reduced in place
    assert t.data_ptr() == address, "all_reduce must write into the tensor's own memory"
    if group_rank == 0:
        store.set(RESULT_KEY.format("aiodist"), t.numpy().tobytes())
    store.wait([RESULT_KEY.format("torch")])
    other = np.frombuffer(store.get(RESULT_KEY.format("torch")), dtype=np.float32)
    dist.destroy_process_group()
    store.close()
    return t.numpy(), other


def main() -> None:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size <= len(TORCH_RANKS):
        sys.exit(f"needs more than {len(TORCH_RANKS)} workers: --nproc-per-node=4")
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    torch_ranks, aiodist_ranks = TORCH_RANKS, range(len(TORCH_RANKS), world_size)
    if rank in torch_ranks:
        world, (own, other) = "torch", torch_worker(rank, host, port)
        own_expected, other_expected = world_sum(torch_ranks), world_sum(aiodist_ranks)
    else:
        world, (own, other) = "aiodist", aiodist_worker(rank, world_size, host, port)
        own_expected, other_expected = world_sum(aiodist_ranks), world_sum(torch_ranks)
    np.testing.assert_array_equal(own, own_expected)
    np.testing.assert_array_equal(other, other_expected)
    np.testing.assert_array_equal(own + other, world_sum(range(world_size)))
    # One write per line: the ranks share the terminal.
    line = {"rank": rank, "world": world, "own": own.tolist(), "other": other.tolist()}
    sys.stdout.write(f"RESULT {json.dumps(line)}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
