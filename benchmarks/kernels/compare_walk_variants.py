"""Time copies of the Hopper window kernel's module side by side, in one process, on the same inputs
(GPU machine).

    python3 benchmarks/kernels/compare_walk_variants.py base.py qreg.py ... \
        [--cases "mimo 4x16384,gpt-oss 4x16384"]

Each argument is a scratch copy of ``vllm_sinks/v1/attention/ops/gluon_window_attention.py`` with one
kernel change (the committed module is always timed too, as "committed"). Every variant is checked
against the fp32 reference, then timed twice per case (do_bench median, L2 flushed), interleaved, so
the spread between the passes shows the noise: kernel changes worth keeping are often a few percent,
about what the H200 moves between runs (docs/kernels/portable.md).
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
from inspect_window_walk import load_variant  # noqa: E402

from vllm_sinks.v1.attention.ops import gluon_window_attention  # noqa: E402
from vllm_sinks.v1.attention.ops.prefill_attention_problem import validate  # noqa: E402
from vllm_sinks.v1.attention.ops.prefill_attention_reference import (  # noqa: E402
    reference_prefill_attention,
    relative_l2,
)


def time_walks(case_names, planners: dict, passes: int = 2):
    """For each benchmark case named, in the benchmark's order: each planner's launch
    (``planner(p, q, k, v, o, starts, lens, sinks)``, a ``WalkLaunch`` or None) checked against the
    fp32 reference, then timed ``passes`` times, interleaved across the launches. Yields
    ``(case name, label, status, times, err)`` per planner; status ``"declined"`` (no plan) or
    ``"fell back"`` (the kernel did not compile) comes with no times and no error."""
    for c in [c for c in _cases() if c.name in case_names]:
        q, k, v, sinks, starts, lens = _inputs(c, torch.device("cuda"))
        ref = reference_prefill_attention(q, k, v, starts, lens, **_op_kwargs(c, sinks))
        o = torch.empty_like(q)
        p = validate(q, k, v, o, starts, lens, c.seq_len, c.is_causal, None, c.window_q,
                     c.window_k, sinks, c.sink_mode == "key0")
        launches, skipped = {}, []
        for label, planner in planners.items():
            walk = planner(p, q, k, v, o, starts, lens, sinks)
            o.fill_(float("nan"))
            if walk is None:
                skipped.append((label, "declined"))
            elif not walk(q, k, v, o, starts, lens, sinks, c.seq_len):
                skipped.append((label, "fell back"))
            else:
                launches[label] = (walk, relative_l2(o, ref))
        for label, status in skipped:
            yield c.name, label, status, None, None
        times = {label: [] for label in launches}
        for _ in range(passes):
            for label, (walk, _) in launches.items():
                times[label].append(_bench(lambda: walk(q, k, v, o, starts, lens, sinks, c.seq_len)))
        for label, (walk, err) in launches.items():
            yield c.name, label, "ran", times[label], err
        del q, k, v, o, ref
        torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("modules", nargs="*", help="copies of gluon_window_attention.py")
    ap.add_argument("--cases", default="mimo 4x16384,gpt-oss 4x16384")
    ap.add_argument("--passes", type=int, default=2)
    args = ap.parse_args(argv)
    variants = {"committed": gluon_window_attention}
    for path in args.modules:
        variants[os.path.splitext(os.path.basename(path))[0]] = load_variant(path)
    planners = {name: module.WalkLaunch.plan for name, module in variants.items()}
    wanted = [w.strip() for w in args.cases.split(",")]
    warm_gpu()
    passes = " | ".join(f"µs (pass {i + 1})" for i in range(args.passes))
    print(f"| case | variant | {passes} | err |")
    print("|---|---|" + "---|" * args.passes + "---|")
    for case, name, status, times, err in time_walks(wanted, planners, args.passes):
        if status != "ran":
            print(f"| {case} | {name} | " + "— | " * args.passes + "did not run |", flush=True)
            continue
        cells = " | ".join(f"{t:.1f}" for t in times)
        print(f"| {case} | {name} | {cells} | {err:.2e} |", flush=True)


if __name__ == "__main__":
    main()
