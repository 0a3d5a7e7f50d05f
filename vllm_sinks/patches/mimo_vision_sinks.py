"""Patch hooks for ``mimo-vision-sinks``: MiMo-V2-Omni's vision window attention applies its sinks.

Target: ``vllm.model_executor.models.mimo_v2_omni.MiMoVisionAttention._forward_window_attn``.
The logic lives in the fork module ``vllm_sinks.model_executor.models.mimo_v2_omni``; this is glue.

What the probe finds, by feature (read off the installed method, then exercised on a fake layer):

* 0.27.x: the method never reads ``self.sinks`` (flash attention with a window, no sink): replace it
  with our window attention through vllm-sinks' prefill op.
* 0.28 … 0.33: the method reads the sinks and calls
  ``vllm.v1.attention.ops.triton_prefill_attention.context_attention_fwd(..., sinks_bias_key0=True)``
  (the prefill-op patch routes our op in there), but slices the sinks by the *global* TP rank: with a
  data-parallel ViT every rank holds all heads, so rank >= 1 passes an empty slice. Replace it with
  ours, which slices by the ViT's own partition and keeps calling that module's op.
* Upstream already right (reads sinks, right slice, same semantics as selected): stand down.
"""

from __future__ import annotations

import builtins
import importlib
import importlib.util
import inspect
import sys
import types
from typing import Any, Callable

from vllm_sinks.model_executor.models import mimo_v2_omni as fork
from vllm_sinks.patches import install
from vllm_sinks.patches.registry import Drift, NotApplicable, Probe, VllmInfo

PATCH_NAME = "mimo-vision-sinks"
MODEL_MODULE = "vllm.model_executor.models.mimo_v2_omni"
OP_MODULE = "vllm.v1.attention.ops.triton_prefill_attention"
CLASS_NAME = "MiMoVisionAttention"
METHOD_NAME = "_forward_window_attn"
EXPECTED_PARAMS = ("self", "q", "k", "v", "cu_seqlens", "max_seqlen")

# Upstream's path, as the probe classified it.
DROPS_SINKS = "drops-sinks"  # 0.27.x: flash attention, sinks never read
VIA_PREFILL_OP = "via-prefill-op"  # 0.28+: sinks through the prefill op's key-0 mode

class _ModelUnavailable(Exception):
    """vLLM's MiMo-V2-Omni module cannot be imported here, so vLLM cannot run the model either."""


def _target_class() -> type:
    try:
        module = importlib.import_module(MODEL_MODULE)
    except ImportError as e:
        raise _ModelUnavailable(f"{MODEL_MODULE} does not import here ({type(e).__name__}: {e})") from e
    cls = getattr(module, CLASS_NAME, None)
    if not isinstance(cls, type):
        raise Drift(f"{MODEL_MODULE}.{CLASS_NAME} not found")
    if not callable(getattr(cls, METHOD_NAME, None)):
        raise Drift(f"{CLASS_NAME}.{METHOD_NAME} not found")
    return cls


def _upstream_method(cls: type) -> Callable:
    method = install.original(getattr(cls, METHOD_NAME))
    params = tuple(inspect.signature(method).parameters)
    if params != EXPECTED_PARAMS:
        raise Drift(f"{CLASS_NAME}.{METHOD_NAME}{params} (expected parameters {EXPECTED_PARAMS})")
    if not hasattr(method, "__code__"):
        raise Drift(f"{CLASS_NAME}.{METHOD_NAME} is not a plain function ({type(method).__name__})")
    return method


def _names_used(fn: Callable) -> set[str]:
    code = fn.__code__
    return set(code.co_names) | {c for c in code.co_consts if isinstance(c, str)}


class _RecordingOp:
    """Stands in for the prefill op during the probe: records how upstream calls it, computes nothing."""

    def __init__(self, signature: inspect.Signature):
        self.signature = signature
        self.calls: list[inspect.BoundArguments] = []

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        self.calls.append(bound)


class _OpModuleView:
    """The op module as the probe's copy of upstream's method sees it: the op is the recorder."""

    def __init__(self, module: types.ModuleType, recorder: _RecordingOp):
        self._module = module
        self.context_attention_fwd = recorder

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _with_recorder(method: Callable, op_module: types.ModuleType, recorder: _RecordingOp) -> Callable:
    """A copy of ``method`` that reaches ``recorder`` wherever it looks up the op, changing nothing.

    Upstream imports the op inside the method (``from <op module> import context_attention_fwd``):
    the copy runs with its own builtins whose ``__import__`` hands back a view of the op module for
    that import. A module-level binding of the name is covered by the copy's own globals (a shallow
    copy of the module's). vLLM's modules and functions stay untouched: other threads, and the
    prefill-op patch, see nothing of the probe.
    """
    real_import = builtins.__import__
    view = _OpModuleView(op_module, recorder)

    def probe_import(name, globals=None, locals=None, fromlist=(), level=0):
        module = real_import(name, globals, locals, fromlist, level)
        if fromlist and getattr(module, "__name__", None) == OP_MODULE:
            return view
        return module

    own_builtins = dict(vars(builtins), __import__=probe_import)
    own_globals = dict(method.__globals__, __builtins__=own_builtins)
    if "context_attention_fwd" in own_globals:
        own_globals["context_attention_fwd"] = recorder
    copy = types.FunctionType(method.__code__, own_globals, method.__name__, method.__defaults__,
                              method.__closure__)
    copy.__kwdefaults__ = method.__kwdefaults__
    return copy


