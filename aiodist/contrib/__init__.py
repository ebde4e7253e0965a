"""Optional integrations with other frameworks, each behind an extra (``aiodist[ray]``).

* :mod:`aiodist.contrib.ray`: process groups among Ray actors.
"""

__all__: list[str] = []
