"""The registry in this process: arm every patch on its modules, resolve each once, log one line.

``apply_all`` arms or applies each patch of ``vllm_sinks.patches.PATCHES`` once per process (a
patch with ``Patch.modules`` waits for a post-import hook, ``importhook``, so the plugin loads
nothing vLLM does not); ``register_all`` is the plugin entry point's body; ``apply_everything``
imports every target for ``vllm-sinks report``. What a patch is lives in ``registry``; this module
sits above the list, so the list and the registry never import it (tests/unit/test_import_cycles.py).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import multiprocessing
import os
import threading
import time
from types import ModuleType
from typing import Callable

# The list is read as ``patches.PATCHES`` at call time, not bound here: tests swap it for fakes.
from vllm_sinks import patches
from vllm_sinks.patches import importhook
from vllm_sinks.patches.registry import Patch, Result, Status, VllmInfo, detect_vllm
from vllm_sinks.version import __version__

logger = logging.getLogger("vllm_sinks")

# One _State per patch. Decisions are made under _lock; probe/apply run *outside* it (they import
# vLLM modules, whose import locks another thread may hold while its post-import hook waits for us).
# A state being resolved by one thread is marked `busy`; a hook firing meanwhile sets `again`, and
# the resolving thread runs apply once more when it is done.


@dataclasses.dataclass(eq=False)  # compared by identity
class _State:
    patch: Patch
    result: Result
    busy: bool = False
    again: bool = False
    owner: int | None = None  # the thread resolving it while busy (a fork may leave it behind)
    hook: Callable[[str, ModuleType], None] | None = None
    seconds: float = 0.0  # wall time spent in this patch's probe/apply in this process


_lock = threading.RLock()
_states: tuple[_State, ...] | None = None
_info: VllmInfo | None = None
_registered_info: VllmInfo | None = None  # set by register_all: the at-fork hook logs for the child
_logged_in_pid: int | None = None


def _ensure_handler() -> None:
    # vLLM configures only its own "vllm" logger; ours would print nothing at INFO otherwise.
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [vllm-sinks] %(message)s",
                                               "%m-%d %H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _armed_result(patch: Patch) -> Result:
    return Result(patch.name, Status.ARMED, "on import of " + " or ".join(patch.modules))


def _snapshot() -> tuple[Result, ...]:
    return tuple(s.result for s in _states or ())


def _process() -> str:
    return f"pid {os.getpid()}, {multiprocessing.current_process().name}"


def _claim(state: _State) -> str | None:
    """Under _lock: what to run for this state now ('run', 'reapply') or None; marks it busy."""
    status = state.result.status
    if state.busy:
        state.again = True
        return None
    if status is Status.ARMED:
        action = "run"
    elif status is Status.APPLIED and state.patch.modules:
        action = "reapply"
    else:
        return None
    state.busy, state.owner = True, threading.get_ident()
    return action


def _resolve(state: _State, action: str, trigger: str | None) -> None:
    """Run ``action`` for a claimed state (outside _lock), record and log the result."""
    info = _info
    while True:
        previous = state.result
        start = time.perf_counter()
        try:
            if action == "run":
                result = state.patch.run(info)
            else:
                result = state.patch.reapply(info, previous)
        except BaseException:
            with _lock:
                state.busy = state.again = False
            raise
        took = time.perf_counter() - start
        with _lock:
            state.seconds += took
            if not any(s is state for s in _states or ()):  # reset meanwhile (tests)
                state.busy = state.again = False
                return
            state.result = result
            again = state.again and result.status is Status.APPLIED and bool(state.patch.modules)
            state.busy = state.again = False
            if again:
                state.busy = True
        if trigger is not None:
            _log_resolution(previous, result, trigger, took)
        if not again:
            return
        action, trigger = "reapply", trigger or "a concurrent import"


def _log_resolution(previous: Result, result: Result, trigger: str, took: float) -> None:
    if previous.status is Status.ARMED:  # one INFO line per patch per process: how it resolved
        level = logging.INFO if result.status in (Status.APPLIED, Status.STOOD_DOWN,
                                                  Status.NOT_APPLICABLE) else logging.WARNING
    elif result != previous:
        level = logging.DEBUG if result.status is Status.APPLIED else logging.WARNING
    else:
        return
    logger.log(level, "%s (on import of %s, %.0f ms) [%s]", result, trigger, took * 1e3, _process())


def seconds_spent() -> dict[str, float]:
    """Wall time each patch's probe/apply took in this process so far (the plugin's own cost)."""
    with _lock:
        return {s.patch.name: s.seconds for s in _states or ()}


def _on_import(state: _State, name: str, module: ModuleType) -> None:
    with _lock:
        action = _claim(state)
    if action is not None:
        _resolve(state, action, name)


def _initial(patch: Patch, info: VllmInfo) -> Result | None:
    """The result decided at register time, or None where probe + apply must run now."""
    decided = patch.mode_or_result()
    if isinstance(decided, Result):
        return decided
    if not patch.modules or any(importhook.loaded(m) is not None for m in patch.modules):
        return None
    return _armed_result(patch)


def apply_all(info: VllmInfo | None = None) -> tuple[Result, ...]:
    """Arm or apply every patch, once per process (re-entrant, idempotent); return the results so far.

    A patch whose modules are not imported yet is *armed* (``Status.ARMED``) and resolved by a
    post-import hook; the others (no modules, or one already imported) are resolved here.
    """
    global _states, _info
    with _lock:
        if _states is not None:
            return _snapshot()
        listed = patches.PATCHES

        info = _info = info or detect_vllm()
        why = info.skip_reason()  # older than the oldest supported; a newer one is probed as usual
        if why is not None:
            _states = tuple(_State(p, Result(p.name, Status.SKIPPED, why)) for p in listed)
            return _snapshot()
        pending = []
        states = []
        for patch in listed:
            initial = _initial(patch, info)
            state = _State(patch, initial or Result(patch.name, Status.ARMED, "being applied"))
            states.append(state)
            if initial is None:
                pending.append(state)
        _states = tuple(states)
        for state in _states:
            if state.result.status is Status.ARMED:  # armed, or about to run: watch for arrivals
                state.hook = functools.partial(_on_import, state)
                for name in state.patch.modules:
                    importhook.watch(name, state.hook)
        for state in pending:
            state.busy, state.owner = True, threading.get_ident()
    # Outside the lock: these import vLLM modules (see the comment above _State).
    for state in pending:
        _resolve(state, "run", None)
    with _lock:
        return _snapshot()


def apply_everything(info: VllmInfo | None = None) -> tuple[Result, ...]:
    """:func:`apply_all`, then import every module a patch waits for or binds in, and run the probe
    of any patch still armed (its modules do not import here: the probe says why). The full picture
    for ``vllm-sinks report``; vLLM's own processes never call this."""
    apply_all(info)
    with _lock:
        states = list(_states or ())
    for state in states:
        if state.result.status in (Status.ARMED, Status.APPLIED):
            for name in state.patch.modules:
                try:
                    importlib.import_module(name)
                except Exception:  # noqa: BLE001 - the probe below reports why, in its words
                    pass
    for state in states:
        with _lock:
            armed = state.result.status is Status.ARMED and not state.busy
            if armed:
                state.busy = True
        if armed:
            _resolve(state, "run", None)
    with _lock:
        return _snapshot()


