"""``upstream_launch.UpstreamRoute``: a call routed to upstream's op is recorded once, then its one
Triton launch is replayed through the C launch with each call's own tensors, and nothing that the
recording did not show is replayed.

On the CPU, a stand-in of upstream's op launches a real ``JITFunction`` whose ``run`` is stood in
for (it hands the release's own ``CudaLauncher.__call__``, on a runner whose C launch records,
what Triton's ``JITFunction.run`` would: the grid and every bound argument). The real upstream op
and kernel are replayed on the H200 (tests/gpu/test_launch_path_gpu.py)."""

from __future__ import annotations

import inspect

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from tests.support import triton_launch_fakes as fakes
from vllm_sinks.v1.attention.ops import kernel_launcher, measured_choice
from vllm_sinks.v1.attention.ops import triton_prefill_attention as op
from vllm_sinks.v1.attention.ops import upstream_launch

PACKED = "arg_annotations" in fakes.init_attributes()
pytestmark = pytest.mark.skipif(not PACKED, reason="Triton 3.6's launcher: nothing is replayed")


def _kernel(Q, K, V, Sinks, sm_scale, Starts, Lens, Out, stride_qbs, stride_qh, stride_kbs,
            stride_kh, stride_obs, stride_oh, kv_group_num: tl.constexpr, BLOCK_M: tl.constexpr,
            IS_CAUSAL: tl.constexpr):
    pass  # never compiled: the test stands in for its run


KERNEL = JITFunction(_kernel)
FOREIGN = torch.zeros(4)


def _upstream(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal=True,
              softmax_scale=None, sliding_window_q=None, sliding_window_k=None, sinks=None,
              sinks_bias_key0=False, *, extra=None):
    """Shaped like upstream's op: scalars from shapes and arguments, one launch."""
    scale = (q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale) * 1.4426950408889634
    grid = (b_seq_len.shape[0], q.shape[1], triton.cdiv(max_input_len, 64))
    if extra == "torch op":
        o.zero_()
    KERNEL[grid](q, k, v, q if sinks is None else sinks, scale, b_start_loc, b_seq_len,
                 FOREIGN if extra == "foreign tensor" else o, q.stride(0), q.stride(1), k.stride(0),
                 k.stride(1), o.stride(0), object() if extra == "object" else o.stride(1),
                 kv_group_num=q.shape[1] // k.shape[1], BLOCK_M=64, IS_CAUSAL=is_causal,
                 num_warps=4, num_stages=1)
    if extra == "two launches":
        KERNEL[grid](q, k, v, q, scale, b_start_loc, b_seq_len, o, 1, 1, 1, 1, 1, 1,
                     kv_group_num=1, BLOCK_M=64, IS_CAUSAL=is_causal)


class _Triton:
    """``JITFunction.run`` stood in for: binds the arguments as Triton does and launches through
    the release's launcher on a runner whose C launch is ``calls``."""

    def __init__(self):
        self.calls = fakes.Recorder()
        self.runs = 0

    def run(self, kernel, *args, grid, warmup, **kwargs):
        self.runs += 1
        signature = inspect.signature(kernel.fn)
        bound = signature.bind(*args, **{n: kwargs[n] for n in kwargs if n in signature.parameters})
        compiled = fakes.FakeCompiled(fakes.fake_runner(self.calls))
        compiled.run(*grid, "stream0", compiled.function, compiled.packed_metadata, None, None, None,
                     *bound.arguments.values())
        return compiled


@pytest.fixture()
def triton_stand_in(monkeypatch):
    stand_in = _Triton()
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **kw: stand_in.run(self, *a, **kw))
    monkeypatch.setattr(measured_choice, "may_measure", lambda device: True)
    monkeypatch.setattr(kernel_launcher, "stream_functions",
                        lambda: (lambda device: f"stream{device}", lambda: 0))
    with fakes.fake_active_driver():
        yield stand_in


def _call(tokens=32, seed=0, offset=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens * 4 * 16 + offset, generator=g)[offset:].view(tokens, 4, 16)
    k, v = torch.randn(tokens, 2, 16, generator=g), torch.randn(tokens, 2, 16, generator=g)
    return (q, k, v, torch.empty(tokens, 4, 16), torch.zeros(1, dtype=torch.int32),
            torch.full((1,), tokens, dtype=torch.int32))


#: A route's arguments after the tensors: bound, is_causal, softmax_scale, window q, window k.
ROUTE_ARGS = (32, False, 0.125, None, None)


def _as_pointers(args):
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)


