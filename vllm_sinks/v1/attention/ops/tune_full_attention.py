"""`vllm-sinks tune`: measure ours against upstream's op on full attention, per shape class, on this
GPU, and write the table the front door reads (``full_attention_table``) for this GPU and Triton.

    vllm-sinks tune                          # this GPU, the installed vLLM's op -> the user's cache
    vllm-sinks tune --peers .gpu/peers       # upstream's op from fetched files (no vLLM: our runs)
    vllm-sinks tune --dry-run --tables-dir /tmp/t   # CPU, stand-in ops (the unit test)
    vllm-sinks tune --show TABLE.json ...    # the reports docs/benchmarks.md quotes

The table goes to ``full_attention_table.user_table_dir()`` (``~/.cache/vllm-sinks/tables``), which
the op reads ahead of the shipped tables, as vLLM reads the fused-MoE configs its ``--tune`` wrote
for a device. ``benchmarks/kernels/tune_full_attention.py`` is the same with the shipped tables'
folder as its default (how the tables in the package are made: ``run_on_device.sh tune``).

Upstream's op is the installed vLLM's (``--peers DIR``: vLLM's file fetched by
``benchmarks/kernels/fetch_peers.sh``, from a source checkout). For every class of the grid (head
dims, dtypes, causal or not, query / KV heads, length buckets 2**6 … 2**14):

- three variants of the bucket: one sequence at its top (2**b), one sequence of a length drawn in
  the bucket, and a batch of lengths drawn in it (8 sequences, fewer on the longest buckets);
  token counts are multiples of 16, so that each class compiles one variant of each kernel per
  sequence count (Triton specialises integer arguments on divisibility by 16);
- each op as a user's eager call sees it: ``n`` calls back to back between two synchronisations,
  host cost included (``n`` fills ~``BLOCK_S``, 2 to 32 calls), after one untimed call; ``ROUNDS``
  rounds, the two ops in turn and the order swapped every round; the best block of each counts;
- ours is the front door with no upstream registered (``use_upstream_op(None)``: the kernels we
  ship), upstream is its raw ``context_attention_fwd``;
- the class's ratio is the worst variant's upstream time / ours (0 where ours failed); the verdict
  is "ours" only where that ratio is at least 1 / ``full_attention_table.MARGIN``;
- first, each group's tile: the candidates of ``tile_candidates`` (the kernel's default first)
  timed on the group's classes of ``TILE_BUCKETS``, the fastest kept where it beats the default
  by ``TILE_MARGIN`` (the table's ``tiles``, with every candidate's time); the classes are then
  timed with the chosen tile, which the front door reads from the same table
  (``full_attention_table.route``), so the verdicts are of the tile users run.

Compiling is most of the cost on a fresh machine (~1–2 s per kernel variant): with ``--jobs N``
(default: the CPU count - 1, at most 15) worker processes first make one call of each op on each
variant, so that Triton's disk cache holds every compiled kernel before the timing starts. The
grid's counts (classes, variants, kernels to compile) print first, the time each stage took last;
the default grid is meant to take under 150 s on an H200 (``--grid quick``: two groups).

Writes ``<gpu>_sm<cc>_triton-<major.minor>.json`` into the user's cache (``--tables-dir``
elsewhere) and into ``--out``/tables (default ``$OUT``: what comes back from the device), reads it
back through the lookup and prints the table. It refuses, saying why, where there is no CUDA GPU,
where the Triton release is not one the kernels were tested under, and where upstream's op does
not load. ``--dry-run``: the same loop on the CPU with stand-in ops of known speed and a tiny grid,
for the unit test (``tests/unit/test_tune_full_attention.py``); it writes only where
``--tables-dir`` says.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import dataclasses
import datetime
import hashlib
import io
import json
import math
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import time
import tokenize
from pathlib import Path

import torch

from vllm_sinks.v1.attention.ops import full_attention_table as fat
from vllm_sinks.v1.attention.ops import gluon_full_attention as gf
from vllm_sinks.v1.attention.ops.gluon_api import TESTED_TRITON
from vllm_sinks.v1.attention.ops.prefill_attention_reference import relative_l2

OPS_DIR = Path(__file__).resolve().parent

#: (head dim, dtype, causal) groups. Non-causal is what the op's full-attention callers pass (vLLM's
#: ViT wrapper, encoder-only attention); causal is measured on the head dims decoders use.
DEFAULT_GROUPS = (
    [(d, dt, False) for dt in ("bfloat16", "float16") for d in (32, 64, 72, 80, 96, 112, 128, 256)]
    + [(d, dt, True) for dt in ("bfloat16", "float16") for d in (64, 80, 128)])
QUICK_GROUPS = [(80, "bfloat16", False), (64, "bfloat16", False)]
#: (query heads, KV heads): head buckets 2, 4 and 5, GQA ratios 1 and 4.
HEADS = ((4, 4), (16, 16), (32, 8))
LENGTH_BUCKETS = tuple(range(fat.MIN_LENGTH_BUCKET, 15))
#: A timed block's target length (s), its bounds in calls, the rounds per op.
BLOCK_S, MIN_CALLS, MAX_CALLS, ROUNDS = 2e-3, 2, 32, 2
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
#: --dry-run: one group, one head shape, four buckets (the lookup interpolates between them).
DRY_GROUPS, DRY_HEADS, DRY_BUCKETS = [(80, "bfloat16", False)], ((16, 16),), (6, 8, 10, 12)
DRY_IDENTITY = ("dry-run CPU", (0, 0))
DRY_TILE_BUCKETS = (12,)
#: Where each group's tile is chosen: its classes of these length buckets (every head shape).
TILE_BUCKETS = (12, 14)
#: A candidate replaces the default tile only below this share of its time (geometric mean over
#: the probe's variants): what two rounds resolve, so noise does not flip a group's tile.
TILE_MARGIN = 0.97
#: A candidate's output may differ from upstream's by this much (relative L2): both are at the
#: bf16 floor, ~3e-3 apart (sweep_full_tiles.py), and a broken tile is off by ~1.
TILE_AGREEMENT = 1e-2
#: Our kernels' sources: the table's "kernels" field says which code it measured.
KERNEL_FILES = ("prefill_attention_portable.py", "gluon_full_attention.py", "gluon_api.py",
                "prefill_attention_problem.py", "kernel_launcher.py")


@dataclasses.dataclass(frozen=True)
class Variant:
    kind: str  # "top", "one", "batch"
    lens: tuple[int, ...]

    @property
    def label(self) -> str:
        if len(self.lens) == 1:
            return f"1x{self.lens[0]}"
        return f"{len(self.lens)}x({min(self.lens)}..{max(self.lens)})"


def variants(bucket: int, seed: int = 0) -> list[Variant]:
    """The bucket's variants: lengths in (2**(b-1), 2**b] (every length up to 64 for the smallest
    bucket, measured in (32, 64]), token counts multiples of 16, drawn from a seeded generator."""
    top, low = 2 ** bucket, 2 ** (bucket - 1)
    rng = random.Random(seed * 1009 + bucket)
    one = 16 * rng.randint(low // 16 + 1, top // 16)
    lens = [rng.randint(low + 1, top) for _ in range(max(2, min(8, 2 ** (15 - bucket))))]
    extra = sum(lens) % 16
    if extra:  # one length moved within the bucket so that the total is a multiple of 16
        i = min(range(len(lens)), key=lambda j: abs(lens[j] - (low + top) // 2))
        lens[i] += -extra if lens[i] - extra > low else 16 - extra
    out = [Variant("top", (top,)), Variant("one", (one,)), Variant("batch", tuple(lens))]
    for v in out:
        assert fat.length_bucket(max(v.lens)) == bucket and sum(v.lens) % 16 == 0, v
    return out


def inputs(head_dim, dtype, hq, hkv, lens, device, fill=True):
    tokens = sum(lens)
    make = torch.randn if fill else torch.empty
    q = make(tokens, hq, head_dim, device=device, dtype=dtype)
    k = make(tokens, hkv, head_dim, device=device, dtype=dtype)
    v = make(tokens, hkv, head_dim, device=device, dtype=dtype)
    lengths = torch.tensor(lens, dtype=torch.int32, device=device)
    starts = torch.zeros_like(lengths)
    starts[1:] = torch.cumsum(lengths, 0)[:-1]
    return q, k, v, torch.empty_like(q), starts, lengths


# ---- the two ops ------------------------------------------------------------------------------------

class DryClock:
    """--dry-run's clock: the stand-ins advance it by their nominal cost instead of spinning, so
    what the dry run measures is exact however busy the CPU is (CI read 1.77 for a ratio of 1.5
    from stand-ins that spun beside other tests)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


