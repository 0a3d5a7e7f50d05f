"""SinkFuser: find, in the FX graph, the learnable sink each Hugging Face attention module hands the
attention interface as ``s_aux``.

Why a graph and not a name: GPT-OSS, Granite SWA, DeepSeek V4, MiMo-V2-Flash, HY V4 ... all pass
``s_aux=self.sinks`` today, but the attribute's name, the module that owns it and whether it exists on a
given layer (MiMo-V2-Flash's full-attention layers have ``sinks = None``) are model choices. The
forward's dataflow says which tensor reaches ``s_aux``; nothing else has to be guessed.

How a module is traced (a ``torch.fx.Tracer`` subclass):

* every submodule is a leaf (one ``call_module`` node): we only need the attention module's own body;
* the attention-interface registry the forward reads (``ALL_ATTENTION_FUNCTIONS``) is swapped, in that
  forward's globals and only during the trace, for a stand-in whose every lookup returns a recorder:
  the call becomes one node of :func:`attention_interface_call` that keeps all its arguments, keywords
  included. A parameter passed as ``s_aux`` is then an edge to a ``get_attr`` node that names it;
* each node also gets its value on meta tensors (``node.meta["val"]``), and a proxy answers tensor
  metadata (``x.shape``, ``x.dtype``, ``x.size()``) with the concrete value: the usual shape code
  (``(*input_shape, -1, d)``, ``if mask.dtype == torch.bool``) then runs as plain Python;
* the forward is traced unwrapped: transformers >= 5.24 wraps it in ``@deprecate_kwarg``, whose
  ``*args, **kwargs`` fx cannot turn into placeholders. The KV-cache argument (``past_key_values``,
  ``cache`` in 5.24) is fixed to None and ``**kwargs`` to ``{}``: vLLM passes neither, and neither
  changes which tensor reaches ``s_aux``;
* fx traces a *view* of the module, never the module: see :func:`_tracing_view`.

Traces are cached per class, but a cached answer is reused only for an instance whose every attribute
the trace read (``sinks``, ``sliding_window``, ``config`` ...) matches (the way dynamo guards a graph),
so one layer's answer never leaks into another layer whose sink is ``None``.

Imports without vLLM: torch only (transformers lazily, while tracing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import logging
import operator
import threading
from typing import Any, Callable, Iterator

import torch
from torch import fx, nn

logger = logging.getLogger(__name__)

#: Forward parameters that carry the KV cache object (name changed across transformers versions).
CACHE_ARGUMENTS = ("past_key_values", "cache", "past_key_value")

#: Method calls that hand their input on unchanged but for dtype/layout; ``s_aux=self.sinks.float()``
#: still names the ``sinks`` parameter.
_PASS_THROUGH_METHODS = frozenset({"to", "float", "half", "bfloat16", "double", "type", "type_as",
                                   "contiguous", "detach", "clone"})

#: Tensor metadata a proxy answers concretely (it does not depend on the input values, and forwards
#: hand it to callees fx cannot trace, such as ``torch.finfo(x.dtype)``).
_METADATA = frozenset({"shape", "dtype", "device", "ndim", "layout", "is_cuda", "size", "dim", "numel",
                       "is_floating_point"})

#: Token count of the fabricated meta inputs: any small size works, they only answer shape questions.
_META_TOKENS = 16

#: nn.Module's own machinery (and what fx calls on the root): reading it says nothing about the model.
_MODULE_INTERNALS = frozenset(vars(nn.Module())) | frozenset(dir(nn.Module))

_INTERFACE_NAMES = frozenset({"ALL_ATTENTION_FUNCTIONS", "AttentionInterface", "get_interface"})

_UNKNOWN = object()  # a node whose value could not be computed on meta tensors

# fx rebinds nn.Module.__call__/__getattr__ while it traces (that is how it sees submodule calls and
# parameter reads) and we swap registries in module globals: one trace at a time. It also guards
# the fuser's cache.
_LOCK = threading.RLock()


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


def attention_interface_call(*args: Any, **kwargs: Any) -> Any:
    """Target of the node that stands for the attention-interface call; a trace never runs it."""
    raise RuntimeError("attention_interface_call is a tracing placeholder and cannot run")


# ---- the tracer --------------------------------------------------------------------------------


def _value(x: Any) -> Any:
    return x.node.meta.get("val", _UNKNOWN) if isinstance(x, fx.Proxy) else x


class _MetaProxy(fx.Proxy):
    """A proxy that answers tensor metadata from its node's meta value."""

    def __getattr__(self, name: str) -> Any:
        value = _value(self)
        if value is _UNKNOWN or name.startswith("__"):
            return super().__getattr__(name)
        if isinstance(value, torch.Tensor) and name in _METADATA:
            return getattr(value, name)
        if callable(getattr(value, name, None)):
            return super().__getattr__(name)  # a method: fx's Attribute, whose call is a node
        return self.tracer.create_proxy("call_function", getattr, (self, name), {})  # x.T: valued

    def __len__(self) -> int:
        value = _value(self)
        return super().__len__() if value is _UNKNOWN else len(value)


