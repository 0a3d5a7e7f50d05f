"""SinkFuser: which tensor each attention module passes as ``s_aux``, read from its FX graph.

Needs torch + transformers only (no vLLM); runs in every venv, so on transformers 5.17 (vLLM 0.27.1's
venv), 5.19 (the no-vLLM venv, vLLM 0.32.0's) and 5.24 (vLLM 0.29.0's, the ``@deprecate_kwarg`` era).

The oracle for the real families is independent of the tracer: a forward pass of the whole tiny
model through a spy attention interface that records which tensor object each module hands over.
"""

from __future__ import annotations

import functools
import math
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch import fx, nn  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface  # noqa: E402

from vllm_sinks.model_executor.models.transformers.fusers.sink import (  # noqa: E402
    AttentionSite,
    SinkFuser,
    SinkFuserError,
    SinkSite,
    attention_interface_call,
)
from vllm_sinks.verify import tiny_models  # noqa: E402

FAMILIES = [f for f in tiny_models.FAMILIES if tiny_models.family_available(f)]
SPY = "vllm_sinks_test_spy"
_SPY_CALLS: list[tuple[nn.Module, object]] = []


def _spy_interface(module, query, key, value, attention_mask, **kwargs):
    """Records (module, s_aux); returns zeros shaped like eager's output [batch, tokens, heads, dim_v]."""
    _SPY_CALLS.append((module, kwargs.get("s_aux")))
    batch, heads, tokens, _ = query.shape
    return value.new_zeros(batch, tokens, heads, value.shape[-1]), None


AttentionInterface.register(SPY, _spy_interface)
# The models build their 4-D masks per attention implementation; the spy wants eager's.
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask  # noqa: E402

ALL_MASK_ATTENTION_FUNCTIONS.register(SPY, eager_mask)


def _tiny_model(family: str, device: str = "cpu") -> nn.Module:
    spec = tiny_models._spec(family)
    config = getattr(transformers, spec.config_class)(**tiny_models._COMMON, **spec.config)
    config._attn_implementation = SPY
    torch.manual_seed(0)
    with torch.device(device):
        return tiny_models.model_class(family)(config).eval()


def _spied_s_aux(model: nn.Module) -> dict[nn.Module, object]:
    """Run one forward; module -> the s_aux it passed (None when it passed none)."""
    _SPY_CALLS.clear()
    ids = torch.arange(3, 23)[None]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    seen = dict(_SPY_CALLS)
    assert len(seen) == len(_SPY_CALLS), "a module called the interface twice"
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_sink_is_what_its_forward_passes(family):
    model = _tiny_model(family)
    spied = _spied_s_aux(model)
    fuser = SinkFuser()
    sites = fuser.scan(model)
    assert {model.get_submodule(n) for n in sites} == set(spied), "traced modules != modules that attend"
    with_sink = 0
    for name, site in sites.items():
        module = model.get_submodule(name)
        assert site.problem is None, (name, site.problem)
        assert site.interface_calls == 1
        if spied[module] is None:
            assert site.sink is None, f"{name}: passes no sink, fuser found {site.sink}"
        else:
            assert site.sink is not None, f"{name}: passes a sink the fuser missed"
            assert site.sink.tensor(module) is spied[module]  # the very parameter, not a look-alike
            assert site.sink.kind == "parameter"
            with_sink += 1
    assert with_sink >= 1
    # Traces are cached per class and reused across layers that read the same state.
    assert fuser.traces <= len(sites)


def test_mimo_full_layers_get_no_sink_whatever_the_order():
    if "mimo_v2_flash" not in FAMILIES:
        pytest.skip("transformers has no MiMo-V2-Flash")
    model = _tiny_model("mimo_v2_flash", device="meta")
    layers = [layer.self_attn for layer in model.model.layers]
    kinds = [getattr(m, "sinks", None) is not None for m in layers]
    assert kinds == [False, True], "tiny config: [full_attention, sliding_attention]"
    for order in (layers, layers[::-1]):  # whichever instance is traced first, no leak
        fuser = SinkFuser()
        answers = {m: fuser.find(m).sink for m in order}
        assert answers[layers[0]] is None
        assert answers[layers[1]] == SinkSite("sinks", "parameter")
        assert fuser.traces == 2


