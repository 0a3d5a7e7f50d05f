"""Prefill attention over packed variable-length sequences, with learnable sinks (Triton).

A drop-in superset of vLLM's ``vllm.v1.attention.ops.triton_prefill_attention.context_attention_fwd``
(same signature, same semantics, plus input checks and no device→host sync). Written for this project;
it imports neither vLLM nor anything but torch and Triton.

Semantics
---------
``context_attention_fwd(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal=True,
softmax_scale=None, sliding_window_q=None, sliding_window_k=None, sinks=None, sinks_bias_key0=False)``

- ``q`` [tokens, Hq, D]; ``k``, ``v`` [tokens, Hkv, D]; ``o`` [tokens, Hq, D] is written in place.
  Hq must be a multiple of Hkv (MHA, GQA, MQA): query head ``h`` reads KV head ``h // (Hq // Hkv)``.
- Sequence ``b`` owns rows ``b_start_loc[b] … b_start_loc[b] + b_seq_len[b] - 1``. Positions ``i``
  (query) and ``j`` (key) are counted from the start of their sequence; attention never crosses
  sequences. Rows of ``o`` that belong to no sequence are not written. Empty batches and zero-length
  sequences are valid.
- Key ``j`` is visible to query ``i`` when ``i - j <= sliding_window_q`` and ``j - i <=
  sliding_window_k`` (``None``, 0 or -1 leave that side unbounded; -1 is what vLLM's triton backend
  passes for "no window"), and, when ``is_causal``, ``j <= i``. Every query sees itself, so no row is
  empty.
- Logits are ``q·k * softmax_scale`` (default ``D ** -0.5``, must be > 0); softmax and accumulation
  run in fp32.
- ``sinks`` [Hq] (fp32, bf16 or fp16), two meanings:

  * ``sinks_bias_key0=False`` — *null logit* (GPT-OSS, Granite SWA, DeepSeek V4, ...): the softmax
    denominator of every query of head ``h`` gets one extra term ``exp(sinks[h])`` that carries no
    value vector: ``o_i = Σ_j e^{s_ij} v_j / (e^{sinks[h]} + Σ_j e^{s_ij})``.
  * ``sinks_bias_key0=True`` — *key-0 bias* (MiMo-V2.5 vision encoder): ``sinks[h]`` is added to the
    scaled logit of key 0 of each sequence, for the queries that see key 0 (e.g. within the window),
    so it also reaches the numerator through ``v_0``. Queries that do not see key 0 are unaffected.

  Both match vLLM ≥ 0.28 (``sinks_bias_key0`` arrived with vLLM PR #49815); vLLM 0.27 has only the
  null logit.
- ``max_input_len`` (an int or a 0-d integer tensor, as MiMo passes it) is accepted for compatibility
  and never read: the launch grid comes from tensor shapes alone (an upper bound on the query tiles
  of all sequences; each program finds its sequence on the device), so a call costs no device→host
  sync and can be captured in a CUDA graph.
- fp16, bf16 and fp32 inputs (fp32 dots run in IEEE fp32, not tf32); head dims 1–256, powers of two
  or not (72, 80, 96, ...).

Bad input raises ``ValueError`` saying what is wrong. What cannot be checked without a sync (start
offsets and lengths against the number of rows) is clamped on the device instead: the kernel never
reads or writes outside the tensors.

Design (H200, MiMo's 32/8 heads, D 64, window 64 is the case that sets the shape of the kernel)
-----------------------------------------------------------------------------------------------
- One program = one tile of ``BLOCK_T`` consecutive query tokens of one sequence × ``GP`` query heads
  that share one KV head, stacked as ``BLOCK_T * GP`` rows of one matrix: K/V tiles are loaded once
  for the GP heads and the MMAs stay 64–128 rows tall even when BLOCK_T is small.
- A small BLOCK_T keeps the band of keys a tile must visit (``BLOCK_T + wq + wk``) close to the
  ``wq + wk + 1`` each query needs; the key loop starts exactly at the first needed key.
- The key loop is split into masked edge blocks and mask-free interior blocks; a band (window) runs
  16-key steps with a register cap, for more programs in flight per SM (it is latency-bound:
  docs/notes/prefill-kernel-log.md).
- A whole-band softmax path (no key loop: the band's scores in two dots, exact row max, no online
  rescaling) exists for windows (``whole_band_config``) but is not the default: it measured slower
  on the H200 (register pressure: 2 programs per SM instead of 6; kernel log, run 3).
- Key 0 under ``sinks_bias_key0`` is folded into the initial softmax state (like the null logit is),
  so no block of the loop carries the bias.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from vllm_sinks.v1.attention.ops.prefill_attention_reference import normalize_window

_LOG2E = 1.4426950408889634  # softmax runs in base 2: exp(x) = exp2(x * log2(e))

_SINKS_NONE, _SINKS_NULL_LOGIT, _SINKS_KEY0_BIAS = 0, 1, 2
# Read when @triton.jit decorates (import time), like Triton itself does.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _mask_invisible(qk, pos_q, pos_k, seq_len, window_q, window_k, IS_CAUSAL: tl.constexpr,
                    HAS_WQ: tl.constexpr, HAS_WK: tl.constexpr):
    """-inf where key ``pos_k`` is invisible to query ``pos_q`` (past the sequence, causal, window)."""
    visible = (pos_k < seq_len)[None, :]
    if IS_CAUSAL:
        visible = visible & (pos_k[None, :] <= pos_q[:, None])
    if HAS_WQ:
        visible = visible & (pos_q[:, None] - pos_k[None, :] <= window_q)
    if HAS_WK:
        visible = visible & (pos_k[None, :] - pos_q[:, None] <= window_k)
    return tl.where(visible, qk, float("-inf"))


@triton.jit
def _attend_key_blocks(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_d, pos_q,
                       seq_len, key_lo, first_block, end_block, qk_scale, window_q, window_k,
                       MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WQ: tl.constexpr,
                       HAS_WK: tl.constexpr, EVEN_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       LAZY_TAU: tl.constexpr = 0.0):
    """Online softmax over key blocks ``first_block … end_block - 1`` starting at key ``key_lo``.

    MASKED blocks straddle a band edge (or the sequence end) and apply the visibility mask; the others
    are visible to every valid row of the tile and skip it. Positions are relative to the sequence.
    LAZY_TAU > 0 (FlashAttention-4's conditional rescaling): the reference max ``m_i`` only moves,
    with the accumulator rescale, when some row's block max exceeds it by more than LAZY_TAU (log2
    units); otherwise the block is exponentiated against the stale max (p ≤ 2^LAZY_TAU, exact after
    the final division) and the rescale of acc and l is skipped for the whole tile.
    """
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    first_key = (key_lo + first_block * BLOCK_N + offs_n).to(tl.int64)
    k_ptrs = k_base + first_key[:, None] * stride_kt + offs_d[None, :]
    v_ptrs = v_base + first_key[:, None] * stride_vt + offs_d[None, :]
    for blk in range(first_block, end_block):
        pos_k = key_lo + blk * BLOCK_N + offs_n
        if MASKED:
            kv_ok = (pos_k < seq_len)[:, None]
            if not EVEN_D:
                kv_ok = kv_ok & d_ok[None, :]
            k = tl.load(k_ptrs, mask=kv_ok, other=0.0)
        elif EVEN_D:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)

        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            qk = _mask_invisible(qk, pos_q, pos_k, seq_len, window_q, window_k, IS_CAUSAL, HAS_WQ,
                                 HAS_WK)
        # qk_scale > 0 (checked by the launcher), so max(qk) * scale is the max of the scaled logits
        # and qk * scale - m below is one FMA per element.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        if LAZY_TAU > 0:
            # (-inf > -inf + tau is False: rows that saw nothing yet do not force a rescale.)
            grow = tl.max(tl.where(m_new > m_i + LAZY_TAU, 1, 0), 0)
            if grow > 0:
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.math.exp2(m_i - m_use)
                acc = acc * alpha[:, None]
                l_i = l_i * alpha
                m_i = m_new
            m_ref = tl.where(m_i == float("-inf"), 0.0, m_i)
            p = tl.math.exp2(qk * qk_scale - m_ref[:, None])
            l_i = l_i + tl.sum(p, 1)
        else:
            # A row may have seen nothing yet (masked edge block, no sink): keep exp2 away from
            # inf - inf.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk * qk_scale - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)

        if MASKED:
            v = tl.load(v_ptrs, mask=kv_ok, other=0.0)
        elif EVEN_D:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        if LAZY_TAU == 0:
            acc = acc * alpha[:, None]
            m_i = m_new
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        k_ptrs += BLOCK_N * stride_kt
        v_ptrs += BLOCK_N * stride_vt
    return acc, l_i, m_i


@triton.jit
def _band_chunk_values(v_base, stride_vt, offs_d, seq_len, key_lo, EVEN_D: tl.constexpr,
                       HEAD_DIM: tl.constexpr, N: tl.constexpr):
    pos_k = key_lo + tl.arange(0, N)
    kv_ok = (pos_k < seq_len)[:, None]
    if not EVEN_D:
        kv_ok = kv_ok & (offs_d < HEAD_DIM)[None, :]
    return tl.load(v_base + pos_k.to(tl.int64)[:, None] * stride_vt + offs_d[None, :], mask=kv_ok,
                   other=0.0)


@triton.jit
def _band_chunk_scores(q, k_base, stride_kt, offs_d, pos_q, seq_len, key_lo, window_q, window_k,
                       IS_CAUSAL: tl.constexpr, HAS_WQ: tl.constexpr, HAS_WK: tl.constexpr,
                       EVEN_D: tl.constexpr, HEAD_DIM: tl.constexpr, N: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    """Masked raw scores ``q·k`` of keys ``key_lo … key_lo + N - 1``."""
    pos_k = key_lo + tl.arange(0, N)
    kv_ok = (pos_k < seq_len)[:, None]
    if not EVEN_D:
        kv_ok = kv_ok & (offs_d < HEAD_DIM)[None, :]
    off = pos_k.to(tl.int64)[:, None]
    k = tl.load(k_base + off * stride_kt + offs_d[None, :], mask=kv_ok, other=0.0)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    return _mask_invisible(qk, pos_q, pos_k, seq_len, window_q, window_k, IS_CAUSAL, HAS_WQ, HAS_WK)


@triton.jit
def _attend_whole_band(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_d, pos_q,
                       seq_len, key_lo, qk_scale, window_q, window_k, IS_CAUSAL: tl.constexpr,
                       HAS_WQ: tl.constexpr, HAS_WK: tl.constexpr, EVEN_D: tl.constexpr,
                       HEAD_DIM: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, EARLY_V: tl.constexpr):
    """Exact softmax over the tile's whole key band ``key_lo … key_lo + N1 + N2 - 1`` at once.

    The launcher guarantees that every key some row of the tile sees lies in that range (N1, N2 are
    powers of two: e.g. 128 + 16 for 16 tokens and a ±64 window). The row max is taken once over all
    scores, so there is no online rescaling of the accumulator (4 multiplies per score at BLOCK_N 16
    in the loop) and there are 2 + 2 dots instead of 2 per 16 keys. The initial state (null logit,
    key 0 with its bias) enters exactly as in the loop: as one more term of the max and the sum.
    """
    # EARLY_V issues V with K: nothing else is in flight in a loop-free program, so its latency
    # hides behind the QK dots and the softmax, at the price of V's registers held meanwhile
    # (run 3: 202 registers per thread at 64 rows × 144 keys, 2 programs per SM). The V loads sit
    # under constexpr ifs (resolved when compiling), so v1 / v2 are defined on one path only.
    if EARLY_V:
        v1 = _band_chunk_values(v_base, stride_vt, offs_d, seq_len, key_lo, EVEN_D, HEAD_DIM, N1)
        if N2 > 0:
            v2 = _band_chunk_values(v_base, stride_vt, offs_d, seq_len, key_lo + N1, EVEN_D,
                                    HEAD_DIM, N2)
    qk1 = _band_chunk_scores(q, k_base, stride_kt, offs_d, pos_q, seq_len, key_lo, window_q,
                             window_k, IS_CAUSAL, HAS_WQ, HAS_WK, EVEN_D, HEAD_DIM, N1,
                             DOT_PRECISION)
    row_max = tl.max(qk1, 1)
    if N2 > 0:
        qk2 = _band_chunk_scores(q, k_base, stride_kt, offs_d, pos_q, seq_len, key_lo + N1,
                                 window_q, window_k, IS_CAUSAL, HAS_WQ, HAS_WK, EVEN_D, HEAD_DIM,
                                 N2, DOT_PRECISION)
        row_max = tl.maximum(row_max, tl.max(qk2, 1))
    # qk_scale > 0, so max(qk) * scale is the max of the scaled logits.
    m_new = tl.maximum(m_i, row_max * qk_scale)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding rows: nothing visible, no sink
    alpha = tl.math.exp2(m_i - m_use)  # once per row (the initial state), not per key block
    p1 = tl.math.exp2(qk1 * qk_scale - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p1, 1)
    acc = acc * alpha[:, None]
    if not EARLY_V:
        v1 = _band_chunk_values(v_base, stride_vt, offs_d, seq_len, key_lo, EVEN_D, HEAD_DIM, N1)
    acc = tl.dot(p1.to(v1.dtype), v1, acc, input_precision=DOT_PRECISION)
    if N2 > 0:
        p2 = tl.math.exp2(qk2 * qk_scale - m_use[:, None])
        l_i += tl.sum(p2, 1)
        if not EARLY_V:
            v2 = _band_chunk_values(v_base, stride_vt, offs_d, seq_len, key_lo + N1, EVEN_D,
                                    HEAD_DIM, N2)
        acc = tl.dot(p2.to(v2.dtype), v2, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _key_band(q_start, q_last, seq_len, window_q, window_k, BLOCK_N: tl.constexpr,
              IS_CAUSAL: tl.constexpr, HAS_WQ: tl.constexpr, HAS_WK: tl.constexpr,
              SKIP_KEY0: tl.constexpr):
    """Key blocks of the query tile ``q_start … q_last``: ``(lo, first_full, end_full, n_blocks)``.

    Block ``b`` holds keys ``lo + b * BLOCK_N …``; blocks ``first_full … end_full - 1`` are visible to
    every row of the tile (no mask), the others straddle a band edge. ``lo`` is the first key any row
    sees (1 with SKIP_KEY0: key 0 was folded into the initial state). Elementwise, so a test kernel
    can check it on vectors of tiles.
    """
    zero = q_start * 0
    lo = zero  # first key some row sees; [lo, hi) is the union of the rows' ranges
    hi = seq_len + zero
    full_lo = zero  # [full_lo, full_hi): the keys every row sees
    full_hi = seq_len + zero
    if HAS_WQ:
        lo = tl.maximum(q_start - window_q, 0)
        full_lo = tl.maximum(q_last - window_q, 0)
    if IS_CAUSAL:
        hi = tl.minimum(hi, q_last + 1)
        full_hi = tl.minimum(full_hi, q_start + 1)
    if HAS_WK:
        hi = tl.minimum(hi, q_last + window_k + 1)
        full_hi = tl.minimum(full_hi, q_start + window_k + 1)
    if SKIP_KEY0:
        lo = tl.maximum(lo, 1)
    n_blocks = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
    first_full = tl.minimum(tl.cdiv(tl.maximum(full_lo - lo, 0), BLOCK_N), n_blocks)
    end_full = tl.minimum(tl.maximum(tl.maximum(full_hi - lo, 0) // BLOCK_N, first_full), n_blocks)
    return lo, first_full, end_full, n_blocks


@triton.jit
def _prefill_attention_kernel(
    Q, K, V, O, Sinks, StartLoc, SeqLen,
    num_seqs, total_tokens, num_head_groups, qk_scale, window_q, window_k,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_sink, stride_start, stride_len,
    QUERIES_PER_KV: tl.constexpr,  # Hq // Hkv
    GP: tl.constexpr,  # query heads per program (power of two dividing QUERIES_PER_KV)
    BLOCK_T: tl.constexpr,  # query tokens per program
    BLOCK_N: tl.constexpr,  # keys per loop step
    BLOCK_D: tl.constexpr,  # head dim padded to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_B: tl.constexpr,  # sequences per step of the tile → sequence lookup
    IS_CAUSAL: tl.constexpr, HAS_WQ: tl.constexpr, HAS_WK: tl.constexpr,
    SINK_MODE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SPLIT_LOOPS: tl.constexpr,  # masked edges / mask-free middle in separate loops, or one loop
    BAND_N1: tl.constexpr, BAND_N2: tl.constexpr,  # > 0: whole-band softmax over N1 + N2 keys
    BAND_EARLY_V: tl.constexpr,  # whole band: load V together with K (else after the softmax)
    LAZY_TAU: tl.constexpr,  # key loop: > 0 rescales only when a row max grows by more (log2)
):
    ROWS: tl.constexpr = BLOCK_T * GP
    pid = tl.program_id(0)
    head_group = pid % num_head_groups  # heads vary fastest: neighbours share K/V rows in L2
    tile = pid // num_head_groups

    # -- which sequence and which query tile of it: walk the per-sequence tile counts on the device
    # (the grid is an upper bound, so programs past the last tile return at once).
    offs_b = tl.arange(0, BLOCK_B)
    seq = 0
    tiles_before = 0
    running = 0
    for b0 in range(0, num_seqs, BLOCK_B):
        in_batch = b0 + offs_b < num_seqs
        lens = tl.load(SeqLen + (b0 + offs_b) * stride_len, mask=in_batch, other=0).to(tl.int32)
        ntiles = (tl.maximum(lens, 0) + BLOCK_T - 1) // BLOCK_T
        inclusive = tl.cumsum(ntiles, 0) + running
        before = (inclusive <= tile) & in_batch
        seq += tl.sum(before.to(tl.int32), 0)
        tiles_before = tl.maximum(tiles_before, tl.max(tl.where(before, inclusive, 0), 0))
        running += tl.sum(ntiles, 0)
    # No early return for programs past the last tile: a `return` splits the kernel into several
    # blocks and Triton's software pipeliner then leaves the key loops alone (measured: no async
    # copies at all). Idle programs run with an empty sequence instead: no key blocks, no stores.
    active = seq < num_seqs
    seq = tl.minimum(seq, num_seqs - 1)
    seq_start = tl.load(StartLoc + seq * stride_start).to(tl.int64)
    seq_len = tl.load(SeqLen + seq * stride_len).to(tl.int64)
    # Offsets cannot be checked on the host without a sync: clamp them to the buffer instead.
    seq_len = tl.minimum(seq_len, total_tokens - seq_start)
    seq_len = tl.where(seq_start < 0, 0, tl.maximum(seq_len, 0)).to(tl.int32)
    q_start = (tile - tiles_before) * BLOCK_T
    seq_len = tl.where(active & (q_start < seq_len), seq_len, 0)
    q_last = tl.minimum(q_start + BLOCK_T, seq_len) - 1

    # -- rows: token-major, GP heads of one KV head per token
    offs_r = tl.arange(0, ROWS)
    pos_q = q_start + offs_r // GP
    head = head_group * GP + offs_r % GP
    kv_head = (head_group * GP) // QUERIES_PER_KV
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = pos_q < seq_len
    if BLOCK_D == HEAD_DIM:
        io_mask = row_ok[:, None]
    else:
        io_mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_ptrs = (Q + (seq_start + pos_q.to(tl.int64))[:, None] * stride_qt
              + head[:, None] * stride_qh + offs_d[None, :])
    q = tl.load(q_ptrs, mask=io_mask, other=0.0)
    k_base = K + seq_start * stride_kt + kv_head * stride_kh
    v_base = V + seq_start * stride_vt + kv_head * stride_vh

    # -- initial softmax state: empty, or the sink as a value-less logit, or key 0 with its bias
    if SINK_MODE == 0:
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    else:
        sink = tl.load(Sinks + head * stride_sink).to(tl.float32) * 1.4426950408889634
        if SINK_MODE == 1:
            m_i = sink
            l_i = tl.full([ROWS], 1.0, tl.float32)
            acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
        else:
            m_i = tl.full([ROWS], float("-inf"), tl.float32)
            l_i = tl.zeros([ROWS], tl.float32)
            acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
            # Key 0 is visible to row i iff i <= window_q (the other conditions always hold for j=0).
            # Its biased logit and its value seed the state; the key loop then starts at key 1.
            key0_in_reach = seq_len > 0  # (0 for idle programs: nothing to load)
            if HAS_WQ:
                key0_in_reach = key0_in_reach & (q_start <= window_q)
            if key0_in_reach:
                d_ok = offs_d < HEAD_DIM
                k0 = tl.load(k_base + offs_d, mask=d_ok, other=0.0).to(tl.float32)
                v0 = tl.load(v_base + offs_d, mask=d_ok, other=0.0).to(tl.float32)
                sees_key0 = row_ok
                if HAS_WQ:
                    sees_key0 = sees_key0 & (pos_q <= window_q)
                s0 = tl.sum(q.to(tl.float32) * k0[None, :], 1) * qk_scale + sink
                m_i = tl.where(sees_key0, s0, float("-inf"))
                l_i = tl.where(sees_key0, 1.0, 0.0)
                acc = tl.where(sees_key0[:, None], v0[None, :], 0.0)

    # -- key blocks: the whole band at once, or masked head, mask-free middle, masked tail
    lo, first_full, end_full, n_blocks = _key_band(
        q_start, q_last, seq_len, window_q, window_k, BLOCK_N, IS_CAUSAL, HAS_WQ, HAS_WK,
        SINK_MODE == 2)
    if BAND_N1 > 0:
        acc, l_i, m_i = _attend_whole_band(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_d, pos_q, seq_len, lo,
            qk_scale, window_q, window_k, IS_CAUSAL, HAS_WQ, HAS_WK, BLOCK_D == HEAD_DIM, HEAD_DIM,
            BAND_N1, BAND_N2, DOT_PRECISION, BAND_EARLY_V)
    elif SPLIT_LOOPS:
        acc, l_i, m_i = _attend_key_blocks(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_d, pos_q, seq_len, lo,
            0, first_full, qk_scale, window_q, window_k, True, IS_CAUSAL, HAS_WQ, HAS_WK,
            BLOCK_D == HEAD_DIM, HEAD_DIM, BLOCK_N, DOT_PRECISION, LAZY_TAU)
        acc, l_i, m_i = _attend_key_blocks(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_d, pos_q, seq_len, lo,
            first_full, end_full, qk_scale, window_q, window_k, False, IS_CAUSAL, HAS_WQ, HAS_WK,
            BLOCK_D == HEAD_DIM, HEAD_DIM, BLOCK_N, DOT_PRECISION, LAZY_TAU)
        acc, l_i, m_i = _attend_key_blocks(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_d, pos_q, seq_len, lo,
            end_full, n_blocks, qk_scale, window_q, window_k, True, IS_CAUSAL, HAS_WQ, HAS_WK,
            BLOCK_D == HEAD_DIM, HEAD_DIM, BLOCK_N, DOT_PRECISION, LAZY_TAU)
    else:
        # One masked loop over the whole band: a single pipeline (one prologue of exposed load
        # latency instead of three) at the price of mask arithmetic in every block.
        acc, l_i, m_i = _attend_key_blocks(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_d, pos_q, seq_len, lo,
            0, n_blocks, qk_scale, window_q, window_k, True, IS_CAUSAL, HAS_WQ, HAS_WK,
            BLOCK_D == HEAD_DIM, HEAD_DIM, BLOCK_N, DOT_PRECISION, LAZY_TAU)

    # Valid rows always have l_i > 0 (a query sees itself); padding rows are not stored.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = (O + (seq_start + pos_q.to(tl.int64))[:, None] * stride_ot
              + head[:, None] * stride_oh + offs_d[None, :])
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=io_mask)


# ---- launcher ---------------------------------------------------------------------------------------

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Tile shape of one launch. ``rows = block_t * gp`` is the height of the score matrix."""

    block_t: int
    gp: int
    block_n: int
    num_warps: int
    num_stages: int
    split_loops: bool = True
    maxnreg: int | None = None  # register cap per thread: more programs per SM (latency hiding)
    # Whole-band softmax (banded problems): all keys of a tile's band in two chunks of band_n1 and
    # band_n2 keys (powers of two, band_n2 may be 0), no key loop; block_n and split_loops unused.
    band_n1: int = 0
    band_n2: int = 0
    band_early_v: bool = False  # load V with K (more registers) or after the softmax
    lazy_tau: float = 0.0  # key loop: conditional rescaling threshold in log2 units (0: every block)


