"""The patch registry: every edit vllm-sinks makes to vLLM, documented in one place.

Each entry says which upstream object it edits (target), which of our modules mirrors that upstream
file (fork), why, how, the upstream PR it carries or works around, and when it can be deleted. The
same entries drive the one-line startup report (``registry.register_all``), ``vllm-sinks report``
and the table in docs/patches.md (``vllm-sinks docs``; a test keeps them in step).

Opt out of one patch with its env var (``Patch.env_var``): ``VLLM_SINKS_<NAME>=off``; ``on`` applies
it even where upstream has its own fix. ``VLLM_PLUGINS`` (vLLM's own) turns the whole plugin off.
"""

from vllm_sinks.patches.registry import Patch

PATCHES: tuple[Patch, ...] = (
    Patch(
        name="prefill-op",
        targets=(
            "vllm.v1.attention.ops.triton_prefill_attention.context_attention_fwd",
            "vllm.v1.attention.backends.triton_attn.context_attention_fwd",
        ),
        fork="vllm_sinks/v1/attention/ops/triton_prefill_attention.py",
        upstream_pr="TODO",
        why="TODO",
        how="TODO",
        remove_when="TODO",
        hooks="vllm_sinks.patches.prefill_op",
    ),
    Patch(
        name="transformers-sinks",
        targets=(
            "vllm.model_executor.models.transformers.base.Base.create_attention_instances",
            "vllm.model_executor.models.transformers (attention interface)",
        ),
        fork="vllm_sinks/model_executor/models/transformers/base.py",
        upstream_pr="TODO",
        why="TODO",
        how="TODO",
        remove_when="TODO",
        hooks="vllm_sinks.patches.transformers_sinks",
    ),
    Patch(
        name="mimo-vision-sinks",
        targets=("vllm.model_executor.models.mimo_v2_omni.MiMoVisionAttention._forward_window_attn",),
        fork="vllm_sinks/model_executor/models/mimo_v2_omni.py",
        upstream_pr="TODO",
        why="TODO",
        how="TODO",
        remove_when="TODO",
        hooks="vllm_sinks.patches.mimo_vision_sinks",
    ),
)
