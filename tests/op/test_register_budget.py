"""The Hopper kernel's register budget (``gluon_window_attention.TIGHT`` / ``ROOMY``): a variant
compiled at 168 registers runs three programs per SM; where that compile spills (Triton 3.9's ptxas
13.4: MiMo 4 × 16384 ran 1.9 × slower spilling, measured: H200, Triton 3.9.0), its first output stands and the
variant runs unspilled at two programs per SM from its next call on. A stand-in kernel reports the
spills a real compile would (``n_spills``, as Triton's compiled kernels do once loaded); the real
compiles are checked on the CPU (``inspect_window_walk.py``, CI) and the GPU (tests/gpu)."""

from __future__ import annotations

import types

import pytest
import torch

from vllm_sinks.v1.attention.ops import gluon_window_attention as gw
from vllm_sinks.v1.attention.ops.kernel_launcher import DirectLauncher


class Compiled:
    function = "fn-handle"
    packed_metadata = "meta"

    def __init__(self, n_spills):
        self.n_spills = n_spills

    def run(self, *args):
        pass


class SpillingKernel:
    """Compiles (counted, with its options) to a kernel that spills at ``spills_at`` registers or
    fewer."""

    def __init__(self, spills_at: int):
        self.spills_at = spills_at
        self.compiles: list = []
        self.params = [types.SimpleNamespace(name=n) for n in ("Q", "K", "V", "O", "S", "Start",
                                                               "Len", "scalar")]

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.compiles.append((grid, kwargs))
            return Compiled(136 if kwargs["maxnreg"] <= self.spills_at else 0)
        return launch


def _plan(variant) -> gw.WalkLaunch:
    """MiMo 1 × 4096 on an H200: 8 head groups of 16-token tiles, 132 SMs."""
    return gw.WalkLaunch(tokens_per_tile=16, num_seqs=1, tokens=4096, head_groups=8, sm_count=132,
                         scalars=(), strides=(), constexprs={},
                         options=dict(num_warps=4, maxnreg=168), variant=variant)


def _walk(monkeypatch, spills_at: int, variant) -> tuple[gw.WalkLaunch, SpillingKernel]:
    kernel = SpillingKernel(spills_at)
    launcher = DirectLauncher(kernel)
    launcher._stream = (lambda device: 0, lambda: 0)  # no GPU driver here
    monkeypatch.setattr(gw, "_LAUNCHER", launcher)
    monkeypatch.setattr(gw, "_BUDGETS", {})
    return _plan(variant), kernel


def _call(walk, n=4096):
    x = torch.zeros(64)
    assert walk(x, x, x, x, x, x, None, n)


def test_a_spilling_compile_moves_its_variant_to_two_programs_per_sm(monkeypatch):
    walk, kernel = _walk(monkeypatch, spills_at=168, variant=("spills",))
    _call(walk)  # compiles at 168: spills; this output stands
    assert walk.budget() is gw.ROOMY and walk.ready(4096) is None  # nothing keeps the spilling kernel
    _call(walk)  # compiles again, unspilled
    _call(walk)
    assert [c[1]["maxnreg"] for c in kernel.compiles] == [168, 255]
    # 256 tiles over 8 head groups: three programs per SM give 43 programs per group (6 tiles
    # each), two give 32 (8 tiles each)
    assert [c[0][1] for c in kernel.compiles] == [43, 32]
    assert walk._by_bound[(4096, None)].signature[-1] == 255
    # another plan of the same variant starts at the budget it needs
    other = _plan(("spills",))
    assert other.budget() is gw.ROOMY and other.chunking(4096) == (8, 32)


def test_an_unspilled_compile_keeps_three_programs_per_sm(monkeypatch):
    walk, kernel = _walk(monkeypatch, spills_at=0, variant=("fits",))
    for _ in range(3):
        _call(walk)
    assert walk.budget() is gw.TIGHT and len(kernel.compiles) == 1
    assert kernel.compiles[0][1]["maxnreg"] == 168 and kernel.compiles[0][0][1] == 43


@pytest.mark.parametrize("budget", [gw.TIGHT, gw.ROOMY])
def test_budgets_fit_the_register_file(budget):
    """Programs per SM × 128 threads × registers (allocated in 8s) fit Hopper's 64K registers, and
    one more program would not."""
    regs = -(-budget.maxnreg // 8) * 8
    assert budget.programs_per_sm * 128 * regs <= 65536 < (budget.programs_per_sm + 1) * 128 * regs
