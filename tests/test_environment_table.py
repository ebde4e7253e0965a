"""The table of environment variables (``aiodist/_util/_environment.py``) keeps up with the code:
every ``AIODIST_*`` variable the package names is in it, and every row's modules still
name its variable. ``docs/environment.md`` renders the table."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

from aiodist._util._environment import VARIABLES

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "aiodist"
_AIODIST_VAR = re.compile(r"AIODIST_[A-Z0-9_]+")


def _variables_named(tree: ast.AST) -> set[str]:
    """``AIODIST_*`` names used as strings: whole string literals (``environ.get("...")``)
    and keyword arguments (``env.update(AIODIST_RUN_ID=...)``)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        elif isinstance(node, ast.keyword) and node.arg is not None:
            text = node.arg
        else:
            continue
        if _AIODIST_VAR.fullmatch(text):
            found.add(text)
    return found


def _python_names(tree: ast.AST) -> set[str]:
    """Names the module binds (``AIODIST_MAGIC = ...``): constants, not variables, even
    when ``__all__`` lists them as strings."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.rpartition(".")[2])
    return names


def _sources() -> dict[str, ast.Module]:
    return {
        path.relative_to(ROOT).as_posix(): ast.parse(path.read_text(), str(path))
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "_environment.py"
    }


def test_every_aiodist_variable_the_code_names_is_in_the_table() -> None:
    trees = _sources()
    bound = set().union(*(_python_names(tree) for tree in trees.values()))
    listed = {v.name for v in VARIABLES}
    missing = {}
    for path, tree in trees.items():
        for name in sorted(_variables_named(tree) - bound - listed):
            missing.setdefault(name, []).append(path)
    assert not missing, (
        f"environment variables missing from aiodist/_util/_environment.py's VARIABLES: {missing}"
    )


def test_the_scan_finds_variables_and_skips_constants() -> None:
    tree = ast.parse(
        "import os\n"
        "__all__ = ['AIODIST_MAGIC']\n"
        "AIODIST_MAGIC = 1\n"
        "os.environ.get('AIODIST_X', '1')\n"
        "env.update(AIODIST_Y='2')\n"
        "'''AIODIST_Z in a docstring'''\n"
    )
    assert _variables_named(tree) - _python_names(tree) == {"AIODIST_X", "AIODIST_Y"}


def test_every_row_names_modules_that_use_its_variable() -> None:
    stale = []
    for variable in VARIABLES:
        assert variable.modules, variable.name
        text = variable.name.partition("<")[0]  # PET_<OPTION>: the prefix
        for module in variable.modules:
            spec = importlib.util.find_spec(module)
            assert spec is not None and spec.origin is not None, module
            if text not in Path(spec.origin).read_text():
                stale.append(f"{variable.name}: {module}")
    assert not stale, f"modules that no longer name the variable of their row: {stale}"


def test_rows_are_unique_and_complete() -> None:
    names = [v.name for v in VARIABLES]
    assert len(names) == len(set(names)), names
    for variable in VARIABLES:
        assert variable.origin in ("aiodist", "torch"), variable
        assert variable.meaning.endswith("."), variable.name
        assert variable.read_by, variable.name
        assert variable.meaning.count("`") % 2 == 0, variable.name
        assert variable.default.count("`") % 2 == 0, variable.name
        assert variable.read_by.count("`") % 2 == 0, variable.name
    page = (ROOT / "docs" / "environment.md").read_text()
    for origin in {v.origin for v in VARIABLES}:
        assert f"{{environment-variables}} {origin}\n" in page, origin
