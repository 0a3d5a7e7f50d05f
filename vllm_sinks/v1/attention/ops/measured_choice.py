"""Which of two launches of one call runs faster here: measured once, on the call itself.

The front door (``triton_prefill_attention``) may hand a call to upstream vLLM's op instead of ours
(full attention, where upstream's kernel is sometimes the faster one). A fixed list of shapes cannot
be right on every shape, GPU and Triton (issue 19: D 128 lost on three shapes, D 80 won on one),
so the choice is timed per call signature, the first time the signature is seen, and cached with
the plan:

- both candidates run once untimed (the first launch compiles), then ``ROUNDS`` rounds on the
  call's own tensors (each candidate writes the same output; the caller's launch afterwards writes
  it again); the candidates swap order every round, so a drift of clocks or caches over the
  measurement favours neither;
- a block is wall-clock time between two device synchronisations, so it holds what the call costs
  the caller: the kernel when it is GPU-bound, the host cost when it is not (small calls);
- a candidate's cost per call is the slope between a block of n calls and one of 2n calls, the best
  block of the rounds each: the fixed cost of a block (the two synchronisations, and the first
  call's launch, which nothing overlaps and which is ~40 µs for upstream's op against ~10 for ours)
  cancels out, which a block's mean per call does not (session 15, Triton 3.8.0: means over blocks
  of ~2 ms rated ours 1.04-1.14 x upstream on calls where it ran at 0.91-1.05 x back to back);
- n calls last about ``BLOCK_S`` (``MIN_CALLS`` to ``MAX_CALLS``);
- the challenger (ours) wins only when it is faster than the default (upstream) by ``MARGIN``: a
  tie, or noise, keeps upstream's own behaviour.

Never measured inside CUDA-graph capture (a synchronisation is illegal there) or ``torch.compile``
tracing: ``may_measure`` says so, and the caller then takes the default without caching it.
The cost: the measured signature's first call takes ~6 × ``ROUNDS`` × max(``BLOCK_S``, 2 calls)
more (~20 ms for calls under 0.3 ms, ~100 ms for a 7 ms call), once per signature and process; a
synchronisation then is the op's only one.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

#: Rounds per candidate (each a block of n and one of 2n calls; the best of each counts);
#: LONG_ROUNDS where a block of n lasts over LONG_BLOCK_S.
ROUNDS, LONG_ROUNDS, LONG_BLOCK_S = 3, 2, 4e-3
#: Wall-clock seconds a block of n calls should last, n in MIN_CALLS to MAX_CALLS: an eager
#: caller's host cost overlaps the previous call's kernel, which a block of one call would not show
#: (session 14, Triton 3.8.0: blocks of one call rated ours 1.06-1.24 x upstream on calls of
#: 100-500 µs where it ran at 0.74-0.94 x back to back).
BLOCK_S = 1e-3
MIN_CALLS, MAX_CALLS = 2, 64
#: The challenger must be this much faster than the default (time ratio) to be chosen: a win
#: smaller than what timing once per signature can resolve (a few % between runs of one shape on
#: the H200) is left to upstream, where a wrong choice would cost the caller.
MARGIN = 0.93


def may_measure(device: torch.device) -> bool:
    """Whether a call on ``device`` may be timed now: a CUDA device, not in graph capture, not
    traced by torch.compile."""
    if device.type != "cuda":
        return False
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and getattr(compiler, "is_compiling", lambda: False)():
        return False
    return not torch.cuda.is_current_stream_capturing()


def _block_s(run: Callable[[], object], calls: int) -> float:
    """Wall-clock seconds of ``calls`` calls back to back, between two synchronisations."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        run()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def challenger_wins(default: Callable[[], object], challenger: Callable[[], object]) -> tuple[bool, float]:
    """(whether ``challenger`` runs faster than ``default`` by MARGIN, default's time / challenger's)
    on this GPU, each a call of the same op on the same tensors. Only where ``may_measure``."""
    runs = (default, challenger)
    first = [_block_s(run, 1) for run in runs]  # compiles
    first = [_block_s(run, 1) for run in runs]  # a rough time per call, fixed costs included
    calls = [max(MIN_CALLS, min(MAX_CALLS, int(BLOCK_S / max(t, 1e-7)))) for t in first]
    rounds = LONG_ROUNDS if max(c * t for c, t in zip(calls, first)) > LONG_BLOCK_S else ROUNDS
    short, long = [float("inf")] * 2, [float("inf")] * 2
    for r in range(rounds):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            short[i] = min(short[i], _block_s(runs[i], calls[i]))
            long[i] = min(long[i], _block_s(runs[i], 2 * calls[i]))
    # Per call: the slope between the two block sizes; a slope that noise made non-positive
    # (host-bound calls of a few µs) falls back to the long block's mean.
    per_call = [max((lg - sh) / c if lg > sh else lg / (2 * c), 1e-9) for sh, lg, c in zip(short, long, calls)]
    return per_call[1] <= MARGIN * per_call[0], per_call[0] / per_call[1]
