"""Hopper kernel of the prefill op for attention without a window: a Gluon kernel.

Same semantics as ``triton_prefill_attention.context_attention_fwd`` (the front door), which runs
this kernel when ``FullLaunch.plan`` accepts the call: no sliding window, causal or not, with or
without sinks (null logit or key-0 bias), fp16/bf16, head dim up to 128. Written for this project;
it needs Triton's Gluon dialect and an NVIDIA sm_90 GPU (wgmma), and imports without either.

Why a kernel of its own (docs/kernels/full-attention.md): the portable Triton kernel runs at
0.7–0.9 × upstream vLLM's op on full attention (both are ``tl.dot`` loops, loads synchronous), and vision
encoders call the op with full attention in most or all of their layers. This one is the usual
flash-attention loop, written for Hopper:

- a program takes ``BLOCK_M`` queries of one head of one sequence (64: one warpgroup, so that the
  programs sharing an SM run out of step, see ``default_tile``); its queries stay in shared
  memory, the A operand of every Q · Kᵀ wgmma;
- keys and values stream through a ring of ``STAGES`` shared-memory slots, issued ``STAGES - 1``
  blocks ahead of their use (``STAGES - 2`` where the previous block's P · V may still read its
  slot: ``defer_pv``, ``overlap``), so a block's load overlaps the work on the blocks before it
  (upstream's kernel loads each block when it needs it). They come by cp.async (every thread
  copies 16-byte pieces, masked) or, with ``TileConfig.tma``, by TMA: one thread copies a block's
  box from a host-side descriptor and an mbarrier says when it landed. TMA takes the copies'
  addresses, masks and pointer registers out of every thread (the kernel drops from 164-255 to
  123-155 registers, measured: H200, Triton 3.7-3.9); it reads whole rows of
  the packed [tokens, heads × head dim] tensors, so it needs heads stored back to back and a head
  dim the parts cover exactly (``tma_unavailable``);
- S = Q · Kᵀ and O += P · V on the tensor cores (asynchronous wgmma, P from registers), the
  online softmax in fp32 registers in base 2;
- only blocks a mask can cut are masked: the last block of the sequence, and under causality
  the blocks that reach past the tile's first query; key 0's bias is added in block 0 only;
- the null-logit sink is the softmax's starting point (running max = the sink, running sum = 1),
  so it costs nothing per block.

The head dim is computed in at most two parts, each a power of two (``head_dim_parts``: 80 = 64
+ 16), so a 72- or 80-wide head costs 80 columns of tensor-core work where upstream's op, which
pads to the next power of two, costs 128; masked loads fill the columns past the head dim with
zeros, and they are never stored.

Gluon's API moves between Triton releases; every Gluon name comes from ``gluon_api``, which maps
the renames.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import NamedTuple

import torch
import triton

from vllm_sinks.v1.attention.ops.gluon_api import (HostTensorDescriptor, async_load, commit_group,
                                                   cta_barrier, fence_async_shared, gl, gluon,
                                                   hopper_unavailable, mbarrier, tma_load,
                                                   wait_group, warpgroup_mma, warpgroup_mma_init,
                                                   warpgroup_mma_wait)
from vllm_sinks.v1.attention.ops.kernel_launcher import DirectLauncher, new_token
from vllm_sinks.v1.attention.ops.prefill_attention_problem import (
    KEY0_BIAS_C,
    MAX_GRID_YZ,
    NULL_LOGIT_C,
    Problem,
    launch_options,
    load_sequence,
    stride_args,
)

DTYPES = (torch.float16, torch.bfloat16)  # q, k, v and o, all alike
MAX_HEAD_DIM = 128


class TileConfig(NamedTuple):
    """Tile shape: query rows per program (16 per warp), keys per block, ring slots, and whether
    a block's P · V is left in flight into the next block's Q · Kᵀ (``defer_pv``: the tensor
    cores then run it while the warps wait at the barrier and issue the next copies; it costs a
    ring slot, since block j - 1's values may still be read while block j + STAGES - 2 loads)."""

    block_m: int
    block_n: int
    stages: int
    defer_pv: bool = False
    #: register cap per thread (128: two programs of 8 warps per SM), None: the compiler's choice
    maxnreg: int | None = None
    #: issue block j's Q · Kᵀ and block j - 1's P · V together, and run block j's softmax while
    #: the tensor cores still run that P · V (the output is rescaled after it): the two costs
    #: overlap instead of adding up. Like ``defer_pv`` it costs a ring slot.
    overlap: bool = False
    #: keys and values by TMA (see the module docstring); calls TMA cannot read take cp.async
    tma: bool = False


def head_dim_parts(d: int) -> tuple[int, int]:
    """The head dim as the kernel computes it: one power of two ≥ 16, or 64 plus a second power
    of two ≤ 32 (72 and 80 -> 64 + 16, 96 -> 64 + 32); above 96, 128. Columns past ``d`` are
    zeros, never stored."""
    if d <= 64:
        return max(16, triton.next_power_of_2(d)), 0
    if d - 64 <= 32:
        return 64, max(16, triton.next_power_of_2(d - 64))
    return 128, 0


def default_tile(causal: bool) -> TileConfig:
    """The tile ``FullLaunch.plan`` takes: the fastest of ``benchmarks/kernels/sweep_full_tiles.py``
    on the H200 (docs/kernels/full-attention.md), the same at every head dim. 64 queries per program
    (one warpgroup): two or three programs then share an SM and run out of step, one's softmax
    under another's wgmmas, where a 128-row program's two warpgroups meet at every block's
    barrier (1.42-2.1 × upstream against 1.2-2.0 ×). 64-key blocks in three slots; P · V in flight
    into the next block's Q · Kᵀ without causality (1.29-1.83 × at head dim 128, overlapped
    1.25-1.77 ×), the softmax overlapped with it under causality (1.51-1.57 × against 1.35 ×)."""
    return TileConfig(64, 64, 3, defer_pv=not causal, overlap=causal)


# ---- kernel --------------------------------------------------------------------------------------

if gluon is not None:

    @gluon.constexpr_function
    def _smem_layout(width):
        """Shared layout of a [rows, width] 16-bit tile: the widest swizzle its rows allow."""
        return gl.NVMMASharedLayout(swizzle_byte_width=min(128, 2 * width), element_bitwidth=16,
                                    rank=2)

    @gluon.constexpr_function
    def _io_layout(width, num_warps):
        """16-byte accesses: width / 8 threads across a row."""
        across = width // 8
        return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // across, across],
                                warps_per_cta=[num_warps, 1], order=[1, 0])

    @gluon.constexpr_function
    def _mma_layout(n, num_warps):
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                         instr_shape=[16, n, 16])

    @gluon.jit
    def _issue_rows(buf, base, stride_t, first, seq_len, COLS: gl.constexpr,
                    NUM_WARPS: gl.constexpr):
        """cp.async rows ``first … first + R - 1`` of one head's part (``base``: its row 0, first
        column) into ``buf`` [R, W]; rows past the sequence and columns past COLS (the head dim
        left in this part) are zero-filled."""
        R: gl.constexpr = buf.shape[0]
        W: gl.constexpr = buf.shape[1]
        io_layout: gl.constexpr = _io_layout(W, NUM_WARPS)
        rows = first + gl.arange(0, R, layout=gl.SliceLayout(1, io_layout))
        cols = gl.arange(0, W, layout=gl.SliceLayout(0, io_layout))
        mask = gl.expand_dims(rows < seq_len, 1)
        if COLS < W:
            mask = mask & gl.expand_dims(cols < COLS, 0)
        ptr = base + gl.expand_dims(rows.to(gl.int64) * stride_t, 1) + gl.expand_dims(cols, 0)
        async_load(buf, ptr, mask)

    @gluon.jit
    def _issue_block(k0, v0, k1, v1, k_base, v_base, stride_kt, stride_vt, first, kv_len,
                     HEAD_DIM: gl.constexpr, D0: gl.constexpr, D1: gl.constexpr,
                     NUM_WARPS: gl.constexpr):
        """One key block's keys and values, both parts of the head dim."""
        _issue_rows(k0, k_base, stride_kt, first, kv_len, HEAD_DIM, NUM_WARPS)
        _issue_rows(v0, v_base, stride_vt, first, kv_len, HEAD_DIM, NUM_WARPS)
        if D1 > 0:
            _issue_rows(k1, k_base + D0, stride_kt, first, kv_len, HEAD_DIM - D0, NUM_WARPS)
            _issue_rows(v1, v_base + D0, stride_vt, first, kv_len, HEAD_DIM - D0, NUM_WARPS)

    @gluon.jit
    def _row(x, layout: gl.constexpr):
        """Per-row vector ``x`` as a column broadcastable against a tensor of ``layout`` (same
        threads and registers: the conversion must be free)."""
        return gl.expand_dims(gl.convert_layout(x, gl.SliceLayout(1, layout), assert_trivial=True), 1)

    @gluon.jit
    def _wait_pv(acc0, acc1, SPLIT: gl.constexpr):
        """Wait for the P · V wgmmas of both parts (the second only where there is one)."""
        if SPLIT:
            acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
        else:
            acc0 = warpgroup_mma_wait(0, deps=(acc0, ))
        return acc0, acc1

    @gluon.jit
    def _softmax_block(s, j, first_masked, kv_len, m0, m_i, l_i, sink_raw, qk_scale, rows_s, cols_s,
                       BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr, SINK_MODE: gl.constexpr):
        """Block j's scores ``s`` (raw, fp32) into probabilities in base 2 against the new running
        max: returns (p, alpha, m_new, l_new), alpha the factor the output so far is rescaled by.
        Only blocks a mask can cut (``j >= first_masked``) pay for it; key 0's bias is added to
        block 0's first column."""
        if SINK_MODE == KEY0_BIAS_C:
            if j == 0:  # key 0 is seen by every query
                s = gl.where(gl.expand_dims(cols_s, 0) == 0, s + sink_raw, s)
        if j >= first_masked:
            keys = gl.expand_dims(j * BLOCK_N + cols_s, 0)
            visible = keys < kv_len
            if IS_CAUSAL:
                visible = visible & (keys <= gl.expand_dims(m0 + rows_s, 1))
            s = gl.where(visible, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        l_new = l_i * alpha + gl.sum(p, 1)
        return p, alpha, m_new, l_new

    @gluon.jit
    def _issue_block_tma(kd0, vd0, kd1, vd1, k0, v0, k1, v1, bar, row, kcol, vcol,
                         D0: gl.constexpr, D1: gl.constexpr, BLOCK_N: gl.constexpr):
        """One key block's keys and values by TMA into one ring slot (rows ``row`` … of the
        [tokens, heads × head dim] views, from columns ``kcol`` and ``vcol``); ``bar`` completes
        once every byte landed. Rows past the tensor's end arrive as zeros."""
        mbarrier.expect(bar, BLOCK_N * (D0 + D1) * 4)  # K and V, two bytes an element
        tma_load(kd0, [row, kcol], bar, k0)
        tma_load(vd0, [row, vcol], bar, v0)
        if D1 > 0:
            tma_load(kd1, [row, kcol + D0], bar, k1)
            tma_load(vd1, [row, vcol + D0], bar, v1)

    @gluon.jit
    def _zero_rows(buf, first, NUM_WARPS: gl.constexpr):
        """Rows ``first`` … of ``buf`` [R, W] set to zero (through registers: plain stores)."""
        R: gl.constexpr = buf.shape[0]
        W: gl.constexpr = buf.shape[1]
        io_layout: gl.constexpr = _io_layout(W, NUM_WARPS)
        x = buf.load(io_layout)
        rows = gl.arange(0, R, layout=gl.SliceLayout(1, io_layout))
        buf.store(gl.where(gl.expand_dims(rows < first, 1), x, gl.zeros_like(x)))

    @gluon.jit
    def _next_block(j, g0, n_blocks, seq_len, kv_len, k0, v0, k1, v1, ready, kd0, vd0, kd1, vd1,
                    row0, kcol, vcol, k_base, v_base, stride_kt, stride_vt,
                    AHEAD: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
                    HEAD_DIM: gl.constexpr, D0: gl.constexpr, D1: gl.constexpr,
                    NUM_WARPS: gl.constexpr, TMA_KV: gl.constexpr):
        """Top of block j, the program's block g0 + j (its slot: ``(g0 + j) % STAGES``): its
        copies landed, and block j + AHEAD's are issued into the slot the barrier says every
        warp is done with.

        cp.async: this thread's copies by the wait, every thread's by the barrier, for the tensor
        cores by the fence (at j = 0 the queries' too); one commit group per block, empty past
        the last, so the wait's count holds. TMA: the slot's mbarrier (its phase flips on every
        use); on the sequence's last block the value rows past its end are zeroed, since TMA read
        the next sequence's rows there and P = 0 times a value that is not finite is not 0 (keys
        there are masked out of the scores, which the mask replaces whatever they are)."""
        g = g0 + j
        if TMA_KV:
            s = g % STAGES
            mbarrier.wait(ready.index(s), (g // STAGES) & 1)
            if (j + 1) * BLOCK_N > seq_len:
                _zero_rows(v0.index(s), seq_len - j * BLOCK_N, NUM_WARPS)
                if D1 > 0:
                    _zero_rows(v1.index(s), seq_len - j * BLOCK_N, NUM_WARPS)
                fence_async_shared()
            cta_barrier()
        else:
            wait_group(AHEAD - 1)
            fence_async_shared()
            cta_barrier()
        nxt = j + AHEAD
        if nxt < n_blocks:
            sn = (g + AHEAD) % STAGES
            if TMA_KV:
                _issue_block_tma(kd0, vd0, kd1, vd1, k0.index(sn), v0.index(sn), k1.index(sn),
                                 v1.index(sn), ready.index(sn), row0 + nxt * BLOCK_N, kcol, vcol,
                                 D0, D1, BLOCK_N)
            else:
                _issue_block(k0.index(sn), v0.index(sn), k1.index(sn), v1.index(sn), k_base,
                             v_base, stride_kt, stride_vt, nxt * BLOCK_N, kv_len, HEAD_DIM, D0,
                             D1, NUM_WARPS)
        if not TMA_KV:
            commit_group()

    @gluon.jit
    def _scores(q0, q1, k0, k1, slot, zeros_s, SPLIT: gl.constexpr):
        """S = Q · Kᵀ of the block in ``slot``, both parts, issued (not waited)."""
        s = warpgroup_mma(q0, k0.index(slot).permute((1, 0)), zeros_s, use_acc=False, is_async=True)
        if SPLIT:
            s = warpgroup_mma(q1, k1.index(slot).permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _accumulate(a0, v0, v1, slot, acc0, acc1, p1_layout: gl.constexpr, SPLIT: gl.constexpr):
        """O += P · V of the block in ``slot`` (P as wgmma's register operand), issued."""
        acc0 = warpgroup_mma(a0, v0.index(slot), acc0, is_async=True)
        if SPLIT:
            acc1 = warpgroup_mma(gl.convert_layout(a0, p1_layout), v1.index(slot), acc1,
                                 is_async=True)
        return acc0, acc1

    @gluon.jit
    def _store_part(acc, inv_l, buf, o_base, stride_ot, m0, seq_len, COLS: gl.constexpr,
                    NUM_WARPS: gl.constexpr):
        """O = acc / l for one part of the head dim, staged in ``buf`` (the part's query buffer,
        free once the tile's wgmmas are done) for 16-byte stores of whole rows."""
        W: gl.constexpr = buf.shape[1]
        io_layout: gl.constexpr = _io_layout(W, NUM_WARPS)
        buf.store((acc * _row(inv_l, acc.type.layout)).to(buf.dtype))
        cta_barrier()
        out = buf.load(io_layout)
        rows = m0 + gl.arange(0, buf.shape[0], layout=gl.SliceLayout(1, io_layout))
        cols = gl.arange(0, W, layout=gl.SliceLayout(0, io_layout))
        mask = gl.expand_dims(rows < seq_len, 1)
        if COLS < W:
            mask = mask & gl.expand_dims(cols < COLS, 0)
        ptr = o_base + gl.expand_dims(rows.to(gl.int64) * stride_ot, 1) + gl.expand_dims(cols, 0)
        gl.store(ptr, out, mask=mask)

    @gluon.jit
    def _full_attention_kernel(
            Q, K, V, O, Sinks, StartLoc, SeqLen,
            total_tokens, qk_scale, inv_scale,
            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
            stride_sink, stride_start, stride_len, Kd0, Vd0, Kd1, Vd1,
            HEAD_DIM: gl.constexpr, D0: gl.constexpr, D1: gl.constexpr, BLOCK_M: gl.constexpr,
            BLOCK_N: gl.constexpr, STAGES: gl.constexpr, QUERIES_PER_KV: gl.constexpr,
            IS_CAUSAL: gl.constexpr, SINK_MODE: gl.constexpr, DEFER_PV: gl.constexpr,
            OVERLAP: gl.constexpr, TMA_KV: gl.constexpr):
        # Kd0 … Vd1: TMA descriptors of K and V as [tokens, heads × head dim], boxes of BLOCK_N
        # rows and one part of the head dim (None without TMA_KV; Kd1, Vd1 repeat Kd0, Vd0 where
        # the head dim has one part)
        NUM_WARPS: gl.constexpr = BLOCK_M // 16
        # The head dim in two parts (D0 a power of two, D1 one or 0): 80 = 64 + 16 computes 80
        # columns, where one power of two would compute 128.
        SPLIT: gl.constexpr = D1 > 0
        D1B: gl.constexpr = D1 if SPLIT else 16  # buffers of a part that is not there: unused
        # Strides come divided by 8 (``FullLaunch.plan`` takes only calls whose rows start on 16
        # bytes): Triton tells the compiler only whether an int is a multiple of 16, so a 72-wide
        # head's rows would otherwise be copied two bytes at a time.
        stride_qt = stride_qt * 8
        stride_qh = stride_qh * 8
        stride_kt = stride_kt * 8
        stride_kh = stride_kh * 8
        stride_vt = stride_vt * 8
        stride_vh = stride_vh * 8
        stride_ot = stride_ot * 8
        stride_oh = stride_oh * 8
        dtype: gl.constexpr = Q.dtype.element_ty
        s_layout: gl.constexpr = _mma_layout(BLOCK_N, NUM_WARPS)
        o0_layout: gl.constexpr = _mma_layout(D0, NUM_WARPS)
        o1_layout: gl.constexpr = _mma_layout(D1B, NUM_WARPS)
        p0_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o0_layout, k_width=2)
        p1_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o1_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        # Blocks issued ahead of their use: every slot but the one being read, and with DEFER_PV
        # the one the previous block's P · V may still read.
        AHEAD: gl.constexpr = STAGES - 1 - (DEFER_PV or OVERLAP)

        head = gl.program_id(1)
        seq = gl.program_id(2)
        seq_start64, seq_len = load_sequence(StartLoc, SeqLen, seq, total_tokens, stride_start,
                                             stride_len)
        kv_head = head // QUERIES_PER_KV
        q_base = Q + seq_start64 * stride_qt + head * stride_qh
        o_base = O + seq_start64 * stride_ot + head * stride_oh
        k_base = K + seq_start64 * stride_kt + kv_head * stride_kh
        v_base = V + seq_start64 * stride_vt + kv_head * stride_vh

        q0 = gl.allocate_shared_memory(dtype, [BLOCK_M, D0], _smem_layout(D0))
        k0 = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D0], _smem_layout(D0))
        v0 = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D0], _smem_layout(D0))
        if SPLIT:
            q1 = gl.allocate_shared_memory(dtype, [BLOCK_M, D1B], _smem_layout(D1B))
            k1 = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D1B], _smem_layout(D1B))
            v1 = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D1B], _smem_layout(D1B))
        else:  # never read or written: the same views stand in, so every call site is one
            q1 = q0
            k1 = k0
            v1 = v0

        # The sink in raw-score units (scores are scaled by qk_scale later): the null logit is the
        # running max's starting point, key 0's bias is added to its raw score.
        if SINK_MODE != 0:
            sink_raw = gl.load(Sinks + head * stride_sink).to(gl.float32) * inv_scale
        else:
            sink_raw = 0.0
        rows_s = gl.arange(0, BLOCK_M, layout=row_layout)
        cols_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        zeros_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        if TMA_KV:  # one mbarrier per ring slot; TMA reads K and V by row and column
            ready = mbarrier.allocate_mbarrier(batch=STAGES)
            for b in gl.static_range(STAGES):
                mbarrier.init(ready.index(b), count=1)
            fence_async_shared()
            row0 = seq_start64.to(gl.int32)
            kcol = kv_head * HEAD_DIM
        else:
            ready = q0
            row0 = 0
            kcol = 0
        g0 = 0  # blocks this program loaded before the current tile: the ring's slots and phases

        # Heavier tiles first under causality (they have more key blocks); a bound that was too
        # small is covered by the programs looping over the tiles past it.
        m_tiles = (seq_len + BLOCK_M - 1) // BLOCK_M
        for tile in range(gl.program_id(0), m_tiles, gl.num_programs(0)):
            if IS_CAUSAL:
                mt = m_tiles - 1 - tile
            else:
                mt = tile
            m0 = mt * BLOCK_M
            if IS_CAUSAL:
                kv_len = gl.minimum(seq_len, m0 + BLOCK_M)
            else:
                kv_len = seq_len
            n_blocks = (kv_len + BLOCK_N - 1) // BLOCK_N
            # The first block a mask may cut: the last one, or (causal) the first to reach past
            # the tile's first query.
            if IS_CAUSAL:
                first_masked = gl.minimum(m0 // BLOCK_N, n_blocks - 1)
            else:
                first_masked = n_blocks - 1

            cta_barrier()  # the previous tile is done in every warp: its buffers are free
            _issue_rows(q0, q_base, stride_qt, m0, seq_len, HEAD_DIM, NUM_WARPS)
            if SPLIT:
                _issue_rows(q1, q_base + D0, stride_qt, m0, seq_len, HEAD_DIM - D0, NUM_WARPS)
            if TMA_KV:
                commit_group()
                for b in gl.static_range(AHEAD):
                    if b < n_blocks:
                        sb = (g0 + b) % STAGES
                        _issue_block_tma(Kd0, Vd0, Kd1, Vd1, k0.index(sb), v0.index(sb),
                                         k1.index(sb), v1.index(sb), ready.index(sb),
                                         row0 + b * BLOCK_N, kcol, kcol, D0, D1, BLOCK_N)
                wait_group(0)  # the queries, before block 0's barrier
                fence_async_shared()
            else:
                for b in gl.static_range(AHEAD):
                    if b < n_blocks:
                        _issue_block(k0.index(b), v0.index(b), k1.index(b), v1.index(b), k_base,
                                     v_base, stride_kt, stride_vt, b * BLOCK_N, kv_len, HEAD_DIM,
                                     D0, D1, NUM_WARPS)
                    commit_group()

            if SINK_MODE == NULL_LOGIT_C:
                m_i = gl.full([BLOCK_M], 0.0, gl.float32, row_layout) + sink_raw * qk_scale
                l_i = gl.full([BLOCK_M], 1.0, gl.float32, row_layout)
            else:
                m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, row_layout)
                l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
            acc0 = gl.zeros([BLOCK_M, D0], gl.float32, o0_layout)
            acc1 = gl.zeros([BLOCK_M, D1B], gl.float32, o1_layout)
            if DEFER_PV:  # carried round the loop as wgmmas in flight
                acc0 = warpgroup_mma_init(acc0)
                if SPLIT:
                    acc1 = warpgroup_mma_init(acc1)

            if OVERLAP:
                # Block 0 alone; then block j's scores with block j - 1's P · V, the softmax of
                # j while that P · V runs, the output rescaled once it is done.
                _next_block(0, g0, n_blocks, seq_len, kv_len, k0, v0, k1, v1, ready, Kd0, Vd0, Kd1,
                            Vd1, row0, kcol, kcol, k_base, v_base, stride_kt, stride_vt, AHEAD,
                            STAGES, BLOCK_N, HEAD_DIM, D0, D1, NUM_WARPS, TMA_KV)
                s = _scores(q0, q1, k0, k1, g0 % STAGES, zeros_s, SPLIT)
                s = warpgroup_mma_wait(0, deps=(s, ))
                p, alpha, m_i, l_i = _softmax_block(s, 0, first_masked, kv_len, m0, m_i, l_i,
                                                    sink_raw, qk_scale, rows_s, cols_s, BLOCK_N,
                                                    IS_CAUSAL, SINK_MODE)
                a0 = gl.convert_layout(p.to(dtype), p0_layout)
                for j in range(1, n_blocks):
                    _next_block(j, g0, n_blocks, seq_len, kv_len, k0, v0, k1, v1, ready, Kd0, Vd0,
                                Kd1, Vd1, row0, kcol, kcol, k_base, v_base, stride_kt, stride_vt,
                                AHEAD, STAGES, BLOCK_N, HEAD_DIM, D0, D1, NUM_WARPS, TMA_KV)
                    s = _scores(q0, q1, k0, k1, (g0 + j) % STAGES, zeros_s, SPLIT)
                    acc0, acc1 = _accumulate(a0, v0, v1, (g0 + j - 1) % STAGES, acc0, acc1,
                                             p1_layout, SPLIT)
                    # wgmma groups finish in order: with the P · V still pending, S is done.
                    if SPLIT:
                        s = warpgroup_mma_wait(2, deps=(s, ))
                    else:
                        s = warpgroup_mma_wait(1, deps=(s, ))
                    p, alpha, m_i, l_i = _softmax_block(s, j, first_masked, kv_len, m0, m_i, l_i,
                                                        sink_raw, qk_scale, rows_s, cols_s,
                                                        BLOCK_N, IS_CAUSAL, SINK_MODE)
                    acc0, acc1 = _wait_pv(acc0, acc1, SPLIT)
                    acc0 = acc0 * _row(alpha, o0_layout)
                    if SPLIT:
                        acc1 = acc1 * _row(alpha, o1_layout)
                    a0 = gl.convert_layout(p.to(dtype), p0_layout)
                acc0, acc1 = _accumulate(a0, v0, v1, (g0 + n_blocks - 1) % STAGES, acc0, acc1,
                                         p1_layout, SPLIT)
                acc0, acc1 = _wait_pv(acc0, acc1, SPLIT)
            else:
                for j in range(0, n_blocks):
                    _next_block(j, g0, n_blocks, seq_len, kv_len, k0, v0, k1, v1, ready, Kd0, Vd0,
                                Kd1, Vd1, row0, kcol, kcol, k_base, v_base, stride_kt, stride_vt,
                                AHEAD, STAGES, BLOCK_N, HEAD_DIM, D0, D1, NUM_WARPS, TMA_KV)
                    slot = (g0 + j) % STAGES
                    s = _scores(q0, q1, k0, k1, slot, zeros_s, SPLIT)
                    if DEFER_PV:  # block j - 1's P · V too
                        if SPLIT:
                            s, acc0, acc1 = warpgroup_mma_wait(0, deps=(s, acc0, acc1))
                        else:
                            s, acc0 = warpgroup_mma_wait(0, deps=(s, acc0))
                    else:
                        s = warpgroup_mma_wait(0, deps=(s, ))
                    p, alpha, m_i, l_i = _softmax_block(s, j, first_masked, kv_len, m0, m_i, l_i,
                                                        sink_raw, qk_scale, rows_s, cols_s,
                                                        BLOCK_N, IS_CAUSAL, SINK_MODE)
                    a0 = gl.convert_layout(p.to(dtype), p0_layout)
                    acc0 = acc0 * _row(alpha, o0_layout)
                    if SPLIT:
                        acc1 = acc1 * _row(alpha, o1_layout)
                    acc0, acc1 = _accumulate(a0, v0, v1, slot, acc0, acc1, p1_layout, SPLIT)
                    if not DEFER_PV:
                        acc0, acc1 = _wait_pv(acc0, acc1, SPLIT)
                if DEFER_PV:
                    acc0, acc1 = _wait_pv(acc0, acc1, SPLIT)
            wait_group(0)  # the empty groups of the last blocks
            if TMA_KV:
                g0 += n_blocks

            inv_l = 1.0 / l_i
            _store_part(acc0, inv_l, q0, o_base, stride_ot, m0, seq_len, HEAD_DIM, NUM_WARPS)
            if SPLIT:
                _store_part(acc1, inv_l, q1, o_base + D0, stride_ot, m0, seq_len, HEAD_DIM - D0,
                            NUM_WARPS)


