"""Our forks of upstream `vllm.model_executor.models.transformers` (the Transformers modeling backend).

`fusers.sink` imports without vLLM (torch + transformers only); `base` imports vLLM lazily.
"""
