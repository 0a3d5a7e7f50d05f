"""Hopper fast path of the prefill op for sliding windows: a Gluon kernel that walks the sequence.

Same semantics as ``triton_prefill_attention.context_attention_fwd`` (see its module docstring),
which dispatches here when ``WalkLaunch.plan`` accepts the call and otherwise runs its portable
Triton kernel. Written for this project. It needs Triton's Gluon dialect
(``triton.experimental.gluon``; the kernel is written against Triton 3.6, whose Gluon API is the
one tested on the GPU) and an sm_90 GPU (wgmma), and it imports without either.

Why a second kernel (docs/notes/prefill-kernel-log.md, runs 2–9): the Triton kernel re-loads a
tile's whole key band (9 blocks of 16 keys for MiMo) for every tile and streams it through a
cp.async ring with three CTA barriers per 16-key step. It levelled off at ~420 µs for MiMo's
4 × 16384 tokens, bound by per-step overhead. Gluon hands the kernel its shared memory, async
copies and asynchronous wgmma, so this one can:

- **walk**: a program takes ``chunk`` consecutive tiles of one sequence and one head group and keeps
  its band's keys and values resident in a shared-memory ring. A tile loads only the 16-key
  block(s) that entered the band (one per tile for MiMo), prefetched one tile ahead together with
  the next tile's queries: no load latency on the critical path, and one CTA barrier per tile;
- **take the exact softmax of the whole band** in registers, with no online rescaling: the band's
  scores come in power-of-two pieces (first block, middle blocks as up to three pieces, last
  block; Gluon shapes must be powers of two), one wgmma each on a view of the ring. The first
  ``MIRROR`` slots are mirrored past the ring's end, so every piece is one contiguous view;
- **mask only where the window cuts**: ``walk_geometry`` proves from the window that every query of
  an interior tile sees all of the middle blocks, that the first block is cut only from below and
  the last only from above (one compare per score there). Tiles at a sequence's edges (key 0 in
  reach, or a band past the end) mask every piece and carry the key-0 bias;
- **sum the rows on the tensor cores**: P · 1 next to P · V (the tensor cores have room; the adds
  and shuffles they replace do not).

Tile: 64 score rows = ``T`` tokens × ``GP`` query heads of one KV head (GP ≥ 4, so T ≤ 16 and a
tile's band gains at most one block), head dim 64, fp16/bf16, output in the input dtype.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import torch
import triton

# Gluon is experimental: absent from older Triton, and its API moves between releases (Triton 3.9,
# for one, has no gl.thread_barrier). The kernel runs only on the releases it was tested with.
TESTED_TRITON = ("3.6.",)
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    GLUON_IMPORT_ERROR: str | None = None
except Exception as e:  # noqa: BLE001 - any failure means "no fast path", said by gluon_unavailable()
    gluon = None
    GLUON_IMPORT_ERROR = f"{type(e).__name__}: {e}"

BLOCK_KEYS = 16  # keys per ring slot
ROWS = 64  # score rows per tile: one wgmma M for one warpgroup
HEAD_DIM = 64
ENV_DISABLE = "VLLM_SINKS_WINDOW_WALK"  # "0" turns the fast path off (A/B timing, bisecting)


# ---- geometry (pure Python: the CPU tests check it exhaustively) --------------------------------

@dataclasses.dataclass(frozen=True)
class WalkGeometry:
    """Band of a tile in 16-key blocks. ``nb`` blocks starting at ``floor((t*T - wq) / 16)`` hold
    every key any query of tile ``t`` sees; on interior tiles every query sees every key of blocks
    1 … nb-2 (so only the first and last blocks are masked). ``ns = nb + 1`` ring slots."""

    tokens_per_tile: int
    nb: int

    @property
    def ns(self) -> int:
        return self.nb + 1


def walk_geometry(tokens_per_tile: int, window_q: int, window_k: int, is_causal: bool):
    """The band layout for tiles of ``tokens_per_tile`` tokens, or None when the walk does not fit
    (a side of the band unbounded, more than one block gained per tile, a middle block some query
    does not fully see, or a middle wider than 256 keys)."""
    T = tokens_per_tile
    if window_q <= 0 or T > BLOCK_KEYS or BLOCK_KEYS % T:
        return None
    if window_k > 0:
        reach_k = min(window_k, 0) if is_causal else window_k
    elif is_causal:
        reach_k = 0
    else:
        return None
    base = BLOCK_KEYS * (window_q + 64)  # a tile far from the sequence start, any phase mod 16
    nb = 0
    for phase in range(0, BLOCK_KEYS, T):
        start = base + phase
        b0 = (start - window_q) // BLOCK_KEYS  # floors (the kernel offsets first: it truncates)
        last_key = start + T - 1 + reach_k
        nb = max(nb, last_key // BLOCK_KEYS - b0 + 1)
    if nb < 3 or (nb - 2) * BLOCK_KEYS > 256:
        return None
    for phase in range(0, BLOCK_KEYS, T):
        start = base + phase
        b0 = (start - window_q) // BLOCK_KEYS
        mid_lo, mid_hi = (b0 + 1) * BLOCK_KEYS, (b0 + nb - 1) * BLOCK_KEYS - 1
        for i in range(start, start + T):
            # Middle blocks fully visible. (That also cuts the first block only from below and the
            # last only from above: the kernel's one compare per edge score.)
            if i - window_q > mid_lo or i + reach_k < mid_hi:
                return None
    return WalkGeometry(T, nb)


# ---- kernel --------------------------------------------------------------------------------------

if gluon is not None:

    @gluon.jit
    def _issue_block(ring_k, ring_v, k_seq, v_seq, stride_kt, stride_vt, k_off, v_off, key_rows,
                     kb, kb0, seq_len, NS: gl.constexpr, MIRROR: gl.constexpr):
        """cp.async key block ``kb`` (keys 16 kb … 16 kb + 15) into its ring slot, and into the
        slot's mirror past the ring's end for the first MIRROR slots; keys past the sequence's end
        are zero-filled. ``k_seq``/``v_seq`` point at key 0 of the sequence and KV head; the
        per-thread offsets ``k_off``/``v_off`` are computed once per program."""
        mask = gl.expand_dims(kb * 16 + key_rows < seq_len, 1)
        first = (kb * 16).to(gl.int64)
        col_layout: gl.constexpr = gl.SliceLayout(0, k_off.type.layout.parent)
        cols = gl.expand_dims(gl.arange(0, ring_k.shape[2], layout=col_layout), 0)
        k_ptr = k_seq + first * stride_kt + (gl.expand_dims(k_off, 1) + cols)
        v_ptr = v_seq + first * stride_vt + (gl.expand_dims(v_off, 1) + cols)
        slot = (kb - kb0) % NS
        async_copy.async_copy_global_to_shared(ring_k.index(slot), k_ptr, mask)
        async_copy.async_copy_global_to_shared(ring_v.index(slot), v_ptr, mask)
        if slot < MIRROR:
            async_copy.async_copy_global_to_shared(ring_k.index(slot + NS), k_ptr, mask)
            async_copy.async_copy_global_to_shared(ring_v.index(slot + NS), v_ptr, mask)

    @gluon.jit
    def _issue_queries(q_buf, q_seq, stride_qt, q_off, row_tokens, t, seq_len, T: gl.constexpr):
        """cp.async the queries of tile ``t``: row r = token t*T + r // GP, head group*GP + r % GP
        (``q_off`` holds each row's offset from the tile's first token, computed once)."""
        mask = gl.expand_dims(t * T + row_tokens < seq_len, 1)
        col_layout: gl.constexpr = gl.SliceLayout(0, q_off.type.layout.parent)
        cols = gl.expand_dims(gl.arange(0, q_buf.shape[1], layout=col_layout), 0)
        ptr = q_seq + (t * T).to(gl.int64) * stride_qt + (gl.expand_dims(q_off, 1) + cols)
        async_copy.async_copy_global_to_shared(q_buf, ptr, mask)

    @gluon.jit
    def _row(x, s):
        """Per-row vector ``x`` as a column broadcastable against piece ``s``. The pieces' wgmma
        layouts differ only in instruction width, so their rows sit in the same threads and
        registers: the conversion must be free (assert_trivial)."""
        x = gl.convert_layout(x, gl.SliceLayout(1, s.type.layout), assert_trivial=True)
        return gl.expand_dims(x, 1)

    @gluon.jit
    def _row_max(s, row_layout: gl.constexpr):
        return gl.convert_layout(gl.max(s, 1), row_layout, assert_trivial=True)

    @gluon.jit
    def _keys(s, first_key):
        """Key positions of piece ``s``'s columns, as a row broadcastable against it."""
        keys = first_key + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s.type.layout))
        return gl.expand_dims(keys, 0)

    @gluon.jit
    def _mask_below(s, first_key, row_lo):
        """Scores of keys ``first_key …`` below their row's first visible key to -inf."""
        return gl.where(_keys(s, first_key) >= _row(row_lo, s), s, float("-inf"))

    @gluon.jit
    def _mask_above(s, first_key, row_hi):
        """Scores of keys ``first_key …`` above their row's last visible key to -inf."""
        return gl.where(_keys(s, first_key) <= _row(row_hi, s), s, float("-inf"))

    @gluon.jit
    def _mask_piece(s, first_key, row_lo, row_hi, bias, KEY0_BIAS: gl.constexpr):
        """Scores of keys ``first_key …`` outside [row_lo, row_hi] to -inf; with KEY0_BIAS, key 0's
        logit gets its row's bias first (so the bias only counts where key 0 is visible)."""
        keys = _keys(s, first_key)
        if KEY0_BIAS:
            s = gl.where(keys == 0, s + _row(bias, s), s)
        visible = (keys >= _row(row_lo, s)) & (keys <= _row(row_hi, s))
        return gl.where(visible, s, float("-inf"))

    @gluon.jit
    def _ring_view(ring, slot, N: gl.constexpr, D: gl.constexpr, smem_layout: gl.constexpr):
        """Keys slot*16 … slot*16 + N - 1 of the ring as one [N, D] view (contiguous: the ring's
        first slots are mirrored past its end)."""
        if N == 16:
            return ring.index(slot)
        else:
            return ring.index(slot)._reinterpret(ring.dtype, [N, D], smem_layout)

    @gluon.jit
    def _qk(q_s, ring_k, slot, M: gl.constexpr, N: gl.constexpr, smem_layout: gl.constexpr):
        """Start the wgmma of the [M, N] scores of N keys from ``slot`` (asynchronous), as one
        m64nNk16 instruction per k-step (fewer, wider wgmmas: a shorter dependent chain)."""
        k = _ring_view(ring_k, slot, N, q_s.shape[1], smem_layout)
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, N, 16])
        zeros = gl.zeros([M, N], gl.float32, layout)
        return warpgroup_mma(q_s, k.permute((1, 0)), zeros, use_acc=False, is_async=True)

    @gluon.jit
    def _pv(p, ring_v, slot, N: gl.constexpr, D: gl.constexpr, acc, l_acc, ones,
            use_acc: gl.constexpr, p_layout: gl.constexpr, l_layout: gl.constexpr,
            smem_layout: gl.constexpr):
        """Start acc += P · V and l_acc += P · 1 for N keys from ``slot`` (P in registers as the A
        operand of both). The row sums ride on the tensor cores, which have room, instead of ~100
        adds and shuffles per thread and tile; they sum the same bf16-rounded P as the numerator."""
        v = _ring_view(ring_v, slot, N, D, smem_layout)
        a = gl.convert_layout(p.to(ring_v.dtype), p_layout)
        acc = warpgroup_mma(a, v, acc, use_acc=use_acc, is_async=True)
        a_l = gl.convert_layout(a, gl.DotOperandLayout(operand_index=0, parent=l_layout, k_width=2),
                                assert_trivial=True)
        l_acc = warpgroup_mma(a_l, ones.slice(0, N), l_acc, use_acc=use_acc, is_async=True)
        return acc, l_acc

    @gluon.jit
    def _window_walk_kernel(
            Q, K, V, O, Sinks, StartLoc, SeqLen,
            total_tokens, qk_scale, inv_scale, window_q, window_k, band_offset, chunk, num_chunks,
            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
            stride_sink, stride_start, stride_len,
            T: gl.constexpr, GP: gl.constexpr, QUERIES_PER_KV: gl.constexpr, MID_A: gl.constexpr,
            MID_B: gl.constexpr, MID_C: gl.constexpr,
            IS_CAUSAL: gl.constexpr, HAS_WK: gl.constexpr, SINK_MODE: gl.constexpr):
        D: gl.constexpr = 64
        M: gl.constexpr = T * GP
        NB: gl.constexpr = MID_A + MID_B + MID_C + 2  # band blocks
        NS: gl.constexpr = NB + 1  # ring slots
        # A piece of the band (at most MID_A blocks) starting at any slot must be contiguous: the
        # first MID_A - 1 slots are mirrored past the ring's end.
        MIRROR: gl.constexpr = MID_A - 1
        dtype: gl.constexpr = Q.dtype.element_ty

        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 16, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        io_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                                   warps_per_cta=[4, 1], order=[1, 0])
        smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                         rank=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 8, 16])

        head_group = gl.program_id(0)
        chunk_id = gl.program_id(1)
        seq = gl.program_id(2)
        kv_head = head_group * GP // QUERIES_PER_KV
        seq_start64 = gl.load(StartLoc + seq * stride_start).to(gl.int64)
        seq_len64 = gl.load(SeqLen + seq * stride_len).to(gl.int64)
        # Offsets cannot be checked on the host without a sync: clamp them into the buffer (as the
        # Triton kernel does), so no program reads or writes outside the tensors.
        seq_len64 = gl.maximum(gl.minimum(seq_len64, total_tokens - seq_start64), 0)
        if seq_start64 < 0:  # a sequence before the buffer is empty
            seq_len64 = seq_len64 * 0
        seq_len = seq_len64.to(gl.int32)
        tiles = (seq_len + T - 1) // T
        t_begin = chunk_id * chunk
        t_end = gl.minimum(t_begin + chunk, tiles)
        if chunk_id == num_chunks - 1:  # a host bound that was too small costs time, never output
            t_end = tiles
        nblocks = (seq_len + 15) // 16

        # Per-thread offsets within a tile (rows of the io layout), computed once per program.
        io_rows = gl.arange(0, M, layout=gl.SliceLayout(1, io_layout))
        io_cols = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, io_layout)), 0)
        row_tokens = io_rows // GP
        row_heads = head_group * GP + io_rows % GP
        q_off = row_tokens * stride_qt + row_heads * stride_qh  # per row (few registers)
        o_off = row_tokens * stride_ot + row_heads * stride_oh
        key_rows = gl.arange(0, 16, layout=gl.SliceLayout(1, io_layout))
        k_off = key_rows * stride_kt
        v_off = key_rows * stride_vt
        q_seq = Q + seq_start64 * stride_qt
        o_seq = O + seq_start64 * stride_ot
        k_seq = K + seq_start64 * stride_kt + kv_head * stride_kh
        v_seq = V + seq_start64 * stride_vt + kv_head * stride_vh

        q_ring = gl.allocate_shared_memory(dtype, [2, M, D], smem_layout)
        ring_k = gl.allocate_shared_memory(dtype, [NS + MIRROR, 16, D], smem_layout)
        ring_v = gl.allocate_shared_memory(dtype, [NS + MIRROR, 16, D], smem_layout)

        # Slots of blocks before the sequence's start or past its end are never loaded; they must
        # hold zeros (finite values) since their probabilities (0) still multiply them.
        zeros_block = gl.zeros([16, D], dtype, io_layout)
        for s in range(NS + MIRROR):
            ring_k.index(s).store(zeros_block)
            ring_v.index(s).store(zeros_block)
        # B operand of the row-sum wgmma: a column block of ones, as tall as the widest piece.
        ones = gl.allocate_shared_memory(
            dtype, [MID_A * 16, 8],
            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2))
        ones.store(gl.full([MID_A * 16, 8], 1.0, dtype,
                           gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32, 1],
                                            warps_per_cta=[4, 1], order=[1, 0])))
        fence_async_shared()
        gl.thread_barrier()

        # Band of tile t: blocks b0(t) … b0(t) + NB - 1, b0(t) = floor((t*T - wq) / 16) (the
        # offset makes the dividend non-negative: integer division truncates). Bands only move
        # forward, so after tile t's prefetch the ring holds blocks max(kb0, 0) … b0(t + 1) + NB - 1.
        kb0 = (t_begin * T - window_q + band_offset) // 16 - band_offset // 16
        first_kb = gl.maximum(kb0, 0)
        if t_begin < t_end:
            _issue_queries(q_ring.index(0), q_seq, stride_qt, q_off, row_tokens, t_begin, seq_len, T)
            for kb in range(first_kb, gl.minimum(kb0 + NB, nblocks)):
                _issue_block(ring_k, ring_v, k_seq, v_seq, stride_kt, stride_vt, k_off, v_off,
                             key_rows, kb, kb0, seq_len, NS, MIRROR)
        async_copy.commit_group()

        rows = gl.arange(0, M, layout=row_layout)
        heads = head_group * GP + rows % GP
        if SINK_MODE != 0:
            sink_raw = gl.load(Sinks + heads * stride_sink).to(gl.float32) * inv_scale
        else:
            sink_raw = gl.zeros([M], gl.float32, row_layout)
        if SINK_MODE == 1:
            m_floor = sink_raw
        else:
            m_floor = gl.full([M], -1.0e30, gl.float32, row_layout)

        for t in range(t_begin, t_end):
            it = t - t_begin
            # Tile t's queries and blocks were issued one tile ahead. One CTA barrier per tile: every
            # warp's copies have landed, and every warp is done with tile t - 1, whose slots the
            # prefetch below may overwrite (each warp's wgmma reads all of a key block).
            async_copy.wait_group(0)
            fence_async_shared()
            gl.thread_barrier()
            b0 = (t * T - window_q + band_offset) // 16 - band_offset // 16
            if t + 1 < t_end:
                _issue_queries(q_ring.index((it + 1) % 2), q_seq, stride_qt, q_off, row_tokens, t + 1,
                               seq_len, T)
                b_next = ((t + 1) * T - window_q + band_offset) // 16 - band_offset // 16
                for kb in range(gl.maximum(b0 + NB, first_kb), gl.minimum(b_next + NB, nblocks)):
                    _issue_block(ring_k, ring_v, k_seq, v_seq, stride_kt, stride_vt, k_off, v_off,
                                 key_rows, kb, kb0, seq_len, NS, MIRROR)
            async_copy.commit_group()

            slot_f = (b0 - kb0) % NS
            slot_a = (b0 + 1 - kb0) % NS
            slot_b = (b0 + 1 + MID_A - kb0) % NS
            slot_c = (b0 + 1 + MID_A + MID_B - kb0) % NS
            slot_l = (b0 + NB - 1 - kb0) % NS
            q_s = q_ring.index(it % 2)
            # Scores of the band in pieces of power-of-two widths (Gluon's shapes must be): the
            # first block, the middle blocks as MID_A (+ MID_B + MID_C) blocks, the last block.
            s_f = _qk(q_s, ring_k, slot_f, M, 16, smem_layout)
            s_a = _qk(q_s, ring_k, slot_a, M, MID_A * 16, smem_layout)
            if MID_B > 0:
                s_b = _qk(q_s, ring_k, slot_b, M, MID_B * 16, smem_layout)
            if MID_C > 0:
                s_c = _qk(q_s, ring_k, slot_c, M, MID_C * 16, smem_layout)
            s_l = _qk(q_s, ring_k, slot_l, M, 16, smem_layout)
            s_f, s_a, s_l = warpgroup_mma_wait(0, deps=(s_f, s_a, s_l))
            if MID_B > 0:
                s_b = warpgroup_mma_wait(0, deps=(s_b, ))
            if MID_C > 0:
                s_c = warpgroup_mma_wait(0, deps=(s_c, ))

            pos = t * T + rows // GP
            row_lo = gl.maximum(pos - window_q, 0)
            if IS_CAUSAL:
                row_hi = pos
                if HAS_WK:
                    row_hi = gl.minimum(row_hi, pos + window_k)
            else:
                row_hi = pos + window_k
            row_hi = gl.minimum(row_hi, seq_len - 1)
            key_f = b0 * 16
            key_a = key_f + 16
            key_b = key_a + MID_A * 16
            key_c = key_b + MID_B * 16
            key_l = key_f + (NB - 1) * 16
            if (t * T - window_q <= 0) | ((b0 + NB) * 16 > seq_len):
                # Edge tile (key 0 in reach, or keys past the end): mask every piece, key-0 bias.
                s_f = _mask_piece(s_f, key_f, row_lo, row_hi, sink_raw, SINK_MODE == 2)
                s_a = _mask_piece(s_a, key_a, row_lo, row_hi, sink_raw, SINK_MODE == 2)
                if MID_B > 0:
                    s_b = _mask_piece(s_b, key_b, row_lo, row_hi, sink_raw, SINK_MODE == 2)
                if MID_C > 0:
                    s_c = _mask_piece(s_c, key_c, row_lo, row_hi, sink_raw, SINK_MODE == 2)
                s_l = _mask_piece(s_l, key_l, row_lo, row_hi, sink_raw, SINK_MODE == 2)
            else:  # interior tile: walk_geometry proved the middle fully visible
                s_f = _mask_below(s_f, key_f, row_lo)
                s_l = _mask_above(s_l, key_l, row_hi)

            m = gl.maximum(gl.maximum(_row_max(s_f, row_layout), _row_max(s_a, row_layout)),
                           _row_max(s_l, row_layout))
            if MID_B > 0:
                m = gl.maximum(m, _row_max(s_b, row_layout))
            if MID_C > 0:
                m = gl.maximum(m, _row_max(s_c, row_layout))
            m = gl.maximum(m, m_floor)
            mc = m * qk_scale
            p_f = gl.exp2(s_f * qk_scale - _row(mc, s_f))
            p_a = gl.exp2(s_a * qk_scale - _row(mc, s_a))
            p_l = gl.exp2(s_l * qk_scale - _row(mc, s_l))
            acc, l_acc = _pv(p_f, ring_v, slot_f, 16, D, gl.zeros([M, D], gl.float32, o_layout),
                             gl.zeros([M, 8], gl.float32, l_layout), ones, False, p_layout, l_layout,
                             smem_layout)
            acc, l_acc = _pv(p_a, ring_v, slot_a, MID_A * 16, D, acc, l_acc, ones, True, p_layout,
                             l_layout, smem_layout)
            if MID_B > 0:
                p_b = gl.exp2(s_b * qk_scale - _row(mc, s_b))
                acc, l_acc = _pv(p_b, ring_v, slot_b, MID_B * 16, D, acc, l_acc, ones, True,
                                 p_layout, l_layout, smem_layout)
            if MID_C > 0:
                p_c = gl.exp2(s_c * qk_scale - _row(mc, s_c))
                acc, l_acc = _pv(p_c, ring_v, slot_c, MID_C * 16, D, acc, l_acc, ones, True,
                                 p_layout, l_layout, smem_layout)
            acc, l_acc = _pv(p_l, ring_v, slot_l, 16, D, acc, l_acc, ones, True, p_layout, l_layout,
                             smem_layout)
            acc, l_acc = warpgroup_mma_wait(0, deps=(acc, l_acc))
            # Every column of l_acc holds the row sum.
            l = gl.convert_layout(gl.max(l_acc, 1), row_layout, assert_trivial=True)
            if SINK_MODE == 1:
                l += gl.exp2(sink_raw * qk_scale - mc)

            inv_l = gl.convert_layout(1.0 / l, gl.SliceLayout(1, o_layout), assert_trivial=True)
            # The output goes out through this tile's query buffer (its wgmma is done): each warp
            # writes the rows its own wgmma read, then reads back rows for 16-byte stores.
            q_s.store((acc * gl.expand_dims(inv_l, 1)).to(dtype))
            gl.thread_barrier()
            out = q_s.load(io_layout)
            o_ptr = o_seq + (t * T).to(gl.int64) * stride_ot + (gl.expand_dims(o_off, 1) + io_cols)
            gl.store(o_ptr, out, mask=gl.expand_dims(t * T + row_tokens < seq_len, 1))
        async_copy.wait_group(0)


