"""Arrays and what is computed on them, before any byte moves.

Holds array intake (``_intake``: numpy, DLPack, bfloat16 through the capsule), ``ReduceOp``
and its kernels (``_reduce``) and the fingerprint of an operation's arguments
(``_fingerprint``).

May import: :mod:`aiodist.errors` and :mod:`aiodist._util`.
"""