def test_the_interface_call_is_one_node_that_keeps_its_keywords():
    model = _tiny_model("gpt_oss", device="meta")
    attn = model.model.layers[0].self_attn
    graph = SinkFuser().trace(attn)
    [call] = [n for n in graph.nodes if n.target is attention_interface_call]
    assert call.meta["attention_interface"] == attn.config._attn_implementation
    s_aux = call.kwargs["s_aux"]
    assert isinstance(s_aux, fx.Node) and s_aux.op == "get_attr" and s_aux.target == "sinks"
    assert call.kwargs["scaling"] == attn.scaling
    assert call.kwargs["sliding_window"] == attn.sliding_window
    # query, key, value come from the traced projections, not from placeholders
    assert all(isinstance(a, fx.Node) and a.op != "placeholder" for a in call.args[:3])


# ---- synthetic modules: the sink under other names and owners -------------------------------------


class _Config:
    hidden_size = 32
    _attn_implementation = SPY


_CONFIG = _Config()


class _Extra(nn.Module):
    def __init__(self, heads):
        super().__init__()
        self.per_head_logit = nn.Parameter(torch.randn(heads))


class _Attention(nn.Module):
    """A GPT-OSS-shaped attention module; subclasses choose what they pass as s_aux."""

    def __init__(self, heads=4, head_dim=8):
        super().__init__()
        self.config = _CONFIG  # shared, as a model's layers share theirs
        self.head_dim = head_dim
        self.scaling = head_dim ** -0.5
        self.q_proj = nn.Linear(32, heads * head_dim)
        self.k_proj = nn.Linear(32, heads * head_dim)
        self.v_proj = nn.Linear(32, heads * head_dim)
        self.o_proj = nn.Linear(heads * head_dim, 32)

    def s_aux(self):
        raise NotImplementedError

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)  # iterates a proxy: needs the meta values
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
        out, _ = interface(self, q, k, v, attention_mask, scaling=self.scaling, s_aux=self.s_aux(), **kwargs)
        return self.o_proj(out.reshape(*input_shape, -1)), None


class NestedOwner(_Attention):
    def __init__(self):
        super().__init__()
        self.extra = _Extra(4)

    def s_aux(self):
        return self.extra.per_head_logit


class BufferSink(_Attention):
    def __init__(self):
        super().__init__()
        self.register_buffer("learned_sink", torch.randn(4))

    def s_aux(self):
        return self.learned_sink


class CastSink(_Attention):
    def __init__(self):
        super().__init__()
        self.attn_bias = nn.Parameter(torch.randn(4))

    def s_aux(self):
        return self.attn_bias.float()


class ComputedSink(_Attention):
    def __init__(self):
        super().__init__()
        self.sinks = nn.Parameter(torch.randn(4))

    def s_aux(self):
        return self.sinks * 2


class PlainTensorSink(_Attention):
    def __init__(self):
        super().__init__()
        self.not_a_parameter = torch.randn(4)  # plain attribute: nothing the checkpoint could load

    def s_aux(self):
        return self.not_a_parameter


class FlaggedSink(_Attention):
    """Same parameters on every instance; a flag decides whether the sink is passed."""

    def __init__(self, use_sink):
        super().__init__()
        self.use_sink = use_sink
        self.sinks = nn.Parameter(torch.randn(4))

    def s_aux(self):
        return self.sinks if self.use_sink else None


class BranchesOnValues(_Attention):
    """Control flow on a tensor's value cannot be traced before the interface call."""

    def __init__(self):
        super().__init__()
        self.sinks = nn.Parameter(torch.randn(4))

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        if hidden_states.sum() > 0:
            hidden_states = hidden_states * 2
        return super().forward(hidden_states, attention_mask, **kwargs)

    def s_aux(self):
        return self.sinks


class DictReadSink(_Attention):
    """Reads its sink past nn.Module.__getattr__: found by identity, not through a proxy."""

    def __init__(self):
        super().__init__()
        self.sinks = nn.Parameter(torch.randn(4))

    def s_aux(self):
        return self._parameters["sinks"]


