"""`vllm-sinks verify --model`: input checks, the fp32-fits decision, verdicts and the table (pure:
no vLLM, no torch; the checkpoints here are safetensors headers written by hand)."""

import json
import struct

import pytest

from vllm_sinks.verify import model as vm
from vllm_sinks.verify import model_inputs as mi
from vllm_sinks.verify.model_inputs import ModelCheckError


def _write_safetensors(path, tensors: dict[str, list[int]]):
    """A valid safetensors file of zero-filled fp32 tensors (name -> shape)."""
    header, offset = {}, 0
    for name, shape in tensors.items():
        size = 4
        for d in shape:
            size *= d
        header[name] = dict(dtype="F32", shape=shape, data_offsets=[offset, offset + size])
        offset += size
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"\0" * offset)


def _checkpoint(tmp_path, tensors, **config):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GptOssForCausalLM"],
                                                       "model_type": "gpt_oss", **config}))
    _write_safetensors(tmp_path / "model.safetensors", tensors)
    return tmp_path


# ---- the checkpoint ---------------------------------------------------------------------------

def test_a_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelCheckError, match="no such directory"):
        mi.resolve_model(str(tmp_path / "nope"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelCheckError, match="is a file"):
        mi.resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ModelCheckError, match="no config.json"):
        mi.resolve_model(str(tmp_path))


def test_a_hub_id_must_already_be_in_the_cache(tmp_path, monkeypatch):
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelCheckError, match="does not download"):
        mi.resolve_model("some-org/some-model")


def test_sinks_and_parameters_come_from_the_safetensors_headers(tmp_path):
    _checkpoint(tmp_path, {"model.layers.0.self_attn.sinks": [4], "model.layers.1.self_attn.sinks": [4],
                           "model.layers.0.self_attn.q_proj.weight": [8, 8], "lm_head.weight": [10, 8]})
    cp = mi.read_checkpoint(tmp_path)
    assert cp.params == 4 + 4 + 64 + 80
    assert cp.sink_layers == {0, 1} and cp.has_sinks
    assert cp.sink_names == ["model.layers.0.self_attn.sinks", "model.layers.1.self_attn.sinks"]


def test_a_model_without_sinks_reads_as_none(tmp_path):
    _checkpoint(tmp_path, {"model.layers.0.self_attn.q_proj.weight": [8, 8]})
    cp = mi.read_checkpoint(tmp_path)
    assert cp.sink_layers == set() and not cp.has_sinks


def test_remote_code_is_needed_only_for_a_model_type_transformers_lacks():
    config = {"model_type": "my_sinky", "auto_map": {"AutoConfig": "conf.MyConfig"}}
    assert mi.needs_remote_code(config, {"llama", "gpt_oss"})
    assert not mi.needs_remote_code({**config, "model_type": "llama"}, {"llama"})
    assert not mi.needs_remote_code({"model_type": "my_sinky"}, {"llama"})


def test_the_backend_needs_a_causal_lm_class():
    with pytest.raises(ModelCheckError, match="cannot load it .*native vLLM has a class"):
        vm.check_backend_can_load({"model_type": "whisper"}, "WhisperForConditionalGeneration", {"llama"},
                                  False, native=True)
    vm.check_backend_can_load({"model_type": "llama"}, "LlamaForCausalLM", {"llama"}, False, native=False)
    remote = {"model_type": "x", "auto_map": {"AutoModelForCausalLM": "m.X"}}
    vm.check_backend_can_load(remote, "X", set(), True, native=False)
    with pytest.raises(ModelCheckError, match="maps none in auto_map"):
        vm.check_backend_can_load({"model_type": "x", "auto_map": {"AutoModel": "m.X"}}, "X", set(), True, False)


def test_dtypes():
    assert mi.config_dtype({"dtype": "bfloat16"}) == "bfloat16"
    assert mi.config_dtype({"torch_dtype": "float16"}) == "float16"
    assert mi.config_dtype({}) == "float32"
    assert mi.canonical_dtype("bf16") == "bfloat16"
    with pytest.raises(ModelCheckError, match="float32, bfloat16, float16"):
        mi.canonical_dtype("int8")


# ---- fp32 reference when it fits --------------------------------------------------------------

