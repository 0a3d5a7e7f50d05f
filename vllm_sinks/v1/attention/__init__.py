"""Mirrors ``vllm.v1.attention``."""
