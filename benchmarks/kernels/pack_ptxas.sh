#!/usr/bin/env bash
# Pack the ptxas that Triton VERSION's wheel compiles sm_90 with (bin/ptxas up to 3.8, bin/ptxas-blackwell
# from 3.9), taken from a venv with that Triton, as a tarball to carry beside its slim build
# (device_triton.sh's PTXAS_TARBALL): 9-12 MB. Never commit it.
#
#   bash benchmarks/kernels/pack_ptxas.sh ~/.cache/vllm-sinks/venvs/triton-3.9.0/bin/python .gpu
set -euo pipefail
py=${1:?python of a venv with the Triton to pack}; dest=${2:?output folder}
mkdir -p "$dest"; dest=$(cd "$dest" && pwd)
read -r version path < <("$py" -c '
import triton
from triton.backends.nvidia import compiler
print(triton.__version__, compiler.get_ptxas(90).path)')
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$work/triton/backends/nvidia/bin"
cp "$path" "$work/triton/backends/nvidia/bin/"
(cd "$work" && tar -cf - triton | xz -T0 -6 > "$dest/ptxas-$version.tar.xz")
echo "$dest/ptxas-$version.tar.xz: $(basename "$path") of triton $version ($("$path" --version | tail -n 1))"
