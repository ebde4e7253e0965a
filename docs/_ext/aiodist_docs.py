"""Directives that put aiodist's command lines into the docs at build time.

``program-output``
    Runs ``python -m MODULE ARGS...`` with this interpreter and shows its standard output
    as a literal block (what ``sphinxcontrib-programoutput`` does, for the one case we need).
``argparse-options``
    Imports ``module:function`` returning an :class:`argparse.ArgumentParser` and renders its
    options as a table: every spelling, the ``PET_<DEST>`` environment variable that
    supplies its default, and the help text.
``environment-variables``
    Renders the rows of one origin (``aiodist`` or ``torch``) of the table in
    ``aiodist._util._environment``, each variable a target of the ``envvar`` role.

They read the code being documented, so the pages cannot drift from it; a command that
fails fails the build.

The performance page reads the benchmarks' results the same way:

``{bench}`FILE; HEADING; ROW; COLUMN[; PART]```
    A role: the text of one cell of a table in ``bench/results/FILE`` (the first table under
    the heading ``HEADING`` with that row and column; ``ROW`` matches a row's first cell, or
    its first cells joined by ", ", backquotes left out; ``PART`` picks the n-th of the
    cell's values written ``a / b``, counting from 1). A lookup that finds no such cell fails the build, so every
    figure of the page's summary table is one of the results files'.
``include-read``
    A results file included into a page is shown with the words of the user documentation
    where the file names aiodist's internals (:data:`PUBLIC_WORDS`).

It also links a name that a docstring spells through another module than the one it is
documented in (``DistUsageError`` in ``aiodist``'s namespace, ``aiodist.store.Store``) to the
entry of the same object, when the name resolves to exactly that object.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective, SphinxRole
from sphinx.util.nodes import make_id


def _clean_env() -> dict[str, str]:
    """The build's environment without the variables that change a command's defaults."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env["COLUMNS"] = "88"  # argparse wraps at the terminal width; fix it for stable pages
    return env


class ProgramOutput(SphinxDirective):
    """``.. program-output:: aiodist.run --help`` shows ``python -m aiodist.run --help``."""

    required_arguments = 1
    final_argument_whitespace = True
    option_spec = {"caption": directives.unchanged}  # noqa: RUF012  (docutils' API)

    def run(self) -> list[nodes.Node]:
        argv = shlex.split(self.arguments[0])
        proc = subprocess.run(
            [sys.executable, "-m", *argv],
            capture_output=True,
            text=True,
            env=_clean_env(),
            timeout=60,
            check=False,
        )
        if proc.returncode != 0:
            raise self.error(
                f"python -m {self.arguments[0]} exited with {proc.returncode}: {proc.stderr}"
            )
        block = nodes.literal_block(proc.stdout, proc.stdout, language="text")
        caption = self.options.get("caption")
        if caption is None:
            return [block]
        container = nodes.container("", literal_block=True, classes=["literal-block-wrapper"])
        container += nodes.caption(caption, caption)
        container += block
        return [container]


_OPTION = re.compile(r"(?<![\w-])(--?[a-z][\w-]*)")


def _cell(content: nodes.Node | str) -> nodes.entry:
    entry = nodes.entry()
    if isinstance(content, str):
        entry += nodes.paragraph(text=content)
    else:
        entry += content
    return entry


def _literals(texts: list[str]) -> nodes.paragraph:
    para = nodes.paragraph()
    for i, text in enumerate(texts):
        if i:
            para += nodes.Text(", ")
        para += nodes.literal(text, text)
    return para


def _help(text: str) -> nodes.paragraph:
    """Help text with the options it names as literals, and no smart dashes or quotes."""
    para = nodes.paragraph(support_smartquotes=False)
    for i, part in enumerate(_OPTION.split(text)):
        if i % 2:
            para += nodes.literal(part, part)
        elif part:
            para += nodes.Text(part)
    return para


