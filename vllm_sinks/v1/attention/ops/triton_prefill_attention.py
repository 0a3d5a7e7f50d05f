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
- ``max_input_len`` (an int, or a one-element integer tensor as MiMo passes it) is only a hint and
  is never read from the device: an int or a CPU tensor sizes the launch grid (programs take their
  sequence from the grid; a bound that is too small costs time, never output), while a device
  tensor is ignored and each program finds its sequence and tile on the device. Either way a call
  costs no device→host sync and can be captured in a CUDA graph.
- fp16, bf16 and fp32 inputs (fp32 dots run in IEEE fp32, not tf32); head dims 1–256, powers of two
  or not (72, 80, 96, ...).

Bad input raises ``ValueError`` saying what is wrong. What cannot be checked without a sync (start
offsets and lengths against the number of rows) is clamped on the device instead: the kernel never
reads or writes outside the tensors.

Two kernels
-----------
Sliding windows on Hopper (fp16/bf16, head dim 64, ≥ 4 query heads per KV head, a host-side length
bound) go to the Gluon kernel in ``gluon_window_attention.py``, which walks each sequence with the
band resident in shared memory (MiMo 4 × 16384: ~250 µs against ~420 µs here; kernel log, run 9).
Everything else, and every call under ``TRITON_INTERPRET=1``, runs the Triton kernel below.

Design (H200, MiMo's 32/8 heads, D 64, window 64 is the case that sets the shape of the kernel)
-----------------------------------------------------------------------------------------------
- One program = one tile of ``BLOCK_T`` consecutive query tokens of one sequence × ``GP`` query heads
  that share one KV head, stacked as ``BLOCK_T * GP`` rows of one matrix: K/V tiles are loaded once
  for the GP heads and the MMAs stay 64–128 rows tall even when BLOCK_T is small.
- A small BLOCK_T keeps the band of keys a tile must visit (``BLOCK_T + wq + wk``) close to the
  ``wq + wk + 1`` each query needs; the key loop starts exactly at the first needed key.
- A tile's key band is one software-pipelined loop; only its edge blocks (the first and last, for a
  window) apply the visibility mask, behind a tile-uniform branch. Banded shapes run 16-key steps
  with a register cap for 6 programs per SM. The kernel is issue-bound there (Nsight Compute), so
  per-tile instructions are what the layout minimises: docs/notes/prefill-kernel-log.md.
- Key 0 under ``sinks_bias_key0`` is folded into the initial softmax state (like the null logit is),
  so no block of the loop carries the bias.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from vllm_sinks.v1.attention.ops.gluon_window_attention import WalkLaunch
from vllm_sinks.v1.attention.ops.prefill_attention_reference import normalize_window

_LOG2E = 1.4426950408889634  # softmax runs in base 2: exp(x) = exp2(x * log2(e))

_SINKS_NONE, _SINKS_NULL_LOGIT, _SINKS_KEY0_BIAS = 0, 1, 2
# Read when @triton.jit decorates (import time), like Triton itself does.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _visible_range(pos_q, seq_len, window_q, window_k, IS_CAUSAL: tl.constexpr,
                   HAS_WQ: tl.constexpr, HAS_WK: tl.constexpr):
    """Per query row, the keys it sees: ``row_lo <= j <= row_hi`` (window, causal, sequence end).

    Computed once per tile, so masking a key block costs two compares and a select per score
    (the per-block form, one subtraction, compare and select per condition, was ~70 instructions
    per warp for a 64 × 16 block: SASS, run 5).
    """
    row_lo = pos_q * 0
    row_hi = pos_q * 0 + seq_len - 1
    if HAS_WQ:
        row_lo = pos_q - window_q
    if IS_CAUSAL:
        row_hi = tl.minimum(row_hi, pos_q)
    if HAS_WK:
        row_hi = tl.minimum(row_hi, pos_q + window_k)
    return row_lo, row_hi


@triton.jit
def _mask_invisible(qk, pos_k, row_lo, row_hi):
    """-inf where key ``pos_k`` is outside its row's visible range."""
    visible = (pos_k[None, :] >= row_lo[:, None]) & (pos_k[None, :] <= row_hi[:, None])
    return tl.where(visible, qk, float("-inf"))


