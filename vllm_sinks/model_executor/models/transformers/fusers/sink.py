"""SinkFuser: find, in the FX graph, the learnable sink each Hugging Face attention module hands the
attention interface as ``s_aux``.

Why a graph and not a name: every sink family passes ``s_aux=self.sinks`` today, but the attribute's
name, the module that owns it and whether it exists on a given layer (MiMo-V2-Flash's full-attention
layers have ``sinks = None``) are model choices. The forward's dataflow says which tensor reaches
``s_aux``; nothing else has to be guessed.

How (a ``torch.fx.Tracer`` subclass): submodules are leaves; the attention-interface registry is
swapped, in the forward's own globals and only while it is traced, for a stand-in whose lookups
return a recorder, so the call is one node that keeps its keywords and ``s_aux`` is an edge to the
parameter's ``get_attr`` node; every node carries its value on meta tensors, so ``x.shape`` is
concrete and shape code runs as plain Python. The forward is traced unwrapped (transformers >= 5.24
wraps it in ``@deprecate_kwarg``, whose ``*args, **kwargs`` fx cannot turn into placeholders), with
the KV cache fixed to None and ``**kwargs`` to ``{}``: vLLM passes neither, and neither changes which
tensor reaches ``s_aux``. fx traces a view of the module, never the module (:func:`_tracing_view`).
A call of a module outside the tree (a hub-kernel ``Func`` of transformers >= 5.20 with ``kernels``,
at module level or in ``_kernel_funcs``; a module held in a plain attribute), which stock fx cannot
record, is one ``call_function`` node valued on meta tensors: the trace goes on past it.

Traces are cached per class, but an answer is reused only for an instance whose every attribute the
trace read (``sinks``, ``sliding_window``, ``config`` ...) matches (the way dynamo guards a graph), so
one layer's answer never leaks into another layer whose sink is ``None``.

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

from vllm_sinks.model_executor.models.transformers.fx_utils import forward_functions, through

logger = logging.getLogger(__name__)

#: Forward parameters that carry the KV cache object (name changed across transformers versions).
CACHE_ARGUMENTS = ("past_key_values", "cache", "past_key_value")

#: Methods that change only dtype/layout: ``s_aux=self.sinks.float()`` still names ``sinks``.
_PASS_THROUGH_METHODS = frozenset({"to", "float", "half", "bfloat16", "double", "type", "type_as",
                                   "contiguous", "detach", "clone"})

#: Tensor metadata a proxy answers with the concrete value: it does not depend on the input values,
#: and forwards hand it to callees fx cannot trace (``torch.finfo(x.dtype)``, ``(*shape, -1, d)``).
_METADATA = frozenset({"shape", "dtype", "device", "ndim", "layout", "is_cuda", "size", "dim", "numel",
                       "is_floating_point"})

_META_TOKENS = 16  # token count of the meta inputs: any small size answers shape questions

#: nn.Module's own machinery (and what fx calls on the root): reading it says nothing about the model.
_MODULE_INTERNALS = frozenset(vars(nn.Module())) | frozenset(dir(nn.Module))

_INTERFACE_NAMES = frozenset({"ALL_ATTENTION_FUNCTIONS", "AttentionInterface", "get_interface"})

_UNKNOWN = object()  # the value of a node that could not be computed on meta tensors

# One trace at a time: fx rebinds nn.Module.__call__/__getattr__ process-wide while it traces (that
# is how it sees submodule calls and parameter reads), and we swap registries in module globals.
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


def _meta_values(tree: Any) -> Any:
    """``tree`` with every proxy replaced by its value and every tensor by a meta one."""

    def one(x: Any) -> Any:
        if (x := _value(x)) is _UNKNOWN:
            raise LookupError("a value is unknown")
        return torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x

    return fx.node.map_aggregate(tree, one)


class _MetaProxy(fx.Proxy):
    """A proxy that answers tensor metadata, and ``len``, from its node's meta value."""

    def __getattr__(self, name: str) -> Any:
        value = _value(self)
        if isinstance(value, torch.Tensor) and name in _METADATA:
            return getattr(value, name)
        with contextlib.suppress(Exception):  # e.g. an attribute that raises on a meta tensor
            if value is not _UNKNOWN and not name.startswith("__") and not callable(getattr(value, name)):
                return self.tracer.create_proxy("call_function", getattr, (self, name), {})  # x.mT: valued
        return super().__getattr__(name)  # fx's Attribute: a method call becomes a node

    def __len__(self) -> int:
        return super().__len__() if _value(self) is _UNKNOWN else len(_value(self))


