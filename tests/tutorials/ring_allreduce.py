"""The PyTorch tutorial "Writing Distributed Applications": point-to-point communication and
its own ring all-reduce, ported by the import line (numpy arrays for tensors).

Run as the tutorial runs it: ``python ring_allreduce.py WORLD PORT [START_METHOD]``. Like the
tutorial (and most scripts), it never calls ``destroy_process_group()``. Each line is printed
in one write (the tutorial's ``print("Rank ", rank, ...)`` interleaves between processes).
"""

import multiprocessing as mp
import os
import sys

import numpy as np

import aiodist.sync as dist


def blocking(rank, size):
    """Blocking point-to-point communication: rank 0 sends to every other rank."""
    tensor = np.zeros(1)
    if rank == 0:
        tensor += 1
        for dst in range(1, size):
            dist.send(tensor=tensor, dst=dst)
    else:
        dist.recv(tensor=tensor, src=0)
    print(f"Rank {rank} has data {tensor[0]}")
    assert tensor[0] == 1


def nonblocking(rank, size):
    """Non-blocking point-to-point communication: the same with isend/irecv and wait()."""
    tensor = np.zeros(1)
    if rank == 0:
        tensor += 2
        reqs = [dist.isend(tensor=tensor, dst=dst) for dst in range(1, size)]
        print("Rank 0 started sending")
    else:
        reqs = [dist.irecv(tensor=tensor, src=0)]
        print(f"Rank {rank} started receiving")
    for req in reqs:
        req.wait()
    print(f"Rank {rank} has data {tensor[0]}")
    assert tensor[0] == 2


def allreduce(send, recv):
    """Implementation of a ring-reduce (the tutorial's)."""
    rank = dist.get_rank()
    size = dist.get_world_size()
    send_buff = send.copy()
    recv_buff = send.copy()
    accum = send.copy()

    left = ((rank - 1) + size) % size
    right = (rank + 1) % size

    for i in range(size - 1):
        if i % 2 == 0:
            # Send send_buff
            send_req = dist.isend(send_buff, right)
            dist.recv(recv_buff, left)
            accum[:] += recv_buff[:]
        else:
            # Send recv_buff
            send_req = dist.isend(recv_buff, right)
            dist.recv(send_buff, left)
            accum[:] += send_buff[:]
        send_req.wait()
    recv[:] = accum[:]


def run(rank, size):
    blocking(rank, size)
    nonblocking(rank, size)
    t = np.ones(4) * (rank + 1)
    r = np.zeros(4)
    allreduce(t, r)
    print(f"Rank {rank} has data {r[0]}")
    assert (r == size * (size + 1) / 2).all(), r


def init_process(rank, size, fn, port, backend="gloo"):
    """Initialize the distributed environment."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(rank, size)


if __name__ == "__main__":
    size, port = int(sys.argv[1]), int(sys.argv[2])
    if len(sys.argv) > 3:
        mp.set_start_method(sys.argv[3])
    processes = []
    for rank in range(size):
        p = mp.Process(target=init_process, args=(rank, size, run, port))
        p.start()
        processes.append(p)

    for p in processes:
        p.join()
    sys.exit(max(abs(p.exitcode) for p in processes))
