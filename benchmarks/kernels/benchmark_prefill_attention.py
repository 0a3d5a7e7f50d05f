"""Speed and error of our prefill attention op against FlexAttention, SDPA and the HBM floor.

    python benchmarks/kernels/benchmark_prefill_attention.py --out OUT_DIR          # the table (H200)
    python benchmarks/kernels/benchmark_prefill_attention.py --tune --out OUT_DIR   # tile-shape sweep

Everything in one run, on one GPU, bf16 inputs, random normal q/k/v, sinks ~ N(0, 2²):

- ours: ``vllm_sinks...triton_prefill_attention.context_attention_fwd`` as vLLM calls it (launcher
  included; ``max_input_len`` a CPU tensor, as MiMo passes it), ``triton.testing.do_bench`` median
  (L2 flushed before every call). "kernel" says which kernel that call ran: the Hopper window
  kernel (``gluon_window_attention.py``, "walk") where it applies, else the portable Triton kernel;
  "triton kernel" times the portable kernel on the same call, as the peer in the same run;
  "device max_len": ``max_input_len`` on the GPU, where the portable kernel finds each program's
  sequence by an on-device search (the walk needs a host-side bound, so it is not used there);
- flex (``--flex``): ``torch.compile(flex_attention)`` with a block mask (same sequence, inside the window / causal)
  and, for the key-0 bias, a score_mod adding ``sinks[h]`` where the key is its sequence's first
  token; for the null logit, the output is rescaled by ``sigmoid(lse - sinks[h])`` (same math);
- sdpa (``--sdpa-mask-gib``): ``scaled_dot_product_attention`` over the sequences as a batch (all sequences of a case have one
  length) with a dense additive mask [Hq, L, L] (null logit: one extra zero key whose mask entry is the
  sink), where the mask fits in ``--sdpa-mask-gib``;
- floor: bytes of q, k, v read once and o written once, over the device-to-device copy bandwidth
  measured at the start of the same run;
- err: ‖out − ref‖ / ‖ref‖ against the fp32 banded reference in the package.

- upstream: vLLM 0.33.0's own ``context_attention_fwd`` and fa3: vLLM's FlashAttention-3 (null-logit
  sinks as ``s_aux``; it has no key-0 mode, so key-0 rows time it with null sinks), both loaded from
  the files ``benchmarks/kernels/fetch_peers.sh`` fetched (``--peers``; no vLLM on the GPU machine);
- host: CPU µs per call once a call signature has been seen (the launch path, no kernel time).

Writes ``prefill_attention.md`` and ``prefill_attention.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.kernels.host_cost import per_call_us  # noqa: E402
from vllm_sinks.v1.attention.ops.prefill_attention_reference import (  # noqa: E402
    reference_prefill_attention,
    relative_l2,
    same_dtype_torch_attention,
)
from vllm_sinks.v1.attention.ops.prefill_attention_portable import (  # noqa: E402
    LaunchConfig,
    PortableLaunch,
    choose_config,
    launch,
)
from vllm_sinks.v1.attention.ops.prefill_attention_problem import validate as _validate  # noqa: E402
from vllm_sinks.v1.attention.ops.triton_prefill_attention import (  # noqa: E402
    context_attention_fwd,
    plan,
)

@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    num_seqs: int
    seq_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    is_causal: bool
    window_q: int
    window_k: int
    sink_mode: str  # "key0" or "null"

    @property
    def tokens(self) -> int:
        return self.num_seqs * self.seq_len


def _cases() -> list[Case]:
    seed = [Case(f"seed 1x{n}", 1, n, 8, 8, 64, False, 64, 64, "key0") for n in (512, 1024, 4096)]
    mimo = [Case(f"mimo {b}x{n}", b, n, 32, 8, 64, False, 64, 64, "key0")
            for b, n in ((1, 4096), (4, 4096), (16, 1024), (1, 16384), (4, 16384))]
    # GPT-OSS sliding layers: 64 q / 8 kv heads, D 64, window 128 -> vLLM passes (127, 0), causal.
    gptoss = [Case(f"gpt-oss {b}x{n}", b, n, 64, 8, 64, True, 127, 0, "null")
              for b, n in ((1, 4096), (4, 4096), (4, 16384))]
    return seed + mimo + gptoss


def _inputs(c: Case, device, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    t = c.tokens
    q = torch.randn(t, c.q_heads, c.head_dim, device=device, dtype=dtype, generator=g)
    k = torch.randn(t, c.kv_heads, c.head_dim, device=device, dtype=dtype, generator=g)
    v = torch.randn(t, c.kv_heads, c.head_dim, device=device, dtype=dtype, generator=g)
    sinks = torch.randn(c.q_heads, device=device, generator=g) * 2.0
    starts = torch.arange(c.num_seqs, device=device, dtype=torch.int32) * c.seq_len
    lens = torch.full((c.num_seqs,), c.seq_len, device=device, dtype=torch.int32)
    return q, k, v, sinks, starts, lens


def _op_kwargs(c: Case, sinks):
    return dict(is_causal=c.is_causal, sliding_window_q=c.window_q, sliding_window_k=c.window_k,
                sinks=sinks, sinks_bias_key0=(c.sink_mode == "key0"))


def _bench(fn) -> float:
    """Median µs. do_bench flushes L2 between calls, so inputs are read from HBM like in a model."""
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def copy_bandwidth(device) -> float:
    """Bytes read + written per second of a large device-to-device copy."""
    n = 1 << 30  # 1 Gi bf16 elements = 2 GiB each way
    buffers = [torch.randn(n, device=device, dtype=torch.bfloat16)]
    buffers.append(torch.empty_like(buffers[0]))
    us = _bench(lambda: buffers[1].copy_(buffers[0]))
    buffers.clear()
    torch.cuda.empty_cache()
    return 2 * n * 2 / (us * 1e-6)


def floor_us(c: Case, bandwidth: float, elt=2) -> float:
    qo = 2 * c.tokens * c.q_heads * c.head_dim * elt
    kv = 2 * c.tokens * c.kv_heads * c.head_dim * elt
    return (qo + kv) / bandwidth * 1e6


# ---- FlexAttention -------------------------------------------------------------------------------

def _flex_runner(c: Case, q, k, v, sinks, lens):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    device = q.device
    doc = torch.repeat_interleave(torch.arange(c.num_seqs, device=device), lens.long())
    # 1.0 at each sequence's first token, else 0.0 (a float gather + FMA in score_mod; a bool
    # gather with torch.where measured ~10x slower on the H200).
    first = torch.zeros(c.tokens, dtype=torch.float32, device=device)
    first[torch.arange(c.num_seqs, device=device) * c.seq_len] = 1.0
    wq, wk, causal = c.window_q, c.window_k, c.is_causal

    def mask_mod(b, h, qi, ki):
        m = doc[qi] == doc[ki]
        if causal:
            m = m & (ki <= qi)
        if wq > 0:
            m = m & (qi - ki <= wq)
        if wk > 0:
            m = m & (ki - qi <= wk)
        return m

    block_mask = create_block_mask(mask_mod, 1, None, c.tokens, c.tokens, device=device,
                                   _compile=device.type == "cuda")
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, T, D]
    # Static shapes, one compile per case (the benchmark's cases exceed dynamo's default cache of 8).
    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 256)
    flex = torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention

    if c.sink_mode == "key0":
        def score_mod(score, b, h, qi, ki):
            return score + first[ki] * sinks[h]

        def run():
            return flex(qt, kt, vt, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)
    else:
        def run():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out, lse = flex(qt, kt, vt, block_mask=block_mask, enable_gqa=True, return_lse=True)
            # Null logit: o * Z / (Z + e^s) = o * sigmoid(lse - s).
            return out * torch.sigmoid(lse - sinks[None, :, None]).unsqueeze(-1).to(out.dtype)

    def result():
        return run()[0].transpose(0, 1)  # [T, H, D]

    return run, result


# ---- SDPA with a dense mask ----------------------------------------------------------------------

def _sdpa_runner(c: Case, q, k, v, sinks, mask_gib: float):
    """SDPA over [num_seqs, H, L, D] with one dense additive mask [1, Hq, L, keys] (None if too big).

    KV heads are expanded to the query heads so the memory-efficient kernel (which takes arbitrary
    masks) runs; the key count is padded to a multiple of 16 with masked zero keys (mask alignment).
    """
    import torch.nn.functional as F

    extra = 1 if c.sink_mode == "null" else 0
    n_keys = -(-(c.seq_len + extra) // 16) * 16
    if c.q_heads * c.seq_len * n_keys * 2 > mask_gib * (1 << 30):
        return None, None
    device = q.device
    i = torch.arange(c.seq_len, device=device)
    d = i[:, None] - i[None, :]
    vis = torch.ones_like(d, dtype=torch.bool)
    if c.is_causal:
        vis &= d >= 0
    if c.window_q > 0:
        vis &= d <= c.window_q
    if c.window_k > 0:
        vis &= -d <= c.window_k
    mask = torch.full((c.q_heads, c.seq_len, n_keys), float("-inf"), device=device, dtype=q.dtype)
    mask[:, :, :c.seq_len].masked_fill_(vis, 0.0)
    b, hq, dd, group = c.num_seqs, c.q_heads, c.head_dim, c.q_heads // c.kv_heads
    qb = q.view(b, c.seq_len, hq, dd).transpose(1, 2)
    kb = k.view(b, c.seq_len, c.kv_heads, dd).repeat_interleave(group, dim=2).transpose(1, 2)
    vb = v.view(b, c.seq_len, c.kv_heads, dd).repeat_interleave(group, dim=2).transpose(1, 2)
    if c.sink_mode == "key0":
        mask[:, :, 0] += torch.where(vis[:, 0], sinks[:, None], 0.0).to(q.dtype)
    else:  # an extra zero key with a zero value: its logit 0 + mask = the sink, no value
        mask[:, :, c.seq_len] = sinks[:, None].to(q.dtype)
    pad = torch.zeros(b, hq, n_keys - c.seq_len, dd, device=device, dtype=q.dtype)
    kb = torch.cat([kb, pad], dim=2)
    vb = torch.cat([vb, pad], dim=2)
    mask = mask.unsqueeze(0)

    def run():
        return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask)

    def result():
        return run().transpose(1, 2).reshape(c.tokens, hq, dd)

    return run, result


# ---- the table -----------------------------------------------------------------------------------

def measure_case(c: Case, bandwidth: float, args, tuned: LaunchConfig | None = None) -> dict:
    device = torch.device("cuda")
    q, k, v, sinks, starts, lens = _inputs(c, device)
    kwargs = _op_kwargs(c, sinks)
    ref = reference_prefill_attention(q, k, v, starts, lens, **kwargs)
    row = dict(case=c.name, tokens=c.tokens, heads=f"{c.q_heads}/{c.kv_heads}", mode=c.sink_mode,
               window=f"{'causal ' if c.is_causal else ''}{c.window_q}/{c.window_k}")
    o = torch.empty_like(q)
    # As MiMo's vision tower passes it: a CPU tensor (its grid sizes stay on the host); vLLM's
    # triton backend passes an int. Both size the grid. A device tensor makes the kernel search.
    mil = torch.tensor(c.seq_len)
    mil_device = mil.to(device)

    def ours():
        context_attention_fwd(q, k, v, o, starts, lens, mil, **kwargs)

    ours()
    row["ours_err"] = relative_l2(o, ref)  # before any other path writes o
    row["ours_us"] = _bench(ours)
    o_search = torch.empty_like(q)
    row["ours_search_us"] = _bench(
        lambda: context_attention_fwd(q, k, v, o_search, starts, lens, mil_device, **kwargs))
    row["ours_search_err"] = relative_l2(o_search, ref)
    row["ours_no_sinks_err"] = relative_l2(_ours_without_sinks(c, q, k, v, starts, lens, mil), ref)
    row["torch_bf16_err"] = relative_l2(same_dtype_torch_attention(q, k, v, starts, lens, **kwargs), ref)
    # The same call captured in a CUDA graph: no launcher, no Python.
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ours()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        ours()
    row["ours_graph_us"] = _bench(graph.replay)
    row["host_us"] = host_us(ours)
    p = _validate(q, k, v, o, starts, lens, mil, c.is_causal, None, c.window_q, c.window_k, sinks,
                  c.sink_mode == "key0")
    row["kernel"] = plan(q, k, v, o, starts, lens, mil, **kwargs).kernel
    _peer_columns(row, c, q, k, v, sinks, starts, lens, ref, args.peers_loaded)
    o_triton = torch.empty_like(q)
    portable = PortableLaunch.plan(p, q, k, v, o_triton, starts, lens, sinks)
    row["triton_us"] = _bench(lambda: portable(q, k, v, o_triton, starts, lens, sinks, c.seq_len))
    row["triton_err"] = relative_l2(o_triton, ref)
    row["config"] = dataclasses.asdict(choose_config(p))
    if tuned is not None and tuned != choose_config(p):
        row["tuned_config"] = dataclasses.asdict(tuned)
        row["ours_tuned_us"] = _bench(
            lambda: launch(p, tuned, q, k, v, o, starts, lens, sinks, c.seq_len))
        row["ours_tuned_err"] = relative_l2(o, ref)
    row["floor_us"] = floor_us(c, bandwidth)
    flex_wanted = args.flex and (not args.flex_cases or any(
        w.strip() and w.strip() in c.name for w in args.flex_cases.split(",")))
    if flex_wanted:
        try:
            run, result = _flex_runner(c, q, k, v, sinks, lens)
            row["flex_err"] = relative_l2(result(), ref)
            row["flex_us"] = _bench(run)
        except Exception as e:  # noqa: BLE001 - a baseline failing must not hide our numbers
            row["flex_error"] = f"{type(e).__name__}: {e}"[:300]
    try:
        run, result = _sdpa_runner(c, q, k, v, sinks, args.sdpa_mask_gib)
        if run is not None:
            row["sdpa_err"] = relative_l2(result(), ref)
            row["sdpa_us"] = _bench(run)
    except Exception as e:  # noqa: BLE001
        row["sdpa_error"] = f"{type(e).__name__}: {e}"[:300]
    torch.cuda.empty_cache()
    return row


def host_us(fn, calls: int = 200) -> float:
    """CPU µs per call of ``fn`` once its call signature has been seen: ``host_cost.per_call_us``
    (median of 7 timed runs of ``calls`` calls, the GPU work only queued and synchronised outside
    the timer)."""
    return per_call_us(fn, calls)


def _peer_columns(row, c: Case, q, k, v, sinks, starts, lens, ref, peers_loaded):
    """Upstream vLLM's op and vLLM's FlashAttention-3, on the same inputs in the same run. FA3 has
    no key-0 mode: key-0 rows time FA3 with the same sinks as null logits (its speed is the bar;
    its error there is not comparable and is left out)."""
    upstream, fa3 = peers_loaded
    if upstream is not None:
        o = torch.full_like(q, float("nan"))
        try:
            upstream(q, k, v, o, starts, lens, c.seq_len, **_op_kwargs(c, sinks))
            row["upstream_err"] = relative_l2(o, ref)
            row["upstream_us"] = _bench(
                lambda: upstream(q, k, v, o, starts, lens, c.seq_len, **_op_kwargs(c, sinks)))
        except Exception as e:  # noqa: BLE001 - a peer failing must not hide our numbers
            row["upstream_error"] = f"{type(e).__name__}: {e}"[:300]
    if fa3 is not None:
        from benchmarks.kernels.peers import cu_seqlens_from

        o = torch.full_like(q, float("nan"))
        cu = cu_seqlens_from(starts, lens)
        sinks_bf16 = sinks.to(torch.bfloat16)  # what FA3 takes: not a conversion per timed call

        def run():
            fa3(q, k, v, o, cu, c.seq_len, causal=c.is_causal, window_left=c.window_q,
                window_right=c.window_k, sinks=sinks_bf16)
        try:
            run()
            if c.sink_mode == "null":
                row["fa3_err"] = relative_l2(o, ref)
            row["fa3_us"] = _bench(run)
        except Exception as e:  # noqa: BLE001
            row["fa3_error"] = f"{type(e).__name__}: {e}"[:300]


def _ours_without_sinks(c, q, k, v, starts, lens, mil):
    o = torch.empty_like(q)
    context_attention_fwd(q, k, v, o, starts, lens, mil, is_causal=c.is_causal,
                          sliding_window_q=c.window_q, sliding_window_k=c.window_k)
    return o


def _fmt(x, spec="{:.1f}"):
    return "—" if x is None else spec.format(x)


def _ratio(num, den):
    return _fmt(num / den if num and den else None, "{:.2f}×")


def markdown(rows, bandwidth, device_name) -> str:
    out = [f"Device: {device_name}; copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write); bf16; "
           "µs = do_bench median (L2 flushed); host = CPU µs per call of a seen signature; "
           "upstream = vLLM 0.33.0's op and fa3 = vLLM's FlashAttention-3 (null sinks; key-0 rows: "
           "the same sinks as null logits, time only), both in this run; err = relative L2 vs the "
           "fp32 reference.", "",
           "| case | kernel | ours | graph | host | triton kernel | upstream | fa3 | floor "
           "| ours/floor | upstream/ours | fa3/ours | flex/ours | err ours | err upstream | err fa3 "
           "| err triton kernel | err torch bf16 | err without sinks |",
           "|---" * 19 + "|"]
    for r in rows:
        ours = r["ours_us"]
        out.append(
            f"| {r['case']} | {r['kernel']} | {ours:.1f} | {r['ours_graph_us']:.1f} "
            f"| {r['host_us']:.1f} | {r['triton_us']:.1f} | {_fmt(r.get('upstream_us'))} "
            f"| {_fmt(r.get('fa3_us'))} | {r['floor_us']:.1f} | {ours / r['floor_us']:.2f} "
            f"| {_ratio(r.get('upstream_us'), ours)} | {_ratio(r.get('fa3_us'), ours)} "
            f"| {_ratio(r.get('flex_us'), ours)} | {r['ours_err']:.2e} "
            f"| {_fmt(r.get('upstream_err'), '{:.2e}')} | {_fmt(r.get('fa3_err'), '{:.2e}')} "
            f"| {r['triton_err']:.2e} | {r['torch_bf16_err']:.2e} | {r['ours_no_sinks_err']:.2e} |")
    errors = [f"- {r['case']}: {name}: {r[name + '_error']}" for r in rows
              for name in ("upstream", "fa3", "flex", "sdpa") if name + "_error" in r]
    return "\n".join(out + (["", "Failed calls:"] + errors if errors else [])) + "\n"


# ---- tile-shape sweep ----------------------------------------------------------------------------

def _sweep(p, group: int) -> list[LaunchConfig]:
    """Tile shapes to time beside the default, most telling first (docs/kernels/portable.md).

    Loop layouts (one pipelined loop masking its edge blocks, masked edges in their own loops, one
    loop masking every block), keys per step (16: more per-step overhead, less band waste; 32: fewer instructions per key, more
    registers), register caps (programs per SM), pipeline depth, and 128-row tiles.
    """
    gp = group & -group
    C = LaunchConfig
    t64, t128 = 64 // gp, 128 // gp
    n16 = [C(t64, gp, 16, 4, 3, layout, 80) for layout in ("edges", "split", "one")]
    n16 += [C(t64, gp, 16, 4, 2, "edges", 80), C(t64, gp, 16, 4, 3, "edges", 72)]
    n32 = [C(t64, gp, 32, 4, st, "edges", reg) for st, reg in ((3, 112), (2, 104))]
    rows = [C(t128, gp, 16, 8, 3, "edges", 80)]
    return [s for s in n16 + n32 + rows if s.block_t >= 1]


def _time_config(p, cfg, q, k, v, o, starts, lens, sinks, ref, hint):
    def fn():
        launch(p, cfg, q, k, v, o, starts, lens, sinks, hint)

    kernel = launch(p, cfg, q, k, v, o, starts, lens, sinks, hint)
    regs = (getattr(kernel, "n_regs", None), getattr(kernel, "n_spills", None))
    return _bench(fn), relative_l2(o, ref), regs


def tune(cases, args) -> list[dict]:
    device = torch.device("cuda")
    results = []
    for c in cases:
        q, k, v, sinks, starts, lens = _inputs(c, device)
        kwargs = _op_kwargs(c, sinks)
        o = torch.empty_like(q)
        p = _validate(q, k, v, o, starts, lens, c.seq_len, c.is_causal, None, c.window_q, c.window_k,
                      sinks, c.sink_mode == "key0")
        ref = reference_prefill_attention(q, k, v, starts, lens, **kwargs)
        default = choose_config(p)
        t0 = time.time()
        mine = []
        # (shape, host bound on the longest sequence): the default also with the on-device search.
        todo = [(default, c.seq_len), (default, None)] + [
            (x, c.seq_len) for x in _sweep(p, c.q_heads // c.kv_heads) if x != default]
        while todo:
            cfg, hint = todo.pop(0)
            if time.time() - t0 > args.tune_seconds:
                print(f"  ({c.name}: stopped at the {args.tune_seconds} s budget)")
                break
            try:
                us, err, regs = _time_config(p, cfg, q, k, v, o, starts, lens, sinks, ref, hint)
                r = dict(case=c.name, config=dataclasses.asdict(cfg), us=us, err=err,
                         regs_spills=regs, default=(cfg == default and hint is not None),
                         sequence="grid" if hint is not None else "search")
            except Exception as e:  # noqa: BLE001 - out of resources etc.: skip that shape
                r = dict(case=c.name, config=dataclasses.asdict(cfg), error=f"{type(e).__name__}: {str(e)[:120]}")
            results.append(r)
            mine.append(r)
        best = sorted((r for r in mine if "us" in r), key=lambda r: r["us"])
        dflt = next((r["us"] for r in mine if r.get("default")), float("nan"))
        print(f"\n{c.name}: {len(mine)} shapes in {time.time() - t0:.0f} s; default {dflt:.1f} µs; best:")
        for r in best[:24]:
            print(f"  {r['us']:8.1f} µs err {r['err']:.2e} regs/spills {r['regs_spills']} "
                  f"{r['sequence']} {r['config']}")
        del q, k, v, o
        torch.cuda.empty_cache()
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/bench")
    ap.add_argument("--cases", default="", help="comma-separated substrings of case names")
    ap.add_argument("--flex", action="store_true", help="add FlexAttention (its compiles are slow)")
    ap.add_argument("--flex-cases", default="", help="only these cases get FlexAttention (substrings)")
    ap.add_argument("--sdpa-mask-gib", type=float, default=0.0, help="dense-mask SDPA up to this mask size")
    ap.add_argument("--peers", default=None, help="folder fetch_peers.sh filled (default .gpu/peers)")
    ap.add_argument("--tune", action="store_true", help="sweep tile shapes (then --table too)")
    ap.add_argument("--table", action="store_true", help="with --tune: also the table, with the "
                    "fastest swept shape timed beside the default")
    ap.add_argument("--tune-cases", default="mimo 4x16384,gpt-oss 4x16384")
    ap.add_argument("--tune-seconds", type=float, default=100.0, help="sweep budget per case")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    from benchmarks.kernels import peers
    from benchmarks.kernels.gpu_warmup import warm_gpu

    args.peers_loaded = (peers.upstream_op(args.peers), peers.fa3_varlen(args.peers))
    warm_gpu()
    cases = _cases()
    best = {}
    if args.tune:
        wanted = [w.strip() for w in args.tune_cases.split(",")]
        results = tune([c for c in cases if c.name in wanted], args)
        with open(os.path.join(args.out, "prefill_attention_tune.json"), "w") as f:
            json.dump(results, f, indent=1)
        for r in sorted((r for r in results if "us" in r and r["sequence"] == "grid"),
                        key=lambda r: -r["us"]):
            best[r["case"]] = LaunchConfig(**r["config"])  # fastest last, so it wins
        if not args.table:
            return
    if args.cases:
        wanted = [w.strip() for w in args.cases.split(",")]
        cases = [c for c in cases if any(w in c.name for w in wanted)]
    t0 = time.time()
    bandwidth = copy_bandwidth(torch.device("cuda"))
    rows = []
    for c in cases:
        rows.append(measure_case(c, bandwidth, args, best.get(c.name)))
        r = rows[-1]
        print(f"{c.name:18s} ours ({r['kernel']}) {r['ours_us']:8.1f} µs (graph {r['ours_graph_us']:8.1f}, "
              f"host {r['host_us']:.1f}, triton kernel {r['triton_us']:8.1f}, "
              f"upstream {_fmt(r.get('upstream_us'))}, fa3 {_fmt(r.get('fa3_us'))}, "
              f"tuned {_fmt(r.get('ours_tuned_us'))}) "
              f"flex {_fmt(r.get('flex_us'))} sdpa {_fmt(r.get('sdpa_us'))} floor {r['floor_us']:.1f} "
              f"err {r['ours_err']:.2e} (torch bf16 {r['torch_bf16_err']:.2e}) "
              f"{r.get('flex_error', '')}{r.get('sdpa_error', '')}", flush=True)
    import triton

    name = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"
    md = markdown(rows, bandwidth, name)
    with open(os.path.join(args.out, "prefill_attention.md"), "w") as f:
        f.write(md)
    with open(os.path.join(args.out, "prefill_attention.json"), "w") as f:
        json.dump(dict(device=name, bandwidth=bandwidth, torch=torch.__version__,
                       triton=triton.__version__,
                       seconds=time.time() - t0, rows=rows), f, indent=1)
    print()
    print(md)


if __name__ == "__main__":
    main()
