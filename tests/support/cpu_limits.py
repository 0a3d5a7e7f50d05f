"""What the installed vLLM refuses to run on the CPU at hand, with or without the plugin.

A test whose tiny model meets such a refusal is skipped by name, never passed and never failed: the
plugin is not what stopped it, and CI rows on other CPUs still run it. Each refusal is matched by
vLLM's own message, so any other error still fails its test.
"""

from __future__ import annotations

import pytest

#: vLLM 0.27's CPU fused MoE (``cpu_fused_moe.CPUFusedMOE.check_grouped_gemm``) raises for every MoE
#: layer that is not bf16 on a CPU with AMX tiles, where other x86 CPUs take its vector kernel; its
#: message blames the alignment of the intermediate size. The tiny MoE families run in fp32, so on
#: such a CPU vLLM 0.27.1 loads none of them (Granite-MoE SWA and MiMo-V2-Flash through the
#: Transformers backend, GPT-OSS natively). Met on a 2-core Xeon with AMX (2026-12-04), where the
#: full rows of 0.29.0 and 0.32.0 (MoE kernels chosen by what the layer supports) ran them all.
#: Delete the entry when 0.27.1 leaves scripts/matrix.txt.
REFUSALS = ("CPU fused-MoE AMX grouped-gemm kernel cannot be used",)


def refusal(error: str | None) -> str | None:
    """The refusal ``error`` holds (the start of vLLM's message), or None."""
    if error:
        for text in REFUSALS:
            if text in error:
                return error[error.index(text):][:160]
    return None


def skip_if_refused(error: str | None, what: str) -> None:
    """Skip the calling test where ``error`` is one of this CPU's refusals."""
    why = refusal(error)
    if why is not None:
        pytest.skip(f"this vLLM refuses {what} on this CPU, with or without the plugin: {why}")
