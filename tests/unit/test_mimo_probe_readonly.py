"""The MiMo probe reads, it does not write: upstream's method runs as a copy against a recorder, and
vLLM's op module is never rebound (fake upstream in sys.modules, no vLLM needed)."""

from __future__ import annotations

import sys
import textwrap
import types

import pytest

torch = pytest.importorskip("torch")

from vllm_sinks.patches import mimo_vision_sinks as hooks  # noqa: E402


class WatchedModule(types.ModuleType):
    """A module that records every attribute write after setup."""

    def __init__(self, name):
        super().__init__(name)
        object.__setattr__(self, "writes", [])

    def __setattr__(self, key, value):
        self.writes.append(key)
        super().__setattr__(key, value)


def upstream_op(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal=True, softmax_scale=None,
                sliding_window_q=None, sliding_window_k=None, sinks=None, sinks_bias_key0=False):
    raise AssertionError("the probe must not run the op")


# Shaped like upstream's MiMo module: the attention's __init__ builds vLLM layers (which would need a
# vLLM config and a TP group: here they refuse to be built, so the probe must stand them in) and keeps
# the global TP rank with a data-parallel ViT (RANK_LINE); its window method imports the op inside
# and slices the sinks by that rank.
GLOBAL_RANK = "self.tp_rank = parallel_state.get_tensor_model_parallel_rank()"
COLLAPSED_RANK = "self.tp_rank = 0 if use_data_parallel else parallel_state.get_tensor_model_parallel_rank()"
UPSTREAM_SOURCE = textwrap.dedent(f"""
    import torch
    from torch import nn

    def is_vit_use_data_parallel():
        raise AssertionError("the probe must ask its own stand-in")

    class parallel_state:
        @staticmethod
        def get_tensor_model_parallel_world_size():
            raise AssertionError("the probe must ask its own stand-in")

        get_tensor_model_parallel_rank = get_tensor_model_parallel_world_size

    class QKVParallelLinear(nn.Module):
        def __init__(self, *args, **kwargs):
            raise AssertionError("a vLLM layer cannot be built without vLLM's config")

    class MiMoVisionAttention(nn.Module):
        def __init__(self, embed_dim, num_heads, num_kv_heads, qk_channels, kv_channels, use_sink=False,
                     visual_token_window_size=64, quant_config=None, prefix=""):
            super().__init__()
            use_data_parallel = is_vit_use_data_parallel()
            self.tp_size = 1 if use_data_parallel else parallel_state.get_tensor_model_parallel_world_size()
            RANK_LINE
            self.num_heads_per_partition = num_heads // self.tp_size
            self.qk_channels = qk_channels
            self.scale = qk_channels ** -0.5
            self.qkv = QKVParallelLinear(embed_dim, qk_channels, num_heads, disable_tp=use_data_parallel)
            self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False) if use_sink else None
            self.visual_token_window_size = visual_token_window_size

        def _forward_window_attn(self, q, k, v, cu_seqlens, max_seqlen):
            from {hooks.OP_MODULE} import context_attention_fwd

            output = torch.empty_like(q)
            start = self.tp_rank * self.num_heads_per_partition
            sinks = self.sinks[start:start + self.num_heads_per_partition]
            context_attention_fwd(q, k, v, output, b_start_loc=cu_seqlens[:-1],
                                  b_seq_len=cu_seqlens[1:] - cu_seqlens[:-1], max_input_len=max_seqlen,
                                  is_causal=False, softmax_scale=self.scale,
                                  sliding_window_q=self.visual_token_window_size,
                                  sliding_window_k=self.visual_token_window_size, sinks=sinks,
                                  sinks_bias_key0=True)
            return output
""")


def _load(model, rank_line=GLOBAL_RANK, source=UPSTREAM_SOURCE):
    code = compile(source.replace("RANK_LINE", rank_line), "<fake mimo_v2_omni>", "exec")
    exec(code, model.__dict__)  # noqa: S102
    return model


@pytest.fixture
def fake_upstream(monkeypatch):
    for name in ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    op_module = WatchedModule(hooks.OP_MODULE)
    op_module.context_attention_fwd = upstream_op
    op_module.writes.clear()
    monkeypatch.setitem(sys.modules, hooks.OP_MODULE, op_module)
    model = WatchedModule(hooks.MODEL_MODULE)
    monkeypatch.setitem(sys.modules, hooks.MODEL_MODULE, model)
    return op_module, model


