"""The CPU harness's tiny models and tokenizer (needs torch + transformers; no vLLM engine runs).

Every family the installed transformers has is built (fp32 and bf16) into a fresh cache, so the
builder itself is exercised on each venv's transformers (5.17 / 5.19 / 5.24).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from vllm_sinks.testing import differential, tiny_models, tokenizer  # noqa: E402

AVAILABLE = [f for f in tiny_models.FAMILIES if tiny_models.family_available(f)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-models")


def _layer(name: str) -> int:
    m = re.search(r"layers\.(\d+)\.", name)
    assert m, f"sink parameter {name} is not inside a numbered layer"
    return int(m[1])


def test_the_families_of_the_notes_are_known():
    assert set(tiny_models.FAMILIES) == {"gpt_oss", "granite_swa", "granitemoe_swa", "deepseek_v4",
                                         "mimo_v2_flash", "hy_v4", "openai_privacy_filter"}
    # Every venv's transformers (>= 5.17) has GPT-OSS; the harness's main check depends on it.
    assert "gpt_oss" in AVAILABLE


@pytest.mark.parametrize("family", AVAILABLE)
@pytest.mark.parametrize("dtype", tiny_models.DTYPES)
def test_tiny_model_builds_loads_and_has_random_sinks(family, dtype, cache):
    model_dir = tiny_models.tiny_model(family, dtype, cache_dir=cache)
    assert (model_dir / "model.safetensors").is_file()
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == [tiny_models.model_class(family).__name__]
    assert (config["pad_token_id"], config["bos_token_id"], config["eos_token_id"]) == (0, 1, 2)
    assert config["vocab_size"] == tokenizer.VOCAB_SIZE

    sinks = tiny_models.sink_parameters(model_dir)
    values = torch.cat([t.float().flatten() for t in sinks.values()])
    assert torch.isfinite(values).all()
    assert (values != 0).all(), "a sink left at its init value (0) would hide a dropped sink"
    # 4-12 draws from N(0, 2²): the sample std lands in [1, 3.5] for these seeds (0.02 init would not).
    assert 1.0 < values.std().item() < 3.5, values

    # HF loads the checkpoint, and its sink parameters are exactly the checkpoint's, layer by layer.
    model = tiny_models.model_class(family).from_pretrained(
        str(model_dir), dtype=getattr(torch, dtype), attn_implementation="eager").eval()
    loaded = {_layer(n): p for n, p in model.named_parameters() if n.endswith("sinks")}
    saved = {_layer(n): t for n, t in sinks.items()}
    assert sorted(loaded) == sorted(saved)
    for layer, t in saved.items():
        torch.testing.assert_close(loaded[layer].float(), t.float(), rtol=0, atol=0)

    # A forward runs and gives finite outputs of the right shape. In fp32, as the differential
    # check's reference does: HF's own DeepSeek V4 cannot run bf16 on CPU (its fp32-pinned q_a_norm
    # feeds a bf16 q_b_proj: "expected m1 and m2 to have the same dtype").
    ids = differential.prompt_token_ids(model_dir)
    with torch.no_grad():
        logits = model.float()(input_ids=torch.tensor([ids]), use_cache=False).logits
    width = config["vocab_size"] if tiny_models.is_causal(family) else model.config.num_labels
    assert logits.shape == (1, len(ids), width)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("family", [f for f in AVAILABLE if tiny_models.is_causal(f)])
def test_sinks_move_the_reference_logprobs(family, cache):
    """The check is only meaningful if a dropped sink shows: HF with sinks at -inf must differ."""
    model_dir = tiny_models.tiny_model(family, "float32", cache_dir=cache)
    ids, with_sinks = differential.hf_prompt_logprobs(model_dir, "float32")
    model = tiny_models.model_class(family).from_pretrained(str(model_dir), attn_implementation="eager")
    # Granite scales by sigmoid(lse - sink): a dropped sink is sink = -inf there too (scale 1).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.fill_(-1e9)
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1].float()
    without = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    gap = (torch.tensor(with_sinks) - without).abs().mean().item()
    assert gap > 0.02, f"{family}: dropping the sinks moves the logprobs by only {gap:.4f}"


def test_tokenizer_ids_and_round_trip(cache):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_models.tiny_model("gpt_oss", cache_dir=cache)))
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.chat_template is None
    ids = tok(differential.PROMPT).input_ids
    assert ids[0] == tokenizer.BOS_ID and 40 <= len(ids) <= 56
    assert tok.decode(ids, skip_special_tokens=True) == differential.PROMPT
    # Byte-level: text the corpus never saw still encodes, and decodes back unchanged.
    odd = "Zürich → 東京 🙂"
    assert tok.decode(tok(odd).input_ids, skip_special_tokens=True) == odd
    assert max(tok(odd).input_ids) < tokenizer.VOCAB_SIZE


def test_tokenizer_training_is_deterministic_across_processes():
    code = ("import hashlib; from vllm_sinks.testing import tokenizer as t; "
            "print(hashlib.sha256(t.build_tokenizer().to_str().encode()).hexdigest())")
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2)}
    assert len(digests) == 1


def test_same_seed_same_weights_other_seed_other_sinks(tmp_path):
    a = tiny_models.sink_parameters(tiny_models.tiny_model("gpt_oss", cache_dir=tmp_path / "a"))
    b = tiny_models.sink_parameters(tiny_models.tiny_model("gpt_oss", cache_dir=tmp_path / "b"))
    c = tiny_models.sink_parameters(tiny_models.tiny_model("gpt_oss", cache_dir=tmp_path / "a", seed=1))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not any(torch.equal(a[k], c[k]) for k in a)


def test_bf16_model_is_the_fp32_model_rounded(cache):
    fp32 = tiny_models.sink_parameters(tiny_models.tiny_model("gpt_oss", "float32", cache_dir=cache))
    bf16 = tiny_models.sink_parameters(tiny_models.tiny_model("gpt_oss", "bfloat16", cache_dir=cache))
    for k in fp32:
        assert bf16[k].dtype == torch.bfloat16
        assert torch.equal(bf16[k], fp32[k].to(torch.bfloat16))


def test_cache_reuses_and_concurrent_builds_do_not_race(tmp_path):
    code = ("import sys; from vllm_sinks.testing import tiny_models as m; "
            "print(m.tiny_model('granite_swa', 'float32', cache_dir=sys.argv[1]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    paths = {o[0].strip() for o in outs}
    assert len(paths) == 1
    entries = sorted(p.name for p in tmp_path.iterdir())
    assert entries == [os.path.basename(paths.pop())], f"left-over build dirs: {entries}"
    again = tiny_models.tiny_model("granite_swa", "float32", cache_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [again.name]


def test_bad_input_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="unknown sink family 'llama'"):
        tiny_models.tiny_model("llama", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        tiny_models.tiny_model("gpt_oss", "float16", cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        tiny_models.sink_parameters(tmp_path)
    assert tiny_models.canonical_dtype("bf16") == "bfloat16"
    assert tiny_models.canonical_dtype("torch.float32") == "float32"
