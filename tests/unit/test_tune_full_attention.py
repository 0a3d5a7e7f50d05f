"""The tune script's loop on the CPU (``--dry-run``: stand-in ops whose speed is known, compiled
first in worker processes as on the device): the file it writes parses, decides what was measured,
and generalises through the lookup as the front door reads it."""

from __future__ import annotations

import json

import pytest
import torch
import triton

from vllm_sinks.v1.attention.ops import tune_full_attention as tune
from vllm_sinks.v1.attention.ops import full_attention_table as fat


def test_variants_stay_in_their_bucket_with_token_counts_of_16():
    for bucket in tune.LENGTH_BUCKETS:
        kinds = [v.kind for v in tune.variants(bucket)]  # each checks its own bucket and total
        assert kinds == ["top", "one", "batch"]
    assert tune.variants(9) == tune.variants(9)  # seeded: the workers compile what is timed


@pytest.mark.vllm_independent  # dry runs: stand-ins, Triton's interpreter
def test_a_dry_run_writes_a_table_the_lookup_reads(tmp_path, monkeypatch):
    tables, out = tmp_path / "tables", tmp_path / "out"
    path = tune.main(["--dry-run", "--tables-dir", str(tables), "--out", str(out), "--jobs", "2"])
    assert path.parent == tables and (out / "tables" / path.name).read_text() == path.read_text()
    gpu, cap = tune.DRY_IDENTITY
    assert path.name == fat.table_name(gpu, cap, json.loads(path.read_text())["triton_full"])
    table = fat.load_table(path)
    verdicts = {c.length_bucket: ours for c, (ours, _) in table.entries.items()}
    # the stand-ins: ours 4x faster up to 256 tokens, 1.5x slower beyond (2x without its cap)
    assert verdicts == {6: True, 8: True, 10: False, 12: False}
    # the tile: the stand-in is faster with a register cap, so that candidate was chosen, and the
    # classes were then timed with it
    (d, dtype, causal), = tune.DRY_GROUPS
    chosen = dict(tune.tile_candidates(d, causal)[0], maxnreg=168)
    assert table.tiles == {(d, dtype, causal): chosen}
    # (the dry run's clock is the stand-ins' own: 200 / 300 us exactly, 200 / 400 without the cap)
    assert 1 / table.entries[next(c for c in table.entries if c.length_bucket == 12)][1] == \
        pytest.approx(1.5, rel=1e-3)
    d, dtype, causal = tune.DRY_GROUPS[0]
    hq, hkv = tune.DRY_HEADS[0]
    monkeypatch.setattr(fat, "device_identity", lambda device: (gpu, cap, triton.__version__))
    fat.use_table_dir(tables)
    try:
        route = fat.route(torch.device("cpu"), d, tune.DTYPES[dtype], causal, hq, hkv)
        assert route.ours(100) is True  # bucket 7: between two ours verdicts
        assert route.ours(400) is False  # bucket 9: between ours and upstream
        assert route.ours(3000) is False  # bucket 12, measured
        assert route.ours(10000) is False  # beyond the grid
    finally:
        fat.use_table_dir()


@pytest.mark.vllm_independent  # dry runs: stand-ins, Triton's interpreter
def test_a_tile_that_is_fast_and_wrong_is_never_chosen(tmp_path, monkeypatch, capsys):
    """The dry run's capped tile is the fastest; where it also writes a wrong output, the group
    keeps the default tile, the candidate's difference from upstream is recorded, and the classes
    are timed with the default (ours 2x slower beyond 256 tokens)."""
    (d, dtype, causal), = tune.DRY_GROUPS
    capped = dict(tune.tile_candidates(d, causal)[0], maxnreg=168)
    monkeypatch.setattr(tune, "DRY_WRONG_TILES", [capped])
    path = tune.main(["--dry-run", "--tables-dir", str(tmp_path), "--jobs", "1"])
    assert "output off upstream's by" in capsys.readouterr().out
    table = fat.load_table(path)
    assert table.tiles == {(d, dtype, causal): tune.tile_candidates(d, causal)[0]}
    row, = json.loads(path.read_text())["tiles"]
    offs = {json.dumps(c["tile"], sort_keys=True): c["off_upstream"] for c in row["candidates"]}
    assert offs.pop(json.dumps(capped, sort_keys=True)) > tune.TILE_AGREEMENT
    assert set(offs.values()) == {0.0}
    assert 1 / table.entries[next(c for c in table.entries if c.length_bucket == 12)][1] == \
        pytest.approx(2.0, rel=1e-3)


@pytest.mark.vllm_independent  # dry runs: stand-ins, Triton's interpreter
def test_the_default_tile_disagreeing_with_upstream_stops_the_tune(tmp_path, monkeypatch):
    (d, dtype, causal), = tune.DRY_GROUPS
    monkeypatch.setattr(tune, "DRY_WRONG_TILES", [tune.tile_candidates(d, causal)[0]])
    with pytest.raises(SystemExit, match="disagrees with upstream's op"):
        tune.main(["--dry-run", "--tables-dir", str(tmp_path), "--jobs", "1"])
    assert not list(tmp_path.glob("*.json"))


