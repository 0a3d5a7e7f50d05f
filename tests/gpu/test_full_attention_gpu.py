"""The Hopper full-attention kernel (gluon_full_attention.py) on the GPU, called directly.

``context_attention_fwd`` runs it for attention without a window in fp16/bf16 up to head dim 128
(test_prefill_op_gpu.py's full-attention cases then go through it); here it is called without the
dispatcher, so a failure points at the kernel: against the fp32 reference with the op's tolerance
rule (≤ 2 × PyTorch's own error in the inputs' dtype), rows outside every sequence untouched, a
length bound that is too small, strided views as vLLM passes them, and CUDA-graph replays.
"""

from __future__ import annotations

import pytest
import torch

from test_prefill_op_gpu import _packed  # skips this module without CUDA, as it skips itself

from vllm_sinks.v1.attention.ops import triton_prefill_attention as op
from vllm_sinks.v1.attention.ops.gluon_full_attention import FullLaunch, TileConfig, full_unavailable
from vllm_sinks.v1.attention.ops.prefill_attention_problem import validate
from vllm_sinks.v1.attention.ops.prefill_attention_reference import (
    covered_rows,
    reference_prefill_attention,
    relative_l2,
    same_dtype_torch_error,
)

pytestmark = [pytest.mark.gpu, pytest.mark.hopper_kernel(gate=full_unavailable)]  # tests/gpu/conftest.py

# Lengths around every tile edge (64 queries, 64 keys; 128 for the sweep's tiles), one key, empty, long.
LENS = [700, 1, 0, 300, 129, 128, 127, 64, 65, 2048]
SINKS = {"none": dict(), "null": dict(sinks=True), "key0": dict(sinks=True, sinks_bias_key0=True)}


def _call_kwargs(sinks, sink_kind, is_causal):
    kw = dict(is_causal=is_causal, sliding_window_q=None, sliding_window_k=None, sinks=None,
              sinks_bias_key0=False)
    if SINKS[sink_kind]:
        kw.update(sinks=sinks, sinks_bias_key0=SINKS[sink_kind].get("sinks_bias_key0", False))
    return kw


def _launch(q, k, v, o, b_start, b_len, max_len, kw, tile=None):
    p = validate(q, k, v, o, b_start, b_len, max_len, softmax_scale=None, **kw)
    launch = FullLaunch.plan(p, q, k, v, o, b_start, b_len, kw["sinks"], tile=tile)
    assert launch is not None, "the kernel must take this call"
    assert launch(q, k, v, o, b_start, b_len, kw["sinks"], max_len)
    return launch


def _check(q, k, v, b_start, b_len, kw, max_len=None, tile=None):
    tokens = q.shape[0]
    o = torch.full_like(q, float("nan"))
    _launch(q, k, v, o, b_start, b_len, int(b_len.max()) if max_len is None else max_len, kw, tile)
    rows = covered_rows(b_start, b_len, tokens)
    assert torch.isfinite(o[rows]).all(), "sequence rows not fully written"
    assert torch.isnan(o[~rows]).all(), "wrote outside the sequence rows"
    ref_kw = {k_: v_ for k_, v_ in kw.items()}
    ref = reference_prefill_attention(q, k, v, b_start, b_len, dtype=torch.float32, **ref_kw)
    base = same_dtype_torch_error(q, k, v, b_start, b_len, ref=ref, rows=rows, **ref_kw)
    err = relative_l2(o[rows], ref[rows])
    assert err <= 2.0 * base, f"{tile}: error {err:.3e} > 2 x same-dtype torch error {base:.3e}"
    return o


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("sink_kind", sorted(SINKS))
def test_matches_reference(head_dim, dtype, is_causal, sink_kind):
    q, k, v, sinks, b_start, b_len = _packed(LENS, 8, 2, head_dim, dtype, gaps=3, seed=head_dim)
    _check(q, k, v, b_start, b_len, _call_kwargs(sinks, sink_kind, is_causal))


@pytest.mark.parametrize("head_dim", [16, 32, 48, 72, 96, 112, 120])
def test_other_head_dims(head_dim):
    q, k, v, sinks, b_start, b_len = _packed([300, 1000, 77], 4, 4, head_dim, torch.bfloat16,
                                             seed=head_dim)
    _check(q, k, v, b_start, b_len, _call_kwargs(sinks, "none", False))
    _check(q, k, v, b_start, b_len, _call_kwargs(sinks, "null", True))


@pytest.mark.parametrize("heads", [(1, 1), (16, 16), (32, 8), (12, 1), (25, 25)])
def test_heads(heads):
    hq, hkv = heads
    q, k, v, sinks, b_start, b_len = _packed([513, 64, 1025], hq, hkv, 80, torch.bfloat16)
    _check(q, k, v, b_start, b_len, _call_kwargs(sinks, "none", False))


