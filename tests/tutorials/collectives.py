"""A torchrun-style collectives tutorial, ported by the import line (numpy for tensors).

Run under the launcher: ``aiodist-run --standalone --nproc-per-node=N collectives.py``. It
joins through ``env://``, runs each collective once and checks the documented result, and,
like most scripts, never calls ``destroy_process_group()``.
"""

import numpy as np

import aiodist.sync as dist

dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()

# all_reduce: every rank ends with the sum.
t = np.array([rank + 1.0, 2.0 * rank])
dist.all_reduce(t, op=dist.ReduceOp.SUM)
assert (t == [size * (size + 1) / 2, size * (size - 1)]).all(), t

# broadcast: rank 0's values everywhere.
t = np.arange(4.0) if rank == 0 else np.zeros(4)
dist.broadcast(t, src=0)
assert (t == np.arange(4.0)).all(), t

# reduce: the product reaches rank 0 only.
t = np.array([float(rank + 1)])
dist.reduce(t, dst=0, op=dist.ReduceOp.PRODUCT)
if rank == 0:
    assert t[0] == np.prod(np.arange(1.0, size + 1)), t

# all_gather: every rank's array, in rank order.
outs = [np.zeros(2) for _ in range(size)]
dist.all_gather(outs, np.array([rank, rank * 10.0]))
assert all((o == [r, r * 10.0]).all() for r, o in enumerate(outs)), outs

# reduce_scatter: rank r gets the sum of everybody's r-th block.
out = np.zeros(3)
dist.reduce_scatter(out, [np.full(3, float(rank + r)) for r in range(size)])
assert (out == sum(q + rank for q in range(size))).all(), out

# A group of the first two ranks, as in the tutorial: every rank calls the collective, and
# on the others, which are not members, it warns and returns, as torch's does.
group = dist.new_group([0, 1])
t = np.ones(1)
dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
assert t[0] == (2 if rank < 2 else 1), t
print(f"rank {rank}: all collectives gave the documented results")
