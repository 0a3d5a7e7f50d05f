"""The Gluon names the Hopper kernels use, mapped across Triton releases, and where those kernels
may run (``hopper_unavailable``): one place for both.

Gluon (``triton.experimental.gluon``) renames things between releases, and users run several
(3.7.1 for vLLM 0.27–0.32, 3.8.x for 0.33, 3.9.0 for the vLLM that moves to torch 2.15). The kernel
(``gluon_window_attention``) imports every Gluon name it needs from here; a rename in a new release
is one line below. Each alias takes the newer name where the release has it:

- ``cta_barrier``: the CTA barrier — ``gl.thread_barrier`` in 3.6, ``gl.barrier`` from 3.7 (3.9
  has no ``thread_barrier``);
- ``async_load``: cp.async of a global tensor into shared memory — ``async_copy_global_to_shared``
  up to 3.7, ``async_load`` from 3.8 (3.9 raises on the old name: "async_copy_global_to_shared has
  been removed; call async_load instead"). Same arguments: (shared view, pointers, mask);
- ``reinterpret(view, dtype, shape, layout)``: a shared-memory view seen as another shape —
  the method ``_reinterpret`` up to 3.8, ``reinterpret`` from 3.9 (which drops ``_reinterpret``);
- ``tma_load(descriptor, coordinates, mbarrier, shared view)``: a TMA copy of one box into shared
  memory, completing on the mbarrier — ``tma.async_copy_global_to_shared`` in 3.7,
  ``tma.async_load`` from 3.8 (3.9 keeps the old name only to raise). ``mbarrier`` (allocate,
  init, expect, wait) and the host's ``TensorDescriptor`` (``HostTensorDescriptor``) have kept
  their names from 3.7 to 3.9.

Importing this module never fails: ``IMPORT_ERROR`` says why Gluon is unavailable (None when it is),
and the kernel module then has no fast path.
"""

from __future__ import annotations

import torch
import triton

from vllm_sinks.v1.attention.ops.prefill_attention_problem import on_nvidia_gpu

#: Triton releases whose GPU tests of the Gluon kernels passed (tests/gpu).
TESTED_TRITON = ("3.6.", "3.7.", "3.8.", "3.9.")
CAPABILITY = (9, 0)  # wgmma: sm_90 (Hopper)

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma,
                                                                  warpgroup_mma_init,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as HostTensorDescriptor
    from triton.language.core import builtin

    cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    commit_group = async_copy.commit_group
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # Methods cannot be aliased by name: a builtin that calls the release's method.
    _REINTERPRET = "reinterpret" if hasattr(gl.shared_memory_descriptor, "reinterpret") else \
        "_reinterpret"

    @builtin
    def reinterpret(view, dtype, shape, layout, _semantic=None):
        return getattr(view, _REINTERPRET)(dtype, shape, layout, _semantic=_semantic)

    wait_group = async_copy.wait_group
    IMPORT_ERROR: str | None = None
except Exception as e:  # noqa: BLE001 - any failure means "no Gluon here"
    gluon = gl = async_copy = fence_async_shared = warpgroup_mma = warpgroup_mma_wait = None
    warpgroup_mma_init = mbarrier = tma = tma_load = HostTensorDescriptor = None
    cta_barrier = async_load = commit_group = wait_group = reinterpret = None
    IMPORT_ERROR = f"{type(e).__name__}: {e}"

_CAPABILITY_REASON: dict = {}  # device index -> why its compute capability rules the kernels out


def hopper_unavailable(device: torch.device) -> str | None:
    """Why the Gluon kernels cannot run on ``device`` (None when they can): Gluon imports, this
    Triton is one the GPU tests passed on, and the device is an NVIDIA GPU of compute capability
    9.0 (wgmma; asked once per device)."""
    if IMPORT_ERROR is not None:
        return f"triton.experimental.gluon unavailable ({IMPORT_ERROR})"
    if not triton.__version__.startswith(TESTED_TRITON):
        return (f"Triton {triton.__version__}: the Gluon kernels are tested on Triton "
                f"{', '.join(v + 'x' for v in TESTED_TRITON)}")
    if not on_nvidia_gpu(device):
        return f"tensors on {device.type}" + (" (ROCm)" if torch.version.hip else "") + \
            ", not an NVIDIA GPU (or the Triton interpreter)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY_REASON:
        major, minor = torch.cuda.get_device_capability(index)
        _CAPABILITY_REASON[index] = (None if (major, minor) == CAPABILITY else
                                     f"compute capability {major}.{minor}: wgmma needs sm_90 "
                                     "(Hopper)")
    return _CAPABILITY_REASON[index]


__all__ = ["CAPABILITY", "HostTensorDescriptor", "IMPORT_ERROR", "TESTED_TRITON", "async_load",
           "commit_group", "cta_barrier", "fence_async_shared", "gl", "gluon", "hopper_unavailable",
           "mbarrier", "reinterpret", "tma_load", "wait_group", "warpgroup_mma",
           "warpgroup_mma_init", "warpgroup_mma_wait"]
