"""The plugin loads nothing of vLLM that vLLM does not: each patch waits for its target module.

Fresh interpreters (the installed vLLM, CPU): ``import vllm`` and vLLM's own
``vllm.plugins.load_general_plugins()``, with our plugin and with plugins off (``VLLM_PLUGINS=''``
matches no plugin name; ``VLLM_PLUGINS=sinks`` loads ours alone). Then a target is imported and the patch must be there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.vllm

TARGETS = (
    "vllm.v1.attention.backends.triton_attn",
    "vllm.v1.attention.ops.triton_prefill_attention",
    "vllm.model_executor.models.mimo_v2_omni",
    "vllm.model_executor.models.transformers.base",
    "vllm.model_executor.models.transformers",
)

_LOAD = textwrap.dedent("""
    import json, sys
    import vllm
    import vllm.plugins
    vllm.plugins.load_general_plugins()
    out = {"vllm_modules": sorted(m for m in sys.modules if m.split(".")[0] == "vllm"),
           "ours": "vllm_sinks" in sys.modules}
""")


def _run(code: str, **env: str) -> dict:
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **env}
    script = _LOAD + textwrap.dedent(code) + "\nprint('RESULT ' + json.dumps(out))\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env=full_env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    out["log"] = proc.stderr
    return out


@pytest.fixture(scope="module")
def plugins_off():
    out = _run("", VLLM_PLUGINS="")
    assert not out["ours"]
    return out


def test_loading_the_plugin_imports_no_target_and_nothing_of_vllm(plugins_off):
    out = _run("", VLLM_PLUGINS="sinks")  # ours only (vLLM ships general plugins of its own)
    assert out["ours"], "the plugin did not load"
    for name in TARGETS:
        assert name not in out["vllm_modules"], f"{name} imported by loading the plugin"
    assert set(out["vllm_modules"]) - set(plugins_off["vllm_modules"]) == set()
    # The startup line says what is armed, naming the modules it waits for.
    assert ("prefill-op armed (on import of vllm.v1.attention.ops.triton_prefill_attention or "
            "vllm.v1.attention.backends.triton_attn)") in out["log"]
    assert "transformers-sinks armed (on import of vllm.model_executor.models.transformers)" in out["log"]


def test_importing_the_backend_applies_the_op_patch_to_both_bindings():
    out = _run("""
        from vllm_sinks.patches import install, lifecycle
        import vllm.v1.attention.backends.triton_attn as backend
        import vllm.v1.attention.ops.triton_prefill_attention as op
        out["backend"] = install.patched_by(backend.context_attention_fwd)
        out["op"] = install.patched_by(op.context_attention_fwd)
        out["result"] = str(lifecycle.apply_all()[0])
    """, VLLM_SINKS_PREFILL_OP="on", TRITON_INTERPRET="1")
    assert out["backend"] == out["op"] == "prefill-op"
    assert out["result"] == ("prefill-op applied (forced by VLLM_SINKS_PREFILL_OP=on; our op bound in "
                             "triton_prefill_attention and triton_attn)")
    # One line when it resolved (the op module arrives first, inside the backend's import).
    lines = [x for x in out["log"].splitlines() if "[vllm-sinks] prefill-op applied" in x]
    assert len(lines) == 1 and "(on import of vllm.v1.attention.ops.triton_prefill_attention, " in lines[0]


@pytest.mark.vllm_platform  # expects vllm-cpu's platform by name
def test_off_cuda_the_op_patch_stands_down_when_its_module_arrives():
    out = _run("""
        from vllm_sinks.patches import install, lifecycle
        import vllm.v1.attention.ops.triton_prefill_attention as op
        out["op"] = install.patched_by(op.context_attention_fwd)
        out["result"] = str(lifecycle.apply_all()[0])
        out["backend_imported"] = "vllm.v1.attention.backends.triton_attn" in sys.modules
    """)
    assert out["op"] is None and not out["backend_imported"]
    assert out["result"] == ("prefill-op stood down (platform cpu: the op patch is CUDA-only; "
                             "VLLM_SINKS_PREFILL_OP=on forces it)")


def test_importing_the_transformers_backend_applies_its_patch():
    out = _run("""
        from vllm_sinks.patches import install, lifecycle
        import vllm.model_executor.models.transformers.base as base
        out["layers"] = install.layers(base.Base.recursive_replace)
        out["result"] = next(r for r in lifecycle.apply_all()
                             if r.patch == "transformers-sinks").status.value
    """)
    # Applied on every version (0.30+: per model, beside upstream's own lookup); transformers-kv-heads
    # wraps the same method on every version.
    assert out["result"] == "applied"
    assert ("transformers-sinks" in out["layers"]) == (out["result"] == "applied"), out
    # transformers-bf16-numerics wraps it outermost: it runs after the others' replacement
    assert out["layers"][0] == "transformers-bf16-numerics", out["layers"]
    assert f"[vllm-sinks] transformers-sinks {out['result']}" in out["log"]
