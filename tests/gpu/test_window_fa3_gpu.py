"""The FA3-structured Hopper window kernel (gluon_window_attention_fa3.py) on the GPU, called
directly: against the fp32 reference with the op's tolerance rule, bit for bit against the
committed walk (the same per-tile math and the same slot pairs: both rings have an even number of
slots, so a block's pair partner is the same), under every way of cutting sequences into programs,
with 2 and 3 consumer warpgroups and the softmax ping-pong, on strided (fused-QKV) inputs. The
consumers' Q · Kᵀ / softmax overlap (``overlap=True``, 2 warpgroups) against the reference under
every pattern, sink mode and cutting, and bit for bit against the same kernel without it."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("VLLM_SINKS_FA3_TESTS") != "1":
    # An mbarrier protocol that deadlocks hangs the whole GPU run (no pytest timeout there):
    # benchmarks/kernels/run_fa3_on_device.sh runs these under a timeout, with this set, until
    # they have passed on the device (docs/notes/prefill-kernel-log.md, run 14).
    pytest.skip("experimental FA3-structured kernel: VLLM_SINKS_FA3_TESTS=1 runs these",
                allow_module_level=True)

from test_prefill_op_gpu import _packed  # noqa: E402
from test_window_walk_gpu import LENS, WINDOWS, _args  # noqa: E402

from vllm_sinks.v1.attention.ops.gluon_window_attention import WalkLaunch, walk_unavailable  # noqa: E402
from benchmarks.kernels.gluon_window_attention_fa3 import Fa3WalkLaunch  # noqa: E402
from vllm_sinks.v1.attention.ops.prefill_attention_problem import validate  # noqa: E402
from vllm_sinks.v1.attention.ops.prefill_attention_reference import (  # noqa: E402
    covered_rows,
    reference_prefill_attention,
    relative_l2,
    same_dtype_torch_error,
)

if walk_unavailable(torch.device("cuda")):
    pytest.skip(walk_unavailable(torch.device("cuda")), allow_module_level=True)


def _problem(q, k, v, o, b_start, b_len, max_len, kwargs):
    kwargs = dict(dict(sliding_window_q=None, sliding_window_k=None, sinks=None,
                       sinks_bias_key0=False), **kwargs)
    return validate(q, k, v, o, b_start, b_len, max_len, softmax_scale=None, **kwargs)


def _run(launch_cls, q, k, v, b_start, b_len, kwargs, max_len, chunk=None, **plan_kw):
    """One launch into a NaN-poisoned buffer one element wider on every side; checks that only
    the sequences' rows were written, all of them finite."""
    tokens, hq, d = q.shape
    buf = torch.full((tokens + 2, hq + 1, d + 1), float("nan"), dtype=q.dtype, device=q.device)
    o = buf[:tokens, :hq, :d]
    p = _problem(q, k, v, o, b_start, b_len, max_len, kwargs)
    launch = launch_cls.plan(p, q, k, v, o, b_start, b_len, kwargs.get("sinks"), **plan_kw)
    assert launch is not None
    assert launch(q, k, v, o, b_start, b_len, kwargs.get("sinks"), max_len, chunk=chunk)
    rows = covered_rows(b_start, b_len, tokens)
    spare = buf.clone()
    spare[:tokens, :hq, :d][rows] = float("nan")
    assert torch.isnan(spare).all(), "wrote outside the sequence rows"
    assert torch.isfinite(o[rows]).all(), "sequence rows not fully written"
    return o, rows


PATTERNS = ["mimo-window", "gptoss-causal-window", "window-32", "causal-window-64"]


def _reference_check(o, rows, q, k, v, b_start, b_len, kwargs, what):
    ref = reference_prefill_attention(q, k, v, b_start, b_len, dtype=torch.float32, **kwargs)
    base = same_dtype_torch_error(q, k, v, b_start, b_len, ref=ref, rows=rows, **kwargs)
    err = relative_l2(o[rows], ref[rows])
    assert err <= 2.0 * base, f"{what}: error {err:.3e} > 2 x same-dtype torch error {base:.3e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("sink_mode", ["key0", "null", "none"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_against_reference_and_committed_walk(pattern, sink_mode, dtype):
    q, k, v, sinks, b_start, b_len = _packed(LENS, 32, 8, 64, dtype, gaps=3, seed=21)
    kwargs = _args(sink_mode, pattern, sinks)
    o, rows = _run(Fa3WalkLaunch, q, k, v, b_start, b_len, kwargs, max(LENS))
    _reference_check(o, rows, q, k, v, b_start, b_len, kwargs, "fa3 walk")
    committed, _ = _run(WalkLaunch, q, k, v, b_start, b_len, kwargs, max(LENS))
    assert torch.equal(o[rows], committed[rows])


