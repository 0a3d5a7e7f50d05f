"""The op's launch path on the GPU: a call signature seen before skips Triton's argument binding
(``kernel_launcher.DirectLauncher``). These check that such a call still runs on *its* tensors
(fresh buffers, fresh data), under CUDA-graph capture, on both kernels, and that the plan picks
the Hopper kernel only on an NVIDIA sm_90 GPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from test_prefill_op_gpu import PATTERNS, _packed  # noqa: E402

from vllm_sinks.v1.attention.ops import triton_prefill_attention as op  # noqa: E402
from vllm_sinks.v1.attention.ops.gluon_window_attention import walk_unavailable  # noqa: E402
from vllm_sinks.v1.attention.ops.prefill_attention_reference import (  # noqa: E402
    reference_prefill_attention,
    relative_l2,
)

LENS = [700, 64, 300]
# (max_input_len as passed, the kernel that runs): a host bound takes the Hopper kernel where it
# can run, a device tensor the portable kernel's on-device sequence search.
BOUNDS = {"host": lambda n: torch.tensor(n), "device": lambda n: torch.tensor(n, device="cuda"),
          "int": lambda n: n}


def _call(q, k, v, o, b_start, b_len, bound, sinks):
    op.context_attention_fwd(q, k, v, o, b_start, b_len, bound, **dict(
        PATTERNS["mimo-window"], sinks=sinks, sinks_bias_key0=True))


def _ref(q, k, v, b_start, b_len, sinks):
    return reference_prefill_attention(q, k, v, b_start, b_len, sinks=sinks, sinks_bias_key0=True,
                                       **PATTERNS["mimo-window"])


@pytest.mark.parametrize("bound", list(BOUNDS))
def test_a_seen_signature_runs_on_this_calls_tensors(bound):
    """Three calls of one signature on fresh tensors and data: each output is its own inputs'."""
    for seed in range(3):
        q, k, v, sinks, b_start, b_len = _packed(LENS, 32, 8, 64, torch.bfloat16, seed=100 + seed)
        o = torch.full_like(q, float("nan"))
        _call(q, k, v, o, b_start, b_len, BOUNDS[bound](max(LENS)), sinks)
        assert relative_l2(o, _ref(q, k, v, b_start, b_len, sinks)) < 4e-3, seed


def test_a_seen_signature_captures_in_a_cuda_graph():
    q, k, v, sinks, b_start, b_len = _packed(LENS, 32, 8, 64, torch.bfloat16, seed=200)
    o = torch.empty_like(q)
    bound = torch.tensor(max(LENS))
    _call(q, k, v, o, b_start, b_len, bound, sinks)  # compile and cache outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _call(q, k, v, o, b_start, b_len, bound, sinks)
    for seed in (201, 202):  # new data in the captured buffers
        q2, k2, v2, s2, _, _ = _packed(LENS, 32, 8, 64, torch.bfloat16, seed=seed)
        for dst, src in ((q, q2), (k, k2), (v, v2), (sinks, s2)):
            dst.copy_(src)
        o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert relative_l2(o, _ref(q, k, v, b_start, b_len, sinks)) < 4e-3


def test_the_plan_names_the_kernel_it_runs():
    q, k, v, sinks, b_start, b_len = _packed(LENS, 32, 8, 64, torch.bfloat16, seed=300)
    o = torch.empty_like(q)
    kwargs = dict(PATTERNS["mimo-window"], sinks=sinks, sinks_bias_key0=True)
    host = op.plan(q, k, v, o, b_start, b_len, max(LENS), **kwargs).kernel
    assert host == ("triton" if walk_unavailable(q.device) else "walk")
    device = op.plan(q, k, v, o, b_start, b_len, torch.tensor(700, device="cuda"), **kwargs).kernel
    assert device == "triton"


def test_upstream_takes_only_the_calls_the_rule_gives_it():
    """With upstream's op registered, full attention at the rule's head dims goes there; windows and
    sinks stay ours. (A stand-in records the calls; no vLLM here.)"""
    calls = []
    op.use_upstream_op(lambda *args: calls.append(args))
    try:
        q, k, v, sinks, b_start, b_len = _packed(LENS, 16, 16, 64, torch.bfloat16, seed=400)
        o = torch.empty_like(q)
        op.context_attention_fwd(q, k, v, o, b_start, b_len, max(LENS), is_causal=False)
        assert len(calls) == 1 and calls[0][0] is q and calls[0][7] is False
        q2, k2, v2, s2, _, _ = _packed(LENS, 32, 8, 64, torch.bfloat16, seed=401)
        _call(q2, k2, v2, torch.empty_like(q2), b_start, b_len, max(LENS), s2)  # window + sinks
        assert len(calls) == 1
    finally:
        op.use_upstream_op(None)
