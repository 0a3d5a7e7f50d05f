"""The MiMo window wrapper with our op: a seen call signature skips the checks and the cu_seqlens
split, and still computes what the reference does; what changes the call is re-checked."""

from __future__ import annotations

import pytest
import torch

from tests.op.prefill_op_cases import DEVICE
from vllm_sinks.model_executor.models import mimo_v2_omni as fork
from vllm_sinks.v1.attention.ops import triton_prefill_attention as op
from vllm_sinks.v1.attention.ops.prefill_attention_reference import (
    reference_prefill_attention,
    relative_l2,
)


def _inputs(seed, lens=(7, 12), hq=4, hkv=2, d=16):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(lens), hq + 2 * hkv, d, generator=g).to(DEVICE)  # fused: q, k, v views
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    return q, k, v, cu, (torch.randn(hq, generator=g) * 2).to(DEVICE)


def _ref(q, k, v, cu, window, sinks, key0=True):
    return reference_prefill_attention(q, k, v, cu[:-1], cu[1:] - cu[:-1], is_causal=False,
                                       sliding_window_q=window, sliding_window_k=window,
                                       sinks=sinks, sinks_bias_key0=key0, dtype=torch.float32)


def test_seen_signature_runs_without_checks_and_stays_right(monkeypatch):
    q, k, v, cu, sinks = _inputs(0)
    bound = torch.tensor(12)
    first = fork.window_attention_with_sinks(q, k, v, cu, bound, 3, sinks)
    assert relative_l2(first, _ref(q, k, v, cu, 3, sinks)) < 1e-5
    calls = []
    monkeypatch.setattr(fork, "_check_inputs", lambda *a: calls.append(a))
    monkeypatch.setattr(op, "plan", lambda *a: pytest.fail("planned again"))
    q2, k2, v2, _, s2 = _inputs(1)  # new data, same signature, same cu_seqlens and bound objects
    out = fork.window_attention_with_sinks(q2, k2, v2, cu, bound, 3, s2)
    assert calls == [] and relative_l2(out, _ref(q2, k2, v2, cu, 3, s2)) < 1e-5


def test_cu_seqlens_written_in_place_is_read_again():
    q, k, v, cu, sinks = _inputs(2)
    fork.window_attention_with_sinks(q, k, v, cu, 12, 3, sinks)
    cu.copy_(torch.tensor([0, 12, 19], dtype=torch.int32))  # same object, new lengths (12, 7)
    out = fork.window_attention_with_sinks(q, k, v, cu, 12, 3, sinks)
    assert relative_l2(out, _ref(q, k, v, cu, 3, sinks)) < 1e-5


@pytest.mark.parametrize("bad, match", [
    (dict(window=True), "window must be a positive int"),
    (dict(window=0), "window must be a positive int"),
    (dict(cu_seqlens=torch.tensor([5], dtype=torch.int32)), "cu_seqlens must be a 1-D integer"),
    (dict(sinks=torch.zeros(3)), r"sinks must be \[query heads\]"),
    (dict(semantics="both"), "expected key0"),
])
def test_a_changed_argument_is_checked_even_after_a_seen_call(bad, match):
    q, k, v, cu, sinks = _inputs(3)
    args = dict(q=q, k=k, v=v, cu_seqlens=cu, max_seqlen=12, window=1, sinks=sinks)
    fork.window_attention_with_sinks(**args)  # seen: window 1, these shapes
    if "sinks" in bad or "cu_seqlens" in bad:
        bad = {n: t.to(DEVICE) for n, t in bad.items()}
    with pytest.raises(ValueError, match=match):
        fork.window_attention_with_sinks(**(args | bad))


