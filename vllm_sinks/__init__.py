"""vllm-sinks: attention sinks applied correctly on every vLLM code path.

vLLM calls :func:`register` (entry point ``vllm.general_plugins``) in each of its processes.
"""

__version__ = "0.1.0"


def register():
    """vLLM plugin entry point: arm every patch on its upstream modules (applied when vLLM imports
    them), once per process.

    Returns the per-patch results (vLLM ignores them; tests and tools read them).
    """
    from vllm_sinks.patches.registry import register_all

    return register_all()