# ---- launcher ------------------------------------------------------------------------------------

def full_unavailable(device: torch.device) -> str | None:
    """Why the kernel cannot run on ``device`` (None when it can)."""
    return hopper_unavailable(device)


def tma_unavailable(p: Problem, k, v) -> str | None:
    """Why TMA cannot read this call's keys and values (None when it can): it reads boxes of the
    [tokens, heads × head dim] view, so each token's heads must be back to back, and the head dim
    must be its parts exactly (72 = 64 + 16 would read 8 columns of the next head)."""
    if HostTensorDescriptor is None:
        return "this Triton's Gluon has no host-side TMA descriptors"
    if sum(head_dim_parts(p.head_dim)) != p.head_dim:
        return f"head dim {p.head_dim} is not {' + '.join(map(str, head_dim_parts(p.head_dim)))}"
    for name, x in (("k", k), ("v", v)):
        if x.stride(2) != 1 or x.stride(1) != p.head_dim:
            return f"{name}'s heads are not stored back to back (strides {tuple(x.stride())})"
    if k.shape[0] >= 2 ** 31:
        return "2**31 tokens or more (TMA coordinates are int32)"
    return None


def _tma_templates(p: Problem, k, v, block_n: int) -> tuple:
    """The four descriptors' fields for this call signature (TMA's boxes: ``block_n`` rows of one
    part of the head dim, K and V, part 0 then part 1), checked by the descriptor class itself;
    () where it refuses them. Each call copies them with its own tensors (``_descriptors``)."""
    d0, d1 = head_dim_parts(p.head_dim)
    templates = []
    for width in (d0, d1 or d0):
        layout = gl.NVMMASharedLayout(swizzle_byte_width=min(128, 2 * width), element_bitwidth=16,
                                      rank=2)
        for x in (k, v):
            try:
                desc = HostTensorDescriptor(x, [x.shape[0], x.shape[1] * p.head_dim],
                                            [x.stride(0), 1], [block_n, width], layout)
            except AssertionError:  # its checks are asserts (alignment, strides, box)
                return ()
            templates.append(dict(vars(desc)))
    return tuple(templates)


