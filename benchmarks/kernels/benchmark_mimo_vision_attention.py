"""Benchmark MiMo-V2.5 vision window attention with sinks: the vllm-sinks op beside FlexAttention.

What it times, for one image of ``--images`` tokens (default one 4096-token image, 1024×1024 px):

* per window layer: one call of the window attention (32 query / 8 KV heads, head dim 64, window 64
  each side, per-head sinks) -- what each of the 24 window blocks of the encoder runs;
* per encoder pass: the 24 window layers one after another, each on its own q / k / v / sinks (the
  attention share of one pass; the 4 full-attention blocks, projections and MLPs are not included).

Variants: our op through ``window_attention_with_sinks`` with the sinks as key-0 bias (the default
semantics), as null logit (opt-in), and without sinks (the cost of the sinks); FlexAttention
(``torch.compile(flex_attention)``, block mask ``same image and |i - j| <= w``) with a score_mod adding
``sinks[h]`` at key 0, and with the null logit applied from its log-sum-exp. Each variant's relative
L2 error is measured on layer 0 against the project's fp32 banded reference of its semantics.

Needs torch and Triton only (no vLLM)::

    python benchmarks/kernels/benchmark_mimo_vision_attention.py --out DIR          # on a GPU
    TRITON_INTERPRET=1 python benchmarks/kernels/benchmark_mimo_vision_attention.py --out DIR \\
        --device cpu --images 40 --heads 4 --kv-heads 2 --head-dim 16 --window 4 --layers 3 \\
        --dtype fp32 --reps 2                                                          # logic check

Writes ``DIR/mimo_vision_attention.md`` (the table) and ``DIR/mimo_vision_attention.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time
from typing import Callable

import torch

_REPO = pathlib.Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # run from a checkout without installing the package
    sys.path.insert(0, str(_REPO))

from vllm_sinks.model_executor.models.mimo_v2_omni import window_attention_with_sinks  # noqa: E402
from vllm_sinks.v1.attention.ops.prefill_attention_reference import (  # noqa: E402
    reference_prefill_attention,
    relative_l2,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=pathlib.Path, help="directory for the table and JSON")
    p.add_argument("--images", default="4096", help="image lengths in tokens, comma-separated")
    p.add_argument("--layers", type=int, default=24, help="window layers in one encoder pass")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--window", type=int, default=64, help="tokens on each side")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--reps", type=int, default=100, help="timed repetitions (CPU); do_bench ms on GPU")
    p.add_argument("--no-flex", action="store_true", help="skip the FlexAttention rows")
    p.add_argument("--flex-eager", action="store_true",
                   help="run flex_attention without torch.compile (default on CPU)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        args.lengths = [int(x) for x in args.images.split(",") if x.strip()]
    except ValueError:
        p.error(f"--images must be comma-separated integers, got {args.images!r}")
    if not args.lengths or min(args.lengths) < 1:
        p.error("--images needs at least one positive length")
    for name in ("layers", "heads", "kv_heads", "head_dim", "window", "reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("no CUDA device here: pass --device cpu (with TRITON_INTERPRET=1) for a logic check")
    return args


# ---- inputs ----------------------------------------------------------------------------------------


def make_layers(args, device) -> tuple[list[dict], torch.Tensor]:
    """One dict of q, k, v, sinks per window layer (distinct tensors, as in a real encoder pass)."""
    gen = torch.Generator(device=device).manual_seed(args.seed)
    dtype, tokens = DTYPES[args.dtype], sum(args.lengths)
    layers = []
    for _ in range(args.layers):
        def randn(*shape):
            return torch.randn(*shape, generator=gen, device=device)
        layers.append(dict(
            q=randn(tokens, args.heads, args.head_dim).to(dtype),
            k=randn(tokens, args.kv_heads, args.head_dim).to(dtype),
            v=randn(tokens, args.kv_heads, args.head_dim).to(dtype),
            sinks=(2 * randn(args.heads)).to(dtype),  # N(0, 2²), as in the op baselines
        ))
    cu = torch.tensor([0, *torch.tensor(args.lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return layers, cu


# ---- the variants ------------------------------------------------------------------------------------


def our_variant(semantics: str | None, cu, args) -> Callable[[dict], torch.Tensor]:
    # max_seqlen as the tower passes it: a host tensor (read on the host, no device sync).
    max_seqlen = torch.tensor(max(args.lengths))

    def run(layer):
        sinks = None if semantics is None else layer["sinks"]
        return window_attention_with_sinks(layer["q"], layer["k"], layer["v"], cu, max_seqlen, args.window,
                                           sinks, semantics or "key0")

    return run


def flex_variants(cu, args, device) -> dict[str, Callable[[dict], torch.Tensor]]:
    """FlexAttention with the same mask, both sink semantics. Inputs are pre-laid out as [1, H, T, D]."""
    from torch.nn.attention import flex_attention as fa

    tokens = sum(args.lengths)
    doc = torch.repeat_interleave(torch.arange(len(args.lengths), device=device),
                                  torch.tensor(args.lengths, device=device))
    pos = torch.arange(tokens, device=device) - cu[:-1].long()[doc]
    window, scale = args.window, args.head_dim ** -0.5

    def same_image_within_window(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & ((pos[q_idx] - pos[kv_idx]).abs() <= window)

    block_mask = fa.create_block_mask(same_image_within_window, B=None, H=None, Q_LEN=tokens,
                                      KV_LEN=tokens, device=device)
    has_aux = hasattr(fa, "AuxRequest")

    def attend(q, k, v, score_mod=None, want_lse=False):
        kwargs = dict(score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=True)
        if not want_lse:
            return fa.flex_attention(q, k, v, **kwargs), None
        if has_aux:
            out, aux = fa.flex_attention(q, k, v, return_aux=fa.AuxRequest(lse=True), **kwargs)
            return out, aux.lse
        return fa.flex_attention(q, k, v, return_lse=True, **kwargs)

    def key0(q, k, v, sinks):
        def bias_key0(score, b, h, q_idx, kv_idx):
            return torch.where(pos[kv_idx] == 0, score + sinks[h].to(score.dtype), score)
        return attend(q, k, v, score_mod=bias_key0)[0]

    def null(q, k, v, sinks):
        out, lse = attend(q, k, v, want_lse=True)  # lse: natural log, [1, H, T]
        keep = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))  # Σe^s / (Σe^s + e^sink)
        return (out.float() * keep.unsqueeze(-1)).to(out.dtype)

    compile_ = (lambda f: f) if args.flex_eager else (lambda f: torch.compile(f, dynamic=False))
    fns = {"key0": compile_(key0), "null": compile_(null)}

    def as_flex(layer):  # [T, H, D] -> [1, H, T, D], done once outside the timed region
        if "flex" not in layer:
            layer["flex"] = tuple(layer[n].transpose(0, 1).unsqueeze(0).contiguous() for n in "qkv")
        return layer["flex"]

    def variant(semantics):
        fn = fns[semantics]

        def run(layer):
            q, k, v = as_flex(layer)
            return fn(q, k, v, layer["sinks"])[0].transpose(0, 1)

        return run

    return {"key0": variant("key0"), "null": variant("null")}


# ---- timing ------------------------------------------------------------------------------------------


def time_ms(fn: Callable[[], object], args, device) -> float:
    """Median milliseconds per call."""
    fn()  # compile / warm up
    if device.type == "cuda":
        import triton.testing

        torch.cuda.synchronize()
        return float(triton.testing.do_bench(fn, warmup=25, rep=args.reps, return_mode="median"))
    samples = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def run_benchmark(args) -> dict:
    device = torch.device(args.device)
    layers, cu = make_layers(args, device)
    b_start, b_len = cu[:-1], cu[1:] - cu[:-1]
    ref_args = dict(is_causal=False, sliding_window_q=args.window, sliding_window_k=args.window,
                    softmax_scale=args.head_dim ** -0.5, dtype=torch.float32)
    first = layers[0]
    refs = {
        semantics: reference_prefill_attention(first["q"], first["k"], first["v"], b_start, b_len,
                                               sinks=first["sinks"], sinks_bias_key0=semantics == "key0",
                                               **ref_args)
        for semantics in ("key0", "null")
    }
    variants = [
        ("vllm-sinks op, sinks as key-0 bias (default)", "key0", our_variant("key0", cu, args)),
        ("vllm-sinks op, sinks as null logit (opt-in)", "null", our_variant("null", cu, args)),
        ("vllm-sinks op, sinks dropped", "key0", our_variant(None, cu, args)),
    ]
    if not args.no_flex:
        flex = flex_variants(cu, args, device)
        variants += [("FlexAttention, key-0 bias score_mod", "key0", flex["key0"]),
                     ("FlexAttention, null logit from LSE", "null", flex["null"])]
    rows = []
    for name, semantics, run in variants:
        err = relative_l2(run(first), refs[semantics])
        layer_ms = time_ms(lambda run=run: run(first), args, device)
        pass_ms = time_ms(lambda run=run: [run(layer) for layer in layers], args, device)
        rows.append(dict(variant=name, semantics=semantics, layer_us=layer_ms * 1e3, pass_ms=pass_ms,
                         rel_err=err))
        print(f"  {name}: {layer_ms * 1e3:.1f} µs/layer, {pass_ms:.3f} ms/pass, err {err:.2e}", flush=True)
    return dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__, triton=_triton_version(), dtype=args.dtype, images=args.lengths,
        layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
        window=args.window, flex_compiled=not args.flex_eager, rows=rows,
    )


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "not installed"


def render_table(result: dict) -> str:
    flex_ms = {r["semantics"]: r["pass_ms"] for r in result["rows"] if r["variant"].startswith("Flex")}
    head = (f"MiMo-V2.5 vision window attention, {result['dtype']}, images {result['images']} tokens, "
            f"{result['heads']}/{result['kv_heads']} heads, head dim {result['head_dim']}, window "
            f"{result['window']}, {result['layers']} window layers per pass; {result['device']}, torch "
            f"{result['torch']}, triton {result['triton']}"
            + ("" if result["flex_compiled"] else "; FlexAttention NOT compiled (eager)") + ".")
    lines = [head, "",
             "| variant | per window layer (µs) | per encoder pass (ms) | speed-up over FlexAttention "
             "(pass, same semantics) | rel. err vs fp32 ref |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        ratio = flex_ms.get(r["semantics"])
        speed = "—" if r["variant"].startswith("Flex") or ratio is None else f"{ratio / r['pass_ms']:.2f}×"
        lines.append(f"| {r['variant']} | {r['layer_us']:.1f} | {r['pass_ms']:.3f} | {speed} "
                     f"| {r['rel_err']:.2e} |")
    lines += ["", "Errors are measured on layer 0 against the fp32 banded reference of the row's semantics "
                  "(the dropped-sinks row against the key-0 reference: what ignoring the sinks costs)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run_benchmark(args)
    table = render_table(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mimo_vision_attention.md").write_text(table)
    (args.out / "mimo_vision_attention.json").write_text(json.dumps(result, indent=2) + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
