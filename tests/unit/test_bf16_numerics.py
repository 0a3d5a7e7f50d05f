"""``transformers-bf16-numerics`` on a tiny HF GPT-OSS (torch + transformers only, no vLLM).

Each part is checked against its own fp32-then-round-once reference written here: the rotary's q/k
and the residual stream through fused add + RMSNorm (vLLM's ``RMSNorm`` is not
here: a reference fused norm with its contract stands in; tests/vllm checks vLLM's own). An fp32
model and a model that is not GPT-OSS-like are left as they are.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch import nn  # noqa: E402

from vllm_sinks.model_executor.models.transformers import bf16_numerics as ours  # noqa: E402
from vllm_sinks.patches import install  # noqa: E402
from tests.support import tiny_gpt_oss as support  # noqa: E402
from vllm_sinks.verify import tiny_models  # noqa: E402

BF16 = torch.bfloat16


class FusedRMSNorm(nn.Module):
    """vLLM's RMSNorm contract: ``norm(x)``; ``norm(x, residual)`` -> (norm of the fp32 sum, the sum
    rounded once to x's dtype)."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(weight.detach().clone()), eps

    def _norm(self, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        s = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + self.eps)
        return (s * self.weight.float()).to(dtype)

    def forward(self, x, residual=None):
        if residual is None:
            return self._norm(x.float(), x.dtype)
        s = x.float() + residual.float()
        return self._norm(s, x.dtype), s.to(x.dtype)


def is_fused(module) -> bool:
    return isinstance(module, FusedRMSNorm)


def tiny_gpt_oss(dtype=BF16, layers: int = 3, seed: int = 0) -> nn.Module:
    return support.tiny_gpt_oss(dtype, layers, seed)


def with_fused_norms(model: nn.Module) -> nn.Module:
    support.replace_norms(model, lambda hf: FusedRMSNorm(hf.weight, hf.variance_epsilon))
    return model


@pytest.fixture
def restore_rotary():
    with support.rotary_restored() as modeling:
        yield modeling


def _inputs(model, n: int = 40):
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, n))
    return ids, torch.arange(n)[None]


def test_gpt_oss_is_recognised_and_others_are_not():
    assert ours.gpt_oss_like(tiny_gpt_oss()) is not None
    spec = tiny_models._spec("granite_swa")
    granite = getattr(transformers, spec.model_class)(getattr(transformers, spec.config_class)(
        **tiny_models._COMMON, **spec.config)).model
    applied = ours.apply_to_model(granite.to(BF16), BF16, "granite", is_fused_norm=is_fused)
    assert not applied.gpt_oss_like and not list(ours.patched_modules(granite))
    assert "not GPT-OSS-like" in applied.line()


def test_rotary_is_fp32_math_rounded_once(restore_rotary):
    modeling = restore_rotary
    model = tiny_gpt_oss()
    applied = ours.apply_to_model(model, BF16, "GptOss", is_fused_norm=is_fused)
    assert applied.rotary == 3
    ids, pos = _inputs(model)
    x = model.embed_tokens(ids)
    cos, sin = model.rotary_emb(x, pos)
    cos_hf, sin_hf = type(model.rotary_emb).forward(model.rotary_emb, x, pos)
    # native vLLM's cos/sin cache is rounded to the model dtype too: same values, held in fp32
    assert cos.dtype == torch.float32 and cos_hf.dtype == BF16 and torch.equal(cos, cos_hf.float())
    torch.manual_seed(2)
    q, k = torch.randn(1, 4, 40, 64, dtype=BF16), torch.randn(1, 2, 40, 64, dtype=BF16)
    q_rot, k_rot = modeling.apply_rotary_pos_emb(q, k, cos, sin)

    def reference(t):  # GPT-OSS rotates halves (not interleaved), in fp32, one rounding
        a, b = t.float().chunk(2, dim=-1)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return torch.cat((a * c - b * s, b * c + a * s), dim=-1).to(t.dtype)

    assert q_rot.dtype == BF16 and torch.equal(q_rot, reference(q)) and torch.equal(k_rot, reference(k))
    hf_q, _ = install.original(modeling.apply_rotary_pos_emb)(q, k, cos_hf, sin_hf)
    assert not torch.equal(hf_q, q_rot)  # HF's bf16 math rounds differently somewhere
    # any other caller (same dtype for cos/sin and q) gets HF's own result, untouched
    assert torch.equal(modeling.apply_rotary_pos_emb(q, k, cos_hf, sin_hf)[0], hf_q)