class ShapeCode(_Attention):
    """Shape code stock fx cannot trace: len() of a proxy, a leaf's output shape, x.mT, a dtype test."""

    def __init__(self):
        super().__init__()
        self.sinks = nn.Parameter(torch.randn(4))

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        q = self.q_proj(hidden_states.mT.mT)
        q = q.view(*q.shape[:-1], len(self.sinks), -1).transpose(1, 2)
        if q.dtype == torch.bool or q.size(-1) != self.head_dim:
            raise AssertionError("meta values are wrong")
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
        return interface(self, q, q, q, attention_mask, s_aux=self.sinks)


_LOCAL_INTERFACES = AttentionInterface()  # a modeling file's own registry instance (as Doge's)


class LocalRegistry(NestedOwner):
    def forward(self, hidden_states, attention_mask=None, **kwargs):
        q = self.q_proj(hidden_states).view(*hidden_states.shape[:-1], -1, self.head_dim).transpose(1, 2)
        interface = _LOCAL_INTERFACES.get_interface(self.config._attn_implementation, None)
        return interface(self, q, q, q, attention_mask, s_aux=self.s_aux())


class ConstantInForward(NestedOwner):
    """Its forward makes a tensor, which fx stows as a constant on the root it traces."""

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        return super().forward(hidden_states + torch.zeros(32), attention_mask, **kwargs)


class NeverCalls(_Attention):
    """Names the registry but, with this config, never calls it (an eager-only branch)."""

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        if self.config._attn_implementation != SPY:
            return ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation](self, hidden_states)
        return hidden_states


class NoInterface(nn.Module):
    def __init__(self):
        super().__init__()
        self.sinks = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x + self.sinks.sum()


@pytest.mark.parametrize("cls, path, kind", [(NestedOwner, "extra.per_head_logit", "parameter"),
                                             (BufferSink, "learned_sink", "buffer"),
                                             (CastSink, "attn_bias", "parameter"),
                                             (DictReadSink, "sinks", "parameter"),
                                             (ShapeCode, "sinks", "parameter"),
                                             (LocalRegistry, "extra.per_head_logit", "parameter")])
def test_the_sink_is_found_under_any_name_and_owner(cls, path, kind):
    module = cls()
    site = SinkFuser().find(module)
    assert site == AttentionSite(cls.__name__, SinkSite(path, kind), 1)
    assert site.sink.tensor(module) is module.get_parameter(path) if kind == "parameter" else True
    assert site.sink.owner(module) is (module.extra if isinstance(module, NestedOwner) else module)
    assert site.sink.attr == path.rpartition(".")[2]


@pytest.mark.parametrize("cls, message", [(ComputedSink, "s_aux is the result of call_function"),
                                          (PlainTensorSink, "not a parameter or buffer")])
def test_a_sink_vllm_cannot_hold_is_reported(cls, message):
    site = SinkFuser().find(cls())
    assert site.sink is None and site.interface_calls == 1
    assert message in site.problem
    with pytest.raises(SinkFuserError, match=cls.__name__):
        site.require_sink()


def test_the_cache_is_guarded_by_the_state_the_trace_read():
    fuser = SinkFuser()
    modules = [FlaggedSink(use_sink=flag) for flag in (False, True, True, False)]
    answers = [fuser.find(m).sink for m in modules]
    assert answers == [None, SinkSite("sinks", "parameter"), SinkSite("sinks", "parameter"), None]
    assert fuser.traces == 2  # one trace per distinct `use_sink`, the rest from the cache


def test_a_cached_answer_is_the_answer_a_trace_gives():
    fuser = SinkFuser()
    assert [fuser.find(NeverCalls()) for _ in range(3)] == [None] * 3
    assert fuser.traces == 1


def test_a_trace_that_stops_before_the_interface_says_so():
    site = SinkFuser().find(BranchesOnValues())
    assert site.sink is None and site.interface_calls == 0
    assert "tracing its forward failed before the attention-interface call" in site.problem


def test_modules_that_never_reach_the_interface_are_not_traced():
    fuser = SinkFuser()
    assert fuser.find(NoInterface()) is None
    assert fuser.find(nn.Linear(2, 2)) is None
    assert fuser.traces == 0


