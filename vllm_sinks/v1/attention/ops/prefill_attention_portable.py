"""The portable kernel of the prefill op: Triton, every shape, dtype and GPU, and the interpreter.

``triton_prefill_attention.context_attention_fwd`` (the front door, with the op's semantics) runs
this kernel for every call the Hopper window kernel (``gluon_window_attention``) or upstream's op
does not take, and under ``TRITON_INTERPRET=1`` (the CPU tests). Imports torch and Triton only.

Design (H200, MiMo's 32/8 heads, D 64, window 64 is the case that set the shape of the kernel)
-----------------------------------------------------------------------------------------------
- One program = one tile of ``BLOCK_T`` consecutive query tokens of one sequence × ``GP`` query heads
  that share one KV head, stacked as ``BLOCK_T * GP`` rows of one matrix: K/V tiles are loaded once
  for the GP heads and the MMAs stay 64–128 rows tall even when BLOCK_T is small.
- A small BLOCK_T keeps the band of keys a tile must visit (``BLOCK_T + wq + wk``) close to the
  ``wq + wk + 1`` each query needs; the key loop starts exactly at the first needed key.
- A tile's key band is one software-pipelined loop; only its edge blocks (the first and last, for a
  window) apply the visibility mask, behind a tile-uniform branch. Banded shapes run 16-key steps
  with a register cap for 6 programs per SM. The kernel is issue-bound there (Nsight Compute), so
  per-tile instructions are what the layout minimises: docs/kernels/portable.md.
- Key 0 under ``sinks_bias_key0`` is folded into the initial softmax state (like the null logit is),
  so no block of the loop carries the bias.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from vllm_sinks.v1.attention.ops.kernel_launcher import DirectLauncher, new_token
from vllm_sinks.v1.attention.ops import prefill_attention_problem as problem
# What the kernel's body reads is imported by name (Triton resolves a kernel's globals in its own
# module); the host side reaches the shared validation and launch helpers through `problem.`.
from vllm_sinks.v1.attention.ops.prefill_attention_problem import (KEY0_BIAS_C, LOG2E_C, NONE_C,
                                                                   NULL_LOGIT_C, load_sequence,
                                                                   load_sequence_cu)


@triton.jit
def _visible_range(pos_q, seq_len, window_q, window_k, IS_CAUSAL: tl.constexpr,
                   HAS_WQ: tl.constexpr, HAS_WK: tl.constexpr):
    """Per query row, the keys it sees: ``row_lo <= j <= row_hi`` (window, causal, sequence end).

    Computed once per tile, so masking a key block costs two compares and a select per score
    (the per-block form, one subtraction, compare and select per condition, was ~70 instructions
    per warp for a 64 × 16 block, read in the SASS).
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
    if SINK_MODE == NONE_C:
        m_i = tl.full([ROWS], -1.0e30, tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    else:
        sink = tl.load(Sinks + head * stride_sink).to(tl.float32) * LOG2E_C
        if SINK_MODE == NULL_LOGIT_C:
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
        SINK_MODE == KEY0_BIAS_C)
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
    # instructions per warp in the epilogue (read in the SASS).
    inv_l = 1.0 / tl.where(l_i > 0, l_i, 1.0)
    out = acc * inv_l[:, None]
    o_ptrs = (O + (seq_start + pos_q.to(tl.int64))[:, None] * stride_ot
              + head[:, None] * stride_oh + offs_d[None, :])
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=io_mask)


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
    CU_SEQLENS: tl.constexpr,  # StartLoc holds cumulative offsets [num_seqs + 1] (SeqLen unused)
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
        if CU_SEQLENS:
            seq_start, seq_len = load_sequence_cu(StartLoc, seq, total_tokens, stride_start)
        else:
            seq_start, seq_len = load_sequence(StartLoc, SeqLen, seq, total_tokens, stride_start,
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
            if CU_SEQLENS:
                ends = tl.load(StartLoc + (b0 + offs_b + 1) * stride_start, mask=in_batch, other=0)
                begins = tl.load(StartLoc + (b0 + offs_b) * stride_start, mask=in_batch, other=0)
                lens = (ends - begins).to(tl.int32)
            else:
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
        if CU_SEQLENS:
            seq_start, seq_len = load_sequence_cu(StartLoc, tl.minimum(seq, num_seqs - 1),
                                                  total_tokens, stride_start)
        else:
            seq_start, seq_len = load_sequence(StartLoc, SeqLen, tl.minimum(seq, num_seqs - 1),
                                                total_tokens, stride_start, stride_len)
        q_start = (tile - tiles_before) * BLOCK_T
        seq_len = tl.where(active & (q_start < seq_len), seq_len, 0)
        _attend_tile(Q, K, V, O, Sinks, seq_start, seq_len, q_start, head_group, qk_scale,
                     window_q, window_k, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                     stride_vh, stride_ot, stride_oh, stride_sink, QUERIES_PER_KV, GP, BLOCK_T,
                     BLOCK_N, BLOCK_D, HEAD_DIM, IS_CAUSAL, HAS_WQ, HAS_WK, SINK_MODE,
                     DOT_PRECISION, LOOP_LAYOUT)


# ---- launcher ---------------------------------------------------------------------------------------

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


def _block_d(p: problem.Problem) -> int:
    return max(16, triton.next_power_of_2(p.head_dim))  # tl.dot needs K >= 16


def choose_config(p: problem.Problem) -> LaunchConfig:
    """Tile shape by problem shape (H200 measurements: docs/kernels/portable.md).

    Banded attention (a window) visits only BLOCK_T + wq + wk keys per tile, so the per-tile work is
    short and the instruction count per tile decides (issue-bound per Nsight Compute): 64
    rows (the GP query heads of a KV head × BLOCK_T tokens), 16 keys per step, 4 warps, capped at 80
    registers (no spill per ptxas: 6 programs per SM), and one key loop that masks only its edge
    blocks. Full attention keeps long key loops, mostly mask-free: 128 rows, 8 warps, masked edges
    in their own loops. fp32 operands and D > 128 need 64 rows × 16 keys with 8 warps not to spill.
    """
    gp_max = p.queries_per_kv & -p.queries_per_kv  # largest power of two dividing it
    block_d = _block_d(p)
    if p.dtype == torch.float32 or block_d > 128:
        rows, cfg = 64, dict(block_n=problem.BLOCK_KEYS, num_warps=8, num_stages=2, loop_layout="split")
    elif p.banded:
        rows = 64
        cfg = dict(block_n=problem.BLOCK_KEYS, num_warps=4, num_stages=3, loop_layout="edges",
                   maxnreg=80 if block_d <= 64 else None)
    else:
        rows, cfg = 128, dict(block_n=64 if block_d <= 64 else 32, num_warps=8, num_stages=2,
                              loop_layout="split")
    gp = min(gp_max, rows)
    return LaunchConfig(block_t=rows // gp, gp=gp, **cfg)


def kernel_constexprs(p: problem.Problem, cfg: LaunchConfig, seq_from_grid: bool) -> dict:
    """The compile-time arguments of the kernel for a problem and tile shape, in kernel order."""
    return dict(
        NUM_HEAD_GROUPS=p.q_heads // cfg.gp, QUERIES_PER_KV=p.queries_per_kv, GP=cfg.gp,
        BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n,
        BLOCK_D=_block_d(p), HEAD_DIM=p.head_dim, BLOCK_B=128, SEQ_FROM_GRID=seq_from_grid,
        IS_CAUSAL=p.is_causal, HAS_WQ=p.window_q > 0, HAS_WK=p.window_k > 0,
        SINK_MODE=p.sink_mode, DOT_PRECISION="ieee" if p.dtype == torch.float32 else "tf32",
        LOOP_LAYOUT=LOOP_LAYOUTS.index(cfg.loop_layout), CU_SEQLENS=p.cu_seqlens)


_LAUNCHER = DirectLauncher(_prefill_attention_kernel)


@dataclasses.dataclass(frozen=True)
class PortableLaunch:
    """A problem bound to this kernel and a tile shape, every non-tensor argument worked out once
    (a ViT calls the op with the same shapes in every layer; building these per call cost ~12 µs).
    Strides are part of the front door's call signature, so they are bound here too."""

    name = "triton"
    p: problem.Problem
    cfg: LaunchConfig
    scalars: tuple  # the kernel's scalar arguments after the seven tensors, in order
    grid_kwargs: dict  # constexprs, sequence from the grid
    search_kwargs: dict  # constexprs, sequence searched on the device
    options: dict
    # Stands for this plan's call key (dtypes included) in the launcher's cache.
    token: int = dataclasses.field(default_factory=new_token, compare=False)
    # grid and constexprs by length bound (a ViT passes the same bound in every layer)
    _by_bound: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)


    @classmethod
    def plan(cls, p: problem.Problem, q, k, v, o, b_start_loc, b_seq_len, sinks,
             cfg: LaunchConfig | None = None) -> "PortableLaunch":
        """This kernel takes every valid call."""
        cfg = cfg or choose_config(p)
        if p.queries_per_kv % cfg.gp:
            raise ValueError(f"gp={cfg.gp} must divide the {p.queries_per_kv} query heads per KV head")
        scalars = (p.num_seqs, p.tokens, p.log2_scale, p.window_q, p.window_k,
                   *problem.stride_args(q, k, v, o, sinks, b_start_loc, b_seq_len))
        options = problem.launch_options(p.device, cfg.num_warps, cfg.num_stages, cfg.maxnreg)
        return cls(p, cfg, scalars, kernel_constexprs(p, cfg, True), kernel_constexprs(p, cfg, False),
                   options)

    def grid(self, max_len_hint: int | None):
        """(grid, constexprs) for a host-side bound on the longest sequence, or None (search)."""
        p, cfg = self.p, self.cfg
        num_head_groups = p.q_heads // cfg.gp
        if max_len_hint is not None and p.num_seqs <= problem.MAX_GRID_YZ:
            slots = triton.cdiv(min(max(max_len_hint, 1), p.tokens), cfg.block_t)
            # + 1 slot per sequence: the tiles past a wrong bound
            return (num_head_groups * (slots + 1), p.num_seqs, 1), self.grid_kwargs
        # Σ ceil(len_b / T) <= floor((tokens + B (T - 1)) / T) when the sequences fit in the buffer.
        max_tiles = (p.tokens + p.num_seqs * (cfg.block_t - 1)) // cfg.block_t
        return (num_head_groups * max_tiles, 1, 1), self.search_kwargs

    def ready(self, max_len_hint: int | None) -> tuple | None:
        """The direct launch of this bound, once launched (``DirectLauncher.ready``), else None."""
        bound = self._by_bound.get(max_len_hint)
        if bound is None:
            return None
        grid, constexprs, signature = bound
        return _LAUNCHER.ready(signature, grid, self.scalars)

    def __call__(self, q, k, v, o, b_start_loc, b_seq_len, sinks, max_len_hint: int | None):
        """Launch on these tensors (of the bound shapes and strides); returns the compiled kernel.
        ``max_len_hint``: a host-side bound on the longest sequence, or None; a bound that is too
        small costs time (programs loop over the extra tiles), never output. Without one, programs
        search their sequence and tile on the device."""
        if self.p.empty:
            return None
        bound = self._by_bound.get(max_len_hint)
        if bound is None:
            if len(self._by_bound) >= 64:
                self._by_bound.clear()
            grid, constexprs = self.grid(max_len_hint)
            bound = self._by_bound[max_len_hint] = (grid, constexprs, (self.token, grid))
        grid, constexprs, signature = bound
        return _LAUNCHER(signature, grid,
                         (q, k, v, o, sinks if sinks is not None else q, b_start_loc, b_seq_len),
                         self.scalars, constexprs, self.options)


def launch(p: problem.Problem, cfg: LaunchConfig, q, k, v, o, b_start_loc, b_seq_len, sinks,
           max_len_hint: int | None = None):
    """Run this kernel with a given tile shape on a validated problem (tests and the benchmark's
    tile sweep; the op itself goes through the front door). Returns the compiled kernel."""
    return PortableLaunch.plan(p, q, k, v, o, b_start_loc, b_seq_len, sinks, cfg)(
        q, k, v, o, b_start_loc, b_seq_len, sinks, max_len_hint)
