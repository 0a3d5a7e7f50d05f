"""Verification: does vLLM, with and without vllm-sinks, give the answers Hugging Face eager gives?

``vllm-sinks verify`` is the front door (:func:`main`). Its parts:

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
    """``vllm-sinks verify [...]``: the family check (the only mode so far)."""
    from vllm_sinks.verify.families import main as families_main

    return families_main(argv)
