"""Hooks of the ``transformers-kv-heads`` patch (glue only; the logic is in
``vllm_sinks.model_executor.models.transformers.base``, section "per-layer KV heads").

Targets (upstream module ``vllm.model_executor.models.transformers.base``): ``Base.recursive_replace``
and the method that builds the attention layers, ``Base.create_attention_instances`` (0.27-0.29) or
``Base._create_attention_instances`` (0.30+).

Probe, by feature: the attention-building method still takes each layer's KV heads from the
model-wide config (it calls ``get_num_kv_heads``) and constructs ``Attention`` by that module-level
name (which we rebind for the call): apply. A method that sizes KV heads some other way: stand down.
A method with neither name, or no ``Attention`` in the module: drift.
"""

from __future__ import annotations

import inspect

from vllm_sinks.patches import install
from vllm_sinks.patches.registry import Drift, Probe, VllmInfo, import_upstream

PATCH = "transformers-kv-heads"
BUILDERS = ("_create_attention_instances", "create_attention_instances")


def _upstream():
    return import_upstream("vllm.model_executor.models.transformers.base")


def _names(fn) -> set[str]:
    code = install.upstream(fn).__code__
    return set(code.co_names)


def _builder(base) -> str:
    for name in BUILDERS:
        if callable(base.Base.__dict__.get(name)):
            return name
    raise Drift(f"Base has none of {', '.join(BUILDERS)}")


def _check(base) -> tuple[str, bool]:
    """(builder method name, whether it sizes KV heads from the model-wide config)."""
    builder = _builder(base)
    fn = base.Base.__dict__[builder]
    params = list(inspect.signature(install.upstream(fn)).parameters)
    if params[:1] != ["self"]:
        raise Drift(f"Base.{builder}{tuple(params)}: expected (self, ...)")
    replace = base.Base.__dict__.get("recursive_replace")
    if replace is None or list(inspect.signature(install.upstream(replace)).parameters) != ["self"]:
        raise Drift("Base.recursive_replace(self) not found")
    names = _names(fn)
    chooser = base.Base.__dict__.get("_get_attn_cls")
    if chooser is not None and "_get_attn_cls" in names:
        names |= _names(chooser)
    if "Attention" not in names or "Attention" not in vars(base):
        raise Drift(f"Base.{builder} no longer constructs `Attention` by that name")
    return builder, "get_num_kv_heads" in names


def probe(info: VllmInfo) -> Probe:
    _, model_wide = _check(_upstream())
    if not model_wide:
        return Probe(False, "upstream no longer sizes every layer's KV heads from the model-wide config")
    return Probe(True, "upstream sizes every layer's KV heads from the model-wide config "
                       "(MiMo-V2-Flash's sliding layers have twice as many)")


def apply(info: VllmInfo) -> str:
    from vllm_sinks.model_executor.models.transformers import base as ours

    base = _upstream()
    builder, _ = _check(base)
    install.install(base.Base, "recursive_replace", ours.kv_recursive_replace, PATCH)
    install.install(base.Base, builder, ours.kv_create_attention_instances, PATCH)
    return f"each layer's KV heads read from its HF module ({builder}); KV heads replicated where TP > heads"
