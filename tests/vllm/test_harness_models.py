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

from vllm_sinks.verify import differential, tiny_models, tokenizer  # noqa: E402

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
    code = ("import hashlib; from vllm_sinks.verify import tokenizer as t; "
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
    code = ("import sys; from vllm_sinks.verify import tiny_models as m; "
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


# ---- the differential check's plumbing, with a stand-in for the vLLM worker --------------------------

_FAKE_WORKER = r'''
import json, os, subprocess, sys, time
from vllm_sinks.verify.vllm_worker import JOB_BEGIN, JOB_END
jobs, out, results = json.load(open(sys.argv[1]))["jobs"], sys.argv[2], []
print(f"INFO [vllm-sinks] vllm-sinks 0.0 in pid {os.getpid()} (MainProcess), fake vLLM: p applied", flush=True)
def write():
    json.dump({"pid": os.getpid(), "results": results}, open(out, "w"))
write()
for i, job in enumerate(jobs):
    print(f"{JOB_BEGIN} {i} pid={os.getpid()}", flush=True)
    kind = os.path.basename(job["model"])
    if kind == "crash":  # a native crash: the process dies inside the job
        print("ERROR 11-30 09:00:00 [core.py:1] RuntimeError: boom in the kernel", flush=True)
        os._exit(3)
    if kind == "hang":  # stuck, with a child of its own (as vLLM's engine core would be)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(f"child pid {child.pid}", flush=True)
        time.sleep(600)
    if kind == "fail":
        print("ValueError: not a model", flush=True)
        results.append({"error": "ValueError: not a model"})
    else:
        results.append({"logprobs": [-float(i)] * (len(job["token_ids"]) - 1)})
    print(f"{JOB_END} {i} pid={os.getpid()}", flush=True)
    write()
'''


@pytest.fixture
def fake_python(tmp_path):
    """An 'interpreter' that runs the stand-in worker instead of ``-m vllm_sinks.verify.vllm_worker``."""
    worker = tmp_path / "fake_worker.py"
    worker.write_text(_FAKE_WORKER)
    exe = tmp_path / "fake-python"
    exe.write_text(f'#!/bin/sh\n[ "$2" = vllm_sinks.verify.vllm_worker ] || exit 99\nshift 2\n'
                   f'exec "{sys.executable}" "{worker}" "$@"\n')
    exe.chmod(0o755)
    return str(exe)


def _jobs(*kinds):
    return [dict(model=f"/models/{k}", impl="vllm", dtype="float32", token_ids=[1, 5, 6], max_model_len=128)
            for k in kinds]


def test_a_crashed_worker_costs_one_job_and_the_rest_still_run(fake_python):
    out = differential._run_jobs(_jobs("ok", "crash", "fail", "ok"), {}, fake_python, timeout_per_job=60)
    assert [o.logprobs for o in out] == [[-0.0, -0.0], None, None, [-1.0, -1.0]]
    assert out[1].error.startswith("vLLM worker exited with code 3: RuntimeError: boom in the kernel")
    assert out[2].error == "ValueError: not a model"
    pids = [int(re.search(r"in pid (\d+)", o.report_line)[1]) for o in out]
    assert pids[0] == pids[1] != pids[2] == pids[3]  # a fresh worker took over after the crash


def test_a_hung_worker_is_killed_with_its_children(fake_python):
    import time

    [out] = differential._run_jobs(_jobs("hang"), {}, fake_python, timeout_per_job=3)
    assert out.error.startswith("timed out after 3 s"), out.error
    child = int(re.search(r"child pid (\d+)", out.log)[1])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the worker's child {child} outlived the timeout")


def test_vllm_prompt_logprobs_raises_with_the_log(fake_python):
    ok = differential.vllm_prompt_logprobs("/models/ok", "vllm", "fp32", [1, 5, 6], python=fake_python)
    assert list(ok) == [-0.0, -0.0] and ok.pid and "vllm-sinks 0.0 in pid" in ok.log
    with pytest.raises(differential.VllmRunError, match="ValueError: not a model") as err:
        differential.vllm_prompt_logprobs("/models/fail", "vllm", "float32", [1, 5], python=fake_python)
    assert "last lines of its log" in str(err.value) and err.value.log
    with pytest.raises(ValueError, match="impl 'hf'"):
        differential.vllm_prompt_logprobs("/models/ok", "hf", "float32", [1, 5], python=fake_python)


def test_cases_labels_and_table():
    off = differential.patch_env("off")
    assert differential.patch_label({}) == "on"
    assert differential.patch_label(off) == "off"
    assert differential.patch_label({"VLLM_SINKS_TRANSFORMERS_SINKS": "off"}) == "transformers-sinks=off"
    with pytest.raises(ValueError, match="impl"):
        differential.Case("gpt_oss", "hf", "float32")
    with pytest.raises(ValueError, match="unknown sink family"):
        differential.Case("llama", "vllm", "float32")
    assert len(differential.default_cases()) == 8  # gpt_oss x 2 impls x 2 dtypes x patch on/off
    ok = differential.CaseResult(differential.Case("gpt_oss", "vllm", "bf16"), mean_abs_delta=0.01234,
                                 max_abs_delta=0.05, tokens=46)
    bad = differential.CaseResult(differential.Case("gpt_oss", "transformers", "float32", off),
                                  error="RuntimeError: a | b")
    table = differential.format_table([ok, bad]).splitlines()
    assert table[2] == "| gpt_oss | vllm | bfloat16 | on | 0.0123 | max 0.050 over 46 tokens |"
    assert table[3] == "| gpt_oss | transformers | float32 | off | error | RuntimeError: a \\| b |"
