#!/usr/bin/env bash
# The main job (README): set up vLLM (CPU build) in a venv and run the differential check —
# tiny random-weight models, vLLM prompt logprobs vs Hugging Face eager, patch on and off — printing
# the table. Default: vLLM 0.29.0, every sink family (`vllm-sinks verify`).
#
#   bash scripts/main.sh                     # defaults
#   VLLM_VERSION=0.27.1 bash scripts/main.sh  # another vLLM
#   bash scripts/main.sh --family gpt_oss    # arguments go to `vllm-sinks verify`
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=$("$repo/scripts/venv.sh" "${VLLM_VERSION:-0.29.0}" | tail -n 1)
export VLLM_CPU_KVCACHE_SPACE=1
"$venv/bin/vllm-sinks" report
exec "$venv/bin/vllm-sinks" verify "$@"
