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


# Shaped like upstream's 0.28+ method: imports the op inside, slices sinks by the global TP rank.
UPSTREAM_SOURCE = textwrap.dedent(f"""
    import torch

    class MiMoVisionAttention:
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


@pytest.fixture
def fake_upstream(monkeypatch):
    for name in ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    op_module = WatchedModule(hooks.OP_MODULE)
    op_module.context_attention_fwd = upstream_op
    op_module.writes.clear()
    monkeypatch.setitem(sys.modules, hooks.OP_MODULE, op_module)
    model = types.ModuleType(hooks.MODEL_MODULE)
    exec(compile(UPSTREAM_SOURCE, "<fake mimo_v2_omni>", "exec"), model.__dict__)  # noqa: S102
    monkeypatch.setitem(sys.modules, hooks.MODEL_MODULE, model)
    return op_module, model


def test_probe_records_upstream_call_without_rebinding_the_op(fake_upstream):
    op_module, model = fake_upstream
    path, facts = hooks._classify(model.MiMoVisionAttention)
    assert path == hooks.VIA_PREFILL_OP
    assert facts == {"dp_rank1_sink_heads": 0, "semantics": "key0"}  # global-rank slicing found
    assert op_module.writes == []  # nothing written into vLLM's op module
    assert op_module.context_attention_fwd is upstream_op
    method = model.MiMoVisionAttention.__dict__["_forward_window_attn"]
    assert method.__globals__ is model.__dict__ and "context_attention_fwd" not in model.__dict__


def test_a_module_level_binding_is_recorded_too(fake_upstream):
    op_module, model = fake_upstream
    source = UPSTREAM_SOURCE.replace(f"            from {hooks.OP_MODULE} import context_attention_fwd\n", "")
    source = f"from {hooks.OP_MODULE} import context_attention_fwd\n" + source
    exec(compile(source, "<fake mimo_v2_omni>", "exec"), model.__dict__)  # noqa: S102
    path, facts = hooks._classify(model.MiMoVisionAttention)
    assert path == hooks.VIA_PREFILL_OP and facts["semantics"] == "key0"
    assert model.context_attention_fwd is upstream_op and op_module.writes == []
