"""The vLLM tests skip a model only on vLLM's own refusal to run it on this CPU (tests/support/cpu_limits.py)."""

from __future__ import annotations

import pytest

from tests.support.cpu_limits import refusal, skip_if_refused

AMX = ("CPU fused-MoE AMX grouped-gemm kernel cannot be used for a layer with w13 shape (4, 64, 64) / w2 "
       "shape (4, 64, 32): the per-partition MoE intermediate size (32) is not a multiple of 32, and ...")


def test_the_refusal_is_found_where_a_worker_process_wraps_it():
    wrapped = f"Exception: WorkerProc initialization failed ... [worker: RuntimeError: {AMX}]"
    assert refusal(wrapped).startswith("CPU fused-MoE AMX grouped-gemm")
    with pytest.raises(pytest.skip.Exception, match="refuses the tiny model on this CPU"):
        skip_if_refused(f"RuntimeError: {AMX}", "the tiny model")


@pytest.mark.parametrize("error", [None, "", "RuntimeError: expected scalar type BFloat16 but found Float",
                                   "AssertionError: sinks dropped"])
def test_any_other_error_is_not_a_refusal(error):
    assert refusal(error) is None
    skip_if_refused(error, "the tiny model")  # returns: the test goes on to fail on the error
