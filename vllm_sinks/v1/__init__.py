"""Mirrors ``vllm.v1``: our forks of vLLM v1 modules."""
