"""An unmodified torch.distributed gloo worker, for running under aiodist-run.

``launcher_torch_worker.py [crash-once]``: init through env://, all_reduce rank+1 and barrier;
with ``crash-once``, rank 1 exits 3 on attempt 0 after the group formed and ran a collective.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if sys.argv[1:] == ["crash-once"] and attempt == 0 and rank == 1:
    print("crashing after the group formed", file=sys.stderr, flush=True)
    os._exit(3)
dist.barrier()
print(f"torch attempt={attempt} sum={t.item():g} expected={world * (world + 1) / 2:g}", flush=True)
dist.destroy_process_group()
