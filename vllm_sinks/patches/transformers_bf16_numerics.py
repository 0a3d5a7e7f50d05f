"""Hooks of the ``transformers-bf16-numerics`` patch (glue only; the logic is in
``vllm_sinks.model_executor.models.transformers.bf16_numerics``).

Target (upstream module ``vllm.model_executor.models.transformers.base``): ``Base.recursive_replace``,
wrapped so that each model, once upstream has put vLLM's layers in, gets GPT-OSS's bf16 numerics
where it is GPT-OSS-like and bf16/fp16 (decided per model at load; one log line per model).

Probe, by feature: ``Base.recursive_replace(self)`` exists and vLLM's ``RMSNorm`` takes a
``residual`` (the fused add + norm the layers are rebuilt on): apply. Either missing: drift.
No upstream release computes these in fp32 on the backend, so there is nothing to stand down for.
"""

from __future__ import annotations

import inspect

from vllm_sinks.patches import install
from vllm_sinks.patches.registry import Drift, Probe, VllmInfo, import_upstream

PATCH = "transformers-bf16-numerics"


def _upstream():
    base = import_upstream("vllm.model_executor.models.transformers.base")
    replace = base.Base.__dict__.get("recursive_replace")
    if replace is None or list(inspect.signature(install.upstream(replace)).parameters) != ["self"]:
        raise Drift("Base.recursive_replace(self) not found")
    layernorm = import_upstream("vllm.model_executor.layers.layernorm")
    norm = getattr(layernorm, "RMSNorm", None)
    if norm is None or "residual" not in inspect.signature(norm.forward_native).parameters:
        raise Drift("vLLM's RMSNorm has no fused add + norm (forward_native(x, residual))")
    return base


def probe(info: VllmInfo) -> Probe:
    _upstream()
    return Probe(True, "the backend runs HF GPT-OSS's rotary and residual adds in "
                       "the model dtype (native vLLM: fp32, rounded once)")


def apply(info: VllmInfo) -> str:
    from vllm_sinks.model_executor.models.transformers import bf16_numerics as ours

    base = _upstream()
    install.install(base.Base, "recursive_replace", ours.numerics_recursive_replace, PATCH)
    return ("per model at load, GPT-OSS-like in bf16/fp16 run eager: rotary in fp32, "
            "residual adds through vLLM's fused add + RMSNorm (under Inductor: left to the compiler)")
