"""Small shared utilities every layer may use.

Holds the wait policy (``_wait``), the long waits that speak (``_speaking``), every default
timeout (``_timeouts``), loop choice (``_loop``), the asyncio internals aiodist relies on
(``_asyncio_internals``), the HMAC helper (``_auth``), switches read from the environment
(``_environment``) and the cluster variables a rank reads (``_cluster``).

May import: :mod:`aiodist.errors` only.
"""
