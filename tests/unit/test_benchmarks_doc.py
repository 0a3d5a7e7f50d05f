"""docs/benchmarks.md says which script makes each of its tables, and benchmarks/ holds nothing the
doc does not name: a reader can go from any table to the script that reproduces it, and from any
script to what it is for."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "benchmarks.md"
SCRIPT = re.compile(r"`(benchmarks/[\w./-]+)")


def sections(text: str) -> list[tuple[str, list[str]]]:
    """(heading, lines) for each part of the doc, split at every markdown heading."""
    parts: list[tuple[str, list[str]]] = [("(top)", [])]
    for line in text.splitlines():
        if re.match(r"#{1,6} ", line):
            parts.append((line.lstrip("# ").strip(), []))
        else:
            parts[-1][1].append(line)
    return parts


def tables_without_a_script(text: str) -> list[str]:
    """Each table whose section, from its heading down to the table, names no existing script under
    benchmarks/ (a `backticked` path)."""
    missing = []
    for heading, lines in sections(text):
        for i, line in enumerate(lines):
            starts_table = line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|"))
            if not starts_table:
                continue
            named = [p for p in SCRIPT.findall("\n".join(lines[:i])) if (ROOT / p).is_file()]
            if not named:
                missing.append(f"{heading}: {line[:60]}")
    return missing


def test_every_table_names_the_script_that_makes_it():
    assert not tables_without_a_script(DOC.read_text())


def test_every_file_in_benchmarks_is_named_by_the_doc():
    text = DOC.read_text()
    files = [p for p in (ROOT / "benchmarks").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    unnamed = [str(p.relative_to(ROOT)) for p in files
               if str(p.relative_to(ROOT)) not in text and f"`{p.name}`" not in text]
    assert not unnamed, f"docs/benchmarks.md does not say what these are for: {unnamed}"


def test_the_check_finds_a_table_without_a_script():
    doc = ("# B\n\n## Made by a script\n\n`benchmarks/plugin_load.py` times it:\n\n| a |\n|---|\n| 1 |\n\n"
           "## Made by nothing\n\nSome prose, `benchmarks/no_such.py`.\n\n| b |\n|---|\n| 2 |\n")
    assert tables_without_a_script(doc) == ["Made by nothing: | b |"]
