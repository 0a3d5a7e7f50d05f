#!/usr/bin/env bash
# On the lent GPU machine (torch + triton + pytest there, no vLLM): the op's GPU tests and the
# benchmark table, in one call. Writes logs and tables under $OUT (default out/device).
#
#   bash benchmarks/kernels/run_on_device.sh            # GPU tests + benchmark tables (op cases,
#                                                       # full attention, MiMo pass, host cost)
#   bash benchmarks/kernels/run_on_device.sh sweep      # GPU tests + tile-shape sweep + table
#   bash benchmarks/kernels/run_on_device.sh tune       # the full-attention table of this GPU and
#                                                       # Triton (tune_full_attention.py, into the
#                                                       # package and $OUT/tables), then the stream
#   bash benchmarks/kernels/run_on_device.sh stream     # a server's stream of new shapes, a process
#                                                       # per path (benchmark_stream.py)
#   bash benchmarks/kernels/run_on_device.sh tests      # GPU tests only (GPU_TESTS: which files,
#                                                       # default tests/gpu)
#   bash benchmarks/kernels/run_on_device.sh bench      # table only
#   bash benchmarks/kernels/run_on_device.sh host       # GPU tests + MiMo pass + host cost
#                                                       # (the tables a host-side change moves)
#   bash benchmarks/kernels/run_on_device.sh dispatch   # GPU tests + full attention + host cost (the
#                                                       # tables a change of the routing moves)
#   bash benchmarks/kernels/run_on_device.sh profile    # ncu of the default shape + code dump + sweep
#   bash benchmarks/kernels/run_on_device.sh release    # one Triton release in one call: (TUNE=1)
#                                                       # `vllm-sinks tune` into the user's cache and
#                                                       # `vllm-sinks report`, the stream (STREAM_WORKLOADS,
#                                                       # STREAM_ROUNDS), host cost, then the GPU tests
#                                                       # in what is left of TEST_S seconds (8 files
#                                                       # under $OUT: what comes back from the device)
#
# TRITON_TARBALL=.gpu/triton-3.7.1-slim.tar.xz runs everything under that Triton instead of the
# machine's (a slimmed Triton wheel, packed outside this repo; carry it): users have 3.7.1 (vLLM 0.27-0.32),
# 3.8.x (0.33) and 3.9.0 (the vLLM on torch 2.15), the machine 3.6. PTXAS_TARBALL (pack_ptxas.sh)
# adds the ptxas that release's wheel ships (device_triton.sh). The benchmarks' peers come from
# benchmarks/kernels/fetch_peers.sh
# (carry .gpu/peers).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-out/device}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
. benchmarks/kernels/device_triton.sh  # TRITON_TARBALL, PTXAS_TARBALL
what=${1:-all}
status=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > "$out/gpu.txt" 2>&1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$out/gpu.txt"

if [ "$what" = profile ]; then
  # Nsight Compute on one launch of the default shape (stall reasons per SASS line), its code, and a
  # sweep of the MiMo case. PROFILE_CONFIGS: more LaunchConfig JSON overrides to profile, one per line.
  t0=$(date +%s)
  prof=benchmarks/kernels/profile_prefill_attention.py
  python3 "$prof" --dump "$out/code" 2>&1 | tail -n 3
  cuobjdump -sass "$out/code/kernel.cubin" > "$out/code/kernel.sass" 2>&1
  i=0
  printf '%s\n' '' "${PROFILE_CONFIGS:-}" | while IFS= read -r cfg; do
    [ $i -gt 0 ] && [ -z "$cfg" ] && continue
    name=prof$i; i=$((i + 1))
    ncu --clock-control none -k regex:_prefill_attention_kernel --launch-skip 2 --launch-count 1 \
      --set full -f -o "$out/$name" python3 "$prof" ${cfg:+--config "$cfg"} > "$out/$name.log" 2>&1
    tail -n 3 "$out/$name.log"
    ncu --import "$out/$name.ncu-rep" --page details > "$out/$name-details.txt" 2>&1
    ncu --import "$out/$name.ncu-rep" --page source --csv --print-source sass > "$out/$name-sass.csv" 2>&1
    grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Memory Throughput|L2 Cache Throughput|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|Warp Cycles Per Issued" "$out/$name-details.txt" | head -n 20
  done
  echo "profile: $(( $(date +%s) - t0 )) s"
  t0=$(date +%s)
  python3 benchmarks/kernels/benchmark_prefill_attention.py --tune --tune-cases "${TUNE_CASES:-mimo 4x16384}" \
    --tune-seconds "${TUNE_SECONDS:-150}" --out "$out" 2>&1 | tee "$out/tune.log" | grep -v -i warn | tail -n 30
  echo "sweep: $(( $(date +%s) - t0 )) s"
  exit 0
