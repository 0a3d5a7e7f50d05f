"""The op on a server's stream: every pass brings shapes not seen before.

    python3 benchmarks/kernels/benchmark_stream.py [--peers .gpu/peers] [--passes 48] [--out DIR]
    TRITON_INTERPRET=1 python3 benchmarks/kernels/benchmark_stream.py --cpu-smoke   # CPU: it runs

A fresh process per path (``--rounds`` of them, the paths in turn; each pass is reported as its
median over them), so that nothing of one path is seen by another, each on a warmed GPU
(``gpu_warmup``), after one throwaway process that ran every path once, so that Triton's disk
cache holds every kernel and no compile is timed:

- ``upstream``: upstream's op alone (vLLM without the plugin: its own ``context_attention_fwd``,
  and MiMo's window layers as upstream's ``_forward_window_attn`` calls it);
- ``patched``: our front door with upstream's op registered (``use_upstream_op``, as the prefill-op
  patch does) and the table in force on this GPU (``full_attention_table.find_table``: the user's
  tuned one, the shipped one, or the architecture default); MiMo through the patched layer;
- ``ours``: our front door with no upstream registered;
- ``patched, no table``: as ``patched`` with no table read (every class to the fallback: upstream).

Workloads, each ``--passes`` passes of images whose token counts are drawn per pass (seeded,
log-uniform in the workload's range), then the same passes again ("seen again"):

- ``full``: full attention, 16 heads, head dim 80, bf16, 24 layers, 1–3 images of 64–16384 tokens,
  as vLLM's Triton ViT wrapper calls the op (``b_start_loc = cu_seqlens[:-1]``, ``b_seq_len`` their
  differences, a fresh output, the longest image's tokens as a Python int, ``is_causal=False``);
- the other full-attention streams of ``FULL_STREAMS``, called the same way: encoders of other
  head dims, dtypes, depths and image mixes, and head dims and head counts no table measured
  (88, 104, 20 heads);
- ``mimo``: MiMo-V2.5's window layers, 32/8 heads, head dim 64, window 64, key-0 sinks,
  ``cu_seqlens`` on the GPU and ``max_seqlen`` a host tensor (``benchmark_mimo_pass``'s layer).

Per pass: wall clock between two synchronisations; per path and workload the total, median and p90
per pass, for first sight and seen again, and the ratio of upstream's to each. Each layer reads
its own q / k / v (four sets in turn, the longest pass's size, views of their first rows). Also
reported: what was measured at run time (the op's own synchronisations, counted by a wrapper
around ``torch.cuda.synchronize``: none is expected) and, for the patched path, how many classes
the table gave ours. Writes ``stream.md`` / ``stream.json`` to ``--out`` (default ``$OUT``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PATHS = ("upstream", "patched", "ours", "patched, no table")
LAYERS, POOL = 24, 4


@dataclasses.dataclass(frozen=True)
class Config:
    passes: int = 48
    layers: int = LAYERS
    tokens: tuple[int, int] = (64, 16384)
    images: tuple[int, int] = (1, 3)
    dtype: str = "bfloat16"
    full_heads: tuple[int, int, int] = (16, 16, 80)  # query heads, KV heads, head dim
    mimo_heads: tuple[int, int, int] = (32, 8, 64)
    window: int = 64
    seed: int = 0
    device: str = "cuda"
    #: fresh processes per path, in turn (upstream, patched, ours, no table, then again): each pass
    #: is reported as its median over them. One process's total moved by a third on the MiMo
    #: workload where three paths ran the same code (measured: H200, Triton 3.9.0).
    rounds: int = 3


#: Full-attention workloads besides ``full`` (called as ``full`` is): the Config fields each sets.
FULL_STREAMS = {
    "d72": dict(full_heads=(16, 16, 72), layers=27, images=(1, 4), tokens=(64, 16384)),
    "d128": dict(full_heads=(25, 25, 128), layers=45, images=(1, 13), tokens=(1025, 1025)),
    "d72-fp16": dict(full_heads=(16, 16, 72), layers=27, images=(1, 8), tokens=(256, 1024),
                     dtype="float16"),
    "d88": dict(full_heads=(16, 16, 88), layers=24, images=(1, 3), tokens=(64, 16384)),
    "d104-fp16": dict(full_heads=(20, 20, 104), layers=32, images=(1, 6), tokens=(256, 4096),
                      dtype="float16"),
    "d96-fp16": dict(full_heads=(16, 16, 96), layers=24, images=(1, 4), tokens=(64, 8192),
                     dtype="float16"),
    "d112": dict(full_heads=(16, 16, 112), layers=24, images=(1, 4), tokens=(64, 8192)),
}


def workload_config(cfg: Config, name: str) -> Config:
    """The Config a workload runs with: ``cfg`` itself for ``full`` and ``mimo``."""
    return dataclasses.replace(cfg, **FULL_STREAMS[name]) if name in FULL_STREAMS else cfg


#: --cpu-smoke: the same code on Triton's interpreter, small enough to run in a test
SMOKE = Config(passes=2, layers=2, tokens=(8, 40), dtype="float32", full_heads=(2, 2, 16),
               mimo_heads=(4, 2, 16), window=4, device="cpu", rounds=1)


def stream_of_passes(cfg: Config) -> list[list[int]]:
    """Per pass, the images' token counts (a new draw per pass, seeded), log-uniform in
    ``cfg.tokens``: images span orders of magnitude, and a uniform draw (median ~8k tokens) makes
    nearly every pass GPU-bound, where what each call costs the host does not show (a uniform draw
    measured 146 ms a pass upstream on the H200)."""
    rng = random.Random(cfg.seed)
    lo, hi = (math.log(n) for n in cfg.tokens)
    return [[min(cfg.tokens[1], max(cfg.tokens[0], round(math.exp(rng.uniform(lo, hi)))))
             for _ in range(rng.randint(*cfg.images))] for _ in range(cfg.passes)]


def _sync(device: str):
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


# ---- one process: one path's workloads ------------------------------------------------------------

class SyncCounter:
    """Counts and times ``torch.cuda.synchronize`` calls made by anyone but the harness (which holds
    the original): the op's run-time measurement, were there any."""

    def __init__(self):
        self.original, self.calls, self.seconds = torch.cuda.synchronize, 0, 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        self.calls += 1
        try:
            return self.original(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def full_layers(cfg: Config, path: str, upstream):
    """(a layer call ``f(q, k, v, cu_seqlens, max_len)``, the input pool) for the ``full`` workload."""
    from vllm_sinks.v1.attention.ops import triton_prefill_attention as op

    hq, hkv, d = cfg.full_heads
    fwd = upstream.raw if path == "upstream" else op.context_attention_fwd
    scale = d ** -0.5

    def layer(q, k, v, cu_seqlens, max_len):  # vLLM's Triton ViT wrapper's call
        o = torch.empty_like(q)
        fwd(q, k, v, o, cu_seqlens[:-1], cu_seqlens[1:] - cu_seqlens[:-1], max_len, False, scale)
        return o

    return layer, _pool(cfg, hq, hkv, d, fused=False)


def mimo_layers(cfg: Config, path: str, upstream):
    """The same for the ``mimo`` workload: the patched layer (ours) or upstream's pattern around
    upstream's op, bound to a stand-in of the layer (its sinks, window, scale)."""
    from benchmarks.kernels.benchmark_mimo_pass import upstream_window_layer
    from benchmarks.kernels.host_cost import vision_attention_stand_in
    from vllm_sinks.model_executor.models.mimo_v2_omni import make_forward_window_attn

    hq, hkv, d = cfg.mimo_heads
    g = torch.Generator(device=cfg.device).manual_seed(cfg.seed + 1)
    attn = vision_attention_stand_in(
        (torch.randn(hq, device=cfg.device, generator=g) * 2).to(getattr(torch, cfg.dtype)),
        window=cfg.window, scale=d ** -0.5)
    forward = upstream_window_layer(upstream) if path == "upstream" else make_forward_window_attn("key0")

    def layer(q, k, v, cu_seqlens, max_len):
        return forward(attn, q, k, v, cu_seqlens, torch.tensor(max_len))  # a host 0-d tensor

    return layer, _pool(cfg, hq, hkv, d, fused=True)


def _pool(cfg: Config, hq: int, hkv: int, d: int, fused: bool) -> list:
    """POOL (q, k, v) sets of the longest pass's size; MiMo's v is a view of a fused projection."""
    rows = cfg.tokens[1] * cfg.images[1]
    g = torch.Generator(device=cfg.device).manual_seed(cfg.seed + 2)
    dtype = getattr(torch, cfg.dtype)
    pool = []
    for _ in range(POOL):
        q = torch.randn(rows, hq, d, device=cfg.device, generator=g).to(dtype)
        k = torch.randn(rows, hkv, d, device=cfg.device, generator=g).to(dtype)
        if fused:
            v = torch.randn(rows, hq + 2 * hkv, d, device=cfg.device, generator=g).to(dtype)[:, hq + hkv:]
        else:
            v = torch.randn(rows, hkv, d, device=cfg.device, generator=g).to(dtype)
        pool.append((q, k, v))
    return pool


def run_passes(cfg: Config, layer, pool, stream, sync) -> list[float]:
    """ms per pass: the pass's layers between two synchronisations, each output dropped before the
    next layer (as in the tower)."""
    times = []
    for lens in stream:
        tokens = sum(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                          device=cfg.device)
        views = [(q[:tokens], k[:tokens], v[:tokens]) for q, k, v in pool]
        max_len = max(lens)
        sync()
        t0 = time.perf_counter()
        for i in range(cfg.layers):
            layer(*views[i % POOL], cu, max_len)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def cpu_now() -> int | None:
    """The CPU this process last ran on (``/proc/self/stat``'s ``processor``; None off Linux): a
    process's host time depends on where it runs, and the report says where each one ran."""
    try:
        stat = Path("/proc/self/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[36])


def python_ns() -> float:
    """ns per step of a fixed pure-Python loop (best of 5): how fast this process runs Python
    where it is. A host-bound pass costs what the host's Python costs, and one process's MiMo
    total has moved by a third against another's running the same code (measured: H200, Triton 3.9.0)."""
    best = float("inf")
    for _ in range(5):
        d, t0 = {}, time.perf_counter()
        for i in range(20000):
            d[i & 255] = d.get(i & 127, 0) + 1
        best = min(best, time.perf_counter() - t0)
    return best / 20000 * 1e9


def child(path: str, cfg: Config, peers_dir, workloads: list[str]) -> dict:
    """One path's workloads in this process: first sight, then seen again."""
    from benchmarks.kernels import peers
    from vllm_sinks.v1.attention.ops import full_attention_table as fat
    from vllm_sinks.v1.attention.ops import triton_prefill_attention as op

    upstream = peers.upstream_op(peers_dir)
    if upstream is None:
        raise SystemExit("upstream's op did not load")
    op.use_upstream_op(upstream.raw if path in ("patched", "patched, no table") else None)
    if path == "patched, no table":
        fat.use_table_dir(None)
    else:
        fat.use_table_dir()  # what a user's process reads: tuned here, shipped, or architecture default
    sync = _sync(cfg.device)
    counter = None
    if cfg.device == "cuda":
        from benchmarks.kernels.gpu_warmup import warm_gpu

        warm_gpu()
        counter = SyncCounter()
        torch.cuda.synchronize = counter  # the harness keeps the original in ``sync``
    result = dict(path=path, python_ns=[python_ns()])
    for name in workloads:
        wcfg = workload_config(cfg, name)
        stream = stream_of_passes(wcfg)
        layer, pool = (mimo_layers if name == "mimo" else full_layers)(wcfg, path, upstream)
        first = run_passes(wcfg, layer, pool, stream, sync)
        cpus = [cpu_now()]
        again = run_passes(wcfg, layer, pool, stream, sync)
        result[name] = dict(first=first, again=again, cpus=cpus + [cpu_now()])
        del pool
    result["python_ns"].append(python_ns())
    result["op_syncs"] = 0 if counter is None else counter.calls
    result["op_sync_ms"] = 0.0 if counter is None else counter.seconds * 1e3
    decisions = [ours for r in fat._ROUTES.values() for ours in r.decided.values()]
    result["classes_ours"], result["classes_upstream"] = sum(decisions), len(decisions) - sum(decisions)
    found = fat.find_table(fat.device_identity((cfg.device, 0))) if path == "patched" else None
    result["table"] = "none" if found is None else found.describe()
    return result


# ---- the parent: one process per path ------------------------------------------------------------------

def spawn(paths: list[str], args, cfg: Config, out_file: Path) -> None:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", *paths, "--result", str(out_file),
           "--passes", str(cfg.passes), "--workloads", args.workloads]
    if args.peers:
        cmd += ["--peers", args.peers]
    if args.cpu_smoke:
        cmd.append("--cpu-smoke")
    subprocess.run(cmd, check=True, cwd=ROOT)


def merge_rounds(rounds: list[dict], workloads: list[str]) -> dict:
    """One path's processes as one result: each pass's median over them, and each process's
    totals (``round_totals``: the spread the report prints)."""
    merged = dict(rounds[0])
    for w in workloads:
        merged[w] = {k: [statistics.median(r[w][k][i] for r in rounds)
                         for i in range(len(rounds[0][w][k]))] for k in ("first", "again")}
        merged[w]["round_totals"] = {k: [sum(r[w][k]) for r in rounds] for k in ("first", "again")}
        merged[w]["round_cpus"] = [r[w].get("cpus") for r in rounds]
    merged["op_syncs"] = sum(r["op_syncs"] for r in rounds)
    merged["op_sync_ms"] = sum(r["op_sync_ms"] for r in rounds)
    merged["round_python_ns"] = [r.get("python_ns") for r in rounds]
    merged["rounds"] = len(rounds)
    return merged


def summary(ms: list[float]) -> dict:
    ordered = sorted(ms)
    return dict(total=sum(ms), median=statistics.median(ms),
                p90=ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)])


