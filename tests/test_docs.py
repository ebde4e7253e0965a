"""The documentation site: it builds without a warning, it documents every public name, and
every Python code block of its pages runs.

Code blocks are fenced ```` ```python ```` blocks in ``docs/**/*.md``. The HTML comment on
the line before a block says how it is checked:

* none: the block is a complete script, run with this interpreter in an empty directory;
* ``<!-- launch: ARGS -->``: a worker script, run as ``aiodist-run --standalone ARGS``;
* ``<!-- fragment -->``: an excerpt that cannot run alone; it is only compiled (top-level
  ``await`` allowed).

Every run must exit 0 within its timeout, with no traceback and no warning on its output
(``PYTHONWARNINGS=error``).
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import pkgutil
import re
import shlex
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BUILD = DOCS / "_build" / "html"

#: Modules whose ``__all__`` is the public API; each name needs an entry in the reference.
DOCUMENTED_MODULES = (
    "aiodist",
    "aiodist.sync",
    "aiodist.multiprocessing",
    "aiodist.errors",
    "aiodist.store",
    "aiodist.rendezvous",
    "aiodist.testing",
    "aiodist.debug",
    "aiodist.metrics",
    "aiodist.launcher",
    "aiodist.serving",
    "aiodist.contrib",
    "aiodist.contrib.ray",
    "aiodist.contrib.aiohttp",
    "aiodist.contrib.fastapi",
)
#: Top-level modules that are layers below the public API (their public names are
#: re-exported by ``aiodist``) or entry points documented as commands.
INTERNAL_MODULES = frozenset(
    {
        "aiodist.backends",
        "aiodist.collectives",
        "aiodist.device_mesh",
        "aiodist.group",
        "aiodist.run",
        "aiodist.transport",
    }
)
#: ``architecture.md`` records how aiodist is built; its snippets are illustrations.
NOT_RUN = frozenset({"architecture.md"})

BLOCK_TIMEOUT = 60.0
#: Variables that would make a block join some other job or change a default.
_JOB_VARS = re.compile(
    r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_.*|"
    r"MASTER_ADDR|MASTER_PORT|TORCHELASTIC_.*|PET_.*|AIODIST_.*|OMPI_COMM_WORLD_.*|SLURM_.*)$"
)
_MARKER = re.compile(r"^<!--\s*(.*?)\s*-->$")
_FENCE = re.compile(r"^(`{3,}|~{3,})(.*)$")


# -- the build -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def built_site() -> Path:
    """Build the site the way ``scripts/test.sh`` does (incremental: a no-op when current)."""
    for module in ("sphinx", "myst_parser", "furo"):
        pytest.importorskip(
            module, reason="the docs extra is not installed: pip install -e .[docs]"
        )
    argv = [sys.executable, "-m", "sphinx", "-n", "-W", "--keep-going", "-q", "-b", "html"]
    proc = subprocess.run(
        [*argv, str(DOCS), str(BUILD)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, f"sphinx-build failed:\n{proc.stdout}\n{proc.stderr}"
    return BUILD


@pytest.mark.timeout(300)
def test_site_builds_without_warnings(built_site: Path) -> None:
    for page in ("index", "quickstart", "concepts", "migrating", "api/aiodist", "api/sync"):
        assert (built_site / f"{page}.html").is_file(), page


def read_inventory(path: Path) -> dict[str, str]:
    """Return ``{name: role}`` for every Python object in a Sphinx ``objects.inv`` (v2)."""
    data = path.read_bytes()
    lines = data.split(b"\n", 4)
    assert lines[0] == b"# Sphinx inventory version 2", lines[0]
    assert b"zlib" in lines[3], lines[3]
    entries = {}
    for line in zlib.decompress(lines[4]).decode().splitlines():
        # name domain:role priority uri display-name (the name itself has no spaces in py)
        name, role = line.split(" ", 2)[:2]
        if role.startswith("py:"):
            entries[name] = role
    return entries


def resolve(dotted: str) -> Any:
    """Import the object a documented name refers to, or return ``None``."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


def _is_value(obj: object) -> bool:
    """Constants are matched by name only: equal small ints and strings share identity."""
    return isinstance(obj, int | float | str | bytes | tuple | type(None))