DRY_CLOCK = DryClock()
#: The clock the timed blocks read: the wall clock, or DRY_CLOCK in a dry run (set by main).
timer = time.perf_counter


def dry_ours(q, k, v, o, starts, lens, max_len, causal):
    """--dry-run's stand-in for ours: fast on short sequences, slow on long ones, and faster on
    long ones with a register cap in the table's tile for its group (so the choice shows). It
    writes upstream's output (``dry_upstream``), or a wrong one under a tile of ``DRY_WRONG_TILES``
    (the tile choice must then pass it over)."""
    tile = fat.route(q.device, q.shape[-1], q.dtype, causal, q.shape[1], k.shape[1]).tile
    capped = tile is not None and tile["maxnreg"] is not None
    o.fill_(2.0 if tile is not None and tile in DRY_WRONG_TILES else 1.0)
    DRY_CLOCK.spend(50e-6 if max_len <= 256 else (300e-6 if capped else 400e-6))


def dry_upstream(q, k, v, o, starts, lens, max_len, causal):
    o.fill_(1.0)
    DRY_CLOCK.spend(200e-6)


#: Tiles under which ``dry_ours`` writes a wrong output (a test sets it).
DRY_WRONG_TILES: list = []


def installed_upstream():
    """The installed vLLM's ``context_attention_fwd`` (its own, also where our patch is bound), or
    None with why not."""
    try:
        from vllm_sinks.patches.prefill_op import _upstream_op

        return _upstream_op()[1], ""
    except Exception as e:  # noqa: BLE001 - no vLLM, or an op we do not recognise: said, not raised
        return None, f"{type(e).__name__}: {e}"


