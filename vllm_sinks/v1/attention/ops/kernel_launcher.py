"""Launch a compiled Triton (or Gluon) kernel again without Triton's per-call Python.

``kernel[grid](*args, **constexprs)`` binds and specialises every argument, hashes a cache key and
checks the kernel's globals on each call: 20–35 µs of CPU on the H200 machine, more than the
kernel itself for one MiMo image (a ViT calls the op with the same shapes in every layer). The
first call of a launch signature goes through Triton (it compiles); later calls with the same
signature skip it, in one of two ways:

- **direct** (Triton 3.6 – 3.8, the usual case): the C launch function that Triton's
  ``CudaLauncher.__call__`` would call, called here with everything that is constant per compiled
  kernel worked out once (function handle, packed metadata, cooperative / PDL flags, and from 3.7
  the argument annotations and packed kernel signature), and the tensors' addresses as ints (the C
  launcher takes an int for a pointer argument as is: no ``data_ptr()`` call, no
  ``cuPointerGetAttribute``; every tensor of the op is on its one CUDA device, validated). Two
  argument layouts are known (``_LAYOUTS``). A compiled kernel takes this path only when its
  launcher has no global or profile scratch to allocate, no GSan instrumentation, the attributes of
  a known layout, and when the release's own ``CudaLauncher.__call__``, run once against a recorder
  in place of the C launch, hands it exactly the arguments this path would (``direct_launch``);
- **run**: otherwise ``CompiledKernel.run(gx, gy, gz, stream, function, packed_metadata,
  launch_metadata, enter_hook, exit_hook, *all_args)``, as ``JITFunction.run`` itself does after its
  checks (Triton 3.6 – 3.8).

What makes this safe: the signature holds everything Triton specialises on. The caller's key
fixes shapes, strides, dtypes and every integer argument; only calls whose pointers are all 16-byte
aligned take either path. Launch hooks (a profiler) send every call through Triton again.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch
import triton

try:  # Triton >= 3.4
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton: always the slow path
    _knobs = None

_MAX_ENTRIES = 1024
# Triton's runtime settings object (one per process; its hooks are read per launch).
_RUNTIME = getattr(_knobs, "runtime", None)


def hooks_set() -> bool:
    """Whether a launch hook (a profiler) is installed. Triton 3.6 – 3.8 keep an empty
    ``HookChain`` there by default: a chain without calls is no hook."""
    runtime = _RUNTIME
    if runtime is None:
        return True
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return bool((enter is not None and getattr(enter, "calls", True)) or
                (leave is not None and getattr(leave, "calls", True)))


_tokens = itertools.count()


def new_token() -> int:
    """A signature part no other launch plan ever had: a plan is made per call key (shapes,
    strides, dtypes, devices, arguments), so its token stands for all of them, and hashes fast."""
    return next(_tokens)


# ---- the C launch function's argument layouts -----------------------------------------------------
#: "packed" (Triton 3.7, 3.8: one C launch function for all kernels, in the driver's ``cuda_utils``):
#:   launch(gx, gy, gz, stream, function, cooperative, pdl, packed_metadata, launch_metadata,
#:          enter_hook, exit_hook, global_scratch, profile_scratch, arg_annotations,
#:          kernel_signature, kernel_args)
#: "flat" (Triton 3.6: a C launcher compiled per kernel signature):
#:   launch(gx, gy, gz, stream, function, cooperative, pdl, global_scratch, profile_scratch,
#:          packed_metadata, launch_metadata, enter_hook, exit_hook, *kernel_args)
#: ``kernel_args`` are all the kernel's arguments, constexprs included (the C side skips those).
_LAYOUTS = ("packed", "flat")


def _layout(runner) -> str | None:
    """Which argument layout the runner's C launch takes, or None: not a launcher this module knows,
    or one whose launch is not a plain C call (scratch to allocate, instrumentation)."""
    try:
        if runner.global_scratch_size != 0 or runner.profile_scratch_size != 0:
            return None
        if getattr(runner, "gsan_enabled", False):
            return None
        runner.launch, runner.launch_cooperative_grid, runner.launch_pdl  # noqa: B018 - must exist
    except AttributeError:
        return None
    if hasattr(runner, "arg_annotations") and hasattr(runner, "kernel_signature"):
        return "packed"
    return "flat"


def _head(layout: str, runner, compiled) -> tuple:
    """The C launch's arguments between the stream and the kernel's arguments, for one compiled
    kernel (no launch metadata, no hooks, no scratch)."""
    if layout == "packed":
        return (compiled.function, runner.launch_cooperative_grid, runner.launch_pdl,
                compiled.packed_metadata, None, None, None, None, None, runner.arg_annotations,
                runner.kernel_signature)
    return (compiled.function, runner.launch_cooperative_grid, runner.launch_pdl, None, None,
            compiled.packed_metadata, None, None, None)


def direct_arguments(layout: str, head: tuple, grid: tuple, stream, kernel_args: tuple) -> tuple:
    """The C launch's whole argument list on the direct path (what ``DirectLauncher`` passes)."""
    if layout == "packed":
        return (grid[0], grid[1], grid[2], stream, *head, kernel_args)
    return (grid[0], grid[1], grid[2], stream, *head, *kernel_args)


