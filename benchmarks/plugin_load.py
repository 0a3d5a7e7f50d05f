"""What the plugin costs a vLLM process at startup, against vLLM with plugins off, in the same run.

vLLM calls general plugins in every process it starts (API server, engine core, workers). For each
vLLM venv given, fresh interpreters time

* ``import vllm`` (for scale), then ``vllm.plugins.load_general_plugins()`` with plugins off
  (``VLLM_PLUGINS=''``: an allow-list matching no plugin) and with ours alone (``VLLM_PLUGINS=sinks``);
  target: at most 0.5 s added per process where no target module is imported;
* then importing each target module of a patch, plugins off vs ours (where ours probes and applies
  the patch when the module arrives); target: at most 10 % of vLLM's own import time of that module.

Modes are interleaved per repetition (the same machine noise for both); medians are reported. The
CPU venvs have no torchvision: ``mimo_v2_omni`` is imported with the tests' stand-in
(``tests/vllm/mimo_support.py``). The prefill-op patch is CUDA-only, so on these CPU builds it stands
down when its module arrives; the ``=on`` rows force it (what a CUDA machine pays: our op module and
Triton). ``--before DIR`` adds a column for another source tree of vllm-sinks (e.g. the eager
version: ``git archive <commit> | tar -x -C DIR``).

    python benchmarks/plugin_load.py [--venv ~/.cache/vllm-sinks/venvs/vllm-0.29.0 ...] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]
VENVS = pathlib.Path.home() / ".cache" / "vllm-sinks" / "venvs"
DEFAULT_VENVS = [VENVS / f"vllm-{v}" for v in ("0.27.1", "0.29.0", "0.32.0")]

# (label, module, patch, extra env for the "ours" mode)
TARGETS = (
    ("prefill-op (auto)", "vllm.v1.attention.ops.triton_prefill_attention", "prefill-op", {}),
    ("prefill-op (=on)", "vllm.v1.attention.ops.triton_prefill_attention", "prefill-op",
     {"VLLM_SINKS_PREFILL_OP": "on"}),
    ("prefill-op (auto)", "vllm.v1.attention.backends.triton_attn", "prefill-op", {}),
    ("prefill-op (=on)", "vllm.v1.attention.backends.triton_attn", "prefill-op",
     {"VLLM_SINKS_PREFILL_OP": "on"}),
    ("transformers-sinks", "vllm.model_executor.models.transformers", "transformers-sinks", {}),
    ("mimo-vision-sinks", "vllm.model_executor.models.mimo_v2_omni", "mimo-vision-sinks", {}),
)

CHILD = textwrap.dedent("""
    import json, sys, time
    target = sys.argv[1] if len(sys.argv) > 1 else None
    t0 = time.perf_counter()
    import vllm
    t1 = time.perf_counter()
    import vllm.plugins
    vllm.plugins.load_general_plugins()
    t2 = time.perf_counter()
    out = {"import_vllm": t1 - t0, "plugins": t2 - t1, "version": vllm.__version__}
    if target:
        if target.endswith("mimo_v2_omni"):
            sys.path.insert(0, %(tests)r)
            import vllm.config  # what the stand-in needs first (mimo_support's docstring)
            import mimo_support
            t2 = time.perf_counter()
            c2 = time.process_time()
            with mimo_support.torchvision_stand_in():
                __import__(target)
        else:
            c2 = time.process_time()
            __import__(target)
        out["target"] = time.perf_counter() - t2
        out["target_cpu"] = time.process_time() - c2
    if "vllm_sinks" in sys.modules:
        try:
            from vllm_sinks.patches import lifecycle as runner
        except ImportError:  # a --before tree older than lifecycle.py: its registry ran the list
            from vllm_sinks.patches import registry as runner
        out["status"] = {r.patch: r.status.value for r in runner.apply_all()}
        if hasattr(runner, "seconds_spent"):
            out["hooks"] = sum(runner.seconds_spent().values())
    print("RESULT " + json.dumps(out))
