"""Hopper kernel of the prefill op for sliding windows: a Gluon kernel that walks the sequence.

Same semantics as ``triton_prefill_attention.context_attention_fwd`` (the front door), which runs
this kernel when ``WalkLaunch.plan`` accepts the call. Written for this project. It needs Triton's
Gluon dialect (``triton.experimental.gluon``) and an NVIDIA sm_90 GPU (wgmma); it imports without
either.

Why a second kernel (docs/kernels/window-walk.md): the portable Triton kernel
re-loads a tile's whole key band (9 blocks of 16 keys for MiMo) for every tile and streams it
through a cp.async ring with three CTA barriers per 16-key step; it levels off at ~420 µs for
MiMo's 4 × 16384 tokens. Gluon hands the kernel its shared memory, async copies and asynchronous
wgmma, so this one can:

- **walk**: a program takes ``chunk`` consecutive tiles of one sequence and one head group and keeps
  its band's keys and values resident in a shared-memory ring of ``NB + 3`` 16-key slots (the band
  is an odd number NB of blocks). A tile loads only the block that entered its band, prefetched
  two tiles ahead together with that tile's queries, and issued once the tile's wgmmas are done:
  no copy is in flight while a wgmma reads the ring, so the only async-proxy fence is the one per
  tile after the copies land;
- **take the exact softmax of the whole band** in registers, with no online rescaling: Q is held
  in registers (the A operand: no re-read of Q from shared memory per key block); the scores are
  one 32-key wgmma per pair of ring slots that starts at an even slot plus one 16-key wgmma for
  the block left over; the elementwise max of the blocks' scores and then one row reduction;
  P · V and P · 1 (the row sums, on the tensor cores) per slot pair;
- **store a tile's output during the next tile's scores**: staged in the tile's query buffer at
  its end, read back and stored after the next tile's barrier, while its wgmmas run;
- **mask only where the window cuts**: ``walk_geometry`` proves from the window that every query of
  an interior tile sees all of the middle blocks, that the first block is cut only from below and
  the last only from above. Tiles at a sequence's edges (key 0 in reach, or a band past the end)
  mask every block and carry the key-0 bias;
- **take 16-token tiles in pairs**: such a tile's band gains one block, so the parity of its first
  slot alternates tile by tile. Walking tiles in pairs (even slot, then odd) makes it a constexpr:
  which slot pairs feed the wgmmas, which block is left over, and that only the first and last
  blocks get one compare each (~8 % fewer instructions per tile). Shorter tiles (``gp`` > 4) read
  the parity per tile and compare the block left over on both sides.

Gluon's API moves between Triton releases. The kernel uses only what 3.6 – 3.9 share, and takes
every Gluon name from ``gluon_api``, which maps the renames (the CTA barrier; ``async_load``, which
3.9 requires).  A ring view is
one slot (``index``) or one pair of slots from a reinterpretation of the whole ring as
``[NS / 2, 32, 64]``: 3.8 no longer lets a view reach past what it was indexed from, which the 3.6
kernel's multi-slot views did.

Tile: 64 score rows = ``T`` tokens × ``GP`` query heads of one KV head (GP ≥ 4, so T ≤ 16 and a
tile's band gains at most one block), head dim 64, fp16/bf16, output in the input dtype.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import triton

from vllm_sinks.env import WINDOW_WALK
# Every Gluon name comes from gluon_api, which maps them across Triton releases (None without Gluon).
from vllm_sinks.v1.attention.ops.gluon_api import (async_load, commit_group, cta_barrier,
                                                   fence_async_shared, gl, gluon, reinterpret,
                                                   wait_group, warpgroup_mma, warpgroup_mma_wait)
from vllm_sinks.v1.attention.ops.hopper_gate import first_launch, kernel_unavailable
from vllm_sinks.v1.attention.ops.kernel_launcher import DirectLauncher, new_token
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
    load_sequence_cu,
    stride_args,
)

ROWS = 64  # score rows per tile: one wgmma M for one warpgroup
HEAD_DIM = 64
DTYPES = (torch.float16, torch.bfloat16)  # q, k, v and o, all alike
#: Band blocks a tile may span: each slot's scores stay in registers for the exact softmax (8 fp32
#: per thread and slot). 9 (MiMo's ±64, GPT-OSS's causal 127) is the widest band the GPU tests run;
#: wider windows take the portable kernel.
MAX_BAND_BLOCKS = 9
ENV_DISABLE = WINDOW_WALK.name  # "0" / "off" turns the kernel off (A/B timing, bisecting)


# ---- geometry (pure Python: the CPU tests check it exhaustively) --------------------------------

@dataclasses.dataclass(frozen=True)
class WalkGeometry:
    """Band of a tile in 16-key blocks. ``nb`` blocks starting at ``floor((t*T - wq) / 16)`` hold
    every key any query of tile ``t`` sees; on interior tiles every query sees every key of blocks
    1 … nb-2 (so only the first and last blocks are masked); ``nb`` is odd. ``ns`` ring slots: the
    band and the blocks the next two tiles gain, plus one to make it even (the scores read slots in
    pairs that start at an even slot)."""

    tokens_per_tile: int
    nb: int

    @property
    def ns(self) -> int:
        return self.nb + 3


def walk_geometry(tokens_per_tile: int, window_q: int, window_k: int, is_causal: bool):
    """The band layout for tiles of ``tokens_per_tile`` tokens, or None when the walk does not fit
    (a side of the band unbounded, more than one block gained per tile, a middle block some query
    does not fully see, more than MAX_BAND_BLOCKS blocks, or an even number of blocks: MiMo's and
    GPT-OSS's bands are 9)."""
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
    if nb < 3 or nb > MAX_BAND_BLOCKS or nb % 2 == 0:
        # An even band would need a second layout of slot pairs (the kernel reads (nb - 1) / 2
        # pairs and one block); no GPU test runs one, so those windows keep the portable kernel.
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
    def _band_start(t, T: gl.constexpr, window_q, band_offset):
        """First block of tile ``t``'s band: floor((t*T - wq) / 16). The offset (a multiple of 16
        ≥ wq) keeps the dividend non-negative, since integer division truncates."""
        return (t * T - window_q + band_offset) // BLOCK_KEYS_C - band_offset // BLOCK_KEYS_C

    @gluon.jit
    def _issue_block(ring_k, ring_v, k_seq, v_seq, stride_kt, stride_vt, k_off, v_off, key_rows,
                     kb, seq_len, NS: gl.constexpr):
        """cp.async key block ``kb`` (keys 16 kb … 16 kb + 15, kb >= 0) into its ring slot,
        ``kb % NS`` (a slot per block of the sequence, whichever program loads it, so that a
        tile's slots, and with them its wgmmas, do not depend on how sequences are cut into
        programs: the output is bit for bit the same however they are); keys past the
        sequence's end are zero-filled. ``k_seq``/``v_seq`` point at key 0 of the sequence and KV
        head; the per-thread offsets ``k_off``/``v_off`` are computed once per program."""
        mask = gl.expand_dims(kb * BLOCK_KEYS_C + key_rows < seq_len, 1)
        first = (kb * BLOCK_KEYS_C).to(gl.int64)
        col_layout: gl.constexpr = gl.SliceLayout(0, k_off.type.layout.parent)
        cols = gl.expand_dims(gl.arange(0, ring_k.shape[2], layout=col_layout), 0)
        slot = kb % NS
        async_load(
            ring_k.index(slot), k_seq + first * stride_kt + (gl.expand_dims(k_off, 1) + cols), mask)
        async_load(
            ring_v.index(slot), v_seq + first * stride_vt + (gl.expand_dims(v_off, 1) + cols), mask)

    @gluon.jit
    def _issue_queries(q_buf, q_seq, stride_qt, q_off, row_tokens, t, seq_len, T: gl.constexpr):
        """cp.async the queries of tile ``t``: row r = token t*T + r // GP, head group*GP + r % GP
        (``q_off`` holds each row's offset from the tile's first token, computed once)."""
        mask = gl.expand_dims(t * T + row_tokens < seq_len, 1)
        col_layout: gl.constexpr = gl.SliceLayout(0, q_off.type.layout.parent)
        cols = gl.expand_dims(gl.arange(0, q_buf.shape[1], layout=col_layout), 0)
        ptr = q_seq + (t * T).to(gl.int64) * stride_qt + (gl.expand_dims(q_off, 1) + cols)
        async_load(q_buf, ptr, mask)

    @gluon.jit
    def _issue_tile(q_buf, ring_k, ring_v, q_seq, k_seq, v_seq, stride_qt, stride_kt, stride_vt,
                    q_off, k_off, v_off, row_tokens, key_rows, t, kb_lo, kb_hi, seq_len,
                    T: gl.constexpr, NS: gl.constexpr, IN_WALK: gl.constexpr):
        """Prefetch tile ``t``: its queries and the key blocks ``kb_lo … kb_hi - 1`` its band gains.
        IN_WALK (every tile but a program's first): at most one block (T <= 16: a band moves by
        at most one block per tile), issued without a loop (no loop counter, no per-block
        modulo in the tile loop)."""
        _issue_queries(q_buf, q_seq, stride_qt, q_off, row_tokens, t, seq_len, T)
        if IN_WALK:
            if kb_lo < kb_hi:
                _issue_block(ring_k, ring_v, k_seq, v_seq, stride_kt, stride_vt, k_off, v_off,
                             key_rows, kb_lo, seq_len, NS)
        else:
            for kb in range(kb_lo, kb_hi):
                _issue_block(ring_k, ring_v, k_seq, v_seq, stride_kt, stride_vt, k_off, v_off,
                             key_rows, kb, seq_len, NS)

    @gluon.jit
    def _row(x, s):
        """Per-row vector ``x`` as a column broadcastable against scores ``s`` (same threads and
        registers: the conversion must be free)."""
        x = gl.convert_layout(x, gl.SliceLayout(1, s.type.layout), assert_trivial=True)
        return gl.expand_dims(x, 1)

    @gluon.jit
    def _keys(s, first_key):
        """Key positions of score block ``s``'s columns, as a row broadcastable against it."""
        keys = first_key + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s.type.layout))
        return gl.expand_dims(keys, 0)

    @gluon.jit
    def _mask_edge_block(s, first_key, row_lo, row_hi, bias, KEY0_BIAS: gl.constexpr):
        """Scores of keys ``first_key …`` outside [row_lo, row_hi] to -inf; with KEY0_BIAS, key 0's
        logit gets its row's bias first (so the bias only counts where key 0 is visible)."""
        keys = _keys(s, first_key)
        if KEY0_BIAS:
            s = gl.where(keys == 0, s + _row(bias, s), s)
        visible = (keys >= _row(row_lo, s)) & (keys <= _row(row_hi, s))
        return gl.where(visible, s, float("-inf"))

    @gluon.jit
    def _slot(s0, j: gl.constexpr, NS: gl.constexpr):
        """Ring slot of the band's block ``j`` when block 0 is in slot ``s0`` (s0 <= NS, as for the
        first pair of a band whose block 0 is in the last slot; s0 + j < 2 NS)."""
        s = s0 + j
        return s - NS * (s >= NS).to(gl.int32)

    @gluon.jit
    def _band_scores(q_s, ring_k, s0, odd, M: gl.constexpr, NB: gl.constexpr, NS: gl.constexpr,
                     s_layout: gl.constexpr, Q_FROM_SHARED: gl.constexpr = False):
        """Issue S = Q · Kᵀ of the tile's band (``_finish_scores`` waits for it); ``odd``: the
        parity of ``s0``, a constexpr where the walk knows it. Q_FROM_SHARED: the wgmmas read
        the queries from shared memory (no registers held while they run; the buffer is theirs
        until they complete), else from registers loaded here."""
        zeros = gl.zeros([M, BLOCK_KEYS_C], gl.float32, s_layout)
        if Q_FROM_SHARED:
            q_r = q_s
        else:
            q_r = q_s.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
        # (NB - 1) / 2 pairs of slots that start at an even slot, each one 32-key view (NS is
        # even), and the one block left over (_block_of): half the wgmmas and descriptors of one
        # wgmma per slot.
        s2_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 2 * BLOCK_KEYS_C, 16])
        zeros2 = gl.zeros([M, 2 * BLOCK_KEYS_C], gl.float32, s2_layout)
        pairs = reinterpret(ring_k, ring_k.dtype, [NS // 2, 2 * BLOCK_KEYS_C, ring_k.shape[2]],
                                    ring_k.type.layout)
        raw = ()
        for i in gl.static_range(NB // 2):
            k2 = pairs.index(_slot(s0 + odd, 2 * i, NS) >> 1)
            raw = raw + (warpgroup_mma(q_r, k2.permute((1, 0)), zeros2, use_acc=False,
                                       is_async=True), )
        k = ring_k.index(_slot(s0, _block_of(NB - 1, odd, NB), NS))
        raw = raw + (warpgroup_mma(q_r, k.permute((1, 0)), zeros, use_acc=False, is_async=True), )
        return raw

    @gluon.jit
    def _finish_scores(raw, NB: gl.constexpr, s_layout: gl.constexpr):
        """Wait for ``_band_scores``' wgmmas; the scores as NB [M, 16] blocks."""
        raw = warpgroup_mma_wait(0, deps=raw)
        scores = ()
        for i in gl.static_range(NB // 2):
            lo, hi = _halves(raw[i], s_layout)
            scores = scores + (lo, hi)
        return scores + (raw[NB // 2], )

    @gluon.jit
    def _block_of(e: gl.constexpr, odd, NB: gl.constexpr):
        """Band block held by score element ``e``: elements 0 … NB - 2 are the pairs' halves, from
        block ``odd`` on; element NB - 1 is the block left over: the last one when the band starts
        at an even slot, the first when at an odd one (``odd``: the parity of that slot)."""
        if e == NB - 1:
            return (1 - odd) * (NB - 1)
        return e + odd

    @gluon.jit
    def _halves(s, s_layout: gl.constexpr):
        """The two 16-key halves of a [M, 32] score block: a renaming of its registers."""
        x = gl.permute(gl.reshape(s, [s.shape[0], 2, BLOCK_KEYS_C]), (0, 2, 1))
        lo, hi = gl.split(x)
        return (gl.convert_layout(lo, s_layout, assert_trivial=True),
                gl.convert_layout(hi, s_layout, assert_trivial=True))

    @gluon.jit
    def _mask_band(scores, key_f, odd, row_lo, row_hi, bias, edge, NB: gl.constexpr,
                   KEY0_BIAS: gl.constexpr, PARITY: gl.constexpr):
        """Visibility on the band's scores. Interior tiles (``edge`` false): walk_geometry proved
        the middle blocks fully visible, the first block cut only from below, the last only from
        above. Edge tiles (key 0 in reach, or keys past the end): every block, and key 0's bias.
        PARITY: ``odd`` as a constexpr (0 or 1) where the walk knows it, else -1."""
        if edge:
            masked = ()
            for j in gl.static_range(NB):
                masked = masked + (_mask_edge_block(
                    scores[j], key_f + _block_of(j, odd, NB) * BLOCK_KEYS_C, row_lo, row_hi, bias,
                    KEY0_BIAS), )
        elif PARITY >= 0:
            # The parity is known, so is where the first and last blocks are: block 0 is element
            # 0 (even) or the block left over (odd), block NB - 1 the block left over (even) or
            # element NB - 2 (odd). One compare each, none on the middle blocks.
            FIRST: gl.constexpr = (NB - 1) * PARITY
            LAST: gl.constexpr = NB - 1 - PARITY
            masked = ()
            for j in gl.static_range(NB):
                s = scores[j]
                if j == FIRST:
                    s = gl.where(_keys(s, key_f) >= _row(row_lo, s), s, float("-inf"))
                elif j == LAST:
                    s = gl.where(_keys(s, key_f + (NB - 1) * BLOCK_KEYS_C) <= _row(row_hi, s), s,
                                 float("-inf"))
                masked = masked + (s, )
        else:
            # Element 0 is block 0 (cut from below) or 1 (all visible), element NB - 2 block
            # NB - 2 (all visible) or NB - 1 (cut from above): one compare each. The block left
            # over is the first or the last: both bounds.
            first = scores[0]
            first_key = key_f + odd * BLOCK_KEYS_C
            masked = (gl.where(_keys(first, first_key) >= _row(row_lo, first), first,
                               float("-inf")), )
            for j in gl.static_range(1, NB - 2):
                masked = masked + (scores[j], )
            end = scores[NB - 2]
            end_key = key_f + (NB - 2 + odd) * BLOCK_KEYS_C
            masked = masked + (gl.where(_keys(end, end_key) <= _row(row_hi, end), end,
                                        float("-inf")), )
            single = scores[NB - 1]
            keys = _keys(single, key_f + _block_of(NB - 1, odd, NB) * BLOCK_KEYS_C)
            visible = (keys >= _row(row_lo, single)) & (keys <= _row(row_hi, single))
            masked = masked + (gl.where(visible, single, float("-inf")), )
        return masked

    @gluon.jit
    def _tile_rows(t, b0, rows, window_q, window_k, seq_len, T: gl.constexpr, GP: gl.constexpr,
                   NB: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_WK: gl.constexpr):
        """What ``_mask_band`` takes for tile ``t`` (band from block ``b0``): each score row's
        visible keys [row_lo, row_hi] (window, causality, the sequence's end), and whether the
        tile is an edge tile (key 0 in reach, or its band past the sequence's end)."""
        pos = t * T + rows // GP
        row_lo = gl.maximum(pos - window_q, 0)
        if IS_CAUSAL:
            row_hi = pos
            if HAS_WK:
                row_hi = gl.minimum(row_hi, pos + window_k)
        else:
            row_hi = pos + window_k
        row_hi = gl.minimum(row_hi, seq_len - 1)
        edge = (t * T - window_q <= 0) | ((b0 + NB) * BLOCK_KEYS_C > seq_len)
        return row_lo, row_hi, edge

    @gluon.jit
    def _band_max(scores, m_floor, NB: gl.constexpr, row_layout: gl.constexpr):
        """Row max of the band (and the floor): elementwise across the blocks, which share a
        layout, then one row reduction (its shuffles once per tile, not per block)."""
        top = scores[0]
        for j in gl.static_range(1, NB):
            top = gl.maximum(top, scores[j])
        m = gl.convert_layout(gl.max(top, 1), row_layout, assert_trivial=True)
        return gl.maximum(m, m_floor)

    @gluon.jit
    def _band_pv(scores, mc, qk_scale, ring_v, ones, s0, odd, M: gl.constexpr, D: gl.constexpr,
                 NB: gl.constexpr, NS: gl.constexpr, o_layout: gl.constexpr,
                 l_layout: gl.constexpr):
        """acc = P · V and l = P · 1 over the band, P = exp2(S * qk_scale - mc) per row, P in
        registers as the A operand of both wgmmas. The row sums ride on the tensor cores (room
        there, unlike for ~100 adds and shuffles per thread and tile) and sum the same rounded P
        as the numerator."""
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        pl_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=l_layout, k_width=2)
        acc = gl.zeros([M, D], gl.float32, o_layout)
        l_acc = gl.zeros([M, 8], gl.float32, l_layout)
        ones1 = ones.slice(0, BLOCK_KEYS_C)
        # The pairs' halves back together: one 32-key wgmma on a pair of value slots, in the
        # blocks' order within the pairs; the block left over last.
        pairs = reinterpret(ring_v, ring_v.dtype, [NS // 2, 2 * BLOCK_KEYS_C, ring_v.shape[2]],
                                    ring_v.type.layout)
        for i in gl.static_range(NB // 2):
            lo = scores[2 * i]
            hi = scores[2 * i + 1]
            p_lo = gl.exp2(lo * qk_scale - _row(mc, lo)).to(ring_v.dtype)
            p_hi = gl.exp2(hi * qk_scale - _row(mc, hi)).to(ring_v.dtype)
            p2 = gl.reshape(gl.permute(gl.join(p_lo, p_hi), (0, 2, 1)), [M, 2 * BLOCK_KEYS_C])
            a = gl.convert_layout(p2, p_layout)
            acc = warpgroup_mma(a, pairs.index(_slot(s0 + odd, 2 * i, NS) >> 1), acc,
                                is_async=True)
            l_acc = warpgroup_mma(gl.convert_layout(a, pl_layout), ones, l_acc, is_async=True)
        s = scores[NB - 1]
        p = gl.exp2(s * qk_scale - _row(mc, s)).to(ring_v.dtype)
        a = gl.convert_layout(p, p_layout)
        acc = warpgroup_mma(a, ring_v.index(_slot(s0, _block_of(NB - 1, odd, NB), NS)), acc,
                            is_async=True)
        l_acc = warpgroup_mma(gl.convert_layout(a, pl_layout, assert_trivial=True), ones1, l_acc,
                              is_async=True)
        return warpgroup_mma_wait(0, deps=(acc, l_acc))

    @gluon.jit
    def _stage_tile(acc, l, q_s):
        """O = acc / l into the tile's query buffer (its queries are in registers), each warp the
        rows its own wgmma computed. ``_store_staged`` reads them back for 16-byte stores in the
        next tile, after its barrier and while its scores are computed."""
        # l >= 1 on every row that is stored (the row max contributes exp2(0)): the approximate
        # reciprocal (one MUFU.RCP, ~1 ulp) needs none of the full division's range fix-ups.
        r = gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [l], dtype=gl.float32,
                                      is_pure=True, pack=1)
        inv_l = gl.convert_layout(r, gl.SliceLayout(1, acc.type.layout), assert_trivial=True)
        q_s.store((acc * gl.expand_dims(inv_l, 1)).to(q_s.dtype))

    @gluon.jit
    def _store_staged(q_s, o_seq, o_off, io_cols, stride_ot, row_tokens, t, seq_len,
                      T: gl.constexpr, io_layout: gl.constexpr):
        """Tile ``t``'s output, staged in ``q_s`` (a CTA barrier since), to its rows of O."""
        out = q_s.load(io_layout)
        o_ptr = o_seq + (t * T).to(gl.int64) * stride_ot + (gl.expand_dims(o_off, 1) + io_cols)
        gl.store(o_ptr, out, mask=gl.expand_dims(t * T + row_tokens < seq_len, 1))

    # The integers that change from call to call (a server's token counts, the chunking its
    # longest image gives) are not specialised on: Triton would otherwise compile and load a
    # variant each time one of them turns divisible by 16 or equal to 1, which a fresh process met
    # in ~3 of 48 passes of new images at ~4-6 ms each (measured: H200, Triton 3.9.0). They are
    # bounds and loop limits only, where a divisibility hint buys nothing.
    @gluon.jit(do_not_specialize=["total_tokens", "chunk", "num_chunks"])
    def _window_walk_kernel(
            Q, K, V, O, Sinks, StartLoc, SeqLen,
            total_tokens, qk_scale, inv_scale, window_q, window_k, band_offset, chunk, num_chunks,
            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
            stride_sink, stride_start, stride_len,
            T: gl.constexpr, GP: gl.constexpr, QUERIES_PER_KV: gl.constexpr, NB: gl.constexpr,
            IS_CAUSAL: gl.constexpr, HAS_WK: gl.constexpr, SINK_MODE: gl.constexpr,
            CU_SEQLENS: gl.constexpr):
        D: gl.constexpr = 64
        M: gl.constexpr = T * GP
        gl.static_assert(NB % 2 == 1, "walk_geometry gives odd bands only")
        NS: gl.constexpr = NB + 3  # WalkGeometry.ns
        dtype: gl.constexpr = Q.dtype.element_ty
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 16, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 16])
        l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 8, 16])
        io_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                                   warps_per_cta=[4, 1], order=[1, 0])
        smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                         rank=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

        # -- this program: head group, sequence, and its run of tiles
        head_group = gl.program_id(0)
        chunk_id = gl.program_id(1)
        seq = gl.program_id(2)
        kv_head = head_group * GP // QUERIES_PER_KV
        if CU_SEQLENS:  # StartLoc holds cumulative offsets (SeqLen unused)
            seq_start64, seq_len = load_sequence_cu(StartLoc, seq, total_tokens, stride_start)
        else:
            seq_start64, seq_len = load_sequence(StartLoc, SeqLen, seq, total_tokens, stride_start,
                                                 stride_len)
        tiles = (seq_len + T - 1) // T
        t_begin = chunk_id * chunk
        t_end = gl.minimum(t_begin + chunk, tiles)
        if chunk_id == num_chunks - 1:  # a host bound that was too small costs time, never output
            t_end = tiles
        nblocks = (seq_len + BLOCK_KEYS_C - 1) // BLOCK_KEYS_C

        # -- per-thread offsets within a tile (rows of the io layout), computed once per program
        io_rows = gl.arange(0, M, layout=gl.SliceLayout(1, io_layout))
        io_cols = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, io_layout)), 0)
        row_tokens = io_rows // GP
        row_heads = head_group * GP + io_rows % GP
        q_off = row_tokens * stride_qt + row_heads * stride_qh
        o_off = row_tokens * stride_ot + row_heads * stride_oh
        key_rows = gl.arange(0, BLOCK_KEYS_C, layout=gl.SliceLayout(1, io_layout))
        k_off = key_rows * stride_kt
        v_off = key_rows * stride_vt
        q_seq = Q + seq_start64 * stride_qt
        o_seq = O + seq_start64 * stride_ot
        k_seq = K + seq_start64 * stride_kt + kv_head * stride_kh
        v_seq = V + seq_start64 * stride_vt + kv_head * stride_vh

        # -- shared memory: three query buffers (also the output staging), the K and V rings, a
        # block of ones (row sums)
        q_ring = gl.allocate_shared_memory(dtype, [3, M, D], smem_layout)
        ring_k = gl.allocate_shared_memory(dtype, [NS, BLOCK_KEYS_C, D], smem_layout)
        ring_v = gl.allocate_shared_memory(dtype, [NS, BLOCK_KEYS_C, D], smem_layout)
        # Slots of blocks before the sequence's start or past its end are never loaded; they must
        # hold finite values (zeros) since their probabilities (0) still multiply them.
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
        fence_async_shared()
        cta_barrier()

        # -- prefetch the first tile. Bands only move forward: after tile t's prefetch the ring
        # holds blocks max(kb0, 0) … b0(t + 2) + NB - 1, block kb in slot kb % NS.
        kb0 = _band_start(t_begin, T, window_q, band_offset)
        first_kb = gl.maximum(kb0, 0)
        if t_begin < t_end:
            _issue_tile(q_ring.index(0), ring_k, ring_v, q_seq, k_seq, v_seq, stride_qt, stride_kt,
                        stride_vt, q_off, k_off, v_off, row_tokens, key_rows, t_begin, first_kb,
                        gl.minimum(kb0 + NB, nblocks), seq_len, T, NS, False)
        commit_group()
        if t_begin + 1 < t_end:
            _issue_tile(q_ring.index(1), ring_k, ring_v, q_seq, k_seq, v_seq, stride_qt, stride_kt,
                        stride_vt, q_off, k_off, v_off, row_tokens, key_rows, t_begin + 1,
                        gl.maximum(kb0 + NB, first_kb),
                        gl.minimum(_band_start(t_begin + 1, T, window_q, band_offset) + NB, nblocks),
                        seq_len, T, NS, True)
        commit_group()

        # -- per-row sink terms: the null logit's floor under the max, or key 0's bias
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

        # A 16-token tile gains one block, so the slot of its band's first block alternates in
        # parity tile by tile: the walk then takes tiles in pairs (even slot, odd slot), and in each
        # the slot pairs, the block left over and the two blocks to mask are known to the compiler
        # (docs/kernels/window-walk.md). Shorter tiles read the parity per tile.
        STEP: gl.constexpr = 2 if T == BLOCK_KEYS_C else 1
        lead = 0
        if STEP == 2:  # a walk that starts at an odd slot starts with the second of a pair
            lead = ((_band_start(t_begin, T, window_q, band_offset) + NS) % NS) % 2
        for t_pair in range(t_begin - lead, t_end, STEP):
            for half in gl.static_range(STEP):
                t = t_pair + half
                if (t >= t_begin) & (t < t_end):
                    it = t - t_begin
                    # Tile t's queries and blocks were issued two tiles ahead (tile t + 1's may
                    # still be in flight). The fence makes the copies visible to the wgmmas (async
                    # proxy); the barrier, every warp's copies and tile t - 1's staged output to
                    # every warp.
                    wait_group(1)
                    fence_async_shared()
                    cta_barrier()
                    b0 = _band_start(t, T, window_q, band_offset)
                    q_s = q_ring.index(it % 3)
                    # block b0's slot (b0 >= -NS: the window reaches < NB blocks back)
                    s0 = (b0 + NS) % NS
                    odd = half if STEP == 2 else s0 % 2
                    pending = _band_scores(q_s, ring_k, s0, odd, M, NB, NS, s_layout)
                    # Tile t - 1's output, staged before the barrier above, goes out while tile
                    # t's scores are computed (the prefetch below refills its buffer: the
                    # compiler puts a barrier before it).
                    if t > t_begin:
                        _store_staged(q_ring.index((it + 2) % 3), o_seq, o_off, io_cols,
                                      stride_ot, row_tokens, t - 1, seq_len, T, io_layout)
                    scores = _finish_scores(pending, NB, s_layout)
                    row_lo, row_hi, edge = _tile_rows(t, b0, rows, window_q, window_k, seq_len,
                                                      T, GP, NB, IS_CAUSAL, HAS_WK)
                    scores = _mask_band(scores, b0 * BLOCK_KEYS_C, odd, row_lo, row_hi, sink_raw,
                                        edge, NB, SINK_MODE == KEY0_BIAS_C,
                                        half if STEP == 2 else -1)
                    m = _band_max(scores, m_floor, NB, row_layout)
                    mc = m * qk_scale
                    acc, l_acc = _band_pv(scores, mc, qk_scale, ring_v, ones, s0, odd, M, D, NB,
                                          NS, o_layout, l_layout)
                    # Every column of l_acc holds the row sum.
                    l = gl.convert_layout(gl.max(l_acc, 1), row_layout, assert_trivial=True)
                    if SINK_MODE == NULL_LOGIT_C:
                        l += gl.exp2(sink_raw * qk_scale - mc)
                    # Prefetch tile t + 2 now that this tile's wgmmas are done: no copy is in
                    # flight while they read the ring, so no proxy fence is needed before them.
                    if t + 2 < t_end:
                        b_next = _band_start(t + 1, T, window_q, band_offset)
                        b_after = _band_start(t + 2, T, window_q, band_offset)
                        _issue_tile(q_ring.index((it + 2) % 3), ring_k, ring_v, q_seq, k_seq,
                                    v_seq, stride_qt, stride_kt, stride_vt, q_off, k_off, v_off,
                                    row_tokens, key_rows, t + 2,
                                    gl.maximum(b_next + NB, first_kb),
                                    gl.minimum(b_after + NB, nblocks), seq_len, T, NS, True)
                    commit_group()
                    _stage_tile(acc, l, q_s)
        cta_barrier()
        if t_end > t_begin:
            _store_staged(q_ring.index((t_end - 1 - t_begin) % 3), o_seq, o_off, io_cols,
                          stride_ot, row_tokens, t_end - 1, seq_len, T, io_layout)
        wait_group(0)