@pytest.mark.timeout(300)
def test_every_public_name_has_an_entry(built_site: Path) -> None:
    inventory = read_inventory(built_site / "objects.inv")
    documented_ids = {}
    for name in inventory:
        obj = resolve(name)
        if obj is not None and not _is_value(obj):
            documented_ids[id(obj)] = name
    missing = []
    for module_name in DOCUMENTED_MODULES:
        module = importlib.import_module(module_name)
        assert f"{module_name}" in inventory, f"module {module_name} has no page"
        for name in module.__all__:
            full = f"{module_name}.{name}"
            obj = getattr(module, name)
            if full in inventory or (not _is_value(obj) and id(obj) in documented_ids):
                continue
            missing.append(full)
    assert not missing, (
        "public names without an entry in the API reference (add them to docs/api/*.rst, "
        f"with a docstring): {missing}"
    )


def test_every_top_level_module_is_documented_or_internal() -> None:
    import aiodist

    public = {
        f"aiodist.{info.name}"
        for info in pkgutil.iter_modules(aiodist.__path__)
        if not info.name.startswith("_")
    }
    unclassified = public - set(DOCUMENTED_MODULES) - INTERNAL_MODULES
    assert not unclassified, (
        f"new modules {sorted(unclassified)}: document them (docs/api/, and "
        "DOCUMENTED_MODULES here) or list them in INTERNAL_MODULES"
    )


# -- pages that must keep up with something else ---------------------------------------------
_TORCH_API = """
import inspect, json, types, warnings
warnings.simplefilter("ignore")
import torch.distributed as d
import torch.distributed.distributed_c10d as c10d

names = set(c10d.__all__)
for name in dir(d):
    if name.startswith("_"):
        continue
    obj = getattr(d, name)
    if isinstance(obj, types.ModuleType):
        if obj.__name__.startswith("torch.distributed."):
            names.add(name)
    elif (getattr(obj, "__module__", None) or "").startswith("torch"):
        names.add(name)
api = {}
for name in sorted(names):
    obj = getattr(d, name, None) or getattr(c10d, name)
    params = None
    if inspect.isfunction(obj):
        params = [p for p in inspect.signature(obj).parameters if not p.startswith("_")]
    api[name] = params
print(json.dumps(api))
"""


def torch_api() -> dict[str, list[str] | None]:
    """torch.distributed's public names, with each function's parameters (in a subprocess:
    importing torch here would load it into every later test of the session)."""
    pytest.importorskip("torch", reason="torch is not installed")
    proc = subprocess.run(
        [sys.executable, "-c", _TORCH_API], capture_output=True, text=True, timeout=120, check=True
    )
    api: dict[str, list[str] | None] = json.loads(proc.stdout)
    return api


