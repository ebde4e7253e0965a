"""Collective algorithms, written only against :class:`~aiodist.transport.base.OpComm`.

Every function here is a coroutine taking the operation's ``OpComm`` first. Arguments are
already validated by the caller (the process group): arrays are C-contiguous numpy arrays
of a supported dtype, sizes agree across ranks as each function states, and ``op`` passed
:func:`aiodist._arrays._reduce.check_reduce_op`. A function returns once this rank's part is done
and no send refers to a caller's array any more. World size 1 sends no messages.

Choices (details and measured crossovers in ``docs/architecture.md``):

* :func:`all_reduce`: recursive doubling below :data:`RING_THRESHOLD_BYTES`; from there
  on a chunked, pipelined exchange for two ranks and a pipelined ring (reduce-scatter +
  all-gather) for more.
* :func:`broadcast`, :func:`reduce`: binomial trees, chunked so levels overlap.
* :func:`all_gather`, :func:`reduce_scatter`: rings, chunked and pipelined.
* :func:`gather`, :func:`scatter`: direct between the root and each rank.
* :func:`all_to_all`: pairwise exchange.
* :func:`barrier`: dissemination; :func:`monitored_barrier`: through rank 0.

Object collectives (pickled objects) are in :mod:`aiodist.collectives.objects`.

May import: the transports, the stores, :mod:`aiodist._arrays`, :mod:`aiodist._util` and
:mod:`aiodist.errors`.
"""

from .all_reduce import (
    RING_THRESHOLD_BYTES,
    all_reduce,
    pair_all_reduce_pipelined,
    ring_all_reduce,
)
from .all_to_all import all_to_all
from .barrier import barrier, monitored_barrier
from .gather import all_gather, gather, scatter
from .reduce_scatter import reduce_scatter
from .tree import broadcast, reduce

__all__ = [
    "RING_THRESHOLD_BYTES",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "gather",
    "monitored_barrier",
    "pair_all_reduce_pipelined",
    "reduce",
    "reduce_scatter",
    "ring_all_reduce",
    "scatter",
]
