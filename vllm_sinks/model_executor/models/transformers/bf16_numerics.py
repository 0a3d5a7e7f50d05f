"""GPT-OSS's bf16/fp16 numerics on the Transformers backend, made as native vLLM makes them
(patch ``transformers-bf16-numerics``; the glue that installs it is
``vllm_sinks.patches.transformers_bf16_numerics``).

The backend runs Hugging Face's GPT-OSS modeling code in the model dtype. Two places round where
native vLLM (``vllm/model_executor/models/gpt_oss.py``) does not (docs/bf16-numerics.md):

1. **rotary**: HF multiplies and adds q/k with cos/sin in bf16 (three roundings); native vLLM's
   rotary takes the same bf16-rounded cos/sin but computes in fp32 and rounds q/k once.
2. **residual adds**: HF rounds ``residual + sublayer`` to bf16 and normalises the rounded sum;
   native vLLM's fused add + RMSNorm (``RMSNorm.forward(x, residual)``) normalises the exact sum
   and keeps it, rounded once, as the residual for the next add: inside a layer (attention ->
   ``post_attention_layernorm``) and across layers (MLP -> next ``input_layernorm``, last layer ->
   final ``norm``).

Per model instance at load (after upstream's ``recursive_replace``, so the norms are vLLM's):

* the rotary embedding module hands out cos/sin still rounded to the model dtype, but held in
  fp32, so HF's ``apply_rotary_pos_emb`` computes in fp32; a wrapper around that module-level
  function (looked up at call time, also by upstream's fused attention forwards, which are compiled
  in the modeling module's globals) rounds q/k to their dtype once. It rounds only when cos/sin and
  q differ in dtype, so it changes nothing for any other model of that modeling module;
* each decoder layer runs :func:`fused_residual_forward` (the same sublayer calls as HF's, with the
  adds done by the fused norms), and hands ``(sublayer output, residual)`` to the next layer or the
  final norm where that one is patched too (pipeline parallel: a layer before a ``PPMissingLayer``
  returns the plain sum).

Only for "GPT-OSS-like" models, decided by structure (:func:`gpt_oss_like`), in bf16 or fp16; an fp32
model is left as it is. Only where the backend runs eager (``enforce_eager``, compilation mode
``NONE``, or a compile backend other than Inductor), unless the patch is forced ``on``: Inductor
fuses the rotary's pointwise chain and the residual add with the norm into kernels that compute in
fp32 and round once at the store (it does not emulate the intermediate bf16 roundings), which is
this patch's math already; measured on vLLM 0.27.1 compiled, seed 0: patched 0.0459, as is 0.0437,
native 0.0571 (mean |Δ prompt logprob| vs HF fp32). There the patch would only add the casts' kernels. The router needs nothing (see "no router part" below). The experts stay
HF's own, in the model dtype (the backend never fuses them; upcasting them measured within noise at
a full weight upcast per call).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import sys
import types
from typing import Any, Callable, Iterable

import torch
from torch import fx, nn

from vllm_sinks.model_executor.models.transformers.fx_utils import through
from vllm_sinks.patches import install

logger = logging.getLogger("vllm_sinks")

PATCH = "transformers-bf16-numerics"

#: The dtypes the patch acts on (fp32 is already what native vLLM computes in).
LOW_PRECISION = (torch.bfloat16, torch.float16)

#: HF's name for the function that rotates q and k (module-level in every modeling file).
ROTARY_FN = "apply_rotary_pos_emb"

#: What a GPT-OSS decoder layer's forward reads (HF: ``residual = hidden_states`` ... ``residual +``).
LAYER_NAMES = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")

#: Attribute our patched layers keep: hand ``(output, residual)`` on instead of their sum.
PASS_PAIR_ATTR = "_vllm_sinks_pass_pair"


# ---- structure checks -----------------------------------------------------------------------------


def forward_code(module: nn.Module) -> types.CodeType | None:
    """The code of the function ``module`` runs: its instance forward where one is set (upstream's
    fusers compile a rewritten forward per instance), through ``functools.wraps`` wrappers
    (transformers 5.24's ``@deprecate_kwarg``)."""
    fn = module.__dict__.get("forward") or type(module).forward
    fn = inspect.unwrap(getattr(fn, "__func__", fn))
    return getattr(fn, "__code__", None)


def _forward_globals(module: nn.Module) -> dict | None:
    fn = module.__dict__.get("forward") or type(module).forward
    fn = inspect.unwrap(getattr(fn, "__func__", fn))
    return getattr(fn, "__globals__", None)


def is_missing(module: Any) -> bool:
    """A pipeline-parallel placeholder (vLLM's ``PPMissingLayer``) or no module at all."""
    if module is None:
        return True
    try:
        from vllm.model_executor.models.utils import PPMissingLayer
    except ImportError:  # no vLLM (unit tests): nothing is missing
        return False
    return isinstance(module, PPMissingLayer)


def is_topk_router(module: Any) -> bool:
    """HF's GPT-OSS router shape: a module whose forward takes the top-k of its logits and softmaxes
    them (``GptOssTopKRouter``: returns logits, top-k scores, top-k indices)."""
    code = forward_code(module) if isinstance(module, nn.Module) else None
    return code is not None and {"topk", "softmax"} <= set(code.co_names)


def rotates_by_global(attn: nn.Module) -> bool:
    """The attention forward calls the modeling module's ``apply_rotary_pos_emb`` by name."""
    code, namespace = forward_code(attn), _forward_globals(attn)
    return (code is not None and namespace is not None and ROTARY_FN in code.co_names
            and callable(namespace.get(ROTARY_FN)))


def is_gpt_oss_layer(layer: nn.Module) -> bool:
    """HF's GPT-OSS decoder layer shape: pre-norm attention and MLP with residual adds, the MLP a
    top-k router, the attention rotating q/k through ``apply_rotary_pos_emb``."""
    code = forward_code(layer)
    if code is None or not set(LAYER_NAMES) <= set(code.co_names) or "residual" not in code.co_varnames:
        return False
    if not all(isinstance(getattr(layer, name, None), nn.Module) for name in LAYER_NAMES):
        return False
    return is_topk_router(getattr(layer.mlp, "router", None)) and rotates_by_global(layer.self_attn)


@dataclasses.dataclass
class Stack:
    """The decoder stack of a model: the module holding ``layers`` (an ``nn.ModuleList``), its final
    ``norm`` and ``rotary_emb`` (either may be missing)."""

    owner: nn.Module
    layers: nn.ModuleList
    norm: nn.Module | None
    rotary: nn.Module | None

    def real_layers(self) -> list[tuple[int, nn.Module]]:
        return [(i, layer) for i, layer in enumerate(self.layers) if not is_missing(layer)]


def find_stack(model: nn.Module) -> Stack | None:
    """The first module (in ``named_modules`` order) with a ``layers`` ModuleList."""
    for _, module in model.named_modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers):
            norm, rotary = getattr(module, "norm", None), getattr(module, "rotary_emb", None)
            return Stack(module, layers, None if is_missing(norm) else norm,
                         None if is_missing(rotary) else rotary)
    return None


