"""SinkFuser: find, in the FX graph, the learnable sink each Hugging Face attention module hands the
attention interface as ``s_aux``.

Why a graph and not a name: GPT-OSS, Granite SWA, DeepSeek V4, MiMo-V2-Flash, HY V4 ... all pass
``s_aux=self.sinks`` today, but the attribute's name, the module that owns it and whether it exists on a
given layer (MiMo-V2-Flash's full-attention layers have ``sinks = None``) are model choices. The
forward's dataflow says which tensor reaches ``s_aux``; nothing else has to be guessed.

How the trace works (torch.fx, our own tracer):

* every submodule stays one ``call_module`` node (we only need the attention module's own body);
* whatever ``ALL_ATTENTION_FUNCTIONS`` hands out becomes one opaque ``call_function`` node that keeps
  *all* its arguments, keywords included. A parameter passed as ``s_aux`` is therefore an edge to a
  ``get_attr`` node, whose target is the parameter's qualified name inside the module;
* each op is also run on meta tensors, so the usual shape code (``(*input_shape, -1, d)``,
  ``batch, seq = x.shape[:-1]``, ``if mask.dtype == torch.bool``) traces instead of failing;
* transformers >= 5.24 wraps attention forwards in ``@deprecate_kwarg`` (its ``*args, **kwargs``
  signature breaks fx's placeholders): we trace the unwrapped function. The KV-cache argument
  (``past_key_values``, renamed ``cache`` in 5.24) is fixed to None and ``**kwargs`` to ``{}``: vLLM
  passes no cache object, and neither changes which tensor reaches ``s_aux``.

Traces are cached per class, but a cached answer is reused only for an instance whose every attribute
the trace read (``sinks``, ``sliding_window``, ``config``, ``training`` ...) matches (the way dynamo
guards a graph), so one layer's answer never leaks into another layer whose sink is ``None``.

Imports without vLLM: torch only (transformers lazily, while tracing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import logging
import math
import operator
import threading
from typing import Any, Callable, Iterator
from unittest import mock

import torch
from torch import fx, nn

logger = logging.getLogger(__name__)

#: Forward parameters that carry the KV cache object (name changed across transformers versions).
CACHE_ARGUMENTS = ("past_key_values", "cache", "past_key_value")

#: Method calls that hand their input on unchanged but for dtype/layout; ``s_aux=self.sinks.float()``
#: still names the ``sinks`` parameter.
_PASS_THROUGH_METHODS = frozenset({"to", "float", "half", "bfloat16", "double", "type", "type_as",
                                   "contiguous", "detach", "clone"})

#: Token count and batch size of the fabricated meta inputs. Any small size works: the values are
#: only there to answer shape questions.
_META_TOKENS = 16

# fx replaces these two while it traces; running a child module on meta tensors needs the real ones.
_REAL_MODULE_CALL = nn.Module.__call__
_REAL_MODULE_GETATTR = nn.Module.__getattr__

# Names nn.Module keeps for its own machinery: reading them says nothing about the model.
_MODULE_INTERNALS = frozenset(vars(nn.Module()))

_UNKNOWN = object()  # a traced value we could not compute on meta tensors

#: Tensor attributes answered with the concrete value instead of a proxy: forwards hand them to
#: untraceable callees (``torch.finfo(x.dtype)``), and they do not depend on the input values.
_SPECIALIZED_ATTRIBUTES = frozenset({"dtype", "device", "ndim", "layout", "is_cuda"})


class SinkFuserError(ValueError):
    """An attention module's ``s_aux`` cannot be handed to vLLM's ``Attention``."""


@dataclasses.dataclass(frozen=True)
class SinkSite:
    """Where an attention module keeps the sink tensor it passes as ``s_aux``."""

    path: str  # qualified name inside the attention module: "sinks", "owner.sinks"
    kind: str  # "parameter" or "buffer"

    @property
    def owner_path(self) -> str:
        return self.path.rpartition(".")[0]

    @property
    def attr(self) -> str:
        return self.path.rpartition(".")[2]

    def owner(self, module: nn.Module) -> nn.Module:
        return module.get_submodule(self.owner_path) if self.owner_path else module

    def tensor(self, module: nn.Module) -> torch.Tensor:
        return getattr(self.owner(module), self.attr)


@dataclasses.dataclass(frozen=True)
class AttentionSite:
    """A module that dispatches to the attention interface, and what it passes as ``s_aux``.

    ``problem`` is set when the answer is unknown (the trace failed before the interface call) or
    unusable (``s_aux`` is computed, not a tensor the module holds): callers then hand no sink to
    vLLM and rely on the runtime guard to fail loudly if the module does apply one.
    """

    module_class: str
    sink: SinkSite | None
    interface_calls: int
    problem: str | None = None

    def require_sink(self) -> SinkSite | None:
        """The sink, or raise :class:`SinkFuserError` if the analysis could not decide."""
        if self.problem is not None:
            raise SinkFuserError(f"{self.module_class}: {self.problem}")
        return self.sink


# ---- the interface stand-in -------------------------------------------------------------------


def attention_interface_call(*args: Any, **kwargs: Any) -> Any:
    """Target of the opaque node that stands for the attention-interface call in a trace.

    Only ever a graph node: the trace never executes it.
    """
    raise RuntimeError("attention_interface_call is a tracing placeholder and cannot run")


def foreign_value(description: str) -> Any:
    """Target of a node standing for an argument the trace cannot name (e.g. a plain tensor)."""
    raise RuntimeError(f"foreign_value({description!r}) is a tracing placeholder and cannot run")


# ---- the tracer --------------------------------------------------------------------------------


class _ValueProxy(fx.Proxy):
    """A proxy that also carries its expression's value, computed on meta tensors (or _UNKNOWN)."""

    value: Any = _UNKNOWN

    def __len__(self) -> int:
        if self.value is not _UNKNOWN:
            return len(self.value)
        return super().__len__()

    def __getattr__(self, name: str) -> Any:
        if name in _SPECIALIZED_ATTRIBUTES and self.value is not _UNKNOWN:
            try:
                return getattr(self.value, name)
            except AttributeError:
                pass
        return _ValueAttribute(self, name)