def test_deprecate_kwarg_wrapped_forward_is_traced_unwrapped():
    from transformers.utils.deprecation import deprecate_kwarg

    class Renamed(NestedOwner):
        @deprecate_kwarg("past_key_values", "99.0.0", new_name="cache")
        def forward(self, hidden_states, attention_mask=None, cache=None, **kwargs):
            return super().forward(hidden_states, attention_mask, None, **kwargs)

    module = Renamed()
    with pytest.raises(Exception):  # what stock fx makes of the wrapper's (*args, **kwargs)
        fx.symbolic_trace(module)
    assert SinkFuser().find(module).sink == SinkSite("extra.per_head_logit", "parameter")


@pytest.mark.parametrize("cls", [ConstantInForward, BranchesOnValues])
def test_tracing_leaves_the_module_and_the_process_as_they_were(cls):
    module = cls()
    process = (nn.Module.__call__, nn.Module.__getattr__, ALL_ATTENTION_FUNCTIONS, _LOCAL_INTERFACES,
               AttentionInterface.get_interface, AttentionInterface.__getitem__)
    before = (type(module), dict(vars(module)), dict(module.named_parameters()), module.forward.__func__)
    SinkFuser().find(module)  # succeeds for one, stops before the interface call for the other
    assert (type(module), dict(vars(module)), dict(module.named_parameters()), module.forward.__func__) == before
    assert (nn.Module.__call__, nn.Module.__getattr__, globals()["ALL_ATTENTION_FUNCTIONS"], _LOCAL_INTERFACES,
            AttentionInterface.get_interface, AttentionInterface.__getitem__) == process
    out, _ = module(torch.randn(1, 5, 32))  # still runs for real
    assert out.shape == (1, 5, 32) and math.isfinite(out.sum().item())


# ---- what transformers releases wrap around what forward calls ---------------------------------------
# Hub kernels (transformers >= 5.20 with a `kernels` in its range) make functions `Func` modules held
# at module level and in the attention module's `__dict__["_kernel_funcs"]`, outside the module tree;
# `use_kernelized_func` (kernels >= 0.18) also wraps `forward` with functools.wraps.


class _Rotate(nn.Module):
    """A module held outside every model's tree, as a hub-kernel ``Func`` is."""

    def forward(self, q, k):
        return q.flip(-1), k.flip(-1)


ROTATE = _Rotate()  # module level, as `apply_rotary_pos_emb` is under hub kernels


def _rotate_function(q, k):
    return q.flip(-1), k.flip(-1)


class _Rotating(NestedOwner):
    def rotate(self, q, k):
        raise NotImplementedError

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        q = self.q_proj(hidden_states).view(*hidden_states.shape[:-1], -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(*hidden_states.shape[:-1], -1, self.head_dim).transpose(1, 2)
        q, k = self.rotate(q, k)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
        out, _ = interface(self, q, k, k, attention_mask, s_aux=self.s_aux())
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), None


class ModuleLevelFunc(_Rotating):
    def rotate(self, q, k):
        return ROTATE(q, k)


class KernelFuncsDict(_Rotating):
    def __init__(self):
        super().__init__()
        self.__dict__.setdefault("_kernel_funcs", {})["rotate"] = _Rotate()  # not a submodule

    def rotate(self, q, k):
        return self._kernel_funcs["rotate"](q, k)


class CallableAttribute(_Rotating):
    def __init__(self):
        super().__init__()
        self.rotate_fn = _rotate_function  # a plain function held in an attribute

    def rotate(self, q, k):
        return self.rotate_fn(q, k)


class UnregisteredModuleAttribute(_Rotating):
    def __init__(self):
        super().__init__()
        object.__setattr__(self, "rotary", _Rotate())  # in __dict__, not in _modules

    def rotate(self, q, k):
        return self.rotary(q, k)


def _context_wrapped(forward):
    """What kernels' ``use_kernelized_func`` makes of ``forward``: a functools.wraps wrapper."""

    @functools.wraps(forward)
    def new_forward(self, *args, **kwargs):
        return forward(self, *args, **kwargs)

    return new_forward


class WrapsWrapped(ModuleLevelFunc):
    forward = _context_wrapped(ModuleLevelFunc.forward)


