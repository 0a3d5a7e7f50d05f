"""The tables shipped in the package: ``vllm-sinks tune`` (``vllm_sinks/v1/attention/ops/
tune_full_attention.py``) writing into the package's tables folder, with upstream's op from the
peers ``fetch_peers.sh`` fetched (the GPU machine has no vLLM).

    python3 benchmarks/kernels/tune_full_attention.py [--peers .gpu/peers] [--out DIR] [--jobs 15]
    python3 benchmarks/kernels/tune_full_attention.py --show vllm_sinks/v1/attention/ops/tables/*.json

On the GPU machine, under the Triton (and ptxas) users compile with: ``run_on_device.sh tune``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.kernels import peers  # noqa: E402
from vllm_sinks.v1.attention.ops import full_attention_table as fat  # noqa: E402
from vllm_sinks.v1.attention.ops import tune_full_attention as tune  # noqa: E402


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--peers" not in argv and "--dry-run" not in argv and "--show" not in argv:
        argv += ["--peers", str(peers.DEFAULT_DIR)]
    return tune.main(argv, prog="benchmarks/kernels/tune_full_attention.py",
                     tables_dir=fat.SHIPPED_DIR)


if __name__ == "__main__":
    main()
