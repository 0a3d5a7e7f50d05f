"""`vllm-sinks report`: what is installed and what each patch does here, without an engine."""

from __future__ import annotations

from vllm_sinks import ci_coverage, hub_kernels, patches
from vllm_sinks.patches.lifecycle import apply_everything
from vllm_sinks.patches.registry import Status, VllmInfo, detect_vllm
from vllm_sinks.version import __version__


def format_report(info: VllmInfo | None = None) -> str:
    """The report for ``info`` (default: the installed vLLM)."""
    listed = patches.PATCHES  # read now: tests swap the list
    info = info or detect_vllm()
    # Unlike vLLM's processes (where each patch waits for vLLM to import its modules), the report
    # imports every target module and applies here: the full picture; drift shows up in apply() too.
    results = apply_everything(info)
    stack = hub_kernels.detect()
    lines = [
        f"vllm-sinks   {__version__}",
        f"vLLM         {info.describe()}   ({info.standing()})",
        # transformers, its `kernels` and whether hub kernels are active (one line)
        hub_kernels.stack_line(stack.transformers, stack.kernels, stack.active, stack.why),
        f"torch        {info.torch or 'not installed'}",
    ]
    # Whether CI runs this vLLM, transformers and kernels (the matrix, shipped as package data).
    lines += [f"CI           {ci_coverage.line(stack.active)}", ""]
    width = max(len(p.name) for p in listed)
    env_width = max(len(p.env_var) for p in listed)
    status_width = max(len(s.value) for s in Status)
    for patch, result in zip(listed, results):
        lines.append(f"{patch.name:<{width}}  {result.status.value:<{status_width}}  {patch.env_var:<{env_width}}"
                     f"  {result.detail}")
        if patch.modules:
            lines.append(f"{'':<{width}}  {'':<{status_width}}  {'':<{env_width}}"
                         f"  target modules: {', '.join(patch.modules)}")
    lines += ["", "full-attention table in force (prefill-op: ours or upstream's op, per call class):"]
    lines += [f"  {line}" for line in _tables_in_force()]
    return "\n".join(lines)


def _tables_in_force() -> list[str]:
    try:
        from vllm_sinks.v1.attention.ops.full_attention_table import tables_in_force
    except ImportError as e:  # no torch: no op
        return [f"none ({type(e).__name__}: {e})"]
    return tables_in_force()
