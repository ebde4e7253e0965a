"""Directives that put aiodist's command lines into the docs at build time.

``program-output``
    Runs ``python -m MODULE ARGS...`` with this interpreter and shows its standard output
    as a literal block (what ``sphinxcontrib-programoutput`` does, for the one case we need).
``argparse-options``
    Imports ``module:function`` returning an :class:`argparse.ArgumentParser` and renders its
    options as a table: every spelling, the ``PET_<DEST>`` environment variable that
    supplies its default, and the help text.

Both read the code being documented, so the pages cannot drift from it; a command that
fails fails the build.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import subprocess
import sys
from typing import Any

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective


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
        rows: list[tuple[Any, ...]] = []
        for action in parser._actions:  # argparse offers no public iterator over its options
            if isinstance(action, argparse._HelpAction):
                continue
            if action.option_strings:
                names = [
                    s if action.nargs == 0 else f"{s} {action.metavar or action.dest.upper()}"
                    for s in action.option_strings
                ]
                env = f"PET_{action.dest.upper()}"
            else:
                names = [action.metavar or action.dest]
                env = ""
            rows.append((names, env, action.help or ""))

        table = nodes.table(classes=["argparse-options"])
        group = nodes.tgroup(cols=3)
        table += group
        for width in (30, 22, 48):
            group += nodes.colspec(colwidth=width)
        head = nodes.thead()
        group += head
        header = nodes.row()
        for title in ("option", "environment default", "meaning"):
            header += _cell(title)
        head += header
        body = nodes.tbody()
        group += body
        for names, env, help_text in rows:
            row = nodes.row()
            row += _cell(_literals(names))
            row += _cell(_literals([env]) if env else "")
            row += _cell(help_text)
            body += row
        return [table]


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("program-output", ProgramOutput)
    app.add_directive("argparse-options", ArgparseOptions)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
