"""Upstream vLLM's op on the calls routed to it, its one kernel launched again without its Python.

The front door (``triton_prefill_attention``) hands upstream's op the full-attention calls on which
upstream measured faster (``measured_choice``). Upstream's ``context_attention_fwd`` is a few lines
of Python around one Triton launch, ``_fwd_kernel[grid](...)``, and that launch is most of what a
small call costs: 30–55 µs of CPU on the H200 machine against a kernel of a few µs (issue 19: a
host-bound call routed to upstream, plus our ~2 µs of routing, ran at 0.95 × upstream alone).

So a route (``UpstreamRoute``: one call signature, one length bound) watches the first call it
hands upstream's op (``recording``): which Triton kernel that call launched, on which grid, with
which arguments. Every argument of that launch is then either one of the call's six tensors (found
by identity) or a value that only the call signature and the route's scalars decide (strides,
scale, block sizes, flags: upstream computes them from shapes, dtypes, its own arguments and the
process's platform, which every supported release does and nothing else). Later calls
of the route launch the same compiled kernel through its C launch with their own tensors' addresses
(``kernel_launcher.direct_launch``, the path our kernels take): the same kernel, grid and arguments
as upstream's own launch, bit for bit the same output, without Triton's per-call Python.

A route replays only what it saw, and only where what it saw is all there is to the call:

- the call made exactly one Triton launch (one ``JITFunction.run``, one launch through the CUDA
  launcher) and no torch operation (a ``TorchDispatchMode`` counts them: an upstream that read a
  tensor on the host, or zeroed a buffer, is not replayed);
- every tensor argument of the launch is one of the call's six, which were six distinct tensors
  (a call passing ``k`` as ``v`` too cannot tell which of the two a launch argument stands for);
  every other argument is a plain int, float, bool, string or None (a tensor descriptor or any
  other object is not replayed);
- the grid is a tuple of ints, the kernel has no pre-run hooks, and the release's own launcher,
  run against a recorder, hands the C launch what the direct path would (``direct_launch``);
- recorded on a CUDA device outside graph capture and tracing (``measured_choice.may_measure``),
  with every pointer 16-byte aligned (Triton specialises on that) and no launch hook set.

A replayed call needs all six pointers 16-byte aligned, the current CUDA device the one it was
recorded on (Triton keeps its compiled kernels per current device) and no launch hook (a profiler);
any other call, and every call of a route that was not replayable, goes to upstream's op as it is.
A replayed call costs upstream's kernel plus 8–12 µs of CPU on the H200 machine, where upstream
alone costs its kernel plus 38–55 µs (``benchmarks/kernels/host_cost.py``, docs/benchmarks.md,
session 18).
"""

from __future__ import annotations

import contextlib
import operator
import threading
import types
from typing import Callable

import torch
import torch.utils._python_dispatch

from vllm_sinks.v1.attention.ops import kernel_launcher, measured_choice

#: Calls a route records before it stops trying (a call whose pointers are not aligned, or a launch
#: hook set, is not recorded; each try costs ~0.1 ms).
RECORD_TRIES = 3
#: The launch arguments a replay keeps as they were recorded: values, never objects.
_PLAIN = (int, float, bool, str, type(None))
_LOCK = threading.Lock()  # one recording at a time (it swaps two class attributes of Triton's)


