"""How the Hopper window kernel spreads a call over the GPU (``WalkLaunch.chunking``): a program
takes ``chunk`` consecutive tiles of one sequence and head group; the host knows the length bound
and the total tokens, not each length. Whatever the lengths, the programs that have tiles must fit
one wave, and a long image beside short ones must get the wave (in a server's stream the slowest
MiMo pass, 16201 + 965 + 341 tokens, gave its 16201 tokens 128 programs on 132 SMs)."""

from __future__ import annotations

import random

import pytest
import triton

from vllm_sinks.v1.attention.ops import gluon_window_attention as gw


def _walk(lengths, head_groups=8, sm_count=132, tokens=None, t=16):
    return gw.WalkLaunch(tokens_per_tile=t, num_seqs=len(lengths),
                         tokens=sum(lengths) if tokens is None else tokens,
                         head_groups=head_groups, sm_count=sm_count, scalars=(), strides=(),
                         constexprs={}, options={}, variant=("chunking",))


def _busy_programs(lengths, chunk, head_groups, t=16):
    """Programs of the grid that have at least one tile."""
    return head_groups * sum(triton.cdiv(triton.cdiv(n, t), chunk) for n in lengths)


def _share_per_sequence(walk, bound):
    """The chunk that gives every sequence the same share of one wave at the bound."""
    per_seq = max(1, walk.sm_count * walk.budget().programs_per_sm // walk.head_groups
                  // walk.num_seqs)
    return max(4, triton.cdiv(triton.cdiv(min(bound, walk.tokens), walk.tokens_per_tile), per_seq))


@pytest.mark.parametrize("budget", [gw.TIGHT, gw.ROOMY])
def test_any_lengths_fit_one_wave_and_never_get_fewer_programs(monkeypatch, budget):
    monkeypatch.setattr(gw, "_BUDGETS", {("chunking",): budget})
    rng = random.Random(0)
    for _ in range(3000):
        n = rng.randint(1, 12)
        lengths = [rng.choice([rng.randint(1, 64), rng.randint(1, 20000)]) for _ in range(n)]
        head_groups = rng.choice([1, 2, 4, 8, 16, 32])
        sm_count = rng.choice([78, 114, 132])
        t = rng.choice([16, 8])
        walk = _walk(lengths, head_groups, sm_count, t=t)
        bound = max(lengths)
        chunk, num_chunks = walk.chunking(bound)
        assert chunk >= 4 and num_chunks == triton.cdiv(triton.cdiv(bound, t), chunk)
        # never coarser than one wave's share per sequence (the first of the two chunk rules) ...
        assert chunk <= _share_per_sequence(walk, bound)
        # ... and the busy programs fit one wave whenever the sequences fit one at all
        resident = sm_count * budget.programs_per_sm
        if head_groups * n <= resident and chunk > 4:
            assert _busy_programs(lengths, chunk, head_groups, t) <= resident, (lengths, chunk)


def test_equal_lengths_keep_their_share_of_the_wave():
    for n, length in ((1, 4096), (4, 16384), (3, 1000), (32, 64), (8, 2048)):
        walk = _walk([length] * n)
        assert walk.chunking(length)[0] == _share_per_sequence(walk, length)


def test_a_long_image_beside_short_ones_gets_the_wave():
    lengths = [16201, 965, 341]
    walk = _walk(lengths)  # MiMo on an H200: 8 head groups, 3 programs per SM unspilled
    chunk, _ = walk.chunking(max(lengths))
    busy_long = _busy_programs(lengths[:1], chunk, 8)
    # the share per sequence gave it 128 of the wave's 396 programs
    assert busy_long >= 2.5 * _busy_programs(lengths[:1], _share_per_sequence(walk, 16201), 8)
    assert _busy_programs(lengths, chunk, 8) <= 132 * 3


def test_padded_tokens_never_make_chunks_coarser():
    """Rows past the sequences (a padded batch) count as tokens; the bound still caps them."""
    lengths = [4096, 4096]
    padded = _walk(lengths, tokens=3 * 8192)
    assert padded.chunking(4096) == _walk(lengths).chunking(4096)
