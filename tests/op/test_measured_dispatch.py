"""Which op takes a full-attention call when upstream's op is registered: a measured choice, cached
per call signature, with calls routed to upstream skipping our checks (CPU: the timing is stood in
for; ``measured_choice`` itself is timed on the device by ``benchmark_full_attention.py``)."""

from __future__ import annotations

import pytest
import torch

from tests.op.prefill_op_cases import check_tolerance, make_case
from vllm_sinks.v1.attention.ops import measured_choice
from vllm_sinks.v1.attention.ops import triton_prefill_attention as op


@pytest.fixture
def upstream(monkeypatch):
    """A recording stand-in for upstream's op, registered as the prefill-op patch registers it."""
    calls = []
    monkeypatch.setattr(measured_choice, "may_measure", lambda device: True)
    op.use_upstream_op(lambda *args: calls.append(args))
    yield calls
    op.use_upstream_op(None)


def _full(seed=0, lens=(5, 9), d=16):
    return make_case(lens, 2, 2, d, torch.float32, sink_mode="none",
                     generator=torch.Generator().manual_seed(seed))


def test_upstream_measured_faster_takes_the_call_and_skips_our_checks(upstream, monkeypatch):
    monkeypatch.setattr(measured_choice, "challenger_wins", lambda default, challenger: (False, 0.8))
    case = _full()
    op.context_attention_fwd(*case.call_args(), 9, **case.op_kwargs())
    assert len(upstream) == 1 and upstream[0][0] is case.q and upstream[0][7] is False
    # Seen: straight to upstream, without building our call key.
    monkeypatch.setattr(op, "call_key", lambda *a: pytest.fail("our key built for a routed call"))
    op.context_attention_fwd(*case.call_args(), 9, **case.op_kwargs())
    assert len(upstream) == 2


def test_ours_measured_faster_runs_ours(upstream, monkeypatch):
    monkeypatch.setattr(measured_choice, "challenger_wins", lambda default, challenger: (True, 1.3))
    case = _full(seed=1)
    chosen = op.plan(*case.call_args(), 9, **case.op_kwargs())
    assert chosen.kernel == "triton" and chosen.speedup == 1.3
    op.context_attention_fwd(*case.call_args(), 9, **case.op_kwargs())
    op.context_attention_fwd(*case.call_args(), 9, **case.op_kwargs())
    assert upstream == []
    check_tolerance(case)


def test_the_timing_runs_both_candidates_on_the_call(upstream, monkeypatch):
    seen = []

    def timed(default, challenger):
        default()
        challenger()
        seen.append(len(upstream))
        return False, 0.9

    monkeypatch.setattr(measured_choice, "challenger_wins", timed)
    case = _full(seed=2)
    op.context_attention_fwd(*case.call_args(), 9, **case.op_kwargs())
    assert seen == [1] and len(upstream) == 2  # once timed, once the call itself
    assert torch.isfinite(case.o).all()  # ours wrote it too


def test_without_a_measurement_upstream_runs_and_nothing_is_cached(upstream, monkeypatch):
    """In graph capture or tracing nothing is timed: upstream's own behaviour, decided again on
    the next call."""
    monkeypatch.setattr(measured_choice, "may_measure", lambda device: False)
    monkeypatch.setattr(measured_choice, "challenger_wins",
                        lambda default, challenger: pytest.fail("timed where it may not"))
    case = _full(seed=3)
    for _ in range(2):
        op.context_attention_fwd(*case.call_args(), 9, **case.op_kwargs())
    assert len(upstream) == 2 and not op._ROUTES and not op._PLANS


@pytest.mark.parametrize("change", [
    dict(sliding_window_q=4, sliding_window_k=4),  # a window
    dict(sinks="yes"),  # a sink
])
def test_windows_and_sinks_stay_ours(upstream, monkeypatch, change):
    monkeypatch.setattr(measured_choice, "challenger_wins",
                        lambda default, challenger: pytest.fail("upstream offered a call it may not take"))
    case = make_case((5, 9), 2, 2, 16, torch.float32, generator=torch.Generator().manual_seed(4),
                     sink_mode="null" if "sinks" in change else "none")
    kwargs = dict(case.op_kwargs(), **{k: v for k, v in change.items() if k != "sinks"})
    op.context_attention_fwd(*case.call_args(), 9, **kwargs)
    assert upstream == []


def test_bad_input_on_a_routed_shape_is_upstreams_own_behaviour(upstream, monkeypatch):
    """A routed call is upstream's call: our checks do not run on it (what upstream does with it
    is what vLLM without the plugin does)."""
    monkeypatch.setattr(measured_choice, "challenger_wins", lambda default, challenger: (False, 0.9))
    case = _full(seed=5)
    op.context_attention_fwd(*case.call_args(), 9, **case.op_kwargs())
    bad = dict(case.op_kwargs(), softmax_scale=-1.0)
    op.context_attention_fwd(*case.call_args(), 9, **bad)  # the routed shape: upstream's call
    assert len(upstream) == 2 and upstream[-1][8] == -1.0
    other = _full(seed=6, lens=(5, 10))  # a shape not routed: our checks
    with pytest.raises(ValueError, match="softmax_scale"):
        op.context_attention_fwd(*other.call_args(), 10, **dict(other.op_kwargs(), softmax_scale=-1.0))


def test_ours_failing_during_the_timing_leaves_the_call_to_upstream(upstream, monkeypatch):
    """A kernel of ours that fails to compile for a shape (Triton 3.7.1's ptxas crashed on D 32 in
    session 14) must not fail a call upstream's op can run."""
    def timed(default, challenger):
        default()
        challenger()

    monkeypatch.setattr(measured_choice, "challenger_wins", timed)
    monkeypatch.setattr(op.PortableLaunch, "__call__",
                        lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("ptxas crashed")))
    case = _full(seed=7)
    for _ in range(2):
        op.context_attention_fwd(*case.call_args(), 9, **case.op_kwargs())
    assert len(upstream) == 3  # timed once, then the call itself twice