# Loop layouts of a tile's key band (LaunchConfig.loop_layout).
LOOP_LAYOUTS = ("edges", "split", "one")


@triton.jit
def _attend_key_blocks(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_d, row_lo,
                       row_hi, seq_len, key_lo, first_block, end_block, first_full, end_full,
                       qk_scale, MASK: tl.constexpr, EVEN_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online softmax over key blocks ``first_block … end_block - 1`` starting at key ``key_lo``.

    Blocks ``first_full … end_full - 1`` are visible to every valid row of the tile; the others
    straddle a band edge (or the sequence end) and need the visibility mask. MASK says which blocks
    of this loop apply it: 0 none (a mask-free middle loop), 1 all, or 2 only the edge blocks,
    tested per block with a tile-uniform branch (one loop for the whole band: no extra loop
    prologues, and the mask arithmetic runs only where it can change something). Positions are
    relative to the sequence.
    """
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    # The softmax denominator is kept per score column and summed across the row once, after the
    # loop: an FMA per score per step instead of a row reduction (shuffles) per step.
    l_cols = tl.where(offs_n[None, :] == 0, l_i[:, None], 0.0)
    first_key = (key_lo + first_block * BLOCK_N + offs_n).to(tl.int64)
    k_ptrs = k_base + first_key[:, None] * stride_kt + offs_d[None, :]
    v_ptrs = v_base + first_key[:, None] * stride_vt + offs_d[None, :]
    for blk in range(first_block, end_block):
        pos_k = key_lo + blk * BLOCK_N + offs_n
        if MASK != 0:
            kv_ok = (pos_k < seq_len)[:, None]
            if not EVEN_D:
                kv_ok = kv_ok & d_ok[None, :]
            k = tl.load(k_ptrs, mask=kv_ok, other=0.0)
        elif EVEN_D:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)

        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASK == 1:
            qk = _mask_invisible(qk, pos_k, row_lo, row_hi)
        elif MASK == 2:
            if (blk < first_full) | (blk >= end_full):
                qk = _mask_invisible(qk, pos_k, row_lo, row_hi)
        # qk_scale > 0 (checked by the launcher), so max(qk) * scale is the max of the scaled logits
        # and qk * scale - m below is one FMA per element.
        # The running max starts finite (at -1e30 at worst), so a row that has seen nothing yet
        # (a masked edge block) gets p = exp2(-inf) = 0 and alpha = 1, never inf - inf: no guard.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_cols = l_cols * alpha[:, None] + p

        if MASK != 0:
            v = tl.load(v_ptrs, mask=kv_ok, other=0.0)
        elif EVEN_D:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None]
        m_i = m_new
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        k_ptrs += BLOCK_N * stride_kt
        v_ptrs += BLOCK_N * stride_vt
    return acc, tl.sum(l_cols, 1), m_i


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
def _attend_tile(Q, K, V, O, Sinks, seq_start, seq_len, q_start, head_group, qk_scale, window_q,
                 window_k, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                 stride_ot, stride_oh, stride_sink,
                 QUERIES_PER_KV: tl.constexpr, GP: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                 IS_CAUSAL: tl.constexpr, HAS_WQ: tl.constexpr, HAS_WK: tl.constexpr,
                 SINK_MODE: tl.constexpr, DOT_PRECISION: tl.constexpr, LOOP_LAYOUT: tl.constexpr):
    """Attention of query tokens ``q_start … q_start + BLOCK_T - 1`` of one sequence (positions
    relative to it; rows at or past ``seq_len`` are padding: computed on zeros, never stored) for
    the GP query heads of ``head_group``, written to O."""
    ROWS: tl.constexpr = BLOCK_T * GP
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
    # The running max never starts at -inf (see _attend_key_blocks): -1e30 is below any logit and
    # weighs exactly 0 once a real one arrives (exp2(-1e30 - m) = 0).
    if SINK_MODE == 0:
        m_i = tl.full([ROWS], -1.0e30, tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    else:
        sink = tl.load(Sinks + head * stride_sink).to(tl.float32) * 1.4426950408889634
        if SINK_MODE == 1:
            # A -inf sink (a head without one) starts the max at -1e30 too: it weighs exactly 0
            # after the first rescale, as exp(-inf) would.
            m_i = tl.maximum(sink, -1.0e30)
            l_i = tl.full([ROWS], 1.0, tl.float32)
            acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
        else:
            m_i = tl.full([ROWS], -1.0e30, tl.float32)
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
                m_i = tl.maximum(tl.where(sees_key0, s0, -1.0e30), -1.0e30)  # -inf sinks too
                l_i = tl.where(sees_key0, 1.0, 0.0)
                acc = tl.where(sees_key0[:, None], v0[None, :], 0.0)

    # -- the tile's key band: one loop (mask on edge blocks / every block) or three loops
    lo, first_full, end_full, n_blocks = _key_band(
        q_start, q_last, seq_len, window_q, window_k, BLOCK_N, IS_CAUSAL, HAS_WQ, HAS_WK,
        SINK_MODE == 2)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    row_lo, row_hi = _visible_range(pos_q, seq_len, window_q, window_k, IS_CAUSAL, HAS_WQ, HAS_WK)
    if LOOP_LAYOUT == 0:
        acc, l_i, m_i = _attend_key_blocks(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_d, row_lo, row_hi,
            seq_len, lo, 0, n_blocks, first_full, end_full, qk_scale, 2, EVEN_D, HEAD_DIM,
            BLOCK_N, DOT_PRECISION)
    elif LOOP_LAYOUT == 1:
        acc, l_i, m_i = _attend_key_blocks(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_d, row_lo, row_hi,
            seq_len, lo, 0, first_full, first_full, end_full, qk_scale, 1, EVEN_D, HEAD_DIM,
            BLOCK_N, DOT_PRECISION)
        acc, l_i, m_i = _attend_key_blocks(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_d, row_lo, row_hi,
            seq_len, lo, first_full, end_full, first_full, end_full, qk_scale, 0, EVEN_D, HEAD_DIM,
            BLOCK_N, DOT_PRECISION)
        acc, l_i, m_i = _attend_key_blocks(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_d, row_lo, row_hi,
            seq_len, lo, end_full, n_blocks, first_full, end_full, qk_scale, 1, EVEN_D, HEAD_DIM,
            BLOCK_N, DOT_PRECISION)
    else:
        acc, l_i, m_i = _attend_key_blocks(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_d, row_lo, row_hi,
            seq_len, lo, 0, n_blocks, first_full, end_full, qk_scale, 1, EVEN_D, HEAD_DIM,
            BLOCK_N, DOT_PRECISION)

    # Valid rows always have l_i > 0 (a query sees itself); padding rows are not stored. One
    # reciprocal per row and a multiply per element: a full-precision divide per element cost ~100
    # instructions per warp in the epilogue (SASS, run 5).
    inv_l = 1.0 / tl.where(l_i > 0, l_i, 1.0)
    out = acc * inv_l[:, None]
    o_ptrs = (O + (seq_start + pos_q.to(tl.int64))[:, None] * stride_ot
              + head[:, None] * stride_oh + offs_d[None, :])
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=io_mask)


@triton.jit
def _load_sequence(StartLoc, SeqLen, seq, total_tokens, stride_start, stride_len):
    """Start row (int64) and length (int32, clamped into the buffer) of sequence ``seq``."""
    seq_start = tl.load(StartLoc + seq * stride_start).to(tl.int64)
    seq_len = tl.load(SeqLen + seq * stride_len).to(tl.int64)
    # Offsets cannot be checked on the host without a sync: clamp them to the buffer instead.
    seq_len = tl.minimum(seq_len, total_tokens - seq_start)
    seq_len = tl.where(seq_start < 0, 0, tl.maximum(seq_len, 0)).to(tl.int32)
    return seq_start, seq_len


@triton.jit
def _prefill_attention_kernel(
    Q, K, V, O, Sinks, StartLoc, SeqLen,
    num_seqs, total_tokens, qk_scale, window_q, window_k,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_sink, stride_start, stride_len,
    NUM_HEAD_GROUPS: tl.constexpr,  # Hq // GP (a constant divides without an emulated division)
    QUERIES_PER_KV: tl.constexpr,  # Hq // Hkv
    GP: tl.constexpr,  # query heads per program (power of two dividing QUERIES_PER_KV)
    BLOCK_T: tl.constexpr,  # query tokens per tile
    BLOCK_N: tl.constexpr,  # keys per loop step
    BLOCK_D: tl.constexpr,  # head dim padded to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_B: tl.constexpr,  # sequences per step of the tile → sequence search
    SEQ_FROM_GRID: tl.constexpr,  # grid axis 1 = sequence (host length bound known), else search
    IS_CAUSAL: tl.constexpr, HAS_WQ: tl.constexpr, HAS_WK: tl.constexpr,
    SINK_MODE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    LOOP_LAYOUT: tl.constexpr,  # 0 one loop, mask on edge blocks; 1 three loops; 2 one masked loop
):
    pid = tl.program_id(0)
    head_group = pid % NUM_HEAD_GROUPS  # heads vary fastest: neighbours share K/V rows in L2
    if SEQ_FROM_GRID:
        # Grid (head groups × (tile slots + 1), sequences), the slots sized from a host-side bound
        # on the longest sequence: slot s takes tile s. The one extra slot per sequence and head
        # group takes the tiles past the bound, if any (none when the bound holds): a wrong bound
        # costs time, never output. Its loop is a separate path, so the common path keeps the
        # register budget of a single tile (the loop's hoisted invariants spill at 80 registers).
        seq = tl.program_id(1)
        slot = pid // NUM_HEAD_GROUPS
        num_slots = tl.num_programs(0) // NUM_HEAD_GROUPS - 1
        seq_start, seq_len = _load_sequence(StartLoc, SeqLen, seq, total_tokens, stride_start,
                                            stride_len)
        if slot < num_slots:
            q_start = slot * BLOCK_T
            _attend_tile(Q, K, V, O, Sinks, seq_start, tl.where(q_start < seq_len, seq_len, 0),
                         q_start, head_group, qk_scale, window_q, window_k, stride_qt, stride_qh,
                         stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                         stride_sink, QUERIES_PER_KV, GP, BLOCK_T, BLOCK_N, BLOCK_D, HEAD_DIM,
                         IS_CAUSAL, HAS_WQ, HAS_WK, SINK_MODE, DOT_PRECISION, LOOP_LAYOUT)
        else:
            for t in range(num_slots, tl.cdiv(seq_len, BLOCK_T)):
                _attend_tile(Q, K, V, O, Sinks, seq_start, seq_len, t * BLOCK_T, head_group,
                             qk_scale, window_q, window_k, stride_qt, stride_qh, stride_kt,
                             stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_sink,
                             QUERIES_PER_KV, GP, BLOCK_T, BLOCK_N, BLOCK_D, HEAD_DIM, IS_CAUSAL,
                             HAS_WQ, HAS_WK, SINK_MODE, DOT_PRECISION, LOOP_LAYOUT)
    else:
        # Grid (head groups × an upper bound on Σ tiles): find this program's sequence and tile by
        # walking the per-sequence tile counts on the device.
        tile = pid // NUM_HEAD_GROUPS
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
        # No early return for programs past the last tile: a `return` splits the kernel into
        # several blocks and Triton's software pipeliner then leaves the key loops alone (measured:
        # no async copies at all). Idle programs run with an empty sequence instead.
        active = seq < num_seqs
        seq_start, seq_len = _load_sequence(StartLoc, SeqLen, tl.minimum(seq, num_seqs - 1),
                                            total_tokens, stride_start, stride_len)
        q_start = (tile - tiles_before) * BLOCK_T
        seq_len = tl.where(active & (q_start < seq_len), seq_len, 0)
        _attend_tile(Q, K, V, O, Sinks, seq_start, seq_len, q_start, head_group, qk_scale,
                     window_q, window_k, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                     stride_vh, stride_ot, stride_oh, stride_sink, QUERIES_PER_KV, GP, BLOCK_T,
                     BLOCK_N, BLOCK_D, HEAD_DIM, IS_CAUSAL, HAS_WQ, HAS_WK, SINK_MODE,
                     DOT_PRECISION, LOOP_LAYOUT)


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
    # The tile's key band as one loop masking only its edge blocks ("edges"), masked edges and a
    # mask-free middle in three loops ("split"), or one loop masking every block ("one").
    loop_layout: str = "edges"
    maxnreg: int | None = None  # register cap per thread: more programs per SM (latency hiding)

    def __post_init__(self):
        if self.loop_layout not in LOOP_LAYOUTS:
            raise ValueError(f"loop_layout must be one of {LOOP_LAYOUTS}, got {self.loop_layout!r}")


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
    def log2_scale(self) -> float:
        """The logit scale in base 2 (both kernels take the softmax with exp2)."""
        return self.scale * _LOG2E

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


def choose_config(p: Problem) -> LaunchConfig:
    """Tile shape by problem shape (H200 measurements: docs/notes/prefill-kernel-log.md).

    Banded attention (a window) visits only BLOCK_T + wq + wk keys per tile, so the per-tile work is
    short and the instruction count per tile decides (issue-bound per Nsight Compute, run 5): 64
    rows (the GP query heads of a KV head × BLOCK_T tokens), 16 keys per step, 4 warps, capped at 80
    registers (no spill per ptxas: 6 programs per SM), and one key loop that masks only its edge
    blocks. Full attention keeps long key loops, mostly mask-free: 128 rows, 8 warps, masked edges
    in their own loops. fp32 operands and D > 128 need 64 rows × 16 keys with 8 warps not to spill.
    """
    gp_max = _largest_pow2_divisor(p.queries_per_kv)
    if p.dtype == torch.float32 or p.block_d > 128:
        rows, cfg = 64, dict(block_n=16, num_warps=8, num_stages=2, loop_layout="split")
    elif p.banded:
        rows = 64
        cfg = dict(block_n=16, num_warps=4, num_stages=3, loop_layout="edges",
                   maxnreg=80 if p.block_d <= 64 else None)
    else:
        rows, cfg = 128, dict(block_n=64 if p.block_d <= 64 else 32, num_warps=8, num_stages=2,
                              loop_layout="split")
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


def host_length_bound(max_input_len) -> int | None:
    """``max_input_len`` as a host int when reading it costs no device sync (an int, or a CPU
    tensor as MiMo's vision tower passes), else None (a device tensor: the kernel searches)."""
    if isinstance(max_input_len, torch.Tensor):
        return int(max_input_len) if max_input_len.device.type == "cpu" else None
    return int(max_input_len)


# Grid axis 1 (sequences) is limited to 65535 programs; past that the kernel searches.
_MAX_GRID_SEQS = 65535


def kernel_constexprs(p: Problem, cfg: LaunchConfig, seq_from_grid: bool) -> dict:
    """The compile-time arguments of the kernel for a problem and tile shape."""
    return dict(
        NUM_HEAD_GROUPS=p.q_heads // cfg.gp, QUERIES_PER_KV=p.queries_per_kv, GP=cfg.gp,
        BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n,
        BLOCK_D=p.block_d, HEAD_DIM=p.head_dim, BLOCK_B=128, SEQ_FROM_GRID=seq_from_grid,
        IS_CAUSAL=p.is_causal, HAS_WQ=p.window_q > 0, HAS_WK=p.window_k > 0,
        SINK_MODE=p.sink_mode, DOT_PRECISION="ieee" if p.dtype == torch.float32 else "tf32",
        LOOP_LAYOUT=LOOP_LAYOUTS.index(cfg.loop_layout))


@dataclasses.dataclass(frozen=True)
class BoundLaunch:
    """A problem and tile shape with every launch argument that is not a tensor worked out once.

    A ViT calls the op with the same shapes in every layer, and the direct call is launch-bound for
    one MiMo image (the kernel takes ~31 µs there): building these per call cost ~12 µs of Python
    (measured on the H200 machine), so ``context_attention_fwd`` caches one per call signature.
    Strides are part of that signature, so they can be bound here too.
    """

    p: Problem
    cfg: LaunchConfig
    scalars: tuple  # the kernel's scalar arguments after the seven tensors, in order
    grid_kwargs: dict  # constexprs and options, sequence from the grid
    search_kwargs: dict  # constexprs and options, sequence searched on the device
    # The Hopper window kernel (gluon_window_attention.py) when the call fits it; it needs the
    # host-side length bound, so calls without one still run the Triton kernel.
    walk: WalkLaunch | None = None

    @classmethod
    def bind(cls, p: Problem, cfg: LaunchConfig, q, k, v, o, b_start_loc, b_seq_len, sinks,
             allow_walk: bool = False):
        if p.queries_per_kv % cfg.gp:
            raise ValueError(f"gp={cfg.gp} must divide the {p.queries_per_kv} query heads per KV head")
        scalars = (p.num_seqs, p.tokens, p.log2_scale, p.window_q, p.window_k,
                   q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                   o.stride(0), o.stride(1), sinks.stride(0) if sinks is not None else 0,
                   b_start_loc.stride(0), b_seq_len.stride(0))
        options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if cfg.maxnreg and not _INTERPRETING:
            options["maxnreg"] = cfg.maxnreg
        walk = WalkLaunch.plan(p, q, k, v, o, b_start_loc, b_seq_len, sinks) if allow_walk else None
        return cls(p, cfg, scalars, {**kernel_constexprs(p, cfg, True), **options},
                   {**kernel_constexprs(p, cfg, False), **options}, walk)

    def __call__(self, q, k, v, o, b_start_loc, b_seq_len, sinks, max_len_hint: int | None = None):
        """Launch on these tensors (of the bound shapes and strides); see ``launch``."""
        p, cfg = self.p, self.cfg
        if p.tokens == 0 or p.num_seqs == 0:
            return None
        if self.walk is not None and max_len_hint is not None and \
                self.walk(q, k, v, o, b_start_loc, b_seq_len, sinks, max_len_hint):
            return None
        num_head_groups = p.q_heads // cfg.gp
        if max_len_hint is not None and p.num_seqs <= _MAX_GRID_SEQS:
            slots = triton.cdiv(min(max(max_len_hint, 1), p.tokens), cfg.block_t)
            grid = (num_head_groups * (slots + 1), p.num_seqs)  # + 1: tiles past a wrong bound
            kwargs = self.grid_kwargs
        else:
            # Σ ceil(len_b / T) <= floor((tokens + B (T - 1)) / T) when the sequences fit in the buffer.
            max_tiles = (p.tokens + p.num_seqs * (cfg.block_t - 1)) // cfg.block_t
            grid = (num_head_groups * max_tiles,)
            kwargs = self.search_kwargs
        # Returns Triton's compiled kernel (registers, spills: the benchmark's sweep prints them).
        return _prefill_attention_kernel[grid](
            q, k, v, o, sinks if sinks is not None else q, b_start_loc, b_seq_len, *self.scalars,
            **kwargs)


def launch(p: Problem, cfg: LaunchConfig, q, k, v, o, b_start_loc, b_seq_len, sinks,
           max_len_hint: int | None = None):
    """Launch the Triton kernel for an already validated problem (the benchmark calls this to
    compare tile shapes, and to time it against the Hopper window kernel).

    ``max_len_hint``: a host-side bound on the longest sequence (from ``host_length_bound``) or
    None. With one, programs take their sequence from the grid; a bound that is too small costs
    time (programs loop over the extra tiles), never output. Without one, each program searches
    its sequence and tile on the device.
    """
    bound = BoundLaunch.bind(p, cfg, q, k, v, o, b_start_loc, b_seq_len, sinks)
    return bound(q, k, v, o, b_start_loc, b_seq_len, sinks, max_len_hint)


# Validated and bound calls by their metadata: a ViT calls the op with the same shapes in every
# layer, and the full checks cost ~20 µs of Python per call (measured), more than the kernel on
# small inputs.
_BOUND_CALLS: dict = {}
_BOUND_CALLS_MAX = 512


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
    hit = _BOUND_CALLS.get(key) if key is not None else None
    if hit is None:
        p = _validate(*args)
        hit = BoundLaunch.bind(p, choose_config(p), q, k, v, o, b_start_loc, b_seq_len, sinks,
                               allow_walk=True)
        if key is not None:
            if len(_BOUND_CALLS) >= _BOUND_CALLS_MAX:
                _BOUND_CALLS.clear()
            _BOUND_CALLS[key] = hit
    hit(q, k, v, o, b_start_loc, b_seq_len, sinks, host_length_bound(max_input_len))