def ops(dry_run: bool, peers_dir):
    """(ours, upstream, synchronise): each op called as ``op(q, k, v, o, starts, lens, max_len,
    causal)``; upstream None where it does not load (printed why). Upstream's op is the installed
    vLLM's, or the one fetched into ``peers_dir``."""
    if dry_run:
        return dry_ours, dry_upstream, lambda: None
    from vllm_sinks.v1.attention.ops import triton_prefill_attention as op

    op.use_upstream_op(None)  # ours: our kernels only
    if peers_dir is not None:
        try:
            from benchmarks.kernels import peers  # a source checkout's loader of fetched files
        except ImportError as e:
            raise SystemExit(f"--peers loads upstream's op with benchmarks/kernels/peers.py of a "
                             f"vllm-sinks source checkout, which is not on the path here ({e})")
        up = peers.upstream_op(peers_dir)
        raw = None if up is None else up.raw
    else:
        raw, why = installed_upstream()
        if raw is None:
            print(f"[tune] the installed vLLM's op does not load: {why}", flush=True)
    upstream = None if raw is None else (
        lambda q, k, v, o, s, n, m, c: raw(q, k, v, o, s, n, m, c))
    return (lambda q, k, v, o, s, n, m, c: op.context_attention_fwd(q, k, v, o, s, n, m, c),
            upstream, torch.cuda.synchronize)


# ---- compiling first, in parallel ---------------------------------------------------------------------

def _compile_unit(unit: tuple, dry_run: bool, peers_dir, buckets: tuple, tile_buckets: tuple,
                  scratch: Path, identity: tuple) -> tuple[tuple, float, list]:
    """One call of each op on every variant of one (group, heads) pair, and of ours under each
    other candidate tile on the variants that choose the tile: what the timing will run, compiled
    into Triton's disk cache. Runs in a worker process."""
    t0 = time.perf_counter()
    set_run_identity(*identity, dry_run)
    group, (hq, hkv) = unit
    head_dim, dtype, causal = group
    ours, upstream, sync = ops(dry_run, peers_dir)
    device = "cpu" if dry_run else "cuda"
    errors = []
    work = [(b, (("ours", ours), ("upstream", upstream)), None) for b in buckets]
    if head_dim <= gf.MAX_HEAD_DIM:
        work += [(b, (("ours", ours), ), tile) for tile in tile_candidates(head_dim, causal)[1:]
                 for b in tile_buckets]
    for n, (bucket, fns, tile) in enumerate(work):
        if tile is not None:
            use_tiles({group: tile}, scratch / f"compile-{os.getpid()}-{n}")
        for var in variants(bucket):
            args = inputs(head_dim, DTYPES[dtype], hq, hkv, var.lens, device, fill=False)
            for name, fn in fns:
                if fn is None:
                    continue
                try:
                    fn(*args, max(var.lens), causal)
                except Exception as e:  # noqa: BLE001 - the timing records it again
                    errors.append(f"{name} {var.label}: {type(e).__name__}: {e}"[:200])
            del args
        fat.use_table_dir()
    sync()
    return unit, time.perf_counter() - t0, errors


def compile_first(units: list, jobs: int, dry_run: bool, peers_dir, buckets, tile_buckets,
                  scratch: Path) -> float:
    """Fill Triton's disk cache with ``jobs`` worker processes; seconds it took."""
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")  # CUDA does not survive a fork
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        futures = [pool.submit(_compile_unit, u, dry_run, peers_dir, buckets, tile_buckets, scratch,
                               _identity_of_run()) for u in units]
        for f in concurrent.futures.as_completed(futures):
            unit, seconds, errors = f.result()
            for e in errors[:2]:
                print(f"[compile] {unit}: {e}", flush=True)
    return time.perf_counter() - t0