def test_null_semantics_and_no_sinks_are_their_own_signatures():
    q, k, v, cu, sinks = _inputs(4)
    key0 = fork.window_attention_with_sinks(q, k, v, cu, 12, 3, sinks, "key0")
    null = fork.window_attention_with_sinks(q, k, v, cu, 12, 3, sinks, "null")
    none = fork.window_attention_with_sinks(q, k, v, cu, 12, 3, None)
    assert relative_l2(key0, _ref(q, k, v, cu, 3, sinks, True)) < 1e-5
    assert relative_l2(null, _ref(q, k, v, cu, 3, sinks, False)) < 1e-5
    assert relative_l2(none, _ref(q, k, v, cu, 3, None)) < 1e-5


def test_a_seen_signature_is_not_planned_again_and_another_signature_is(monkeypatch):
    """A call of a seen signature takes its plan by key; a tensor with another dtype, shape or
    strides is a signature of its own, checked and planned."""
    q, k, v, cu, sinks = _inputs(5)
    bound = torch.tensor(12)
    fork.window_attention_with_sinks(q, k, v, cu, bound, 3, sinks)
    real = op.plan
    planned = []
    monkeypatch.setattr(op, "plan", lambda *a, **kw: planned.append(a) or real(*a, **kw))
    fork.window_attention_with_sinks(q, k, v, cu, bound, 3, sinks)
    assert planned == []
    changed = [
        (q, k, v, cu, sinks.to(torch.bfloat16)),  # a sink dtype
        (q.contiguous(), k, v, cu, sinks),  # q's strides (not a view of the fused projection)
        (q, k, v, torch.tensor([0, 7, 12, 19], dtype=cu.dtype, device=cu.device), sinks),  # 3 images
        (q, k, v, cu.long(), sinks),  # cu_seqlens' dtype
    ]
    for i, (q2, k2, v2, cu2, s2) in enumerate(changed, 1):
        out = fork.window_attention_with_sinks(q2, k2, v2, cu2, bound, 3, s2)
        assert len(planned) == i, i  # not taken for the seen signature
        assert relative_l2(out, _ref(q2, k2, v2, cu2, 3, s2.float())) < 1e-2
        fork.window_attention_with_sinks(q2, k2, v2, cu2, bound, 3, s2)
        assert len(planned) == i, i  # now seen itself
    fork.window_attention_with_sinks(q, k, v, cu, torch.tensor(12, dtype=torch.int32), 3, sinks)
    assert len(planned) == len(changed) + 1  # the bound's dtype is part of the signature too


@pytest.mark.parametrize("bad, match", [
    (lambda q, k, v, cu, s: (q, k[:, :1], v, cu, s), "head counts differ"),
    (lambda q, k, v, cu, s: (q, k, v, cu.float(), s), "cu_seqlens must be a 1-D integer"),
    (lambda q, k, v, cu, s: (q[..., :8], k, v, cu, s), "head dims differ"),
    (lambda q, k, v, cu, s: (q, k, v.double(), cu, s), "share a dtype"),
])
def test_bad_tensors_beside_a_seen_signature_get_the_checks(bad, match):
    q, k, v, cu, sinks = _inputs(6)
    fork.window_attention_with_sinks(q, k, v, cu, 12, 3, sinks)
    q2, k2, v2, cu2, s2 = bad(q, k, v, cu, sinks)
    with pytest.raises(ValueError, match=match):
        fork.window_attention_with_sinks(q2, k2, v2, cu2, 12, 3, s2)


def test_sinks_are_read_from_a_modules_parameters_buffers_or_attributes():
    """The patched layer reads its sinks per call: a parameter through the module's parameter
    dict (nn.Module's own lookup is slow), a buffer or a plain attribute as before."""
    def module(how):
        m = torch.nn.Module()
        m.num_heads_per_partition, m.tp_rank, m.tp_size = 2, 1, 2
        sinks = torch.arange(4.0)
        if how == "parameter":
            m.sinks = torch.nn.Parameter(sinks, requires_grad=False)
        elif how == "buffer":
            m.register_buffer("sinks", sinks)
        elif how == "attribute":
            m.__dict__["sinks"] = sinks
        return m

    for how in ("parameter", "buffer", "attribute"):
        assert fork.attention_sinks_for_rank(module(how)).tolist() == [2.0, 3.0], how
    assert fork.attention_sinks_for_rank(module("none")) is None


