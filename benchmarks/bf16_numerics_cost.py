"""What ``transformers-bf16-numerics`` costs per GPT-OSS decoder layer, on CPU, in bf16.

    python benchmarks/bf16_numerics_cost.py [--tokens 512 4096] [--repeats 7]

One HF GPT-OSS decoder layer of the real checkpoints' width (hidden 2880, 64 query heads and 8 KV
heads of 64, 32 experts, top-4) with vLLM's ``RMSNorm`` in place of HF's (as upstream's backend
leaves it), run as the backend runs it (HF's layer, bf16 rotary) and as the patch runs it (fp32
rotary rounded once, the residual adds through the fused add + norm, ``(output, residual)`` in and
out). Two parts are stand-ins so the table isolates what the patch touches: the attention kernel
(returns the values, no T x T work) and the experts (scale the input by the routing weights) — both
are the same before and after, so the ratio is an upper bound of the patch's relative cost in a real
layer, where attention and experts dominate.

Prints, per token count: aten ops dispatched per layer call (by name where they differ) and the
median wall time of a layer call before / after.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOP_K = 2880, 64, 8, 64, 32, 4
FAKE_ATTENTION = "vllm_sinks_bench_values"


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _values_attention(module, query, key, value, attention_mask, **kwargs):
    """Stand-in attention: each query head gets its KV group's values ([batch, tokens, heads, dim])."""
    groups = query.shape[1] // value.shape[1]
    return value.repeat_interleave(groups, dim=1).transpose(1, 2).contiguous(), None


class RoutedScale(torch.nn.Module):
    """Stand-in experts: the input scaled by its summed routing weights (keeps the router live)."""

    def forward(self, hidden_states, router_indices=None, routing_weights=None):
        return hidden_states * routing_weights.sum(-1, keepdim=True).to(hidden_states.dtype)


def build_layer():
    import transformers
    from transformers.modeling_utils import AttentionInterface
    from vllm.model_executor.layers.layernorm import RMSNorm

    AttentionInterface.register(FAKE_ATTENTION, _values_attention)
    from vllm_sinks.verify.tiny_models import GPT_OSS_ROPE

    config = transformers.GptOssConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                       head_dim=HEAD_DIM, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                       intermediate_size=64, num_hidden_layers=2, vocab_size=64,
                                       rope_parameters=dict(GPT_OSS_ROPE))
    config._attn_implementation = FAKE_ATTENTION
    torch.manual_seed(0)
    model = transformers.GptOssModel(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    for layer in model.layers:
        layer.mlp.experts = RoutedScale()
        for name in ("input_layernorm", "post_attention_layernorm"):
            norm = RMSNorm(HIDDEN, eps=config.rms_norm_eps, dtype=torch.bfloat16)
            setattr(layer, name, norm)
    model.norm = RMSNorm(HIDDEN, eps=config.rms_norm_eps, dtype=torch.bfloat16)
    return model


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure(tokens: int, repeats: int) -> dict:
    from vllm_sinks.model_executor.models.transformers import bf16_numerics

    model = build_layer()
    layer = model.layers[0]
    torch.manual_seed(1)
    x = torch.randn(1, tokens, HIDDEN, dtype=torch.bfloat16)
    residual = torch.randn(1, tokens, HIDDEN, dtype=torch.bfloat16)
    pos = torch.arange(tokens)[None]

    def before():
        pe = model.rotary_emb(x, pos)
        return layer(x + residual, position_embeddings=pe, attention_mask=None)

    with torch.no_grad():
        counts = {}
        with OpCounter() as c:
            before()
        counts["before"] = c.ops
        t_before = _median_ms(before, repeats)
        applied = bf16_numerics.apply_to_model(model, torch.bfloat16, "bench")
        assert applied.fused_layers == 2 and applied.rotary == 2, applied

        def after():  # steady state: a pair in from the layer before, a pair out to the next
            pe = model.rotary_emb(x, pos)
            return layer((x.clone(), residual.clone()), position_embeddings=pe, attention_mask=None)

        def clones():
            return x.clone(), residual.clone()

        with OpCounter() as c:
            after()
        counts["after"] = c.ops
        counts["after"]["clone"] -= 2  # the benchmark's own input copies (the fused norm writes in place)
        t_after = _median_ms(after, repeats) - _median_ms(clones, repeats)
    return dict(tokens=tokens, before=t_before, after=t_after, counts=counts)


def main(argv=None) -> int:
    from vllm.config import VllmConfig, set_current_vllm_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; one GPT-OSS layer "
          f"(hidden {HIDDEN}, {HEADS}x{HEAD_DIM} q heads, {KV_HEADS} KV heads, {EXPERTS} experts top-{TOP_K}; "
          "attention kernel and experts stand-ins), bf16\n")
    rows = []
    with set_current_vllm_config(VllmConfig()):
        for tokens in args.tokens:
            rows.append(measure(tokens, args.repeats))
    print("| tokens | aten ops before | after | before ms | after ms | after / before |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        b, a = r["counts"]["before"], r["counts"]["after"]
        print(f"| 1x{r['tokens']} | {sum(b.values())} | {sum(a.values())} | {r['before']:.2f} | "
              f"{r['after']:.2f} | {r['after'] / r['before']:.3f} |")
    b, a = rows[0]["counts"]["before"], rows[0]["counts"]["after"]
    diff = {op: (b[op], a[op]) for op in sorted(set(b) | set(a)) if b[op] != a[op]}
    print("\nops whose count changed (before -> after): "
          + ", ".join(f"{op} {x} -> {y}" for op, (x, y) in diff.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
