"""Tile shapes of the Hopper full-attention kernel, timed against each other and upstream's op.

    python3 benchmarks/kernels/sweep_full_tiles.py [--peers .gpu/peers] [--out DIR]

On the GPU machine (no vLLM: upstream's op comes from ``fetch_peers.sh``'s files). Each candidate
``TileConfig`` of ``CANDIDATES`` runs every shape of ``SHAPES`` (checked against upstream's output:
both are at the bf16 floor, so they agree to ~3e-3), timed by ``do_bench`` (median, L2 flushed),
interleaved over two rounds (the spread is the noise), with FA3 (``fetch_peers.sh``) for scale.
``gluon_full_attention.default_tile`` takes the fastest by geometric mean per computed width
(docs/benchmarks.md, "Hopper full-attention kernel: tile shapes"); this script is how that choice
was made and how to remake it on another GPU or Triton. ``CANDIDATES`` holds the last call's
candidates; the earlier calls' are in that section.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.kernels import peers  # noqa: E402
from benchmarks.kernels.benchmark_full_attention import FullShape, _inputs  # noqa: E402
from benchmarks.kernels.gpu_warmup import warm_gpu  # noqa: E402
from vllm_sinks.v1.attention.ops import gluon_full_attention as gf  # noqa: E402
from vllm_sinks.v1.attention.ops.prefill_attention_problem import validate  # noqa: E402
from vllm_sinks.v1.attention.ops.prefill_attention_reference import relative_l2  # noqa: E402

T = gf.TileConfig
O = dict(overlap=True)
#: By computed width (``head_dim_parts`` summed, rounded up to 64, 96 or 128).
CANDIDATES = {64: [T(64, 64, 4, True), T(64, 64, 4, **O), T(64, 64, 3, True), T(64, 128, 3, True),
                   T(64, 128, 3, **O)],
              96: [T(64, 64, 3, True), T(64, 64, 3, **O), T(64, 64, 3)],
              128: [T(64, 64, 3, True), T(64, 64, 3, **O), T(64, 64, 3)]}
SHAPES = [FullShape("qwen2.5-vl 4x4096 D80", (4096,) * 4, 16, 80),
          FullShape("qwen2.5-vl 1x1024 D80", (1024,), 16, 80),
          FullShape("siglip 8x729 D72", (729,) * 8, 16, 72),
          FullShape("D96 3x2000 h16", (2000,) * 3, 16, 96),
          FullShape("internvit 6x1025 D128", (1025,) * 6, 25, 128),
          FullShape("D128 1x4096 h4", (4096,), 4, 128),
          FullShape("D128 1x9952 h4", (9952,), 4, 128),
          FullShape("D128 1x16384 h16", (16384,), 16, 128),
          FullShape("GQA 32/8 D128 1x4096", (4096,), 32, 128, kv_heads=8),
          FullShape("causal GQA 32/8 D128 2x2048", (2048, 2048), 32, 128, kv_heads=8, is_causal=True),
          FullShape("encoder 64x512 D64", (512,) * 64, 12, 64),
          FullShape("mixed D64", (256, 1024, 4000, 77, 2500), 16, 64),
          FullShape("D64 1x4096 h4", (4096,), 4, 64),
          FullShape("D64 1x6224 h4", (6224,), 4, 64),
          FullShape("GQA 32/8 D64 1x8192", (8192,), 32, 64, kv_heads=8),
          FullShape("1x16384 D64", (16384,), 16, 64),
          FullShape("causal D64 1x8192 h16", (8192,), 16, 64, is_causal=True),
          FullShape("causal D64 8x1024 h16", (1024,) * 8, 16, 64, is_causal=True),
          FullShape("causal D80 2x4096 h16", (4096, 4096), 16, 80, is_causal=True),
          FullShape("causal D128 1x8192 h16", (8192,), 16, 128, is_causal=True)]


def _name(t) -> str:
    return (f"{t.block_m}x{t.block_n} s{t.stages}{' defer' if t.defer_pv else ''}"
            f"{' overlap' if t.overlap else ''}{f' r{t.maxnreg}' if t.maxnreg else ''}")


def _width(d: int) -> int:
    w = sum(gf.head_dim_parts(d))
    return 64 if w <= 64 else 96 if w <= 96 else 128


def main(argv=None):
    import triton

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT") or None)
    args = ap.parse_args(argv)
    upstream = peers.upstream_op(args.peers)
    fa3 = peers.fa3_varlen(args.peers)
    warm_gpu()
    bench = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3  # noqa: E731
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
             "bf16; µs = do_bench median (2 rounds: min / max); ratio = upstream / tile", ""]
    for dp, tiles in CANDIDATES.items():
        shapes = [s for s in SHAPES if _width(s.head_dim) == dp]
        header = ["shape", "upstream µs", "FA3 µs (×)"] + [_name(t) for t in tiles]
        lines += ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
        logs = {t: [] for t in tiles}
        for s in shapes:
            q, k, v, starts, lens = _inputs(s, torch.device("cuda"), torch.bfloat16)
            kw = dict(is_causal=s.is_causal, sliding_window_q=None, sliding_window_k=None,
                      sinks=None, sinks_bias_key0=False)
            o_up = torch.empty_like(q)
            run_up = lambda: upstream(q, k, v, o_up, starts, lens, s.max_len, is_causal=s.is_causal)  # noqa: E731
            run_up()
            p = validate(q, k, v, q, starts, lens, s.max_len, softmax_scale=None, **kw)
            runs = {}
            for t in tiles:
                o = torch.full_like(q, float("nan"))
                launch = gf.FullLaunch.plan(p, q, k, v, o, starts, lens, None, tile=t)
                if launch is None or not launch(q, k, v, o, starts, lens, None, s.max_len):
                    continue
                err = relative_l2(o, o_up)
                if not err < 1e-2:
                    print(f"{s.name}: tile {_name(t)} disagrees with upstream: {err:.2e}", flush=True)
                    continue
                runs[t] = (lambda launch=launch, o=o: launch(q, k, v, o, starts, lens, None, s.max_len))
            times = {name: [] for name in ["upstream", *runs]}
            if fa3 is not None:
                cu, o_fa = peers.cu_seqlens_from(starts, lens), torch.empty_like(q)
                runs_fa = lambda: fa3(q, k, v, o_fa, cu, s.max_len, causal=s.is_causal)  # noqa: E731
                runs_fa()
                times["fa3"] = []
            for _ in range(2):
                times["upstream"].append(bench(run_up))
                if fa3 is not None:
                    times["fa3"].append(bench(runs_fa))
                for t, fn in runs.items():
                    times[t].append(bench(fn))
            up = min(times["upstream"])
            cells = [s.name, f"{up:.1f} ({max(times['upstream']):.1f})",
                     f"{min(times['fa3']):.1f} {up / min(times['fa3']):.2f}×" if "fa3" in times else "—"]
            for t in tiles:
                if t in times:
                    best = min(times[t])
                    logs[t].append(math.log(up / best))
                    cells.append(f"{best:.1f} ({max(times[t]):.1f}) {up / best:.2f}×")
                else:
                    cells.append("—")
            lines.append("| " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
            del q, k, v, o_up
            torch.cuda.empty_cache()
        geo = ["geomean vs upstream", "", ""] + [f"{math.exp(sum(x) / len(x)):.2f}×" if x else "—"
                                            for x in logs.values()]
        lines += ["| " + " | ".join(geo) + " |", ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "full_tiles.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
