"""The transformers-trace, transformers-kv-heads and logits-scaling patches inside an installed vLLM,
without starting an engine (seconds). Their end-to-end checks (TP=2 against HF and TP=1, MiMo-V2-Flash,
Granite's logits_scaling) are in test_transformers_sinks_e2e.py.
"""

from __future__ import annotations

import functools
import types

import pytest

pytestmark = pytest.mark.vllm

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from torch import nn  # noqa: E402

from vllm_sinks.model_executor.models.transformers import base as ours_base  # noqa: E402
from vllm_sinks.model_executor.models.transformers import causal as ours_causal  # noqa: E402
from vllm_sinks.model_executor.models.transformers import fx_utils as ours_fx  # noqa: E402
from vllm_sinks.patches import install, logits_scaling, transformers_kv_heads, transformers_trace  # noqa: E402
from vllm_sinks.patches.registry import detect_vllm  # noqa: E402
from vllm_sinks.verify import tiny_models  # noqa: E402

INFO = detect_vllm()


def _wrapped(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


class WrappedAttention(nn.Module):
    """q/k/v/o projections around a forward wrapped the way transformers 5.24 wraps attention."""

    def __init__(self, hidden=8, heads=2, head_dim=4):
        super().__init__()
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim)
        self.k_proj = nn.Linear(hidden, heads * head_dim)
        self.v_proj = nn.Linear(hidden, heads * head_dim)
        self.o_proj = nn.Linear(heads * head_dim, hidden)

    @_wrapped
    def forward(self, hidden_states, cache=None, **kwargs):
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        return self.o_proj(q * k + v)


class _Scale(nn.Module):
    def forward(self, x):
        return x * 2


HUB_SCALE = _Scale()  # held in the module's globals, outside every tree: what a hub-kernel Func is


class HubKernelAttention(WrappedAttention):
    """A wrapped forward that also calls a module outside its tree, as transformers' attention does
    under hub kernels (``apply_rotary_pos_emb`` a kernels ``Func``)."""

    @_wrapped
    def forward(self, hidden_states, cache=None, **kwargs):
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        return self.o_proj(HUB_SCALE(q) * k + v)


# ---- transformers-trace ---------------------------------------------------------------------------


def _fx_utils():
    found = transformers_trace._modules()
    if found is None:
        pytest.skip("this backend has no fx fusers")
    return found


def test_our_trace_reads_through_a_wrapped_forward_and_restores_it():
    fx_utils, _ = _fx_utils()
    with torch.device("meta"):
        module = WrappedAttention()
    forward = WrappedAttention.__dict__["forward"]
    upstream = install.upstream(fx_utils.trace)
    if ours_fx.complete(upstream(module)):
        pytest.skip("upstream's trace reads through wrapped forwards here (the patch stands down)")
    transformers_trace.apply(INFO)  # idempotent; what the plugin does in every vLLM process
    graph = fx_utils.trace(module)
    assert ours_fx.complete(graph)
    assert _fx_utils()[1].trace is fx_utils.trace  # the name get_fuser calls
    assert {n.target for n in graph.nodes if n.op == "call_module"} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert WrappedAttention.__dict__["forward"] is forward


def test_our_trace_reads_through_a_module_outside_the_tree_and_restores_it():
    fx_utils, _ = _fx_utils()
    with torch.device("meta"):
        module = HubKernelAttention()
    if ours_fx.complete(install.upstream(fx_utils.trace)(module)):
        pytest.skip("upstream's trace reads through modules outside the tree here (the patch stands down)")
    transformers_trace.apply(INFO)
    graph = fx_utils.trace(module)
    assert ours_fx.complete(graph)
    assert {n.target for n in graph.nodes if n.op == "call_module"} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert globals()["HUB_SCALE"] is HUB_SCALE


def test_the_probe_applies_exactly_where_upstream_cannot_trace_a_wrapper():
    fx_utils, _ = _fx_utils()
    upstream_ok = transformers_trace._traces_wrapped_forward(fx_utils.trace)
    assert transformers_trace.probe(INFO).applies is (not upstream_ok)


