"""Hooks of the ``logits-scaling`` patch (glue only; the logic is in
``vllm_sinks.model_executor.models.transformers.causal``).

Target (upstream module ``vllm.model_executor.models.transformers.causal``): ``CausalMixin.__init__``.

Probe, by feature: upstream's ``CausalMixin.__init__`` builds a ``LogitsProcessor`` (whose ``scale``
we fold into) and never names ``logits_scaling``: apply. It names it: upstream applies it itself,
stand down. No ``LogitsProcessor`` built there, or one without a ``scale`` parameter: drift.
"""

from __future__ import annotations

import inspect

from vllm_sinks.patches import install
from vllm_sinks.patches.registry import Drift, Probe, VllmInfo

PATCH = "logits-scaling"


def _upstream():
    try:
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.model_executor.models.transformers.causal import CausalMixin
    except ImportError as e:
        raise Drift(f"cannot import vLLM's Transformers backend causal mixin: {e}") from e
    init = CausalMixin.__dict__.get("__init__")
    if init is None:
        raise Drift("CausalMixin.__init__ not found")
    code = install.upstream(init).__code__
    if "LogitsProcessor" not in code.co_names:
        raise Drift("CausalMixin.__init__ no longer builds a LogitsProcessor")
    params = list(inspect.signature(install.upstream(init)).parameters)
    if params != ["self", "vllm_config", "prefix"]:
        raise Drift(f"CausalMixin.__init__{tuple(params)}: expected (self, *, vllm_config, prefix)")
    if "scale" not in inspect.signature(LogitsProcessor.__init__).parameters:
        raise Drift("LogitsProcessor takes no `scale`")
    return CausalMixin, code


def probe(info: VllmInfo) -> Probe:
    from vllm_sinks.model_executor.models.transformers.causal import ATTR

    _, code = _upstream()
    if ATTR in code.co_consts or ATTR in code.co_names:
        return Probe(False, f"upstream's CausalMixin reads `{ATTR}` itself")
    return Probe(True, f"upstream's CausalMixin scales logits by `logit_scale` only, not `{ATTR}`")


def apply(info: VllmInfo) -> str:
    from vllm_sinks.model_executor.models.transformers import causal as ours

    mixin, _ = _upstream()
    install.install(mixin, "__init__", ours.causal_init, PATCH)
    return f"logits divided by `{ours.ATTR}` where a config has it (Granite family)"
