"""The whole-band softmax path (banded problems, no key loop) against the reference.

``whole_band_config`` gives it for bf16/fp16 windows whose band fits ``_WHOLE_BAND_MAX_KEYS``
(``choose_config`` takes it only when ``_WHOLE_BAND_DEFAULT`` is on: it measured slower on the H200,
so it is off). These tests check where it applies and run the path itself, through ``launch`` and
through the public call with the default switched on: both sink modes, GQA, MQA, zero-length and
short sequences, key 0 outside the window, causal windows, bands that are exactly a power of two
(one chunk) or not (two chunks), V loaded early or late, head dims that need masking; fp32 with
explicit whole-band configs.
"""

from __future__ import annotations

import pytest
import torch

from prefill_op_cases import check_tolerance, check_writes, make_case
import vllm_sinks.v1.attention.ops.triton_prefill_attention as op
from vllm_sinks.v1.attention.ops.triton_prefill_attention import (
    LaunchConfig,
    _validate,
    band_span,
    choose_config,
    context_attention_fwd,
    launch,
    whole_band_chunks,
    whole_band_config,
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _problem(case, max_len=100):
    kw = case.kwargs
    return _validate(case.q, case.k, case.v, case.o, case.b_start_loc, case.b_seq_len, max_len,
                     kw["is_causal"], kw["softmax_scale"], kw["sliding_window_q"],
                     kw["sliding_window_k"], case.sinks, kw["sinks_bias_key0"])


@pytest.mark.parametrize("span,chunks", [(144, (128, 16)), (135, (128, 16)), (128, (128, 0)),
                                         (129, (128, 16)), (160, (128, 32)), (192, (128, 64)),
                                         (200, (256, 0)), (5, (16, 0)), (17, (32, 0)), (40, (32, 16))])
def test_whole_band_chunks_cover_the_band(span, chunks):
    n1, n2 = whole_band_chunks(span)
    assert (n1, n2) == chunks
    assert n1 + n2 >= span and n1 >= 16 and (n2 == 0 or n2 >= 16)


def test_where_whole_band_applies(monkeypatch):
    case = make_case([40], 32, 8, 64, torch.float16, window_q=64, window_k=64, sink_mode="key0",
                     generator=_gen(0))
    p = _problem(case)
    cfg = whole_band_config(p)
    assert (cfg.block_t, cfg.gp, cfg.band_n1, cfg.band_n2) == (16, 4, 128, 16)
    assert choose_config(p).band_n1 == 0  # off by default (slower on the H200)
    monkeypatch.setattr(op, "_WHOLE_BAND_DEFAULT", True)
    assert choose_config(p) == cfg
    # Not banded (one side unbounded), fp32, D > 64, band too long: the loop kernel.
    for kw, dtype, d in ((dict(window_q=64, window_k=None), torch.float16, 64),
                         (dict(window_q=64, window_k=64), torch.float32, 64),
                         (dict(window_q=None, window_k=None), torch.float16, 64),
                         (dict(window_q=64, window_k=64), torch.float16, 128),
                         (dict(window_q=100, window_k=64), torch.float16, 64)):
        case = make_case([40], 32, 8, d, dtype, sink_mode="key0", generator=_gen(0), **kw)
        assert whole_band_config(_problem(case)) is None
        assert choose_config(_problem(case)).band_n1 == 0


def test_launch_rejects_chunks_shorter_than_the_band():
    case = make_case([40], 4, 4, 16, torch.float32, window_q=8, window_k=8, generator=_gen(1))
    p = _problem(case)
    cfg = LaunchConfig(block_t=16, gp=1, block_n=16, num_warps=4, num_stages=1, band_n1=16,
                       band_n2=16)  # band: 16 + 8 + 8 = 32 keys: fits exactly
    launch(p, cfg, case.q, case.k, case.v, case.o, case.b_start_loc, case.b_seq_len, case.sinks)
    with pytest.raises(ValueError, match="do not cover"):
        launch(p, LaunchConfig(16, 1, 16, 4, 1, band_n1=16, band_n2=0), case.q, case.k, case.v,
               case.o, case.b_start_loc, case.b_seq_len, case.sinks)


# Through the public call (choose_config selects the whole band): fp16, the shapes it is chosen for.
DEFAULT_CASES = {
    # MiMo heads / window: key 0 inside the window for the first 65 rows only.
    "mimo-key0": dict(lens=[150, 0, 3, 70], hq=8, hkv=2, d=64, window_q=64, window_k=64,
                      sink_mode="key0"),
    "mimo-null": dict(lens=[150, 0, 3, 70], hq=8, hkv=2, d=64, window_q=64, window_k=64,
                      sink_mode="null"),
    "mimo-none": dict(lens=[150, 1], hq=8, hkv=2, d=64, window_q=64, window_k=64, sink_mode="none"),
    "small-window-mha": dict(lens=[90, 0, 17, 1], hq=2, hkv=2, d=32, window_q=5, window_k=9,
                             sink_mode="key0"),
    "gqa4-w8-key0-far": dict(lens=[100, 33], hq=8, hkv=2, d=16, window_q=8, window_k=8,
                             sink_mode="key0"),
    "causal-window-null": dict(lens=[120, 9, 0], hq=16, hkv=2, d=64, window_q=40, window_k=0,
                               is_causal=True, sink_mode="null"),
    "causal-window-key0": dict(lens=[120, 9], hq=16, hkv=2, d=64, window_q=40, window_k=0,
                               is_causal=True, sink_mode="key0"),
    "causal-and-wk": dict(lens=[77], hq=4, hkv=1, d=64, window_q=20, window_k=3, is_causal=True,
                          sink_mode="key0"),
    "odd-head-dim": dict(lens=[60, 5], hq=8, hkv=2, d=40, window_q=12, window_k=3, sink_mode="key0"),
    "mqa": dict(lens=[70], hq=4, hkv=1, d=64, window_q=16, window_k=16, sink_mode="null"),
}


@pytest.mark.parametrize("early_v", [False, True], ids=["late-v", "early-v"])
@pytest.mark.parametrize("name", list(DEFAULT_CASES))
def test_default_whole_band_against_reference(name, early_v, monkeypatch):
    spec = dict(DEFAULT_CASES[name])
    lens, hq, hkv, d = spec.pop("lens"), spec.pop("hq"), spec.pop("hkv"), spec.pop("d")
    case = make_case(lens, hq, hkv, d, torch.float16, gaps=1, sink_std=2.0, generator=_gen(7),
                     **spec)
    cfg = whole_band_config(_problem(case), early_v=early_v)
    assert cfg is not None, "the whole-band path does not apply"
    # Through the public call, as choose_config would launch it with the default switched on.
    monkeypatch.setattr(op, "choose_config", lambda p: cfg)
    op._VALIDATED.clear()
    try:
        context_attention_fwd(*case.call_args(), max(lens), **case.op_kwargs())
    finally:
        op._VALIDATED.clear()
    check_writes(case)
    check_tolerance(case)


# Explicit whole-band configs in fp32 (exact-ish reference): tile shapes with several tiles per
# sequence, one or two chunks, key 0 outside the window of later tiles.
EXPLICIT = [
    (LaunchConfig(16, 1, 16, 4, 1, band_n1=32, band_n2=0), dict(is_causal=False, window_q=7, window_k=9)),
    (LaunchConfig(8, 2, 16, 4, 1, band_n1=32, band_n2=16, band_early_v=True),
     dict(is_causal=False, window_q=20, window_k=17)),
    (LaunchConfig(4, 4, 16, 4, 1, band_n1=16, band_n2=16), dict(is_causal=True, window_q=24, window_k=0)),
    (LaunchConfig(16, 2, 16, 4, 1, band_n1=64, band_n2=0), dict(is_causal=False, window_q=3, window_k=40)),
]


@pytest.mark.parametrize("cfg,win", EXPLICIT, ids=["one-chunk", "two-chunks", "causal", "asym"])
@pytest.mark.parametrize("sink_mode", ["key0", "null", "none"])
def test_explicit_whole_band_fp32(cfg, win, sink_mode):
    case = make_case([70, 7, 0, 41, 1], 8, 2, 32, torch.float32, gaps=1, sink_mode=sink_mode,
                     sink_std=2.0, generator=_gen(21), **win)
    p = _problem(case)
    assert band_span(p, cfg.block_t) <= cfg.band_n1 + cfg.band_n2
    launch(p, cfg, case.q, case.k, case.v, case.o, case.b_start_loc, case.b_seq_len, case.sinks)
    check_writes(case)
    check_tolerance(case)
