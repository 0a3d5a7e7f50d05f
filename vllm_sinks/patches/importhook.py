"""Post-import hooks: call a function right after a named module has finished executing.

The registry arms each patch on the upstream modules it edits (``Patch.modules``) instead of
importing them itself, so a process that never imports a target never loads it because of us.

One meta-path finder, first in ``sys.meta_path``, answers only for watched names (one dict lookup
for every other import, so unrelated imports cost nothing measurable). For a watched name it asks
the other finders for the spec and wraps its loader; the wrapper puts the real loader back on the
module and its spec *before* the module body runs (``inspect``, ``importlib.resources`` and pickling
see the usual loader), runs the body, then calls the callbacks. Properties:

* **After, not during**: a callback sees the module fully executed. Until then
  :func:`loaded` treats it as absent, so a patch never edits a half-initialised module.
* **Every execution**: an ``importlib.reload`` finds the spec through the finder again, so callbacks
  run after a reload too (the registry re-applies a patch that reload undid).
* **Never breaks an import**: a callback that raises is logged and swallowed; if the module body
  raises, no callback runs and the module stays watched (the next import attempt is hooked again).
* **No recursion**: the finder skips itself, and a finder that searches ``sys.meta_path`` from its
  own ``find_spec`` finds nothing from us for the name being searched (a per-thread guard).
* **Watched mid-import**: a module whose import already started (without our loader) when
  :func:`watch` is called is still called back when that import finishes: the watch marks the
  module's spec, and importlib's own "done initialising" step (``spec._initializing = False``, set
  by ``_bootstrap._load_unlocked`` on every CPython we support) runs the callbacks. Until then
  :func:`loaded` treats it as absent, as for an import through our loader.
* **Threads and fork**: the watch table is guarded by a lock that is re-created in a forked child
  (a thread holding it at fork time does not exist there); callbacks run without any lock of ours
  held. The finder is part of the interpreter state a forked child inherits, so hooks keep working
  there; a spawned child starts clean and vLLM calls the plugin (which arms them) again. A fork
  while another thread runs a module's callbacks leaves the child with a module whose body has
  finished but whose import never ends (that thread is gone, holding importlib's lock for the
  module): the child marks it done (:func:`interrupted_by_fork` names it), so the registry can
  finish the interrupted patch there at once instead of waiting for an import that would block.

Why not wrapt's post-import hooks (``wrapt.register_post_import_hook``): weighed and not
taken. A name already in ``sys.modules`` fires its hook at once, even while that module's body is
still running (the mid-import case above, where we wait for the body); hooks fire once per name, so
a reload that undoes a patch is not seen; a hook that raises fails the target's import; and hooks run
under wrapt's one global lock, so our probes, which import vLLM modules, would hold it while taking
importlib's module locks (the ordering ``lifecycle`` avoids, see its ``_State``). Nothing there
handles fork. Closing those gaps on top of it would leave this module's code plus a dependency.

Pure Python, no vLLM.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
import threading
from types import ModuleType
from typing import Callable

logger = logging.getLogger("vllm_sinks")

Callback = Callable[[str, ModuleType], None]

_lock = threading.Lock()
#: module name -> callbacks, in the order they were added. Read without the lock on the hot path
#: (a dict lookup is atomic); written as a new list under the lock.
_watched: dict[str, list[Callback]] = {}
#: names whose body is executing through our loader right now (any thread).
_executing: dict[str, int] = {}
#: name -> the module object whose body finished executing under our watch (its callbacks may still
#: be running). Keyed by the object, not just the name: a module dropped from sys.modules and imported
#: again is a new object, unfinished until its own body is.
_completed: dict[str, ModuleType] = {}
#: names whose callbacks are running now -> the threads running them.
_in_callbacks: dict[str, list[int]] = {}
#: in a forked child: names whose callbacks were running in another thread at the fork.
_interrupted: set[str] = set()
_finding = threading.local()


class _HookedLoader(importlib.abc.Loader):
    """Delegates to the real loader; runs the callbacks after ``exec_module``."""

    def __init__(self, loader: importlib.abc.Loader, name: str):
        self._loader = loader
        self._name = name

    def __getattr__(self, attr: str):  # get_source, get_resource_reader, is_package, ...
        return getattr(self._loader, attr)

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self._loader
        if module.__dict__.get("__loader__") is self:
            module.__loader__ = self._loader
        name = self._name
        with _lock:
            _executing[name] = _executing.get(name, 0) + 1
        ok = False
        try:
            self._loader.exec_module(module)
            ok = True
        finally:
            with _lock:
                left = _executing.get(name, 1) - 1
                if left:
                    _executing[name] = left
                else:
                    _executing.pop(name, None)
                if ok:
                    _completed[name] = sys.modules.get(name, module)
                else:
                    _completed.pop(name, None)
        _run_callbacks(name, sys.modules.get(name, module))


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _watched:
            return None
        busy = getattr(_finding, "names", None)
        if busy is None:
            busy = _finding.names = set()
        if fullname in busy:
            return None
        busy.add(fullname)
        try:
            spec = None
            for finder in list(sys.meta_path):
                if finder is self or isinstance(finder, _Finder):
                    continue
                find = getattr(finder, "find_spec", None)
                if find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        finally:
            busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # not found, a namespace package, or a legacy loader: imported unhooked
        if not isinstance(spec.loader, _HookedLoader):
            spec.loader = _HookedLoader(spec.loader, fullname)
        return spec

    def invalidate_caches(self):
        pass


_FINDER = _Finder()


def _run_callbacks(name: str, module: ModuleType) -> None:
    me = threading.get_ident()
    with _lock:
        _in_callbacks[name] = [*_in_callbacks.get(name, ()), me]
    try:
        for callback in list(_watched.get(name, ())):
            try:
                callback(name, module)
            except Exception:  # noqa: BLE001 - a failing hook must never fail vLLM's import
                logger.exception("vllm-sinks: post-import hook for %s failed", name)
    finally:
        with _lock:
            left = list(_in_callbacks.get(name, ()))
            if me in left:
                left.remove(me)
            if left:
                _in_callbacks[name] = left
            else:
                _in_callbacks.pop(name, None)


class _FinishingSpec(importlib.machinery.ModuleSpec):
    """The class a mid-import module's spec takes while watched: importlib's closing
    ``spec._initializing = False`` runs the callbacks (then the spec is a plain ModuleSpec again)."""

    def __setattr__(self, attr, value):
        super().__setattr__(attr, value)
        if attr != "_initializing" or value:
            return
        object.__setattr__(self, "__class__", importlib.machinery.ModuleSpec)
        module = sys.modules.get(self.name)
        if module is None or getattr(module, "__spec__", None) is not self:
            return  # the body raised (importlib dropped the module): the next import is hooked
        with _lock:
            _completed[self.name] = module
        _run_callbacks(self.name, module)


def _hook_running_import(name: str) -> None:
    """Under _lock: where ``name`` is mid-import without our loader, call back when it finishes."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    if (module is None or name in _executing or _completed.get(name) is module or spec is None
            or not getattr(spec, "_initializing", False)):
        return
    if type(spec) is importlib.machinery.ModuleSpec:
        object.__setattr__(spec, "__class__", _FinishingSpec)


