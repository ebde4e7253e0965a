"""The usage errors of the rejection matrix, written once for the async and the blocking API.

A case is a function ``case(rank, size, bad) -> (steps, pattern)``: the calls this rank
makes (bad where ``bad`` is true, correct elsewhere) as ``(function name, args, kwargs)``
steps, and the pattern its own error matches when it is bad. :func:`check_async` and
:func:`check_blocking` make the calls through ``aiodist`` or ``aiodist.sync`` and check what
every rank raised: the local error on a bad rank, the peer's rejection on the others that
wait for it, within a second. Then :func:`agree_async`/:func:`agree_blocking` check that the
next collective equals numpy on every rank.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import aiodist
import aiodist.sync as dist

Step = tuple[str, tuple[Any, ...], dict[str, Any]]
Case = Callable[[int, int, bool], tuple[list[Step], str]]

#: Who makes the mistake: rank 0 only, or every rank.
ONE_SIDED, SYMMETRIC = "one-sided", "symmetric"
#: A step that waits for the point-to-point works started so far.
WAIT: Step = ("wait", (), {})
#: A barrier made even when an earlier step of the rank raised.
ALWAYS_BARRIER: Step = ("barrier", (), {"always": True})


def bad_op(rank: int, size: int, bad: bool) -> tuple[list[Step], str]:
    op = aiodist.ReduceOp.BAND if bad else aiodist.ReduceOp.SUM
    steps = [("all_reduce", (np.ones(4, np.float32),), {"op": op})]
    return steps, "all_reduce: ReduceOp.BAND is not supported for dtype float32"


def bad_op_among_premul(rank: int, size: int, bad: bool) -> tuple[list[Step], str]:
    # The ranks that make no mistake pass a premultiplied sum: every variant of an
    # operation takes the same place in the group's sequence (a turn in shared memory).
    op = aiodist.ReduceOp.BAND if bad else aiodist.make_premul_sum(0.5)
    steps = [("all_reduce", (np.ones(4, np.float32),), {"op": op})]
    return steps, "all_reduce: ReduceOp.BAND is not supported for dtype float32"


def read_only_premul(rank: int, size: int, bad: bool) -> tuple[list[Step], str]:
    x = np.ones(4, np.float32)
    x.flags.writeable = not bad
    steps = [("all_reduce", (x,), {"op": aiodist.make_premul_sum(0.5)})]
    return steps, "all_reduce: tensor is read-only, but the collective writes its result"


def short_premul_reduce_scatter(rank: int, size: int, bad: bool) -> tuple[list[Step], str]:
    ins = [np.ones(3) for _ in range(size - 1 if bad else size)]
    steps = [("reduce_scatter", (np.zeros(3), ins), {"op": aiodist.make_premul_sum(2.0)})]
    return steps, f"reduce_scatter: input_list has {size - 1} entries; it needs {size} arrays"


def bad_root(rank: int, size: int, bad: bool) -> tuple[list[Step], str]:
    # One-sided, the rank naming a root outside the group is rank 0, the real root, so
    # every rank waits for it.
    src = size + 5 if bad else 0
    steps = [("broadcast", (np.ones(4),), {"src": src})]
    return steps, f"broadcast: src {size + 5} is not in the process group"


def mixed_list(rank: int, size: int, bad: bool) -> tuple[list[Step], str]:
    outs = [np.zeros(2) for _ in range(size)]
    if bad:
        outs[-1] = np.zeros(2, np.float32)
    steps = [("all_gather", (outs, np.full(2, float(rank))), {})]
    return steps, (
        rf"all_gather: tensor_list mixes dtypes: tensor_list\[0\] is float64 but "
        rf"tensor_list\[{size - 1}\] is float32"
    )


def short_scatter_list(rank: int, size: int, bad: bool) -> tuple[list[Step], str]:
    # One-sided: only the source (rank 0) errs, its list one entry short. Symmetric: the
    # other ranks pass a list too, which only the source may.
    if rank == 0:
        items: list[Any] | None = [np.ones(3)] * (size - 1 if bad else size)
        pattern = f"scatter: scatter_list has {size - 1} entries; it needs {size} arrays"
    else:
        items = [np.ones(3)] * size if bad else None
        pattern = "scatter: scatter_list must only be given on the root rank"
    return [("scatter", (np.zeros(3), items), {"src": 0})], pattern


def send_to_self(rank: int, size: int, bad: bool) -> tuple[list[Step], str]:
    # Nobody else is involved: no rank waits for a message a rank sends itself.
    if not bad:
        return [], ""
    return [("send", (np.ones(2),), {"dst": rank})], f"send: peer group rank {rank} is this rank"


def bad_tag(rank: int, size: int, bad: bool) -> tuple[list[Step], str]:
    # Rank 0 sends to rank 1, which posted its receive first: a sender that cannot name a
    # tag can only fail the receives already waiting for it. Symmetric: both name bad tags.
    pattern = r"tag must be an int in \[0, 2\*\*63\), got "
    if rank == 0:
        steps = [("barrier", (), {}), ("isend", (np.ones(2),), {"dst": 1, "tag": -1 if bad else 0})]
        return [*steps, WAIT], f"send: {pattern}-1"
    if rank == 1:
        steps = [("irecv", (np.zeros(2),), {"src": 0, "tag": "x" if bad else 0}), ALWAYS_BARRIER]
        return [*steps, WAIT], f"recv: {pattern}'x'"
    return [("barrier", (), {})], ""


def bad_send_array(rank: int, size: int, bad: bool) -> tuple[list[Step], str]:
    # Rank 0 sends something that is not an array; the receive of rank 1 takes its place.
    if rank == 0:
        data = [1.0, 2.0] if bad else np.ones(2)
        return [
            ("isend", (data,), {"dst": 1, "tag": 3}),
            WAIT,
        ], "send: tensor must be a numpy array"
    if rank == 1:
        out = np.zeros(2)
        if bad:
            out.setflags(write=False)
        return [("irecv", (out,), {"src": 0, "tag": 3}), WAIT], "recv: tensor is read-only"
    return [], ""


def different_new_group(rank: int, size: int, bad: bool) -> tuple[list[Step], str]:
    # Symmetric: rank r asks for [r], a list of its own; one-sided: rank 0 asks for [0]
    # while the others ask for every rank.
    ranks = [rank] if bad else list(range(size))
    return [("new_group", (ranks,), {})], "new_group: group .* is ranks .* on another rank"


CASES: dict[str, Case] = {
    "bad_op": bad_op,
    "bad_op_among_premul": bad_op_among_premul,
    "read_only_premul": read_only_premul,
    "short_premul_reduce_scatter": short_premul_reduce_scatter,
    "bad_root": bad_root,
    "mixed_list": mixed_list,
    "short_scatter_list": short_scatter_list,
    "send_to_self": send_to_self,
    "bad_tag": bad_tag,
    "bad_send_array": bad_send_array,
    "different_new_group": different_new_group,
}


def _peer_pattern(case: str) -> str:
    """What a rank that made no mistake raises: the first problem, told by another rank."""
    if case == "different_new_group":
        # The rank that finds the lists differ says so; the others name it.
        return r"new_group.* is ranks .* on another rank"
    if case in ("bad_tag", "bad_send_array"):
        return r"recv from rank 0 \(.*\): rank 0 rejected its send: send: "
    return r"\(seq \d+\) on <ProcessGroup .*> was rejected by rank \d+: "


def _outcome(
    case: str, side: str, rank: int, exc: BaseException | None, took: float, pattern: str
) -> str:
    bad = (side == SYMMETRIC or rank == 0) and bool(pattern)
    # Who waits for rank 0: the receiver of its send, or every rank of a collective.
    waits = rank == 1 if case in ("bad_tag", "bad_send_array") else case != "send_to_self"
    if not bad and not waits:
        assert exc is None, f"{case} ({side}): rank {rank} is not involved but raised {exc!r}"
        return "not involved"
    assert exc is not None, f"{case} ({side}): rank {rank} raised nothing"
    assert isinstance(exc, aiodist.DistUsageError), (case, side, rank, repr(exc))
    want = pattern if bad else _peer_pattern(case)
    assert re.search(want, str(exc)), f"{case} ({side}) rank {rank}: {want!r} not in {exc}"
    # A no-hang guard: a rejection is told at once; a rank that missed it would wait for the
    # group timeout (60 s and more here). How fast is bench/'s business.
    assert took < 10.0, f"{case} ({side}) rank {rank} took {took:.2f} s to raise"
    return "raised"


async def check_async(case: str, side: str, rank: int, size: int) -> str:
    """Make ``case``'s calls on this rank through ``aiodist``; check what it raised."""
    steps, pattern = CASES[case](rank, size, side == SYMMETRIC or rank == 0)
    started = time.monotonic()
    pending: list[Any] = []
    error: BaseException | None = None
    took = 0.0
    for name, args, kwargs in steps:
        if error is not None and not kwargs.get("always"):
            continue
        try:
            if name == "wait":
                for work in pending:
                    await work
                continue
            kwargs = {k: v for k, v in kwargs.items() if k != "always"}
            result = getattr(aiodist, name)(*args, **kwargs)
            if name in ("isend", "irecv"):
                pending.append(result)
            else:
                await result
        except aiodist.DistUsageError as exc:
            error, took = exc, time.monotonic() - started
    return _outcome(case, side, rank, error, took, pattern)