def warm_gpu(seconds: float = 1.0) -> None:
    """Bring the GPU's clocks up before the first timed case: they idle low between compiles."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


# ---- timing -----------------------------------------------------------------------------------------------

def block_s(fn, calls: int, sync) -> float:
    """Seconds (on ``timer``) of ``calls`` calls back to back between two synchronisations."""
    sync()
    t0 = timer()
    for _ in range(calls):
        fn()
    sync()
    return timer() - t0


def time_pair(ours, upstream, sync) -> tuple[float, float]:
    """(ours, upstream) seconds per call, each the best of ROUNDS blocks, the ops interleaved."""
    fns = (ours, upstream)
    calls = [max(MIN_CALLS, min(MAX_CALLS, int(BLOCK_S / max(block_s(f, 1, sync), 1e-7))))
             for f in fns]
    best = [float("inf")] * 2
    for r in range(ROUNDS):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            best[i] = min(best[i], block_s(fns[i], calls[i], sync) / calls[i])
    return best[0], best[1]


def measure_class(group, heads, bucket, ours, upstream, sync, device, fill) -> dict | None:
    """One class's entry (ShapeClass fields, worst ratio, its variants), or None where upstream's
    op failed (the class is then left out: upstream's own behaviour)."""
    head_dim, dtype, causal = group
    hq, hkv = heads
    rows = []
    for var in variants(bucket):
        args = inputs(head_dim, DTYPES[dtype], hq, hkv, var.lens, device, fill)
        bound = max(var.lens)
        run_up = lambda: upstream(*args, bound, causal)  # noqa: E731
        run_ours = lambda: ours(*args, bound, causal)  # noqa: E731
        try:
            run_up()
        except Exception as e:  # noqa: BLE001
            print(f"[tune] upstream fails on {group} {heads} {var.label}: {type(e).__name__}: {e}"[:300])
            return None
        try:
            run_ours()
        except Exception as e:  # noqa: BLE001 - e.g. a ptxas crash: the class is upstream's
            rows.append(dict(variant=var.label, lengths=list(var.lens), ours_us=None, upstream_us=None,
                             ratio=0.0, error=f"{type(e).__name__}: {e}"[:200]))
            continue
        t_ours, t_up = time_pair(run_ours, run_up, sync)
        rows.append(dict(variant=var.label, lengths=list(var.lens), ours_us=round(t_ours * 1e6, 2),
                         upstream_us=round(t_up * 1e6, 2), ratio=round(t_up / t_ours, 4)))
        del args
    c = fat.ShapeClass(head_dim, dtype, causal, hq // hkv, fat.heads_bucket(hq), bucket)
    return dict(dataclasses.asdict(c), ratio=min(r["ratio"] for r in rows), variants=rows)


# ---- the tile of each group ----------------------------------------------------------------------------

def tile_candidates(head_dim: int, causal: bool) -> list[dict]:
    """The tiles timed for a group, the kernel's default first. What the compiler does with a
    tile moves between Triton releases (ptxas 12.9 of 3.8.0 spilled at head dim 128
    where 3.9.0's did not, and held 206 registers at head dim 64 where 3.7.1 and 3.9.0 held 161),
    so each release's table measures them: the default with a cap of 168 registers (three
    64-row programs of 128 threads fit the 65536 registers of an SM, two at more than 170); the
    default's other schedule (P · V deferred, or softmax overlapped); the default with neither;
    and keys and values by TMA (123-155 registers and no spill under every release)
    in the default's schedule, the other one, and two slots with neither. (32-key blocks, timed
    on the H200, lost by 9-38 % in every group and release.) Where TMA cannot read a call
    (``gluon_full_attention.tma_unavailable``), a TMA tile runs its schedule by cp.async."""
    default = gf.default_tile(causal)._asdict()
    other = dict(default, defer_pv=default["overlap"], overlap=default["defer_pv"])
    plain = dict(default, defer_pv=False, overlap=False)
    return [default, dict(default, maxnreg=168), other, plain, dict(default, tma=True),
            dict(other, tma=True), dict(plain, stages=2, tma=True)]


def _tiles_document(tiles: dict) -> dict:
    """A table document that holds only tiles (no entries: ours is timed with no upstream)."""
    gpu, cap = _identity_of_run()
    import triton

    rows = [dict(head_dim=g[0], dtype=g[1], causal=g[2], tile=t) for g, t in tiles.items()]
    return fat.table_document(gpu, cap, triton.__version__, [], tiles=rows)


_RUN_IDENTITY: list = []  # (gpu, capability) of this run (the dry run's stand-in identity)


def _identity_of_run() -> tuple:
    return _RUN_IDENTITY[0]


def set_run_identity(gpu: str, cap: tuple, dry_run: bool) -> None:
    """The device the tables of this run are for. The dry run's stand-in device (the CPU) has no
    tables of its own, so the lookup is told it is ``DRY_IDENTITY`` (this process only)."""
    _RUN_IDENTITY[:] = [(gpu, tuple(cap))]
    if dry_run:
        import triton

        fat.device_identity = lambda device: (gpu, tuple(cap), triton.__version__)


def use_tiles(tiles: dict, directory: Path) -> None:
    """Make the front door run ``tiles`` ({group: tile}) through its own lookup: a table of them
    alone in ``directory``."""
    write(_tiles_document(tiles), [directory])
    fat.use_table_dir(directory)


def choose_tiles(groups, heads_list, buckets, ours, upstream, sync, device, fill,
                 scratch: Path) -> list[dict]:
    """Per group: each candidate of ``tile_candidates`` timed on the classes of ``buckets``
    (every head shape, every variant; candidates in turn per variant, the order rotated every
    round), the fastest by geometric mean kept where it beats the default by ``TILE_MARGIN``. A
    candidate whose output differs from upstream's by more than ``TILE_AGREEMENT`` on any variant
    is never kept (a table could otherwise ship a tile that is fast and wrong). Returns the
    table's ``tiles`` rows (with every candidate's time and its largest difference)."""
    rows = []
    for n, group in enumerate(groups):
        head_dim, dtype, causal = group
        if head_dim > gf.MAX_HEAD_DIM:
            continue  # the portable kernel's group: no Hopper tile to choose
        candidates = tile_candidates(head_dim, causal)
        logs = [[] for _ in candidates]
        worst = [0.0] * len(candidates)  # relative L2 against upstream's output
        for hq, hkv in heads_list:
            for bucket in buckets:
                for var in variants(bucket):
                    args = inputs(head_dim, DTYPES[dtype], hq, hkv, var.lens, device, fill)
                    bound = max(var.lens)
                    upstream(*args, bound, causal)
                    want = args[3].clone()
                    best = [float("inf")] * len(candidates)
                    for r in range(ROUNDS):
                        for i in (range(len(candidates)) if r % 2 == 0 else
                                  reversed(range(len(candidates)))):
                            use_tiles({group: candidates[i]}, scratch / f"g{n}c{i}")
                            run = lambda: ours(*args, bound, causal)  # noqa: E731
                            if r == 0:  # the first call of a tile compiles (workers filled the cache)
                                args[3].zero_()
                                run()
                                worst[i] = max(worst[i], relative_l2(args[3], want))
                            calls = max(MIN_CALLS, min(MAX_CALLS, int(BLOCK_S / max(block_s(run, 1, sync), 1e-7))))
                            best[i] = min(best[i], block_s(run, calls, sync) / calls)
                    for i, t in enumerate(best):
                        logs[i].append(math.log(t))
                    del args, want
        means = [math.exp(sum(x) / len(x)) for x in logs]
        right = [i for i in range(len(candidates)) if worst[i] <= TILE_AGREEMENT]
        for i in sorted(set(range(len(candidates))) - set(right)):
            print(f"[tune] tile {_tile_name(candidates[i])} of {group}: output off upstream's by "
                  f"{worst[i]:.2e} (> {TILE_AGREEMENT}): not chosen", flush=True)
        if 0 not in right:  # the kernel's own default is wrong: no table may send calls to it
            sys.exit(f"[tune] the default tile of {group} disagrees with upstream's op: a kernel bug")
        pick = min(right, key=means.__getitem__)
        if means[pick] > TILE_MARGIN * means[0]:
            pick = 0
        rows.append(dict(head_dim=head_dim, dtype=dtype, causal=causal, tile=candidates[pick],
                         candidates=[dict(tile=c, geomean_us=round(m * 1e6, 2),
                                          off_upstream=float(f"{e:.2e}") if math.isfinite(e) else None)
                                     for c, m, e in zip(candidates, means, worst)]))
    fat.use_table_dir()
    return rows


# ---- the table --------------------------------------------------------------------------------------------

def _code_of(source: str) -> str:
    """The source without its comments, docstrings and blank lines: a reworded comment is no new
    code to time. Text, not ``ast.unparse``: that one's output moves between Python releases (3.12
    quotes f-strings its own way), and the device's Python is not CI's."""
    lines = [line.encode() for line in source.splitlines()]  # ast's columns count UTF-8 bytes
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:  # (tokenize's columns count characters)
            row, col = tok.start
            lines[row - 1] = lines[row - 1].decode()[:col].encode()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            doc = body[0]  # cut out its span alone: code may share its first or last line
            first, last = doc.lineno - 1, doc.end_lineno - 1
            tail = lines[last][doc.end_col_offset:]
            for row in range(first + 1, last + 1):
                lines[row] = b""
            lines[first] = lines[first][:doc.col_offset] + tail
    return "\n".join(text for text in (line.decode().rstrip() for line in lines) if text.strip())


def kernels_fingerprint() -> str:
    """Which code a table measured: a hash of ``KERNEL_FILES`` as code (``_code_of``)."""
    h = hashlib.sha256()
    for name in KERNEL_FILES:
        path = OPS_DIR / name
        if path.is_file():
            h.update(_code_of(path.read_text()).encode())
    return h.hexdigest()[:16]


def print_table(doc: dict) -> None:
    """Per (group, heads): the ratio per length bucket, ``*`` where ours is chosen."""
    rows: dict = {}
    for e in doc["entries"]:
        key = (e["head_dim"], e["dtype"], e["causal"], e["queries_per_kv"], e["heads_bucket"])
        rows.setdefault(key, {})[e["length_bucket"]] = e
    buckets = sorted({e["length_bucket"] for e in doc["entries"]})
    print(f"\nupstream time / ours per class ({doc['gpu']}, Triton {doc['triton']}; * = ours, "
          f"ratio >= 1/{doc['margin']}); columns: longest sequence <= 2**b\n")
    print("| D | dtype | causal | q/kv | heads <= | " + " | ".join(f"b{b}" for b in buckets) + " |")
    print("|---" * (5 + len(buckets)) + "|")
    for (d, dtype, causal, qpk, hb), by_bucket in sorted(rows.items()):
        cells = [f"{by_bucket[b]['ratio']:.2f}" + ("*" if by_bucket[b]["verdict"] == "ours" else "")
                 if b in by_bucket else "—" for b in buckets]
        print(f"| {d} | {dtype} | {'yes' if causal else 'no'} | {qpk} | {2 ** hb} | "
              + " | ".join(cells) + " |")


#: The encoder target: upstream time / ours at least this, on encoder shapes from 1k tokens on.
TARGET_RATIO, TARGET_BUCKETS = 1.3, tuple(range(10, 15))


def _group_name(head_dim: int, causal: bool) -> str:
    return f"{head_dim}{' causal' if causal else ''}"


def print_tiles(doc: dict) -> None:
    """Per group: the default tile's time, the best tile by cp.async and by TMA, and the one chosen
    (geometric means over the group's classes of ``TILE_BUCKETS``, µs; × the default's time)."""
    print(f"\nTriton {doc['triton_full']}: each group's tile, geometric mean µs over its classes of "
          f"2**{'/'.join(map(str, TILE_BUCKETS))} tokens (× the default's time)\n")
    print("| group | dtype | default | best by cp.async | best by TMA | chosen |")
    print("|---|---|---|---|---|---|")
    for row in doc["tiles"]:
        cands = row["candidates"]
        base = cands[0]["geomean_us"]

        def best(tma: bool) -> str:
            c = min((c for c in cands[1:] if bool(c["tile"].get("tma")) is tma),
                    key=lambda c: c["geomean_us"], default=None)
            return "—" if c is None else (f"{_tile_name(c['tile'])}: {c['geomean_us']:.0f} "
                                          f"({base / c['geomean_us']:.2f}×)")

        print(f"| {_group_name(row['head_dim'], row['causal'])} | {row['dtype']} | {base:.0f} | "
              f"{best(False)} | {best(True)} | {_tile_name(row['tile'])} |")


def print_worst_grid(doc: dict, dtype: str) -> None:
    """Per group of ``dtype``: each length bucket's worst ratio over the head shapes; ``†`` where
    a class of the cell is upstream's."""
    cells: dict = {}
    for e in doc["entries"]:
        if e["dtype"] == dtype:
            cells.setdefault((e["head_dim"], e["causal"]), {}).setdefault(e["length_bucket"], []).append(e)
    buckets = sorted({b for row in cells.values() for b in row})
    ours = sum(e["verdict"] == "ours" for e in doc["entries"])
    print(f"\nTriton {doc['triton_full']}, {dtype}: upstream time / ours, the worst head shape per "
          f"cell († a class upstream's); {ours} of {len(doc['entries'])} classes ours\n")
    print("| D | " + " | ".join(f"{2 ** b if b < 10 else f'{2 ** (b - 10)}k'}" for b in buckets) + " |")
    print("|---" * (1 + len(buckets)) + "|")
    for (d, causal), row in sorted(cells.items()):
        out = []
        for b in buckets:
            es = row.get(b, [])
            out.append("—" if not es else f"{min(e['ratio'] for e in es):.2f}"
                       + ("†" if any(e["verdict"] != "ours" for e in es) else ""))
        print(f"| {_group_name(d, causal)} | " + " | ".join(out) + " |")


def target_cells(doc: dict) -> dict:
    """{(head dim, causal): ratios of every class of ``TARGET_BUCKETS`` (both dtypes, every head
    shape)}."""
    cells: dict = {}
    for e in doc["entries"]:
        if e["length_bucket"] in TARGET_BUCKETS:
            cells.setdefault((e["head_dim"], e["causal"]), []).append(e["ratio"])
    return cells


def print_target(docs: list[dict]) -> None:
    """Per release and group: the ratio range from 1k tokens on, and how many cells miss
    ``TARGET_RATIO``."""
    per_doc = [target_cells(doc) for doc in docs]
    groups = sorted({g for cells in per_doc for g in cells})
    print(f"\nupstream time / ours from {2 ** (TARGET_BUCKETS[0] - 10)}k to "
          f"{2 ** (TARGET_BUCKETS[-1] - 10)}k tokens, every class (both dtypes, every head shape): "
          f"range (cells below {TARGET_RATIO} of all)\n")
    print("| Triton | " + " | ".join(_group_name(*g) for g in groups) + " |")
    print("|---" * (1 + len(groups)) + "|")
    for doc, cells in zip(docs, per_doc):
        out = []
        for g in groups:
            r = cells.get(g, [])
            low = sum(x < TARGET_RATIO for x in r)
            out.append("—" if not r else f"{min(r):.2f}–{max(r):.2f}" + (f" ({low} of {len(r)})" if low else ""))
        print(f"| {doc['triton_full']} | " + " | ".join(out) + " |")


def show(paths: list[str]) -> None:
    """``--show``: the reports docs/benchmarks.md quotes, from shipped (or returned) tables."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    for doc in docs:
        print_tiles(doc)
    for doc in docs:
        for dtype in DTYPES:
            print_worst_grid(doc, dtype)
    print_target(docs)


def dumps(doc: dict) -> str:
    """The document as JSON, one entry a line (a diff of two tables then reads class by class)."""
    head = json.dumps({k: v for k, v in doc.items() if k != "entries"}, indent=1)
    entries = ",\n".join("  " + json.dumps(e) for e in doc["entries"])
    return f'{head[:-2]},\n "entries": [\n{entries}\n ]\n}}\n'


def write(doc: dict, directories: list[Path]) -> list[Path]:
    name = fat.table_name(doc["gpu"], tuple(doc["capability"]), doc["triton"])
    text = dumps(doc)
    assert json.loads(text) == doc
    paths = []
    for d in directories:
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
        paths.append(d / name)
    return paths


def check_round_trip(path: Path, doc: dict) -> None:
    """The written file, read back as the front door reads it, decides every class as measured."""
    table = fat.load_table(path)
    for e in doc["entries"]:
        c = fat.ShapeClass(*(e[f.name] for f in dataclasses.fields(fat.ShapeClass)))
        assert table.decide(c) is (e["verdict"] == "ours"), (path, c)


def refusal(dry_run: bool) -> str | None:
    """Why the tune cannot run here (None where it can): no CUDA GPU, a Triton the kernels were
    not tested under (its table would time code no user runs)."""
    if dry_run:
        return None
    if not torch.cuda.is_available():
        return "no CUDA GPU visible: the tune times both ops on a GPU (--dry-run: stand-ins on the CPU)"
    try:
        import triton
    except ImportError as e:
        return f"Triton does not import ({e}): neither op can run"
    if not triton.__version__.startswith(TESTED_TRITON):
        return (f"Triton {triton.__version__} is not one the kernels were tested under "
                f"({', '.join(v + 'x' for v in TESTED_TRITON)}): no table is written for it")
    return None


def destination(asked: str | None, default: Path | None) -> Path:
    """Where the table goes: ``--tables-dir``, else the caller's default, else the user's cache
    (``full_attention_table.user_table_dir``, read ahead of the shipped tables)."""
    return Path(asked) if asked else (default or fat.user_table_dir())


def main(argv=None, prog: str = "vllm-sinks tune", tables_dir: Path | None = None) -> Path | None:
    """The tune (``argv``: its command line); ``tables_dir``: where the table goes by default
    (the user's cache)."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("--peers", default=None, help="upstream's op from fetch_peers.sh's folder "
                    "(a source checkout), not the installed vLLM")
    ap.add_argument("--out", default=os.environ.get("OUT") or None, help="also write DIR/tables")
    ap.add_argument("--tables-dir", default=None, help="write the table here (default: "
                    f"{tables_dir or 'the user cache, ' + str(fat.user_table_dir())})")
    ap.add_argument("--grid", choices=("default", "quick"), default="default")
    ap.add_argument("--jobs", type=int, default=min(15, max(1, (os.cpu_count() or 2) - 1)),
                    help="worker processes compiling first (1: none)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, stand-in ops, a tiny grid")
    ap.add_argument("--show", nargs="+", metavar="TABLE", help="print the reports of these tables "
                    "(each group's tile, the worst head shape per cell, the target from 1k tokens); "
                    "measure nothing")
    args = ap.parse_args(argv)
    if args.show:
        return show(args.show)
    why_not = refusal(args.dry_run)
    if why_not is not None:
        sys.exit(f"{prog}: {why_not}")
    t_start = time.perf_counter()
    import triton

    global timer
    timer = DRY_CLOCK if args.dry_run else time.perf_counter

    if args.dry_run:
        groups, heads_list, buckets = DRY_GROUPS, DRY_HEADS, DRY_BUCKETS
        (gpu, cap), device, fill = DRY_IDENTITY, "cpu", False
        if args.tables_dir is None:
            sys.exit("--dry-run writes only where --tables-dir says")
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --dry-run)")
        groups = DEFAULT_GROUPS if args.grid == "default" else QUICK_GROUPS
        heads_list, buckets = HEADS, LENGTH_BUCKETS
        gpu, cap = torch.cuda.get_device_name(), tuple(torch.cuda.get_device_capability())
        device, fill = "cuda", True
    ours, upstream, sync = ops(args.dry_run, args.peers)
    if upstream is None:
        sys.exit(f"{prog}: upstream's op did not load: nothing to measure against")
    units = [(g, h) for g in groups for h in heads_list]
    n_classes = len(units) * len(buckets)
    ours_kernels = len(units) * 2  # one sequence or several (token counts all multiples of 16)
    upstream_kernels = len(groups) * len({hq // hkv for hq, hkv in heads_list})
    print(f"[tune] {gpu} sm_{cap[0]}{cap[1]}, torch {torch.__version__}, triton {triton.__version__}: "
          f"{len(groups)} groups x {len(heads_list)} head shapes x {len(buckets)} length buckets = "
          f"{n_classes} classes, {3 * n_classes} variants; kernels to compile: ~{ours_kernels} of ours "
          f"(portable; more where a Hopper kernel takes the calls) + {upstream_kernels} of "
          f"upstream's", flush=True)
    set_run_identity(gpu, cap, args.dry_run)
    tile_buckets = DRY_TILE_BUCKETS if args.dry_run else TILE_BUCKETS
    scratch = Path(tempfile.mkdtemp(prefix="tune-tiles-"))
    compile_s = 0.0
    if args.jobs > 1:
        compile_s = compile_first(units, args.jobs, args.dry_run, args.peers, buckets, tile_buckets,
                                  scratch)
        print(f"[tune] compiled in {args.jobs} workers: {compile_s:.1f} s", flush=True)
    if not args.dry_run:
        warm_gpu()
    t_tiles = time.perf_counter()
    tiles = choose_tiles(groups, heads_list, tile_buckets, ours, upstream, sync, device, fill,
                         scratch)
    tiles_s = time.perf_counter() - t_tiles
    for row in tiles:
        times = ", ".join(f"{_tile_name(c['tile'])} {c['geomean_us']} µs" for c in row["candidates"])
        print(f"[tune] tile of {row['head_dim']}/{row['dtype']}/{'causal' if row['causal'] else 'full'}: "
              f"{_tile_name(row['tile'])} ({times})", flush=True)
    use_tiles({(r["head_dim"], r["dtype"], r["causal"]): r["tile"] for r in tiles}, scratch / "chosen")
    t_measure = time.perf_counter()
    entries = []
    for n, (group, heads) in enumerate(units):
        for bucket in buckets:
            entry = measure_class(group, heads, bucket, ours, upstream, sync, device, fill)
            if entry is not None:
                entries.append(entry)
        if device == "cuda":
            torch.cuda.empty_cache()
        print(f"[tune] timed {n + 1}/{len(units)}: {group} {heads[0]}/{heads[1]} heads "
              f"({time.perf_counter() - t_measure:.0f} s)", flush=True)
    measure_s = time.perf_counter() - t_measure
    fat.use_table_dir()
    shutil.rmtree(scratch, ignore_errors=True)
    about = dict(torch=torch.__version__, triton_full=triton.__version__,
                 ptxas=_ptxas(args.dry_run), upstream=_upstream_source(args.peers, args.dry_run),
                 kernels=kernels_fingerprint(), measured=datetime.datetime.now(datetime.timezone.utc)
                 .strftime("%Y-%m-%dT%H:%M:%SZ"), by=prog,
                 seconds=round(time.perf_counter() - t_start, 1))
    doc = fat.table_document(gpu, cap, triton.__version__, entries, tiles=tiles, **about)
    directories = [destination(args.tables_dir, tables_dir)]
    if args.out:
        directories.append(Path(args.out) / "tables")
    paths = write(doc, directories)
    for p in paths:
        check_round_trip(p, doc)
    print_table(doc)
    ours_n = sum(e["verdict"] == "ours" for e in doc["entries"])
    print(f"\n[tune] {len(entries)} classes ({ours_n} ours); wrote {', '.join(map(str, paths))}")
    print(f"[tune] took {time.perf_counter() - t_start:.1f} s (compile {compile_s:.1f} s, tiles "
          f"{tiles_s:.1f} s, timing {measure_s:.1f} s)", flush=True)
    return paths[0]


def _tile_name(t: dict) -> str:
    cap = f" r{t['maxnreg']}" if t["maxnreg"] else ""
    return (f"{t['block_m']}x{t['block_n']} s{t['stages']}{' defer' if t['defer_pv'] else ''}"
            f"{' overlap' if t['overlap'] else ''}{cap}{' tma' if t.get('tma') else ''}")


def _ptxas(dry_run: bool) -> str:
    """The ptxas Triton compiles sm_90 with, and its release (the environment names candidates:
    which one a release uses for sm_90 is its own choice)."""
    if dry_run:
        return "none (dry run)"
    from triton.backends.nvidia import compiler

    tool = compiler.get_ptxas(90)
    return f"{tool.path} ({compiler.get_ptxas_version(90).strip().splitlines()[-1]})"


def _upstream_source(peers_dir, dry_run: bool) -> str:
    if dry_run:
        return "dry-run stand-in"
    if peers_dir is None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"installed vllm {version('vllm')}"
        except PackageNotFoundError:
            return "installed vllm (version unknown)"
    source = Path(peers_dir) / "SOURCE"
    return source.read_text().splitlines()[0] if source.is_file() else "unknown"


if __name__ == "__main__":
    main()