def _same(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def direct_launch(compiled, grid: tuple, stream, kernel_args: tuple):
    """``(launch, layout, head)`` for calling this compiled kernel's C launch directly, or None (take
    ``compiled.run``). Checked on this call's arguments: the release's own launcher class runs
    once on a copy of the runner whose C launch is a recorder, and must hand it what the direct
    path would; anything else (an unknown release, a changed layout) is None."""
    try:
        runner = compiled.run
        layout = _layout(runner)
        if layout is None:
            return None
        head = _head(layout, runner, compiled)
        probe = copy.copy(runner)
        probe.launch = recorder = _Recorder()
        type(runner).__call__(probe, grid[0], grid[1], grid[2], stream, compiled.function,
                              compiled.packed_metadata, None, None, None, *kernel_args)
    except Exception:  # noqa: BLE001 - a launcher this module does not know: Triton's own path
        return None
    if len(recorder.calls) != 1 or \
            not _same(recorder.calls[0], direct_arguments(layout, head, grid, stream, kernel_args)):
        return None
    return runner.launch, layout, head


class DirectLauncher:
    """Launches of one jitted kernel, by signature. The kernel takes its seven tensors first (q, k,
    v, o, sinks, start offsets, lengths), then its scalars, then its compile-time parameters (both
    of the op's kernels are declared so). A "scalar" may also be a host-side TMA descriptor: an
    object made per call (it holds that call's address), which the release's C-launch wrapper
    turns into the CUtensorMap, shape and strides; a signature then keeps none of a call's
    scalars (they would keep its tensors alive) and has no ``ready`` launch."""

    def __init__(self, kernel):
        self.kernel = kernel
        # signature -> (compiled, constexpr values in order, C launch or None, packed layout?, the
        # launch's arguments before the kernel's, the scalars seen first, those scalars + constexprs)
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
        a, b, c, d, e, f, g = (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), s.data_ptr(),
                               start.data_ptr(), length.data_ptr())
        aligned = not (a | b | c | d | e | f | g) & 15
        entry = self._compiled.get(signature) if aligned else None
        if entry is None or hooks_set():
            return self._through_triton(signature, grid, tensors, scalars, constexprs, options,
                                        aligned, (a, b, c, d, e, f, g))
        compiled, tail, launch, packed, head, entry_scalars, rest = entry
        if scalars is not entry_scalars:  # the plans pass one tuple per signature: rarely taken
            rest = (*scalars, *tail)
        get_stream, get_device = self._stream
        stream = get_stream(get_device())
        if launch is None:
            compiled.run(grid[0], grid[1], grid[2], stream, compiled.function,
                         compiled.packed_metadata, None, None, None, *tensors, *rest)
        elif packed:
            launch(grid[0], grid[1], grid[2], stream, *head, (a, b, c, d, e, f, g, *rest))
        else:
            launch(grid[0], grid[1], grid[2], stream, *head, a, b, c, d, e, f, g, *rest)
        return compiled

    def ready(self, signature: Any, grid: tuple, scalars: tuple) -> tuple | None:
        """``(C launch, get_stream, get_device, gx, gy, gz, head, rest)`` of a signature launched
        before on this grid with these scalars (``rest``: the scalars and constexprs), where its
        launch is a direct C call of the packed layout (Triton 3.7 – 3.9), else None. A seen call
        then launches with nothing else run
        (``triton_prefill_attention.Plan.launch_seen``; DirectLauncher.__call__'s packed branch
        with everything per signature looked up once):

            launch(gx, gy, gz, get_stream(get_device()), *head,
                   (q, k, v, o, sinks, starts, lengths, *rest))

        with the seven pointers as ints, all 16-byte aligned, and no launch hook set
        (``hooks_set``)."""
        entry = self._compiled.get(signature)
        if entry is None or self._stream is None:
            return None
        compiled, tail, launch, packed, head, entry_scalars, rest = entry
        if launch is None or not packed or rest is None:
            return None
        return (launch, *self._stream, *grid, head, (*scalars, *tail))

    def _through_triton(self, signature, grid, tensors, scalars, constexprs, options, aligned, ptrs):
        """Triton's own launch (it compiles a new signature), then the signature's entry."""
        compiled = self.kernel[grid](*tensors, *scalars, **constexprs, **options)
        if aligned and hasattr(compiled, "run") and hasattr(compiled, "packed_metadata"):
            if len(self._compiled) >= _MAX_ENTRIES:
                self._compiled.clear()
            if self._stream is None:
                self._stream = stream_functions()
            names = [p.name for p in self.kernel.params][len(tensors) + len(scalars):]
            tail = tuple(constexprs[n] for n in names)
            get_stream, get_device = self._stream
            direct = direct_launch(compiled, grid, get_stream(get_device()), (*ptrs, *scalars, *tail))
            launch, layout, head = direct or (None, None, None)
            plain = all(type(x) in (int, float) for x in scalars)  # else: per-call descriptors
            self._compiled[signature] = (compiled, tail, launch, layout == "packed", head,
                                         scalars if plain else None,
                                         (*scalars, *tail) if plain else None)
        return compiled


def stream_functions():
    """(current raw stream of a device, current device): what Triton's CUDA driver reads, straight
    from torch's C functions where they exist (Triton's wrappers add a lazy-init check per call)."""
    get_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    get_device = getattr(torch._C, "_cuda_getDevice", None)
    if get_stream is None or get_device is None:
        driver = triton.runtime.driver.active
        return driver.get_current_stream, driver.get_current_device
    return get_stream, get_device
