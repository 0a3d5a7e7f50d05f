"""The op's launch path on the GPU: a call signature seen before skips Triton's argument binding
(``kernel_launcher.DirectLauncher``). These check that such a call still runs on *its* tensors
(fresh buffers, fresh data), under CUDA-graph capture, on both kernels, that the plan picks
the Hopper kernel only on an NVIDIA sm_90 GPU, and that the direct C launch (Triton 3.6 – 3.8)
writes bit for bit what Triton's own launch of the same compiled kernel writes."""

from __future__ import annotations

import pytest
import torch
import triton

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from test_prefill_op_gpu import PATTERNS, _packed  # noqa: E402

from vllm_sinks.v1.attention.ops import kernel_launcher  # noqa: E402
from vllm_sinks.v1.attention.ops import prefill_attention_portable as portable  # noqa: E402
from vllm_sinks.v1.attention.ops import triton_prefill_attention as op  # noqa: E402
from vllm_sinks.v1.attention.ops.gluon_window_attention import walk_unavailable  # noqa: E402
from vllm_sinks.v1.attention.ops.prefill_attention_reference import (  # noqa: E402
    reference_prefill_attention,
    relative_l2,
)

LENS = [700, 64, 300]
# (max_input_len as passed, the kernel that runs): a host bound takes the Hopper kernel where it
# can run, a device tensor the portable kernel's on-device sequence search.
BOUNDS = {"host": lambda n: torch.tensor(n), "device": lambda n: torch.tensor(n, device="cuda"),
          "int": lambda n: n}


def _call(q, k, v, o, b_start, b_len, bound, sinks):
    op.context_attention_fwd(q, k, v, o, b_start, b_len, bound, **dict(
        PATTERNS["mimo-window"], sinks=sinks, sinks_bias_key0=True))


def _ref(q, k, v, b_start, b_len, sinks):
    return reference_prefill_attention(q, k, v, b_start, b_len, sinks=sinks, sinks_bias_key0=True,
                                       **PATTERNS["mimo-window"])


@pytest.mark.parametrize("bound", list(BOUNDS))
def test_a_seen_signature_runs_on_this_calls_tensors(bound):
    """Three calls of one signature on fresh tensors and data: each output is its own inputs'."""
    for seed in range(3):
        q, k, v, sinks, b_start, b_len = _packed(LENS, 32, 8, 64, torch.bfloat16, seed=100 + seed)
        o = torch.full_like(q, float("nan"))
        _call(q, k, v, o, b_start, b_len, BOUNDS[bound](max(LENS)), sinks)
        assert relative_l2(o, _ref(q, k, v, b_start, b_len, sinks)) < 4e-3, seed


def test_a_seen_signature_captures_in_a_cuda_graph():
    q, k, v, sinks, b_start, b_len = _packed(LENS, 32, 8, 64, torch.bfloat16, seed=200)
    o = torch.empty_like(q)
    bound = torch.tensor(max(LENS))
    _call(q, k, v, o, b_start, b_len, bound, sinks)  # compile and cache outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _call(q, k, v, o, b_start, b_len, bound, sinks)
    for seed in (201, 202):  # new data in the captured buffers
        q2, k2, v2, s2, _, _ = _packed(LENS, 32, 8, 64, torch.bfloat16, seed=seed)
        for dst, src in ((q, q2), (k, k2), (v, v2), (sinks, s2)):
            dst.copy_(src)
        o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert relative_l2(o, _ref(q, k, v, b_start, b_len, sinks)) < 4e-3


def test_the_plan_names_the_kernel_it_runs():
    q, k, v, sinks, b_start, b_len = _packed(LENS, 32, 8, 64, torch.bfloat16, seed=300)
    o = torch.empty_like(q)
    kwargs = dict(PATTERNS["mimo-window"], sinks=sinks, sinks_bias_key0=True)
    host = op.plan(q, k, v, o, b_start, b_len, max(LENS), **kwargs).kernel
    assert host == ("triton" if walk_unavailable(q.device) else "walk")
    device = op.plan(q, k, v, o, b_start, b_len, torch.tensor(700, device="cuda"), **kwargs).kernel
    assert device == "triton"


