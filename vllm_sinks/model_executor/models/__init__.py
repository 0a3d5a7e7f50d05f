"""Our forks of upstream `vllm.model_executor.models` modules (mirrors its layout; imports without vLLM)."""
