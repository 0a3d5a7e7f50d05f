"""Bring the GPU's clocks up before the first timed case: they idle low (345 MHz on the H200)
between compiles, and the first case would otherwise be timed at a low clock."""

from __future__ import annotations

import time

import torch


def warm_gpu(seconds: float = 1.0) -> None:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t0 = time.time()
    while time.time() - t0 < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
