"""Patch hooks for ``mimo-vision-sinks``: MiMo-V2-Omni's vision window attention applies its sinks.

Target: ``vllm.model_executor.models.mimo_v2_omni.MiMoVisionAttention._forward_window_attn``.
The logic lives in the fork module ``vllm_sinks.model_executor.models.mimo_v2_omni``; this is glue.

What the probe finds, by feature (read off the installed method, then exercised on rank 1 of 2 as
the release's own ``__init__`` builds it, for a data-parallel and a tensor-parallel ViT):

* 0.27.x: the method never reads ``self.sinks`` (flash attention with a window, no sink): replace it
  with our window attention through vllm-sinks' prefill op.
* 0.28 and later: the method reads the sinks and calls
  ``vllm.v1.attention.ops.triton_prefill_attention.context_attention_fwd(..., sinks_bias_key0=True)``
  (the prefill-op patch routes our op in there). Before ``DATA_PARALLEL_VIT_RANK_SINCE`` its
  ``__init__`` keeps the *global* TP rank with a data-parallel ViT, where every rank holds all heads,
  so rank >= 1 passes an empty slice: replace it with ours, which slices by the ViT's own partition
  and keeps calling that module's op.
* Upstream already right (reads sinks, right slice on both ViTs, same semantics as selected): stand
  down, saying that the data-parallel slicing is upstream's own.
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


#: The probe's parallel world: rank 1 of 2, a layer of 2 heads with these sinks.
PROBE_WORLD, PROBE_RANK, PROBE_HEADS = 2, 1, 2
PROBE_SINKS = (0.25, -0.75)


class _LayerStandIn:
    """Stands in for a vLLM layer the attention's ``__init__`` builds (linear, encoder attention,
    rotary): keeps its arguments, computes nothing (the probe reads only the attention's own fields)."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.args, self.kwargs = args, kwargs


class _ParallelState:
    """The parallel state as the probe's copy of ``__init__`` sees it: rank 1 of a TP group of 2."""

    @staticmethod
    def get_tensor_model_parallel_world_size() -> int:
        return PROBE_WORLD

    @staticmethod
    def get_tensor_model_parallel_rank() -> int:
        return PROBE_RANK


def _built_layer(cls: type, data_parallel: bool) -> Any:
    """Rank 1 of 2 as the release's own ``MiMoVisionAttention.__init__`` builds it, with a
    data-parallel ViT (``is_vit_use_data_parallel()``) or a tensor-parallel one.

    A copy of ``__init__`` runs with its own globals: the parallel state says rank 1 of 2, the ViT
    mode is the one asked for, and vLLM's layer classes it names are stand-ins. The class and its
    module stay untouched (read-only, as :func:`_with_recorder`).
    """
    init = cls.__dict__.get("__init__")
    if not isinstance(init, types.FunctionType):
        raise Drift(f"{CLASS_NAME}.__init__ is not a plain function")
    names = set(init.__code__.co_names)
    for needed in ("is_vit_use_data_parallel", "parallel_state"):
        if needed not in names:
            raise Drift(f"{CLASS_NAME}.__init__ no longer reads {needed}")
    import torch

    own_globals = dict(init.__globals__, parallel_state=_ParallelState,
                       is_vit_use_data_parallel=lambda *a, **k: data_parallel)
    for name in names:
        value = own_globals.get(name)
        if isinstance(value, type) and issubclass(value, torch.nn.Module) and \
                value.__module__.startswith("vllm."):
            own_globals[name] = _LayerStandIn
    copy = types.FunctionType(init.__code__, own_globals, init.__name__, init.__defaults__,
                              init.__closure__)
    copy.__kwdefaults__ = init.__kwdefaults__
    layer = cls.__new__(cls)
    try:
        copy(layer, embed_dim=8, num_heads=PROBE_HEADS, num_kv_heads=PROBE_HEADS, qk_channels=4,
             kv_channels=4, use_sink=True, visual_token_window_size=1, prefix="probe")
        with torch.no_grad():
            layer.sinks.copy_(torch.tensor(PROBE_SINKS))
    except Exception as e:  # noqa: BLE001 - whatever upstream tripped on, it is not what we know
        mode = "data" if data_parallel else "tensor"
        raise Drift(f"upstream {CLASS_NAME}.__init__ failed building rank {PROBE_RANK} of {PROBE_WORLD} of "
                    f"a {mode}-parallel ViT ({type(e).__name__}: {e})") from e
    return layer


def _exercise_upstream(method: Callable, layer: Any) -> inspect.BoundArguments:
    """Run upstream's method on ``layer`` (:func:`_built_layer`); return the op's arguments.

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
    q = torch.zeros(3, layer.num_heads_per_partition, layer.qk_channels)
    cu_seqlens = torch.tensor([0, 3], dtype=torch.int32)
    recorder = _RecordingOp(signature)
    try:
        _with_recorder(method, op_module, recorder)(layer, q, q.clone(), q.clone(), cu_seqlens,
                                                    torch.tensor(3))
    except Exception as e:  # noqa: BLE001 - whatever upstream tripped on, it is not what we know
        raise Drift(f"upstream {METHOD_NAME} failed on rank {PROBE_RANK} of {PROBE_WORLD} as its "
                    f"__init__ builds it ({type(e).__name__}: {e})") from e
    if len(recorder.calls) != 1:
        raise Drift(f"upstream {METHOD_NAME} called {OP_MODULE}.context_attention_fwd "
                    f"{len(recorder.calls)} times (expected once)")
    return recorder.calls[0]


def _sinks_passed(call: inspect.BoundArguments) -> list[float] | None:
    sinks = call.arguments.get("sinks")
    return None if sinks is None else [float(x) for x in sinks.reshape(-1)]


def _declares_encoder_tp_data(cls: type) -> bool:
    """Whether a class of the model's module declares ``supports_encoder_tp_data`` (vLLM then lets
    the user run its ViT data-parallel): where none does, a data-parallel slicing bug is latent."""
    module = sys.modules.get(cls.__module__)
    return any(isinstance(c, type) and vars(c).get("supports_encoder_tp_data") is True
               for c in vars(module or types.SimpleNamespace()).values())


def _classify(cls: type) -> tuple[str, dict[str, Any]]:
    """Upstream's path and what it does with the sinks (see the module docstring).

    On the prefill-op path the facts are what upstream's method passes the op on rank 1 of 2 of a
    data-parallel and of a tensor-parallel ViT (``dp_rank1_sinks``, ``tp_rank1_sinks``: the sinks'
    values, None for none), with which semantics, and whether the model declares
    ``supports_encoder_tp_data``.
    """
    method = _upstream_method(cls)
    names = _names_used(method)
    if "sinks" not in names:
        if "flash_attn_varlen_func" not in names:
            raise Drift(f"{METHOD_NAME} uses neither the sinks nor flash_attn_varlen_func")
        return DROPS_SINKS, {}
    if "context_attention_fwd" not in names:
        raise Drift(f"{METHOD_NAME} reads the sinks but not through {OP_MODULE}.context_attention_fwd")
    data = _exercise_upstream(method, _built_layer(cls, data_parallel=True))
    tensor = _exercise_upstream(method, _built_layer(cls, data_parallel=False))
    key0 = {bool(data.arguments.get("sinks_bias_key0")), bool(tensor.arguments.get("sinks_bias_key0"))}
    if len(key0) != 1:
        raise Drift(f"upstream {METHOD_NAME} picks the sink semantics by the ViT's parallelism")
    return VIA_PREFILL_OP, {
        "dp_rank1_sinks": _sinks_passed(data),
        "tp_rank1_sinks": _sinks_passed(tensor),
        "semantics": fork.KEY0 if key0.pop() else fork.NULL,
        "declares_encoder_tp_data": _declares_encoder_tp_data(cls),
    }


def _slicing(facts: dict[str, Any]) -> tuple[list[str], str]:
    """What upstream slices wrong (problems), and a phrase for the data-parallel slicing it does right
    (empty where it does not)."""
    per_rank = PROBE_HEADS // PROBE_WORLD
    tp_heads = list(PROBE_SINKS[PROBE_RANK * per_rank:(PROBE_RANK + 1) * per_rank])
    problems, fixed = [], ""
    if facts["dp_rank1_sinks"] == list(PROBE_SINKS):
        fixed = (f"data-parallel ViT slicing fixed upstream (rank {PROBE_RANK} of a data-parallel ViT "
                 f"passes all {PROBE_HEADS} heads' sinks)")
    else:
        latent = "" if facts["declares_encoder_tp_data"] else \
            " (latent: no model class here declares supports_encoder_tp_data)"
        problems.append(f"slices sinks by the global TP rank: rank {PROBE_RANK} of a data-parallel ViT "
                        f"passes {len(facts['dp_rank1_sinks'] or ())} of {PROBE_HEADS} heads' sinks{latent}")
    if facts["tp_rank1_sinks"] != tp_heads:
        problems.append(f"slices sinks wrong under tensor parallelism: rank {PROBE_RANK} of "
                        f"{PROBE_WORLD} passes {facts['tp_rank1_sinks']}, its heads' are {tp_heads}")
    return problems, fixed


def probe(info: VllmInfo) -> Probe:
    semantics = fork.sink_semantics_from_env()  # a bad value raises: the report line says why
    try:
        path, facts = _classify(_target_class())
    except _ModelUnavailable as e:
        raise NotApplicable(f"{e}; vLLM cannot load MiMo-V2-Omni here either") from e
    if path == DROPS_SINKS:
        return Probe(True, "upstream window attention drops the vision sinks")
    problems, fixed = _slicing(facts)
    if facts["semantics"] != semantics:
        problems.append(f"upstream applies the sinks as {facts['semantics']}, {fork.SEMANTICS_ENV} "
                        f"selects {semantics}")
    if problems:
        return Probe(True, "; ".join(problems + [fixed] * bool(fixed)))
    return Probe(False, f"upstream applies the vision sinks as {semantics}, sliced by the ViT's own head "
                        f"partition; {fixed}")


def _prefill_op_of_vllm() -> Callable:
    # Looked up per call: whatever the prefill-op patch (or upstream) put there is what runs.
    return sys.modules[OP_MODULE].context_attention_fwd


def apply(info: VllmInfo) -> str:
    semantics = fork.sink_semantics_from_env()
    try:
        cls = _target_class()
    except _ModelUnavailable as e:
        raise RuntimeError(f"nothing to patch: {e}") from e
    path, facts = _classify(cls)
    # what upstream's slicing gets wrong, else what it does right (the report line says which)
    problems, fixed = ([], "") if path == DROPS_SINKS else _slicing(facts)
    upstream = "; ".join(f"upstream {p}" for p in problems) or fixed
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
    return (f"{where}, {fork.describe_semantics(active)}, sinks sliced by the ViT's own head partition"
            + (f"; {upstream}" if upstream else ""))
