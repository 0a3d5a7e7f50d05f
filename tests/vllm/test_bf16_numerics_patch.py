"""``transformers-bf16-numerics`` inside an installed vLLM, without an engine (seconds): the patch is
installed around ``Base.recursive_replace``, vLLM's ``RMSNorm`` keeps the fused add + norm contract
the patched layers are built on, and a tiny HF GPT-OSS with vLLM's norms (as upstream's backend
leaves it) runs with every residual add fused. The engine runs (backend vs native vLLM) are in
test_transformers_sinks_e2e.py.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("vllm")

from vllm_sinks.model_executor.models.transformers import bf16_numerics as ours  # noqa: E402
from vllm_sinks.patches import install, transformers_bf16_numerics  # noqa: E402
from vllm_sinks.patches.registry import detect_vllm  # noqa: E402
from tests.support import tiny_gpt_oss as support  # noqa: E402

BF16 = torch.bfloat16


@pytest.fixture
def vllm_config():
    """vLLM's CustomOps read the current config when built and called."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


@pytest.fixture
def restore_rotary():
    with support.rotary_restored() as modeling:
        yield modeling


def _rms(t: torch.Tensor, eps: float) -> torch.Tensor:
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)


def test_patch_probes_and_wraps_recursive_replace():
    import vllm.model_executor.models.transformers.base as base

    before = base.Base.__dict__["recursive_replace"]
    assert transformers_bf16_numerics.probe(detect_vllm()).applies
    try:
        transformers_bf16_numerics.apply(detect_vllm())
        assert transformers_bf16_numerics.PATCH in install.layers(base.Base.recursive_replace)
    finally:  # later tests in this process see upstream's method as they found it
        base.Base.recursive_replace = before


@pytest.mark.vllm_platform  # VllmConfig() infers the device: a vLLM platform
def test_vllm_rms_norm_is_the_fused_add_norm_we_rely_on(vllm_config):
    """``norm(x, residual)``: the residual is the sum rounded once; the output normalises the fp32
    sum (closer to it than to the norm of the rounded sum)."""
    from vllm.model_executor.layers.layernorm import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(128, eps=1e-5, dtype=BF16)
    with torch.no_grad():
        norm.weight.normal_(1, 0.3)
    x, r = torch.randn(256, 128).to(BF16), torch.randn(256, 128).to(BF16)
    s = x.float() + r.float()
    out, residual = norm(x.clone(), r.clone())
    assert torch.equal(residual, s.to(BF16))
    exact = _rms(s, 1e-5) * norm.weight.float()
    of_rounded = _rms(s.to(BF16).float(), 1e-5) * norm.weight.float()
    assert (out.float() - exact).abs().mean() < (out.float() - of_rounded).abs().mean()


def _tiny_with_vllm_norms(layers: int = 3):
    from vllm.model_executor.layers.layernorm import RMSNorm

    def vllm_norm(hf):
        norm = RMSNorm(hf.weight.numel(), eps=hf.variance_epsilon, dtype=BF16)
        with torch.no_grad():
            norm.weight.copy_(hf.weight)
        return norm

    model = support.tiny_gpt_oss(BF16, layers)
    support.replace_norms(model, vllm_norm)
    return model


@pytest.mark.vllm_platform  # VllmConfig() infers the device: a vLLM platform
def test_gpt_oss_with_vllm_norms_runs_fused(vllm_config, restore_rotary):
    """Every layer patched, pairs carried into the final norm; the output equals the same sublayers
    wired by hand with vLLM's fused norms (and differs from HF's bf16 adds)."""
    model = _tiny_with_vllm_norms()
    ids, pos = torch.randint(0, model.config.vocab_size, (1, 40)), torch.arange(40)[None]
    with torch.no_grad():
        plain = model(input_ids=ids, position_ids=pos).last_hidden_state
    applied = ours.apply_to_model(model, BF16, "GptOssForCausalLM")
    assert (applied.rotary, applied.fused_layers, applied.layers, applied.final_norm) == (3, 3, 3, True)
    assert len(list(ours.patched_modules(model))) == 3 + 1 + 1  # layers, final norm, rotary
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=pos).last_hidden_state
        emb = model.embed_tokens(ids)
        pe = model.rotary_emb(emb, pos)
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        masks = {"full_attention": create_causal_mask(model.config, emb, None, None),
                 "sliding_attention": create_sliding_window_causal_mask(model.config, emb, None, None)}
        residual, x = emb.clone(), None
        for i, layer in enumerate(model.layers):
            if x is None:
                h = layer.input_layernorm(residual)
            else:
                h, residual = layer.input_layernorm(x, residual)
            a = layer.self_attn(hidden_states=h, position_embeddings=pe,
                                attention_mask=masks[model.config.layer_types[i]])[0]
            h, residual = layer.post_attention_layernorm(a, residual)
            x = layer.mlp(h)[0]
        expected = model.norm(x, residual)[0]
    assert torch.equal(out, expected)
    assert not torch.equal(out, plain)


@pytest.mark.vllm_platform  # VllmConfig() infers the device: a vLLM platform
def test_fp32_model_is_untouched(vllm_config, restore_rotary):
    model = _tiny_with_vllm_norms().float()
    applied = ours.apply_to_model(model, torch.float32, "GptOssForCausalLM")
    assert applied.gpt_oss_like and not list(ours.patched_modules(model))
    assert restore_rotary.apply_rotary_pos_emb is not None
    assert install.patched_by(restore_rotary.apply_rotary_pos_emb) is None


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_compiled_or_eager_from_vllms_own_config(enforce_eager):
    """vLLM's own CompilationConfig, as it resolves it: eager (``enforce_eager``, mode NONE) gets
    the patch; the default compiled mode (Inductor) is left to the compiler."""
    from vllm.config import CompilationConfig, CompilationMode

    mode = CompilationMode.NONE if enforce_eager else CompilationMode.VLLM_COMPILE
    reason = ours.inductor_compiled(CompilationConfig(mode=mode))
    assert (reason == "") is enforce_eager
    if not enforce_eager:
        assert reason == "VLLM_COMPILE"