class _SinkTracer(fx.Tracer):
    """Submodules are leaves, every node carries its meta value, the interface call is one node."""

    def __init__(self, inputs: dict[str, torch.Tensor]):
        super().__init__()
        self.proxy_buffer_attributes = True  # a buffer passed as s_aux becomes get_attr too
        self.inputs = inputs  # placeholder name -> meta tensor
        self.interface_nodes: list[fx.Node] = []
        self.evaluating = False  # computing a node's value: fx's module hooks step aside

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True

    def call_module(self, m, forward, args, kwargs):
        # While a leaf runs on meta tensors its children run for real, not as nodes.
        if self.evaluating:
            return forward(*args, **kwargs)
        try:
            self.path_of_module(m)
        except NameError:  # outside the tree (a hub-kernel Func): fx has no path for a call_module
            return self.create_proxy("call_function", through(m), args, kwargs)  # one leaf node, valued
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        # ... and read their (meta) parameters as tensors, not as get_attr nodes.
        return attr_val if self.evaluating else super().getattr(attr, attr_val, parameter_proxy_cache)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _MetaProxy(node, self)

    def create_proxy(self, kind, target, args, kwargs, *rest, **kw_rest):
        proxy = super().create_proxy(kind, target, args, kwargs, *rest, **kw_rest)
        proxy.node.meta["val"] = self._evaluate(kind, target, args, kwargs)
        return proxy

    def _evaluate(self, kind: str, target: Any, args: tuple, kwargs: dict) -> Any:
        if kind == "placeholder":
            return self.inputs.get(target, _UNKNOWN)
        self.evaluating = True
        try:
            if kind == "get_attr":
                return _meta_values(operator.attrgetter(target)(self.root))
            args, kwargs = _meta_values(args), _meta_values(kwargs)
            if kind == "call_method":
                return getattr(args[0], target)(*args[1:], **kwargs)
            foreign = getattr(target, "__wrapped__", None) if kind == "call_function" else None
            if kind == "call_function" and not isinstance(foreign, nn.Module):
                return target(*args, **kwargs)
            # call_module, or a call of a module outside the tree: run it with its state on meta.
            module = foreign if kind == "call_function" else self.root.get_submodule(target)
            state = itertools.chain(module.named_parameters(), module.named_buffers())
            return torch.func.functional_call(module, dict(_meta_values(list(state))), args, kwargs)
        except Exception:  # noqa: BLE001 - unknown is an answer; fatal only if a later question needs it
            return _UNKNOWN
        finally:
            self.evaluating = False

    def to_bool(self, obj: fx.Proxy) -> bool:
        value = _value(obj)
        if value is _UNKNOWN or isinstance(value, torch.Tensor):
            return super().to_bool(obj)  # control flow on tensor data: the trace stops here
        return bool(value)

    def iter(self, obj: fx.Proxy):
        value = _value(obj)
        return super().iter(obj) if value is _UNKNOWN else iter([obj[i] for i in range(len(value))])

    def interface_call(self, implementation: str, module: nn.Module, *args: Any, **kwargs: Any) -> fx.Proxy:
        """One call of the attention interface as one node: every argument but the module kept."""

        def argument(x: Any) -> Any:
            try:
                return self.create_arg(x)
            except NotImplementedError:  # an object fx cannot put in a graph: say what it was
                return f"<a {type(x).__name__}>"

        node = self.create_node("call_function", attention_interface_call,
                                *fx.node.map_aggregate((args, kwargs), argument))
        node.meta["attention_interface"] = implementation
        self.interface_nodes.append(node)
        return self.proxy(node)  # valueless: nothing after the call matters


