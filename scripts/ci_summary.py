"""scripts/test.sh's bookkeeping: checks a `vllm-sinks report` and prints the closing tables.

    python scripts/ci_summary.py report out/test/report-0.29.0.txt [out/test/resolved-0.29.0.txt]
                                  # one line; exit 1 if a patch is refused, failed or missing; each
                                  # such patch is named with the vLLM, transformers and kernels
    python scripts/ci_summary.py summary out/test SECONDS NAME...     # per-row and per-step tables

Needs only the standard library and this checkout (the patch list and statuses come from the registry,
so a new patch or status cannot slip past the check).
"""

from __future__ import annotations

import collections
import pathlib
import sys
import xml.etree.ElementTree as ET

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from vllm_sinks.patches import PATCHES  # noqa: E402
from vllm_sinks.patches.registry import Status  # noqa: E402

#: A CI run passes only if every patch ends in one of these (armed/disabled/skipped cannot happen in a
#: report, which applies everything with default settings; refused/failed are what CI is for).
RESOLVED = (Status.APPLIED, Status.STOOD_DOWN, Status.NOT_APPLICABLE)


def report_lines(text: str) -> dict[str, tuple[str, str]]:
    """Patch name -> (status, detail), read from the report's patch lines (`name  status  ENV_VAR  detail`)."""
    names = {p.name: p.env_var for p in PATCHES}
    statuses = sorted((s.value for s in Status), key=len, reverse=True)
    found = {}
    for line in text.splitlines():
        head, _, rest = line.partition(" ")
        if head in names:
            rest = rest.lstrip()
            status = next((s for s in statuses if rest.startswith(s + " ")), rest.split("  ")[0])
            detail = rest[len(status):].strip().removeprefix(names[head]).strip()
            found[head] = (status, detail)
    return found


def report_statuses(text: str) -> dict[str, str]:
    """Patch name -> status."""
    return {name: status for name, (status, _) in report_lines(text).items()}


def resolved(path: pathlib.Path) -> str:
    """What a row's venv holds, in words (scripts/venv.sh writes `vllm=… transformers=… kernels=… hub=…`)."""
    if not path.is_file():
        return "-"
    pairs = dict(pair.split("=", 1) for pair in path.read_text().split() if "=" in pair)
    vllm = f"vLLM {pairs['vllm']}, " if pairs.get("vllm", "-") != "-" else "no vLLM, "
    return (f"{vllm}transformers {pairs.get('transformers', '?')}, kernels {pairs.get('kernels', '?')} "
            f"(hub kernels {pairs.get('hub', '?')})")


def report_line(text: str) -> tuple[str, list[str]]:
    """('applied 3, stood down 2, not applicable 1', problems)."""
    found = report_statuses(text)
    details = report_lines(text)
    problems = [f"{name}: {status}: {details[name][1]}" for name, status in found.items()
                if status not in {s.value for s in RESOLVED}]
    problems += [f"{p.name}: missing from the report" for p in PATCHES if p.name not in found]
    counts = collections.Counter(found.values())
    return ", ".join(f"{status} {n}" for status, n in counts.most_common()), problems


def junit_counts(path: pathlib.Path) -> dict[str, int]:
    totals = dict(tests=0, failures=0, errors=0, skipped=0)
    if path.is_file():
        for suite in ET.parse(path).getroot().iter("testsuite"):
            for key in totals:
                totals[key] += int(suite.get(key, 0))
    totals["failed"] = totals["failures"] + totals["errors"]
    totals["passed"] = totals["tests"] - totals["failed"] - totals["skipped"]
    return totals


def failed_tests(path: pathlib.Path, limit: int = 12) -> list[str]:
    """The ids of the failed or erroring tests of a JUnit file (the family is in the parameters)."""
    if not path.is_file():
        return []
    failed = [f"{case.get('classname', '')}::{case.get('name', '')}" for case in ET.parse(path).getroot().iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    return failed[:limit] + ([f"... and {len(failed) - limit} more"] if len(failed) > limit else [])


def summary(out: pathlib.Path, seconds: str, names: list[str]) -> None:
    steps = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()] \
        if (out / "steps.tsv").is_file() else []
    print(f"\nwhole matrix in {seconds} s ({int(seconds) / 60:.1f} min)\n")
    print(f"{'row':<14} {'result':<7} {'passed':>6} {'failed':>6} {'skipped':>7}  report")
    for name in names:
        counts = junit_counts(out / f"junit-{name}.xml")
        report = out / f"report-{name}.txt"
        line = report_line(report.read_text())[0] if report.is_file() else "-"
        twin = next((what for row, what, _, _ in steps if row == name and what.startswith("same as ")), None)
        line = f"{twin} (the same packages and suite: not run again)" if twin else line
        result = "FAIL" if (out / f"failed-{name}").exists() else "ok"
        shown = counts if (out / f"junit-{name}.xml").is_file() else dict(passed="-", failed="-", skipped="-")
        print(f"{name:<14} {result:<7} {shown['passed']:>6} {shown['failed']:>6} {shown['skipped']:>7}  {line}")
    print(f"\n{'row':<14} resolved (what pip installed for the row: pinned, or `newest` as of this run)")
    for name in names:
        print(f"{name:<14} {resolved(out / f'resolved-{name}.txt')}")
    for name in names:
        if (out / f"failed-{name}").exists():
            print(f"\nFAILED row {name} on {resolved(out / f'resolved-{name}.txt')}:")
            report = out / f"report-{name}.txt"
            for problem in report_line(report.read_text())[1] if report.is_file() else []:
                print(f"    report: {problem}")
            for _, what, rc, _ in (s for s in steps if s[0] == name and s[2] != "0"):
                print(f"    step failed: {what}")
            for test in failed_tests(out / f"junit-{name}.xml"):
                print(f"    {test}")
    print(f"\n{'row':<14} {'step':<34} {'rc':>3} {'seconds':>7}")
    for name, what, rc, secs in steps:
        print(f"{name:<14} {what:<34} {rc:>3} {secs:>7}")


def main(argv: list[str]) -> int:
    if len(argv) in (2, 3) and argv[0] == "report":
        line, problems = report_line(pathlib.Path(argv[1]).read_text())
        where = resolved(pathlib.Path(argv[2])) if len(argv) == 3 else "-"
        print(f"report: {line}" + (f"  [{where}]" if where != "-" else ""))
        for problem in problems:
            print(f"report: NOT RESOLVED on {where}: {problem}")
        return 1 if problems else 0
    if len(argv) >= 2 and argv[0] == "summary":
        summary(pathlib.Path(argv[1]), argv[2] if len(argv) > 2 else "?", argv[3:])
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
