"""Mirrors ``vllm.v1.attention.ops``: attention ops that import without vLLM."""
