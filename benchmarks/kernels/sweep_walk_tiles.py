"""Time the Hopper window kernel at each tile shape it can take (query heads per tile GP, tokens per
tile 64 / GP) on the benchmark's window cases, in one run (GPU machine).

    python3 benchmarks/kernels/sweep_walk_tiles.py [--cases "gpt-oss 4x16384,mimo 4x16384"]

A smaller GP means more head groups, each re-reading the KV head's band from L2, but tiles twice as
tall in tokens: half the tiles, so half the per-tile overhead (prefetch, barrier, epilogue) per
token; GP 4 (16-token tiles, the default) also walks tiles in pairs of static slot parity
(docs/kernels/window-walk.md). Each shape is checked against the fp32 reference, then timed twice (do_bench median,
L2 flushed), interleaved, so the spread shows the noise.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from compare_walk_variants import time_walks  # noqa: E402
from gpu_warmup import warm_gpu  # noqa: E402

from vllm_sinks.v1.attention.ops.gluon_window_attention import WalkLaunch  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="gpt-oss 4x16384,gpt-oss 4x4096,mimo 4x16384")
    args = ap.parse_args(argv)
    wanted = [w.strip() for w in args.cases.split(",")]
    warm_gpu()
    print("| case | GP | tokens per tile | µs (pass 1) | µs (pass 2) | err |")
    print("|---|---|---|---|---|---|")
    planners = {gp: functools.partial(WalkLaunch.plan, gp=gp) for gp in (4, 8, 16)}
    for case, gp, status, times, err in time_walks(wanted, planners, passes=2):
        if status == "declined":  # a GP the call's heads do not allow
            continue
        assert status == "ran", (case, gp, status)
        print(f"| {case} | {gp} | {64 // gp} | {times[0]:.1f} | {times[1]:.1f} | {err:.2e} |",
              flush=True)


if __name__ == "__main__":
    main()
