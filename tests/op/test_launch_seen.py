"""``Plan.launch_seen``: a seen call signature launched straight through the C launch its kernel
took before, and every case where it must not be (no launch yet with this bound, a pointer that is
not 16-byte aligned, a launch hook), on stand-in kernels (the real ones: tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.kernels.host_cost import vision_attention_stand_in
from tests.support import triton_launch_fakes as fakes
from vllm_sinks.model_executor.models import mimo_v2_omni as fork
from vllm_sinks.v1.attention.ops import kernel_launcher
from vllm_sinks.v1.attention.ops import prefill_attention_portable as portable
from vllm_sinks.v1.attention.ops import triton_prefill_attention as op

PACKED = "arg_annotations" in fakes.init_attributes()
pytestmark = pytest.mark.skipif(not PACKED, reason="Triton 3.6's launcher: no ready launches")


@pytest.fixture()
def launches(monkeypatch):
    """The portable kernel's launcher on a stand-in kernel whose C launch records its arguments."""
    calls = fakes.Recorder()
    kernel = fakes.FakeKernel(fakes.kernel_params(portable._LAUNCHER.kernel),
                              lambda: fakes.fake_runner(calls))
    launcher = kernel_launcher.DirectLauncher(kernel)
    launcher._stream = (lambda device: f"stream{device}", lambda: 0)
    monkeypatch.setattr(portable, "_LAUNCHER", launcher)
    op.use_upstream_op(None)  # clears the plan caches
    with fakes.fake_active_driver():
        yield calls
    op.use_upstream_op(None)


def _call(tokens=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, 4, 16, generator=g)
    k, v = torch.randn(tokens, 2, 16, generator=g), torch.randn(tokens, 2, 16, generator=g)
    o = torch.empty_like(q)
    starts = torch.zeros(1, dtype=torch.int32)
    lens = torch.full((1,), tokens, dtype=torch.int32)
    return q, k, v, o, starts, lens


def test_a_seen_call_launches_what_the_plans_launch_does(launches):
    sinks = torch.randn(4)
    kw = dict(is_causal=False, sliding_window_q=3, sliding_window_k=3, sinks=sinks, sinks_bias_key0=True)
    first = _call()
    op.context_attention_fwd(*first, 32, **kw)  # validated, planned, compiled through "Triton"
    assert launches.calls == []
    (plan,) = op._PLANS.values()
    assert list(plan._ready) == [32]  # the bound the call launched with
    second = _call(seed=1)
    op.context_attention_fwd(*second, 32, **kw)  # launch_seen
    third = _call(seed=2)
    plan.portable(*third[:6], sinks, 32)  # the launch object's own path (DirectLauncher.__call__)
    seen, own = launches.calls
    ptrs = lambda call: (*(t.data_ptr() for t in call[:4]), sinks.data_ptr(),  # noqa: E731
                         call[4].data_ptr(), call[5].data_ptr())
    assert seen[-1][:7] == ptrs(second) and own[-1][:7] == ptrs(third)
    assert seen[:-1] == own[:-1] and seen[-1][7:] == own[-1][7:]


def test_what_launch_seen_leaves_to_the_plan(launches, monkeypatch):
    sinks = torch.randn(4)
    q, k, v, o, starts, lens = _call()
    op.context_attention_fwd(q, k, v, o, starts, lens, 32, False, None, 3, 3, sinks, True)
    (plan,) = op._PLANS.values()
    args = (q, k, v, o, sinks)
    assert plan.launch_seen(*args, 32, starts.data_ptr(), lens.data_ptr())
    assert not plan.launch_seen(*args, 31, starts.data_ptr(), lens.data_ptr())  # not launched with 31
    assert not plan.launch_seen(*args, 32, starts.data_ptr() + 4, lens.data_ptr())  # misaligned
    monkeypatch.setattr(kernel_launcher, "hooks_set", lambda: True)
    assert not plan.launch_seen(*args, 32, starts.data_ptr(), lens.data_ptr())  # a profiler's hook
    assert len(launches.calls) == 1


def test_a_seen_mimo_layer_launches_once_into_a_fresh_output(launches, monkeypatch):
    """The patched layer's seen call: one C launch, into the output it returns (a new one each
    call), with cu_seqlens' own address as the offsets (the kernel reads its cumulative offsets)."""
    layer = fork.make_forward_window_attn("key0")
    attn = vision_attention_stand_in(torch.randn(4), window=3, scale=0.25)
    q, k, v, *_ = _call()
    cu = torch.tensor([0, 32], dtype=torch.int32)
    bound = torch.tensor(32)
    layer(attn, q, k, v, cu, bound)  # planned and compiled
    assert launches.calls == []
    with monkeypatch.context() as m:
        m.setattr(op.Plan, "__call__", lambda *a: pytest.fail("not launched by launch_seen"))
        outs = [layer(attn, *_call(seed=s)[:3], cu, bound) for s in (1, 2)]
    assert len(launches.calls) == 2 and outs[0].data_ptr() != outs[1].data_ptr()
    for call, out in zip(launches.calls, outs):
        assert call[-1][3] == out.data_ptr()
        assert call[-1][5:7] == (cu.data_ptr(), cu.data_ptr())
    bound.fill_(31)  # a bound it has not launched with: the plan's own path, then ready for it
    layer(attn, *_call(seed=3)[:3], cu, bound)
    assert len(launches.calls) == 3
    (plan,) = [p for key, p in op._PLANS.items() if key[0] == fork._WRAPPER_KEY]
    assert sorted(plan._ready) == [31, 32]


def test_a_seen_mimo_layer_in_inference_mode_takes_launch_seen(launches, monkeypatch):
    """As vLLM runs the tower: every tensor made in inference mode (no version counters)."""
    layer = fork.make_forward_window_attn("key0")
    with torch.inference_mode():
        attn = vision_attention_stand_in(torch.randn(4), window=3, scale=0.25)
        cu, bound = torch.tensor([0, 20, 32], dtype=torch.int32), torch.tensor(20)
        layer(attn, *_call()[:3], cu, bound)
        with monkeypatch.context() as m:
            m.setattr(op.Plan, "__call__", lambda *a: pytest.fail("not launched by launch_seen"))
            out = layer(attn, *_call(seed=1)[:3], cu, bound)
    (call,) = launches.calls
    assert call[-1][3] == out.data_ptr() and call[-1][5:7] == (cu.data_ptr(), cu.data_ptr())