# ---- launcher ------------------------------------------------------------------------------------

def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def walk_unavailable(device: torch.device) -> str | None:
    """Why the Gluon kernel cannot run on ``device`` (None when it can): the environment switch
    turned it off, or the platform rules it out."""
    return kernel_unavailable(device, WINDOW_WALK)


@dataclasses.dataclass(frozen=True)
class RegisterBudget:
    """Registers per thread a variant is compiled with (``maxnreg``) and the programs per SM its
    launches plan for (``WalkLaunch.chunking``)."""

    maxnreg: int
    programs_per_sm: int


#: Three programs per SM: up to 74 KB of shared memory each (NB = 9: 12 ring slots of K and V,
#: three query buffers), and registers capped at 168 so that three programs' 12 warps fit the
#: 64K-register file. ptxas 12.8–13.0 (Triton 3.7, 3.8) fit the walk there without a spill.
TIGHT = RegisterBudget(168, 3)
#: Where ptxas spills at 168 (13.3–13.4, the ptxas-blackwell that Triton 3.9 compiles sm_90 with,
#: needs ~208 registers: MiMo 4 × 16384 ran 435 µs spilling against 228 µs unspilled, measured:
#: H200, Triton 3.9.0): no cap below the hardware's, and the two programs per SM that then fit.
ROOMY = RegisterBudget(255, 2)
#: variant -> the budget it runs with, once its compile at TIGHT spilled (a fact of the compiler
#: at hand, read from the compiled kernel: not a list of releases)
_BUDGETS: dict = {}
_SM_COUNT: dict = {}


