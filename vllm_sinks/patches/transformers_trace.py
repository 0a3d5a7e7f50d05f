"""Hooks of the ``transformers-trace`` patch (glue only; the logic is in
``vllm_sinks.model_executor.models.transformers.fx_utils``).

Targets (upstream modules ``vllm.model_executor.models.transformers.fx_utils`` and ``.fuser``):
``fx_utils.trace`` and the name ``fuser.trace``, which ``fuser`` imports at load time and
``get_fuser`` calls.

Probe, by feature: trace with upstream's ``trace`` a two-linear module whose ``forward`` is wrapped
the way transformers' ``@deprecate_kwarg`` wraps it (``functools.wraps``, ``*args, **kwargs``) and
calls, between the linears, a module held in its globals outside the tree (what a hub-kernel ``Func``
is). Upstream stops short of the output there (0.29 + transformers 5.24, or any release with hub
kernels active): apply. It reaches the output: stand down. A backend without ``fx_utils.trace`` (no
fx fusers) has nothing to fix: stand down.
"""

from __future__ import annotations

import functools
import inspect

from vllm_sinks.patches import install
from vllm_sinks.patches.registry import Drift, Probe, VllmInfo, import_upstream

PATCH = "transformers-trace"
FX_UTILS = "vllm.model_executor.models.transformers.fx_utils"
FUSER = "vllm.model_executor.models.transformers.fuser"


def _modules():
    """(fx_utils, fuser) of the installed backend, or None where it has no fx fusers."""
    fx_utils = import_upstream(FX_UTILS, absent_ok=True)
    if fx_utils is None:
        return None
    trace = getattr(fx_utils, "trace", None)
    if not callable(trace):
        return None
    params = list(inspect.signature(install.original(trace)).parameters)
    if params != ["module"]:
        raise Drift(f"{FX_UTILS}.trace{tuple(params)}: expected (module)")
    fuser = import_upstream(FUSER)
    if install.upstream(getattr(fuser, "trace", None)) is not install.upstream(trace):
        raise Drift(f"{FUSER} no longer calls {FX_UTILS}.trace by the name `trace`")
    return fx_utils, fuser


def _traces_wrapped_forward(trace) -> bool:
    """Does ``trace`` reach the output of a module whose forward is a ``functools.wraps`` wrapper
    calling a module from its globals that is not in its tree?"""
    import types

    import torch
    from torch import nn

    from vllm_sinks.model_executor.models.transformers.fx_utils import complete

    def deprecate_like(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            return fn(*args, **kwargs)
        return wrapped

    class WrappedTwoLinear(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x, cache=None, **kwargs):
            return self.second(hub_func(self.first(x)))  # noqa: F821 - hub_func: the globals below

    forward = WrappedTwoLinear.forward
    # A function of its own globals: `hub_func` is a module there, as `apply_rotary_pos_emb` is a kernels
    # Func in a modeling module's globals under hub kernels.
    WrappedTwoLinear.forward = deprecate_like(types.FunctionType(
        forward.__code__, {"__builtins__": __builtins__, "hub_func": nn.Identity()}, forward.__name__))
    with torch.device("meta"):
        module = WrappedTwoLinear()
    return complete(install.original(trace)(module))


def probe(info: VllmInfo) -> Probe:
    found = _modules()
    if found is None:
        return Probe(False, "this Transformers backend has no fx fusers")
    fx_utils, _ = found
    if _traces_wrapped_forward(fx_utils.trace):
        return Probe(False, "upstream's fx trace reads through wrapped forwards")
    return Probe(True, "upstream's fx trace stops at a wrapped forward (transformers' @deprecate_kwarg) or "
                       "at a hub-kernel module outside the tree: no fusion, GPT-OSS attention unsharded at TP > 1")


def apply(info: VllmInfo) -> str:
    from vllm_sinks.model_executor.models.transformers import fx_utils as ours

    found = _modules()
    if found is None:
        raise Drift(f"{FX_UTILS}.trace disappeared between probe and apply")
    fx_utils, fuser = found
    install.install(fx_utils, "trace", ours.trace, PATCH)
    install.install(fuser, "trace", ours.trace, PATCH)
    return ("fx trace retried through the unwrapped forward and hub-kernel modules (fusers match "
            "transformers 5.24+ attention)")
