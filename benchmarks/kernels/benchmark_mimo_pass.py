"""One MiMo-V2.5 vision encoder pass of window attention, eager, as vLLM runs it: ours beside upstream's.

    python3 benchmarks/kernels/benchmark_mimo_pass.py [--images 256,1024,4096,16384] [--peers DIR] [--out DIR]

Per image size (one image of that many tokens), 24 window layers one after another, each on its own
q / k / v / sinks (32 / 8 heads, head dim 64, window 64 each side, bf16, key-0 sinks), no CUDA graph:

- q and k contiguous (the rotary embedding's outputs), v a view of the layer's fused QKV projection;
  ``cu_seqlens`` one int32 tensor on the GPU for every layer, ``max_seqlen`` one host 0-d tensor
  (MiMo derives it from ``grid_thw``);
- **ours**: the patched ``MiMoVisionAttention._forward_window_attn``
  (``mimo_v2_omni.make_forward_window_attn``) bound to a stand-in of the layer (its sinks, window,
  scale, head partition): this rank's sinks, the wrapper, our op;
- **upstream**: vLLM 0.33.0's op (``peers.upstream_op``) called the way 0.33's
  ``_forward_window_attn`` calls it: a fresh output like q, this rank's slice of the sinks, start
  offsets and lengths sliced and subtracted from ``cu_seqlens``, the op with keywords;
- ms / pass: ``triton.testing.do_bench`` median of the whole pass (L2 flushed before each pass),
  each layer's output dropped before the next layer (``pass_of``);
- CPU µs / layer: ours, one layer's call of a seen signature (``host_cost.per_call_us``: the GPU
  work only queued, synchronised outside the timer);
- every number the best of ``--rounds`` rounds over all image sizes, interleaved: the GPU
  machine's host CPU is shared, and its noise only ever adds (one run there measured the same
  1024-token layer at 13 and 19 µs);
- kernel µs / layer: our op's launches of the pass captured in one CUDA graph and replayed (no host
  cost), / 24;
- pass / (24 × kernel): 1.0 is a pass bound by the GPU alone; the target is ≤ 1.15 on 1024 and 4096.

Errors of both against the fp32 reference, on layer 0. Writes ``mimo_pass.md`` / ``.json`` to
``--out`` (default ``$OUT``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

HEADS, KV_HEADS, HEAD_DIM, WINDOW, LAYERS = 32, 8, 64, 64, 24


def make_layers(tokens: int, seed: int = 0) -> list:
    g = torch.Generator(device="cuda").manual_seed(seed)
    layers = []
    for _ in range(LAYERS):
        qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, HEAD_DIM, device="cuda", generator=g).bfloat16()
        q = torch.randn(tokens, HEADS, HEAD_DIM, device="cuda", generator=g).bfloat16()
        k = torch.randn(tokens, KV_HEADS, HEAD_DIM, device="cuda", generator=g).bfloat16()
        attn = types.SimpleNamespace(  # what _forward_window_attn reads off the layer
            sinks=torch.randn(HEADS, device="cuda", generator=g).bfloat16() * 2,
            num_heads_per_partition=HEADS, tp_rank=0, tp_size=1,
            visual_token_window_size=WINDOW, scale=HEAD_DIM ** -0.5)
        layers.append((attn, q, k, qkv[:, HEADS + KV_HEADS:]))
    return layers


def upstream_window_layer(op):
    """upstream 0.33's per-call pattern around its op (see the module docstring)."""

    def forward(attn, q, k, v, cu_seqlens, max_seqlen):
        output = torch.empty_like(q)
        start = attn.tp_rank * attn.num_heads_per_partition
        sinks = attn.sinks[start:start + attn.num_heads_per_partition]
        op(q, k, v, output, b_start_loc=cu_seqlens[:-1],
           b_seq_len=cu_seqlens[1:] - cu_seqlens[:-1], max_input_len=max_seqlen, is_causal=False,
           softmax_scale=attn.scale, sliding_window_q=attn.visual_token_window_size,
           sliding_window_k=attn.visual_token_window_size, sinks=sinks, sinks_bias_key0=True)
        return output

    return forward


def pass_of(forward, layers, cu, max_seqlen) -> None:
    """One pass: each layer's output dropped before the next layer runs, as in the tower (the block
    projects it, and it is freed; keeping all 24 alive would make
    every layer's allocation find a new block)."""
    for layer in layers:
        forward(*layer, cu, max_seqlen)


