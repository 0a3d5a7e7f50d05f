"""Time the Hopper window kernel at each tile shape it can take (query heads per tile GP, tokens per
tile 64 / GP) on the benchmark's window cases, in one run (GPU machine).

    python3 benchmarks/kernels/sweep_walk_tiles.py [--cases "gpt-oss 4x16384,mimo 4x16384"]

A smaller GP means more head groups, each re-reading the KV head's band from L2, but tiles twice as
tall in tokens: half the tiles, so half the per-tile overhead (prefetch, barrier, epilogue) per
token. Each shape is checked against the fp32 reference, then timed twice (do_bench median, L2
flushed), interleaved, so the spread shows the noise.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from benchmark_prefill_attention import _bench, _cases, _inputs, _op_kwargs  # noqa: E402
from gpu_warmup import warm_gpu  # noqa: E402

from vllm_sinks.v1.attention.ops.gluon_window_attention import WalkLaunch  # noqa: E402
from vllm_sinks.v1.attention.ops.prefill_attention_problem import validate  # noqa: E402
from vllm_sinks.v1.attention.ops.prefill_attention_reference import (  # noqa: E402
    reference_prefill_attention,
    relative_l2,
)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="gpt-oss 4x16384,gpt-oss 4x4096,mimo 4x16384")
    args = ap.parse_args(argv)
    wanted = [w.strip() for w in args.cases.split(",")]
    warm_gpu()
    print("| case | GP | tokens per tile | µs (pass 1) | µs (pass 2) | err |")
    print("|---|---|---|---|---|---|")
    for c in [c for c in _cases() if c.name in wanted]:
        q, k, v, sinks, starts, lens = _inputs(c, torch.device("cuda"))
        kwargs = _op_kwargs(c, sinks)
        ref = reference_prefill_attention(q, k, v, starts, lens, **kwargs)
        o = torch.empty_like(q)
        p = validate(q, k, v, o, starts, lens, c.seq_len, c.is_causal, None, c.window_q,
                     c.window_k, sinks, c.sink_mode == "key0")
        launches = {}
        for gp in (4, 8, 16):
            walk = WalkLaunch.plan(p, q, k, v, o, starts, lens, sinks, gp=gp)
            if walk is not None:
                o.fill_(float("nan"))
                assert walk(q, k, v, o, starts, lens, sinks, c.seq_len)
                launches[gp] = (walk, relative_l2(o, ref))
        times = {gp: [] for gp in launches}
        for _ in range(2):
            for gp, (walk, _) in launches.items():
                times[gp].append(_bench(lambda: walk(q, k, v, o, starts, lens, sinks, c.seq_len)))
        for gp, (walk, err) in launches.items():
            print(f"| {c.name} | {gp} | {64 // gp} | {times[gp][0]:.1f} | {times[gp][1]:.1f} "
                  f"| {err:.2e} |", flush=True)
        del q, k, v, o, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
