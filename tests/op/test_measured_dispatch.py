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


def _routed(upstream, monkeypatch, seed):
    """A full-attention case whose signature upstream's op took (measured), then routed."""
    monkeypatch.setattr(measured_choice, "challenger_wins", lambda default, challenger: (False, 0.9))
    case = _full(seed=seed)
    op.context_attention_fwd(*case.call_args(), 9, **case.op_kwargs())
    assert len(op._ROUTES) == 1 and len(upstream) == 1
    return case


def test_bad_input_on_a_routed_shape_gets_our_checks(upstream, monkeypatch):
    """Only a signature validated before is routed: bad arguments beside routed tensors are a new
    signature, and our checks say what is wrong."""
    case = _routed(upstream, monkeypatch, seed=5)
    with pytest.raises(ValueError, match="softmax_scale"):
        op.context_attention_fwd(*case.call_args(), 9, **dict(case.op_kwargs(), softmax_scale=-1.0))
    with pytest.raises(ValueError, match="max_input_len"):
        op.context_attention_fwd(*case.call_args(), -1, **case.op_kwargs())
    q, k, v, o, starts, lens = case.call_args()
    with pytest.raises(ValueError, match="share a dtype"):
        op.context_attention_fwd(q, k, v.double(), o, starts, lens, 9, **case.op_kwargs())
    with pytest.raises(ValueError, match="same shape"):
        op.context_attention_fwd(q, k, v[:, :1], o, starts, lens, 9, **case.op_kwargs())
    with pytest.raises(ValueError, match="unit stride"):
        strided = torch.empty(*v.shape[:2], 2 * v.shape[2])[..., ::2].copy_(v)
        op.context_attention_fwd(q, k, strided, o, starts, lens, 9, **case.op_kwargs())
    with pytest.raises(ValueError, match="b_seq_len must be int32 or int64"):
        op.context_attention_fwd(q, k, v, o, starts, lens.float(), 9, **case.op_kwargs())
    with pytest.raises(ValueError, match="one device"):
        op.context_attention_fwd(q, k, v, o.to("meta"), starts, lens, 9, **case.op_kwargs())
    assert len(upstream) == 1  # none of them reached upstream's op


@pytest.mark.parametrize("change", ["dtype", "shape", "stride", "sequences"])
def test_a_routed_route_never_takes_another_signature(upstream, monkeypatch, change):
    """A valid call differing from the routed signature in one tensor's dtype, shape or strides is
    planned (and measured) as its own signature: the route of the other is not reused."""
    case = _routed(upstream, monkeypatch, seed=8)
    q, k, v, o, starts, lens = case.call_args()
    if change == "dtype":
        q, k, v, o = (t.bfloat16() for t in (q, k, v, o))
    elif change == "shape":  # one more query head: Hq 4 over Hkv 2 (GQA)
        q, o = torch.cat([q, q], dim=1), torch.cat([o, o], dim=1)
    elif change == "stride":  # the same values in a padded buffer
        wide = torch.zeros(q.shape[0], q.shape[1], q.shape[2] + 8)
        q = wide[..., :q.shape[2]].copy_(q)
    else:  # the same rows as one sequence (a bound too small costs time, never output)
        starts, lens = starts[:1].clone(), lens.sum(0, keepdim=True).to(lens.dtype)
    # the same route key (bound, flags): only the tensor check tells the signatures apart
    seen = []
    monkeypatch.setattr(measured_choice, "challenger_wins",
                        lambda default, challenger: seen.append(True) or (False, 0.9))
    op.context_attention_fwd(q, k, v, o, starts, lens, 9, **case.op_kwargs())
    assert seen == [True] and len(upstream) == 2  # measured as new, then upstream's call
    op.context_attention_fwd(q, k, v, o, starts, lens, 9, **case.op_kwargs())
    assert seen == [True] and len(upstream) == 3 and upstream[-1][0] is q
    # both signatures are routed now, each to itself, without our key or checks
    monkeypatch.setattr(op, "call_key", lambda *a: pytest.fail("our key built for a routed call"))
    op.context_attention_fwd(*case.call_args(), 9, **case.op_kwargs())
    op.context_attention_fwd(q, k, v, o, starts, lens, 9, **case.op_kwargs())
    assert len(upstream) == 5 and upstream[-2][0] is case.q and upstream[-1][0] is q


def test_a_route_is_the_measured_signatures_only(upstream, monkeypatch):
    """Routes are made for upstream's measured wins with an int bound; ours winning, a tensor
    bound or an unmeasured choice (graph capture) route nothing."""
    monkeypatch.setattr(measured_choice, "challenger_wins", lambda default, challenger: (True, 1.2))
    case = _full(seed=9)
    op.context_attention_fwd(*case.call_args(), 9, **case.op_kwargs())
    monkeypatch.setattr(measured_choice, "challenger_wins", lambda default, challenger: (False, 0.9))
    op.context_attention_fwd(*case.call_args(), torch.tensor(9), **case.op_kwargs())
    assert not op._ROUTES and len(upstream) == 1  # upstream's (tensor bound: no route)
    op.context_attention_fwd(*case.call_args(), torch.tensor(9), **case.op_kwargs())
    assert not op._ROUTES and len(upstream) == 2


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
