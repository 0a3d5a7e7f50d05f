"""Our fork of the logits part of upstream's ``vllm/model_executor/models/transformers/causal.py``.

What upstream gets wrong (0.27 … 0.33): ``CausalMixin.__init__`` builds the ``LogitsProcessor`` with
``scale=config.logit_scale`` only. Granite-family configs (Granite, Granite SWA, Granite MoE (SWA),
…) carry ``logits_scaling`` instead, which their HF ``ForCausalLM`` applies as ``logits /
logits_scaling`` after ``lm_head``. The backend runs only the HF base model plus its own
``lm_head``, so the division is lost: every logit is ``logits_scaling`` times too large (granite-swash-2b:
mean |Δ prompt logprob| 6.89 vs HF with the sinks fixed, 0.0165 with this). Native vLLM's Granite
models apply it (``LogitsProcessor(scale=1 / logits_scaling)``).

:func:`causal_init` runs upstream's ``__init__`` and then folds ``1 / logits_scaling`` into the
processor's ``scale`` (which the processor multiplies the logits by, before any soft cap — HF's
Granite has none, so the order is HF's).
"""

from __future__ import annotations

import logging
import numbers
from typing import Any

from torch import nn

from vllm_sinks.patches import install

logger = logging.getLogger("vllm_sinks")

#: The config attribute HF's Granite-family causal LMs divide their logits by.
ATTR = "logits_scaling"


def logits_divisor(config: Any) -> float | None:
    """``config.logits_scaling`` where it is a number other than 1, else None."""
    value = getattr(config, ATTR, None)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value == 1:
        return None
    if value == 0:
        raise ValueError(f"{type(config).__name__}.{ATTR} is 0: the logits cannot be divided by it")
    return float(value)


def apply_logits_scaling(model: nn.Module) -> float | None:
    """Fold ``1 / logits_scaling`` into ``model.logits_processor.scale``; return the divisor applied."""
    processor = getattr(model, "logits_processor", None)
    divisor = logits_divisor(getattr(model, "text_config", None))
    if processor is None or divisor is None:  # not the last pipeline rank, or nothing to apply
        return None
    scale = getattr(processor, "scale", None)
    if not isinstance(scale, numbers.Real):
        raise RuntimeError(f"vllm-sinks: {type(processor).__name__} has no numeric `scale` to fold "
                           f"{ATTR} into (upstream drift: report to vllm-sinks)")
    processor.scale = scale / divisor
    logger.info("vllm-sinks: logits divided by %s=%g (HF applies it after lm_head)", ATTR, divisor)
    return divisor


def causal_init(self, *, vllm_config: Any, prefix: str = "") -> None:
    """Replacement of ``CausalMixin.__init__``: upstream's, then ``logits_scaling`` applied.

    Same signature as upstream's: vLLM reads the model class's ``__init__`` parameters to decide
    how to construct it (``vllm_config=`` or the legacy positional form).
    """
    install.original(causal_init)(self, vllm_config=vllm_config, prefix=prefix)
    apply_logits_scaling(self)
