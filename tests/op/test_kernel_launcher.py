"""The direct launch path (``kernel_launcher.DirectLauncher``) with a stand-in kernel: what it hands
Triton's launcher, and when it goes back through Triton (new signature, new pointer alignment,
launch hooks). The real kernels go through it on the GPU (tests/gpu)."""

from __future__ import annotations

import types

import torch

from vllm_sinks.v1.attention.ops import kernel_launcher
from vllm_sinks.v1.attention.ops.kernel_launcher import DirectLauncher


class FakeCompiled:
    function = "fn-handle"
    packed_metadata = "meta"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class FakeKernel:
    """``kernel[grid](*args, **kw)`` compiles (counted) and returns one compiled kernel per call."""

    params = [types.SimpleNamespace(name=n)
              for n in ("Q", "K", "V", "O", "S", "Start", "Len", "n", "scale", "BLOCK", "MODE")]

    def __init__(self):
        self.compiles = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.compiles.append((grid, args, kwargs))
            self.last = FakeCompiled()
            return self.last
        return launch


def _launcher(kernel) -> DirectLauncher:
    launcher = DirectLauncher(kernel)
    launcher._stream = (lambda device: f"stream{device}", lambda: 3)  # no GPU driver here
    return launcher


def test_first_call_compiles_then_launches_directly():
    kernel = FakeKernel()
    launcher = _launcher(kernel)
    x = torch.zeros(64)
    constexprs = dict(MODE=2, BLOCK=16)  # any order: the launcher orders them as the kernel does
    assert launcher("sig", (4, 1, 1), (x,) * 7, (64, 0.5), constexprs, dict(num_warps=4)) is kernel.last
    assert len(kernel.compiles) == 1 and kernel.compiles[0][2] == dict(MODE=2, BLOCK=16, num_warps=4)
    compiled = kernel.last
    y = torch.ones(64)
    launcher("sig", (4, 1, 1), (y,) * 7, (64, 0.25), constexprs, dict(num_warps=4))
    assert len(kernel.compiles) == 1  # no second trip through Triton
    (run,) = compiled.runs
    assert run[:9] == (4, 1, 1, "stream3", "fn-handle", "meta", None, None, None)
    assert run[9] is y and run[16:] == (64, 0.25, 16, 2)  # this call's tensors, constexprs in order


def test_new_signature_or_alignment_goes_through_triton():
    kernel = FakeKernel()
    launcher = _launcher(kernel)
    x = torch.zeros(64)
    launcher("a", (1, 1, 1), (x,) * 7, (64, 1.0), dict(BLOCK=16, MODE=0), {})
    launcher("b", (1, 1, 1), (x,) * 7, (64, 1.0), dict(BLOCK=16, MODE=0), {})
    assert len(kernel.compiles) == 2
    misaligned = x[1:]  # 4 bytes past a 16-byte boundary: Triton specialises on that
    for _ in range(2):  # never cached: every such call goes through Triton
        launcher("a", (1, 1, 1), (x,) * 6 + (misaligned,), (63, 1.0), dict(BLOCK=16, MODE=0), {})
    assert len(kernel.compiles) == 4
    launcher("a", (1, 1, 1), (x,) * 7, (64, 1.0), dict(BLOCK=16, MODE=0), {})
    assert len(kernel.compiles) == 4  # the aligned entry is still there


def test_launch_hooks_send_every_call_through_triton(monkeypatch):
    kernel = FakeKernel()
    launcher = _launcher(kernel)
    x = torch.zeros(64)
    launcher("a", (1, 1, 1), (x,) * 7, (64, 1.0), dict(BLOCK=16, MODE=0), {})
    monkeypatch.setattr(kernel_launcher, "_hooks_set", lambda: True)
    launcher("a", (1, 1, 1), (x,) * 7, (64, 1.0), dict(BLOCK=16, MODE=0), {})
    assert len(kernel.compiles) == 2


def test_interpreter_results_are_not_cached():
    """Triton's interpreter returns no compiled kernel: every call goes through it."""
    class Interpreted(FakeKernel):
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                self.compiles.append(grid)
            return launch

    kernel = Interpreted()
    launcher = _launcher(kernel)
    for _ in range(2):
        assert launcher("a", (1, 1, 1), (torch.zeros(4),) * 7, (4, 1.0), dict(BLOCK=16, MODE=0), {}) is None
    assert len(kernel.compiles) == 2