class _Unknowable(Exception):
    pass


def _meta_values(tree: Any) -> Any:
    """``tree`` with every proxy replaced by its value and every tensor by a meta one."""

    def one(x: Any) -> Any:
        x = _value(x)
        if x is _UNKNOWN:
            raise _Unknowable
        return torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x

    return fx.node.map_aggregate(tree, one)


class _SinkTracer(fx.Tracer):
    """Submodules are leaves, every node carries its meta value, the interface call is one node."""

    def __init__(self, inputs: dict[str, torch.Tensor]):
        super().__init__()
        self.proxy_buffer_attributes = True  # a buffer passed as s_aux becomes get_attr too
        self.inputs = inputs  # placeholder name -> meta tensor
        self.interface_nodes: list[fx.Node] = []
        self.evaluating = False  # a node's value is being computed: fx's hooks then step aside

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True

    def call_module(self, m, forward, args, kwargs):
        if self.evaluating:  # a leaf running on meta tensors calls its own children for real
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if self.evaluating:  # the same leaf reads its real (here: meta) parameters
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _MetaProxy(node, self)

    def create_proxy(self, kind, target, args, kwargs, *rest, **kw_rest):
        proxy = super().create_proxy(kind, target, args, kwargs, *rest, **kw_rest)
        proxy.node.meta["val"] = self._evaluate(kind, target, args, kwargs)
        return proxy

    def _evaluate(self, kind: str, target: Any, args: tuple, kwargs: dict) -> Any:
        if kind == "placeholder":
            return self.inputs.get(target, _UNKNOWN)
        if target is attention_interface_call:
            return _UNKNOWN
        self.evaluating = True
        try:
            if kind == "get_attr":
                return _meta_values(operator.attrgetter(target)(self.root))
            args, kwargs = _meta_values(args), _meta_values(kwargs)
            if kind == "call_function":
                return target(*args, **kwargs)
            if kind == "call_method":
                return getattr(args[0], target)(*args[1:], **kwargs)
            if kind == "call_module":
                module = self.root.get_submodule(target)
                state = {name: torch.empty_like(t, device="meta")
                         for name, t in itertools.chain(module.named_parameters(), module.named_buffers())}
                return torch.func.functional_call(module, state, args, kwargs)
        except Exception:  # noqa: BLE001 - unknown is an answer; fatal only if a later question needs it
            pass
        finally:
            self.evaluating = False
        return _UNKNOWN

    def to_bool(self, obj: fx.Proxy) -> bool:
        value = _value(obj)
        if value is _UNKNOWN or isinstance(value, torch.Tensor):
            return super().to_bool(obj)  # data-dependent control flow: the trace stops here
        return bool(value)

    def iter(self, obj: fx.Proxy):
        value = _value(obj)
        return super().iter(obj) if value is _UNKNOWN else iter([obj[i] for i in range(len(value))])

    def interface_call(self, implementation: str, module: nn.Module, *args: Any, **kwargs: Any) -> fx.Proxy:
        """Record one call of the attention interface as one node; every argument but the module kept."""

        def argument(x: Any) -> Any:
            try:
                return self.create_arg(x)
            except NotImplementedError:  # an object fx cannot put in a graph: say what it was
                return f"<a {type(x).__name__}>"

        args, kwargs = fx.node.map_aggregate((args, kwargs), argument)
        node = self.create_node("call_function", attention_interface_call, args, kwargs)
        node.meta["attention_interface"] = implementation
        self.interface_nodes.append(node)
        return self.proxy(node)  # no value: what comes after the call does not matter


