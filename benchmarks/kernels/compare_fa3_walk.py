"""Time the FA3-structured window kernel (``gluon_window_attention_fa3``) against the committed walk,
vLLM's FlashAttention-3 and upstream vLLM's op, in one process, on the same inputs (GPU machine).

    python3 benchmarks/kernels/compare_fa3_walk.py [--cases "mimo 4x16384,gpt-oss 4x16384"] \
        [--peers .gpu/peers] [--passes 2]

The walks (committed; FA3 structure with 2 consumer warpgroups, with the softmax ping-pong, with 3
consumers, with the consumers' Q · Kᵀ / softmax overlap over tile pairs, alone and with the
ping-pong, and over single tiles; ``--only`` picks, e.g. ``--only committed,fa3,fa3-overlap``)
are checked against the fp32 reference and timed ``passes`` times interleaved
(``compare_walk_variants.time_walks``); the peers are timed as ``benchmark_prefill_attention``
times them. Ratios are the peer's time over ours.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from benchmark_prefill_attention import _bench, _cases, _inputs, _peer_columns  # noqa: E402
from compare_walk_variants import time_walks  # noqa: E402
from gpu_warmup import warm_gpu  # noqa: E402

from benchmarks.kernels import gluon_window_attention_fa3  # noqa: E402
from vllm_sinks.v1.attention.ops import gluon_window_attention  # noqa: E402
from vllm_sinks.v1.attention.ops.prefill_attention_reference import (  # noqa: E402
    reference_prefill_attention,
)

PLANNERS = {
    "committed": gluon_window_attention.WalkLaunch.plan,
    "fa3": gluon_window_attention_fa3.Fa3WalkLaunch.plan,
    "fa3-pingpong": functools.partial(gluon_window_attention_fa3.Fa3WalkLaunch.plan, pingpong=True),
    "fa3-3wg": functools.partial(gluon_window_attention_fa3.Fa3WalkLaunch.plan, consumers=3),
    "fa3-overlap": functools.partial(gluon_window_attention_fa3.Fa3WalkLaunch.plan, overlap=True),
    "fa3-overlap-pingpong": functools.partial(gluon_window_attention_fa3.Fa3WalkLaunch.plan,
                                              overlap=True, pingpong=True),
    "fa3-overlap-tiles": functools.partial(gluon_window_attention_fa3.Fa3WalkLaunch.plan,
                                           overlap="tiles"),
}


def peer_times(case_name, peers_loaded, passes):
    from benchmark_prefill_attention import _op_kwargs

    c = next(c for c in _cases() if c.name == case_name)
    q, k, v, sinks, starts, lens = _inputs(c, torch.device("cuda"))
    ref = reference_prefill_attention(q, k, v, starts, lens, **_op_kwargs(c, sinks))
    rows = []
    for _ in range(passes):
        row = {}
        _peer_columns(row, c, q, k, v, sinks, starts, lens, ref, peers_loaded)
        rows.append(row)
    del q, k, v, ref
    torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="mimo 4x16384,gpt-oss 4x16384")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--peers", default=None)
    ap.add_argument("--only", default=",".join(PLANNERS), help="planners to time")
    args = ap.parse_args(argv)
    from benchmarks.kernels import peers

    peers_loaded = (peers.upstream_op(args.peers), peers.fa3_varlen(args.peers))
    planners = {n: PLANNERS[n] for n in args.only.split(",")}
    wanted = [w.strip() for w in args.cases.split(",")]
    warm_gpu()
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    for case in wanted:
        ours = list(time_walks([case], planners, args.passes))
        prow = peer_times(case, peers_loaded, args.passes)
        up = [r.get("upstream_us") for r in prow]
        fa = [r.get("fa3_us") for r in prow]
        print(f"\n{case}: upstream µs {up}, FA3 µs {fa} "
              f"(upstream err {prow[0].get('upstream_err', prow[0].get('upstream_error'))}, "
              f"FA3 {prow[0].get('fa3_error', '')})")
        print("| variant | " + " | ".join(f"µs (pass {i + 1})" for i in range(args.passes))
              + " | err | × FA3 | × upstream |")
        print("|---|" + "---|" * args.passes + "---|---|---|")
        for _, name, status, times, err in ours:
            if status != "ran":
                print(f"| {name} | " + "— | " * args.passes + f"{status} | | |", flush=True)
                continue
            best = min(times)
            vs_fa = f"{min(x for x in fa if x) / best:.2f}" if any(fa) else "—"
            vs_up = f"{min(x for x in up if x) / best:.2f}" if any(up) else "—"
            print(f"| {name} | " + " | ".join(f"{t:.1f}" for t in times)
                  + f" | {err:.2e} | {vs_fa} | {vs_up} |", flush=True)


if __name__ == "__main__":
    main()