class ArgparseOptions(SphinxDirective):
    """``.. argparse-options:: aiodist.launcher:get_args_parser`` renders the options table."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        module_name, _, func_name = self.arguments[0].partition(":")
        saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("PET_")}
        try:
            parser: argparse.ArgumentParser = getattr(
                importlib.import_module(module_name), func_name
            )()
        finally:
            os.environ.update(saved)
        table = nodes.table(classes=["argparse-options"])
        group = nodes.tgroup(cols=2)
        table += group
        for width in (40, 60):
            group += nodes.colspec(colwidth=width)
        head = nodes.thead()
        group += head
        header = nodes.row()
        for title in ("option, and the variable for its default", "meaning"):
            header += _cell(title)
        head += header
        body = nodes.tbody()
        group += body
        for action in parser._actions:  # argparse offers no public iterator over its options
            if isinstance(action, argparse._HelpAction):
                continue
            names = nodes.entry()
            if action.option_strings:
                first, *others = action.option_strings
                if action.nargs != 0:
                    first = f"{first} {action.metavar or action.dest.upper()}"
                names += _literals([first])
                if others:
                    also = nodes.paragraph(text="also ")
                    also += _literals(others).children
                    names += also
                names += _literals([f"PET_{action.dest.upper()}"])
            else:
                names += _literals([action.metavar or action.dest])
            row = nodes.row()
            row += names
            row += _cell(_help(action.help or ""))
            body += row
        return [table]


_CODE = re.compile(r"`([^`]+)`")


def _inline_code(text: str) -> nodes.paragraph:
    """``text`` with its backquoted parts as literals."""
    para = nodes.paragraph(support_smartquotes=False)
    for i, part in enumerate(_CODE.split(text)):
        if i % 2:
            para += nodes.literal(part, part)
        elif part:
            para += nodes.Text(part)
    return para


class EnvironmentVariables(SphinxDirective):
    """``.. environment-variables:: aiodist`` renders that origin's rows of the table."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        module = importlib.import_module("aiodist._util._environment")
        # The page shows the module's table: rebuild it when the module changes.
        self.env.note_dependency(str(module.__file__))
        origin = self.arguments[0]
        rows = [v for v in module.VARIABLES if v.origin == origin]
        if not rows:
            raise self.error(f"no environment variable has the origin {origin!r}")
        table = nodes.table(classes=["environment-variables"])
        group = nodes.tgroup(cols=4)
        table += group
        for width in (27, 17, 33, 23):
            group += nodes.colspec(colwidth=width)
        head = nodes.thead()
        group += head
        header = nodes.row()
        for title in ("variable", "when unset", "meaning", "read by"):
            header += _cell(title)
        head += header
        body = nodes.tbody()
        group += body
        std = self.env.get_domain("std")
        for variable in rows:
            node_id = make_id(self.env, self.state.document, "envvar", variable.name)
            name = _literals([variable.name])
            name["ids"].append(node_id)
            self.set_source_info(name)
            std.note_object("envvar", variable.name, node_id, location=name)
            row = nodes.row()
            row += _cell(name)
            for text in (variable.default, variable.meaning, variable.read_by):
                row += _cell(_inline_code(text))
            body += row
        return [table]


#: The benchmarks' results files, which the performance page reads.
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


