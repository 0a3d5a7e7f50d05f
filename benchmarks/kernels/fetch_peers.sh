#!/usr/bin/env bash
# Fetch the two same-run benchmark peers from the vllm 0.34.0 wheel into DIR (git-ignored: .gpu/peers),
# for the GPU machine, which has no vLLM and no network. Nothing fetched may be committed.
#
#   bash benchmarks/kernels/fetch_peers.sh .gpu/peers     (~336 MB download; DIR gets ~12 MB)
#   VLLM_WHEEL=/path/vllm-0.34.0-...whl bash benchmarks/kernels/fetch_peers.sh .gpu/peers   (no download)
#
# DIR/upstream/  vLLM's own prefill op, vllm/v1/attention/ops/triton_prefill_attention.py (the op our
#                plugin replaces), and vllm/utils/math_utils.py (stdlib only; it gives the op its RCP_LN2).
#                Its other imports (vllm.platforms.current_platform, vllm.triton_utils.tl/triton, from
#                0.34 vllm.utils.mem_utils.get_max_shared_memory_bytes, which sizes its tile to shared
#                memory) are tiny shims in benchmarks/kernels/peers.py: upstream_op(DIR).
# DIR/fa3/       vLLM's FlashAttention-3 build (_vllm_fa3_C.abi3.so.xz, flash_attn_interface.py), taken
#                from the same wheel so that one download serves both peers: peers.py: fa3_varlen(DIR).
# DIR/SOURCE     the wheel's name and sha256, and each extracted file's sha256.
set -euo pipefail
OUT=${1:?usage: fetch_peers.sh DIR  (e.g. .gpu/peers)}
VERSION=${VLLM_VERSION:-0.34.0}  # the newest supported vLLM: the op users compare against
repo=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
if (cd "$repo" && git rev-parse --is-inside-work-tree >/dev/null 2>&1) && [[ "$OUT" == "$repo"/* ]] \
   && ! (cd "$repo" && git check-ignore -q "${OUT#"$repo"/}/x"); then
  echo "fetch_peers.sh: $OUT is not ignored by git (use .gpu/peers): refusing to fetch vLLM files there" >&2
  exit 1
fi
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
whl=${VLLM_WHEEL:-}
if [ -z "$whl" ]; then
  PIP_CONSTRAINT= PIP_FIND_LINKS= python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 -d "$W" "vllm==$VERSION"
  whl=$(ls "$W"/vllm-"$VERSION"-*.whl)
fi
case "$(basename "$whl")" in vllm-"$VERSION"-*.whl) ;; *) echo "not a vllm $VERSION wheel: $whl" >&2; exit 1;; esac

mkdir -p "$OUT/upstream" "$OUT/fa3"
unzip -p "$whl" vllm/v1/attention/ops/triton_prefill_attention.py > "$OUT/upstream/triton_prefill_attention.py"
unzip -p "$whl" vllm/utils/math_utils.py > "$OUT/upstream/math_utils.py"
# FA3: its compiled library (xz: the carry limit) and its Python interface.
unzip -p "$whl" vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so | xz -T0 -6 > "$OUT/fa3/_vllm_fa3_C.abi3.so.xz"
unzip -p "$whl" vllm/vllm_flash_attn/flash_attn_interface.py > "$OUT/fa3/flash_attn_interface.py"

{
  echo "wheel $(basename "$whl") sha256 $(sha256sum "$whl" | cut -d' ' -f1)"
  echo "fetched $(date -u +%Y-%m-%dT%H:%M:%SZ) by benchmarks/kernels/fetch_peers.sh"
  (cd "$OUT" && sha256sum upstream/triton_prefill_attention.py upstream/math_utils.py \
     fa3/_vllm_fa3_C.abi3.so.xz fa3/flash_attn_interface.py)
} > "$OUT/SOURCE"
cat "$OUT/SOURCE"
du -sh "$OUT"
