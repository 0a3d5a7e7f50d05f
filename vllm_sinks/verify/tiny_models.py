"""Tiny random-weight models of every sink family, built locally (the CPU harness has no model hub).

``tiny_model(family, dtype)`` builds a model from the installed transformers' own config and
causal-LM classes, gives every attention sink a value drawn from N(0, 2²) (checkpoints initialise
sinks to 0 or a constant, which would hide a dropped sink), saves it with ``save_pretrained`` (so
the checkpoint has the upstream on-disk names, as a real one would) beside our tokenizer, and caches
the directory. The cache key covers family, dtype, seed, transformers version and a hash of the
builder code, so editing this file or upgrading transformers rebuilds instead of reusing stale
weights. Builds are atomic (temp dir + rename) because several test processes may ask at once.

The bf16 model is the fp32 one loaded with ``dtype=torch.bfloat16`` and saved again: HF then keeps
the modules its model class pins to fp32 (DeepSeek V4 / HY V4 / privacy-filter sinks) in fp32, as
the real checkpoints of those families do, and both dtypes share the same underlying draw.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import importlib.metadata
import json
import os
import pathlib
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

from vllm_sinks.verify import tokenizer as _tok

if TYPE_CHECKING:
    import torch

#: Standard deviation of the sink values. Large enough that sinks soak up a visible share of the
#: attention mass (sink logit vs. ordinary scores of O(1)), so dropping them moves the logprobs.
SINK_STD = 2.0

#: Weight init std for every other parameter. HF's 0.02 makes a 64-wide model's logits nearly flat
#: (every logprob ≈ -log(vocab)), so no difference between implementations would show; at 0.2 the
#: attention scores and logits are O(1) and a wrong attention path is visible in the logprobs.
INIT_STD = 0.2

DTYPES = ("float32", "bfloat16")
_DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "float": "float32",
                  "bfloat16": "bfloat16", "bf16": "bfloat16"}


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    config_class: str  # name in the top-level ``transformers`` namespace
    model_class: str  # the class we instantiate (its name is the checkpoint's ``architectures``)
    config: dict[str, Any]  # tiny overrides of the family's defaults
    causal: bool = True  # False: an encoder (token classification), not a causal LM
    #: Classes from ``remote_sink_model`` (saved into the checkpoint, ``auto_map``) instead of transformers.
    remote_code: bool = False
    #: The family this is a shape variant of (same classes, other sizes); None for a family itself.
    variant_of: str | None = None


_COMMON = dict(vocab_size=_tok.VOCAB_SIZE, pad_token_id=_tok.PAD_ID, bos_token_id=_tok.BOS_ID,
               eos_token_id=_tok.EOS_ID, initializer_range=INIT_STD)

# Sizes from the shared notes (sink-families.md): each builds in well under 2 s and runs a forward in
# milliseconds. sliding_window 8 < the ~48-token prompt, so the sliding-window path is exercised too.
# Every attention head dim is 32 or 64: vLLM's CPU attention kernel accepts only 32, 64, 80, ... 256
# (CPUAttentionBackend.get_supported_head_sizes), so the notes' 16 / 24 would not run in vLLM on CPU.
#: Non-default scalings, as real checkpoints ship them, so a backend that drops one cannot pass:
#: Granite's logits_scaling and embedding / residual multipliers (the attention multiplier is set per
#: family below) and GPT-OSS's YaRN rope scaling (gpt-oss-20b's). granite-3.x-2b ships 8 / 12 / 0.22;
#: on a 2-layer random model (init std 0.2) those drown the sinks' effect (dropping them would move
#: the logprobs by < 0.01), so the Granite values are milder but still far from the default 1.
GRANITE_MULTIPLIERS = dict(logits_scaling=2.0, embedding_multiplier=1.5, residual_multiplier=0.5)
GPT_OSS_ROPE = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=4096, rope_theta=150000.0)

#: HY V4's latent KV: vLLM's CPU MLA kernels take only DeepSeek's latent width, 512 + 64 = 576
#: (`CPUMLABackend.get_supported_head_sizes`); smaller latents stop the run before the attention
#: interface, so the sink guard could never be reached.
HY_V4_KV_LORA_RANK, HY_V4_ROPE_DIM = 512, 64

_SPECS: dict[str, FamilySpec] = {
    "gpt_oss": FamilySpec("GptOssConfig", "GptOssForCausalLM", dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_parameters=dict(GPT_OSS_ROPE))),
    "granite_swa": FamilySpec("GraniteSWAConfig", "GraniteSWAForCausalLM", dict(
        num_hidden_layers=2, hidden_size=128, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8, attention_multiplier=0.25, max_position_embeddings=4096,
        layer_types=["sliding_attention", "full_attention"], **GRANITE_MULTIPLIERS)),
    "granitemoe_swa": FamilySpec("GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM", dict(
        num_hidden_layers=2, hidden_size=128, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8, attention_multiplier=0.25, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=4096,
        layer_types=["sliding_attention", "full_attention"], **GRANITE_MULTIPLIERS)),
    "deepseek_v4": FamilySpec("DeepseekV4Config", "DeepseekV4ForCausalLM", dict(
        num_hidden_layers=3,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        partial_rotary_factor=0.25, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=64,
        mlp_layer_types=["moe", "moe", "moe"],  # hash_moe (the default) routes by input id
        sliding_window=8, hc_mult=2, hc_sinkhorn_iters=3, index_n_heads=2, index_head_dim=16,
        index_topk=2, num_nextn_predict_layers=0, max_position_embeddings=4096)),
    "mimo_v2_flash": FamilySpec("MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", dict(
        num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"],
        mlp_layer_types=["dense", "sparse"], hidden_size=64, intermediate_size=128,
        moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
        v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=4096)),
    "hy_v4": FamilySpec("HYV4Config", "HYV4ForCausalLM", dict(
        num_hidden_layers=3, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, q_lora_rank=32, kv_lora_rank=HY_V4_KV_LORA_RANK, qk_nope_head_dim=32,
        qk_rope_head_dim=HY_V4_ROPE_DIM, v_head_dim=32, head_dim=96, index_topk=4, index_head_dim=96,
        index_n_heads=2, hc_mult=2, max_position_embeddings=4096)),
    "openai_privacy_filter": FamilySpec("OpenAIPrivacyFilterConfig",
                                        "OpenAIPrivacyFilterForTokenClassification", dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8, max_position_embeddings=131072, num_labels=5), causal=False),
}

#: Trust-remote-code models: Llama-shaped, the sink reached where vLLM >= 0.30's AST lookup (which
#: resolves only ``s_aux=self.<attr>``) does not look; see ``remote_sink_model``. Head dim 32.
_REMOTE = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, tie_word_embeddings=False)
_SPECS.update({
    "remote_nested_sink": FamilySpec("SinkRemoteConfig", "SinkRemoteForCausalLM",
                                     dict(_REMOTE, sink_style="nested"), remote_code=True),
    "remote_alias_sink": FamilySpec("SinkRemoteConfig", "SinkRemoteForCausalLM",
                                    dict(_REMOTE, sink_style="alias"), remote_code=True),
})

#: Attention shaped like the real checkpoints' (gpt-oss-20b / 120b: head dim 64, YaRN factor 32 on
#: theta 150000, sliding window 128 on alternate layers), everything else tiny: the bf16 rows of
#: ``verify`` are measured on these (bf16 rounding depends on head dim and rotary frequencies, which
#: the 32-wide tiny GPT-OSS does not share with the real ones).
_SPECS["gpt_oss_hd64"] = FamilySpec("GptOssConfig", "GptOssForCausalLM", dict(
    _SPECS["gpt_oss"].config, hidden_size=128, head_dim=64, sliding_window=128,
    rope_parameters=dict(GPT_OSS_ROPE)), variant_of="gpt_oss")

#: The sink families of transformers (the family ``verify`` runs these).
FAMILIES: tuple[str, ...] = tuple(name for name, spec in _SPECS.items()
                                  if not spec.remote_code and spec.variant_of is None)
#: Family -> its tiny model with real-checkpoint attention shapes (``verify``'s bf16 rows).
REALISTIC_SHAPES: dict[str, str] = {spec.variant_of: name for name, spec in _SPECS.items() if spec.variant_of}
#: Tiny models that load only with ``trust_remote_code`` (their modeling file is in the checkpoint).
REMOTE_CODE_MODELS: tuple[str, ...] = tuple(name for name, spec in _SPECS.items() if spec.remote_code)
#: A remote-code model whose ``s_aux`` is computed in forward (``sinks * 0.5``): no vLLM ``Attention``
#: can hold it, so vllm-sinks refuses it while it loads. Not among the models above, which it serves.
REFUSED_MODEL = "remote_scaled_sink"
_SPECS[REFUSED_MODEL] = FamilySpec("SinkRemoteConfig", "SinkRemoteForCausalLM", dict(_REMOTE, sink_style="scaled"),
                                   remote_code=True)
#: Name of the modeling file in a remote-code checkpoint (``auto_map`` points into it).
REMOTE_MODELING_FILE = "modeling_vllm_sinks_remote.py"


def _spec(family: str) -> FamilySpec:
    try:
        return _SPECS[family]
    except KeyError:
        raise ValueError(f"unknown sink family {family!r}; known: {', '.join(_SPECS)}") from None


def canonical_dtype(dtype: str) -> str:
    """'fp32'/'float32' -> 'float32', 'bf16'/'bfloat16' -> 'bfloat16'; anything else is an error."""
    key = str(dtype).removeprefix("torch.").lower()
    if key not in _DTYPE_ALIASES:
        raise ValueError(f"dtype {dtype!r}: tiny models are saved in {' or '.join(DTYPES)}")
    return _DTYPE_ALIASES[key]


def _transformers_class(name: str, remote_code: bool = False):
    if remote_code:
        from vllm_sinks.verify import remote_sink_model as namespace
    else:
        import transformers as namespace

    return getattr(namespace, name, None)


def needs_remote_code(family: str) -> bool:
    return _spec(family).remote_code


def family_available(family: str) -> bool:
    """True when the installed transformers has this family's config and model classes."""
    spec = _spec(family)
    try:
        return (_transformers_class(spec.config_class, spec.remote_code) is not None
                and _transformers_class(spec.model_class, spec.remote_code) is not None)
    except ImportError:  # transformers not installed, or the lazy module fails to import
        return False


