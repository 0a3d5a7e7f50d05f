"""Which op takes a full-attention call when upstream's op is registered: the shipped table's
verdict for the call's class, looked up, never timed (a recording stand-in for upstream's op, a
device that says it is an H200: no GPU here)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from tests.op.prefill_op_cases import check_tolerance, make_case
from vllm_sinks.v1.attention.ops import full_attention_table as fat
from vllm_sinks.v1.attention.ops import triton_prefill_attention as op

H200 = ("NVIDIA H200", (9, 0), "3.8.0")
HQ = HKV = 2
D = 16


@pytest.fixture
def upstream(monkeypatch, tmp_path):
    """Upstream's op registered as the prefill-op patch registers it, tables from a scratch folder,
    and every synchronisation a failure: nothing on the request path may time or wait."""
    calls = []
    monkeypatch.setattr(fat, "device_identity", lambda device: H200)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("synchronised"))
    fat.use_table_dir(tmp_path)
    op.use_upstream_op(lambda *args: calls.append(args))
    yield calls, tmp_path
    op.use_upstream_op(None)
    fat.use_table_dir()


def _ship(directory, *length_buckets_and_ratios, dtype="float32"):
    entries = [dict(head_dim=D, dtype=dtype, causal=False, queries_per_kv=HQ // HKV,
                    heads_bucket=fat.heads_bucket(HQ), length_bucket=b, ratio=r)
               for b, r in length_buckets_and_ratios]
    (directory / fat.table_name(*H200)).write_text(json.dumps(fat.table_document(*H200, entries)))


def _full(seed=0, lens=(5, 9)):
    return make_case(lens, HQ, HKV, D, torch.float32, sink_mode="none",
                     generator=torch.Generator().manual_seed(seed))


def _run(case, bound=9, **kw):
    op.context_attention_fwd(*case.call_args(), bound, **dict(case.op_kwargs(), **kw))


def test_the_timing_machinery_is_gone():
    for name in ("measured_choice", "signature_cache", "upstream_launch"):
        assert importlib.util.find_spec(f"vllm_sinks.v1.attention.ops.{name}") is None, name


def test_without_a_table_upstream_takes_the_call_with_its_own_arguments(upstream):
    calls, _ = upstream
    case = _full()
    for _ in range(2):
        _run(case)
    assert len(calls) == 2
    q, k, v, o, starts, lens = case.call_args()
    for got in calls:  # upstream's own positional arguments, up to its windows; no sink passed
        assert len(got) == 11 and all(a is b for a, b in zip(got[:6], (q, k, v, o, starts, lens)))
        assert got[6:] == (9, False, None, None, None)


def test_where_the_table_says_ours_ours_runs(upstream):
    calls, tables = upstream
    _ship(tables, (fat.MIN_LENGTH_BUCKET, 1.3))  # bound 9: the smallest bucket
    case = _full(seed=1)
    _run(case)
    _run(case)
    assert calls == []
    check_tolerance(case)


def test_the_verdict_is_per_length_bucket_of_the_host_bound(upstream):
    calls, tables = upstream
    _ship(tables, (6, 1.3), (8, 1.3), (9, 0.8))
    case = _full(seed=2)
    _run(case, 9)  # bucket 6: ours
    _run(case, 150)  # bucket 8: ours (a bound too large costs time, never output)
    _run(case, torch.tensor(100))  # bucket 7, a host tensor: between two ours verdicts
    assert calls == []
    _run(case, 300)  # bucket 9: upstream
    _run(case, 3000)  # bucket 12: beyond what was measured
    assert len(calls) == 2 and calls[0][6] == 300 and calls[1][6] == 3000


def test_a_device_tensor_bound_goes_to_upstream(upstream):
    """No host length, no class: the fallback, even where the table says ours."""
    calls, tables = upstream
    _ship(tables, (6, 1.3))
    case = _full(seed=3)
    bound = torch.tensor(9, device="meta")  # not on the host (the CPU is the interpreter's device)
    _run(case, bound)
    assert len(calls) == 1 and calls[0][6] is bound


@pytest.mark.parametrize("change", [dict(sliding_window_q=4, sliding_window_k=4), dict(sinks=True)])
def test_windows_and_sinks_stay_ours(upstream, change):
    calls, _ = upstream
    case = make_case((5, 9), HQ, HKV, D, torch.float32, generator=torch.Generator().manual_seed(4),
                     sink_mode="null" if "sinks" in change else "none")
    _run(case, **{k: v for k, v in change.items() if k != "sinks"})
    assert calls == []


def test_other_dtypes_and_an_unmeasured_class_go_to_upstream(upstream):
    calls, tables = upstream
    _ship(tables, (6, 1.3), dtype="bfloat16")  # another dtype than the case's fp32
    _run(_full(seed=5))
    assert len(calls) == 1


def test_a_malformed_table_never_fails_a_call(upstream):
    calls, tables = upstream
    (tables / fat.table_name(*H200)).write_text('{"format": "not a table"}')
    case = _full(seed=6)
    with pytest.warns(UserWarning, match="full-attention table ignored"):
        _run(case)
    _run(case)
    assert len(calls) == 2


def test_bad_input_on_a_routed_shape_gets_our_checks(upstream):
    calls, _ = upstream
    case = _full(seed=7)
    _run(case)
    with pytest.raises(ValueError, match="softmax_scale"):
        _run(case, softmax_scale=-1.0)
    with pytest.raises(ValueError, match="max_input_len"):
        _run(case, -1)
    q, k, v, o, starts, lens = case.call_args()
    with pytest.raises(ValueError, match="share a dtype"):
        op.context_attention_fwd(q, k, v.double(), o, starts, lens, 9, **case.op_kwargs())
    assert len(calls) == 1


def test_a_stream_of_new_lengths_reads_the_table_once_per_class(upstream, monkeypatch):
    """New token counts every call (a server's images): each a new call signature, planned once;
    the table is read once, and each class decided once."""
    calls, tables = upstream
    _ship(tables, (6, 1.3), (7, 1.3))
    real, loads = fat.load_table, []
    monkeypatch.setattr(fat, "load_table", lambda path: loads.append(path) or real(path))
    for n, seed in zip((10, 20, 33, 64, 70, 128), range(10, 16)):
        case = _full(seed=seed, lens=(n,))
        _run(case, n)
        check_tolerance(case)
    assert calls == [] and len(loads) == 1
    assert {b for r in fat._ROUTES.values() for b in r.decided} == {6, 7}


def test_another_table_source_is_read_by_plans_made_before(upstream):
    """Plans keep their verdict per bound; pointing the lookup elsewhere drops them."""
    calls, tables = upstream
    case = _full(seed=20)
    _run(case)
    assert len(calls) == 1  # no table: upstream
    _ship(tables, (6, 1.3))
    fat.use_table_dir(tables)
    _run(case)
    assert len(calls) == 1  # ours now
    check_tolerance(case)


def test_new_token_counts_of_a_class_seen_going_upstream_go_straight_there(upstream, monkeypatch):
    """A server's every pass has new token counts: once a class and length bucket went to
    upstream's op, its later calls neither build a call key nor plan (the fallback's host cost is
    upstream's own plus ~10 attribute reads); a sink, a window or a new bucket is planned again."""
    calls, _ = upstream
    _run(_full(seed=30, lens=(5, 9)), 9)
    assert len(calls) == 1 and len(op._TO_UPSTREAM) == 1

    def never(*args, **kwargs):
        raise AssertionError("planned a call whose class already went upstream")

    monkeypatch.setattr(op, "call_key", never)
    monkeypatch.setattr(op, "plan", never)
    for seed, lens in zip(range(31, 34), ((3, 12), (16,), (1, 2, 14))):  # bound 12-16: bucket 4
        _run(_full(seed=seed, lens=lens), max(lens))
    assert len(calls) == 4
    with pytest.raises(AssertionError, match="planned"):
        _run(_full(seed=34, lens=(40,)), 40)  # another bucket
    with pytest.raises(AssertionError, match="planned"):
        _run(_full(seed=35), sliding_window_q=4)
    op.use_upstream_op(lambda *args: calls.append(args))
    assert not op._TO_UPSTREAM  # a new upstream op: everything is routed afresh
