"""The Python model of the FA3-structured kernel's ring protocol
(benchmarks/kernels/model_fa3_ring.py) passes every case, with and without the consumers' overlap and the softmax ping-pong, at the
kernel's ring size; and it does catch a ring too small for the overlap (so "ok" means something)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "kernels"))

import model_fa3_ring as model  # noqa: E402

NB = 9
NS = NB + 3 + 4  # gluon_window_attention_fa3: NB + 3 + EXTRA_SLOTS (not imported: it needs Triton)


@pytest.mark.parametrize("overlap", [False, "pairs", "tiles"])
@pytest.mark.parametrize("pingpong", [False, True], ids=["", "pingpong"])
@pytest.mark.parametrize("nc", [2, 3])
@pytest.mark.parametrize("window_q", [64, 127])
def test_ring_protocol(window_q, nc, pingpong, overlap):
    for seq_len, t_begin, t_end in model.CASES:
        for seed in range(2):
            model.run(seq_len, t_begin, t_end, NC=nc, NB=NB, NS=NS, window_q=window_q, seed=seed,
                      overlap=overlap, pingpong=pingpong)


def test_overlap_needs_more_ring_than_plain():
    """Holding this band while the next one loads takes NC more slots than the plain order: with
    2 consumers the plain protocol runs in NB + 1 slots, the overlap needs NB + 3 (the kernel has
    NB + 7)."""
    model.run(4096, 0, 256, NC=2, NB=NB, NS=NB + 1)
    with pytest.raises((AssertionError, RuntimeError)):
        for seed in range(3):
            model.run(4096, 0, 256, NC=2, NB=NB, NS=NB + 1, seed=seed, overlap="pairs")
    model.run(4096, 0, 256, NC=2, NB=NB, NS=NB + 3, overlap="pairs")