def check_blocking(case: str, side: str, rank: int, size: int) -> str:
    """Make ``case``'s calls on this rank through ``aiodist.sync``; check what it raised."""
    steps, pattern = CASES[case](rank, size, side == SYMMETRIC or rank == 0)
    started = time.monotonic()
    pending: list[Any] = []
    error: BaseException | None = None
    took = 0.0
    for name, args, kwargs in steps:
        if error is not None and not kwargs.get("always"):
            continue
        try:
            if name == "wait":
                for work in pending:
                    work.wait()
                continue
            kwargs = {k: v for k, v in kwargs.items() if k != "always"}
            result = getattr(dist, name)(*args, **kwargs)
            if name in ("isend", "irecv"):
                pending.append(result)
        except aiodist.DistUsageError as exc:
            error, took = exc, time.monotonic() - started
    return _outcome(case, side, rank, error, took, pattern)


async def agree_async(rank: int, size: int) -> None:
    """The next collective equals numpy on every rank: the group is still usable."""
    x = np.full(3, float(rank + 1))
    await aiodist.all_reduce(x)
    np.testing.assert_array_equal(x, np.full(3, size * (size + 1) / 2))


def agree_blocking(rank: int, size: int) -> None:
    """:func:`agree_async` through the blocking API."""
    x = np.full(3, float(rank + 1))
    dist.all_reduce(x)
    np.testing.assert_array_equal(x, np.full(3, size * (size + 1) / 2))
