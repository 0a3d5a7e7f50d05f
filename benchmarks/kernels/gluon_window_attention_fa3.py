"""Hopper window kernel with FlashAttention-3's structure (experimental; issue 19, item 4).

Same semantics and interface as ``gluon_window_attention`` (the committed walk: banded window, the
null-logit and key-0 sinks, GQA, ragged varlen batches, fp16/bf16, head dim 64), and the same
per-tile math, whose jitted pieces it calls (band scores, masks, max, P · V). What differs is who
moves the data and how the warps are organised, FlashAttention-3's way:

- **a producer warp** loads the queries and the band's key/value blocks with TMA (host-built
  tensor descriptors, ``tma`` async copies) into shared memory, one ``mbarrier`` per ring slot to
  say "landed" (transaction bytes) and one to say "free again": no CTA barrier, no cp.async
  address arithmetic and no proxy fence in the consumers;
- **NC consumer warpgroups** (2 by default) take a program's tiles round robin, each with its own
  query buffers, and share one ring of key/value blocks; their registers are raised and the
  producer's lowered with ``gl.warp_specialize(..., worker_num_warps, worker_num_regs)``, which
  lowers to ``setmaxnreg``;
- ``PINGPONG`` (a constexpr, off by default): the consumers take turns through the softmax (an
  mbarrier token passed round), so one warpgroup's exponentials overlap the other's wgmmas, as
  FlashAttention-3 schedules them;
- ``OVERLAP`` (a constexpr, off by default; 2 consumers only: with 3 the second band of scores
  spills): FlashAttention-3's overlap inside a warpgroup. Each consumer issues its next tile's
  Q · Kᵀ (queries read from shared memory) before this tile's mask, max and P · V, and waits only
  for this tile's wgmma groups, so the tensor cores compute the next scores while the softmax
  runs. Tiles go in pairs (two sets of score registers, none copied round the loop; an odd count's
  last tile is not overlapped), or with ``OVERLAP_TILES`` one by one (the set carried round the
  loop is copied each tile). The first tile's Q · Kᵀ is not overlapped.

Ring protocol. Block ``kb`` of the sequence lives in slot ``kb % NS``; a program loads the blocks
``first_kb …`` in order, so the n-th load of a slot is ``(kb - first_kb) // NS`` and its parity is
what every wait checks. A block is free once every consumer has said it will not read it again:
each consumer, after a tile's P · V, releases the blocks before its next tile's band (from
``first_kb`` on, so blocks it never needed count too), exactly once each; the "free" barrier
counts NC arrivals. A slot cannot be reloaded before its block's release, nor released twice in
one load, so no wait can skip a phase.

Keys and values are read through a descriptor over the whole [tokens, KV heads, 64] tensor: rows of
a band past its sequence's end are the next sequence's rows (finite; their scores are masked, their
probabilities 0) or, past the tensor, zeros (TMA's out-of-bounds fill). Output rows are stored with
masked stores (a TMA store would write past a sequence's end).

Needs 16-byte-aligned strides and base pointers (TMA); ``plan`` declines other calls, and 16-token
tiles (``gp`` 4: a band gains exactly one block per tile).

Status (docs/notes/prefill-kernel-log.md, runs 14, 15, 17): compiles for sm_90a under Triton 3.7.1,
3.8.0 and 3.9.0; timed in run 15 (slower than the walk; OVERLAP not yet timed), not wired into
the op (``triton_prefill_attention``): it replaces the walk only once it beats it on MiMo's and
GPT-OSS's shapes in one run (``compare_fa3_walk.py``).
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from vllm_sinks.v1.attention.ops import gluon_window_attention as walk
from vllm_sinks.v1.attention.ops.prefill_attention_problem import (
    BLOCK_KEYS,
    BLOCK_KEYS_C,
    KEY0_BIAS_C,
    MAX_GRID_YZ,
    NONE_C,
    NULL_LOGIT_C,
    Problem,
    launch_options,
    load_sequence,
)

from vllm_sinks.v1.attention.ops.gluon_api import TMA_IMPORT_ERROR as GLUON_IMPORT_ERROR
from vllm_sinks.v1.attention.ops.gluon_api import (TensorDescriptor, cta_barrier,
                                                   fence_async_shared, gl, gluon, mbarrier,
                                                   reinterpret, tma_load, warpgroup_mma_wait)

if GLUON_IMPORT_ERROR is not None:
    gluon = None
else:  # the committed walk's per-tile pieces
    from vllm_sinks.v1.attention.ops.gluon_window_attention import (
        _band_max,
        _band_pv,
        _band_scores,
        _band_start,
        _finish_scores,
        _mask_band,
        _tile_rows,
    )

ROWS = walk.ROWS
HEAD_DIM = walk.HEAD_DIM
#: Consumer warpgroups per program, and registers per thread of each partition (setmaxnreg): with
#: two consumers, 12 warps (the producer's warp rounds up to a warpgroup) at 168 = one program per
#: SM, 240 for each consumer and 24 for the producer.
CONSUMERS = 2
_PARTITION_REGS = {2: (168, 240, 24), 3: (128, 160, 24)}
#: Ring slots beyond the committed walk's NB + 3 (even: the ring's size stays even, so slot pairs
#: start at even slots): how much further ahead the producer may load. One program per SM has
#: shared memory to spare.
EXTRA_SLOTS = 4
#: Consumer counts the OVERLAP variants compile for (two bands of scores per warpgroup: with three
#: consumers at 160 registers they spill, run 17).
OVERLAP_CONSUMERS = (2, )
#: OVERLAP's values (a constexpr): off, a loop of single tiles, a loop of tile pairs. ``plan`` takes
#: ``overlap=True`` (pairs) or ``"tiles"``.
OVERLAP_OFF, OVERLAP_TILES, OVERLAP_PAIRS = 0, 1, 2
OVERLAP_MODES = {False: OVERLAP_OFF, "tiles": OVERLAP_TILES, True: OVERLAP_PAIRS,
                 "pairs": OVERLAP_PAIRS}
OVERLAP_TILES_C = triton.language.constexpr(OVERLAP_TILES)
OVERLAP_PAIRS_C = triton.language.constexpr(OVERLAP_PAIRS)


if gluon is not None:

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_bufs, ring_k, ring_v, q_ready, q_free, kv_ready,
                  kv_free, seq_row, seq_len, q_col, kv_head, t_begin, t_end, window_q,
                  band_offset, T: gl.constexpr, NB: gl.constexpr, NS: gl.constexpr,
                  NC: gl.constexpr):
        """One warp: for each tile of the program, in order, the key/value blocks its band gains
        (each once its slot's previous block is released) and its queries (once the consumer's
        buffer is free), by TMA."""
        nblocks = (seq_len + BLOCK_KEYS_C - 1) // BLOCK_KEYS_C
        first_kb = gl.maximum(_band_start(t_begin, T, window_q, band_offset), 0)
        kv_bytes: gl.constexpr = 2 * k_desc.block_type.nbytes
        q_bytes: gl.constexpr = q_desc.block_type.nbytes
        for t in range(t_begin, t_end):
            hi = gl.minimum(_band_start(t, T, window_q, band_offset) + NB, nblocks)
            # Blocks from where the previous tile's loads stopped (bands only move forward). Not
            # carried through the loop: Triton 3.7 drops a loop-carried scalar whose only use is
            # an inner range() bound (kernel log, run 14).
            lo = first_kb
            if t > t_begin:
                lo = gl.maximum(first_kb, gl.minimum(
                    _band_start(t - 1, T, window_q, band_offset) + NB, nblocks))
            for kb in range(lo, hi):
                slot = kb % NS
                n = (kb - first_kb) // NS
                # A fresh barrier passes parity 1: the first load of a slot does not wait.
                mbarrier.wait(kv_free.index(slot), (n & 1) ^ 1)
                bar = kv_ready.index(slot)
                mbarrier.expect(bar, kv_bytes)
                tma_load(k_desc, [seq_row + kb * BLOCK_KEYS_C, kv_head, 0], bar,
                          ring_k.index(slot))
                tma_load(v_desc, [seq_row + kb * BLOCK_KEYS_C, kv_head, 0], bar,
                          ring_v.index(slot))
            it = t - t_begin
            i = it // NC
            qi = (it % NC) * 2 + i % 2
            mbarrier.wait(q_free.index(qi), ((i // 2) & 1) ^ 1)
            mbarrier.expect(q_ready.index(qi), q_bytes)
            tma_load(q_desc, [seq_row + t * T, q_col, 0], q_ready.index(qi), q_bufs.index(qi))

    @gluon.jit
    def _tile_output(scores, C: gl.constexpr, i, t, b0, s0, odd, buffers, scalars, rows, sink_raw,
                     m_floor, nblocks, first_kb, o_seq, o_off, io_cols, row_tokens,
                     T: gl.constexpr, GP: gl.constexpr, NB: gl.constexpr, NS: gl.constexpr,
                     NC: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_WK: gl.constexpr,
                     SINK_MODE: gl.constexpr, PINGPONG: gl.constexpr):
        """Tile ``t`` (this warpgroup's ``i``-th) from its band's scores on: the committed walk's
        mask, max and P · V, the release of the blocks before the warpgroup's next band, the
        normalisation and the store."""
        q_bufs, ring_k, ring_v, ones, q_ready, q_free, kv_ready, kv_free, turn = buffers
        (O, Sinks, seq_start64, seq_len, head_group, t_begin, t_end, qk_scale, inv_scale,
         window_q, window_k, band_offset, stride_ot, stride_oh, stride_sink) = scalars
        D: gl.constexpr = 64
        M: gl.constexpr = T * GP
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 16])
        l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 8, 16])
        io_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                                   warps_per_cta=[4, 1], order=[1, 0])
        row_layout: gl.constexpr = rows.type.layout
        if PINGPONG:
            # Consumer 0 takes the first turn without waiting; from then on its turn comes
            # from consumer NC - 1 of the round before.
            if C == 0:
                mbarrier.wait(turn.index(0), (i - 1) & 1, pred=i > 0)
            else:
                mbarrier.wait(turn.index(C), i & 1)
        row_lo, row_hi, edge = _tile_rows(t, b0, rows, window_q, window_k, seq_len, T, GP, NB,
                                          IS_CAUSAL, HAS_WK)
        scores = _mask_band(scores, b0 * BLOCK_KEYS_C, odd, row_lo, row_hi, sink_raw, edge,
                            NB, SINK_MODE == KEY0_BIAS_C, -1)
        m = _band_max(scores, m_floor, NB, row_layout)
        mc = m * qk_scale
        acc, l_acc = _band_pv(scores, mc, qk_scale, ring_v, ones, s0, odd, M, D, NB, NS,
                              o_layout, l_layout)
        if PINGPONG:
            # The next consumer's turn starts once this one's exponentials are issued. Round
            # robin gives consumer C - 1 at least as many tiles as C, and consumer NC - 1 at
            # least one fewer than 0 (whose first turn is not waited for): every turn
            # waited for comes, each barrier's phases complete in order, none is skipped.
            mbarrier.arrive(turn.index((C + 1) % NC), count=1)
        # Blocks before this warpgroup's next band are done with (its wgmmas have completed),
        # from where its previous tile's release stopped (from first_kb on its first tile).
        rel_lo = first_kb
        if i > 0:
            rel_lo = gl.maximum(first_kb, gl.minimum(b0, nblocks))
        rel_hi = gl.minimum(_band_start(t + NC, T, window_q, band_offset), nblocks)
        for kb in range(rel_lo, rel_hi):
            mbarrier.arrive(kv_free.index(kb % NS), count=1)
        l = gl.convert_layout(gl.max(l_acc, 1), row_layout, assert_trivial=True)
        if SINK_MODE == NULL_LOGIT_C:
            l += gl.exp2(sink_raw * qk_scale - mc)
        r = gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [l],
                                      dtype=gl.float32, is_pure=True, pack=1)
        inv_l = gl.convert_layout(r, gl.SliceLayout(1, o_layout), assert_trivial=True)
        out = gl.convert_layout((acc * gl.expand_dims(inv_l, 1)).to(O.dtype.element_ty),
                                io_layout)
        o_ptr = o_seq + (t * T).to(gl.int64) * stride_ot + (gl.expand_dims(o_off, 1) + io_cols)
        gl.store(o_ptr, out, mask=gl.expand_dims(t * T + row_tokens < seq_len, 1))

    @gluon.jit
    def _consumer(C: gl.constexpr, buffers, scalars, T: gl.constexpr, GP: gl.constexpr,
                  NB: gl.constexpr, NS: gl.constexpr, NC: gl.constexpr, IS_CAUSAL: gl.constexpr,
                  HAS_WK: gl.constexpr, SINK_MODE: gl.constexpr, PINGPONG: gl.constexpr,
                  OVERLAP: gl.constexpr):
        """One warpgroup: tiles ``t_begin + C``, ``+ NC``, … of the program, each the committed
        walk's exact band softmax. ``buffers`` and ``scalars``: the kernel's shared memory and
        the program's runtime values, as the kernel packs them (one tuple each, so that every
        partition's argument list stays short; constexprs stay separate literals).

        OVERLAP (FlashAttention-3's intra-warpgroup overlap): tile i's Q · Kᵀ was issued in the
        iteration before; iteration i waits for tile i + 1's blocks and queries, issues its
        Q · Kᵀ, waits for tile i's scores only (its groups stay in flight), and runs tile i's
        softmax and P · V while the tensor cores compute tile i + 1's scores."""
        q_bufs, ring_k, ring_v, ones, q_ready, q_free, kv_ready, kv_free, turn = buffers
        (O, Sinks, seq_start64, seq_len, head_group, t_begin, t_end, qk_scale, inv_scale,
         window_q, window_k, band_offset, stride_ot, stride_oh, stride_sink) = scalars
        D: gl.constexpr = 64
        M: gl.constexpr = T * GP
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 16, 16])
        io_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                                   warps_per_cta=[4, 1], order=[1, 0])
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

        nblocks = (seq_len + BLOCK_KEYS_C - 1) // BLOCK_KEYS_C
        first_kb = gl.maximum(_band_start(t_begin, T, window_q, band_offset), 0)

        rows = gl.arange(0, M, layout=row_layout)
        heads = head_group * GP + rows % GP
        if SINK_MODE == NONE_C:
            sink_raw = gl.zeros([M], gl.float32, row_layout)
        else:
            sink_raw = gl.load(Sinks + heads * stride_sink).to(gl.float32) * inv_scale
        if SINK_MODE == NULL_LOGIT_C:
            m_floor = sink_raw
        else:
            m_floor = gl.full([M], -1.0e30, gl.float32, row_layout)

        io_rows = gl.arange(0, M, layout=gl.SliceLayout(1, io_layout))
        io_cols = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, io_layout)), 0)
        row_tokens = io_rows // GP
        o_off = row_tokens * stride_ot + (head_group * GP + io_rows % GP) * stride_oh
        o_seq = O + seq_start64 * stride_ot

        n_tiles = (t_end - t_begin - C + NC - 1) // NC
        if OVERLAP:
            gl.static_assert(NC == 2, "OVERLAP: two consumer warpgroups (three spill, run 17)")
            # OVERLAP_PAIRS: tiles in pairs, the loop unrolled by two: tile 2j's scores in one
            # set of registers, tile 2j + 1's in another, so the set carried round the loop is
            # the one the second half's wgmmas wrote. OVERLAP_TILES: one tile per iteration;
            # the set carried is copied at the back edge (72 moves per tile, run 17).
            n_pairs = n_tiles // 2
            if OVERLAP == OVERLAP_PAIRS_C:
                n_overlapped = 2 * n_pairs
            else:
                n_overlapped = n_tiles
            # Prologue: tile 0's band, waited for at once. In flight into the loop, ptxas
            # serialises every wgmma of the kernel (C7514: it does not follow groups that cross
            # the loop's entry), so the first tile's Q · Kᵀ is not overlapped. A warpgroup
            # with no tile to overlap waits for no barrier and issues it anyway over whatever
            # its buffers hold (no branch around a wgmma, DEVELOPERS.md run 13); the results
            # are dropped.
            t = t_begin + C
            b0 = _band_start(t, T, window_q, band_offset)
            hi = gl.minimum(b0 + NB, nblocks)
            if n_overlapped <= 0:
                hi = first_kb
            for kb in range(first_kb, hi):
                mbarrier.wait(kv_ready.index(kb % NS), ((kb - first_kb) // NS) & 1)
            mbarrier.wait(q_ready.index(C * 2), 0, pred=n_overlapped > 0)
            s0 = (b0 + NS) % NS
            pending = _band_scores(q_bufs.index(C * 2), ring_k, s0, s0 % 2, M, NB, NS, s_layout,
                                   True)
            pending = warpgroup_mma_wait(0, deps=pending)
            if OVERLAP == OVERLAP_PAIRS_C:
                for j in range(0, n_pairs):
                    odd_scores = _overlap_tile(pending, 2 * j, True, C, buffers, scalars, rows,
                                               sink_raw, m_floor, nblocks, first_kb, o_seq,
                                               o_off, io_cols, row_tokens, T, GP, NB, NS, NC,
                                               IS_CAUSAL, HAS_WK, SINK_MODE, PINGPONG)
                    pending = _overlap_tile(odd_scores, 2 * j + 1, j + 1 < n_pairs, C, buffers,
                                            scalars, rows, sink_raw, m_floor, nblocks, first_kb,
                                            o_seq, o_off, io_cols, row_tokens, T, GP, NB, NS, NC,
                                            IS_CAUSAL, HAS_WK, SINK_MODE, PINGPONG)
                # An odd count's last tile, not overlapped (a Q · Kᵀ issued for it in the loop
                # would be in flight across the loop's exit: see the prologue).
                if n_tiles % 2 == 1:
                    _plain_tile(n_tiles - 1, C, buffers, scalars, rows, sink_raw, m_floor,
                                nblocks, first_kb, o_seq, o_off, io_cols, row_tokens, T, GP, NB,
                                NS, NC, IS_CAUSAL, HAS_WK, SINK_MODE, PINGPONG)
            else:
                gl.static_assert(OVERLAP == OVERLAP_TILES_C, "OVERLAP: 0, 1 (tiles), 2 (pairs)")
                for i in range(0, n_tiles):
                    pending = _overlap_tile(pending, i, i + 1 < n_tiles, C, buffers, scalars,
                                            rows, sink_raw, m_floor, nblocks, first_kb, o_seq,
                                            o_off, io_cols, row_tokens, T, GP, NB, NS, NC,
                                            IS_CAUSAL, HAS_WK, SINK_MODE, PINGPONG)
        else:
            for i in range(0, n_tiles):
                _plain_tile(i, C, buffers, scalars, rows, sink_raw, m_floor, nblocks, first_kb,
                            o_seq, o_off, io_cols, row_tokens, T, GP, NB, NS, NC, IS_CAUSAL,
                            HAS_WK, SINK_MODE, PINGPONG)

    @gluon.jit
    def _plain_tile(i, C: gl.constexpr, buffers, scalars, rows, sink_raw, m_floor, nblocks,
                    first_kb, o_seq, o_off, io_cols, row_tokens, T: gl.constexpr,
                    GP: gl.constexpr, NB: gl.constexpr, NS: gl.constexpr, NC: gl.constexpr,
                    IS_CAUSAL: gl.constexpr, HAS_WK: gl.constexpr, SINK_MODE: gl.constexpr,
                    PINGPONG: gl.constexpr):
        """This warpgroup's ``i``-th tile, start to end: wait for its blocks and queries, Q · Kᵀ,
        wait for it, free the queries, the rest (``_tile_output``)."""
        q_bufs, ring_k, ring_v, ones, q_ready, q_free, kv_ready, kv_free, turn = buffers
        (O, Sinks, seq_start64, seq_len, head_group, t_begin, t_end, qk_scale, inv_scale,
         window_q, window_k, band_offset, stride_ot, stride_oh, stride_sink) = scalars
        M: gl.constexpr = T * GP
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 16, 16])
        t = t_begin + C + i * NC
        qi = C * 2 + i % 2
        b0 = _band_start(t, T, window_q, band_offset)
        hi = gl.minimum(b0 + NB, nblocks)
        # The blocks this warpgroup has not waited for: from where its previous tile's band
        # ended (not carried through the loop: see _producer).
        lo = first_kb
        if i > 0:
            lo = gl.maximum(first_kb, gl.minimum(
                _band_start(t - NC, T, window_q, band_offset) + NB, nblocks))
        for kb in range(lo, hi):
            mbarrier.wait(kv_ready.index(kb % NS), ((kb - first_kb) // NS) & 1)
        mbarrier.wait(q_ready.index(qi), (i // 2) & 1)
        s0 = (b0 + NS) % NS
        odd = s0 % 2
        pending = _band_scores(q_bufs.index(qi), ring_k, s0, odd, M, NB, NS, s_layout)
        scores = _finish_scores(pending, NB, s_layout)
        # The QK wgmmas read every warp's Q registers: the buffer is free. The fence orders
        # this warpgroup's reads of it (ldmatrix, generic proxy) before the producer's next
        # TMA write (async proxy).
        fence_async_shared()
        mbarrier.arrive(q_free.index(qi), count=1)
        _tile_output(scores, C, i, t, b0, s0, odd, buffers, scalars, rows, sink_raw, m_floor,
                     nblocks, first_kb, o_seq, o_off, io_cols, row_tokens, T, GP, NB, NS, NC,
                     IS_CAUSAL, HAS_WK, SINK_MODE, PINGPONG)

    @gluon.jit
    def _overlap_tile(pending, i, has_next, C: gl.constexpr, buffers, scalars, rows, sink_raw,
                      m_floor, nblocks, first_kb, o_seq, o_off, io_cols, row_tokens,
                      T: gl.constexpr, GP: gl.constexpr, NB: gl.constexpr, NS: gl.constexpr,
                      NC: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_WK: gl.constexpr,
                      SINK_MODE: gl.constexpr, PINGPONG: gl.constexpr):
        """This warpgroup's ``i``-th tile, whose Q · Kᵀ (``pending``) was issued before: wait for
        the next tile's blocks and queries and issue its Q · Kᵀ (``has_next``; else this tile's
        band again, over its own query buffer and blocks, which nothing else writes yet: the
        results are dropped), wait for this tile's groups only, free its queries, the rest
        (``_tile_output``). Returns the next tile's pending scores."""
        q_bufs, ring_k, ring_v, ones, q_ready, q_free, kv_ready, kv_free, turn = buffers
        (O, Sinks, seq_start64, seq_len, head_group, t_begin, t_end, qk_scale, inv_scale,
         window_q, window_k, band_offset, stride_ot, stride_oh, stride_sink) = scalars
        M: gl.constexpr = T * GP
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 16, 16])
        # Groups _band_scores commits (one per wgmma): the next tile's, left in flight.
        GROUPS: gl.constexpr = NB // 2 + 1
        t = t_begin + C + i * NC
        qi = C * 2 + i % 2
        b0 = _band_start(t, T, window_q, band_offset)
        s0 = (b0 + NS) % NS
        odd = s0 % 2
        # The next tile's blocks: from where this tile's band ends (computed from the tile
        # index, not carried: see _producer). Its Q · Kᵀ reads only blocks from its own band's
        # start on, which this warpgroup releases after that tile.
        bn = _band_start(t + NC, T, window_q, band_offset)
        lo_n = gl.maximum(first_kb, gl.minimum(b0 + NB, nblocks))
        hi_n = gl.minimum(bn + NB, nblocks)
        qn = C * 2 + (i + 1) % 2
        sn = (bn + NS) % NS
        if not has_next:
            hi_n = lo_n
            qn = qi
            sn = s0
        for kb in range(lo_n, hi_n):
            mbarrier.wait(kv_ready.index(kb % NS), ((kb - first_kb) // NS) & 1)
        mbarrier.wait(q_ready.index(qn), ((i + 1) // 2) & 1, pred=has_next)
        nxt = _band_scores(q_bufs.index(qn), ring_k, sn, sn % 2, M, NB, NS, s_layout, True)
        # This tile's groups were committed before the next tile's GROUPS: wait for them only.
        # (P · V's wait for all groups, in _band_pv, completes the next tile's too: by then the
        # tensor cores have long computed them. Nothing is in flight when this returns.)
        scores = _finish_scores(pending, NB, s_layout, GROUPS)
        # This tile's Q · Kᵀ has completed: its query buffer is free. (Its wgmmas read it from
        # shared memory through the async proxy, as TMA writes it: no fence, unlike _plain_tile.)
        mbarrier.arrive(q_free.index(qi), count=1)
        _tile_output(scores, C, i, t, b0, s0, odd, buffers, scalars, rows, sink_raw, m_floor,
                     nblocks, first_kb, o_seq, o_off, io_cols, row_tokens, T, GP, NB, NS, NC,
                     IS_CAUSAL, HAS_WK, SINK_MODE, PINGPONG)
        return nxt

    @gluon.jit
    def _consumer_worker(buffers, scalars, C: gl.constexpr, T: gl.constexpr, GP: gl.constexpr,
                         NB: gl.constexpr, NS: gl.constexpr, NC: gl.constexpr,
                         IS_CAUSAL: gl.constexpr, HAS_WK: gl.constexpr, SINK_MODE: gl.constexpr,
                         PINGPONG: gl.constexpr, OVERLAP: gl.constexpr):
        """A worker partition's consumer (workers take no tensors and no leading constexpr)."""
        _consumer(C, buffers, scalars, T, GP, NB, NS, NC, IS_CAUSAL, HAS_WK, SINK_MODE, PINGPONG,
                  OVERLAP)

    @gluon.jit
    def _window_fa3_kernel(
            q_desc, k_desc, v_desc, O, Sinks, StartLoc, SeqLen,
            total_tokens, qk_scale, inv_scale, window_q, window_k, band_offset, chunk, num_chunks,
            stride_ot, stride_oh, stride_sink, stride_start, stride_len,
            T: gl.constexpr, GP: gl.constexpr, QUERIES_PER_KV: gl.constexpr, NB: gl.constexpr,
            NS: gl.constexpr, NC: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_WK: gl.constexpr,
            SINK_MODE: gl.constexpr, PINGPONG: gl.constexpr, OVERLAP: gl.constexpr,
            CONSUMER_REGS: gl.constexpr):
        D: gl.constexpr = 64
        M: gl.constexpr = T * GP
        gl.static_assert(NB % 2 == 1, "walk_geometry gives odd bands only")
        gl.static_assert(NS % 2 == 0, "slot pairs start at even slots")
        dtype: gl.constexpr = q_desc.dtype
        io_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                                   warps_per_cta=[4, 1], order=[1, 0])
        smem2: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                   rank=2)

        head_group = gl.program_id(0)
        chunk_id = gl.program_id(1)
        seq = gl.program_id(2)
        kv_head = head_group * GP // QUERIES_PER_KV
        seq_start64, seq_len = load_sequence(StartLoc, SeqLen, seq, total_tokens, stride_start,
                                             stride_len)
        tiles = (seq_len + T - 1) // T
        t_begin = chunk_id * chunk
        t_end = gl.minimum(t_begin + chunk, tiles)
        if chunk_id == num_chunks - 1:  # a host bound that was too small costs time, never output
            t_end = tiles

        # Shared memory: two query buffers per consumer, the K and V rings (TMA writes them as
        # [16, 1, 64] / [T, GP, 64] boxes: the same bytes as the [16, 64] / [64, 64] tiles the
        # wgmmas read, 128-byte rows under one swizzle), a block of ones (row sums), barriers.
        q_bufs = gl.allocate_shared_memory(dtype, [2 * NC, M, D], smem2)
        ring_k = gl.allocate_shared_memory(dtype, [NS, BLOCK_KEYS_C, D], smem2)
        ring_v = gl.allocate_shared_memory(dtype, [NS, BLOCK_KEYS_C, D], smem2)
        # Slots of blocks before the sequence's start are never loaded; they must hold finite
        # values (zeros) since their probabilities (0) still multiply them.
        zeros_block = gl.zeros([BLOCK_KEYS_C, D], dtype, io_layout)
        for s in gl.static_range(NS):
            ring_k.index(s).store(zeros_block)
            ring_v.index(s).store(zeros_block)
        ones = gl.allocate_shared_memory(
            dtype, [2 * BLOCK_KEYS_C, 8],
            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2))
        ones.store(gl.full([2 * BLOCK_KEYS_C, 8], 1.0, dtype,
                           gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32, 1],
                                            warps_per_cta=[4, 1], order=[1, 0])))
        q_ready = gl.allocate_shared_memory(gl.int64, [2 * NC, 1], mbarrier.MBarrierLayout())
        q_free = gl.allocate_shared_memory(gl.int64, [2 * NC, 1], mbarrier.MBarrierLayout())
        kv_ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        kv_free = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [NC, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2 * NC):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_free.index(i), count=1)
        for i in gl.static_range(NS):
            mbarrier.init(kv_ready.index(i), count=1)
            mbarrier.init(kv_free.index(i), count=NC)
        for i in gl.static_range(NC):
            mbarrier.init(turn.index(i), count=1)
        fence_async_shared()
        cta_barrier()

        # TMA views of the buffers: the boxes the descriptors name.
        q_tma = reinterpret(q_bufs, dtype, [2 * NC, T, GP, D], q_desc.layout)
        k_tma = reinterpret(ring_k, dtype, [NS, BLOCK_KEYS_C, 1, D], k_desc.layout)
        v_tma = reinterpret(ring_v, dtype, [NS, BLOCK_KEYS_C, 1, D], v_desc.layout)
        seq_row = seq_start64.to(gl.int32)

        buffers = (q_bufs, ring_k, ring_v, ones, q_ready, q_free, kv_ready, kv_free, turn)
        scalars = (O, Sinks, seq_start64, seq_len, head_group, t_begin, t_end, qk_scale,
                   inv_scale, window_q, window_k, band_offset, stride_ot, stride_oh, stride_sink)
        # One tuple literal per partition (DEVELOPERS.md: constexprs in a tuple variable become
        # tensors); the producer's warp is rounded up to a warpgroup for the registers.
        if NC == 2:
            gl.warp_specialize([
                (_consumer, (0, buffers, scalars, T, GP, NB, NS, NC, IS_CAUSAL, HAS_WK, SINK_MODE,
                             PINGPONG, OVERLAP)),
                (_consumer_worker, (buffers, scalars, 1, T, GP, NB, NS, NC, IS_CAUSAL, HAS_WK,
                                    SINK_MODE, PINGPONG, OVERLAP)),
                (_producer, (q_desc, k_desc, v_desc, q_tma, k_tma, v_tma, q_ready, q_free,
                             kv_ready, kv_free, seq_row, seq_len, head_group * GP, kv_head,
                             t_begin, t_end, window_q, band_offset, T, NB, NS, NC)),
            ], [4, 1], [CONSUMER_REGS, 24])
        else:
            gl.static_assert(NC == 3, "two or three consumer warpgroups")
            gl.warp_specialize([
                (_consumer, (0, buffers, scalars, T, GP, NB, NS, NC, IS_CAUSAL, HAS_WK, SINK_MODE,
                             PINGPONG, OVERLAP)),
                (_consumer_worker, (buffers, scalars, 1, T, GP, NB, NS, NC, IS_CAUSAL, HAS_WK,
                                    SINK_MODE, PINGPONG, OVERLAP)),
                (_consumer_worker, (buffers, scalars, 2, T, GP, NB, NS, NC, IS_CAUSAL, HAS_WK,
                                    SINK_MODE, PINGPONG, OVERLAP)),
                (_producer, (q_desc, k_desc, v_desc, q_tma, k_tma, v_tma, q_ready, q_free,
                             kv_ready, kv_free, seq_row, seq_len, head_group * GP, kv_head,
                             t_begin, t_end, window_q, band_offset, T, NB, NS, NC)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])


# ---- launcher ------------------------------------------------------------------------------------

def _smem_layout(rank: int):
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=rank)


