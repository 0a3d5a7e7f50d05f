"""Auto mode's per-module decision on vLLM >= 0.30 (``sink_owner``), and the remote-code tiny models
it is proved on. Needs torch + transformers only (no vLLM).

The upstream side is a stand-in here (``_Lookup``: an object with ``s_aux_expr`` and ``sinks``, as
upstream's ``AttentionFuser`` has); ``tests/vllm/test_transformers_sinks.py`` asks the real one.
"""

from __future__ import annotations

import ast

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch import nn  # noqa: E402

from vllm_sinks.model_executor.models.transformers import sink_owner  # noqa: E402
from vllm_sinks.model_executor.models.transformers.fusers.sink import (  # noqa: E402
    AttentionSite,
    SinkFuser,
    SinkSite,
)
from vllm_sinks.verify import remote_sink_model, tiny_models  # noqa: E402

SITE = AttentionSite("NestedSinkAttention", SinkSite("sink_holder.sinks", "parameter"), 1)
NO_SINK = AttentionSite("LlamaAttention", None, 1)
UNKNOWN = AttentionSite("Odd", None, 0, problem="trace stopped at a data-dependent branch")


# ---- decide / summary ----------------------------------------------------------------------------


def test_upstream_keeps_what_it_resolves_even_where_the_sinkfuser_would_too():
    verdict = sink_owner.decide(sink_owner.UpstreamLookup("self.sinks", True), None)
    assert (verdict.owner, verdict.has_sink) == (sink_owner.UPSTREAM, True)
    assert "`s_aux=self.sinks`" in verdict.reason


def test_a_sink_upstream_misses_goes_to_the_sinkfuser():
    verdict = sink_owner.decide(sink_owner.UpstreamLookup("self.sink_holder.sinks", False), SITE)
    assert (verdict.owner, verdict.has_sink) == (sink_owner.OURS, True)
    assert "`s_aux=self.sink_holder.sinks`" in verdict.reason and "`sink_holder.sinks`" in verdict.reason


def test_a_sink_upstream_refuses_goes_to_the_sinkfuser():
    lookup = sink_owner.UpstreamLookup("self.buf", False, "Cannot resolve attention s_aux expression")
    verdict = sink_owner.decide(lookup, SITE)
    assert verdict.owner == sink_owner.OURS and "refuses" in verdict.reason
    assert "Cannot resolve" in verdict.reason


@pytest.mark.parametrize("site", [None, NO_SINK, UNKNOWN])
def test_without_a_sinkfuser_sink_upstream_keeps_the_module(site):
    missed = sink_owner.decide(sink_owner.UpstreamLookup(None, False), site)
    assert (missed.owner, missed.has_sink) == (sink_owner.UPSTREAM, False)
    # Upstream's refusal stands (its error is what the user sees, as without vllm-sinks).
    refused = sink_owner.decide(sink_owner.UpstreamLookup("self.buf", False, "boom"), site)
    assert refused.owner == sink_owner.UPSTREAM and "boom" in refused.reason
    if site is UNKNOWN:
        assert UNKNOWN.problem in missed.reason


def test_summary_counts_layers_and_says_who_and_why():
    ours = sink_owner.decide(sink_owner.UpstreamLookup("sinks", False), SITE)
    theirs = sink_owner.decide(sink_owner.UpstreamLookup("self.sinks", True), None)
    line = sink_owner.summary("M", {"l.0.a": ("A", ours), "l.1.a": ("A", ours), "l.2.b": ("B", theirs)})
    assert line.startswith("transformers-sinks: M: sinks of 2 A layers served by vllm-sinks (SinkFuser): ")
    assert "; 1 B layer served by upstream: upstream's AST lookup resolved `s_aux=self.sinks`" in line
    none = sink_owner.decide(sink_owner.UpstreamLookup(None, False), None)
    assert sink_owner.summary("Llama", {"x": ("LlamaAttention", none)}) == (
        "transformers-sinks: Llama: no attention sinks; upstream's backend serves it unchanged")


# ---- upstream_lookup: what it reads off upstream's fuser -----------------------------------------


