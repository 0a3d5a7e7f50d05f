"""`vllm-sinks report`: what is installed and what each patch does here, without an engine."""

from __future__ import annotations

from vllm_sinks import hub_kernels, patches
from vllm_sinks.patches.lifecycle import apply_everything
from vllm_sinks.patches.registry import SUPPORTED_MAX, SUPPORTED_MIN, Status, VllmInfo, detect_vllm
from vllm_sinks.version import __version__


def format_report(info: VllmInfo | None = None) -> str:
    """The report for ``info`` (default: the installed vLLM)."""
    listed = patches.PATCHES  # read now: tests swap the list
    info = info or detect_vllm()
    # Unlike vLLM's processes (where each patch waits for vLLM to import its modules), the report
    # imports every target module and applies here: the full picture; drift shows up in apply() too.
    results = apply_everything(info)
    lines = [
        f"vllm-sinks   {__version__}",
        f"vLLM         {info.describe()}   (supported {SUPPORTED_MIN} … {SUPPORTED_MAX}"
        + ("" if info.supported or not info.installed else ": OUTSIDE, nothing patched") + ")",
        # transformers, its `kernels` and whether hub kernels are active (one line; CI's word on the pair: ci=)
        hub_kernels.describe(),
        f"torch        {info.torch or 'not installed'}",
        "",
    ]
    width = max(len(p.name) for p in listed)
    env_width = max(len(p.env_var) for p in listed)
    status_width = max(len(s.value) for s in Status)
    for patch, result in zip(listed, results):
        lines.append(f"{patch.name:<{width}}  {result.status.value:<{status_width}}  {patch.env_var:<{env_width}}"
                     f"  {result.detail}")
        if patch.modules:
            lines.append(f"{'':<{width}}  {'':<{status_width}}  {'':<{env_width}}"
                         f"  target modules: {', '.join(patch.modules)}")
    return "\n".join(lines)