@pytest.mark.parametrize("verdict", ["upstream", "ours"])
def test_full_attention_goes_where_the_table_says(verdict, tmp_path):
    """With upstream's op registered (a recording stand-in), a full-attention call goes to it unless
    the table read says ours for its class (a table written here for this GPU); windows and sinks
    stay ours. Nothing is timed. (No vLLM here.)"""
    import json

    from vllm_sinks.v1.attention.ops import full_attention_table as fat

    calls = []
    name, cap, version = fat.device_identity(("cuda", torch.cuda.current_device()))
    ratio = 1.5 if verdict == "ours" else 0.5
    entry = dict(head_dim=64, dtype="bfloat16", causal=False, queries_per_kv=1,
                 heads_bucket=fat.heads_bucket(16), length_bucket=fat.length_bucket(max(LENS)),
                 ratio=ratio)
    (tmp_path / fat.table_name(name, cap, version)).write_text(
        json.dumps(fat.table_document(name, cap, version, [entry])))
    op.use_upstream_op(lambda *args: calls.append(args))
    fat.use_table_dir(tmp_path)
    try:
        q, k, v, sinks, b_start, b_len = _packed(LENS, 16, 16, 64, torch.bfloat16, seed=400)
        o = torch.full_like(q, float("nan"))
        op.context_attention_fwd(q, k, v, o, b_start, b_len, max(LENS), is_causal=False)
        assert len(calls) == (1 if verdict == "upstream" else 0)
        if verdict == "ours":
            ref = reference_prefill_attention(q, k, v, b_start, b_len, is_causal=False,
                                              dtype=torch.float32)
            assert relative_l2(o, ref) < 4e-3
        before = len(calls)
        q2, k2, v2, s2, _, _ = _packed(LENS, 32, 8, 64, torch.bfloat16, seed=401)
        _call(q2, k2, v2, torch.empty_like(q2), b_start, b_len, max(LENS), s2)  # window + sinks
        assert len(calls) == before
    finally:
        op.use_upstream_op(None)
        fat.use_table_dir()


#: Releases whose launcher layout kernel_launcher knows: the direct C launch must be taken there.
DIRECT_RELEASES = ("3.6", "3.7", "3.8", "3.9")


def _launch_parts(kernel: str, seed: int):
    """(launch object, its DirectLauncher, the jitted kernel, grid, scalars, constexprs, signature,
    tensors but o) for one MiMo-shaped call."""
    q, k, v, sinks, b_start, b_len = _packed(LENS, 32, 8, 64, torch.bfloat16, seed=seed)
    chosen = op.plan(q, k, v, torch.empty_like(q), b_start, b_len, max(LENS),
                     **dict(PATTERNS["mimo-window"], sinks=sinks, sinks_bias_key0=True))
    hint = max(LENS)
    if kernel == "walk":
        if chosen.walk is None:
            pytest.skip("the Hopper kernel does not run on this GPU / Triton")
        from vllm_sinks.v1.attention.ops import gluon_window_attention as gw

        launch = chosen.walk
        launch(q, k, v, torch.empty_like(q), b_start, b_len, sinks, hint)  # compile, bind the bound
        grid, tail, signature, _ = launch._by_bound[(hint, None)]
        return (launch, gw._LAUNCHER, gw._window_walk_kernel, grid, tail, launch.constexprs,
                signature, (q, k, v, sinks, b_start, b_len), hint)
    launch = chosen.portable
    launch(q, k, v, torch.empty_like(q), b_start, b_len, sinks, hint)
    grid, constexprs, signature = launch._by_bound[hint]
    return (launch, portable._LAUNCHER, portable._prefill_attention_kernel, grid, launch.scalars,
            constexprs, signature, (q, k, v, sinks, b_start, b_len), hint)


@pytest.mark.parametrize("kernel", ["walk", "portable"])
def test_direct_launch_writes_what_tritons_launch_writes(kernel):
    """The direct C launch (and the compiled.run fallback) against ``kernel[grid](...)`` on the same
    inputs: bit-identical outputs (both kernels are deterministic)."""
    launch, launcher, jitted, grid, tail, constexprs, signature, inputs, hint = \
        _launch_parts(kernel, seed=500)
    q, k, v, sinks, b_start, b_len = inputs
    entry = launcher._compiled[signature]
    if triton.__version__[:3] in DIRECT_RELEASES:
        assert entry[2] is not None, "the direct C launch is not taken on this Triton"

    def ours():
        o = torch.full_like(q, 7.0)
        launch(q, k, v, o, b_start, b_len, sinks, hint)
        return o

    direct = [ours() for _ in range(2)]
    launcher._compiled[signature] = entry[:2] + (None, ) + entry[3:]  # force compiled.run
    try:
        through_run = ours()
    finally:
        launcher._compiled[signature] = entry
    o_triton = torch.full_like(q, 7.0)
    jitted[grid](q, k, v, o_triton, sinks, b_start, b_len, *tail, **constexprs, **launch.options)
    torch.cuda.synchronize()
    assert not (o_triton == 7.0).all(dim=-1).any(), "Triton's own launch left rows unwritten"
    for o in (*direct, through_run):
        assert torch.equal(o, o_triton)


