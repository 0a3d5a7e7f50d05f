"""Docs and scripts name only what exists: relative links, repo paths, modules, and no machine paths.

Reads README.md, DEVELOPERS.md, CHANGELOG.md and docs/**/*.md (links, `backticked` repo paths and
dotted ``vllm_sinks`` modules, anchors into markdown files), and the repo's scripts (repo paths they
name in comments or code). A path of a machine (``/work/...``, ``/root/...``, a home directory) cannot be
opened by a reader and fails anywhere in them.
"""

from __future__ import annotations

import importlib
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "DEVELOPERS.md", ROOT / "CHANGELOG.md",
               *(ROOT / "docs").rglob("*.md")])
SCRIPTS = sorted(p for folder in ("scripts", "benchmarks", ".ci", ".buildkite")
                 for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in ("", ".sh", ".py", ".yml", ".yaml", ".txt"))


def _tracked_top_folders() -> tuple[str, ...]:
    """Top-level folders of the files git tracks: not what a run leaves beside them (`out/`, a
    venv), whose absence on a fresh clone would make the same script pass or fail by history."""
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):  # not a checkout: every folder but dot ones
        return tuple(sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")))
    return tuple(sorted({name.split("/")[0] for name in listed if "/" in name}))


#: Top-level folders a repo path starts with.
TOP = _tracked_top_folders()
#: Machine paths: a reader's machine has none of them.
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|root|home|Users|mnt|scratch)/[\w.-]")
OUTSIDE = re.compile(r"(?<![\w./$)\"'-])(\.\./[\w./-]*\w)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\s]+)`")
MODULE = re.compile(r"\bvllm_sinks(?:\.\w+)+")
REPO_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*\w)" % "|".join(re.escape(t) for t in TOP))


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")}


def _exists(relative: str) -> bool:
    """A repo path exists (a glob or ``{a,b}`` alternation: one match at least)."""
    relative = re.sub(r":[\w:.\[\]-]*$", "", relative)  # file.py:12, file.py::test_name
    if "{" in relative:
        head, rest = relative.split("{", 1)
        options, tail = rest.split("}", 1)
        return all(_exists(head + option + tail) for option in options.split(","))
    if any(c in relative for c in "*?<"):
        return any(ROOT.glob(relative.split("<")[0] + "*" if "<" in relative else relative))
    return (ROOT / relative).exists()


def _module_exists(dotted: str) -> bool:
    """``vllm_sinks.a.b``: a module, or an attribute path inside one (imports it; vLLM stays lazy)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            obj = importlib.import_module(".".join(parts[:cut]))
            for attr in parts[cut:]:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True
    return False


def _problems_in_doc(path: pathlib.Path) -> list[str]:
    text = path.read_text()
    problems = []
    for target in LINK.findall(re.sub(r"`[^`]*`", "", text)):  # a link in a code span is code
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            problems.append(f"link to {target}: no such file")
        elif not str(resolved).startswith(str(ROOT)):
            problems.append(f"link to {target}: outside the repo")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            problems.append(f"link to {target}: no such section")
    for code in CODE.findall(text):
        if code.startswith("../") and not str((path.parent / code).resolve()).startswith(str(ROOT) + "/"):
            problems.append(f"`{code}` is outside the repo")
        for name in REPO_PATH.findall(code):
            if not _exists(name):
                problems.append(f"`{code}` names {name}, which does not exist")
        for dotted in MODULE.findall(code):
            if not _module_exists(dotted):
                problems.append(f"`{code}` names {dotted}, which is no module")
    return problems


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_docs_name_only_what_exists(path):
    assert not _problems_in_doc(path), _rel(path)


@pytest.mark.parametrize("path", DOCS + SCRIPTS, ids=_rel)
def test_no_machine_paths(path):
    found = [line.strip() for line in path.read_text(errors="replace").splitlines()
             if MACHINE_PATH.search(line)]
    assert not found, f"{_rel(path)} names paths of a machine: {found}"


@pytest.mark.parametrize("path", SCRIPTS, ids=_rel)
def test_scripts_name_only_repo_paths_that_exist(path):
    text = path.read_text(errors="replace")
    missing = sorted({name for name in REPO_PATH.findall(text)
                      if not _exists(name) and not _made_by_the_script(name, text)})
    # `../x` where it stands on its own (not `$(dirname "$0")/../..`): beside the script, in the repo.
    missing += sorted({name for name in OUTSIDE.findall(text)
                       if not (path.parent / name).resolve().exists()
                       or not str((path.parent / name).resolve()).startswith(str(ROOT) + "/")})
    assert not missing, f"{_rel(path)} names {missing}, which do not exist"


def _made_by_the_script(name: str, text: str) -> bool:
    # Output a script writes (`-o docs/x.md`, `> results/`) is not expected to exist beforehand.
    return bool(re.search(r"(?:>|-o|--out\w*|mkdir -p)\s*[\"']?" + re.escape(name), text))


def test_the_checker_catches_what_it_is_for(tmp_path, monkeypatch):
    # The checks above must be able to fail: a doc with each kind of stale reference.
    doc = ROOT / "docs" / "_probe_for_the_link_test.md"
    body = ("[gone](no/such/file.md) [section](../README.md#no-such-section) "
            "`vllm_sinks/no_such_module.py` `vllm_sinks.no_such_module` `tests/op/test_hopper_compile.py` "
            "`../../shared/tools/x.sh`\n")
    try:
        doc.write_text(body)
        problems = _problems_in_doc(doc)
    finally:
        doc.unlink()
    assert len(problems) == 6, problems
    assert OUTSIDE.findall("see ../shared/tools/x.sh") and not OUTSIDE.findall('cd "$(dirname "$0")/../.."')
    assert MACHINE_PATH.search("see /work/.device/4/") and MACHINE_PATH.search("(`/root/x`)")
    assert not MACHINE_PATH.search("~/.cache/vllm-sinks/venvs and docs/work/x")
