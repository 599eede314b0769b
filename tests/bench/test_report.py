"""`python -m bench.report`: every marked figure table in README.md and BENCHMARKS.md is the
table its JSON keeps; an edited number, a table with no marker, or a marker whose section names
no command for its JSON is reported, and a rewrite restores the table from its JSON."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.report import DOCS, check

REPO = Path(__file__).resolve().parents[2]
MARKED = "<!-- figure: bench/results/codec-qwen3-100m.json table 1 -->"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    for doc in DOCS:
        shutil.copy(REPO / doc, tmp_path / doc)
    shutil.copytree(REPO / "bench" / "results", tmp_path / "bench" / "results")
    return tmp_path


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_the_docs_match_their_json_as_ci_checks():
    done = subprocess.run(
        [sys.executable, "-m", "bench.report", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every figure table matches its JSON" in done.stdout


def test_an_edited_number_is_reported_and_a_rewrite_restores_it(root):
    doc = root / "BENCHMARKS.md"
    original = doc.read_text()
    table_line = original.split(MARKED, 1)[1].split("\n")[4]  # the first data row
    _edit(doc, table_line, table_line.replace("|", "| 9", 1))
    problems = check(root)
    assert len(problems) == 1, problems
    assert "differs from table 1 of bench/results/codec-qwen3-100m.json" in problems[0]
    assert problems[0].startswith("BENCHMARKS.md:")
    assert check(root, write=True) == []
    assert doc.read_text() == original


def test_a_figure_needs_a_marker_and_its_section_a_command(root):
    doc = root / "BENCHMARKS.md"
    _edit(doc, MARKED, "")  # the table loses its marker
    assert any("a figure with no source marker" in p for p in check(root))
    _edit(doc, "\n\n| step | density |", f"\n{MARKED}\n\n| step | density |")  # back
    _edit(doc, "--json bench/results/codec-qwen3-100m.json", "--json elsewhere.json")
    problems = check(root)
    assert any(
        "names no command writing bench/results/codec-qwen3-100m.json" in p for p in problems
    )


def test_a_marker_naming_a_missing_table_or_json_is_reported(root):
    doc = root / "BENCHMARKS.md"
    _edit(doc, MARKED, MARKED.replace("table 1", "table 9"))
    assert any("has 3 tables, not a table 9" in p for p in check(root))
    (root / "bench/results/codec-qwen3-100m.json").unlink()
    assert any("codec-qwen3-100m.json does not exist" in p for p in check(root))


def test_a_marker_left_without_its_table_is_reported(root):
    doc = root / "BENCHMARKS.md"
    text = doc.read_text()
    start = text.index(MARKED) + len(MARKED)
    table = text[start:].split("\n\n", 2)[1]  # the blank line after the marker, then the table
    doc.write_text(text.replace(table, "(the table was removed)", 1))
    assert any("a marker with no table below it" in p for p in check(root))


def test_a_readme_table_of_percentages_is_a_figure_and_fenced_tables_are_text(root):
    readme = root / "README.md"
    readme.write_text(
        readme.read_text()
        + "\n```\n| in a code fence | 5 % |\n|---|---|\n```\n\n| share | of runs |\n|---|---|\n"
        "| valid calls | 42 % |\n"
    )
    problems = check(root)
    assert [p for p in problems if "README.md" in p] == [
        f"README.md:{len(readme.read_text().splitlines()) - 2}: a figure with no source marker"
    ], problems
