"""`vllm-sinks report` / `verify`'s line on transformers, its `kernels`, and whether hub kernels are on."""

from __future__ import annotations

import importlib.metadata

import pytest

from vllm_sinks import hub_kernels


def test_the_line_names_both_versions_the_state_and_ci_where_known():
    assert hub_kernels.stack_line("5.25.0", "0.19.1", True) == \
        "transformers 5.25.0, kernels 0.19.1, hub kernels active"
    assert hub_kernels.stack_line("5.24.0", None, False, ci="pinned") == \
        "transformers 5.24.0, kernels not installed, hub kernels inactive, CI: pinned"
    assert hub_kernels.stack_line(None, None, None, "transformers is not installed") == \
        "transformers not installed, kernels not installed, hub kernels unknown (transformers is not installed)"


def test_detect_agrees_with_what_the_modeling_files_hold():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from torch import nn
    from transformers.models.granite import modeling_granite  # decorated since hub kernels came

    found = hub_kernels.detect()
    assert found.transformers == importlib.metadata.version("transformers")
    assert found.why == "" and found.active is isinstance(modeling_granite.apply_rotary_pos_emb, nn.Module)
    if found.kernels is None:
        assert found.active is False
    assert hub_kernels.describe() == hub_kernels.stack_line(found.transformers, found.kernels, found.active)