def gpt_oss_like(model: nn.Module) -> Stack | None:
    """The model's decoder stack where every layer on this rank has GPT-OSS's structure, else None."""
    stack = find_stack(model)
    if stack is None or not stack.real_layers():
        return None
    if not all(is_gpt_oss_layer(layer) for _, layer in stack.real_layers()):
        return None
    return stack


# ---- 1. rotary: fp32 math on the model-dtype cos/sin, one rounding -------------------------------


def rotary_fp32_forward(self: nn.Module, x: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs):
    """The rotary module's own forward, its cos/sin (rounded to ``x``'s dtype, as native vLLM's
    cos/sin cache is) handed out in fp32, so the products and sums with q/k are fp32."""
    cos, sin = type(self).forward(self, x, position_ids, *args, **kwargs)
    return cos.float(), sin.float()


def round_rotary_once(fn: Callable) -> Callable:
    """``apply_rotary_pos_emb`` that returns q/k in their own dtype where cos/sin came in another
    (ours: fp32): the fp32 result rounded once. Same cos/sin dtype as q (any other model): as is."""

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        # With hub kernels ``fn`` is a kernels ``Func`` module outside every model's tree, which fx
        # cannot record: traced, its forward is traced through instead.
        traced_module = isinstance(q, fx.Proxy) and isinstance(fn, nn.Module)
        q_embed, k_embed = (through(fn) if traced_module else fn)(q, k, cos, sin, *args, **kwargs)
        # Under torch.fx (the backend's fusers, the SinkFuser among them, trace each attention
        # forward to read its graph, which is never run) a dtype comparison is a Proxy that cannot
        # be branched on: the trace would stop here, before the attention call, and the sink would
        # go unfound. This wrapper stays in the modeling module once a first model installed it, so
        # every later GPT-OSS model of the process is traced through it: HF's call stands for it.
        if isinstance(q, fx.Proxy) or cos.dtype == q.dtype:
            return q_embed, k_embed
        return q_embed.to(q.dtype), k_embed.to(k.dtype)

    apply_rotary_pos_emb.__wrapped__ = fn
    apply_rotary_pos_emb.__doc__ = fn.__doc__
    return apply_rotary_pos_emb


