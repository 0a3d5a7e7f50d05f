"""Conditional (lazy) rescaling in the key loop (``LaunchConfig.lazy_tau``) against the reference.

The running max only moves, with the accumulator rescale, when a row's block max exceeds it by more
than ``lazy_tau`` (log2 units). Thresholds from tiny (a rescale in nearly every block) to large (the
first block's max is kept to the end), large sink values, every sink mode, both loop layouts.
"""

from __future__ import annotations

import pytest
import torch

from prefill_op_cases import check_tolerance, check_writes, make_case
from vllm_sinks.v1.attention.ops.triton_prefill_attention import LaunchConfig, _validate, launch

WINDOWS = {
    "window": dict(is_causal=False, window_q=20, window_k=17),
    "causal-window": dict(is_causal=True, window_q=30, window_k=0),
}


@pytest.mark.parametrize("tau", [0.25, 8.0, 20.0])
@pytest.mark.parametrize("split", [True, False], ids=["split", "one-loop"])
@pytest.mark.parametrize("sink_mode", ["key0", "null", "none"])
@pytest.mark.parametrize("win", list(WINDOWS))
def test_lazy_rescale_against_reference(tau, split, sink_mode, win):
    w = WINDOWS[win]
    dtype = torch.float16 if tau == 8.0 else torch.float32
    case = make_case([70, 7, 0, 41, 1], 8, 2, 32, dtype, gaps=1, sink_mode=sink_mode, sink_std=3.0,
                     generator=torch.Generator().manual_seed(5), **w)
    p = _validate(case.q, case.k, case.v, case.o, case.b_start_loc, case.b_seq_len, 100,
                  w["is_causal"], None, w["window_q"], w["window_k"], case.sinks,
                  sink_mode == "key0")
    cfg = LaunchConfig(block_t=8, gp=2, block_n=16, num_warps=4, num_stages=1, split_loops=split,
                       lazy_tau=tau)
    launch(p, cfg, case.q, case.k, case.v, case.o, case.b_start_loc, case.b_seq_len, case.sinks)
    check_writes(case)
    check_tolerance(case)