def takes(p: Problem) -> str | None:
    """Why the kernel does not take a validated call (None when it does), platform aside."""
    if p.window_q or p.window_k:
        return "a sliding window (the window kernels take those)"
    if p.dtype not in DTYPES or p.out_dtype != p.dtype:
        return f"{p.dtype} -> {p.out_dtype} (fp16/bf16, output alike)"
    if p.head_dim > MAX_HEAD_DIM:
        return f"head dim {p.head_dim} > {MAX_HEAD_DIM}"
    if not p.host_bound:
        return "no host-side length bound (max_input_len on the device)"
    if p.cu_seqlens:
        return "cumulative offsets (the MiMo wrapper's calls take the portable kernel)"
    if p.empty or p.num_seqs > MAX_GRID_YZ or p.q_heads > MAX_GRID_YZ:
        return "empty, or more sequences or heads than a grid axis holds"
    return None


_LAUNCHER = DirectLauncher(_full_attention_kernel) if gluon is not None else None
_FAILED_VARIANTS: set = set()
_COMPILED_VARIANTS: set = set()


@dataclasses.dataclass(frozen=True)
class FullLaunch:
    """A validated problem bound to the Hopper full-attention kernel (``plan`` says whether it
    fits: ``takes`` and ``full_unavailable``)."""

    name = "full"
    tokens: int
    num_seqs: int
    q_heads: int
    block_m: int
    scalars: tuple  # the kernel's scalar arguments after the seven tensors, in order
    constexprs: dict
    options: dict
    variant: tuple  # the compiled kernel this launch needs: its constexprs and dtype
    #: K, V, K, V descriptors' fields (``_tma_templates``) where TMA reads them, else ()
    descriptors: tuple = ()
    token: int = dataclasses.field(default_factory=new_token, compare=False)
    # length bound -> (grid, the launcher's signature)
    _by_bound: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def plan(cls, p: Problem, q, k, v, o, b_start_loc, b_seq_len, sinks,
             tile: TileConfig | None = None) -> "FullLaunch | None":
        """A launch when the call fits the kernel, else None. ``tile``: another tile shape (the
        benchmarks' sweep), default ``default_tile``; a TMA tile takes cp.async where TMA cannot
        read the call (``tma_unavailable``). Declines rows that do not start on 16 bytes (the
        portable kernel takes those)."""
        if takes(p) is not None or full_unavailable(p.device) is not None:
            return None
        strides = stride_args(q, k, v, o, sinks, b_start_loc, b_seq_len)
        if any(x % 8 for x in strides[:8]):
            return None  # rows that do not start on 16 bytes: cp.async copies 4 bytes or more
        parts = head_dim_parts(p.head_dim)
        tile = tile or default_tile(p.is_causal)
        if tile.defer_pv and tile.overlap:
            raise ValueError(f"{tile}: defer_pv and overlap are two schedules; take one")
        if tile.stages - 1 - (tile.defer_pv or tile.overlap) < 1:
            raise ValueError(f"{tile}: no ring slot left to load ahead (stages too few)")
        descriptors = ()
        if tile.tma and tma_unavailable(p, k, v) is None:
            descriptors = _tma_templates(p, k, v, tile.block_n)
        constexprs = dict(HEAD_DIM=p.head_dim, D0=parts[0], D1=parts[1], BLOCK_M=tile.block_m,
                          BLOCK_N=tile.block_n, STAGES=tile.stages,
                          QUERIES_PER_KV=p.queries_per_kv, IS_CAUSAL=p.is_causal,
                          SINK_MODE=p.sink_mode, DEFER_PV=tile.defer_pv,
                          OVERLAP=tile.overlap, TMA_KV=bool(descriptors))
        if not descriptors:  # no descriptors: constants, compiled away
            constexprs.update(Kd0=None, Vd0=None, Kd1=None, Vd1=None)
        scalars = (p.tokens, p.log2_scale, 1.0 / p.scale, *(x // 8 for x in strides[:8]),
                   *strides[8:])
        options = launch_options(p.device, num_warps=tile.block_m // 16, maxnreg=tile.maxnreg)
        return cls(p.tokens, p.num_seqs, p.q_heads, tile.block_m, scalars, constexprs, options,
                   tuple(sorted(constexprs.items())) + (p.dtype, ), descriptors)

    def grid(self, max_len_hint: int) -> tuple:
        tiles = triton.cdiv(min(max(max_len_hint, 1), self.tokens), self.block_m)
        return (tiles, self.q_heads, self.num_seqs)

    def _bound(self, max_len_hint: int) -> tuple:
        bound = self._by_bound.get(max_len_hint)
        if bound is None:
            if len(self._by_bound) >= 64:
                self._by_bound.clear()
            grid = self.grid(max_len_hint)
            bound = self._by_bound[max_len_hint] = (grid, (self.token, grid))
        return bound

    def ready(self, max_len_hint: int) -> tuple | None:
        """The direct launch of this bound, once launched (``DirectLauncher.ready``), else None."""
        bound = self._by_bound.get(max_len_hint)
        if bound is None or self.descriptors:  # descriptors hold each call's addresses
            return None
        return _LAUNCHER.ready(bound[1], bound[0], self.scalars)

    def _scalars(self, k, v) -> tuple:
        """The kernel's arguments after the seven tensors for this call: with TMA, each call's
        descriptors (its K's and V's addresses) after the fixed scalars. A copy of the plan's
        checked descriptor with another tensor of the same shape, strides and alignment is as
        valid as the original (``__call__`` checks the alignment)."""
        if not self.descriptors:
            return self.scalars
        made = []
        for i, fields in enumerate(self.descriptors):
            desc = object.__new__(HostTensorDescriptor)
            vars(desc).update(fields, base=v if i % 2 else k)
            made.append(desc)
        return (*self.scalars, *made)

    def __call__(self, q, k, v, o, b_start_loc, b_seq_len, sinks, max_len_hint: int) -> bool:
        """Launch; False (nothing launched, nothing written) when this kernel variant failed to
        compile, which is then reported once and never tried again: the caller falls back."""
        if (q.data_ptr() | k.data_ptr() | v.data_ptr() | o.data_ptr()) & 15:
            return False  # a view that starts off 16 bytes: cp.async cannot copy its rows whole
        grid, signature = self._bound(max_len_hint)
        tensors = (q, k, v, o, sinks if sinks is not None else q, b_start_loc, b_seq_len)
        scalars = self._scalars(k, v)
        if self.variant in _COMPILED_VARIANTS:
            _LAUNCHER(signature, grid, tensors, scalars, self.constexprs, self.options)
            return True
        if self.variant in _FAILED_VARIANTS:
            return False
        try:  # the first launch of a variant compiles it
            _LAUNCHER(signature, grid, tensors, scalars, self.constexprs, self.options)
        except Exception as e:  # noqa: BLE001 - an experimental compiler: fall back, say why
            _FAILED_VARIANTS.add(self.variant)
            warnings.warn(f"vllm-sinks: the Hopper full-attention kernel failed to compile "
                          f"({type(e).__name__}: {str(e)[:300]}); using the Triton kernel for this "
                          "shape", stacklevel=2)
            return False
        _COMPILED_VARIANTS.add(self.variant)
        return True