class DeprecateKwargAndWraps(KernelFuncsDict):
    from transformers.utils.deprecation import deprecate_kwarg

    @_context_wrapped
    @deprecate_kwarg("past_key_values", "99.0.0", new_name="cache")
    def forward(self, hidden_states, attention_mask=None, cache=None, **kwargs):
        return super().forward(hidden_states, attention_mask, **kwargs)


WRAPPER_KINDS = [ModuleLevelFunc, KernelFuncsDict, CallableAttribute, UnregisteredModuleAttribute, WrapsWrapped,
                 DeprecateKwargAndWraps]


@pytest.mark.parametrize("cls", WRAPPER_KINDS)
def test_the_sink_is_found_through_what_forward_calls(cls):
    module = cls()
    site = SinkFuser().find(module)
    assert site == AttentionSite(cls.__name__, SinkSite("extra.per_head_logit", "parameter"), 1), site
    out, _ = module(torch.randn(1, 5, 32))  # the module itself is untouched and still runs
    assert out.shape == (1, 5, 32)


def test_a_call_outside_the_tree_is_one_valued_leaf():
    graph = SinkFuser().trace(ModuleLevelFunc())
    [leaf] = [n for n in graph.nodes if getattr(n.target, "__wrapped__", None) is ROTATE]
    assert leaf.op == "call_function" and [a.op for a in leaf.args] == ["call_method", "call_method"]
    assert leaf.meta["val"][0].shape == (1, 4, 16, 8)  # run on meta: what follows still has shapes
    assert vars(sys.modules[__name__])["ROTATE"] is ROTATE  # the SinkFuser swaps no global


def test_foreign_modules_are_traced_through_only_while_tracing():
    from vllm_sinks.model_executor.models.transformers.fx_utils import (
        forward_functions,
        foreign_modules_traced_through,
    )

    class CallsRotate(nn.Module):
        def forward(self, q, k):
            return ROTATE(q, k)

    module = CallsRotate()
    with pytest.raises(NameError, match="not installed as a submodule"):
        fx.symbolic_trace(module)  # what stock fx (and vLLM's trace) makes of a hub-kernel call
    with foreign_modules_traced_through(module, forward_functions(type(module))) as swapped:
        graph = fx.symbolic_trace(module).graph
    assert swapped >= 1 and any(n.op == "output" for n in graph.nodes)
    assert "flip" in {n.target for n in graph.nodes}  # traced through: its ops are in the graph
    assert vars(sys.modules[__name__])["ROTATE"] is ROTATE


try:  # the real `kernels` package, at whatever release this venv holds
    import kernels
except ImportError:
    kernels = None

if kernels is not None:
    HUB_ROTATE = kernels.use_kernel_forward_from_hub("vllm_sinks_test_rotate")(_rotate_function)

    @kernels.use_kernelized_func(HUB_ROTATE)
    class HubKernelised(_Rotating):
        def rotate(self, q, k):
            return HUB_ROTATE(q, k)


def test_kernels_decorators_are_read_through():
    if kernels is None:
        pytest.skip("the `kernels` package is not installed (transformers' hub kernels cannot be active)")
    assert isinstance(HUB_ROTATE, nn.Module)  # what transformers' modeling files hold under hub kernels
    module = HubKernelised()
    assert "_kernel_funcs" in vars(module) and not dict(module.named_children()).keys() & {"HUB_ROTATE"}
    site = SinkFuser().find(module)
    assert site == AttentionSite("HubKernelised", SinkSite("extra.per_head_logit", "parameter"), 1), site


@pytest.mark.parametrize("family", [f for f in ("gpt_oss", "granite_swa") if f in FAMILIES])
def test_families_under_active_hub_kernels(family):
    from vllm_sinks import hub_kernels

    found = hub_kernels.detect()
    if not found.active:
        pytest.skip(f"hub kernels inactive here ({hub_kernels.stack_line(found.transformers, found.kernels, found.active)})")
    model = _tiny_model(family)
    attn = next(m for m in model.modules() if "_kernel_funcs" in vars(m))
    assert any(isinstance(f, nn.Module) for f in attn._kernel_funcs.values())
    site = SinkFuser().find(attn)
    assert site.problem is None and site.sink == SinkSite("sinks", "parameter"), site
