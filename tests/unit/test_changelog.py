"""CHANGELOG.md is written for the version being made: its newest heading is the package version
(pyproject.toml and vllm_sinks/version.py agree on it), and the generated table of what each patch
fixes on which vLLM releases sits under that heading (its contents: tests/unit/test_docs_table.py)."""

from __future__ import annotations

import pathlib
import re
import sys

import vllm_sinks
from vllm_sinks.patches import PATCHES, docs

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHANGELOG = ROOT / "CHANGELOG.md"

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def versions(text: str) -> list[tuple[str, int]]:
    """(version, offset) of each `## X.Y.Z ...` heading, newest (first) first."""
    return [(m.group(1), m.start()) for m in re.finditer(r"^## (\d+\.\d+\.\d+)\b", text, re.M)]


def test_the_newest_heading_is_the_package_version():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert vllm_sinks.__version__ == project
    assert versions(CHANGELOG.read_text())[0][0] == project


def test_the_generated_table_is_under_the_newest_version():
    text = CHANGELOG.read_text()
    found = versions(text)
    start = found[0][1]
    stop = found[1][1] if len(found) > 1 else len(text)
    block = text.index(docs.begin(docs.CHANGELOG))
    assert start < block < stop, "the generated block belongs under the newest version's heading"
    body = text[block:text.index(docs.end(docs.CHANGELOG))]
    assert all(f"| `{p.name}` |" in body for p in PATCHES)