# ---- launcher ------------------------------------------------------------------------------------

def split_middle(blocks: int):
    """The middle of a band as at most three power-of-two pieces, largest first (Gluon tensors and
    shared-memory views must have power-of-two shapes), or None."""
    pieces = [1 << b for b in range(blocks.bit_length() - 1, -1, -1) if blocks >> b & 1]
    if not pieces or len(pieces) > 3:
        return None
    return tuple(pieces + [0] * (3 - len(pieces)))


_UNAVAILABLE: dict = {}


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def walk_unavailable(device: torch.device) -> str | None:
    """Why the Gluon kernel cannot run on ``device`` (None when it can)."""
    if GLUON_IMPORT_ERROR is not None:
        return f"triton.experimental.gluon unavailable ({GLUON_IMPORT_ERROR})"
    if not triton.__version__.startswith(TESTED_TRITON):
        return (f"Triton {triton.__version__}: the Gluon kernel is written for Triton "
                f"{', '.join(v + 'x' for v in TESTED_TRITON)}")
    if os.environ.get(ENV_DISABLE, "1") == "0":
        return f"{ENV_DISABLE}=0"
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "the Triton interpreter cannot run Gluon kernels"
    if device.type != "cuda":
        return f"tensors on {device.type}, not a CUDA GPU"
    index = _device_index(device)
    if index not in _UNAVAILABLE:
        major, minor = torch.cuda.get_device_capability(index)
        _UNAVAILABLE[index] = (None if major == 9 else
                               f"compute capability {major}.{minor}: wgmma needs sm_90 (Hopper)")
    return _UNAVAILABLE[index]