def _exercise_upstream(method: Callable) -> inspect.BoundArguments:
    """Run upstream's method on a fake rank-1 layer of a data-parallel ViT; return the op's arguments.

    The fake layer is what ``MiMoVisionAttention.__init__`` builds when ``is_vit_use_data_parallel()``:
    ``tp_size`` 1 (all heads here), ``tp_rank`` the global rank (1), the QKV projection unsharded.
    Read-only: a copy of the method runs against a recorder (:func:`_with_recorder`).
    """
    import torch

    op_module = importlib.import_module(OP_MODULE)
    real_op = getattr(op_module, "context_attention_fwd", None)
    if not callable(real_op):
        raise Drift(f"{OP_MODULE}.context_attention_fwd not found")
    signature = inspect.signature(install.original(real_op))
    for name in ("sinks", "sinks_bias_key0"):
        if name not in signature.parameters:
            raise Drift(f"{OP_MODULE}.context_attention_fwd has no {name!r} parameter")
    heads = 2
    fake = types.SimpleNamespace(
        num_heads=heads, num_kv_heads=heads, num_heads_per_partition=heads,
        num_kv_heads_per_partition=heads, tp_size=1, tp_rank=1, qk_channels=4, kv_channels=4,
        scale=0.5, visual_token_window_size=1, use_sink=True,
        sinks=torch.tensor([0.25, -0.75]), qkv=types.SimpleNamespace(tp_rank=0, tp_size=1),
    )
    q = torch.zeros(3, heads, 4)
    cu_seqlens = torch.tensor([0, 3], dtype=torch.int32)
    recorder = _RecordingOp(signature)
    try:
        _with_recorder(method, op_module, recorder)(fake, q, q.clone(), q.clone(), cu_seqlens,
                                                    torch.tensor(3))
    except Exception as e:  # noqa: BLE001 - whatever upstream tripped on, it is not what we know
        raise Drift(f"upstream {METHOD_NAME} failed on a fake data-parallel layer "
                    f"({type(e).__name__}: {e})") from e
    if len(recorder.calls) != 1:
        raise Drift(f"upstream {METHOD_NAME} called {OP_MODULE}.context_attention_fwd "
                    f"{len(recorder.calls)} times (expected once)")
    return recorder.calls[0]


def _classify(cls: type) -> tuple[str, dict[str, Any]]:
    """Upstream's path and what it does with the sinks (see the module docstring)."""
    method = _upstream_method(cls)
    names = _names_used(method)
    if "sinks" not in names:
        if "flash_attn_varlen_func" not in names:
            raise Drift(f"{METHOD_NAME} uses neither the sinks nor flash_attn_varlen_func")
        return DROPS_SINKS, {}
    if "context_attention_fwd" not in names:
        raise Drift(f"{METHOD_NAME} reads the sinks but not through {OP_MODULE}.context_attention_fwd")
    call = _exercise_upstream(method).arguments
    sinks = call.get("sinks")
    return VIA_PREFILL_OP, {
        "dp_rank1_sink_heads": 0 if sinks is None else int(sinks.numel()),
        "semantics": fork.KEY0 if call.get("sinks_bias_key0") else fork.NULL,
    }


def probe(info: VllmInfo) -> Probe:
    semantics = fork.sink_semantics_from_env()  # a bad value raises: the report line says why
    try:
        path, facts = _classify(_target_class())
    except _ModelUnavailable as e:
        raise NotApplicable(f"{e}; vLLM cannot load MiMo-V2-Omni here either") from e
    if path == DROPS_SINKS:
        return Probe(True, "upstream window attention drops the vision sinks")
    problems = []
    if facts["dp_rank1_sink_heads"] != 2:
        problems.append(f"slices sinks by the global TP rank (data-parallel ViT rank 1 gets "
                        f"{facts['dp_rank1_sink_heads']} of 2 heads)")
    if facts["semantics"] != semantics:
        problems.append(f"upstream applies the sinks as {facts['semantics']}, {fork.SEMANTICS_ENV} "
                        f"selects {semantics}")
    if problems:
        return Probe(True, "; ".join(problems))
    return Probe(False, "upstream applies the vision sinks, sliced by the ViT's own partition, as "
                        f"{semantics}")


def _prefill_op_of_vllm() -> Callable:
    # Looked up per call: whatever the prefill-op patch (or upstream) put there is what runs.
    return sys.modules[OP_MODULE].context_attention_fwd


def apply(info: VllmInfo) -> str:
    semantics = fork.sink_semantics_from_env()
    try:
        cls = _target_class()
    except _ModelUnavailable as e:
        raise RuntimeError(f"nothing to patch: {e}") from e
    path, _ = _classify(cls)
    if path == DROPS_SINKS:
        # Fail here, not at the first image, if our op cannot import; without importing it now
        # (Triton and our kernels cost ~60 ms, 12 % of vLLM's own import of the MiMo module).
        if importlib.util.find_spec("triton") is None:
            raise RuntimeError("the vllm-sinks prefill op needs Triton, which is not installed here")
        resolve_op, where = None, "window attention through the vllm-sinks prefill op"
    else:
        importlib.import_module(OP_MODULE)
        resolve_op, where = _prefill_op_of_vllm, f"window attention through {OP_MODULE}"
    new = fork.make_forward_window_attn(semantics, resolve_op)
    install.install(cls, METHOD_NAME, new, PATCH_NAME)
    active = getattr(getattr(cls, METHOD_NAME), "sink_semantics", semantics)
    return f"{where}, {fork.describe_semantics(active)}, sinks sliced by the ViT's own head partition"
