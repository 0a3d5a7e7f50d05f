"""Building blocks of the prefill-op tests: packed inputs, poisoned outputs, the tolerance rule.

Tolerance rule: the op's relative L2 error against the reference (fp32 reference for fp16 /
bf16 inputs, fp64 for fp32 inputs) must be at most twice the error of the same computation done by
PyTorch in the inputs' dtype (``same_dtype_torch_error``).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from vllm_sinks.v1.attention.ops.prefill_attention_reference import (
    covered_rows,
    reference_dtype_for,
    reference_prefill_attention,
    relative_l2,
    same_dtype_torch_error,
)

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
TOLERANCE_FACTOR = 2.0
#: In fp32 both errors sit at the rounding floor (torch's is often ~0.3 ulp of the output's norm), and
#: Triton's interpreter rounds its exponentials differently from release to release (3.9.0: 9.3e-8
#: against torch's 3.7e-8 on a tiny case): there, one ulp of the norm is the bound.
FP32_FLOOR = torch.finfo(torch.float32).eps


@dataclasses.dataclass
class Case:
    """One packed batch. ``o`` is a poisoned view into a larger buffer ``o_buf``: the extra rows,
    heads and head-dim columns around it must survive the call untouched."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    o_buf: torch.Tensor
    b_start_loc: torch.Tensor
    b_seq_len: torch.Tensor
    sinks: torch.Tensor | None
    kwargs: dict

    @property
    def tokens(self) -> int:
        return self.q.shape[0]

    def call_args(self):
        return (self.q, self.k, self.v, self.o, self.b_start_loc, self.b_seq_len)

    def op_kwargs(self) -> dict:
        return dict(self.kwargs, sinks=self.sinks)


def make_case(lens, hq, hkv, d, dtype, *, gaps=0, is_causal=False, window_q=None, window_k=None,
              sink_mode="key0", sink_std=1.0, sinks_dtype=torch.float32, index_dtype=torch.int32,
              softmax_scale=None, generator=None, device=DEVICE) -> Case:
    """Packed sequences of ``lens`` with ``gaps`` unused rows before each one and after the last."""
    g = generator
    starts, pos = [], 0
    for n in lens:
        pos += gaps
        starts.append(pos)
        pos += n
    tokens = pos + gaps

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)

    q, k, v = randn(tokens, hq, d), randn(tokens, hkv, d), randn(tokens, hkv, d)
    # o lives inside a buffer with one spare row, one spare head and 3 spare head-dim columns.
    o_buf = torch.full((tokens + 1, hq + 1, d + 3), float("nan"), dtype=dtype, device=device)
    o = o_buf[:tokens, :hq, :d]
    sinks = None
    if sink_mode != "none":
        sinks = (torch.randn(hq, generator=g) * sink_std).to(device=device, dtype=sinks_dtype)
    kwargs = dict(is_causal=is_causal, softmax_scale=softmax_scale, sliding_window_q=window_q,
                  sliding_window_k=window_k, sinks_bias_key0=(sink_mode == "key0"))
    return Case(q, k, v, o, o_buf, torch.tensor(starts, dtype=index_dtype, device=device),
                torch.tensor(list(lens), dtype=index_dtype, device=device), sinks, kwargs)


def reference(case: Case, *, sinks="case") -> torch.Tensor:
    kwargs = case.op_kwargs()
    if sinks != "case":
        kwargs["sinks"] = sinks
    return reference_prefill_attention(case.q, case.k, case.v, case.b_start_loc, case.b_seq_len,
                                       dtype=reference_dtype_for(case.q.dtype), **kwargs)


def check_writes(case: Case) -> None:
    """Every element of every sequence row written (finite); nothing else in the buffer touched."""
    rows = covered_rows(case.b_start_loc, case.b_seq_len, case.tokens)
    inside = case.o[rows]
    assert torch.isfinite(inside).all(), \
        f"{int((~torch.isfinite(inside)).sum())} output elements of sequence rows were not written"
    spare = case.o_buf.clone()
    spare[:case.tokens, :case.q.shape[1], :case.q.shape[2]][rows] = float("nan")
    assert torch.isnan(spare).all(), "the op wrote outside the sequence rows of o"


def check_tolerance(case: Case, out: torch.Tensor | None = None) -> tuple[float, float]:
    """Assert the tolerance rule on the sequence rows; return (op error, same-dtype torch error)."""
    out = case.o if out is None else out
    rows = covered_rows(case.b_start_loc, case.b_seq_len, case.tokens)
    if not bool(rows.any()):
        return 0.0, 0.0
    ref = reference(case)
    base = same_dtype_torch_error(case.q, case.k, case.v, case.b_start_loc, case.b_seq_len,
                                  ref=ref, rows=rows, **case.op_kwargs())
    err = relative_l2(out[rows], ref[rows])
    bound = TOLERANCE_FACTOR * base
    if case.q.dtype == torch.float32:
        bound = max(bound, FP32_FLOOR)
    assert err <= bound, (
        f"op error {err:.3e} > {bound:.3e} ({TOLERANCE_FACTOR} x same-dtype torch error {base:.3e}"
        f"{', floor one fp32 ulp' if bound != TOLERANCE_FACTOR * base else ''})")
    return err, base
