"""A trust-remote-code sink model: the modeling file ``tiny_models`` saves beside a tiny checkpoint.

A Llama-shaped decoder whose attention applies a learnable per-head sink (``s_aux``, GPT-OSS's
semantics: one extra logit per head in every softmax denominator, no value), reached in one of two
ways that a lookup reading the forward's source for ``s_aux=self.<attr>`` does not resolve:

* ``nested``: the sink lives on a submodule, ``s_aux=self.sink_holder.sinks``;
* ``alias``: the forward first binds it to a local, ``sinks = self.sinks``, then ``s_aux=sinks``.

vLLM >= 0.30's ``AttentionFuser`` resolves only ``self.<attr>`` (or a literal), so on these it
hands ``Attention`` no sink, and its attention interface then refuses the first forward ("applies
attention sinks, but they were not passed"). The SinkFuser follows the forward's dataflow and finds
both. ``config.sink_style`` picks the attention class.

This file is saved into the checkpoint (``auto_map``) and imported from there by transformers under
``trust_remote_code``, so it imports only torch and transformers (nothing of vllm_sinks, nothing
relative). It must stay traceable by both lookups: one ``ALL_ATTENTION_FUNCTIONS.get_interface``
assignment and one call of it.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaForCausalLM,
    LlamaModel,
    apply_rotary_pos_emb,
)

SINK_STYLES = ("nested", "alias")  # the styles vllm-sinks serves; "scaled" it refuses at load

#: The checkpoint's ``auto_map``: Auto class -> class of this file (vLLM's backend builds ``AutoModel``).
AUTO_CLASSES = {"AutoConfig": "SinkRemoteConfig", "AutoModel": "SinkRemoteModel",
                "AutoModelForCausalLM": "SinkRemoteForCausalLM"}


class SinkRemoteConfig(LlamaConfig):
    model_type = "vllm_sinks_remote"
    sink_style: str = "nested"


def sink_eager_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                         s_aux: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention with a sink: softmax over [scores, s_aux[h]], the sink column dropped after.

    query [b, h, q, d], key/value [b, kv, k, d] (grouped heads repeated here); the mask is additive.
    The softmax runs in fp32 whatever the model dtype, as HF's eager paths do.
    """
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    if s_aux is not None:
        sink = s_aux.to(scores.dtype).reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    if s_aux is not None:
        probs = probs[..., :-1]
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs, value).transpose(1, 2).contiguous()
    return out, probs


class SinkHolder(nn.Module):
    """A submodule that only holds the sink (the ``nested`` style)."""

    def __init__(self, heads: int):
        super().__init__()
        self.sinks = nn.Parameter(torch.zeros(heads))


class _SinkAttentionBase(nn.Module):
    def __init__(self, config: SinkRemoteConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        self.is_causal = True
        kv = config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def _project(self, hidden_states, position_embeddings, past_key_values):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        return q, k, v

    def _output(self, out: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous())


class NestedSinkAttention(_SinkAttentionBase):
    """``s_aux=self.sink_holder.sinks``: the sink two attribute steps away."""

    def __init__(self, config: SinkRemoteConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.sink_holder = SinkHolder(self.num_heads)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                **kwargs):
        q, k, v = self._project(hidden_states, position_embeddings, past_key_values)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, sink_eager_attention)
        out, weights = attention_interface(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,
                                           s_aux=self.sink_holder.sinks, **kwargs)
        return self._output(out, hidden_states), weights


class AliasSinkAttention(_SinkAttentionBase):
    """``sinks = self.sinks`` then ``s_aux=sinks``: the sink through a local name."""

    def __init__(self, config: SinkRemoteConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                **kwargs):
        q, k, v = self._project(hidden_states, position_embeddings, past_key_values)
        sinks = self.sinks
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, sink_eager_attention)
        out, weights = attention_interface(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,
                                           s_aux=sinks, **kwargs)
        return self._output(out, hidden_states), weights


class ScaledSinkAttention(_SinkAttentionBase):
    """``s_aux=self.sinks * 0.5``: a sink computed in forward, which no vLLM ``Attention`` can hold
    (vllm-sinks refuses this style while the model loads)."""

    def __init__(self, config: SinkRemoteConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                **kwargs):
        q, k, v = self._project(hidden_states, position_embeddings, past_key_values)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, sink_eager_attention)
        out, weights = attention_interface(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,
                                           s_aux=self.sinks * 0.5, **kwargs)
        return self._output(out, hidden_states), weights


_ATTENTION = {"nested": NestedSinkAttention, "alias": AliasSinkAttention, "scaled": ScaledSinkAttention}


class _NoSinklessKernels:
    """HF's SDPA / flash paths would drop ``s_aux``: eager (our sink-aware function) is the default."""

    _supports_sdpa = False
    _supports_flash_attn = False
    _supports_flex_attn = False


class SinkRemoteModel(_NoSinklessKernels, LlamaModel):
    config_class = SinkRemoteConfig

    def __init__(self, config: SinkRemoteConfig):
        super().__init__(config)
        if config.sink_style not in _ATTENTION:
            raise ValueError(f"sink_style {config.sink_style!r}: expected one of {', '.join(_ATTENTION)}")
        for index, layer in enumerate(self.layers):
            layer.self_attn = _ATTENTION[config.sink_style](config, index)
        self.post_init()


class SinkRemoteForCausalLM(_NoSinklessKernels, LlamaForCausalLM):
    config_class = SinkRemoteConfig

    def __init__(self, config: SinkRemoteConfig):
        super().__init__(config)
        self.model = SinkRemoteModel(config)
        self.post_init()