def test_direct_launch_probe_accepts_the_real_launcher():
    """``direct_launch`` on a real compiled kernel: the release's own CudaLauncher hands its C
    launch what the direct path passes (else the fallback; an unknown release may take it)."""
    _, launcher, _, grid, tail, _, signature, (q, k, v, sinks, b_start, b_len), _ = \
        _launch_parts("portable", seed=501)
    compiled, constexpr_tail = launcher._compiled[signature][:2]
    ptrs = tuple(t.data_ptr() for t in (q, k, v, q, sinks, b_start, b_len))
    stream = torch.cuda.current_stream().cuda_stream
    direct = kernel_launcher.direct_launch(compiled, grid, stream, (*ptrs, *tail, *constexpr_tail))
    if triton.__version__[:3] in DIRECT_RELEASES:
        assert direct is not None and direct[0] is compiled.run.launch


def test_launch_hook_sees_every_call_then_the_direct_path_resumes():
    from triton import knobs

    launch, launcher, _, _, _, _, _, (q, k, v, sinks, b_start, b_len), hint = \
        _launch_parts("portable", seed=502)
    seen = []

    def hook(metadata):
        seen.append(metadata)
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        for _ in range(2):
            launch(q, k, v, torch.empty_like(q), b_start, b_len, sinks, hint)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    torch.cuda.synchronize()
    assert len(seen) == 2
    launch(q, k, v, torch.empty_like(q), b_start, b_len, sinks, hint)
    assert len(seen) == 2


# (lengths, query heads, KV heads, head dim, dtype, causal): full-attention calls of the kinds the
# front door routes to upstream's op where the table does not give them to ours.
ROUTED = {
    "1x128 D80 bf16": ([128], 16, 16, 80, torch.bfloat16, False),
    "ragged GQA D64 fp16 causal": ([700, 64, 300], 32, 8, 64, torch.float16, True),
    "D128 fp32": ([5, 1000], 8, 8, 128, torch.float32, False),
    "D72 bf16 causal": ([256, 17], 12, 4, 72, torch.bfloat16, True),
}


@pytest.mark.parametrize("case", list(ROUTED))
def test_a_routed_call_writes_what_upstreams_own_call_writes(case):
    """vLLM's own op (the fetched peer) registered, no table read (every class to upstream): the
    front door hands the call to it with the caller's arguments, eager and in a captured CUDA
    graph, and the output is bit for bit what upstream's own call writes."""
    import os
    from pathlib import Path

    from benchmarks.kernels import peers
    from vllm_sinks.v1.attention.ops import full_attention_table as fat

    upstream = peers.upstream_op(Path(os.environ.get("VLLM_SINKS_PEERS_DIR", peers.DEFAULT_DIR)))
    if upstream is None:
        pytest.skip("upstream op not fetched (benchmarks/kernels/fetch_peers.sh .gpu/peers)")
    lens, hq, hkv, d, dtype, causal = ROUTED[case]
    q, k, v, _, b_start, b_len = _packed(lens, hq, hkv, d, dtype, seed=501)
    expected, eager, graphed = torch.empty_like(q), torch.empty_like(q), torch.zeros_like(q)
    upstream(q, k, v, expected, b_start, b_len, max(lens), causal, 0.1)
    op.use_upstream_op(upstream)
    fat.use_table_dir(None)
    try:
        op.context_attention_fwd(q, k, v, eager, b_start, b_len, max(lens), causal, 0.1)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            op.context_attention_fwd(q, k, v, graphed, b_start, b_len, max(lens), causal, 0.1)
        graph.replay()
        torch.cuda.synchronize()
    finally:
        op.use_upstream_op(None)
        fat.use_table_dir()
    rows = torch.cat([torch.arange(s, s + n) for s, n in zip(b_start.tolist(), lens)])
    assert torch.equal(eager[rows], expected[rows]) and torch.equal(graphed[rows], expected[rows])
