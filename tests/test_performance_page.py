"""The figures users read about aiodist's speed come from the benchmarks' results files.

**User pages**, whose figures are checked here:

* ``docs/performance.md``: its own text; the results files it includes are the results
  themselves, and its summary's figures are ``{bench}`` lookups into them, each checked to
  name a cell (the site's build checks them too);
* ``docs/index.md`` and ``README.md``, the front pages;
* ``docs/failures.md`` (the times to error, from ``bench/faults.py``) and
  ``docs/guides/sync.md`` (the cost of a blocking call, from ``bench/latency.py``), which
  quote a benchmark in passing.

Not user pages in this sense: ``docs/architecture.md``, which records how aiodist was built
and the measurements taken along the way, each with its date and script; and
``docs/elastic.md``, whose times are the output of its own example program.

A *figure* is a number with a unit of time, rate, size or ratio (µs, ms, s, x, ops/s, GB/s,
KiB, MiB, ...) in a page's prose or tables, outside code blocks and inline code. It is *in
a results file* when one of ``bench/results/*.md`` has the same number with the same unit,
inline or in a table whose header or text names that unit, written as on the page or as
the page rounds it (19 µs for 19.2 µs). A bound ("up to 1 s", "within 10 s") is a promise
or a setting, not a measurement, and is not a figure.

The file also checks what the performance page shows of the results files (no internal class
or module names) and that the benchmarks can be imported and run without the optional
packages (torch, matplotlib, mpi4py), writing their results to a temporary folder unless
``--write`` is given.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
USER_PAGES = (
    "docs/performance.md",
    "docs/index.md",
    "README.md",
    "docs/failures.md",
    "docs/guides/sync.md",
)
#: Packages a benchmark may use only where it runs, never at import.
OPTIONAL = ("torch", "matplotlib", "mpi4py")

sys.path.insert(0, str(DOCS / "_ext"))
import aiodist_docs  # noqa: E402  (the extension that renders the page, found through docs/_ext)

_NUM = r"\d+(?:,\d{3})*(?:\.\d+)?"
_UNIT = r"µs|us|ms|s|min|x|ops/s|requests/s|calls/s|GB/s|MB/s|B|KiB|MiB|GiB|%|k"
_FIGURE = re.compile(
    rf"(?<![\w.,/-])(?P<a>{_NUM})(?:\s*(?:-|\u2013|to)\s*(?P<b>{_NUM}))?\s?(?P<unit>{_UNIT})(?![\w/])"
)
_BOUND = re.compile(r"(up to|within|under|at most|at least|below|more than|less than)\s+$")
_SAME_UNIT = {"us": "µs"}


def _unit(unit: str) -> str:
    return _SAME_UNIT.get(unit, unit)


def prose(text: str) -> str:
    """A Markdown page without its front matter, code blocks, inline code and comments."""
    text = re.sub(r"\A---\n.*?\n---\n", "", text, flags=re.S)
    text = re.sub(r"^(`{3,}|~{3,}).*?^\1\s*$", "", text, flags=re.S | re.M)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"(`+).+?\1", " ", text, flags=re.S)
    return re.sub(r"\]\([^)]*\)", "]", text)  # link targets


def figures(text: str) -> list[tuple[str, str]]:
    """The figures of a page's prose: (number as written, unit), both ends of a range."""
    found = []
    for m in _FIGURE.finditer(text):
        if _BOUND.search(text[max(0, m.start() - 20) : m.start()]):
            continue
        found += [
            (number.replace(",", ""), _unit(m["unit"]))
            for number in (m["a"], m["b"])
            if number is not None
        ]
    return found


def _units_named(text: str) -> set[str]:
    """The units a table's header or its file's text names for bare numbers: "p50 (us)",
    "ops/s", "per call in µs"."""
    return {
        _unit(u) for u in re.findall(rf"(?:\(|\bin |^)({_UNIT})(?:\)|[;,.\s]|$)", text, flags=re.M)
    }


def results_index() -> dict[str, set[str]]:
    """Every number of the results files (commas dropped), with the units it may carry."""
    index: dict[str, set[str]] = {}
    for path in sorted(RESULTS.glob("*.md")):
        text = path.read_text(encoding="utf-8")
        for number, unit in figures(text):
            index.setdefault(number, set()).add(unit)
        file_units = _units_named(
            "\n".join(line for line in text.splitlines() if not line.startswith("|"))
        )
        for _heading, header, rows in aiodist_docs.results_tables(text):
            for cells in rows:
                for column, cell in zip(header, cells, strict=False):
                    units = _units_named(column) | file_units
                    for number in re.findall(rf"(?<![\w.]){_NUM}(?![\w.])", cell):
                        index.setdefault(number.replace(",", ""), set()).update(units)
    return index


def in_results(number: str, unit: str, index: dict[str, set[str]]) -> bool:
    """Whether the figure, or a number that the page rounds to it, is in the results."""
    if unit in index.get(number, set()):
        return True
    digits = len(number.partition(".")[2])
    scale = 1000.0 if unit == "k" else 1.0
    value = float(number)
    for candidate, units in index.items():
        if (unit in units or unit == "k") and round(float(candidate) / scale, digits) == value:
            return True
    return False


