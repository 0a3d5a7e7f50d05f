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
    monkeypatch.setattr(kernel_launcher, "hooks_set", lambda: True)
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


# ---- the direct C launch, against each release's own CudaLauncher --------------------------------
# A CPU cannot build a real CudaLauncher (libcuda); ``triton_launch_fakes.fake_runner`` makes one of
# the installed release's class with its __init__'s attributes and a recorder as its C launch. The
# release's own __call__ then shows what the C launch would get from Triton.

import pytest  # noqa: E402
from triton import knobs  # noqa: E402

from tests.support import triton_launch_fakes as fakes  # noqa: E402

PACKED = "arg_annotations" in fakes.init_attributes()  # Triton 3.7, 3.8; 3.6 is "flat"
CONSTEXPRS = dict(MODE=2, BLOCK=16)


@pytest.fixture(autouse=True)
def _driver():
    with fakes.fake_active_driver():  # Triton 3.8's __call__ reads driver.active
        yield


def _direct_setup(**runner_kwargs):
    """A launcher whose kernel compiles to a fake compiled kernel around a real-class runner."""
    launches = fakes.Recorder()
    kernel = fakes.FakeKernel(FakeKernel.params, lambda: fakes.fake_runner(launches, **runner_kwargs))
    return _launcher(kernel), kernel, launches


def _tensors(n=64):
    return tuple(torch.zeros(n) + i for i in range(7))


def _what_triton_passes(compiled, grid, stream, kernel_args):
    """The release's own CudaLauncher.__call__ on a fresh runner: its C launch's arguments."""
    launches = fakes.Recorder()
    runner = fakes.fake_runner(launches)
    type(runner).__call__(runner, *grid, stream, compiled.function, compiled.packed_metadata,
                          None, None, None, *kernel_args)
    (args,) = launches.calls
    return args


def test_direct_launch_passes_what_the_releases_launcher_passes():
    launcher, kernel, launches = _direct_setup()
    x = _tensors()
    launcher("sig", (4, 2, 1), x, (64, 0.5), CONSTEXPRS, dict(num_warps=4))
    assert len(kernel.compiles) == 1 and launches.calls == []  # compiled (through Triton), not launched here
    y = _tensors()
    assert launcher("sig", (4, 2, 1), y, (64, 0.25), CONSTEXPRS, dict(num_warps=4)) is kernel.last
    assert len(kernel.compiles) == 1
    (args,) = launches.calls
    ptrs = tuple(t.data_ptr() for t in y)  # this call's tensors, as ints
    kernel_args = (*ptrs, 64, 0.25, 16, 2)  # scalars, then constexprs in the kernel's order
    compiled = kernel.last
    assert args == _what_triton_passes(compiled, (4, 2, 1), "stream3", kernel_args)
    runner = compiled.run
    if PACKED:  # Triton 3.7 / 3.8: one C launch, the kernel's arguments as one tuple
        assert args == (4, 2, 1, "stream3", compiled.function, False, False, (4, 1, 0), None, None,
                        None, None, None, runner.arg_annotations, runner.kernel_signature, kernel_args)
    else:  # Triton 3.6: a C launcher per kernel, the kernel's arguments flat
        assert args == (4, 2, 1, "stream3", compiled.function, False, False, None, None, (4, 1, 0),
                        None, None, None, *kernel_args)
    assert all(type(a) is int for a in (args[-1][:7] if PACKED else args[-11:-4]))


def test_direct_launch_keeps_cooperative_and_pdl_flags():
    launcher, kernel, launches = _direct_setup(cooperative=True, pdl=True)
    for _ in range(2):
        launcher("sig", (1, 1, 1), _tensors(), (64, 1.0), CONSTEXPRS, {})
    (args,) = launches.calls
    assert args[5:7] == (True, True)


class _RecordingRunner(fakes.launcher_class()):
    """A runner whose ``compiled.run`` path is recorded (the fallback)."""

    def __call__(self, *args):
        self.runs.append(args)


def _fallback_setup(mutate):
    launches = fakes.Recorder()
    runs = []

    def make():
        runner = fakes.fake_runner(launches, cls=_RecordingRunner)
        runner.runs = runs
        mutate(runner)
        return runner
    kernel = fakes.FakeKernel(FakeKernel.params, make)
    return _launcher(kernel), kernel, launches, runs


def _drop(name):
    def mutate(runner):
        delattr(runner, name)
    return mutate


@pytest.mark.parametrize("why, mutate", [
    ("global scratch", lambda r: setattr(r, "global_scratch_size", 256)),
    ("profile scratch", lambda r: setattr(r, "profile_scratch_size", 64)),
    ("gsan", lambda r: setattr(r, "gsan_enabled", True)),
    ("no launch", _drop("launch")),
    ("no pdl flag", _drop("launch_pdl")),
    ("no cooperative flag", _drop("launch_cooperative_grid")),
    ("no scratch size", _drop("global_scratch_size")),
])
def test_fallback_to_compiled_run(why, mutate):
    launcher, kernel, launches, runs = _fallback_setup(mutate)
    launcher("sig", (2, 1, 1), _tensors(), (64, 1.0), CONSTEXPRS, {})
    y = _tensors()
    launcher("sig", (2, 1, 1), y, (64, 1.0), CONSTEXPRS, {})
    assert launches.calls == [], why
    (run,) = runs
    assert run[:9] == (2, 1, 1, "stream3", kernel.last.function, (4, 1, 0), None, None, None)
    assert all(a is b for a, b in zip(run[9:16], y)) and run[16:] == (64, 1.0, 16, 2)


