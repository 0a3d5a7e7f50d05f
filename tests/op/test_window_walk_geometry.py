"""The Hopper window kernel's geometry and dispatch rules, checked on the CPU.

The kernel itself (Gluon, sm_90) cannot run in Triton's interpreter; tests/gpu/test_window_walk_gpu.py
runs it on the GPU. What it relies on is plain Python and checked here by brute force: the band
layout ``walk_geometry`` accepts must make the kernel's masking shortcuts exact.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from vllm_sinks.v1.attention.ops import gluon_api
from vllm_sinks.v1.attention.ops import gluon_window_attention as gw
from vllm_sinks.v1.attention.ops import triton_prefill_attention as op
from vllm_sinks.v1.attention.ops.prefill_attention_problem import validate
from vllm_sinks.v1.attention.ops.prefill_attention_reference import (
    reference_prefill_attention,
    relative_l2,
)

B = gw.BLOCK_KEYS


def _visible(i, wq, wk, causal):
    """Keys query ``i`` sees far from the sequence's edges (the op's definition)."""
    hi = i if causal else i + wk
    if causal and wk > 0:
        hi = min(hi, i + wk)
    return i - wq, hi


def _band_claims(T, wq, wk, causal, nb):
    """Whether a band of ``nb`` blocks from floor((t T - wq) / 16) has every property the kernel
    uses, for every tile phase: holds all visible keys, middle blocks fully visible, first block cut
    only from below, last only from above, and at most one block gained per tile."""
    base = 16 * (wq + 200)
    for t in range(base // T, base // T + 2 * B):
        b0 = (t * T - wq) // B
        if (((t + 1) * T - wq) // B) - b0 > 1:
            return False
        for i in range(t * T, t * T + T):
            lo, hi = _visible(i, wq, wk, causal)
            if lo < b0 * B or hi > (b0 + nb) * B - 1:
                return False
            if nb >= 3 and (lo > (b0 + 1) * B or hi < (b0 + nb - 1) * B - 1):
                return False
            if hi < (b0 + 1) * B - 1 or lo > (b0 + nb - 1) * B:
                return False
    return True


def _smallest_band(T, wq, wk, causal):
    base = 16 * (wq + 200)
    nb = 0
    for t in range(base // T, base // T + 2 * B):
        b0 = (t * T - wq) // B
        last = max(_visible(i, wq, wk, causal)[1] for i in range(t * T, t * T + T))
        nb = max(nb, last // B - b0 + 1)
    return nb


WINDOWS = [(wq, wk, causal) for wq in (1, 7, 15, 16, 17, 31, 32, 48, 63, 64, 65, 100, 127, 128, 200)
           for wk, causal in ((0, True), (wq, False), (64, False), (7, True), (30, False))]


@pytest.mark.parametrize("T", [4, 8, 16])
def test_geometry_accepts_exactly_the_bands_whose_shortcuts_are_exact(T):
    for wq, wk, causal in WINDOWS:
        g = gw.walk_geometry(T, wq, wk, causal)
        nb = _smallest_band(T, wq, wk, causal)
        fits = 3 <= nb <= gw.MAX_BAND_BLOCKS and nb % 2 == 1 and _band_claims(T, wq, wk, causal, nb)
        assert (g is not None) == fits, (T, wq, wk, causal, g, nb)
        if g is not None:
            assert g.nb == nb and g.tokens_per_tile == T
            # The ring holds the band and the blocks the next two tiles gain (prefetched two
            # tiles ahead), in an even number of slots (the scores read slots in pairs).
            assert g.ns >= nb + 2 and g.ns % 2 == 0 and g.ns <= nb + 3


def test_geometry_of_the_shapes_that_matter():
    assert gw.walk_geometry(16, 64, 64, False) == gw.WalkGeometry(16, 9)  # MiMo-V2.5 vision
    assert gw.walk_geometry(8, 127, 0, True) == gw.WalkGeometry(8, 9)  # GPT-OSS sliding layers
    assert gw.walk_geometry(16, 100, 30, False) is None  # edge blocks cut from both sides
    assert gw.walk_geometry(16, 0, 0, True) is None  # causal without a window: unbounded band
    assert gw.walk_geometry(16, 64, 0, False) is None  # right side unbounded
    assert gw.walk_geometry(32, 64, 64, False) is None  # 32-token tiles gain two blocks per tile


def test_even_bands_keep_the_portable_kernel():
    """The kernel reads a band as slot pairs plus one block, a layout for odd bands only; the GPU
    tests run bands of 5 and 9 blocks. Windows whose band is even are left to the Triton kernel."""
    assert _smallest_band(16, 48, 0, True) == 4 and gw.walk_geometry(16, 48, 0, True) is None
    assert _smallest_band(8, 112, 0, True) == 8 and gw.walk_geometry(8, 112, 0, True) is None
    assert gw.walk_geometry(16, 48, 48, False) == gw.WalkGeometry(16, 7)


def test_geometry_caps_the_band_at_what_registers_hold():
    """Every slot's scores stay in registers: a window wider than MAX_BAND_BLOCKS blocks is left to
    the Triton kernel rather than spilled."""
    assert gw.walk_geometry(16, gw.MAX_BAND_BLOCKS * B, 0, True) is None
    assert gw.walk_geometry(16, (gw.MAX_BAND_BLOCKS - 1) * B, 0, True).nb == gw.MAX_BAND_BLOCKS


def _mimo_call():
    """A small MiMo-shaped call (32 / 8 heads, window ±64, key-0 sinks) and its validated problem."""
    q = torch.randn(40, 32, 64, dtype=torch.float16)
    k = torch.randn(40, 8, 64, dtype=torch.float16)
    v = torch.randn_like(k)
    o = torch.empty_like(q)
    start, length = torch.tensor([0], dtype=torch.int32), torch.tensor([40], dtype=torch.int32)
    sinks = torch.randn(32)
    kwargs = dict(is_causal=False, sliding_window_q=64, sliding_window_k=64, sinks=sinks,
                  sinks_bias_key0=True)
    p = validate(q, k, v, o, start, length, 40, softmax_scale=None, **kwargs)
    return q, k, v, o, start, length, sinks, kwargs, p


def test_integers_that_change_between_calls_are_not_specialised_on(monkeypatch):
    """Triton compiles (and a fresh process loads) a kernel variant per specialisation of its
    integer arguments (divisible by 16, equal to 1): the ones a server's new token counts move would
    load a variant in ~1 of 16 calls (a server's stream of new image sizes)."""
    if gw.gluon is None:
        pytest.skip(f"no Gluon: {gluon_api.IMPORT_ERROR}")
    monkeypatch.setattr(gw, "walk_unavailable", lambda device: None)
    monkeypatch.setattr(gw, "_sm_count", lambda device: 132)
    tails = []
    for lengths in ((40,), (4096, 904)):
        q = torch.randn(sum(lengths), 32, 64, dtype=torch.float16)
        k = torch.randn(sum(lengths), 8, 64, dtype=torch.float16)
        v, o = torch.randn_like(k), torch.empty_like(q)
        length = torch.tensor(lengths, dtype=torch.int32)
        start = torch.cumsum(length, 0, dtype=torch.int32) - length
        sinks = torch.randn(32)
        kwargs = dict(is_causal=False, sliding_window_q=64, sliding_window_k=64, sinks=sinks,
                      sinks_bias_key0=True)
        p = validate(q, k, v, o, start, length, max(lengths), softmax_scale=None, **kwargs)
        walk = gw.WalkLaunch.plan(p, q, k, v, o, start, length, sinks)
        tails.append(walk._new_bound(max(lengths), None).tail)
    params = gw._window_walk_kernel.params[7:]  # after the seven tensors, in the tail's order
    moved = {p.name for p, a, b in zip(params, *tails) if isinstance(a, int) and a != b}
    assert moved >= {"total_tokens", "chunk", "num_chunks"}  # the calls above move all three
    assert moved <= {p.name for p in params if p.do_not_specialize}


def test_no_walk_off_the_gpu():
    """On the CPU (interpreter or not) the planner says why and the op keeps its Triton kernel."""
    reason = gw.walk_unavailable(torch.device("cpu"))
    assert reason  # a non-empty reason string
    q, k, v, o, start, length, sinks, kwargs, p = _mimo_call()
    assert gw.WalkLaunch.plan(p, q, k, v, o, start, length, sinks) is None
    assert op.plan(q, k, v, o, start, length, 40, **kwargs).kernel == "triton"


def test_the_kernel_is_gated_to_the_tested_triton(monkeypatch):
    monkeypatch.setattr(gw.triton, "__version__", "9.9.0")
    monkeypatch.setattr(gluon_api, "IMPORT_ERROR", None)
    assert "9.9.0" in gw.walk_unavailable(torch.device("cuda", 0))
    monkeypatch.setenv(gw.ENV_DISABLE, "0")
    monkeypatch.setattr(gw.triton, "__version__", gluon_api.TESTED_TRITON[0] + "0")
    assert gw.ENV_DISABLE in gw.walk_unavailable(torch.device("cuda", 0))


def test_a_variant_that_fails_to_compile_falls_back_once(monkeypatch):
    """An experimental compiler may reject the kernel on some Triton build: the launch then says why
    once, writes nothing, and the op runs its Triton kernel for that shape from then on."""
    calls = []

    class Broken:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                calls.append(grid)
                raise RuntimeError("no such Gluon op")
            return run

    monkeypatch.setattr(gw, "_FAILED_VARIANTS", set())
    q, k, v, o, start, length, sinks, kwargs, p = _mimo_call()
    o.fill_(float("nan"))
    monkeypatch.setattr(gw, "_LAUNCHER", gw.DirectLauncher(Broken()))
    walk = gw.WalkLaunch(tokens_per_tile=16, num_seqs=1, tokens=40, head_groups=8,
                         sm_count=132, scalars=(), strides=(), constexprs={}, options={},
                         variant=("v",))
    chosen = dataclasses.replace(op.plan(q, k, v, o, start, length, 40, **kwargs), walk=walk)
    with pytest.warns(UserWarning, match="failed to compile"):
        chosen(q, k, v, o, start, length, sinks, 40)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chosen(q, k, v, o, start, length, sinks, 40)  # no second try, no second warning
    assert len(calls) == 1
    ref = reference_prefill_attention(q, k, v, start, length, dtype=torch.float64, **kwargs)
    assert torch.isfinite(o).all() and relative_l2(o, ref) < 1e-3  # the Triton kernel's output
