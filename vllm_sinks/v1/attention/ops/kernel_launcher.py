"""Launch a compiled Triton (or Gluon) kernel again without Triton's per-call argument binding.

``kernel[grid](*args, **constexprs)`` binds and specialises every argument, hashes a cache key and
checks the kernel's globals on each call: 20–35 µs of CPU on the H200 machine, more than the
kernel itself for one MiMo image (a ViT calls the op with the same shapes in every layer). The
first call of a launch signature goes through Triton (it compiles); later calls with the same
signature hand the cached ``CompiledKernel`` straight to its launcher, as ``JITFunction.run``
itself does after its checks (Triton 3.6 – 3.8: ``CompiledKernel.run(gx, gy, gz, stream, function,
packed_metadata, launch_metadata, enter_hook, exit_hook, *all_args)``).

What makes this safe: the signature holds everything Triton specialises on. The caller's key
fixes shapes, strides, dtypes and every integer argument; only calls whose pointers are all 16-byte
aligned take the direct path. Launch hooks (a profiler) send every call through Triton again.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import triton

try:  # Triton >= 3.4
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton: always the slow path
    _knobs = None

_MAX_ENTRIES = 1024


def _hooks_set() -> bool:
    """Whether a launch hook (a profiler) is installed. Triton 3.8 keeps an empty ``HookChain``
    there by default: a chain without calls is no hook."""
    if _knobs is None:
        return True
    enter, leave = _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
    return bool((enter is not None and getattr(enter, "calls", True)) or
                (leave is not None and getattr(leave, "calls", True)))


_tokens = itertools.count()


def new_token() -> int:
    """A signature part no other launch plan ever had: a plan is made per call key (shapes,
    strides, dtypes, devices, arguments), so its token stands for all of them, and hashes fast."""
    return next(_tokens)


class DirectLauncher:
    """Launches of one jitted kernel, by signature. The kernel takes its seven tensors first (q, k,
    v, o, sinks, start offsets, lengths), then its scalars, then its compile-time parameters (both
    of the op's kernels are declared so)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self._compiled: dict = {}
        self._stream = None

    def __call__(self, signature: Any, grid: tuple, tensors: tuple, scalars: tuple,
                 constexprs: dict, options: dict):
        """Launch ``kernel[grid](*tensors, *scalars, **constexprs, **options)`` and return the
        compiled kernel (None in the interpreter). ``signature`` (hashable) must change whenever
        anything but tensor addresses and float scalars changes: tensor dtypes, grid, integer
        arguments, constexprs, options (a plan's ``new_token()`` and its grid do)."""
        # Triton specialises each pointer on 16-byte alignment: calls whose tensors are all
        # aligned (every tensor the allocator hands out) share one entry; others go through Triton.
        q, k, v, o, s, start, length = tensors  # both kernels take these seven
        aligned = (q.data_ptr() | k.data_ptr() | v.data_ptr() | o.data_ptr() | s.data_ptr()
                   | start.data_ptr() | length.data_ptr()) & 15 == 0
        entry = self._compiled.get(signature) if aligned else None
        if entry is None or _hooks_set():
            compiled = self.kernel[grid](*tensors, *scalars, **constexprs, **options)
            if aligned and hasattr(compiled, "run") and hasattr(compiled, "packed_metadata"):
                if len(self._compiled) >= _MAX_ENTRIES:
                    self._compiled.clear()
                names = [p.name for p in self.kernel.params][len(tensors) + len(scalars):]
                self._compiled[signature] = (compiled, tuple(constexprs[n] for n in names))
            return compiled
        compiled, tail = entry
        if self._stream is None:
            self._stream = _stream_functions()
        get_stream, get_device = self._stream
        compiled.run(grid[0], grid[1], grid[2], get_stream(get_device()), compiled.function,
                     compiled.packed_metadata, None, None, None, *tensors, *scalars, *tail)
        return compiled


def _stream_functions():
    """(current raw stream of a device, current device): what Triton's CUDA driver reads, straight
    from torch's C functions where they exist (Triton's wrappers add a lazy-init check per call)."""
    get_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    get_device = getattr(torch._C, "_cuda_getDevice", None)
    if get_stream is None or get_device is None:
        driver = triton.runtime.driver.active
        return driver.get_current_stream, driver.get_current_device
    return get_stream, get_device