def test_fallback_when_the_release_passes_something_else():
    """A release whose launcher hands its C launch another layout (the probe sees it)."""
    launches = fakes.Recorder()
    runs = []

    class FutureRunner(fakes.launcher_class()):
        def __call__(self, gx, gy, gz, stream, function, *args):
            runs.append(args)
            self.launch(gx, gy, gz, stream, function, "a new argument", *args)

    kernel = fakes.FakeKernel(FakeKernel.params, lambda: fakes.fake_runner(launches, cls=FutureRunner))
    launcher = _launcher(kernel)
    for _ in range(2):
        launcher("sig", (1, 1, 1), _tensors(), (64, 1.0), CONSTEXPRS, {})
    # runs: the probe (once, on a copy whose launch is a recorder), then the second call through
    # compiled.run with its tensors; the runner's own C launch only by that second call
    assert len(runs) == 2 and isinstance(runs[1][4], torch.Tensor)
    assert len(launches.calls) == 1 and launches.calls[0][5] == "a new argument"


def test_a_real_launch_hook_sends_calls_through_triton():
    launcher, kernel, launches = _direct_setup()
    launcher("sig", (1, 1, 1), _tensors(), (64, 1.0), CONSTEXPRS, {})

    def hook(metadata):
        pass
    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
        undo = lambda: chain.remove(hook)  # noqa: E731
    else:  # pragma: no cover - a release where the hook is a plain attribute
        knobs.runtime.launch_enter_hook = hook
        undo = lambda: setattr(knobs.runtime, "launch_enter_hook", chain)  # noqa: E731
    try:
        assert kernel_launcher.hooks_set()
        launcher("sig", (1, 1, 1), _tensors(), (64, 1.0), CONSTEXPRS, {})
    finally:
        undo()
    assert len(kernel.compiles) == 2 and launches.calls == []
    assert not kernel_launcher.hooks_set()
    launcher("sig", (1, 1, 1), _tensors(), (64, 1.0), CONSTEXPRS, {})
    assert len(kernel.compiles) == 2 and len(launches.calls) == 1


def test_misaligned_pointer_never_takes_the_direct_path():
    launcher, kernel, launches = _direct_setup()
    x = _tensors()
    launcher("sig", (1, 1, 1), x, (64, 1.0), CONSTEXPRS, {})
    for _ in range(2):
        launcher("sig", (1, 1, 1), x[:6] + (x[6][1:],), (63, 1.0), CONSTEXPRS, {})
    assert len(kernel.compiles) == 3 and launches.calls == []


def test_new_scalars_object_with_the_same_signature():
    """Scalars passed as another tuple (a float scalar changed) reach the launch."""
    launcher, kernel, launches = _direct_setup()
    launcher("sig", (1, 1, 1), _tensors(), (64, 1.0), CONSTEXPRS, {})
    launcher("sig", (1, 1, 1), _tensors(), (64, 2.0), CONSTEXPRS, {})
    kernel_args = launches.calls[0][-1] if PACKED else launches.calls[0][-11:]
    assert kernel_args[7:] == (64, 2.0, 16, 2)


def test_ready_launch_is_the_launchers_own_c_call():
    """``DirectLauncher.ready``: what a seen call launches with, nothing in between, is exactly what
    the launcher's own direct path hands the C launch for the same call."""
    launcher, kernel, launches = _direct_setup()
    assert launcher.ready("sig", (4, 2, 1), (64, 0.5)) is None  # never launched: nothing to reuse
    launcher("sig", (4, 2, 1), _tensors(), (64, 0.5), CONSTEXPRS, dict(num_warps=4))
    ready = launcher.ready("sig", (4, 2, 1), (64, 0.25))
    if not PACKED:  # Triton 3.6's per-kernel launcher: only the packed layout is made ready
        assert ready is None
        return
    y = _tensors()
    launcher("sig", (4, 2, 1), y, (64, 0.25), CONSTEXPRS, dict(num_warps=4))
    launch, get_stream, get_device, gx, gy, gz, head, rest = ready
    launch(gx, gy, gz, get_stream(get_device()), *head, (*(t.data_ptr() for t in y), *rest))
    first, second = launches.calls
    assert first == second
    assert launcher.ready("other", (4, 2, 1), (64, 0.25)) is None


def test_no_ready_launch_where_the_launcher_goes_through_compiled_run():
    launcher, kernel, launches = _direct_setup(global_scratch_size=64)
    launcher("sig", (1, 1, 1), _tensors(), (64, 1.0), CONSTEXPRS, {})
    assert launcher.ready("sig", (1, 1, 1), (64, 1.0)) is None
