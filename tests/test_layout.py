"""The shape of the package, read from its source: layers, import circles, sizes.

The import graph is built from every ``import`` statement in ``aiodist/`` (``ast``), at
module level and inside functions alike, and inside ``if TYPE_CHECKING:`` blocks too: an
annotation that names a module above is still a dependency on it, so a part that needs its
owner's type takes a ``Protocol`` of its own instead. Importing a submodule runs its
package's ``__init__`` first; that implicit step is not an edge (a package's ``__init__``
may import its own modules, and they never import it back).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "aiodist"

#: The packages (and top-level modules) of aiodist, bottom to top. A module imports only
#: from its own package or from a row above its package's; packages in one row are peers
#: and import nothing of each other. The root package, the public async API's index, sits
#: at the top: it may name anything below, nothing imports it by name.
LAYERS: list[list[str]] = [
    ["errors"],
    ["_util"],
    ["_arrays"],
    ["store"],
    ["rendezvous"],
    ["transport"],
    ["collectives"],
    ["group"],
    ["backends"],
    ["_assembly"],
    ["_api", "debug"],
    ["device_mesh"],
    ["sync", "serving", "launcher", "multiprocessing"],
    ["metrics", "run", "testing"],
    ["contrib"],
    [""],
]

#: Functions allowed over MAX_FUNCTION_LINES: declarative tables, read as a list rather
#: than followed as steps.
LONG_TABLES = {
    # One add_argument per option of aiodist-run, mirroring torchrun's help.
    "aiodist.launcher._cli.get_args_parser",
}
MAX_FUNCTION_LINES = 100

#: Modules allowed over MAX_MODULE_LINES (at most three): each holds one concern whose
#: parts share private state closely.
LONG_MODULES = {
    "aiodist.group",  # World and ProcessGroup: the operation's life on a rank
    "aiodist.collectives.shm_workspace",  # the node workspace: layout, turns, leaving
    "aiodist.store.etcd",  # EtcdStore: every store operation as etcd transactions
}
MAX_MODULE_LINES = 900


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _imported(name: str, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    """The aiodist modules one import statement of module ``name`` loads."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        base = _from_base(name, node)
        targets = [f"{base}.{alias.name}" for alias in node.names]
        targets = [t if t in MODULES else base for t in targets]
    for target in targets:
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        if target and target != name:
            yield target


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                graph[name].update(_imported(name, node))
    return graph


def _unit(module: str) -> str:
    """The package (or top-level module) of ``module``: ``""`` for the root package."""
    return module.split(".")[1] if "." in module else ""


def _layer(module: str) -> int:
    unit = _unit(module)
    for index, row in enumerate(LAYERS):
        if unit in row:
            return index
    raise AssertionError(f"{module}: its package {unit!r} has no row in LAYERS")


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_package_has_a_row_and_a_docstring() -> None:
    for name, tree in TREES.items():
        _layer(name)
        if MODULES[name].name == "__init__.py":
            assert ast.get_docstring(tree), f"{name}: a package says what it holds"
    rows = [unit for row in LAYERS for unit in row]
    assert len(rows) == len(set(rows))


def test_no_import_circles() -> None:
    assert _circles(_graph()) == []


def test_no_upward_imports() -> None:
    upward = [
        f"{a} -> {b}"
        for a, targets in _graph().items()
        for b in sorted(targets)
        if _unit(a) != _unit(b) and _layer(b) >= _layer(a)
    ]
    assert upward == []


def test_no_module_imports_another_modules_private_names() -> None:
    """``from x import _name`` reaches into another module's insides (a private *module*
    is fine: it is its package's to share)."""
    found = [
        f"{name}: {base}.{alias.name}"
        for name, tree in TREES.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and (base := _from_base(name, node)).startswith("aiodist")
        for alias in node.names
        if alias.name.startswith("_") and f"{base}.{alias.name}" not in MODULES
    ]
    assert found == []


#: Private names of other libraries that are public in all but name.
_FOREIGN_PRIVATE = {"_replace", "_exit", "_getframe", "_current_frames", "_Unpickler"}


def _own_names(tree: ast.Module) -> set[str]:
    """Every name the module defines or binds (its classes' attributes included)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.rpartition(".")[2])
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)  # __slots__ entries
    return names


def test_no_module_reads_another_modules_private_attributes() -> None:
    """``x._name`` where ``x`` is not ``self`` and no class of this module defines
    ``_name``: an object of another module read through its insides. (A subclass reading
    its base class's attributes through ``self`` is its own business; the asyncio internals
    are read in one module, ``_util/_asyncio_internals.py``, checked per Python.)"""
    found = [
        f"{name}: {ast.unparse(node)}"
        for name, tree in TREES.items()
        if name != "aiodist._util._asyncio_internals"
        for own in [_own_names(tree) | _FOREIGN_PRIVATE]
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and node.attr not in own
        and not (isinstance(node.value, ast.Name) and node.value.id in {"self", "cls"})
    ]
    assert found == []


def _from_base(name: str, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` statement of module ``name`` reads from."""
    if not node.level:
        return node.module or ""
    package = name.split(".")
    if MODULES[name].name != "__init__.py":
        package.pop()
    package = package[: len(package) - node.level + 1]
    return ".".join([*package, *([node.module] if node.module else [])])


def _functions() -> Iterator[tuple[str, int]]:
    for name, tree in TREES.items():
        yield from _functions_in(name, tree.body)


def _functions_in(prefix: str, body: list[ast.stmt]) -> Iterator[tuple[str, int]]:
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            yield f"{prefix}.{node.name}", node.end_lineno - node.lineno + 1
            yield from _functions_in(f"{prefix}.{node.name}", node.body)
        elif isinstance(node, ast.ClassDef):
            yield from _functions_in(f"{prefix}.{node.name}", node.body)


def test_functions_read_in_one_screen() -> None:
    long = {name: lines for name, lines in _functions() if lines > MAX_FUNCTION_LINES}
    assert sorted(set(long) - LONG_TABLES) == []
    assert sorted(LONG_TABLES - set(long)) == [], "a listed table is short now: unlist it"


def test_at_most_three_long_modules() -> None:
    long = {
        name
        for name, path in MODULES.items()
        if len(path.read_text().splitlines()) > MAX_MODULE_LINES
    }
    assert len(LONG_MODULES) <= 3
    assert sorted(long - LONG_MODULES) == []


@pytest.mark.parametrize("unit", [unit for row in LAYERS for unit in row if unit])
def test_every_row_names_a_package_or_module(unit: str) -> None:
    assert f"aiodist.{unit}" in MODULES
