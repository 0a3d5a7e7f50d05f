"""`vllm-sinks verify`'s verdicts and table (pure Python: the engine runs are not needed for these)."""

import pytest

from vllm_sinks.verify.families import Row, format_table, sixteen_bit_bound, verdict


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


def test_bf16_judges_the_backend_as_installed_against_native():
    """The patched backend (transformers-bf16-numerics on) is judged; the run with it off is shown only."""
    row = Row("gpt_oss", "bfloat16", on=0.072, numerics_off=0.11, native=0.071)
    assert verdict(row, bf16_sink_kernel=True) == "ok"
    row.on = 0.09
    assert verdict(row, bf16_sink_kernel=True) == "FAIL: 0.0900 > 0.0852 (1.2x native)"
    assert verdict(Row("granite_swa", "bfloat16", on=0.06), bf16_sink_kernel=True).startswith("FAIL")
    # a family the numerics patch does not cover: over 1.2x native is the backend's bf16 rounding (n/a),
    # but the no-native bound still holds
    granite = Row("granite_swa", "bfloat16", on=0.0325, native=0.0248)
    assert verdict(granite, bf16_sink_kernel=True).startswith(
        "n/a: 0.0325 > 0.0298 (1.2x native): the backend rounds")
    granite.on = 0.06
    assert verdict(granite, bf16_sink_kernel=True) == "FAIL: 0.0600 > 0.05"
    assert verdict(Row("granite_swa", "bfloat16", on=0.04), bf16_sink_kernel=True) == "ok"


def test_bf16_is_also_judged_against_hfs_own_bf16_error():
    """HF eager's own bf16 error on the same model is the second yardstick (as in ``verify --model``):
    seed 0's GPT-OSS on 0.27.1, measured 2026-12-02 on an AVX512-BF16 machine (backend 0.0413,
    native 0.0339, HF eager bf16 0.0622), is ok; a dropped sink
    (0.43 on the 32-wide tiny GPT-OSS in fp32, 0.27.1) is not."""
    row = Row("gpt_oss", "bfloat16", on=0.0413, native=0.0339)
    assert verdict(row, bf16_sink_kernel=True) == "FAIL: 0.0413 > 0.0407 (1.2x native)"
    row.hf_own = 0.0622
    assert verdict(row, bf16_sink_kernel=True) == "ok"
    row.on = 0.43
    assert verdict(row, bf16_sink_kernel=True) == "FAIL: 0.4300 > 0.0746 (1.2x HF eager's own bfloat16 error)"
    # either yardstick alone, and neither
    assert sixteen_bit_bound(None, 0.0622, "bfloat16") == pytest.approx((0.07464, "1.2x HF eager's own bfloat16 error"))
    assert sixteen_bit_bound(0.0339, None, "bfloat16")[1] == "1.2x native"
    assert sixteen_bit_bound(None, None, "bfloat16") is None


OURS = ("ValueError: HYV4Attention applies learnable attention sinks (s_aux), but vLLM's Transformers "
        "backend runs it on MLA attention (MLAAttention), and no vLLM MLA backend applies sinks")
UPSTREAMS = ("ValueError: HYV4Attention applies attention sinks, but they were not passed to "
             "MLAAttention, so the output would be wrong.")


def test_mla_families_must_stop_at_the_guard_that_names_them():
    for message in (OURS, UPSTREAMS):
        refused = Row("hy_v4", "float32", errors={"on": message})
        assert verdict(refused, bf16_sink_kernel=True, guard="HYV4Attention") == \
            "ok: refused by the MLA sink guard (HYV4Attention)"
        # The guard must name the module that applies the sink.
        assert verdict(refused, bf16_sink_kernel=True, guard="OtherAttention").startswith("FAIL: stopped before")
    answered = Row("hy_v4", "float32", on=0.01)
    assert verdict(answered, bf16_sink_kernel=True, guard="HYV4Attention").startswith("FAIL: answered")


def test_any_other_error_is_a_failure_where_the_guard_applies():
    early = Row("hy_v4", "float32", errors={"on": "ValueError: No common block size for 16."})
    assert verdict(early, bf16_sink_kernel=True, guard="HYV4Attention").startswith(
        "FAIL: stopped before the MLA sink guard: ValueError: No common block size")
    assert verdict(early, bf16_sink_kernel=True, guard="HYV4Attention", guard_reachable=False).startswith(
        "n/a: stops before attention runs here")


def test_a_family_the_backend_cannot_build_is_not_applicable_unless_it_runs():
    why = "vLLM's DeepseekV4Config shadows HF's"
    failed = Row("deepseek_v4", "float32", errors={"on": "StrictDataclassClassValidationError: ..."})
    assert verdict(failed, bf16_sink_kernel=True, may_not_load=why) == \
        f"n/a: {why}: StrictDataclassClassValidationError: ..."
    runs = Row("deepseek_v4", "float32", on=5e-4, sinks="3/3")
    assert verdict(runs, bf16_sink_kernel=False, may_not_load=why) == "ok"
    runs.on = 0.3
    assert verdict(runs, bf16_sink_kernel=False, may_not_load=why).startswith("FAIL")


def test_table_shows_every_column():
    rows = [Row("gpt_oss", "float32", on=2.4e-4, off=0.33, sinks="2/2", verdict="ok"),
            Row("gpt_oss", "bfloat16", on=0.0720, numerics_off=0.0834, native=0.0711, verdict="ok"),
            Row("hy_v4", "float32", errors={"on": "x"}, verdict="ok: refused by the MLA sink guard")]
    table = format_table(rows).splitlines()
    assert table[0].startswith("| family | dtype | patch on | patch off | native vLLM |")
    assert table[2] == "| gpt_oss | float32 | 2.4e-04 | 0.3300 | — | 2/2 | ok |"
    assert table[3] == "| gpt_oss | bfloat16 | 0.0720 (0.0834 bf16-numerics off) | — | 0.0711 | — | ok |"
    assert table[4] == "| hy_v4 | float32 | error | — | — | — | ok: refused by the MLA sink guard |"
    rows[1].hf_own = 0.0622
    assert format_table(rows).splitlines()[3] == ("| gpt_oss | bfloat16 | 0.0720 (0.0834 bf16-numerics off) | — | "
                                                 "0.0711 (HF eager bfloat16 0.0622) | — | ok |")


def test_a_row_measured_on_another_tiny_model_names_it():
    row = Row("gpt_oss", "bfloat16", on=0.057, native=0.034, verdict="ok", model="gpt_oss_hd64")
    assert format_table([row]).splitlines()[2].startswith("| gpt_oss (gpt_oss_hd64) | bfloat16 | 0.0570 |")


def test_bf16_rows_use_the_real_checkpoints_attention_shapes():
    pytest.importorskip("transformers")
    from vllm_sinks.verify import tiny_models

    assert tiny_models.REALISTIC_SHAPES == {"gpt_oss": "gpt_oss_hd64"}
    config = tiny_models._spec("gpt_oss_hd64").config
    assert (config["head_dim"], config["sliding_window"]) == (64, 128)
    assert config["rope_parameters"] == dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                             truncate=False, original_max_position_embeddings=4096,
                                             rope_theta=150000.0)
    assert tiny_models.model_class("gpt_oss_hd64") is tiny_models.model_class("gpt_oss")
    assert not set(tiny_models.FAMILIES) & {"gpt_oss_hd64", *tiny_models.REMOTE_CODE_MODELS}
