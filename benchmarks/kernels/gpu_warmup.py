"""Bring the GPU's clocks up before the first timed case: they idle low (345 MHz on the H200)
between compiles, and the first case would otherwise be timed at a low clock. The tune's own
(``vllm-sinks tune`` warms the GPU the same way)."""

from __future__ import annotations

from vllm_sinks.v1.attention.ops.tune_full_attention import warm_gpu

__all__ = ["warm_gpu"]