def test_a_later_model_of_the_process_is_still_traced_to_its_sink(restore_rotary):
    """The rotary wrapper stays in GPT-OSS's modeling module once a first model installed it. The
    backend's fusers trace each later model's attention forward with torch.fx, where the wrapper's
    dtype test is a Proxy: it broke the SinkFuser's trace of every GPT-OSS after the first in one
    process (vLLM 0.27.1, 2026-12-02: "tracing its forward failed before the attention-interface
    call"), and the model refused to load."""
    from vllm_sinks.model_executor.models.transformers.fusers.sink import SinkFuser, SinkSite

    ours.apply_to_model(with_fused_norms(tiny_gpt_oss()), BF16, "GptOss", is_fused_norm=is_fused)
    assert install.patched_by(restore_rotary.apply_rotary_pos_emb) == ours.PATCH
    later = tiny_gpt_oss(seed=1)
    site = SinkFuser().find(later.layers[0].self_attn)
    assert site.problem is None, site.problem
    assert site.sink == SinkSite("sinks", "parameter") and site.interface_calls == 1


def test_the_rotary_wrapper_traces_as_hfs_call(restore_rotary):
    """Traced, the wrapper's graph is HF's own rotary (plain torch.fx here); run, it gives HF's result
    where cos/sin are q's dtype."""
    modeling = restore_rotary
    ours.apply_to_model(tiny_gpt_oss(), BF16, "GptOss", is_fused_norm=is_fused)

    class Rotate(nn.Module):
        def forward(self, q, k, cos, sin):
            return modeling.apply_rotary_pos_emb(q, k, cos, sin)

    graph_module = torch.fx.symbolic_trace(Rotate())
    torch.manual_seed(3)
    q, k = torch.randn(1, 4, 8, 64, dtype=BF16), torch.randn(1, 2, 8, 64, dtype=BF16)
    cos, sin = torch.randn(1, 8, 32, dtype=BF16), torch.randn(1, 8, 32, dtype=BF16)  # GPT-OSS: half the head
    expected = install.original(modeling.apply_rotary_pos_emb)(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(graph_module(q, k, cos, sin), expected))


def test_router_needs_no_patch():
    """Why the patch leaves HF's router alone: torch's bf16 softmax (``dtype=bf16``, as HF's router
    calls it) computes in fp32 and rounds once, i.e. what native vLLM's fp32 top-k softmax gives on
    the same bf16 logits. If a torch release stops doing so, this fails and the router needs a part."""
    torch.manual_seed(3)
    for k in (2, 4):  # the tiny models' top-2, the real checkpoints' top-4
        top = (torch.randn(100_000, k) * 3).to(BF16)
        hf = torch.nn.functional.softmax(top, dim=1, dtype=BF16)
        native = torch.softmax(top.float(), dim=-1).to(BF16)
        assert (hf != native).sum().item() <= 1e-5 * hf.numel()


def test_residual_stream_is_fused_add_norm(restore_rotary):
    """The whole stack equals a native-style reference: every add in fp32 feeding the norm, the
    residual kept rounded once, the last layer's add fused into the final norm."""
    model = with_fused_norms(tiny_gpt_oss())
    applied = ours.apply_to_model(model, BF16, "GptOss", is_fused_norm=is_fused)
    assert (applied.fused_layers, applied.layers, applied.final_norm) == (3, 3, True)
    assert "carried into the final norm" in applied.line()
    ids, pos = _inputs(model)
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=pos).last_hidden_state
        # reference, from the (patched) sublayers themselves
        emb = model.embed_tokens(ids)
        position_embeddings = model.rotary_emb(emb, pos)
        masks = {t: transformers.masking_utils.create_causal_mask(model.config, emb, None, None)
                 if t == "full_attention" else transformers.masking_utils.create_sliding_window_causal_mask(
                     model.config, emb, None, None) for t in set(model.config.layer_types)}
        residual, x = emb, None
        for i, layer in enumerate(model.layers):
            h = layer.input_layernorm(emb) if x is None else layer.input_layernorm(x, residual)
            if x is not None:
                h, residual = h
            a = layer.self_attn(hidden_states=h, position_embeddings=position_embeddings,
                                attention_mask=masks[model.config.layer_types[i]])[0]
            s = a.float() + residual.float()
            residual = s.to(BF16)
            x = layer.mlp(layer.post_attention_layernorm._norm(s, BF16))[0]
        s = x.float() + residual.float()
        expected = model.norm._norm(s, BF16)
    assert out.dtype == BF16 and torch.equal(out, expected)


