"""The Gluon name map, on the CPU."""

from __future__ import annotations

import pytest
import triton

from vllm_sinks.v1.attention.ops import gluon_api


def test_every_gluon_name_resolves_under_the_installed_triton():
    if gluon_api.IMPORT_ERROR is not None:
        pytest.skip(f"no Gluon here: {gluon_api.IMPORT_ERROR}")
    for name in gluon_api.__all__:
        if not name.endswith("IMPORT_ERROR"):  # the error strings are None where all is well
            assert getattr(gluon_api, name) is not None, name
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    # The newer name wherever the release has it (3.9 raises on the old one).
    if hasattr(async_copy, "async_load"):
        assert gluon_api.async_load is async_copy.async_load
    major_minor = tuple(int(x) for x in triton.__version__.split(".")[:2])
    if major_minor >= (3, 9):
        assert gluon_api._REINTERPRET == "reinterpret"
