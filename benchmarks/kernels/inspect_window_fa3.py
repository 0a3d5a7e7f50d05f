"""Compile the FA3-structured Hopper window kernel (``gluon_window_attention_fa3``) for sm_90a
without a GPU: registers per partition (setmaxnreg), spills, shared memory, instructions by opcode.

    ~/.cache/vllm-sinks/venvs/vllm-none/bin/python benchmarks/kernels/inspect_window_fa3.py --case mimo
    ... --consumers 3 --pingpong --overlap [pairs|tiles] --sass out.sass --ptx out.ptx \
        --ttgir out.ttgir --module COPY.py

Its arguments differ from the committed walk's (TMA descriptors), hence a script of its own; the
cases are ``inspect_window_walk``'s.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from benchmarks.kernels.compare_op_variants import load_module  # noqa: E402
from benchmarks.kernels.inspect_window_walk import CASES, read_compiled  # noqa: E402
from benchmarks.kernels import gluon_window_attention_fa3 as fa3  # noqa: E402


def _desc_type(block, dtype="bf16"):
    layout = fa3._smem_layout(len(block))
    return f"tensordesc<{dtype}[{', '.join(map(str, block))}],{layout!r}>"


def compile_fa3(case: str, consumers: int, pingpong: bool, module=fa3, overlap=False):
    """``overlap``: a key of the module's OVERLAP_MODES (False, True or "pairs", "tiles")."""
    from triton.experimental.gluon._runtime import GluonASTSource

    T, gp, qpk, wq, wk, causal, sink_mode = CASES[case][:7]  # the walk's 8th: CU_SEQLENS
    geometry = module.walk.walk_geometry(T, wq, wk, causal)
    regs = module._PARTITION_REGS[consumers]
    constexprs = dict(T=T, GP=gp, QUERIES_PER_KV=qpk, NB=geometry.nb,
                      NS=geometry.nb + 3 + module.EXTRA_SLOTS, NC=consumers, IS_CAUSAL=causal,
                      HAS_WK=wk > 0, SINK_MODE=sink_mode, PINGPONG=pingpong,
                      CONSUMER_REGS=regs[1])
    if overlap or "OVERLAP" in kernel_params(module._window_fa3_kernel):  # not in older copies
        constexprs["OVERLAP"] = module.OVERLAP_MODES[overlap]
    kernel = module._window_fa3_kernel
    types = {"q_desc": _desc_type([T, gp, 64]), "k_desc": _desc_type([16, 1, 64]),
             "v_desc": _desc_type([16, 1, 64]), "O": "*bf16", "Sinks": "*fp32",
             "StartLoc": "*i32", "SeqLen": "*i32", "qk_scale": "fp32", "inv_scale": "fp32"}
    sig, attrs = {}, {}
    for i, n in enumerate(kernel.arg_names):
        if n in constexprs:
            sig[n] = "constexpr"
            continue
        sig[n] = types.get(n, "i32")
        if n in ("O", "StartLoc", "SeqLen", "Sinks") or n in ("stride_ot", "stride_oh"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = GluonASTSource(fn=kernel, signature=sig, attrs=attrs,
                         constexprs={(kernel.arg_names.index(n),): v for n, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=regs[0]))


def kernel_params(kernel):
    return {p.name for p in kernel.params}


def wgmma_waits(ptx: str, sass: str) -> str:
    """The wgmma wait structure: PTX ``wgmma.wait_group N`` by N, SASS ``WARPGROUP.DEPBAR`` by
    operand, and how many HGMMAs each SASS wait follows (issued since the one before)."""
    ptx_waits = collections.Counter(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx))
    runs, n, waits = [], 0, collections.Counter()
    for line in sass.splitlines():
        if "HGMMA" in line:
            n += 1
        m = re.search(r"WARPGROUP\.DEPBAR\S*\s+([^;]*)", line)
        if m:
            waits[m.group(1).strip()] += 1
            runs.append(n)
            n = 0
    return (f"PTX wait_group {dict(sorted(ptx_waits.items()))}; SASS WARPGROUP.DEPBAR "
            f"{dict(waits)}; HGMMAs between SASS waits {runs}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", choices=sorted(CASES), default="mimo")
    ap.add_argument("--consumers", type=int, default=fa3.CONSUMERS)
    ap.add_argument("--pingpong", action="store_true")
    ap.add_argument("--overlap", nargs="?", const="pairs", default=False,
                    choices=["pairs", "tiles"],
                    help="the next tile's Q · Kᵀ in flight during this one's softmax: a loop of "
                         "tile pairs (the default) or of single tiles")
    ap.add_argument("--ptx", help="also write the PTX here")
    ap.add_argument("--ttgir", help="also write the TTGIR here")
    ap.add_argument("--sass", help="also write the SASS here")
    ap.add_argument("--module", help="compile this copy of gluon_window_attention_fa3.py instead")
    args = ap.parse_args(argv)
    module = load_module(args.module) if args.module else fa3
    compiled = compile_fa3(args.case, args.consumers, args.pingpong, module, args.overlap)
    sass, res, ops = read_compiled(compiled, args.sass)
    for path, key in ((args.ptx, "ptx"), (args.ttgir, "ttgir")):
        if path:
            with open(path, "w") as f:
                f.write(compiled.asm[key])
    setmaxnreg = sorted(set(re.findall(r"USETMAXREG\S*\s+[^;]*", sass)))
    print(f"triton {triton.__version__} {args.case} consumers={args.consumers} "
          f"pingpong={args.pingpong} overlap={args.overlap}: {res.get('reg')} registers, "
          f"{res.get('stack', 0)} B stack (spills), {compiled.metadata.shared} B shared memory, {sum(ops.values())} instructions")
    print("  setmaxnreg: " + ("; ".join(setmaxnreg) or "none"))
    print("  " + wgmma_waits(compiled.asm["ptx"], sass))
    print("  " + ", ".join(f"{op} {n}" for op, n in ops.most_common(18)))


if __name__ == "__main__":
    main()