class _InterfaceStandIn:
    """Takes an attention-interface registry's place in a traced forward's globals: every lookup
    returns the tracer's recorder; anything else is the real registry's."""

    def __init__(self, registry: Any, tracer: _SinkTracer):
        self._registry, self._tracer = registry, tracer

    def get_interface(self, implementation: str, default: Any = None, *args: Any, **kwargs: Any) -> Callable:
        return functools.partial(self._tracer.interface_call, str(implementation))

    get = get_interface

    def __getitem__(self, implementation: str) -> Callable:
        return self.get_interface(implementation)

    def __contains__(self, key: str) -> bool:
        return key in self._registry

    def __getattr__(self, name: str) -> Any:
        return getattr(self._registry, name)


@contextlib.contextmanager
def _interface_stand_ins(module: nn.Module, tracer: _SinkTracer) -> Iterator[None]:
    """Swap every registry the module's forwards read for a stand-in, in the forwards' own globals.

    Scoped to the modules defining those forwards (an inherited ``super().forward`` may live in
    another one) and to the trace. A forward of the same model class running meanwhile in another
    thread would see the stand-in; vLLM traces while it builds the model, before any forward runs.
    """
    from transformers.modeling_utils import AttentionInterface

    swapped = []
    try:
        for fn in _forwards(module):
            namespace = getattr(fn, "__globals__", {})
            for name in getattr(getattr(fn, "__code__", None), "co_names", ()):
                registry = namespace.get(name)
                if isinstance(registry, AttentionInterface):  # a stand-in already is not one
                    swapped.append((namespace, name, registry))
                    namespace[name] = _InterfaceStandIn(registry, tracer)
        yield
    finally:
        for namespace, name, registry in reversed(swapped):
            namespace[name] = registry


def _tracing_view(module: nn.Module, forward: Callable, reads: set[str]) -> nn.Module:
    """What fx traces in the module's place: an instance of a throwaway subclass of its class whose
    ``forward`` is ``forward`` and which adds the name of every attribute it is asked for to ``reads``.

    It holds a shallow copy of the module's ``__dict__`` (the same parameter, buffer and submodule
    dicts, the same config), so the forward sees the module's state while whatever the trace sets on
    its root (fx stows constant tensors there) lands on the view. A subclass instance, not a wrapper,
    so that ``super().forward()`` and ``isinstance`` in the forward keep working.
    """
    cls = type(module)

    def __getattribute__(self, name: str) -> Any:
        if name not in _MODULE_INTERNALS:
            reads.add(name)
        return super(view_class, self).__getattribute__(name)  # then nn.Module.__getattr__ (fx's)

    view_class = type(cls.__name__, (cls,), {"forward": forward, "__getattribute__": __getattribute__,
                                             "__module__": cls.__module__})
    view = object.__new__(view_class)
    vars(view).update(vars(module))
    return view


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
    """The guard token of ``module.<name>``: instance dict and class first, then nn.Module's stores."""
    try:
        return _token(object.__getattribute__(module, name))
    except AttributeError:
        for store in ("_parameters", "_buffers", "_modules"):
            if name in vars(module).get(store, {}):
                return _token(vars(module)[store][name])
        return ("missing",)


@dataclasses.dataclass
class _Variant:
    guards: dict[str, tuple]
    site: AttentionSite

    def matches(self, module: nn.Module) -> bool:
        return all(_instance_token(module, name) == token for name, token in self.guards.items())


# ---- the fuser ------------------------------------------------------------------------------------


def _forwards(module: nn.Module) -> list[Callable]:
    """The module's forward functions, unwrapped: one bound on the instance, then its classes'."""
    found = [vars(module).get("forward")] + [vars(klass).get("forward") for klass in type(module).__mro__]
    return [inspect.unwrap(getattr(fn, "__func__", fn)) for fn in found if fn is not None]


def forward_function(module: nn.Module) -> Callable:
    """The function that is the module's forward, unwrapped (``@deprecate_kwarg`` & co)."""
    forward = vars(module).get("forward") or type(module).forward  # fusers may bind one on the instance
    return inspect.unwrap(getattr(forward, "__func__", forward))


def looks_up_attention_interface(module: nn.Module) -> bool:
    """Cheap filter before tracing: does a forward of the module (its own, or one up its class
    hierarchy: ``super().forward(...)``) name the attention-interface registry? A model holds
    thousands of modules and a trace costs tens of milliseconds."""
    return any(_INTERFACE_NAMES & set(getattr(getattr(fn, "__code__", None), "co_names", ()))
               for fn in _forwards(module))


