"""MiMo-V2.5 vision window attention on a GPU, at the model's shapes, in bf16 (no vLLM needed).

The function under test is the one the patched ``MiMoVisionAttention._forward_window_attn`` calls:
``vllm_sinks.model_executor.models.mimo_v2_omni.window_attention_with_sinks``. MiMo-V2.5's vision
config: 32 query / 8 KV heads, head dim 64, window 64 on each side, an image of 1024×1024 px is 4096
patch tokens. The yardstick is the project's fp32 banded reference.

Run: ``python -m pytest tests/gpu/test_mimo_window_gpu.py`` (skipped without CUDA).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, HEAD_DIM, WINDOW = 32, 8, 64, 64
#: Error bounds of the MiMo window path: bf16 within 2.5e-3 of fp32; dropping the sinks must cost >= 1e-2.
BF16_BOUND, SINK_EFFECT_FLOOR = 2.5e-3, 1e-2
IMAGE_SETS = {
    "1x1024": (1024,),
    "1x4096": (4096,),
    "1x16384": (16384,),
    "4x4096": (4096,) * 4,
    "mixed-1024-4096-16384": (1024, 4096, 16384),
}


def _case(lengths, seed=0, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)
    tokens = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    q = randn(tokens, HEADS, HEAD_DIM).bfloat16()
    k = randn(tokens, KV_HEADS, HEAD_DIM).bfloat16()
    v = randn(tokens, KV_HEADS, HEAD_DIM).bfloat16()
    # N(0, 2²) as in the op baselines: with N(0, 1) the null logit moves the output by only ~1e-2
    # at window 64 (129 keys share the denominator), too close to the floor this test asserts.
    sinks = 2 * randn(HEADS)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, sinks, cu


def _sink_reached_rows(lengths, semantics, device="cuda"):
    """Rows the sinks can change: all under ``null``; under ``key0`` only queries that see key 0."""
    rows = torch.zeros(sum(lengths), dtype=torch.bool, device=device)
    start = 0
    for length in lengths:
        rows[start:start + (length if semantics == "null" else min(length, WINDOW + 1))] = True
        start += length
    return rows


@pytest.mark.parametrize("semantics", ["key0", "null"])
@pytest.mark.parametrize("images", list(IMAGE_SETS), ids=list(IMAGE_SETS))
def test_bf16_window_attention_at_mimo_shapes(images, semantics):
    from vllm_sinks.model_executor.models.mimo_v2_omni import window_attention_with_sinks
    from vllm_sinks.v1.attention.ops.prefill_attention_reference import (
        reference_prefill_attention,
        relative_l2,
    )

    lengths = IMAGE_SETS[images]
    q, k, v, sinks, cu = _case(lengths)
    # As MiMo's tower passes it: derived from grid_thw, which stays on the host.
    max_seqlen = torch.tensor(max(lengths))
    out = window_attention_with_sinks(q, k, v, cu, max_seqlen, WINDOW, sinks.bfloat16(), semantics)
    ref_args = dict(is_causal=False, sliding_window_q=WINDOW, sliding_window_k=WINDOW,
                    softmax_scale=HEAD_DIM ** -0.5, dtype=torch.float32)
    b_start, b_len = cu[:-1], cu[1:] - cu[:-1]
    ref = reference_prefill_attention(q, k, v, b_start, b_len, sinks=sinks.bfloat16(),
                                      sinks_bias_key0=semantics == "key0", **ref_args)
    dropped = reference_prefill_attention(q, k, v, b_start, b_len, **ref_args)
    reached = _sink_reached_rows(lengths, semantics)

    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    err = relative_l2(out, ref)
    err_reached = relative_l2(out[reached], ref[reached])
    err_dropped = relative_l2(dropped[reached], ref[reached])
    print(f"{images} {semantics}: err {err:.2e}, on sink-reached rows {err_reached:.2e}, "
          f"sinks dropped {err_dropped:.2e}")
    assert err <= BF16_BOUND
    assert err_reached <= BF16_BOUND
    assert err_dropped >= SINK_EFFECT_FLOOR


def test_no_host_sync_on_max_seqlen():
    """max_seqlen as MiMo passes it (host tensor) or as a device tensor: the call never syncs.

    The two run different kernels on the H200 (a host bound lets the op take the Hopper window
    kernel; a device tensor keeps the Triton kernel, which finds its sequences on the device), so
    they agree to the bf16 floor, not bit for bit."""
    from vllm_sinks.model_executor.models.mimo_v2_omni import window_attention_with_sinks
    from vllm_sinks.v1.attention.ops.prefill_attention_reference import relative_l2

    lengths = (1024, 4096)
    q, k, v, sinks, cu = _case(lengths, seed=1)
    sinks = sinks.bfloat16()
    as_passed = (torch.tensor(max(lengths)), torch.tensor(max(lengths), device="cuda"))
    for max_seqlen in as_passed:  # compile outside the check
        window_attention_with_sinks(q, k, v, cu, max_seqlen, WINDOW, sinks)
    torch.cuda.synchronize()
    outs = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for max_seqlen in as_passed:
            outs.append(window_attention_with_sinks(q, k, v, cu, max_seqlen, WINDOW, sinks))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert relative_l2(outs[0], outs[1]) <= 2 * BF16_BOUND  # each within the floor of the truth


def test_a_captured_layer_replays_like_eager_calls_with_new_lengths():
    """The wrapper's seen-signature path (its plan and its launch kept from eager calls) inside a
    CUDA graph: the kernel reads cu_seqlens itself, so new offsets written into it are what a replay
    uses, and eager calls after the capture compute the same bits."""
    from vllm_sinks.model_executor.models.mimo_v2_omni import window_attention_with_sinks
    from vllm_sinks.v1.attention.ops.prefill_attention_reference import (
        reference_prefill_attention,
        relative_l2,
    )

    q, k, v, sinks, cu = _case((1024, 3072), seed=7)
    bound = torch.tensor(4096)

    def layer():
        return window_attention_with_sinks(q, k, v, cu, bound, WINDOW, sinks, "key0")

    def ref():
        return reference_prefill_attention(q, k, v, cu[:-1], cu[1:] - cu[:-1], is_causal=False,
                                           sliding_window_q=WINDOW, sliding_window_k=WINDOW,
                                           sinks=sinks, sinks_bias_key0=True, dtype=torch.float32)

    eager = layer()  # planned
    layer()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer()
    for lengths in ((2048, 2048), (100, 3996)):
        cu.copy_(torch.tensor([0, lengths[0], 4096], dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert relative_l2(out, ref()) < BF16_BOUND
        assert torch.equal(out, layer())  # eager, after the capture: the same bits
    assert relative_l2(eager, ref()) > SINK_EFFECT_FLOOR  # the lengths did change


def test_the_patched_layer_in_inference_mode():
    """As vLLM runs the tower (inference mode: its tensors keep no version counter): the patched
    layer's first and seen calls give the reference's output, and new offsets written into the same
    cu_seqlens are what the next call computes with."""
    from benchmarks.kernels.host_cost import vision_attention_stand_in
    from vllm_sinks.model_executor.models.mimo_v2_omni import make_forward_window_attn
    from vllm_sinks.v1.attention.ops.prefill_attention_reference import (
        reference_prefill_attention,
        relative_l2,
    )

    layer = make_forward_window_attn("key0")
    with torch.inference_mode():
        q, k, v, sinks, cu = _case((1024, 3072), seed=11)
        attn = vision_attention_stand_in(sinks, WINDOW, HEAD_DIM ** -0.5)
        bound = torch.tensor(3072)
        for lengths in ((1024, 3072), (1024, 3072), (3000, 1096)):
            cu.copy_(torch.tensor([0, lengths[0], 4096], dtype=torch.int32))
            bound.fill_(max(lengths))
            out = layer(attn, q, k, v, cu, bound)
            ref = reference_prefill_attention(q, k, v, cu[:-1], cu[1:] - cu[:-1], is_causal=False,
                                              sliding_window_q=WINDOW, sliding_window_k=WINDOW,
                                              sinks=sinks, sinks_bias_key0=True, dtype=torch.float32)
            assert relative_l2(out, ref) < BF16_BOUND, lengths
