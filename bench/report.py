"""Every figure table in README.md and BENCHMARKS.md, from the JSON in bench/results/ it came from.

A figure table follows a marker naming its source, the n-th table (from 1) the benchmark printed
and saved with its results (the JSON's `markdown` or `summary` text):

    <!-- figure: bench/results/codec-qwen3-0.6b.json table 2 -->

and the section (`## ...`) it is in gives the command that wrote that JSON (`--json` and a
path ending in its name). `python -m bench.report` rewrites each marked table from its JSON;
`--check` rewrites nothing and exits 1 naming each table that differs from its JSON, a marker
whose JSON or table is missing, a marker with no table below it, a section that names no command
for its JSON, and a figure table with no marker: a figure with no saved result is re-run or
removed (issue 47).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DOCS", "Table", "check", "main", "render", "tables_in"]

REPO = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "BENCHMARKS.md")
MARKER = re.compile(r"<!-- figure: (\S+\.json) table (\d+) -->")
# The keys under which a benchmark keeps the text it printed (bench/output.py).
SAVED_TEXT = ("markdown", "summary")
# A table whose rows carry a measured quantity is a figure (README also has tables of names).
FIGURE = re.compile(r"\|[^|\n]*\d(?:\.\d+)?\s?(?:%|(?:s|ms|MB|GB|kB|MB/s|GB/s|min|x)\b)")


@dataclass(frozen=True)
class Table:
    """A table in a document: its lines [start, stop) (0-based), its marker and section."""

    doc: str
    start: int
    stop: int
    text: str
    source: tuple[str, int] | None  # (JSON path, table number) from its marker
    section: str  # the enclosing `## ` section's text

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.start + 1}"


def tables_in(text: str) -> list[str]:
    """The tables of a text (runs of lines starting with `|`), in order."""
    found, current = [], []
    for line in [*text.split("\n"), ""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            found.append("\n".join(current))
            current = []
    return found


def _sections(lines: list[str]) -> list[str]:
    """For each line, the text of the `## ` section it is in."""
    starts = [i for i, line in enumerate(lines) if line.startswith("## ")] + [len(lines)]
    owner = ["\n".join(lines[: starts[0]])] * starts[0]
    for a, b in itertools.pairwise(starts):
        owner += ["\n".join(lines[a:b])] * (b - a)
    return owner


def _tables(doc: str, text: str) -> list[Table]:
    """The tables of a document (outside code fences), each with the marker right above it."""
    sections = _sections(text.split("\n"))  # commands in code fences count
    lines = _outside_fences(text.split("\n"))
    found, i = [], 0
    while i < len(lines):
        if not lines[i].startswith("|"):
            i += 1
            continue
        stop = i
        while stop < len(lines) and lines[stop].startswith("|"):
            stop += 1
        before = next((x for x in reversed(lines[:i]) if x.strip()), "")
        marker = MARKER.fullmatch(before.strip())
        source = (marker.group(1), int(marker.group(2))) if marker else None
        found.append(Table(doc, i, stop, "\n".join(lines[i:stop]), source, sections[i]))
        i = stop
    return found


def _outside_fences(lines: list[str]) -> list[str]:
    """`lines` with those inside ``` fences blanked (their line numbers kept)."""
    out, fenced = [], False
    for line in lines:
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return out


def _orphan_markers(doc: str, text: str) -> list[str]:
    """Markers with no table right below them (the table was removed or moved)."""
    lines = _outside_fences(text.split("\n"))
    problems = []
    for i, line in enumerate(lines):
        if MARKER.fullmatch(line.strip()):
            after = next((x for x in lines[i + 1 :] if x.strip()), "")
            if not after.startswith("|"):
                problems.append(f"{doc}:{i + 1}: a marker with no table below it")
    return problems


def render(source: str, number: int, root: Path = REPO) -> str:
    """Table `number` (from 1) of the text the benchmark saved in `source`."""
    path = root / source
    if not path.is_file():
        raise LookupError(f"{source} does not exist")
    result = json.loads(path.read_text())
    if not isinstance(result, dict):
        raise LookupError(f"{source} keeps no printed table (not a JSON object)")
    text = next((result[k] for k in SAVED_TEXT if isinstance(result.get(k), str)), None)
    if text is None:
        raise LookupError(f"{source} keeps no printed table ({' or '.join(SAVED_TEXT)})")
    tables = tables_in(text)
    if not 1 <= number <= len(tables):
        raise LookupError(f"{source} has {len(tables)} tables, not a table {number}")
    return tables[number - 1]


def _problems(table: Table, root: Path) -> list[str]:
    if table.source is None:
        is_figure = table.doc == "BENCHMARKS.md" or FIGURE.search(table.text)
        return [f"{table.where}: a figure with no source marker"] if is_figure else []
    source, number = table.source
    try:
        want = render(source, number, root)
    except LookupError as exc:
        return [f"{table.where}: {exc}"]
    problems = []
    if not re.search(rf"--json[\s=]+\S*{re.escape(Path(source).name)}\b", table.section):
        problems.append(f"{table.where}: its section names no command writing {source}")
    if table.text != want:
        problems.append(f"{table.where}: differs from table {number} of {source}")
    return problems


def check(root: Path = REPO, *, write: bool = False) -> list[str]:
    """Every problem of the docs' figure tables; with `write`, marked tables are rewritten from
    their JSON first."""
    problems = []
    for doc in DOCS:
        path = root / doc
        text = path.read_text()
        tables = _tables(doc, text)
        if write:
            lines = text.split("\n")
            for table in reversed(tables):
                if table.source is not None:
                    with contextlib.suppress(LookupError):  # reported below
                        lines[table.start : table.stop] = render(*table.source, root).split("\n")
            path.write_text("\n".join(lines))
            tables = _tables(doc, path.read_text())
        problems += _orphan_markers(doc, path.read_text())
        for table in tables:
            problems += _problems(table, root)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.report", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    args = parser.parse_args(argv)
    problems = check(write=not args.check)
    for line in problems:
        print(line)
    if not problems:
        print("every figure table matches its JSON" if args.check else "tables rewritten")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