class _Lookup:
    """Stands in for upstream's ``AttentionFuser``: ``match`` -> self, ``sinks`` -> the canned answer."""

    def __init__(self, expr: str | None, answer):
        self.s_aux_expr = ast.parse(expr, mode="eval").body if expr else None
        self.answer = answer

    def match(self, graph, module):
        assert graph is None
        return None if self.answer == "no match" else self

    def sinks(self, module):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def test_upstream_lookup_reads_expression_answer_and_refusal():
    param = nn.Parameter(torch.zeros(2))
    module = nn.Linear(1, 1)
    assert sink_owner.upstream_lookup(_Lookup("self.sinks", param), module) == (
        sink_owner.UpstreamLookup("self.sinks", True))
    assert sink_owner.upstream_lookup(_Lookup("self.a.b", None), module) == (
        sink_owner.UpstreamLookup("self.a.b", False))
    assert sink_owner.upstream_lookup(_Lookup(None, None), module) == sink_owner.UpstreamLookup(None, False)
    assert sink_owner.upstream_lookup(_Lookup("x", ValueError("nope")), module) == (
        sink_owner.UpstreamLookup("x", False, "nope"))
    assert sink_owner.upstream_lookup(_Lookup("x", "no match"), module) is None
    with pytest.raises(TypeError):  # anything but upstream's refusal (ValueError) is not swallowed
        sink_owner.upstream_lookup(_Lookup("x", TypeError("bug")), module)


# ---- the remote-code models ------------------------------------------------------------------------


def _remote(style: str) -> nn.Module:
    config = remote_sink_model.SinkRemoteConfig(**tiny_models._COMMON, **dict(
        tiny_models._REMOTE, sink_style=style))
    torch.manual_seed(0)
    return remote_sink_model.SinkRemoteForCausalLM(config).eval()


@pytest.mark.parametrize("style, path", [("nested", "sink_holder.sinks"), ("alias", "sinks")])
def test_the_sinkfuser_finds_the_remote_models_sink(style, path):
    model = _remote(style)
    sites = SinkFuser().scan(model)
    assert sorted(sites) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    for name, site in sites.items():
        attn = model.get_submodule(name)
        assert site.problem is None and site.sink == SinkSite(path, "parameter")
        assert site.sink.tensor(attn) is attn.get_parameter(path)
        assert sink_owner.names_sink_keyword(attn)


def test_a_sink_computed_in_forward_is_refused_at_load_with_the_guards_message():
    from vllm_sinks.model_executor.models.transformers import base

    model = _remote("scaled")
    for name, site in SinkFuser().scan(model).items():
        attn = model.get_submodule(name)
        assert site.sink is None and "s_aux is the result of" in site.problem
        with pytest.raises(ValueError) as refused:
            base.refuse_unservable_sink(attn, site)
        assert str(refused.value) == base.missing_sink_error("ScaledSinkAttention", attn.layer_idx, site.problem)
    served = _remote("nested")
    for name, site in SinkFuser().scan(served).items():
        base.refuse_unservable_sink(served.get_submodule(name), site)  # a sink found: nothing to refuse
    never_names_it = nn.Linear(2, 2)  # a problem on a module that passes no s_aux is no refusal
    base.refuse_unservable_sink(never_names_it, UNKNOWN)


def test_a_forward_that_never_names_s_aux_is_screened_out():
    from transformers.models.llama.modeling_llama import LlamaAttention

    attn = LlamaAttention(transformers.LlamaConfig(hidden_size=64, num_attention_heads=2), 0)
    assert not sink_owner.names_sink_keyword(attn)


def test_the_remote_models_apply_their_sinks():
    """Dropping the sink (-inf) must move the eager logits; both styles compute the same thing."""
    ids = torch.arange(3, 30)[None]
    nested, alias = _remote("nested"), _remote("alias")
    with torch.no_grad():
        for n, a in zip(nested.model.layers, alias.model.layers):
            a.self_attn.sinks.copy_(torch.randn(4) * 2)
            n.self_attn.sink_holder.sinks.copy_(a.self_attn.sinks)
        out_n, out_a = nested(input_ids=ids).logits, alias(input_ids=ids).logits
        torch.testing.assert_close(out_n, out_a)
        for layer in alias.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))
        assert (alias(input_ids=ids).logits - out_a).abs().mean() > 1e-2


@pytest.mark.parametrize("family", tiny_models.REMOTE_CODE_MODELS)
def test_the_saved_checkpoint_loads_only_as_remote_code(family, tmp_path):
    folder = tiny_models.tiny_model(family, cache_dir=tmp_path)
    config = (folder / "config.json").read_text()
    assert (folder / tiny_models.REMOTE_MODELING_FILE).read_text() == (
        open(remote_sink_model.__file__).read())
    assert "auto_map" in config and '"AutoModel"' in config
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True).eval()
    assert type(hf).__module__.startswith("transformers_modules.")  # the checkpoint's file, not ours
    ours = tiny_models.model_class(family).from_pretrained(str(folder)).eval()
    ids = torch.arange(3, 20)[None]
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, ours(input_ids=ids).logits)
    assert len(tiny_models.sink_parameters(folder)) == 2
