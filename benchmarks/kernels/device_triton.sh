# Sourced by the device scripts (run_on_device.sh): put the Triton of
# TRITON_TARBALL (a slim build, carried) first on PYTHONPATH, compiling with the ptxas that release's
# wheel ships, as a user's compiles do:
#
#   TRITON_TARBALL=.gpu/triton-3.9.0-slim.tar.xz PTXAS_TARBALL=.gpu/ptxas-3.9.0.tar.xz ...
#
# Slim builds leave out the wheel's ptxas binaries (30-50 MB each). PTXAS_TARBALL carries the one
# that compiles sm_90 under that release (triton/backends/nvidia/bin/ptxas for 3.7 and 3.8,
# .../ptxas-blackwell from 3.9 on), packed by pack_ptxas.sh; it is unpacked beside the slim build.
# Where the release's binary is still missing, the machine's ptxas (CUDA 13.0) stands in, and
# ptxas.txt says so. It is not what users compile with: the walk fits 168 registers without a
# spill under 12.8 (3.7.1), 12.9 (3.8) and 13.0, and spills 136-144 B under 13.3-13.4 (3.9's
# ptxas-blackwell; docs/kernels/window-walk.md).
if [ -n "${TRITON_TARBALL:-}" ]; then
  slim=/tmp/triton-slim; rm -rf "$slim"; mkdir -p "$slim"; tar -xJf "$TRITON_TARBALL" -C "$slim"
  [ -n "${PTXAS_TARBALL:-}" ] && tar -xJf "$PTXAS_TARBALL" -C "$slim"
  export PYTHONPATH="$slim:$PYTHONPATH"
  machine_ptxas=$(command -v ptxas || echo /usr/local/cuda/bin/ptxas)
  for tool in ptxas ptxas-blackwell; do
    if [ ! -x "$slim/triton/backends/nvidia/bin/$tool" ]; then
      var=TRITON_$(echo "$tool" | tr a-z- A-Z_)_PATH
      export "$var=$machine_ptxas"
    fi
  done
  python3 - <<'PY' | tee -a "${out:-.}/ptxas.txt"
import triton
from triton.backends.nvidia import compiler
tool = compiler.get_ptxas(90)
print(f"triton {triton.__version__} compiles sm_90 with {tool.path}: "
      f"{compiler.get_ptxas_version(90).strip().splitlines()[-1]}")
PY
fi