def test_the_reference_is_fp32_when_it_fits():
    gib = 2 ** 30
    params = 2 * 10 ** 9  # 8 GB in fp32, 10 GB with the headroom
    assert mi.reference_dtype(params, "bfloat16", 20 * gib)[0] == "float32"
    dtype, why = mi.reference_dtype(params, "bfloat16", 8 * gib)
    assert dtype == "bfloat16" and "fp32 would need" in why
    assert mi.reference_dtype(params, "float32", 1 * gib)[0] == "float32"  # nothing else to run it in
    assert mi.reference_dtype(params, "float16", None) == ("float16", "free memory unknown: the model's dtype")


# ---- prompts and lengths ----------------------------------------------------------------------

def test_prompts_file(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("first prompt\n\n  \nsecond\\nwith a newline\n")
    assert mi.read_prompts(f) == ["first prompt", "second\nwith a newline"]
    f.write_text("\n\n")
    with pytest.raises(ModelCheckError, match="no prompt"):
        mi.read_prompts(f)
    with pytest.raises(ModelCheckError, match="no such file"):
        mi.read_prompts(tmp_path / "missing.txt")


def test_a_prompt_longer_than_the_max_length_is_refused():
    where = ["prompt 1", "prompt 2"]
    with pytest.raises(ModelCheckError, match="prompt 2 has 120 tokens; .* needs 136 .*--max-model-len \\(128\\)"):
        mi.check_lengths([10, 120], 16, 128, 4096, where)
    with pytest.raises(ModelCheckError, match="max_position_embeddings \\(100\\)"):
        mi.check_lengths([10, 90], 16, None, 100, where)
    with pytest.raises(ModelCheckError, match="at least 2"):
        mi.check_lengths([1, 5], 16, None, None, where)
    assert mi.check_lengths([10, 120], 16, None, 4096, where) == 144  # rounded up to 16
    assert mi.check_lengths([10, 20], 16, None, 4096, where) == 128  # at least 128
    assert mi.check_lengths([10, 20], 16, None, 100, where) == 100  # at most the model's
    assert mi.check_lengths([10, 20], 16, 512, 4096, where) == 512


def test_default_prompts_are_of_several_lengths():
    lengths = sorted(len(p) for p in mi.DEFAULT_PROMPTS)
    assert len(lengths) >= 4 and lengths[-1] > 10 * lengths[0]


# ---- comparison, verdicts, table --------------------------------------------------------------

def _run(name="patch on", impl="transformers", dtype="float32", **kw):
    return vm.Run(name, impl, dtype, **kw)


def test_compare_finds_the_first_greedy_difference():
    hf = [dict(logprobs=[-1.0, -2.0], continuation=[5, 6, 7]), dict(logprobs=[-1.0], continuation=[1, 2, 3])]
    got = [dict(logprobs=[-1.1, -2.0], continuation=[5, 6, 7]), dict(logprobs=[-0.7], continuation=[1, 9, 3])]
    run = _run()
    vm.compare(run, hf, got)
    assert run.mean_abs_delta == pytest.approx(0.4 / 3) and run.max_abs_delta == pytest.approx(0.3)
    assert (run.first_diff, run.first_diff_prompt, run.tokens, run.continuation) == (1, 1, 3, 3)
    assert vm.greedy_cell(run) == "token 1 (prompt 2)"
    vm.compare(run, hf, hf)
    assert run.first_diff is None and vm.greedy_cell(run) == "same (3/3)"
    with pytest.raises(ValueError, match="answered 1 prompts"):
        vm.compare(run, hf, hf[:1])


def test_verdicts_can_fail():
    ok = dict(wanted={0, 1}, reference="float32", native_mean=None, bf16_sink_kernel=False)
    assert vm.verdict(_run(mean_abs_delta=3e-4, sink_layers=[0, 1]), **ok) == "ok"
    assert vm.verdict(_run(mean_abs_delta=1.5e-3, sink_layers=[0, 1]), **ok) == "FAIL: mean |Δ| 0.0015 > 0.0010 (fp32)"
    assert vm.verdict(_run(mean_abs_delta=1.5e-3, sink_layers=[0, 1]), **{**ok, "bf16_sink_kernel": True}) == "ok"
    dropped = vm.verdict(_run("patch off", mean_abs_delta=0.43, sink_layers=[]), **ok)
    assert dropped.startswith("FAIL: sinks dropped in 2 of 2 layers (0, 1); mean |Δ| 0.4300 > 0.0010")
    # Right numbers with a sink missing still fail: the sink must be where the checkpoint has it.
    assert vm.verdict(_run(mean_abs_delta=1e-4, sink_layers=[0]), **ok).startswith("FAIL: sinks dropped in 1 of 2")
    assert "with none in the checkpoint (2)" in vm.verdict(_run(mean_abs_delta=1e-4, sink_layers=[0, 1, 2]), **ok)
    assert vm.verdict(_run(error="ValueError: boom\ntraceback"), **ok) == "FAIL: ValueError: boom"


def test_bf16_is_judged_against_native_where_it_ran():
    kw = dict(wanted=set(), reference="float32", bf16_sink_kernel=True)
    assert vm.verdict(_run(dtype="bfloat16", mean_abs_delta=0.03, sink_layers=[]), native_mean=0.026, **kw) == "ok"
    assert vm.verdict(_run(dtype="bfloat16", mean_abs_delta=0.04, sink_layers=[]), native_mean=0.026,
                      **kw).startswith("FAIL: mean |Δ| 0.0400 > 0.0312 (1.2x native)")
    assert vm.verdict(_run(dtype="bfloat16", mean_abs_delta=0.04, sink_layers=[]), native_mean=None, **kw) == "ok"
    assert vm.verdict(_run(dtype="bfloat16", mean_abs_delta=0.06, sink_layers=[]), native_mean=None,
                      **kw).startswith("FAIL")
    # A bf16 reference (fp32 did not fit) judges even an fp32 run by the 16-bit bound.
    assert vm.verdict(_run(mean_abs_delta=0.01, sink_layers=[]), native_mean=None,
                      **{**kw, "reference": "bfloat16"}) == "ok"


def test_table_rows():
    runs = [_run(mean_abs_delta=3e-4, max_abs_delta=2e-3, sink_layers=[0, 1], continuation=16, verdict="ok"),
            _run("patch off", mean_abs_delta=0.43, max_abs_delta=1.9, sink_layers=[], first_diff=0,
                 first_diff_prompt=2, continuation=16, verdict="FAIL: sinks dropped"),
            _run("native", "vllm", error="RuntimeError: no kernel", verdict="FAIL: RuntimeError: no kernel")]
    table = vm.format_table(runs, {0, 1}).splitlines()
    assert table[2] == "| patch on | transformers | float32 | 3.0e-04 | 0.0020 | same (16/16) | 2/2 | ok |"
    assert table[3] == ("| patch off | transformers | float32 | 0.4300 | 1.9000 | token 0 (prompt 3) | 0/2 | "
                        "FAIL: sinks dropped |")
    assert table[4].startswith("| native | vllm | float32 | error | — | — | — |")
    assert vm.sinks_cell(_run(sink_layers=[]), set()) == "none / none"
    assert vm.sinks_cell(_run(sink_layers=[3]), None) == "1 / ? (no safetensors)"


def _plan(tmp_path, runs, sink_layers):
    cp = mi.Checkpoint(params=10, sink_names=[f"model.layers.{i}.self_attn.sinks" for i in sorted(sink_layers)],
                       sink_layers=set(sink_layers))
    return vm.ModelPlan("m", tmp_path, "LlamaForCausalLM", "float32", "float32", "the model's own dtype", "cpu", cp,
                        ["a b"], [[1, 5, 6]], 128, 4, False, 1, runs)


def test_report_says_no_sinks_and_exit_follows_the_patch_on_run(tmp_path):
    on, off = _run(verdict="ok", sink_layers=[]), _run("patch off", verdict="FAIL: x", sink_layers=[])
    plan = _plan(tmp_path, [on, off], set())
    text = vm.report(plan, "vLLM x")
    assert vm.NO_SINKS in text and "no native vLLM class for LlamaForCausalLM" in text
    assert not vm.failed(plan)  # patch off failing is what the tool is there to show
    on.verdict = "FAIL: sinks dropped"
    assert vm.failed(plan)
    assert vm.sinks_line(_plan(tmp_path, [on], {0, 3})).startswith("sinks in the checkpoint: 2 tensors in 2 layers (0, 3)")


def test_the_patch_report_lines_are_picked_from_the_log():
    log = ("INFO [vllm-sinks] vllm-sinks 0.1.0 in pid 42 (EngineCore), vLLM 0.29.0: transformers-sinks armed (x)\n"
           "INFO [vllm-sinks] transformers-sinks applied (SinkFuser) (on import of m, 1 ms) [pid 42, EngineCore]\n"
           "INFO [base.py:122] [vllm-sinks] vllm-sinks: transformers-sinks: /m: sinks of 2 A layers served by upstream\n"
           "INFO [bf16_numerics.py:9] [vllm-sinks] vllm-sinks: transformers-bf16-numerics: G (bfloat16): rotary in fp32\n"
           "INFO [vllm-sinks] logits-scaling applied (x) [pid 42, EngineCore]\n")
    assert [m[1] for m in vm._PATCH_LINE.finditer(log)] == [
        "transformers-sinks applied (SinkFuser) (on import of m, 1 ms)",
        "transformers-sinks: /m: sinks of 2 A layers served by upstream",
        "transformers-bf16-numerics: G (bfloat16): rotary in fp32"]


def test_per_model_patch_lines_go_to_their_own_model(tmp_path):
    from vllm_sinks.verify.vllm_worker import JOB_BEGIN, JOB_END

    a, b = _plan(tmp_path, [], set()), _plan(tmp_path, [], set())
    log = (f"[vllm-sinks] transformers-sinks applied (per model) [pid 1, E]\n{JOB_BEGIN} 0 pid=1\n"
           f"[vllm-sinks] vllm-sinks: transformers-sinks: A: served by upstream\n{JOB_END} 0 pid=1\n"
           f"{JOB_BEGIN} 1 pid=1\n[vllm-sinks] vllm-sinks: transformers-sinks: B: served by vllm-sinks\n"
           f"{JOB_END} 1 pid=1\n")
    vm._attribute_patch_lines("on", [(a, None, {}), (b, None, {})], log)
    assert a.patch_lines["on"] == ["transformers-sinks applied (per model)", "transformers-sinks: A: served by upstream"]
    assert b.patch_lines["on"] == ["transformers-sinks applied (per model)", "transformers-sinks: B: served by vllm-sinks"]


def test_bf16_yardstick_is_the_larger_of_native_and_hf_eagers_own_error():
    """A 16-bit run is judged within 1.2x of native's error or of HF eager's own error in that dtype
    (against the fp32 reference), whichever is larger: a model whose bf16 rounding alone is large
    passes; a dropped sink, far beyond both, still fails."""
    kw = dict(wanted={0}, reference="float32", bf16_sink_kernel=False)
    # a tiny GPT-OSS on 0.32.0 (2026-12-01): backend 0.1195, native 0.0932, HF's own bf16 0.125
    assert vm.verdict(_run(dtype="bfloat16", mean_abs_delta=0.1195, sink_layers=[0]), native_mean=0.0932,
                      **kw) .startswith("FAIL: mean |Δ| 0.1195 > 0.1118 (1.2x native)")
    assert vm.verdict(_run(dtype="bfloat16", mean_abs_delta=0.1195, sink_layers=[0]), native_mean=0.0932,
                      hf_own=0.125, **kw) == "ok"
    assert vm.verdict(_run(dtype="bfloat16", mean_abs_delta=0.16, sink_layers=[0]), native_mean=0.0932,
                      hf_own=0.125, **kw) == "FAIL: mean |Δ| 0.1600 > 0.1500 (1.2x HF eager's own bfloat16 error)"
    # native itself is judged against HF eager's own error where it is known (else the 0.05 bound)
    native = _run("native", impl="vllm", dtype="bfloat16", mean_abs_delta=0.0932, sink_layers=[0])
    assert vm.verdict(native, native_mean=0.0932, hf_own=0.125, **kw) == "ok"
    assert vm.verdict(native, native_mean=0.0932, **kw).startswith("FAIL: mean |Δ| 0.0932 > 0.0500")
    # fp32 runs against the fp32 reference keep the fp32 bound whatever the yardsticks
    assert vm.verdict(_run(mean_abs_delta=2e-3, sink_layers=[0]), native_mean=None, hf_own=0.125,
                      **kw).startswith("FAIL: mean |Δ| 0.0020 > 0.0010 (fp32)")
