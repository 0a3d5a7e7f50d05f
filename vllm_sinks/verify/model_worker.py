"""Subprocess side of ``vllm-sinks verify --model``: run a user's checkpoint in vLLM offline, read
which attention layers got a sink, the prompt logprobs of every prompt, and a greedy continuation.

    python -m vllm_sinks.verify.model_worker JOBS.json RESULTS.json

JOBS.json: ``{"jobs": [{"model": dir, "impl": "transformers"|"vllm", "dtype": str, "prompts": [[ids],
...], "max_tokens": int, "max_model_len": int, "tp": int, "trust_remote_code": bool}, ...]}``; one
``LLM`` per job, all in this process (the job-file protocol of ``vllm_worker.serve_jobs``; started by
``inspect_transformers_model.run_inspection(..., module=__name__)``, which sets
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` so the model can be inspected here). Each result:
``{"prompts": [{"logprobs": [...], "continuation": [ids]}], "layers": [...], "registered": bool}``.
"""

from __future__ import annotations

import gc
import sys

from vllm_sinks.verify.inspect_transformers_model import _merge_ranks, describe_attention, tp_kwargs
from vllm_sinks.verify.vllm_worker import _shutdown, prompt_logprobs, serve_jobs


def run_job(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    tp = int(job.get("tp", 1))
    llm = LLM(model=job["model"], tokenizer=job["model"], model_impl=job["impl"], dtype=job["dtype"],
              enforce_eager=True, max_model_len=int(job["max_model_len"]), seed=0,
              trust_remote_code=bool(job.get("trust_remote_code")), **tp_kwargs(tp))
    try:
        inside = _merge_ranks(llm.apply_model(describe_attention))
        # ignore_eos: the continuation is compared token by token with HF's greedy one, which runs a
        # fixed number of steps; stopping at an end-of-text token would cut the comparison short.
        params = SamplingParams(max_tokens=int(job["max_tokens"]), temperature=0.0, prompt_logprobs=0,
                                ignore_eos=True)
        prompts = [list(ids) for ids in job["prompts"]]
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        return dict(prompts=[dict(logprobs=prompt_logprobs(out, ids), continuation=list(out.outputs[0].token_ids))
                             for out, ids in zip(outputs, prompts)], **inside)
    finally:
        _shutdown(llm)  # free the cores / GPU memory before the next job's engine starts
        del llm
        gc.collect()


def main(argv: list[str] | None = None) -> int:
    return serve_jobs(argv, "vllm_sinks.verify.model_worker", run_job)


if __name__ == "__main__":
    sys.exit(main())