def model_class(family: str):
    """The transformers class a family's tiny model is built from (and loads with)."""
    spec = _spec(family)
    cls = _transformers_class(spec.model_class, spec.remote_code)
    if cls is None:
        raise RuntimeError(f"transformers {_transformers_version()} has no {spec.model_class} ({family})")
    return cls


def is_causal(family: str) -> bool:
    return _spec(family).causal


def _transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _builder_hash() -> str:
    # Anything that changes the bytes we write: this file, the tokenizer code and its corpus.
    h = hashlib.sha256()
    here = pathlib.Path(__file__).parent
    for name in ("tiny_models.py", "remote_sink_model.py", "tokenizer.py", "data/corpus.txt"):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:12]


def default_cache_dir() -> pathlib.Path:
    """$VLLM_SINKS_CACHE, else ~/.cache/vllm-sinks/models."""
    from vllm_sinks.env import CACHE

    root = CACHE.read()
    return pathlib.Path(root) if root else pathlib.Path.home() / ".cache" / "vllm-sinks" / "models"


def _model_dir_name(family: str, dtype: str, seed: int) -> str:
    return f"{family}-{dtype}-seed{seed}-tf{_transformers_version()}-{_builder_hash()}"


@contextlib.contextmanager
def quiet_progress_bars():
    # save/load print tqdm bars per call; in a test log they are noise. Restore what was there.
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _draw_sinks(model, seed: int) -> int:
    """Overwrite every ``sinks`` parameter with N(0, SINK_STD²); return how many layers have one."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1_000_003)  # independent of the weight init stream
    count = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            sinks = getattr(module, "sinks", None)
            if isinstance(sinks, torch.nn.Parameter):  # MiMo full-attention layers have sinks = None
                draw = torch.randn(sinks.shape, generator=gen, dtype=torch.float32) * SINK_STD
                sinks.copy_(draw.to(sinks.dtype))
                count += 1
    return count


def _build_fp32(family: str, seed: int, out: pathlib.Path) -> None:
    import torch

    spec = _spec(family)
    cfg_cls, cls = _transformers_class(spec.config_class, spec.remote_code), model_class(family)
    config = cfg_cls(**_COMMON, **spec.config)
    config.architectures = [spec.model_class]
    if spec.remote_code:
        from vllm_sinks.verify.remote_sink_model import AUTO_CLASSES

        module = REMOTE_MODELING_FILE.removesuffix(".py")
        config.auto_map = {auto: f"{module}.{name}" for auto, name in AUTO_CLASSES.items()}
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    if _draw_sinks(model, seed) == 0:
        raise RuntimeError(f"{spec.model_class} built without any `sinks` parameter: "
                           "transformers changed the family, update vllm_sinks/verify/tiny_models.py")
    model.save_pretrained(str(out))


def _build_from_fp32(family: str, dtype: str, fp32_dir: pathlib.Path, out: pathlib.Path) -> None:
    import torch

    model = model_class(family).from_pretrained(str(fp32_dir), dtype=getattr(torch, dtype))
    model.save_pretrained(str(out))


def tiny_model(family: str, dtype: str = "float32", *, cache_dir: str | os.PathLike | None = None,
               seed: int = 0) -> pathlib.Path:
    """Build (once) and return the directory of a tiny ``family`` model saved in ``dtype``.

    The directory holds config.json, model.safetensors and the tokenizer files.
    """
    _spec(family)
    dtype = canonical_dtype(dtype)
    if not family_available(family):
        raise RuntimeError(f"transformers {_transformers_version()} has no {family} model classes")
    root = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / _model_dir_name(family, dtype, seed)
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    fp32_dir = tiny_model(family, "float32", cache_dir=root, seed=seed) if dtype != "float32" else None
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        with quiet_progress_bars():
            if fp32_dir is None:
                _build_fp32(family, seed, tmp)
            else:
                _build_from_fp32(family, dtype, fp32_dir, tmp)
        _tok.save_tokenizer(tmp)
        if _spec(family).remote_code:
            from vllm_sinks.verify import remote_sink_model

            shutil.copyfile(remote_sink_model.__file__, tmp / REMOTE_MODELING_FILE)
        (tmp / "vllm_sinks_build.json").write_text(json.dumps(dict(
            family=family, dtype=dtype, seed=seed, transformers=_transformers_version(),
            builder=_builder_hash(), sink_std=SINK_STD, init_std=INIT_STD), indent=1))
        try:
            os.rename(tmp, final)  # the commit point: a complete directory appears at once
        except OSError:
            if not (final / "config.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _is_sink_name(name: str) -> bool:
    # Checkpoint names differ per family (``...self_attn.sinks``, DeepSeek's ``...attn.attn_sink``,
    # HY's ``...learnable_sink_param``): every one is the last component and mentions "sink".
    return "sink" in name.rsplit(".", 1)[-1]


def sink_parameters(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Checkpoint name -> tensor of every sink parameter saved in ``model_dir`` (as stored on disk)."""
    from safetensors import safe_open

    model_dir = pathlib.Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    out = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if _is_sink_name(name):
                    out[name] = f.get_tensor(name)
    if not out:
        raise ValueError(f"{model_dir}: no sink parameter in the checkpoint")
    return out