def test_gpt_oss_attention_fuses_its_qkv_through_our_trace():
    """What made GPT-OSS right at TP=2: its TP plan names no attention projection, so only the QKV
    fusion shards them."""
    fx_utils, _ = _fx_utils()
    from vllm.model_executor.models.transformers.fusers import QKVFuser

    cls = tiny_models.model_class("gpt_oss")
    config = cls.config_class.from_pretrained(tiny_models.tiny_model("gpt_oss"))
    config._attn_implementation = "vllm"
    with torch.device("meta"):
        attention = cls(config).model.layers[0].self_attn
    transformers_trace.apply(INFO)
    fuser = QKVFuser.match(fx_utils.trace(attention), attention)
    assert fuser is not None and (fuser.q_name, fuser.o_name) == ("q_proj", "o_proj")


# ---- transformers-kv-heads ------------------------------------------------------------------------


@pytest.mark.parametrize("kv, tp, per_rank, heads", [
    (2, 1, 2, [None]), (2, 2, 1, [None, None]), (1, 2, 1, [0, 0]), (2, 4, 1, [0, 0, 1, 1]),
])
def test_kv_heads_per_rank_follow_vllms_replication(kv, tp, per_rank, heads):
    geo = ours_base.KvGeometry("layers.0.self_attn", kv, 64, 32)
    assert geo.per_rank(tp) == per_rank
    assert [geo.replica_head(rank, tp) for rank in range(tp)] == heads


def test_kv_heads_tp_cannot_place_are_refused():
    with pytest.raises(ValueError, match="neither divides"):
        ours_base.KvGeometry("layers.0.self_attn", 3, 64, 32).per_rank(2)


def test_mimo_v2_flash_kv_heads_are_read_per_layer():
    if not tiny_models.family_available("mimo_v2_flash"):
        pytest.skip("transformers has no MiMo-V2-Flash")
    cls = tiny_models.model_class("mimo_v2_flash")
    config = cls.config_class.from_pretrained(tiny_models.tiny_model("mimo_v2_flash"))  # not on meta
    with torch.device("meta"):
        model = cls(config)
    geometry = ours_base.read_kv_geometry(model.model)
    assert {i: g.kv_heads for i, g in geometry.items()} == {0: 1, 1: 2}  # full, sliding (HF: x2)
    assert {g.v_head_dim for g in geometry.values()} == {32}


def test_kv_head_loader_takes_this_ranks_head():
    param = nn.Parameter(torch.empty(4, 3), requires_grad=False)
    full = torch.arange(24.0).view(8, 3)  # two heads of width 4
    ours_base._kv_head_loader(4, 4)(param, full)
    assert torch.equal(param.data, full[4:])


def test_the_kv_heads_probe_reads_the_attention_builder():
    builder, model_wide = transformers_kv_heads._check(transformers_kv_heads._upstream())
    assert builder in transformers_kv_heads.BUILDERS
    assert transformers_kv_heads.probe(INFO).applies is model_wide


# ---- logits-scaling --------------------------------------------------------------------------------


def test_logits_scaling_is_folded_into_the_processor_scale():
    model = types.SimpleNamespace(text_config=types.SimpleNamespace(logits_scaling=8.0, logit_scale=1.0),
                                  logits_processor=types.SimpleNamespace(scale=1.0))
    assert ours_causal.apply_logits_scaling(model) == 8.0
    assert model.logits_processor.scale == 0.125


@pytest.mark.parametrize("config", [types.SimpleNamespace(), types.SimpleNamespace(logits_scaling=1.0),
                                    types.SimpleNamespace(logits_scaling=None)])
def test_no_or_default_logits_scaling_changes_nothing(config):
    model = types.SimpleNamespace(text_config=config, logits_processor=types.SimpleNamespace(scale=0.5))
    assert ours_causal.apply_logits_scaling(model) is None
    assert model.logits_processor.scale == 0.5


def test_a_pipeline_rank_without_logits_is_left_alone():
    model = types.SimpleNamespace(text_config=types.SimpleNamespace(logits_scaling=8.0))
    assert ours_causal.apply_logits_scaling(model) is None


def test_the_logits_scaling_probe_reads_upstreams_init():
    _, code = logits_scaling._upstream()
    upstream_reads_it = "logits_scaling" in code.co_consts or "logits_scaling" in code.co_names
    assert logits_scaling.probe(INFO).applies is (not upstream_reads_it)
