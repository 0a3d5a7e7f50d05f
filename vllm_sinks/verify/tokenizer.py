"""A tiny byte-level BPE tokenizer for the test models, trained on a corpus that ships with us.

Why trained here rather than downloaded: the CPU harness has no model hub. Byte-level BPE can encode
any text (every byte has a token), so prompts never hit an unknown token. The special tokens come
first so their ids are fixed: pad 0, bos 1, eos 2; the encoder prepends bos, as most causal LMs do,
so HF and vLLM tokenize a prompt to the same ids.

Imports ``tokenizers`` only; ``transformers`` is needed just to save the HF wrapper files.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
import pathlib

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

#: 3 specials + 256 byte tokens + 253 merges. Small enough for a 64-wide embedding to stay tiny,
#: large enough that English prose is ~4 characters a token.
VOCAB_SIZE = 512


def corpus_text() -> str:
    """The training corpus (plain English prose written for this project)."""
    return importlib.resources.files("vllm_sinks.verify").joinpath("data/corpus.txt").read_text("utf-8")


@functools.lru_cache(maxsize=None)
def _trained_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 3 + 256:
        raise ValueError(f"vocab_size={vocab_size}: byte-level BPE needs at least 259 (3 specials + 256 bytes)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[PAD, BOS, EOS],  # ids 0, 1, 2 in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text().splitlines(), trainer=trainer)
    got = [tok.token_to_id(t) for t in (PAD, BOS, EOS)]
    if got != [PAD_ID, BOS_ID, EOS_ID]:
        raise RuntimeError(f"special token ids came out {got}, expected [0, 1, 2]")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                      special_tokens=[(BOS, BOS_ID)]),
    ])
    return tok.to_str()


def build_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A fresh ``tokenizers.Tokenizer`` (training is deterministic and takes milliseconds)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_trained_json(vocab_size))


def save_tokenizer(directory: str | os.PathLike, vocab_size: int = VOCAB_SIZE) -> pathlib.Path:
    """Write tokenizer.json + tokenizer_config.json + special_tokens_map.json for ``AutoTokenizer``.

    No chat template on purpose: the harness sends raw completions, and a template would hide
    tokenization differences between HF and vLLM.
    """
    from transformers import PreTrainedTokenizerFast

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(vocab_size),
        pad_token=PAD, bos_token=BOS, eos_token=EOS,
        model_max_length=4096,
    )
    hf_tok.save_pretrained(str(directory))
    return directory
