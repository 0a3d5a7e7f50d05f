from vllm_sinks.patches import PATCHES
from vllm_sinks.patches.docs import render_table, sync_docs


def test_docs_table_matches_registry():
    assert not sync_docs(check=True), "docs/patches.md is stale: run `vllm-sinks docs`"


def test_table_has_a_row_per_patch():
    table = render_table()
    for p in PATCHES:
        assert f"`{p.name}`" in table and f"`{p.env_var}`" in table
    assert len(table.splitlines()) == 2 + len(PATCHES)