class ResultsLookupError(LookupError):
    """A ``bench`` role that names no cell of a results file."""


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def results_tables(text: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """The Markdown tables of a results file: (the heading above it, header, rows)."""
    tables: list[tuple[str, list[str], list[list[str]]]] = []
    heading = ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif (
            line.startswith("|")
            and i + 1 < len(lines)
            and re.fullmatch(r"\|?(\s*:?-+:?\s*\|)+\s*:?-*:?\s*", lines[i + 1].strip())
        ):
            header, rows = _cells(line), []
            i += 2
            while i < len(lines) and lines[i].strip().startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            tables.append((heading, header, rows))
            continue
        i += 1
    return tables


def results_cell(spec: str, results: Path = RESULTS) -> str:
    """The cell ``FILE; HEADING; ROW; COLUMN[; PART]`` names (the ``bench`` role's text)."""
    parts = [p.strip() for p in spec.split(";")]
    if len(parts) not in (4, 5) or not all(parts):
        raise ResultsLookupError(f"{spec!r}: expected FILE; HEADING; ROW; COLUMN[; PART]")
    name, heading, row, column = parts[:4]
    path = results / name
    if path.parent != results or not path.is_file():
        raise ResultsLookupError(f"{spec!r}: no results file {path}")
    for title, header, rows in results_tables(path.read_text(encoding="utf-8")):
        if title != heading or column not in header:
            continue
        for cells in rows:
            plain = [c.replace("`", "") for c in cells]
            if any(", ".join(plain[:k]) == row for k in range(1, len(cells) + 1)):
                value = cells[header.index(column)]
                if len(parts) == 5:
                    values = [v.strip() for v in value.split(" / ")]
                    index = int(parts[4]) if parts[4].isdigit() else 0
                    if not 1 <= index <= len(values):
                        raise ResultsLookupError(
                            f"{spec!r}: the cell {value!r} has no part {index}"
                        )
                    value = values[index - 1]
                if not value or value == "-":
                    raise ResultsLookupError(f"{spec!r}: the cell is empty")
                return value
    raise ResultsLookupError(
        f"{spec!r}: no table under the heading {heading!r} of {path.name} has the row {row!r} "
        f"and the column {column!r}"
    )


class BenchFigure(SphinxRole):
    """``{bench}`latency.md; 2 ranks, shm; all_reduce 8 B; async; 1``` shows that cell."""

    def run(self) -> tuple[list[nodes.Node], list[nodes.system_message]]:
        try:
            value = results_cell(self.text)
        except ResultsLookupError as exc:
            msg = self.inliner.reporter.error(str(exc), line=self.lineno)
            return [self.inliner.problematic(self.rawtext, self.rawtext, msg)], [msg]
        self.env.note_dependency(str(RESULTS / self.text.split(";")[0].strip()))
        return [nodes.inline(value, value, classes=["bench-figure"])], []


#: What the user documentation calls the internals that the results files name: a results
#: file included into a page is shown with these words (the benchmarks write them too, from
#: now on). ``tests/test_performance_page.py`` checks that no internal name is left.
PUBLIC_WORDS: list[tuple[str, str]] = [
    # bench/compare.py: the process group's transport, as the library's class name.
    (
        r"RoutedTransport",
        "shared memory between the ranks of this host (TCP to other hosts)",
    ),
    (r"(?<=AIODIST_SHM=0 transport: )TCPTransport", "TCP over loopback"),
    # bench/shm.py: what each mode of its tables runs.
    (
        r"Modes: `tcp` and `shm` run the transport algorithms of\s+`aiodist\.collectives` over"
        r"\s+`TCPTransport` and `ShmTransport`; `direct` and `shared` run\s+"
        r"`aiodist\.collectives\.shm` on private arrays and on arrays from\s+"
        r"`aiodist\._shared_array`\.",
        "Modes: `tcp` and `shm` run aiodist's collective algorithms alone (no process group, "
        "no operation layer) over TCP and over shared memory; `direct` and `shared` run its "
        "shared-memory all_reduce alone, on private arrays and on arrays allocated in shared "
        "memory. All four leave out the layers that a call through the public API goes "
        "through: they are the floor under the figures of the summary table, not what a "
        "call costs.",
    ),
]


def public_text(text: str) -> str:
    """A results file's text with :data:`PUBLIC_WORDS` applied."""
    for pattern, words in PUBLIC_WORDS:
        text = re.sub(pattern, words, text)
    return text


def _include_read(
    app: Sphinx, relative_path: Path, parent_docname: str, content: list[str]
) -> None:
    if Path(app.srcdir, relative_path).resolve().parent == RESULTS:
        content[0] = public_text(content[0])


def _import(dotted: str) -> Any:
    """The object ``dotted`` names (longest importable module, then attributes), or ``None``."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
        return obj
    return None


def _resolve_reexport(
    app: Sphinx, env: Any, node: addnodes.pending_xref, contnode: nodes.TextElement
) -> nodes.reference | None:
    """Link an unresolved aiodist name to the documented entry of the same object."""
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip(".~")
    module, cls = node.get("py:module") or "", node.get("py:class")
    candidates = [target, f"{module}.{target}", f"aiodist.{target}"]
    if cls:
        candidates.insert(0, f"{module}.{cls}.{target}")
    domain = env.get_domain("py")
    for candidate in candidates:
        if not candidate.startswith("aiodist."):
            continue
        obj = _import(candidate)
        # Equal small ints and strings share identity: only match real objects.
        if obj is None or isinstance(obj, int | float | str | bytes | tuple):
            continue
        same = [
            (entry.aliased, len(name), name)
            for name, entry in domain.objects.items()
            if name.startswith("aiodist.") and _import(name) is obj
        ]
        if same:
            name = min(same)[2]
            return domain.resolve_xref(
                env, node["refdoc"], app.builder, "obj", name, node, contnode
            )
    return None


def setup(app: Sphinx) -> dict[str, Any]:
    # Sphinx rebuilds everything when a config value changes, not when an extension does;
    # this one's value is the extension's own source, so editing it rebuilds the pages.
    source = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    app.add_config_value("aiodist_docs_source", source, "env")
    app.add_directive("program-output", ProgramOutput)
    app.add_directive("argparse-options", ArgparseOptions)
    app.add_directive("environment-variables", EnvironmentVariables)
    app.add_role("bench", BenchFigure())
    app.connect("include-read", _include_read)
    app.connect("missing-reference", _resolve_reexport)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
