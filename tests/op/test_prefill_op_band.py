"""Exhaustive check of the op's key-band arithmetic (``_key_band``), the part most prone to off-by-one.

A probe kernel evaluates the very ``@triton.jit`` helper the op uses on vectors of (tile, windows,
sequence length) and the test compares, tile by tile, with brute force over the visibility rule:

- every key some row of the tile sees lies in one of the ``n_blocks`` blocks starting at ``lo``;
- no block is wasted (each holds a key some row sees);
- the mask-free blocks ``first_full … end_full - 1`` are exactly the blocks every row sees entirely.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import triton
import triton.language as tl

from prefill_op_cases import DEVICE
from vllm_sinks.v1.attention.ops.prefill_attention_portable import _key_band


@triton.jit
def _band_probe(QStart, QLast, SeqLen, WinQ, WinK, Out, n, BLOCK_N: tl.constexpr,
                IS_CAUSAL: tl.constexpr, HAS_WQ: tl.constexpr, HAS_WK: tl.constexpr,
                SKIP_KEY0: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    qs = tl.load(QStart + offs, mask=ok, other=0)
    ql = tl.load(QLast + offs, mask=ok, other=0)
    seq_len = tl.load(SeqLen + offs, mask=ok, other=1)
    wq = tl.load(WinQ + offs, mask=ok, other=1)
    wk = tl.load(WinK + offs, mask=ok, other=1)
    lo, first_full, end_full, n_blocks = _key_band(qs, ql, seq_len, wq, wk, BLOCK_N, IS_CAUSAL,
                                                   HAS_WQ, HAS_WK, SKIP_KEY0)
    tl.store(Out + offs * 4 + 0, lo, mask=ok)
    tl.store(Out + offs * 4 + 1, first_full, mask=ok)
    tl.store(Out + offs * 4 + 2, end_full, mask=ok)
    tl.store(Out + offs * 4 + 3, n_blocks, mask=ok)


WINDOWS = [1, 2, 3, 5, 8, 13, 16, 17, 31, 33]
LENGTHS = [1, 7, 40, 77]
TILE_TOKENS = [1, 4, 16]


def _tiles(has_wq, has_wk):
    """All (q_start, q_last, seq_len, wq, wk) combinations, as int32 tensors."""
    rows = []
    for seq_len, bt in itertools.product(LENGTHS, TILE_TOKENS):
        for q_start in range(0, seq_len, bt):
            q_last = min(q_start + bt, seq_len) - 1
            for wq in (WINDOWS if has_wq else [0]):
                for wk in (WINDOWS if has_wk else [0]):
                    rows.append((q_start, q_last, seq_len, wq, wk))
    return torch.tensor(rows, dtype=torch.int32).T.contiguous()


@pytest.mark.parametrize("block_n", [4, 16, 32])
@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=4)),
                         ids=lambda f: "".join(n for n, on in zip(("C", "Q", "K", "0"), f) if on) or "-")
def test_key_band_matches_brute_force(block_n, flags):
    is_causal, has_wq, has_wk, skip_key0 = flags
    qs, ql, seq_len, wq, wk = _tiles(has_wq, has_wk)
    n = qs.numel()
    out = torch.full((n, 4), -7, dtype=torch.int32, device=DEVICE)
    args = [t.to(DEVICE) for t in (qs, ql, seq_len, wq, wk)]
    block = 1024
    _band_probe[(triton.cdiv(n, block),)](*args, out, n, BLOCK_N=block_n, IS_CAUSAL=is_causal,
                                          HAS_WQ=has_wq, HAS_WK=has_wk, SKIP_KEY0=skip_key0,
                                          BLOCK=block)
    lo, first_full, end_full, n_blocks = out.cpu().long().T

    # Brute force: rows r (query positions) and keys j of each tile, [tile, row, key].
    kmax = max(LENGTHS)
    rows = qs.long()[:, None] + torch.arange(16)[None, :]  # at most 16 query tokens per tile
    row_ok = rows <= ql.long()[:, None]
    keys = torch.arange(kmax)[None, None, :]
    i = rows[:, :, None]
    vis = keys < seq_len.long()[:, None, None]
    if is_causal:
        vis = vis & (keys <= i)
    if has_wq:
        vis = vis & (i - keys <= wq.long()[:, None, None])
    if has_wk:
        vis = vis & (keys - i <= wk.long()[:, None, None])
    if skip_key0:
        vis = vis & (keys >= 1)
    some_row = (vis & row_ok[:, :, None]).any(1)  # [tile, key]
    every_row = (vis | ~row_ok[:, :, None]).all(1)

    # Which block each key falls in (-1: before lo), per tile.
    blk = torch.div(keys[0] - lo[:, None], block_n, rounding_mode="floor")  # [tile, key]
    in_loop = (keys[0] >= lo[:, None]) & (blk < n_blocks[:, None])
    bad = some_row & ~in_loop
    assert not bad.any(), f"{int(bad.any(1).sum())} tiles miss keys they need"
    assert (first_full <= end_full).all() and (end_full <= n_blocks).all()

    nb_max = int(n_blocks.max()) if n else 0
    for b in range(nb_max):
        in_b = (blk == b) & in_loop
        has_block = b < n_blocks
        useful = (some_row & in_b).any(1)
        assert not (has_block & ~useful).any(), f"block {b} holds no visible key in some tiles"
        full_keys = torch.arange(b * block_n, (b + 1) * block_n)[None, :] + lo[:, None]
        idx = full_keys.clamp(max=kmax - 1)
        fully_visible = torch.gather(every_row, 1, idx).all(1) & (full_keys < kmax).all(1)
        fully_visible &= full_keys.max(1).values < seq_len.long()
        says_free = (first_full <= b) & (b < end_full)
        wrong = has_block & (says_free != fully_visible)
        assert not wrong.any(), (
            f"block {b}: mask-free classification wrong in {int(wrong.sum())} tiles, e.g. tile "
            f"{[int(x[wrong.nonzero()[0]]) for x in (qs, ql, seq_len, wq, wk)]}")