def test_the_figure_extractor() -> None:
    text = prose(
        "---\ntocdepth: 2\n---\n# t\n\n11.2 µs and 2-4x, `3.5 ms` no, 62.5k ops/s, 8 B, "
        "within 10 s, timeout + up to 1 s, 2 ranks, 1.72x.\n\n```sh\nsleep 5 s\n```\n"
    )
    assert figures(text) == [
        ("11.2", "µs"),
        ("2", "x"),
        ("4", "x"),
        ("62.5", "k"),
        ("8", "B"),
        ("1.72", "x"),
    ]
    index = {"19.2": {"µs"}, "62495": {"ops/s"}, "0.60": {"GB/s"}}
    assert in_results("19", "µs", index)
    assert in_results("19.2", "µs", index)
    assert in_results("62.5", "k", index)
    assert not in_results("0.60", "s", index)  # the number, but not the unit
    assert not in_results("19.3", "µs", index)


@pytest.mark.parametrize("page", USER_PAGES)
def test_every_figure_of_a_user_page_is_in_a_results_file(page: str) -> None:
    index = results_index()
    missing = [
        f"{number} {unit}"
        for number, unit in figures(prose((ROOT / page).read_text(encoding="utf-8")))
        if not in_results(number, unit, index)
    ]
    assert not missing, (
        f"{page} quotes figures that no bench/results/*.md file has: {missing}; read them "
        "from the results with the {bench} role (docs/_ext/aiodist_docs.py), or rerun the "
        "benchmark with --write"
    )


_ROLE = re.compile(r"\{bench\}`([^`]+)`")


@pytest.mark.parametrize("page", USER_PAGES)
def test_every_bench_lookup_names_a_cell(page: str) -> None:
    text = (ROOT / page).read_text(encoding="utf-8")
    failed = []
    for spec in _ROLE.findall(text):
        try:
            aiodist_docs.results_cell(spec)
        except aiodist_docs.ResultsLookupError as exc:
            failed.append(str(exc))
    assert not failed, "\n".join(failed)


def test_the_summary_reads_every_figure_from_the_results() -> None:
    """The summary table's cells hold lookups (and units), never a hand-copied figure."""
    text = (DOCS / "performance.md").read_text(encoding="utf-8")
    summary = text.split("## In short", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in summary.splitlines() if line.startswith("| ")][1:]
    assert len(rows) >= 5, "the summary table is missing"
    for row in rows:
        for cell in row.strip("| ").split(" | ")[1:]:
            assert not figures(prose(cell)), f"a figure written by hand in the summary: {row}"
    assert len(rows) <= 12, "keep the summary short: details go below it"


_INCLUDE = re.compile(r"```\{include\} \.\./bench/results/(\S+)\n((?::[\w-]+:.*\n)*)```")
_INTERNAL = re.compile(
    r"\b\w+(Transport|Workspace)\b|aiodist\._\w+|aiodist\.(collectives|transport|group|backends)"
    r"\b|`_\w+`"
)


def test_the_page_shows_no_internal_names() -> None:
    page = (DOCS / "performance.md").read_text(encoding="utf-8")
    includes = _INCLUDE.findall(page)
    assert includes, "docs/performance.md includes no results file"
    shown = [prose(page)]
    for name, options in includes:
        text = aiodist_docs.public_text((RESULTS / name).read_text(encoding="utf-8"))
        end = re.search(r':end-before: "?(.*?)"?\n', options)
        if end:
            assert end[1] in text, f"{name}: :end-before: text not found"
            text = text.split(end[1], 1)[0]
        shown.append(text)
    names = sorted({m[0] for text in shown for m in _INTERNAL.finditer(text)})
    assert not names, (
        f"internal names on the performance page: {names}; give them the user "
        "documentation's words in aiodist_docs.PUBLIC_WORDS (and in the benchmark's output)"
    )


def test_public_words_apply_to_the_compare_report() -> None:
    text = "- aiodist transport: RoutedTransport\n- AIODIST_SHM=0 transport: TCPTransport\n"
    assert not _INTERNAL.search(aiodist_docs.public_text(text))


def _benches() -> list[Path]:
    return sorted(BENCH.glob("*.py"))


@pytest.mark.parametrize("path", _benches(), ids=lambda p: p.name)
def test_a_benchmark_imports_no_optional_package_at_load(path: Path) -> None:
    """``--help`` and the results must not need torch, matplotlib or mpi4py: they are
    imported where they are used, and their columns are left out, saying so, without them."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            top += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            top.append(node.module)
    assert not [m for m in top if m.split(".")[0] in OPTIONAL], f"{path.name}: {top}"


@pytest.mark.parametrize("path", _benches(), ids=lambda p: p.name)
def test_a_benchmark_writes_to_a_temp_folder_unless_told(path: Path) -> None:
    source = path.read_text(encoding="utf-8")
    assert '"--write"' in source, f"{path.name}: no --write option"
    assert "mkdtemp(" in source, f"{path.name}: results go to a temp folder without --write"
    if "matplotlib" in source:
        assert "plot skipped: matplotlib is not installed (pip install matplotlib)" in source
        assert "'.[bench]'" in (DOCS / "performance.md").read_text(encoding="utf-8")
