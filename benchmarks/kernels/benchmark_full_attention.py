"""Full attention (no window, no sinks, non-causal): our prefill op against vLLM's own, in one run.

These are the calls vLLM's Triton ViT attention (any VLM that selects it) and the Triton backend's
encoder-only path make to ``context_attention_fwd``. On a GPU (bf16):

    bash benchmarks/kernels/fetch_peers.sh .gpu/peers          # here, once: the peers (git-ignored)
    python3 benchmarks/kernels/benchmark_full_attention.py [--fa3] [--peers .gpu/peers] [--shapes SUBSTR,...]

On the CPU, to check that it runs (Triton's interpreter, tiny fp32 shapes, no timing worth reading):

    TRITON_INTERPRET=1 python3 benchmarks/kernels/benchmark_full_attention.py --smoke [--fa3]

- ours: ``vllm_sinks.v1.attention.ops.triton_prefill_attention.context_attention_fwd``;
- upstream: vLLM 0.33.0's ``context_attention_fwd`` loaded by ``peers.upstream_op`` (same call);
- fa3 (``--fa3``): vLLM's FlashAttention-3 varlen (``peers.fa3_varlen``), non-causal, no window;
- µs: ``triton.testing.do_bench`` median (L2 flushed before each call) after a GPU warm-up and one
  call of each op; ``max_input_len`` a Python int, ``b_start_loc``/``b_seq_len`` int32 on the GPU;
- err: relative L2 norm ‖out − ref‖ / ‖ref‖ against an fp32 reference computed with torch on the GPU
  (``prefill_attention_reference``), q/k/v random normal.

Prints a markdown table and writes ``full_attention.md`` / ``full_attention.json`` to ``--out``
(default ``$OUT``; nothing written when neither is set). The shapes are one module-level list,
``FULL_ATTENTION_SHAPES``, for other code to import (``from benchmarks.kernels.benchmark_full_attention
import FULL_ATTENTION_SHAPES``).
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


@dataclasses.dataclass(frozen=True)
class FullShape:
    """Packed sequences of ``lens``, ``heads`` query heads (= KV heads unless ``kv_heads``) of ``head_dim``."""

    name: str
    lens: tuple[int, ...]
    heads: int
    head_dim: int
    kv_heads: int | None = None
    #: vLLM 0.33.0's op on the H200, bf16, µs (shared/notes/op-baselines.md, 2026-11-30), if recorded.
    upstream_notes_us: float | None = None
    #: None: the run's dtype (bf16 on a GPU)
    dtype: str | None = None
    is_causal: bool = False

    @property
    def tokens(self) -> int:
        return sum(self.lens)

    @property
    def max_len(self) -> int:
        return max(self.lens)

    @property
    def hkv(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def batch(self) -> str:
        if len(set(self.lens)) == 1:
            return f"{len(self.lens)}×{self.lens[0]}"
        return "(" + ", ".join(map(str, self.lens)) + ")"


FULL_ATTENTION_SHAPES: list[FullShape] = [
    FullShape("qwen2.5-vl 1x1024", (1024,), 16, 80, upstream_notes_us=37.4),
    FullShape("qwen2.5-vl 4x4096", (4096,) * 4, 16, 80, upstream_notes_us=1913.0),
    FullShape("qwen2.5-vl 1x16384", (16384,), 16, 80, upstream_notes_us=7322.0),
    FullShape("siglip 8x729", (729,) * 8, 16, 72, upstream_notes_us=608.0),
    FullShape("internvit 6x1025", (1025,) * 6, 25, 128, upstream_notes_us=419.0),
    FullShape("mixed lengths", (256, 1024, 4000, 77, 2500), 16, 64, upstream_notes_us=420.0),
    FullShape("encoder 64x512", (512,) * 64, 12, 64, upstream_notes_us=275.0),
    FullShape("encoder 256x128", (128,) * 256, 12, 64, upstream_notes_us=105.0),
    # Shapes no model list names (the dispatch must hold on any shape, so any
    # shape must come out >= 0.97 x upstream): other head dims, head counts, GQA, lengths, batch
    # mixes, fp16 / fp32, causal, and small host-bound calls.
    FullShape("tiny 1x64 D64", (64,), 8, 64),
    FullShape("small 2x300 D96", (300, 300), 12, 96),
    FullShape("D128 1x4096", (4096,), 16, 128),
    FullShape("D128 12x577 h12", (577,) * 12, 12, 128),
    FullShape("D112 3x1500", (1500,) * 3, 14, 112),
    FullShape("D32 4x2048 h32", (2048,) * 4, 32, 32),
    FullShape("D256 2x1024 h8", (1024, 1024), 8, 256),
    FullShape("GQA 32/8 D128 2x2048", (2048, 2048), 32, 128, kv_heads=8),
    FullShape("ragged D80 (17,900,3100,5)", (17, 900, 3100, 5), 16, 80),
    FullShape("D72 1x3000 fp16", (3000,), 16, 72, dtype="fp16"),
    FullShape("D64 2x1024 fp32", (1024, 1024), 16, 64, dtype="fp32"),
    FullShape("causal D128 2x2048", (2048, 2048), 16, 128, is_causal=True),
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

#: --smoke: tiny shapes for Triton's interpreter (fp32): uneven lengths, a head dim that is not a power of 2.
SMOKE_SHAPES: list[FullShape] = [
    FullShape("smoke 2x40", (40, 40), 2, 64),
    FullShape("smoke mixed D 72", (33, 7, 50), 2, 72),
]


def _inputs(s: FullShape, device, dtype, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(s.tokens, s.heads, s.head_dim, device=device, dtype=dtype, generator=g)
    k = torch.randn(s.tokens, s.hkv, s.head_dim, device=device, dtype=dtype, generator=g)
    v = torch.randn(s.tokens, s.hkv, s.head_dim, device=device, dtype=dtype, generator=g)
    lens = torch.tensor(s.lens, device=device, dtype=torch.int32)
    starts = torch.zeros_like(lens)
    starts[1:] = torch.cumsum(lens, 0)[:-1]
    return q, k, v, starts, lens


def _timer(device):
    """Median µs: do_bench on a GPU; on the CPU (interpreter) one wall-clock call, only to show it runs."""
    if device.type == "cuda":
        import triton

        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3

    def wall(fn):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6

    return wall


def measure(s: FullShape, device, dtype, ours, upstream, fa3, bench) -> dict:
    from benchmarks.kernels.peers import cu_seqlens_from
    from vllm_sinks.v1.attention.ops.prefill_attention_reference import (
        reference_prefill_attention,
        relative_l2,
    )

    if s.dtype is not None and device.type == "cuda":
        dtype = DTYPES[s.dtype]
    causal = s.is_causal
    q, k, v, starts, lens = _inputs(s, device, dtype)
    ref = reference_prefill_attention(q, k, v, starts, lens, is_causal=causal, dtype=torch.float32)
    row = dict(shape=s.name, batch=s.batch, tokens=s.tokens, heads=f"{s.heads}/{s.hkv}", head_dim=s.head_dim,
               upstream_notes_us=s.upstream_notes_us, dtype=str(dtype).replace("torch.", ""),
               causal=causal)
    max_len = s.max_len  # a Python int, as vLLM's callers pass it (upstream needs one)

    def run(name, fn):
        o = torch.full_like(q, float("nan"))
        try:
            fn(o)  # compile + check, before any timing
            row[f"{name}_err"] = relative_l2(o, ref)
            row[f"{name}_us"] = bench(lambda: fn(o))
            if name in ("upstream", "dispatch") and device.type == "cuda":
                row[f"{name}_loop_us"] = back_to_back_us(lambda: fn(o))
        except Exception as e:  # noqa: BLE001 - a peer failing must not hide the other numbers
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]

    from vllm_sinks.v1.attention.ops import triton_prefill_attention as op

    op.use_upstream_op(None)  # "ours": our kernels only
    run("ours", lambda o: ours(q, k, v, o, starts, lens, max_len, is_causal=causal))
    if upstream is not None:
        run("upstream", lambda o: upstream(q, k, v, o, starts, lens, max_len, is_causal=causal))
        # What the op does where the prefill-op patch registered upstream's op (as in vLLM): the
        # shipped table's verdict for the call's class (full_attention_table), nothing timed.
        op.use_upstream_op(upstream)
        run("dispatch", lambda o: ours(q, k, v, o, starts, lens, max_len, is_causal=causal))
        chosen = op._PLANS.get(op.call_key(q, k, v, q, starts, lens, max_len, causal, None, None,
                                           None, None, False))
        if chosen is not None:
            row["kernel"] = "upstream" if chosen.upstream_takes(max_len) else chosen.kernel
        op.use_upstream_op(None)
    if fa3 is not None and not causal:
        cu = cu_seqlens_from(starts, lens)
        run("fa3", lambda o: fa3(q, k, v, o, cu, max_len, causal=False))
    del q, k, v, ref
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def back_to_back_us(fn, calls: int = 100, reps: int = 5) -> float:
    """µs per call of ``calls`` calls in a row between two synchronisations (best of ``reps``): what
    an eager caller waits, host cost included (do_bench's L2 flush before each call hides the host
    cost of a small call)."""
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def _f(x, spec="{:.1f}"):
    return "—" if x is None else spec.format(x)


def markdown(rows, header: str, with_fa3: bool) -> str:
    cols = ["shape", "sequences", "tokens", "heads q/kv", "D", "dtype", "ours µs", "upstream µs",
            "ours vs upstream (upstream µs / ours µs)", "dispatch: kernel (table)",
            "dispatch µs", "dispatch vs upstream", "back to back: upstream µs", "dispatch µs",
            "dispatch vs upstream"]
    if with_fa3:
        cols += ["fa3 µs", "ours vs fa3 (fa3 µs / ours µs)"]
    cols += ["upstream µs (notes)", "err ours", "err upstream"] + (["err fa3"] if with_fa3 else [])
    out = [header, "", "| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]
    for r in rows:
        ours, up, fa = r.get("ours_us"), r.get("upstream_us"), r.get("fa3_us")
        disp = r.get("dispatch_us")
        kernel = r.get("kernel", "—")
        cells = [r["shape"], r["batch"], f"{r['tokens']:,}", r["heads"], str(r["head_dim"]),
                 r.get("dtype", "—") + (", causal" if r.get("causal") else ""), _f(ours), _f(up),
                 _f(up / ours if ours and up else None, "{:.2f}×"), kernel, _f(disp),
                 _f(up / disp if disp and up else None, "{:.2f}×")]
        up_loop, disp_loop = r.get("upstream_loop_us"), r.get("dispatch_loop_us")
        cells += [_f(up_loop), _f(disp_loop), _f(up_loop / disp_loop if up_loop and disp_loop else None,
                                                "{:.2f}×")]
        if with_fa3:
            cells += [_f(fa), _f(fa / ours if ours and fa else None, "{:.2f}×")]
        cells += [_f(r.get("upstream_notes_us")), _f(r.get("ours_err"), "{:.2e}"),
                  _f(r.get("upstream_err"), "{:.2e}")]
        if with_fa3:
            cells.append(_f(r.get("fa3_err"), "{:.2e}"))
        out.append("| " + " | ".join(cells) + " |")
    errors = [f"- {r['shape']}: {name}: {r[f'{name}_error']}" for r in rows
              for name in ("ours", "upstream", "dispatch", "fa3") if f"{name}_error" in r]
    if errors:
        out += ["", "Failed calls:"] + errors
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default=None, help="folder fetch_peers.sh filled (default .gpu/peers)")
    ap.add_argument("--fa3", action="store_true", help="add vLLM's FlashAttention-3 as a column")
    ap.add_argument("--smoke", action="store_true", help="tiny fp32 shapes (CPU: Triton's interpreter)")
    ap.add_argument("--shapes", default="", help="comma-separated substrings of shape names")
    ap.add_argument("--out", default=os.environ.get("OUT") or None, help="folder for the table (default $OUT)")
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda:
        if not args.smoke:
            sys.exit("needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1 on the CPU)")
        # Triton reads it when a kernel is decorated: before the op modules below are imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        # Upstream divides the rows past a sequence's end by a zero softmax sum (never stored).
        warnings.filterwarnings("ignore", "invalid value encountered in divide", RuntimeWarning)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    from benchmarks.kernels import peers
    from benchmarks.kernels.gpu_warmup import warm_gpu
    from vllm_sinks.v1.attention.ops.triton_prefill_attention import context_attention_fwd

    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    shapes = SMOKE_SHAPES if args.smoke else FULL_ATTENTION_SHAPES
    if args.shapes:
        wanted = [w.strip() for w in args.shapes.split(",") if w.strip()]
        shapes = [s for s in shapes if any(w in s.name for w in wanted)]
    upstream = peers.upstream_op(args.peers)
    fa3 = peers.fa3_varlen(args.peers) if args.fa3 else None
    if fa3 is not None and dtype == torch.float32:
        print("[peers] FA3: skipped (no fp32 kernels; --smoke runs fp32)")
        fa3 = None

    import triton

    name = torch.cuda.get_device_name() if cuda else "CPU (Triton interpreter: times are not a benchmark)"
    header = (f"Device: {name}; torch {torch.__version__}, triton {triton.__version__}; "
              f"{str(dtype).replace('torch.', '')}; full attention (non-causal, no window, no sinks); "
              + ("µs = do_bench median (L2 flushed); " if cuda else "µs = one call's wall time; ")
              + "err = relative L2 vs an fp32 torch reference. "
              f"upstream: vLLM 0.33.0 context_attention_fwd {'loaded' if upstream else 'not loaded'}.")
    if cuda:
        warm_gpu()
    bench = _timer(device)
    rows = []
    t0 = time.time()
    for s in shapes:
        r = measure(s, device, dtype, context_attention_fwd, upstream, fa3, bench)
        rows.append(r)
        print(f"{s.name:20s} ours {_f(r.get('ours_us')):>8s} µs  upstream {_f(r.get('upstream_us')):>8s} µs"
              + (f"  fa3 {_f(r.get('fa3_us')):>8s} µs" if args.fa3 else "")
              + f"  err ours {_f(r.get('ours_err'), '{:.2e}')} upstream {_f(r.get('upstream_err'), '{:.2e}')}"
              + "".join(f"  {k}: {v}" for k, v in r.items() if k.endswith("_error")), flush=True)
    md = markdown(rows, header, args.fa3)
    print()
    print(md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "full_attention.md"), "w") as f:
            f.write(md)
        with open(os.path.join(args.out, "full_attention.json"), "w") as f:
            json.dump(dict(device=name, torch=torch.__version__, triton=triton.__version__,
                           dtype=str(dtype), seconds=time.time() - t0, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