def test_show_reports_each_tile_the_worst_head_shape_and_the_target(tmp_path, capsys):
    """``--show``: what docs/benchmarks.md quotes, read from a table as the tune wrote it."""
    tiles = tune.tile_candidates(64, False)
    times = (700, 690, 750, 760, 600, 650, 580)
    doc = dict(triton_full="3.9.0", tiles=[dict(
        head_dim=64, dtype="bfloat16", causal=False, tile=tiles[6],
        candidates=[dict(tile=t, geomean_us=us, off_upstream=1e-3) for t, us in zip(tiles, times)])])

    def entry(heads_bucket, bucket, ratio, verdict="ours"):
        return dict(head_dim=64, dtype="bfloat16", causal=False, queries_per_kv=1,
                    heads_bucket=heads_bucket, length_bucket=bucket, ratio=ratio, variants=[],
                    verdict=verdict)

    doc["entries"] = [entry(2, 6, 3.0), entry(2, 10, 1.5), entry(4, 10, 1.2), entry(2, 11, 2.0),
                      entry(4, 11, 0.9, "upstream")]
    path = tmp_path / "table.json"
    path.write_text(json.dumps(doc))
    assert tune.main(["--show", str(path)]) is None  # measures nothing
    out = capsys.readouterr().out
    assert ("| 64 | bfloat16 | 700 | 64x64 s3 defer r168: 690 (1.01×) | 64x64 s2 tma: 580 (1.21×) "
            "| 64x64 s2 tma |") in out
    assert "| D | 64 | 1k | 2k |" in out and "| 64 | 3.00 | 1.20 | 0.90† |" in out
    assert "| 3.9.0 | 0.90–2.00 (2 of 4) |" in out  # 1k tokens on: 1.2 and 0.9 miss 1.3


def test_the_shipped_tables_measured_the_kernels_in_this_tree():
    """A table's verdicts hold for the code it timed: a change to our kernels (or to what they are
    built from) is re-tuned on the GPU (``run_on_device.sh tune``) before it ships."""
    now = tune.kernels_fingerprint()
    for path in sorted(fat.SHIPPED_DIR.glob("*.json")):
        measured = json.loads(path.read_text())["kernels"]
        assert measured == now, (f"{path.name} measured kernels {measured}, the tree has {now}: "
                                 "re-run benchmarks/kernels/run_on_device.sh tune under that Triton")


def test_the_fingerprint_is_of_code_not_of_comments():
    code = 'def f(x):\n    """Doc."""\n    return x + 1  # why\n'
    assert tune._code_of(code) == tune._code_of('def f(x):\n    # reworded\n    return x + 1\n')
    assert tune._code_of(code) != tune._code_of('def f(x):\n    return x + 2\n')


def test_the_fingerprint_is_the_same_under_every_python():
    """The device (Python 3.12) writes the tables and CI (3.11) checks them: the code is kept as
    written, where ``ast.unparse`` requotes f-strings under 3.12 (a table written on 3.12 read
    another fingerprint than CI's for the same files)."""
    code = 'def f(a):\n    return f"{a!r:>10}" + \'x\'  # why\n'
    assert tune._code_of(code) == 'def f(a):\n    return f"{a!r:>10}" + \'x\''


def test_code_beside_a_docstring_is_code():
    """A docstring is cut out by its span, not its lines (columns in UTF-8 bytes: a × before the
    code on its line)."""
    assert tune._code_of('def f():\n    \"\"\"a × b.\"\"\"; return 1\n') == 'def f():\n    ; return 1'
    assert tune._code_of('def f():\n    \"\"\"a ×\n    b.\"\"\"; return 2  # ×\n') == \
        'def f():\n    ; return 2'


# ---- `vllm-sinks tune` and `vllm-sinks report`: refusals and the table in force -----------------------

def test_the_tune_refuses_without_a_gpu(monkeypatch, capsys):
    from vllm_sinks.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="vllm-sinks tune: no CUDA GPU visible"):
        main(["tune"])


def test_the_tune_refuses_a_triton_the_kernels_were_not_tested_under(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(triton, "__version__", "3.5.1")
    with pytest.raises(SystemExit, match=r"Triton 3\.5\.1 is not one the kernels were tested under"):
        tune.main([])


def test_the_tune_refuses_when_upstreams_op_does_not_load(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(triton, "__version__", "3.8.0")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(tune, "installed_upstream", lambda: (None, "ModuleNotFoundError: vllm"))
    with pytest.raises(SystemExit, match="upstream's op did not load"):
        tune.main(["--tables-dir", str(tmp_path)])


def test_the_tune_writes_to_the_users_cache_unless_told(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tune.destination(None, None) == tmp_path / "vllm-sinks" / "tables"
    assert tune.destination(None, fat.SHIPPED_DIR) == fat.SHIPPED_DIR  # the benchmark's default
    assert tune.destination(str(tmp_path / "x"), fat.SHIPPED_DIR) == tmp_path / "x"


@pytest.mark.parametrize("own, kind", [(False, "architecture default"), (True, "user-tuned")])
def test_report_names_the_table_in_force_on_each_gpu(monkeypatch, tmp_path, own, kind):
    h100 = ("NVIDIA H100 80GB HBM3", (9, 0), "3.8.0")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(fat, "device_identity", lambda device: h100)
    fat.use_table_dir()
    try:
        if own:
            fat.user_table_dir().mkdir(parents=True)
            doc = fat.table_document(*h100, [dict(head_dim=80, dtype="bfloat16", causal=False,
                                                  queries_per_kv=1, heads_bucket=4,
                                                  length_bucket=10, ratio=1.2)])
            (fat.user_table_dir() / fat.table_name(*h100)).write_text(json.dumps(doc))
        line, = fat.tables_in_force()
    finally:
        fat.use_table_dir()
    assert line.startswith("GPU 0 NVIDIA H100 80GB HBM3 sm_90, Triton 3.8.0: " + kind)
    if not own:
        assert "nvidia-h200_sm90_triton-3.8.json, measured on NVIDIA H200" in line


def test_report_says_none_where_no_table_fits(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(fat, "device_identity", lambda device: ("NVIDIA A100", (8, 0), "3.8.0"))
    line, = fat.tables_in_force()
    assert "none: upstream's op takes every full-attention call" in line
