"""May a Hopper Gluon kernel run here, and has its variant compiled: what the Gluon kernels
(``gluon_window_attention``, ``gluon_full_attention``) ask before a launch.

- ``kernel_unavailable``: the kernel's env switch, then the platform (``gluon_api.hopper_unavailable``:
  Gluon imports, a Triton the GPU tests passed on, an NVIDIA GPU of compute capability 9.0);
- ``first_launch``: a variant compiles on its first launch, and an experimental compiler may
  refuse it on some Triton build; then the launch says why once, writes nothing, and never tries
  that variant again, so the front door runs the portable kernel for that shape.

Imports torch and Triton only (through ``gluon_api``); nothing of vLLM.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from vllm_sinks.env import Setting
from vllm_sinks.v1.attention.ops.gluon_api import hopper_unavailable


def kernel_unavailable(device: torch.device, switch: Setting | None = None) -> str | None:
    """Why a Hopper Gluon kernel cannot run on ``device`` (None when it can): its env switch
    (``switch``, where the kernel has one) turned it off, or the platform rules it out."""
    if switch is not None and switch.read() == "off":
        return f"{switch.name}=off"
    return hopper_unavailable(device)


def first_launch(launch: Callable[[], Any], variant, compiled: set, failed: set,
                 kernel: str) -> tuple[bool, Any]:
    """Run ``launch()`` for a variant not known to have compiled: (True, what it returned), or
    (False, None) where the variant failed to compile, now (warned once) or before. ``compiled``
    and ``failed`` are the kernel's own sets of variants; a variant that compiled before and then
    raises is a real launch error, not the compiler's, and propagates."""
    if variant in failed:
        return False, None
    try:
        result = launch()
    except Exception as e:  # noqa: BLE001 - an experimental compiler: fall back, say why
        if variant in compiled:
            raise
        failed.add(variant)
        warnings.warn(f"vllm-sinks: the Hopper {kernel} kernel failed to compile "
                      f"({type(e).__name__}: {str(e)[:300]}); using the Triton kernel for this "
                      "shape", stacklevel=3)
        return False, None
    compiled.add(variant)
    return True, result