def report_line(results: tuple[Result, ...], info: VllmInfo) -> str:
    proc = multiprocessing.current_process().name
    return (f"vllm-sinks {__version__} in pid {os.getpid()} ({proc}), {info.describe()}: "
            + "; ".join(str(r) for r in results))


def register_all() -> tuple[Result, ...]:
    """The plugin entry point's body: arm/apply once, log one INFO line per process.

    vLLM calls plugins in the API server, the engine core, each worker and model-inspection
    subprocesses. A forked child inherits our state (and the import hooks), so we re-log (not
    re-apply) per pid; a patch still armed at the fork resolves in the child when its module arrives.
    """
    global _registered_info
    info = detect_vllm()
    results = apply_all(info)  # not under _lock: it runs probes (see the comment above _State)
    with _lock:
        _registered_info = info
        _log_once(info, results)
    return results


def _log_once(info: VllmInfo, results: tuple[Result, ...]) -> None:
    global _logged_in_pid
    if _logged_in_pid == os.getpid():
        return
    _logged_in_pid = os.getpid()
    _ensure_handler()
    why = info.skip_reason()
    if info.installed and why is not None:
        logger.warning("vllm-sinks: %s; nothing patched", why)
    else:  # an untested vLLM: the same one line, as a warning (describe() says "untested")
        logger.log(logging.WARNING if info.untested else logging.INFO, "%s", report_line(results, info))


def _after_fork_in_child() -> None:
    # A forked child (vLLM's default start method on GPU) inherits the patched modules and vLLM's own
    # "plugins loaded" flag, so nobody calls us there: say so from the child. A thread that held our
    # lock, or was resolving a patch, at the fork does not exist here: a patch it was resolving is
    # resolved again here and now (probe + apply, or apply: both idempotent), not at the module's next
    # import, which may never come (importhook marks such a module's import done in the child).
    global _lock
    _lock = threading.RLock()
    me = threading.get_ident()
    interrupted = []
    for state in _states or ():
        if state.busy and state.owner != me:
            interrupted.append(state)
            state.busy = state.again = False
            state.owner = None
    if _registered_info is not None:
        _log_once(_registered_info, apply_all(_registered_info))
    for state in interrupted:
        with _lock:
            action = _claim(state)
        if action is not None:
            loaded = [m for m in state.patch.modules if importhook.loaded(m) is not None]
            _resolve(state, action, (loaded[0] if loaded else "register") + ", finished after a fork")


os.register_at_fork(after_in_child=_after_fork_in_child)


def _reset_for_tests() -> None:
    global _states, _info, _registered_info, _logged_in_pid
    with _lock:
        for state in _states or ():
            if state.hook is not None:
                for name in state.patch.modules:
                    importhook.unwatch(name, state.hook)
        _states = None
        _info = None
        _registered_info = None
        _logged_in_pid = None
