"""`vllm-sinks` command line (also `python -m vllm_sinks`).

    vllm-sinks report            versions and each patch's status here, without starting an engine
    vllm-sinks docs [--check]    (re)write the generated blocks of README.md, docs/patches.md, CHANGELOG.md
    vllm-sinks diff [...]        differential check: vLLM prompt logprobs vs HF eager on tiny models
    vllm-sinks verify [...]      the differential check for every sink family, patch on and off
    vllm-sinks verify --model PATH [...]   the same check on your checkpoint (HF eager reference)
    vllm-sinks tune [...]        time our op against the installed vLLM's on this GPU; write its table
"""

from __future__ import annotations

import argparse
import pathlib
import sys


def _report(_args: argparse.Namespace) -> int:
    from vllm_sinks.patches.report import format_report

    print(format_report())
    return 0


def _docs(args: argparse.Namespace) -> int:
    from vllm_sinks.patches.docs import sync_docs

    try:
        stale = sync_docs(check=args.check, root=args.root)
    except (FileNotFoundError, ValueError) as e:
        print(f"vllm-sinks docs: {e}", file=sys.stderr)
        return 2
    if stale and args.check:
        print(f"{', '.join(stale)} out of step with the registry: run `vllm-sinks docs`", file=sys.stderr)
        return 1
    return 0


def _diff(args: argparse.Namespace) -> int:
    from vllm_sinks.verify.differential import main as diff_main

    return diff_main(args.rest)


def _verify(args: argparse.Namespace) -> int:
    from vllm_sinks.verify import main as verify_main

    return verify_main(args.rest)


def _tune(args: argparse.Namespace) -> int:
    from vllm_sinks.v1.attention.ops.tune_full_attention import main as tune_main

    tune_main(args.rest)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-sinks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("report", help="versions and patch statuses").set_defaults(func=_report)
    docs = sub.add_parser("docs", help="write the generated blocks of README.md, docs/patches.md and "
                                       "CHANGELOG.md")
    docs.add_argument("--check", action="store_true", help="only check; exit 1 if stale")
    docs.add_argument("--root", type=pathlib.Path, default=None,
                      help="the source checkout to edit (default: the one the current directory is in)")
    docs.set_defaults(func=_docs)
    for name, func, text in (("diff", _diff, "differential check vs HF eager"),
                             ("verify", _verify, "differential check, all families (or --model PATH), patch on/off"),
                             ("tune", _tune, "time our op against vLLM's on this GPU, write its table")):
        p = sub.add_parser(name, help=text, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=func)
    # REMAINDER does not take an option as its first word (`verify --tp 2`): pass the unknown on.
    args, unknown = parser.parse_known_args(argv)
    if unknown and not hasattr(args, "rest"):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if hasattr(args, "rest"):
        args.rest = unknown + list(args.rest)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
