"""Our forks of upstream `vllm.model_executor` modules (mirrors its layout; imports without vLLM)."""
