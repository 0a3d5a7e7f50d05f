"""Verification: does vLLM, with and without vllm-sinks, give the answers Hugging Face eager gives?

``vllm-sinks verify`` is the front door (:func:`main`): without ``--model`` the family check, with
``--model PATH`` the check of one checkpoint. Its parts:

- ``model``: ``verify --model PATH``: the user's checkpoint, patch on / off / native vs HF eager;
  ``model_inputs`` (its input checks, pure) and ``model_worker`` (its vLLM subprocess).
- ``families``: every sink family's tiny model, patch on and off, native beside it; one table.
- ``differential``: vLLM prompt logprobs vs HF eager, mean |Δ logprob| per case (``vllm-sinks diff``).
- ``inspect_transformers_model``: the subprocess job that loads a model through the Transformers
  backend and reads which attention layers got a sink.
- ``vllm_worker``: the subprocess that runs vLLM offline for ``differential``.
- ``tiny_models`` / ``tokenizer``: random-weight models of every sink family (sinks ~ N(0, 2²)) and a
  byte-level BPE trained on ``data/corpus.txt``, built locally (no hub).

Importing this package needs neither vLLM nor torch; the functions that run models import them.
"""

from __future__ import annotations

from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """``vllm-sinks verify [...]``: the family check; ``vllm-sinks verify --model PATH [...]``: one model."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--model" or a.startswith("--model=") for a in args):
        from vllm_sinks.verify.model import main as model_main

        return model_main(args)
    if "-h" in args or "--help" in args:
        print("vllm-sinks verify --model PATH [...]: the same check on your own checkpoint "
              "(`vllm-sinks verify --model PATH --help` lists its options)\n")
    from vllm_sinks.verify.families import main as families_main

    return families_main(args)
