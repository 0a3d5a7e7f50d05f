"""Our fork of one function of upstream's ``vllm/model_executor/models/transformers/fx_utils.py``:
``trace``, which the backend's fusers (``fuser.get_fuser``) read every module class through.

What upstream gets wrong (0.29 with transformers 5.24, measured): transformers 5.24 wraps the
attention modules' ``forward`` in ``@deprecate_kwarg`` (the ``past_key_values`` -> ``cache`` rename).
``torch.fx`` cannot trace such a wrapper (``ValueError: code: co_varnames is too small`` while it
patches the root function), ``trace`` returns the partial graph (placeholders only), and no fuser
matches. For GPT-OSS that is the fault behind the wrong answers at tensor parallel size > 1:

* GPT-OSS's tensor parallel plan in transformers 5.x names only ``embed_tokens``, so the attention
  projections are sharded only if the ``QKVFuser`` fuses them (into ``QKVParallelLinear`` + a
  row-parallel ``o_proj``);
* without the fusion ``q_proj``/``k_proj``/``v_proj``/``o_proj`` stay ``ReplicatedLinear``: every rank
  computes all heads, while ``create_attention_instances`` builds each rank's ``Attention`` for
  ``heads / tp`` heads. The attention kernel reads the wrong heads (or the shapes fail), and the
  replicated ``o_proj`` is never reduced.

At TP=1 nothing visible changes (the unfused projections compute the same thing), which is why only
TP > 1 broke. Families whose plan names their projections (Granite SWA, MiMo-V2-Flash) are sharded
by the plan and were right either way.

:func:`trace` traces with upstream's function; where that stops short of the output and the class's
``forward`` is a wrapper (``__wrapped__``, as ``functools.wraps`` leaves it), it traces again with the
class's innermost function bound as ``forward`` for the duration of the call, and returns whichever
graph got further (upstream's fusers match on partial graphs too, e.g. HY V4's, which stops at
data-dependent code past its projections). The fusers already
rewrite that innermost function (``recover_forward`` unwraps it), so what they fuse is the code they
analysed.

Hub kernels (transformers >= 5.20 with a ``kernels`` release in its range installed; 5.25 needs one)
turn ``apply_rotary_pos_emb`` & co into ``kernels`` ``Func`` modules held in the modeling module's
globals, outside every model's module tree. fx records a module call by its path in the tree, so the
trace ends there (``NameError: module is not installed as a submodule``), before the projections
upstream's fusers need. The retry also swaps, in the forwards' globals and only while it traces,
each such foreign module for a plain function calling its ``forward`` (:func:`foreign_modules_traced_through`):
fx traces through it as through any Python function.

vLLM is imported lazily.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterable, Iterator

from torch import fx, nn

from vllm_sinks.patches import install

_MISSING = object()


def complete(graph: fx.Graph | None) -> bool:
    """Did the trace reach the module's return (an ``output`` node)?"""
    return graph is not None and any(node.op == "output" for node in graph.nodes)


def innermost_forward(cls: type[nn.Module]) -> Any:
    """``cls.forward`` with every ``functools.wraps`` layer peeled off (itself if none)."""
    return inspect.unwrap(cls.forward)


@contextlib.contextmanager
def unwrapped_forward(cls: type[nn.Module]) -> Iterator[None]:
    """Bind ``cls.forward`` to its innermost function for the duration (restored after, even when
    ``forward`` was inherited)."""
    own = cls.__dict__.get("forward", _MISSING)
    cls.forward = innermost_forward(cls)
    try:
        yield
    finally:
        if own is _MISSING:
            del cls.forward
        else:
            cls.forward = own


def forward_functions(cls: type[nn.Module]) -> list[Callable]:
    """The ``forward`` functions of ``cls`` and its bases (nearest first), each unwrapped."""
    found = [vars(klass).get("forward") for klass in cls.__mro__]
    return [inspect.unwrap(getattr(fn, "__func__", fn)) for fn in found if fn is not None]


def through(foreign: nn.Module) -> Callable:
    """A plain function calling ``foreign.forward`` (``__wrapped__``: the module)."""

    def call_forward(*args: Any, **kwargs: Any) -> Any:
        return foreign.forward(*args, **kwargs)  # its forward, not __call__: fx's hook never sees it

    call_forward.__name__ = call_forward.__qualname__ = type(foreign).__name__
    call_forward.__wrapped__ = foreign
    return call_forward


@contextlib.contextmanager
def foreign_modules_traced_through(module: nn.Module, functions: Iterable[Callable]) -> Iterator[int]:
    """For the duration, each ``nn.Module`` held in the globals of ``functions`` that is not in
    ``module``'s tree (a hub-kernel ``Func``) is a plain function calling its ``forward`` there.
    Yields how many were swapped. A forward of the same modeling module running meanwhile in another
    thread would see the stand-in, which computes the same thing; vLLM traces while it builds."""
    tree = {id(m) for m in module.modules()}
    swapped = []
    try:
        for fn in functions:
            namespace = getattr(fn, "__globals__", None) or {}
            for name, value in list(namespace.items()):
                # A namespace two functions share is swapped once: a stand-in is no module.
                if isinstance(value, nn.Module) and id(value) not in tree:
                    swapped.append((namespace, name, value))
                    namespace[name] = through(value)
        yield len(swapped)
    finally:
        for namespace, name, value in reversed(swapped):
            namespace[name] = value


def trace(module: nn.Module) -> fx.Graph | None:
    """Replacement of ``fx_utils.trace`` (and of the name ``fuser.trace``): upstream's trace, and a
    second one through the unwrapped ``forward`` and the foreign modules it calls where the first
    stops short."""
    upstream = install.original(trace)
    graph = upstream(module)
    cls = type(module)
    if complete(graph):
        return graph
    wrapped = innermost_forward(cls) is not cls.forward
    with contextlib.ExitStack() as retrying:
        if wrapped:
            retrying.enter_context(unwrapped_forward(cls))
        foreign = retrying.enter_context(foreign_modules_traced_through(module, forward_functions(cls)))
        if not wrapped and not foreign:
            return graph
        retry = upstream(module)
    # Upstream's fusers work on partial graphs too (a trace may stop at data-dependent code); the
    # retry got past the wrapper, so whatever it reached is at least what the first one did.
    return retry if _size(retry) > _size(graph) else graph


def _size(graph: fx.Graph | None) -> int:
    return -1 if graph is None else len(graph.nodes)
