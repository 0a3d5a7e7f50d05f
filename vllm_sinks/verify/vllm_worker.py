"""Subprocess side of the differential check: run vLLM offline and write prompt logprobs as JSON.

    python -m vllm_sinks.verify.vllm_worker JOBS.json RESULTS.json

JOBS.json: ``{"jobs": [{"model": dir, "impl": "transformers"|"vllm", "dtype": "float32"|"bfloat16",
"token_ids": [...], "max_model_len": int}, ...]}``. Jobs run one after another, one ``LLM`` each,
in this one process, so vLLM is imported once (importing it is a large part of a run on CPU).

RESULTS.json is rewritten after every job (``{"pid": ..., "results": [{"logprobs": [...]} |
{"error": "..."}]}``): if a job takes the whole process down (a native crash), the caller still has
the finished ones and knows which job was running. Each job is framed on stderr by
``JOB_BEGIN``/``JOB_END`` marker lines so the caller can cut the log (and the plugin's report lines)
per job.

Why a subprocess at all: vLLM keeps process-wide state (plugins loaded once, patches applied once,
logging config), and the env a case needs (e.g. ``VLLM_SINKS_TRANSFORMERS_SINKS=off``) must be set
before vLLM loads the plugin.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Callable

JOB_BEGIN = "@@vllm-sinks-job-begin"
JOB_END = "@@vllm-sinks-job-end"


def _mark(marker: str, index: int) -> None:
    sys.stderr.flush()
    print(f"{marker} {index} pid={os.getpid()}", file=sys.stderr, flush=True)


def prompt_logprobs(output, token_ids: list[int]) -> list[float]:
    """Logprob of token i+1 given tokens 0..i, read from vLLM's ``prompt_logprobs`` (entry 0 is None)."""
    entries = output.prompt_logprobs
    if entries is None or len(entries) != len(token_ids):
        got = None if entries is None else len(entries)
        raise RuntimeError(f"vLLM returned {got} prompt logprob entries for {len(token_ids)} tokens")
    values = []
    for pos in range(1, len(token_ids)):
        entry = entries[pos]
        tok = token_ids[pos]
        if entry is None or tok not in entry:
            raise RuntimeError(f"vLLM gave no logprob for prompt token {tok} at position {pos}")
        values.append(float(entry[tok].logprob))
    return values


def stop_group(proc) -> None:
    """Stop a worker started in its own session and everything it started (engine core, TP workers):
    SIGTERM to the group, then SIGKILL to whatever of it is left."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        # The leader is gone; its children may linger in the group a moment longer.
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return


def _shutdown(llm) -> None:
    # Stop the engine core now instead of at interpreter exit, so the next job's engine does not
    # start while the previous one still holds its cores and KV cache.
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    stop = getattr(core, "shutdown", None)
    if callable(stop):
        stop()


def run_job(job: dict) -> list[float]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], tokenizer=job["model"], model_impl=job["impl"], dtype=job["dtype"],
              enforce_eager=True, max_model_len=int(job["max_model_len"]))
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        [output] = llm.generate([{"prompt_token_ids": list(job["token_ids"])}], params, use_tqdm=False)
        return prompt_logprobs(output, list(job["token_ids"]))
    finally:
        _shutdown(llm)
        del llm
        gc.collect()


def serve_jobs(argv: list[str] | None, prog: str, run: Callable[[dict], dict]) -> int:
    """The job-file protocol shared by this worker and ``inspect_transformers_model``.

    Reads ``{"jobs": [...]}``, runs ``run(job)`` for each (a result dict, or ``{"error": ...}`` if it
    raises), frames each job on stderr with JOB_BEGIN/JOB_END and rewrites RESULTS.json atomically after
    every job, so a native crash still leaves the finished results and says which job was running.
    """
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(f"usage: python -m {prog} JOBS.json RESULTS.json", file=sys.stderr)
        return 2
    jobs_path, out_path = argv
    with open(jobs_path) as f:
        jobs = json.load(f)["jobs"]
    results: list[dict] = []

    def write() -> None:
        tmp = out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"pid": os.getpid(), "results": results}, f)
        os.replace(tmp, out_path)

    write()
    for i, job in enumerate(jobs):
        _mark(JOB_BEGIN, i)
        start = time.monotonic()
        try:
            result = run(job)
        except Exception as e:  # noqa: BLE001 - one failing model must not hide the others' numbers
            traceback.print_exc()
            result = {"error": f"{type(e).__name__}: {e}"}
        result["seconds"] = round(time.monotonic() - start, 2)
        results.append(result)
        _mark(JOB_END, i)
        write()
    return 0


def main(argv: list[str] | None = None) -> int:
    return serve_jobs(argv, "vllm_sinks.verify.vllm_worker", lambda job: {"logprobs": run_job(job)})


if __name__ == "__main__":
    sys.exit(main())