class _InterfaceStandIn:
    """Takes a registry's place in a traced forward's globals: lookups return the tracer's recorder."""

    def __init__(self, registry: Any, tracer: _SinkTracer):
        self._registry, self._tracer = registry, tracer

    def get_interface(self, implementation: str, *default: Any, **kwargs: Any) -> Callable:
        return functools.partial(self._tracer.interface_call, str(implementation))

    __getitem__ = get_interface

    def __getattr__(self, name: str) -> Any:  # anything else: the real registry's
        return getattr(self._registry, name)


@contextlib.contextmanager
def _interface_stand_ins(module: nn.Module, tracer: _SinkTracer) -> Iterator[None]:
    """Swap every registry the module's forwards name for a stand-in, in the forwards' own globals.

    A forward of the same modeling module running meanwhile in another thread would see it; vLLM
    traces while it builds the model, before any forward runs.
    """
    from transformers.modeling_utils import AttentionInterface

    swapped = []
    try:
        for fn in _forwards(module):
            namespace = getattr(fn, "__globals__", {})
            for name in getattr(getattr(fn, "__code__", None), "co_names", ()):
                # A namespace two forwards share is swapped once: a stand-in is no AttentionInterface.
                if isinstance(registry := namespace.get(name), AttentionInterface):
                    swapped.append((namespace, name, registry))
                    namespace[name] = _InterfaceStandIn(registry, tracer)
        yield
    finally:
        for namespace, name, registry in reversed(swapped):
            namespace[name] = registry


def _tracing_view(module: nn.Module, forward: Callable, reads: set[str]) -> nn.Module:
    """What fx traces in the module's place, so that the module itself is never changed.

    An instance of a throwaway subclass whose ``forward`` is ``forward`` and which adds the name of
    every attribute it is asked for to ``reads`` (the guards), holding a shallow copy of the module's
    ``__dict__``: the same parameter, buffer and submodule dicts and config, while what the trace sets
    on its root (fx stows constant tensors there) lands on the view. A subclass rather than a wrapper
    so that ``super().forward()`` and ``isinstance`` in the forward keep working.
    """

    def __getattribute__(self, name: str) -> Any:
        if name not in _MODULE_INTERNALS:
            reads.add(name)
        return super(view_class, self).__getattribute__(name)  # then nn.Module.__getattr__ (fx's)

    cls = type(module)
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
        stores = [vars(module).get(store, {}) for store in ("_parameters", "_buffers", "_modules")]
        return next((_token(store[name]) for store in stores if name in store), ("missing",))


# ---- the fuser ------------------------------------------------------------------------------------


def _forwards(module: nn.Module) -> list[Callable]:
    """The module's forward functions, unwrapped: one bound on the instance (fusers may bind a
    rewritten forward there), then those of its classes, nearest first."""
    own = vars(module).get("forward")
    return ([inspect.unwrap(getattr(own, "__func__", own))] if own is not None else []) + forward_functions(type(module))


def forward_function(module: nn.Module) -> Callable:
    """The function that is the module's forward, unwrapped (``@deprecate_kwarg`` & co)."""
    return _forwards(module)[0]


def looks_up_attention_interface(module: nn.Module) -> bool:
    """Cheap filter before tracing (a model holds thousands of modules; a trace costs milliseconds):
    does a forward of the module, or one it inherits (``super().forward()``), name the registry?"""
    return any(_INTERFACE_NAMES & set(getattr(getattr(fn, "__code__", None), "co_names", ()))
               for fn in _forwards(module))


