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


def pytest_collection_modifyitems(config, items):
    has_cuda = _cuda_available()
    try:
        import vllm  # noqa: F401

        has_vllm = True
    except ImportError:
        has_vllm = False
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="needs vLLM installed"))