""") % {"tests": str(ROOT / "tests" / "vllm")}


def run_child(python: pathlib.Path, src: pathlib.Path | None, target: str | None, env: dict) -> dict:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_SINKS_", "VLLM_PLUGINS"))}
    full.update(VLLM_CPU_KVCACHE_SPACE="1", TRITON_INTERPRET="1", **env)
    if src is not None:
        full["PYTHONPATH"] = str(src)
    proc = subprocess.run([str(python), "-c", CHILD, *([target] if target else [])], capture_output=True,
                          text=True, timeout=600, env=full, cwd="/")
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{python} {target}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def modes(before: pathlib.Path | None) -> dict[str, tuple[pathlib.Path | None, dict]]:
    out = {"off": (ROOT, {"VLLM_PLUGINS": ""}), "ours": (ROOT, {"VLLM_PLUGINS": "sinks"})}
    if before is not None:
        out["before"] = (before, {"VLLM_PLUGINS": "sinks"})
    return out


def measure(venv: pathlib.Path, reps: int, before: pathlib.Path | None) -> dict:
    python = venv / "bin" / "python"
    runs: dict[tuple[str, str | None, str], list[dict]] = {}
    cases = [(None, None, {})] + [(label, module, extra) for label, module, _, extra in TARGETS]
    for rep in range(reps):
        for label, module, extra in cases:
            for mode, (src, env) in modes(before).items():
                if mode == "off" and extra:  # plugins off: the =on row's baseline is the auto one's
                    continue
                if mode == "before" and module:  # the eager version: its load_general_plugins row
                    continue
                env = {**env, **(extra if mode != "off" else {})}
                r = run_child(python, src, module, env)
                runs.setdefault((label or "", module, mode), []).append(r)
                print(f"  {venv.name} rep {rep + 1}/{reps} {mode:6} {module or 'plugins only':55} "
                      f"plugins {r['plugins']:.3f} s" + (f", target {r['target']:.3f} s" if module else ""),
                      file=sys.stderr, flush=True)
    return {"runs": runs, "version": next(iter(runs.values()))[0]["version"]}


def _median(values):
    return statistics.median(values) if values else float("nan")


def table(results: dict[str, dict], before: bool) -> str:
    """Wall-time medians; "in our hooks" is the time measured inside our probe/apply in that process
    (what the plugin itself adds to the import, free of the machine's noise)."""
    head = ("| vLLM | step | plugins off (s) | vllm-sinks (s) | difference (s) | in our hooks (s) | "
            "ours / vLLM's | target | status here |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for res in results.values():
        runs, version = res["runs"], res["version"]
        every = {m: [r for (_, _, mode), rs in runs.items() if mode == m for r in rs]
                 for m in ("off", "ours", "before")}
        iv = _median([r["import_vllm"] for r in every["off"] + every["ours"]])
        rows.append(f"| {version} | `import vllm` (for scale; vLLM's own) | {iv:.2f} | | | | | | |")
        off_runs = runs.get(("", None, "off"), [])
        ours_runs = runs.get(("", None, "ours"), [])
        off, ours = (_median([r["plugins"] for r in rs]) for rs in (off_runs, ours_runs))
        rows.append(f"| {version} | `load_general_plugins()`, no target imported | {off:.3f} | {ours:.3f} | "
                    f"{ours - off:+.3f} | | {(ours - off) / iv:+.1%} of `import vllm` | ≤ 0.5 s | "
                    "every patch armed |")
        if before and runs.get(("", None, "before")):
            b = _median([r["plugins"] for r in runs[("", None, "before")]])
            rows.append(f"| {version} | the same, eager version (every patch at load) | {off:.3f} | {b:.3f} | "
                        f"{b - off:+.3f} | | {(b - off) / iv:+.0%} of `import vllm` | ≤ 0.5 s | "
                        "every patch applied at load |")
        for label, module, patch, extra in TARGETS:
            base_label = label.replace("(=on)", "(auto)")
            t_off = _median([r["target"] for r in runs.get((base_label, module, "off"), [])])
            ours_runs = runs.get((label, module, "ours"), [])
            t_ours = _median([r["target"] for r in ours_runs])
            hooks = _median([r.get("hooks", float("nan")) for r in ours_runs])
            status = ", ".join(sorted({r["status"][patch] for r in ours_runs}))
            short = module.replace("vllm.model_executor.models.", "…models.").replace(
                "vllm.v1.attention.", "…attention.")
            rows.append(f"| {version} | `import {short}` → {label} | {t_off:.3f} | {t_ours:.3f} | "
                        f"{t_ours - t_off:+.3f} | {hooks:.3f} | {hooks / t_off:.1%} | ≤ 10 % | {status} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", action="append", type=pathlib.Path,
                        help="a vLLM venv (repeatable; default: the 0.27.1, 0.29.0, 0.32.0 test venvs)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--before", type=pathlib.Path, help="another vllm-sinks source tree to compare")
    parser.add_argument("--json", type=pathlib.Path, help="also write the raw runs here")
    args = parser.parse_args(argv)
    results = {}
    for venv in args.venv or DEFAULT_VENVS:
        results[str(venv)] = measure(venv.expanduser(), args.reps, args.before)
    if args.json:
        args.json.write_text(json.dumps({v: {"version": r["version"], "runs": {
            " | ".join(str(x) for x in k): rs for k, rs in r["runs"].items()}} for v, r in results.items()},
            indent=1))
    print(table(results, args.before is not None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
