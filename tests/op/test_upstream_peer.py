"""vLLM's own prefill op, loaded as a benchmark peer (benchmarks/kernels/peers.py), against our reference.

It checks that the peer the benchmarks time is the op they claim it is: loaded from the vllm 0.33.0
file through the shim, it computes the same attention as our reference in every mode it has (no
window / two-sided / causal window; no sinks, null-logit sinks, key-0 sinks). fp32 through Triton's
interpreter on the CPU, or compiled on a GPU.

Skipped unless the fetched files are there (``bash benchmarks/kernels/fetch_peers.sh .gpu/peers``, or
``VLLM_SINKS_PEERS_DIR``): nothing of vLLM is committed, and CI does not fetch it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from prefill_op_cases import DEVICE, make_case, reference
from vllm_sinks.v1.attention.ops.prefill_attention_reference import covered_rows, relative_l2

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.kernels import peers  # noqa: E402

PEERS_DIR = Path(os.environ.get("VLLM_SINKS_PEERS_DIR", peers.DEFAULT_DIR))
pytestmark = pytest.mark.skipif(not (PEERS_DIR / peers.UPSTREAM_FILE).is_file(),
                                reason=f"upstream op not fetched ({PEERS_DIR / peers.UPSTREAM_FILE}; "
                                       "run benchmarks/kernels/fetch_peers.sh .gpu/peers)")

# fp32 inputs against the fp64 reference. The interpreter computes upstream's fp32 dots in IEEE fp32;
# compiled on a GPU they run in TF32 (upstream leaves tl.dot's default precision; ours asks for IEEE),
# about 1e-3 relative: that bound is an estimate, not yet measured on the device.
TOL = 1e-5 if DEVICE == "cpu" else 1e-2

# (lens, window_q, window_k, is_causal)
SHAPES = {
    "full": ((40, 40), None, None, False),
    "window 8/8": ((40, 40), 8, 8, False),
    "causal window 11": ((40, 40), 11, 0, True),
    "uneven, window 5/13": ((40, 23), 5, 13, False),
}


@pytest.fixture(scope="module")
def upstream():
    op = peers.upstream_op(PEERS_DIR)
    assert op is not None, "the upstream op file is there but does not load through the shim"
    return op


# Upstream divides the accumulator of every row of a query block by its softmax sum, rows past the
# sequence end included (0/0 without a null sink); those rows are never stored. The interpreter warns.
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
@pytest.mark.parametrize("sink_mode", ["none", "null", "key0"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_upstream_op_matches_reference(upstream, shape, sink_mode):
    lens, wq, wk, causal = SHAPES[shape]
    case = make_case(lens, 4, 2, 64, torch.float32, is_causal=causal, window_q=wq, window_k=wk,
                     sink_mode=sink_mode, sink_std=2.0, generator=torch.Generator().manual_seed(7))
    upstream(*case.call_args(), max(lens), **case.op_kwargs())
    rows = covered_rows(case.b_start_loc, case.b_seq_len, case.tokens)
    err = relative_l2(case.o[rows], reference(case)[rows])
    assert err <= TOL, f"upstream op vs reference: {err:.2e}"


def test_upstream_sinks_matter(upstream):
    """The sinks reach upstream's kernel: the same call without them is far from the reference."""
    case = make_case((40, 40), 4, 2, 64, torch.float32, window_q=8, window_k=8, sink_mode="key0",
                     sink_std=2.0, generator=torch.Generator().manual_seed(3))
    upstream(*case.call_args(), 40, **dict(case.op_kwargs(), sinks=None))
    assert relative_l2(case.o, reference(case)) > 1e-2


def test_upstream_takes_tensor_max_len(upstream):
    """A one-element tensor max_input_len (as MiMo passes it) is turned into the int upstream needs."""
    case = make_case((40, 23), 4, 2, 64, torch.float32, sink_mode="null",
                     generator=torch.Generator().manual_seed(5))
    upstream(*case.call_args(), torch.tensor(40, device=DEVICE), **case.op_kwargs())
    assert relative_l2(case.o, reference(case)) <= TOL


def test_shim_leaves_no_vllm_behind(upstream):
    """The shim's fake ``vllm`` modules are gone after loading; the op lives under a private name."""
    fake = [name for name, m in sys.modules.items()
            if (name == "vllm" or name.startswith("vllm.")) and m is not None
            and m.__name__.startswith("_vllm_sinks_peer_shim.")]
    assert fake == []
    assert upstream.module.__name__.startswith("_vllm_sinks_peer_")
    assert upstream.module.__file__ == str((PEERS_DIR / peers.UPSTREAM_FILE).resolve())