@pytest.mark.parametrize("bound", [19, 1, 100, "search"])
def test_kernels_read_cumulative_offsets_as_is(bound):
    """``cu_seqlens=True`` (the wrapper's calls): the kernels take sequence b as rows cu[b] …
    cu[b + 1] - 1 from the one tensor, with a host bound exact, too small or too large, and with
    the on-device search (a device tensor, here on the meta device, is never read); empty images
    and offsets past the buffer are clamped, as with start offsets and lengths."""
    lens = (7, 0, 12, 5)
    q, k, v, cu, sinks = _inputs(8, lens=lens)
    bound = torch.tensor(19, device="meta") if bound == "search" else bound
    o = torch.full_like(q, float("nan"))
    chosen = op.plan(q, k, v, o, cu, cu, bound, False, None, 3, 3, sinks, True, cu_seqlens=True)
    chosen(q, k, v, o, cu, cu, sinks, bound)
    assert relative_l2(o, _ref(q, k, v, cu, 3, sinks)) < 1e-5
    past = torch.tensor([0, 20, 40], dtype=torch.int32)  # the second image runs past the 24 rows
    q, k, v, _, sinks = _inputs(9, lens=(20, 4))
    o = torch.full_like(q, float("nan"))
    op.plan(q, k, v, o, past, past, 20, False, None, 3, 3, sinks, True, cu_seqlens=True)(
        q, k, v, o, past, past, sinks, 20)
    clamped = torch.tensor([0, 20, 24], dtype=torch.int32)
    assert relative_l2(o, _ref(q, k, v, clamped, 3, sinks)) < 1e-5


def test_cumulative_offsets_must_be_one_tensor():
    q, k, v, cu, sinks = _inputs(10)
    with pytest.raises(ValueError, match="one cu_seqlens tensor"):
        op.plan(q, k, v, torch.empty_like(q), cu, cu.clone(), 12, False, None, 3, 3, sinks, True,
                cu_seqlens=True)
    with pytest.raises(ValueError, match="one cu_seqlens tensor"):
        empty = torch.zeros(0, dtype=torch.int32)
        op.plan(q, k, v, torch.empty_like(q), empty, empty, 12, False, None, 3, 3, sinks, True,
                cu_seqlens=True)


def test_inference_mode_tensors_and_in_place_offsets():
    """vLLM runs models in inference mode, whose tensors keep no version counter: the wrapper
    caches nothing keyed by one, so a seen signature with new offsets written into the same
    cu_seqlens (and a new value into the same bound) computes with the new ones."""
    with torch.inference_mode():
        q, k, v, cu, sinks = _inputs(11)
        bound = torch.tensor(12)
        first = fork.window_attention_with_sinks(q, k, v, cu, bound, 3, sinks)
        assert relative_l2(first, _ref(q, k, v, cu, 3, sinks)) < 1e-5
        cu.copy_(torch.tensor([0, 12, 19], dtype=torch.int32))
        bound.fill_(7)  # too small now: costs time, never output
        again = fork.window_attention_with_sinks(q, k, v, cu, bound, 3, sinks)
        assert relative_l2(again, _ref(q, k, v, cu, 3, sinks)) < 1e-5
        o = torch.empty_like(q)
        starts, lens = cu[:-1].clone(), (cu[1:] - cu[:-1])
        for _ in range(2):  # the op's own seen path with an inference-mode host bound
            op.context_attention_fwd(q, k, v, o, starts, lens, bound, False, None, 3, 3, sinks, True)
        assert relative_l2(o, _ref(q, k, v, cu, 3, sinks)) < 1e-5
