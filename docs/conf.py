"""Sphinx configuration of aiodist's documentation site.

Build: ``sphinx-build -W --keep-going -b html docs docs/_build/html`` (``scripts/test.sh``
does, with ``pip install -e '.[docs]'``). The API reference is generated from the
docstrings of the installed ``aiodist`` package; the command-line pages run the commands
at build time, so they never drift from the code.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))

import aiodist  # noqa: E402  (after the path set-up above)

project = "aiodist"
author = "the aiodist developers"
copyright = "the aiodist developers"
release = aiodist.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "aiodist_docs",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# The docstrings are Google style.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# "Attributes:" sections become fields, so a documented property is not described twice.
napoleon_use_ivar = True

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_default_options = {"show-inheritance": True}
# Long signatures (init_process_group, TCPStore) list one parameter per line.
python_maximum_signature_line_length = 100

# ``sphinx -n`` (nitpicky) resolves every name in a signature or a cross-reference. The build
# runs offline, so no intersphinx inventory is loaded; these are the targets it cannot
# resolve, and why.
nitpick_ignore_regex = [
    # The standard library and third-party packages (numpy, aiohttp, fastapi, ray): no
    # inventory of their documentation is available offline.
    (
        r"py:.*",
        r"(_?asyncio|abc|argparse|collections\.abc|concurrent\.futures|contextvars|datetime"
        r"|enum|multiprocessing|os|pathlib|signal|np|numpy|aiohttp|fastapi|ray)\..+",
    ),
    # Names in private modules (aiodist.group._work, aiodist.store._state, ...) and type
    # variables: implementation details that have no entry of their own.
    (r"py:.*", r"aiodist(\.\w+)*\._\w+(\.\w+)*"),
    (r"py:.*", r"aiodist(\.\w+)*\.T"),
    # Module-level type aliases, shown by name in signatures (``timeout: Timeout``); each
    # function's "Args" section says what the argument accepts.
    (r"py:class", r"Timeout|Group|Op|Validate|Path|Reject|HostArray|Intake|DataPath"),
    # Internal classes in the annotations of documented attributes (ProcessGroup.world,
    # ProcessGroup.paths).
    (r"py:class", r"aiodist\.group\.(World|DataPath)"),
]

myst_enable_extensions = ["colon_fence", "deflist", "attrs_inline", "attrs_block"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = f"aiodist {release}"
html_static_path = ["_static"]
html_css_files = ["aiodist.css"]
html_theme_options = {
    "navigation_with_keys": True,
}
pygments_style = "friendly"
pygments_dark_style = "monokai"