class _ValueAttribute(_ValueProxy, fx.proxy.Attribute):
    """``proxy.attr`` (``x.shape``, ``x.dtype``): fx builds these lazily, outside create_proxy."""

    def __init__(self, root: fx.Proxy, attr: str):
        fx.proxy.Attribute.__init__(self, root, attr)
        base = getattr(root, "value", _UNKNOWN)
        if base is not _UNKNOWN:
            try:
                self.value = getattr(base, attr)
            except Exception:  # noqa: BLE001 - unknown is a valid answer
                pass


class _Unknowable(Exception):
    pass


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device="meta")
    return value


def _values_of(tree: Any) -> Any:
    """Replace every proxy in ``tree`` by its value and real tensors by meta ones."""

    def one(x: Any) -> Any:
        if isinstance(x, fx.Proxy):
            value = getattr(x, "value", _UNKNOWN)
            if value is _UNKNOWN:
                raise _Unknowable
            return value
        return _to_meta(x)

    return fx.node.map_aggregate(tree, one)


@contextlib.contextmanager
def _real_module_methods() -> Iterator[None]:
    """Run real module code in the middle of a trace (fx has patched nn.Module's call and getattr)."""
    saved = {name: nn.Module.__dict__[name] for name in ("__call__", "__getattr__")}
    nn.Module.__call__ = _REAL_MODULE_CALL
    nn.Module.__getattr__ = _REAL_MODULE_GETATTR
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.Module, name, fn)