def kernel_us_per_layer(layers, cu, max_seqlen, bench) -> float:
    """Our op's launches of one pass in a CUDA graph, replayed: µs per layer, no host cost."""
    from vllm_sinks.v1.attention.ops.triton_prefill_attention import context_attention_fwd

    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    outs = [torch.empty_like(q) for _, q, _, _ in layers]

    def launches():
        for (attn, q, k, v), o in zip(layers, outs):
            context_attention_fwd(q, k, v, o, starts, lengths, max_seqlen, False, attn.scale, WINDOW,
                                  WINDOW, attn.sinks, True)

    launches()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launches()
    return bench(graph.replay) * 1e3 / len(layers)


def measure(tokens: int, upstream, bench) -> dict:
    from benchmarks.kernels.host_cost import per_call_us
    from vllm_sinks.model_executor.models.mimo_v2_omni import make_forward_window_attn
    from vllm_sinks.v1.attention.ops.prefill_attention_reference import (
        reference_prefill_attention,
        relative_l2,
    )

    layers = make_layers(tokens)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    max_seqlen = torch.tensor(tokens)  # a host 0-d tensor, as MiMo's tower passes it
    ours = make_forward_window_attn("key0")
    row = dict(tokens=tokens)
    attn, q, k, v = layers[0]
    ref = reference_prefill_attention(q, k, v, cu[:-1], cu[1:] - cu[:-1], is_causal=False,
                                      sliding_window_q=WINDOW, sliding_window_k=WINDOW,
                                      softmax_scale=attn.scale, sinks=attn.sinks, sinks_bias_key0=True,
                                      dtype=torch.float32)
    candidates = [("ours", ours)] + ([("upstream", upstream_window_layer(upstream))] if upstream else [])
    for name, forward in candidates:
        row[f"{name}_err"] = relative_l2(forward(attn, q, k, v, cu, max_seqlen), ref)
        row[f"{name}_ms"] = bench(lambda: pass_of(forward, layers, cu, max_seqlen))
    row["cpu_us"] = per_call_us(lambda: ours(*layers[0], cu, max_seqlen), 1000)
    row["kernel_us"] = kernel_us_per_layer(layers, cu, max_seqlen, bench)
    row["bound"] = row["ours_ms"] * 1e3 / (LAYERS * row["kernel_us"])
    del layers
    torch.cuda.empty_cache()
    return row


def markdown(rows, header) -> str:
    cols = ["image tokens", "ours ms / pass", "upstream ms / pass", "upstream / ours", "our CPU µs / layer",
            "kernel µs / layer", "pass / (24 × kernel)", "err ours", "err upstream"]
    out = [header, "", "| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]

    def f(x, spec="{:.3f}"):
        return "—" if x is None else spec.format(x)

    for r in rows:
        up, ours = r.get("upstream_ms"), r["ours_ms"]
        out.append("| " + " | ".join([
            f"{r['tokens']:,}", f(ours), f(up), f(up / ours if up else None, "{:.2f}×"),
            f(r["cpu_us"], "{:.1f}"), f(r["kernel_us"], "{:.1f}"), f(r["bound"], "{:.2f}"),
            f(r["ours_err"], "{:.2e}"), f(r.get("upstream_err"), "{:.2e}")]) + " |")
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", default="256,1024,4096,16384")
    ap.add_argument("--peers", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT") or None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    import triton
    import triton.testing

    from benchmarks.kernels import peers
    from benchmarks.kernels.gpu_warmup import warm_gpu

    upstream = peers.upstream_op(args.peers)
    warm_gpu()

    def bench(fn):
        fn()
        torch.cuda.synchronize()
        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))

    sizes = [int(x) for x in args.images.split(",")]
    best: dict = {}
    for _ in range(args.rounds):
        for tokens in sizes:
            row = measure(tokens, upstream, bench)
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
            kept = best.setdefault(tokens, row)
            for name, value in row.items():
                if name.endswith(("_ms", "_us")) and value < kept[name]:
                    kept[name] = value
    rows = [best[tokens] for tokens in sizes]
    for r in rows:
        r["bound"] = r["ours_ms"] * 1e3 / (LAYERS * r["kernel_us"])
    header = (f"MiMo-V2.5 window attention, one encoder pass (24 window layers, eager), one image, "
              f"best of {args.rounds} rounds; "
              f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
              f"32/8 heads, D 64, window 64, key-0 sinks, bf16; upstream = vLLM 0.33.0's op "
              f"{'as its _forward_window_attn calls it' if upstream else 'NOT loaded'}.")
    md = markdown(rows, header)
    print("\n" + md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "mimo_pass.md"), "w") as f:
            f.write(md)
        with open(os.path.join(args.out, "mimo_pass.json"), "w") as f:
            json.dump(dict(triton=triton.__version__, torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
