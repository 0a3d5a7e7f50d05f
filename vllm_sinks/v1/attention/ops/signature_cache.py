"""Recognise a call signature seen before in one C call, not twenty Python attribute reads.

A call signature of the prefill op is every tensor's shape, strides, dtype and device plus the
arguments that are not tensors. Reading the tensors' metadata in Python costs ~0.1 µs a field
(``q.shape`` builds a ``torch.Size``, ``q.stride()`` a tuple): ~2–3 µs for the op's six tensors,
more than the rest of a routed call. torch has a C check of exactly that metadata, the one
``torch.compile``'s guards use (``torch._C._dynamo.guards.TensorGuards``): ~0.12 µs plus ~0.1 µs a
tensor. So the fast paths (a call routed to upstream's op, a MiMo window layer) keep, per key of
the scalar arguments, the last few signatures seen with it as (check, value) pairs, newest first:

    entries = cache.get(scalar_key)
    for check, value in entries or ():
        if check(q, k, ...): <use value>

A miss takes the slow path (the checks and the plan cache) and ``remember``s its signature. Where
this torch has no such check (``signature_check`` is None), nothing is remembered and every call
takes the slow path: slower, never wrong.
"""

from __future__ import annotations

import torch

#: Signatures kept per scalar key (a ViT's images change the token count from one pass to the next;
#: alternating shapes must not rebuild the check on every call) and scalar keys per cache.
WAYS, MAX_KEYS = 4, 512


# Stand-ins in a check for an absent sink and an int bound (the check takes tensors only, and each
# tensor once: an argument of the call cannot stand in for another).
NO_SINKS, INT_BOUND = torch.empty(0), torch.empty(0)


def _tensor_guards():
    try:  # torch's own tensor check (what torch.compile's guards use)
        from torch._C._dynamo.guards import TensorGuards
    except ImportError:  # pragma: no cover - a torch without it: no fast path
        return None
    return TensorGuards


_GUARDS: list = []  # [torch's TensorGuards class, or None once it is missing or refused its arguments]


def signature_check(*tensors):
    """A C function that takes as many tensors and says whether they have these tensors' dtypes,
    devices, shapes and strides (and dispatch keys and requires_grad, which do not change between
    a model's calls). None where this torch has no such check (then never tried again: each try
    costs µs) or it refuses these tensors (one tensor passed twice)."""
    if not _GUARDS:
        _GUARDS.append(_tensor_guards())
    guards = _GUARDS[0]
    if guards is None:
        return None
    try:
        check = guards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                       dynamic_dims_strides=[list(t.stride()) for t in tensors]).check
    except Exception:  # noqa: BLE001 - a torch whose private check takes other arguments
        _GUARDS[0] = None
        return None
    return check if check(*tensors) else None


def remember(cache: dict, key, tensors: tuple, value) -> None:
    """Put ``value`` first under ``key`` for the signature of ``tensors`` (the oldest of WAYS goes)."""
    check = signature_check(*tensors)
    if check is None:
        return
    if len(cache) >= MAX_KEYS and key not in cache:
        cache.clear()
    cache[key] = ((check, value), *cache.get(key, ())[:WAYS - 1])