def pass_zero_lines(results: list[dict], workloads: list[str]) -> list[str]:
    """Pass 0 holds what a fresh process does once: each kernel's first launch (Triton's cache key,
    the module load; Triton's own start on the first workload), which a vLLM server pays in its
    start-up profile run before any request. Per workload: pass 0's excess over the same pass seen
    again, per path, and first sight's ratio to upstream without pass 0 (measured on the H200: 390–490 ms of
    the full workload's ~2 s on every path)."""
    base = {w: r[w]["first"][1:] for r in results if r["path"] == "upstream" for w in workloads}
    out = []
    for w in workloads:
        if len(results[0][w]["first"]) < 2:
            continue
        cells = []
        for r in results:
            excess = r[w]["first"][0] - r[w]["again"][0]
            ratio = "" if w not in base else f", {sum(base[w]) / sum(r[w]['first'][1:]):.2f}×"
            cells.append(f"{r['path']} {excess:.1f} ms{ratio}")
        out.append(f"- {w}: pass 0 over seen again, and first sight without pass 0 × upstream "
                   f"(total): {'; '.join(cells)}")
    return out


def markdown(results: list[dict], header: str, workloads: list[str]) -> str:
    cols = ["workload", "path", "first sight: total ms", "median", "p90", "× upstream (total, p90)",
            "seen again: total ms", "median", "p90", "× upstream (total, p90)"]
    out = [header, "", "| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]
    base = {w: {k: summary(r[w][k]) for k in ("first", "again")} for r in results
            if r["path"] == "upstream" for w in workloads}
    for w in workloads:
        for r in results:
            cells = [w, r["path"]]
            for k in ("first", "again"):
                s, b = summary(r[w][k]), base.get(w, {}).get(k)
                ratio = "—" if b is None else f"{b['total'] / s['total']:.2f}×, {b['p90'] / s['p90']:.2f}×"
                cells += [f"{s['total']:.1f}", f"{s['median']:.2f}", f"{s['p90']:.2f}", ratio]
            out.append("| " + " | ".join(cells) + " |")
    out.append("")
    for w in workloads:
        spread = "; ".join(
            f"{r['path']} " + ", ".join(f"{min(t):.0f}–{max(t):.0f}"
                                        for t in r[w]["round_totals"].values())
            for r in results if "round_totals" in r[w])
        if spread:
            out.append(f"- {w}: total ms of each process, min–max (first sight, seen again): "
                       f"{spread}")
    for w in workloads:
        where = "; ".join(f"{r['path']} " + ", ".join("/".join(map(str, c or ["?"])) for c in r[w]["round_cpus"])
                          for r in results if r[w].get("round_cpus"))
        if where:
            out.append(f"- {w}: the CPU each process was on after first sight / seen again: {where}")
    speed = "; ".join(f"{r['path']} " + ", ".join("/".join(f"{x:.0f}" for x in ns or []) or "?"
                                                  for ns in r["round_python_ns"])
                      for r in results if r.get("round_python_ns"))
    if speed:
        out.append(f"- each process's Python, ns per step of a fixed loop (before / after its "
                   f"workloads): {speed}")
    out += pass_zero_lines(results, workloads)
    for r in results:
        out.append(f"- {r['path']}: measured at run time: {r['op_syncs']} synchronisations inside "
                   f"the op ({r['op_sync_ms']:.1f} ms), no timing; table classes decided: "
                   f"{r['classes_ours']} ours, {r['classes_upstream']} upstream"
                   + (f"; table in force: {r['table']}" if r.get("table") else ""))
    return "\n".join(out) + "\n"


def describe_workload(cfg: Config, name: str) -> str:
    hq, hkv, d = cfg.mimo_heads if name == "mimo" else cfg.full_heads
    lens = (f"{cfg.tokens[0]}" if cfg.tokens[0] == cfg.tokens[1]
            else f"{cfg.tokens[0]}–{cfg.tokens[1]}")
    extra = f", window {cfg.window}, key-0 sinks" if name == "mimo" else ""
    return (f"{name}: {hq}/{hkv} heads, D {d}, {cfg.dtype}{extra}, {cfg.layers} layers, "
            f"{cfg.images[0]}–{cfg.images[1]} images of {lens} tokens")


def routes(cfg: Config, workloads: list[str], gpu: str, capability: tuple[int, int]) -> str:
    """``--routes``: which op the patched path sends each full-attention workload's passes to, read
    from the tables a ``gpu`` of ``capability`` finds under each Triton release the package ships
    tables for (its own, else the architecture default): no GPU, nothing timed."""
    from vllm_sinks.v1.attention.ops import full_attention_table as fat

    releases = sorted({fat.load_table(p).triton for p in fat.SHIPPED_DIR.glob("*.json")})
    fat.use_table_dir(fat.SHIPPED_DIR, fat.SHIPPED)
    found = {r: fat.find_table((gpu, capability, r)) for r in releases}
    tables = "; ".join(f"{r}: " + ("none" if f is None else f"{f.kind} {f.path.name}")
                       for r, f in found.items())
    out = [f"Passes of each workload the patched path sends to ours on {gpu} (sm_"
           f"{capability[0]}{capability[1]}), per Triton release; in brackets the length buckets b "
           f"(longest image <= 2**b) that go to upstream's op. Tables: {tables}", "",
           "| workload | " + " | ".join(f"Triton {r}" for r in releases) + " |",
           "|---" * (1 + len(releases)) + "|"]
    for name in (w for w in workloads if w != "mimo"):
        wcfg = workload_config(cfg, name)
        hq, hkv, d = wcfg.full_heads
        buckets = [fat.length_bucket(max(lens)) for lens in stream_of_passes(wcfg)]
        cells = []
        for release in releases:
            table = found[release] and found[release].table
            ours = {b: bool(table and table.decide(fat.ShapeClass(
                d, wcfg.dtype, False, hq // hkv, fat.heads_bucket(hq), b))) for b in set(buckets)}
            upstream = sorted(b for b in ours if not ours[b])
            cells.append(f"{sum(ours[b] for b in buckets)} of {len(buckets)}"
                         + (f" (b{', b'.join(map(str, upstream))})" if upstream else ""))
        out.append(f"| {describe_workload(wcfg, name)} | " + " | ".join(cells) + " |")
    fat.use_table_dir()
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", default=None)
    ap.add_argument("--passes", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None, help="fresh processes per path (default 3)")
    ap.add_argument("--workloads", default="full,mimo")
    ap.add_argument("--out", default=os.environ.get("OUT") or None)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny, on Triton's interpreter")
    ap.add_argument("--routes", default=None, metavar="GPU",
                    help="print which op each workload's passes go to on this sm_90 GPU (e.g. "
                    "'NVIDIA H100 80GB HBM3'), per shipped Triton release, and exit: no GPU needed")
    ap.add_argument("--child", nargs="+", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cfg = SMOKE if args.cpu_smoke else Config()
    if args.passes is not None:
        cfg = dataclasses.replace(cfg, passes=args.passes)
    if args.rounds is not None:
        if args.rounds < 1:
            sys.exit("--rounds: at least 1")
        cfg = dataclasses.replace(cfg, rounds=args.rounds)
    if args.routes:
        text = routes(cfg, args.workloads.split(","), args.routes, (9, 0))
        print(text)
        return text
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the op modules import Triton
    elif not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --cpu-smoke)")
    workloads = args.workloads.split(",")
    unknown = sorted(set(workloads) - {"full", "mimo", *FULL_STREAMS})
    if unknown:
        sys.exit(f"--workloads: unknown {unknown}; known: full, mimo, {', '.join(FULL_STREAMS)}")
    if args.child:  # in a child process: the paths named, one after another (the warm-up: all)
        results = [child(path, cfg, args.peers, workloads) for path in args.child]
        Path(args.result).write_text(json.dumps(results))
        return results
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        spawn(list(PATHS), args, cfg, Path(tmp) / "warm-up.json")  # Triton's disk cache, thrown away
        warm_s = time.perf_counter() - t0
        rounds = {path: [] for path in PATHS}
        for n in range(cfg.rounds):  # the paths in turn, so that a slow spell hits all of them
            for i, path in enumerate(PATHS):
                out_file = Path(tmp) / f"{n}-{i}.json"
                spawn([path], args, cfg, out_file)
                rounds[path] += json.loads(out_file.read_text())
        results = [merge_rounds(rounds[path], workloads) for path in PATHS]
    import triton

    from benchmarks.kernels.peers import peer_release

    device = "CPU (interpreter)" if args.cpu_smoke else torch.cuda.get_device_name()
    shapes = "; ".join(describe_workload(workload_config(cfg, w), w) for w in workloads)
    header = (f"A server's stream: {cfg.passes} passes (new images per pass), {cfg.rounds} fresh "
              f"process(es) per path in turn after a warm-up process, each pass its median over "
              f"them; {shapes}; {device}, torch {torch.__version__}, triton {triton.__version__}, "
              f"upstream = {peer_release(args.peers)}'s op; ms per pass, wall clock, synchronised "
              f"per pass")
    md = markdown(results, header, workloads)
    print("\n" + md)
    print(f"[stream] took {time.perf_counter() - t0:.1f} s (warm-up process {warm_s:.1f} s)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, "stream.md").write_text(md)
        Path(args.out, "stream.json").write_text(json.dumps(dict(config=dataclasses.asdict(cfg),
                                                                 results=results), indent=1))
    return results


if __name__ == "__main__":
    main()
