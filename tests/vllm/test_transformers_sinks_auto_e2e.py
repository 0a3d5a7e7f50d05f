"""End to end on CPU vLLM >= 0.30: auto mode serves the sinks upstream's AST lookup misses, and leaves
upstream in charge of the ones it finds.

One inspection subprocess per setting, fp32, ``--model-impl transformers``:

* auto (no env var): the remote-code tiny models (``s_aux=self.sink_holder.sinks``, and
  ``sinks = self.sinks; s_aux=sinks``) must match HF eager, hold the checkpoint's sinks in every
  layer, and their report line must say vllm-sinks served them and why; tiny GPT-OSS
  (``s_aux=self.sinks``) must match HF too, with a report line saying upstream served it;
* off: upstream alone must refuse the remote-code models (its ``check_sinks``), which is what auto
  mode takes over from.
"""

from __future__ import annotations

import re

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm_sinks.patches import transformers_sinks  # noqa: E402
from vllm_sinks.patches.registry import detect_vllm  # noqa: E402
from vllm_sinks.verify import differential, tiny_models  # noqa: E402
from vllm_sinks.verify.inspect_transformers_model import run_inspection  # noqa: E402
from vllm_sinks.verify.vllm_worker import JOB_BEGIN, JOB_END  # noqa: E402

if transformers_sinks._era(detect_vllm()) != "upstream-fix":
    pytest.skip("auto mode shares the work with upstream's lookup only on vLLM >= 0.30",
                allow_module_level=True)

MODELS = tiny_models.REMOTE_CODE_MODELS + ("gpt_oss",)
#: fp32 against HF eager. Measured on 0.32.0: 2.5e-6 (remote-code models).
FP32_BOUND = 2e-3
ENV_VAR = "VLLM_SINKS_TRANSFORMERS_SINKS"
UPSTREAM_REFUSAL = "applies attention sinks, but they were not passed to Attention"


def _job_logs(log: str) -> dict[int, str]:
    """Job index -> its section of the worker's log (framed by the worker's marker lines)."""
    pattern = re.compile(rf"^{re.escape(JOB_BEGIN)} (\d+) .*?^{re.escape(JOB_END)} \1 ", re.M | re.S)
    return {int(m[1]): m[0] for m in pattern.finditer(log)}


class Runs:
    def __init__(self):
        from transformers import AutoTokenizer

        self.dirs, self.hf, jobs = {}, {}, []
        for name in MODELS:
            folder = self.dirs[name] = tiny_models.tiny_model(name, "float32")
            remote = tiny_models.needs_remote_code(name)
            ids = list(AutoTokenizer.from_pretrained(str(folder), trust_remote_code=remote)(
                differential.PROMPT).input_ids)
            self.hf[name] = differential.hf_prompt_logprobs(folder, "float32", token_ids=ids)[1]
            jobs.append(dict(model=str(folder), impl="transformers", dtype="float32", token_ids=ids,
                             max_model_len=max(128, len(ids) + 16), trust_remote_code=remote))
        results, log = run_inspection(jobs, env={ENV_VAR: ""})
        logs = _job_logs(log)
        self.auto = {name: dict(r, log=logs.get(i, "")) for i, (name, r) in enumerate(zip(MODELS, results))}
        remote = [j for j in jobs if j["trust_remote_code"]]
        results, _ = run_inspection(remote, env={ENV_VAR: "off"})
        self.off = dict(zip(tiny_models.REMOTE_CODE_MODELS, results))

    def result(self, name: str) -> dict:
        result = self.auto[name]
        assert "error" not in result, result["error"] + "\n" + result.get("log_tail", "")
        return result

    def report(self, name: str) -> str:
        lines = [line for line in self.auto[name]["log"].splitlines() if "transformers-sinks: " in line
                 and "sinks of" in line]
        assert lines, f"no per-model report line in {name}'s log"
        return lines[-1]


@pytest.fixture(scope="module")
def runs():
    return Runs()


@pytest.mark.parametrize("name", MODELS)
def test_auto_mode_matches_hf_eager(runs, name):
    logprobs, ref = runs.result(name)["logprobs"], runs.hf[name]
    assert len(logprobs) == len(ref)
    delta = sum(abs(a - b) for a, b in zip(logprobs, ref)) / len(ref)
    assert delta <= FP32_BOUND, f"{name}: mean |Δ logprob| vs HF eager {delta:.3g}"


@pytest.mark.parametrize("name", MODELS)
def test_every_layer_holds_the_checkpoints_sink(runs, name):
    checkpoint = {int(next(p for p in n.split(".") if p.isdigit())): t
                  for n, t in tiny_models.sink_parameters(runs.dirs[name]).items()}
    layers = {layer["index"]: layer for layer in runs.result(name)["layers"]}
    assert sorted(layers) == sorted(checkpoint)
    for index, want in checkpoint.items():
        assert layers[index]["has_sink"]
        got = torch.tensor(layers[index]["sinks"])
        torch.testing.assert_close(got, want.float().to(got.dtype), rtol=0, atol=1e-2)


@pytest.mark.parametrize("name", tiny_models.REMOTE_CODE_MODELS)
def test_report_line_says_vllm_sinks_served_what_upstream_missed(runs, name):
    line = runs.report(name)
    assert "SinkRemoteForCausalLM: sinks of 2 " in line, line
    assert "layers served by vllm-sinks (SinkFuser): upstream's AST lookup finds no parameter in" in line
    assert "served by upstream" not in line


def test_report_line_says_upstream_served_gpt_oss(runs):
    line = runs.report("gpt_oss")
    assert "GptOssForCausalLM: sinks of 2 GptOssAttention layers served by upstream: upstream's AST " \
           "lookup resolved `s_aux=self.sinks`" in line, line
    assert "vllm-sinks (SinkFuser)" not in line


@pytest.mark.parametrize("name", tiny_models.REMOTE_CODE_MODELS)
def test_without_the_patch_upstream_refuses_them(runs, name):
    assert UPSTREAM_REFUSAL in runs.off[name].get("error", ""), runs.off[name]