def _sm_count(device: torch.device) -> int:
    index = _device_index(device)
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


_LAUNCHER = DirectLauncher(_window_walk_kernel) if gluon is not None else None
_COMPILED_VARIANTS: set = set()
_FAILED_VARIANTS: set = set()


class BoundLaunch(NamedTuple):
    """One length bound's launch of a ``WalkLaunch``: worked out once, used by every call."""

    grid: tuple
    tail: tuple  # the kernel's scalar arguments after the tensors
    signature: tuple  # the DirectLauncher's key: plan token, bound, chunk, register budget
    options: dict  # Triton's launch options (the budget's maxnreg)


@dataclasses.dataclass(frozen=True)
class WalkLaunch:
    """A validated problem bound to the Gluon kernel (``plan`` says whether it fits)."""

    name = "walk"
    tokens_per_tile: int
    num_seqs: int
    tokens: int
    head_groups: int
    sm_count: int
    scalars: tuple  # tokens, qk_scale, inv_scale, window_q, window_k, band_offset
    strides: tuple
    constexprs: dict
    options: dict
    variant: tuple  # the compiled kernel this launch needs: its constexprs and dtype
    # Stands for this plan's call key (dtypes included) in the launcher's cache.
    token: int = dataclasses.field(default_factory=new_token, compare=False)
    # (length bound, chunk) -> BoundLaunch: the launch is CPU-bound for one MiMo image, so nothing
    # is recomputed per call (a ViT passes the same bound in every layer)
    _by_bound: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    _compiled: list = dataclasses.field(default_factory=list, compare=False, repr=False)  # [True] once launched

    @classmethod
    def plan(cls, p: Problem, q, k, v, o, b_start_loc, b_seq_len, sinks, gp: int | None = None):
        """A launch when the call fits the kernel, else None. ``gp``: query heads per tile (a
        power of two ≥ 4 dividing the heads per KV head; tiles are 64 / gp tokens), default 4:
        16-token tiles, whose slot parity the walk knows statically (1–4 % faster than 8-token
        tiles of 8 heads: docs/kernels/window-walk.md; benchmarks/kernels/sweep_walk_tiles.py
        times the others)."""
        if not p.host_bound or walk_unavailable(p.device) is not None:
            return None
        if p.dtype not in DTYPES or p.out_dtype != p.dtype:
            return None
        if p.head_dim != HEAD_DIM or p.empty or p.num_seqs > MAX_GRID_YZ:
            return None
        most = min(p.queries_per_kv & -p.queries_per_kv, ROWS)
        gp = ROWS // BLOCK_KEYS if gp is None else gp
        if gp < ROWS // BLOCK_KEYS or gp > most or gp & (gp - 1):
            return None
        geometry = walk_geometry(ROWS // gp, p.window_q, p.window_k, p.is_causal)
        if geometry is None:
            return None
        band_offset = BLOCK_KEYS * -(-p.window_q // BLOCK_KEYS)
        scalars = (p.tokens, p.log2_scale, 1.0 / p.scale, p.window_q, p.window_k, band_offset)
        constexprs = dict(T=geometry.tokens_per_tile, GP=gp, QUERIES_PER_KV=p.queries_per_kv,
                          NB=geometry.nb, IS_CAUSAL=p.is_causal, HAS_WK=p.window_k > 0,
                          SINK_MODE=p.sink_mode, CU_SEQLENS=p.cu_seqlens)
        options = launch_options(p.device, num_warps=4, maxnreg=TIGHT.maxnreg)
        return cls(geometry.tokens_per_tile, p.num_seqs, p.tokens, p.q_heads // gp,
                   _sm_count(p.device), scalars,
                   stride_args(q, k, v, o, sinks, b_start_loc, b_seq_len), constexprs, options,
                   tuple(sorted(constexprs.items())) + (p.dtype, ))

    def budget(self) -> RegisterBudget:
        """The register budget this launch's variant runs with (``TIGHT`` unless it spilled)."""
        return _BUDGETS.get(self.variant, TIGHT)

    def chunking(self, max_len_hint: int, chunk: int | None = None):
        """(tiles per program, programs per sequence and head group) for a length bound: by
        default one wave of programs over the sequences' tiles, at least 4 tiles each.

        The host knows the bound on each sequence's length and the tokens of all of them, not each
        length (those are on the GPU). Both give a chunk under which the programs that have tiles
        fit one wave whatever the lengths are: one wave's share per sequence at the bound, or the
        wave's share per head group over all the tiles (less one program per sequence for its
        partial chunk). The smaller one runs. Equal lengths keep the first; a long image beside
        short ones (a server's usual pass) gets the second, which gives the long one the wave
        instead of 1 / num_seqs of it (a server's stream: a pass of 16201, 965 and 341 tokens
        had 128 programs for its 16201 on 132 SMs)."""
        bound = min(max(max_len_hint, 1), self.tokens)
        tiles = triton.cdiv(bound, self.tokens_per_tile)
        if chunk is None:
            per_group = self.sm_count * self.budget().programs_per_sm // self.head_groups
            chunk = triton.cdiv(tiles, max(1, per_group // self.num_seqs))
            if per_group > self.num_seqs:
                # each sequence adds at most one partial tile (+ n - 1 tiles) and one partial
                # chunk (n programs fewer for the whole tiles)
                all_tiles = triton.cdiv(min(self.tokens, self.num_seqs * bound), self.tokens_per_tile)
                chunk = min(chunk, triton.cdiv(all_tiles + self.num_seqs - 1,
                                               per_group - self.num_seqs))
            chunk = max(4, chunk)
        return chunk, triton.cdiv(tiles, chunk)

    def ready(self, max_len_hint: int) -> tuple | None:
        """The direct launch of this bound, once launched (``DirectLauncher.ready``), else None."""
        bound = self._by_bound.get((max_len_hint, None))
        if bound is None:
            return None
        return _LAUNCHER.ready(bound.signature, bound.grid, bound.tail)

    def _new_bound(self, max_len_hint: int, chunk: int | None) -> BoundLaunch:
        """Work out (and keep) a bound's launch under the variant's register budget now."""
        budget = self.budget()
        chunk_tiles, num_chunks = self.chunking(max_len_hint, chunk)
        options = self.options
        if "maxnreg" in options and budget is not TIGHT:
            options = {**options, "maxnreg": budget.maxnreg}
        if len(self._by_bound) >= 64:
            self._by_bound.clear()
        bound = self._by_bound[(max_len_hint, chunk)] = BoundLaunch(
            (self.head_groups, num_chunks, self.num_seqs),
            (*self.scalars, chunk_tiles, num_chunks, *self.strides),
            (self.token, max_len_hint, chunk, budget.maxnreg), options)
        return bound

    def __call__(self, q, k, v, o, b_start_loc, b_seq_len, sinks, max_len_hint: int,
                 chunk: int | None = None) -> bool:
        """Launch; False (nothing launched, nothing written) when this kernel variant failed to
        compile, which is then reported once and never tried again: the caller falls back."""
        grid, tail, signature, options = self._by_bound.get((max_len_hint, chunk)) or \
            self._new_bound(max_len_hint, chunk)
        tensors = (q, k, v, o, sinks if sinks is not None else q, b_start_loc, b_seq_len)
        if self._compiled:  # the common case: nothing to decide
            _LAUNCHER(signature, grid, tensors, tail, self.constexprs, options)
            return True
        launched, compiled = first_launch(  # the first launch of a variant compiles it
            lambda: _LAUNCHER(signature, grid, tensors, tail, self.constexprs, options),
            self.variant, _COMPILED_VARIANTS, _FAILED_VARIANTS, "window")
        if not launched:
            return False
        if signature[-1] == TIGHT.maxnreg and getattr(compiled, "n_spills", 0):
            # This output is right, only slow: from the next call on, the variant runs unspilled
            # at two programs per SM (its bounds are planned again, and their direct launches
            # made then, so none keeps the spilling kernel).
            _BUDGETS[self.variant] = ROOMY
            self._by_bound.clear()
            return True
        self._compiled.append(True)
        return True
