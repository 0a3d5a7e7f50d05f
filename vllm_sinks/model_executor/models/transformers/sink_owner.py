"""Who serves each attention module's sink on vLLM >= 0.30 in auto mode: upstream or vllm-sinks.

vLLM 0.30+ finds the sink an HF attention module hands its attention interface by reading the
forward's source (``AttentionFuser``): it resolves ``s_aux=self.<attr>`` (or a literal) and nothing
else. A sink on a nested submodule (``s_aux=self.holder.sinks``), bound to a local first (``sinks =
self.sinks``) or held in a buffer is missed (no ``sinks=`` for ``Attention``; the first forward then
fails upstream's ``check_sinks``) or refused (``ValueError`` at load). The SinkFuser traces the
dataflow and finds those. Auto mode keeps upstream's answer wherever it found a parameter, and takes
over only the modules where it did not and the SinkFuser finds a sink, decided per module at load.

:func:`decide` and :func:`summary` are pure (tested without vLLM); :func:`upstream_lookup` asks
upstream's own ``AttentionFuser`` (passed in) what it would do, on the still-pristine module.
"""

from __future__ import annotations

import ast
import dataclasses
from typing import Any, Iterable

from torch import nn

from vllm_sinks.model_executor.models.transformers.fusers.sink import AttentionSite, forward_function

UPSTREAM, OURS = "upstream", "vllm-sinks"

#: The keyword a Hugging Face attention module passes its sink under.
SINK_KEYWORD = "s_aux"


@dataclasses.dataclass(frozen=True)
class UpstreamLookup:
    """What upstream's ``AttentionFuser`` makes of one attention module."""

    expression: str | None  # the source of its ``s_aux=`` argument; None where the call has none
    found: bool  # it resolved to a parameter, which upstream hands to ``Attention``
    error: str | None = None  # it refused the module (``ValueError`` at load)


@dataclasses.dataclass(frozen=True)
class Verdict:
    owner: str  # UPSTREAM or OURS
    has_sink: bool
    reason: str


def _constants(code: Any) -> Iterable[Any]:
    for const in getattr(code, "co_consts", ()):
        if isinstance(const, tuple):
            yield from const
        elif hasattr(const, "co_consts"):  # a nested function or comprehension
            yield from _constants(const)
        else:
            yield const


def names_sink_keyword(module: nn.Module) -> bool:
    """Does the module's forward name ``s_aux`` at all (a keyword argument or a dict key)?

    Python keeps call keywords and string keys among the code's constants, so this costs no trace. A
    forward that never names it passes no sink for either lookup to find, and is not traced.
    """
    try:
        fn = forward_function(module)
    except (AttributeError, IndexError):
        return False
    return SINK_KEYWORD in set(_constants(getattr(fn, "__code__", None)))


def upstream_lookup(fuser_cls: type, module: nn.Module) -> UpstreamLookup | None:
    """Upstream's verdict on ``module``, or None where its ``AttentionFuser`` does not match it."""
    fuser = fuser_cls.match(None, module)
    if fuser is None:
        return None
    expr = getattr(fuser, "s_aux_expr", None)
    text = ast.unparse(expr) if isinstance(expr, ast.AST) else None
    try:
        sink = fuser.sinks(module)
    except ValueError as e:
        return UpstreamLookup(text, False, str(e))
    return UpstreamLookup(text, sink is not None)


def decide(lookup: UpstreamLookup, site: AttentionSite | None) -> Verdict:
    """Upstream keeps every module it serves or where the SinkFuser finds no sink to serve."""
    shown = f"`{SINK_KEYWORD}={lookup.expression}`" if lookup.expression else f"no `{SINK_KEYWORD}=`"
    if lookup.found:
        return Verdict(UPSTREAM, True, f"upstream's AST lookup resolved {shown}")
    sink = site.sink if site is not None else None
    if sink is None:
        why = f"; the SinkFuser: {site.problem}" if site is not None and site.problem else ""
        if lookup.error:
            return Verdict(UPSTREAM, False, f"upstream refuses {shown} ({lookup.error}) and the "
                                            f"SinkFuser found no sink to serve{why}")
        return Verdict(UPSTREAM, False, f"no sink ({shown}){why}")
    if lookup.error:
        return Verdict(OURS, True, f"upstream's AST lookup refuses {shown} ({lookup.error}); the "
                                   f"SinkFuser traced it to `{sink.path}`")
    return Verdict(OURS, True, f"upstream's AST lookup finds no parameter in {shown} (it resolves "
                               f"only `self.<attr>`); the SinkFuser traced it to `{sink.path}`")


def summary(model: str, verdicts: dict[str, tuple[str, Verdict]]) -> str:
    """One report line for a model: ``{module name: (module class, verdict)}`` -> who served its sinks.

    Modules that agree (same class, same owner, same reason) are counted, not listed.
    """
    groups: dict[tuple[str, str, bool, str], int] = {}
    for cls, verdict in verdicts.values():
        key = (verdict.owner, cls, verdict.has_sink, verdict.reason)
        groups[key] = groups.get(key, 0) + 1
    with_sinks = [(k, n) for k, n in groups.items() if k[2]]
    if not with_sinks:
        return f"transformers-sinks: {model}: no attention sinks; upstream's backend serves it unchanged"
    parts = []
    for (owner, cls, _, reason), n in sorted(with_sinks, key=lambda item: item[0][0] != OURS):
        who = "vllm-sinks (SinkFuser)" if owner == OURS else "upstream"
        parts.append(f"{n} {cls} layer{'s' if n > 1 else ''} served by {who}: {reason}")
    return f"transformers-sinks: {model}: sinks of " + "; ".join(parts)