def test_migration_guide_lists_every_torch_name_and_argument() -> None:
    api = torch_api()
    page = (DOCS / "migrating.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    unlisted, arguments = [], []
    for name, params in api.items():
        if f"`{name}`" not in page and f"`{name}(" not in page:
            unlisted.append(name)
        if params is None:
            continue
        row = next((r for r in rows if f"`{name}(" in r.split(" | ")[0]), None)
        if row is None:
            arguments.append(f"{name}: no row with its signature")
            continue
        first_cell = row.split(" | ")[0]
        absent = [p for p in params if not re.search(rf"\b{p}\b", first_cell)]
        if absent:
            arguments.append(f"{name}: {absent}")
    assert not unlisted, f"torch.distributed names missing from docs/migrating.md: {unlisted}"
    assert not arguments, f"torch arguments missing from docs/migrating.md: {arguments}"
    assert len(api) > 100, len(api)


#: Where a "missing" row of each section of docs/migrating.md must find no such name.
_MISSING_CHECKED_IN = {
    "Process groups": ("aiodist.sync",),
    "Collectives": ("aiodist.sync",),
    "Point-to-point": ("aiodist.sync",),
    "Object collectives": ("aiodist.sync",),
    "Work": ("aiodist.sync.Work", "aiodist.Work"),
    "Stores": ("aiodist.sync.Store", "aiodist.sync.TCPStore", "aiodist.Store"),
    "Errors": ("aiodist.sync",),
    "Debugging and logging": ("aiodist.sync",),
}


def test_migration_guide_missing_rows_are_still_missing() -> None:
    """A row that says aiodist lacks a name must be updated once the name exists."""
    section, stale = "", []
    for line in (DOCS / "migrating.md").read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        if section not in _MISSING_CHECKED_IN or not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not cells[-1].startswith("missing"):
            continue
        for name in re.findall(r"`(\w+)[(`]", cells[0]):
            owners = [resolve(o) for o in _MISSING_CHECKED_IN[section]]
            if any(hasattr(o, name) for o in owners):
                stale.append(f"{section}: {name}")
    assert not stale, f"docs/migrating.md says these are missing, but they exist: {stale}"


def test_performance_page_includes_every_benchmark_result() -> None:
    page = (DOCS / "performance.md").read_text()
    results = sorted((ROOT / "bench" / "results").glob("*.md"))
    assert results
    missing = [p.name for p in results if f"../bench/results/{p.name}" not in page]
    assert not missing, f"add to docs/performance.md: {missing}"


def test_every_image_is_shown() -> None:
    pages = "".join(p.read_text() for p in DOCS.rglob("*.md") if "_build" not in p.parts)
    images = [p for p in (DOCS / "images").glob("*") if p.is_file()]
    unshown = [p.name for p in images if f"images/{p.name}" not in pages]
    assert not unshown, f"images under docs/images that no page shows: {unshown}"


# -- the code blocks -------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    """One fenced Python block of a page."""

    page: str
    line: int
    kind: str  # "script", "launch" or "fragment"
    args: tuple[str, ...]
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def extract_blocks(text: str, page: str) -> list[Block]:
    """The ```` ```python ```` blocks of one Markdown page, with how each is checked."""
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i].strip())
        if fence is None:
            i += 1
            continue
        marker, info = fence.group(1), fence.group(2).strip()
        start = i
        i += 1
        body = []
        while i < len(lines):
            closing = lines[i].strip()
            if closing.startswith(marker[0] * len(marker)) and not closing.strip(marker[0]):
                break
            body.append(lines[i])
            i += 1
        i += 1
        if info.split()[:1] not in (["python"], ["py"]):
            continue
        previous = next((s.strip() for s in reversed(lines[:start]) if s.strip()), "")
        kind, args = "script", ()
        comment = _MARKER.match(previous)
        if comment is not None:
            word, _, rest = comment.group(1).partition(":")
            if word == "fragment" and not rest:
                kind = "fragment"
            elif word == "launch":
                kind, args = "launch", tuple(shlex.split(rest))
            else:
                raise ValueError(f"{page}:{start + 1}: unknown code block marker {previous!r}")
        blocks.append(Block(page, start + 1, kind, args, "\n".join(body) + "\n"))
    return blocks


def all_blocks() -> list[Block]:
    blocks = []
    for path in sorted(DOCS.rglob("*.md")):
        if "_build" in path.parts or path.name in NOT_RUN:
            continue
        blocks.extend(extract_blocks(path.read_text(), path.relative_to(DOCS).as_posix()))
    return blocks


BLOCKS = all_blocks()


def test_the_extractor_reads_markers() -> None:
    text = (
        "# t\n\n```python\nprint(1)\n```\n\n<!-- fragment -->\n```python\nawait x\n```\n\n"
        "<!-- launch: --nproc-per-node=2 -->\n````python\nprint('```')\n````\n\n"
        "```{note}\nnot code\n```\n\n```text\nprint(2)\n```\n"
    )
    with pytest.raises(ValueError, match=r"check.md:2: unknown code block marker"):
        extract_blocks("<!-- fragmnet -->\n```python\npass\n```\n", "check.md")
    blocks = extract_blocks(text, "check.md")
    assert [(b.kind, b.args, b.code, b.line) for b in blocks] == [
        ("script", (), "print(1)\n", 3),
        ("fragment", (), "await x\n", 8),
        ("launch", ("--nproc-per-node=2",), "print('```')\n", 13),
    ]


def test_the_guides_have_code_to_run() -> None:
    kinds = {b.kind for b in BLOCKS}
    assert kinds == {"script", "launch", "fragment"}, kinds
    assert len([b for b in BLOCKS if b.kind != "fragment"]) >= 20


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _JOB_VARS.match(k)}
    env["PYTHONWARNINGS"] = "error"
    return env


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_code_block(block: Block, tmp_path: Path) -> None:
    if block.kind == "fragment":
        compile(block.code, block.id, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        return
    script = tmp_path / "block.py"
    script.write_text(block.code)
    if block.kind == "launch":
        argv = [sys.executable, "-m", "aiodist.run", "--standalone", *block.args, str(script)]
    else:
        argv = [sys.executable, str(script)]
    proc = subprocess.run(
        argv,
        cwd=tmp_path,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT,
        check=False,
    )
    output = f"{block.id} ({' '.join(argv[1:])}):\n{proc.stdout}\n{proc.stderr}"
    assert proc.returncode == 0, output
    for sign in ("Traceback", "Warning:", "Exception ignored", "never awaited", "Unclosed"):
        assert sign not in proc.stderr, output
