"""The GPU tests' one skip rule for the Hopper kernels.

A module that tests one Hopper Gluon kernel marks itself ``hopper_kernel(gate=...)`` with that
kernel's gate (``gluon_full_attention.full_unavailable``, ``gluon_window_attention.walk_unavailable``):
where the gate gives a reason (no Gluon, an untested Triton, not an NVIDIA sm_90 GPU, the kernel's
env switch off), every test of the module skips with it. Without a CUDA GPU nothing here runs: the
``gpu`` marker skips each test (tests/conftest.py), and a module importing ``test_prefill_op_gpu``
skips at that import, as that module does.
"""

from __future__ import annotations

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "hopper_kernel(gate=...): tests of one Hopper Gluon kernel, "
                            "skipped with gate(device)'s reason where that kernel may not run")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        return
    reasons: dict = {}  # gate -> its reason on this machine (None: the kernel may run)
    for item in items:
        marker = item.get_closest_marker("hopper_kernel")
        if marker is None:
            continue
        gate = marker.kwargs["gate"]  # a keyword: a lone function argument would be the marked test
        if gate not in reasons:
            reasons[gate] = gate(torch.device("cuda"))
        if reasons[gate]:
            item.add_marker(pytest.mark.skip(reason=reasons[gate]))
