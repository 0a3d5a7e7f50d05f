"""``python -m vllm.entrypoints.openai.api_server --model <tiny GPT-OSS> --model-impl transformers`` on
127.0.0.1 answers the same greedy completion as HF eager (fp32), with the transformers-sinks patch as
the plugin applies it (forced on where upstream has its own fix, vLLM >= 0.30)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm_sinks.patches import transformers_sinks  # noqa: E402
from vllm_sinks.patches.registry import detect_vllm  # noqa: E402
from tests.support import server
from vllm_sinks.verify import differential, tiny_models  # noqa: E402

MAX_TOKENS = 8


def _hf_greedy(model_dir, prompt: str, n: int) -> str:
    """HF eager fp32, greedy, ``n`` new tokens (eos not special-cased, as the server's ignore_eos)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = tiny_models.model_class("gpt_oss").from_pretrained(str(model_dir), dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    ids = differential.prompt_token_ids(model_dir, prompt)
    new = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids + new]), use_cache=False).logits[0, -1]
            new.append(int(logits.argmax()))
    return tok.decode(new, skip_special_tokens=True)


def test_api_server_greedy_completion_equals_hf():
    model_dir = tiny_models.tiny_model("gpt_oss", "float32")
    era = transformers_sinks._era(detect_vllm())
    env = {"VLLM_SINKS_TRANSFORMERS_SINKS": "on"} if era == "upstream-fix" else {}
    expected = _hf_greedy(model_dir, server.DEFAULT_PROMPT, MAX_TOKENS)
    result = server.server_check(model_dir, "transformers", dtype="float32", max_tokens=MAX_TOKENS, env=env)
    assert "transformers-sinks applied" in result.log, "the plugin's report line is missing"
    assert result.text == expected, f"server {result.text!r} != HF {expected!r}"
