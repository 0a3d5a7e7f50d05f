"""The Hopper full-attention kernel's planning on the CPU (the platform check stood in for): which
calls it takes, the tile it takes them with, and the tiles it refuses. Its numbers are checked on
the GPU (tests/gpu/test_full_attention_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from vllm_sinks.v1.attention.ops import gluon_full_attention as gf
from vllm_sinks.v1.attention.ops.prefill_attention_problem import validate


def _call(head_dim=80, is_causal=False, dtype=torch.bfloat16, window=None):
    q = torch.randn(300, 4, head_dim, dtype=dtype)
    k, v, o = torch.randn_like(q), torch.randn_like(q), torch.empty_like(q)
    start, length = torch.tensor([0, 100], dtype=torch.int32), torch.tensor([100, 200], dtype=torch.int32)
    p = validate(q, k, v, o, start, length, 200, softmax_scale=None, is_causal=is_causal,
                 sliding_window_q=window, sliding_window_k=window, sinks=None, sinks_bias_key0=False)
    return p, (q, k, v, o, start, length, None)


@pytest.fixture
def on_hopper(monkeypatch):
    monkeypatch.setattr(gf, "full_unavailable", lambda device: None)


@pytest.mark.parametrize("is_causal", [False, True])
def test_the_default_tile_is_the_swept_one(on_hopper, is_causal):
    p, args = _call(is_causal=is_causal)
    launch = gf.FullLaunch.plan(p, *args)
    assert launch.block_m == 64 and launch.options["num_warps"] == 4
    c = launch.constexprs
    assert (c["BLOCK_N"], c["STAGES"], c["DEFER_PV"], c["OVERLAP"]) == (64, 3, not is_causal, is_causal)
    assert (c["D0"], c["D1"]) == (64, 16)  # 80 = 64 + 16


@pytest.mark.parametrize("tile, match", [
    (gf.TileConfig(64, 64, 3, defer_pv=True, overlap=True), "two schedules"),
    (gf.TileConfig(64, 64, 2, overlap=True), "no ring slot"),
    (gf.TileConfig(64, 64, 1), "no ring slot"),
])
def test_a_tile_that_cannot_run_is_refused_by_name(on_hopper, tile, match):
    p, args = _call()
    with pytest.raises(ValueError, match=match):
        gf.FullLaunch.plan(p, *args, tile=tile)


@pytest.mark.parametrize("call", [dict(window=32), dict(head_dim=256), dict(dtype=torch.float32)])
def test_calls_it_does_not_take(on_hopper, call):
    p, args = _call(**call)
    assert gf.takes(p) is not None and gf.FullLaunch.plan(p, *args) is None


def test_off_hopper_it_takes_nothing():
    p, args = _call()
    assert gf.full_unavailable(p.device) is not None
    assert gf.FullLaunch.plan(p, *args) is None


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_every_tile_the_tune_times_is_one_the_table_and_the_plan_take(on_hopper, head_dim, is_causal):
    """A candidate the plan refused would cost the tune its time and warn on every table naming it."""
    from vllm_sinks.v1.attention.ops import tune_full_attention as tune
    from vllm_sinks.v1.attention.ops import full_attention_table as fat

    candidates = tune.tile_candidates(head_dim, is_causal)
    assert len({tuple(sorted(t.items())) for t in candidates}) == len(candidates)  # no repeats
    p, args = _call(head_dim=head_dim, is_causal=is_causal)
    for tile in candidates:
        doc = fat.table_document("gpu", (9, 0), "3.8.0", [], tiles=[
            dict(head_dim=head_dim, dtype="bfloat16", causal=is_causal, tile=tile)])
        assert fat.parse_table(doc).tiles == {(head_dim, "bfloat16", is_causal): tile}
        launch = gf.FullLaunch.plan(p, *args, tile=gf.TileConfig(**tile))
        c = launch.constexprs
        assert (c["BLOCK_N"], c["STAGES"], c["DEFER_PV"], c["OVERLAP"], c["TMA_KV"]) == (
            tile["block_n"], tile["stages"], tile["defer_pv"], tile["overlap"], tile["tma"])
        assert len(launch.descriptors) == (4 if tile["tma"] else 0)  # all three take TMA
        assert launch.block_m == tile["block_m"]  # (the cap is a CUDA launch option: not on the CPU)


def test_the_compile_check_compiles_every_tile_a_shipped_table_names(monkeypatch):
    """CI compiles the kernel for sm_90a under each Triton of its matrix
    (``inspect_full_attention.py``, no GPU): with every tile the shipped tables of that release name,
    since the front door runs those tiles on every call of their group."""
    from benchmarks.kernels import inspect_full_attention as inspect
    from vllm_sinks.v1.attention.ops import full_attention_table as fat

    tables = [fat.load_table(p) for p in sorted(fat.SHIPPED_DIR.glob("*.json"))]
    assert tables
    for table in tables:
        monkeypatch.setattr(inspect.triton, "__version__", table.triton + ".0")
        compiled = {(inspect.CASES[c][0], inspect.CASES[c][2], t)
                    for c in inspect.CASES for t in [gf.default_tile(inspect.CASES[c][2]),
                                                     *inspect.shipped_tiles(c)]}
        for (head_dim, _dtype, causal), tile in table.tiles.items():
            assert (head_dim, causal, gf.TileConfig(**tile)) in compiled, (table.triton, head_dim, causal)


@pytest.mark.skipif(gf.HostTensorDescriptor is None, reason="no Gluon in this Triton")
def test_a_tma_tile_reads_by_cp_async_where_tma_cannot(on_hopper):
    """Head dims the parts do not cover exactly, and heads not back to back, keep the tile's
    schedule by cp.async: no descriptors, no TMA in the compiled variant."""
    tma = gf.TileConfig(64, 64, 2, tma=True)
    p, args = _call(head_dim=72)
    assert "72 is not 64 + 16" in gf.tma_unavailable(p, args[1], args[2])
    launch = gf.FullLaunch.plan(p, *args, tile=tma)
    assert launch.descriptors == () and launch.constexprs["TMA_KV"] is False
    p, args = _call(head_dim=64)
    q, k, v, *rest = args
    wide = torch.zeros(k.shape[0], k.shape[1], 96, dtype=k.dtype)[:, :, :64]
    assert "not stored back to back" in gf.tma_unavailable(p, wide, v)
    assert gf.FullLaunch.plan(p, q, wide, v, *rest, tile=tma).descriptors == ()
    launch = gf.FullLaunch.plan(p, *args, tile=tma)
    assert launch.constexprs["TMA_KV"] is True and "Kd0" not in launch.constexprs
    fields = launch.descriptors[0]
    assert fields["shape"] == [k.shape[0], k.shape[1] * 64] and fields["block_shape"] == [64, 64]