def test_pairs_stop_where_the_next_consumer_is_not_patched(restore_rotary):
    """Layer 1's norms are HF's (not fused): layer 0 hands on a plain sum, layer 1 runs HF's forward,
    layer 2 is patched and (last) carries its pair into the final norm."""
    model = with_fused_norms(tiny_gpt_oss())
    hf_norm = nn.RMSNorm(model.config.hidden_size, eps=1e-5, dtype=BF16)
    model.layers[1].input_layernorm = hf_norm
    applied = ours.apply_to_model(model, BF16, "GptOss", is_fused_norm=is_fused)
    assert applied.fused_layers == 2 and applied.final_norm
    assert [getattr(model.layers[i], ours.PASS_PAIR_ATTR, None) for i in range(3)] == [False, None, True]
    ids, pos = _inputs(model)
    with torch.no_grad():
        assert model(input_ids=ids, position_ids=pos).last_hidden_state.shape == (1, 40, 128)


def test_output_capturing_hooks_get_tensors(restore_rotary):
    """HF's output capturing (``output_hidden_states``; vLLM's Eagle3 aux states) hooks the decoder
    layers: with hooks on them, patched layers return the plain sum, so what is captured is a tensor."""
    model = with_fused_norms(tiny_gpt_oss())
    ours.apply_to_model(model, BF16, "GptOss", is_fused_norm=is_fused)
    ids, pos = _inputs(model)
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=pos, output_hidden_states=True)
    assert all(isinstance(h, torch.Tensor) for h in out.hidden_states)
    assert len(out.hidden_states) == 4


def test_fp32_model_is_untouched(restore_rotary):
    modeling = restore_rotary
    before = modeling.apply_rotary_pos_emb
    model = with_fused_norms(tiny_gpt_oss(torch.float32))
    ids, pos = _inputs(model)
    with torch.no_grad():
        expected = model(input_ids=ids, position_ids=pos).last_hidden_state
    applied = ours.apply_to_model(model, torch.float32, "GptOss", is_fused_norm=is_fused)
    assert applied.gpt_oss_like and "nothing to do" in applied.line()
    assert not list(ours.patched_modules(model)) and modeling.apply_rotary_pos_emb is before
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, position_ids=pos).last_hidden_state, expected)


def test_patched_bf16_moves_toward_fp32(restore_rotary):
    """The point of the patch, on one tiny model: bf16 with it is closer to the fp32 model than
    HF's own bf16 (mean |error| of the last hidden state over 64 tokens)."""
    fp32 = tiny_gpt_oss(torch.float32)
    ids, pos = _inputs(fp32, 64)
    with torch.no_grad():
        exact = fp32(input_ids=ids, position_ids=pos).last_hidden_state
        plain = with_fused_norms(tiny_gpt_oss())
        before = (plain(input_ids=ids, position_ids=pos).last_hidden_state.float() - exact).abs().mean()
        ours.apply_to_model(plain, BF16, "GptOss", is_fused_norm=is_fused)
        after = (plain(input_ids=ids, position_ids=pos).last_hidden_state.float() - exact).abs().mean()
    assert after < before


def test_compiled_model_is_left_to_inductor(restore_rotary):
    """Auto mode under Inductor: nothing patched (Inductor already computes the rotary and the add
    + norm in fp32 and rounds once), and the report line says who computes them and how to force it."""
    modeling = restore_rotary
    before = modeling.apply_rotary_pos_emb
    model = with_fused_norms(tiny_gpt_oss())
    applied = ours.apply_to_model(model, BF16, "GptOss", compiled="VLLM_COMPILE", is_fused_norm=is_fused)
    assert applied.gpt_oss_like and "left to the compiler (VLLM_COMPILE" in applied.line()
    assert "=on" in applied.line()
    assert not list(ours.patched_modules(model)) and modeling.apply_rotary_pos_emb is before


@pytest.mark.parametrize("mode, backend, expected", [
    (None, "inductor", ""),  # not resolved: eager is what the patch is for
    (0, "inductor", ""),  # CompilationMode.NONE (enforce_eager)
    (3, "eager", ""),  # compiled by Dynamo but the ops run as they are
    (3, "", "3"),  # the default backend is Inductor
    (3, "inductor", "3"),
])
def test_inductor_compiled_reads_mode_and_backend(mode, backend, expected):
    import types as _types

    assert ours.inductor_compiled(_types.SimpleNamespace(mode=mode, backend=backend)) == expected
