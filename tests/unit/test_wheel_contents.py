"""The wheel holds the package and nothing test-only, and its `vllm-sinks docs` works installed.

Builds the wheel from a copy of the checkout (the build writes `build/` and egg-info next to the
sources), lists it, installs it into a scratch folder and runs the installed CLI there.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest
from packaging.version import Version

pytestmark = pytest.mark.vllm_independent

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: What a user's install must never carry: the test tree, fakes, the test server.
TEST_ONLY = ("tests/", "conftest", "fake", "server.py")


def _build_isolation_flag() -> list[str]:
    # Offline-friendly where the venv already has the build backend pyproject.toml asks for.
    try:
        ok = Version(importlib.metadata.version("setuptools")) >= Version("77")
        importlib.metadata.version("wheel")
    except importlib.metadata.PackageNotFoundError:
        ok = False
    return ["--no-build-isolation"] if ok else []


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    scratch = tmp_path_factory.mktemp("wheel")
    src = scratch / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "build", "dist", "*.egg-info", ".pytest_cache", "*.whl"))
    out = scratch / "out"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--no-cache-dir",
                    *_build_isolation_flag(), "-w", str(out), str(src)], check=True, timeout=600)
    (built,) = out.glob("vllm_sinks-*.whl")
    return built


def test_the_wheel_holds_the_package_and_nothing_test_only(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    outside = [n for n in names if not n.startswith(("vllm_sinks/", "vllm_sinks-"))]
    assert not outside, f"outside the package: {outside}"
    test_only = [n for n in names if any(mark in n.lower() for mark in TEST_ONLY)]
    assert not test_only, f"test-only files in the wheel: {test_only}"
    shipped = {pathlib.PurePosixPath(n) for n in names}
    sources = {pathlib.PurePosixPath(p.relative_to(ROOT).as_posix())
               for p in (ROOT / "vllm_sinks").rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert sources <= shipped, f"missing from the wheel: {sorted(map(str, sources - shipped))}"


def test_installed_docs_command_checks_a_checkout(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--no-cache-dir",
                    "--target", str(target), str(wheel)], check=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(target)}
    run = lambda *args, cwd: subprocess.run([sys.executable, "-m", "vllm_sinks", "docs", *args],
                                            cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    located = subprocess.run([sys.executable, "-c", "import vllm_sinks; print(vllm_sinks.__file__)"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert located.stdout.startswith(str(target)), located.stdout  # the installed copy runs
    checked = run("--check", "--root", str(ROOT), cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    outside = run("--check", cwd=tmp_path)  # no checkout here: says so, edits nothing
    assert outside.returncode == 2 and "no vllm-sinks source checkout" in outside.stderr


TABLES = "vllm_sinks/v1/attention/ops/tables/"


def test_the_installed_package_reads_the_full_attention_tables_it_ships(wheel, tmp_path):
    """Every table of the checkout is package data in the wheel, and the installed lookup finds and
    parses each one there (a table missing from the wheel would silently leave its GPU to
    upstream's op)."""
    checkout = sorted(p.name for p in (ROOT / TABLES).glob("*.json"))
    in_wheel = sorted(n[len(TABLES):] for n in zipfile.ZipFile(wheel).namelist()
                      if n.startswith(TABLES) and n.endswith(".json"))
    assert in_wheel == checkout
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--no-cache-dir",
                    "--target", str(target), str(wheel)], check=True, timeout=300)
    script = ("import json; from vllm_sinks.v1.attention.ops import full_attention_table as f; "
              "paths = sorted(f.SHIPPED_DIR.glob('*.json')); [f.load_table(p) for p in paths]; "
              "print(json.dumps([str(f.SHIPPED_DIR), [p.name for p in paths]]))")
    found = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(target)}, check=True, timeout=120)
    where, names = json.loads(found.stdout)
    assert where.startswith(str(target)) and names == checkout
