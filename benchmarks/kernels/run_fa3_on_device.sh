#!/usr/bin/env bash
# On the lent GPU machine: the FA3-structured window kernel's smoke test, its comparison against the
# committed walk, FA3 and upstream (compare_fa3_walk.py), and its GPU tests, under the Triton of
# TRITON_TARBALL (a slim build, carried; the machine's own otherwise). Each step is bounded by a
# timeout: a kernel that deadlocks on its mbarriers costs that step, not the call.
#
#   TRITON_TARBALL=.gpu/triton-3.8.0-slim.tar.xz PEERS=.gpu/peers bash benchmarks/kernels/run_fa3_on_device.sh [TEST_FILTER]
#   (BENCH_ARGS="--only committed,fa3,fa3-overlap" picks the variants timed; SMOKE_S, BENCH_S,
#   TESTS_S bound the steps)
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-out/device}
mkdir -p "$out"
export VLLM_SINKS_FA3_TESTS=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
. benchmarks/kernels/device_triton.sh  # TRITON_TARBALL, PTXAS_TARBALL
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee "$out/versions.txt"
t0=$(date +%s)
# The smoke test: the plain kernel (against the walk) and the overlap (tile pairs) on one case each.
timeout "${SMOKE_S:-150}" python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_window_fa3_gpu.py \
  -k "(test_against_reference_and_committed_walk or test_overlap_against_reference) and mimo-window and key0 and bfloat16 and not pingpong and not tiles" \
  2>&1 | grep -v -e nanobind -e '^ - leaked' -e refleaks | tail -n 15 | tee "$out/smoke.txt"
grep -q " passed" "$out/smoke.txt" || { echo "smoke test failed: stopping"; exit 1; }
echo "smoke: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout "${BENCH_S:-300}" python3 benchmarks/kernels/compare_fa3_walk.py --peers "${PEERS:-.gpu/peers}" \
  ${BENCH_ARGS:-} 2>&1 | grep -v -i warn | tee "$out/bench.txt" | tail -n 40
echo "bench: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
# Workers share the GPU: the time goes into compiling kernel variants, on the CPU.
xdist=(); python3 -c 'import xdist' 2>/dev/null && xdist=(-n 8)
timeout "${TESTS_S:-240}" python3 -m pytest -q -p no:cacheprovider "${xdist[@]}" tests/gpu/test_window_fa3_gpu.py \
  ${1:+-k "$1"} 2>&1 | grep -v -e nanobind -e '^ - leaked' -e refleaks | tail -n 30 > "$out/tests.txt"
tail -n 8 "$out/tests.txt"
echo "tests: $(( $(date +%s) - t0 )) s"
