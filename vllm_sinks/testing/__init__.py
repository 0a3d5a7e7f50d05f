"""The CPU harness: real vLLM on CPU against Hugging Face eager, on tiny local models (no hub, no GPU).

- ``tokenizer``: byte-level BPE trained on ``data/corpus.txt`` (pad/bos/eos = 0/1/2).
- ``tiny_models``: random-weight models of every sink family, sinks ~ N(0, 2²), cached on disk.
- ``differential``: vLLM prompt logprobs vs HF eager, mean |Δ logprob| per case, as a table.
- ``vllm_worker``: the subprocess that runs vLLM offline for ``differential``.
- ``server``: start vLLM's OpenAI API server on a tiny model, one completion, stop it.

Importing these modules needs neither vLLM nor torch; the functions that run models import them.
"""
