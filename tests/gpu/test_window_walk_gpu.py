"""The Hopper window kernel (gluon_window_attention.py) on the GPU, called directly.

``context_attention_fwd`` dispatches to it for windows in fp16/bf16 at head dim 64 (the op tests in
test_prefill_op_gpu.py then run through it); here it is called without the dispatcher, so a failure
points at the kernel: against the fp32 reference with the op's tolerance rule, against the Triton
kernel, and bitwise against itself under every way of cutting a sequence into programs.
"""

from __future__ import annotations

import pytest
import torch

from test_prefill_op_gpu import PATTERNS, _packed  # skips this module without CUDA, as it skips itself

from vllm_sinks.v1.attention.ops import triton_prefill_attention as op
from vllm_sinks.v1.attention.ops.gluon_window_attention import WalkLaunch, walk_unavailable
from vllm_sinks.v1.attention.ops.prefill_attention_portable import choose_config, launch
from vllm_sinks.v1.attention.ops.prefill_attention_problem import validate
from vllm_sinks.v1.attention.ops.prefill_attention_reference import (
    covered_rows,
    reference_prefill_attention,
    relative_l2,
    same_dtype_torch_error,
)

pytestmark = [pytest.mark.gpu, pytest.mark.hopper_kernel(gate=walk_unavailable)]  # tests/gpu/conftest.py

WINDOWS = dict(PATTERNS, **{
    "window-32": dict(is_causal=False, sliding_window_q=32, sliding_window_k=32),
    "causal-window-64": dict(is_causal=True, sliding_window_q=64, sliding_window_k=0),
})
HEADS = {"gqa4": (32, 8), "gqa8": (64, 8), "gqa16": (32, 2), "gqa12": (24, 2)}
LENS = [700, 1, 0, 300, 129, 16, 17, 63, 64, 65, 2048]


def _plan(q, k, v, o, b_start, b_len, max_len, kwargs, gp=None):
    kwargs = dict(dict(sliding_window_q=None, sliding_window_k=None, sinks=None,
                       sinks_bias_key0=False), **kwargs)
    p = validate(q, k, v, o, b_start, b_len, max_len, softmax_scale=None, **kwargs)
    return WalkLaunch.plan(p, q, k, v, o, b_start, b_len, kwargs.get("sinks"), gp=gp)


