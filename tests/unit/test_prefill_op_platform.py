"""The prefill-op patch is CUDA-only: its probe reads vLLM's platform (faked here, no vLLM needed)."""

from __future__ import annotations

import enum
import sys
import types

import pytest
from packaging.version import Version

from vllm_sinks.patches import PATCHES, prefill_op
from vllm_sinks.patches.registry import Drift, Status, VllmInfo

PATCH = next(p for p in PATCHES if p.name == "prefill-op")
INFO = VllmInfo("vllm", "0.29.0", Version("0.29.0"), None, None)


class PlatformEnum(enum.Enum):
    CUDA = enum.auto()
    ROCM = enum.auto()
    CPU = enum.auto()
    XPU = enum.auto()


class FakePlatform:
    def __init__(self, kind: PlatformEnum):
        self._enum = kind
        self.device_type = "cuda" if kind in (PlatformEnum.CUDA, PlatformEnum.ROCM) else kind.name.lower()

    def is_cuda(self) -> bool:
        return self._enum is PlatformEnum.CUDA


def upstream_op(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal=True, softmax_scale=None,
                sliding_window_q=None, sliding_window_k=None, sinks=None, sinks_bias_key0=False):
    raise AssertionError("the probe must not call the op")


def ours(*args, **kwargs):
    return "ours"


@pytest.fixture
def fake_vllm(monkeypatch):
    """Fake ``vllm``, ``vllm.platforms`` and the op module in sys.modules (restored afterwards)."""
    modules = {}
    for name in ("vllm", "vllm.platforms", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.ops",
                 prefill_op.OP_MODULE):
        modules[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, modules[name])
    monkeypatch.delitem(sys.modules, prefill_op.BACKEND_MODULE, raising=False)
    modules[prefill_op.OP_MODULE].context_attention_fwd = upstream_op
    monkeypatch.setattr(prefill_op, "_ours", lambda: (ours, ""))

    def use(kind):
        modules["vllm.platforms"].current_platform = FakePlatform(kind)
        return modules[prefill_op.OP_MODULE]

    return use


def test_cuda_applies(fake_vllm):
    fake_vllm(PlatformEnum.CUDA)
    probe = prefill_op.probe(INFO)
    assert probe.applies and "both sink modes" in probe.reason


@pytest.mark.parametrize("kind,name", [(PlatformEnum.CPU, "cpu"), (PlatformEnum.ROCM, "rocm"),
                                       (PlatformEnum.XPU, "xpu")])
def test_every_other_platform_stands_down_with_the_reason(fake_vllm, kind, name, monkeypatch):
    op_module = fake_vllm(kind)
    monkeypatch.delenv(PATCH.env_var, raising=False)
    probe = prefill_op.probe(INFO)
    assert not probe.applies
    assert probe.reason == f"platform {name}: the op patch is CUDA-only; VLLM_SINKS_PREFILL_OP=on forces it"
    result = PATCH.run(INFO)
    assert result.status is Status.STOOD_DOWN and result.detail == probe.reason
    assert op_module.context_attention_fwd is upstream_op


def test_on_forces_it_elsewhere(fake_vllm, monkeypatch):
    op_module = fake_vllm(PlatformEnum.CPU)
    monkeypatch.setenv(PATCH.env_var, "on")
    result = PATCH.run(INFO)
    assert result.status is Status.APPLIED
    assert result.detail == ("forced by VLLM_SINKS_PREFILL_OP=on; our op bound in triton_prefill_attention; "
                             "triton_attn not imported yet, binds ours when it is")
    assert op_module.context_attention_fwd is ours


def test_a_platform_without_is_cuda_is_drift(fake_vllm):
    fake_vllm(PlatformEnum.CUDA)
    sys.modules["vllm.platforms"].current_platform = object()
    with pytest.raises(Drift, match="has no is_cuda"):
        prefill_op.probe(INFO)


@pytest.mark.parametrize("kind,handed_back", [(PlatformEnum.CUDA, True), (PlatformEnum.CPU, False)])
def test_faster_calls_go_back_to_upstream_on_cuda_only(fake_vllm, kind, handed_back, monkeypatch):
    """With our real op installed, the front door gets upstream's op for the full-attention calls
    the shipped table does not give ours (full_attention_table), on CUDA; forced elsewhere, ours
    keeps every call."""
    from vllm_sinks.v1.attention.ops import triton_prefill_attention as front_door

    op_module = fake_vllm(kind)
    monkeypatch.setattr(prefill_op, "_ours", lambda: (front_door.context_attention_fwd, ""))
    monkeypatch.setenv(PATCH.env_var, "on")
    monkeypatch.setattr(front_door, "_UPSTREAM", [])
    try:
        assert PATCH.run(INFO).status is Status.APPLIED
        assert op_module.context_attention_fwd is front_door.context_attention_fwd
        assert front_door._UPSTREAM == ([upstream_op] if handed_back else [])
    finally:
        op_module.context_attention_fwd = upstream_op
        for mark in ("__vllm_sinks_original__", "__vllm_sinks_patch__"):  # install()'s marks
            front_door.context_attention_fwd.__dict__.pop(mark, None)
