"""Which of two launches of one call runs faster here: measured once, on the call itself.

The front door (``triton_prefill_attention``) may hand a call to upstream vLLM's op instead of ours
(full attention, where upstream's kernel is sometimes the faster one). A fixed list of shapes cannot
be right on every shape, GPU and Triton (issue 19: D 128 lost on three shapes, D 80 won on one),
so the choice is timed per call signature, the first time the signature is seen, and cached with
the plan:

- both candidates run once untimed (the first launch compiles), then ``ROUNDS`` rounds, each
  candidate's block of calls in turn, on the call's own tensors (each candidate writes the same
  output; the caller's launch afterwards writes it again);
- a block is wall-clock time between two device synchronisations, so it holds what the call costs
  the caller: the kernel when it is GPU-bound, the host cost when it is not (small calls);
- a block holds enough calls back to back to last ``BLOCK_S`` (``MIN_CALLS`` to ``MAX_CALLS``),
  the best block of the rounds counts;
- the challenger (ours) wins only when it is faster than the default (upstream) by ``MARGIN``: a
  tie, or noise, keeps upstream's own behaviour.

Never measured inside CUDA-graph capture (a synchronisation is illegal there) or ``torch.compile``
tracing: ``may_measure`` says so, and the caller then takes the default without caching it.
The cost: the measured signature's first call takes ~2 × ``ROUNDS`` × max(``BLOCK_S``, 2 calls)
more (~15 ms for calls under 1 ms, ~90 ms for a 7 ms call), once per signature and process; a
synchronisation then is the op's only one.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

#: Rounds of timed blocks per candidate (the best counts); LONG_ROUNDS where a block lasts over
#: LONG_BLOCK_S.
ROUNDS, LONG_ROUNDS, LONG_BLOCK_S = 3, 2, 5e-3
#: Wall-clock seconds a timed block should last, in MIN_CALLS to MAX_CALLS calls back to back: an
#: eager caller's host cost overlaps the previous call's kernel, which a block of one call would
#: not show (session 14, Triton 3.8.0: blocks of one call rated ours 1.06-1.24 x upstream on calls
#: of 100-500 µs where it ran at 0.74-0.94 x back to back).
BLOCK_S = 2e-3
MIN_CALLS, MAX_CALLS = 2, 64
#: The challenger must be this much faster than the default (time ratio) to be chosen.
MARGIN = 0.97


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
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        run()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls


def challenger_wins(default: Callable[[], object], challenger: Callable[[], object]) -> tuple[bool, float]:
    """(whether ``challenger`` runs faster than ``default`` by MARGIN, default's time / challenger's)
    on this GPU, each a call of the same op on the same tensors. Only where ``may_measure``."""
    runs = (default, challenger)
    first = [_block_s(run, 1) for run in runs]  # compiles; a rough time per call
    first = [_block_s(run, 1) for run in runs]
    calls = [max(MIN_CALLS, min(MAX_CALLS, int(BLOCK_S / max(t, 1e-7)))) for t in first]
    rounds = LONG_ROUNDS if max(c * t for c, t in zip(calls, first)) > LONG_BLOCK_S else ROUNDS
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for i, run in enumerate(runs):
            best[i] = min(best[i], _block_s(run, calls[i]))
    return best[1] <= MARGIN * best[0], best[0] / best[1]
