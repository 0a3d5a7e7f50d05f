"""Time copies of the prefill op module side by side, in one process, on the same inputs.

    python benchmarks/kernels/compare_op_variants.py VARIANTS --cases "mimo 4x16384,gpt-oss 4x16384"

VARIANTS is a text file, one variant per line: ``name  path/to/module.py  {LaunchConfig JSON}``
(``#`` starts a comment). Each module is a scratch copy of
``vllm_sinks/v1/attention/ops/prefill_attention_portable.py`` (the portable kernel) with one kernel change; the JSON overrides
fields of that module's default tile shape (``{}`` for none). Every variant is checked against the
fp32 reference and timed twice per case (do_bench median, L2 flushed), interleaved, so the spread
between the two passes shows the noise. Why: the H200 moves by a few percent between runs, and
kernel changes worth keeping are often that size (docs/kernels/portable.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from benchmark_prefill_attention import _bench, _cases, _inputs, _op_kwargs  # noqa: E402

from vllm_sinks.v1.attention.ops.prefill_attention_problem import validate  # noqa: E402
from vllm_sinks.v1.attention.ops.prefill_attention_reference import (  # noqa: E402
    reference_prefill_attention,
    relative_l2,
)


def load_module(path: str):
    """Import a module file under its own name (registered first: its dataclasses need that)."""
    name = "variant_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def read_variants(path: str) -> list[tuple[str, str, dict]]:
    variants = []
    for line in open(path).read().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, module, config = line.split(None, 2)
            variants.append((name, module, json.loads(config)))
    return variants


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", help="file: name, module path, LaunchConfig JSON per line")
    ap.add_argument("--cases", default="mimo 4x16384,gpt-oss 4x16384", help="case names, comma-separated")
    ap.add_argument("--passes", type=int, default=2)
    args = ap.parse_args(argv)
    variants = read_variants(args.variants)
    modules = {path: load_module(path) for _, path, _ in variants}
    wanted = args.cases.split(",")
    device = torch.device("cuda")
    print("| case | variant | pass | µs | err | regs / spills | config |")
    print("|---|---|---|---|---|---|---|")
    for case in (c for c in _cases() if c.name in wanted):
        q, k, v, sinks, starts, lens = _inputs(case, device)
        ref = reference_prefill_attention(q, k, v, starts, lens, **_op_kwargs(case, sinks))
        for rep in range(args.passes):
            for name, path, overrides in variants:
                op = modules[path]
                o = torch.full_like(q, float("nan"))
                p = validate(q, k, v, o, starts, lens, case.seq_len, case.is_causal, None,
                                 case.window_q, case.window_k, sinks, case.sink_mode == "key0")
                cfg = dataclasses.replace(op.choose_config(p), **overrides)
                try:
                    kernel = op.launch(p, cfg, q, k, v, o, starts, lens, sinks, case.seq_len)
                    err = relative_l2(o, ref)
                    us = _bench(lambda: op.launch(p, cfg, q, k, v, o, starts, lens, sinks, case.seq_len))
                except Exception as e:  # noqa: BLE001 - out of resources, compile error: report it
                    print(f"| {case.name} | {name} | {rep + 1} | — | {type(e).__name__}: {str(e)[:80]} | — | — |")
                    continue
                regs = (getattr(kernel, "n_regs", None), getattr(kernel, "n_spills", None))
                print(f"| {case.name} | {name} | {rep + 1} | {us:.1f} | {err:.2e} | {regs[0]} / {regs[1]} "
                      f"| {json.dumps(overrides)} |", flush=True)
        del q, k, v, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