@pytest.mark.parametrize("is_causal", [False, True])
def test_a_bound_too_small_costs_time_never_output(is_causal):
    q, k, v, sinks, b_start, b_len = _packed([1000, 300, 2500], 4, 4, 64, torch.bfloat16)
    kw = _call_kwargs(sinks, "null", is_causal)
    right = _check(q, k, v, b_start, b_len, kw)
    short = _check(q, k, v, b_start, b_len, kw, max_len=100)
    assert torch.equal(right, short)


def test_strided_views_as_vllm_splits_qkv():
    """vLLM's ViT wrappers pass q, k, v as views of one fused projection ([tokens, 3, heads, D]),
    and a head stride that is not a multiple of 8 takes the kernel's unit-stride path."""
    tokens, h, d = 1500, 16, 80
    for pad in (0, 8):  # pad 8: head stride 88
        qkv = torch.randn(tokens, 3, h, d + pad, device="cuda", dtype=torch.bfloat16)
        q, k, v = (qkv[:, i, :, :d] for i in range(3))
        b_len = torch.tensor([700, 800], device="cuda", dtype=torch.int32)
        b_start = torch.tensor([0, 700], device="cuda", dtype=torch.int32)
        _check(q, k, v, b_start, b_len, _call_kwargs(None, "none", False))


def test_rows_off_16_bytes_take_the_portable_kernel():
    """cp.async copies 4 bytes or more: a head stride of 84 elements, or a view that starts 2
    bytes in, is declined by the plan or the launch, and the front door runs the portable kernel."""
    tokens, h = 600, 4
    big = torch.randn(tokens, h, 84, device="cuda", dtype=torch.bfloat16)
    q = k = v = big[:, :, :80]
    b_start = torch.tensor([0], device="cuda", dtype=torch.int32)
    b_len = torch.tensor([tokens], device="cuda", dtype=torch.int32)
    kw = _call_kwargs(None, "none", False)
    p = validate(q, k, v, torch.empty_like(q), b_start, b_len, tokens, softmax_scale=None, **kw)
    assert FullLaunch.plan(p, q, k, v, torch.empty_like(q), b_start, b_len, None) is None
    shifted = torch.randn(tokens, h, 81, device="cuda", dtype=torch.bfloat16)[:, :, 1:]
    o = torch.empty(tokens, h, 80, device="cuda", dtype=torch.bfloat16)
    aligned = torch.randn(tokens, h, 80, device="cuda", dtype=torch.bfloat16)
    p = validate(aligned, aligned, aligned, o, b_start, b_len, tokens, softmax_scale=None, **kw)
    launch = FullLaunch.plan(p, aligned, aligned, aligned, o, b_start, b_len, None)
    assert launch is not None
    assert not launch(shifted, aligned, aligned, o, b_start, b_len, None, tokens)
    op.use_upstream_op(None)
    for args in ((q, k, v), (shifted, aligned, aligned)):
        o = torch.full((tokens, h, 80), float("nan"), device="cuda", dtype=torch.bfloat16)
        op.context_attention_fwd(*args, o, b_start, b_len, tokens, is_causal=False)
        ref = reference_prefill_attention(*args, b_start, b_len, is_causal=False)
        assert relative_l2(o, ref) < 1e-2


