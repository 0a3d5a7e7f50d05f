"""The full-attention table: bucketing, the neighbour rule, the fallbacks, the file format, and the
process-wide lookup the front door makes (device identity stood in for: no GPU here)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from vllm_sinks.v1.attention.ops import full_attention_table as fat

H200 = ("NVIDIA H200", (9, 0), "3.8.0")


def entry(length_bucket, ratio, head_dim=80, dtype="bfloat16", causal=False, qpk=1, hb=4):
    return dict(head_dim=head_dim, dtype=dtype, causal=causal, queries_per_kv=qpk, heads_bucket=hb,
                length_bucket=length_bucket, ratio=ratio)


def table(*entries, gpu=H200) -> fat.Table:
    return fat.parse_table(fat.table_document(gpu[0], gpu[1], gpu[2], list(entries)))


def cls(length_bucket, head_dim=80, dtype="bfloat16", causal=False, qpk=1, hb=4):
    return fat.ShapeClass(head_dim, dtype, causal, qpk, hb, length_bucket)


@pytest.mark.parametrize("n, bucket", [(0, 6), (1, 6), (64, 6), (65, 7), (128, 7), (129, 8),
                                       (16384, 14), (16385, 15)])
def test_length_bucket(n, bucket):
    assert fat.length_bucket(n) == bucket


@pytest.mark.parametrize("h, bucket", [(1, 0), (2, 1), (4, 2), (5, 3), (16, 4), (25, 5), (32, 5)])
def test_heads_bucket(h, bucket):
    assert fat.heads_bucket(h) == bucket


def test_names():
    assert fat.gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert fat.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert fat.table_name("NVIDIA H200", (9, 0), "3.9.0") == "nvidia-h200_sm90_triton-3.9.json"
    assert fat.table_name("NVIDIA H200", (9, 0), "3.8.1+git") == "nvidia-h200_sm90_triton-3.8.json"
    with pytest.raises(fat.TableError, match="major.minor"):
        fat.triton_release("nightly")


def test_shape_class_of_a_call():
    c = fat.shape_class(80, torch.bfloat16, False, 16, 16, 1000)
    assert c == cls(10)
    assert fat.shape_class(128, torch.float16, True, 32, 8, 64) == cls(6, 128, "float16", True, 4, 5)


def test_the_verdict_follows_the_ratio_and_the_margin():
    t = table(entry(8, 1.0 / fat.MARGIN + 1e-9), entry(9, 1.0 / fat.MARGIN - 1e-3), entry(10, 0.8))
    assert t.decide(cls(8)) is True
    assert t.decide(cls(9)) is False  # faster, but not by the margin
    assert t.decide(cls(10)) is False


def test_a_class_between_agreeing_neighbours_takes_their_verdict():
    t = table(entry(7, 1.3), entry(10, 1.2), entry(12, 0.9), entry(14, 0.8))
    assert t.decide(cls(8)) is True and t.decide(cls(9)) is True  # between 7 and 10: both ours
    assert t.decide(cls(11)) is None  # between ours (10) and upstream (12)
    assert t.decide(cls(13)) is False  # between two upstream verdicts
    assert t.decide(cls(6)) is None  # below the measured range: host-bound calls, not extrapolated
    assert t.decide(cls(15)) is None  # past the top: upstream's verdict there does not carry over


def test_neighbours_along_heads_and_gqa_ratio():
    t = table(entry(10, 1.2, hb=2), entry(10, 1.3, hb=5), entry(10, 1.2, qpk=1, hb=4),
              entry(10, 1.2, qpk=8, hb=4))
    assert t.decide(cls(10, hb=3)) is True  # between head buckets 2 and 4
    assert t.decide(cls(10, qpk=4)) is True  # between ratios 1 and 8
    assert t.decide(cls(10, hb=6)) is True  # past the last measured bucket, next to a clear win
    assert t.decide(cls(10, hb=3, qpk=4)) is None  # two coordinates off: no neighbour agrees on the rest


def test_past_the_measured_range_only_a_clear_win_of_ours_carries_over():
    t = table(entry(10, 1.3, hb=4), entry(12, 1.2), entry(13, 1.3), entry(10, 0.9, hb=2, head_dim=64))
    assert t.decide(cls(10, hb=5)) is True  # 25 heads past 16: ours by 1.3 there
    assert t.decide(cls(14)) is True  # 16k past 8k: ours by 1.3
    t = table(entry(10, 1.2, hb=4), entry(10, 0.9, hb=2))
    assert t.decide(cls(10, hb=5)) is None  # ours by less than EDGE_RATIO
    assert t.decide(cls(10, hb=1)) is None  # upstream's verdict does not carry over: it is the fallback


def test_a_head_dim_not_measured_takes_its_measured_neighbours_verdict_where_they_agree():
    t = table(entry(10, 1.5, head_dim=96), entry(10, 1.4, head_dim=112), entry(11, 1.4, head_dim=96),
              entry(11, 0.9, head_dim=112), entry(10, 1.5, head_dim=96, dtype="float16"))
    assert t.decide(cls(10, head_dim=100)) is True
    assert t.decide(cls(11, head_dim=100)) is None  # the neighbours disagree
    assert t.decide(cls(10, head_dim=120)) is None  # nothing measured above
    assert t.decide(cls(10, head_dim=100, dtype="float16")) is None  # no neighbour above in fp16


def test_axes_that_disagree_leave_the_class_undecided():
    t = table(entry(9, 1.2), entry(11, 1.2),  # along the length: ours
              entry(10, 0.8, hb=3), entry(10, 0.9, hb=5))  # along the heads: upstream
    assert t.decide(cls(10)) is None


@pytest.mark.parametrize("other", [dict(head_dim=96), dict(dtype="float16"), dict(causal=True),
                                   dict(dtype="float32")])
def test_an_unmeasured_group_is_undecided(other):
    t = table(entry(9, 1.2), entry(11, 1.2))
    assert t.decide(cls(10, **other)) is None


# ---- the file format ------------------------------------------------------------------------------

def good_document():
    return fat.table_document(*H200, [entry(10, 1.2), entry(11, 0.9)], measured_by="test")


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(format="something else"), "format must be"),
    (lambda d: d.update(version=2), "version must be 1"),
    (lambda d: d.update(capability=[9]), "capability must be"),
    (lambda d: d.update(triton="3.8.0"), "triton must be major.minor"),
    (lambda d: d.update(margin=1.5), "margin must be"),
    (lambda d: d.update(entries={}), "entries must be a list"),
    (lambda d: d["entries"][0].pop("ratio"), "entry 0 has no 'ratio'"),
    (lambda d: d["entries"][1].update(verdict="ours"), "entry 1: verdict 'ours' does not follow"),
    (lambda d: d["entries"][0].update(verdict="maybe"), "verdict must be one of"),
    (lambda d: d["entries"][0].update(ratio=float("nan")), "ratio must be a finite number >= 0"),
    (lambda d: d["entries"][0].update(head_dim=300), "head_dim must be an int in 1..256"),
    (lambda d: d["entries"][0].update(dtype="int8"), "dtype must be one of"),
    (lambda d: d["entries"][0].update(causal="no"), "causal must be true or false"),
    (lambda d: d["entries"][0].update(length_bucket=3), "length_bucket must be an int in 6..64"),
    (lambda d: d["entries"].append(dict(d["entries"][0])), "entry 2 repeats the class"),
])
def test_a_malformed_table_says_what_is_wrong(edit, match):
    doc = good_document()
    edit(doc)
    with pytest.raises(fat.TableError, match=match):
        fat.parse_table(doc, "t.json")


def test_a_table_round_trips_through_its_file(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(good_document()))
    t = fat.load_table(path)
    assert (t.gpu, t.capability, t.triton, t.margin) == ("NVIDIA H200", (9, 0), "3.8", fat.MARGIN)
    assert t.decide(cls(10)) is True and t.decide(cls(11)) is False


def test_a_file_that_is_not_json_names_itself(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{ not json")
    with pytest.raises(fat.TableError, match="broken.json"):
        fat.load_table(path)


def test_the_shipped_tables_parse_and_are_named_for_what_they_hold():
    for path in sorted(fat.SHIPPED_DIR.glob("*.json")):
        t = fat.load_table(path)
        assert path.name == fat.table_name(t.gpu, t.capability, t.triton), path
        assert t.entries, path


# ---- the process-wide lookup ------------------------------------------------------------------------

@pytest.fixture
def on_h200(monkeypatch, tmp_path):
    """Tables read from a scratch folder, on a device that says it is an H200 under Triton 3.8."""
    identity = {"value": H200}
    monkeypatch.setattr(fat, "device_identity", lambda device: identity["value"])
    fat.use_table_dir(tmp_path)
    yield tmp_path, identity
    fat.use_table_dir()


def write(directory, doc, gpu=H200):
    (directory / fat.table_name(*gpu)).write_text(json.dumps(doc))


def ours_faster(max_len, head_dim=80, q_heads=16, kv_heads=16):
    return fat.route(torch.device("cpu"), head_dim, torch.bfloat16, False, q_heads,
                     kv_heads).ours(max_len)


def test_lookup_reads_this_devices_table_once_and_caches_each_class(on_h200, monkeypatch):
    directory, _ = on_h200
    write(directory, good_document())
    real, loads = fat.load_table, []
    monkeypatch.setattr(fat, "load_table", lambda path: loads.append(path) or real(path))
    assert ours_faster(1000) is True  # bucket 10
    assert ours_faster(600) is True  # bucket 10 too
    assert ours_faster(2000) is False  # bucket 11
    assert ours_faster(5000) is False  # bucket 13: beyond what was measured
    assert len(loads) == 1 and len(fat._ROUTES) == 1
    assert fat._ROUTES[next(iter(fat._ROUTES))].decided == {10: True, 11: False, 13: False}


@pytest.mark.parametrize("identity", [("NVIDIA A100-SXM4-80GB", (8, 0), "3.8.0"),
                                      ("NVIDIA H200", (9, 0), "3.9.0"),
                                      None])  # another architecture, another Triton, not CUDA
def test_no_table_for_this_device_falls_back_to_upstream(on_h200, identity):
    directory, current = on_h200
    write(directory, good_document())
    current["value"] = identity
    assert ours_faster(1000) is False
    assert fat.find_table(identity) is None


def test_another_gpu_of_the_architecture_takes_its_table_as_the_default(on_h200):
    """An H100 (or H20, H800, GH200: sm_90) with no table of its own reads the H200's under its
    Triton release; its own table, where one is there, comes first."""
    directory, current = on_h200
    write(directory, good_document())
    h100 = ("NVIDIA H100 80GB HBM3", (9, 0), "3.8.0")
    current["value"] = h100
    assert ours_faster(1000) is True
    found = fat.find_table(h100)
    assert found.kind == fat.ARCHITECTURE_DEFAULT and found.table.gpu == "NVIDIA H200"
    assert "measured on NVIDIA H200" in found.describe()
    write(directory, fat.table_document(*h100, [entry(10, 0.9)]), gpu=h100)
    fat.use_table_dir(directory)
    assert ours_faster(1000) is False
    assert fat.find_table(h100).kind == fat.GIVEN


def test_the_users_tuned_table_comes_before_the_shipped_one(monkeypatch, tmp_path):
    cache, shipped = tmp_path / "cache", tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.setattr(fat, "SHIPPED_DIR", shipped)
    assert fat.user_table_dir() == cache / "vllm-sinks" / "tables"
    write(shipped, good_document())
    fat.use_table_dir()
    try:
        assert fat.find_table(H200).kind == fat.SHIPPED
        fat.user_table_dir().mkdir(parents=True)
        write(fat.user_table_dir(), fat.table_document(*H200, [entry(10, 0.9)]))
        found = fat.find_table(H200)
        assert found.kind == fat.USER_TUNED and found.table.decide(cls(10)) is False
        monkeypatch.delenv("XDG_CACHE_HOME")
        assert fat.user_table_dir() == fat.Path.home() / ".cache" / "vllm-sinks" / "tables"
    finally:
        fat.use_table_dir()


def test_no_tables_at_all_falls_back_to_upstream(on_h200):
    directory, _ = on_h200
    write(directory, good_document())
    fat.use_table_dir(None)
    assert ours_faster(1000) is False


@pytest.mark.parametrize("content", ["{ not json", json.dumps({"format": "other"}),
                                     json.dumps(fat.table_document("NVIDIA A100", (8, 0), "3.8.0",
                                                                   [entry(10, 1.2)]))])
def test_a_malformed_table_warns_once_and_falls_back(on_h200, content):
    directory, _ = on_h200
    (directory / fat.table_name(*H200)).write_text(content)
    with pytest.warns(UserWarning, match="full-attention table ignored"):
        assert ours_faster(1000) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ours_faster(1000) is False
        assert ours_faster(100, q_heads=4, kv_heads=4) is False  # another class: not read again


# ---- the tile a table chose per group ---------------------------------------------------------------

CAPPED = dict(block_m=64, block_n=64, stages=3, defer_pv=True, overlap=False, maxnreg=168,
              tma=False)


def tiled_document(*tiles):
    rows = [dict(head_dim=80, dtype="bfloat16", causal=False, tile=t, candidates=[]) for t in tiles]
    return fat.table_document(*H200, [entry(10, 1.2)], tiles=rows)


def test_a_table_without_tiles_has_none_and_its_tiles_are_read_by_group():
    assert fat.parse_table(good_document()).tiles == {}
    assert fat.parse_table(tiled_document(CAPPED)).tiles == {(80, "bfloat16", False): CAPPED}


def test_a_tile_written_before_tma_reads_as_cp_async():
    """A table written before the ``tma`` field names tiles without it: they ran cp.async."""
    older = {key: value for key, value in CAPPED.items() if key != "tma"}
    assert fat.parse_table(tiled_document(older)).tiles == {(80, "bfloat16", False): CAPPED}
    tma = dict(CAPPED, maxnreg=None, tma=True)
    assert fat.parse_table(tiled_document(tma)).tiles == {(80, "bfloat16", False): tma}


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(tiles={}), "tiles must be a list"),
    (lambda d: d["tiles"][0].pop("tile"), "tile 0 is not an object with a 'tile' object"),
    (lambda d: d["tiles"][0].update(causal=1), "tile 0: causal must be true or false"),
    (lambda d: d["tiles"][0]["tile"].pop("maxnreg"), "tile must have the fields"),
    (lambda d: d["tiles"][0]["tile"].update(tma=1), "tile tma must be one of"),
    (lambda d: d["tiles"][0]["tile"].update(stages=9), "tile stages must be one of"),
    (lambda d: d["tiles"][0]["tile"].update(defer_pv=1), "tile defer_pv must be one of"),
    (lambda d: d["tiles"][0]["tile"].update(maxnreg=170), "tile maxnreg must be one of"),
    (lambda d: d["tiles"].append(dict(d["tiles"][0])), "tile 1 repeats the group"),
])
def test_a_malformed_tile_says_what_is_wrong(edit, match):
    doc = tiled_document(dict(CAPPED))
    edit(doc)
    with pytest.raises(fat.TableError, match=match):
        fat.parse_table(doc, "t.json")


def test_the_route_reads_the_tile_of_the_devices_table(on_h200):
    directory, current = on_h200
    write(directory, tiled_document(CAPPED))
    cpu = torch.device("cpu")

    def tile_of(head_dim, dtype, causal):
        return fat.route(cpu, head_dim, dtype, causal, 16, 16).tile

    assert tile_of(80, torch.bfloat16, False) == CAPPED
    assert tile_of(80, torch.bfloat16, True) is None  # another group: the default tile
    assert tile_of(64, torch.float16, False) is None
    current["value"] = ("NVIDIA H200", (9, 0), "3.9.0")  # no table for that Triton
    fat.use_table_dir(directory)
    assert tile_of(80, torch.bfloat16, False) is None


class _FakeFullLaunch:
    """Stands in for the Hopper kernel's ``FullLaunch`` (no GPU here): records the tiles asked for
    and refuses the ones its ``refuse`` says."""

    def __init__(self, refuse=lambda tile: False):
        self.asked, self.refuse = [], refuse

    def plan(self, p, q, k, v, o, starts, lens, sinks, tile=None):
        self.asked.append(tile)
        if tile is not None and self.refuse(tile):
            raise ValueError("refused for the test")
        return ("launch", tile)


def _problem():
    from vllm_sinks.v1.attention.ops.prefill_attention_problem import validate

    q = torch.zeros(32, 16, 80, dtype=torch.bfloat16)
    starts, lens = torch.tensor([0], dtype=torch.int32), torch.tensor([32], dtype=torch.int32)
    p = validate(q, q, q, q, starts, lens, 32, False, None, None, None, None, False)
    return p, (q, q, q, q, starts, lens, None)


def test_the_front_door_plans_the_tables_tile_and_falls_back_once_when_refused(on_h200):
    from vllm_sinks.v1.attention.ops import triton_prefill_attention as op
    from vllm_sinks.v1.attention.ops.gluon_full_attention import TileConfig

    directory, _ = on_h200
    p, args = _problem()
    fake = _FakeFullLaunch()

    def tile():
        return fat.route(p.device, p.head_dim, p.dtype, p.is_causal, p.q_heads, p.kv_heads).tile

    assert op._full_launch(fake, p, *args, tile()) == ("launch", None)  # no table: the default
    write(directory, tiled_document(CAPPED))
    fat.use_table_dir(directory)
    assert op._full_launch(fake, p, *args, tile()) == ("launch", TileConfig(**CAPPED))
    refusing = _FakeFullLaunch(refuse=lambda tile: True)
    op._REFUSED_TILES.clear()
    try:
        with pytest.warns(UserWarning, match="tile .* is refused"):
            assert op._full_launch(refusing, p, *args, tile()) == ("launch", None)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # refused once: not asked again, not warned again
            assert op._full_launch(refusing, p, *args, tile()) == ("launch", None)
        assert refusing.asked == [TileConfig(**CAPPED), None, None]
    finally:
        op._REFUSED_TILES.clear()