def _ensure_finder() -> None:
    if not any(f is _FINDER for f in sys.meta_path):
        sys.meta_path.insert(0, _FINDER)


def watch(name: str, callback: Callback) -> None:
    """Call ``callback(name, module)`` each time module ``name`` finishes executing (import or
    reload) from now on. A module already imported is not called back for that import: check
    :func:`loaded` first."""
    with _lock:
        callbacks = _watched.get(name, [])
        if callback not in callbacks:
            _watched[name] = [*callbacks, callback]
        _ensure_finder()
        _hook_running_import(name)


def unwatch(name: str, callback: Callback) -> None:
    with _lock:
        callbacks = [c for c in _watched.get(name, ()) if c is not callback]
        if callbacks:
            _watched[name] = callbacks
        else:
            _watched.pop(name, None)


def watched() -> dict[str, tuple[Callback, ...]]:
    return {name: tuple(cbs) for name, cbs in _watched.items()}


def loaded(name: str) -> ModuleType | None:
    """The module if it has finished importing, else None (absent, or its body still running)."""
    module = sys.modules.get(name)
    if module is None or name in _executing:
        return None
    if _completed.get(name) is module:
        return module
    if getattr(getattr(module, "__spec__", None), "_initializing", False):
        return None  # imported before we watched it and still running (e.g. a circular import)
    return module


def interrupted_by_fork() -> frozenset[str]:
    """In a forked child: the modules whose callbacks another thread was running at the fork (their
    bodies had finished; the child has marked their imports done)."""
    return frozenset(_interrupted)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    # The threads running callbacks at the fork are gone. Their modules' bodies had finished (we call
    # back only after); what importlib had left to do is mark the import done, which those threads
    # would have done: do it here, or the next import of the module in the child would wait forever
    # for the dead thread's module lock.
    # (The forking thread itself lives on in the child and finishes its own imports.)
    me = threading.get_ident()
    _interrupted.clear()
    for name, threads in list(_in_callbacks.items()):
        if all(t == me for t in threads):
            continue
        spec = getattr(sys.modules.get(name), "__spec__", None)
        if spec is not None and getattr(spec, "_initializing", False):
            object.__setattr__(spec, "_initializing", False)
        _interrupted.add(name)
        _in_callbacks[name] = [t for t in threads if t == me]
        if not _in_callbacks[name]:
            del _in_callbacks[name]


os.register_at_fork(after_in_child=_after_fork_in_child)