fi

if [ "$what" = release ]; then
  peers=${PEERS:-.gpu/peers}
  t0=$(date +%s)
  if [ "${TUNE:-0}" = 1 ]; then
    python3 -m vllm_sinks tune --peers "$peers" --out "$out" 2>&1 | tee "$out/tune.log" \
      | grep -v -i warn | grep -v "^\[tune\] timed" | tail -n 45
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    python3 -m vllm_sinks report 2>&1 | tee -a "$out/tune.log" | tail -n 3
    echo "tune + report: $(( $(date +%s) - t0 )) s"
  fi
  t1=$(date +%s)
  python3 benchmarks/kernels/benchmark_stream.py --peers "$peers" --rounds "${STREAM_ROUNDS:-2}" \
    --workloads "${STREAM_WORKLOADS:-full,mimo}" --out "$out" 2>&1 | grep -v -i warn | tail -n 40
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  echo "stream: $(( $(date +%s) - t1 )) s"
  python3 benchmarks/kernels/host_cost.py --peers "$peers" 2>&1 | tee "$out/host.log" | grep -i routed
  xdist=(); python3 -c "import xdist" 2>/dev/null && xdist=(-n "${XDIST_WORKERS:-4}")
  left=$(( ${TEST_S:-560} - ($(date +%s) - t0) ))
  if [ "$left" -gt 30 ]; then
    timeout "$left" python3 -m pytest -q -p no:cacheprovider "${xdist[@]}" --maxfail=20 \
      ${GPU_TESTS:-tests/gpu} > "$out/gpu-tests.log" 2>&1
    echo "gpu tests (rc $?, ${left} s allowed): $(grep -E "passed|failed" "$out/gpu-tests.log" | tail -n 1)"
  fi
  exit $status
fi

if [ "$what" = tune ] || [ "$what" = stream ]; then
  # no GPU tests: the table's measurement (105–121 s on an H200) and the stream (~150 s) fit one call
  if [ "$what" = tune ]; then
    python3 benchmarks/kernels/tune_full_attention.py --out "$out" 2>&1 | tee "$out/tune-full.log" \
      | grep -v -i warn | tail -n 60
    [ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
  fi
  python3 benchmarks/kernels/benchmark_stream.py --out "$out" 2>&1 | tee "$out/stream.log" \
    | grep -v -i warn | tail -n 20
  exit "${PIPESTATUS[0]}"
fi

if [ "$what" != bench ]; then
  t0=$(date +%s)
  # Four workers share the GPU: the time goes into compiling kernel variants, on the CPU.
  xdist=(); python3 -c "import xdist" 2>/dev/null && xdist=(-n "${XDIST_WORKERS:-4}")
  python3 -m pytest -q -p no:cacheprovider "${xdist[@]}" --maxfail=20 ${GPU_TESTS:-tests/gpu} \
    2>&1 | tee "$out/gpu-tests.log" | tail -n 15
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  echo "gpu tests: $(( $(date +%s) - t0 )) s"
  [ "$what" = tests ] && exit $status
fi

# step LOG LINES SCRIPT ARGS...: one benchmark script, its output in $out/LOG, its last LINES shown
step() {
  local log=$1 lines=$2; shift 2
  python3 "$@" 2>&1 | tee "$out/$log" | grep -v -i warn | tail -n "$lines"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}

t0=$(date +%s)
if [ "$what" != host ] && [ "$what" != dispatch ]; then
  bench_args=()
  [ "$what" = sweep ] && bench_args=(--tune --table --tune-seconds "${TUNE_SECONDS:-60}")
  # e.g. BENCH_ARGS='--flex-cases "mimo 4x16384,gpt-oss 4x16384"' to save FlexAttention compiles
  eval "bench_args+=(${BENCH_ARGS:-})"
  step bench.log 40 benchmarks/kernels/benchmark_prefill_attention.py "${bench_args[@]}" --out "$out"
fi
[ "$what" != host ] && step full.log 14 benchmarks/kernels/benchmark_full_attention.py --fa3 --out "$out"
[ "$what" != dispatch ] && step mimo-pass.log 8 benchmarks/kernels/benchmark_mimo_pass.py --out "$out"
step host.log 16 benchmarks/kernels/host_cost.py
echo "benchmark: $(( $(date +%s) - t0 )) s"
exit $status