def patch_rotary(stack: Stack) -> int:
    """Rotary in fp32 for this model; returns how many attention modules now rotate that way."""
    if stack.rotary is None:
        return 0
    namespaces = {id(ns): ns for _, layer in stack.real_layers()
                  if (ns := _forward_globals(layer.self_attn)) is not None}
    for namespace in namespaces.values():
        module = sys.modules.get(namespace.get("__name__", ""))
        if module is None or module.__dict__ is not namespace:
            raise RuntimeError(f"vllm-sinks: {PATCH}: the attention forward's globals are not a module's")
        install.install(module, ROTARY_FN, round_rotary_once(getattr(module, ROTARY_FN)), PATCH)
    stack.rotary.forward = types.MethodType(rotary_fp32_forward, stack.rotary)
    return len(stack.real_layers())


# ---- (no router part) -----------------------------------------------------------------------------
#
# HF's router softmaxes its bf16 top-k logits with ``softmax(..., dtype=bf16)``; torch computes that
# in fp32 and rounds once (CPU and CUDA kernels accumulate bf16 in fp32), which is what native
# vLLM's fp32 top-k softmax gives on the same bf16 logits: 0 of 2M scores differ at top-2, 8 of 4M
# at top-4 (tests/unit/test_bf16_numerics.py keeps checking it). Nothing to patch there.


# ---- 2. residual adds through vLLM's fused add + RMSNorm -----------------------------------------


def is_vllm_rms_norm(module: Any) -> bool:
    """vLLM's ``RMSNorm`` (what upstream puts in place of HF's): ``norm(x, residual)`` is the fused
    add + norm, returning (normed, x + residual rounded once)."""
    try:
        from vllm.model_executor.layers.layernorm import RMSNorm
    except ImportError:
        return False
    return isinstance(module, RMSNorm)


def _first(out: Any) -> torch.Tensor:
    """HF's sublayers return (output, extra): attention weights, router scores."""
    return out[0] if isinstance(out, tuple) else out


def fused_residual_forward(self: nn.Module, hidden_states, *args, **kwargs):
    """A GPT-OSS decoder layer (HF's sublayer calls, in HF's order) whose residual adds are vLLM's
    fused add + RMSNorm: the norms see the exact sum, the residual stream is the sum rounded once.

    ``hidden_states`` is a tensor (the residual stream) or, from a patched layer before this one,
    ``(sublayer output, residual)``, added by this layer's input norm. Returns the pair where the
    next consumer is patched (``PASS_PAIR_ATTR``) and no forward hook (HF's output capturing) would
    read this layer's output, else the plain sum. Everything else the layer is called with goes to
    the attention as HF's layer passes it (keywords)."""
    if args:
        raise TypeError(f"vllm-sinks: {PATCH}: {type(self).__name__} called with positional arguments "
                        "after hidden_states; HF's GPT-OSS model passes keywords")
    if isinstance(hidden_states, tuple):
        x, residual = hidden_states
        hidden, residual = self.input_layernorm(x, residual)
    else:
        residual = hidden_states
        hidden = self.input_layernorm(hidden_states)
    hidden = _first(self.self_attn(hidden_states=hidden, **kwargs))
    hidden, residual = self.post_attention_layernorm(hidden, residual)
    hidden = _first(self.mlp(hidden))
    if getattr(self, PASS_PAIR_ATTR, False) and not self._forward_hooks:
        return hidden, residual
    return residual + hidden


def pair_norm_forward(self: nn.Module, x, residual: torch.Tensor | None = None):
    """The final norm taking the last layer's ``(output, residual)``: the fused add + norm, normed
    output only (HF's model returns that)."""
    if isinstance(x, tuple):
        return type(self).forward(self, *x)[0]
    return type(self).forward(self, x) if residual is None else type(self).forward(self, x, residual)


def patch_residual_adds(stack: Stack, is_fused_norm: Callable[[Any], bool] = is_vllm_rms_norm) -> tuple[int, bool]:
    """Fused residual adds in every layer whose two norms are fused norms; pairs passed on between
    patched neighbours. Returns (layers patched, whether the final norm takes the pair)."""
    patched = {i for i, layer in stack.real_layers()
               if is_fused_norm(layer.input_layernorm) and is_fused_norm(layer.post_attention_layernorm)}
    final = stack.norm is not None and is_fused_norm(stack.norm)
    n = len(stack.layers)
    for i in sorted(patched):
        layer = stack.layers[i]
        setattr(layer, PASS_PAIR_ATTR, (i + 1 in patched) if i + 1 < n else final)
        layer.forward = types.MethodType(fused_residual_forward, layer)
    passes_to_norm = final and (n - 1) in patched
    if passes_to_norm:
        stack.norm.forward = types.MethodType(pair_norm_forward, stack.norm)
    return len(patched), passes_to_norm


