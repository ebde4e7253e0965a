"""Random programs of collectives, point-to-point calls and subgroups, checked against numpy.

A *program* (:func:`generate`) is 20-40 steps that every rank of a world of 2-4 runs in
order, drawn from a seed: every collective (``all_reduce`` with every ``ReduceOp`` its dtype
takes and ``make_premul_sum``, the coalesced, ``*_into_tensor`` and object variants,
``all_to_all_single`` with uneven splits, ``barrier``), point to point (``send``/``recv``,
``isend``/``irecv``, ``batch_isend_irecv``, receives from any source, object lists), and
``new_group`` with operations on the groups made, over several dtypes and shapes, empty
arrays included. Into some steps one rank brings a usage error (a read-only output, a list
of the wrong length, a root or peer outside the group, a ``ReduceOp`` its dtype cannot take
while the others pass another, split sizes that do not add up). A rank may await a step's
``Work`` at once, a few steps later, through a task that is cancelled first, or under a
caller's deadline that expires first. A program may end with a ``work.wait(timeout)`` that
expires (a receive nobody sends), which aborts the world as gloo does.

The model (:func:`part`): every input is drawn from ``(seed, step, rank)``, so each rank
knows every rank's inputs and computes, with numpy, what each of its calls must give:

* an accepted call: its outputs equal the model (exactly for integers and booleans, within
  a few ulps for floats, whose inputs are small integers so that sums are exact);
* the rank that errs: ``DistUsageError`` from the call itself, with the exact message;
* its peers: ``DistUsageError`` naming the rejection (``... was rejected by rank 2: ...``;
  point to point, the receive that a rejected send would have matched:
  ``recv from rank 2 (tag 7): rank 2 rejected its send: ...``). A peer whose part needs
  nothing from the erring rank (the root of a broadcast) may complete instead, with the
  right value; a rank whose receive was rejected takes the message with its next receive;
* after an expired ``work.wait(timeout)``: every later call of every rank raises
  ``DistError``.

Every later call must give the right value again: a rejection leaves the group usable.

:func:`run_program` runs one program under a :class:`Config`: the async API with the ranks
as tasks of one loop (:func:`aiodist.testing.run_world`), or the blocking API
(``aiodist.sync``) in processes (:func:`aiodist.testing.run_world_processes`), on the
standard loop or uvloop, over shared memory or TCP, with the default staging bound or a
small one that sends most messages the announced way (``$AIODIST_STAGING_BYTES``: see
:class:`Config`). The :class:`Report` lists each rank's
problems; its :meth:`Report.describe` prints the configuration, the problems, the command
that replays it (``bench/fuzz.py``) and the program.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import functools
import math
import os
import random
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import aiodist
import aiodist.sync as dist
from aiodist import DistError, DistTimeoutError, DistUsageError
from aiodist._util._loop import loop_factory
from aiodist.testing import run_world, run_world_processes
from aiodist.transport._flow import STAGING_BYTES_ENV

#: Seconds an operation may take before its group times out (a hang, for the model).
OP_TIMEOUT = 5.0
#: Seconds a whole program may take (the runners' limit).
RUN_LIMIT = 60.0
#: How long a caller's deadline (``deadline`` mode) or a blocking future's wait lasts.
CALLER_DEADLINE = 0.0005
#: What a ``work.wait(timeout)`` that must expire waits.
WAIT_TIMEOUT = 0.3
#: Problems a rank records before it stops.
MAX_PROBLEMS = 8

TRANSPORTS = ("shm", "tcp")
APIS = ("async", "sync")
LOOPS = ("asyncio", "uvloop")

# The kinds of problem.
WRONG_VALUE = "wrong value"
HANG = "hang"
MISSING_ERROR = "missing error"
UNEXPECTED_ERROR = "unexpected error"


# -- configurations and programs ------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    """How one program runs: its seed, world size, transport, API and event loop, and the
    staging bound of every rank (``$AIODIST_STAGING_BYTES``; ``None``: the environment's,
    by default 16 MiB). A message beyond the receiver's bound is announced and its payload
    waits for the receive (``aiodist.transport._flow``): a small bound sends most messages
    that way, and the program draws larger arrays too (:func:`generate`)."""

    seed: int
    ranks: int
    transport: str = "tcp"
    api: str = "async"
    loop: str = "asyncio"
    staging: int | None = None

    def __str__(self) -> str:
        staging = "" if self.staging is None else f", staging {self.staging} bytes"
        return (
            f"seed {self.seed}, {self.ranks} ranks, {self.transport}, {self.api} API, "
            f"{self.loop} loop{staging}"
        )

    @property
    def name(self) -> str:
        """A short name, for test ids: ``17-3r-shm-async-uvloop`` (``-s64``: staging 64)."""
        staging = "" if self.staging is None else f"-s{self.staging}"
        return f"{self.seed}-{self.ranks}r-{self.transport}-{self.api}-{self.loop}{staging}"

    @property
    def replay(self) -> str:
        """The command that runs this program again and prints its report."""
        staging = "" if self.staging is None else f" --staging {self.staging}"
        return (
            f".venv/bin/python bench/fuzz.py --seed {self.seed} --ranks {self.ranks} "
            f"--transport {self.transport} --api {self.api} --loop {self.loop}{staging} "
            "--programs 1"
        )

    def program(self) -> Program:
        """The program this configuration runs."""
        return generate(self.seed, self.ranks, large=self.staging is not None)

    def environment(self) -> dict[str, str]:
        """The environment variables that set its staging bound (none for the default)."""
        return {} if self.staging is None else {STAGING_BYTES_ENV: str(self.staging)}


@dataclass(frozen=True)
class Fault:
    """A usage error of one rank in one step.

    Attributes:
        rank: the global rank that errs.
        kind: ``readonly``, ``length``, ``root``, ``reduce_op``, ``splits`` (collectives);
            ``bad_send``, ``readonly_recv``, ``bad_peer`` (point to point).
        at: which entry, message or variant it hits.
    """

    rank: int
    kind: str
    at: int = 0

    def __str__(self) -> str:
        return f"{self.kind}@r{self.rank}.{self.at}"


@dataclass(frozen=True)
class Message:
    """One point-to-point message of a step (global ranks)."""

    src: int
    dst: int
    tag: int

    def __str__(self) -> str:
        return f"{self.src}->{self.dst}:{self.tag}"


@dataclass(frozen=True)
class Step:
    """One step of a program: an operation, on a group, with everything drawn for it.

    Attributes:
        index: its place in the program.
        op: the public function (or ``p2p``, ``any_source``, ``object_p2p``,
            ``wait_timeout``: point-to-point patterns).
        group: the index of the ``new_group`` step that made its group; -1: the default.
        ranks: the global ranks of that group (of the new group, for ``new_group``).
        dtype, shape: its arrays.
        root: the root (or receiver) as a group rank.
        by_group_rank: whether roots and peers are named as group ranks (``group_src=``).
        reduce, factor: the reduction every rank that does not err passes.
        sizes: op-specific sizes: block sizes ``S[src][dst]`` of an all_to_all, the shapes
            of a coalesced call, object counts.
        flag: the output of ``all_gather_into_tensor`` or input of ``reduce_scatter_tensor``
            is stacked (``(size, *shape)``); ``all_to_all_single`` splits evenly and passes
            no split sizes.
        messages: the point-to-point messages.
        fault: the usage error of one rank, if any.
        modes: per global rank, how it awaits its works: ``now``, ``later``, ``cancel``
            (a task awaiting it is cancelled first), ``deadline`` (a caller's deadline
            expires first), ``blocking`` (the blocking API's blocking form).
        due: per global rank, the step at which a ``later`` work is awaited.
        variant: a number the model draws per-rank choices from.
    """

    index: int
    op: str
    group: int = -1
    ranks: tuple[int, ...] = ()
    dtype: str = "float32"
    shape: tuple[int, ...] = (1,)
    root: int = 0
    by_group_rank: bool = False
    reduce: str = "SUM"
    factor: float = 1.0
    sizes: tuple[tuple[int, ...], ...] = ()
    flag: bool = False
    messages: tuple[Message, ...] = ()
    fault: Fault | None = None
    modes: tuple[str, ...] = ()
    due: tuple[int, ...] = ()
    variant: int = 0

    def __str__(self) -> str:
        where = "world" if self.group < 0 else f"g{self.group}"
        text = f"#{self.index} {self.op} {where}{list(self.ranks)}"
        if self.op in _ARRAY_OPS:
            text += f" {self.dtype}{self.shape}"
        if self.op in _REDUCING:
            text += f" {self.reduce}" + (f"({self.factor:g})" if self.reduce == PREMUL else "")
        if self.op in _ROOTED:
            text += f" root={self.root}" + (" (group rank)" if self.by_group_rank else "")
        if self.sizes:
            text += f" sizes={[list(s) for s in self.sizes]}"
        if self.flag and self.op in _FLAGS:
            text += f" {_FLAGS[self.op]}"
        if self.messages:
            text += " msgs=" + ",".join(map(str, self.messages))
        if self.fault is not None:
            text += f" FAULT={self.fault}"
        modes = [f"{r}:{m}" + (f">{d}" if m == "later" else "") for r, (m, d) in
                 enumerate(zip(self.modes, self.due, strict=True)) if m != "now"]  # fmt: skip
        if modes:
            text += " modes=" + ",".join(modes)
        return text


@dataclass(frozen=True)
class Program:
    """A seed's program for a world of ``ranks``."""

    seed: int
    ranks: int
    steps: tuple[Step, ...]

    def listing(self) -> str:
        """The program, one step a line."""
        return "\n".join(f"  {s}" for s in self.steps)


PREMUL = "PREMUL_SUM"
DTYPES = (
    "bool", "int8", "uint8", "int32", "int64", "float16", "float32", "float64", "complex64",
)  # fmt: skip
SHAPES = (
    (1,), (3,), (4,), (2, 3), (0,), (0, 2), (5,), (8,), (2, 2, 2), (17,), (3, 0), (257,),
    (1000,),
)  # fmt: skip
#: What a program for a small staging bound draws as well, for one step in two: arrays
#: of hundreds to thousands of elements, whose messages go beyond the bound.
LARGE_SHAPES = ((100,), (700,), (1500,), (4099,), (3, 700))
#: The trailing dimensions of an all_to_all's blocks, and (large programs) a longer one.
BLOCK_TRAILS: tuple[tuple[int, ...], ...] = ((), (2,), (3, 2))
LARGE_BLOCK_TRAIL = (300,)
FACTORS = (0.5, 2.0, -1.0, 0.25, 3.0)

#: The reductions each dtype kind takes, and those it refuses (a usage error).
VALID_OPS = {
    "b": ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"),
    "i": ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"),
    "u": ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"),
    "f": ("SUM", "AVG", "PRODUCT", "MIN", "MAX", PREMUL),
    "c": ("SUM", "AVG", "PRODUCT", PREMUL),
}
INVALID_OPS = {
    "b": ("AVG", PREMUL),
    "i": (PREMUL,),
    "u": (PREMUL,),
    "f": ("BAND", "BOR", "BXOR"),
    "c": ("MIN", "MAX", "BAND", "BOR", "BXOR"),
}

#: How often each operation is drawn, and the usage errors a rank may make in it.
WEIGHTS = {
    "all_reduce": 10,
    "all_reduce_coalesced": 3,
    "broadcast": 5,
    "reduce": 5,
    "all_gather": 4,
    "all_gather_into_tensor": 3,
    "all_gather_coalesced": 2,
    "gather": 3,
    "scatter": 3,
    "reduce_scatter": 3,
    "reduce_scatter_tensor": 3,
    "all_to_all": 3,
    "all_to_all_single": 5,
    "barrier": 2,
    "broadcast_object_list": 2,
    "all_gather_object": 2,
    "gather_object": 1.5,
    "scatter_object_list": 1.5,
    "p2p": 6,
    "any_source": 3,
    "batch_isend_irecv": 4,
    "object_p2p": 1.5,
    "new_group": 2.5,
}
FAULTS = {
    "all_reduce": ("readonly", "reduce_op"),
    "all_reduce_coalesced": ("readonly", "reduce_op"),
    "broadcast": ("readonly", "root"),
    "reduce": ("readonly", "reduce_op", "root"),
    "all_gather": ("readonly", "length"),
    "all_gather_into_tensor": ("readonly",),
    "all_gather_coalesced": ("readonly", "length"),
    "gather": ("readonly", "length", "root"),
    "scatter": ("readonly", "length", "root"),
    "reduce_scatter": ("readonly", "length", "reduce_op"),
    "reduce_scatter_tensor": ("readonly", "reduce_op"),
    "all_to_all": ("readonly", "length"),
    "all_to_all_single": ("readonly", "splits"),
    "broadcast_object_list": ("root",),
    "all_gather_object": ("length",),
    "gather_object": ("length", "root"),
    "scatter_object_list": ("length", "root"),
    "p2p": ("bad_send", "readonly_recv", "bad_peer"),
    "any_source": ("bad_send", "readonly_recv"),
    "batch_isend_irecv": ("bad_send", "readonly_recv"),
    "object_p2p": ("bad_send",),
}
_REDUCING = frozenset(
    {"all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor"}
)
_ROOTED = frozenset(
    {
        "broadcast", "reduce", "gather", "scatter", "broadcast_object_list", "gather_object",
        "scatter_object_list", "any_source",
    }
)  # fmt: skip
_OBJECTS = frozenset(
    {"broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list"}
)
_ARRAY_OPS = frozenset(WEIGHTS) - _OBJECTS - {"barrier", "object_p2p", "new_group"}
#: What ``Step.flag`` means, by operation.
_FLAGS = {
    "all_gather_into_tensor": "stacked",
    "reduce_scatter_tensor": "stacked",
    "all_to_all_single": "even",
}
#: Point-to-point patterns: they need two ranks in their group.
_P2P = frozenset({"p2p", "any_source", "batch_isend_irecv", "object_p2p"})
#: The modes a rank awaits its works with, and their weights.
MODES = {"now": 50, "later": 20, "cancel": 10, "deadline": 5, "blocking": 15}


def generate(seed: int, ranks: int, large: bool = False) -> Program:
    """The program of ``seed`` for a world of ``ranks`` (2-4): the same on every machine.

    ``large``: for a small staging bound, one array in two is drawn from
    :data:`LARGE_SHAPES` (and an all_to_all's blocks may be long), so that most messages
    go beyond the bound; the program differs from the one without.
    """
    rng = random.Random(seed)
    world = tuple(range(ranks))
    groups: list[tuple[int, tuple[int, ...]]] = [(-1, world)]
    length = rng.randint(20, 40)
    ends_in_timeout = rng.random() < 0.15
    steps: list[Step] = []
    names = list(WEIGHTS)
    weights = [WEIGHTS[n] for n in names]
    for index in range(length - ends_in_timeout):
        op = rng.choices(names, weights)[0]
        if op == "new_group" and len(groups) >= 4:
            op = "all_reduce"
        if op == "new_group":
            members = tuple(sorted(rng.sample(world, rng.randint(1, ranks))))
            steps.append(_finish(rng, Step(index, op, -1, world, sizes=(members,)), ranks))
            groups.append((index, members))
            continue
        previous = steps[-1] if steps else None
        if previous is not None and previous.op in FAULTS and rng.random() < 0.2:
            # The same call again (with other arrays, and maybe another fault): a call that
            # took another's turn then matches it, and gives a wrong value rather than a
            # mismatch.
            step = Step(
                index, previous.op, previous.group, previous.ranks, variant=rng.getrandbits(32)
            )
            fields = ("dtype", "shape", "reduce", "factor", "sizes", "flag")
            step = _replace(_draw(rng, step, large), **{f: getattr(previous, f) for f in fields})
            steps.append(_finish(rng, step, ranks))
            continue
        candidates = [g for g in groups if op not in _P2P or len(g[1]) >= 2]
        gid, members = (
            candidates[0]
            if len(candidates) == 1 or rng.random() < 0.6
            else rng.choice(candidates[1:])
        )
        step = Step(index, op, gid, members, variant=rng.getrandbits(32))
        steps.append(_finish(rng, _draw(rng, step, large), ranks))
    if ends_in_timeout:
        waiter, sender = rng.sample(world, 2)
        tag = 100 * (length + 1)
        step = Step(length - 1, "wait_timeout", -1, world, messages=(Message(sender, waiter, tag),))
        steps.append(_finish(rng, step, ranks))
    return Program(seed, ranks, tuple(steps))


def _finish(rng: random.Random, step: Step, ranks: int) -> Step:
    """Draw how each rank awaits the step's works, and maybe a fault."""
    modes, due = [], []
    for _ in range(ranks):
        mode = rng.choices(list(MODES), list(MODES.values()))[0]
        if step.op in ("new_group", "wait_timeout"):
            mode = "now"
        modes.append(mode)
        due.append(step.index + rng.randint(1, 4) if mode == "later" else step.index)
    fault = None
    kinds = FAULTS.get(step.op, ())
    if kinds and rng.random() < 0.25:
        fault = _draw_fault(rng, step, rng.choice(kinds))
    return _replace(step, modes=tuple(modes), due=tuple(due), fault=fault)


def _replace(step: Step, **changes: Any) -> Step:
    fields = {name: getattr(step, name) for name in step.__dataclass_fields__}
    fields.update(changes)
    return Step(**fields)


def _draw(rng: random.Random, step: Step, large: bool) -> Step:
    """Draw the dtype, shape, root, reduction and sizes of ``step`` (``large``: see
    :func:`generate`)."""
    m = len(step.ranks)
    op = step.op
    dtype = rng.choice(DTYPES)
    shape = rng.choice(SHAPES) if rng.random() < 0.9 else (rng.randint(1, 64),)
    if large and rng.random() < 0.5:
        shape = rng.choice(LARGE_SHAPES)
    changes: dict[str, Any] = {
        "dtype": dtype,
        "shape": shape,
        "root": rng.randrange(m),
        "by_group_rank": rng.random() < 0.3,
        "flag": rng.random() < 0.5,
    }
    kind = np.dtype(dtype).kind
    if op in _REDUCING:
        ops = VALID_OPS[kind]
        # The premultiplied sum often: its turn on shared memory is the one most often lost.
        reduce = PREMUL if PREMUL in ops and rng.random() < 0.3 else rng.choice(ops)
        changes["reduce"] = reduce
        changes["factor"] = rng.choice(FACTORS) if reduce == PREMUL else 1.0
    if op in ("all_reduce_coalesced", "all_gather_coalesced"):
        changes["sizes"] = tuple(rng.choice(SHAPES[:11]) for _ in range(rng.randint(1, 3)))
    elif op in ("all_to_all", "all_to_all_single"):
        even = op == "all_to_all_single" and changes["flag"]
        same = rng.randint(0, 3)
        changes["sizes"] = tuple(
            tuple(same if even else rng.randint(0, 3) for _ in range(m)) for _ in range(m)
        )
        trails = (*BLOCK_TRAILS, LARGE_BLOCK_TRAIL) if large else BLOCK_TRAILS
        changes["shape"] = (0, *rng.choice(trails))  # only the trailing dims count
    elif op in ("broadcast_object_list", "object_p2p"):
        changes["sizes"] = ((rng.randint(1, 3),),)
    if op in _P2P:
        changes["messages"] = _messages(rng, step)
        if op == "any_source":
            changes["root"] = step.ranks.index(changes["messages"][0].dst)
    return _replace(step, **changes)


def _messages(rng: random.Random, step: Step) -> tuple[Message, ...]:
    """The messages of a point-to-point step, tags unique to the step."""
    members = step.ranks
    base = 100 * (step.index + 1)
    if step.op == "p2p":
        out: list[Message] = []
        for k in range(rng.randint(1, 4)):
            if out and rng.random() < 0.25:  # the same sender, receiver and tag again
                out.append(out[-1])
                continue
            src, dst = rng.sample(members, 2)
            out.append(Message(src, dst, base + k))
        return tuple(out)
    if step.op == "any_source":
        dst = rng.choice(members)
        others = [r for r in members if r != dst]
        senders = rng.sample(others, rng.randint(1, len(others)))
        return tuple(Message(s, dst, base) for s in senders)
    if step.op == "batch_isend_irecv":
        m = len(members)
        ring = [Message(members[i], members[(i + 1) % m], base) for i in range(m)]
        if rng.random() < 0.5:  # a second ring the other way
            ring += [Message(members[(i + 1) % m], members[i], base + 1) for i in range(m)]
        return tuple(ring)
    src, dst = rng.sample(members, 2)  # object_p2p: send_object_list travels with tag 0
    return (Message(src, dst, 0),)


def _draw_fault(rng: random.Random, step: Step, kind: str) -> Fault | None:
    """A usage error of one rank of ``step``, where ``kind`` fits it."""
    members, m, op = step.ranks, len(step.ranks), step.op
    root = members[step.root]
    anyone = rng.choice(members)
    non_roots = [r for r in members if r != root]
    if kind == "readonly":
        if op == "broadcast":  # the root's array is only read
            return Fault(rng.choice(non_roots), kind) if non_roots else None
        if op in ("reduce", "gather"):  # only the root's outputs are written
            return Fault(root, kind, rng.randrange(m))
        return Fault(anyone, kind, rng.randrange(m * max(1, len(step.sizes))))
    if kind == "length":
        if op in ("gather", "scatter", "gather_object", "scatter_object_list"):
            return Fault(root, kind, rng.randrange(2))
        return Fault(anyone, kind, rng.randrange(4))
    if kind in ("root", "reduce_op", "splits"):
        return Fault(anyone, kind, rng.randrange(6))
    if kind in ("bad_send", "readonly_recv"):
        message = rng.choice(step.messages)
        rank = message.src if kind == "bad_send" else message.dst
        return Fault(rank, kind, step.messages.index(message))
    assert kind == "bad_peer"
    return Fault(anyone, kind, rng.randrange(4))


# -- inputs --------------------------------------------------------------------------------
def values(seed: int, index: int, who: int, salt: int, dtype: str, shape: tuple[int, ...]) -> Any:
    """The array of rank ``who`` (global) in step ``index``: small integers of ``dtype``, so
    that every sum, product and premultiplied sum of up to four of them is exact."""
    rng = np.random.default_rng([seed, index, who, salt])
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dt.kind == "u":
        return rng.integers(0, 4, shape).astype(dt)
    if dt.kind == "i":
        return rng.integers(-3, 4, shape).astype(dt)
    if dt.kind == "f":
        return rng.integers(-4, 5, shape).astype(dt)
    return (rng.integers(-3, 4, shape) + 1j * rng.integers(-3, 4, shape)).astype(dt)


def make_object(seed: int, index: int, who: int, salt: int) -> Any:
    """A picklable object of rank ``who`` in step ``index``."""
    rng = random.Random(f"{seed}/{index}/{who}/{salt}")
    kind = rng.randrange(7)
    if kind == 0:
        return rng.randint(-(10**12), 10**12)
    if kind == 1:
        return f"rank {who} step {index} " + "x" * rng.randint(0, 40)
    if kind == 2:
        return (who, index, [rng.random() for _ in range(rng.randint(0, 3))])
    if kind == 3:
        return {"rank": who, "nested": {"v": rng.randbytes(rng.randint(0, 64))}}
    if kind == 4:
        return None
    if kind == 5:
        return np.arange(rng.randint(0, 6), dtype=np.int32) * who
    return list(range(rng.randint(0, 300)))


def same_object(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are equal, numpy arrays inside included (type, dtype, shape)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            type(a) is type(b)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(np.array_equal(a, b))
        )
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_object(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same_object(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


_UFUNCS = {
    "SUM": np.add,
    "AVG": np.add,
    "PRODUCT": np.multiply,
    "MIN": np.minimum,
    "MAX": np.maximum,
    "BAND": np.bitwise_and,
    "BOR": np.bitwise_or,
    "BXOR": np.bitwise_xor,
    PREMUL: np.add,
}


def reduce_model(reduce: str, factor: float, arrays: list[Any]) -> Any:
    """numpy's reduction of ``arrays`` (one per rank) by ``reduce``, in their dtype.

    ``AVG`` divides the sum by the number of ranks (floor division for integers);
    ``PREMUL_SUM`` multiplies each array by ``factor`` first. On booleans numpy's ufuncs
    are the logical ones (SUM and MAX: or; PRODUCT and MIN: and).
    """
    dtype = arrays[0].dtype
    if reduce == PREMUL:
        arrays = [a * dtype.type(factor) for a in arrays]
    acc = arrays[0].copy()
    for a in arrays[1:]:
        _UFUNCS[reduce](acc, a, out=acc)
    if reduce == "AVG" and len(arrays) > 1:
        if dtype.kind in "iu":
            np.floor_divide(acc, dtype.type(len(arrays)), out=acc)
        else:
            np.divide(acc, dtype.type(len(arrays)), out=acc)
    return acc


def op_arg(reduce: str, factor: float) -> Any:
    """The ``op=`` argument for ``reduce``."""
    if reduce == PREMUL:
        return aiodist.make_premul_sum(factor)
    return getattr(aiodist.ReduceOp, reduce)


# -- what a call must give -------------------------------------------------------------------
@dataclass
class Outcome:
    """What a call gave: its result or its error.

    Attributes:
        result: the result (of the work, or of a blocking call).
        error: the exception, if it failed.
        at_call: whether the call itself raised (``None``: a blocking call, where the call
            and its work are one).
    """

    result: Any = None
    error: BaseException | None = None
    at_call: bool | None = False


@dataclass(frozen=True)
class Problem:
    """A difference between a run and the model."""

    step: int
    rank: int
    kind: str
    text: str

    def __str__(self) -> str:
        return f"rank {self.rank}, step #{self.step}: {self.kind}: {self.text}"


#: A check of a call's outputs (given its result): ``(kind, text)`` of a difference, or None.
Check = Callable[[Any], "tuple[str, str] | None"]


def NOTHING(_result: Any) -> tuple[str, str] | None:
    """The check of a call with no output to compare."""
    return None


def _described(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _error_kind(exc: BaseException) -> str:
    """The kind of problem an unexpected ``exc`` is: a timeout is a hang."""
    return HANG if isinstance(exc, TimeoutError) else UNEXPECTED_ERROR


def runner_failure(exc: BaseException) -> tuple[str, str]:
    """A runner's own failure (a rank that crashed, a run that timed out): text and kind."""
    return _described(exc), _error_kind(exc)


class Expect:
    """What one call must give; :meth:`problem` says how an outcome differs."""

    def problem(self, outcome: Outcome) -> tuple[str, str] | None:
        raise NotImplementedError


@dataclass
class Completes(Expect):
    """The call succeeds and ``check(result)`` finds its outputs equal to the model."""

    check: Check

    def problem(self, outcome: Outcome) -> tuple[str, str] | None:
        if outcome.error is not None:
            exc = outcome.error
            return _error_kind(exc), f"expected success, got {_described(exc)}"
        return self.check(outcome.result)


@dataclass
class Rejects(Expect):
    """The call itself raises ``DistUsageError`` with exactly ``message``; then ``check``."""

    message: str
    check: Check = NOTHING

    def problem(self, outcome: Outcome) -> tuple[str, str] | None:
        exc = outcome.error
        if exc is None:
            return MISSING_ERROR, f"expected the call to raise DistUsageError({self.message!r})"
        if not isinstance(exc, DistUsageError) or str(exc) != self.message:
            return _error_kind(exc), (
                f"expected DistUsageError({self.message!r}), got {_described(exc)}"
            )
        if outcome.at_call is False:
            return UNEXPECTED_ERROR, "the call returned a Work (that failed) instead of raising"
        return self.check(None)


@dataclass
class PeerRejected(Expect):
    """The call or its work fails with ``DistUsageError`` matching ``pattern`` (a peer's
    rejection).

    Unless ``must``, it may succeed instead (the rank needed nothing from the one that
    erred), and then ``check`` finds its outputs right.
    """

    pattern: str
    must: bool
    check: Check

    def problem(self, outcome: Outcome) -> tuple[str, str] | None:
        exc = outcome.error
        if exc is None:
            if self.must:
                return MISSING_ERROR, f"expected {_shown(self.pattern)}, got success"
            return self.check(outcome.result)
        if not isinstance(exc, DistUsageError) or not re.fullmatch(self.pattern, str(exc)):
            return _error_kind(exc), f"expected {_shown(self.pattern)}, got {_described(exc)}"
        return None


@dataclass
class Aborted(Expect):
    """The call (or its work) raises ``DistError``: the world was aborted."""

    def problem(self, outcome: Outcome) -> tuple[str, str] | None:
        if outcome.error is None:
            return MISSING_ERROR, "expected DistError (the world was aborted), got success"
        if not isinstance(outcome.error, DistError):
            return UNEXPECTED_ERROR, f"expected DistError, got {_described(outcome.error)}"
        return None


@dataclass
class TimesOut(Expect):
    """The ``work.wait(timeout)`` expires with ``DistTimeoutError``."""

    def problem(self, outcome: Outcome) -> tuple[str, str] | None:
        if not isinstance(outcome.error, DistTimeoutError):
            got = "success" if outcome.error is None else _described(outcome.error)
            return UNEXPECTED_ERROR, f"expected DistTimeoutError from work.wait(timeout), got {got}"
        return None


@dataclass
class Either(Expect):
    """A receive from any source: a message, or a sender's rejection; ``joint`` checks all."""

    pattern: str

    def problem(self, outcome: Outcome) -> tuple[str, str] | None:
        exc = outcome.error
        if exc is None:
            return None
        if not isinstance(exc, DistUsageError) or not re.fullmatch(self.pattern, str(exc)):
            shown = _shown(self.pattern)
            return _error_kind(exc), f"expected a message or {shown}, got {_described(exc)}"
        return None


def _shown(pattern: str) -> str:
    """A pattern of a peer's rejection as a reader wants it: ``DistUsageError: ... (seq N)``."""
    if pattern == _NEVER:
        return "no error"
    return "DistUsageError: " + re.sub(r"\\(.)", r"\1", pattern.replace(r"\d+", "N"))


def differs(name: str, got: Any, want: Any) -> tuple[str, str] | None:
    """How array ``got`` differs from the model's ``want``, or ``None``."""
    if not isinstance(got, np.ndarray) or got.dtype != want.dtype or got.shape != want.shape:
        what = f"{got.dtype}{got.shape}" if isinstance(got, np.ndarray) else type(got).__name__
        return WRONG_VALUE, f"{name}: expected {want.dtype}{want.shape}, got {what}"
    if want.dtype.kind in "fc":
        eps = float(np.finfo(want.dtype).eps)
        same = bool(np.allclose(got, want, rtol=4 * eps, atol=0.0))
    else:
        same = bool(np.array_equal(got, want))
    if same:
        return None
    bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
    at = int(bad[0]) if bad.size else 0
    return WRONG_VALUE, (
        f"{name}: expected {_short(want)}, got {_short(got)} "
        f"({bad.size} of {want.size} elements differ, first at flat index {at})"
    )


def _short(a: Any) -> str:
    flat = a.reshape(-1)
    text = np.array2string(flat[:8], separator=", ")
    return text[:-1] + ", ...]" if flat.size > 8 else text


def all_of(*checks: Check) -> Check:
    """A check that runs ``checks`` in turn and reports the first difference."""

    def check(result: Any) -> tuple[str, str] | None:
        for c in checks:
            found = c(result)
            if found is not None:
                return found
        return None

    return check


def equals(name: str, got: Any, want: Any) -> Check:
    """A check that array ``got`` (filled in place) equals ``want`` once the call is done."""
    return lambda _result: differs(name, got, want)


def lists_equal(name: str, got: list[Any], want: list[Any]) -> Check:
    """A check that each array of ``got`` equals the one of ``want``."""
    return all_of(
        *(equals(f"{name}[{i}]", g, w) for i, (g, w) in enumerate(zip(got, want, strict=True)))
    )


def objects_equal(name: str, got: list[Any], want: list[Any]) -> Check:
    """A check that the object list ``got`` (filled in place) equals ``want``."""

    def check(_result: Any) -> tuple[str, str] | None:
        if len(got) != len(want) or not all(
            same_object(g, w) for g, w in zip(got, want, strict=True)
        ):
            return WRONG_VALUE, f"{name}: expected {want!r:.300}, got {got!r:.300}"
        return None

    return check


def sender_is(name: str, got: Any, want: Any, src: int) -> Check:
    """A check for a receive: its result is the sender ``src`` and ``got`` equals ``want``."""

    def check(result: Any) -> tuple[str, str] | None:
        if result != src:
            return WRONG_VALUE, f"{name}: expected the sender {src}, got {result!r}"
        return differs(name, got, want)

    return check


def returns(want: Any) -> Check:
    """A check that the call's result is ``want`` (a receive's sender)."""

    def check(result: Any) -> tuple[str, str] | None:
        if result != want:
            return WRONG_VALUE, f"expected the sender {want!r}, got {result!r}"
        return None

    return check


#: One entry of a ``batch_isend_irecv``: ``(is_send, array, peer and tag, expectation)``.
Entry = tuple[bool, Any, dict[str, Any], "Expect"]
#: A check of a part's outcomes together (receives from any source).
Joint = Callable[[list["Outcome"]], "tuple[str, str] | None"]


@dataclass
class Call:
    """One call a rank makes in a step.

    Attributes:
        fn: the public function's name (``aiodist.<fn>`` or ``aiodist.sync.<fn>``).
        args, kwargs: its arguments (``group=`` is added by the runner).
        expect: what it must give.
        entries: for ``batch_isend_irecv``: ``(is_send, tensor, peer kwargs, expect)``.
        blocking: whether the blocking API makes it as a blocking call (``async_op=False``,
            or ``send``/``recv``) rather than one returning a ``Work``.
    """

    fn: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    expect: Expect = field(default_factory=lambda: Completes(NOTHING))
    entries: list[Entry] = field(default_factory=list)
    blocking: bool = False


@dataclass
class Part:
    """What one rank does in one step, and how its outcomes are checked."""

    step: Step
    calls: list[Call]
    mode: str = "now"
    due: int = 0
    joint: Joint | None = None

    def expects(self) -> list[Expect]:
        """One expectation per outcome: per call, or per entry of a batch."""
        out: list[Expect] = []
        for call in self.calls:
            out.extend(e[3] for e in call.entries) if call.entries else out.append(call.expect)
        return out


# -- the model: what each rank does and gets in each step ------------------------------------
class _Rank:
    """The model's view of one step from one rank: its inputs, and how its call may err.

    The methods that make a usage error (:meth:`readonly`, :meth:`wrong_length`,
    :meth:`bad_root`, :meth:`op`) break the arguments on the erring rank only, and
    return on every rank the message the erring rank raises (after ``"<fn>: "``).
    """

    def __init__(self, program: Program, step: Step, rank: int) -> None:
        self.program, self.step, self.rank = program, step, rank
        self.members = step.ranks
        self.m = len(step.ranks)
        self.me = step.ranks.index(rank)
        self.root = step.root
        self.is_root = self.me == step.root
        self.fault = step.fault
        self.kind = "" if step.fault is None else step.fault.kind
        self.at = 0 if step.fault is None else step.fault.at
        self.faulty = step.fault is not None and step.fault.rank == rank
        self.mode = step.modes[rank]

    def data(self, who: int, salt: int = 0, shape: tuple[int, ...] | None = None) -> Any:
        """The array of group rank ``who`` (``salt``: which of its arrays)."""
        shape = self.step.shape if shape is None else shape
        who = self.members[who]
        return values(self.program.seed, self.step.index, who, salt, self.step.dtype, shape)

    def obj(self, who: int, salt: int = 0) -> Any:
        """The object of group rank ``who``."""
        return make_object(self.program.seed, self.step.index, self.members[who], salt)

    def root_kwargs(self, name: str) -> dict[str, Any]:
        """``src=``/``dst=`` naming the root, or ``group_src=``/``group_dst=``."""
        return _peer(self, name, self.members[self.root])

    def readonly(self, array: Any, name: str) -> str:
        """Make ``array`` (the argument ``name``) read-only on the erring rank."""
        if self.faulty:
            array.flags.writeable = False
        return f"{name} is read-only, but the collective writes its result into it"

    def wrong_length(
        self, name: str, items: Any, make: Callable[[int], Any], arrays: bool = True
    ) -> tuple[str, Any]:
        """A list of one entry too many or too few (``make(k)`` makes it) on the erring rank."""
        k = self.m - 1 if self.at % 2 and self.m > 1 else self.m + 1
        what = " arrays" if arrays else ""
        reason = f"{name} has {k} entries; it needs {self.m}{what}, one per rank"
        return reason, make(k) if self.faulty else items

    def bad_root(self, name: str, kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """``src``/``dst`` (``name``) outside the group on the erring rank, for ``kwargs``."""
        if self.step.by_group_rank:
            bad = self.m + self.at % 3
            reason = f"group_{name} {bad} is out of range for a group of size {self.m}"
            wrong = {f"group_{name}": bad}
        else:
            outside = [r for r in range(self.program.ranks) if r not in self.members]
            bad = outside[0] if outside and self.at % 2 else self.program.ranks + 3
            reason = f"{name} {bad} is not in the process group (global ranks {list(self.members)})"
            wrong = {name: bad}
        if not self.faulty:
            return reason, kwargs
        return reason, {
            **{k: v for k, v in kwargs.items() if k not in (name, f"group_{name}")},
            **wrong,
        }

    def op(self) -> tuple[str, Any]:
        """The ``op=`` argument: the step's; on the erring rank of a ``reduce_op`` fault, a
        reduction the dtype cannot take."""
        good = op_arg(self.step.reduce, self.step.factor)
        if self.kind != "reduce_op":
            return "", good
        refused = INVALID_OPS[np.dtype(self.step.dtype).kind]
        bad = refused[self.at % len(refused)]
        dtype = np.dtype(self.step.dtype)
        if dtype.kind == "c" and self.step.op in ("all_reduce", "all_reduce_coalesced"):
            # torch's words, which scripts match.
            reason = (
                f"all_reduce does not support ReduceOp.{bad} on complex tensors (dtype "
                f"{dtype}): complex arrays take SUM, AVG, PRODUCT and PREMUL_SUM"
            )
        else:
            reason = f"ReduceOp.{bad} is not supported for dtype {dtype}"
        return reason, op_arg(bad, 0.5) if self.faulty else good

    def needs_erring(self, fn: str) -> bool:
        """Whether this rank's result of ``fn`` needs data from the erring rank (another
        rank). If not (a root that only sends, an empty array), it may complete."""
        assert self.fault is not None
        erring = self.members.index(self.fault.rank)
        if fn in ("broadcast", "broadcast_object_list", "scatter", "scatter_object_list"):
            needs = erring == self.root
        elif fn in ("reduce", "gather", "gather_object"):
            needs = self.is_root
        else:
            needs = True
        if fn in _OBJECTS:  # (a pickle is never empty)
            return needs
        shape = self.step.shape
        if fn in ("all_to_all", "all_to_all_single"):
            shape = (self.step.sizes[erring][self.me], *shape[1:])
        shapes = self.step.sizes if fn.endswith("_coalesced") else (shape,)
        return needs and any(math.prod(s) for s in shapes)

    def collective(
        self, fn: str, args: tuple[Any, ...], kwargs: dict[str, Any], check: Check, reason: str = ""
    ) -> Part:
        """The part of a collective call; ``reason``: what the erring rank raises, if any."""
        if self.faulty:
            expect: Expect = _rejects(f"{fn}: {reason}", args)
        elif self.fault is not None:
            pattern = (
                rf"{fn} \(seq \d+\) on <ProcessGroup rank={self.me}/{self.m} backend=cpu> "
                rf"was rejected by rank {self.fault.rank}: " + re.escape(f"{fn}: {reason}")
            )
            expect = PeerRejected(pattern, self.needs_erring(fn), check)
        else:
            expect = Completes(check)
        blocking = self.mode == "blocking" or fn in _OBJECTS
        return self.part([Call(fn, args, kwargs, expect, blocking=blocking)])

    def part(self, calls: list[Call], joint: Joint | None = None) -> Part:
        return Part(self.step, calls, self.mode, self.step.due[self.rank], joint)


def blank(want: Any) -> Any:
    """An output array that differs from ``want`` in every element (so that an element the
    call does not write shows)."""
    if want.dtype == bool:
        return ~want
    return (want + want.dtype.type(99)).astype(want.dtype)


def _rejects(message: str, args: Any) -> Rejects:
    """The call raises ``message`` and has no effect: its arguments stay as they were."""
    before = copy.deepcopy(args)

    def unchanged(_result: Any) -> tuple[str, str] | None:
        if not same_object(args, before):
            return WRONG_VALUE, "the rejected call changed its arguments"
        return None

    return Rejects(message, unchanged)


def _reduced(c: _Rank, salt: int = 0, shape: tuple[int, ...] | None = None) -> Any:
    """The model's reduction of the ranks' arrays ``salt`` (of a reduce-scatter: the blocks
    for group rank ``salt``)."""
    arrays = [c.data(j, salt, shape) for j in range(c.m)]
    return reduce_model(c.step.reduce, c.step.factor, arrays)


def _all_reduce(c: _Rank) -> Part:
    want = _reduced(c)
    x = c.data(c.me)
    reason, op = c.op()
    if c.kind == "readonly":
        reason = c.readonly(x, "tensor")
    return c.collective("all_reduce", (x,), {"op": op}, equals("tensor", x, want), reason)


def _all_reduce_coalesced(c: _Rank) -> Part:
    shapes = c.step.sizes
    wants = [_reduced(c, i, s) for i, s in enumerate(shapes)]
    xs = [c.data(c.me, i, s) for i, s in enumerate(shapes)]
    reason, op = c.op()
    if c.kind == "readonly":
        k = c.at % len(shapes)
        reason = c.readonly(xs[k], f"tensors[{k}]")
    check = lists_equal("tensors", xs, wants)
    return c.collective("all_reduce_coalesced", (xs,), {"op": op}, check, reason)


def _broadcast(c: _Rank) -> Part:
    want = c.data(c.root)
    x = want.copy() if c.is_root else blank(want)
    reason, kwargs = "", c.root_kwargs("src")
    if c.kind == "readonly":
        reason = c.readonly(x, "tensor")
    elif c.kind == "root":
        reason, kwargs = c.bad_root("src", kwargs)
    return c.collective("broadcast", (x,), kwargs, equals("tensor", x, want), reason)


def _reduce(c: _Rank) -> Part:
    mine = c.data(c.me)
    want = _reduced(c) if c.is_root else mine  # the other ranks' arrays are only read
    x = mine.copy()
    reason, op = c.op()
    kwargs = c.root_kwargs("dst")
    if c.kind == "readonly":
        reason = c.readonly(x, "tensor")
    elif c.kind == "root":
        reason, kwargs = c.bad_root("dst", kwargs)
    return c.collective("reduce", (x,), {**kwargs, "op": op}, equals("tensor", x, want), reason)


def _all_gather(c: _Rank) -> Part:
    wants = [c.data(j) for j in range(c.m)]
    outs = [blank(w) for w in wants]
    check = lists_equal("tensor_list", outs, wants)
    reason = ""
    if c.kind == "readonly":
        k = c.at % c.m
        reason = c.readonly(outs[k], f"tensor_list[{k}]")
    elif c.kind == "length":
        reason, outs = c.wrong_length(
            "tensor_list", outs, lambda k: [blank(wants[0]) for _ in range(k)]
        )
    return c.collective("all_gather", (outs, c.data(c.me)), {}, check, reason)


def _all_gather_into_tensor(c: _Rank) -> Part:
    parts = [c.data(j) for j in range(c.m)]
    shape = c.step.shape
    if c.step.flag:  # stacked: (size, *shape)
        want = np.stack(parts)
    else:
        want = np.concatenate(parts).reshape(c.m * shape[0], *shape[1:])
    out = blank(want)
    reason = c.readonly(out, "output_tensor") if c.kind == "readonly" else ""
    check = equals("output_tensor", out, want)
    return c.collective("all_gather_into_tensor", (out, c.data(c.me)), {}, check, reason)


def _all_gather_coalesced(c: _Rank) -> Part:
    shapes = c.step.sizes
    xs = [c.data(c.me, i, s) for i, s in enumerate(shapes)]
    wants = [[c.data(r, i, s) for i, s in enumerate(shapes)] for r in range(c.m)]
    rows = [[blank(w) for w in row] for row in wants]
    checks = [lists_equal(f"output_tensor_lists[{r}]", rows[r], wants[r]) for r in range(c.m)]
    reason = ""
    if c.kind == "readonly":
        r, i = c.at % c.m, c.at % len(shapes)
        reason = c.readonly(rows[r][i], f"output_tensor_lists[{r}][{i}]")
    elif c.kind == "length":
        _, rows = c.wrong_length(
            "", rows, lambda k: [[blank(w) for w in wants[0]] for _ in range(k)]
        )
        reason = (
            f"output_tensor_lists must be a list of {c.m} lists (one per rank), one array "
            "each per input"
        )
    return c.collective("all_gather_coalesced", (rows, xs), {}, all_of(*checks), reason)


def _gather(c: _Rank) -> Part:
    wants = [c.data(j) for j in range(c.m)]
    outs = [blank(w) for w in wants] if c.is_root else None
    check = lists_equal("gather_list", outs, wants) if outs is not None else NOTHING
    reason, kwargs = "", c.root_kwargs("dst")
    if c.kind == "readonly":  # (the root errs)
        k = c.at % c.m
        reason = c.readonly(outs[k] if outs is not None else wants[k], f"gather_list[{k}]")
    elif c.kind == "length":
        reason, outs = c.wrong_length(
            "gather_list", outs, lambda k: [blank(wants[0]) for _ in range(k)]
        )
    elif c.kind == "root":
        reason, kwargs = c.bad_root("dst", kwargs)
    return c.collective("gather", (c.data(c.me), outs), kwargs, check, reason)


def _scatter(c: _Rank) -> Part:
    ins = [c.data(c.root, k) for k in range(c.m)] if c.is_root else None
    want = c.data(c.root, c.me)
    out = blank(want)
    reason, kwargs = "", c.root_kwargs("src")
    if c.kind == "readonly":
        reason = c.readonly(out, "tensor")
    elif c.kind == "length":  # (the root errs)
        reason, ins = c.wrong_length(
            "scatter_list", ins, lambda k: [c.data(c.root, j) for j in range(k)]
        )
    elif c.kind == "root":
        reason, kwargs = c.bad_root("src", kwargs)
    return c.collective("scatter", (out, ins), kwargs, equals("tensor", out, want), reason)


def _reduce_scatter(c: _Rank) -> Part:
    want = _reduced(c, c.me)
    ins = [c.data(c.me, k) for k in range(c.m)]
    out = blank(want)
    reason, op = c.op()
    if c.kind == "readonly":
        reason = c.readonly(out, "output")
    elif c.kind == "length":
        reason, ins = c.wrong_length(
            "input_list", ins, lambda k: [c.data(c.me, j) for j in range(k)]
        )
    check = equals("output", out, want)
    return c.collective("reduce_scatter", (out, ins), {"op": op}, check, reason)


def _reduce_scatter_tensor(c: _Rank) -> Part:
    shape = c.step.shape
    want = _reduced(c, c.me)
    blocks = [c.data(c.me, k) for k in range(c.m)]
    if c.step.flag:  # stacked: (size, *shape)
        x = np.stack(blocks)
    else:
        x = np.concatenate(blocks).reshape(c.m * shape[0], *shape[1:])
    out = blank(want)
    reason, op = c.op()
    if c.kind == "readonly":
        reason = c.readonly(out, "output")
    check = equals("output", out, want)
    return c.collective("reduce_scatter_tensor", (out, x), {"op": op}, check, reason)


def _block(c: _Rank, src: int, dst: int) -> Any:
    """The block group rank ``src`` sends to group rank ``dst`` in an all_to_all."""
    return c.data(src, dst, (c.step.sizes[src][dst], *c.step.shape[1:]))


def _all_to_all(c: _Rank) -> Part:
    ins = [_block(c, c.me, k) for k in range(c.m)]
    wants = [_block(c, j, c.me) for j in range(c.m)]
    outs = [blank(w) for w in wants]
    check = lists_equal("output_tensor_list", outs, wants)
    reason = ""
    if c.kind == "readonly":
        k = c.at % c.m
        reason = c.readonly(outs[k], f"output_tensor_list[{k}]")
    elif c.kind == "length" and c.at < 2:
        reason, outs = c.wrong_length(
            "output_tensor_list", outs, lambda k: [blank(wants[0]) for _ in range(k)]
        )
    elif c.kind == "length":
        reason, ins = c.wrong_length(
            "input_tensor_list", ins, lambda k: [_block(c, c.me, j % c.m) for j in range(k)]
        )
    return c.collective("all_to_all", (outs, ins), {}, check, reason)


def _all_to_all_single(c: _Rank) -> Part:
    sizes, trail = c.step.sizes, c.step.shape[1:]
    in_splits = list(sizes[c.me])
    out_splits = [sizes[j][c.me] for j in range(c.m)]
    x = np.concatenate([_block(c, c.me, k) for k in range(c.m)]).reshape(-1, *trail)
    want = np.concatenate([_block(c, j, c.me) for j in range(c.m)]).reshape(-1, *trail)
    out = blank(want)
    kwargs: dict[str, Any] = {}
    if not c.step.flag:  # (flag: even splits, left to the call)
        kwargs = {"output_split_sizes": out_splits, "input_split_sizes": in_splits}
    reason = ""
    if c.kind == "readonly":
        reason = c.readonly(out, "output")
    elif c.kind == "splits":
        # The erring rank's split sizes, one of them broken.
        erring = c.members.index(c.fault.rank) if c.fault else 0
        name = "input_split_sizes" if c.at % 2 == 0 else "output_split_sizes"
        column = [sizes[j][erring] for j in range(c.m)]
        splits = list(sizes[erring]) if name == "input_split_sizes" else column
        dim0 = sum(splits)
        if c.at // 2 == 0:  # one more than dimension 0
            splits[-1] += 1
        elif c.at // 2 == 1:  # one size short
            splits = splits[:-1]
        else:
            splits[0] = -1
        reason = (
            f"{name} {splits} must be {c.m} non-negative sizes adding up to dimension 0 ({dim0})"
        )
        if c.faulty:
            kwargs = {
                "output_split_sizes": out_splits,
                "input_split_sizes": in_splits,
                name: splits,
            }
    return c.collective("all_to_all_single", (out, x), kwargs, equals("output", out, want), reason)


def _barrier(c: _Rank) -> Part:
    return c.collective("barrier", (), {}, NOTHING)


def _broadcast_object_list(c: _Rank) -> Part:
    count = c.step.sizes[0][0]
    want = [c.obj(c.root, k) for k in range(count)]
    objs = copy.deepcopy(want) if c.is_root else [None] * count
    reason, kwargs = "", c.root_kwargs("src")
    if c.kind == "root":
        reason, kwargs = c.bad_root("src", kwargs)
    check = objects_equal("object_list", objs, want)
    return c.collective("broadcast_object_list", (objs,), kwargs, check, reason)


def _all_gather_object(c: _Rank) -> Part:
    want = [c.obj(j) for j in range(c.m)]
    objs: list[Any] = [None] * c.m
    check = objects_equal("object_list", objs, want)
    reason = ""
    if c.kind == "length":
        reason, objs = c.wrong_length("object_list", objs, lambda k: [None] * k, arrays=False)
    return c.collective("all_gather_object", (objs, c.obj(c.me)), {}, check, reason)


def _gather_object(c: _Rank) -> Part:
    objs: list[Any] | None = [None] * c.m if c.is_root else None
    want = [c.obj(j) for j in range(c.m)]
    check = objects_equal("object_gather_list", objs, want) if objs is not None else NOTHING
    reason, kwargs = "", c.root_kwargs("dst")
    if c.kind == "length":  # (the root errs)
        reason, objs = c.wrong_length(
            "object_gather_list", objs, lambda k: [None] * k, arrays=False
        )
    elif c.kind == "root":
        reason, kwargs = c.bad_root("dst", kwargs)
    return c.collective("gather_object", (c.obj(c.me), objs), kwargs, check, reason)


def _scatter_object_list(c: _Rank) -> Part:
    ins = [c.obj(c.root, k) for k in range(c.m)] if c.is_root else None
    out: list[Any] = [None]
    check = objects_equal("scatter_object_output_list", out, [c.obj(c.root, c.me)])
    reason, kwargs = "", c.root_kwargs("src")
    if c.kind == "length":  # (the root errs)
        make = lambda k: [c.obj(c.root, j) for j in range(k)]  # noqa: E731
        reason, ins = c.wrong_length("scatter_object_input_list", ins, make, arrays=False)
    elif c.kind == "root":
        reason, kwargs = c.bad_root("src", kwargs)
    return c.collective("scatter_object_list", (out, ins), kwargs, check, reason)


# -- point to point ---------------------------------------------------------------------------
#: A pattern that matches no error message.
_NEVER = "(?!)"
#: What a send of a list instead of an array raises.
_BAD_ARRAY = "send: tensor must be a numpy array or a CPU tensor supporting DLPack, got list"
_READONLY_RECV = "recv: tensor is read-only, but the collective writes its result into it"


def _peer(c: _Rank, name: str, peer: int) -> dict[str, Any]:
    """``dst=``/``src=`` (global rank ``peer``), or ``group_dst=``/``group_src=``."""
    if c.step.by_group_rank:
        return {f"group_{name}": c.members.index(peer)}
    return {name: peer}


def _sender(c: _Rank, peer: int) -> int:
    """What a receive from global rank ``peer`` returns: its global or its group rank."""
    return c.members.index(peer) if c.step.by_group_rank else peer


def _rejected_send(erring: int, tag: int, reason: str) -> str:
    """What the receive of a rejected send raises (a pattern)."""
    told = rf"recv from rank {erring} \(tag {tag}\): rank {erring} rejected its send: "
    return told + re.escape(reason)


def _message(c: _Rank, k: int) -> Any:
    """The array of message ``k`` of the step."""
    sender = c.step.messages[k].src
    return values(c.program.seed, c.step.index, sender, 100 + k, c.step.dtype, c.step.shape)


def _sends(c: _Rank, blocking: bool) -> list[Call]:
    """This rank's sends of the step's messages; the erring one sends a list."""
    calls = []
    for k, msg in enumerate(c.step.messages):
        if msg.src != c.rank:
            continue
        data: Any = _message(c, k)
        expect: Expect = Completes(NOTHING)
        if c.faulty and c.kind == "bad_send" and c.at == k:
            data = data.tolist()
            expect = _rejects(_BAD_ARRAY, data)
        kwargs = {**_peer(c, "dst", msg.dst), "tag": msg.tag}
        calls.append(
            Call("send" if blocking else "isend", (data,), kwargs, expect, blocking=blocking)
        )
    return calls


def _p2p(c: _Rank) -> Part:
    receives = [k for k, msg in enumerate(c.step.messages) if msg.dst == c.rank]
    blocking = c.mode == "blocking"
    calls = []
    if c.faulty and c.kind == "bad_peer":
        calls.append(_bad_peer(c))
    # The blocking API sends blocking only from a rank that receives nothing in the step,
    # so that no two ranks wait for each other's send.
    calls += _sends(c, blocking and not receives)
    recv = "recv" if blocking else "irecv"
    for k in receives:
        msg = c.step.messages[k]
        want = _message(c, k)
        out = blank(want)
        kwargs = {**_peer(c, "src", msg.src), "tag": msg.tag}
        if c.kind == "bad_send" and c.at == k:
            pattern = _rejected_send(msg.src, msg.tag, _BAD_ARRAY)
            calls.append(
                Call(recv, (out,), kwargs, PeerRejected(pattern, True, NOTHING), blocking=blocking)
            )
            continue
        if c.kind == "readonly_recv" and c.at == k:  # and then a receive that takes it
            bad = blank(want)
            bad.flags.writeable = False
            calls.append(
                Call(recv, (bad,), kwargs, _rejects(_READONLY_RECV, bad), blocking=blocking)
            )
        check = sender_is(f"message {k}", out, want, _sender(c, msg.src))
        calls.append(Call(recv, (out,), kwargs, Completes(check), blocking=blocking))
    return c.part(calls)


def _bad_peer(c: _Rank) -> Call:
    """A send or receive naming a peer it cannot: this rank raises, nobody else is involved."""
    fn, name = ("send", "dst") if c.at % 2 == 0 else ("recv", "src")
    array = values(c.program.seed, c.step.index, c.rank, 99, c.step.dtype, c.step.shape)
    if c.at < 2:
        reason, kwargs = c.bad_root(name, {})
    else:
        kwargs = {f"group_{name}": c.me} if c.step.by_group_rank else {name: c.rank}
        reason = f"peer group rank {c.me} is this rank; a rank cannot {fn} to or from itself"
    call = "isend" if fn == "send" else "irecv"
    return Call(call, (array,), {**kwargs, "tag": 1}, _rejects(f"{fn}: {reason}", array))


def _any_source(c: _Rank) -> Part:
    messages = c.step.messages
    receiver, tag = messages[0].dst, messages[0].tag
    blocking = c.mode == "blocking"
    if c.rank != receiver:
        return c.part(_sends(c, blocking))
    # One receive from any source per sender; which takes which message is not fixed.
    wants = {msg.src: _message(c, k) for k, msg in enumerate(messages)}
    bad_sender = c.fault.rank if c.fault is not None and c.kind == "bad_send" else None
    rejection = _rejected_send(bad_sender, tag, _BAD_ARRAY) if bad_sender is not None else _NEVER
    recv = "recv" if blocking else "irecv"
    kwargs = {"src": None, "tag": tag}
    calls, outs = [], []
    for k in range(len(messages)):
        if c.kind == "readonly_recv" and c.at == k:  # and then a receive that takes it
            bad = blank(_message(c, 0))
            bad.flags.writeable = False
            calls.append(
                Call(recv, (bad,), kwargs, _rejects(_READONLY_RECV, bad), blocking=blocking)
            )
        outs.append((len(calls), blank(_message(c, 0))))
        calls.append(Call(recv, (outs[-1][1],), kwargs, Either(rejection), blocking=blocking))

    def joint(outcomes: list[Outcome]) -> tuple[str, str] | None:
        senders, rejected = [], 0
        for i, out in outs:
            if outcomes[i].error is not None:
                rejected += 1
                continue
            sender = outcomes[i].result
            if sender not in wants or sender == bad_sender or sender in senders:
                return WRONG_VALUE, f"a receive from any source returned the sender {sender!r}"
            senders.append(sender)
            found = differs(f"the message of rank {sender}", out, wants[sender])
            if found is not None:
                return found
        expected = sorted(s for s in wants if s != bad_sender)
        if sorted(senders) != expected or rejected != (bad_sender is not None):
            return WRONG_VALUE, (
                f"the receives from any source got the messages of {sorted(senders)} and "
                f"{rejected} rejections; expected {expected} and {int(bad_sender is not None)}"
            )
        return None

    return c.part(calls, joint)


def _batch_order(c: _Rank, rank: int) -> list[int]:
    """The messages of ``rank``'s batch, in the order of its entries."""
    order = [k for k, msg in enumerate(c.step.messages) if rank in (msg.src, msg.dst)]
    random.Random(c.step.variant * 31 + rank).shuffle(order)
    return order


def _batch(c: _Rank) -> Part:
    messages = c.step.messages
    fault = c.fault
    # What the erring rank raises; its receivers are told its sends were rejected with it,
    # but the bad send itself for its own reason.
    reason = ""
    if fault is not None:
        entry = _batch_order(c, fault.rank).index(c.at)
        reason = f"batch_isend_irecv: entry {entry}: " + (
            _BAD_ARRAY if c.kind == "bad_send" else _READONLY_RECV
        )
    entries: list[Entry] = []
    retries: list[Call] = []
    for k in _batch_order(c, c.rank):
        msg = messages[k]
        sends = msg.src == c.rank
        peer = msg.dst if sends else msg.src
        kwargs = {"group_peer": c.members.index(peer)} if c.step.by_group_rank else {"peer": peer}
        kwargs["tag"] = msg.tag
        if sends:
            data: Any = _message(c, k)
            if c.faulty and c.kind == "bad_send" and c.at == k:
                data = data.tolist()
            entries.append((True, data, kwargs, Completes(NOTHING)))
            continue
        want = _message(c, k)
        out = blank(want)
        expect: Expect = Completes(sender_is(f"message {k}", out, want, _sender(c, peer)))
        if c.faulty:
            # Its receives were never posted: their messages wait for the next receives.
            retries.append(Call("irecv", (out,), {**_peer(c, "src", peer), "tag": msg.tag}, expect))
            out = blank(want)
            if c.kind == "readonly_recv" and c.at == k:
                out.flags.writeable = False
        elif fault is not None and peer == fault.rank:
            told = (
                _BAD_ARRAY
                if c.kind == "bad_send" and c.at == k
                else f"send: the batch was rejected: {reason}"
            )
            expect = PeerRejected(_rejected_send(peer, msg.tag, told), True, NOTHING)
        entries.append((False, out, kwargs, expect))
    if c.faulty:
        entries = [(s, t, kw, _rejects(reason, t)) for s, t, kw, _ in entries]
    return c.part([Call("batch_isend_irecv", entries=entries), *retries])


def _object_p2p(c: _Rank) -> Part:
    msg = c.step.messages[0]
    count = c.step.sizes[0][0]
    want = [make_object(c.program.seed, c.step.index, msg.src, k) for k in range(count)]
    reason = "send_object_list: object_list is empty"
    if c.rank == msg.src:
        objs: list[Any] = [] if c.fault is not None else copy.deepcopy(want)
        expect: Expect = _rejects(reason, objs) if c.fault is not None else Completes(NOTHING)
        call = Call("send_object_list", (objs,), _peer(c, "dst", msg.dst), expect, blocking=True)
        return c.part([call])
    if c.rank != msg.dst:
        return c.part([])
    out: list[Any] = [None] * count
    if c.fault is not None:
        expect = PeerRejected(_rejected_send(msg.src, 0, reason), True, NOTHING)
    else:
        expect = Completes(
            all_of(returns(_sender(c, msg.src)), objects_equal("object_list", out, want))
        )
    call = Call("recv_object_list", (out,), _peer(c, "src", msg.src), expect, blocking=True)
    return c.part([call])


def _new_group(c: _Rank) -> Part:
    members = c.step.sizes[0]

    def check(group: Any) -> tuple[str, str] | None:
        if c.rank not in members:
            if group is not aiodist.NON_GROUP_MEMBER:
                return WRONG_VALUE, f"expected NON_GROUP_MEMBER on a non-member, got {group!r}"
            return None
        want = f"<ProcessGroup rank={members.index(c.rank)}/{len(members)} backend=cpu>"
        if not isinstance(group, aiodist.ProcessGroup) or repr(group) != want:
            return WRONG_VALUE, f"expected {want}, got {group!r}"
        return None

    return c.part([Call("new_group", (list(members),), {"timeout": OP_TIMEOUT}, Completes(check))])


def _wait_timeout(c: _Rank) -> Part:
    msg = c.step.messages[0]
    calls = []
    if c.rank == msg.dst:  # a receive nobody sends
        buffer = np.zeros(1)
        calls.append(Call("wait_timeout", (buffer,), {"src": msg.src, "tag": msg.tag}, TimesOut()))
    # Every later call of every rank fails: the expired wait aborted the world.
    calls.append(Call("barrier", (), {}, Aborted(), blocking=True))
    calls.append(Call("all_reduce", (np.ones(2),), {}, Aborted(), blocking=True))
    return c.part(calls)


_BUILDERS: dict[str, Callable[[_Rank], Part]] = {
    "all_reduce": _all_reduce,
    "all_reduce_coalesced": _all_reduce_coalesced,
    "broadcast": _broadcast,
    "reduce": _reduce,
    "all_gather": _all_gather,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "all_gather_coalesced": _all_gather_coalesced,
    "gather": _gather,
    "scatter": _scatter,
    "reduce_scatter": _reduce_scatter,
    "reduce_scatter_tensor": _reduce_scatter_tensor,
    "all_to_all": _all_to_all,
    "all_to_all_single": _all_to_all_single,
    "barrier": _barrier,
    "broadcast_object_list": _broadcast_object_list,
    "all_gather_object": _all_gather_object,
    "gather_object": _gather_object,
    "scatter_object_list": _scatter_object_list,
    "p2p": _p2p,
    "any_source": _any_source,
    "batch_isend_irecv": _batch,
    "object_p2p": _object_p2p,
    "new_group": _new_group,
    "wait_timeout": _wait_timeout,
}


def part(program: Program, step: Step, rank: int) -> Part | None:
    """What ``rank`` does in ``step`` and must get; ``None`` if it is not in the step's group."""
    if rank not in step.ranks:
        return None
    return _BUILDERS[step.op](_Rank(program, step, rank))


# -- running a rank ----------------------------------------------------------------------------
@dataclass
class RankReport:
    """What one rank found: its problems, and how far it got."""

    rank: int
    problems: list[Problem] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0


class _Checker:
    """Compares a rank's outcomes with the model; says when the rank must stop."""

    def __init__(self, rank: int) -> None:
        self.report = RankReport(rank)
        self.stopped = False

    def check(self, part: Part, outcomes: list[Outcome]) -> None:
        for expect, outcome in zip(part.expects(), outcomes, strict=True):
            found = expect.problem(outcome)
            if found is not None:
                self.add(part.step, *found)
                if outcome.error is not None and _aborts(outcome.error, expect):
                    self.stopped = True
        if part.joint is not None and not self.stopped:
            found = part.joint(outcomes)
            if found is not None:
                self.add(part.step, *found)

    def add(self, step: Step, kind: str, text: str) -> None:
        self.report.problems.append(
            Problem(step.index, self.report.rank, kind, f"{step.op}: {text}")
        )
        if len(self.report.problems) >= MAX_PROBLEMS:
            self.stopped = True


def _aborts(exc: BaseException, expect: Expect) -> bool:
    """Whether an unexpected ``exc`` means the world is broken (every later call fails)."""
    if isinstance(expect, Aborted | TimesOut):
        return False
    return not isinstance(exc, DistUsageError)


def _group_kwargs(call: Call, step: Step, groups: dict[int, Any]) -> dict[str, Any]:
    if step.group < 0:
        return call.kwargs
    return {**call.kwargs, "group": groups[step.group]}


def _due(later: list[tuple[Part, list[Any]]], step: Step) -> list[tuple[Part, list[Any]]]:
    """The parts awaited ``later`` that are due at ``step`` (all, before a wait expires)."""
    due = [x for x in later if x[0].due <= step.index or step.op == "wait_timeout"]
    for x in due:
        later.remove(x)
    return due


#: Steps whose calls are made one after the other ended: a group is used once it is made,
#: and a call made after a wait expired must fail.
_IN_TURN = frozenset({"new_group", "wait_timeout"})


async def run_async_rank(program: Program, rank: int) -> RankReport:
    """Run ``program`` as ``rank`` with the async API; the default group must be set up."""
    started = time.monotonic()
    checker = _Checker(rank)
    aiodist.set_timeout(OP_TIMEOUT)
    groups: dict[int, Any] = {}  # the new_group step's index -> the group made
    later: list[tuple[Part, list[Any]]] = []
    for step in program.steps:
        for p, works in _due(later, step):
            checker.check(p, [await _settle_async(w) for w in works])
        if checker.stopped:
            break
        checker.report.steps = step.index + 1
        p = part(program, step, rank)
        if p is None:
            continue
        if step.op in _IN_TURN:
            outcomes = []
            for call in p.calls:
                outcomes += [await _settle_async(w) for w in _start_async(call, step, groups)]
            if step.op == "new_group":
                groups[step.index] = outcomes[0].result
            checker.check(p, outcomes)
            continue
        works = [w for call in p.calls for w in _start_async(call, step, groups)]
        if p.mode == "later":
            later.append((p, works))
        else:
            checker.check(p, [await _await_async(w, p.mode) for w in works])
    for p, works in later:
        if not checker.stopped:
            checker.check(p, [await _settle_async(w) for w in works])
    checker.report.seconds = time.monotonic() - started
    return checker.report


def _start_async(call: Call, step: Step, groups: dict[int, Any]) -> list[Any]:
    """Make ``call``: its works (a coroutine for ``new_group`` and an expiring wait), or,
    if the call raised, its outcome (one per entry of a batch)."""
    kwargs = _group_kwargs(call, step, groups)
    try:
        if call.fn == "batch_isend_irecv":
            group = kwargs.get("group")
            ops = [
                aiodist.P2POp(aiodist.isend if sends else aiodist.irecv, array, group=group, **kw)
                for sends, array, kw, _ in call.entries
            ]
            return list(aiodist.batch_isend_irecv(ops))
        if call.fn == "new_group":
            return [aiodist.new_group(*call.args, **kwargs)]
        if call.fn == "wait_timeout":
            return [aiodist.irecv(*call.args, **kwargs).wait(WAIT_TIMEOUT)]
        return [getattr(aiodist, call.fn)(*call.args, **kwargs)]
    except Exception as exc:
        return [Outcome(error=exc, at_call=True)] * max(1, len(call.entries))


async def _settle_async(work: Any) -> Outcome:
    """Wait for a work (or coroutine) to end; its outcome."""
    if isinstance(work, Outcome):
        return work
    try:
        return Outcome(await work)
    except Exception as exc:
        return Outcome(error=exc)


async def _await_async(work: Any, mode: str) -> Outcome:
    """Await ``work`` as ``mode`` says: a first wait that is cancelled (``cancel``) or whose
    deadline passes (``deadline``) leaves the operation running, to be awaited again."""
    if isinstance(work, aiodist.Work) and mode == "cancel":
        waiter = asyncio.ensure_future(work.wait())
        await asyncio.sleep(0)
        waiter.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await waiter
    elif isinstance(work, aiodist.Work) and mode == "deadline":
        with contextlib.suppress(TimeoutError, Exception):
            async with asyncio.timeout(CALLER_DEADLINE):
                await work
    return await _settle_async(work)


def run_sync_rank(program: Program, rank: int) -> RankReport:
    """Run ``program`` as ``rank`` with the blocking API; the default group must be set up."""
    started = time.monotonic()
    checker = _Checker(rank)
    dist.set_timeout(OP_TIMEOUT)
    groups: dict[int, Any] = {}
    later: list[tuple[Part, list[Any]]] = []
    for step in program.steps:
        for p, works in _due(later, step):
            checker.check(p, [_settle_sync(w) for w in works])
        if checker.stopped:
            break
        checker.report.steps = step.index + 1
        p = part(program, step, rank)
        if p is None:
            continue
        # (new_group and an expiring wait block: their calls are made in turn.)
        works = [w for call in p.calls for w in _start_sync(call, step, groups)]
        if step.op == "new_group":
            groups[step.index] = works[0].result
        if p.mode == "later":
            later.append((p, works))
        else:
            checker.check(p, [_await_sync(w, p.mode) for w in works])
    for p, works in later:
        if not checker.stopped:
            checker.check(p, [_settle_sync(w) for w in works])
    checker.report.seconds = time.monotonic() - started
    return checker.report


#: The blocking API's functions that take ``async_op``.
_ASYNC_OP = (_ARRAY_OPS | {"barrier"}) - _P2P


def _start_sync(call: Call, step: Step, groups: dict[int, Any]) -> list[Any]:
    """Make ``call`` with the blocking API: its works, or the outcome of a blocking call
    (or of a call that raised)."""
    kwargs = _group_kwargs(call, step, groups)
    try:
        if call.fn == "batch_isend_irecv":
            group = kwargs.get("group")
            ops = [
                dist.P2POp(dist.isend if sends else dist.irecv, array, group=group, **kw)
                for sends, array, kw, _ in call.entries
            ]
            return list(dist.batch_isend_irecv(ops))
        if call.fn == "wait_timeout":
            work = dist.irecv(*call.args, **kwargs)
            return [_blocking(lambda: work.wait(timeout=WAIT_TIMEOUT))]
        fn = getattr(dist, call.fn)
        if call.fn in _ASYNC_OP and not call.blocking:
            return [fn(*call.args, async_op=True, **kwargs)]
        if call.fn in ("isend", "irecv"):
            return [fn(*call.args, **kwargs)]
        return [_blocking(lambda: fn(*call.args, **kwargs))]
    except Exception as exc:
        return [Outcome(error=exc, at_call=True)] * max(1, len(call.entries))


def _blocking(call: Callable[[], Any]) -> Outcome:
    """The outcome of a blocking call: the call and its operation are one."""
    try:
        return Outcome(call(), at_call=None)
    except Exception as exc:
        return Outcome(error=exc, at_call=None)


def _settle_sync(work: Any) -> Outcome:
    """Wait for a blocking API's work to end; its outcome."""
    if isinstance(work, Outcome):
        return work
    try:
        work.wait()
        return Outcome(work.result())
    except Exception as exc:
        return Outcome(error=exc)


def _await_sync(work: Any, mode: str) -> Outcome:
    """Wait as ``mode`` says: ``cancel``/``deadline`` first give up on the work's future."""
    if not isinstance(work, Outcome) and mode in ("cancel", "deadline"):
        with contextlib.suppress(concurrent.futures.TimeoutError, Exception):
            work.get_future().result(timeout=CALLER_DEADLINE)
    return _settle_sync(work)


# -- running a program ---------------------------------------------------------------------------
@dataclass
class Report:
    """The outcome of one program under one configuration."""

    config: Config
    program: Program
    ranks: list[RankReport]
    error: str = ""  # the runner's own failure (a rank that crashed, a run that timed out)
    error_kind: str = ""
    seconds: float = 0.0

    @property
    def problems(self) -> list[Problem]:
        """Every problem, earliest step first; the runner's own failure as step -1."""
        found = [p for r in self.ranks for p in r.problems]
        if self.error:
            found.append(Problem(-1, -1, self.error_kind or UNEXPECTED_ERROR, self.error))
        return sorted(found, key=lambda p: (p.step, p.rank))

    @property
    def kinds(self) -> set[str]:
        """The kinds of problem found."""
        return {p.kind for p in self.problems}

    def describe(self) -> str:
        """Configuration, problems, replay command and program: a failure message."""
        lines = [f"{self.config}: {len(self.problems)} problems"]
        lines += [f"  {p}" for p in self.problems]
        lines += [f"replay: {self.config.replay}", "program:", self.program.listing()]
        return "\n".join(lines)


def run_program(config: Config) -> Report:
    """Run ``config``'s program and compare every rank's outcomes with the model."""
    program = config.program()
    started = time.monotonic()
    report = Report(config, program, [])
    try:
        if config.api == "async":
            report.ranks = _run_async(config, report)
        else:
            report.ranks = run_world_processes(
                functools.partial(sync_rank, config),
                config.ranks,
                timeout=RUN_LIMIT,
                env={
                    "AIODIST_LOOP": config.loop,
                    "AIODIST_SHM": "1" if config.transport == "shm" else "0",
                    **config.environment(),
                },
            )
    except Exception as exc:
        report.error, report.error_kind = runner_failure(exc)
    report.seconds = time.monotonic() - started
    return report


def _run_async(config: Config, report: Report) -> list[RankReport]:
    caught: list[dict[str, Any]] = []
    with asyncio.Runner(loop_factory=loop_factory(config.loop)) as runner:
        runner.get_loop().set_exception_handler(lambda _loop, context: caught.append(context))
        ranks = runner.run(run_world_program(config))
    if caught:
        report.error = handler_fired(caught)
    return ranks


def handler_fired(caught: list[dict[str, Any]]) -> str:
    """The problem of an event loop whose exception handler was called with ``caught``."""
    return f"the event loop's exception handler fired: {caught!r:.2000}"


async def run_world_program(config: Config) -> list[RankReport]:
    """Run ``config``'s program with the async API, its ranks as tasks of the running loop,
    over its transport with its staging bound."""
    with temporary_environment(config.environment()):
        return await run_world(
            functools.partial(_async_rank, config.program()),
            config.ranks,
            transport="shm" if config.transport == "shm" else "tcp",
            timeout=RUN_LIMIT,
        )


@contextlib.contextmanager
def temporary_environment(variables: dict[str, str]) -> Iterator[None]:
    """Set ``variables`` in this process's environment meanwhile: the transports of a
    world made meanwhile read them (its ranks are tasks of this process)."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


async def _async_rank(program: Program, rank: int, world_size: int) -> RankReport:
    return await run_async_rank(program, rank)


def sync_rank(config: Config, rank: int, world_size: int) -> RankReport:
    """A process's rank of :func:`run_world_processes`: ``config``'s program, blocking API."""
    return run_sync_rank(config.program(), rank)