@dataclasses.dataclass(frozen=True)
class Problem:
    """A validated call, reduced to what the launch needs."""

    tokens: int
    num_seqs: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    is_causal: bool
    window_q: int
    window_k: int
    sink_mode: int
    scale: float

    @property
    def queries_per_kv(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def block_d(self) -> int:
        return max(16, triton.next_power_of_2(self.head_dim))  # tl.dot needs K >= 16

    @property
    def banded(self) -> bool:
        """Both band sides bounded (a window, or a causal window): key span per tile is small."""
        return self.window_q > 0 and (self.window_k > 0 or self.is_causal)


def _largest_pow2_divisor(n: int) -> int:
    return n & -n


def band_span(p: Problem, block_t: int) -> int | None:
    """Most keys one tile of ``block_t`` query tokens can see (None: unbounded).

    Rows ``q … q + T - 1`` see keys ``q - wq … q + T - 1 + wk`` (``… q + T - 1`` when causal): at
    most ``T + wq + wk`` (``T + wq``) keys. Key 0 under the key-0 bias is folded in before, so it only
    shortens the band.
    """
    if not p.banded:
        return None
    ahead = 0 if p.is_causal else p.window_k
    return block_t + p.window_q + ahead


def whole_band_chunks(span: int) -> tuple[int, int]:
    """Two power-of-two chunks covering ``span`` keys with little waste: 144 → 128 + 16.

    The second chunk is at least 16 keys (tl.dot's minimum K for the P·V product); when it would be
    as long as the first, one chunk of twice the size does the same work in fewer dots.
    """
    n1 = 1 << (span.bit_length() - 1)
    rest = span - n1
    if rest == 0:
        return max(n1, 16), 0
    n2 = max(16, triton.next_power_of_2(rest))
    if n2 >= n1:
        return max(2 * n1, 16), 0
    return n1, n2


# Longest band the whole-band path takes (keys, after rounding to the two chunks): a 64-row tile
# holds 64 × (n1 + n2) fp32 scores in registers, 72 per thread at 160 keys and 4 warps.
_WHOLE_BAND_MAX_KEYS = 160
# Whether choose_config picks the whole band where it applies. Off: on the H200 it lost to the key
# loop (run 3, MiMo 4 × 16384: 688 µs vs 494 µs; 202 registers per thread, 2 programs per SM where
# the loop kernel runs 6). Kept for the sweep and for later work (docs/notes/prefill-kernel-log.md).
_WHOLE_BAND_DEFAULT = False


def whole_band_config(p: Problem, num_warps: int = 4, maxnreg: int | None = None,
                      early_v: bool = False, rows: int = 64) -> LaunchConfig | None:
    """The whole-band tile shape for ``p`` (None where it does not apply: not banded, fp32, D > 64,
    or a band longer than _WHOLE_BAND_MAX_KEYS keys)."""
    if not p.banded or p.dtype == torch.float32 or p.block_d > 64:
        return None
    gp = min(_largest_pow2_divisor(p.queries_per_kv), rows)
    block_t = rows // gp
    n1, n2 = whole_band_chunks(band_span(p, block_t))
    if n1 + n2 > _WHOLE_BAND_MAX_KEYS:
        return None
    return LaunchConfig(block_t=block_t, gp=gp, block_n=16, num_warps=num_warps, num_stages=1,
                        split_loops=False, maxnreg=maxnreg, band_n1=n1, band_n2=n2,
                        band_early_v=early_v)


def choose_config(p: Problem) -> LaunchConfig:
    """Tile shape by problem shape (H200 measurements: docs/notes/prefill-kernel-log.md).

    Banded attention (a window) is latency-bound: each tile visits only (BLOCK_T + wq + wk) keys, so
    what counts is programs in flight per SM. 64 rows (the GP query heads of a KV head × BLOCK_T
    tokens), 16 keys per step, 4 warps, capped at 80 registers (no spill per ptxas) gives 6 programs
    per SM; masked edge blocks in their own loops (2–3 % over one masked loop). The whole-band path
    is taken only when _WHOLE_BAND_DEFAULT says so (off: slower, kernel log run 3). Full attention
    keeps long key loops, mostly mask-free: 128 rows, 8 warps, masked edges in their own loops. fp32
    operands and D > 128 need 64 rows × 16 keys with 8 warps not to spill.
    """
    gp_max = _largest_pow2_divisor(p.queries_per_kv)
    if _WHOLE_BAND_DEFAULT:
        whole = whole_band_config(p)
        if whole is not None:
            return whole
    if p.dtype == torch.float32 or p.block_d > 128:
        rows, cfg = 64, dict(block_n=16, num_warps=8, num_stages=2)
    elif p.banded:
        rows = 64
        # Masked edges in their own loops: 493 vs 503 µs (MiMo) and 948 vs 973 µs (GPT-OSS-like)
        # over one masked loop, the same in runs 2 and 3.
        cfg = dict(block_n=16, num_warps=4, num_stages=3, split_loops=True,
                   maxnreg=80 if p.block_d <= 64 else None)
    else:
        rows, cfg = 128, dict(block_n=64 if p.block_d <= 64 else 32, num_warps=8, num_stages=2)
    gp = min(gp_max, rows)
    return LaunchConfig(block_t=rows // gp, gp=gp, **cfg)


def _check_tensor(name, t, ndim):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")


def _validate(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal, softmax_scale,
              sliding_window_q, sliding_window_k, sinks, sinks_bias_key0) -> Problem:
    """Every check runs on tensor metadata only (no device→host sync)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("o", o)):
        _check_tensor(name, t, 3)
    tokens, hq, d = q.shape
    if k.shape[0] != tokens or v.shape[0] != tokens or o.shape[0] != tokens:
        raise ValueError(f"q, k, v, o must have the same number of tokens; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}, o {tuple(o.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    hkv = k.shape[1]
    if k.shape[2] != d:
        raise ValueError(f"q and k must have the same head dim; got {d} and {k.shape[2]}")
    if tuple(o.shape) != (tokens, hq, d):
        raise ValueError(f"o must be [{tokens}, {hq}, {d}] like q, got {tuple(o.shape)}")
    if d < 1 or d > 256:
        raise ValueError(f"head dim must be in 1..256, got {d}")
    if hkv < 1 or hq < 1 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a positive multiple of KV heads ({hkv})")
    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if o.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"o must be float16, bfloat16 or float32, got {o.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v), ("o", o)):
        if t.numel() and t.stride(2) != 1:
            raise ValueError(f"{name} must have a unit stride in its last (head_dim) dimension, "
                             f"got strides {t.stride()}")
    for name, t in (("b_start_loc", b_start_loc), ("b_seq_len", b_seq_len)):
        _check_tensor(name, t, 1)
        if t.dtype not in _INDEX_DTYPES:
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if b_start_loc.shape != b_seq_len.shape:
        raise ValueError(f"b_start_loc and b_seq_len must have the same length; got "
                         f"{b_start_loc.shape[0]} and {b_seq_len.shape[0]}")
    if isinstance(max_input_len, torch.Tensor):
        if max_input_len.numel() != 1 or max_input_len.dtype.is_floating_point or \
                max_input_len.dtype == torch.bool:
            raise ValueError(f"max_input_len must be an int or a one-element integer tensor, got a "
                             f"{max_input_len.dtype} tensor of shape {tuple(max_input_len.shape)}")
    elif isinstance(max_input_len, bool) or not isinstance(max_input_len, int):
        raise ValueError(f"max_input_len must be an int or a 0-d integer tensor, got "
                         f"{type(max_input_len).__name__}")
    elif max_input_len < 0:
        raise ValueError(f"max_input_len must be >= 0, got {max_input_len}")
    wq = normalize_window(sliding_window_q, "sliding_window_q")
    wk = normalize_window(sliding_window_k, "sliding_window_k")
    if softmax_scale is None:
        scale = d ** -0.5
    elif isinstance(softmax_scale, (int, float)) and not isinstance(softmax_scale, bool):
        scale = float(softmax_scale)
        if not (0.0 < scale < float("inf")):
            raise ValueError(f"softmax_scale must be positive and finite, got {softmax_scale}")
    else:
        raise ValueError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if not isinstance(sinks_bias_key0, bool):
        raise ValueError(f"sinks_bias_key0 must be a bool, got {type(sinks_bias_key0).__name__}")
    if sinks is None:
        sink_mode = _SINKS_NONE
    else:
        _check_tensor("sinks", sinks, 1)
        if sinks.shape[0] != hq:
            raise ValueError(f"sinks must have one value per query head ({hq}), got {sinks.shape[0]}")
        if sinks.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"sinks must be float32, bfloat16 or float16, got {sinks.dtype}")
        sink_mode = _SINKS_KEY0_BIAS if sinks_bias_key0 else _SINKS_NULL_LOGIT
    tensors = [("q", q), ("k", k), ("v", v), ("o", o), ("b_start_loc", b_start_loc),
               ("b_seq_len", b_seq_len)]
    if sinks is not None:
        tensors.append(("sinks", sinks))
    # max_input_len is never read, so it may live anywhere: MiMo's vision tower passes a host tensor
    # (its grid sizes stay on the CPU) while q is on the GPU, and upstream's op accepts that.
    device = q.device
    for name, t in tensors:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device: q is on {device}, {name} on {t.device}")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError("tensors are on the CPU: the Triton kernel needs a GPU "
                         "(or TRITON_INTERPRET=1 for the interpreter)")
    return Problem(tokens=tokens, num_seqs=b_seq_len.shape[0], q_heads=hq, kv_heads=hkv, head_dim=d,
                   dtype=q.dtype, is_causal=bool(is_causal), window_q=wq, window_k=wk,
                   sink_mode=sink_mode, scale=scale)


def launch(p: Problem, cfg: LaunchConfig, q, k, v, o, b_start_loc, b_seq_len, sinks):
    """Launch for an already validated problem (the benchmark calls this to compare tile shapes)."""
    if p.tokens == 0 or p.num_seqs == 0:
        return
    if p.queries_per_kv % cfg.gp:
        raise ValueError(f"gp={cfg.gp} must divide the {p.queries_per_kv} query heads per KV head")
    if cfg.band_n1:
        span = band_span(p, cfg.block_t)
        if span is None or cfg.band_n1 + cfg.band_n2 < span:
            raise ValueError(f"whole-band chunks {cfg.band_n1} + {cfg.band_n2} do not cover the "
                             f"band of {span} keys of a {cfg.block_t}-token tile")
    num_head_groups = p.q_heads // cfg.gp
    # Σ ceil(len_b / T) <= floor((tokens + B (T - 1)) / T) when the sequences fit in the buffer.
    max_tiles = (p.tokens + p.num_seqs * (cfg.block_t - 1)) // cfg.block_t
    grid = (num_head_groups * max_tiles,)
    # Returns Triton's compiled kernel (registers, spills: the benchmark's sweep prints them).
    return _prefill_attention_kernel[grid](
        q, k, v, o, sinks if sinks is not None else q, b_start_loc, b_seq_len,
        p.num_seqs, p.tokens, num_head_groups, p.scale * _LOG2E, p.window_q, p.window_k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        o.stride(0), o.stride(1), sinks.stride(0) if sinks is not None else 0,
        b_start_loc.stride(0), b_seq_len.stride(0),
        QUERIES_PER_KV=p.queries_per_kv, GP=cfg.gp, BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n,
        BLOCK_D=p.block_d, HEAD_DIM=p.head_dim, BLOCK_B=128,
        IS_CAUSAL=p.is_causal, HAS_WQ=p.window_q > 0, HAS_WK=p.window_k > 0,
        SINK_MODE=p.sink_mode, DOT_PRECISION="ieee" if p.dtype == torch.float32 else "tf32",
        SPLIT_LOOPS=cfg.split_loops, BAND_N1=cfg.band_n1, BAND_N2=cfg.band_n2,
        BAND_EARLY_V=cfg.band_early_v, LAZY_TAU=float(cfg.lazy_tau),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg and not _INTERPRETING else {}),
    )


# Validated calls by their metadata: a ViT calls the op with the same shapes in every layer, and the
# full checks cost ~20 µs of Python per call (measured), more than the kernel on small inputs.
_VALIDATED: dict = {}
_VALIDATED_MAX = 512


def _meta(t):
    return t.shape, t.stride(), t.dtype, t.device


def _call_key(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal, softmax_scale,
              sliding_window_q, sliding_window_k, sinks, sinks_bias_key0):
    """Everything ``_validate`` looks at, or None when an argument is not what a valid call passes."""
    try:
        if isinstance(max_input_len, torch.Tensor):
            mil = (max_input_len.numel(), max_input_len.dtype, max_input_len.device)
        else:
            mil = (type(max_input_len), max_input_len >= 0)
        return (_meta(q), _meta(k), _meta(v), _meta(o), _meta(b_start_loc), _meta(b_seq_len),
                None if sinks is None else _meta(sinks), mil, is_causal, softmax_scale,
                sliding_window_q, sliding_window_k, sinks_bias_key0)
    except Exception:  # noqa: BLE001 - not a tensor, incomparable value...: _validate says what
        return None


def context_attention_fwd(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal=True,
                          softmax_scale=None, sliding_window_q=None, sliding_window_k=None,
                          sinks=None, sinks_bias_key0=False):
    """Attention over packed sequences with optional window and sinks; writes ``o`` in place.

    See the module docstring for the semantics. Raises ``ValueError`` on bad input.
    """
    args = (q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal, softmax_scale,
            sliding_window_q, sliding_window_k, sinks, sinks_bias_key0)
    key = _call_key(*args)
    hit = _VALIDATED.get(key) if key is not None else None
    if hit is None:
        p = _validate(*args)
        hit = (p, choose_config(p))
        if key is not None:
            if len(_VALIDATED) >= _VALIDATED_MAX:
                _VALIDATED.clear()
            _VALIDATED[key] = hit
    launch(hit[0], hit[1], q, k, v, o, b_start_loc, b_seq_len, sinks)