# ---- per model ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Applied:
    """What the patch did to one model (the report line)."""

    model: str
    dtype: torch.dtype
    gpt_oss_like: bool
    compiled: str = ""  # why the backend's math is fp32 already (auto mode stands down), or ""
    rotary: int = 0
    fused_layers: int = 0
    layers: int = 0
    final_norm: bool = False

    def line(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        if not self.gpt_oss_like:
            return f"{PATCH}: {self.model} ({dtype}): not GPT-OSS-like, left alone"
        if self.dtype not in LOW_PRECISION:
            return f"{PATCH}: {self.model} ({dtype}): nothing to do (fp32 is native vLLM's math already)"
        if self.compiled:
            return (f"{PATCH}: {self.model} ({dtype}): left to the compiler ({self.compiled}: Inductor "
                    "computes the rotary and the residual add + norm in fp32, rounded once; "
                    f"VLLM_SINKS_TRANSFORMERS_BF16_NUMERICS=on patches it anyway)")
        fused = f"fused add + RMSNorm in {self.fused_layers}/{self.layers} layers"
        if self.fused_layers:
            fused += ", carried into the final norm" if self.final_norm else ", final norm unfused"
        return f"{PATCH}: {self.model} ({dtype}): rotary in fp32 for {self.rotary} attention modules, {fused}"


def apply_to_model(model: nn.Module, dtype: torch.dtype, name: str, *, compiled: str = "",
                   is_fused_norm: Callable[[Any], bool] = is_vllm_rms_norm) -> Applied:
    """Make ``model``'s bf16/fp16 numerics native vLLM's, where it is GPT-OSS-like (see module doc).
    ``compiled``: why the backend's forward is compiled by Inductor (nothing is changed then), or ""."""
    stack = gpt_oss_like(model)
    if stack is None:
        return Applied(name, dtype, False)
    if dtype not in LOW_PRECISION:
        return Applied(name, dtype, True)
    if compiled:
        return Applied(name, dtype, True, compiled)
    rotary = patch_rotary(stack)
    fused, final = patch_residual_adds(stack, is_fused_norm)
    return Applied(name, dtype, True, "", rotary, fused, len(stack.real_layers()), final)


def inductor_compiled(compilation_config: Any) -> str:
    """Why vLLM compiles the model's forward with Inductor under ``compilation_config`` (e.g.
    "VLLM_COMPILE"), or "" where it runs eager: mode ``NONE`` (``enforce_eager``), or a backend other
    than Inductor (``"eager"`` runs the ops as they are)."""
    mode = getattr(compilation_config, "mode", None)
    if mode is None or getattr(mode, "value", mode) == 0:  # CompilationMode.NONE
        return ""
    backend = getattr(compilation_config, "backend", "") or "inductor"
    if backend != "inductor":
        return ""
    return str(getattr(mode, "name", mode))


def _forced_on() -> bool:
    from vllm_sinks.patches import PATCHES
    from vllm_sinks.patches.registry import Mode

    return next(p for p in PATCHES if p.name == PATCH).mode() is Mode.ON


def _compiled_here() -> str:
    """``inductor_compiled`` of the vLLM config being loaded ("" where it cannot be read: eager is
    the case the patch is for, and patching a compiled model is only the casts' cost)."""
    try:
        from vllm.config import get_current_vllm_config

        return inductor_compiled(get_current_vllm_config().compilation_config)
    except Exception:  # noqa: BLE001 - a vLLM without this config: treat as eager
        return ""


def model_name(self) -> str:
    config = getattr(self, "config", None)
    return (getattr(config, "architectures", None) or [type(self.model).__name__])[0]


def numerics_recursive_replace(self) -> Any:
    """Replacement of ``Base.recursive_replace``: upstream's (and the other patches') replacement,
    then this model's bf16 numerics (the norms are vLLM's by then). One log line per model."""
    result = install.original(numerics_recursive_replace)(self)
    compiled = "" if _forced_on() else _compiled_here()
    applied = apply_to_model(self.model, self.model_config.dtype, model_name(self), compiled=compiled)
    if applied.gpt_oss_like:
        logger.info("vllm-sinks: %s", applied.line())
    return result


def patched_modules(model: nn.Module) -> Iterable[str]:
    """Names of the modules of ``model`` that run one of this patch's forwards (for tests, reports)."""
    ours = {rotary_fp32_forward, fused_residual_forward, pair_norm_forward}
    for name, module in model.named_modules():
        fn = module.__dict__.get("forward")
        if getattr(fn, "__func__", None) in ours:
            yield name
