"""Every ``pip install`` line on the site and in the README can work as pasted: aiodist is
installed from its checkout (it is on no package index), and every extra named exists."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

from aiodist._arrays._intake import CUDA_INSTALL_HINT

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
EXTRAS = set(
    tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
)
# A pip command: up to the end of the line, an inline code span's end or a comment.
_PIP = re.compile(r"pip install ([^`\n#]+)")
# aiodist's checkout as pip names it, with its extras: ".[a,b]", "/path/to/aiodist[a]".
_CHECKOUT = re.compile(r"^(?:\.|/\S*aiodist)(?:\[(?P<extras>[\w,]+)\])?$")


def _install_lines() -> list[tuple[str, str]]:
    found = [
        (page.relative_to(ROOT).as_posix(), match.group(1).strip())
        for page in PAGES
        if "_build" not in page.parts
        for match in _PIP.finditer(page.read_text())
    ]
    hint = _PIP.search(CUDA_INSTALL_HINT)
    assert hint is not None
    return [*found, ("aiodist._arrays._intake.CUDA_INSTALL_HINT", hint.group(1))]


def test_every_install_line_names_the_checkout_and_real_extras() -> None:
    lines = _install_lines()
    assert len(lines) > 5, lines  # the pages do say how to install
    problems = []
    for where, line in lines:
        args = shlex.split(line.rstrip(")"))
        for i, arg in enumerate(args):
            if arg.startswith("-"):
                continue
            if re.fullmatch(r"aiodist(\[.*\])?", arg):
                problems.append(f"{where}: {line!r} installs aiodist from a package index")
                continue
            checkout = _CHECKOUT.match(arg)
            if checkout is None:
                continue  # another package, by its index name
            if i == 0 or args[i - 1] != "-e":
                problems.append(f"{where}: {line!r}: the checkout without -e")
            unknown = set((checkout.group("extras") or "").split(",")) - {""} - EXTRAS
            if unknown:
                problems.append(
                    f"{where}: {line!r} names extras {sorted(unknown)} that do not exist"
                )
    assert not problems, "\n".join(problems)