def _untouched(op_module, model):
    model.writes.clear()  # the fake's own definitions
    return lambda: op_module.writes == [] and model.writes == [] and \
        op_module.context_attention_fwd is upstream_op


def test_probe_records_upstream_call_without_rebinding_the_op(fake_upstream):
    op_module, model = fake_upstream
    _load(model)
    untouched = _untouched(op_module, model)
    init = model.MiMoVisionAttention.__dict__["__init__"]
    path, facts = hooks._classify(model.MiMoVisionAttention)
    assert path == hooks.VIA_PREFILL_OP
    # global-rank slicing found: rank 1 of a data-parallel ViT passes no sink; tensor-parallel rank 1
    # passes its own head's
    assert facts == {"dp_rank1_sinks": [], "tp_rank1_sinks": [hooks.PROBE_SINKS[1]], "semantics": "key0",
                     "declares_encoder_tp_data": False}
    assert untouched()  # nothing written into vLLM's op module or the model's
    assert model.MiMoVisionAttention.__dict__["__init__"] is init
    assert model.__dict__["parallel_state"].__name__ == "parallel_state"
    assert model.__dict__["is_vit_use_data_parallel"].__module__ == hooks.MODEL_MODULE
    method = model.MiMoVisionAttention.__dict__["_forward_window_attn"]
    assert method.__globals__ is model.__dict__ and "context_attention_fwd" not in model.__dict__
    problems, fixed = hooks._slicing(facts)
    assert problems == ["slices sinks by the global TP rank: rank 1 of a data-parallel ViT passes 0 of 2 "
                        "heads' sinks (latent: no model class here declares supports_encoder_tp_data)"]
    assert fixed == ""


def test_a_collapsed_data_parallel_rank_is_upstream_fixed(fake_upstream, monkeypatch):
    op_module, model = fake_upstream
    _load(model, COLLAPSED_RANK)
    model.MiMoV2OmniForCausalLM = type("MiMoV2OmniForCausalLM", (), {"supports_encoder_tp_data": True})
    untouched = _untouched(op_module, model)
    path, facts = hooks._classify(model.MiMoVisionAttention)
    assert facts["dp_rank1_sinks"] == list(hooks.PROBE_SINKS) and facts["declares_encoder_tp_data"]
    assert hooks._slicing(facts) == ([], "data-parallel ViT slicing fixed upstream (rank 1 of a "
                                         "data-parallel ViT passes all 2 heads' sinks)")
    monkeypatch.delenv("VLLM_SINKS_MIMO_SINK_SEMANTICS", raising=False)
    verdict = hooks.probe(None)
    assert not verdict.applies and "data-parallel ViT slicing fixed upstream" in verdict.reason
    monkeypatch.setenv("VLLM_SINKS_MIMO_SINK_SEMANTICS", "null")
    verdict = hooks.probe(None)
    assert verdict.applies and "VLLM_SINKS_MIMO_SINK_SEMANTICS selects null" in verdict.reason
    assert untouched()


def test_a_module_level_binding_is_recorded_too(fake_upstream):
    op_module, model = fake_upstream
    source = UPSTREAM_SOURCE.replace(f"            from {hooks.OP_MODULE} import context_attention_fwd\n", "")
    _load(model, source=f"from {hooks.OP_MODULE} import context_attention_fwd\n" + source)
    untouched = _untouched(op_module, model)
    path, facts = hooks._classify(model.MiMoVisionAttention)
    assert path == hooks.VIA_PREFILL_OP and facts["semantics"] == "key0"
    assert model.context_attention_fwd is upstream_op and untouched()


def test_an_init_that_reads_no_vit_mode_is_drift(fake_upstream):
    _, model = fake_upstream
    _load(model, source=UPSTREAM_SOURCE.replace("use_data_parallel = is_vit_use_data_parallel()",
                                                "use_data_parallel = False"))
    with pytest.raises(hooks.Drift, match="no longer reads is_vit_use_data_parallel"):
        hooks._classify(model.MiMoVisionAttention)
