"""The op's CUDA-only parts stay off other platforms: the Hopper kernel only on an NVIDIA sm_90
GPU, CUDA-only launch options (``maxnreg``, ``enable_fp_fusion``) only there. ROCm builds of PyTorch also call their
devices "cuda" (and an MI300 reports compute capability 9.4), so the checks look at
``torch.version.hip``, not at the device type alone. No GPU needed: the platform is faked."""

from __future__ import annotations

import pytest
import torch

from vllm_sinks.v1.attention.ops import gluon_api
from vllm_sinks.v1.attention.ops import gluon_window_attention as gw
from vllm_sinks.v1.attention.ops import prefill_attention_problem as problem

CUDA = torch.device("cuda", 0)


@pytest.fixture
def nvidia(monkeypatch):
    """A process that is not interpreting, on a CUDA build of PyTorch."""
    monkeypatch.setattr(problem, "INTERPRETING", False)
    monkeypatch.setattr(torch.version, "hip", None)


def test_launch_options_are_cuda_only(nvidia, monkeypatch):
    assert problem.launch_options(CUDA, 4, 3, maxnreg=80) == dict(num_warps=4, num_stages=3, maxnreg=80,
                                                                 enable_fp_fusion=True)
    # FMA contraction by name: Triton 3.10 turns its default off (3.9 warns so)
    assert problem.launch_options(CUDA, 4) == dict(num_warps=4, enable_fp_fusion=True)
    assert problem.launch_options(torch.device("cpu"), 4, maxnreg=80) == dict(num_warps=4)
    monkeypatch.setattr(torch.version, "hip", "6.4.0")  # ROCm: "cuda" devices, no maxnreg
    assert problem.launch_options(CUDA, 4, 3, maxnreg=80) == dict(num_warps=4, num_stages=3)


def test_no_cuda_only_options_in_the_interpreter(monkeypatch):
    monkeypatch.setattr(problem, "INTERPRETING", True)
    assert problem.launch_options(CUDA, 4, maxnreg=80) == dict(num_warps=4)


def test_hopper_kernel_rejects_rocm(nvidia, monkeypatch):
    monkeypatch.setattr(gluon_api, "IMPORT_ERROR", None)
    monkeypatch.setattr(gw.triton, "__version__", gluon_api.TESTED_TRITON[-1] + "0")
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    monkeypatch.setattr(gluon_api, "_CAPABILITY_REASON", {})
    assert "not an NVIDIA GPU" in gw.walk_unavailable(CUDA)


def test_hopper_kernel_needs_exactly_sm90(nvidia, monkeypatch):
    monkeypatch.setattr(gluon_api, "IMPORT_ERROR", None)
    monkeypatch.setattr(gw.triton, "__version__", gluon_api.TESTED_TRITON[-1] + "0")
    for capability, ok in (((9, 0), True), ((9, 4), False), ((8, 0), False), ((10, 0), False)):
        monkeypatch.setattr(gluon_api, "_CAPABILITY_REASON", {})
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        reason = gw.walk_unavailable(CUDA)
        assert (reason is None) == ok, (capability, reason)