@pytest.mark.parametrize("variant", [dict(), dict(consumers=3), dict(pingpong=True),
                                     dict(consumers=3, pingpong=True)],
                         ids=["2wg", "3wg", "2wg-pingpong", "3wg-pingpong"])
@pytest.mark.parametrize("pattern", ["mimo-window", "gptoss-causal-window"])
def test_same_bits_however_the_sequences_are_cut(pattern, variant):
    """Tiles per program (1, 2, 3, 7, the default, all) and a too-small length bound give the
    committed walk's bits: chunks shorter than the consumers, chunks that start at an odd slot,
    rings that wrap many times."""
    q, k, v, sinks, b_start, b_len = _packed(LENS, 64, 8, 64, torch.bfloat16, gaps=1, seed=22)
    kwargs = _args("key0" if pattern == "mimo-window" else "null", pattern, sinks)
    first, rows = _run(WalkLaunch, q, k, v, b_start, b_len, kwargs, max(LENS))
    for max_len, chunk in ((max(LENS), 1), (max(LENS), 2), (max(LENS), 3), (max(LENS), 7),
                           (max(LENS), None), (max(LENS), 10**6), (64, None), (1, 1), (200, 2)):
        o, _ = _run(Fa3WalkLaunch, q, k, v, b_start, b_len, kwargs, max_len, chunk, **variant)
        assert torch.equal(o[rows], first[rows]), (max_len, chunk)


#: The OVERLAP variants (2 consumer warpgroups only: the plan declines 3).
OVERLAP = [pytest.param(torch.bfloat16, dict(overlap=True), id="bfloat16-overlap"),
           pytest.param(torch.float16, dict(overlap=True), id="float16-overlap"),
           pytest.param(torch.bfloat16, dict(overlap=True, pingpong=True),
                        id="bfloat16-overlap-pingpong"),
           pytest.param(torch.bfloat16, dict(overlap="tiles"), id="bfloat16-overlap-tiles")]
CUT_VARIANTS = [pytest.param(dict(overlap=True), id="2wg-overlap"),
                pytest.param(dict(overlap=True, pingpong=True), id="2wg-overlap-pingpong"),
                pytest.param(dict(overlap="tiles"), id="2wg-overlap-tiles")]
CUTS = ((max(LENS), 1), (max(LENS), 2), (max(LENS), 3), (max(LENS), 7), (max(LENS), None),
        (max(LENS), 10**6), (64, None), (1, 1), (200, 2))


