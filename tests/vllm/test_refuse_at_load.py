"""A model whose sink vllm-sinks cannot hand to vLLM is refused while it loads: the API server exits
before it says it is up, and offline ``LLM(...)`` raises at construction, both with the message the
forward-time guard gives. The model: the remote-code tiny model whose ``s_aux`` is computed in forward
(``sinks * 0.5``; ``tiny_models.REFUSED_MODEL``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

pytest.importorskip("torch")
pytest.importorskip("vllm")

from tests.support import server  # noqa: E402
from vllm_sinks.verify import differential, tiny_models  # noqa: E402

#: What the guard's message (``base.missing_sink_error``) says of the refused model's first layer.
REFUSAL = "ScaledSinkAttention (layer 0) passes a learnable attention sink (s_aux) to the attention interface"

_CONSTRUCT = """
import json, sys
from vllm import LLM
try:
    LLM(model=sys.argv[1], model_impl="transformers", dtype="float32", trust_remote_code=True,
        enforce_eager=True, max_model_len=128)
except Exception as e:
    print("RESULT " + json.dumps({"constructed": False, "type": type(e).__name__, "message": str(e)}))
else:
    print("RESULT " + json.dumps({"constructed": True}))
"""


@pytest.fixture(scope="module")
def refused_model():
    return tiny_models.tiny_model(tiny_models.REFUSED_MODEL, "float32")


def test_offline_llm_raises_the_guards_message_at_construction(refused_model):
    env = {**os.environ, **differential.BASE_ENV, **differential.DEFAULT_RUN_ENV}  # the engine in this process
    proc = subprocess.run([sys.executable, "-c", _CONSTRUCT, str(refused_model)], env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert not result["constructed"], "LLM(...) built an engine for a model whose sink vLLM cannot hold"
    assert result["type"] == "ValueError" and REFUSAL in result["message"], result


def test_api_server_exits_at_load_naming_the_sink(refused_model):
    with pytest.raises(server.ServerError) as failed:
        with server.running_server(refused_model, "transformers", dtype="float32",
                                   extra_args=("--trust-remote-code",)):
            pass
    log = failed.value.log
    assert "exited with code" in str(failed.value) and "code 0 " not in str(failed.value), \
        f"{failed.value}\n{log[-3000:]}"
    assert REFUSAL in log, log[-3000:]
    assert "Application startup complete" not in log  # refused before the server said it was up
