"""Bad input to the prefill op raises ValueError saying what is wrong (checked on metadata only)."""

from __future__ import annotations

import pytest
import torch

from prefill_op_cases import DEVICE
from vllm_sinks.v1.attention.ops import prefill_attention_problem as problem
from vllm_sinks.v1.attention.ops.triton_prefill_attention import context_attention_fwd

T, HQ, HKV, D = 12, 4, 2, 32


def good(**over):
    g = torch.Generator().manual_seed(0)
    args = dict(
        q=torch.randn(T, HQ, D, generator=g).to(DEVICE), k=torch.randn(T, HKV, D, generator=g).to(DEVICE),
        v=torch.randn(T, HKV, D, generator=g).to(DEVICE), o=torch.empty(T, HQ, D, device=DEVICE),
        b_start_loc=torch.tensor([0, 5], dtype=torch.int32, device=DEVICE),
        b_seq_len=torch.tensor([5, 7], dtype=torch.int32, device=DEVICE), max_input_len=7,
        sinks=torch.randn(HQ, generator=g).to(DEVICE))
    args.update(over)
    return args


def call(**over):
    kwargs = good(**over)
    pos = [kwargs.pop(n) for n in ("q", "k", "v", "o", "b_start_loc", "b_seq_len", "max_input_len")]
    context_attention_fwd(*pos, **kwargs)


CASES = {
    "q not 3-D": (dict(q=torch.randn(T, HQ * D)), "q must have 3 dimensions"),
    "k tokens": (dict(k=torch.randn(T + 1, HKV, D), v=torch.randn(T + 1, HKV, D)), "same number of tokens"),
    "k v shapes": (dict(v=torch.randn(T, HKV, D + 1)), "k and v must have the same shape"),
    "head dim": (dict(k=torch.randn(T, HKV, D + 8), v=torch.randn(T, HKV, D + 8)), "same head dim"),
    "o shape": (dict(o=torch.empty(T, HQ + 1, D)), r"o must be \[12, 4, 32\]"),
    "gqa ratio": (dict(k=torch.randn(T, 3, D), v=torch.randn(T, 3, D)), "multiple of KV heads"),
    "head dim too large": (dict(q=torch.randn(T, HQ, 288), k=torch.randn(T, HKV, 288),
                                v=torch.randn(T, HKV, 288), o=torch.empty(T, HQ, 288)), "1..256"),
    "int q": (dict(q=torch.ones(T, HQ, D, dtype=torch.int32)), "float16, bfloat16 or float32"),
    "mixed dtypes": (dict(k=torch.randn(T, HKV, D, dtype=torch.float16)), "share a dtype"),
    "o dtype": (dict(o=torch.empty(T, HQ, D, dtype=torch.float64)), "o must be float16"),
    "strided head dim": (dict(q=torch.randn(T, HQ, 2 * D)[:, :, ::2]), "unit stride"),
    "float offsets": (dict(b_start_loc=torch.tensor([0.0, 5.0])), "b_start_loc must be int32 or int64"),
    "2-D lengths": (dict(b_seq_len=torch.tensor([[5, 7]], dtype=torch.int32)), "b_seq_len must have 1"),
    "length mismatch": (dict(b_seq_len=torch.tensor([5, 7, 0], dtype=torch.int32)), "same length"),
    "max_input_len float": (dict(max_input_len=7.0), "max_input_len must be an int"),
    "max_input_len negative": (dict(max_input_len=-1), "max_input_len must be >= 0"),
    "max_input_len float tensor": (dict(max_input_len=torch.tensor(7.0)), "one-element integer tensor"),
    "negative window": (dict(sliding_window_q=-5), "sliding_window_q must be >= 0"),
    "float window": (dict(sliding_window_k=4.5), "sliding_window_k must be an int or None"),
    "sinks length": (dict(sinks=torch.randn(HQ + 1)), r"one value per query head \(4\), got 5"),
    "sinks 2-D": (dict(sinks=torch.randn(1, HQ)), "sinks must have 1 dimensions"),
    "sinks int": (dict(sinks=torch.ones(HQ, dtype=torch.int32)), "sinks must be float32"),
    "scale zero": (dict(softmax_scale=0.0), "softmax_scale must be positive"),
    "scale nan": (dict(softmax_scale=float("nan")), "softmax_scale must be positive"),
    "scale tensor": (dict(softmax_scale=torch.tensor(0.1)), "softmax_scale must be a float"),
    "key0 flag not bool": (dict(sinks_bias_key0="yes"), "sinks_bias_key0 must be a bool"),
    "not a tensor": (dict(v=[[1.0]]), "v must be a torch.Tensor"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_says_what_is_wrong(name):
    over, message = CASES[name]
    over = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) and k != "max_input_len" else v)
            for k, v in over.items()}
    with pytest.raises(ValueError, match=message):
        call(**over)