def test_cuda_graph_replay_is_eager():
    """A captured call replays the eager call bit for bit, on the inputs the buffers hold then."""
    q, k, v, sinks, b_start, b_len = _packed([900, 333, 64], 16, 16, 80, torch.bfloat16)
    o = torch.empty_like(q)
    kw = _call_kwargs(sinks, "none", False)
    max_len = 900
    _launch(q, k, v, o, b_start, b_len, max_len, kw)  # compiles
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _launch(q, k, v, o, b_start, b_len, max_len, kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _launch(q, k, v, o, b_start, b_len, max_len, kw)
    for seed in (1, 2):
        q2, k2, v2, *_ = _packed([900, 333, 64], 16, 16, 80, torch.bfloat16, seed=seed)
        q.copy_(q2), k.copy_(k2), v.copy_(v2)
        graph.replay()
        eager = torch.empty_like(o)
        _launch(q, k, v, eager, b_start, b_len, max_len, kw)
        torch.cuda.synchronize()
        assert torch.equal(o, eager)


def test_the_front_door_runs_it_for_full_attention():
    q, k, v, sinks, b_start, b_len = _packed([600, 40], 8, 8, 96, torch.float16)
    o = torch.empty_like(q)
    op.use_upstream_op(None)
    chosen = op.plan(q, k, v, o, b_start, b_len, 600, is_causal=False)
    assert chosen.kernel == "full"
    windowed = op.plan(q, k, v, o, b_start, b_len, 600, is_causal=True, sliding_window_q=100)
    assert windowed.kernel != "full"
    on_device_bound = op.plan(q, k, v, o, b_start, b_len, torch.tensor(600, device="cuda"))
    assert on_device_bound.kernel == "triton"


@pytest.mark.parametrize("candidate", range(7))
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_every_tile_a_table_may_name_matches_reference(head_dim, is_causal, candidate):
    """A shipped table may name any of the tune's candidates for a group (``tiles``), and the front
    door then runs every call of that group with it: each is checked here, whichever the tables
    chose on this machine (with sinks under causality: the other sink path)."""
    from vllm_sinks.v1.attention.ops.tune_full_attention import tile_candidates

    candidates = tile_candidates(head_dim, is_causal)
    assert len(candidates) == 7, "parametrize over every candidate"
    q, k, v, sinks, b_start, b_len = _packed(LENS, 8, 2, head_dim, torch.bfloat16, gaps=3,
                                             seed=head_dim + candidate)
    kw = _call_kwargs(sinks, "null" if is_causal else "none", is_causal)
    _check(q, k, v, b_start, b_len, kw, tile=TileConfig(**candidates[candidate]))


TMA_TILE = TileConfig(64, 64, 2, tma=True)


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("is_causal", [False, True])
def test_tma_reads_past_a_sequence_and_past_the_tensor_without_harm(head_dim, is_causal):
    """TMA reads whole key blocks: the rows past a sequence's end (the gap, the next sequence)
    and past the tensor's end (zeros). Those rows hold NaN here; they must change nothing."""
    q, k, v, sinks, b_start, b_len = _packed(LENS, 8, 2, head_dim, torch.bfloat16, gaps=3,
                                             seed=head_dim + 7)
    rows = covered_rows(b_start, b_len, q.shape[0])
    kw = _call_kwargs(sinks, "null", is_causal)
    ref = reference_prefill_attention(q, k, v, b_start, b_len, dtype=torch.float32, **kw)
    base = same_dtype_torch_error(q, k, v, b_start, b_len, ref=ref, rows=rows, **kw)
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[~rows] = float("nan")
    v_nan[~rows] = float("nan")
    o = torch.full_like(q, float("nan"))
    launch = _launch(q, k_nan, v_nan, o, b_start, b_len, int(b_len.max()), kw, TMA_TILE)
    assert launch.constexprs["TMA_KV"]
    assert torch.isfinite(o[rows]).all()
    assert relative_l2(o[rows], ref[rows]) <= 2.0 * base


def test_tma_tiles_take_cp_async_where_tma_cannot_read_the_call():
    """Heads not back to back (a view into a wider buffer), and a head dim its parts do not cover
    exactly (72 = 64 + 16 would read the next head's columns): cp.async, same results."""
    q, k, v, sinks, b_start, b_len = _packed(LENS, 8, 2, 72, torch.bfloat16, gaps=3, seed=72)
    kw = _call_kwargs(sinks, "none", False)
    p = validate(q, k, v, q, b_start, b_len, int(b_len.max()), softmax_scale=None, **kw)
    assert not FullLaunch.plan(p, q, k, v, q, b_start, b_len, None, tile=TMA_TILE).constexprs["TMA_KV"]
    _check(q, k, v, b_start, b_len, kw, tile=TMA_TILE)
    wide = torch.randn(q.shape[0], 2, 96, device=q.device, dtype=torch.bfloat16)
    k64 = wide[:, :, :64]  # rows of 192 elements: 16-byte aligned, heads 96 apart
    q, _, v, sinks, b_start, b_len = _packed(LENS, 8, 2, 64, torch.bfloat16, gaps=3, seed=64)
    p = validate(q, k64, v, q, b_start, b_len, int(b_len.max()), softmax_scale=None, **kw)
    assert not FullLaunch.plan(p, q, k64, v, q, b_start, b_len, None,
                               tile=TMA_TILE).constexprs["TMA_KV"]
    _check(q, k64, v, b_start, b_len, kw, tile=TMA_TILE)


def test_tma_descriptors_follow_each_calls_tensors():
    """The plan keeps the descriptors' fields, each call its own addresses: a second call with
    other tensors of the same shapes (one plan) reads those, not the first call's."""
    q, k, v, sinks, b_start, b_len = _packed(LENS, 8, 2, 80, torch.bfloat16, gaps=3, seed=1)
    kw = _call_kwargs(sinks, "none", False)
    max_len = int(b_len.max())
    launch = _launch(q, k, v, torch.empty_like(q), b_start, b_len, max_len, kw, TMA_TILE)
    assert launch.constexprs["TMA_KV"] and launch.ready(max_len) is None
    k2, v2 = torch.randn_like(k), torch.randn_like(v)
    o = torch.full_like(q, float("nan"))
    assert launch(q, k2, v2, o, b_start, b_len, None, max_len)
    rows = covered_rows(b_start, b_len, q.shape[0])
    ref = reference_prefill_attention(q, k2, v2, b_start, b_len, dtype=torch.float32, **kw)
    base = same_dtype_torch_error(q, k2, v2, b_start, b_len, ref=ref, rows=rows, **kw)
    assert relative_l2(o[rows], ref[rows]) <= 2.0 * base