def _placeholder_values(module: nn.Module, parameters: dict[str, inspect.Parameter]) -> dict[str, Any]:
    """Meta stand-ins for the inputs whose shape a forward commonly asks about."""
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.get_default_dtype())
    hidden = getattr(getattr(module, "config", None), "hidden_size", None)
    if not isinstance(hidden, int):
        hidden = next((m.in_features for m in module.modules() if isinstance(m, nn.Linear)), None)
    n = _META_TOKENS
    shapes = {"hidden_states": (1, n, hidden), "attention_mask": (1, 1, n, n), "position_ids": (1, n)}
    return {name: torch.empty(shape, dtype=torch.long if name == "position_ids" else dtype, device="meta")
            for name, shape in shapes.items() if name in parameters and None not in shape}


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


def _site(name: str, nodes: list[fx.Node], module: nn.Module, error: Exception | None) -> AttentionSite:
    if not nodes:
        problem = error and ("tracing its forward failed before the attention-interface call "
                             f"({type(error).__name__}: {error})")
        return AttentionSite(name, None, 0, problem)
    try:
        sinks = {_sink_of(node, module) for node in nodes} - {None}
    except SinkFuserError as e:
        return AttentionSite(name, None, len(nodes), str(e))
    if len(sinks) > 1:
        paths = ", ".join(sorted(s.path for s in sinks))
        return AttentionSite(name, None, len(nodes), f"its interface calls pass different sinks ({paths})")
    return AttentionSite(name, next(iter(sinks), None), len(nodes))


class SinkFuser:
    """Finds each attention module's sink through its FX graph; caches traces per class, guarded."""

    #: Guarded variants kept per class; a model has a handful (e.g. sliding vs full layers).
    MAX_VARIANTS = 64

    def __init__(self) -> None:
        # (class, forward) -> [(guards: attribute name -> token, site)]
        self._variants: dict[tuple[type, Callable], list[tuple[dict[str, tuple], AttentionSite]]] = {}
        self.traces = 0  # traces run so far (how well the cache works)

    def find(self, module: nn.Module) -> AttentionSite | None:
        """The module's attention site, or None if its forward never reaches the interface."""
        if not looks_up_attention_interface(module):
            return None
        forward = forward_function(module)
        with _LOCK:
            variants = self._variants.setdefault((type(module), forward), [])
            site = next((site for guards, site in variants
                         if all(_instance_token(module, n) == t for n, t in guards.items())), None)
            if site is None:
                graph, nodes, guards, error = self._trace(module, forward)
                site = _site(type(module).__name__, nodes, module, error)
                if len(variants) < self.MAX_VARIANTS:
                    variants.append((guards, site))
        return site if site.interface_calls or site.problem else None

    def scan(self, model: nn.Module, prefix: str = "") -> dict[str, AttentionSite]:
        """Qualified name -> site, for every module of ``model`` that calls the attention interface."""
        sites = {name: self.find(module) for name, module in model.named_modules(prefix=prefix)}
        return {name: site for name, site in sites.items() if site is not None}

    def trace(self, module: nn.Module) -> fx.Graph:
        """The (possibly partial) graph of the module's forward, for inspection and tests."""
        return self._trace(module, forward_function(module))[0]

    def _trace(self, module: nn.Module, forward: Callable):
        """Graph, interface-call nodes, guards (each attribute read, as a token) and the error if any."""
        try:
            parameters = dict(list(inspect.signature(forward).parameters.items())[1:])  # drop self
        except (TypeError, ValueError) as e:
            return fx.Graph(), [], {}, e
        concrete: dict[str, Any] = {n: None for n in parameters if n in CACHE_ARGUMENTS}
        concrete.update({"**" + p.name: {} for p in parameters.values() if p.kind is p.VAR_KEYWORD})
        tracer, reads, error = _SinkTracer(_placeholder_values(module, parameters)), set(), None
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
