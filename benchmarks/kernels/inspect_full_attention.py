"""Compile the Hopper full-attention kernel (Gluon) for sm_90a without a GPU: registers, spills,
shared memory, and its instructions by opcode, per case.

    python benchmarks/kernels/inspect_full_attention.py                 # every case
    python benchmarks/kernels/inspect_full_attention.py --case d80 --sass out.sass

What it answers between GPU runs: whether the kernel compiles under this Triton at all (CI runs
it under every Triton of the matrix's compile rows), and whether it spills. Timing needs the device.
Without ``--tile``, each case compiles the default tile and every other tile a shipped table of this
Triton release names for the case's head dim and causality (``tiles``): the front door runs those
on every call of their group, so CI compiles them too.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from benchmarks.kernels.compare_op_variants import load_module  # noqa: E402
from benchmarks.kernels.inspect_prefill_sass import signature  # noqa: E402
from benchmarks.kernels.inspect_window_walk import read_compiled  # noqa: E402
from vllm_sinks.v1.attention.ops.tune_full_attention import _tile_name  # noqa: E402
from vllm_sinks.v1.attention.ops import gluon_full_attention as gf  # noqa: E402
from vllm_sinks.v1.attention.ops.prefill_attention_problem import (  # noqa: E402
    SINKS_KEY0_BIAS, SINKS_NONE, SINKS_NULL_LOGIT)

# name: (head dim, query heads per KV head, causal, sink mode)
CASES = {"d64": (64, 1, False, SINKS_NONE),
         "d128": (128, 1, False, SINKS_NONE),
         "d80": (80, 1, False, SINKS_NONE),
         "d72": (72, 1, False, SINKS_NONE),
         "d96": (96, 1, False, SINKS_NONE),
         "d32": (32, 1, False, SINKS_NONE),
         "d112": (112, 1, False, SINKS_NONE),
         "d80-causal": (80, 1, True, SINKS_NONE),
         "d128-causal-gqa": (128, 4, True, SINKS_NONE),
         "d64-causal-null-sink": (64, 8, True, SINKS_NULL_LOGIT),
         "d80-key0-sink": (80, 4, False, SINKS_KEY0_BIAS)}


def compile_case(case: str, tile=None, module=gf):
    """Compile ``case`` with ``tile`` (default: the kernel's default tile) from ``module`` (a copy
    of ``gluon_full_attention.py`` with a kernel change, or the package's). A TMA tile compiles
    with the descriptor types a call of packed heads gives (``tma_unavailable`` aside: this
    compiles the kernel, not a call)."""
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    d, qpk, causal, sink_mode = CASES[case]
    parts = module.head_dim_parts(d)
    tile = tile or module.default_tile(causal)
    tma = bool(tile.tma) and sum(parts) == d
    constexprs = dict(HEAD_DIM=d, D0=parts[0], D1=parts[1], BLOCK_M=tile.block_m,
                      BLOCK_N=tile.block_n, STAGES=tile.stages, QUERIES_PER_KV=qpk,
                      IS_CAUSAL=causal, SINK_MODE=sink_mode, DEFER_PV=tile.defer_pv,
                      OVERLAP=tile.overlap, TMA_KV=tma)
    descriptors = {}
    if tma:  # the types the JIT gives the four descriptors of a call (K, V per part), on the CPU
        k = torch.empty(256, 2, d, dtype=torch.bfloat16)
        for name, fields in zip(("Kd0", "Vd0", "Kd1", "Vd1"),
                                module._tma_templates(_Shape(d), k, k, tile.block_n)):
            desc = object.__new__(module.HostTensorDescriptor)
            vars(desc).update(fields)
            descriptors[name] = mangle_type(desc)
    else:
        constexprs.update(Kd0=None, Vd0=None, Kd1=None, Vd1=None)
    kernel = module._full_attention_kernel
    sig, attrs, constexprs = signature(kernel, constexprs, floats={"qk_scale", "inv_scale"})
    sig.update(descriptors)
    src = GluonASTSource(fn=kernel, signature=sig, attrs=attrs, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=tile.block_m // 16, enable_fp_fusion=True,
                                       **({"maxnreg": tile.maxnreg} if tile.maxnreg else {})))


class _Shape:
    """What ``_tma_templates`` reads of a problem: its head dim."""

    def __init__(self, head_dim):
        self.head_dim = head_dim


@functools.cache
def _release_tiles(release: str) -> tuple:
    """(head dim, causal, tile) of every group of the shipped tables for ``release``, read once."""
    from vllm_sinks.v1.attention.ops import full_attention_table as fat

    rows = []
    for path in sorted(fat.SHIPPED_DIR.glob("*.json")):
        table = fat.load_table(path)
        if table.triton == release:
            rows += [(d, causal, gf.TileConfig(**tile))
                     for (d, _dtype, causal), tile in sorted(table.tiles.items())]
    return tuple(rows)


def shipped_tiles(case: str) -> list:
    """The tiles other than the default that the shipped tables for this Triton release name for
    the case's (head dim, causal) group, any GPU and dtype."""
    from vllm_sinks.v1.attention.ops import full_attention_table as fat

    d, _, causal, _ = CASES[case]
    tiles = []
    for head_dim, group_causal, t in _release_tiles(fat.triton_release(triton.__version__)):
        if head_dim == d and group_causal == causal and t != gf.default_tile(causal) \
                and t not in tiles:
            tiles.append(t)
    return tiles


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", choices=sorted(CASES), action="append")
    ap.add_argument("--sass", help="also write the SASS here (one case)")
    ap.add_argument("--tile", help="another tile: BLOCK_M,BLOCK_N,STAGES,DEFER_PV,MAXNREG(0: none)"
                    "[,OVERLAP[,TMA]] (e.g. 128,64,4,0,0,1; 64,64,2,0,0,0,1)")
    ap.add_argument("--module", help="compile this copy of gluon_full_attention.py instead")
    args = ap.parse_args(argv)
    module = gf
    if args.module:
        module = load_module(args.module)
    for case in args.case or CASES:
        tiles = [None, *shipped_tiles(case)]
        if args.tile:
            m, n, st, defer, reg, *more = (int(x) for x in args.tile.split(","))
            overlap, tma = (bool(x) for x in (more + [0, 0])[:2])
            tiles = [gf.TileConfig(m, n, st, bool(defer), reg or None, overlap, tma)]
        for tile in tiles:
            compiled = compile_case(case, tile, module)
            sass, res, ops = read_compiled(compiled, args.sass)
            label = case if tile is None else f"{case} ({_tile_name(tile._asdict())}, a shipped table's tile)"
            print(f"{label}: {res.get('reg')} registers, {res.get('stack', 0)} B stack (spills), "
                  f"{compiled.metadata.shared} B shared memory, {sum(ops.values())} instructions "
                  f"(Triton {triton.__version__})")
            print("  " + ", ".join(f"{op} {n}" for op, n in ops.most_common(12)))


if __name__ == "__main__":
    main()
