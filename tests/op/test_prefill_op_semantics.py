"""The Triton prefill op against the reference: every semantic case of the op, fp32 and fp16.

On a CPU these run through Triton's interpreter (bf16 is not trustworthy there: tests/gpu covers it).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from prefill_op_cases import DEVICE, TOLERANCE_FACTOR, check_tolerance, check_writes, make_case, reference
from vllm_sinks.v1.attention.ops.prefill_attention_reference import (
    covered_rows,
    relative_l2,
    same_dtype_torch_error,
)
from vllm_sinks.v1.attention.ops.prefill_attention_portable import LOOP_LAYOUTS, LaunchConfig, launch
from vllm_sinks.v1.attention.ops.prefill_attention_problem import validate
from vllm_sinks.v1.attention.ops.triton_prefill_attention import context_attention_fwd

DTYPES = [torch.float32, torch.float16]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def run(case, max_input_len=None):
    lens = case.b_seq_len.tolist()
    if max_input_len is None:
        max_input_len = max(lens, default=0)
    context_attention_fwd(*case.call_args(), max_input_len, **case.op_kwargs())
    check_writes(case)
    return check_tolerance(case)


# ---- the seed's regression: MHA and GQA, one sequence shorter than the window, one longer ----------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("sink_mode", ["key0", "null"])
def test_seed_regression_window_8(dtype, heads, sink_mode):
    case = make_case([5, 40], *heads, 64, dtype, window_q=8, window_k=8, sink_mode=sink_mode,
                     generator=_gen(1))
    run(case)


# ---- one property at a time ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_key0_outside_window_leaves_far_queries_alone(dtype):
    """Under the key-0 bias, queries farther than the window from key 0 do not see the sink."""
    case = make_case([50], 4, 2, 32, dtype, window_q=6, window_k=6, sink_mode="key0", sink_std=3.0,
                     generator=_gen(2))
    run(case)
    with_sinks = case.o.clone()
    case.sinks = None
    case.o.fill_(float("nan"))
    run(case)
    far = torch.arange(50, device=case.o.device) > 6
    torch.testing.assert_close(with_sinks[far], case.o[far], rtol=1e-3, atol=1e-3)
    assert not torch.allclose(with_sinks[~far], case.o[~far], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sink_mode", ["key0", "null", "none"])
def test_length_one_sequences(dtype, sink_mode):
    run(make_case([1, 1, 3, 1], 4, 2, 32, dtype, window_q=4, window_k=4, sink_mode=sink_mode,
                  generator=_gen(3)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_length_sequence_in_batch(dtype):
    run(make_case([9, 0, 13, 0], 4, 1, 32, dtype, gaps=2, window_q=4, window_k=4, sink_mode="key0",
                  generator=_gen(4)))


def test_empty_batch_writes_nothing():
    case = make_case([], 4, 2, 32, torch.float32, generator=_gen(5))
    context_attention_fwd(*case.call_args(), 0, **case.op_kwargs())
    assert torch.isnan(case.o_buf).all()
    case = make_case([0, 0], 4, 2, 32, torch.float32, gaps=3, generator=_gen(5))
    context_attention_fwd(*case.call_args(), 0, **case.op_kwargs())
    assert torch.isnan(case.o_buf).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sink_mode", ["key0", "null"])
def test_window_at_least_sequence_length_is_full_attention(dtype, sink_mode):
    case = make_case([12, 20], 4, 2, 32, dtype, window_q=20, window_k=64, sink_mode=sink_mode,
                     generator=_gen(6))
    run(case)
    windowed = case.o.clone()
    case.kwargs.update(sliding_window_q=None, sliding_window_k=None)
    run(case)
    # Same function; the launcher picks other tile shapes for banded and full attention, so the
    # low-precision roundings differ.
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(windowed, case.o, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sink_mode", ["null", "key0", "none"])
def test_causal_with_window(dtype, sink_mode):
    """GPT-OSS sliding layers: causal, window w-1 behind, nothing ahead (vLLM passes (w - 1, 0))."""
    run(make_case([30, 17], 8, 2, 64, dtype, is_causal=True, window_q=7, window_k=0,
                  sink_mode=sink_mode, generator=_gen(7)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sink_mode", ["null", "key0", "none"])
def test_causal_full(dtype, sink_mode):
    run(make_case([40, 3], 4, 4, 32, dtype, is_causal=True, sink_mode=sink_mode, generator=_gen(8)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sink_mode", ["null", "key0", "none"])
def test_bidirectional_full(dtype, sink_mode):
    run(make_case([33, 8], 4, 2, 32, dtype, sink_mode=sink_mode, generator=_gen(9)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("windows", [(5, 0), (0, 5), (3, 9)], ids=["behind", "ahead", "asymmetric"])
def test_one_sided_and_asymmetric_windows(dtype, windows):
    run(make_case([26], 4, 2, 32, dtype, window_q=windows[0], window_k=windows[1], sink_mode="key0",
                  generator=_gen(10)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sink_mode", ["null", "key0"])
def test_mqa(dtype, sink_mode):
    run(make_case([19, 11], 8, 1, 32, dtype, window_q=4, window_k=4, sink_mode=sink_mode,
                  generator=_gen(11)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [72, 80, 96, 40, 256])
def test_head_dims_not_a_power_of_two_and_large(dtype, head_dim):
    run(make_case([21, 6], 4, 2, head_dim, dtype, window_q=8, window_k=8, sink_mode="key0",
                  generator=_gen(12)))


@pytest.mark.parametrize("group", [3, 6])
def test_query_groups_not_a_power_of_two(group):
    run(make_case([17, 9], 2 * group, 2, 32, torch.float16, window_q=5, window_k=5, sink_mode="null",
                  generator=_gen(13)))


@pytest.mark.parametrize("sinks_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_sinks(sinks_dtype):
    run(make_case([15], 4, 2, 32, torch.float16, window_q=4, window_k=4, sink_mode="key0",
                  sinks_dtype=sinks_dtype, generator=_gen(14)))


def test_softmax_scale_and_int64_offsets():
    run(make_case([22, 5], 4, 2, 32, torch.float32, window_q=6, window_k=6, softmax_scale=0.37,
                  index_dtype=torch.int64, sink_mode="null", generator=_gen(15)))


def test_output_dtype_may_differ_from_inputs():
    case = make_case([14], 4, 2, 32, torch.float16, window_q=4, window_k=4, generator=_gen(16))
    o32 = torch.full(case.o.shape, float("nan"), dtype=torch.float32, device=case.o.device)
    context_attention_fwd(case.q, case.k, case.v, o32, case.b_start_loc, case.b_seq_len, 14,
                          **case.op_kwargs())
    check_tolerance(case, out=o32)


def test_strided_views_of_a_fused_qkv_buffer():
    """vLLM hands over q, k, v as views of one [tokens, (Hq + 2 Hkv) * D] projection output."""
    g = _gen(17)
    hq, hkv, d, tokens = 4, 2, 32, 23
    qkv = torch.randn(tokens, hq + 2 * hkv, d, generator=g).to(DEVICE)
    q, k, v = qkv.split([hq, hkv, hkv], dim=1)
    case = make_case([tokens], hq, hkv, d, torch.float32, window_q=5, window_k=5, generator=g)
    case.q, case.k, case.v = q, k, v
    run(case)


# ---- semantics knobs: max_input_len, -1 windows -----------------------------------------------------

def test_max_input_len_tensor_or_stale_int_is_not_trusted():
    case = make_case([37, 4], 4, 2, 32, torch.float32, window_q=6, window_k=6, generator=_gen(18))
    run(case, max_input_len=torch.tensor(37, device=DEVICE))
    first = case.o.clone()
    case.o.fill_(float("nan"))
    run(case, max_input_len=1)  # a wrong hint must not drop tiles
    torch.testing.assert_close(first, case.o, rtol=0, atol=0)


def test_minus_one_window_means_unbounded():
    case = make_case([25], 4, 2, 32, torch.float32, generator=_gen(19))
    case.kwargs.update(sliding_window_q=-1, sliding_window_k=-1)
    run(case)
    a = case.o.clone()
    case.kwargs.update(sliding_window_q=None, sliding_window_k=0)
    run(case)
    torch.testing.assert_close(a, case.o, rtol=0, atol=0)


# ---- the tolerance can fail ---------------------------------------------------------------------

@pytest.mark.parametrize("sink_mode", ["key0", "null"])
def test_dropping_or_swapping_sinks_is_far_outside_tolerance(sink_mode):
    """The check is not vacuous: the op without sinks, or with the other sink meaning, fails it."""
    case = make_case([5, 40], 8, 2, 64, torch.float16, window_q=8, window_k=8, sink_mode=sink_mode,
                     generator=_gen(20))
    run(case)  # with the right sinks: within tolerance
    rows = covered_rows(case.b_start_loc, case.b_seq_len, case.tokens)
    ref = reference(case)
    base = same_dtype_torch_error(case.q, case.k, case.v, case.b_start_loc, case.b_seq_len, ref=ref,
                                  rows=rows, **case.op_kwargs())
    wrong = {"dropped": dict(case.op_kwargs(), sinks=None),
             "swapped": dict(case.op_kwargs(), sinks_bias_key0=not case.kwargs["sinks_bias_key0"])}
    for what, kwargs in wrong.items():
        out = torch.full_like(case.o, float("nan"))
        context_attention_fwd(case.q, case.k, case.v, out, case.b_start_loc, case.b_seq_len, 40,
                              **kwargs)
        err = relative_l2(out[rows], ref[rows])
        assert err > 10 * TOLERANCE_FACTOR * base, f"sinks {what}: error {err:.3e} vs base {base:.3e}"
    # ... and the rule the other tests use rejects it.
    context_attention_fwd(*case.call_args(), 40, **dict(case.op_kwargs(), sinks=None))
    with pytest.raises(AssertionError, match="same-dtype torch error"):
        check_tolerance(case)


# ---- tile shapes: small tiles exercise the band split (masked edges, mask-free middle) -------------

# (tile shape, attention pattern): small tiles so that sequences span several tiles and the band has
# masked edges and a mask-free middle; test_prefill_op_band.py checks the band arithmetic exhaustively.
TILE_CASES = [
    (LaunchConfig(block_t=16, gp=1, block_n=16, num_warps=4, num_stages=1),
     dict(is_causal=False, window_q=20, window_k=20)),
    (LaunchConfig(block_t=8, gp=2, block_n=16, num_warps=4, num_stages=1),
     dict(is_causal=True, window_q=24, window_k=0)),
    (LaunchConfig(block_t=4, gp=4, block_n=32, num_warps=4, num_stages=1),
     dict(is_causal=False, window_q=3, window_k=40)),
    (LaunchConfig(block_t=32, gp=2, block_n=16, num_warps=4, num_stages=1),
     dict(is_causal=True, window_q=0, window_k=0)),
]


# How the launch finds each program's sequence: from the grid, sized by a host bound that is exact,
# too small (the extra slot per sequence must take the missing tiles) or too large; or by the
# on-device search (a device tensor, here one on the meta device, is never read).
HINTS = {"exact": 70, "too-small": 1, "too-large": 1000, "search": None}


@pytest.mark.parametrize("layout", LOOP_LAYOUTS)
@pytest.mark.parametrize("cfg,win", TILE_CASES, ids=["t16-sym", "t8g2-causal-w", "t4g4-asym", "t32g2-causal"])
def test_tile_shapes_against_reference(cfg, win, layout):
    case = make_case([70, 7, 0, 41], 8, 2, 32, torch.float32, gaps=1, sink_mode="key0",
                     generator=_gen(21), **win)
    p = validate(case.q, case.k, case.v, case.o, case.b_start_loc, case.b_seq_len, 100,
                  softmax_scale=None, sliding_window_q=win["window_q"],
                  sliding_window_k=win["window_k"], is_causal=win["is_causal"], sinks=case.sinks,
                  sinks_bias_key0=True)
    cfg = dataclasses.replace(cfg, loop_layout=layout)
    for hint in HINTS.values():
        case.o.fill_(float("nan"))
        launch(p, cfg, case.q, case.k, case.v, case.o, case.b_start_loc, case.b_seq_len, case.sinks,
               hint)
        check_writes(case)
        check_tolerance(case)


@pytest.mark.parametrize("hint", [torch.tensor(41), torch.tensor([3], dtype=torch.int32),
                                  torch.tensor(70, device="meta"), 0, 5])
def test_any_max_input_len_gives_the_same_output(hint):
    """The public call with host bounds right or wrong, and a device tensor (the search path)."""
    case = make_case([70, 7, 0, 41], 4, 2, 32, torch.float32, gaps=2, sink_mode="null",
                     is_causal=True, window_q=9, window_k=0, generator=_gen(5))
    context_attention_fwd(*case.call_args(), hint, **case.op_kwargs())
    check_writes(case)
    check_tolerance(case)


# ---- random shapes, drawn fresh every run -------------------------------------------------------

@pytest.mark.parametrize("draw", range(6))
def test_random_shapes(draw):
    seed = random.SystemRandom().randrange(2**31)
    rnd = random.Random(seed)
    hkv = rnd.choice([1, 2, 3])
    group = rnd.choice([1, 2, 3, 4, 8])
    d = rnd.choice([16, 24, 32, 48, 64, 72, 80, 96, 128])
    lens = [rnd.choice([0, 1, rnd.randint(2, 20), rnd.randint(20, 90)]) for _ in range(rnd.randint(1, 4))]
    win = rnd.choice([None, -1, 0, rnd.randint(1, 12), rnd.randint(12, 80)])
    wk = rnd.choice([win, 0, rnd.randint(1, 12)])
    kwargs = dict(gaps=rnd.choice([0, 2]), is_causal=rnd.random() < 0.5, window_q=win, window_k=wk,
                  sink_mode=rnd.choice(["none", "null", "key0"]), sink_std=rnd.choice([0.5, 2.0]),
                  generator=_gen(seed))
    dtype = rnd.choice(DTYPES)
    note = f"seed={seed}: lens={lens} hq={hkv * group} hkv={hkv} d={d} {dtype} {kwargs}"
    case = make_case(lens, hkv * group, hkv, d, dtype, **kwargs)
    try:
        run(case)
    except AssertionError as e:
        raise AssertionError(f"{note}\n{e}") from e



@pytest.mark.parametrize("layout", LOOP_LAYOUTS)
@pytest.mark.parametrize("sink_mode", ["null", "key0"])
def test_minus_inf_sinks_on_rows_that_see_nothing_in_the_first_block(sink_mode, layout):
    """A -inf sink is no sink: a null logit of -inf adds nothing to the denominator, a key-0 bias of
    -inf takes key 0 out of the rows that see it. Also for rows whose first key block is fully
    masked (a 32-token tile, 16-key steps, window 3/2): no inf - inf in the running max."""
    case = make_case([70, 41], 4, 2, 32, torch.float32, sink_mode=sink_mode, is_causal=False,
                     window_q=3, window_k=2, generator=_gen(8))
    case.sinks[::2] = float("-inf")
    p = validate(case.q, case.k, case.v, case.o, case.b_start_loc, case.b_seq_len, 70,
                  is_causal=False, softmax_scale=None, sliding_window_q=3, sliding_window_k=2,
                  sinks=case.sinks, sinks_bias_key0=sink_mode == "key0")
    launch(p, LaunchConfig(block_t=32, gp=2, block_n=16, num_warps=4, num_stages=1,
                           loop_layout=layout), case.q, case.k, case.v, case.o, case.b_start_loc,
           case.b_seq_len, case.sinks, 70)
    check_writes(case)
    check_tolerance(case)

# ---- the launch bound once per call signature -------------------------------------------------------

def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a view with a token stride twice as long (another call signature)."""
    wide = torch.zeros(t.shape[0], 2 * t.shape[1], t.shape[2], dtype=t.dtype, device=t.device)
    wide[:, :t.shape[1]] = t
    return wide[:, :t.shape[1]]


@pytest.mark.parametrize("sink_mode", ["key0", "null"])
def test_launch_bound_per_call_signature(sink_mode):
    """The public call binds its launch (tile shape, strides, scalars) once per signature of shapes,
    strides, dtypes and options. New tensors of a signature get their own data and lengths right,
    and tensors that differ only in their strides get a launch of their own."""
    shape = (4, 2, 32, torch.float32)
    kw = dict(window_q=5, window_k=5, sink_mode=sink_mode)
    run(make_case([30, 9], *shape, **kw, generator=_gen(31)))
    run(make_case([12, 27], *shape, **kw, generator=_gen(32)))  # same signature, other lengths
    case = make_case([12, 27], *shape, **kw, generator=_gen(33))
    case.q, case.k, case.v = _strided(case.q), _strided(case.k), _strided(case.v)
    assert case.q.stride(0) == 2 * 4 * 32
    run(case)
