"""Which transformers, which ``kernels``, and whether transformers' hub kernels are active here.

transformers >= 5.20 turns functions such as ``apply_rotary_pos_emb`` into ``kernels`` ``Func``
modules (``@use_kernel_forward_from_hub``) whenever a ``kernels`` release inside its own range is
installed (5.25 requires one; ``USE_HUB_KERNELS=0`` stops it on some releases only). The modules the
Transformers backend traces then call modules outside their tree, so ``vllm-sinks report`` and
``vllm-sinks verify`` say which case a user is in. Told by feature: decorate a throwaway function the
way the modeling files do and see whether a module comes back.

Imports nothing at import time; :func:`detect` imports transformers (and torch).
"""

from __future__ import annotations

import dataclasses

from vllm_sinks.ci_coverage import dist_version


@dataclasses.dataclass(frozen=True)
class TransformersStack:
    transformers: str | None  # None: not installed
    kernels: str | None  # None: not installed
    active: bool | None  # hub kernels on; None: cannot tell (transformers missing or broken)
    why: str = ""  # what stopped the detection, when ``active`` is None


def hub_kernels_active() -> bool:
    """Does transformers' ``use_kernel_forward_from_hub`` turn a function into a module here?"""
    from torch import nn
    from transformers import integrations

    decorate = getattr(integrations, "use_kernel_forward_from_hub", None)
    if decorate is None:
        return False

    def identity(x):
        return x

    return isinstance(decorate("vllm_sinks_detect")(identity), nn.Module)


def detect() -> TransformersStack:
    transformers, kernels = dist_version("transformers"), dist_version("kernels")
    if transformers is None:
        return TransformersStack(None, kernels, None, "transformers is not installed")
    try:
        return TransformersStack(transformers, kernels, hub_kernels_active())
    except Exception as e:  # noqa: BLE001 - a report line, never a crash of the report
        return TransformersStack(transformers, kernels, None, f"{type(e).__name__}: {e}")


def stack_line(transformers: str | None, kernels: str | None, active: bool | None, why: str = "",
               ci: str | None = None) -> str:
    """One report line for the pair; ``ci`` (pinned / newest at the last CI run / untested) is
    appended where the caller knows it."""
    hub = {True: "hub kernels active", False: "hub kernels inactive", None: f"hub kernels unknown ({why})"}
    parts = [f"transformers {transformers or 'not installed'}", f"kernels {kernels or 'not installed'}",
             hub[active]] + ([f"CI: {ci}"] if ci else [])
    return ", ".join(parts)


def describe(ci: str | None = None) -> str:
    """:func:`stack_line` for what is installed here."""
    found = detect()
    return stack_line(found.transformers, found.kernels, found.active, found.why, ci)
