"""How close bf16 GPT-OSS through the Transformers backend comes to native vLLM, with and without the
``transformers-bf16-numerics`` patch, over several random tiny models (seeds).

    python benchmarks/bf16_numerics_seeds.py [--model gpt_oss_hd64] [--seeds 0-11] [--json PATH]

Per seed: the tiny model in bf16 (``vllm_sinks.verify.tiny_models``), HF eager in fp32 on it as the
reference (what ``vllm-sinks verify`` does), and three vLLM runs on the same prompt: the backend with
the patch (as installed), the backend with ``VLLM_SINKS_TRANSFORMERS_BF16_NUMERICS=off`` (as shipped
before it) and native vLLM. All seeds of one setting share one vLLM process (two processes in all).
Prints one row per seed (mean |Δ prompt logprob| each, ratio to native) and a summary: means, the
per-seed difference from native (mean ± standard error) and the largest ratio to native.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

ENV_VAR = "VLLM_SINKS_TRANSFORMERS_BF16_NUMERICS"
SETTINGS = ("patched", "off", "native")


def _seeds(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def _delta(logprobs: list[float], ref: list[float]) -> float:
    return sum(abs(a - b) for a, b in zip(logprobs, ref)) / len(ref)


def _stats(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:+.4f}" if values else "—"
    return f"{statistics.mean(values):+.4f} ± {statistics.stdev(values) / math.sqrt(len(values)):.4f}"


def main(argv: list[str] | None = None) -> int:
    from vllm_sinks.verify import differential, tiny_models
    from vllm_sinks.verify.inspect_transformers_model import run_inspection

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt_oss_hd64")
    ap.add_argument("--seeds", default="0-3", help="e.g. 0-23 or 0,5,7")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    start = time.monotonic()

    seeds = _seeds(args.seeds)
    refs, jobs = {}, {"on": [], "off": []}
    for seed in seeds:
        model = tiny_models.tiny_model(args.model, "bfloat16", seed=seed)
        ids, ref = differential.hf_prompt_logprobs(model, "float32")
        refs[seed] = ref
        job = dict(model=str(model), dtype="bfloat16", token_ids=ids, max_model_len=max(128, len(ids) + 16))
        jobs["on"] += [(seed, "patched", dict(job, impl="transformers")),
                       (seed, "native", dict(job, impl="vllm"))]
        jobs["off"].append((seed, "off", dict(job, impl="transformers")))
    print(f"{len(seeds)} models built and referenced in {time.monotonic() - start:.0f} s", file=sys.stderr)

    deltas: dict[tuple[int, str], float] = {}
    for name, batch in jobs.items():
        env = {ENV_VAR: "off"} if name == "off" else {}
        results, log = run_inspection([j for _, _, j in batch], env=env, timeout=300 + 120 * len(batch))
        for (seed, setting, _), result in zip(batch, results):
            if "error" in result:
                print(f"seed {seed} {setting}: {result['error']}", file=sys.stderr)
                continue
            deltas[(seed, setting)] = _delta(result["logprobs"], refs[seed])
        lines = [line for line in log.splitlines() if "transformers-bf16-numerics:" in line]
        print(f"[{name}] {time.monotonic() - start:.0f} s; first patch line: {lines[0] if lines else 'none'}",
              file=sys.stderr)

    print(f"{args.model} bf16, {differential.environment_line()}; mean |Δ prompt logprob| vs HF eager fp32\n")
    print("| seed | backend, patch off | backend, patched | native vLLM | off / native | patched / native |")
    print("|---|---|---|---|---|---|")
    complete = [s for s in seeds if all((s, k) in deltas for k in SETTINGS)]
    for s in complete:
        off, on, nat = (deltas[(s, k)] for k in ("off", "patched", "native"))
        print(f"| {s} | {off:.4f} | {on:.4f} | {nat:.4f} | {off / nat:.2f} | {on / nat:.2f} |")
    if complete:
        col = {k: [deltas[(s, k)] for s in complete] for k in SETTINGS}
        print(f"| mean ({len(complete)}) | {statistics.mean(col['off']):.4f} | {statistics.mean(col['patched']):.4f} | "
              f"{statistics.mean(col['native']):.4f} | max {max(o / n for o, n in zip(col['off'], col['native'])):.2f} | "
              f"max {max(o / n for o, n in zip(col['patched'], col['native'])):.2f} |")
        print(f"\nd vs native (mean ± s.e.): off {_stats([o - n for o, n in zip(col['off'], col['native'])])}, "
              f"patched {_stats([o - n for o, n in zip(col['patched'], col['native'])])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{s}:{k}": v for (s, k), v in deltas.items()}, f, indent=1)
    return 0 if len(complete) == len(seeds) else 1


if __name__ == "__main__":
    sys.exit(main())
