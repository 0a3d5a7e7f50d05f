"""Every env var the package reads is in the one table (vllm_sinks/env.py; the per-patch switches
joined with it: vllm_sinks.patches.SETTINGS), named in a user-facing doc, and a bad value of any of
them ends the same way."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from vllm_sinks import env
from vllm_sinks.patches import PATCHES, SETTINGS, registry

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vllm_sinks"
USER_DOCS = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
NAME = re.compile(r"^VLLM_SINKS_[A-Z0-9_]+$")


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "literal"`` assignments."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and \
                isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = node.value.value
    return found


def _direct_reads(tree: ast.Module) -> list[str]:
    """Names read through os.environ / os.getenv (a literal or a module constant); '?' otherwise."""
    constants = _constants(tree)

    def value(arg):
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
        if isinstance(arg, ast.Name):
            return constants.get(arg.id, "?")
        return "?"

    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = ast.unparse(node.func)
            if func in ("os.environ.get", "os.getenv", "environ.get", "os.environ.setdefault"):
                reads.append(value(node.args[0]))
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("os.environ", "environ"):
            reads.append(value(node.slice))
    return reads


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text())


def test_our_env_vars_are_read_only_through_the_table():
    # A direct os.environ read of a VLLM_SINKS_ name would bypass the accepted words and the message.
    for path, tree in _sources():
        if path == PACKAGE / "env.py":
            continue
        ours = [name for name in _direct_reads(tree) if name == "?" or name.startswith("VLLM_SINKS_")]
        assert not ours, f"{path.relative_to(ROOT)} reads {ours} directly: use vllm_sinks.env"


def test_every_env_var_the_package_names_is_in_the_table_and_the_docs():
    named = {node.value for _, tree in _sources() for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.match(node.value)}
    table = {s.name for s in SETTINGS}
    assert {p.env_var for p in PATCHES} <= table
    assert named <= table, f"named in the package but not in vllm_sinks/env.py: {named - table}"
    text = "\n".join(p.read_text() for p in USER_DOCS)
    undocumented = sorted(name for name in table if name not in text)
    assert not undocumented, f"no user-facing doc names {undocumented}"


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.words is not None],
                         ids=lambda s: s.name)
def test_a_bad_value_of_any_setting_fails_with_the_same_message(setting):
    with pytest.raises(env.BadSetting, match=rf"^{setting.name}='bogus': expected "):
        setting.read({setting.name: "bogus"})
    assert setting.read({}) == setting.default == setting.read({setting.name: "  "})
    for value, synonyms in setting.choices():
        for word in (value, *synonyms):
            assert setting.read({setting.name: f" {word.upper()} "}) == value


def test_a_patch_meeting_a_bad_setting_is_refused(monkeypatch):
    # Its own switch or another variable its probe reads: refused, the message as read() words it.
    import types

    hooks = types.ModuleType("hooks_bad_setting")
    hooks.probe = lambda info: registry.Probe(True, env.MIMO_SINK_SEMANTICS.read() and "ok")
    hooks.apply = lambda info: "applied"
    monkeypatch.setitem(__import__("sys").modules, "hooks_bad_setting", hooks)
    patch = registry.Patch(name="fake", targets=("x",), fork="f", upstream_pr="-", why="w", how="h",
                           remove_when="r", hooks="hooks_bad_setting")
    info = registry.VllmInfo("vllm", "0.29.0", None, None, None)
    monkeypatch.setenv(env.MIMO_SINK_SEMANTICS.name, "denominator")
    own = patch.run(info)
    assert own.status is registry.Status.REFUSED
    assert own.detail.startswith(f"{env.MIMO_SINK_SEMANTICS.name}='denominator': expected ")
    monkeypatch.delenv(env.MIMO_SINK_SEMANTICS.name)
    monkeypatch.setenv(patch.env_var, "maybe")
    switch = patch.run(info)
    assert switch.status is registry.Status.REFUSED
    assert switch.detail.startswith(f"{patch.env_var}='maybe': expected ")


def test_the_read_finder_sees_each_way_of_reading():
    source = 'X = "VLLM_SINKS_A"\nos.environ.get(X)\nos.getenv("VLLM_SINKS_B")\nos.environ["C"]\nos.environ.get(f())\n'
    assert _direct_reads(ast.parse(source)) == ["VLLM_SINKS_A", "VLLM_SINKS_B", "C", "?"]
