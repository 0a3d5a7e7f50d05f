"""The Hopper kernels' gate (``hopper_gate``): a kernel's env switch comes before the platform, and
a variant's first launch either compiles it or is refused once, with one warning, for good; a
variant that compiled before and then fails is a real error and is raised. No GPU needed."""

from __future__ import annotations

import warnings

import pytest
import torch

from vllm_sinks.env import WINDOW_WALK
from vllm_sinks.v1.attention.ops import hopper_gate


def test_the_switch_is_asked_before_the_platform(monkeypatch):
    monkeypatch.setattr(hopper_gate, "hopper_unavailable", lambda device: None)
    monkeypatch.setenv(WINDOW_WALK.name, "off")
    assert hopper_gate.kernel_unavailable(torch.device("cuda", 0), WINDOW_WALK) == f"{WINDOW_WALK.name}=off"
    assert hopper_gate.kernel_unavailable(torch.device("cuda", 0)) is None  # a kernel without a switch
    monkeypatch.setenv(WINDOW_WALK.name, "on")
    assert hopper_gate.kernel_unavailable(torch.device("cuda", 0), WINDOW_WALK) is None
    monkeypatch.setattr(hopper_gate, "hopper_unavailable", lambda device: "not sm_90")
    assert hopper_gate.kernel_unavailable(torch.device("cuda", 0), WINDOW_WALK) == "not sm_90"


def test_a_refused_variant_warns_once_and_is_never_tried_again():
    compiled, failed, tries = set(), set(), []

    def broken():
        tries.append(1)
        raise RuntimeError("no such Gluon op")

    with pytest.warns(UserWarning, match="Hopper window kernel failed to compile.*no such Gluon op"):
        assert hopper_gate.first_launch(broken, "v", compiled, failed, "window") == (False, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hopper_gate.first_launch(broken, "v", compiled, failed, "window") == (False, None)
    assert len(tries) == 1 and failed == {"v"} and not compiled


def test_a_variant_that_compiled_before_raises_its_launch_error():
    compiled, failed = set(), set()
    assert hopper_gate.first_launch(lambda: "kernel", "v", compiled, failed, "full") == (True, "kernel")
    assert compiled == {"v"}

    def fails():
        raise RuntimeError("launch failed")

    with pytest.raises(RuntimeError, match="launch failed"):
        hopper_gate.first_launch(fails, "v", compiled, failed, "full")
    assert not failed