@pytest.mark.parametrize("dtype, variant", OVERLAP)
@pytest.mark.parametrize("sink_mode", ["key0", "null", "none"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_overlap_against_reference(pattern, sink_mode, dtype, variant):
    q, k, v, sinks, b_start, b_len = _packed(LENS, 32, 8, 64, dtype, gaps=3, seed=21)
    kwargs = _args(sink_mode, pattern, sinks)
    o, rows = _run(Fa3WalkLaunch, q, k, v, b_start, b_len, kwargs, max(LENS), **variant)
    _reference_check(o, rows, q, k, v, b_start, b_len, kwargs, f"fa3 {variant}")


@pytest.mark.parametrize("variant", CUT_VARIANTS)
@pytest.mark.parametrize("pattern", ["mimo-window", "gptoss-causal-window"])
def test_overlap_however_the_sequences_are_cut(pattern, variant):
    """Against the reference under every cutting: programs of one tile (the second warpgroup
    has none, the first no pair: each issues its prologue's Q · Kᵀ over whatever its buffers
    hold and drops it), odd and even tile counts per warpgroup (the pairs' last tile re-issues
    its own band; an odd count's last tile runs unpaired; in "tiles", the last tile does),
    rings that wrap many times."""
    q, k, v, sinks, b_start, b_len = _packed(LENS, 64, 8, 64, torch.bfloat16, gaps=1, seed=22)
    kwargs = _args("key0" if pattern == "mimo-window" else "null", pattern, sinks)
    for max_len, chunk in CUTS:
        o, rows = _run(Fa3WalkLaunch, q, k, v, b_start, b_len, kwargs, max_len, chunk, **variant)
        _reference_check(o, rows, q, k, v, b_start, b_len, kwargs, f"{variant} {max_len} {chunk}")


@pytest.mark.parametrize("overlap", [True, "tiles"], ids=["pairs", "tiles"])
@pytest.mark.parametrize("pattern", ["mimo-window", "gptoss-causal-window"])
def test_overlap_same_bits_as_without(pattern, overlap):
    """The overlap moves when each tile's Q · Kᵀ is issued, not what it computes: the same
    wgmmas on the same slots (the queries read from shared memory instead of registers, the
    same products), so the same bits as the kernel without it, however cut."""
    q, k, v, sinks, b_start, b_len = _packed(LENS, 64, 8, 64, torch.bfloat16, gaps=1, seed=22)
    kwargs = _args("key0" if pattern == "mimo-window" else "null", pattern, sinks)
    for max_len, chunk in CUTS:
        plain, rows = _run(Fa3WalkLaunch, q, k, v, b_start, b_len, kwargs, max_len, chunk)
        o, _ = _run(Fa3WalkLaunch, q, k, v, b_start, b_len, kwargs, max_len, chunk,
                    overlap=overlap)
        assert torch.equal(o[rows], plain[rows]), (max_len, chunk)


def test_fused_qkv_views():
    """q, k, v as column slices of one [tokens, (32 + 8 + 8) * 64] projection (vLLM's fused QKV):
    the TMA descriptors take their strides."""
    lens = [1000, 37, 4096]
    g = torch.Generator(device="cuda").manual_seed(23)
    tokens = sum(lens)
    qkv = torch.randn(tokens, 48, 64, device="cuda", generator=g).to(torch.bfloat16)
    q, k, v = qkv[:, :32], qkv[:, 32:40], qkv[:, 40:]
    sinks = torch.randn(32, device="cuda", generator=g) * 2.0
    b_len = torch.tensor(lens, dtype=torch.int32, device="cuda")
    b_start = torch.cumsum(b_len, 0, dtype=torch.int32) - b_len
    kwargs = _args("key0", "mimo-window", sinks)
    o, rows = _run(Fa3WalkLaunch, q, k, v, b_start, b_len, kwargs, max(lens))
    committed, _ = _run(WalkLaunch, q.contiguous(), k.contiguous(), v.contiguous(), b_start, b_len,
                        kwargs, max(lens))
    assert torch.equal(o[rows], committed[rows])


def test_plan_declines_what_tma_cannot_load():
    """A head dim padded to a stride TMA cannot take (not a multiple of 16 bytes) and tiles other
    than 16 tokens are declined (the committed walk takes them)."""
    q, k, v, sinks, b_start, b_len = _packed([256], 64, 8, 64, torch.bfloat16, seed=24)
    kwargs = _args("null", "gptoss-causal-window", sinks)
    o = torch.empty_like(q)
    p = _problem(q, k, v, o, b_start, b_len, 256, kwargs)
    assert Fa3WalkLaunch.plan(p, q, k, v, o, b_start, b_len, sinks) is not None
    assert Fa3WalkLaunch.plan(p, q, k, v, o, b_start, b_len, sinks, gp=8) is None
    assert Fa3WalkLaunch.plan(p, q, k, v, o, b_start, b_len, sinks, overlap=True) is not None
    assert Fa3WalkLaunch.plan(p, q, k, v, o, b_start, b_len, sinks, consumers=3,
                              overlap=True) is None  # two score sets do not fit 160 registers
    odd = torch.empty(256, 64, 67, dtype=torch.bfloat16, device="cuda")[:, :, :64]
    odd.copy_(q)
    p2 = _problem(odd, k, v, o, b_start, b_len, 256, kwargs)
    assert Fa3WalkLaunch.plan(p2, odd, k, v, o, b_start, b_len, sinks) is None