def _tma_ready(t: torch.Tensor) -> bool:
    """TMA's rules: 16-byte-aligned base and strides but the last, which is 1."""
    es = t.element_size()
    return (t.data_ptr() % 16 == 0 and t.stride(-1) == 1
            and all((s * es) % 16 == 0 for s in t.stride()[:-1]))


@dataclasses.dataclass(frozen=True)
class Fa3WalkLaunch:
    """A validated problem bound to the FA3-structured kernel (``plan`` says whether it fits).
    Same interface as ``gluon_window_attention.WalkLaunch``."""

    name = "walk-fa3"
    tokens_per_tile: int
    num_seqs: int
    tokens: int
    head_groups: int
    sm_count: int
    scalars: tuple  # tokens, qk_scale, inv_scale, window_q, window_k, band_offset
    strides: tuple  # stride_ot, stride_oh, stride_sink, stride_start, stride_len
    constexprs: dict
    options: dict
    gp: int

    @classmethod
    def plan(cls, p: Problem, q, k, v, o, b_start_loc, b_seq_len, sinks, gp: int | None = None,
             consumers: int = CONSUMERS, pingpong: bool = False, overlap: bool | str = False):
        """A launch when the call fits, else None: the committed walk's conditions, 16-token
        tiles (``gp`` 4: a band gains one block per tile), and TMA-legal q, k, v. ``overlap``
        (the consumers' Q · Kᵀ of the next tile during this one's softmax: True or "pairs", or
        "tiles", OVERLAP_MODES) only with OVERLAP_CONSUMERS warpgroups."""
        overlap = OVERLAP_MODES[overlap]
        if overlap and consumers not in OVERLAP_CONSUMERS:
            return None
        if not p.host_bound or walk.walk_unavailable(p.device) is not None:
            return None
        if GLUON_IMPORT_ERROR is not None:
            return None
        if p.dtype not in (torch.float16, torch.bfloat16) or p.out_dtype != p.dtype:
            return None
        if p.head_dim != HEAD_DIM or p.empty or p.num_seqs > MAX_GRID_YZ or p.cu_seqlens:
            return None  # (cu_seqlens offsets: the committed walk's CU_SEQLENS is not built here)
        gp = ROWS // BLOCK_KEYS if gp is None else gp
        if gp != ROWS // BLOCK_KEYS or p.queries_per_kv % gp:
            return None
        geometry = walk.walk_geometry(ROWS // gp, p.window_q, p.window_k, p.is_causal)
        if geometry is None or not all(_tma_ready(t) for t in (q, k, v)):
            return None
        band_offset = BLOCK_KEYS * -(-p.window_q // BLOCK_KEYS)
        scalars = (p.tokens, p.log2_scale, 1.0 / p.scale, p.window_q, p.window_k, band_offset)
        regs = _PARTITION_REGS[consumers]
        constexprs = dict(T=geometry.tokens_per_tile, GP=gp, QUERIES_PER_KV=p.queries_per_kv,
                          NB=geometry.nb, NS=geometry.nb + 3 + EXTRA_SLOTS, NC=consumers,
                          IS_CAUSAL=p.is_causal, HAS_WK=p.window_k > 0, SINK_MODE=p.sink_mode,
                          PINGPONG=pingpong, OVERLAP=overlap, CONSUMER_REGS=regs[1])
        options = launch_options(p.device, num_warps=4, maxnreg=regs[0])
        strides = (o.stride(0), o.stride(1), sinks.stride(0) if sinks is not None else 0,
                   b_start_loc.stride(0), b_seq_len.stride(0))
        return cls(geometry.tokens_per_tile, p.num_seqs, p.tokens, p.q_heads // gp,
                   walk._sm_count(p.device), scalars, strides, constexprs, options, gp)

    def chunking(self, max_len_hint: int, chunk: int | None = None):
        """(tiles per program, programs per sequence and head group): one program per SM, one
        wave."""
        tiles = triton.cdiv(min(max(max_len_hint, 1), self.tokens), self.tokens_per_tile)
        if chunk is None:
            per_seq = max(1, self.sm_count // (self.head_groups * self.num_seqs))
            chunk = max(4, triton.cdiv(tiles, per_seq))
        return chunk, triton.cdiv(tiles, chunk)

    def descriptors(self, q, k, v):
        T, gp = self.tokens_per_tile, self.gp
        return (TensorDescriptor(q, list(q.shape), list(q.stride()), [T, gp, HEAD_DIM],
                                 _smem_layout(3)),
                TensorDescriptor(k, list(k.shape), list(k.stride()), [BLOCK_KEYS, 1, HEAD_DIM],
                                 _smem_layout(3)),
                TensorDescriptor(v, list(v.shape), list(v.stride()), [BLOCK_KEYS, 1, HEAD_DIM],
                                 _smem_layout(3)))

    def __call__(self, q, k, v, o, b_start_loc, b_seq_len, sinks, max_len_hint: int,
                 chunk: int | None = None) -> bool:
        chunk_tiles, num_chunks = self.chunking(max_len_hint, chunk)
        grid = (self.head_groups, num_chunks, self.num_seqs)
        _window_fa3_kernel[grid](
            *self.descriptors(q, k, v), o, sinks if sinks is not None else q, b_start_loc,
            b_seq_len, *self.scalars, chunk_tiles, num_chunks, *self.strides,
            **self.constexprs, **self.options)
        return True


#: compare_walk_variants.py plans every module through ``WalkLaunch``.
WalkLaunch = Fa3WalkLaunch