class _TorchOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the torch operations a call runs (tensor metadata reads are not operations)."""

    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


class Recording:
    """What one call launched: the jitted kernels run, and each launch through the CUDA launcher as
    (launcher, grid, stream, function, packed metadata, kernel arguments)."""

    def __init__(self):
        self.kernels: list = []
        self.launches: list = []
        self.torch_ops: list = []


def _launcher_class():
    try:
        from triton.backends.nvidia.driver import CudaLauncher
    except ImportError:  # no NVIDIA backend in this Triton: nothing to replay
        return None
    return CudaLauncher


@contextlib.contextmanager
def _swapped(cls, name: str, new):
    """``cls.name`` is ``new`` for the duration (restored as it was, inherited or not)."""
    own = cls.__dict__.get(name)
    setattr(cls, name, new)
    try:
        yield
    finally:
        if own is None:
            delattr(cls, name)
        else:
            setattr(cls, name, own)


@contextlib.contextmanager
def recording():
    """Record the Triton launches and torch operations of the calls made inside (``Recording``).
    Launches of other threads meanwhile are recorded too: the recording then shows more than one
    launch, and nothing is replayed."""
    from triton.runtime.jit import JITFunction

    seen = Recording()
    launcher = _launcher_class()
    jit_run = JITFunction.run
    launch_call = launcher.__call__ if launcher is not None else None

    def run(self, *args, **kwargs):
        seen.kernels.append(self)
        return jit_run(self, *args, **kwargs)

    def launch(self, gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter_hook,
               exit_hook, *args):
        seen.launches.append((self, (gx, gy, gz), stream, function, packed_metadata, args))
        return launch_call(self, gx, gy, gz, stream, function, packed_metadata, launch_metadata,
                           enter_hook, exit_hook, *args)

    with _LOCK, contextlib.ExitStack() as stack:
        stack.enter_context(_swapped(JITFunction, "run", run))
        if launcher is not None:
            stack.enter_context(_swapped(launcher, "__call__", launch))
        ops = stack.enter_context(_TorchOps())
        try:
            yield seen
        finally:
            seen.torch_ops = ops.ops


def _pointers(tensors) -> tuple:
    return tuple(t.data_ptr() for t in tensors)


def replay_of(seen: Recording, tensors: tuple, pointers: tuple):
    """(the replay tuple ``UpstreamRoute`` launches with, "") where the recording of a call on
    ``tensors`` (whose addresses were ``pointers``) is one replayable launch, else (None, why not)."""
    if seen.torch_ops:
        return None, f"the call ran torch operations ({', '.join(map(str, seen.torch_ops[:3]))})"
    if len(seen.kernels) != 1 or len(seen.launches) != 1:
        return None, (f"the call made {len(seen.kernels)} Triton kernel runs and "
                      f"{len(seen.launches)} launches, not one")
    if getattr(seen.kernels[0], "pre_run_hooks", None):
        return None, "the kernel has pre-run hooks"
    runner, grid, stream, function, packed_metadata, args = seen.launches[0]
    if not all(type(g) is int for g in grid):
        return None, f"grid {grid} is not ints"
    slot = {id(t): i for i, t in enumerate(tensors)}
    if len(slot) != len(tensors):  # k is v: which of the two a launch argument stands for is unknown
        return None, "the recorded call passed one tensor in two places"
    values, picks = [], []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            if id(arg) not in slot:
                return None, "the launch takes a tensor that is not one of the call's"
            picks.append(slot[id(arg)])
        elif isinstance(arg, _PLAIN):
            picks.append(len(tensors) + len(values))
            values.append(arg)
        else:
            return None, f"the launch takes a {type(arg).__name__}, not a plain value"
    if len(picks) < 2:
        return None, "the launch takes fewer than two arguments"
    values = tuple(values)
    kernel_args = tuple((*pointers, *values)[i] for i in picks)
    compiled = types.SimpleNamespace(run=runner, function=function, packed_metadata=packed_metadata)
    direct = kernel_launcher.direct_launch(compiled, grid, stream, kernel_args)
    if direct is None or direct[1] != "packed":
        return None, "the release's launcher is not one the direct C launch knows"
    launch, _, head = direct
    get_stream, get_device = kernel_launcher.stream_functions()
    # The compiled kernel is the one Triton loaded for the device current at the recording (its
    # kernel cache is per current device): replayed on that device only.
    return (launch, get_stream, get_device, get_device(), *grid, head, values,
            operator.itemgetter(*picks)), ""


class UpstreamRoute:
    """Upstream's op on one call signature and length bound, called as upstream's op is
    (``route(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal, softmax_scale,
    sliding_window_q, sliding_window_k)``, the arguments the front door's route key holds).
    Replays the launch of the first call it records (module docstring); until then, and where a
    call cannot be replayed, calls upstream's op."""

    __slots__ = ("fn", "replay", "why_not", "tries")

    def __init__(self, fn: Callable):
        self.fn = fn
        self.replay = None
        self.why_not = "not recorded yet"
        self.tries = RECORD_TRIES

    def entry(self) -> Callable:
        """What the front door's route cache should call: this route, or upstream's op itself
        once the recording showed a call that cannot be replayed (one Python call less)."""
        return self.fn if self.replay is None and not self.tries else self

    def __call__(self, q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal,
                 softmax_scale, sliding_window_q, sliding_window_k):
        replay = self.replay
        if replay is not None:
            a, b, c, d, e, f = (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(),
                                b_start_loc.data_ptr(), b_seq_len.data_ptr())
            launch, get_stream, get_device, device, gx, gy, gz, head, values, pick = replay
            if not (a | b | c | d | e | f) & 15 and get_device() == device and \
                    not kernel_launcher.hooks_set():
                launch(gx, gy, gz, get_stream(device), *head, pick((a, b, c, d, e, f, *values)))
                return
        elif self.tries:
            self._record((q, k, v, o, b_start_loc, b_seq_len),
                         (max_input_len, is_causal, softmax_scale, sliding_window_q, sliding_window_k))
            return
        self.fn(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal, softmax_scale,
                sliding_window_q, sliding_window_k)

    def _record(self, tensors: tuple, scalars: tuple) -> None:
        """Call upstream's op, recorded where it may be, and keep its launch for replay where it is
        replayable."""
        pointers = _pointers(tensors)
        device = tensors[0].device
        why_not, tries_left = None, self.tries - 1
        if not measured_choice.may_measure(device):
            why_not = "not recorded in CUDA-graph capture or torch.compile tracing, or off CUDA"
            if device.type != "cuda":  # never recorded: no retry on every call
                tries_left = 0
        elif any(p & 15 for p in pointers) or kernel_launcher.hooks_set():
            why_not = "called with pointers not 16-byte aligned or a launch hook set"
        if why_not is not None:
            self.tries, self.why_not = tries_left, why_not
            self.fn(*tensors, *scalars)
            return
        self.tries = 0
        with recording() as seen:
            self.fn(*tensors, *scalars)
        self.replay, self.why_not = replay_of(seen, tensors, pointers)


class UpstreamLaunch:
    """A plan's launch of upstream's op (only calls without sinks: every supported release takes
    those, with the same semantics), through one ``UpstreamRoute`` per int length bound."""

    name = "upstream"
    __slots__ = ("fn", "scalars", "_routes")

    def __init__(self, fn: Callable, is_causal, softmax_scale, sliding_window_q, sliding_window_k):
        self.fn = fn
        self.scalars = (is_causal, softmax_scale, sliding_window_q, sliding_window_k)
        self._routes: dict = {}

    def route(self, max_input_len: int) -> UpstreamRoute:
        """The route of this plan's call signature with this int length bound (which sets the grid)."""
        route = self._routes.get(max_input_len)
        if route is None:
            if len(self._routes) >= 64:
                self._routes.clear()
            route = self._routes[max_input_len] = UpstreamRoute(self.fn)
        return route

    def __call__(self, q, k, v, o, b_start_loc, b_seq_len, sinks, max_input_len):
        if type(max_input_len) is int:
            self.route(max_input_len)(q, k, v, o, b_start_loc, b_seq_len, max_input_len, *self.scalars)
        else:  # a tensor bound: upstream's own call, as vLLM makes it
            self.fn(q, k, v, o, b_start_loc, b_seq_len, max_input_len, *self.scalars)