def _run_module_on_meta(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    state = {name: torch.empty_like(t, device="meta")
             for name, t in itertools.chain(module.named_parameters(), module.named_buffers())}
    return torch.func.functional_call(module, state, tuple(args), kwargs)


class _SinkTracer(fx.Tracer):
    """fx tracer: submodules are leaves, values ride along on meta tensors, the interface is opaque."""

    def __init__(self, placeholder_values: dict[str, Any]):
        super().__init__(autowrap_modules=(math,))
        self.proxy_buffer_attributes = True  # a buffer passed as s_aux becomes get_attr too
        self.placeholder_values = placeholder_values
        self.interface_nodes: list[fx.Node] = []

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _ValueProxy(node, self)

    def create_proxy(self, kind, target, args, kwargs, *rest, **kw_rest):
        proxy = super().create_proxy(kind, target, args, kwargs, *rest, **kw_rest)
        if isinstance(proxy, _ValueProxy) and proxy.value is _UNKNOWN:
            try:
                proxy.value = self._evaluate(kind, target, args, kwargs)
            except Exception:  # noqa: BLE001 - only fatal if a later shape question needs it
                proxy.value = _UNKNOWN
        return proxy

    def _evaluate(self, kind: str, target: Any, args: tuple, kwargs: dict) -> Any:
        if kind == "placeholder":
            return self.placeholder_values.get(str(target), _UNKNOWN)
        if kind == "get_attr":
            return _to_meta(operator.attrgetter(str(target))(self.root))
        if target in (attention_interface_call, foreign_value):
            return _UNKNOWN
        try:
            args_v, kwargs_v = _values_of(args), _values_of(kwargs)
        except _Unknowable:
            return _UNKNOWN
        with _real_module_methods():
            if kind == "call_function":
                return target(*args_v, **kwargs_v)
            if kind == "call_method":
                receiver, *rest = args_v
                return getattr(receiver, str(target))(*rest, **kwargs_v)
            if kind == "call_module":
                return _run_module_on_meta(self.root.get_submodule(str(target)), args_v, kwargs_v)
        return _UNKNOWN

    def to_bool(self, obj: fx.Proxy) -> bool:
        value = getattr(obj, "value", _UNKNOWN)
        if value is not _UNKNOWN and not isinstance(value, torch.Tensor):
            return bool(value)
        return super().to_bool(obj)

    def iter(self, obj: fx.Proxy):
        value = getattr(obj, "value", _UNKNOWN)
        if value is not _UNKNOWN:
            return iter([obj[i] for i in range(len(value))])
        return super().iter(obj)

    # -- the interface call ------------------------------------------------------------------------

    def interface_call(self, implementation: str, args: tuple, kwargs: dict) -> fx.Proxy:
        """Record one call of the attention interface, every argument kept (args[0] is the module)."""
        node_args = tuple(self._as_argument(a) for a in args[1:])
        node_kwargs = {k: self._as_argument(v) for k, v in kwargs.items()}
        proxy = self.create_proxy("call_function", attention_interface_call, node_args, node_kwargs)
        proxy.node.meta["attention_interface"] = implementation
        self.interface_nodes.append(proxy.node)
        return proxy

    def _as_argument(self, value: Any) -> Any:
        if isinstance(value, fx.Proxy):
            return value
        if isinstance(value, (tuple, list)):
            return type(value)(self._as_argument(v) for v in value)
        if isinstance(value, dict):
            return {k: self._as_argument(v) for k, v in value.items()}
        if isinstance(value, torch.Tensor):
            # fx proxies parameters and buffers read through `self.<name>`; one reached another way
            # (e.g. `self._parameters["sinks"]`) still gets its get_attr edge, by identity.
            for name, tensor in itertools.chain(self.root.named_parameters(), self.root.named_buffers()):
                if tensor is value:
                    return self.create_proxy("get_attr", name, (), {})
            shape = "x".join(map(str, value.shape)) or "scalar"
            return self.create_proxy("call_function", foreign_value,
                                     (f"a {shape} tensor that is not a parameter or buffer",), {})
        if isinstance(value, nn.Module):
            return None
        try:
            return self.create_arg(value)
        except NotImplementedError:
            return self.create_proxy("call_function", foreign_value, (f"a {type(value).__name__}",), {})


@contextlib.contextmanager
def _interface_as_leaf(tracer: _SinkTracer) -> Iterator[None]:
    """Make every attention-interface lookup return the tracer's opaque stand-in."""
    from transformers.modeling_utils import AttentionInterface

    def stand_in(implementation: str) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            return tracer.interface_call(str(implementation), args, kwargs)

        return call

    def get_interface(self, attn_implementation, default=None, *args, **kwargs):
        return stand_in(attn_implementation)

    def getitem(self, key):
        return stand_in(key)

    with mock.patch.object(AttentionInterface, "get_interface", get_interface), \
            mock.patch.object(AttentionInterface, "__getitem__", getitem):
        yield


# ---- guards: which instance state a trace depended on -----------------------------------------


def _token(value: Any) -> tuple:
    """What a guard compares for one attribute value."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return ("value", type(value), value)
    if isinstance(value, (tuple, list)) and all(v is None or isinstance(v, (bool, int, float, str))
                                                for v in value):
        return ("value", type(value), tuple(value))
    if isinstance(value, torch.Tensor):
        return ("tensor", isinstance(value, nn.Parameter), tuple(value.shape), value.dtype)
    if isinstance(value, nn.Module):
        return ("module", type(value))
    if inspect.ismethod(value):
        return ("method", value.__func__)
    # Configs, functions, ...: the very same object. The guard keeps a reference, so the id cannot
    # be reused by another object while the cache entry lives.
    return ("object", id(value), value)


def _instance_token(module: nn.Module, name: str) -> tuple:
    """The guard token of ``module.<name>`` as plain Python sees it (never an fx proxy)."""
    try:
        value = object.__getattribute__(module, name)  # instance dict, class attributes, methods
    except AttributeError:
        try:
            value = _REAL_MODULE_GETATTR(module, name)  # parameters, buffers, submodules
        except AttributeError:
            return ("missing",)
    return _token(value)


class _Recorder:
    """Collects the attributes of the traced module that its forward reads."""

    def __init__(self, root: nn.Module):
        self.root = root
        self.reads: dict[str, tuple] = {}

    def note(self, module: nn.Module, name: str) -> None:
        if module is not self.root or name in self.reads:
            return
        if name.startswith("__") or name in _MODULE_INTERNALS or name == "forward":
            return  # "forward" is part of the cache key already
        self.reads[name] = _instance_token(module, name)


_recorder = threading.local()

# A trace swaps the module's class and fx patches nn.Module process-wide: one trace at a time.
_TRACE_LOCK = threading.RLock()


def _note_read(module: nn.Module, name: str) -> None:
    recorder = getattr(_recorder, "active", None)
    if recorder is not None:
        recorder.note(module, name)


_tracing_classes: dict[tuple[type, Callable], type] = {}


def _tracing_class(cls: type, forward: Callable) -> type:
    """A subclass of ``cls`` whose forward is ``forward`` and whose attribute reads are recorded.

    The traced instance wears this class only for the duration of the trace.
    """
    key = (cls, forward)
    if key not in _tracing_classes:

        def __getattribute__(self, name):
            value = super(sub, self).__getattribute__(name)
            if not name.startswith("__"):
                _note_read(self, name)
            return value

        def __getattr__(self, name):  # parameters, buffers, submodules (fx proxies the first two)
            _note_read(self, name)
            return super(sub, self).__getattr__(name)

        sub = type(cls.__name__, (cls,), {"forward": forward, "__getattribute__": __getattribute__,
                                         "__getattr__": __getattr__, "__module__": cls.__module__})
        _tracing_classes[key] = sub
    return _tracing_classes[key]


# ---- the fuser ------------------------------------------------------------------------------------


def forward_function(module: nn.Module) -> Callable:
    """The function that is the module's forward, unwrapped (``@deprecate_kwarg`` & co)."""
    forward = vars(module).get("forward")  # fusers may bind a rewritten forward on the instance
    if forward is None:
        forward = type(module).forward
    forward = getattr(forward, "__func__", forward)
    return inspect.unwrap(forward)


_INTERFACE_NAMES = frozenset({"ALL_ATTENTION_FUNCTIONS", "AttentionInterface", "get_interface"})


def _names_interface(fn: Any) -> bool:
    code = getattr(inspect.unwrap(getattr(fn, "__func__", fn)), "__code__", None)
    return code is not None and bool(_INTERFACE_NAMES & set(code.co_names))


def looks_up_attention_interface(module: nn.Module) -> bool:
    """Cheap filter before tracing: does the module's code name the attention-interface registry?

    A model holds thousands of modules and a trace costs milliseconds; only those whose forward, or
    a ``forward`` up their class hierarchy (``super().forward(...)``), reads ``ALL_ATTENTION_FUNCTIONS``
    / ``AttentionInterface`` / ``get_interface`` are traced.
    """
    if _names_interface(vars(module).get("forward")):
        return True
    return _class_looks_up_attention_interface(type(module))


@functools.lru_cache(maxsize=None)
def _class_looks_up_attention_interface(cls: type) -> bool:
    return any(_names_interface(vars(klass).get("forward")) for klass in cls.__mro__)


def _hidden_size(module: nn.Module) -> int | None:
    size = getattr(getattr(module, "config", None), "hidden_size", None)
    if isinstance(size, int):
        return size
    for child in module.modules():
        if isinstance(child, nn.Linear):
            return child.in_features
    return None


def _compute_dtype(module: nn.Module) -> torch.dtype:
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()


def _placeholder_values(module: nn.Module, parameters: dict[str, inspect.Parameter]) -> dict[str, Any]:
    """Meta stand-ins for the inputs whose shape a forward commonly asks about."""
    dtype, hidden, n = _compute_dtype(module), _hidden_size(module), _META_TOKENS
    values: dict[str, Any] = {}
    if "hidden_states" in parameters and hidden is not None:
        values["hidden_states"] = torch.empty(1, n, hidden, dtype=dtype, device="meta")
    if "attention_mask" in parameters:
        values["attention_mask"] = torch.empty(1, 1, n, n, dtype=dtype, device="meta")
    if "position_ids" in parameters:
        values["position_ids"] = torch.empty(1, n, dtype=torch.long, device="meta")
    return values


def _peel(arg: Any) -> Any:
    while (isinstance(arg, fx.Node) and arg.op == "call_method" and arg.target in _PASS_THROUGH_METHODS
           and arg.args):
        arg = arg.args[0]
    return arg


def _describe(arg: Any) -> str:
    if isinstance(arg, fx.Node):
        if arg.target is foreign_value:
            return str(arg.args[0])
        target = getattr(arg.target, "__name__", arg.target)
        return f"the result of {arg.op} {target!r}"
    return repr(arg)


def _sink_of(node: fx.Node, root: nn.Module) -> SinkSite | None:
    """The sink one interface call receives as ``s_aux`` (None if it passes none)."""
    arg = node.kwargs.get("s_aux")
    if arg is None:
        return None
    arg = _peel(arg)
    if isinstance(arg, fx.Node) and arg.op == "get_attr":
        target = str(arg.target)
        if target in dict(root.named_parameters()):
            return SinkSite(target, "parameter")
        if target in dict(root.named_buffers()):
            return SinkSite(target, "buffer")
    raise SinkFuserError(f"s_aux is {_describe(arg)}; vLLM's Attention needs the sink parameter the "
                         "module holds (one value per head), not a tensor computed in forward")


@dataclasses.dataclass
class _Variant:
    guards: dict[str, tuple]
    site: AttentionSite

    def matches(self, module: nn.Module) -> bool:
        return all(_instance_token(module, name) == token for name, token in self.guards.items())


class SinkFuser:
    """Finds each attention module's sink through its FX graph; caches traces per class, guarded."""

    #: Guarded variants kept per class; a model has a handful (e.g. sliding vs full layers).
    MAX_VARIANTS = 64

    def __init__(self) -> None:
        self._variants: dict[tuple[type, Callable], list[_Variant]] = {}
        self._lock = threading.RLock()
        self.traces = 0  # traces run so far (how well the cache works)

    def find(self, module: nn.Module) -> AttentionSite | None:
        """The module's attention site, or None if its forward never reaches the interface."""
        if not looks_up_attention_interface(module):
            return None
        forward = forward_function(module)
        key = (type(module), forward)
        with self._lock:
            for variant in self._variants.get(key, ()):
                if variant.matches(module):
                    return variant.site
            site, guards = self._analyse(module, forward)
            variants = self._variants.setdefault(key, [])
            if len(variants) < self.MAX_VARIANTS:
                variants.append(_Variant(guards, site))
            return site if site.interface_calls or site.problem else None

    def scan(self, model: nn.Module, prefix: str = "") -> dict[str, AttentionSite]:
        """Qualified name -> site, for every module of ``model`` that calls the attention interface."""
        found = {}
        for name, module in model.named_modules(prefix=prefix):
            site = self.find(module)
            if site is not None:
                found[name] = site
        return found

    def trace(self, module: nn.Module) -> fx.Graph:
        """The (possibly partial) graph of the module's forward, for inspection and tests."""
        graph, _, _, _ = self._trace(module, forward_function(module))
        return graph

    # -- internals --------------------------------------------------------------------------------

    def _analyse(self, module: nn.Module, forward: Callable) -> tuple[AttentionSite, dict[str, tuple]]:
        graph, nodes, guards, error = self._trace(module, forward)
        name = type(module).__name__
        if not nodes:
            problem = None
            if error is not None:
                problem = (f"tracing its forward failed before the attention-interface call "
                           f"({type(error).__name__}: {error})")
            return AttentionSite(name, None, 0, problem), guards
        try:
            sinks = {_sink_of(node, module) for node in nodes} - {None}
        except SinkFuserError as e:
            return AttentionSite(name, None, len(nodes), str(e)), guards
        if len(sinks) > 1:
            paths = ", ".join(sorted(s.path for s in sinks))
            return AttentionSite(name, None, len(nodes),
                                 f"its interface calls pass different sinks ({paths})"), guards
        return AttentionSite(name, next(iter(sinks), None), len(nodes)), guards

    def _trace(self, module: nn.Module, forward: Callable):
        try:
            parameters = dict(list(inspect.signature(forward).parameters.items())[1:])  # drop self
        except (TypeError, ValueError) as e:
            return fx.Graph(), [], {}, e
        concrete: dict[str, Any] = {n: None for n in parameters if n in CACHE_ARGUMENTS}
        for p in parameters.values():
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                concrete["**" + p.name] = {}
        tracer = _SinkTracer(_placeholder_values(module, parameters))
        recorder = _Recorder(module)
        error: Exception | None = None
        original_class = module.__class__
        with _TRACE_LOCK, _interface_as_leaf(tracer):
            self.traces += 1
            _recorder.active = recorder
            module.__class__ = _tracing_class(original_class, forward)
            try:
                tracer.trace(module, concrete_args=concrete or None)
            except Exception as e:  # noqa: BLE001 - a partial graph may already hold the interface call
                error = e
                logger.debug("vllm-sinks: tracing %s stopped: %s", original_class.__name__, e)
            finally:
                module.__class__ = original_class
                _recorder.active = None
        return tracer.graph, list(tracer.interface_nodes), recorder.reads, error


#: The process-wide fuser the patches use (its cache lives as long as the process).
SINK_FUSER = SinkFuser()
