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

vLLM is imported lazily.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator

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


def trace(module: nn.Module) -> fx.Graph | None:
    """Replacement of ``fx_utils.trace`` (and of the name ``fuser.trace``): upstream's trace, and a
    second one through the unwrapped ``forward`` where the first stops short behind a wrapper."""
    upstream = install.original(trace)
    graph = upstream(module)
    cls = type(module)
    if complete(graph) or innermost_forward(cls) is cls.forward:
        return graph
    with unwrapped_forward(cls):
        retry = upstream(module)
    # Upstream's fusers work on partial graphs too (a trace may stop at data-dependent code); the
    # retry got past the wrapper, so whatever it reached is at least what the first one did.
    return retry if _size(retry) > _size(graph) else graph


def _size(graph: fx.Graph | None) -> int:
    return -1 if graph is None else len(graph.nodes)
