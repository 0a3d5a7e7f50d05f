"""Graph analyses of Hugging Face modules for the Transformers backend (torch + transformers only)."""

from vllm_sinks.model_executor.models.transformers.fusers.sink import (
    AttentionSite,
    SinkFuser,
    SinkFuserError,
    SinkSite,
)

__all__ = ["AttentionSite", "SinkFuser", "SinkFuserError", "SinkSite"]
