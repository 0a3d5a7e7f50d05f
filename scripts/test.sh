#!/usr/bin/env bash
# The test command (README): build or reuse the venvs, run the whole suite on the vLLM matrix.
#
#   bash scripts/test.sh                         # everything: unit + op (no vLLM) + vLLM 0.27.1 0.29.0 0.32.0
#   VLLM_SINKS_VERSIONS="0.29.0" bash scripts/test.sh      # one vLLM version
#   VLLM_SINKS_PYTEST_ARGS="-m 'not slow'" bash scripts/test.sh
#
# Each venv first compiles the Hopper kernel for sm_90a under its Triton (3.8.0 in the no-vLLM venv,
# as vLLM 0.33 installs; 3.7.1 in the others, as vLLM 0.27-0.32 do): a Triton release whose Gluon
# API breaks the kernel fails the run here, without a GPU.
# Layout of the run: tests/unit + tests/op + tests/gpu in a venv without vLLM (the op must work there;
# gpu tests skip cleanly on CPU); tests/unit + tests/vllm in each vLLM venv (tests/unit again because
# each venv pins a different transformers, which the SinkFuser must trace). Venvs build in the
# background, one after another, while earlier ones test. JUnit XML goes to $VLLM_SINKS_TEST_OUT.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
versions=${VLLM_SINKS_VERSIONS:-0.27.1 0.29.0 0.32.0}
out=${VLLM_SINKS_TEST_OUT:-$repo/out/test}
rm -rf "$out"; mkdir -p "$out"
export VLLM_CPU_KVCACHE_SPACE=1 PYTHONUNBUFFERED=1
start=$(date +%s)

# Build chain in the background: none first (fastest to be useful), then each vLLM version.
(
  for v in none $versions; do
    if venv=$(scripts/venv.sh "$v" 2>"$out/venv-$v.log" | tail -n 1); then
      echo "$venv" > "$out/venv-$v.path"
    fi
    touch "$out/venv-$v.done"
  done
) &
builder=$!
trap 'kill $builder 2>/dev/null' EXIT

wait_venv() {  # prints the venv path once built, or fails
  while [ ! -f "$out/venv-$1.done" ]; do sleep 5; done
  if [ ! -f "$out/venv-$1.path" ]; then
    echo "test.sh: building the venv for $1 failed:" >&2; tail -n 40 "$out/venv-$1.log" >&2; return 1
  fi
  cat "$out/venv-$1.path"
}

status=0
run_pytest() {  # name venv paths...
  local name=$1 venv=$2; shift 2
  local t0; t0=$(date +%s)
  echo "=== [$name] pytest $* ($(date +%T))"
  eval "\"$venv/bin/python\" -m pytest -p no:cacheprovider --junitxml=\"$out/junit-$name.xml\" \
    ${VLLM_SINKS_PYTEST_ARGS:-} $*"
  local rc=$?
  # pytest exits 5 when nothing was collected (e.g. a filtered run): not a failure of this script.
  if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then status=1; fi
  echo "=== [$name] rc=$rc in $(( $(date +%s) - t0 )) s"
}

compile_hopper_kernel() {  # name venv: the Hopper kernel must compile for sm_90a under this Triton
  local name=$1 venv=$2 case
  for case in mimo gpt-oss gpt-oss-gp8; do  # both paths of the tile loop (kernel log, run 13)
    echo "=== [$name] compile check: benchmarks/kernels/inspect_window_walk.py --case $case"
    if ! "$venv/bin/python" benchmarks/kernels/inspect_window_walk.py --case "$case" \
        >"$out/compile-$name-$case.log" 2>&1; then
      echo "compile check FAILED ($name, $case):"; tail -n 30 "$out/compile-$name-$case.log"; status=1
    else head -n 1 "$out/compile-$name-$case.log"; fi
  done
}

if venv=$(wait_venv none); then
  compile_hopper_kernel no-vllm "$venv"
  run_pytest no-vllm "$venv" tests/unit tests/op tests/gpu
else status=1; fi
for v in $versions; do
  if venv=$(wait_venv "$v"); then
    compile_hopper_kernel "vllm-$v" "$venv"
    run_pytest "vllm-$v" "$venv" tests/unit tests/vllm
  else status=1; fi
done
wait $builder 2>/dev/null

"${PYTHON:-python3}" - "$out" "$(( $(date +%s) - start ))" <<'PY'
import glob, sys, xml.etree.ElementTree as ET
totals = dict(tests=0, failures=0, errors=0, skipped=0)
for path in sorted(glob.glob(f"{sys.argv[1]}/junit-*.xml")):
    for suite in ET.parse(path).getroot().iter("testsuite"):
        for key in totals:
            totals[key] += int(suite.get(key, 0))
failed = totals["failures"] + totals["errors"]
passed = totals["tests"] - failed - totals["skipped"]
print(f"whole matrix in {sys.argv[2]} s")
print(f"{passed} passed, {failed} failed, {totals['skipped']} skipped")
PY
exit $status
