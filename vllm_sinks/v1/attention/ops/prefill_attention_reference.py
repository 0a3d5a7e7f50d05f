"""Plain-PyTorch reference for the prefill attention op, both sink semantics.

This is the yardstick the Triton op (``triton_prefill_attention``), its tests, its benchmark and the
MiMo vision patch measure against. It needs only torch (no vLLM, no Triton) and runs on any device.

Semantics (the same as ``context_attention_fwd``; see that module's docstring for the full text):

- packed variable-length sequences: sequence ``b`` owns rows ``b_start_loc[b] … b_start_loc[b] +
  b_seq_len[b] - 1`` of q, k, v and the output; positions below are relative to the sequence start;
- key ``j`` is visible to query ``i`` when ``i - j <= sliding_window_q`` and ``j - i <=
  sliding_window_k`` (``None``, 0 or -1: unbounded on that side), and ``j <= i`` when causal;
- ``sinks`` [Hq], ``sinks_bias_key0=False``: a *null logit* — one extra ``exp(sinks[h])`` term in the
  softmax denominator with no value vector (GPT-OSS);
- ``sinks_bias_key0=True``: ``sinks[h]`` is added to the (already scaled) logit of key 0 of each
  sequence, for the queries that see key 0 (MiMo vision encoder).

The reference works per sequence and per block of queries, and only materialises the band of keys the
block can see, so 4 × 16384 tokens with a window of 64 fits in a few hundred MB even on a GPU.
"""

from __future__ import annotations

import math

import torch

#: Upper bound on the score elements one query block materialises (fp32: 4 bytes each).
_SCORE_BUDGET = 1 << 25


def normalize_window(value, name: str) -> int:
    """Window size as an int, 0 meaning unbounded.

    Accepts ``None``, 0 and -1 as "unbounded": vLLM's triton backend passes ``(-1, -1)`` when a layer
    has no window (flash-attn's convention), upstream's op treats ``None`` and 0 the same way.
    """
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import numpy as np  # numpy integers are fine; floats and tensors are not

            if isinstance(value, np.integer):
                value = int(value)
            else:
                raise TypeError
        except (ImportError, TypeError):
            raise ValueError(f"{name} must be an int or None, got {type(value).__name__}") from None
    if value == -1:
        return 0
    if value < 0:
        raise ValueError(f"{name} must be >= 0 (or None / -1 for unbounded), got {value}")
    return int(value)


def _visible(pos_q: torch.Tensor, pos_k: torch.Tensor, is_causal: bool, wq: int, wk: int) -> torch.Tensor:
    """[nq, nk] bool: which keys each query sees (positions relative to the sequence start)."""
    diff = pos_q[:, None] - pos_k[None, :]  # i - j
    vis = torch.ones_like(diff, dtype=torch.bool)
    if is_causal:
        vis &= diff >= 0
    if wq > 0:
        vis &= diff <= wq
    if wk > 0:
        vis &= -diff <= wk
    return vis


def _keys_per_block(nq: int, length: int, wq: int, wk: int) -> int:
    """Most keys a block of ``nq`` consecutive queries can see (the band it materialises)."""
    return min(length, nq + (wq if wq > 0 else length) + (wk if wk > 0 else length))


