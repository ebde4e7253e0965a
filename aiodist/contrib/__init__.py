"""Optional integrations with other frameworks, each behind an extra (``aiodist[ray]``).

* :mod:`aiodist.contrib.ray`: process groups among Ray actors.
* :mod:`aiodist.contrib.aiohttp` (``aiodist[aiohttp]``) and :mod:`aiodist.contrib.fastapi`
  (``aiodist[fastapi]``): a serving controller (:mod:`aiodist.serving`) in a web
  application.
"""

__all__: list[str] = []
