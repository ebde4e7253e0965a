"""Optional integrations with other frameworks, each needing that framework (aiodist's extra
of the same name installs it: ``pip install -e '/path/to/aiodist[ray]'``).

* :mod:`aiodist.contrib.ray`: process groups among Ray actors.
* :mod:`aiodist.contrib.dask`: a function run as a process group on the workers of a Dask
  cluster.
* :mod:`aiodist.contrib.aiohttp` and :mod:`aiodist.contrib.fastapi`: a serving controller (:mod:`aiodist.serving`) in a web
  application.

May import anything but the package index.
"""

__all__: list[str] = []