def _banded_attention(q, k, v, b_start_loc, b_seq_len, *, matmul_dtype, out_dtype, is_causal=True,
                      softmax_scale=None, sliding_window_q=None, sliding_window_k=None, sinks=None,
                      sinks_bias_key0=False):
    """Shared body: scores and P·V in ``matmul_dtype``, masking and softmax in fp32 or better."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [tokens, heads, head_dim]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    tokens, hq, d = q.shape
    hkv = k.shape[1]
    if k.shape != v.shape or k.shape[0] != tokens or k.shape[2] != d:
        raise ValueError(f"k and v must be [{tokens}, Hkv, {d}]; got {tuple(k.shape)}, {tuple(v.shape)}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if b_start_loc.shape != b_seq_len.shape or b_start_loc.dim() != 1:
        raise ValueError("b_start_loc and b_seq_len must be 1-D of the same length")
    if sinks is not None and tuple(sinks.shape) != (hq,):
        raise ValueError(f"sinks must be [{hq}] (one per query head), got {tuple(sinks.shape)}")
    wq = normalize_window(sliding_window_q, "sliding_window_q")
    wk = normalize_window(sliding_window_k, "sliding_window_k")
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    group = hq // hkv
    soft_dtype = torch.float64 if out_dtype == torch.float64 else torch.float32
    sink_h = None if sinks is None else sinks.to(q.device, soft_dtype).view(hkv, group, 1)

    out = torch.zeros(tokens, hq, d, dtype=out_dtype, device=q.device)
    starts = b_start_loc.tolist()
    lens = b_seq_len.tolist()
    for start, length in zip(starts, lens):
        if length <= 0:
            continue
        if start < 0 or start + length > tokens:
            raise ValueError(f"sequence [{start}, {start + length}) is outside the {tokens} tokens")
        qb_size = length
        while qb_size > 1 and hq * qb_size * _keys_per_block(qb_size, length, wq, wk) > _SCORE_BUDGET:
            qb_size = (qb_size + 1) // 2
        for i0 in range(0, length, qb_size):
            i1 = min(length, i0 + qb_size)
            lo = max(0, i0 - wq) if wq > 0 else 0
            hi = min(length, i1 + wk) if wk > 0 else length
            if is_causal:
                hi = min(hi, i1)
            pos_q = torch.arange(i0, i1, device=q.device)
            pos_k = torch.arange(lo, hi, device=q.device)
            vis = _visible(pos_q, pos_k, is_causal, wq, wk)  # [nq, nk]
            qb = q[start + i0:start + i1].to(matmul_dtype).permute(1, 0, 2)  # [Hq, nq, D]
            qb = qb.reshape(hkv, group * (i1 - i0), d)
            kb = k[start + lo:start + hi].to(matmul_dtype).permute(1, 2, 0)  # [Hkv, D, nk]
            vb = v[start + lo:start + hi].to(matmul_dtype).permute(1, 0, 2)  # [Hkv, nk, D]
            s = torch.bmm(qb, kb).to(soft_dtype) * scale  # [Hkv, G*nq, nk]
            s = s.view(hkv, group, i1 - i0, hi - lo)
            if sink_h is not None and sinks_bias_key0 and lo == 0:
                s[..., 0] = s[..., 0] + torch.where(vis[:, 0], sink_h, torch.zeros_like(sink_h))
            s = s.masked_fill(~vis, float("-inf"))
            if sink_h is not None and not sinks_bias_key0:
                null = sink_h.unsqueeze(-1).expand(hkv, group, i1 - i0, 1)
                p = torch.softmax(torch.cat([s, null], dim=-1), dim=-1)[..., :-1]
            else:
                p = torch.softmax(s, dim=-1)
            p = p.reshape(hkv, group * (i1 - i0), hi - lo).to(matmul_dtype)
            ob = torch.bmm(p, vb).view(hkv, group, i1 - i0, d).reshape(hq, i1 - i0, d)
            out[start + i0:start + i1] = ob.permute(1, 0, 2).to(out_dtype)
    return out


def reference_prefill_attention(q, k, v, b_start_loc, b_seq_len, *, is_causal=True, softmax_scale=None,
                                sliding_window_q=None, sliding_window_k=None, sinks=None,
                                sinks_bias_key0=False, dtype=torch.float32) -> torch.Tensor:
    """Exact attention in ``dtype`` (fp32 or fp64): [tokens, Hq, D]; rows outside every sequence are 0."""
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"the reference computes in float32 or float64, not {dtype}")
    return _banded_attention(q, k, v, b_start_loc, b_seq_len, is_causal=is_causal,
                             softmax_scale=softmax_scale, sliding_window_q=sliding_window_q,
                             sliding_window_k=sliding_window_k, sinks=sinks,
                             sinks_bias_key0=sinks_bias_key0, matmul_dtype=dtype, out_dtype=dtype)


def same_dtype_torch_attention(q, k, v, b_start_loc, b_seq_len, **kwargs) -> torch.Tensor:
    """The same attention as PyTorch computes it in the inputs' dtype (the tolerance baseline).

    Q·Kᵀ and P·V run as matmuls on q.dtype operands (PyTorch accumulates in fp32 and rounds the result
    to q.dtype), the masked softmax in fp32 and P is rounded to q.dtype before P·V — the rounding steps
    a flash-attention kernel also takes, and no others. Output in q.dtype.
    """
    return _banded_attention(q, k, v, b_start_loc, b_seq_len, matmul_dtype=q.dtype, out_dtype=q.dtype,
                             **kwargs)


def reference_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """One precision step above the inputs: fp64 for fp32 inputs, fp32 for fp16 / bf16."""
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def relative_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (NaN or inf anywhere gives inf, so it never passes a bound)."""
    if out.shape != ref.shape:
        raise ValueError(f"shapes differ: {tuple(out.shape)} vs {tuple(ref.shape)}")
    o = out.detach().to(torch.float64)
    r = ref.detach().to(torch.float64)
    if not torch.isfinite(o).all():
        return math.inf
    denom = torch.linalg.vector_norm(r).item()
    num = torch.linalg.vector_norm(o - r).item()
    if denom == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / denom


def same_dtype_torch_error(q, k, v, b_start_loc, b_seq_len, *, ref: torch.Tensor | None = None,
                           rows: torch.Tensor | None = None, **kwargs) -> float:
    """Relative L2 error of :func:`same_dtype_torch_attention` against the reference.

    The tolerance rule of the op's tests: the op's error against the same reference must be at most
    twice this. ``ref`` may be passed to avoid recomputing it (it must come from
    :func:`reference_prefill_attention` with ``dtype=reference_dtype_for(q.dtype)``); ``rows``
    (bool [tokens]) restricts the comparison to the rows that belong to a sequence.
    """
    if ref is None:
        ref = reference_prefill_attention(q, k, v, b_start_loc, b_seq_len,
                                          dtype=reference_dtype_for(q.dtype), **kwargs)
    base = same_dtype_torch_attention(q, k, v, b_start_loc, b_seq_len, **kwargs)
    if rows is not None:
        return relative_l2(base[rows], ref[rows])
    return relative_l2(base, ref)


def covered_rows(b_start_loc: torch.Tensor, b_seq_len: torch.Tensor, tokens: int) -> torch.Tensor:
    """bool [tokens]: rows that belong to some sequence (the op writes exactly these)."""
    rows = torch.zeros(tokens, dtype=torch.bool, device=b_start_loc.device)
    for start, length in zip(b_start_loc.tolist(), b_seq_len.tolist()):
        if length > 0:
            rows[start:start + length] = True
    return rows