def _placeholder_values(module: nn.Module, parameters: dict[str, inspect.Parameter]) -> dict[str, Any]:
    """Meta stand-ins for the inputs whose shape a forward commonly asks about."""
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.get_default_dtype())
    hidden = getattr(getattr(module, "config", None), "hidden_size", None)
    if not isinstance(hidden, int):
        hidden = next((m.in_features for m in module.modules() if isinstance(m, nn.Linear)), None)
    shapes = {"hidden_states": (1, _META_TOKENS, hidden), "attention_mask": (1, 1, _META_TOKENS, _META_TOKENS)}
    values = {name: torch.empty(shape, dtype=dtype, device="meta") for name, shape in shapes.items()
              if name in parameters and None not in shape}
    if "position_ids" in parameters:
        values["position_ids"] = torch.empty(1, _META_TOKENS, dtype=torch.long, device="meta")
    return values


def _sink_of(node: fx.Node, root: nn.Module) -> SinkSite | None:
    """The sink one interface call receives as ``s_aux`` (None if it passes none)."""
    arg = node.kwargs.get("s_aux")
    if arg is None:
        return None
    while isinstance(arg, fx.Node) and arg.op == "call_method" and arg.target in _PASS_THROUGH_METHODS:
        arg = arg.args[0]
    if isinstance(arg, fx.Node) and arg.op == "get_attr":
        if arg.target in dict(root.named_parameters()):
            return SinkSite(arg.target, "parameter")
        if arg.target in dict(root.named_buffers()):
            return SinkSite(arg.target, "buffer")
        what = f"{arg.target!r}, a tensor that is not a parameter or buffer"
    elif isinstance(arg, fx.Node):
        what = f"the result of {arg.op} {getattr(arg.target, '__name__', arg.target)!r}"
    else:
        what = repr(arg)
    raise SinkFuserError(f"s_aux is {what}; vLLM's Attention needs the sink parameter the module "
                         "holds (one value per head), not a tensor computed in forward")


class SinkFuser:
    """Finds each attention module's sink through its FX graph; caches traces per class, guarded."""

    #: Guarded variants kept per class; a model has a handful (e.g. sliding vs full layers).
    MAX_VARIANTS = 64

    def __init__(self) -> None:
        self._variants: dict[tuple[type, Callable], list[_Variant]] = {}
        self.traces = 0  # traces run so far (how well the cache works)

    def find(self, module: nn.Module) -> AttentionSite | None:
        """The module's attention site, or None if its forward never reaches the interface."""
        if not looks_up_attention_interface(module):
            return None
        forward = forward_function(module)
        key = (type(module), forward)
        with _LOCK:
            site = next((v.site for v in self._variants.get(key, ()) if v.matches(module)), None)
            if site is None:
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
        return self._trace(module, forward_function(module))[0]

    # -- internals --------------------------------------------------------------------------------

    def _analyse(self, module: nn.Module, forward: Callable) -> tuple[AttentionSite, dict[str, tuple]]:
        _, nodes, guards, error = self._trace(module, forward)
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
        """Graph, interface-call nodes, guards (the attributes read, as tokens) and the error if any."""
        try:
            parameters = dict(list(inspect.signature(forward).parameters.items())[1:])  # drop self
        except (TypeError, ValueError) as e:
            return fx.Graph(), [], {}, e
        concrete: dict[str, Any] = {n: None for n in parameters if n in CACHE_ARGUMENTS}
        concrete.update({"**" + p.name: {} for p in parameters.values() if p.kind is p.VAR_KEYWORD})
        tracer = _SinkTracer(_placeholder_values(module, parameters))
        reads: set[str] = set()
        error: Exception | None = None
        with _LOCK, _interface_stand_ins(module, tracer):
            self.traces += 1
            try:
                tracer.trace(_tracing_view(module, forward, reads), concrete_args=concrete or None)
            except Exception as e:  # noqa: BLE001 - a partial graph may already hold the interface call
                error = e
                logger.debug("vllm-sinks: tracing %s stopped: %s", type(module).__name__, e)
        guards = {name: _instance_token(module, name) for name in sorted(reads)}
        return tracer.graph, list(tracer.interface_nodes), guards, error


#: The process-wide fuser the patches use (its cache lives as long as the process).
SINK_FUSER = SinkFuser()
