"""Every environment variable vllm-sinks reads: its accepted words, its default, and the one way a
bad value ends.

Each variable is a :class:`Setting`. Code reads it through :meth:`Setting.read` (never
``os.environ`` directly), so the words a variable accepts, the error message and the docs (the
env-var list of docs/patches.md is rendered from ``vllm_sinks.patches.SETTINGS``) come from one
table. A value outside the table raises :class:`BadSetting`; a patch whose probe or apply meets one
is *refused* with that message, nothing changed (``registry.Patch.run``), the same for every
variable.

The per-patch switches (``VLLM_SINKS_<PATCH>``) are made from the registry (``Patch.setting``);
the others are listed here. This module imports nothing of vllm_sinks: the registry and the patch
list depend on it, never the reverse. Pure Python, no vLLM.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping


class BadSetting(ValueError):
    """A vllm-sinks environment variable holds a value it does not accept."""


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    #: accepted word (lower case, surrounding space ignored) -> the value it stands for, in the
    #: order the docs list them; None: free text (a path), every value accepted.
    words: Mapping[str, str] | None
    default: str
    meaning: str  # what it does, for the docs

    def read(self, environ: Mapping[str, str] | None = None) -> str:
        """The value it stands for (the default where unset or empty); BadSetting if not accepted."""
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is None or not raw.strip():
            return self.default
        if self.words is None:
            return raw
        value = self.words.get(raw.strip().lower())
        if value is None:
            raise BadSetting(f"{self.name}={raw!r}: expected {self.accepted()}")
        return value

    def choices(self) -> list[tuple[str, list[str]]]:
        """Each value it stands for, with the other words that mean it, in table order."""
        synonyms: dict[str, list[str]] = {}
        for word, value in (self.words or {}).items():
            synonyms.setdefault(value, [])
            if word != value:
                synonyms[value].append(word)
        return list(synonyms.items())

    def accepted(self, quote: str = "") -> str:
        """The accepted words, each value with its synonyms: ``auto (default) | on (also 1, ...)``."""
        if self.words is None:
            return "any path"
        parts = []
        for value, others in self.choices():
            notes = (["default"] if value == self.default else []) + \
                ([f"also {', '.join(others)}"] if others else [])
            parts.append(f"{quote}{value}{quote}" + (f" ({'; '.join(notes)})" if notes else ""))
        return " | ".join(parts)


#: The words of every per-patch switch ``VLLM_SINKS_<PATCH>``.
PATCH_MODE_WORDS: Mapping[str, str] = {
    "auto": "auto",
    "on": "on", "1": "on", "true": "on", "yes": "on", "force": "on",
    "off": "off", "0": "off", "false": "off", "no": "off", "disable": "off",
}

MIMO_SINK_SEMANTICS = Setting(
    "VLLM_SINKS_MIMO_SINK_SEMANTICS", {"key0": "key0", "null": "null"}, "key0",
    "how `mimo-vision-sinks` applies MiMo-V2.5's vision sinks: `key0` = a bias on key 0's logit, "
    "`null` = an extra softmax-denominator logit (evidence: docs/mimo-sink-semantics.md)")

WINDOW_WALK = Setting(
    "VLLM_SINKS_WINDOW_WALK", {"on": "on", "1": "on", "off": "off", "0": "off"}, "on",
    "`off` keeps sliding windows on Hopper off the Gluon kernel (the Triton kernel runs them): "
    "for A/B timing and bisecting")

CACHE = Setting(
    "VLLM_SINKS_CACHE", None, "",
    "where `vllm-sinks verify` / `diff` keep the tiny models they build (default "
    "`~/.cache/vllm-sinks/models`)")

#: The settings that are not a per-patch switch, in the order the docs list them.
OTHER_SETTINGS: tuple[Setting, ...] = (MIMO_SINK_SEMANTICS, WINDOW_WALK, CACHE)
