"""A tiny HF GPT-OSS module stack for the ``transformers-bf16-numerics`` tests (torch + transformers).

The real checkpoints' attention shapes (``gpt_oss_hd64``: head dim 64, YaRN x32), weights drawn as
``vllm_sinks.verify.tiny_models`` draws them (std 0.2, sinks std 2), so logits and bf16 rounding are
visible. Imports torch and transformers only when called.
"""

from __future__ import annotations

import contextlib
import importlib


def tiny_gpt_oss(dtype, layers: int = 3, seed: int = 0):
    """The base model (``GptOssModel``: embeddings, layers, final norm, rotary) in ``dtype``."""
    import torch
    import transformers

    from vllm_sinks.verify import tiny_models

    spec = tiny_models._spec("gpt_oss_hd64")
    config = transformers.GptOssConfig(**tiny_models._COMMON, **dict(spec.config, num_hidden_layers=layers))
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 2.0 if name.endswith("sinks") else 0.2)
    return model.to(dtype).model


def replace_norms(model, make_norm) -> None:
    """Put ``make_norm(hf_norm)`` in place of every HF norm, as upstream's backend puts vLLM's."""
    for parent, names in [(model, ("norm",))] + [(layer, ("input_layernorm", "post_attention_layernorm"))
                                                 for layer in model.layers]:
        for name in names:
            setattr(parent, name, make_norm(getattr(parent, name)))


@contextlib.contextmanager
def rotary_restored():
    """The patch installs its rotary wrapper in GPT-OSS's modeling module: put HF's back after."""
    import transformers

    modeling = importlib.import_module(transformers.GptOssModel.__module__)
    before = modeling.apply_rotary_pos_emb
    try:
        yield modeling
    finally:
        modeling.apply_rotary_pos_emb = before
