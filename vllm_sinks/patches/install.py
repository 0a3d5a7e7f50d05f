"""Idempotent attribute replacement: the one way our patches edit vLLM objects."""

from __future__ import annotations

from typing import Any

_ORIGINAL = "__vllm_sinks_original__"
_PATCH = "__vllm_sinks_patch__"


def install(owner: Any, attr: str, new: Any, patch: str) -> bool:
    """Set ``owner.attr = new`` unless our patch is already there; remember the original.

    Returns True if this call changed something. ``new`` must accept attributes (functions do).
    """
    current = getattr(owner, attr)
    if patch in layers(current):  # already there, possibly under another patch's layer
        return False
    setattr(new, _ORIGINAL, current)
    setattr(new, _PATCH, patch)
    setattr(owner, attr, new)
    return True


def original(obj: Any) -> Any:
    """The upstream object a patched one replaced (``obj`` itself if it is not ours)."""
    return getattr(obj, _ORIGINAL, obj)


def patched_by(obj: Any) -> str | None:
    """Name of the vllm-sinks patch that installed ``obj``, or None."""
    return getattr(obj, _PATCH, None)


def layers(obj: Any) -> list[str]:
    """The vllm-sinks patches wrapped around ``obj``, outermost first (two patches may wrap the
    same method)."""
    found = []
    while hasattr(obj, _ORIGINAL):
        found.append(getattr(obj, _PATCH, None))
        obj = getattr(obj, _ORIGINAL)
    return found


def upstream(obj: Any) -> Any:
    """The upstream object under every vllm-sinks layer (two patches may wrap the same method)."""
    while hasattr(obj, _ORIGINAL):
        obj = getattr(obj, _ORIGINAL)
    return obj
