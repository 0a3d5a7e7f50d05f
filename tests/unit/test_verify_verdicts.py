"""`vllm-sinks verify`'s verdicts and table (pure Python: the engine runs are not needed for these)."""

from vllm_sinks.verify import Row, format_table, verdict


def test_fp32_bounds_follow_the_sink_dtype_of_the_kernel():
    row = Row("gpt_oss", "float32", on=1.5e-3, off=0.3, sinks="2/2")
    assert verdict(row, bf16_sink_kernel=True) == "ok"
    assert verdict(row, bf16_sink_kernel=False).startswith("FAIL: 1.50e-03 > 1e-03")


def test_a_lost_sink_or_an_error_is_a_regression():
    assert verdict(Row("gpt_oss", "float32", on=1e-4, sinks="1/2"), bf16_sink_kernel=False) == \
        "FAIL: sinks reached 1/2 layers"
    row = Row("granite_swa", "float32", errors={"on": "RuntimeError: boom"})
    assert verdict(row, bf16_sink_kernel=False) == "FAIL: RuntimeError: boom"


def test_a_backend_limitation_is_not_blamed_on_sinks():
    row = Row("mimo_v2_flash", "float32", on=0.8, off=0.8, sinks="1/1", note="backend builds layer 1 "
              "with 1 KV heads, HF has 2 (not a sink issue)")
    assert verdict(row, bf16_sink_kernel=True).startswith("n/a: backend builds layer 1")


def test_bf16_is_judged_against_native_with_the_rotary_control():
    row = Row("gpt_oss", "bfloat16", on=0.065, control=0.025, native=0.0254)
    assert verdict(row, bf16_sink_kernel=True) == "ok"
    row.control = 0.04
    assert verdict(row, bf16_sink_kernel=True).startswith("FAIL: 0.0400 > 1.2x native")
    assert verdict(Row("granite_swa", "bfloat16", on=0.06), bf16_sink_kernel=True).startswith("FAIL")
    assert verdict(Row("granite_swa", "bfloat16", on=0.04), bf16_sink_kernel=True) == "ok"


def test_families_that_must_refuse_must_not_answer():
    refused = Row("hy_v4", "float32", errors={"on": "ValueError: HYV4Attention applies ..."})
    assert verdict(refused, bf16_sink_kernel=True, expect_failure="MLA") == "ok: no output (MLA)"
    answered = Row("hy_v4", "float32", on=0.01)
    assert verdict(answered, bf16_sink_kernel=True, expect_failure="MLA").startswith("FAIL: answered")


def test_table_shows_every_column():
    rows = [Row("gpt_oss", "float32", on=2.4e-4, off=0.33, sinks="2/2", verdict="ok"),
            Row("gpt_oss", "bfloat16", on=0.0649, control=0.0248, native=0.0254, verdict="ok"),
            Row("hy_v4", "float32", errors={"on": "x"}, verdict="ok: no output (MLA)")]
    table = format_table(rows).splitlines()
    assert table[0].startswith("| family | dtype | patch on | patch off | native vLLM |")
    assert table[2] == "| gpt_oss | float32 | 2.4e-04 | 0.3300 | — | 2/2 | ok |"
    assert table[3] == "| gpt_oss | bfloat16 | 0.0649 (0.0248 fp32 rotary) | — | 0.0254 | — | ok |"
    assert table[4] == "| hy_v4 | float32 | error | — | — | — | ok: no output (MLA) |"