def _short_tiles_gp(hq, hkv):
    """The most query heads per tile (the shortest tiles: 64 / gp tokens), or None where that is
    the default's 4 (16-token tiles)."""
    most = min((hq // hkv) & -(hq // hkv), 64)
    return most if most > 4 else None


def _run(q, k, v, b_start, b_len, kwargs, max_len, chunk=None, gp=None):
    """Output of one walk launch into a NaN-poisoned buffer one element wider on every side (the
    launch is planned for that output view: its strides are bound at planning)."""
    tokens, hq, d = q.shape
    buf = torch.full((tokens + 2, hq + 1, d + 1), float("nan"), dtype=q.dtype, device=q.device)
    o = buf[:tokens, :hq, :d]
    walk = _plan(q, k, v, o, b_start, b_len, max_len, kwargs, gp)
    assert walk is not None
    assert walk.tokens_per_tile == 64 // (gp or 4)
    assert walk(q, k, v, o, b_start, b_len, kwargs.get("sinks"), max_len, chunk=chunk)
    rows = covered_rows(b_start, b_len, tokens)
    spare = buf.clone()
    spare[:tokens, :hq, :d][rows] = float("nan")
    assert torch.isnan(spare).all(), "wrote outside the sequence rows"
    assert torch.isfinite(o[rows]).all(), "sequence rows not fully written"
    return o, rows


def _args(sink_mode, pattern, sinks):
    return dict(WINDOWS[pattern], sinks=None if sink_mode == "none" else sinks,
                sinks_bias_key0=sink_mode == "key0")


def test_plan_takes_the_window_shapes_only():
    q, k, v, sinks, b_start, b_len = _packed([64], 32, 8, 64, torch.bfloat16)
    o = torch.empty_like(q)
    mimo = _args("key0", "mimo-window", sinks)
    assert _plan(q, k, v, o, b_start, b_len, 64, mimo) is not None
    assert _plan(q, k, v, o, b_start, b_len, 64, _args("null", "gptoss-causal-window", sinks))
    for kwargs in (dict(is_causal=True), dict(is_causal=False)):  # no window: Triton kernel
        assert _plan(q, k, v, o, b_start, b_len, 64, kwargs) is None
    q32, k32, v32 = (t.float() for t in (q, k, v))  # fp32: Triton kernel
    assert _plan(q32, k32, v32, q32.clone(), b_start, b_len, 64, mimo) is None
    for hkv, d in ((32, 64), (8, 128)):  # MHA (64-token tiles), head dim 128
        q2, k2, v2, s2, _, _ = _packed([64], 32, hkv, d, torch.bfloat16)
        mimo2 = _args("key0", "mimo-window", s2)
        assert _plan(q2, k2, v2, torch.empty_like(q2), b_start, b_len, 64, mimo2) is None
    assert _plan(q, k, v, o.float(), b_start, b_len, 64, mimo) is None  # o of another dtype
    # A window whose masked edges span two blocks (100 / 30 at 16-token tiles): Triton kernel.
    unaligned = dict(mimo, sliding_window_q=100, sliding_window_k=30)
    assert _plan(q, k, v, o, b_start, b_len, 64, unaligned) is None


# 16-token tiles (the default: the walk takes them in pairs of static slot parity) for every head
# ratio, and the shortest tiles a ratio allows where those are shorter (8 or 4 tokens: the parity
# read per tile).
TILINGS = [(h, None) for h in HEADS] + [(h, _short_tiles_gp(*HEADS[h])) for h in HEADS
                                        if _short_tiles_gp(*HEADS[h])]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads,gp", TILINGS, ids=[f"{h}-gp{gp or 4}" for h, gp in TILINGS])
@pytest.mark.parametrize("sink_mode", ["key0", "null", "none"])
@pytest.mark.parametrize("pattern", list(WINDOWS)[:2] + list(WINDOWS)[4:])
def test_against_reference_and_triton_kernel(pattern, sink_mode, heads, gp, dtype):
    hq, hkv = HEADS[heads]
    q, k, v, sinks, b_start, b_len = _packed(LENS, hq, hkv, 64, dtype, gaps=3, seed=11)
    kwargs = _args(sink_mode, pattern, sinks)
    o, rows = _run(q, k, v, b_start, b_len, kwargs, max(LENS), gp=gp)
    ref = reference_prefill_attention(q, k, v, b_start, b_len, dtype=torch.float32, **kwargs)
    base = same_dtype_torch_error(q, k, v, b_start, b_len, ref=ref, rows=rows, **kwargs)
    err = relative_l2(o[rows], ref[rows])
    assert err <= 2.0 * base, f"walk error {err:.3e} > 2 x same-dtype torch error {base:.3e}"
    o_triton = torch.empty_like(q)
    p = validate(q, k, v, o_triton, b_start, b_len, max(LENS), softmax_scale=None, **kwargs)
    launch(p, choose_config(p), q, k, v, o_triton, b_start, b_len, kwargs["sinks"], max(LENS))
    assert relative_l2(o[rows], o_triton[rows]) <= 2.0 * base


@pytest.mark.parametrize("gp", [None, 8])
@pytest.mark.parametrize("pattern", ["mimo-window", "gptoss-causal-window"])
def test_same_bits_however_the_sequences_are_cut(pattern, gp):
    """Tiles per program (1, 3, 7, the default, all) and a too-small length bound (the last program
    of each sequence then takes every tile past it) give bit-identical outputs: with 16-token tiles
    a program's walk starts at an odd slot as often as at an even one."""
    q, k, v, sinks, b_start, b_len = _packed(LENS, 64, 8, 64, torch.bfloat16, gaps=1, seed=12)
    kwargs = _args("key0" if pattern == "mimo-window" else "null", pattern, sinks)
    first, rows = _run(q, k, v, b_start, b_len, kwargs, max(LENS), gp=gp)
    for max_len, chunk in ((max(LENS), 1), (max(LENS), 3), (max(LENS), 7), (max(LENS), 10**6),
                           (64, None), (1, 1), (200, 2)):
        o, _ = _run(q, k, v, b_start, b_len, kwargs, max_len, chunk, gp=gp)
        assert torch.equal(o[rows], first[rows]), (max_len, chunk)


def test_mimo_shape_through_the_op_uses_the_walk():
    """The dispatcher binds the walk for MiMo's call, and the result is at the bf16 floor."""
    q, k, v, sinks, b_start, b_len = _packed([4096] * 4, 32, 8, 64, torch.bfloat16, seed=13)
    kwargs = _args("key0", "mimo-window", sinks)
    o = torch.empty_like(q)
    op.context_attention_fwd(q, k, v, o, b_start, b_len, torch.tensor(4096), **kwargs)
    assert op.plan(q, k, v, o, b_start, b_len, torch.tensor(4096), **kwargs).kernel == "walk"
    ref = reference_prefill_attention(q, k, v, b_start, b_len, **kwargs)
    assert relative_l2(o, ref) < 4e-3


def test_offsets_past_the_buffer_are_clamped():
    """Offsets are not checked on the host (that would sync), so the kernel clamps them like the
    Triton kernel: a sequence running past the buffer ends with it, one with a negative start is
    empty, and nothing outside the tensors is read or written."""
    q, k, v, sinks, _, _ = _packed([300], 32, 8, 64, torch.bfloat16, seed=14)
    b_start = torch.tensor([0, 250, -5], dtype=torch.int32, device="cuda")
    b_len = torch.tensor([120, 200, 10], dtype=torch.int32, device="cuda")
    kwargs = _args("key0", "mimo-window", sinks)
    tokens, hq, d = q.shape
    buf = torch.full((tokens + 40, hq, d), float("nan"), dtype=q.dtype, device="cuda")
    o = buf[:tokens]
    walk = _plan(q, k, v, o, b_start, b_len, 200, kwargs)
    assert walk(q, k, v, o, b_start, b_len, sinks, 200)
    assert torch.isnan(buf[tokens:]).all(), "wrote past the output tensor"
    clamped_start = torch.tensor([0, 250], dtype=torch.int32, device="cuda")
    clamped_len = torch.tensor([120, 50], dtype=torch.int32, device="cuda")
    rows = covered_rows(clamped_start, clamped_len, tokens)
    assert torch.isnan(o[~rows]).all() and torch.isfinite(o[rows]).all()
    ref = reference_prefill_attention(q, k, v, clamped_start, clamped_len, **kwargs)
    base = same_dtype_torch_error(q, k, v, clamped_start, clamped_len, ref=ref, rows=rows, **kwargs)
    assert relative_l2(o[rows], ref[rows]) <= 2.0 * base


@pytest.mark.parametrize("pattern,heads", [("mimo-window", "gqa4"), ("causal-window-64", "gqa8")])
def test_the_kernel_that_runs_does_not_spill(pattern, heads):
    """Under the ptxas at hand (Triton 3.9's 13.4 spills at 168 registers), the second launch of a
    variant runs a compile without spills, at the budget whose programs per SM the grid assumes,
    and gives the first launch's output bit for bit."""
    from vllm_sinks.v1.attention.ops import gluon_window_attention as gw

    hq, hkv = HEADS[heads]
    q, k, v, sinks, b_start, b_len = _packed([1000, 300], hq, hkv, 64, torch.bfloat16, seed=7)
    kwargs = _args("null", pattern, sinks)
    first, rows = _run(q, k, v, b_start, b_len, kwargs, 1000)
    o = torch.empty_like(q)
    walk = _plan(q, k, v, o, b_start, b_len, 1000, kwargs)
    for _ in range(2):  # the first may compile at the tight budget (then the roomy one follows)
        assert walk(q, k, v, o, b_start, b_len, sinks, 1000)
    bound = walk._by_bound[(1000, None)]
    compiled = gw._LAUNCHER._compiled[bound.signature][0]
    assert compiled.n_spills == 0, f"{compiled.n_regs} registers, {compiled.n_spills} B spilled"
    assert bound.signature[-1] == walk.budget().maxnreg
    assert compiled.n_regs <= walk.budget().maxnreg
    assert torch.equal(o[rows], first[rows])
