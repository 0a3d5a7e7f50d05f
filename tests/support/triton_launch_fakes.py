"""Stand-ins for Triton's compiled-kernel launch objects, for CPU tests and the CPU host-cost benchmark.

A CPU cannot build a real ``CudaLauncher`` (its ``__init__`` loads the C launcher, which needs
libcuda). ``fake_runner`` makes an instance of the installed release's own ``CudaLauncher`` class
without running ``__init__``, with the attributes that ``__init__`` sets in that release (read from
its code) and a stand-in ``launch`` in place of the C function. The release's ``__call__`` then runs
unchanged on it: what it hands ``launch`` is what it would hand the C launcher on a GPU.

Imports Triton and torch only when called (nothing here is imported by the op).
"""

from __future__ import annotations

import contextlib
import types


class Recorder:
    """A ``launch`` that records its positional arguments."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __call__(self, *args):
        self.calls.append(args)


def launcher_class():
    """The installed release's CUDA launcher class (importable without a GPU)."""
    from triton.backends.nvidia.driver import CudaLauncher

    return CudaLauncher


def init_attributes(cls=None) -> set:
    """The attributes the release's ``CudaLauncher.__init__`` names (its code's ``co_names``)."""
    cls = cls or launcher_class()
    return set(cls.__init__.__code__.co_names)


def fake_runner(launch, *, global_scratch_size=0, profile_scratch_size=0, gsan=False, cls=None,
                cooperative=False, pdl=False):
    """An instance of the release's ``CudaLauncher`` (``__init__`` not run) whose C launch is
    ``launch``; every attribute that release's ``__init__`` sets is set, with stand-in values for
    the ones that need the driver (argument annotations, the packed kernel signature)."""
    cls = cls or launcher_class()
    names = init_attributes(cls)
    runner = object.__new__(cls)
    runner.launch = launch
    runner.num_ctas = 1
    runner.global_scratch_size = global_scratch_size
    runner.global_scratch_align = 128
    runner.profile_scratch_size = profile_scratch_size
    runner.profile_scratch_align = 1
    runner.launch_cooperative_grid = cooperative
    runner.launch_pdl = pdl
    if "arg_annotations" in names:
        runner.arg_annotations = ["annotation"] * 13  # stand-ins for the C PyKernelArg objects
    if "kernel_signature" in names:
        runner.kernel_signature = b"\x01" * 13
    if "gsan_enabled" in names:
        runner.gsan_enabled = gsan
    return runner


def kernel_params(kernel) -> list:
    """A jitted kernel's parameters (objects with ``name``), as ``DirectLauncher`` reads them; under
    Triton's interpreter, whose wrapper has none, from the Python function's signature."""
    import inspect

    params = getattr(kernel, "params", None)
    if params:
        return params
    return [types.SimpleNamespace(name=n) for n in inspect.signature(kernel.fn).parameters]


class FakeCompiled:
    """What ``kernel[grid](...)`` returns on a GPU: ``run`` (the launcher), ``function`` (the CUfunction
    handle), ``packed_metadata`` (num_warps, num_ctas, shared memory)."""

    def __init__(self, run, function=0x7F00_0000_1234, packed_metadata=(4, 1, 0)):
        self.run = run
        self.function = function
        self.packed_metadata = packed_metadata


class FakeKernel:
    """A jitted kernel whose ``kernel[grid](*args, **kw)`` 'compiles' (counted in ``compiles``) and
    returns a ``FakeCompiled`` around ``make_runner()``; ``params`` as the real kernel's."""

    def __init__(self, params, make_runner):
        self.params = params
        self.make_runner = make_runner
        self.compiles: list = []
        self.last = None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.compiles.append((grid, args, kwargs))
            self.last = FakeCompiled(self.make_runner())
            return self.last
        return launch


@contextlib.contextmanager
def fake_active_driver():
    """Triton 3.8's ``CudaLauncher.__call__`` reads ``triton.runtime.driver.active`` on every call
    (the CPU has none): a stand-in for the duration."""
    from triton.runtime import driver

    saved = driver._active
    driver._active = types.SimpleNamespace(name="fake-driver")
    try:
        yield
    finally:
        driver._active = saved
