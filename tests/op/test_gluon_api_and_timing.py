"""The Gluon name map and the timing of the measured choice, on the CPU."""

from __future__ import annotations

import time

import pytest
import torch
import triton

from vllm_sinks.v1.attention.ops import gluon_api, measured_choice


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


@pytest.fixture
def no_device_sync(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)


@pytest.mark.parametrize("default_s, challenger_s, wins", [(2e-3, 0.0, True), (0.0, 2e-3, False)])
def test_the_faster_candidate_wins(no_device_sync, default_s, challenger_s, wins):
    """The chooser's logic (not a speed target): 2 ms of sleep against none, far from the margin."""
    def sleeper(seconds):
        return lambda: time.sleep(seconds) if seconds else None

    won, ratio = measured_choice.challenger_wins(sleeper(default_s), sleeper(challenger_s))
    assert won is wins and (ratio > 1) is wins


def test_no_timing_off_a_cuda_device():
    assert not measured_choice.may_measure(torch.device("cpu"))
