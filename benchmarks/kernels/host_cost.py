"""Where the CPU time of one op call goes, for a call signature seen before (GPU machine).

    python3 benchmarks/kernels/host_cost.py [--calls 2000]

One MiMo image (1 × 4096 tokens, 32/8 heads, D 64, window ±64, key-0 sinks; max_input_len a CPU
tensor, as MiMo passes it) and the same call with an int bound on full attention (the portable
kernel). Each row is the median over 7 repetitions of a CPU timer around ``--calls`` calls, the GPU
work only queued (synchronised outside the timer every ``SYNC_EVERY`` calls, so that the launch
queue never fills and the CPU never waits for the GPU inside the timer). Rows:

- call key: building the call signature (``prefill_attention_problem.call_key``), which every call
  pays (the plan cache's key);
- op call: ``context_attention_fwd`` end to end (key, plan lookup, launch);
- plan launch: the chosen kernel's launch object on this call's tensors (grid by bound, then
  ``DirectLauncher``: alignment, hooks, stream, and the C launch called directly where the Triton
  release allows it, else Triton's compiled launcher);
- triton run: ``CompiledKernel.run(...)`` with the tensors (Triton's Python ``CudaLauncher.__call__``
  and its C launch): what Triton's own launch runs;
- C launch: the C launch function alone with the direct path's arguments (pointers as ints): the
  floor of the direct path (n/a where the release's launcher is not one ``kernel_launcher`` knows);
- triton [grid]: the same kernel launched through ``kernel[grid](...)`` (Triton's own binding):
  what each launch would cost without the direct path.

Then one MiMo window layer as the patched ``_forward_window_attn`` runs it (``mimo_layer_us``: wrapper
and op), and a call routed to upstream's op: upstream alone against the same call through our front
door (``routed_case``: our key, plan lookup and table lookup, then upstream's own function). With
upstream's op (``--peers``) and with a do-nothing stand-in of its signature, which launches
nothing: the difference is then what our routing adds.

``host_cost_cpu.py`` times the Python layers above the C launch on a CPU (no GPU needed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from vllm_sinks.v1.attention.ops import gluon_window_attention as gw  # noqa: E402
from vllm_sinks.v1.attention.ops import kernel_launcher  # noqa: E402
from vllm_sinks.v1.attention.ops import prefill_attention_portable as portable  # noqa: E402
from vllm_sinks.v1.attention.ops import full_attention_table  # noqa: E402
from vllm_sinks.v1.attention.ops import triton_prefill_attention as op  # noqa: E402
from vllm_sinks.v1.attention.ops.prefill_attention_problem import call_key  # noqa: E402


#: Calls timed between two synchronisations. CUDA's launch queue is bounded: when a kernel takes
#: longer on the GPU than its launch on the CPU (MiMo 1 × 4096: ~26 µs against ~10), a long run of
#: calls fills it and the CPU then waits for the GPU inside the timer. With one synchronisation per
#: 2,000 calls (measured: H200 host, Triton 3.7.1/3.8.0) the C launch alone measured 9.5–10.6 µs and an op call 10.7–19.0 µs
#: from one run to the next; with one per 250, 3.8 µs and 10.2–11.5 µs (same machine).
SYNC_EVERY = 250


def per_call_us(fn, calls: int, reps: int = 7, sync=torch.cuda.synchronize) -> float:
    """Median over ``reps`` of the CPU µs per call of ``calls`` calls; ``sync`` (the GPU work
    queued, None on a CPU) runs outside the timer, every SYNC_EVERY calls."""
    fn()
    block = calls if sync is None else min(calls, SYNC_EVERY)
    times = []
    for _ in range(reps):
        elapsed, done = 0.0, 0
        while done < calls:
            n = min(block, calls - done)
            if sync is not None:
                sync()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            elapsed += time.perf_counter() - t0
            done += n
        times.append(elapsed / calls * 1e6)
    if sync is not None:
        sync()
    return statistics.median(times)


def case(name, tokens, hq, hkv, bound, kwargs, calls):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(tokens, hq, 64, device="cuda", generator=g).bfloat16()
    k = torch.randn(tokens, hkv, 64, device="cuda", generator=g).bfloat16()
    v = torch.randn_like(k)
    o = torch.empty_like(q)
    starts = torch.zeros(1, dtype=torch.int32, device="cuda")
    lens = torch.full((1,), tokens, dtype=torch.int32, device="cuda")
    sinks = kwargs.get("sinks")
    args = (q, k, v, o, starts, lens, bound, kwargs.get("is_causal", True), None,
            kwargs.get("sliding_window_q"), kwargs.get("sliding_window_k"), sinks,
            kwargs.get("sinks_bias_key0", False))
    chosen = op.plan(*args)
    launch = chosen.walk or chosen.portable
    rows = {"call key": per_call_us(lambda: call_key(*args), calls),
            "op call": per_call_us(lambda: op.context_attention_fwd(q, k, v, o, starts, lens, bound,
                                                                    **kwargs), calls)}
    hint = tokens
    rows["plan launch"] = per_call_us(lambda: launch(q, k, v, o, starts, lens, sinks, hint), calls)
    tensors = (q, k, v, o, sinks if sinks is not None else q, starts, lens)
    if chosen.walk is not None:
        grid, tail, signature, _ = launch._by_bound[(hint, None)]
        kernel, constexprs, launcher = gw._window_walk_kernel, launch.constexprs, gw._LAUNCHER
    else:
        grid, constexprs, signature = launch._by_bound[hint]
        kernel, tail, launcher = portable._prefill_attention_kernel, launch.scalars, portable._LAUNCHER
    compiled, constexpr_tail, c_launch, packed, head = launcher._compiled[signature][:5]
    stream = torch.cuda.current_stream().cuda_stream
    rows["triton run"] = per_call_us(
        lambda: compiled.run(grid[0], grid[1], grid[2], stream, compiled.function,
                             compiled.packed_metadata, None, None, None, *tensors, *tail,
                             *constexpr_tail), calls)
    rows["C launch"] = float("nan")
    if c_launch is not None:
        c_args = kernel_launcher.direct_arguments(
            "packed" if packed else "flat", head, grid, stream,
            (*(t.data_ptr() for t in tensors), *tail, *constexpr_tail))
        rows["C launch"] = per_call_us(lambda: c_launch(*c_args), calls)
    rows["triton [grid]"] = per_call_us(
        lambda: kernel[grid](*tensors, *tail, **constexprs, **launch.options), calls)
    # the rows below "op call" take the walk or the portable launch apart (a full-attention call the
    # Hopper kernel takes is timed end to end in "op call" only)
    kernel = chosen.kernel if chosen.kernel == launch.name else f"{chosen.kernel}; parts: {launch.name}"
    print(f"{name} ({kernel}): " + ", ".join(f"{k} {v:.1f} µs" for k, v in rows.items()))
    return kernel, rows


def host_cases(sinks) -> list[tuple]:
    """The calls both host-cost scripts time (this one and ``host_cost_cpu.py``): (label, name,
    tokens, query heads, KV heads, max_input_len, op keyword arguments, runs the Hopper kernel)."""
    return [
        ("MiMo 1×4096, CPU-tensor bound", "mimo", 4096, 32, 8, torch.tensor(4096),
         dict(is_causal=False, sliding_window_q=64, sliding_window_k=64, sinks=sinks,
              sinks_bias_key0=True), True),
        ("full attention 1×1024, int bound", "full", 1024, 16, 16, 1024, dict(is_causal=False),
         False),
    ]


def print_table(title: str, results: list[tuple], digits: int) -> None:
    """``results``: (label, kernel, {row name: µs}) per case, one markdown table."""
    print(f"\n{title}\n")
    names = list(results[0][2])
    print("| case | kernel | " + " | ".join(f"{n} µs" for n in names) + " |")
    print("|---" * (2 + len(names)) + "|")
    for label, kernel, rows in results:
        print(f"| {label} | {kernel} | " + " | ".join(f"{rows[n]:.{digits}f}" for n in names) + " |")


def routed_case(upstream, calls: int, device: str = "cuda", sync=torch.cuda.synchronize) -> dict:
    """A full-attention call routed to upstream's op (1 × 128, 16 heads, D 80, bf16, int bound: a
    kernel shorter than either launch, so the time per call is the CPU's): ``upstream`` (the op)
    alone, and the same call through our front door with upstream registered and no table read
    (``full_attention_table.use_table_dir(None)``: every class goes to upstream), interleaved
    twice; seen again, and first sight: every call a signature not seen before (the plans
    forgotten before each call in both arms, as a server's new token counts make them; the class
    itself was seen). The difference is what the route adds. Shared with ``host_cost_cpu.py``
    (the stand-in, CPU tensors)."""
    n = 128
    q = torch.randn(n, 16, 80, device=device).bfloat16()
    k, v, o = torch.randn_like(q), torch.randn_like(q), torch.empty_like(q)
    starts = torch.zeros(1, dtype=torch.int32, device=device)
    lens = torch.full((1,), n, dtype=torch.int32, device=device)
    op.use_upstream_op(upstream)
    full_attention_table.use_table_dir(None)

    def alone():
        upstream(q, k, v, o, starts, lens, n, is_causal=False)

    def routed():
        op.context_attention_fwd(q, k, v, o, starts, lens, n, is_causal=False)

    def first_sight(fn):
        def call():
            op._PLANS.clear()  # a new signature (the class's route stays: seen in an earlier pass)
            fn()
        return call

    try:
        chosen = op.plan(q, k, v, o, starts, lens, n, False)
        assert chosen.upstream_takes(n), "the call is not routed to upstream's op"
        arms = {"upstream alone": alone, "routed op call": routed,
                "upstream alone, first sight": first_sight(alone),
                "routed op call, first sight": first_sight(routed)}
        times = {name: [] for name in arms}
        for _ in range(2):
            for name, fn in arms.items():
                times[name].append(per_call_us(fn, calls, sync=sync))
    finally:
        op.use_upstream_op(None)
        full_attention_table.use_table_dir()
    rows = {name: min(ts) for name, ts in times.items()}
    rows["ours on top"] = rows["routed op call"] - rows["upstream alone"]
    rows["ours on top, first sight"] = (rows["routed op call, first sight"]
                                        - rows["upstream alone, first sight"])
    return rows


def upstream_stand_in(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal=True,
                      softmax_scale=None, sliding_window_q=None, sliding_window_k=None, sinks=None):
    """Upstream's ``context_attention_fwd`` signature, doing nothing: what a routed call costs of
    ours is the difference between calling this through the front door and calling it alone."""


def vision_attention_stand_in(sinks: torch.Tensor, window: int = 64,
                              scale: float = 64 ** -0.5) -> torch.nn.Module:
    """What ``_forward_window_attn`` reads of vLLM's ``MiMoVisionAttention``: a module whose sinks are
    a parameter (read through ``nn.Module``'s attribute lookup, as on the model), one partition."""
    attn = torch.nn.Module()
    attn.sinks = torch.nn.Parameter(sinks, requires_grad=False)  # vLLM's weights take no grad
    attn.num_heads_per_partition, attn.tp_rank, attn.tp_size = sinks.shape[0], 0, 1
    attn.visual_token_window_size, attn.scale = window, scale
    return attn


def mimo_layer_us(calls: int, device: str = "cuda", sync=torch.cuda.synchronize) -> float:
    """One MiMo window layer as the patched ``_forward_window_attn`` runs it (sinks of this rank,
    the wrapper, the op) on a module like vLLM's, a signature seen before: 1 × 4096 tokens, 32/8
    heads, D 64, window 64, q, k, v views of one fused projection, ``max_seqlen`` a host tensor
    and ``cu_seqlens`` one tensor for every layer, as MiMo passes them."""
    from vllm_sinks.model_executor.models.mimo_v2_omni import make_forward_window_attn

    qkv = torch.randn(4096, 48, 64, device=device).bfloat16()
    q, k, v = qkv[:, :32], qkv[:, 32:40], qkv[:, 40:]
    attn = vision_attention_stand_in(torch.randn(32, device=device))
    forward = make_forward_window_attn("key0")
    cu = torch.tensor([0, 4096], dtype=torch.int32, device=device)
    max_seqlen = torch.tensor(4096)
    return per_call_us(lambda: forward(attn, q, k, v, cu, max_seqlen), calls, sync=sync)


def mimo_layer_parts(calls: int, device: str = "cuda", sync=torch.cuda.synchronize,
                     tokens: int = 1024) -> dict:
    """``mimo_layer_us``'s call taken apart (µs per call, each piece timed on its own), to show
    where a seen MiMo window layer's CPU goes on this machine: the layer, then its pieces in the
    order it runs them (``launch seen``: ``Plan.launch_seen``, pointers, stream and C launch), the
    generic launch it replaces (``plan call``), and the floor no Python can go under: a fresh
    output (allocated and freed, as each layer does) plus the C launch of an empty kernel. The
    layer is timed first and last, the lower kept."""
    import triton
    import triton.language as tl

    from vllm_sinks.model_executor.models import mimo_v2_omni as mimo

    qkv = torch.randn(tokens, 48, 64, device=device).bfloat16()
    q, k, v = qkv[:, :32], qkv[:, 32:40], qkv[:, 40:]
    attn = vision_attention_stand_in(torch.randn(32, device=device))
    forward = mimo.make_forward_window_attn("key0")
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    max_seqlen = torch.tensor(tokens)
    sinks = mimo.attention_sinks_for_rank(attn)
    for _ in range(2):  # planned, then launched once through the plan (its C launch kept)
        forward(attn, q, k, v, cu, max_seqlen)
    mod = mimo._OPS[0]
    key_args = (q, k, v, cu, max_seqlen, attn.visual_token_window_size, sinks, True, attn.scale)
    chosen = mod._PLANS[mimo.wrapper_key(*key_args)]
    cu_ptr = cu.data_ptr()
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    parts = {
        "layer": lambda: forward(attn, q, k, v, cu, max_seqlen),
        "sinks of rank": lambda: mimo.attention_sinks_for_rank(attn),
        "key + plan": lambda: mod._PLANS.get(mimo.wrapper_key(*key_args)),
        "bound read": lambda: max_seqlen.item(),
        "output": lambda: torch.empty_like(q, memory_format=torch.contiguous_format),
        "launch seen": lambda: chosen.launch_seen(q, k, v, o, sinks, tokens, cu_ptr, cu_ptr),
        "plan call": lambda: chosen(q, k, v, o, cu, cu, sinks, max_seqlen),
    }
    rows = {name: per_call_us(fn, calls, sync=sync) for name, fn in parts.items()}
    # the layer again last: the host's noise drifts over seconds, and only ever adds
    rows["layer"] = min(rows["layer"], per_call_us(parts["layer"], calls, sync=sync))
    if device != "cuda":
        return rows

    @triton.jit
    def _empty_kernel(X, n):
        if tl.program_id(0) < 0:  # never: a kernel that does nothing, as cheap to launch as any
            tl.store(X, n)

    x = torch.zeros(4, device=device)
    compiled = _empty_kernel[(1,)](x, 1, enable_fp_fusion=True)  # as the op asks (no 3.9 warning)
    stream = torch.cuda.current_stream().cuda_stream
    direct = kernel_launcher.direct_launch(compiled, (1, 1, 1), stream, (x.data_ptr(), 1))
    if direct is not None:
        launch, layout, head = direct
        c_args = kernel_launcher.direct_arguments(layout, head, (1, 1, 1), stream, (x.data_ptr(), 1))
        rows["C launch, empty kernel"] = per_call_us(lambda: launch(*c_args), calls, sync=sync)
    rows["torch op (x.zero_())"] = per_call_us(lambda: x.zero_(), calls, sync=sync)
    return rows


def print_parts(parts: dict, tokens: int) -> None:
    print(f"\nMiMo window layer ({tokens} tokens) taken apart, µs per call: " +
          ", ".join(f"{name} {us:.2f}" for name, us in parts.items()))
    floor = parts.get("output", 0.0) + parts.get("C launch, empty kernel", 0.0)
    print(f"  floor (output + C launch of an empty kernel) {floor:.2f} µs; the layer "
          f"{parts['layer']:.2f} µs = floor + {parts['layer'] - floor:.2f} µs of Python")


def print_routed(rows: dict, digits: int, what: str = "") -> None:
    print(f"\nA call routed to upstream's op{what} (full attention 1×128, D 80; best of 2 "
          "interleaved): " + ", ".join(f"{name} {us:.{digits}f} µs" for name, us in rows.items()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--peers", default=None, help="fetch_peers.sh's folder (default .gpu/peers)")
    args = ap.parse_args(argv)
    import triton

    sinks = torch.randn(32, device="cuda") * 2
    results = [(label,) + case(*spec, args.calls) for label, *spec, _ in host_cases(sinks)]
    print_table(f"Host cost per call, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
                f"triton {triton.__version__} (median of 7 × {args.calls} calls)", results, 1)
    print(f"\nMiMo window layer as the patched _forward_window_attn runs it (wrapper + op, fused-QKV "
          f"views): {mimo_layer_us(args.calls):.2f} µs per call")
    print_parts(mimo_layer_parts(args.calls), 1024)
    from benchmarks.kernels.peers import upstream_op

    upstream = upstream_op(args.peers)
    if upstream is not None:
        upstream = upstream.raw
        print_routed(routed_case(upstream, args.calls), 2)
    # what ours adds, without upstream's own launch in the difference (its noise is µs)
    print_routed(routed_case(upstream_stand_in, args.calls), 2, " (a do-nothing stand-in)")


if __name__ == "__main__":
    main()
