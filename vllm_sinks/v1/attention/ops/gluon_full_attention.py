"""Hopper kernel of the prefill op for attention without a window: a Gluon kernel (work in progress).

Interface only for now (``FullLaunch.plan`` takes no call yet); the kernel lands in the next commit.
Same interface as ``gluon_window_attention.WalkLaunch``: the front door asks ``plan`` whether it
takes a call and launches what it returns.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_sinks.v1.attention.ops.prefill_attention_problem import Problem


def full_unavailable(device: torch.device) -> str | None:
    """Why the kernel cannot run on ``device`` (None when it can)."""
    return "not built yet"


@dataclasses.dataclass(frozen=True)
class FullLaunch:
    """A validated problem bound to the Hopper full-attention kernel (``plan`` says whether it
    fits: no window, an NVIDIA sm_90 GPU, fp16/bf16, head dim <= 128, a host-side length bound)."""

    name = "full"

    @classmethod
    def plan(cls, p: Problem, q, k, v, o, b_start_loc, b_seq_len, sinks) -> "FullLaunch | None":
        return None

    def ready(self, max_len_hint: int) -> tuple | None:
        """The direct C launch of this bound once launched (``DirectLauncher.ready``), else None."""
        return None

    def __call__(self, q, k, v, o, b_start_loc, b_seq_len, sinks, max_len_hint: int) -> bool:
        """Launch; False (nothing launched) when the kernel failed to compile: the caller falls
        back to the portable kernel."""
        return False
