"""Patches armed on their modules: the post-import hook (``patches.importhook``) and the registry's use
of it, on fake upstream packages written to a temporary directory (no vLLM).

The fake package mirrors the prefill-op case: ``ops`` defines ``fn``; ``backend`` does
``from .ops import fn`` at import. The fake patch binds ``ours`` in ``ops`` and, if it has finished
importing, in ``backend`` — never importing ``backend`` itself.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import itertools
import logging
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest

import vllm_sinks
import vllm_sinks.patches as patches_pkg
from vllm_sinks.patches import importhook, install, lifecycle, registry
from vllm_sinks.patches.registry import Drift, Patch, Probe, Status, VllmInfo

from .test_registry import _info

_counter = itertools.count()


class Fake:
    """One fake upstream package on disk plus the hooks of a patch armed on two of its modules."""

    def __init__(self, root):
        self.pkg = f"fakeupstream{os.getpid()}_{next(_counter)}"
        self.ops, self.backend, self.other = (f"{self.pkg}.{m}" for m in ("ops", "backend", "other"))
        d = root / self.pkg
        d.mkdir()
        (d / "__init__.py").write_text("")
        (d / "ops.py").write_text("def fn():\n    return 'upstream'\n")
        (d / "backend.py").write_text("from .ops import fn\n\ndef call():\n    return fn()\n")
        (d / "other.py").write_text("VALUE = 1\n")
        self.dir = d
        self.calls: list[str] = []
        self.probe_error: Exception | None = None
        self.probe_applies = True
        self.hooks = types.ModuleType(f"hooks_{self.pkg}")
        self.hooks.probe = self._probe
        self.hooks.apply = self._apply
        sys.modules[self.hooks.__name__] = self.hooks

    @staticmethod
    def ours():
        return "ours"

    def _probe(self, info):
        self.calls.append("probe")
        if self.probe_error is not None:
            raise self.probe_error
        ops = importlib.import_module(self.ops)
        if "fn" not in vars(ops):
            raise Drift("ops.fn not found")
        return Probe(self.probe_applies, "fake upstream lacks it" if self.probe_applies else "has it")

    def _apply(self, info):
        self.calls.append("apply")
        ops = importlib.import_module(self.ops)
        install.install(ops, "fn", self.ours, "fake")
        backend = importhook.loaded(self.backend)
        if backend is None:
            return "ops"
        install.install(backend, "fn", self.ours, "fake")
        return "ops and backend"

    def patch(self, name="fake", modules=None) -> Patch:
        return Patch(name=name, targets=("x",), fork="f", upstream_pr="#0", why="w", how="h",
                     remove_when="r", hooks=self.hooks.__name__,
                     modules=(self.ops, self.backend) if modules is None else modules)

    def imported(self):
        return sorted(n for n in sys.modules if n.startswith(self.pkg + "."))


@pytest.fixture
def fake(tmp_path, monkeypatch):
    lifecycle._reset_for_tests()
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    f = Fake(tmp_path)
    monkeypatch.setattr(lifecycle, "detect_vllm", lambda: _info("0.29.0"))
    yield f
    lifecycle._reset_for_tests()
    for name in [n for n in sys.modules if n == f.pkg or n.startswith(f.pkg + ".")]:
        del sys.modules[name]
    sys.modules.pop(f.hooks.__name__, None)


def _use(monkeypatch, *entries):
    monkeypatch.setattr(patches_pkg, "PATCHES", entries)


def _status(name="fake"):
    return next(r for r in lifecycle.apply_all() if r.patch == name)


@contextlib.contextmanager
def _log_records():
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    level = registry.logger.level
    registry.logger.addHandler(handler)
    registry.logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        registry.logger.removeHandler(handler)
        registry.logger.setLevel(level)


def test_register_imports_nothing_and_arms(fake, monkeypatch):
    _use(monkeypatch, fake.patch())
    with _log_records() as records:
        (result,) = vllm_sinks.register()
    assert result.status is Status.ARMED
    assert result.detail == f"on import of {fake.ops} or {fake.backend}"
    assert fake.imported() == [] and fake.calls == []
    lines = [r.getMessage() for r in records if r.levelno == logging.INFO]
    assert len(lines) == 1 and f"fake armed (on import of {fake.ops} or {fake.backend})" in lines[0]


def test_op_module_first_then_backend_binds_ours(fake, monkeypatch):
    _use(monkeypatch, fake.patch())
    vllm_sinks.register()
    with _log_records() as records:
        ops = importlib.import_module(fake.ops)
        assert ops.fn() == "ours" and install.original(ops.fn)() == "upstream"
        assert fake.imported() == [fake.ops]  # the backend was not imported by us
        assert _status().status is Status.APPLIED and _status().detail == "ops"
        backend = importlib.import_module(fake.backend)
    assert backend.call() == "ours"
    assert fake.calls == ["probe", "apply", "apply"]  # probe once; apply again on the backend's arrival
    assert _status().detail == "ops and backend"
    infos = [r.getMessage() for r in records if r.levelno == logging.INFO]
    assert len(infos) == 1, infos  # one line when the patch resolves, none for the second binding
    assert re.match(rf"fake applied \(ops\) \(on import of {fake.ops}, \d+ ms\) \[pid {os.getpid()}, ",
                    infos[0]), infos[0]
    assert lifecycle.seconds_spent()["fake"] > 0


def test_backend_first_imports_op_module_inside_and_binds_ours(fake, monkeypatch):
    _use(monkeypatch, fake.patch())
    vllm_sinks.register()
    backend = importlib.import_module(fake.backend)
    assert backend.fn is Fake.ours and sys.modules[fake.ops].fn is Fake.ours
    assert fake.calls == ["probe", "apply", "apply"]
    assert _status().detail == "ops and backend"


def test_backend_that_bound_upstream_is_rebound_when_it_finishes(fake, monkeypatch):
    # The backend binds upstream's function in a way no hook of the op module can precede (here: it
    # defines its own reference at import); the patch rebinds it when the backend has finished.
    (fake.dir / "backend.py").write_text(
        "import importlib\nfn = importlib.import_module(__package__ + '.ops').__dict__['fn']\n"
        "_seen_during_import = fn\n")
    _use(monkeypatch, fake.patch())
    vllm_sinks.register()
    with _log_records():
        ops = importlib.import_module(fake.ops)
        ops_upstream = install.original(ops.fn)
        # Undo ours in ops only, to stand for "upstream's at the time backend imported it".
        ops.fn = ops_upstream
        backend = importlib.import_module(fake.backend)
    assert backend._seen_during_import is ops_upstream  # it bound upstream's during its import
    assert backend.fn is Fake.ours  # and ours once it had finished


def test_already_imported_target_is_applied_at_register(fake, monkeypatch):
    ops = importlib.import_module(fake.ops)
    _use(monkeypatch, fake.patch())
    (result,) = vllm_sinks.register()
    assert result.status is Status.APPLIED and ops.fn() == "ours"
    assert fake.imported() == [fake.ops]
    importlib.import_module(fake.backend)
    assert sys.modules[fake.backend].fn is Fake.ours


def test_register_twice_and_reimport_probe_once(fake, monkeypatch):
    _use(monkeypatch, fake.patch())
    vllm_sinks.register()
    vllm_sinks.register()
    importlib.import_module(fake.ops)
    importlib.import_module(fake.ops)
    vllm_sinks.register()
    assert fake.calls == ["probe", "apply"]


def test_reload_reapplies(fake, monkeypatch):
    _use(monkeypatch, fake.patch())
    vllm_sinks.register()
    ops = importlib.import_module(fake.ops)
    importlib.reload(ops)  # re-executes the body: upstream's fn again, then our hook
    assert ops.fn() == "ours"
    assert fake.calls == ["probe", "apply", "apply"]


def test_probe_failure_is_contained_and_reported(fake, monkeypatch):
    fake.probe_error = KeyError("boom")
    _use(monkeypatch, fake.patch())
    vllm_sinks.register()
    with _log_records() as records:
        ops = importlib.import_module(fake.ops)  # the import itself succeeds
    assert ops.fn() == "upstream"
    result = _status()
    assert result.status is Status.FAILED and "KeyError" in result.detail
    assert any("fake failed" in r.getMessage() and r.levelno == logging.WARNING for r in records)
    importlib.import_module(fake.backend)  # a failed patch stays failed: no second try
    assert fake.calls == ["probe"]


def test_drift_and_stand_down_leave_the_module_alone(fake, monkeypatch):
    fake.probe_error = Drift("ops.fn lost a parameter")
    _use(monkeypatch, fake.patch())
    vllm_sinks.register()
    assert importlib.import_module(fake.ops).fn() == "upstream"
    assert _status().status is Status.REFUSED and "ops.fn lost a parameter" in _status().detail


def test_stood_down_patch_forced_on(fake, monkeypatch):
    fake.probe_applies = False
    monkeypatch.setenv("VLLM_SINKS_FAKE", "on")
    _use(monkeypatch, fake.patch())
    vllm_sinks.register()
    importlib.import_module(fake.backend)
    assert _status().status is Status.APPLIED
    assert _status().detail == "forced by VLLM_SINKS_FAKE=on; ops and backend"


def test_disabled_patch_is_not_armed(fake, monkeypatch):
    monkeypatch.setenv("VLLM_SINKS_FAKE", "off")
    _use(monkeypatch, fake.patch())
    (result,) = vllm_sinks.register()
    assert result.status is Status.DISABLED
    assert fake.ops not in importhook.watched()
    assert importlib.import_module(fake.ops).fn() == "upstream" and fake.calls == []


def test_module_whose_body_raises_stays_armed(fake, monkeypatch):
    (fake.dir / "other.py").write_text("raise ImportError('optional dependency missing')\n")
    _use(monkeypatch, fake.patch(modules=(fake.other,)))
    vllm_sinks.register()
    with pytest.raises(ImportError, match="optional dependency"):
        importlib.import_module(fake.other)
    assert _status().status is Status.ARMED and fake.calls == []
    (fake.dir / "other.py").write_text("VALUE = 2\n")
    importlib.invalidate_caches()
    sys.modules.pop(fake.other, None)
    (fake.dir / "__pycache__").exists() and [p.unlink() for p in (fake.dir / "__pycache__").iterdir()]
    assert importlib.import_module(fake.other).VALUE == 2
    assert _status().status is Status.APPLIED


def test_failing_callback_never_breaks_the_import(fake):
    def bad(name, module):
        raise RuntimeError("hook bug")

    importhook.watch(fake.other, bad)
    try:
        assert importlib.import_module(fake.other).VALUE == 1
    finally:
        importhook.unwatch(fake.other, bad)


def test_the_module_keeps_its_real_loader(fake):
    seen = []
    cb = lambda name, module: seen.append(importhook.loaded(name))  # noqa: E731
    importhook.watch(fake.ops, cb)
    try:
        ops = importlib.import_module(fake.ops)
    finally:
        importhook.unwatch(fake.ops, cb)
    assert seen == [ops]  # complete when the callback runs
    assert type(ops.__loader__).__name__ == "SourceFileLoader"
    assert ops.__spec__.loader is ops.__loader__
    assert "return 'upstream'" in inspect.getsource(ops.fn)


def test_unrelated_imports_are_not_intercepted(fake, monkeypatch):
    """For a module nobody watches the hook answers from its table alone: it asks no other finder
    (so an unrelated import costs one dict lookup; benchmarks/plugin_load.py has the timings)."""
    importhook.watch(fake.ops, lambda *a: None)
    finder = importhook._FINDER
    assert sys.meta_path[0] is finder
    asked = []

    class Spy:
        def find_spec(self, name, path, target=None):
            asked.append(name)
            return None

    monkeypatch.setattr(sys, "meta_path", [finder, Spy(), *sys.meta_path[1:]])
    assert finder.find_spec("json", None) is None
    assert finder.find_spec("some.unrelated.module", None) is None
    assert asked == []


def test_a_finder_that_searches_meta_path_does_not_recurse(fake, monkeypatch):
    class Searching:  # e.g. a finder that delegates by searching sys.meta_path again
        busy = False

        def find_spec(self, name, path, target=None):
            if name != fake.ops or self.busy:
                return None
            self.busy = True
            try:
                return importlib.util.find_spec(name)  # ours is in there too
            finally:
                self.busy = False

    seen = []
    importhook.watch(fake.ops, lambda name, module: seen.append(name))
    monkeypatch.setattr(sys, "meta_path", [sys.meta_path[0], Searching(), *sys.meta_path[1:]])
    assert importlib.import_module(fake.ops).fn() == "upstream"
    assert seen == [fake.ops]  # hooked once, not wrapped twice


def test_concurrent_imports_probe_once(fake, monkeypatch):
    gate = threading.Barrier(4)
    orig = fake.hooks.probe

    def slow_probe(info):
        time.sleep(0.05)
        return orig(info)

    fake.hooks.probe = slow_probe
    _use(monkeypatch, fake.patch())
    vllm_sinks.register()

    def worker(name):
        gate.wait()
        importlib.import_module(name)

    threads = [threading.Thread(target=worker, args=(n,))
               for n in (fake.ops, fake.backend, fake.ops, fake.backend)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert fake.calls.count("probe") == 1
    assert sys.modules[fake.ops].fn is Fake.ours and sys.modules[fake.backend].fn is Fake.ours
    assert _status().detail == "ops and backend"


def test_forked_child_resolves_an_armed_patch_itself(fake, monkeypatch, tmp_path):
    # vLLM forks its workers on GPU: a patch still armed at the fork resolves in the child when the
    # child imports its module, and logs there; the parent stays armed.
    script = textwrap.dedent(f"""
        import importlib, os, sys
        sys.path.insert(0, {str(tmp_path)!r})
        import tests.unit.test_import_hook as t
        from vllm_sinks.patches import lifecycle
        import vllm_sinks.patches as pkg
        f = t.Fake.__new__(t.Fake)
        f.__dict__.update(pkg=%r, calls=[], probe_error=None, probe_applies=True)
        f.ops, f.backend = f.pkg + ".ops", f.pkg + ".backend"
        import types
        f.hooks = types.ModuleType("hooks_fork"); f.hooks.probe = f._probe; f.hooks.apply = f._apply
        sys.modules["hooks_fork"] = f.hooks
        pkg.PATCHES = (f.patch(),)
        lifecycle.detect_vllm = lambda: t._info("0.29.0")
        lifecycle.register_all()
        pid = os.fork()
        if pid == 0:
            ops = importlib.import_module(f.ops)
            print("child", ops.fn(), lifecycle.apply_all()[0].status.value, flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        print("parent", f.ops in sys.modules, lifecycle.apply_all()[0].status.value, flush=True)
    """) % fake.pkg
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=str(pathlib_root()))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["child ours applied", "parent False armed"], proc.stdout
    lines = [line for line in proc.stderr.splitlines() if "[vllm-sinks]" in line]
    assert len(lines) == 3, proc.stderr  # parent's report line, child's report line, child's resolution
    assert "fake applied (ops) (on import of " in lines[2]


def pathlib_root():
    import pathlib

    return pathlib.Path(__file__).resolve().parents[2]


def test_version_outside_range_arms_nothing(fake, monkeypatch):
    # older than the oldest supported release (a newer one is probed as usual: test_registry.py)
    monkeypatch.setattr(lifecycle, "detect_vllm", lambda: VllmInfo("vllm", "0.26.0", _info("0.26.0").version,
                                                                  None, None))
    _use(monkeypatch, fake.patch())
    (result,) = vllm_sinks.register()
    assert result.status is Status.SKIPPED
    assert fake.ops not in importhook.watched()


def test_a_module_mid_import_at_register_is_patched_when_it_finishes(fake, monkeypatch):
    # vLLM may load plugins while one of our target modules is itself being imported (without our
    # loader: nothing was watched yet). The patch stays armed during the body and applies when
    # importlib finishes that import, to the finished module.
    mid = f"{fake.pkg}.mid"
    (fake.dir / "mid.py").write_text(textwrap.dedent("""
        import os
        from vllm_sinks.patches import lifecycle
        AT_REGISTER = lifecycle.apply_all()
        if os.environ.get("FAKE_MID_FAIL") == "1":
            raise RuntimeError("body fails")
        def fn():
            return "upstream"
        FINISHED = True
    """))
    seen = []

    def apply(info):
        module = importhook.loaded(mid)
        seen.append(getattr(module, "FINISHED", False))
        install.install(module, "fn", Fake.ours, "fake")
        return "mid"

    monkeypatch.setattr(fake.hooks, "apply", apply)
    monkeypatch.setattr(fake.hooks, "probe", lambda info: Probe(True, "lacks it"))
    _use(monkeypatch, fake.patch(modules=(mid,)))
    monkeypatch.setenv("FAKE_MID_FAIL", "1")
    with pytest.raises(RuntimeError, match="body fails"):
        importlib.import_module(mid)  # registers mid-import; the body then fails: no callback
    assert _status().status is Status.ARMED and not seen
    monkeypatch.delenv("FAKE_MID_FAIL")
    module = importlib.import_module(mid)  # the next import: hooked by the finder as usual
    assert _status().status is Status.APPLIED and seen == [True] and module.fn() == "ours"

    lifecycle._reset_for_tests()
    del sys.modules[mid]
    seen.clear()
    module = importlib.import_module(mid)  # nothing watched when it starts: registers inside
    assert [r.status for r in module.AT_REGISTER] == [Status.ARMED]
    assert _status().status is Status.APPLIED and seen == [True] and module.fn() == "ours"
    assert type(module.__spec__) is importlib.machinery.ModuleSpec  # the mark is gone again


def test_a_fork_during_another_threads_apply_finishes_the_patch_in_the_child(fake, tmp_path):
    # Thread T imports ops; its post-import hook is inside the patch's apply when the main thread
    # forks. T does not exist in the child: the child finishes the patch at once (not at the next
    # import of ops, which would wait for T's import lock), and can import ops.
    script = textwrap.dedent(f"""
        import importlib, os, sys, threading
        sys.path.insert(0, {str(tmp_path)!r})
        import tests.unit.test_import_hook as t
        from vllm_sinks.patches import install, lifecycle
        import vllm_sinks.patches as pkg
        f = t.Fake.__new__(t.Fake)
        f.__dict__.update(pkg=%r, calls=[], probe_error=None, probe_applies=True)
        f.ops, f.backend = f.pkg + ".ops", f.pkg + ".backend"
        parent, inside, release = os.getpid(), threading.Event(), threading.Event()
        def apply(info):
            if os.getpid() == parent and threading.current_thread().name == "T":
                inside.set()
                release.wait(60)
            return f._apply(info)
        import types
        f.hooks = types.ModuleType("hooks_fork2"); f.hooks.probe = f._probe; f.hooks.apply = apply
        sys.modules["hooks_fork2"] = f.hooks
        pkg.PATCHES = (f.patch(),)
        lifecycle.detect_vllm = lambda: t._info("0.29.0")
        lifecycle.register_all()
        worker = threading.Thread(target=importlib.import_module, args=(f.ops,), name="T")
        worker.start()
        assert inside.wait(60)
        pid = os.fork()
        if pid == 0:
            import signal
            signal.alarm(60)  # a hung child (the gap this test is about) must not outlive the test
            status = lifecycle.apply_all()[0].status.value
            ops = importlib.import_module(f.ops)
            print("child", status, ops.fn(), flush=True)
            os._exit(0)
        release.set()
        worker.join(60)
        os.waitpid(pid, 0)
        print("parent", lifecycle.apply_all()[0].status.value, sys.modules[f.ops].fn(), flush=True)
    """) % fake.pkg
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=150,
                          cwd=str(pathlib_root()))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["child applied ours", "parent applied ours"], proc.stdout + proc.stderr
    assert "finished after a fork" in proc.stderr