# Programs resident per SM: 69.6 KB of shared memory each (Triton 3.6), and registers capped at 168
# so that three programs' 12 warps fit the register file (ptxas: no spill at 168).
_PROGRAMS_PER_SM = 3
_MAX_REGISTERS = 168
_SM_COUNT: dict = {}


def _sm_count(device: torch.device) -> int:
    index = _device_index(device)
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


@dataclasses.dataclass(frozen=True)
class WalkLaunch:
    """A validated problem bound to the Gluon kernel (``plan`` says whether it fits)."""

    tokens_per_tile: int
    num_seqs: int
    tokens: int
    head_groups: int
    sm_count: int
    scalars: tuple  # tokens, qk_scale, inv_scale, window_q, window_k, band_offset
    strides: tuple
    constexprs: dict
    variant: tuple  # the compiled kernel this launch needs: its constexprs and dtype
    # grid and scalar arguments by length bound: the launch is CPU-bound for one MiMo image, so
    # nothing is recomputed per call (a ViT passes the same bound in every layer)
    _by_bound: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def plan(cls, p, q, k, v, o, b_start_loc, b_seq_len, sinks):
        """A launch when the call fits the kernel, else None (the caller uses the Triton kernel)."""
        if walk_unavailable(q.device) is not None:
            return None
        if p.dtype not in (torch.float16, torch.bfloat16) or o.dtype != p.dtype:
            return None
        if p.head_dim != HEAD_DIM or p.tokens == 0 or p.num_seqs == 0 or p.num_seqs > 65535:
            return None
        gp = min(p.queries_per_kv & -p.queries_per_kv, ROWS)
        if gp < ROWS // BLOCK_KEYS:
            return None
        geometry = walk_geometry(ROWS // gp, p.window_q, p.window_k, p.is_causal)
        if geometry is None:
            return None
        mids = split_middle(geometry.nb - 2)
        if mids is None:
            return None
        band_offset = BLOCK_KEYS * -(-p.window_q // BLOCK_KEYS)
        scalars = (p.tokens, p.log2_scale, 1.0 / p.scale, p.window_q, p.window_k, band_offset)
        strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                   o.stride(0), o.stride(1), sinks.stride(0) if sinks is not None else 0,
                   b_start_loc.stride(0), b_seq_len.stride(0))
        constexprs = dict(T=geometry.tokens_per_tile, GP=gp, QUERIES_PER_KV=p.queries_per_kv,
                          MID_A=mids[0], MID_B=mids[1], MID_C=mids[2], IS_CAUSAL=p.is_causal,
                          HAS_WK=p.window_k > 0, SINK_MODE=p.sink_mode, num_warps=4,
                          maxnreg=_MAX_REGISTERS)
        return cls(geometry.tokens_per_tile, p.num_seqs, p.tokens, p.q_heads // gp,
                   _sm_count(q.device), scalars, strides, constexprs,
                   tuple(sorted(constexprs.items())) + (p.dtype, ))

    def chunking(self, max_len_hint: int, chunk: int | None = None):
        """(tiles per program, programs per sequence and head group) for a length bound: by
        default one wave of programs over the bound's tiles, at least 4 tiles each."""
        tiles = triton.cdiv(min(max(max_len_hint, 1), self.tokens), self.tokens_per_tile)
        if chunk is None:
            resident = self.sm_count * _PROGRAMS_PER_SM
            per_seq = max(1, resident // (self.head_groups * self.num_seqs))
            chunk = max(4, triton.cdiv(tiles, per_seq))
        return chunk, triton.cdiv(tiles, chunk)

    def __call__(self, q, k, v, o, b_start_loc, b_seq_len, sinks, max_len_hint: int,
                 chunk: int | None = None) -> bool:
        """Launch; False (nothing launched, nothing written) when this kernel variant failed to
        compile, which is then reported once and never tried again: the caller falls back."""
        key = self.variant
        if key in _FAILED_VARIANTS:
            return False
        bound = self._by_bound.get((max_len_hint, chunk))
        if bound is None:
            chunk_tiles, num_chunks = self.chunking(max_len_hint, chunk)
            bound = ((self.head_groups, num_chunks, self.num_seqs),
                     (*self.scalars, chunk_tiles, num_chunks, *self.strides))
            if len(self._by_bound) >= 64:
                self._by_bound.clear()
            self._by_bound[(max_len_hint, chunk)] = bound
        grid, tail = bound
        args = (q, k, v, o, sinks if sinks is not None else q, b_start_loc, b_seq_len, *tail)
        try:  # the first launch of a variant compiles it
            _window_walk_kernel[grid](*args, **self.constexprs)
        except Exception as e:  # noqa: BLE001 - an experimental compiler: fall back, say why
            if key in _COMPILED_VARIANTS:
                raise  # it compiled before: a real launch error, not the compiler's
            _FAILED_VARIANTS.add(key)
            warnings.warn(f"vllm-sinks: the Hopper window kernel failed to compile "
                          f"({type(e).__name__}: {str(e)[:300]}); using the Triton kernel for this "
                          "shape", stacklevel=2)
            return False
        _COMPILED_VARIANTS.add(key)
        return True


_COMPILED_VARIANTS: set = set()
_FAILED_VARIANTS: set = set()