def test_a_route_replays_the_launch_upstream_makes(triton_stand_in):
    route = upstream_launch.UpstreamRoute(_upstream)
    first = _call()
    route(*first, *ROUTE_ARGS)  # recorded: upstream's op ran
    assert route.replay is not None, route.why_not
    assert triton_stand_in.runs == 1 and len(triton_stand_in.calls.calls) == 1
    second = _call(seed=1)
    route(*second, *ROUTE_ARGS)  # replayed: no JITFunction.run, one C launch
    _upstream(*second, 32, False, 0.125)  # what upstream's own call hands the C launch
    replayed, own = triton_stand_in.calls.calls[1:]
    assert triton_stand_in.runs == 2
    assert replayed[:4] == (1, 4, 1, "stream0")  # grid (1 sequence, 4 heads, 1 block), stream
    assert replayed[:-1] == own[:-1]
    assert replayed[-1] == _as_pointers(own[-1])
    # Each tensor's address lands where upstream put that tensor (q also stands in for sinks).
    q, k, v, o, starts, lens = (t.data_ptr() for t in second)
    assert replayed[-1][:8] == (q, k, v, q, 0.125 * 1.4426950408889634, starts, lens, o)


@pytest.mark.parametrize("extra, why", [
    ("torch op", "torch operations"),
    ("two launches", "not one"),
    ("foreign tensor", "not one of the call's"),
    ("object", "not a plain value"),
])
def test_what_a_route_does_not_replay(triton_stand_in, extra, why):
    calls = []

    def upstream(*args):
        calls.append(args)
        _upstream(*args, extra=extra)
    route = upstream_launch.UpstreamRoute(upstream)
    route(*_call(), *ROUTE_ARGS)
    assert route.replay is None and why in route.why_not
    route(*_call(seed=1), *ROUTE_ARGS)
    assert len(calls) == 2  # upstream's op itself, every time
    assert route.tries == 0  # recorded once only
    assert route.entry() is upstream  # the front door then calls upstream's op directly


def test_a_call_passing_one_tensor_twice_is_not_replayed(triton_stand_in):
    """Recorded with ``k`` passed as ``v`` too, the launch's V could stand for either: a later call
    of the same shapes with its own ``v`` must not get ``k`` there."""
    calls = []

    def upstream(*args):
        calls.append(args)
        _upstream(*args)
    route = upstream_launch.UpstreamRoute(upstream)
    q, k, _, o, starts, lens = _call()
    route(q, k, k, o, starts, lens, *ROUTE_ARGS)
    assert route.replay is None and "two places" in route.why_not
    second = _call(seed=1)
    route(*second, *ROUTE_ARGS)
    assert len(calls) == 2 and calls[1][2] is second[2]


def test_unaligned_hooked_or_other_device_calls_go_to_upstream(triton_stand_in, monkeypatch):
    calls = []

    def upstream(*args):
        calls.append(args)
        _upstream(*args)
    route = upstream_launch.UpstreamRoute(upstream)
    route(*_call(offset=1), *ROUTE_ARGS)  # q 4 bytes off: not recorded, tried again later
    assert route.replay is None and route.tries == upstream_launch.RECORD_TRIES - 1
    route(*_call(), *ROUTE_ARGS)
    assert route.replay is not None and len(calls) == 2 and route.entry() is route
    route(*_call(offset=2), *ROUTE_ARGS)  # unaligned: upstream's op, not the replay
    assert len(calls) == 3
    launch, get_stream, get_device, device, *rest = route.replay
    route.replay = (launch, get_stream, lambda: 1, device, *rest)
    route(*_call(), *ROUTE_ARGS)  # another current device: upstream's op (its own kernel cache)
    assert len(calls) == 4
    route.replay = (launch, get_stream, get_device, device, *rest)
    monkeypatch.setattr(kernel_launcher, "hooks_set", lambda: True)
    route(*_call(), *ROUTE_ARGS)  # a profiler's hook sees upstream's own launch
    assert len(calls) == 5
    monkeypatch.undo()


def test_the_recording_leaves_triton_as_it_was(triton_stand_in):
    run = JITFunction.__dict__["run"]
    call = upstream_launch._launcher_class().__call__
    route = upstream_launch.UpstreamRoute(_upstream)
    with pytest.raises(RuntimeError, match="upstream failed"):
        def failing(*args):
            raise RuntimeError("upstream failed")
        upstream_launch.UpstreamRoute(failing)(*_call(), *ROUTE_ARGS)
    route(*_call(), *ROUTE_ARGS)
    assert JITFunction.__dict__["run"] is run and upstream_launch._launcher_class().__call__ is call


def test_a_routed_call_through_the_front_door_replays(triton_stand_in, monkeypatch):
    calls = []

    def upstream(*args):
        calls.append(args)
        _upstream(*args)
    monkeypatch.setattr(measured_choice, "challenger_wins", lambda default, challenger: (False, 0.9))
    op.use_upstream_op(upstream)
    try:
        op.context_attention_fwd(*_call(), 32, is_causal=False)  # planned, routed, recorded
        assert len(calls) == 1 and len(op._ROUTES) == 1
        second = _call(seed=3)
        op.context_attention_fwd(*second, 32, is_causal=False)  # replayed
        assert len(calls) == 1
        launched = triton_stand_in.calls.calls[-1][-1]
        assert launched[:4] == tuple(t.data_ptr() for t in (second[0], second[1], second[2], second[0]))
        op.context_attention_fwd(*_call(), 48, is_causal=False)  # another bound: another route
        assert len(calls) == 2 and len(op._ROUTES) == 2
    finally:
        op.use_upstream_op(None)
