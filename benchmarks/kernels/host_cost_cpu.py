"""The op's Python per call, for a call signature seen before, measured on the CPU (no GPU needed).

    python3 benchmarks/kernels/host_cost_cpu.py [--calls 20000]

The GPU machine's ``host_cost.py`` measures the whole call; this measures the Python layers above
the C launcher anywhere, with CPU tensors, so a change to them can be timed without the device. The
kernels' ``DirectLauncher``s get a stand-in kernel whose compiled launcher is an instance of the
installed Triton's own ``CudaLauncher`` class (``tests.support.triton_launch_fakes``) with a
C no-op (``"".format``) as its C ``launch``: the release's Python ``CudaLauncher.__call__`` runs as on
the GPU, the C launch (argument parsing, ``cuLaunchKernelEx``) costs ~nothing. The Hopper kernel's
launch is planned as on an sm_90 GPU (its platform gate is lifted for the run). Rows (median of 7
× ``--calls`` calls, µs per call):

- call key: ``call_key`` (the call signature, the plan cache's key: every call builds it);
- op call: ``context_attention_fwd`` end to end (key, plan lookup, launch object, launcher);
- plan launch: the chosen launch object (``WalkLaunch`` / ``PortableLaunch``) on this call's tensors;
- launcher: ``DirectLauncher`` alone (alignment, hooks, stream, the compiled launcher);
- triton run: Triton's ``CudaLauncher.__call__`` alone (what Triton's own launch runs).

Then one MiMo window layer as the patched ``_forward_window_attn`` runs it (wrapper and op), and
a call routed to upstream's op (``host_cost.routed_case``, upstream's op stood in for by a function
of its signature that does nothing): upstream alone against the call through our front door.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors pass validation; the kernels never run here
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks.kernels import host_cost  # noqa: E402
from benchmarks.kernels.host_cost import (  # noqa: E402
    host_cases,
    print_routed,
    print_table,
    routed_case,
    upstream_stand_in,
)
from tests.support import triton_launch_fakes as fakes  # noqa: E402
from vllm_sinks.v1.attention.ops import gluon_window_attention as gw  # noqa: E402
from vllm_sinks.v1.attention.ops import prefill_attention_portable as portable  # noqa: E402
from vllm_sinks.v1.attention.ops import prefill_attention_problem as problem  # noqa: E402
from vllm_sinks.v1.attention.ops import triton_prefill_attention as op  # noqa: E402

C_NOOP = "".format  # a C function that takes any positional arguments and ignores them


def per_call_us(fn, calls: int) -> float:
    return host_cost.per_call_us(fn, calls, sync=None)


def install_fake_kernels():
    for launcher in (portable._LAUNCHER, gw._LAUNCHER):
        if launcher is None:
            continue
        launcher.kernel = fakes.FakeKernel(fakes.kernel_params(launcher.kernel),
                                           lambda: fakes.fake_runner(C_NOOP))
        launcher._stream = (lambda device: 0, lambda: 0)  # torch's C functions on the GPU


def case(name, tokens, hq, hkv, bound, kwargs, calls, walk: bool):
    q = torch.randn(tokens, hq, 64).bfloat16()
    k = torch.randn(tokens, hkv, 64).bfloat16()
    v = torch.randn_like(k)
    o = torch.empty_like(q)
    starts = torch.zeros(1, dtype=torch.int32)
    lens = torch.full((1,), tokens, dtype=torch.int32)
    sinks = kwargs.get("sinks")
    args = (q, k, v, o, starts, lens, bound, kwargs.get("is_causal", True), None,
            kwargs.get("sliding_window_q"), kwargs.get("sliding_window_k"), sinks,
            kwargs.get("sinks_bias_key0", False))
    p = problem.validate(*args)
    launch = portable.PortableLaunch.plan(p, q, k, v, o, starts, lens, sinks)
    walk_launch = None
    if walk:  # as on an sm_90 GPU
        gw.walk_unavailable, gw._sm_count = (lambda device: None), (lambda device: 132)
        walk_launch = gw.WalkLaunch.plan(p, q, k, v, o, starts, lens, sinks)
        assert walk_launch is not None
    chosen = op.Plan(walk_launch, None, launch)
    op._PLANS[problem.call_key(*args)] = chosen
    launch = walk_launch or launch
    hint = problem.host_length_bound(bound)
    rows = {"call key": per_call_us(lambda: problem.call_key(*args), calls),
            "op call": per_call_us(lambda: op.context_attention_fwd(q, k, v, o, starts, lens, bound,
                                                                    **kwargs), calls)}
    rows["plan launch"] = per_call_us(lambda: launch(q, k, v, o, starts, lens, sinks, hint), calls)
    tensors = (q, k, v, o, sinks if sinks is not None else q, starts, lens)
    if walk:
        grid, tail, signature, _ = launch._by_bound[(hint, None)]
        constexprs, launcher = launch.constexprs, gw._LAUNCHER
    else:
        grid, constexprs, signature = launch._by_bound[hint]
        tail, launcher = launch.scalars, portable._LAUNCHER
    rows["launcher"] = per_call_us(
        lambda: launcher(signature, grid, tensors, tail, constexprs, launch.options), calls)
    compiled = launcher.kernel.last
    full = (*tensors, *tail, *launcher._compiled[signature][1])
    rows["triton run"] = per_call_us(
        lambda: compiled.run(grid[0], grid[1], grid[2], 0, compiled.function,
                             compiled.packed_metadata, None, None, None, *full), calls)
    print(f"{name} ({chosen.kernel}): " + ", ".join(f"{k} {v:.2f} µs" for k, v in rows.items()))
    return chosen.kernel, rows


def mimo_layer_us(calls: int) -> float:
    """``host_cost.mimo_layer_us`` on CPU tensors, the Hopper kernel planned as on an sm_90 GPU."""
    gw.walk_unavailable, gw._sm_count = (lambda device: None), (lambda device: 132)
    op.on_nvidia_gpu = lambda device: True
    us = host_cost.mimo_layer_us(calls, "cpu", sync=None)
    kernels = {chosen.kernel for key, chosen in op._PLANS.items()
               if key[0] == "window_attention_with_sinks"}
    assert kernels == {"walk"}, kernels
    return us


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args(argv)
    install_fake_kernels()
    with fakes.fake_active_driver():
        results = [(label,) + case(*spec, args.calls, walk=walk)
                   for label, *spec, walk in host_cases(torch.randn(32) * 2)
                   if gw._LAUNCHER is not None or not walk]  # no Gluon here: the portable row
        layer = mimo_layer_us(args.calls) if gw._LAUNCHER is not None else float("nan")
        if gw._LAUNCHER is not None:
            host_cost.print_parts(host_cost.mimo_layer_parts(args.calls, "cpu", sync=None), 1024)
    print_table(f"Python per call (C launch a no-op), CPU, torch {torch.__version__}, "
                f"triton {triton.__version__} (median of 7 × {args.calls} calls)", results, 2)
    print(f"\nMiMo window layer as the patched _forward_window_attn runs it (wrapper + op, fused-QKV "
          f"views, CPU tensors): {layer:.2f} µs per call")
    print_routed(routed_case(upstream_stand_in, args.calls, device="cpu", sync=None), 2,
                 " (a do-nothing stand-in, CPU tensors)")


if __name__ == "__main__":
    main()
