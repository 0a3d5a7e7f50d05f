"""Launch the prefill op with one tile shape a few times, for Nsight Compute (and dump its code).

    ncu --clock-control none -k regex:_prefill_attention_kernel --launch-skip 2 --launch-count 1 \
        --set full -o OUT/prof python benchmarks/kernels/profile_prefill_attention.py \
        --case "mimo 4x16384" --config '{"block_t": 16, "gp": 4, ...}'
    python benchmarks/kernels/profile_prefill_attention.py --dump OUT/code   # ttgir / ptx / cubin

``--config`` takes LaunchConfig fields as JSON (missing fields: the default shape's); without it the
default shape ``choose_config`` picks is launched. Prints the registers, spills and shared memory
the compiler gave the kernel. Used by benchmarks/kernels/run_on_device.sh's ``profile`` mode.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from benchmark_prefill_attention import _cases, _inputs  # noqa: E402

from vllm_sinks.v1.attention.ops.prefill_attention_portable import choose_config, launch  # noqa: E402
from vllm_sinks.v1.attention.ops.prefill_attention_problem import validate as _validate  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="mimo 4x16384")
    ap.add_argument("--config", default="", help="LaunchConfig fields as JSON")
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--search", action="store_true", help="no host length bound: on-device search")
    ap.add_argument("--dump", default="", help="write the compiled kernel's ttgir/ptx/cubin here")
    args = ap.parse_args(argv)
    case = next(c for c in _cases() if c.name == args.case)
    q, k, v, sinks, starts, lens = _inputs(case, torch.device("cuda"))
    o = torch.empty_like(q)
    p = _validate(q, k, v, o, starts, lens, case.seq_len, case.is_causal, None, case.window_q,
                  case.window_k, sinks, case.sink_mode == "key0")
    cfg = choose_config(p)
    if args.config:
        cfg = dataclasses.replace(cfg, **json.loads(args.config))
    kernel = None
    hint = None if args.search else case.seq_len
    for _ in range(args.launches):
        kernel = launch(p, cfg, q, k, v, o, starts, lens, sinks, hint)
    torch.cuda.synchronize()
    print(f"{case.name}: {cfg}: regs {kernel.n_regs}, spills {kernel.n_spills}, "
          f"shared {kernel.metadata.shared} B")
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        for key, ext in (("ttgir", "ttgir"), ("ptx", "ptx"), ("cubin", "cubin")):
            data = kernel.asm.get(key)
            if data is None:
                continue
            mode = "wb" if isinstance(data, bytes) else "w"
            with open(os.path.join(args.dump, f"kernel.{ext}"), mode) as f:
                f.write(data)


if __name__ == "__main__":
    main()
