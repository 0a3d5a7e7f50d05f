"""vllm-sinks: attention sinks applied correctly on every vLLM code path.

vLLM calls :func:`register` (entry point ``vllm.general_plugins``) in each of its processes.
"""

from vllm_sinks.version import __version__

__all__ = ["__version__", "register"]


def register():
    """vLLM plugin entry point: arm every patch on its upstream modules (applied when vLLM imports
    them), once per process.

    Returns the per-patch results (vLLM ignores them; tests and tools read them).
    """
    from vllm_sinks.patches.lifecycle import register_all

    return register_all()
