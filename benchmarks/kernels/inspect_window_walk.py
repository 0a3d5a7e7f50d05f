"""Compile the Hopper window kernel (Gluon) for sm_90a without a GPU: registers, spills, shared
memory, and its instructions by opcode.

    python benchmarks/kernels/inspect_window_walk.py                  # MiMo's shape
    python benchmarks/kernels/inspect_window_walk.py --case gpt-oss --sass out.sass

Needs the GPU machine's Triton (3.6: Gluon's API differs in other releases; see DEVELOPERS.md for
the venv). What it answers between GPU runs: whether the kernel compiles at all, whether it still
fits three programs per SM (≤ 168 registers, no spill; ≤ ~75 KB of shared memory), and where its
instructions go. Where it spills at 168 (Triton 3.9's ptxas 13.4), the budget ``WalkLaunch`` then
takes (``ROOMY``) is compiled too. Timing still needs the device (docs/kernels/window-walk.md).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from benchmarks.kernels.compare_op_variants import load_module as load_variant  # noqa: E402
from benchmarks.kernels.inspect_prefill_sass import _INSTR, _cuobjdump, resources, signature  # noqa: E402
from vllm_sinks.v1.attention.ops import gluon_window_attention as gw  # noqa: E402
from vllm_sinks.v1.attention.ops.prefill_attention_problem import SINKS_KEY0_BIAS, SINKS_NULL_LOGIT  # noqa: E402

# (T, GP, queries per KV head, window q, window k, causal, sink mode, cu_seqlens offsets)
# mimo: as the MiMo wrapper calls it (its cu_seqlens read as is); gpt-oss: the default tiling
# (16-token tiles of 4 of the 8 heads per KV head: the walk's pairs of static slot parity, like
# mimo), start offsets and lengths as the op's callers pass them; gpt-oss-gp8: 8-token tiles of 8
# heads (the parity read per tile).
CASES = {"mimo": (16, 4, 4, 64, 64, False, SINKS_KEY0_BIAS, True),
         "gpt-oss": (16, 4, 8, 127, 0, True, SINKS_NULL_LOGIT, False),
         "gpt-oss-gp8": (8, 8, 8, 127, 0, True, SINKS_NULL_LOGIT, False)}


def compile_walk(case: str, gw=gw, maxnreg: int = gw.TIGHT.maxnreg):
    from triton.experimental.gluon._runtime import GluonASTSource


    T, gp, qpk, wq, wk, causal, sink_mode, cu = CASES[case]
    geometry = gw.walk_geometry(T, wq, wk, causal)
    constexprs = dict(T=T, GP=gp, QUERIES_PER_KV=qpk, NB=geometry.nb, IS_CAUSAL=causal,
                      HAS_WK=wk > 0, SINK_MODE=sink_mode)
    if "CU_SEQLENS" in {p.name for p in gw._window_walk_kernel.params}:  # not in older --module copies
        constexprs["CU_SEQLENS"] = cu
    sig, attrs, constexprs = signature(gw._window_walk_kernel, constexprs,
                                       floats={"qk_scale", "inv_scale"})
    src = GluonASTSource(fn=gw._window_walk_kernel, signature=sig, attrs=attrs,
                         constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=maxnreg, enable_fp_fusion=True))


def read_compiled(compiled, sass_path: str | None = None):
    """(SASS, resources, opcode counts) of a compiled kernel; the SASS also written to ``sass_path``."""
    sass = _cuobjdump(compiled, "-sass")
    if sass_path:
        with open(sass_path, "w") as f:
            f.write(sass)
    ops = collections.Counter(
        text.split()[1 if text.startswith("@") else 0].split(".")[0] for _, text in _INSTR.findall(sass))
    return sass, resources(compiled), ops


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", choices=sorted(CASES), default="mimo")
    ap.add_argument("--sass", help="also write the SASS here (of the budget the launch runs: "
                    "ROOMY where TIGHT spills)")
    ap.add_argument("--module", help="compile this copy of gluon_window_attention.py instead")
    args = ap.parse_args(argv)
    module = load_variant(args.module) if args.module else gw
    for budget in (gw.TIGHT, gw.ROOMY):  # as WalkLaunch runs it: the second where the first spills
        compiled = compile_walk(args.case, module, budget.maxnreg)
        sass, res, ops = read_compiled(compiled, args.sass)
        print(f"{args.case}: {res.get('reg')} registers, {res.get('stack', 0)} B stack (spills), "
              f"{compiled.metadata.shared} B shared memory, {sum(ops.values())} instructions "
              f"(maxnreg {budget.maxnreg}, {budget.programs_per_sm} programs per SM)")
        print("  " + ", ".join(f"{op} {n}" for op, n in ops.most_common(16)))
        if not res.get("stack"):
            break


if __name__ == "__main__":
    main()
