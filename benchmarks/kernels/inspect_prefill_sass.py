"""Compile the prefill kernel for sm_90a without a GPU and count its SASS, loop by loop.

    python benchmarks/kernels/inspect_prefill_sass.py                       # the MiMo default shape
    python benchmarks/kernels/inspect_prefill_sass.py --config '{"block_n": 32}' --sass out.sass

Needs Triton with its bundled ptxas / cuobjdump (any Triton wheel for Linux has them); the GPU
machine's Triton is 3.6, so compile with 3.6 for numbers that match it. Why: Nsight Compute on the
H200 showed issue slots 67–71 % busy (docs/kernels/portable.md), so the
instruction count per key block and per program bounds what a change can save, and it can be read
here, for free, between GPU runs (the time it saves still has to be measured on the GPU). Prints registers, spills, shared memory, the instruction
count of each loop body (a backward branch closes a loop) and outside loops, and the wgmma count.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from vllm_sinks.v1.attention.ops import prefill_attention_portable as op  # noqa: E402
from vllm_sinks.v1.attention.ops.prefill_attention_problem import SINKS_KEY0_BIAS, Problem  # noqa: E402

_POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "Sinks": "*fp32",
             "StartLoc": "*i32", "SeqLen": "*i32"}
_FLOATS = {"qk_scale"}


def mimo_problem(num_seqs=4, seq_len=16384) -> Problem:
    return Problem(tokens=num_seqs * seq_len, num_seqs=num_seqs, q_heads=32, kv_heads=8,
                   head_dim=64, dtype=torch.bfloat16, out_dtype=torch.bfloat16,
                   device=torch.device("cuda"), is_causal=False, window_q=64, window_k=64,
                   sink_mode=SINKS_KEY0_BIAS, scale=64 ** -0.5, host_bound=True)


def signature(kernel, constexprs: dict, floats=frozenset(_FLOATS)):
    """Argument types and the divisibility hints the JIT would give the op's kernels (bf16
    tensors, 64-wide heads): without the hints nothing vectorises."""
    sig, attrs = {}, {}
    for i, n in enumerate(kernel.arg_names):
        if n in constexprs:
            sig[n] = "constexpr"
        elif n in _POINTERS:
            sig[n] = _POINTERS[n]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in floats:
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if n.startswith("stride_") and n not in ("stride_sink", "stride_start", "stride_len"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs, {(kernel.arg_names.index(n),): v for n, v in constexprs.items()}


def compile_kernel(p: Problem, cfg: op.LaunchConfig, seq_from_grid: bool = True):
    kernel = op._prefill_attention_kernel
    sig, attrs, constexprs = signature(kernel, op.kernel_constexprs(p, cfg, seq_from_grid))
    src = ASTSource(fn=kernel, signature=sig, attrs=attrs, constexprs=constexprs)
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.maxnreg:
        options["maxnreg"] = cfg.maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _cuobjdump(compiled, flag) -> str:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([cuobjdump, flag, f.name], check=True, capture_output=True,
                              text=True).stdout


def resources(compiled) -> dict:
    """Registers, stack (spill) bytes and shared memory, from the cubin's resource usage."""
    text = _cuobjdump(compiled, "-res-usage")
    found = dict(re.findall(r"(REG|STACK|SHARED):(\d+)", text))
    return {k.lower(): int(v) for k, v in found.items()}


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


def loops(sass: str):
    """(start, end, instructions) of each loop: a branch to a lower address closes one.

    ``cuobjdump -sass`` prints branch targets as absolute addresses (``BRA 0x2800``).
    """
    instrs = [(int(a, 16), text.strip()) for a, text in _INSTR.findall(sass)]
    found = []
    for addr, text in instrs:
        m = re.search(r"BRA\s+0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) <= addr:
            target = int(m.group(1), 16)
            found.append((target, addr, [t for a, t in instrs if target <= a <= addr]))
    return instrs, found


def summary(p, cfg, seq_from_grid=True) -> dict:
    c = compile_kernel(p, cfg, seq_from_grid)
    sass = _cuobjdump(c, "-sass")
    instrs, found = loops(sass)
    in_loops = set()
    for start, end, _ in found:
        in_loops.update(a for a, _ in instrs if start <= a <= end)
    out = dict(**resources(c), total=len(instrs),
               outside_loops=len(instrs) - len(in_loops),
               loops=[len(body) for _, _, body in found],
               hgmma=sum("HGMMA" in t for _, t in instrs),
               wgmma_waits=sum("WARPGROUP.DEPBAR" in t for _, t in instrs),
               ldgsts=sum("LDGSTS" in t for _, t in instrs), bar=sum("BAR.SYNC" in t for _, t in instrs))
    return out, sass


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="", help="LaunchConfig fields as JSON over the default")
    ap.add_argument("--device-len", action="store_true", help="max_input_len on the device (search)")
    ap.add_argument("--sass", default="", help="write the SASS here")
    args = ap.parse_args(argv)
    p = mimo_problem()
    cfg = op.choose_config(p)
    if args.config:
        cfg = dataclasses.replace(cfg, **json.loads(args.config))
    out, sass = summary(p, cfg, seq_from_grid=not args.device_len)
    print(cfg)
    print(json.dumps(out))
    if args.sass:
        with open(args.sass, "w") as f:
            f.write(sass)


if __name__ == "__main__":
    main()
