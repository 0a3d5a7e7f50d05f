"""scripts/torch_source.sh, venv.sh's choice of where the CPU torch wheel comes from, run with the
local wheel hidden and no network: pip's configuration emptied, its index an address that refuses at
once, PyTorch's CPU index stood in for by a local one (or by one that refuses)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time
import zipfile

import pytest

pytestmark = pytest.mark.vllm_independent

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "torch_source.sh"
WHEEL = "torch==2.13.0+cpu"
REFUSED = "http://127.0.0.1:9/simple"  # the discard port: the connection is refused, no wait


def fake_torch_wheel(folder: pathlib.Path) -> pathlib.Path:
    """A wheel that says it is torch 2.13.0+cpu (metadata only: pip reads no more for a dry run)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "torch-2.13.0+cpu-py3-none-any.whl"
    info = "torch-2.13.0+cpu.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0+cpu\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")
    return path


def run(tmp_path, cpu_index: str, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VLLM_SINKS_TORCH_INDEX"))}
    clean.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL=REFUSED, PYTHON=sys.executable,
                 PIP_NO_CACHE_DIR="1", **env)
    return subprocess.run(["bash", str(SCRIPT), WHEEL, cpu_index], env=clean, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)


def test_pytorchs_cpu_index_is_chosen_where_pips_sources_lack_the_wheel(tmp_path):
    index = tmp_path / "whl" / "cpu"
    wheel = fake_torch_wheel(index / "torch")
    (index / "torch" / "index.html").write_text(f'<a href="{wheel.name}">{wheel.name}</a>\n')
    done = run(tmp_path, index.as_uri())
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["--extra-index-url", index.as_uri()]
    said = done.stderr.strip().splitlines()
    assert len(said) == 1 and "PyTorch's CPU index" in said[0] and "VLLM_SINKS_TORCH_INDEX" in said[0]


def test_nothing_changes_where_pips_find_links_carry_the_wheel(tmp_path):
    local = tmp_path / "wheels"
    fake_torch_wheel(local)
    done = run(tmp_path, REFUSED, PIP_FIND_LINKS=str(local))
    assert done.returncode == 0 and done.stdout == "" and done.stderr == "", (done.stdout, done.stderr)


def test_no_source_gives_one_clear_message_within_seconds(tmp_path):
    start = time.monotonic()
    done = run(tmp_path, "http://127.0.0.1:9/whl/cpu")
    assert time.monotonic() - start < 60
    assert done.returncode == 2 and done.stdout == ""
    said = done.stderr.strip().splitlines()
    assert len(said) == 1, said  # one message, never pip's resolver output
    for words in (WHEEL, "PyTorch", "http://127.0.0.1:9/whl/cpu", "VLLM_SINKS_TORCH_INDEX"):
        assert words in said[0]
    assert "ResolutionImpossible" not in done.stderr


def test_the_variable_overrides_unchecked(tmp_path):
    done = run(tmp_path, REFUSED, VLLM_SINKS_TORCH_INDEX="https://mirror.example/whl/cpu")
    assert done.returncode == 0 and done.stdout.split() == ["--extra-index-url", "https://mirror.example/whl/cpu"]


def test_venv_sh_asks_it_before_building_the_torch_base():
    venv_sh = (SCRIPT.parent / "venv.sh").read_text()
    assert 'sources=$("$repo/scripts/torch_source.sh" "$TORCH+cpu") || exit 2' in venv_sh
    assert 'pip_in "$base" "$TORCH" ${torch_from[@]+"${torch_from[@]}"}' in venv_sh
    assert os.access(SCRIPT, os.X_OK)  # venv.sh runs it by its path