def test_devices_must_match():
    if DEVICE == "cpu":
        pytest.skip("needs a second device")
    with pytest.raises(ValueError, match="one device"):
        call(sinks=torch.randn(HQ))


def test_cpu_without_interpreter_is_refused(monkeypatch):
    if DEVICE != "cpu":
        pytest.skip("CPU tensors only")
    # The kernels were decorated under the interpreter (read once, at import, as Triton does):
    # what the op checks is that same reading.
    monkeypatch.setattr(problem, "INTERPRETING", False)
    with pytest.raises(ValueError, match="needs a GPU"):
        call(q=torch.randn(T, HQ, 16), k=torch.randn(T, HKV, 16), v=torch.randn(T, HKV, 16),
             o=torch.empty(T, HQ, 16))  # fresh shapes: not in the launcher's cache of checked calls


def test_cache_of_checked_calls_does_not_hide_errors():
    """A good call is remembered by its metadata; a call that differs in any checked item is
    checked again (same shapes but another dtype of o, another window sign, ...)."""
    call()
    call()
    with pytest.raises(ValueError, match="o must be float16"):
        call(o=torch.empty(T, HQ, D, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="max_input_len must be >= 0"):
        call(max_input_len=-3)
    with pytest.raises(ValueError, match="sinks must have one value per query head"):
        call(sinks=torch.randn(HQ + 2, device=DEVICE))


def test_max_input_len_may_be_a_tensor_on_another_device():
    # Never read (no host sync), so its device does not matter: MiMo passes a host tensor beside GPU q.
    # Under the interpreter everything is on the CPU, so the meta device stands in for "another one".
    outs = []
    for max_input_len in (7, torch.tensor(7, dtype=torch.int64, device="meta")):
        kwargs = good(max_input_len=max_input_len)
        pos = [kwargs.pop(n) for n in ("q", "k", "v", "o", "b_start_loc", "b_seq_len", "max_input_len")]
        pos[3].fill_(float("nan"))
        context_attention_fwd(*pos, **kwargs)
        outs.append(pos[3])
    assert not outs[0].isnan().any()
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)


@pytest.mark.parametrize("bad, match", [
    (dict(k=torch.randn(T, HKV, D).to(torch.bfloat16)), "share a dtype"),
    (dict(v=torch.randn(T, HKV, D)[:, :1]), "same shape"),
    (dict(q=torch.randn(T, HQ, 2 * D)[..., ::2]), "unit stride"),
    (dict(b_seq_len=torch.tensor([5, 7], dtype=torch.int16)), "b_seq_len must be int32 or int64"),
    (dict(b_start_loc=torch.tensor([0], dtype=torch.int32)), "same length"),
    (dict(sinks=torch.randn(HQ, dtype=torch.float64)), "sinks must be float32"),
    (dict(sinks_bias_key0=1), "sinks_bias_key0 must be a bool"),
    (dict(max_input_len=torch.tensor([7, 7])), "one-element integer tensor"),
    (dict(max_input_len=7.0), "max_input_len must be an int"),
    (dict(softmax_scale=float("nan")), "softmax_scale must be positive"),
    (dict(o="o"), "o must be a torch.Tensor"),
])
def test_a_seen_signature_does_not_hide_a_bad_call_beside_it(bad, match):
    """Seen calls are recognised by their arguments that are not tensors and one check of their
    tensors' metadata (shapes, strides, dtypes, devices): a call differing in any one of them is a
    new signature, checked."""
    call()
    call()
    bad = {n: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for n, t in bad.items()}
    with pytest.raises(ValueError, match=match):
        call(**bad)


def test_a_seen_signature_is_not_planned_again_and_each_signature_keeps_its_plan(monkeypatch):
    from vllm_sinks.v1.attention.ops import triton_prefill_attention as op

    signatures = [good(), good(max_input_len=torch.tensor(7)), good(sinks=None),
                  good(q=torch.randn(T, 2 * HQ, D, device=DEVICE)[:, ::2])]  # q's strides differ
    op.use_upstream_op(None)  # clears the plan cache
    real, planned, outs = op.plan, [], []
    monkeypatch.setattr(op, "plan", lambda *a, **kw: planned.append(a) or real(*a, **kw))
    for kwargs in signatures:  # each seen once: each its own plan
        call(**kwargs)
        outs.append(kwargs["o"].clone())
    assert len(planned) == len(signatures) == len(op._PLANS)
    monkeypatch.setattr(op, "plan", lambda *a, **kw: pytest.fail("a seen signature planned again"))
    for kwargs, first in zip(signatures, outs):
        kwargs["o"].fill_(float("nan"))
        call(**kwargs)
        torch.testing.assert_close(kwargs["o"], first, rtol=0, atol=0)
